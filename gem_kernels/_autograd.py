"""register_autograd: a custom op's autograd formula, behind a leaner Autograd kernel than torch's.

``CustomOpDef.register_autograd`` stores the formula and torch's generated Autograd kernel
(torch/_library/autograd.py) calls it. On every forward with grad that kernel rebuilds the op's full
argument list with ``torch._library.utils.fill_defaults``, which reads ``schema.arguments`` (a new
list of Argument objects per read) once per argument: quadratic in the argument count. Measured
2026-12-06 (2-core Xeon, torch 2.14.1): 23 us per call at 7 arguments, 71 us at 11 (hstu_uvqk_fwd),
154 us at 17 (jagged_attention_fwd), 210 us at 20 (embedding_bag), more than the kernels themselves
at small batches. Our ops' schemas have no defaults and no keyword-only arguments, so the
dispatcher passes every argument and there is nothing to fill.

``register_autograd`` registers the formula with torch as before (the op's metadata stays
complete), then replaces the op's Autograd kernel with one that does what torch's does for such a
schema without the refill: below autograd when grad is off or no input requires grad; otherwise one
``torch.autograd.Function`` whose forward redispatches below autograd with the same keyset and runs
setup_context, and whose backward runs the formula (``ctx.needs_input_grad`` without the keyset
slot). An op whose schema has defaults, keyword-only arguments, tensor lists or mutated arguments
keeps torch's kernel.

``enable_eager_fast_paths`` (called once all ops are defined, by ``gem_kernels/__init__.py``) gives
every gem_kernels op an eager fast path: called on plain CPU/CUDA tensors outside any tracing, mode
or transform, the op runs its body (the function ``custom_op`` decorated: step 5-7 of
docs/op-flow.md) directly, inside a ``torch.autograd.Function`` with the same setup_context and
backward formula when a gradient is needed. A call through the dispatcher crosses into Python twice
(the Autograd kernel above, then torch's CompositeExplicitAutograd kernel that runs the body),
boxing every argument each way. Measured on the GEM small model's training step (2-core Xeon under
SCHED_FIFO, 2026-12-07; 8 batches x 9-10 rounds, the two paths alternated step by step in one process,
medians of the paired differences): 2 threads -1.18 ms of 30.8 (ratio 0.96) and -0.92 ms of 26.9; 1
thread -1.02 ms of 48.9. Per call on tiny tensors the saving is only ~5-7 us (16.7 -> 11.7 us without
grad, 23.2 -> 16.1 with), so most of it is not the Python the path skips but what that path costs the
kernels around it (a guess: instruction-cache and branch-predictor state; not measured).
Measured and not kept (front12, 2026-12-07, same step, batch 8, 1 thread, 60 rounds): running the body
under ``_AutoDispatchBelowAutograd``, so that its native calls skip their autograd fallback: +41 us a step
(paired median; not better).
Everything else keeps the dispatcher path, so the op is still one graph node to torch.compile, export,
FakeTensor, functionalization, vmap, fx and opcheck: a call while compiling, jit tracing, under a
TorchDispatchMode or TorchFunctionMode, inside a functorch transform, under autocast, below autograd,
with keyword arguments or a missing argument, with any argument that is not a plain tensor, number,
bool, string or None (a subclass, a Proxy, a SymInt), on a tensor that is not a strided CPU/CUDA one, or
needing a gradient from an op without a formula. Ops with a
device-specific kernel and the schemas ``_lean_ok`` refuses keep the dispatcher path always. An op
that mutates an argument (the fused embedding-bag backward's in-place optimizer step, the hashed
tables' remap) takes the fast path too: its natives declare the mutation in their schemas (Tensor(a!))
but calling them directly does not bump the version counters (the dispatcher path's ADInplaceOrView
kernel does), so the fast path bumps each mutated argument's after the body, as that kernel would.
``GEM_KERNELS_EAGER_FAST=0`` (read at import) turns the fast path off; ``dispatcher_path_only()`` does
for a block (tests, timing both paths in one process). Two public functions go one step further on
the same conditions (``fast_paths_on()`` and ``eager_plain``): ``gem_kernels.ops.hstu_layer`` runs a
whole HSTU layer (three ops) as one autograd node, and ``gem_kernels.ops.interaction.
wukong_feature_mix_norm`` builds a Wukong layer's mix matrix inside feature_mix_norm's node; see there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch import _C
from torch._library.custom_ops import OPDEFS, CustomOpDef


# One IMPL library per op namespace, kept alive: a Library deregisters its kernels when collected.
_LIBS: dict[str, torch.library.Library] = {}


def _lean_ok(schema: _C.FunctionSchema, allow_mutation: bool = False) -> bool:
    """No defaults, keyword-only arguments or tensor lists; no mutated (aliased) argument unless
    allow_mutation (the eager fast path, which bumps the mutated arguments' version counters itself)."""
    args = schema.arguments
    if any(a.kwarg_only or a.has_default_value() or (a.alias_info is not None and not allow_mutation) for a in args):
        return False
    return not any("[]" in str(a.type) or "List" in str(a.type) for a in (*args, *schema.returns))


def register_autograd(op, backward: Callable, *, setup_context: Callable) -> None:
    """op.register_autograd(backward, setup_context=setup_context), with the lean Autograd kernel
    (module docstring) when op's schema allows it."""
    op.register_autograd(backward, setup_context=setup_context)
    overload = op._opoverload
    if not _lean_ok(overload._schema):
        return
    num_args = len(overload._schema.arguments)
    after_autograd = _C._after_autograd_keyset

    def forward(ctx, *args):
        keyset = args[-1]
        inputs = args[:-1]
        with _C._AutoDispatchBelowAutograd():
            result = overload.redispatch(keyset & after_autograd, *inputs)
        setup_context(ctx=ctx, inputs=inputs, output=result)
        return result

    def lean_backward(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[:-1]
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        result = result if isinstance(result, tuple) else (result,)
        if len(result) != num_args:
            raise RuntimeError(f"the backward formula of {overload} returned {len(result)} gradients, "
                               f"expected {num_args} (one per input, None where there is none)")
        return (*result, None)

    # Built with its name (not renamed afterwards): autograd names the graph node after the class at
    # creation, so a profile shows LeanFor_<ns>_<op>Backward per op rather than one shared name.
    Lean = type(f"LeanFor_{overload._namespace}_{overload._opname}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(lean_backward)})

    def autograd_kernel(keyset, *args):
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            return Lean.apply(*args, keyset)
        with _C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & after_autograd, *args)

    if overload._namespace not in _LIBS:
        _LIBS[overload._namespace] = torch.library.Library(overload._namespace, "IMPL")
    _LIBS[overload._namespace].impl(overload._opname, autograd_kernel, "Autograd", with_keyset=True, allow_override=True)


# ---------------------------------------------------------------------------------------------
# Eager fast path (module docstring)
# ---------------------------------------------------------------------------------------------

_PLAIN_SCALARS = (int, float, bool, str, type(None))
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_increment_version = torch.autograd.graph.increment_version
_AUTOGRAD_CPU, _AUTOGRAD_CUDA = _C.DispatchKey.AutogradCPU, _C.DispatchKey.AutogradCUDA
_excluded = _C._dispatch_tls_is_dispatch_key_excluded


def _eager_plain(args: tuple) -> bool:
    """Whether a call with these positional arguments may skip the dispatcher (module docstring)."""
    if (torch.compiler.is_compiling() or _C._len_torch_dispatch_stack() or _C._is_torch_function_mode_enabled()
            or _C._functorch.peek_interpreter_stack() is not None or torch.jit.is_tracing()
            or _C._is_any_autocast_enabled() or _excluded(_AUTOGRAD_CPU) or _excluded(_AUTOGRAD_CUDA)):
        return False
    for a in args:
        t = type(a)
        if t in _PLAIN_TENSORS:
            if not (a.is_cpu or a.is_cuda) or a.layout is not _STRIDED or a.is_nested:
                return False
        elif t not in _PLAIN_SCALARS:
            return False
    return True


eager_plain = _eager_plain


class _EagerFastOp(CustomOpDef):
    """A gem_kernels CustomOpDef whose call takes the eager fast path when it may (module docstring).
    Only __call__ differs: the object is the same op (isinstance CustomOpDef, same _opoverload)."""

    def __call__(self, *args, **kwargs):
        fast = self._gk_fast
        if not kwargs and len(args) == fast[2] and _eager_plain(args):
            body, function = fast[0], fast[1]
            if _C.is_grad_enabled() and _C._any_requires_grad(*args):
                if function is not None:
                    return function.apply(*args)
            else:
                result = body(*args)
                for i in fast[3]:  # the mutated arguments: their version, as the dispatcher bumps it
                    _increment_version(args[i])
                return result
        return self._opoverload(*args, **kwargs)


def _direct_function(op: CustomOpDef, body: Callable, num_args: int):
    """The torch.autograd.Function of op's eager fast path: the body forward, op's setup_context and
    backward formula (those register_autograd registered) backward."""
    setup_context, backward = op._setup_context_fn, op._backward_fn

    def forward(ctx, *args):
        result = body(*args)
        if setup_context is not None:  # register_autograd without one (a forward-only op's refusal)
            setup_context(ctx=ctx, inputs=args, output=result)
        return result

    def direct_backward(ctx, *grads):
        result = backward(ctx, *grads)
        result = result if isinstance(result, tuple) else (result,)
        if len(result) != num_args:
            raise RuntimeError(f"the backward formula of {op._qualname} returned {len(result)} gradients, "
                               f"expected {num_args} (one per input, None where there is none)")
        return result

    return type(f"EagerFor_{op._namespace}_{op._name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(direct_backward)})


# Whether the eager fast paths are on (enable_eager_fast_paths ran and no dispatcher_path_only block is
# open): gem_kernels.ops.hstu_layer's whole-layer node follows it too.
_fast_paths_on = False


def fast_paths_on() -> bool:
    return _fast_paths_on


def enable_eager_fast_paths(namespace: str = "gem_kernels") -> list[str]:
    """Give every custom op of `namespace` defined so far the eager fast path (module docstring);
    returns the qualified names that got it. A no-op with GEM_KERNELS_EAGER_FAST=0."""
    global _fast_paths_on
    if os.environ.get("GEM_KERNELS_EAGER_FAST", "1") == "0":
        return []
    _fast_paths_on = True
    enabled = []
    for name, op in list(OPDEFS.items()):
        if op._namespace != namespace or type(op) not in (CustomOpDef, _EagerFastOp):
            continue
        schema = op._opoverload._schema
        if not _lean_ok(schema, allow_mutation=True) or set(op._backend_fns) - {None}:
            continue
        num_args = len(schema.arguments)
        has_formula = getattr(op, "_backward_fn", None) is not None
        mutated = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        op._gk_fast = (op._init_fn, _direct_function(op, op._init_fn, num_args) if has_formula else None, num_args,
                       mutated)
        op.__class__ = _EagerFastOp
        enabled.append(name)
    return enabled


@contextlib.contextmanager
def dispatcher_path_only() -> Iterator[None]:
    """Within it, every op takes the dispatcher path (tests compare both paths; timing A/B in one process).
    Not thread-safe: it changes the op objects' class for the whole process."""
    global _fast_paths_on
    ops = [op for op in list(OPDEFS.values()) if type(op) is _EagerFastOp]
    was_on, _fast_paths_on = _fast_paths_on, False
    for op in ops:
        op.__class__ = CustomOpDef
    try:
        yield
    finally:
        for op in ops:
            op.__class__ = _EagerFastOp
        _fast_paths_on = was_on
