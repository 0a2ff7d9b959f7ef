"""Analytic FLOPs and minimum bytes of every op: the two numbers of each kernel's roofline.

Minimum bytes count what any implementation must move between memory and the chip: each input
element read once, each output element written once, nothing for padding a kernel never touches.
The bench divides them by the measured time to report TFLOP/s and GB/s.
"""

from __future__ import annotations

import torch


def _lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets.long().diff()


def jagged_to_padded(offsets: torch.Tensor, max_len: int, dim: int, elem_bytes: int) -> tuple[int, int]:
    """(flops, bytes): read sum_b min(L_b, max_len) rows, write B*max_len rows, plus the offsets."""
    kept = int(_lengths(offsets).clamp(max=max_len).sum())
    num_seqs = offsets.numel() - 1
    return 0, (kept + num_seqs * max_len) * dim * elem_bytes + offsets.numel() * offsets.element_size()


def padded_to_jagged(offsets: torch.Tensor, max_len: int, dim: int, elem_bytes: int) -> tuple[int, int]:
    """(flops, bytes): read sum_b min(L_b, max_len) padded rows, write all N jagged rows, plus the offsets."""
    lengths = _lengths(offsets)
    kept = int(lengths.clamp(max=max_len).sum())
    total = int(lengths.sum())
    return 0, (kept + total) * dim * elem_bytes + offsets.numel() * offsets.element_size()


def embedding_bag(lookups: list[int], dims: list[int], batch: int, elem_bytes: int, index_bytes: int) -> tuple[int, int]:
    """(flops, bytes) of a pooled multi-table lookup, by FBGEMM's benchmark formula (B x sum(D) x L):
    every lookup reads its row, the [B, sum D] output written once, plus the indices and offsets.
    lookups[t]: indices of table t. Comparable with FBGEMM's published GB/s, but not a floor: a row
    looked up twice need not be read twice (``embedding_bag_floor`` counts it once)."""
    rows_read = sum(n * d for n, d in zip(lookups, dims))
    indices = sum(lookups) * index_bytes + (len(dims) * batch + 1) * index_bytes
    return 2 * rows_read, (rows_read + batch * sum(dims)) * elem_bytes + indices


def embedding_bag_backward_rowwise_adagrad(lookups: list[int], unique_rows: list[int], dims: list[int], batch: int,
                                           elem_bytes: int, index_bytes: int) -> tuple[int, int]:
    """(flops, bytes) of the backward with the row-wise Adagrad update fused: grad_output [B, sum D] read
    once, every unique row read and written once with its fp32 state, plus the indices and offsets.
    FLOPs: 2 per looked-up element (the duplicate sums) + 6 per updated element (g^2, mean, scale, update)."""
    updated = sum(u * d for u, d in zip(unique_rows, dims))
    indices = sum(lookups) * index_bytes + (len(dims) * batch + 1) * index_bytes
    grad_read = batch * sum(dims) * elem_bytes
    flops_ = 2 * sum(n * d for n, d in zip(lookups, dims)) + rowwise_adagrad_update(unique_rows, dims)
    return flops_, grad_read + 2 * updated * elem_bytes + 2 * sum(unique_rows) * 4 + indices


def rowwise_adagrad_update(unique_rows: list[int], dims: list[int]) -> int:
    """FLOPs of the row-wise Adagrad update of the distinct rows (6 per element: g^2, the mean,
    the scale, the update): the optimizer's part of embedding_bag_backward_rowwise_adagrad."""
    return 6 * sum(u * d for u, d in zip(unique_rows, dims))


def embedding_bag_distinct_rows(indices: torch.Tensor, offsets: torch.Tensor, num_tables: int,
                                batch: int) -> list[int]:
    """Distinct row ids of each table in a batch: table t's ids are indices[offsets[t*B]:offsets[(t+1)*B]]
    (feature-major offsets [T*B+1], ids local to their table)."""
    bounds = offsets.cpu()
    ids = indices.cpu()
    return [int(ids[int(bounds[t * batch]):int(bounds[(t + 1) * batch])].unique().numel()) for t in range(num_tables)]


def embedding_bag_floor(indices: torch.Tensor, offsets: torch.Tensor, dims: list[int], batch: int, elem_bytes: int,
                        *, rowwise_adagrad: bool = False) -> int:
    """Minimum bytes of a pooled multi-table lookup: each distinct row of each table read once (a
    row looked up twice is in cache or registers the second time), the [B, sum D] output written
    once, the indices and offsets read once. With ``rowwise_adagrad``, forward + backward + the fused
    update: the backward's bytes of ``embedding_bag_backward_rowwise_adagrad`` are added (grad_output
    read, every distinct row and its fp32 state read and written once, the indices again).

    The floor under skewed (Zipf) ids is far below FBGEMM's every-lookup formula (``embedding_bag``),
    and it is what "% of peak" divides by: no implementation can move fewer bytes, so no row passes
    100 % of the copy peak by reusing cached rows. indices/offsets as the op takes them (their
    element size is the index bytes); dims[t]: embedding dim of table t."""
    num_tables = len(dims)
    unique = embedding_bag_distinct_rows(indices, offsets, num_tables, batch)
    index_bytes = indices.element_size() * indices.numel() + offsets.element_size() * offsets.numel()
    nbytes = (sum(u * d for u, d in zip(unique, dims)) + batch * sum(dims)) * elem_bytes + index_bytes
    if rowwise_adagrad:
        bounds = offsets.cpu()
        lookups = [int(bounds[(t + 1) * batch]) - int(bounds[t * batch]) for t in range(num_tables)]
        nbytes += embedding_bag_backward_rowwise_adagrad(lookups, unique, dims, batch, elem_bytes,
                                                         indices.element_size())[1]
    return nbytes


def jagged_attention(offsets: torch.Tensor, num_heads: int, dim_qk: int, dim_v: int, elem_bytes: int, *,
                     causal: bool = True, backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of jagged attention over the real (unpadded) sequences.

    FLOPs (FlashAttention's convention): the two products Q K^T and P V cost 2 * sum_b L_b^2 * H *
    (Dqk + Dv) = 4 * sum L^2 * H * D when Dqk = Dv = D, halved when causal (only the visible half
    is work); the backward costs 2.5x the forward. backward=True gives forward + backward.
    Bytes: q, k, v read and out written once (N * H * (2 * Dqk + 2 * Dv)); the backward adds reading
    q, k, v, out, dout and writing dq, dk, dv.
    """
    lengths = _lengths(offsets)
    total = int(lengths.sum())
    pairs = int((lengths * lengths).sum())
    flops = 2 * pairs * num_heads * (dim_qk + dim_v)
    if causal:
        flops //= 2
    nbytes = total * num_heads * (2 * dim_qk + 2 * dim_v) * elem_bytes
    if backward:
        flops = int(flops * 3.5)
        nbytes += total * num_heads * (4 * dim_qk + 4 * dim_v) * elem_bytes
    return flops, nbytes

def hstu_layer(offsets: torch.Tensor, dim: int, num_heads: int, linear_dim: int, attention_dim: int,
               elem_bytes: int, *, concat_u: bool = True, concat_x: bool = True,
               backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of one HSTU layer (generative-recommenders' STULayer) on the real tokens.

    FLOPs: the UVQK GEMM 2 * N * D * O (O = H * (2 * linear_dim + 2 * attention_dim)), the output GEMM
    2 * N * K * D (K = H * linear_dim * (1 + concat_u + concat_x)), and the causal attention
    (``jagged_attention`` with Dqk = attention_dim, Dv = linear_dim); norms and gating are O(N * (D + K))
    and not counted. The backward of a GEMM is two GEMMs (2x), of the attention 2.5x.
    Bytes: x read and out written, the weights read, and u, v, q, k and the attention output written
    once and read once (what a layer that fuses the projections but not the attention must move);
    the backward adds reading x and grad_out and writing dx and the weight gradients, plus the
    attention's own backward traffic.
    """
    total = int(_lengths(offsets).sum())
    width = num_heads * linear_dim
    num_out = num_heads * (2 * linear_dim + 2 * attention_dim)
    k = width * (1 + concat_u + concat_x)
    gemm = 2 * total * dim * num_out + 2 * total * k * dim
    attn_flops, attn_bytes = jagged_attention(offsets, num_heads, attention_dim, linear_dim, elem_bytes,
                                              backward=backward)
    weights = dim * num_out + k * dim + 2 * dim + num_out + 2 * width
    nbytes = elem_bytes * (2 * total * dim + weights + 2 * total * (num_out + width))
    flops = gemm + attn_flops
    if backward:
        flops += 2 * gemm
        nbytes += elem_bytes * (3 * total * dim + weights) + attn_bytes - total * num_heads * (
            2 * attention_dim + 2 * linear_dim) * elem_bytes
    return flops, nbytes


def hstu_uvqk(total: int, dim: int, num_heads: int, linear_dim: int, attention_dim: int, elem_bytes: int, *,
              backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of the layer's uvqk half (``hstu_uvqk_fwd``, or ``hstu_uvqk_bwd`` alone when
    backward) on N = total tokens: its GEMM [N, D] x [D, O], O = H * (2 * linear_dim + 2 * attention_dim),
    2 * N * D * O forward, twice that backward (dx and the weight gradient; what a kernel recomputes,
    such as silu_qkv's pre-activations, is not counted). Bytes: forward reads x and the weights and
    writes u, v, q, k and the fp32 row stats; backward reads the four gradients, x, the stats and the
    weights and writes dx and the weight gradients."""
    num_out = num_heads * (2 * linear_dim + 2 * attention_dim)
    weights = dim * num_out + num_out + 2 * dim
    flops = 2 * total * dim * num_out * (2 if backward else 1)
    nbytes = elem_bytes * (total * dim + total * num_out + weights) + 8 * total
    if backward:
        nbytes += elem_bytes * (total * dim + weights)
    return flops, nbytes


def hstu_output(total: int, dim: int, num_heads: int, linear_dim: int, elem_bytes: int, *, concat_u: bool,
                concat_x: bool, backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of the layer's output half (``hstu_output_fwd``, or ``hstu_output_bwd`` alone when
    backward) on N = total tokens: its GEMM [N, K] x [K, D], K = H * linear_dim * (1 + concat_u +
    concat_x), 2 * N * K * D forward, twice that backward. Bytes: forward reads attn, u and x and the
    weights and writes out and the fp32 norm stats; backward reads grad_out, attn, u, the stats and
    the weights and writes dattn, du and the weight gradients (norm stats counted per row, 8 bytes)."""
    width = num_heads * linear_dim
    k = width * (1 + concat_u + concat_x)
    weights = k * dim + dim + 2 * width
    flops = 2 * total * k * dim * (2 if backward else 1)
    if backward:
        return flops, elem_bytes * (4 * total * width + total * dim + 2 * weights) + 8 * total
    return flops, elem_bytes * (2 * total * width + 2 * total * dim + weights) + 8 * total


# ---------------------------------------------------------------------------------------------
# Interaction family. `backward=True` returns forward + backward totals (what a fwd+bwd bench
# iteration does). Minimum bytes read each input once and write each output once; saved
# activations a kernel may keep (z, mean/rstd) are not counted since they can be recomputed.
# ---------------------------------------------------------------------------------------------


def linear(rows: int, in_features: int, out_features: int, elem_bytes: int, relu: bool = False,
           backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of gem_kernels.linear: act(x W^T + b), x [R, K] (x and x2 together), W [N, K].
    Forward: 2*R*N*K (+ R*N bias, + R*N ReLU); read x, W, b, write out. Backward: 4*R*N*K (grad_x,
    grad_W) + R*N (bias sums; + R*N mask); read grad, x, W (and out for the mask), write grad_x,
    grad_W, grad_b."""
    act, weight = rows * out_features, out_features * in_features
    matmul = 2 * rows * weight
    flops_ = matmul + act * (2 if relu else 1)
    bytes_ = (rows * in_features + weight + out_features + act) * elem_bytes
    if backward:
        flops_ += 2 * matmul + act * (2 if relu else 1)
        bytes_ += (act * (2 if relu else 1) + 2 * rows * in_features + 2 * weight + out_features) * elem_bytes
    return flops_, bytes_


def dot_interaction(batch: int, num_features: int, dim: int, self_interaction: bool, elem_bytes: int,
                    backward: bool = False) -> tuple[int, int]:
    """(flops, bytes). Forward: 2*B*P*D FLOPs (the P upper-triangle dot products), read x, write
    [B, P]. Backward: grad_x = sym(G) x, 4*B*P*D FLOPs (each pair feeds two rows); read grad and x,
    write grad_x."""
    pairs = num_features * (num_features + 1) // 2 if self_interaction else num_features * (num_features - 1) // 2
    x_elems = batch * num_features * dim
    flops_, bytes_ = 2 * batch * pairs * dim, (x_elems + batch * pairs) * elem_bytes
    if backward:
        flops_ += 4 * batch * pairs * dim
        bytes_ += (batch * pairs + 2 * x_elems) * elem_bytes
    return flops_, bytes_


def cross_layer(batch: int, width: int, rank: int | None, elem_bytes: int, backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of one DCNv2 cross layer x0 * (W xl + b) + xl, W [N, N] or U [N, r] V [r, N].
    Forward: the matmul 2*B*N*N (low rank 4*B*N*r) plus 3*B*N for bias, product and residual; read
    x0, xl, W, b, write out. Backward: twice the matmul FLOPs (grad input, grad weight) plus 3*B*N;
    read grad, x0, xl, W, write grad_x0, grad_xl, grad_W, grad_b."""
    weight_elems = width * width if rank is None else 2 * width * rank
    matmul = 2 * batch * weight_elems
    act = batch * width
    flops_, bytes_ = matmul + 3 * act, (3 * act + weight_elems + width) * elem_bytes
    if backward:
        flops_ += 2 * matmul + 3 * act
        bytes_ += (5 * act + 2 * weight_elems + 2 * width) * elem_bytes
    return flops_, bytes_


def fm_compress(batch: int, num_features: int, dim: int, rank: int, elem_bytes: int,
                backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of Wukong's LayerNorm(flatten(X (X^T Y))), X [B, F, D], Y [F, k].
    Forward: 4*B*F*D*k for the two products plus ~8*B*F*k for the LayerNorm; read X, Y and the
    LayerNorm parameters, write [B, F*k]. Backward: 8*B*F*D*k (grad A, grad X twice, grad Y) plus
    ~12*B*F*k; read grad, X, Y, LayerNorm weight, write grad X, grad Y and the two parameter grads."""
    x_elems, out_elems, params = batch * num_features * dim, batch * num_features * rank, num_features * rank
    flops_, bytes_ = 4 * x_elems * rank + 8 * out_elems, (x_elems + out_elems + 3 * params) * elem_bytes
    if backward:
        flops_ += 8 * x_elems * rank + 12 * out_elems
        bytes_ += (out_elems + 2 * x_elems + 5 * params) * elem_bytes
    return flops_, bytes_


def feature_mix_norm(batch: int, num_in: int, num_out: int, num_fm: int, dim: int, elem_bytes: int,
                     backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of LayerNorm_D(M X + concat(fm, 0)), X [B, F, D], M [O, F], fm [B, O_fm, D].
    Forward: 2*B*O*F*D plus ~8*B*O*D for the add and the LayerNorm; read X, fm, M and the LayerNorm
    parameters, write [B, O, D]. Backward: 4*B*O*F*D (grad X = M^T grad S, grad M = grad S X^T) plus
    ~12*B*O*D; read grad, X, fm (S recomputed), write grad X and grad fm (recomputing S adds
    2*B*O*F*D FLOPs the minimum does not count)."""
    x_elems, out_elems, fm_elems = batch * num_in * dim, batch * num_out * dim, batch * num_fm * dim
    params = num_out * num_in + 2 * dim
    flops_ = 2 * out_elems * num_in + 8 * out_elems
    bytes_ = (x_elems + fm_elems + out_elems + params) * elem_bytes
    if backward:
        flops_ += 4 * out_elems * num_in + 12 * out_elems
        bytes_ += (out_elems + 2 * x_elems + 2 * fm_elems + 2 * params) * elem_bytes
    return flops_, bytes_


def wukong_layer(batch: int, num_in: int, num_fm_out: int, num_lcb_out: int, dim: int, fm_rank: int,
                 mlp_hidden: list[int], elem_bytes: int, backward: bool = False) -> tuple[int, int]:
    """(flops, bytes) of one WukongLayer: fm_compress (its products and LayerNorm), the FMB MLP's
    matmuls, the LCB and residual projections over the feature axis and the final LayerNorm (~8
    FLOPs per output element forward, ~12 backward, as feature_mix_norm counts it). Bias adds,
    ReLUs and the identity residual's add are elementwise and not counted, as for every other MLP
    of the model (model.archs.mlp_flops). Bytes: the input, the parameters and the output once.
    Backward: twice the matmul FLOPs (grad input, grad weight) and fm_compress's backward."""
    num_out = num_fm_out + num_lcb_out
    fm_flops = fm_compress(batch, num_in, dim, fm_rank, elem_bytes, backward=backward)[0] if num_fm_out else 0
    sizes = [num_in * fm_rank, *mlp_hidden, num_fm_out * dim] if num_fm_out else []
    mlp_weights = sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))
    mlp_params = mlp_weights + sum(sizes[1:])
    # LCB and the residual projection are one [num_out, num_in] matrix over the feature axis (the
    # identity residual is an add: then only the LCB rows multiply).
    proj_rows = num_out if num_out != num_in else num_lcb_out
    matmul = 2 * batch * mlp_weights + 2 * batch * proj_rows * num_in * dim
    out_elems = batch * num_out * dim
    params = mlp_params + proj_rows * num_in + num_in * fm_rank * 3 + 2 * dim
    flops_ = fm_flops + matmul + 8 * out_elems
    bytes_ = (batch * num_in * dim + out_elems + params) * elem_bytes
    if backward:
        flops_ += 2 * matmul + 12 * out_elems
        bytes_ += (out_elems + batch * num_in * dim + params) * elem_bytes
    return flops_, bytes_
