"""Backend selection: available_backends, use_backend (setter and context manager), backend=, errors."""

import dataclasses
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
        _backend.resolve_backend("cpu", torch.device("cuda"), "jagged")


def test_auto_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _backend.resolve_backend("auto", cpu, "jagged") == "cpu"
    assert _backend.resolve_backend(None, cpu, "jagged") == "cpu"
    no_native = dataclasses.replace(_backend.FAMILIES["jagged"], implemented=("reference", "triton"))
    assert _backend.resolve_backend("auto", cpu, no_native) == "reference"
    cuda_ok, triton_ok = (_backend.unavailable_reason(b) is None for b in ("cuda", "triton"))
    first = {"cuda": "cuda" if cuda_ok else ("triton" if triton_ok else "reference"),
             "triton": "triton" if triton_ok else ("cuda" if cuda_ok else "reference")}
    # One rule, a per-family preference: attention and the HSTU layer's projections (tensor-core tiles in
    # triton, CUDA-core loops in cuda) take triton first on CUDA tensors, the others cuda.
    for family, fam in _backend.FAMILIES.items():
        assert _backend.resolve_backend("auto", cuda, family) == first[fam.auto_cuda[0]], family
    triton_first = {"attention", "hstu_layer"}
    assert {n for n, f in _backend.FAMILIES.items() if f.auto_cuda[0] == "triton"} == triton_first
    assert {f.auto_cuda[0] for n, f in _backend.FAMILIES.items() if n not in triton_first} == {"cuda"}


def test_dispatch_table_reaches_every_family_module():
    """kernel() finds each family's reference/triton functions through FAMILIES' written-out imports."""
    import gem_kernels.reference.attention as reference_attention
    import gem_kernels.reference.jagged as reference_jagged

    assert _backend.kernel("jagged", "jagged_to_padded", "reference") is reference_jagged.jagged_to_padded
    assert _backend.kernel("attention", "jagged_attention_fwd", "reference") is reference_attention.jagged_attention_fwd
    # The native ops, each its own (looked up once, then from kernel()'s table), on either native backend.
    for _ in range(2):
        for op in ("dot_interaction", "dot_interaction_backward", "fm_compress"):
            for backend in ("cpu", "cuda"):
                assert _backend.kernel("interaction", op, backend) is getattr(torch.ops.gem_kernels, f"{op}_native")
    for family, fam in _backend.FAMILIES.items():
        assert fam.module("reference").__name__ == f"gem_kernels.reference.{family}"
    with pytest.raises(KeyError):
        _backend.kernel("nosuchfamily", "op", "reference")


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


def test_triton_kernels_run_on_their_inputs_device(monkeypatch):
    """A Triton launch goes to the *current* device: the triton backend makes its first CUDA input's
    device current for the call (what a CUDAGuard does for the CUDA kernels). Checked with a fake
    cuda:1 tensor and a recording torch.cuda.device, so it runs without a GPU."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import gem_kernels.triton.interaction as triton_interaction

    entered, seen = [], []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    guarded = _backend._on_device_of_inputs(lambda *args, **kwargs: seen.append(list(entered)) or "ran")
    with FakeTensorMode():
        x1 = torch.empty(2, 3, device="cuda:1")
    assert guarded(3, x1, flag=True) == "ran" and seen[-1] == [torch.device("cuda:1")]
    assert entered == [torch.device("cuda:1"), "exit"]
    assert guarded(1, y=x1) == "ran" and seen[-1][-1] == torch.device("cuda:1")  # keyword tensors count
    entered.clear()
    assert guarded(torch.ones(2), 5) == "ran" and seen[-1] == [] and entered == []  # no CUDA input: no guard

    wrapped = _backend.kernel("interaction", "dot_interaction", "triton")
    assert wrapped.__wrapped__ is triton_interaction.dot_interaction
    assert _backend.kernel("interaction", "dot_interaction", "reference") is not wrapped


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two GPUs")
def test_triton_kernels_on_a_second_gpu():
    if _backend.unavailable_reason("triton") is not None:
        pytest.skip(_backend.unavailable_reason("triton"))
    x = torch.randn(4, 5, 8, device="cuda:1")
    with torch.cuda.device(0):
        out = gk.dot_interaction(x, backend="triton")
    assert out.device == x.device
    torch.testing.assert_close(out, gk.dot_interaction(x, backend="reference"))
