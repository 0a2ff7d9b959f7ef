// CUDA kernels of the interaction family: DLRM dot interaction, DCNv2 cross-layer epilogues,
// Wukong fm_compress and feature_mix_norm. Compiled for sm_80 and sm_90a.
//
// Work decomposition:
// - dot_interaction fwd: one block per sample. The sample's X [F, D] is staged in shared memory as
//   fp32 (row stride D + 1 against bank conflicts) when it fits in 48 KiB, else read through L1
//   from global memory; thread t owns the pairs (i, j), j >= i + off, of the flattened F x F grid
//   t, t + blockDim, ... and writes each at its packed upper-triangle index. Nothing [B, F, F] is
//   materialised. bwd: grad_x = sym(G) X as a tiled GEMM, one block per (sample, 32-row tile,
//   32-column tile) walking j in 32-wide chunks, sym(G) tiles rebuilt from the packed gradient in
//   shared memory (fixed 8.5 KiB, so any F works); 4*B*P*D FLOPs, B*(P + 2*F*D)*s bytes.
// - cross_layer: the matmuls are at::addmm / at::mm (cuBLAS); the epilogues out = x0 * z + xl and
//   (grad_z, grad_x0) = (g * x0, g * z) are one elementwise grid-stride kernel each.
// - fm_compress: one block per sample, A = X^T Y [D, k] and S = X A [F, k] in shared memory (X is
//   read from global memory through L1), the LayerNorm statistics by a block reduction, fp32
//   throughout. bwd recomputes A and S, forms grad_S in shared memory, grad_A = X^T grad_S, writes
//   grad_X = grad_S A^T + Y grad_A^T and per-sample fp32 partials of grad_Y and the LayerNorm
//   parameter gradients, which at::sum reduces over the batch.
//
// - feature_mix_norm: a warp per output row (b, o), kMixWarps rows per block: lanes stride over D,
//   s[c] = fm + sum_f M[o, f] X[b, f, c] (X and M through L1: the block's warps share a sample),
//   the row kept in shared memory, the LayerNorm statistics by warp shuffles. bwd recomputes the
//   row, writes grad_S (fp32 [B, O, D]), grad_fm and per-block fp32 partials of the LayerNorm
//   parameter gradients (a block reduction over its warps' rows); grad_X = M^T grad_S and
//   grad_M = sum_b grad_S X_b^T are at::matmul / at::einsum (cuBLAS).
//
// Roofline (s = element size): dot_interaction fwd 2*B*P*D FLOPs, B*(F*D + P)*s bytes;
// fm_compress fwd 4*B*F*D*k FLOPs, (B*F*D + B*F*k)*s bytes; feature_mix_norm fwd 2*B*O*F*D
// (+ ~8*B*O*D) FLOPs, (B*F*D + B*O_fm*D + B*O*D + O*F + 2*D)*s bytes, bwd 4*B*O*F*D FLOPs (+ the
// recomputed S) and about twice the forward's bytes plus grad_S's fp32 4*B*O*D written and read
// back. All memory bound at D <= ~128 on an H100/H200 (see gem_kernels/flops.py). Index math over
// the batch is 64-bit.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "gem_kernels/checks.h"
#include "gem_kernels/cuda_smem.h"
#include "gem_kernels/interaction_checks.h"

namespace gem_kernels {
namespace {

constexpr int kThreads = 256;
constexpr size_t kDefaultSmem = 48 * 1024;

__device__ __forceinline__ int64_t pair_index(int64_t i, int64_t j, int64_t F, int64_t off) {
  return i * (F - off) - i * (i - 1) / 2 + j - i - off;
}

// Sum of v over the block (every thread gets it). `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = lane < warps ? scratch[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// ------------------------------------------------------------------------------------------------
// dot_interaction
// ------------------------------------------------------------------------------------------------

template <typename scalar_t, bool kSmem>
__global__ void dot_interaction_fwd_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out, int64_t F,
                                           int64_t D, int64_t P, int64_t off) {
  extern __shared__ float smem[];
  const int64_t b = blockIdx.x;
  const scalar_t* xb = x + b * F * D;
  const int64_t ld = D + 1;
  if (kSmem) {
    for (int64_t e = threadIdx.x; e < F * D; e += blockDim.x) smem[(e / D) * ld + e % D] = static_cast<float>(xb[e]);
    __syncthreads();
  }
  for (int64_t e = threadIdx.x; e < F * F; e += blockDim.x) {
    const int64_t i = e / F, j = e % F;
    if (j < i + off) continue;
    float acc = 0.f;
    if (kSmem) {
      for (int64_t d = 0; d < D; ++d) acc += smem[i * ld + d] * smem[j * ld + d];
    } else {
      for (int64_t d = 0; d < D; ++d) acc += static_cast<float>(xb[i * D + d]) * static_cast<float>(xb[j * D + d]);
    }
    out[b * P + pair_index(i, j, F, off)] = static_cast<scalar_t>(acc);
  }
}

// grad_x = sym(G) X per sample, as a tiled GEMM so that any F fits: block (b, i-tile, d-tile) owns
// grad_x[b, i0 : i0 + kBwdTileI, d0 : d0 + kBwdTileD] and walks j in kBwdTileJ chunks, staging the
// sym(G) tile (rebuilt from the packed gradient) and the X tile in 8.5 KiB of shared memory. Thread
// (tx, ty) owns column d0 + tx of rows i0 + ty + kBwdRowStep * r: a warp shares one row, so its sym(G)
// reads are broadcasts and its X reads one conflict-free row. X is re-read ceil(F / kBwdTileI)
// times and the packed gradient ceil(D / kBwdTileD) times, from L2 in the common case.
constexpr int kBwdTileI = 32, kBwdTileJ = 32, kBwdTileD = 32, kBwdRowStep = 8;
constexpr int kBwdRowsPerThread = kBwdTileI / kBwdRowStep;

template <typename scalar_t>
__global__ void __launch_bounds__(kBwdTileD * kBwdRowStep)
dot_interaction_bwd_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ x,
                           scalar_t* __restrict__ grad_x, int64_t F, int64_t D, int64_t P, int64_t off) {
  __shared__ float gs[kBwdTileI][kBwdTileJ];
  __shared__ float xs[kBwdTileJ][kBwdTileD + 1];
  const int64_t b = blockIdx.x, i0 = static_cast<int64_t>(blockIdx.y) * kBwdTileI,
                d0 = static_cast<int64_t>(blockIdx.z) * kBwdTileD;
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kBwdTileD + tx;
  const scalar_t* g = grad_out + b * P;
  const scalar_t* xb = x + b * F * D;
  float acc[kBwdRowsPerThread] = {};
  for (int64_t j0 = 0; j0 < F; j0 += kBwdTileJ) {
    for (int e = tid; e < kBwdTileI * kBwdTileJ; e += kBwdTileD * kBwdRowStep) {
      const int64_t i = i0 + e / kBwdTileJ, j = j0 + e % kBwdTileJ;
      float v = 0.f;
      if (i < F && j < F) {
        const int64_t lo = min(i, j), hi = max(i, j);
        if (hi >= lo + off) v = static_cast<float>(g[pair_index(lo, hi, F, off)]);
        if (i == j) v *= 2.f;  // d<x_i, x_i>/dx_i = 2 x_i
      }
      gs[e / kBwdTileJ][e % kBwdTileJ] = v;
    }
    for (int e = tid; e < kBwdTileJ * kBwdTileD; e += kBwdTileD * kBwdRowStep) {
      const int64_t j = j0 + e / kBwdTileD, d = d0 + e % kBwdTileD;
      xs[e / kBwdTileD][e % kBwdTileD] = j < F && d < D ? static_cast<float>(xb[j * D + d]) : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int jj = 0; jj < kBwdTileJ; ++jj) {
      const float xv = xs[jj][tx];
#pragma unroll
      for (int r = 0; r < kBwdRowsPerThread; ++r) acc[r] += gs[ty + kBwdRowStep * r][jj] * xv;
    }
    __syncthreads();
  }
  const int64_t d = d0 + tx;
  if (d >= D) return;
#pragma unroll
  for (int r = 0; r < kBwdRowsPerThread; ++r) {
    const int64_t i = i0 + ty + kBwdRowStep * r;
    if (i < F) grad_x[(b * F + i) * D + d] = static_cast<scalar_t>(acc[r]);
  }
}

std::string fm_sizes(int64_t F, int64_t D, int64_t k) {
  return "F = " + std::to_string(F) + ", D = " + std::to_string(D) + ", fm_rank k = " + std::to_string(k);
}

at::Tensor dot_interaction_cuda(const at::Tensor& x, bool self_interaction) {
  GK_CHECK_CUDA(x);
  interaction_checks::dot_interaction(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2);
  const int64_t off = self_interaction ? 0 : 1;
  const int64_t P = interaction_checks::num_pairs(F, self_interaction);
  auto out = at::empty({B, P}, x.options());
  if (out.numel() == 0) return out;
  const size_t smem = static_cast<size_t>(F) * (D + 1) * sizeof(float);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dot_interaction_cuda", [&] {
    if (smem <= kDefaultSmem) {
      dot_interaction_fwd_kernel<scalar_t, true><<<B, kThreads, smem, stream>>>(
          x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), F, D, P, off);
    } else {
      dot_interaction_fwd_kernel<scalar_t, false><<<B, kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), F, D, P, off);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor dot_interaction_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, bool self_interaction) {
  GK_CHECK_CUDA(x);
  interaction_checks::dot_interaction_backward(grad_out, x, self_interaction);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2);
  const int64_t off = self_interaction ? 0 : 1;
  const int64_t P = interaction_checks::num_pairs(F, self_interaction);
  auto grad_x = at::empty_like(x);
  if (grad_x.numel() == 0) return grad_x;
  TORCH_CHECK((F + kBwdTileI - 1) / kBwdTileI <= 65535 && (D + kBwdTileD - 1) / kBwdTileD <= 65535,
              "dot_interaction backward: F and D must be at most ", 65535 * kBwdTileI);
  const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>((F + kBwdTileI - 1) / kBwdTileI),
                  static_cast<unsigned>((D + kBwdTileD - 1) / kBwdTileD));
  const dim3 block(kBwdTileD, kBwdRowStep);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dot_interaction_backward_cuda", [&] {
    dot_interaction_bwd_kernel<scalar_t><<<grid, block, 0, stream>>>(
        grad_out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), grad_x.data_ptr<scalar_t>(), F, D, P, off);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_x;
}

// ------------------------------------------------------------------------------------------------
// cross_layer epilogues
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
__global__ void cross_layer_fwd_kernel(const scalar_t* __restrict__ x0, const scalar_t* __restrict__ z,
                                       const scalar_t* __restrict__ xl, scalar_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = static_cast<scalar_t>(static_cast<float>(x0[i]) * static_cast<float>(z[i]) + static_cast<float>(xl[i]));
}

template <typename scalar_t>
__global__ void cross_layer_bwd_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x0,
                                       const scalar_t* __restrict__ z, scalar_t* __restrict__ grad_z,
                                       scalar_t* __restrict__ grad_x0, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = static_cast<float>(g[i]);
    grad_z[i] = static_cast<scalar_t>(gv * static_cast<float>(x0[i]));
    grad_x0[i] = static_cast<scalar_t>(gv * static_cast<float>(z[i]));
  }
}

int elementwise_blocks(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_layer_cuda(const at::Tensor& x0, const at::Tensor& xl,
                                                                const at::Tensor& u, const at::Tensor& v,
                                                                const at::Tensor& bias) {
  GK_CHECK_CUDA(x0);
  const bool low_rank = interaction_checks::cross_layer(x0, xl, u, v, bias);
  const c10::cuda::CUDAGuard guard(x0.device());
  at::Tensor p = low_rank ? at::mm(xl, v.t()) : at::empty({0}, xl.options());
  at::Tensor z = at::addmm(bias, low_rank ? p : xl, u.t());
  auto out = at::empty_like(xl);
  const int64_t n = out.numel();
  if (n == 0) return {out, z, p};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x0.scalar_type(), "cross_layer_cuda", [&] {
    cross_layer_fwd_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(
        x0.data_ptr<scalar_t>(), z.data_ptr<scalar_t>(), xl.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, z, p};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_layer_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x0, const at::Tensor& xl, const at::Tensor& u,
    const at::Tensor& v, const at::Tensor& z, const at::Tensor& p) {
  GK_CHECK_CUDA(x0);
  const bool low_rank = interaction_checks::cross_layer_backward(grad_out, x0, xl, u, v, z, p);
  const c10::cuda::CUDAGuard guard(x0.device());
  auto grad_z = at::empty_like(x0);
  auto grad_x0 = at::empty_like(x0);
  const int64_t n = x0.numel();
  if (n > 0) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x0.scalar_type(), "cross_layer_backward_cuda", [&] {
      cross_layer_bwd_kernel<scalar_t><<<elementwise_blocks(n), kThreads, 0, stream>>>(
          grad_out.data_ptr<scalar_t>(), x0.data_ptr<scalar_t>(), z.data_ptr<scalar_t>(),
          grad_z.data_ptr<scalar_t>(), grad_x0.data_ptr<scalar_t>(), n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  auto grad_bias = grad_z.sum(0, /*keepdim=*/false, at::kFloat).to(x0.scalar_type());
  at::Tensor grad_u, grad_v, grad_xl;
  if (low_rank) {
    grad_u = at::mm(grad_z.t(), p);
    auto grad_p = at::mm(grad_z, u);
    grad_v = at::mm(grad_p.t(), xl);
    grad_xl = at::addmm(grad_out, grad_p, v);
  } else {
    grad_u = at::mm(grad_z.t(), xl);
    grad_v = at::empty({0}, x0.options());
    grad_xl = at::addmm(grad_out, grad_z, u);
  }
  return {grad_x0, grad_xl, grad_u, grad_v, grad_bias};
}

// ------------------------------------------------------------------------------------------------
// fm_compress
// ------------------------------------------------------------------------------------------------

// a[d, j] = sum_f x[f, d] * y[f, j]  (A = X^T Y, [D, k] in shared memory)
template <typename scalar_t, typename y_t>
__device__ void fm_xt_times(const scalar_t* xb, const y_t* y, int64_t F, int64_t D, int64_t k, float* a) {
  for (int64_t e = threadIdx.x; e < D * k; e += blockDim.x) {
    const int64_t d = e / k, j = e % k;
    float acc = 0.f;
    for (int64_t f = 0; f < F; ++f) acc += static_cast<float>(xb[f * D + d]) * static_cast<float>(y[f * k + j]);
    a[e] = acc;
  }
}

// s[f, j] = sum_d x[f, d] * a[d, j]  (S = X A, [F, k] in shared memory)
template <typename scalar_t>
__device__ void fm_x_times(const scalar_t* xb, const float* a, int64_t F, int64_t D, int64_t k, float* s) {
  for (int64_t e = threadIdx.x; e < F * k; e += blockDim.x) {
    const int64_t f = e / k, j = e % k;
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += static_cast<float>(xb[f * D + d]) * a[d * k + j];
    s[e] = acc;
  }
}

template <typename scalar_t>
__global__ void fm_compress_fwd_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ y,
                                       const scalar_t* __restrict__ w, const scalar_t* __restrict__ bias,
                                       scalar_t* __restrict__ out, float* __restrict__ mean_out,
                                       float* __restrict__ rstd_out, int64_t F, int64_t D, int64_t k, float eps) {
  extern __shared__ float smem[];
  __shared__ float scratch[32];
  float* a = smem;          // [D, k]
  float* s = smem + D * k;  // [F, k]
  const int64_t b = blockIdx.x, n = F * k;
  const scalar_t* xb = x + b * F * D;
  fm_xt_times(xb, y, F, D, k, a);
  __syncthreads();
  fm_x_times(xb, a, F, D, k, s);
  __syncthreads();
  float part = 0.f;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) part += s[e];
  const float mean = block_sum(part, scratch) / n;
  part = 0.f;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) part += (s[e] - mean) * (s[e] - mean);
  const float rstd = rsqrtf(block_sum(part, scratch) / n + eps);
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x)
    out[b * n + e] = static_cast<scalar_t>((s[e] - mean) * rstd * static_cast<float>(w[e]) + static_cast<float>(bias[e]));
  if (threadIdx.x == 0) {
    mean_out[b] = mean;
    rstd_out[b] = rstd;
  }
}

template <typename scalar_t>
__global__ void fm_compress_bwd_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ x,
                                       const scalar_t* __restrict__ y, const scalar_t* __restrict__ w,
                                       const float* __restrict__ mean_in, const float* __restrict__ rstd_in,
                                       scalar_t* __restrict__ grad_x, float* __restrict__ part_y,
                                       float* __restrict__ part_w, float* __restrict__ part_b, int64_t F, int64_t D,
                                       int64_t k) {
  extern __shared__ float smem[];
  __shared__ float scratch[32];
  float* a = smem;              // [D, k]   A = X^T Y
  float* s = a + D * k;         // [F, k]   S, then grad_S
  float* da = s + F * k;        // [D, k]   grad_A = X^T grad_S
  const int64_t b = blockIdx.x, n = F * k;
  const scalar_t* xb = x + b * F * D;
  const scalar_t* g = grad_out + b * n;
  fm_xt_times(xb, y, F, D, k, a);
  __syncthreads();
  fm_x_times(xb, a, F, D, k, s);
  __syncthreads();
  const float mean = mean_in[b], rstd = rstd_in[b];
  float c1 = 0.f, c2 = 0.f;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const float gv = static_cast<float>(g[e]);
    const float xhat = (s[e] - mean) * rstd;
    const float gh = gv * static_cast<float>(w[e]);
    part_w[b * n + e] = gv * xhat;
    part_b[b * n + e] = gv;
    c1 += gh;
    c2 += gh * xhat;
  }
  c1 = block_sum(c1, scratch) / n;
  c2 = block_sum(c2, scratch) / n;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const float xhat = (s[e] - mean) * rstd;
    const float gh = static_cast<float>(g[e]) * static_cast<float>(w[e]);
    s[e] = rstd * (gh - c1 - xhat * c2);  // each thread rewrites only its own elements
  }
  __syncthreads();
  fm_xt_times(xb, s, F, D, k, da);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < F * D; e += blockDim.x) {
    const int64_t f = e / D, d = e % D;
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) acc += s[f * k + j] * a[d * k + j] + static_cast<float>(y[f * k + j]) * da[d * k + j];
    grad_x[b * F * D + e] = static_cast<scalar_t>(acc);
  }
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int64_t f = e / k, j = e % k;
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += static_cast<float>(xb[f * D + d]) * da[d * k + j];
    part_y[b * n + e] = acc;
  }
}

// `save_products` is ignored: the backward recomputes X^T Y and S (returned `products` is empty),
// since this kernel is memory bound and saving them (4*(D + F)*k bytes per sample) costs more
// traffic than their 4*F*D*k FLOPs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fm_compress_cuda(
    const at::Tensor& x, const at::Tensor& y, const at::Tensor& ln_weight, const at::Tensor& ln_bias, double eps,
    bool /*save_products*/) {
  GK_CHECK_CUDA(x);
  interaction_checks::fm_compress(x, y, ln_weight, ln_bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2), k = y.size(1);
  auto out = at::empty({B, F * k}, x.options());
  auto mean = at::empty({B}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({B}, x.options().dtype(at::kFloat));
  auto products = at::empty({0, k * D + F * k}, x.options().dtype(at::kFloat));
  if (B == 0) return {out, mean, rstd, products};
  const size_t smem = static_cast<size_t>(D * k + F * k) * sizeof(float);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fm_compress_cuda", [&] {
    auto kernel = fm_compress_fwd_kernel<scalar_t>;
    prepare_dynamic_smem(kernel, smem, "fm_compress", fm_sizes(F, D, k));
    kernel<<<B, kThreads, smem, stream>>>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                          ln_weight.data_ptr<scalar_t>(), ln_bias.data_ptr<scalar_t>(),
                                          out.data_ptr<scalar_t>(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                          F, D, k, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, mean, rstd, products};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fm_compress_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& y, const at::Tensor& ln_weight,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& /*products: always empty here*/) {
  GK_CHECK_CUDA(x);
  interaction_checks::fm_compress_backward(grad_out, x, y, ln_weight, mean, rstd);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2), k = y.size(1);
  auto grad_x = at::empty_like(x);
  auto part_y = at::empty({B, F, k}, x.options().dtype(at::kFloat));
  auto part_w = at::empty({B, F * k}, x.options().dtype(at::kFloat));
  auto part_b = at::empty({B, F * k}, x.options().dtype(at::kFloat));
  if (B > 0) {
    const size_t smem = static_cast<size_t>(2 * D * k + F * k) * sizeof(float);
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fm_compress_backward_cuda", [&] {
      auto kernel = fm_compress_bwd_kernel<scalar_t>;
      prepare_dynamic_smem(kernel, smem, "fm_compress backward", fm_sizes(F, D, k));
      kernel<<<B, kThreads, smem, stream>>>(grad_out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                            y.data_ptr<scalar_t>(), ln_weight.data_ptr<scalar_t>(),
                                            mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                            grad_x.data_ptr<scalar_t>(), part_y.data_ptr<float>(),
                                            part_w.data_ptr<float>(), part_b.data_ptr<float>(), F, D, k);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  const auto dt = x.scalar_type();
  return {grad_x, part_y.sum(0).to(dt), part_w.sum(0).to(dt), part_b.sum(0).to(dt)};
}

// ------------------------------------------------------------------------------------------------
// feature_mix_norm
// ------------------------------------------------------------------------------------------------

constexpr int kMixWarps = 8;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// s[c] (c = lane, lane + 32, ... < D) = fm[b, o, c] (o < O_fm) + sum_f M[o, f] X[b, f, c]; returns the
// lane's part of the row sum. Each lane reads back only the columns it wrote.
template <typename scalar_t>
__device__ float mix_row(const scalar_t* __restrict__ x, const scalar_t* __restrict__ mix,
                         const scalar_t* __restrict__ fm, int64_t b, int64_t o, int64_t F, int64_t D, int64_t Ofm,
                         float* s) {
  const int lane = threadIdx.x & 31;
  const scalar_t* xb = x + b * F * D;
  const scalar_t* m = mix + o * F;
  float sum = 0.f;
  for (int64_t c = lane; c < D; c += 32) {
    float acc = o < Ofm ? static_cast<float>(fm[(b * Ofm + o) * D + c]) : 0.f;
    for (int64_t f = 0; f < F; ++f) acc += static_cast<float>(m[f]) * static_cast<float>(xb[f * D + c]);
    s[c] = acc;
    sum += acc;
  }
  return sum;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kMixWarps * 32)
feature_mix_norm_fwd_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ mix,
                            const scalar_t* __restrict__ fm, const scalar_t* __restrict__ w,
                            const scalar_t* __restrict__ bias, scalar_t* __restrict__ out,
                            float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int64_t F,
                            int64_t D, int64_t O, int64_t Ofm, float eps) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMixWarps + warp;
  if (row >= rows) return;  // a whole warp: no block barrier below
  const int64_t b = row / O, o = row % O;
  float* s = smem + warp * D;
  const float mean = warp_sum(mix_row(x, mix, fm, b, o, F, D, Ofm, s)) / D;
  float sq = 0.f;
  for (int64_t c = lane; c < D; c += 32) sq += (s[c] - mean) * (s[c] - mean);
  const float rstd = rsqrtf(warp_sum(sq) / D + eps);
  for (int64_t c = lane; c < D; c += 32)
    out[row * D + c] =
        static_cast<scalar_t>((s[c] - mean) * rstd * static_cast<float>(w[c]) + static_cast<float>(bias[c]));
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// Shared memory: the warps' rows s [kMixWarps, D], then g * x_hat and g [kMixWarps, D] each for the
// block's partial of the LayerNorm parameter gradients.
template <typename scalar_t>
__global__ void __launch_bounds__(kMixWarps * 32)
feature_mix_norm_bwd_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ x,
                            const scalar_t* __restrict__ mix, const scalar_t* __restrict__ fm,
                            const scalar_t* __restrict__ w, const float* __restrict__ mean_in,
                            const float* __restrict__ rstd_in, float* __restrict__ grad_s,
                            scalar_t* __restrict__ grad_fm, float* __restrict__ part, int64_t rows, int64_t F,
                            int64_t D, int64_t O, int64_t Ofm) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMixWarps + warp;
  float* s = smem + warp * D;
  float* gx = smem + (kMixWarps + warp) * D;
  float* gg = smem + (2 * kMixWarps + warp) * D;
  if (row < rows) {  // every warp reaches the barrier below
    const int64_t b = row / O, o = row % O;
    mix_row(x, mix, fm, b, o, F, D, Ofm, s);
    const float mean = mean_in[row], rstd = rstd_in[row];
    const scalar_t* g = grad_out + row * D;
    float c1 = 0.f, c2 = 0.f;
    for (int64_t c = lane; c < D; c += 32) {
      const float gv = static_cast<float>(g[c]);
      const float xhat = (s[c] - mean) * rstd;
      const float gh = gv * static_cast<float>(w[c]);
      gx[c] = gv * xhat;
      gg[c] = gv;
      c1 += gh;
      c2 += gh * xhat;
    }
    c1 = warp_sum(c1) / D;
    c2 = warp_sum(c2) / D;
    for (int64_t c = lane; c < D; c += 32) {
      const float xhat = (s[c] - mean) * rstd;
      const float gh = static_cast<float>(g[c]) * static_cast<float>(w[c]);
      const float ds = rstd * (gh - c1 - xhat * c2);
      grad_s[row * D + c] = ds;
      if (o < Ofm) grad_fm[(b * Ofm + o) * D + c] = static_cast<scalar_t>(ds);
    }
  } else {
    for (int64_t c = lane; c < D; c += 32) gx[c] = gg[c] = 0.f;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    float pw = 0.f, pb = 0.f;
    for (int r = 0; r < kMixWarps; ++r) {
      pw += smem[(kMixWarps + r) * D + c];
      pb += smem[(2 * kMixWarps + r) * D + c];
    }
    part[static_cast<int64_t>(blockIdx.x) * 2 * D + c] = pw;
    part[(static_cast<int64_t>(blockIdx.x) * 2 + 1) * D + c] = pb;
  }
}

std::string mix_sizes(int64_t D) { return "embedding dim D = " + std::to_string(D); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> feature_mix_norm_cuda(const at::Tensor& x, const at::Tensor& mix,
                                                                     const at::Tensor& fm, const at::Tensor& ln_weight,
                                                                     const at::Tensor& ln_bias, double eps) {
  GK_CHECK_CUDA(x);
  interaction_checks::feature_mix_norm(x, mix, fm, ln_weight, ln_bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2), O = mix.size(0), Ofm = fm.size(1);
  auto out = at::empty({B, O, D}, x.options());
  auto mean = at::empty({B, O}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({B, O}, x.options().dtype(at::kFloat));
  const int64_t rows = B * O;
  if (rows == 0) return {out, mean, rstd};
  const int64_t blocks = (rows + kMixWarps - 1) / kMixWarps;
  const size_t smem = static_cast<size_t>(kMixWarps * D) * sizeof(float);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "feature_mix_norm_cuda", [&] {
    auto kernel = feature_mix_norm_fwd_kernel<scalar_t>;
    prepare_dynamic_smem(kernel, smem, "feature_mix_norm", mix_sizes(D));
    kernel<<<blocks, kMixWarps * 32, smem, stream>>>(
        x.data_ptr<scalar_t>(), mix.data_ptr<scalar_t>(), Ofm ? fm.data_ptr<scalar_t>() : nullptr,
        ln_weight.data_ptr<scalar_t>(), ln_bias.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, F, D, O, Ofm, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feature_mix_norm_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mix, const at::Tensor& fm,
    const at::Tensor& ln_weight, const at::Tensor& mean, const at::Tensor& rstd) {
  GK_CHECK_CUDA(x);
  interaction_checks::feature_mix_norm_backward(grad_out, x, mix, fm, ln_weight, mean, rstd);
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2), O = mix.size(0), Ofm = fm.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dt = x.scalar_type();
  auto grad_fm = at::empty_like(fm);
  const int64_t rows = B * O;
  if (rows == 0)
    return {at::zeros_like(x), at::zeros_like(mix), grad_fm, at::zeros_like(ln_weight), at::zeros_like(ln_weight)};
  const int64_t blocks = (rows + kMixWarps - 1) / kMixWarps;
  auto grad_s = at::empty({B, O, D}, x.options().dtype(at::kFloat));
  auto part = at::empty({blocks, 2, D}, x.options().dtype(at::kFloat));
  const size_t smem = static_cast<size_t>(3 * kMixWarps * D) * sizeof(float);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "feature_mix_norm_backward_cuda", [&] {
    auto kernel = feature_mix_norm_bwd_kernel<scalar_t>;
    prepare_dynamic_smem(kernel, smem, "feature_mix_norm backward", mix_sizes(D));
    kernel<<<blocks, kMixWarps * 32, smem, stream>>>(
        grad_out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), mix.data_ptr<scalar_t>(),
        Ofm ? fm.data_ptr<scalar_t>() : nullptr, ln_weight.data_ptr<scalar_t>(), mean.data_ptr<float>(),
        rstd.data_ptr<float>(), grad_s.data_ptr<float>(), Ofm ? grad_fm.data_ptr<scalar_t>() : nullptr,
        part.data_ptr<float>(), rows, F, D, O, Ofm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  auto grad_x = at::matmul(mix.to(at::kFloat).t(), grad_s).to(dt);
  auto grad_mix = at::einsum("bod,bfd->of", {grad_s, x.to(at::kFloat)}).to(dt);
  auto sums = part.sum(0);
  return {grad_x, grad_mix, grad_fm, sums[0].to(dt).clone(), sums[1].to(dt).clone()};
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) {
  m.impl("dot_interaction_native", &dot_interaction_cuda);
  m.impl("dot_interaction_backward_native", &dot_interaction_backward_cuda);
  m.impl("cross_layer_native", &cross_layer_cuda);
  m.impl("cross_layer_backward_native", &cross_layer_backward_cuda);
  m.impl("fm_compress_native", &fm_compress_cuda);
  m.impl("fm_compress_backward_native", &fm_compress_backward_cuda);
  m.impl("feature_mix_norm_native", &feature_mix_norm_cuda);
  m.impl("feature_mix_norm_backward_native", &feature_mix_norm_backward_cuda);
}

}  // namespace gem_kernels
