#!/usr/bin/env bash
# The main job: sets up .venv and the extension, then runs the bench (python -m bench).
# Extra args go to the bench, e.g. `bash scripts/bench.sh jagged --quick`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m bench "$@"
