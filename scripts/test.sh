#!/usr/bin/env bash
# The test command: sets up .venv and the extension, then runs the whole suite.
# Without a GPU the Triton tests run in Triton's CPU interpreter (tests/conftest.py sets
# TRITON_INTERPRET=1) and the CUDA tests skip with their reason. Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m gem_kernels info
python -m pytest tests -q "$@"
