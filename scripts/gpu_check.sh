#!/usr/bin/env bash
# The GPU check, for a lent GPU machine (one call of the device tool; the steps' own timeouts add
# up to 560 s, so run it with timeout_s 590): builds gem_kernels._C for sm_90a, runs the CUDA and
# Triton tests, the GPU bench of every kernel family, the host-sync count, and the TorchRec-based
# parts (gk.swap's bench, the model's `large` bf16 run with MFU, model.train --distributed on NCCL)
# when TorchRec imports there. Everything goes under $OUT (default ./gpu_out).
# Usage (device tool):  bash scripts/gpu_check.sh
# The machine's python3 (2026-11): torch 2.11.0+cu130, triton 3.6.0, numpy 2.5, Python 3.12, no
# TorchRec and no CUDA fbgemm-gpu (too large to carry), so the TorchRec-based steps say "skipped".
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

# At most 8 files come back from $OUT: summary, build, tests and bench logs, host syncs, model, and the
# bench's JSON; its markdown and two figures are redrawn here from that JSON:
#   python -m bench.report gpu_out/cuda-<timestamp>.json   (writes .md, .png roofline, -speedup.png)
{ nvidia-smi; "$PY" -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"; } \
  >> "$OUT/summary.txt" 2>&1

log "build (sm_90a)"
start=$(date +%s)
GEM_KERNELS_CUDA=1 GEM_KERNELS_CUDA_ARCHS="${GEM_KERNELS_CUDA_ARCHS:-90a}" MAX_JOBS="$(nproc)" \
  timeout 180 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
log "build rc=$? in $(( $(date +%s) - start ))s"
"$PY" -m gem_kernels info >> "$OUT/summary.txt" 2>&1

# The timeouts send SIGINT: pytest and the bench then stop cleanly and still report what they did
# (pytest its summary line; the bench its JSON/markdown with the families measured so far).
# --maxfail, not -x: the first GPU run should report every failing kernel, not just the first.
# pytest-xdist (in the machine's image): 8 workers compile the Triton specialisations in parallel
# (about 2000 tests, most of them a new Triton specialisation to JIT-compile; not yet timed on a GPU).
log "tests: CUDA and Triton backends on the GPU"
start=$(date +%s)
XDIST=()
"$PY" -c "import xdist" 2> /dev/null && XDIST=(-n 8)
timeout -s INT -k 20 150 "$PY" -m pytest tests -q --maxfail=30 -m "gpu or triton" -p no:cacheprovider "${XDIST[@]}" \
  > "$OUT/tests.log" 2>&1
rc=$?
summary=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/tests.log" | tail -n 1)
log "tests rc=$rc in $(( $(date +%s) - start ))s (${XDIST[*]:-serial}): ${summary:-no summary line, see tests.log}"

# Issue 19: the bad-input fuzz on the cuda and triton backends (forked children; counts per outcome
# class into the summary) and the edge-value tests on the GPU.
timeout -s INT -k 10 60 "$PY" -m pytest tests/test_fuzz.py tests/test_edge_values.py -q -k "cuda" -p no:cacheprovider \
  2>&1 | grep -E "^fuzz |passed|failed|^E +(crash|hang|garbage|unclear_error|rejected_valid|accepted_bad)" | head -40 \
  | tee -a "$OUT/summary.txt" > /dev/null
log "fuzz + edge values done"

log "bench (GPU)"
start=$(date +%s)
timeout -s INT -k 15 80 "$PY" -m bench attention embedding_bag interaction jagged --device cuda --budget 60 \
  --out "$OUT" > "$OUT/bench.log" 2>&1
log "bench rc=$? in $(( $(date +%s) - start ))s"

log "host syncs per op and per model step (CUDA)"
timeout -s INT -k 5 25 "$PY" -m bench.host_syncs --device cuda --json "$OUT/host-syncs-cuda.json" >> "$OUT/summary.txt" 2>&1
log "host syncs rc=$?"

if "$PY" -c "import torchrec" > /dev/null 2>&1; then
  # Issue 15: the `large` preset in bf16 on one GPU, MFU against the measured bf16 peak and the vendor's.
  log "model large bf16"
  timeout -s INT -k 10 90 "$PY" -m model.train --config large --steps 30 --kernels fused --amp bf16 --device cuda \
    --no-progress --json "$OUT/model-large.json" >> "$OUT/summary.txt" 2>&1
  log "model large rc=$?"
  # Issue 14: gk.swap's bench (swapped DLRM, TransformerEncoder), quick sizes.
  timeout -s INT -k 5 60 "$PY" -m bench swap --device cuda --quick --out /tmp/gk_swap_bench >> "$OUT/summary.txt" 2>&1
  log "swap bench rc=$?"
  # Issue 16: model.train --distributed on NCCL, one rank (DMP + gem_kernels sharders; plan auto).
  timeout -s INT -k 10 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m model.train \
    --config tiny --distributed --steps 8 --no-progress --device cuda >> "$OUT/summary.txt" 2>&1
  log "distributed (NCCL, 1 rank) rc=$?"
else
  log "model large / swap bench / distributed: skipped (TorchRec does not import on this machine)"
fi

# Attention tile shapes, timed (the shipped ones were chosen from register counts): into the summary.
log "attention tiles"
timeout -s INT -k 5 25 "$PY" scripts/attention_tiles.py --budget 15 >> "$OUT/summary.txt" 2>&1
log "attention tiles rc=$?"
# pytest-benchmark regression suite (bench/regression): every op and backend verified, then timed briefly.
log "regression suite"
timeout -k 5 40 "$PY" -m pytest bench/regression --benchmark-only -q --benchmark-max-time=0.05 -p no:cacheprovider >> "$OUT/summary.txt" 2>&1
log "regression suite rc=$?"
# Duplicates of the timestamped results, and what `python -m bench.report` redraws from the JSON.
rm -f "$OUT"/latest-* "$OUT"/cuda-*.md "$OUT"/cuda-*.png
ls "$OUT" >> "$OUT/summary.txt"
