#!/usr/bin/env bash
# The GPU check: everything a lent GPU machine should verify, in one call of the device tool, ordered
# by value so that a run cut short still brings back the most useful results (issue 25):
#   facts, build, raise (C++ checks raise, not crash), tests (CUDA + Triton correctness, stopping at
#   38 % of the budget), one bench row per kernel family, the model `large` bf16 MFU run, the fused HSTU
#   layers against generative-recommenders' Triton STULayer at dlrm_v3's shape (issue 26), swap and
#   DMP on TorchRec, and the bad-input fuzz last with whatever time is left.
# Each step runs under its own time box (SIGINT first, so pytest and the bench still report what they
# did, then SIGKILL), and its result line is appended to $OUT/summary.txt before the next step starts;
# the step logs and result JSONs are packed into $OUT/gpu_check.tar.gz after every step. Both files
# therefore come back even when the device tool kills the run (at most 8 files come back from $OUT).
#
# Usage (on the GPU machine, the first command, nothing before it; docs/gpu.md has the protocol):
#   bash scripts/gpu_check.sh                 # device tool: timeout_s 600, carry [".gpu_carry"]
#   bash scripts/gpu_check.sh --dry-run       # prints the plan with each step's time box; runs nothing
#   bash scripts/gpu_check.sh --budget 300 --only tests,fuzz    # a shorter second call
# Options: --budget SECONDS (default $GPU_CHECK_BUDGET or 550: the whole run ends by then),
#          --only STEP[,STEP] / --skip STEP[,STEP] (a step's name, or "bench" for every bench step).
# Environment: OUT (default ./gpu_out), PYTHON (default python3), GEM_KERNELS_CUDA_ARCHS (default 90a).
#
# Adding a step: a line in PLAN below and a function step_<name> (the command, output to its log).
# Adding a bench family: its name in BENCH_FAMILIES; a family that `python -m bench` does not list,
# or whose module does not exist, is skipped with that reason.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DRY_RUN=0
BUDGET="${GPU_CHECK_BUDGET:-550}"
ONLY=""
SKIP=""
while (( $# )); do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
    --only) ONLY="${2:?--only needs step names}"; shift ;;
    --skip) SKIP="${2:?--skip needs step names}"; shift ;;
    -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if ! [[ "$BUDGET" =~ ^[0-9]+$ ]] || (( BUDGET < 60 )); then
  echo "gpu_check: --budget must be a whole number of seconds >= 60, got '$BUDGET'" >&2
  exit 2
fi

# The bench families to time, headline kernels first. The bench runs each family's headline shapes
# first (fwd, then fwd+bwd), so a family's short budget measures exactly those rows.
BENCH_FAMILIES=(attention jagged embedding_bag interaction hstu_layer inference ranking hashed)
BENCH_WINDOW=$(( BUDGET * 25 / 100 ))   # shared evenly by the bench families that exist
RESERVE=8      # seconds kept at the end to pack the results
MIN_BOX=10     # a step offered less than this is recorded as skipped (no time left)

# The plan, in order of value. Box: seconds, "N%" (until N % of the budget since the start, with at
# least 45 s), "bench" (an even share of BENCH_WINDOW) or "rest" (until the end of the budget).
# Steps marked torchrec run only when the carried TorchRec imports (step torchrec says why not).
PLAN=(
  "facts     25    -         GPU, driver, torch/triton/CUDA/Python versions, compilers"
  "build     170   -         gem_kernels._C with CUDA for sm_90a (GEM_KERNELS_CUDA_ARCHS), nproc jobs"
  "raise     25    -         a C++ TORCH_CHECK raises a Python exception (tests/test_build_toolchain.py)"
  "tests     38%   -         CUDA and Triton correctness: pytest -m 'gpu or triton' (xdist when there)"
)
for fam in "${BENCH_FAMILIES[@]}"; do
  PLAN+=("bench:$fam bench -     python -m bench $fam --device cuda (headline rows, fwd and fwd+bwd)")
done
PLAN+=(
  "torchrec  20    -         install .gpu_carry wheels (pip --no-index) and probe the fbgemm ops on CUDA"
  "model     55    torchrec  model.train --config large --amp bf16 --kernels fused: MFU"
  "grstu     40    -         scripts/gr_stu_vs.py: fused HSTU layers vs GR's Triton STULayer, dlrm_v3 shape, bf16"
  "swap      25    torchrec  python -m bench swap --device cuda --quick"
  "dmp       30    torchrec  model.train --distributed on NCCL, 1 process (torchrun)"
  "fuzz      rest  -         the bad-input fuzz (tests/test_fuzz.py: cuda, triton, host)"
)

PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/gpu_out}"
WORK="${GPU_CHECK_WORK:-/tmp/gk_gpu_check}"
SITE="$WORK/site"            # the carried wheels are installed here (PYTHONPATH)
ARCHS="${GEM_KERNELS_CUDA_ARCHS:-90a}"

bench_exists() {  # prints why a bench family is not there, nothing when it is
  local fam="$1"
  grep -q "^ *\"$fam\": *\"bench\.[a-z_]*\"" bench/__main__.py || { echo "not a family of python -m bench"; return; }
  local module
  module=$(sed -n "s/^ *\"$fam\": *\"\(bench\.[a-z_]*\)\".*/\1/p" bench/__main__.py | head -n 1)
  [ -f "${module//.//}.py" ] || [ -f "${module//.//}/__init__.py" ] || echo "module $module does not exist"
}

selected() {  # is step $1 chosen by --only/--skip?
  local name="$1" group="${1%%:*}"
  if [ -n "$ONLY" ] && ! [[ ",$ONLY," == *",$name,"* || ",$ONLY," == *",$group,"* ]]; then return 1; fi
  if [ -n "$SKIP" ] && [[ ",$SKIP," == *",$name,"* || ",$SKIP," == *",$group,"* ]]; then return 1; fi
  return 0
}

# Resolve the plan: name, box (seconds, or "until:T" / "rest"), needs, description, skip reason.
n_bench=0
for fam in "${BENCH_FAMILIES[@]}"; do
  selected "bench:$fam" && [ -z "$(bench_exists "$fam")" ] && n_bench=$((n_bench + 1))
done
NAMES=(); BOXES=(); NEEDS=(); DESCS=(); WHYS=()
for line in "${PLAN[@]}"; do
  read -r name box needs desc <<< "$line"
  why=""
  if ! selected "$name"; then why="not selected (--only/--skip)"; fi
  if [[ "$name" == bench:* && -z "$why" ]]; then why="$(bench_exists "${name#bench:}")"; fi
  case "$box" in
    *%) box="until:$(( BUDGET * ${box%\%} / 100 ))" ;;
    bench) box=$(( n_bench > 0 ? BENCH_WINDOW / n_bench : 0 )) ;;
  esac
  NAMES+=("$name"); BOXES+=("$box"); NEEDS+=("$needs"); DESCS+=("$desc"); WHYS+=("$why")
done

print_plan() {
  echo "gpu_check plan: budget ${BUDGET}s (steps end by then; ${RESERVE}s kept to pack results), out $OUT"
  printf '%-22s %-14s %s\n' step "time box" what
  local i box
  for i in "${!NAMES[@]}"; do
    box="${BOXES[$i]}"
    case "$box" in
      until:*) box="until ${box#until:}s" ;;
      rest) box="rest" ;;
      *) box="${box}s" ;;
    esac
    if [ -n "${WHYS[$i]}" ]; then box="skip"; fi
    printf '%-22s %-14s %s%s\n' "${NAMES[$i]}" "$box" "${DESCS[$i]}" "${WHYS[$i]:+  [skipped: ${WHYS[$i]}]}"
  done
}

if (( DRY_RUN )); then
  print_plan
  exit 0
fi

# ---------------------------------------------------------------- the steps (output: their log)
step_facts() {
  nvidia-smi || true
  "$PY" - <<'PY'
import platform, sys, sysconfig
import torch
print("python", sys.version.replace("\n", " "), platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI,
      "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", p.total_memory >> 20, "MiB")
for name in ("triton", "numpy", "pytest", "xdist", "hypothesis", "torchrec", "fbgemm_gpu", "tensordict", "torchmetrics"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:  # a fact to record, whatever the failure
        print(name, "does not import:", type(exc).__name__, exc)
print("CXX", sysconfig.get_config_var("CXX"))
PY
  for cc in c++ g++ gcc nvcc; do command -v "$cc" > /dev/null && { echo "$cc: $(command -v "$cc")"; "$cc" --version | head -n 4; }; done
  "$PY" setup.py --toolchain-report
}

step_build() {
  GEM_KERNELS_CUDA=1 GEM_KERNELS_CUDA_ARCHS="$ARCHS" MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace \
    && "$PY" -m gem_kernels info
}

step_raise() {
  "$PY" -m pytest tests/test_build_toolchain.py -q -p no:cacheprovider
}

step_tests() {
  local xdist=()
  "$PY" -c "import xdist" 2> /dev/null && xdist=(-n 8)
  # --maxfail, not -x: the first GPU run should report every failing kernel, not just the first.
  "$PY" -m pytest tests -q --maxfail=50 -m "gpu or triton" -p no:cacheprovider "${xdist[@]}"
}

step_bench() {  # $1: the family; $2: the step's box (the bench stops itself a little before it)
  "$PY" -m bench "$1" --device cuda --budget "$(( $2 * 3 / 4 ))" --out "$WORK/bench"
}

step_torchrec() {
  local wheels=("$ROOT"/.gpu_carry/*.whl)
  if [ -e "${wheels[0]}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || return 1
  else
    echo "no wheels in .gpu_carry/ (bash scripts/gpu_carry.sh here, then carry [\".gpu_carry\"] in the device call)"
  fi
  PYTHONPATH="$SITE:$PYTHONPATH" "$PY" scripts/gpu_torchrec_probe.py
}

step_model() {
  torchrec_env "$PY" -m model.train --config large --steps 30 --kernels fused --amp bf16 --device cuda \
    --no-progress --json "$WORK/model-large.json"
}

step_grstu() {  # GR's package carried by scripts/gpu_carry.sh (pure Python + Triton: no TorchRec needed)
  "$PY" scripts/gr_stu_vs.py --device cuda --repeats 10 --gr-path "$ROOT/.gpu_carry/generative-recommenders" \
    --out "$WORK/bench/gr-stu"
}

step_swap() {
  torchrec_env "$PY" -m bench swap --device cuda --quick --out "$WORK/bench"
}

step_dmp() {
  torchrec_env "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m model.train \
    --config tiny --distributed --steps 8 --no-progress --device cuda
}

step_fuzz() {
  # The CUDA and Triton backends first (never fuzzed on a GPU yet), then the host one, where the GPU
  # image's C++ checks crashed before (issue 25).
  "$PY" -m pytest tests/test_fuzz.py tests/test_edge_values.py -q -p no:cacheprovider -k "cuda or triton" \
    && "$PY" -m pytest tests/test_fuzz.py -q -p no:cacheprovider -k "fuzz-host"
}

torchrec_env() {  # the carried TorchRec, with CUDA kernels for the fbgemm ops it calls (the shim)
  PYTHONPATH="$ROOT/scripts/gpu_site:$SITE:$PYTHONPATH" "$@"
}

# ---------------------------------------------------------------- the runner
mkdir -p "$OUT" "$WORK/logs" "$WORK/bench"
rm -f "$OUT/summary.txt" "$OUT/gpu_check.tar.gz"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
END=$(( START + BUDGET ))
SUMMARY="$OUT/summary.txt"
TORCHREC_OK=0

pack() {  # the logs and results so far, replaced atomically (a kill mid-pack keeps the previous one)
  tar -czf "$OUT/.gpu_check.tar.gz" -C "$WORK" logs bench $(cd "$WORK" && ls ./*.json 2> /dev/null) 2> /dev/null
  mv -f "$OUT/.gpu_check.tar.gz" "$OUT/gpu_check.tar.gz"
}

result_line() {  # the line of a step's log worth reading in the summary
  local line
  line=$(grep -E "[0-9]+ (passed|failed|error|skipped)|MFU|Error|error:|^fuzz " "$1" 2> /dev/null | tail -n 1)
  [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' "$1" 2> /dev/null | tail -n 1)
  echo "$line" | cut -c1-200
}

{ print_plan; echo; echo "started $(date -u +%FT%TZ) on $(hostname), git $(git rev-parse --short HEAD 2> /dev/null || echo '?')"; } > "$SUMMARY"
pack

for i in "${!NAMES[@]}"; do
  name="${NAMES[$i]}"; box="${BOXES[$i]}"; log="$WORK/logs/${name/:/_}.log"
  now=$(date +%s)
  left=$(( END - RESERVE - now ))
  case "$box" in
    until:*) box=$(( START + ${box#until:} - now )); (( box < 45 )) && box=45 ;;
    rest) box=$left ;;
  esac
  (( box > left )) && box=$left
  why="${WHYS[$i]}"
  [ -z "$why" ] && [ "${NEEDS[$i]}" = torchrec ] && (( ! TORCHREC_OK )) && why="TorchRec does not import (see step torchrec)"
  [ -z "$why" ] && (( box < MIN_BOX )) && why="no time left (${box}s)"
  if [ -n "$why" ]; then
    printf '%-22s SKIP    %s\n' "$name" "$why" >> "$SUMMARY"
    continue
  fi
  grace=$(( box / 6 < 15 ? box / 6 : 15 ))
  printf '%-22s ...     box %ss, started at +%ss\n' "$name" "$box" "$(( now - START ))" >> "$SUMMARY"
  if [[ "$name" == bench:* ]]; then
    cmd=(step_bench "${name#bench:}" "$box")
  else
    cmd=("step_$name")
  fi
  export PY ROOT WORK SITE ARCHS
  timeout -s INT -k "$grace" "$(( box - grace ))" bash -c "$(declare -f "${cmd[0]}" torchrec_env); ${cmd[*]}" > "$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - now ))
  case $rc in
    0) status=PASS ;;
    124|137) status=TIMEOUT ;;
    *) status=FAIL ;;
  esac
  [ "$name" = torchrec ] && (( rc == 0 )) && TORCHREC_OK=1
  printf '%-22s %-7s rc=%s in %ss of %ss: %s\n' "$name" "$status" "$rc" "$took" "$box" "$(result_line "$log")" >> "$SUMMARY"
  [ "$name" = facts ] && sed 's/^/    /' "$log" | head -n 60 >> "$SUMMARY"
  pack
done

echo "finished $(date -u +%FT%TZ) after $(( $(date +%s) - START ))s" >> "$SUMMARY"
pack
