"""FlatAdam: torch.optim.Adam(fused=True) whose step is one fused call over one flat buffer.

The model's dense parameters are ~55 small tensors. torch's fused Adam steps them as a list: the
step counters by ``_foreach_add_`` (on the CPU a slow path, one add and one scalar copy per tensor),
then ``_fused_adam_``, one parallel region per tensor, beside the Python of ``_init_group`` per
parameter. Measured at the small config (2-core Xeon, 2 threads, SCHED_FIFO, 2026-12-07): 0.37 ms
per step over the 55 tensors, 0.11 ms for one tensor of the same 204K elements.

Here the parameters are views of one flat buffer (each slot starting at a multiple of 16 elements:
the 64-byte alignment the kernels' aligned loads rely on, as ATen's allocator gives), and so are
Adam's exp_avg / exp_avg_sq (flat buffers) and step counters (one [num_params] buffer). A step
gathers the gradients into one flat gradient (one cat; the gaps between slots are zeros, and stay
zero in every buffer), adds 1 to the step counters (one add) and runs ``_fused_adam_`` once.
Per element that is torch's update exactly; the state_dict is torch.optim.Adam's (same keys, one
state per parameter: model.train's checkpoints load either way).

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
# Parameters of at least this many elements keep their own gradient (no copy into the flat one) and
# are one more tensor of the fused call; the rest share one. At the small config: 9 of 55 tensors,
# 93 % of the elements (copying those gradients cost more than the per-tensor calls it saved).
_OWN_TENSOR = 4096


class _Flat(NamedTuple):
    params: list
    values: torch.Tensor          # every parameter's slot
    small_grad: torch.Tensor      # the small parameters' gradients, gathered
    small_total: int              # the small slots are values[:small_total]
    small: list[int]              # indices (into params) of the small parameters, in slot order
    large: list[int]
    pieces: list                  # the cat's pieces (None: the next small gradient)
    slots: list[tuple[int, int]]  # (start, numel) per parameter
    data_ptrs: list[int]          # where each parameter must still point


def _adam_step(optimizer: torch.optim.Adam, closure):
    """torch.optim.Adam.step without the step hooks, which FlatAdam.step's own wrapper has run already
    (Optimizer wraps each class's step once, the first time one of its instances is built)."""
    step = torch.optim.Adam.step
    return (step.__wrapped__ if getattr(step, "hooked", False) else step)(optimizer, closure)


class FlatAdam(torch.optim.Adam):
    """torch.optim.Adam(params, lr, betas, eps, weight_decay, fused=True), stepping every parameter in
    one fused call over flat buffers (module docstring). The parameters become views of one buffer
    at construction (values unchanged)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self._flat: _Flat | None = None
        self._state_views = None  # the fused call's state lists, once the state is in the flat buffers
        params = self.param_groups[0]["params"] if len(self.param_groups) == 1 else []
        if not params or len({(p.device, p.dtype) for p in params}) != 1 or not params[0].dtype.is_floating_point:
            return
        # Small parameters first, each in its slot of the flat buffer; the large ones after them, in
        # slots too (their state and values in the same buffers) but stepped on their own gradients.
        order = sorted(range(len(params)), key=lambda i: params[i].numel() >= _OWN_TENSOR)
        slots, total, small_total = [None] * len(params), 0, 0
        for i in order:
            slots[i] = (total, params[i].numel())
            total += -(-params[i].numel() // _ALIGN) * _ALIGN
            if params[i].numel() < _OWN_TENSOR:
                small_total = total
        flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, (start, n) in zip(params, slots):
                view = flat[start:start + n].view(p.shape)
                view.copy_(p)
                p.data = view
        small = [i for i in order if params[i].numel() < _OWN_TENSOR]
        large = [i for i in order if params[i].numel() >= _OWN_TENSOR]
        # The cat's pieces over the small slots: None where a gradient goes, zeros for the gaps.
        pieces: list[torch.Tensor | None] = []
        for j, i in enumerate(small):
            start, n = slots[i]
            end = slots[small[j + 1]][0] if j + 1 < len(small) else small_total
            pieces.append(None)
            if end > start + n:
                pieces.append(flat.new_zeros(end - start - n))
        self._flat = _Flat(params, flat, flat.new_zeros(small_total), small_total, small, large, pieces, slots,
                           [p.data_ptr() for p in params])

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._state_views = None  # the loaded tensors replace the views: gathered again at the next step

    def _flat_ready(self) -> bool:
        """Whether this step may take the flat path (module docstring), the state then in the flat buffers."""
        if self._flat is None or len(self.param_groups) != 1:
            return False
        group = self.param_groups[0]
        if (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]
                or group.get("decoupled_weight_decay", False) or not group["fused"] or torch.is_tensor(group["lr"])):
            return False
        flat = self._flat
        params, dtype, device = flat.params, flat.values.dtype, flat.values.device
        current = group["params"]
        if current is not params and (len(current) != len(params) or any(a is not b for a, b in zip(current, params))):
            return False
        for p, ptr in zip(params, flat.data_ptrs):
            grad = p.grad
            if p.data_ptr() != ptr or grad is None or grad.is_sparse or grad.dtype != dtype or grad.device != device:
                return False
        if self._state_views is None:
            return self._gather_state()
        return True

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
        small, large = slice(0, flat.small_total), [slots[i] for i in flat.large]
        self._state_views = (steps,
                             [values[small]] + [values[a:a + n] for a, n in large],
                             [exp_avg[small]] + [exp_avg[a:a + n] for a, n in large],
                             [exp_avg_sq[small]] + [exp_avg_sq[a:a + n] for a, n in large],
                             [steps[0]] * (1 + len(large)))
        return True

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not self._flat_ready():
            self._state_views = None  # torch's step may create per-parameter state: gathered again after
            return _adam_step(self, closure)
        group = self.param_groups[0]
        flat = self._flat
        params = flat.params
        grads = iter([params[i].grad.reshape(-1) for i in flat.small])
        torch.cat([next(grads) if piece is None else piece for piece in flat.pieces], out=flat.small_grad)
        steps, values, exp_avg, exp_avg_sq, step = self._state_views
        steps.add_(1)
        beta1, beta2 = group["betas"]
        torch._fused_adam_(values, [flat.small_grad] + [params[i].grad.reshape(-1) for i in flat.large], exp_avg,
                           exp_avg_sq, [], step, amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                           weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, grad_scale=None,
                           found_inf=None)
        return None
