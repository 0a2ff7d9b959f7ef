#!/usr/bin/env bash
# What the GPU machine needs and cannot fetch (it reaches no package registry): TorchRec and the
# pure-Python packages it imports that the machine's image lacks, plus the CPU build of FBGEMM_GPU
# made for the machine's torch. Downloaded here, for the machine's Python and torch, into .gpu_carry/
# (git-ignored: name it in the device call's `carry`); scripts/gpu_check.sh installs them there with
# pip --no-index into a target folder before its TorchRec steps.
#
# Pins (docs/gpu.md says why each and lists the sizes):
#   torchrec 1.9.2        the version this repo is tested with (requirements-torchrec.txt); pure Python
#   fbgemm-gpu-cpu 1.6.0  FBGEMM's release for torch 2.11 (its compatibility table: 1.5 <-> 2.10,
#                         1.4 <-> 2.9); the CUDA build (fbgemm-gpu) is far over the 64 MiB carry limit
#   tensordict 0.15.3, pyvers 0.2.3   imported by torchrec.distributed; pure Python
# torchmetrics, tqdm, pyre-extensions, typing-inspect, cloudpickle, numpy: already in the image.
#
# Usage: bash scripts/gpu_carry.sh [DEST]   (default DEST: .gpu_carry; GPU_PYTHON_VERSION=3.12)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.gpu_carry}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
PY="${PYTHON:-python3}"
[ -x "$ROOT/.venv/bin/python" ] && PY="${PYTHON:-$ROOT/.venv/bin/python}"
# The device tool's limit on everything that travels with the working tree (tree + carried paths).
LIMIT_BYTES=$((64 << 20))
PINS=(torchrec==1.9.2 fbgemm-gpu-cpu==1.6.0 tensordict==0.15.3 pyvers==0.2.3)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${PINS[@]}"
ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
# generative-recommenders' Python package, for scripts/gr_stu_vs.py (gpu_check's step grstu: its Triton
# STULayer against ours): its common.py, modules/ and ops/ without their tests, from a checkout at
# $GENERATIVE_RECOMMENDERS_PATH (default /tmp/gr, e.g. a clone of the fetched
# github:meta-recsys/generative-recommenders). Pure Python and Triton, ~2 MB. Without it step grstu
# times gem_kernels' layers alone and says why.
GR_SRC="${GENERATIVE_RECOMMENDERS_PATH:-/tmp/gr}"
rm -rf "$DEST/generative-recommenders"
if [ -d "$GR_SRC/generative_recommenders" ]; then
  (cd "$GR_SRC" && find generative_recommenders -maxdepth 1 -name '*.py' \
     && find generative_recommenders/modules generative_recommenders/ops -name '*.py' -not -path '*/tests/*') |
    while read -r f; do
      mkdir -p "$DEST/generative-recommenders/$(dirname "$f")"
      cp "$GR_SRC/$f" "$DEST/generative-recommenders/$f"
    done
  git -C "$GR_SRC" rev-parse HEAD > "$DEST/generative-recommenders/COMMIT" 2> /dev/null || true
  echo "generative-recommenders: $(find "$DEST/generative-recommenders" -name '*.py' | wc -l) files from $GR_SRC"
else
  echo "gpu_carry: no generative-recommenders checkout at $GR_SRC (step grstu will time gem_kernels alone)" >&2
fi
carry=$(cat "$DEST"/*.whl | wc -c)
[ -d "$DEST/generative-recommenders" ] && carry=$(( carry + $(find "$DEST/generative-recommenders" -type f -exec cat {} + | wc -c) ))
tree=$(git -C "$ROOT" ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && xargs -0 cat 2>/dev/null) | wc -c)
echo "carry ${carry} bytes + working tree ${tree} bytes = $((carry + tree)) of ${LIMIT_BYTES}"
if (( carry + tree > LIMIT_BYTES )); then
  echo "gpu_carry: over the device tool's 64 MiB limit" >&2
  exit 1
fi
