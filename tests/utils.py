"""Helpers shared by every test module: the tolerance table, backend/device parametrisation,
jagged input makers and allocator poisoning."""

from __future__ import annotations

import os

import pytest
import torch

from gem_kernels import _backend

# Absolute/relative tolerance per dtype for ops that compute (copies compare exactly). The rule
# (FlashAttention's): a kernel's error against the fp32 reference may be at most about twice the
# error of the same-dtype eager computation; these bounds hold that for the reductions we test.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
DEVICES = ("cpu", "cuda")

# GK_CUDA_EMU=1 (tests/cuda_emu): the `cpu` backend runs the CUDA kernels in a CPU emulation of
# CUDA. A test of something only the C++ CPU kernel does is skipped then, with this mark.
CUDA_EMULATION = os.environ.get("GK_CUDA_EMU") == "1"
cpu_kernel_only = pytest.mark.skipif(CUDA_EMULATION, reason="tests the C++ CPU kernel, which GK_CUDA_EMU=1 replaces "
                                                             "with the emulated CUDA kernel")


def _skip_reason(device: str, backend: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if backend == "triton" and device == "cpu" and torch.cuda.is_available():
        return "Triton runs on the GPU here; the CPU interpreter is used only on machines without one"
    return _backend.unavailable_reason(backend)


# The backends a comparison test runs: every one but the reference, which is what they are compared
# with. The reference itself is checked against independent oracles (loops, torch.nn modules,
# torch.optim, eager autograd), never against itself.
KERNEL_BACKENDS = tuple(b for b in _backend.BACKENDS if b != "reference")


def device_backend_params(backends=KERNEL_BACKENDS):
    """pytest params (device, backend) for every pair that makes sense, skipped with the reason
    when this machine cannot run it (never silently dropped). Never the reference: a test comparing
    a backend with the reference would compare the reference with itself (see reference_params)."""
    if "reference" in backends:
        raise ValueError("device_backend_params: the reference is compared with an oracle, not with itself; "
                         "use reference_params() for a test of the reference's own behaviour")
    params = []
    for device in DEVICES:
        for backend in backends:
            if (backend == "cpu" and device == "cuda") or (backend == "cuda" and device == "cpu"):
                continue
            reason = _skip_reason(device, backend)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            if backend == "triton":
                marks.append(pytest.mark.triton)
            if device == "cuda":
                marks.append(pytest.mark.gpu)
            params.append(pytest.param(device, backend, marks=marks, id=f"{device}-{backend}"))
    return params


def reference_params(devices=DEVICES):
    """pytest params (device, "reference") for tests of the reference's own behaviour against an
    oracle (a loop, zeros, torch.nn). The cpu id is "reference" (not "cpu-..."): the GK_CUDA_EMU pass,
    which selects ids containing "cpu", has no CUDA code to run in them."""
    params = []
    for device in devices:
        reason = _skip_reason(device, "reference")
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        if device == "cuda":
            marks.append(pytest.mark.gpu)
        params.append(pytest.param(device, "reference", marks=marks,
                                   id="reference" if device == "cpu" else f"{device}-reference"))
    return params


def cuda_kernel_params():
    """pytest params (device, backend) that run the CUDA kernels: ("cuda", "cuda") on a GPU, and
    ("cpu", "cpu") under GK_CUDA_EMU=1, where the cpu backend runs them in the CPU emulation."""
    if CUDA_EMULATION:
        return [pytest.param("cpu", "cpu", id="cpu-cuda_emulated")]
    reason = _skip_reason("cuda", "cuda")
    marks = [pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])
    return [pytest.param("cuda", "cuda", marks=marks, id="cuda-cuda")]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **kw) -> None:
    tol = dict(TOLERANCES[dtype or expected.dtype])
    tol.update(kw)
    torch.testing.assert_close(actual, expected.to(actual.dtype), **tol)


def offsets_from_lengths(lengths, dtype=torch.int64, device="cpu") -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets.to(dtype=dtype, device=device)


def randn_nonzero(*shape, dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Random values bounded away from 0, so an element a kernel never wrote (0 or garbage) and a
    zero it should have written are told apart."""
    x = torch.randn(*shape, generator=generator)
    x = x + torch.where(x >= 0, 0.5, -0.5)
    return x.to(dtype=dtype, device=device)


def poison_allocator(nbytes: int, device) -> None:
    """Fill a block of memory with NaN and free it, so the op's next empty() likely reuses NaN
    memory (always on CUDA's caching allocator; for small blocks under glibc malloc): any element a
    kernel forgets to write then fails the comparison instead of passing as a lucky 0."""
    block = torch.full((max(nbytes, 4) // 4 + 1024,), float("nan"), dtype=torch.float32, device=device)
    del block


def interpreter_rounding_factor(backend: str, device, dtype: torch.dtype) -> int:
    """How much coarser than round-to-nearest a backend's low-precision stores are.

    # NOTE: Triton's CPU interpreter (triton 3.8) converts fp32 -> bf16 by truncation, not
    # round-to-nearest (half of all values differ from torch's cast; max error 2x), so a Triton
    # kernel's bf16 intermediates carry up to twice eager's rounding error there. On a GPU the
    # factor is 1.
    """
    interpreted = backend == "triton" and torch.device(device).type == "cpu"
    return 2 if interpreted and dtype == torch.bfloat16 else 1


def assert_rounded_once(actual: torch.Tensor, expected32: torch.Tensor, dtype: torch.dtype,
                        rounding_factor: int = 1) -> None:
    """For kernels that accumulate in fp32 and cast once (pooling, scatter-add of rows): `actual` in
    `dtype` is the fp32 `expected32` rounded to `dtype`, up to fp32 reassociation, element by element.
    `rounding_factor`: see interpreter_rounding_factor."""
    expected32 = expected32.detach().float()
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected32)
        return
    # NOTE: half an ulp of each element, plus fp32's reassociation noise (which can tip a rounding).
    bound = rounding_factor * 0.5 * torch.finfo(dtype).eps * expected32.abs() + 1e-5 * (1 + expected32.abs())
    err = (actual.detach().float() - expected32).abs()
    worst = int(torch.argmax(err - bound)) if err.numel() else 0
    assert bool((err <= bound).all()), (f"max error {err.max().item()} beyond a rounding of the fp32 result "
                                        f"(worst element {worst}: {actual.flatten()[worst].item()} vs "
                                        f"{expected32.flatten()[worst].item()})")


def rounding_atol(expected: torch.Tensor, dtype: torch.dtype) -> float:
    """FlashAttention's atol, `2 * |(out_ref + 0.3 - 0.3) - out_ref|` in `dtype`: one rounding's
    worth at the magnitude of the values, not a fixed table entry. On a few elements that formula
    can come out 0 (the +0.3/-0.3 round trip happens to be exact), so it is at least one unit of
    `dtype` at the largest magnitude, which is what the formula gives on a large tensor."""
    if not expected.numel():
        return 0.0
    e = expected.detach().to(dtype)
    ulp = torch.finfo(dtype).eps * expected.detach().abs().max().item()
    return max(2 * ((e + 0.3 - 0.3) - e).abs().max().item(), ulp)


def assert_close_vs_eager(actual: torch.Tensor, expected: torch.Tensor, eager: torch.Tensor,
                          dtype: torch.dtype, msg: str = "", rounding_factor: int = 1) -> None:
    """FlashAttention's rule: the max error of `actual` against the fp32 `expected` is at most twice
    the max error of the same computation done eagerly in `dtype` (`eager`), plus a rounding-sized
    atol (rounding_atol). `rounding_factor` (see interpreter_rounding_factor) scales the bound for
    backends whose casts truncate."""
    expected = expected.detach().float()
    err = (actual.detach().float() - expected).abs().max().item() if actual.numel() else 0.0
    eager_err = (eager.detach().float() - expected).abs().max().item() if eager.numel() else 0.0
    atol = rounding_atol(expected, dtype)
    bound = rounding_factor * (2 * eager_err + atol)
    assert err <= bound, (f"{msg}: max error {err} > {rounding_factor} x (2 x eager's {eager_err} + rounding "
                          f"atol {atol})")


def run_on_vector_path(code: str, avx512: str, marker: str) -> None:
    """Run `code` with `python -c` in a fresh process from the repository root, on one cpu vector path:
    avx512 == "off" sets GEM_KERNELS_NO_AVX512=1 (the 8-lane AVX2 rows on any CPU), anything else
    leaves the CPU's own choice (16-lane AVX-512F where it has it). A fresh process because the kernels
    choose their path once. Asserts it exits 0 and prints `marker`."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("GEM_KERNELS_NO_AVX512", None)
    if avx512 == "off":
        env["GEM_KERNELS_NO_AVX512"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and marker in run.stdout, run.stderr[-2000:]
