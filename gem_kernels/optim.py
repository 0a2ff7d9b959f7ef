"""Fused optimizers of ``FusedEmbeddingBag``: configs only; the update runs inside the backward kernel.

Each config names an exact (deterministic) sparse update in FBGEMM's EXACT_* sense: the gradients of
duplicate rows in a batch are summed first, then every row the batch touched is updated once; rows
the batch did not touch are left alone (their state too). State is fp32 whatever the weight dtype.
Weight decay is L2 (added to the row's gradient), as in ``torch.optim``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    # `not value > 0` (not `value <= 0`) so that NaN fails too; inf is refused by name: either
    # would turn every row the backward touches into NaN or -inf.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value}")
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class ExactSGD:
    """``w -= lr * (g + weight_decay * w)`` on every touched row (torch.optim.SGD without momentum)."""

    lr: float = 0.01
    weight_decay: float = 0.0
    name = "sgd"

    def __post_init__(self):
        _check_positive("lr", self.lr)
        _check_positive("weight_decay", self.weight_decay, allow_zero=True)

    def hyperparams(self) -> tuple[float, float, float, float, float]:
        """(lr, eps, beta1, beta2, weight_decay), the flat scalars of the backward op."""
        return float(self.lr), 0.0, 0.0, 0.0, float(self.weight_decay)


@dataclass(frozen=True)
class ExactRowwiseAdagrad:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one fp32 state per row, the running sum of mean(g^2) over the row.

    ``m += mean(g^2); w -= lr * g / (sqrt(m) + eps)`` with ``g`` the row's summed gradient (+ L2 decay).
    """

    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    name = "rowwise_adagrad"

    def __post_init__(self):
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps, allow_zero=True)
        _check_positive("weight_decay", self.weight_decay, allow_zero=True)

    def hyperparams(self) -> tuple[float, float, float, float, float]:
        return float(self.lr), float(self.eps), 0.0, 0.0, float(self.weight_decay)


@dataclass(frozen=True)
class ExactAdam:
    """torch.optim.Adam's update (bias-corrected, L2 weight decay) applied to the touched rows only.

    Two fp32 states per weight element; ``step`` counts backward calls of the module.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    name = "adam"

    def __post_init__(self):
        _check_positive("lr", self.lr)
        _check_positive("eps", self.eps, allow_zero=True)
        _check_positive("weight_decay", self.weight_decay, allow_zero=True)
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        for i, beta in enumerate(betas):
            # `0 <= beta < 1` is False for NaN; bools are ints to Python but not betas.
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
                raise ValueError(f"betas[{i}] must be a float in [0, 1), got {beta!r} (betas={betas!r})")

    def hyperparams(self) -> tuple[float, float, float, float, float]:
        return float(self.lr), float(self.eps), float(self.betas[0]), float(self.betas[1]), float(self.weight_decay)


OPTIMIZERS = (ExactSGD, ExactRowwiseAdagrad, ExactAdam)
