#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (one call of the device tool, under 8 minutes):
#   builds gem_kernels._C for sm_90a, runs the CUDA and Triton tests, runs the GPU bench, and writes
#   everything under $OUT (default ./gpu_out). Uses the machine's own python3 (no network there).
# Usage (device tool):  bash scripts/gpu_check.sh            (timeout_s ~ 540)
# The machine's python3 had torch 2.11.0+cu130, triton 3.6.0, numpy 2.5 (KINDS.md, 2026-11). Checked
# on the CPU against those versions (2026-12-03): the CPU + CUDA (sm_80, sm_90a) build links; the
# suite gave 1508 passed, 6 failed, all 6 in Triton 3.6's *interpreter* (not used on a GPU), whose
# int() of a 1-element numpy array is a TypeError with numpy >= 2.4 and a DeprecationWarning with
# 2.2; and every Triton kernel compiles for sm_90a with 3.6 (scripts/triton_compile_check.py).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

# At most 8 files come back from $OUT: summary, build, tests and bench logs, and the bench's json/md/png.
{ nvidia-smi; "$PY" -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"; } \
  >> "$OUT/summary.txt" 2>&1

log "build (sm_90a)"
start=$(date +%s)
GEM_KERNELS_CUDA=1 GEM_KERNELS_CUDA_ARCHS="${GEM_KERNELS_CUDA_ARCHS:-90a}" MAX_JOBS="$(nproc)" \
  timeout 240 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
log "build rc=$? in $(( $(date +%s) - start ))s"
"$PY" -m gem_kernels info >> "$OUT/summary.txt" 2>&1

# --maxfail, not -x: the first GPU run should report every failing kernel, not just the first.
log "tests: CUDA and Triton backends on the GPU"
start=$(date +%s)
timeout 180 "$PY" -m pytest tests -q --maxfail=30 -m "gpu or triton" -p no:cacheprovider > "$OUT/tests.log" 2>&1
log "tests rc=$? in $(( $(date +%s) - start ))s: $(tail -n 1 "$OUT/tests.log")"

log "bench (GPU)"
start=$(date +%s)
timeout 150 "$PY" -m bench --device cuda --out "$OUT" > "$OUT/bench.log" 2>&1
log "bench rc=$? in $(( $(date +%s) - start ))s"
rm -f "$OUT"/latest-*  # duplicates of the timestamped results
ls "$OUT" >> "$OUT/summary.txt"
