"""Triton kernels of the attention family: jagged attention (softmax and HSTU), forward and backward.

Work decomposition (FlashAttention-2 on a jagged batch, one sequence per program row of the grid):
- forward: a 1-D grid of cdiv(max_seq_len, BLOCK_M) * B * H programs, m fastest (the query blocks of
  one sequence and head run side by side and share its K, V in L2; grid axes 1 and 2 stop at 65535,
  which B * H passes at B = 16384, H = 4). Program (m, b*H+h) owns BLOCK_M query rows of
  sequence b, head h, and walks the key blocks of that sequence only, with the online softmax in
  fp32 (softmax) or a plain fp32 accumulator (HSTU). The visibility mask is computed from the (i, j)
  ids in-tile; a key block with no visible pair is skipped before any load; the biases are gathered
  in-tile. Programs past the sequence end exit at once.
- cached forward (inference, `cached_jagged_attention`): the same kernel on the last delta rows of every
  sequence only (queries in delta_q [B * delta, ...], k/v the whole sequences): cdiv(delta, BLOCK_M) * B * H
  programs, each walking the key blocks as above; delta * L pairs per sequence instead of L^2.
- backward: two passes of one kernel, no atomics on dq/dk/dv: the KV pass (grid over key blocks)
  accumulates dk, dv over the query blocks; the Q pass (grid over query blocks) accumulates dq over
  the key blocks. Both recompute the scores. delta_i = <dO_i, O_i> (softmax) is one torch reduction
  before them. The bias gradients come from the KV pass: with deterministic=False it adds them with
  fp32 atomics (fast, order-dependent bits); with deterministic=True each KV program writes its
  partial sums to scratch (pos_bias: the diagonal sums of dS over its key block, one store per
  tile-wide block of relative positions; time_bias: its num_buckets+1 bucket sums), reduced afterwards
  in a fixed order (`_pos_bias_grad_reduce_kernel`, torch.sum): bit-identical run to run.
Roofline: FLOPs 4 * sum(visible pairs) * H * D forward (2 products), 2.5x backward (5 products, one
recomputed); minimum bytes N*H*(2*Dqk + 2*Dv)*s forward.

Under TRITON_INTERPRET=1 (CPU) every tl.dot runs on fp32 operands (the interpreter's bf16 dot is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._attention import bucket_thresholds
from . import triton_interpret


# The widest head dim (padded to a power of two) whose smallest tile fits a GPU block's shared memory:
# the backward's query pass holds about 8 B (fp16/bf16) or 16 B (fp32) per BLOCK x padded-head-dim
# element, against 227 KiB on H100/H200 and 163 KiB on A100. At 16 x 16 tiles, 1024 fits in fp16/bf16
# (128 KiB) and 512 in fp32 (130 KiB); fp32 at 1024 needs 256 KiB (compiled for sm_90a, triton 3.8).
MAX_HEAD_DIM = {torch.float16: 1024, torch.bfloat16: 1024, torch.float32: 512}


def check_head_dims(dtype: torch.dtype, D: int, Dv: int) -> None:
    """ValueError naming the head dims when the triton backend's tiles cannot hold them."""
    limit = MAX_HEAD_DIM[dtype]
    if max(D, Dv) > limit:
        raise ValueError(f"jagged_attention: head dims Dqk = {D}, Dv = {Dv} are above the triton backend's limit of "
                         f"{limit} for {str(dtype).removeprefix('torch.')} (its smallest tiles would not fit a GPU "
                         f"block's shared memory); split the heads, or use the reference backend")


def _launch_config(dtype: torch.dtype, block_d: int, block_dv: int) -> tuple[int, int]:
    """(BLOCK, num_warps): square BLOCK x BLOCK tiles (the deterministic pos_bias gradient walks query
    blocks in steps of one key block, see _diagonal_sums). Chosen from register counts and shared
    memory, compiled for sm_90a without a GPU (scripts/triton_compile_check.py, triton 3.8; not timed: a
    GPU run should confirm them):
    - fp16/bf16 (tensor-core tl.dot): 64 x 64, 8 warps once a head dim reaches 64. At 4 warps every
      program sat at 255 registers and most spilled (medians 230-260 B per thread, up to 1.5 KB with
      biases); at 8 warps the D = 128 forward takes 206 registers, and 7 of 8 D = 128 forwards, 14 of 16
      D = 64 forwards and 22 of 32 D = 64 backwards fit without spills (worst left: 316 B).
      Wider heads take narrower tiles, 8 warps (softmax with both biases, deterministic):
      | padded head dim | tile | shared memory (fwd / bwd) | spills (fwd / kv pass / q pass) |
      | 256  | 32 x 32 (64 x 64: 96 / 144 KiB, spills 384 / 840 / 76 B) | 36 / 64 KiB | 0 / 20 / 0 B |
      | 512  | 16 x 16 (32 x 32: spills 24 / 1684 / 12 B)               | 33 / 64 KiB | 0 / 120 / 0 B |
      | 1024 | 16 x 16                                                  | 65 / 128 KiB | 120 / 5080 / 80 B |
    - fp32 (PRECISION "ieee": exact products on the FMA units, whose dot holds operand rows per thread):
      16 x 16; 4 warps up to head dim 64, 8 above. Of the 120 fp32 specialisations, none fit at
      64 x 64 / 8 warps (spills up to 19 KB per thread forward, 30 KB backward, at D = 128); 75 at
      32 x 32 / 8 warps (D = 128 still spills 476-716 B); at this choice 115, the rest spilling <= 20 B.
      At 256 and 512 the spills reach 300 B and 2 KB; 1024 needs 256 KiB (MAX_HEAD_DIM).
    The interpreter (CPU) runs 64 x 64 for every dtype: its cost grows with the number of tiles, and
    test_triton_interpreter_tile_sizes runs the fp32 tiles there."""
    widest = max(block_d, block_dv)
    if triton_interpret():
        return 64, (8 if widest >= 64 else 4)
    if dtype == torch.float32:
        return 16, (8 if widest > 64 else 4)
    if widest <= 128:
        return 64, (8 if widest >= 64 else 4)
    return (32 if widest == 256 else 16), 8


@triton.jit
def _ids(pos, L, max_id, contextual_len):
    """generative-recommenders' position ids: context -> 0, p >= c -> p - c + 1, targets -> max_id."""
    ids = tl.where(contextual_len > 0, tl.maximum(pos - contextual_len + 1, 0), pos)
    return tl.minimum(ids, max_id)


@triton.jit
def _visible(offs_m, offs_n, id_m, id_n, L, max_id, contextual_len, max_attn_len, CAUSAL: tl.constexpr):
    d = id_m[:, None] - id_n[None, :]
    if not CAUSAL:
        d = tl.where(d < 0, -d, d)
    vis = (offs_m[:, None] == offs_n[None, :]) | ((d > 0) & ((max_attn_len == 0) | (d <= max_attn_len)))
    vis = vis | ((contextual_len > 0) & (id_m[:, None] == 0) & (id_n[None, :] < max_id))
    return vis & (offs_m[:, None] < L) & (offs_n[None, :] < L)


@triton.jit
def _scores(q, k, offs_m, offs_n, vis, start, L, hp, ht, scale, M,
            pos_bias_ptr, stride_pb, time_bias_ptr, stride_tb, timestamps_ptr, query_timestamps_ptr, thr_ptr,
            num_buckets, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, MAX_BUCKETS: tl.constexpr,
            PRECISION: tl.constexpr):
    """fp32 s = scale * q k^T + pos_bias[hp, j - i + M - 1] + time_bias[ht, bucket(tq_i - t_j)], and the buckets."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    bucket = tl.zeros(s.shape, dtype=tl.int32)
    if HAS_POS:
        rel = offs_n[None, :] - offs_m[:, None] + M - 1
        s += tl.load(pos_bias_ptr + hp * stride_pb + rel, mask=vis, other=0.0).to(tl.float32)
    if HAS_TIME:
        t_m = tl.load(query_timestamps_ptr + start + offs_m, mask=offs_m < L, other=0)
        t_n = tl.load(timestamps_ptr + start + offs_n, mask=offs_n < L, other=0)
        dt = t_m[:, None] - t_n[None, :]
        dt = tl.where(dt < 0, -dt, dt)
        # bucket = number of thresholds <= |dt| (host-computed with the reference's fp64 formula).
        for b in range(0, MAX_BUCKETS):
            thr = tl.load(thr_ptr + b, mask=b < num_buckets, other=9223372036854775807)
            bucket += (dt >= thr).to(tl.int32)
        s += tl.load(time_bias_ptr + ht * stride_tb + bucket, mask=vis, other=0.0).to(tl.float32)
    return s, bucket


@triton.jit
def _masked_dot(w, vis, x, K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 [R, W] = sum over visible k of w[r, k] * x[k, :], for w [R, K] (zero where invisible), vis
    [R, K] int32, x [K, W]. The dot runs on x's finite part; a tile whose x holds an Inf or NaN (rare)
    then adds those entries pair by pair where visible, so an invisible one adds nothing (the dot alone
    would add 0 * inf = NaN) and a visible one follows IEEE maths."""
    finite = (x == x) & (tl.abs(x.to(tl.float32)) < float("inf"))
    out = tl.dot(w.to(x.dtype), tl.where(finite, x, 0.0).to(x.dtype), input_precision=PRECISION)
    if tl.max((~finite).to(tl.int32)) > 0:
        offs = tl.arange(0, K)
        bad = tl.where(finite, 0.0, x.to(tl.float32))  # the non-finite entries, 0 elsewhere
        for c in range(0, K):
            w_c = tl.sum(tl.where(offs[None, :] == c, w.to(tl.float32), 0.0), 1)
            vis_c = tl.max(tl.where(offs[None, :] == c, vis, 0), 1) > 0
            x_c = tl.sum(tl.where(offs[:, None] == c, bad, 0.0), 0)
            out += tl.where(vis_c[:, None] & (x_c[None, :] != 0.0), w_c[:, None] * x_c[None, :], 0.0)
    return out


@triton.jit
def _load_rows(ptr, rows, row_ok, stride_n, col0, cols, width, UPCAST: tl.constexpr):
    """The [rows, cols] tile of one head of a packed [N, H, width] tensor (col0 = h * stride_h),
    zero outside the sequence and past width; in fp32 when UPCAST."""
    x = tl.load(ptr + rows[:, None] * stride_n + col0 + cols[None, :],
                mask=row_ok[:, None] & (cols[None, :] < width), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _store_rows(ptr, x, rows, row_ok, stride_n, col0, cols, width):
    """Store x as the [rows, cols] tile of one head of a packed [N, H, width] tensor (_load_rows' twin),
    in the tensor's dtype, nothing outside the sequence or past width."""
    tl.store(ptr + rows[:, None] * stride_n + col0 + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < width))


@triton.jit
def _block(first, L, max_id, contextual_len, BLOCK: tl.constexpr):
    """The BLOCK positions from ``first`` of a sequence of length L: (positions, inside the sequence,
    position ids)."""
    offs = first + tl.arange(0, BLOCK)
    return offs, offs < L, _ids(offs, L, max_id, contextual_len)


@triton.jit
def _program(blocks, H, offsets_ptr, targets_ptr, contextual_len, pos_heads, time_heads, HAS_TARGETS: tl.constexpr):
    """The prologue of every attention program: 1-D grid, block fastest, (block, sequence b, head h);
    the sequence's start row and length L, the largest position id (targets and the contextual
    prefix share ids, see reference/attention.py), and the bias rows of head h (hp, ht)."""
    pid = tl.program_id(0) % blocks
    bh = tl.program_id(0) // blocks
    b = bh // H
    h = bh % H
    start = tl.load(offsets_ptr + b).to(tl.int64)
    L = (tl.load(offsets_ptr + b + 1).to(tl.int64) - start).to(tl.int32)
    n_t = 0
    if HAS_TARGETS:
        n_t = tl.load(targets_ptr + b).to(tl.int32)
    max_id = L - n_t + tl.where(contextual_len > 0, 1 - contextual_len, 0)
    hp = h if pos_heads > 1 else 0
    ht = h if time_heads > 1 else 0
    return pid, b, h, bh, start, L, max_id, hp, ht


@triton.jit
def _jagged_attention_fwd_kernel(
    Q_ptr, K_ptr, V_ptr, Out_ptr, Lse_ptr, offsets_ptr, targets_ptr,
    pos_bias_ptr, time_bias_ptr, timestamps_ptr, query_timestamps_ptr, thr_ptr,
    stride_qn, stride_qh, stride_vn, stride_vh, stride_pb, stride_tb,
    H, D, Dv, M, scale, inv_m, contextual_len, max_attn_len, num_buckets, pos_heads, time_heads, q_blocks, delta,
    SOFTMAX: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, MAX_BUCKETS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """delta == 0: every row of the sequence is a query, in Q/Out/Lse row start + i. delta > 0 (the cached
    forward): only positions i in [L - delta, L) are, and their Q/Out/Lse rows are b * delta + i - (L - delta).
    q_blocks: query blocks per (sequence, head), cdiv(max_seq_len or delta, BLOCK_M)."""
    pid_m, b, h, bh, start, L, max_id, hp, ht = _program(q_blocks, H, offsets_ptr, targets_ptr,
                                                         contextual_len, pos_heads, time_heads, HAS_TARGETS)
    q_lo = tl.where(delta > 0, L - delta, 0)
    q_start = tl.where(delta > 0, b.to(tl.int64) * delta - q_lo, start)  # Q row of position i: q_start + i
    if q_lo + pid_m * BLOCK_M < L:
        offs_m, row_ok, id_m = _block(q_lo + pid_m * BLOCK_M, L, max_id, contextual_len, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = _load_rows(Q_ptr, q_start + offs_m, row_ok, stride_qn, h * stride_qh, offs_d, D, UPCAST)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
        for j0 in range(0, L, BLOCK_N):
            offs_n, col_ok, id_n = _block(j0, L, max_id, contextual_len, BLOCK_N)
            vis = _visible(offs_m, offs_n, id_m, id_n, L, max_id, contextual_len, max_attn_len, CAUSAL)
            if tl.max(vis.to(tl.int32)) > 0:  # skip fully masked tiles before any load
                k = _load_rows(K_ptr, start + offs_n, col_ok, stride_qn, h * stride_qh, offs_d, D, UPCAST)
                v = _load_rows(V_ptr, start + offs_n, col_ok, stride_vn, h * stride_vh, offs_dv, Dv, UPCAST)
                s, _bucket = _scores(q, k, offs_m, offs_n, vis, start, L, hp, ht, scale, M, pos_bias_ptr, stride_pb,
                                     time_bias_ptr, stride_tb, timestamps_ptr, query_timestamps_ptr, thr_ptr, num_buckets, HAS_POS,
                                     HAS_TIME, MAX_BUCKETS, PRECISION)
                vis_i = vis.to(tl.int32)
                if SOFTMAX:
                    # A NaN score makes p, hence l and the row, NaN whatever max does with it.
                    s = tl.where(vis, s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.where(vis, tl.exp(s - m_safe[:, None]), 0.0)
                    alpha = tl.exp(m_i - m_safe)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None] + _masked_dot(p, vis_i, v, BLOCK_N, PRECISION)
                    m_i = m_new
                else:
                    w = tl.where(vis, s * tl.sigmoid(s) * inv_m, 0.0)
                    acc += _masked_dot(w, vis_i, v, BLOCK_N, PRECISION)
        if SOFTMAX:
            # l == 0: every visible score is -inf: out = acc (0), lse = -inf. A NaN l stays NaN.
            l_safe = tl.where(l_i == 0, 1.0, l_i)
            acc = acc / l_safe[:, None]
            tl.store(Lse_ptr + (q_start + offs_m) * H + h, m_i + tl.log(l_safe), mask=row_ok)
        _store_rows(Out_ptr, acc, q_start + offs_m, row_ok, stride_vn, h * stride_vh, offs_dv, Dv)


@triton.jit
def _tile_grads(q, k, v, do, lse, delta, offs_m, offs_n, vis, start, L, hp, ht, scale, inv_m, M,
                pos_bias_ptr, stride_pb, time_bias_ptr, stride_tb, timestamps_ptr, query_timestamps_ptr, thr_ptr, num_buckets,
                SOFTMAX: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, MAX_BUCKETS: tl.constexpr,
                PRECISION: tl.constexpr):
    """(P or the HSTU weights, dS, buckets) of one tile, fp32, zero where invisible."""
    s, bucket = _scores(q, k, offs_m, offs_n, vis, start, L, hp, ht, scale, M, pos_bias_ptr, stride_pb,
                        time_bias_ptr, stride_tb, timestamps_ptr, query_timestamps_ptr, thr_ptr, num_buckets, HAS_POS, HAS_TIME,
                        MAX_BUCKETS, PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION).to(tl.float32)
    if SOFTMAX:
        # lse = -inf: every visible score was -inf, p = 0 (exp(-inf - -inf) would be NaN).
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        # Selected, not multiplied: dp of an invisible pair may be inf or NaN (an infinite v).
        p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
    else:
        sig = tl.sigmoid(s)
        p = tl.where(vis, s * sig * inv_m, 0.0)
        ds = tl.where(vis, dp * sig * (1.0 + s * (1.0 - sig)) * inv_m, 0.0)
    return p, ds, bucket


@triton.jit
def _diagonal_sums(ds, BLOCK: tl.constexpr):
    """Sums of a [BLOCK, BLOCK] tile along its diagonals c - r: (upper[t] for c - r = t + 1, lower[t] for
    c - r = t - BLOCK + 1), t in [0, BLOCK). Each row is gathered into its diagonal's column, then
    the columns are summed: a fixed order, no atomics."""
    r = tl.arange(0, BLOCK)[:, None]
    t = tl.arange(0, BLOCK)[None, :]
    up = r + 1 + t
    upper = tl.sum(tl.where(up < BLOCK, tl.gather(ds, tl.minimum(up, BLOCK - 1), 1), 0.0), 0)
    lo = r + t - (BLOCK - 1)
    lower = tl.sum(tl.where(lo >= 0, tl.gather(ds, tl.maximum(lo, 0), 1), 0.0), 0)
    return upper, lower


@triton.jit
def _bucket_sums(ds, bucket, num_buckets, TB: tl.constexpr):
    """part[m] = sum of ds over the tile's pairs in time bucket m (m <= num_buckets < TB), fixed order."""
    offs = tl.arange(0, TB)
    part = tl.zeros((TB,), tl.float32)
    for m in range(0, num_buckets + 1):
        total = tl.sum(tl.sum(tl.where(bucket == m, ds, 0.0), 1), 0)
        part += tl.where(offs == m, total, 0.0)
    return part


@triton.jit
def _row_stats(Lse_ptr, Delta_ptr, rows, row_ok, H, h, BLOCK_M: tl.constexpr, SOFTMAX: tl.constexpr):
    """The backward's per-row softmax statistics (lse, delta = <dO, O>) of head h; zeros for HSTU."""
    lse = tl.zeros((BLOCK_M,), tl.float32)
    delta = tl.zeros((BLOCK_M,), tl.float32)
    if SOFTMAX:
        lse = tl.load(Lse_ptr + rows * H + h, mask=row_ok, other=0.0)
        delta = tl.load(Delta_ptr + rows * H + h, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def _jagged_attention_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr, Lse_ptr, Delta_ptr, offsets_ptr, targets_ptr, pos_bias_ptr, time_bias_ptr,
    timestamps_ptr, query_timestamps_ptr, thr_ptr, stride_qn, stride_qh, stride_vn, stride_vh, stride_pb, stride_tb,
    H, D, Dv, M, scale, inv_m, contextual_len, max_attn_len, num_buckets, pos_heads, time_heads, key_blocks,
    DK_ptr, DV_ptr, DPos_ptr, DTime_ptr, pos_base_ptr,
    SOFTMAX: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, MAX_BUCKETS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DETERMINISTIC: tl.constexpr, TB: tl.constexpr,
):
    """Program = one key block of one (sequence, head) -> its dk, dv and the bias gradients.

    Bias gradients, DETERMINISTIC=False: fp32 atomics straight into DPos_ptr [pos_heads, 2M-1] and
    DTime_ptr [time_heads, num_buckets+1]. DETERMINISTIC=True: DPos_ptr is the pos scratch, where
    program (kt, b, h) owns nt + 1 blocks of BLOCK_N floats from pos_base_ptr[b] + (h*nt + kt)*(nt+1)*BLOCK_N
    (nt = cdiv(L, BLOCK_N)); its block x holds the dS sums of relative positions j - i in
    (BLOCK_N*(x + kt - nt), BLOCK_N*(x + kt - nt + 1)]. Query block qt touches blocks nt - qt (c - r > 0)
    and nt - qt - 1 (c - r <= 0), which query block qt + 1 touches next: the walk keeps the second in
    `carry` and stores each block once, complete. DTime_ptr is the time scratch [B*H, key_blocks, num_buckets+1].
    """
    pid, b, h, bh, start, L, max_id, hp, ht = _program(key_blocks, H, offsets_ptr, targets_ptr, contextual_len,
                                                       pos_heads, time_heads, HAS_TARGETS)
    if pid * BLOCK_N < L:
        offs_n, col_ok, id_n = _block(pid * BLOCK_N, L, max_id, contextual_len, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k = _load_rows(K_ptr, start + offs_n, col_ok, stride_qn, h * stride_qh, offs_d, D, UPCAST)
        v = _load_rows(V_ptr, start + offs_n, col_ok, stride_vn, h * stride_vh, offs_dv, Dv, UPCAST)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
        offs_blk = tl.arange(0, BLOCK_N)
        if DETERMINISTIC and HAS_POS:
            nt = tl.cdiv(L, BLOCK_N)
            pos_row = DPos_ptr + tl.load(pos_base_ptr + b) + (h * nt + pid).to(tl.int64) * (nt + 1) * BLOCK_N
            carry = tl.zeros((BLOCK_N,), tl.float32)
        if DETERMINISTIC and HAS_TIME:
            time_part = tl.zeros((TB,), tl.float32)
        for i0 in range(0, L, BLOCK_M):
            upper = tl.zeros((BLOCK_N,), tl.float32)
            lower = tl.zeros((BLOCK_N,), tl.float32)
            offs_m, row_ok, id_m = _block(i0, L, max_id, contextual_len, BLOCK_M)
            vis = _visible(offs_m, offs_n, id_m, id_n, L, max_id, contextual_len, max_attn_len, CAUSAL)
            if tl.max(vis.to(tl.int32)) > 0:
                q = _load_rows(Q_ptr, start + offs_m, row_ok, stride_qn, h * stride_qh, offs_d, D, UPCAST)
                do = _load_rows(DO_ptr, start + offs_m, row_ok, stride_vn, h * stride_vh, offs_dv, Dv, UPCAST)
                lse, delta = _row_stats(Lse_ptr, Delta_ptr, start + offs_m, row_ok, H, h, BLOCK_M, SOFTMAX)
                p, ds, bucket = _tile_grads(q, k, v, do, lse, delta, offs_m, offs_n, vis, start, L, hp, ht,
                                            scale, inv_m, M, pos_bias_ptr, stride_pb, time_bias_ptr, stride_tb,
                                            timestamps_ptr, query_timestamps_ptr, thr_ptr, num_buckets, SOFTMAX, HAS_POS, HAS_TIME,
                                            MAX_BUCKETS, PRECISION)
                vis_t = tl.trans(vis.to(tl.int32))
                dv += _masked_dot(tl.trans(p), vis_t, do, BLOCK_M, PRECISION)
                dk += _masked_dot(tl.trans(ds), vis_t, q, BLOCK_M, PRECISION) * scale
                if HAS_POS:
                    if DETERMINISTIC:
                        upper, lower = _diagonal_sums(ds, BLOCK_N)
                    else:
                        rel = offs_n[None, :] - offs_m[:, None] + M - 1
                        # relaxed: only the sum matters (the kernel's end orders it), no fence per add.
                        tl.atomic_add(DPos_ptr + hp * stride_pb + rel, ds, mask=vis, sem="relaxed")
                if HAS_TIME:
                    if DETERMINISTIC:
                        time_part += _bucket_sums(ds, bucket, num_buckets, TB)
                    else:
                        tl.atomic_add(DTime_ptr + ht * stride_tb + bucket, ds, mask=vis, sem="relaxed")
            if DETERMINISTIC and HAS_POS:
                # Skipped (fully masked) query blocks still store: every scratch block is written.
                tl.store(pos_row + (nt - i0 // BLOCK_M) * BLOCK_N + offs_blk, carry + upper)
                carry = lower
        if DETERMINISTIC and HAS_POS:
            tl.store(pos_row + offs_blk, carry)
        if DETERMINISTIC and HAS_TIME:
            offs_tb = tl.arange(0, TB)
            tl.store(DTime_ptr + (bh.to(tl.int64) * key_blocks + pid) * (num_buckets + 1) + offs_tb, time_part,
                     mask=offs_tb <= num_buckets)
        _store_rows(DK_ptr, dk, start + offs_n, col_ok, stride_qn, h * stride_qh, offs_d, D)
        _store_rows(DV_ptr, dv, start + offs_n, col_ok, stride_vn, h * stride_vh, offs_dv, Dv)


@triton.jit
def _jagged_attention_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr, Lse_ptr, Delta_ptr, offsets_ptr, targets_ptr, pos_bias_ptr, time_bias_ptr,
    timestamps_ptr, query_timestamps_ptr, thr_ptr, stride_qn, stride_qh, stride_vn, stride_vh, stride_pb, stride_tb,
    H, D, Dv, M, scale, inv_m, contextual_len, max_attn_len, num_buckets, pos_heads, time_heads, key_blocks,
    DQ_ptr,
    SOFTMAX: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, MAX_BUCKETS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program = one query block of one (sequence, head) -> its dq (no atomics: it owns its rows)."""
    pid, b, h, bh, start, L, max_id, hp, ht = _program(key_blocks, H, offsets_ptr, targets_ptr, contextual_len,
                                                       pos_heads, time_heads, HAS_TARGETS)
    if pid * BLOCK_M < L:
        offs_m, row_ok, id_m = _block(pid * BLOCK_M, L, max_id, contextual_len, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q = _load_rows(Q_ptr, start + offs_m, row_ok, stride_qn, h * stride_qh, offs_d, D, UPCAST)
        do = _load_rows(DO_ptr, start + offs_m, row_ok, stride_vn, h * stride_vh, offs_dv, Dv, UPCAST)
        lse, delta = _row_stats(Lse_ptr, Delta_ptr, start + offs_m, row_ok, H, h, BLOCK_M, SOFTMAX)
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for j0 in range(0, L, BLOCK_N):
            offs_n, col_ok, id_n = _block(j0, L, max_id, contextual_len, BLOCK_N)
            vis = _visible(offs_m, offs_n, id_m, id_n, L, max_id, contextual_len, max_attn_len, CAUSAL)
            if tl.max(vis.to(tl.int32)) > 0:
                k = _load_rows(K_ptr, start + offs_n, col_ok, stride_qn, h * stride_qh, offs_d, D, UPCAST)
                v = _load_rows(V_ptr, start + offs_n, col_ok, stride_vn, h * stride_vh, offs_dv, Dv, UPCAST)
                _p, ds, _bucket = _tile_grads(q, k, v, do, lse, delta, offs_m, offs_n, vis, start, L, hp, ht,
                                              scale, inv_m, M, pos_bias_ptr, stride_pb, time_bias_ptr,
                                              stride_tb, timestamps_ptr, query_timestamps_ptr, thr_ptr, num_buckets, SOFTMAX, HAS_POS,
                                              HAS_TIME, MAX_BUCKETS, PRECISION)
                dq += _masked_dot(ds, vis.to(tl.int32), k, BLOCK_N, PRECISION) * scale
        _store_rows(DQ_ptr, dq, start + offs_m, row_ok, stride_qn, h * stride_qh, offs_d, D)


@triton.jit
def _pos_bias_grad_reduce_kernel(Scratch_ptr, pos_base_ptr, offsets_ptr, DPos_ptr, num_seqs, H, M, pos_heads,
                                 stride_pb, key_blocks, BLOCK: tl.constexpr):
    """Program (m + key_blocks, hp): block m of relative positions j - i in (BLOCK*m, BLOCK*(m+1)], m in [-key_blocks,
    key_blocks), of dpos[hp]: the sum over sequences b, heads h of group hp (every h when pos_heads == 1)
    and key blocks kt of the dkdv programs' scratch blocks (layout in _jagged_attention_bwd_dkdv_kernel), in
    that fixed order. FLOPs: one add per scratch float; bytes: the scratch read once, dpos written once."""
    m = tl.program_id(0) - key_blocks
    hp = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    h_lo = tl.where(pos_heads == 1, 0, hp)
    h_hi = tl.where(pos_heads == 1, H, hp + 1)
    for b in range(0, num_seqs):
        L = tl.load(offsets_ptr + b + 1) - tl.load(offsets_ptr + b)
        nt = tl.cdiv(L, BLOCK)
        base = tl.load(pos_base_ptr + b)
        for h in range(h_lo, h_hi):
            # Key block kt holds block m at x = m - kt + nt, present when 0 <= x <= nt.
            for kt in range(tl.maximum(m, 0), tl.minimum(nt, m + nt + 1)):
                x = m - kt + nt
                acc += tl.load(Scratch_ptr + base + ((h * nt + kt) * (nt + 1) + x).to(tl.int64) * BLOCK + offs)
    rel = BLOCK * m + 1 + offs + M - 1
    tl.store(DPos_ptr + hp * stride_pb + rel, acc, mask=(rel >= 0) & (rel < 2 * M - 1))


def _common(q, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len, max_attn_len, pos_bias,
            time_bias, timestamps, query_timestamps):
    N, H, D = q.shape
    Dv = v.shape[2]
    dummy = q.new_empty((1,), dtype=torch.float32)
    num_buckets = time_bias.shape[1] - 1 if time_bias is not None else 0
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    block, num_warps = _launch_config(q.dtype, block_d, block_dv)
    timestamps_arg = timestamps.long() if timestamps is not None else seq_offsets.long()
    args = dict(
        offsets_ptr=seq_offsets,
        targets_ptr=num_targets if num_targets is not None else seq_offsets,
        pos_bias_ptr=pos_bias.float().contiguous() if pos_bias is not None else dummy,
        time_bias_ptr=time_bias.float().contiguous() if time_bias is not None else dummy,
        timestamps_ptr=timestamps_arg,
        query_timestamps_ptr=query_timestamps.long() if query_timestamps is not None else timestamps_arg,
        thr_ptr=bucket_thresholds(num_buckets, q.device),
        stride_qn=H * D, stride_qh=D, stride_vn=H * Dv, stride_vh=Dv,
        stride_pb=pos_bias.shape[1] if pos_bias is not None else 0,
        stride_tb=time_bias.shape[1] if time_bias is not None else 0,
        H=H, D=D, Dv=Dv, M=max_seq_len, scale=scale, inv_m=1.0 / max_seq_len if max_seq_len > 0 else 0.0,
        contextual_len=contextual_len, max_attn_len=max_attn_len, num_buckets=num_buckets,
        pos_heads=pos_bias.shape[0] if pos_bias is not None else 1,
        time_heads=time_bias.shape[0] if time_bias is not None else 1,
        SOFTMAX=kind == "softmax", CAUSAL=causal, HAS_TARGETS=num_targets is not None, HAS_POS=pos_bias is not None,
        HAS_TIME=time_bias is not None, MAX_BUCKETS=max(1, num_buckets),
        UPCAST=triton_interpret() or q.dtype == torch.float32,
        # fp32 operands: exact fp32 products (no TF32), so fp32 matches the reference to 1e-5.
        PRECISION="ieee" if (triton_interpret() or q.dtype == torch.float32) else "tf32",
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=num_warps,
    )
    return args


def jagged_attention_fwd(q, k, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                         max_attn_len, pos_bias, time_bias, timestamps, query_timestamps=None):
    N, H, _ = q.shape
    check_head_dims(q.dtype, q.shape[2], v.shape[2])
    out = torch.empty((N, H, v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((N, H) if kind == "softmax" else (0,), dtype=torch.float32, device=q.device)
    num_seqs = seq_offsets.numel() - 1
    if N == 0 or num_seqs == 0 or H == 0:
        return out, lse
    args = _common(q, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len, max_attn_len,
                   pos_bias, time_bias, timestamps, query_timestamps)
    q_blocks = triton.cdiv(max_seq_len, args["BLOCK_M"])
    _jagged_attention_fwd_kernel[(q_blocks * num_seqs * H,)](q, k, v, out, lse if kind == "softmax" else out,
                                                             q_blocks=q_blocks, delta=0, **args)
    return out, lse


def cached_jagged_attention_fwd(delta_q, k, v, seq_offsets, max_seq_len, kind, scale, num_targets, contextual_len,
                                max_attn_len, pos_bias, time_bias, timestamps, query_timestamps):
    """The forward kernel on the last delta rows of every sequence (delta_q [B * delta, H, D]); k, v whole.
    Its programs own query blocks of those rows only: cdiv(delta, BLOCK_M) * B * H programs."""
    rows, H, _ = delta_q.shape
    check_head_dims(delta_q.dtype, delta_q.shape[2], v.shape[2])
    out = torch.empty((rows, H, v.shape[2]), dtype=delta_q.dtype, device=delta_q.device)
    num_seqs = seq_offsets.numel() - 1
    delta = rows // num_seqs if num_seqs > 0 else 0
    if delta == 0 or H == 0:
        return out
    if query_timestamps is not None:
        # The kernel reads tq of position i at row start + i: the delta rows' tq go into a copy of timestamps.
        ends = seq_offsets[1:].long()
        full = timestamps.long().clone()
        full[(ends[:, None] - delta + torch.arange(delta, device=ends.device)).reshape(-1)] = query_timestamps.long()
        query_timestamps = full
    args = _common(delta_q, v, seq_offsets, max_seq_len, kind, True, scale, num_targets, contextual_len,
                   max_attn_len, pos_bias, time_bias, timestamps, query_timestamps)
    lse = torch.empty((rows, H) if kind == "softmax" else (1,), dtype=torch.float32, device=delta_q.device)
    q_blocks = triton.cdiv(delta, args["BLOCK_M"])
    _jagged_attention_fwd_kernel[(q_blocks * num_seqs * H,)](delta_q, k, v, out, lse, q_blocks=q_blocks, delta=delta,
                                                             **args)
    return out


def _pos_scratch_bases(seq_offsets, num_heads: int, block: int) -> tuple[torch.Tensor, int]:
    """(int64 [B] start of sequence b's block in the deterministic pos scratch, its total floats).

    Sequence b (nt = cdiv(L_b, block) key blocks) takes H * nt * (nt + 1) * block floats: the
    scratch is 4 * H * sum_b nt_b (nt_b + 1) * block bytes, about 4 * H * sum_b L_b^2 / block bytes (jagged:
    no padding to max_seq_len). One host sync reads the total to allocate it."""
    key_blocks = (seq_offsets.long().diff() + block - 1) // block
    sizes = num_heads * key_blocks * (key_blocks + 1) * block
    bases = torch.cumsum(sizes, 0) - sizes
    return bases.contiguous(), int(sizes.sum()) if sizes.numel() else 0


def jagged_attention_bwd(grad_out, q, k, v, out, lse, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
                         contextual_len, max_attn_len, pos_bias, time_bias, timestamps, query_timestamps,
                         deterministic):
    N, H, D = q.shape
    check_head_dims(q.dtype, D, v.shape[2])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dpos = torch.zeros(pos_bias.shape, dtype=torch.float32, device=q.device) if pos_bias is not None else None
    dtime = torch.zeros(time_bias.shape, dtype=torch.float32, device=q.device) if time_bias is not None else None
    num_seqs = seq_offsets.numel() - 1
    if N > 0 and num_seqs > 0 and H > 0:
        args = _common(q, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                       max_attn_len, pos_bias, time_bias, timestamps, query_timestamps)
        if kind == "softmax":
            delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # [N, H]
        else:
            lse = delta = q.new_zeros((1,), dtype=torch.float32)
        block = args["BLOCK_N"]
        key_blocks = triton.cdiv(max_seq_len, block)
        pos_out, time_out, pos_bases = dpos, dtime, seq_offsets
        if deterministic and pos_bias is not None:
            pos_bases, pos_floats = _pos_scratch_bases(seq_offsets, H, block)
            pos_out = torch.empty((pos_floats,), dtype=torch.float32, device=q.device)  # every float is stored
        if deterministic and time_bias is not None:
            # [B*H, key_blocks, num_buckets+1]: 4 * B * H * cdiv(max_seq_len, block) * (num_buckets+1) bytes
            # (linear in max_seq_len: ~0.5 MiB at B=32, H=4, max_seq_len=4096, 32 buckets with block 64; 4x that
            # with fp32's 16). Zeroed: programs past their sequence's end store nothing.
            time_out = torch.zeros((num_seqs * H, key_blocks, time_bias.shape[1]), dtype=torch.float32,
                                   device=q.device)
        grid = (key_blocks * num_seqs * H,)
        inputs = dict(Q_ptr=q, K_ptr=k, V_ptr=v, DO_ptr=grad_out, Lse_ptr=lse, Delta_ptr=delta, key_blocks=key_blocks)
        _jagged_attention_bwd_dkdv_kernel[grid](
            **inputs, DK_ptr=dk, DV_ptr=dv, DPos_ptr=pos_out if pos_out is not None else delta,
            DTime_ptr=time_out if time_out is not None else delta, pos_base_ptr=pos_bases,
            DETERMINISTIC=deterministic, TB=triton.next_power_of_2(args["num_buckets"] + 1), **args)
        _jagged_attention_bwd_dq_kernel[grid](**inputs, DQ_ptr=dq, **args)
        if deterministic and pos_bias is not None:
            _pos_bias_grad_reduce_kernel[(2 * key_blocks, pos_bias.shape[0])](
                pos_out, pos_bases, seq_offsets, dpos, num_seqs, H, max_seq_len, pos_bias.shape[0],
                pos_bias.shape[1], key_blocks, BLOCK=block)
        if deterministic and time_bias is not None:
            # torch.sum reduces in a fixed order for a given shape: deterministic.
            per_head = time_out.view(num_seqs, H, key_blocks, -1).sum(dim=(0, 2))
            dtime = per_head if time_bias.shape[0] == H else per_head.sum(0, keepdim=True)
    dpos = dpos.to(pos_bias.dtype) if dpos is not None else q.new_empty((0,))
    dtime = dtime.to(time_bias.dtype) if time_bias is not None else q.new_empty((0,))
    return dq, dk, dv, dpos, dtime
