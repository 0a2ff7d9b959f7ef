"""Backend selection: available_backends, use_backend (setter and context manager), backend=, errors."""

import subprocess
import sys

import pytest
import torch

import gem_kernels as gk
from gem_kernels import _backend

from .utils import offsets_from_lengths


def test_reference_always_available():
    assert "reference" in gk.available_backends()
    assert set(gk.available_backends()) <= set(gk.BACKENDS)


def test_extension_loaded_for_cpu_backend():
    # The test command builds the extension; a missing one must not pass quietly as "reference only".
    assert _backend.unavailable_reason("cpu") is None, _backend.unavailable_reason("cpu")


def test_use_backend_as_setter_and_context_manager():
    assert gk.get_backend() == "auto"
    with gk.use_backend("reference"):
        assert gk.get_backend() == "reference"
        with gk.use_backend("cpu"):
            assert gk.get_backend() == "cpu"
        assert gk.get_backend() == "reference"
    assert gk.get_backend() == "auto"
    gk.use_backend("reference")
    try:
        assert gk.get_backend() == "reference"
    finally:
        gk.use_backend("auto")
    assert gk.get_backend() == "auto"


def test_unknown_backend_is_value_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        gk.use_backend("tpu")
    values, offsets = torch.ones(3, 2), offsets_from_lengths([3])
    with pytest.raises(ValueError, match="'tpu'"):
        gk.jagged_to_padded(values, offsets, 4, backend="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_unavailable_backend_says_why():
    # A CUDA build says there is no device; a CPU-only build says it has no CUDA kernels.
    with pytest.raises(gk.BackendUnavailableError, match="no CUDA device|built without CUDA"):
        gk.use_backend("cuda")


def test_backend_must_match_device():
    values, offsets = torch.ones(3, 2), offsets_from_lengths([3])
    if torch.cuda.is_available() and "cuda" in gk.available_backends():
        with pytest.raises(gk.BackendUnavailableError, match="CUDA tensors"):
            gk.jagged_to_padded(values, offsets, 4, backend="cuda")
    with pytest.raises(gk.BackendUnavailableError):
        _backend.resolve_backend("cpu", torch.device("cuda"))


def test_auto_resolution():
    assert _backend.resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert _backend.resolve_backend(None, torch.device("cpu")) == "cpu"
    assert _backend.resolve_backend("auto", torch.device("cpu"), implemented=("reference", "triton")) == "reference"
    expected_cuda = "cuda" if _backend.unavailable_reason("cuda") is None else (
        "triton" if _backend.unavailable_reason("triton") is None else "reference")
    assert _backend.resolve_backend("auto", torch.device("cuda")) == expected_cuda


def test_info_command():
    out = subprocess.run([sys.executable, "-m", "gem_kernels", "info"], capture_output=True, text=True, check=True)
    for word in ("gem_kernels", "torch", "backends:", "reference", "cpu", "cuda", "triton", "build:"):
        assert word in out.stdout


def test_cuda_compiled_when_toolchain_present():
    """With nvcc and a CUDA torch at build time, the CUDA kernels must be in the extension (CI's
    proof that csrc/cuda compiles and links); GEM_KERNELS_CUDA=0 opts out."""
    import os
    import shutil

    if os.environ.get("GEM_KERNELS_CUDA") == "0" or shutil.which("nvcc") is None or torch.version.cuda is None:
        pytest.skip("no CUDA toolchain at build time (or GEM_KERNELS_CUDA=0)")
    assert _backend.ext_with_cuda(), "nvcc and a CUDA torch are here but gem_kernels._C was built without CUDA"


def test_import_without_extension_keeps_reference_and_says_why():
    """A missing or broken gem_kernels._C must not break `import gem_kernels`."""
    code = (
        "import sys; sys.modules['gem_kernels._C'] = None\n"  # makes `import gem_kernels._C` raise ImportError
        "import torch, gem_kernels as gk\n"
        "from gem_kernels import _backend\n"
        "assert 'reference' in gk.available_backends() and 'cpu' not in gk.available_backends()\n"
        "print(_backend.unavailable_reason('cpu'))\n"
        "v, o = torch.ones(3, 2), torch.tensor([0, 1, 3])\n"
        "assert gk.jagged_to_padded(v, o, 2).shape == (2, 2, 2)\n"  # auto falls back to reference
        "try:\n"
        "    gk.jagged_to_padded(v, o, 2, backend='cpu')\n"
        "except gk.BackendUnavailableError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "gem_kernels._C failed to import" in out.stdout
    assert "refused: backend 'cpu' is not available" in out.stdout
