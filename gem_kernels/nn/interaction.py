"""nn.Modules of the interaction family: DLRM DotInteraction, DCNv2 CrossNet, Wukong layers, and the
replacements ``gk.swap`` puts in for TorchRec's DLRM ``InteractionArch``, ``CrossNet`` and
``LowRankCrossNet`` (they hold the originals' parameters; TorchRec itself is not imported).

Every module takes ``backend`` ("reference" | "cpu" | "cuda" | "triton" | "auto", None for the
``use_backend`` default) and passes it to the fused ops; the rest of the layer is plain PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..ops.interaction import (WukongXGrad, cross_layer, dot_interaction, fm_compress, wukong_feature_mix_norm,
                                wukong_fm_compress, wukong_mix)
from ._fx import NotScriptable, is_proxy, trace_call
from .linear import MLP


class DotInteraction(nn.Module):
    """DLRM / TorchRec InteractionArch: [B, F, D] -> [B, P] pairwise dot products (upper triangle)."""

    def __init__(self, self_interaction: bool = False, backend: str | None = None):
        super().__init__()
        self.self_interaction = self_interaction
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dot_interaction(x, self.self_interaction, backend=self.backend)


class CrossNet(nn.Module):
    """DCNv2 cross network: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` for l < num_layers.

    TorchRec's ``CrossNet`` (full-rank W_l [N, N]) or, with ``low_rank=r``, ``LowRankCrossNet``
    (W_l = U_l V_l, U_l [N, r], V_l [r, N]). Weights xavier-normal, biases zero, as in TorchRec.
    Input and output [B, in_features].
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int | None = None,
                 backend: str | None = None, device=None, dtype=None):
        super().__init__()
        if in_features < 1 or num_layers < 1:
            raise ValueError(f"in_features and num_layers must be >= 1, got {in_features}, {num_layers}")
        if low_rank is not None and low_rank < 1:
            raise ValueError(f"low_rank must be None or >= 1, got {low_rank}")
        kw = dict(device=device, dtype=dtype)
        self.in_features, self.num_layers, self.low_rank, self.backend = in_features, num_layers, low_rank, backend
        if low_rank is None:
            self.weights = nn.ParameterList(nn.Parameter(torch.empty(in_features, in_features, **kw))
                                            for _ in range(num_layers))
        else:
            self.u = nn.ParameterList(nn.Parameter(torch.empty(in_features, low_rank, **kw)) for _ in range(num_layers))
            self.v = nn.ParameterList(nn.Parameter(torch.empty(low_rank, in_features, **kw)) for _ in range(num_layers))
        self.biases = nn.ParameterList(nn.Parameter(torch.empty(in_features, **kw)) for _ in range(num_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.xavier_normal_(p)
            else:
                nn.init.zeros_(p)

    def layer_weight(self, layer: int):
        """W_l as cross_layer takes it: a tensor, or the (u, v) pair in the low-rank case."""
        return self.weights[layer] if self.low_rank is None else (self.u[layer], self.v[layer])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xl = x
        for layer in range(self.num_layers):
            xl = cross_layer(x, xl, self.layer_weight(layer), self.biases[layer], backend=self.backend)
        return xl


class WukongLayer(nn.Module):
    """One Wukong interaction layer on X [B, num_in, dim] -> [B, num_fm_out + num_lcb_out, dim].

    ``FMB(X) = MLP(LayerNorm(flatten(X (X^T Y))))`` reshaped to [B, num_fm_out, dim], with Y
    [num_in, fm_rank] learned (the paper's optimised FM; the first two steps are the fused
    ``fm_compress``); ``LCB(X) = W X`` over the feature axis, W [num_lcb_out, num_in];
    ``out = LayerNorm_dim(concat(FMB(X), LCB(X)) + residual(X))`` where residual is X itself when
    num_fm_out + num_lcb_out == num_in, else a learned projection over the feature axis
    [num_out, num_in]. The final LayerNorm is over the embedding dim. ``mlp_hidden`` is the MLP's
    hidden widths (an int for one hidden layer), ReLU between layers.
    """

    def __init__(self, num_in: int, num_fm_out: int, num_lcb_out: int, dim: int, fm_rank: int,
                 mlp_hidden: int | Sequence[int], backend: str | None = None, device=None, dtype=None):
        super().__init__()
        if min(num_in, dim, fm_rank) < 1 or min(num_fm_out, num_lcb_out) < 0 or num_fm_out + num_lcb_out < 1:
            raise ValueError("num_in, dim, fm_rank must be >= 1 and num_fm_out + num_lcb_out >= 1, got "
                             f"{num_in}, {dim}, {fm_rank}, {num_fm_out}, {num_lcb_out}")
        kw = dict(device=device, dtype=dtype)
        hidden = [mlp_hidden] if isinstance(mlp_hidden, int) else list(mlp_hidden)
        self.num_in, self.num_fm_out, self.num_lcb_out, self.dim = num_in, num_fm_out, num_lcb_out, dim
        self.num_out = num_fm_out + num_lcb_out
        self._backend = backend
        self.fm_y = nn.Parameter(torch.empty(num_in, fm_rank, **kw))
        self.fm_norm = nn.LayerNorm(num_in * fm_rank, **kw)
        # Each Linear with the ReLU after it as one gem_kernels.linear op (MLP); backend "reference" runs
        # the plain nn.Sequential.
        self.fm_mlp = MLP([num_in * fm_rank, *hidden, num_fm_out * dim], backend=backend, **kw) if num_fm_out else None
        self.lcb_weight = nn.Parameter(torch.empty(num_lcb_out, num_in, **kw))
        self.residual_weight = (nn.Parameter(torch.empty(self.num_out, num_in, **kw))
                                if self.num_out != num_in else None)
        self.norm = nn.LayerNorm(dim, **kw)
        self.reset_parameters()

    @property
    def backend(self) -> str | None:
        return self._backend

    @backend.setter
    def backend(self, name: str | None) -> None:
        self._backend = name
        if self.fm_mlp is not None:
            self.fm_mlp.backend = name

    def reset_parameters(self) -> None:
        std = 1.0 / math.sqrt(self.num_in)
        for p in (self.fm_y, self.lcb_weight, self.residual_weight):
            if p is not None:
                nn.init.normal_(p, std=std)

    def fm_block(self, x: torch.Tensor, x_grad: WukongXGrad | None = None) -> torch.Tensor:
        if x_grad is None:
            compressed = fm_compress(x, self.fm_y, self.fm_norm.weight, self.fm_norm.bias, self.fm_norm.eps,
                                     backend=self.backend)
        else:
            compressed = wukong_fm_compress(x, self.fm_y, self.fm_norm.weight, self.fm_norm.bias, self.fm_norm.eps,
                                            x_grad, backend=self.backend)
        return self.fm_mlp(compressed).view(x.shape[0], self.num_fm_out, self.dim)

    def feature_mix(self) -> torch.Tensor:
        """M [num_out, num_in] with ``concat(0, LCB(X)) + residual(X) = M X``: the residual
        projection (the identity when num_out == num_in) with lcb_weight added to its last
        num_lcb_out rows, so the LCB and the residual are one matmul over the feature axis
        (gem_kernels.ops.interaction.wukong_mix)."""
        return wukong_mix(self.residual_weight, self.lcb_weight, self.num_in, self.num_fm_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LCB + residual as one matrix over the feature axis, the FMB rows added in place of the
        # eager concat, and the LayerNorm: one fused op (feature_mix_norm), where eager runs a
        # transposing matmul, a concat, an add and a LayerNorm, each a pass over [B, num_out, dim];
        # with M built inside its autograd node on the eager fast path (wukong_feature_mix_norm).
        # x's two gradients (the FMB's and the mix's) are written once: WukongXGrad.
        x_grad = WukongXGrad() if self.num_fm_out else None
        fm = self.fm_block(x, x_grad) if self.num_fm_out else None
        return wukong_feature_mix_norm(x, self.residual_weight, self.lcb_weight, fm, self.norm.weight,
                                       self.norm.bias, self.norm.eps, backend=self.backend, x_grad=x_grad)


class WukongStack(nn.Module):
    """num_layers WukongLayers: the first maps num_in features to num_fm_out + num_lcb_out, the
    rest keep that count (their residual is the identity)."""

    def __init__(self, num_layers: int, num_in: int, num_fm_out: int, num_lcb_out: int, dim: int, fm_rank: int,
                 mlp_hidden: int | Sequence[int], backend: str | None = None, device=None, dtype=None):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        num_out = num_fm_out + num_lcb_out
        self.layers = nn.ModuleList(
            WukongLayer(num_in if i == 0 else num_out, num_fm_out, num_lcb_out, dim, fm_rank, mlp_hidden,
                        backend=backend, device=device, dtype=dtype)
            for i in range(num_layers))

    @property
    def backend(self) -> str | None:
        return self.layers[0].backend

    @backend.setter
    def backend(self, name: str | None) -> None:
        for layer in self.layers:
            layer.backend = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class FusedInteractionArch(NotScriptable, nn.Module):
    """TorchRec DLRM ``InteractionArch`` on the fused dot interaction: the same output
    ``cat(dense, <x_i, x_j> for i < j over [dense, sparse_1..F])`` in ``triu_indices(F+1, F+1, 1)`` order."""

    def __init__(self, num_sparse_features: int, backend: str | None = None):
        super().__init__()
        self.F = num_sparse_features
        self.backend = backend

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if is_proxy(dense_features, sparse_features):
            return trace_call(self, dense_features, sparse_features)
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return torch.cat((dense_features, dot_interaction(combined, False, backend=self.backend)), dim=1)


class FusedCrossNet(NotScriptable, nn.Module):
    """TorchRec ``CrossNet`` (full rank: ``kernels`` [N, N], ``bias`` [N, 1]) on fused cross layers;
    holds the original's ParameterLists (same state_dict keys, same Parameters)."""

    def __init__(self, kernels: nn.ParameterList, bias: nn.ParameterList, backend: str | None = None):
        super().__init__()
        self._num_layers = len(kernels)
        self.kernels, self.bias, self.backend = kernels, bias, backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if is_proxy(input):
            return trace_call(self, input)
        x_l = input
        for layer in range(self._num_layers):
            x_l = cross_layer(input, x_l, self.kernels[layer], self.bias[layer].view(-1), backend=self.backend)
        return x_l


class FusedLowRankCrossNet(NotScriptable, nn.Module):
    """TorchRec ``LowRankCrossNet`` (``W_kernels`` [N, r], ``V_kernels`` [r, N], ``bias`` [N]) on fused
    cross layers: ``x_{l+1} = x_0 * (W (V x_l) + b) + x_l``."""

    def __init__(self, W_kernels: nn.ParameterList, V_kernels: nn.ParameterList, bias: nn.ParameterList,
                 backend: str | None = None):
        super().__init__()
        self._num_layers = len(W_kernels)
        self._low_rank = W_kernels[0].shape[1] if len(W_kernels) else 0
        self.W_kernels, self.V_kernels, self.bias, self.backend = W_kernels, V_kernels, bias, backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if is_proxy(input):
            return trace_call(self, input)
        x_l = input
        for layer in range(self._num_layers):
            x_l = cross_layer(input, x_l, (self.W_kernels[layer], self.V_kernels[layer]), self.bias[layer],
                              backend=self.backend)
        return x_l
