#!/usr/bin/env bash
# The test command: sets up .venv and the extension, then runs the whole suite.
# Without a GPU the Triton tests run in Triton's CPU interpreter (tests/conftest.py sets
# TRITON_INTERPRET=1) and the CUDA tests skip with their reason; a second pass then runs the CUDA
# kernels' code in tests/cuda_emu's CPU emulation of CUDA, through every cpu-backend test
# (GK_CUDA_EMU=1; README "The CUDA kernels on a machine without a GPU"). Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m gem_kernels info
python -m pytest tests -q "$@"
if python -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then  # no GPU
  echo "[test] the CUDA kernels under the CPU emulation of CUDA (GK_CUDA_EMU=1, cpu-backend tests)"
  GK_CUDA_EMU=1 python -m pytest tests -q -k "cpu and not triton" "$@"
fi
