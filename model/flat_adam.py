"""FlatAdam: torch.optim.Adam(fused=True) whose step is one fused call, its state in flat buffers.

The model's dense parameters are ~55 small tensors. torch's fused Adam steps them as a list: the
step counters by ``_foreach_add_`` (on the CPU a slow path, one add and one scalar copy per tensor),
then ``_fused_adam_``, beside the Python of ``_init_group`` per parameter. Measured at the small
config (2-core Xeon, 2 threads, SCHED_FIFO, 2026-12-07): 0.37 ms per step over the 55 tensors,
0.11 ms for one tensor of the same 204K elements.

Here the parameters are views of one flat buffer (each slot starting at a multiple of 16 elements:
the 64-byte alignment the kernels' aligned loads rely on, as ATen's allocator gives), and so are
Adam's exp_avg / exp_avg_sq (flat buffers) and step counters (one [num_params] buffer). A step adds
1 to the step counters (one add) and runs ``_fused_adam_`` once, over the parameters, their own
gradients and the state views (lists built once), every entry reading the one step counter.
Per element that is torch's update exactly; the state_dict is torch.optim.Adam's (same keys, one
state per parameter: model.train's checkpoints load either way).

The gradients go in as they are, one list entry each. Measured and not kept (front12, 2026-12-07):
gathering the small parameters' gradients into one flat gradient first (one cat, so that the fused
call saw 10 tensors, not 55), this optimizer's first version. In isolation (1 thread, denormals
flushed so that repeated identical updates stay at speed): the gather cost 51 us (a reshape per
gradient, the cat), the 45 more list entries of the fused call 25 us; the two calls 306 -> 219 us.
In the small model's step (2-core Xeon, SCHED_FIFO, both optimizers alternated by round in one
process): batch 8, 1 thread, CPU time 6.69 -> 6.55 ms (paired -147 us, 80 rounds); batch 256,
2 threads, 30.3 -> 29.7 ms (paired -0.68 ms, 24 rounds, round ratios 0.84-1.21: noisy).

Whenever the flat path does not apply, the step is torch's own (``Adam.step``), on the same
state: a closure, a gradient missing or sparse or of another dtype, a parameter no longer a view of
its slot (``module.to(...)`` after the optimizer was built, a second FlatAdam over the same
parameters), amsgrad / maximize / capturable / differentiable / decoupled_weight_decay or a tensor lr,
several param groups, or step counters that differ between parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_ALIGN = 16  # elements: 64 bytes of fp32, ATen's CPU alignment
_profiler_enabled = torch._C._autograd._profiler_enabled


class _Flat(NamedTuple):
    params: list
    values: torch.Tensor          # every parameter's slot
    slots: list[tuple[int, int]]  # (start, numel) per parameter
    data_ptrs: list[int]          # where each parameter must still point


def _adam_step(optimizer: torch.optim.Adam, closure):
    """torch.optim.Adam.step without the step hooks, which FlatAdam.step's own wrapper has run already
    (Optimizer wraps each class's step once, the first time one of its instances is built)."""
    step = torch.optim.Adam.step
    return (step.__wrapped__ if getattr(step, "hooked", False) else step)(optimizer, closure)


class FlatAdam(torch.optim.Adam):
    """torch.optim.Adam(params, lr, betas, eps, weight_decay, fused=True), stepping every parameter in
    one fused call, its state in flat buffers (module docstring). The parameters become views of one
    buffer at construction (values unchanged)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self._flat: _Flat | None = None
        self._state_views = None  # the fused call's state lists, once the state is in the flat buffers
        params = self.param_groups[0]["params"] if len(self.param_groups) == 1 else []
        if not params or len({(p.device, p.dtype) for p in params}) != 1 or not params[0].dtype.is_floating_point:
            return
        slots, total = [], 0
        for p in params:
            slots.append((total, p.numel()))
            total += -(-p.numel() // _ALIGN) * _ALIGN
        flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, (start, n) in zip(params, slots):
                view = flat[start:start + n].view(p.shape)
                view.copy_(p)
                p.data = view
        self._flat = _Flat(params, flat, slots, [p.data_ptr() for p in params])

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._state_views = None  # the loaded tensors replace the views: gathered again at the next step

    def _flat_grads(self) -> list | None:
        """The parameters' gradients where this step may take the flat path (module docstring), the
        state then in the flat buffers; else None."""
        if self._flat is None or len(self.param_groups) != 1:
            return None
        group = self.param_groups[0]
        if (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]
                or group.get("decoupled_weight_decay", False) or not group["fused"] or torch.is_tensor(group["lr"])):
            return None
        flat = self._flat
        params, dtype = flat.params, flat.values.dtype
        current = group["params"]
        if current is not params and (len(current) != len(params) or any(a is not b for a, b in zip(current, params))):
            return None
        # A gradient's device is its parameter's (torch refuses any other in the .grad setter and
        # AccumulateGrad makes none), and an unmoved parameter is on the flat buffer's.
        grads = []
        for p, ptr in zip(params, flat.data_ptrs):
            grad = p.grad
            if grad is None or p.data_ptr() != ptr or grad.dtype is not dtype or grad.is_sparse:
                return None
            grads.append(grad)
        if self._state_views is None and not self._gather_state():
            return None
        return grads

    def _gather_state(self) -> bool:
        """Puts Adam's state in flat buffers (fresh zeros, or the current per-parameter state copied in)
        and the per-parameter state entries as views of them; False (state untouched) where the step
        counters differ between parameters or a state is partial."""
        flat = self._flat
        params, values, slots = flat.params, flat.values, flat.slots
        states = [self.state[p] for p in params]
        fresh = [len(s) == 0 for s in states]
        if any(fresh) and not all(fresh):
            return False
        if not all(fresh):
            if any({"step", "exp_avg", "exp_avg_sq"} - s.keys() for s in states):
                return False
            steps = {float(s["step"]) for s in states}
            if len(steps) != 1:
                return False
        exp_avg, exp_avg_sq = torch.zeros_like(values), torch.zeros_like(values)
        steps = torch.zeros(len(params), dtype=torch.float32, device=values.device)
        with torch.no_grad():
            for i, (p, s, (start, n)) in enumerate(zip(params, states, slots)):
                m, v = exp_avg[start:start + n].view(p.shape), exp_avg_sq[start:start + n].view(p.shape)
                if s:
                    m.copy_(s["exp_avg"])
                    v.copy_(s["exp_avg_sq"])
                    steps[i] = float(s["step"])
                s["step"], s["exp_avg"], s["exp_avg_sq"] = steps[i], m, v
        self._state_views = (steps, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                             [steps[0]] * len(params))
        return True

    @torch.no_grad()
    def step(self, closure=None):
        grads = None if closure is not None else self._flat_grads()
        if grads is None:
            self._state_views = None  # torch's step may create per-parameter state: gathered again after
            return _adam_step(self, closure)
        group = self.param_groups[0]
        steps, exp_avg, exp_avg_sq, step = self._state_views
        steps.add_(1)
        beta1, beta2 = group["betas"]
        torch._fused_adam_(self._flat.params, grads, exp_avg, exp_avg_sq, [], step, amsgrad=False, lr=group["lr"],
                           beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                           maximize=False, grad_scale=None, found_inf=None)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad. set_to_none with one param group: one loop setting every .grad to None,
        without torch's profiler range unless a profiler is on (in isolation, the gradients already None:
        11.5 -> 2.7 us over 55 parameters)."""
        if not set_to_none or len(self.param_groups) != 1 or _profiler_enabled():
            return super().zero_grad(set_to_none)
        for p in self.param_groups[0]["params"]:
            p.grad = None
