"""Triton kernels of the embedding_bag family: fused multi-table embedding bags (TBE) and their
backward with the optimizer fused.

Forward work decomposition: one program per (table, bag); it walks the bag's indices BLOCK_P at a
time, gathering a [BLOCK_P, BLOCK_D] tile of rows (BLOCK_P rows' loads in flight, where one index
per step left one row in flight behind a dependent index load) and accumulating their fp32 sum over
one BLOCK_D tile covering the table's D (so every output slice is written by one program). pooling
"none" writes each looked-up row instead of accumulating.

Backward work decomposition: the host sorts the kept lookups by global row (rows_offsets[t] + row,
a stable sort, so duplicates keep position order: deterministic sums) and cuts the runs of equal
rows (segments); one program per unique row sums its gradient rows in fp32 and writes the row
once: the dense gradient, or the optimizer step on the weight row and its state. No atomics.

Bounds checks run on the host before the launch (gem_kernels._embedding_bag.kept_mask);
the kernels drop out-of-range indices.

Roofline: forward FLOPs 2 * N * D, bytes N * D * s + B * sum D * s + indices; backward with
row-wise Adagrad: grad_output B * sum D * s read, U unique rows read and written, U fp32 states.
"""

import torch
import triton
import triton.language as tl

from .._embedding_bag import MEAN, NONE, OPT_ADAM, OPT_NONE, OPT_ROWWISE_ADAGRAD, OPT_SGD, kept_mask, segments

# The option codes as constants the kernels can name (gem_kernels/_embedding_bag.py).
POOL_MEAN: tl.constexpr = tl.constexpr(MEAN)
POOL_NONE: tl.constexpr = tl.constexpr(NONE)
OPTIM_NONE: tl.constexpr = tl.constexpr(OPT_NONE)
OPTIM_SGD: tl.constexpr = tl.constexpr(OPT_SGD)
OPTIM_ROWWISE_ADAGRAD: tl.constexpr = tl.constexpr(OPT_ROWWISE_ADAGRAD)


@triton.jit
def _program_bag(B, w_off_ptr, d_off_ptr, r_off_ptr, offsets_ptr):
    """The (table t, bag b) this program owns: (b, t's element offset, column offset, D, rows, and the
    bag's index range [start, stop))."""
    tb = tl.program_id(0).to(tl.int64)
    t = tb // B
    d_begin = tl.load(d_off_ptr + t)
    return (tb - t * B, tl.load(w_off_ptr + t), d_begin, tl.load(d_off_ptr + t + 1) - d_begin,
            tl.load(r_off_ptr + t + 1) - tl.load(r_off_ptr + t), tl.load(offsets_ptr + tb).to(tl.int64),
            tl.load(offsets_ptr + tb + 1).to(tl.int64))


@triton.jit
def _embedding_bag_fwd_kernel(
    weights_ptr, w_off_ptr, d_off_ptr, r_off_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr,
    B, output_dim,
    POOLING: tl.constexpr, HAS_PSW: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # indices gathered per step of the pooled forward (_block_p)
):
    b, w_off, d_begin, D, rows, start, stop = _program_bag(B, w_off_ptr, d_off_ptr, r_off_ptr, offsets_ptr)
    d = tl.arange(0, BLOCK_D)
    col = d < D
    if POOLING == POOL_NONE:
        for p in range(start, stop):
            idx = tl.load(indices_ptr + p).to(tl.int64)
            valid = (idx >= 0) & (idx < rows)
            row = tl.load(weights_ptr + w_off + idx * D + d, mask=col & valid, other=0.0).to(tl.float32)
            if HAS_PSW:
                row = row * tl.load(psw_ptr + p)
            tl.store(out_ptr + p * output_dim + d, row.to(out_ptr.dtype.element_ty), mask=d < output_dim)
    else:
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        kept = 0.0
        for p0 in range(start, stop, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            in_bag = p < stop
            idx = tl.load(indices_ptr + p, mask=in_bag, other=-1).to(tl.int64)
            valid = in_bag & (idx >= 0) & (idx < rows)
            tile = tl.load(weights_ptr + w_off + idx[:, None] * D + d[None, :], mask=valid[:, None] & col[None, :],
                           other=0.0).to(tl.float32)
            if HAS_PSW:
                tile = tile * tl.load(psw_ptr + p, mask=valid, other=0.0)[:, None]
            acc += tl.sum(tile, axis=0)
            kept += tl.sum(tl.where(valid, 1.0, 0.0), axis=0)
        if POOLING == POOL_MEAN:
            acc = acc / tl.maximum(kept, 1.0)
        tl.store(out_ptr + b * output_dim + d_begin + d, acc.to(out_ptr.dtype.element_ty), mask=col)


@triton.jit
def _embedding_bag_bwd_kernel(
    grad_ptr, weights_ptr, m1_ptr, m2_ptr, w_off_ptr, d_off_ptr, r_off_ptr,
    seg_ptr, order_ptr, seg_table_ptr, seg_row_ptr, src_row_ptr, scale_ptr,
    grad_stride, lr, eps, beta1, beta2, weight_decay, step_size, inv_bias2_sqrt,
    POOLING: tl.constexpr, OPTIMIZER: tl.constexpr, BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    t = tl.load(seg_table_ptr + u)
    global_row = tl.load(seg_row_ptr + u)
    d_begin = tl.load(d_off_ptr + t)
    D = tl.load(d_off_ptr + t + 1) - d_begin
    local_row = global_row - tl.load(r_off_ptr + t)
    element = tl.load(w_off_ptr + t) + local_row * D
    d = tl.arange(0, BLOCK_D)
    col = d < D
    first = tl.load(seg_ptr + u)
    last = tl.load(seg_ptr + u + 1)
    g = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if POOLING == POOL_NONE:  # grad_output [N, D]: the index's own row
        grad_cols = grad_ptr + d
    else:  # grad_output [B, sum D]: the bag's row, table t's columns
        grad_cols = grad_ptr + d_begin + d
    for i in range(first, last):
        p = tl.load(order_ptr + i)
        src = tl.load(src_row_ptr + p)
        g += tl.load(grad_cols + src * grad_stride, mask=col, other=0.0).to(tl.float32) * tl.load(scale_ptr + p)
    if OPTIMIZER == OPTIM_NONE:
        tl.store(weights_ptr + element + d, g.to(weights_ptr.dtype.element_ty), mask=col)
    else:
        w = tl.load(weights_ptr + element + d, mask=col, other=0.0).to(tl.float32)
        g = g + weight_decay * w
        if OPTIMIZER == OPTIM_SGD:
            w = w - lr * g
        elif OPTIMIZER == OPTIM_ROWWISE_ADAGRAD:
            state = tl.load(m1_ptr + global_row) + tl.sum(g * g, axis=0) / D.to(tl.float32)
            tl.store(m1_ptr + global_row, state)
            w = w - (lr / (tl.sqrt(state) + eps)) * g
        else:
            m1 = beta1 * tl.load(m1_ptr + element + d, mask=col, other=0.0) + (1.0 - beta1) * g
            m2 = beta2 * tl.load(m2_ptr + element + d, mask=col, other=0.0) + (1.0 - beta2) * g * g
            tl.store(m1_ptr + element + d, m1, mask=col)
            tl.store(m2_ptr + element + d, m2, mask=col)
            w = w - step_size * m1 / (tl.sqrt(m2) * inv_bias2_sqrt + eps)
        tl.store(weights_ptr + element + d, w.to(weights_ptr.dtype.element_ty), mask=col)


@triton.jit
def _embedding_bag_psw_bwd_kernel(
    grad_ptr, weights_ptr, w_off_ptr, d_off_ptr, r_off_ptr, indices_ptr, offsets_ptr, out_ptr,
    B, grad_stride,
    POOLING: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Gradient of per_sample_weights: one program per (table, bag), as the forward; for each index
    the dot of its weight row with the bag's gradient row (pooling "none": the index's own row; mean:
    the bag's gradient row divided by its kept length)."""
    b, w_off, d_begin, D, rows, start, stop = _program_bag(B, w_off_ptr, d_off_ptr, r_off_ptr, offsets_ptr)
    d = tl.arange(0, BLOCK_D)
    col = d < D
    if POOLING != POOL_NONE:
        g = tl.load(grad_ptr + b * grad_stride + d_begin + d, mask=col, other=0.0).to(tl.float32)
    if POOLING == POOL_MEAN:  # mean: the bag's weighted sum is divided by its kept length, so is each gradient
        kept = 0.0
        for p in range(start, stop):
            idx = tl.load(indices_ptr + p).to(tl.int64)
            kept += tl.where((idx >= 0) & (idx < rows), 1.0, 0.0)
        g = g / tl.maximum(kept, 1.0)
    for p in range(start, stop):
        idx = tl.load(indices_ptr + p).to(tl.int64)
        valid = (idx >= 0) & (idx < rows)
        row = tl.load(weights_ptr + w_off + idx * D + d, mask=col & valid, other=0.0).to(tl.float32)
        if POOLING == POOL_NONE:
            g = tl.load(grad_ptr + p * grad_stride + d, mask=col, other=0.0).to(tl.float32)
        tl.store(out_ptr + p, tl.sum(row * g, axis=0))


def _block_d(D_offsets: torch.Tensor) -> int:
    return triton.next_power_of_2(max(int(D_offsets.diff().max()), 1))


# The pooled forward's [BLOCK_P, BLOCK_D] gather tile: at most this many fp32 values, so 8 rows in
# flight at D <= 128, fewer for wider tables. ptxas (sm_90a, triton 3.8): 40-46 registers, no spill;
# 2048 (16 rows) took 48-69 registers and spilled 4 B with per-sample weights. One row per step (the
# kernel before) took 38. Not yet measured on a GPU.
FWD_TILE_ELEMS = 1024


def _block_p(block_d: int) -> int:
    return max(1, min(16, FWD_TILE_ELEMS // block_d))


def embedding_bag_forward(weights, weights_offsets, D_offsets, rows_offsets, indices, offsets, per_sample_weights,
                          output_dim: int, pooling: int, bounds_check: int) -> torch.Tensor:
    kept_mask(rows_offsets, indices, offsets, bounds_check)  # raises or warns; the kernel drops the bad ones
    num_tables = weights_offsets.numel()
    batch = (offsets.numel() - 1) // num_tables
    rows_out = indices.numel() if pooling == NONE else batch
    out = weights.new_empty((rows_out, output_dim))
    if num_tables * batch == 0 or out.numel() == 0:
        return out.zero_()
    if pooling == NONE:
        out.zero_()  # rows of dropped indices
    has_psw = per_sample_weights.numel() > 0
    block_d = _block_d(D_offsets)
    _embedding_bag_fwd_kernel[(num_tables * batch,)](
        weights, weights_offsets, D_offsets, rows_offsets, indices, offsets,
        per_sample_weights if has_psw else weights, out, batch, output_dim,
        POOLING=pooling, HAS_PSW=has_psw, BLOCK_D=block_d, BLOCK_P=_block_p(block_d))
    return out


def _launch_backward(grad_output, weights, momentum1, momentum2, weights_offsets, D_offsets, rows_offsets, indices,
                     offsets, per_sample_weights, pooling, optimizer, hyper=(0.0,) * 7):
    seg, order, seg_tables, unique_rows, src_rows, scale = segments(rows_offsets, indices, offsets,
                                                                     per_sample_weights, pooling,
                                                                     weights_offsets.numel())
    if unique_rows.numel() == 0:
        return
    _embedding_bag_bwd_kernel[(unique_rows.numel(),)](
        grad_output, weights, momentum1 if momentum1.numel() else weights, momentum2 if momentum2.numel() else weights,
        weights_offsets, D_offsets, rows_offsets, seg, order, seg_tables, unique_rows, src_rows, scale,
        grad_output.shape[1], *hyper, POOLING=pooling, OPTIMIZER=optimizer, BLOCK_D=_block_d(D_offsets))


def embedding_bag_backward(grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, offsets,
                           per_sample_weights, pooling: int) -> torch.Tensor:
    grad_weights = torch.zeros_like(weights)
    _launch_backward(grad_output, grad_weights, grad_output.new_empty(0), grad_output.new_empty(0), weights_offsets,
                     D_offsets, rows_offsets, indices, offsets, per_sample_weights, pooling, OPT_NONE)
    return grad_weights


def embedding_bag_backward_fused(grad_output, weights, momentum1, momentum2, step, weights_offsets, D_offsets,
                                 rows_offsets, indices, offsets, per_sample_weights, pooling: int, optimizer: int,
                                 lr: float, eps: float, beta1: float, beta2: float, weight_decay: float) -> None:
    assert optimizer in (OPT_SGD, OPT_ROWWISE_ADAGRAD, OPT_ADAM)
    step += 1
    step_value = int(step)
    step_size = lr / (1 - beta1 ** step_value) if optimizer == OPT_ADAM else 0.0
    inv_bias2_sqrt = (1 - beta2 ** step_value) ** -0.5 if optimizer == OPT_ADAM else 0.0
    _launch_backward(grad_output, weights, momentum1, momentum2, weights_offsets, D_offsets, rows_offsets, indices,
                     offsets, per_sample_weights, pooling, optimizer,
                     (lr, eps, beta1, beta2, weight_decay, step_size, inv_bias2_sqrt))


def embedding_bag_per_sample_weights_backward(grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices,
                                              offsets, pooling: int) -> torch.Tensor:
    num_tables = weights_offsets.numel()
    batch = (offsets.numel() - 1) // num_tables
    grad_psw = torch.zeros(indices.numel(), dtype=torch.float32, device=weights.device)
    if num_tables * batch == 0 or indices.numel() == 0:
        return grad_psw
    _embedding_bag_psw_bwd_kernel[(num_tables * batch,)](
        grad_output, weights, weights_offsets, D_offsets, rows_offsets, indices, offsets, grad_psw, batch,
        grad_output.shape[1], POOLING=pooling, BLOCK_D=_block_d(D_offsets))
    return grad_psw
