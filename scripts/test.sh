#!/usr/bin/env bash
# The test command: sets up .venv and the extension, then runs the whole suite.
# Without a GPU the Triton tests run in Triton's CPU interpreter (tests/conftest.py sets
# TRITON_INTERPRET=1) and the CUDA tests skip with their reason; a second pass then runs the CUDA
# kernels' code in tests/cuda_emu's CPU emulation of CUDA, through every cpu-backend test
# (GK_CUDA_EMU=1; README "The CUDA kernels on a machine without a GPU"). Last, the quick bench at 1
# and at 2 threads: its verification (FlashAttention's rule against float64, bench/harness.py) must
# hold whatever the reduction order, so a rule that depends on it fails here, not on a user's machine.
# Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m gem_kernels info
python -m pytest tests -q "$@"
if python -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then  # no GPU
  echo "[test] the CUDA kernels under the CPU emulation of CUDA (GK_CUDA_EMU=1, cpu-backend tests)"
  GK_CUDA_EMU=1 python -m pytest tests -q -k "cpu and not triton" "$@"
fi
results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
for threads in 1 2; do
  echo "[test] python -m bench --quick at OMP_NUM_THREADS=$threads (exits 1 on a verification mismatch)"
  OMP_NUM_THREADS=$threads python -m bench --quick --out "$results/threads-$threads" > "$results/threads-$threads.log"
done
