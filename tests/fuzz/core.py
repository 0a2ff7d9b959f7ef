"""The fuzz's machinery: the Case record, the outcome classes, the input helpers and `run_case` (runs one case, classifies its outcome)."""

from __future__ import annotations

import math
import os
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

import gem_kernels as gk

if os.environ.get("GK_CUDA_EMU") == "1":  # as tests/conftest.py: the cpu backend runs the CUDA kernels' code
    from tests.cuda_emu import build as _cuda_emu

    _cuda_emu.load()

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
NAN, INF = math.nan, math.inf

# Outcome classes. The first five are right outcomes, the rest fail the fuzz.
OK_CLASSES = ("error_named", "equal_reference", "nan_inf_rule", "native_rejected", "native_returned")
FAIL_CLASSES = ("crash", "hang", "unclear_error", "accepted_bad_input", "rejected_valid_input", "garbage")
# A mismatch in a case marked `pending` (a rule another change is fixing): listed, not failed, unless
# GK_FUZZ_STRICT=1. Attention's NaN/Inf rule (issue 19, helper attn) is the one such rule; once
# it lands the cpu backend must agree with the reference and the mark goes.
KNOWN_CLASSES = ("known_issue",)
STRICT = os.environ.get("GK_FUZZ_STRICT") == "1"

# |actual - oracle| <= atol * max(1, max|oracle|) + rtol * |oracle|; inputs are small, so these are
# loose against the kernels' real error and tight against a wrong element.
TOL = {F32: (2e-4, 2e-4), F16: (1e-2, 1e-2), BF16: (6e-2, 6e-2)}
BAD_INPUT_ERRORS = (ValueError, IndexError, TypeError, gk.BackendUnavailableError)


@dataclass
class Case:
    name: str
    kind: str  # "bad" | "value" | "native"
    make: Callable[[str], dict]  # device -> named inputs
    call: Callable[[dict, str], Any]  # (inputs, backend) -> output tensor
    names: tuple = ()  # bad: the message must name one of these
    oracle: Callable[[dict], torch.Tensor] | None = None  # value: on inputs cast to oracle_dtype
    oracle_dtype: torch.dtype = torch.float64
    grad: tuple = ()  # value: inputs to differentiate (a random grad_out, seeded by the case)
    target: str = "oracle"  # value: "oracle", or "reference" (the reference backend's result is the truth)
    check: Callable[[dict, Any], None] | None = None  # native: asserts on the result
    backends: tuple | None = None  # the backends the case runs on (None: all)
    errors: tuple = ()  # bad: exception types accepted besides BAD_INPUT_ERRORS (torch's own, e.g. load_state_dict's)
    pending: str = ""  # value: why a mismatch is a known issue being fixed elsewhere (see KNOWN_CLASSES)
    pending_cuda: str = ""  # native: why a crash on the cuda backend is a known issue


CASES: dict[str, Case] = {}


def add(case: Case) -> None:
    assert case.name not in CASES, case.name
    CASES[case.name] = case


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(name))


def _rand(g, *shape, dtype=F32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


def _offsets(lengths, dtype=torch.int64, device="cpu"):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        out[1:] = torch.tensor(lengths).cumsum(0)
    return out.to(dtype=dtype, device=device)


def _poke(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------------
# Running and classifying one case
# ---------------------------------------------------------------------------------------------


def _names_in(message: str, names: tuple) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def _to_oracle(inputs: dict, dtype: torch.dtype, grad: tuple) -> dict:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach().to(dtype)
            if k in grad:
                v.requires_grad_(True)
        out[k] = v
    return out


def _leaves(inputs: dict, grad: tuple) -> dict:
    out = dict(inputs)
    for k in grad:
        out[k] = inputs[k].detach().clone().requires_grad_(True)
    return out


def _forward_backward(fn, inputs: dict, grad: tuple, grad_seed: int, grad_dtype: torch.dtype | None = None):
    """(output, gradients of <output, g> w.r.t. inputs[grad]) with g random, seeded, and rounded to
    grad_dtype (the tested backend's output dtype, so that its oracle sees the same g)."""
    out = fn(inputs)
    if not grad:
        return out.detach(), []
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    g = g.to(grad_dtype or out.dtype).to(out.device)
    leaves = [inputs[k] for k in grad]
    if out.requires_grad:
        grads = torch.autograd.grad(out, leaves, g.to(out.dtype), allow_unused=True)
    else:  # e.g. an output with 0 elements that autograd never saw depend on the inputs
        grads = [None] * len(leaves)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads)]
    return out.detach(), [gr.detach() for gr in grads]


def _compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> tuple[str | None, bool]:
    """(why they differ or None, whether anything non-finite was involved)."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}", False
    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(dtype).to(torch.float64)  # the oracle rounded to the output dtype
    nonfinite = bool((~torch.isfinite(a)).any() or (~torch.isfinite(e)).any())
    if not torch.equal(a.isnan(), e.isnan()):
        bad = (a.isnan() != e.isnan()).nonzero()[:3].tolist()
        return f"{what}: NaN positions differ (first at {bad}; {int(a.isnan().sum())} vs {int(e.isnan().sum())})", True
    inf_a, inf_e = a.isinf(), e.isinf()
    if not torch.equal(inf_a, inf_e) or not torch.equal(a[inf_a], e[inf_e]):
        return f"{what}: Inf positions differ ({int(inf_a.sum())} vs {int(inf_e.sum())})", True
    fin = torch.isfinite(e)
    if fin.any():
        atol, rtol = TOL.get(dtype, TOL[F32])
        scale = max(1.0, float(e[fin].abs().max()))
        err = (a[fin] - e[fin]).abs() - (atol * scale + rtol * e[fin].abs())
        if bool((err > 0).any()):
            i = int(err.argmax())
            return f"{what}: {float(a[fin][i])} != expected {float(e[fin][i])}", nonfinite
    return None, nonfinite


def _has_nonfinite(inputs: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
               for v in inputs.values()) or any(isinstance(v, float) and not math.isfinite(v) for v in inputs.values())


def run_case(case: Case, backend: str, device: str) -> tuple[str, str]:
    """(outcome class, detail) of one case on one backend, in this process."""
    try:
        inputs = case.make(device)
    except Exception as exc:  # a bug of the case itself: report it as unclear, never as a pass
        return "unclear_error", f"case set-up failed: {type(exc).__name__}: {exc}"
    if case.kind == "bad":
        try:
            case.call(inputs, backend)
        except BAD_INPUT_ERRORS + case.errors as exc:
            msg = str(exc)
            if _names_in(msg, case.names):
                return "error_named", ""
            return "unclear_error", f"{type(exc).__name__} names none of {case.names}: {msg[:300]}"
        except Exception as exc:
            return "unclear_error", f"{type(exc).__name__}: {str(exc)[:300]}"
        return "accepted_bad_input", f"no error (expected one naming {case.names})"
    if case.kind == "native":
        try:
            result = case.call(inputs, backend)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:
            if re.search(r"CUDA error|illegal memory access|device-side assert", str(exc)):
                if case.pending_cuda and backend == "cuda" and not STRICT:
                    return "known_issue", f"{str(exc)[:200]} ({case.pending_cuda})"
                return "crash", f"{type(exc).__name__}: {str(exc)[:300]}"
            return "native_rejected", ""
        if case.check is not None:
            try:
                case.check(inputs, result)
            except AssertionError as exc:
                return "garbage", f"native result wrong: {exc}"
        return "native_returned", ""
    # value
    grad_seed = _seed(case.name) + 1
    try:
        out, grads = _forward_backward(lambda x: case.call(x, backend), _leaves(inputs, case.grad), case.grad,
                                       grad_seed)
    except Exception as exc:
        return "rejected_valid_input", f"{type(exc).__name__}: {str(exc)[:300]}"
    dtype = out.dtype
    nonfinite = _has_nonfinite(inputs)

    def reference_run():
        return _forward_backward(lambda x: case.call(x, "reference"), _leaves(inputs, case.grad), case.grad,
                                 grad_seed, dtype)
    try:
        if case.target == "reference":
            exp_out, exp_grads = reference_run()
        else:
            oracle_in = _to_oracle({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()},
                                   case.oracle_dtype, case.grad)
            exp_out, exp_grads = _forward_backward(case.oracle, oracle_in, case.grad, grad_seed, dtype)
            if nonfinite and case.grad:
                # The rule for gradients at non-finite inputs is the reference backend's (eager
                # PyTorch's matmul-based backward puts NaN where the elementwise maths has none:
                # a masked 0 * Inf); on the reference backend itself they are not compared.
                exp_grads = reference_run()[1] if backend != "reference" else grads
    except Exception as exc:
        return "unclear_error", f"the case's oracle failed: {type(exc).__name__}: {str(exc)[:300]}"
    if out.dtype != exp_out.dtype and case.target == "reference" or (
            case.target == "oracle" and out.dtype not in (F32, F16, BF16)):
        return "garbage", f"dtype {out.dtype}"
    for what, a, e, dt in [("out", out, exp_out, dtype)] + [
            (f"grad {k}", ga, ge, _looser(dtype, inputs[k].dtype)) for k, ga, ge in zip(case.grad, grads, exp_grads)]:
        why, nf = _compare(a, e, dt, what)
        nonfinite = nonfinite or nf
        if why:
            if case.pending and not STRICT:
                return "known_issue", f"{why} ({case.pending})"
            return "garbage", why
    return ("nan_inf_rule" if nonfinite else "equal_reference"), ""


def _looser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if TOL.get(a, TOL[F32])[0] >= TOL.get(b, TOL[F32])[0] else b
