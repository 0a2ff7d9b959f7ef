"""Reference multi-table embedding bags (TBE): per-table ``F.embedding_bag``, and the fused optimizers' math.

Packed layout (FBGEMM's TBE layout): the T tables live back to back in one flat ``weights`` buffer;
table t is ``weights[weights_offsets[t] : weights_offsets[t] + rows_t * D_t].view(rows_t, D_t)`` with
``rows_t = rows_offsets[t+1] - rows_offsets[t]`` and ``D_t = D_offsets[t+1] - D_offsets[t]``.
Bag b of table t is ``indices[offsets[t*B+b] : offsets[t*B+b+1]]`` (feature-major, TorchRec's KJT).

Pooled output (sum/mean): ``out[b, D_offsets[t]:D_offsets[t+1]] = sum_i w_i * W_t[indices[i]]`` over
the kept indices of the bag (mean: divided by their count, also with per-sample weights, as FBGEMM's
TBE; an empty bag gives zeros). Unpooled
output ("none", one shared D): ``out[i] = w_i * W_t[indices[i]]``, zero for a dropped index.

Optimizer state is fp32 whatever the weight dtype: row-wise Adagrad keeps one value per row
(``momentum1[rows_offsets[t] + r]``), Adam two values per weight element (same flat layout as
``weights``) and ``step`` counts the optimizer steps. Everything here computes in fp32 and casts back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The option codes and the bounds check (kept_mask) every backend shares.
from .._embedding_bag import (  # noqa: F401  (the codes are re-exported for the tests)
    BOUNDS_CHECK_CODES,
    FATAL,
    MEAN,
    NONE,
    OPT_ADAM,
    OPT_NONE,
    OPT_ROWWISE_ADAGRAD,
    OPT_SGD,
    OPTIMIZER_CODES,
    POOLING_CODES,
    SKIP,
    SUM,
    WARN,
    kept_mask,
)


def table_views(weights: torch.Tensor, weights_offsets: torch.Tensor, D_offsets: torch.Tensor,
                rows_offsets: torch.Tensor) -> list[torch.Tensor]:
    """The [rows_t, D_t] view of every table inside the flat buffer."""
    w_off, d_off, r_off = weights_offsets.tolist(), D_offsets.tolist(), rows_offsets.tolist()
    views = []
    for t in range(len(w_off)):
        rows, dim = r_off[t + 1] - r_off[t], d_off[t + 1] - d_off[t]
        views.append(weights[w_off[t]:w_off[t] + rows * dim].view(rows, dim))
    return views


def _table_batch(t: int, batch: int, offsets: torch.Tensor, indices: torch.Tensor, kept: torch.Tensor,
                 bag_ids: torch.Tensor, per_sample_weights: torch.Tensor):
    """Table t's index range, kept mask, kept indices, their local bag ids, weights, kept count per bag."""
    lo, hi = int(offsets[t * batch]), int(offsets[(t + 1) * batch])
    keep = kept[lo:hi]
    idx = indices[lo:hi].long()[keep]
    bags = bag_ids[lo:hi][keep] - t * batch
    psw = per_sample_weights[lo:hi].float()[keep] if per_sample_weights.numel() else None
    counts = torch.bincount(bags, minlength=batch)
    return lo, hi, keep, idx, bags, psw, counts


def embedding_bag_forward(weights, weights_offsets, D_offsets, rows_offsets, indices, offsets, per_sample_weights,
                          output_dim: int, pooling: int, bounds_check: int) -> torch.Tensor:
    tables = table_views(weights, weights_offsets, D_offsets, rows_offsets)
    num_tables = len(tables)
    batch = (offsets.numel() - 1) // max(num_tables, 1)
    kept, bag_ids = kept_mask(rows_offsets, indices, offsets, bounds_check)
    d_off = D_offsets.tolist()
    if pooling == NONE:
        out = torch.zeros(indices.numel(), output_dim, dtype=torch.float32, device=weights.device)
    else:
        out = torch.zeros(batch, output_dim, dtype=torch.float32, device=weights.device)
    for t, table in enumerate(tables):
        lo, hi, keep, idx, bags, psw, counts = _table_batch(t, batch, offsets, indices, kept, bag_ids,
                                                            per_sample_weights)
        if pooling == NONE:
            rows = F.embedding(idx, table.float())
            out[lo:hi][keep] = rows if psw is None else rows * psw[:, None]
            continue
        bag_offsets = torch.zeros(batch + 1, dtype=torch.int64, device=weights.device)
        bag_offsets[1:] = counts.cumsum(0)
        # Mean = the (weighted) sum / the kept length, as FBGEMM's TBE; F.embedding_bag's own mean
        # refuses per_sample_weights, so the division is done here.
        pooled = F.embedding_bag(idx, table.float(), bag_offsets, mode="sum", per_sample_weights=psw,
                                 include_last_offset=True)
        if pooling == MEAN:
            pooled = pooled / counts.clamp(min=1)[:, None].float()
        out[:, d_off[t]:d_off[t + 1]] = pooled
    return out.to(weights.dtype)


def _table_grads(grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, offsets,
                 per_sample_weights, pooling):
    """Per table: (the unique rows the batch touched, their fp32 gradient [n_unique, D_t]).

    Duplicates are summed first (index_add on the unique rows), so each row gets one gradient.
    Out-of-range indices are dropped (the forward already raised or warned).
    """
    tables = table_views(weights, weights_offsets, D_offsets, rows_offsets)
    batch = (offsets.numel() - 1) // max(len(tables), 1)
    kept, bag_ids = kept_mask(rows_offsets, indices, offsets, SKIP)
    d_off = D_offsets.tolist()
    grad_output = grad_output.float()
    result = []
    for t, table in enumerate(tables):
        lo, hi, keep, idx, bags, psw, counts = _table_batch(t, batch, offsets, indices, kept, bag_ids,
                                                            per_sample_weights)
        if pooling == NONE:
            src = grad_output[lo:hi][keep]
        else:
            src = grad_output[bags, d_off[t]:d_off[t + 1]]
            if pooling == MEAN:
                src = src / counts[bags].clamp(min=1)[:, None].float()
        if psw is not None:
            src = src * psw[:, None]
        unique_rows, inverse = torch.unique(idx, return_inverse=True)
        grad = torch.zeros(unique_rows.numel(), table.shape[1], dtype=torch.float32, device=weights.device)
        grad.index_add_(0, inverse, src)
        result.append((unique_rows, grad))
    return tables, result


def embedding_bag_backward(grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, offsets,
                           per_sample_weights, pooling: int) -> torch.Tensor:
    """Dense gradient of the flat weights buffer, weights' dtype."""
    grad_weights = torch.zeros(weights.numel(), dtype=torch.float32, device=weights.device)
    grad_tables = table_views(grad_weights, weights_offsets, D_offsets, rows_offsets)
    _, grads = _table_grads(grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, offsets,
                            per_sample_weights, pooling)
    for grad_table, (rows, grad) in zip(grad_tables, grads):
        grad_table[rows] = grad
    return grad_weights.to(weights.dtype)


def embedding_bag_per_sample_weights_backward(grad_output, weights, weights_offsets, D_offsets, rows_offsets,
                                              indices, offsets, pooling: int) -> torch.Tensor:
    """Gradient of the output w.r.t. per_sample_weights: fp32 [N].

    ``grad[i] = <grad_output[b, D_offsets[t]:D_offsets[t+1]], W_t[indices[i]]>`` for index i of bag b of
    table t (sum pooling; mean pooling divides it by the bag's kept length),
    ``<grad_output[i], W_t[indices[i]]>`` (pooling "none"); 0 for a dropped index.
    """
    tables = table_views(weights, weights_offsets, D_offsets, rows_offsets)
    batch = (offsets.numel() - 1) // max(len(tables), 1)
    kept, bag_ids = kept_mask(rows_offsets, indices, offsets, SKIP)
    d_off = D_offsets.tolist()
    grad_output = grad_output.float()
    grad = torch.zeros(indices.numel(), dtype=torch.float32, device=weights.device)
    for t, table in enumerate(tables):
        lo, hi, keep, idx, bags, _, counts = _table_batch(t, batch, offsets, indices, kept, bag_ids,
                                                          grad.new_empty(0))
        src = grad_output[lo:hi][keep] if pooling == NONE else grad_output[bags, d_off[t]:d_off[t + 1]]
        if pooling == MEAN:
            src = src / counts[bags].clamp(min=1)[:, None].float()
        grad[lo:hi][keep] = (F.embedding(idx, table.float()) * src).sum(dim=1)
    return grad


def apply_optimizer(optimizer: int, w: torch.Tensor, g: torch.Tensor, m1: torch.Tensor | None,
                    m2: torch.Tensor | None, step: int, lr: float, eps: float, beta1: float, beta2: float,
                    weight_decay: float):
    """One exact (dense-row) optimizer step on the touched rows, all fp32: returns (w, m1, m2).

    w, g: [n, D]; m1: [n] (row-wise Adagrad) or [n, D] (Adam); m2: [n, D] (Adam). Weight decay is
    L2 (added to the gradient), as in torch.optim. Row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD):
    m1 += mean(g^2 over the row); w -= lr * g / (sqrt(m1) + eps). Adam: torch.optim.Adam's update
    with bias corrections at `step`, applied to the touched rows only (FBGEMM's EXACT_ADAM).
    """
    if weight_decay != 0.0:
        g = g + weight_decay * w
    if optimizer == OPT_SGD:
        return w - lr * g, m1, m2
    if optimizer == OPT_ROWWISE_ADAGRAD:
        m1 = m1 + (g * g).mean(dim=1)
        return w - lr * g / (m1.sqrt() + eps)[:, None], m1, m2
    if optimizer == OPT_ADAM:
        m1 = beta1 * m1 + (1 - beta1) * g
        m2 = beta2 * m2 + (1 - beta2) * g * g
        bias1 = 1 - beta1 ** step
        bias2 = 1 - beta2 ** step
        denom = (m2 / bias2).sqrt() + eps
        return w - (lr / bias1) * m1 / denom, m1, m2
    raise ValueError(f"unknown optimizer code {optimizer}")


def embedding_bag_backward_fused(grad_output, weights, momentum1, momentum2, step, weights_offsets, D_offsets,
                                 rows_offsets, indices, offsets, per_sample_weights, pooling: int, optimizer: int,
                                 lr: float, eps: float, beta1: float, beta2: float, weight_decay: float) -> None:
    """Applies one optimizer step in place to the rows the batch touched (and to their state)."""
    step += 1
    step_value = int(step)
    tables, grads = _table_grads(grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices,
                                 offsets, per_sample_weights, pooling)
    r_off = rows_offsets.tolist()
    if optimizer == OPT_ADAM:
        m1_tables = table_views(momentum1, weights_offsets, D_offsets, rows_offsets)
        m2_tables = table_views(momentum2, weights_offsets, D_offsets, rows_offsets)
    for t, (table, (rows, grad)) in enumerate(zip(tables, grads)):
        m1 = m2 = None
        if optimizer == OPT_ROWWISE_ADAGRAD:
            m1 = momentum1[r_off[t]:r_off[t + 1]][rows]
        elif optimizer == OPT_ADAM:
            m1, m2 = m1_tables[t][rows], m2_tables[t][rows]
        w, m1, m2 = apply_optimizer(optimizer, table[rows].float(), grad, m1, m2, step_value, lr, eps, beta1, beta2,
                                    weight_decay)
        table[rows] = w.to(table.dtype)
        if optimizer == OPT_ROWWISE_ADAGRAD:
            momentum1[r_off[t]:r_off[t + 1]][rows] = m1
        elif optimizer == OPT_ADAM:
            m1_tables[t][rows] = m1
            m2_tables[t][rows] = m2
