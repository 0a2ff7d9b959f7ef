#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/bench.sh: makes .venv with the pinned dependencies and
# builds gem_kernels._C (incrementally: ninja recompiles only what changed). Idempotent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="${GEM_KERNELS_VENV:-$ROOT/.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

# Reinstall the pinned deps only when the requirement files change.
stamp="$VENV/.gem_kernels_requirements"
want="$(cat requirements.txt requirements-peers.txt requirements-torchrec.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned dependencies (requirements.txt)"
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements.txt
  # Peers are optional: the bench reports them as missing when they do not install here.
  python -m pip install -q -r requirements-peers.txt || echo "[setup] peers (fbgemm-gpu-cpu) not installed; bench will skip them"
  # TorchRec goes in with --no-deps next to the fbgemm-gpu(-cpu) already there (see requirements-torchrec.txt).
  if python -c "import fbgemm_gpu" >/dev/null 2>&1; then
    python -m pip install -q $(grep -v -e '^#' -e '^torchrec==' requirements-torchrec.txt) \
      && python -m pip install -q --no-deps "$(grep '^torchrec==' requirements-torchrec.txt)" \
      || echo "[setup] torchrec not installed; gk.torchrec, its tests and bench rows will skip"
  else
    echo "[setup] fbgemm_gpu missing, so torchrec is not installed; gk.torchrec, its tests and bench rows will skip"
  fi
  echo "$want" > "$stamp"
fi

# Build the extension. With nvcc and a CUDA torch present, the CUDA kernels must build too
# (GEM_KERNELS_CUDA=1 fails loudly): that is how CI proves the .cu sources compile and link.
if [ -z "${GEM_KERNELS_CUDA:-}" ] && command -v nvcc >/dev/null 2>&1 \
   && python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
  export GEM_KERNELS_CUDA=1
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
echo "[setup] building gem_kernels._C (GEM_KERNELS_CUDA=${GEM_KERNELS_CUDA:-auto})"
start=$(date +%s)
# One build path, whoever runs first (bench.sh or test.sh): build_ext --inplace keeps its objects in
# build/ and ninja recompiles only what changed. (`pip install -e .` builds in a temporary folder, so
# a later build_ext --inplace used to compile the whole extension a second time.)
python setup.py -q build_ext --inplace > build.log 2>&1 || { cat build.log; exit 1; }
# Importable from any directory in this venv, as an editable install would make it, with no build.
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
[ "$(cat "$site/gem_kernels_repo.pth" 2>/dev/null)" = "$ROOT" ] || echo "$ROOT" > "$site/gem_kernels_repo.pth"
echo "[setup] extension ready in $(( $(date +%s) - start ))s"
