// CUDA kernels of the embedding_bag family: fused multi-table embedding bags (TBE) and their
// backward with the optimizer fused.
//
// Forward work decomposition: one warp per (table, bag); a block holds kWarps bags. Lane l owns
// columns d = d0 + l + 32*j (j < kPerLane) of each kPerLane*32-wide column chunk, so a warp reads a
// row in coalesced 128-byte transactions; it loops over the bag's indices, accumulating in fp32
// registers, and writes its output columns once. Out-of-range indices are dropped (the host raised
// or warned before the launch).
//
// Backward work decomposition: segments are built with ATen ops (sort the kept lookups by global
// row, stable, then unique_consecutive: one segment per unique row); one warp per unique row sums
// its gradient rows in fp32 and writes the row once: the dense gradient, or the optimizer step on
// the weight row and its state (row-wise Adagrad reduces sum(g^2) across the warp in a first pass).
// No atomics, deterministic.
//
// Roofline: forward FLOPs 2 * N * D, bytes N * D * s + B * sum D * s + indices; backward with
// row-wise Adagrad: grad_output B * sum D * s read, U unique rows read and written, U fp32 states.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>

#include "gem_kernels/checks.h"
#include "gem_kernels/embedding_bag_codes.h"
#include "gem_kernels/table_meta.h"

namespace gem_kernels {
namespace {

constexpr int kWarps = 4;      // bags (or unique rows) per block
constexpr int kPerLane = 4;    // columns per lane per chunk: 128 columns per warp pass
// Rows of a bag whose loads a warp issues before it adds any of them. With one row at a time a warp
// keeps one row's D * s bytes in flight (each load sits behind its own branch, no unrolling across
// indices): at 48 registers (42 warps / SM) about 60% of an H200's HBM bandwidth by Little's law at
// D = 128, 30% at D = 64. Four rows at 64 registers (ptxas, sm_90a: 32 warps / SM) keep ~3x the
// bytes in flight per SM. A prediction from the PTX and ptxas, not yet measured on a GPU.
constexpr int kRowsInFlight = 4;

// The bag a warp of the bag-per-warp kernels owns (warp threadIdx.y of block blockIdx.x): bag
// tb = t * B + b, table t's D, row count and first weight. valid is false for the warps past the
// last bag, which read nothing.
template <typename scalar_t>
struct WarpBag {
  int64_t tb, t, b, D, rows;
  const scalar_t* table;
  bool valid;
};

template <typename scalar_t>
__device__ __forceinline__ WarpBag<scalar_t> warp_bag(const scalar_t* weights, const TableMeta& m) {
  const int64_t tb = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y;
  if (tb >= m.T * m.B) return {tb, 0, 0, 0, 0, nullptr, false};
  const int64_t t = tb / m.B;
  return {tb, t, tb - t * m.B, m.d_off[t + 1] - m.d_off[t], m.r_off[t + 1] - m.r_off[t], weights + m.w_off[t], true};
}

template <typename scalar_t, typename index_t>
__global__ void embedding_bag_fwd_kernel(const scalar_t* __restrict__ weights, const TableMeta m,
                                         const index_t* __restrict__ indices, const index_t* __restrict__ offsets,
                                         const float* __restrict__ psw, scalar_t* __restrict__ out,
                                         int64_t output_dim, int64_t pooling) {
  const auto [tb, t, b, D, rows, table, valid] = warp_bag(weights, m);
  if (!valid) return;
  const int lane = threadIdx.x;
  const int64_t start = offsets[tb];
  const int64_t stop = offsets[tb + 1];
  for (int64_t d0 = 0; d0 < D; d0 += 32 * kPerLane) {
    if (pooling == kNone) {
      for (int64_t p = start; p < stop; ++p) {
        const int64_t idx = indices[p];
        const bool valid = idx >= 0 && idx < rows;
        const float w = psw ? psw[p] : 1.f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          const int64_t d = d0 + lane + 32 * j;
          if (d < D) {
            out[p * output_dim + d] = static_cast<scalar_t>(valid ? w * static_cast<float>(table[idx * D + d]) : 0.f);
          }
        }
      }
      continue;
    }
    // kRowsInFlight rows at a time: their indices, then all their loads, then the adds (in index
    // order, so the sum is the one-row-at-a-time sum); a dropped or missing row adds 0 * 0.
    float acc[kPerLane] = {0.f};
    int64_t kept = 0;
    for (int64_t p0 = start; p0 < stop; p0 += kRowsInFlight) {
      int64_t row[kRowsInFlight];
      float w[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int64_t p = p0 + u;
        const int64_t idx = p < stop ? static_cast<int64_t>(indices[p]) : -1;
        const bool valid = idx >= 0 && idx < rows;
        row[u] = valid ? idx : -1;
        w[u] = valid ? (psw ? psw[p] : 1.f) : 0.f;
        kept += valid;
      }
      float val[kRowsInFlight][kPerLane];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          const int64_t d = d0 + lane + 32 * j;
          val[u][j] = row[u] >= 0 && d < D ? static_cast<float>(table[row[u] * D + d]) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) acc[j] += w[u] * val[u][j];
      }
    }
    const float scale = (pooling == kMean && kept > 0) ? 1.f / static_cast<float>(kept) : 1.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = d0 + lane + 32 * j;
      if (d < D) out[b * output_dim + m.d_off[t] + d] = static_cast<scalar_t>(acc[j] * scale);
    }
  }
}

// Gradient of per_sample_weights, decomposed as the forward (one warp per (table, bag)): for each
// index p of the bag, the lanes' partial dots of its weight row with the bag's gradient row (or
// row p for pooling "none") are reduced across the warp; lane 0 writes grad[p] (0 when dropped),
// divided by the bag's kept length for mean pooling (FBGEMM TBE: weighted sum / length).
// FLOPs 2 * N * D; bytes N * D * s + B * sum D * s + N * (4 + i).
template <typename scalar_t, typename index_t>
__global__ void embedding_bag_psw_grad_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ weights,
                                              const TableMeta m, const index_t* __restrict__ indices,
                                              const index_t* __restrict__ offsets, float* __restrict__ grad_psw,
                                              int64_t grad_stride, int64_t pooling) {
  const auto [tb, t, b, D, rows, table, valid] = warp_bag(weights, m);
  if (!valid) return;
  const int lane = threadIdx.x;
  // Mean pooling: the bag's output is divided by its kept length, so is every index's gradient.
  float scale = 1.f;
  if (pooling == kMean) {
    int64_t kept = 0;
    for (int64_t p = offsets[tb]; p < offsets[tb + 1]; ++p) kept += (indices[p] >= 0 && indices[p] < rows);
    scale = kept > 0 ? 1.f / static_cast<float>(kept) : 0.f;
  }
  for (int64_t p = offsets[tb]; p < offsets[tb + 1]; ++p) {
    const int64_t idx = indices[p];
    const bool valid = idx >= 0 && idx < rows;  // warp-uniform
    const scalar_t* g = pooling == kNone ? grad + p * grad_stride : grad + b * grad_stride + m.d_off[t];
    float dot = 0.f;
    if (valid) {
      for (int64_t d = lane; d < D; d += 32) dot += static_cast<float>(g[d]) * static_cast<float>(table[idx * D + d]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) grad_psw[p] = dot * scale;
  }
}

struct OptimizerArgs {
  int64_t kind;
  float lr, eps, beta1, beta2, weight_decay, step_size, inv_bias2_sqrt;
};

// The summed gradient of columns d0 + lane + 32 j (j < kPerLane; 0 past D) of a unique row, whose
// lookups are order[first:last] (pooling decides which grad_output row src_rows[p] and columns from
// column0 they read). Each lookup's order -> src_rows, scale chain is loaded once per chunk, then
// its kPerLane columns together (a chain per column would leave one load in flight behind it).
template <typename scalar_t>
__device__ __forceinline__ void segment_grad(float (&g)[kPerLane], const scalar_t* __restrict__ grad,
                                             int64_t grad_stride, int64_t column0, int64_t d0, int64_t D, int lane,
                                             const int64_t* __restrict__ order, const int64_t* __restrict__ src_rows,
                                             const float* __restrict__ scale, int64_t first, int64_t last) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) g[j] = 0.f;
  for (int64_t i = first; i < last; ++i) {
    const int64_t p = order[i];
    const scalar_t* row = grad + src_rows[p] * grad_stride + column0;
    const float s = scale[p];
    float v[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = d0 + lane + 32 * j;
      v[j] = d < D ? static_cast<float>(row[d]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) g[j] += v[j] * s;
  }
}

template <typename scalar_t>
__global__ void embedding_bag_bwd_kernel(const scalar_t* __restrict__ grad, scalar_t* __restrict__ weights,
                                         float* __restrict__ m1, float* __restrict__ m2,
                                         const TableMeta m, const int64_t* __restrict__ seg,
                                         const int64_t* __restrict__ order, const int64_t* __restrict__ seg_tables,
                                         const int64_t* __restrict__ seg_rows, const int64_t* __restrict__ src_rows,
                                         const float* __restrict__ scale, int64_t num_unique, int64_t grad_stride,
                                         int64_t pooling, OptimizerArgs o) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y;
  if (u >= num_unique) return;
  const int lane = threadIdx.x;
  const int64_t t = seg_tables[u];
  const int64_t global_row = seg_rows[u];
  const int64_t D = m.d_off[t + 1] - m.d_off[t];
  const int64_t element = m.w_off[t] + (global_row - m.r_off[t]) * D;
  const int64_t column0 = pooling == kNone ? 0 : m.d_off[t];
  const int64_t first = seg[u];
  const int64_t last = seg[u + 1];
  // f(d, g) for every column d < D of the row this lane owns, g its summed gradient.
  const auto for_each_column = [&](auto&& f) {
    float g[kPerLane];
    for (int64_t d0 = 0; d0 < D; d0 += 32 * kPerLane) {
      segment_grad(g, grad, grad_stride, column0, d0, D, lane, order, src_rows, scale, first, last);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int64_t d = d0 + lane + 32 * j;
        if (d < D) f(d, g[j]);
      }
    }
  };
  float multiplier = 0.f;
  if (o.kind == kOptRowwiseAdagrad) {  // first pass: sum of g^2 over the row, reduced across the warp
    float sum_sq = 0.f;
    for_each_column([&](int64_t d, float g) {
      const float gd = g + o.weight_decay * static_cast<float>(weights[element + d]);
      sum_sq += gd * gd;
    });
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    const float state = m1[global_row] + sum_sq / static_cast<float>(D);
    __syncwarp();
    if (lane == 0) m1[global_row] = state;
    multiplier = o.lr / (sqrtf(state) + o.eps);
  }
  for_each_column([&](int64_t d, float g) {
    if (o.kind == kOptNone) {
      weights[element + d] = static_cast<scalar_t>(g);
      return;
    }
    float w = static_cast<float>(weights[element + d]);
    g += o.weight_decay * w;
    if (o.kind == kOptSgd) {
      w -= o.lr * g;
    } else if (o.kind == kOptRowwiseAdagrad) {
      w -= multiplier * g;
    } else {
      const float a = o.beta1 * m1[element + d] + (1.f - o.beta1) * g;
      const float v = o.beta2 * m2[element + d] + (1.f - o.beta2) * g * g;
      m1[element + d] = a;
      m2[element + d] = v;
      w -= o.step_size * a / (sqrtf(v) * o.inv_bias2_sqrt + o.eps);
    }
    weights[element + d] = static_cast<scalar_t>(w);
  });
}

void check_cuda_args(const at::Tensor& weights, const at::Tensor& indices, const at::Tensor& offsets,
                     const at::Tensor& per_sample_weights) {
  for (const auto* t : {&weights, &indices, &offsets}) {
    GK_CHECK_CUDA(*t);
    GK_CHECK_CONTIGUOUS(*t);
  }
  GK_CHECK_INDEX(indices);
  TORCH_CHECK(offsets.scalar_type() == indices.scalar_type(), "offsets must have indices' dtype");
  TORCH_CHECK(per_sample_weights.numel() == 0 || per_sample_weights.scalar_type() == at::kFloat,
              "per_sample_weights must be empty or fp32");
}

at::Tensor embedding_bag_forward_cuda(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                      const at::Tensor& D_offsets, const at::Tensor& rows_offsets,
                                      const at::Tensor& indices, const at::Tensor& offsets,
                                      const at::Tensor& per_sample_weights, int64_t output_dim, int64_t pooling,
                                      int64_t bounds_check) {
  check_cuda_args(weights, indices, offsets, per_sample_weights);
  const c10::cuda::CUDAGuard guard(weights.device());
  const TableMeta m = table_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights);
  auto out = at::empty({pooling == kNone ? indices.numel() : m.B, output_dim}, weights.options());
  if (m.T * m.B == 0 || out.numel() == 0) return out.zero_();
  const dim3 block(32, kWarps);
  const dim3 grid(static_cast<unsigned>((m.T * m.B + kWarps - 1) / kWarps));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "embedding_bag_fwd_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_bag_fwd_cuda_idx", [&] {
      embedding_bag_fwd_kernel<scalar_t, index_t><<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
          weights.data_ptr<scalar_t>(), m, indices.data_ptr<index_t>(), offsets.data_ptr<index_t>(),
          per_sample_weights.numel() ? per_sample_weights.data_ptr<float>() : nullptr, out.data_ptr<scalar_t>(),
          output_dim, pooling);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

// Segments of the kept lookups, with ATen ops: one per unique global row (rows_offsets[t] + row).
struct Segments {
  at::Tensor seg, order, seg_tables, seg_rows, src_rows, scale;
};

Segments make_segments(const TableMeta& m, const at::Tensor& rows_offsets, const at::Tensor& indices,
                       const at::Tensor& offsets, const at::Tensor& per_sample_weights, int64_t pooling) {
  const int64_t N = indices.numel();
  const int64_t T = m.T, B = m.B;
  const auto long_opts = indices.options().dtype(at::kLong);
  auto bag_ids = at::repeat_interleave(at::arange(T * B, long_opts), offsets.to(at::kLong).diff(), 0,
                                       std::optional<int64_t>(N));
  auto tables = at::floor_divide(bag_ids, std::max<int64_t>(B, 1));
  auto idx = indices.to(at::kLong);
  auto kept = idx.ge(0).logical_and(idx.lt(rows_offsets.diff().index_select(0, tables)));
  auto global_rows = rows_offsets.index_select(0, tables) + idx;
  auto scale = per_sample_weights.numel() ? per_sample_weights.clone() : at::ones({N}, indices.options().dtype(at::kFloat));
  if (pooling == kMean) {
    auto counts = at::zeros({T * B}, scale.options()).index_add_(0, bag_ids, kept.to(at::kFloat));
    scale = scale / counts.clamp_min(1).index_select(0, bag_ids);
  }
  auto src_rows = pooling == kNone ? at::arange(N, long_opts) : at::remainder(bag_ids, std::max<int64_t>(B, 1));
  auto positions = kept.nonzero().squeeze(1);
  auto [sorted_rows, perm] = at::sort(global_rows.index_select(0, positions), /*stable=*/true, 0, false);
  auto order = positions.index_select(0, perm);
  auto [unique_rows, inverse, counts] = at::unique_consecutive(sorted_rows, false, true);
  auto seg = at::zeros({unique_rows.numel() + 1}, long_opts);
  seg.slice(0, 1).copy_(counts.cumsum(0));
  auto seg_tables = at::searchsorted(rows_offsets, unique_rows, false, /*right=*/true) - 1;
  return {seg, order, seg_tables, unique_rows, src_rows, scale};
}

void launch_backward(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& momentum1,
                     const at::Tensor& momentum2, const TableMeta& m, const at::Tensor& rows_offsets,
                     const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& per_sample_weights,
                     int64_t pooling, const OptimizerArgs& o) {
  const Segments s = make_segments(m, rows_offsets, indices, offsets, per_sample_weights, pooling);
  const int64_t U = s.seg_rows.numel();
  if (U == 0) return;
  const dim3 block(32, kWarps);
  const dim3 grid(static_cast<unsigned>((U + kWarps - 1) / kWarps));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "embedding_bag_bwd_cuda", [&] {
    embedding_bag_bwd_kernel<scalar_t><<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
        grad_output.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>(),
        momentum1.numel() ? momentum1.data_ptr<float>() : nullptr,
        momentum2.numel() ? momentum2.data_ptr<float>() : nullptr, m, s.seg.data_ptr<int64_t>(),
        s.order.data_ptr<int64_t>(), s.seg_tables.data_ptr<int64_t>(), s.seg_rows.data_ptr<int64_t>(),
        s.src_rows.data_ptr<int64_t>(), s.scale.data_ptr<float>(), U, grad_output.size(1), pooling, o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor embedding_bag_backward_cuda(const at::Tensor& grad_output, const at::Tensor& weights,
                                       const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                                       const at::Tensor& rows_offsets, const at::Tensor& indices,
                                       const at::Tensor& offsets, const at::Tensor& per_sample_weights,
                                       int64_t pooling) {
  check_cuda_args(weights, indices, offsets, per_sample_weights);
  GK_CHECK_CUDA(grad_output);
  GK_CHECK_CONTIGUOUS(grad_output);
  const c10::cuda::CUDAGuard guard(weights.device());
  auto grad_weights = at::zeros_like(weights);
  const at::Tensor none = at::empty({0}, weights.options().dtype(at::kFloat));
  launch_backward(grad_output, grad_weights, none, none,
                  table_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights), rows_offsets, indices,
                  offsets, per_sample_weights, pooling, OptimizerArgs{kOptNone, 0, 0, 0, 0, 0, 0, 0});
  return grad_weights;
}

void embedding_bag_backward_fused_cuda(const at::Tensor& grad_output, const at::Tensor& weights,
                                       const at::Tensor& momentum1, const at::Tensor& momentum2,
                                       const at::Tensor& step, const at::Tensor& weights_offsets,
                                       const at::Tensor& D_offsets, const at::Tensor& rows_offsets,
                                       const at::Tensor& indices, const at::Tensor& offsets,
                                       const at::Tensor& per_sample_weights, int64_t pooling, int64_t optimizer,
                                       double lr, double eps, double beta1, double beta2, double weight_decay) {
  check_cuda_args(weights, indices, offsets, per_sample_weights);
  GK_CHECK_CUDA(grad_output);
  GK_CHECK_CONTIGUOUS(grad_output);
  TORCH_CHECK(optimizer >= 1 && optimizer <= 3, "bad optimizer code ", optimizer);
  const c10::cuda::CUDAGuard guard(weights.device());
  step.add_(1);
  const double step_value = static_cast<double>(step.item<int64_t>());  // one sync: Adam's bias corrections
  OptimizerArgs o{optimizer, float(lr), float(eps), float(beta1), float(beta2), float(weight_decay), 0.f, 0.f};
  if (optimizer == kOptAdam) {
    o.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, step_value)));
    o.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, step_value)));
  }
  launch_backward(grad_output, weights, momentum1, momentum2,
                  table_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights), rows_offsets, indices,
                  offsets, per_sample_weights, pooling, o);
}

at::Tensor embedding_bag_per_sample_weights_backward_cuda(const at::Tensor& grad_output, const at::Tensor& weights,
                                                          const at::Tensor& weights_offsets,
                                                          const at::Tensor& D_offsets, const at::Tensor& rows_offsets,
                                                          const at::Tensor& indices, const at::Tensor& offsets,
                                                          int64_t pooling) {
  check_cuda_args(weights, indices, offsets, at::empty({0}, weights.options().dtype(at::kFloat)));
  GK_CHECK_CUDA(grad_output);
  GK_CHECK_CONTIGUOUS(grad_output);
  TORCH_CHECK(grad_output.dim() == 2 && grad_output.scalar_type() == weights.scalar_type(),
              "grad_output must be 2-D with weights' dtype");
  TORCH_CHECK(pooling >= kSum && pooling <= kNone, "bad pooling code ", pooling);
  const c10::cuda::CUDAGuard guard(weights.device());
  const TableMeta m = table_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights);
  auto grad_psw = at::zeros({indices.numel()}, weights.options().dtype(at::kFloat));
  if (m.T * m.B == 0 || indices.numel() == 0) return grad_psw;
  const dim3 block(32, kWarps);
  const dim3 grid(static_cast<unsigned>((m.T * m.B + kWarps - 1) / kWarps));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "embedding_bag_psw_grad_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_bag_psw_grad_cuda_idx", [&] {
      embedding_bag_psw_grad_kernel<scalar_t, index_t><<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
          grad_output.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>(), m, indices.data_ptr<index_t>(),
          offsets.data_ptr<index_t>(), grad_psw.data_ptr<float>(), grad_output.size(1), pooling);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return grad_psw;
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) {
  m.impl("embedding_bag_forward_native", &embedding_bag_forward_cuda);
  m.impl("embedding_bag_backward_native", &embedding_bag_backward_cuda);
  m.impl("embedding_bag_backward_fused_native", &embedding_bag_backward_fused_cuda);
  m.impl("embedding_bag_per_sample_weights_backward_native", &embedding_bag_per_sample_weights_backward_cuda);
}

}  // namespace gem_kernels
