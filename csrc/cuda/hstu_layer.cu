// CUDA kernels of the HSTU layer's two projection halves (generative-recommenders' STULayer; the
// attention between them is cuda/attention.cu). Maths in gem_kernels/reference/hstu_layer.py; the
// same decomposition as cpu/hstu_layer.cpp and triton/hstu_layer.py. fp32 throughout (fp16/bf16
// operands are converted on entry and the outputs back, as the cpu kernels do): the GEMM tiles are
// CUDA-core loops, so `auto` takes the triton kernels (tensor cores) first on CUDA tensors.
//
// Work decomposition:
// - norm_stats_kernel: one warp per (row, norm group), two passes over the group (mean, then the
//   biased variance about it, as torch's norms): the [N, 2G] fp32 stats (mean, rstd).
// - fused_gemm_kernel<Prologue, Epilogue>: one block of 256 threads per 64 x 64 output tile, K in
//   chunks of 16 staged in shared memory; thread (tx, ty) owns rows ty + 16 i and columns tx + 16 j
//   (i, j < 4), so the A reads are broadcasts and the W reads one conflict-free row. The A tile is
//   never read from memory as such: the Prologue builds each element from the layer's inputs.
//   - uvqk forward: A = LayerNorm(x) (LayerNormRows, from the row stats: no xn in memory), W one
//     column slice (u, v, q, k: one launch each, written straight into its own output), epilogue
//     bias + SiLU (v, q, k with silu_qkv). FLOPs 2*N*D*O; minimum bytes 4*(N*D + D*O + N*O).
//   - output forward: A = [silu(u)], [a], silu(u) * Norm(a) (times the dropout mask) (ConcatRows, from
//     attn, u_pre and the attention norm's stats: no [N, K] concat in memory), epilogue + x (the
//     residual) + bias. FLOPs 2*N*K*D; minimum bytes 4*(2*N*H*Lh + 2*N*D + K*D).
// - backward, recomputing what the cpu kernels recompute: xn from x and its stats, c from attn, u_pre
//   and the stats (prologue_kernel: the forward's Prologue written out, one thread per element), and
//   with silu_qkv the pre-activations of v, q, k (fused_gemm_kernel again, its epilogue multiplying
//   the incoming gradient by silu'(z)). The plain GEMMs (weight gradients, dxn = dz W^T, dc = g W^T)
//   are at::mm (cuBLAS). The norms' backward: one warp per (row, group) (layer_norm_bwd_kernel,
//   output_bwd_rows_kernel); the norm parameters' gradients by norm_param_grad_kernel, one thread per
//   column over a fixed chunk of rows in fp64, the chunks summed by at::sum (bit-identical run to run,
//   no atomics).
// Compiled for sm_90a only (nvcc 13, the build's flags, -Xptxas=-v), not run on a GPU: fused_gemm_kernel
// 64 registers and 8 KiB of static shared memory per instance (the LayerNormRows / UvqkStore one spills
// 4 bytes), the row kernels 28-72 registers, no spills.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "gem_kernels/checks.h"

namespace gem_kernels {
namespace {

using at::Tensor;

constexpr int kTile = 64;        // output tile rows and columns of fused_gemm_kernel
constexpr int kTileK = 16;       // K chunk staged in shared memory (2 x 4 KiB)
constexpr int kTileThreads = 16; // threads per tile side: 16 x 16 threads, 4 x 4 outputs each
constexpr int kPerThread = kTile / kTileThreads;
constexpr int kGemmThreads = kTileThreads * kTileThreads;
constexpr int kNormWarps = 8;    // warps per block of the row kernels
constexpr int kElementThreads = 256;
constexpr int64_t kParamRows = 256;  // rows per chunk of norm_param_grad_kernel

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float silu(float z) { return z / (1.0f + expf(-z)); }

// d silu(z) / dz = s * (1 + z * (1 - s)), s = sigmoid(z)
__device__ __forceinline__ float silu_grad(float z) {
  const float s = 1.0f / (1.0f + expf(-z));
  return s * (1.0f + z * (1.0f - s));
}

__global__ void norm_stats_kernel(const float* __restrict__ x, float* __restrict__ stats, int64_t pairs, int64_t groups,
                                  int64_t group_size, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  if (pair >= pairs) return;  // the whole warp: pair is uniform across it
  const int64_t row = pair / groups, g = pair % groups;
  const float* xg = x + row * groups * group_size + g * group_size;
  float s = 0.0f;
  for (int64_t j = lane; j < group_size; j += 32) s += xg[j];
  const float mean = warp_sum(s) / static_cast<float>(group_size);
  float q = 0.0f;
  for (int64_t j = lane; j < group_size; j += 32) {
    const float d = xg[j] - mean;
    q += d * d;
  }
  const float var = warp_sum(q) / static_cast<float>(group_size);
  if (lane == 0) {
    stats[row * 2 * groups + g] = mean;
    stats[row * 2 * groups + groups + g] = rsqrtf(var + eps);
  }
}

// The uvqk GEMM's A operand: xn = (x - mean) * rstd * weight + bias, from the row stats [N, 2].
struct LayerNormRows {
  const float* x;
  const float* stats;
  const float* weight;
  const float* bias;
  int64_t d;
  __device__ __forceinline__ float operator()(int64_t row, int64_t k) const {
    return (x[row * d + k] - stats[2 * row]) * stats[2 * row + 1] * weight[k] + bias[k];
  }
};

// The output GEMM's A operand: c = [silu(u)], [a], silu(u) * Norm(a), times the dropout mask; Norm over
// G groups of group_size (weight / bias per element, or per group with group_norm).
struct ConcatRows {
  const float* attn;
  const float* u;
  const float* stats;
  const float* weight;
  const float* bias;
  const float* mask;  // [N, K] or null
  int64_t width, k_total, groups, group_size;
  bool concat_u, concat_x, per_group;
  __device__ __forceinline__ float operator()(int64_t row, int64_t kk) const {
    // slot kk / width of c holds part 0 (u), 1 (a) or 2 (y), the absent ones skipped
    int part = static_cast<int>(kk / width) + (concat_u ? 0 : 1);
    if (!concat_x && part >= 1) part += 1;
    const int64_t e = kk % width;
    float c;
    if (part == 1) {
      c = attn[row * width + e];
    } else {
      c = silu(u[row * width + e]);
      if (part == 2) {
        const int64_t g = e / group_size;
        const float mean = stats[row * 2 * groups + g], rstd = stats[row * 2 * groups + groups + g];
        const int64_t p = per_group ? g : e;
        c *= (attn[row * width + e] - mean) * rstd * weight[p] + bias[p];
      }
    }
    return mask != nullptr ? c * mask[row * k_total + kk] : c;
  }
};

// z = acc + bias[col0 + col]; stores act(z) (SiLU when silu), or grad * silu'(z) when grad is given
// (the backward's dz of a silu_qkv slice).
struct UvqkStore {
  const float* bias;
  float* out;
  int64_t ld_out, col0;
  bool silu_out;
  const float* grad;
  int64_t ld_grad;
  __device__ __forceinline__ void operator()(int64_t row, int64_t col, float acc) const {
    float z = acc + bias[col0 + col];
    if (grad != nullptr) {
      z = grad[row * ld_grad + col] * silu_grad(z);
    } else if (silu_out) {
      z = silu(z);
    }
    out[row * ld_out + col] = z;
  }
};

// out = acc + x (the residual) + bias.
struct ResidualStore {
  const float* x;
  const float* bias;  // or null
  float* out;
  int64_t d;
  __device__ __forceinline__ void operator()(int64_t row, int64_t col, float acc) const {
    const int64_t i = row * d + col;
    out[i] = acc + x[i] + (bias != nullptr ? bias[col] : 0.0f);
  }
};

// Epilogue(row, col, A[M, K] @ W[K, N]) for A given by the Prologue, W row-major with leading dim ldw.
template <typename Prologue, typename Epilogue>
__global__ void __launch_bounds__(kGemmThreads)
fused_gemm_kernel(Prologue a, const float* __restrict__ w, int64_t ldw, int64_t M, int64_t N, int64_t K,
                  Epilogue epilogue) {
  __shared__ float as[kTileK][kTile];
  __shared__ float ws[kTileK][kTile];
  const int tid = threadIdx.x, tx = tid % kTileThreads, ty = tid / kTileThreads;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTile, n0 = static_cast<int64_t>(blockIdx.y) * kTile;
  float acc[kPerThread][kPerThread] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    for (int e = tid; e < kTile * kTileK; e += kGemmThreads) {
      const int r = e / kTileK, k = e % kTileK;
      const int64_t row = m0 + r, kk = k0 + k;
      as[k][r] = (row < M && kk < K) ? a(row, kk) : 0.0f;
    }
    for (int e = tid; e < kTile * kTileK; e += kGemmThreads) {
      const int k = e / kTile, c = e % kTile;
      const int64_t kk = k0 + k, col = n0 + c;
      ws[k][c] = (kk < K && col < N) ? w[kk * ldw + col] : 0.0f;
    }
    __syncthreads();
    for (int k = 0; k < kTileK; ++k) {
      float av[kPerThread], wv[kPerThread];
      for (int i = 0; i < kPerThread; ++i) av[i] = as[k][ty + kTileThreads * i];
      for (int j = 0; j < kPerThread; ++j) wv[j] = ws[k][tx + kTileThreads * j];
      for (int i = 0; i < kPerThread; ++i)
        for (int j = 0; j < kPerThread; ++j) acc[i][j] += av[i] * wv[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t row = m0 + ty + kTileThreads * i;
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t col = n0 + tx + kTileThreads * j;
      if (row < M && col < N) epilogue(row, col, acc[i][j]);
    }
  }
}

// out[row, k] = a(row, k) for [M, K]: the backward's recomputed xn or c.
template <typename Prologue>
__global__ void prologue_kernel(Prologue a, float* __restrict__ out, int64_t M, int64_t K) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < M * K;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a(i / K, i % K);
}

// The input LayerNorm's backward, one warp per row: dx = rstd * (g w - mean(g w) - xhat mean(g w xhat)),
// in fp64 as the cpu kernel's: the difference cancels and rstd amplifies what is left (in fp32 the
// emulated layer's dx missed FlashAttention's rule, 3x eager's error).
__global__ void layer_norm_bwd_kernel(const float* __restrict__ dxn, const float* __restrict__ x,
                                      const float* __restrict__ stats, const float* __restrict__ weight,
                                      float* __restrict__ dx, int64_t n, int64_t d) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const float mean = stats[2 * row], rstd = stats[2 * row + 1];
  const float* g = dxn + row * d;
  const float* xr = x + row * d;
  double m1 = 0.0, m2 = 0.0;
  for (int64_t j = lane; j < d; j += 32) {
    const double gh = static_cast<double>(g[j]) * weight[j];
    m1 += gh;
    m2 += gh * ((static_cast<double>(xr[j]) - mean) * rstd);
  }
  m1 = warp_sum(m1) / static_cast<double>(d);
  m2 = warp_sum(m2) / static_cast<double>(d);
  for (int64_t j = lane; j < d; j += 32) {
    const double xhat = (static_cast<double>(xr[j]) - mean) * rstd;
    dx[row * d + j] = static_cast<float>(rstd * (static_cast<double>(g[j]) * weight[j] - m1 - xhat * m2));
  }
}

// The output half's row backward, one warp per (row, norm group), from dc = g W^T [N, K]: du_pre,
// dattn (the norm's backward in fp64, as layer_norm_bwd_kernel), and dn = dy * silu(u) (the gradient
// reaching Norm's output, for norm_param_grad_kernel).
__global__ void output_bwd_rows_kernel(const float* __restrict__ dc, const float* __restrict__ attn,
                                       const float* __restrict__ u, const float* __restrict__ stats,
                                       const float* __restrict__ weight, const float* __restrict__ bias,
                                       const float* __restrict__ mask, float* __restrict__ dattn,
                                       float* __restrict__ du, float* __restrict__ dn, int64_t pairs, int64_t groups,
                                       int64_t group_size, int64_t k_total, bool concat_u, bool concat_x,
                                       bool per_group) {
  const int lane = threadIdx.x & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kNormWarps + (threadIdx.x >> 5);
  if (pair >= pairs) return;
  const int64_t row = pair / groups, g = pair % groups, width = groups * group_size;
  const int64_t y_off = width * ((concat_u ? 1 : 0) + (concat_x ? 1 : 0)), x_off = concat_u ? width : 0;
  const float mean = stats[row * 2 * groups + g], rstd = stats[row * 2 * groups + groups + g];
  const float* dcr = dc + row * k_total;
  const float* mr = mask != nullptr ? mask + row * k_total : nullptr;
  double m1 = 0.0, m2 = 0.0;
  for (int64_t j = lane; j < group_size; j += 32) {
    const int64_t e = g * group_size + j, i = row * width + e;
    const int64_t p = per_group ? g : e;
    const double xhat = (static_cast<double>(attn[i]) - mean) * rstd;
    const float dy = dcr[y_off + e] * (mr != nullptr ? mr[y_off + e] : 1.0f);
    float dut = dy * static_cast<float>(xhat * weight[p] + bias[p]);
    if (concat_u) dut += dcr[e] * (mr != nullptr ? mr[e] : 1.0f);
    du[i] = dut * silu_grad(u[i]);
    const float d = dy * silu(u[i]);
    dn[i] = d;
    m1 += static_cast<double>(d) * weight[p];
    m2 += static_cast<double>(d) * weight[p] * xhat;
  }
  m1 = warp_sum(m1) / static_cast<double>(group_size);
  m2 = warp_sum(m2) / static_cast<double>(group_size);
  for (int64_t j = lane; j < group_size; j += 32) {
    const int64_t e = g * group_size + j, i = row * width + e;
    const int64_t p = per_group ? g : e;
    const double xhat = (static_cast<double>(attn[i]) - mean) * rstd;
    float da = static_cast<float>(rstd * (static_cast<double>(dn[i]) * weight[p] - m1 - xhat * m2));
    if (concat_x) da += dcr[x_off + e] * (mr != nullptr ? mr[x_off + e] : 1.0f);
    dattn[i] = da;
  }
}

// Per-element partial sums of a norm's parameter gradients over one chunk of kParamRows rows:
// partials[chunk] = (sum dn * xhat, sum dn) [2, width] in fp64, xhat from x and the stats [N, 2G].
__global__ void norm_param_grad_kernel(const float* __restrict__ dn, const float* __restrict__ x,
                                       const float* __restrict__ stats, double* __restrict__ partials, int64_t n,
                                       int64_t width, int64_t groups, int64_t group_size) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= width) return;
  const int64_t g = col / group_size, r0 = static_cast<int64_t>(blockIdx.y) * kParamRows;
  const int64_t r1 = r0 + kParamRows < n ? r0 + kParamRows : n;
  double dw = 0.0, db = 0.0;
  for (int64_t r = r0; r < r1; ++r) {
    const double xhat = (static_cast<double>(x[r * width + col]) - stats[r * 2 * groups + g]) *
                        stats[r * 2 * groups + groups + g];
    dw += dn[r * width + col] * xhat;
    db += dn[r * width + col];
  }
  partials[blockIdx.y * 2 * width + col] = dw;
  partials[blockIdx.y * 2 * width + width + col] = db;
}

// ---------------------------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------------------------

Tensor as_float(const Tensor& t) { return t.to(at::kFloat).contiguous(); }

unsigned blocks_for(int64_t items, int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

Tensor norm_stats(const Tensor& x, int64_t groups, double eps) {
  const int64_t n = x.size(0);
  Tensor stats = at::empty({n, 2 * groups}, x.options());
  if (n == 0) return stats;
  norm_stats_kernel<<<blocks_for(n * groups, kNormWarps), kNormWarps * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), stats.data_ptr<float>(), n * groups, groups, x.size(1) / groups, static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return stats;
}

template <typename Prologue, typename Epilogue>
void fused_gemm(const Prologue& a, const float* w, int64_t ldw, int64_t m, int64_t n, int64_t k,
                const Epilogue& epilogue) {
  if (m == 0 || n == 0) return;
  const dim3 grid(blocks_for(m, kTile), blocks_for(n, kTile));
  fused_gemm_kernel<Prologue, Epilogue><<<grid, kGemmThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      a, w, ldw, m, n, k, epilogue);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Prologue>
void write_prologue(const Prologue& a, float* out, int64_t m, int64_t k) {
  if (m * k == 0) return;
  // grid-stride: at most 65535 blocks
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((m * k + kElementThreads - 1) / kElementThreads,
                                                                  65535));
  prologue_kernel<Prologue><<<blocks, kElementThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a, out, m, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// (weight grad, bias grad) fp32 [width] of a norm (per element) from dn [N, width], x and its stats.
std::pair<Tensor, Tensor> norm_param_grads(const Tensor& dn, const Tensor& x, const Tensor& stats, int64_t groups) {
  const int64_t n = x.size(0), width = x.size(1);
  const int64_t chunks = std::max<int64_t>((n + kParamRows - 1) / kParamRows, 1);
  Tensor partials = at::zeros({chunks, 2, width}, x.options().dtype(at::kDouble));
  if (n > 0) {
    const dim3 grid(blocks_for(width, kElementThreads), static_cast<unsigned>(chunks));
    norm_param_grad_kernel<<<grid, kElementThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dn.data_ptr<float>(), x.data_ptr<float>(), stats.data_ptr<float>(), partials.data_ptr<double>(), n, width,
        groups, width / groups);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const Tensor sums = partials.sum(0).to(at::kFloat);
  return {sums[0].clone(), sums[1].clone()};
}

void check_cuda_2d(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, name, " must have 2 dims, got ", t.dim());
}

struct UvqkShape {
  int64_t n, d, hl, ha, o;
  int64_t starts[4], widths[4];
};

UvqkShape uvqk_shape(const Tensor& x, const Tensor& uvqk_weight, const Tensor& uvqk_bias, const Tensor& norm_weight,
                     const Tensor& norm_bias, int64_t num_heads, int64_t linear_dim, int64_t attention_dim) {
  check_cuda_2d(x, "x");
  check_cuda_2d(uvqk_weight, "uvqk_weight");
  const int64_t n = x.size(0), d = x.size(1), hl = num_heads * linear_dim, ha = num_heads * attention_dim;
  const int64_t o = 2 * hl + 2 * ha;
  TORCH_CHECK(uvqk_weight.size(0) == d && uvqk_weight.size(1) == o, "uvqk_weight must be [", d, ", ", o, "], got ",
              uvqk_weight.sizes());
  TORCH_CHECK(uvqk_bias.numel() == o && norm_weight.numel() == d && norm_bias.numel() == d,
              "uvqk_bias / norm_weight / norm_bias sizes do not match the layer");
  return {n, d, hl, ha, o, {0, hl, 2 * hl, 2 * hl + ha}, {hl, hl, ha, ha}};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> hstu_uvqk_fwd_cuda(const Tensor& x_in, const Tensor& norm_weight,
                                                                      const Tensor& norm_bias, double eps,
                                                                      const Tensor& uvqk_weight,
                                                                      const Tensor& uvqk_bias, int64_t num_heads,
                                                                      int64_t linear_dim, int64_t attention_dim,
                                                                      bool silu_qkv) {
  const UvqkShape s = uvqk_shape(x_in, uvqk_weight, uvqk_bias, norm_weight, norm_bias, num_heads, linear_dim,
                                 attention_dim);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = as_float(x_in), nw = as_float(norm_weight), nb = as_float(norm_bias);
  const Tensor w = as_float(uvqk_weight), b = as_float(uvqk_bias);
  const Tensor stats = norm_stats(x, 1, eps);
  const LayerNormRows xn{x.data_ptr<float>(), stats.data_ptr<float>(), nw.data_ptr<float>(), nb.data_ptr<float>(),
                         s.d};
  Tensor outs[4];
  for (int i = 0; i < 4; ++i) {
    outs[i] = at::empty({s.n, s.widths[i]}, x.options());
    const UvqkStore store{b.data_ptr<float>(), outs[i].data_ptr<float>(), s.widths[i], s.starts[i],
                          silu_qkv && i > 0, nullptr, 0};
    fused_gemm(xn, w.data_ptr<float>() + s.starts[i], s.o, s.n, s.widths[i], s.d, store);
  }
  const auto dtype = x_in.scalar_type();
  return {outs[0].to(dtype), outs[1].view({s.n, num_heads, linear_dim}).to(dtype),
          outs[2].view({s.n, num_heads, attention_dim}).to(dtype),
          outs[3].view({s.n, num_heads, attention_dim}).to(dtype), stats};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> hstu_uvqk_bwd_cuda(
    const Tensor& grad_u, const Tensor& grad_v, const Tensor& grad_q, const Tensor& grad_k, const Tensor& x_in,
    const Tensor& norm_weight, const Tensor& norm_bias, double eps, const Tensor& uvqk_weight,
    const Tensor& uvqk_bias, const Tensor& stats_in, int64_t num_heads, int64_t linear_dim, int64_t attention_dim,
    bool silu_qkv, const std::optional<Tensor>& grad_residual) {
  const UvqkShape s = uvqk_shape(x_in, uvqk_weight, uvqk_bias, norm_weight, norm_bias, num_heads, linear_dim,
                                 attention_dim);
  TORCH_CHECK(stats_in.dim() == 2 && stats_in.size(0) == s.n && stats_in.size(1) == 2, "stats must be [", s.n,
              ", 2], got ", stats_in.sizes());
  if (grad_residual.has_value()) {
    const Tensor& r = *grad_residual;
    TORCH_CHECK_VALUE(r.device() == x_in.device() && r.scalar_type() == x_in.scalar_type() && r.sizes() == x_in.sizes(),
                      "grad_residual must have x's shape ", x_in.sizes(), ", dtype ", x_in.scalar_type(),
                      " and device, got ", r.sizes(), " ", r.scalar_type(), " on ", r.device());
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = as_float(x_in), nw = as_float(norm_weight), nb = as_float(norm_bias);
  const Tensor w = as_float(uvqk_weight), b = as_float(uvqk_bias), stats = as_float(stats_in);
  const Tensor grads[4] = {as_float(grad_u).view({s.n, s.hl}), as_float(grad_v).view({s.n, s.hl}),
                           as_float(grad_q).view({s.n, s.ha}), as_float(grad_k).view({s.n, s.ha})};
  const LayerNormRows xn_rows{x.data_ptr<float>(), stats.data_ptr<float>(), nw.data_ptr<float>(),
                              nb.data_ptr<float>(), s.d};
  Tensor dz;
  if (silu_qkv) {
    // dz of v, q, k = grad * silu'(z), z recomputed by the forward's GEMM (not stored by it)
    dz = at::empty({s.n, s.o}, x.options());
    dz.narrow(1, 0, s.hl).copy_(grads[0]);
    for (int i = 1; i < 4; ++i) {
      const UvqkStore store{b.data_ptr<float>(), dz.data_ptr<float>() + s.starts[i], s.o, s.starts[i], false,
                            grads[i].data_ptr<float>(), s.widths[i]};
      fused_gemm(xn_rows, w.data_ptr<float>() + s.starts[i], s.o, s.n, s.widths[i], s.d, store);
    }
  } else {
    dz = at::cat({grads[0], grads[1], grads[2], grads[3]}, 1);
  }
  Tensor xn = at::empty({s.n, s.d}, x.options());
  write_prologue(xn_rows, xn.data_ptr<float>(), s.n, s.d);
  Tensor dw = at::mm(xn.t(), dz);
  Tensor db = dz.sum(0);
  Tensor dxn = at::mm(dz, w.t());
  Tensor dx = at::empty({s.n, s.d}, x.options());
  if (s.n > 0) {
    layer_norm_bwd_kernel<<<blocks_for(s.n, kNormWarps), kNormWarps * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dxn.data_ptr<float>(), x.data_ptr<float>(), stats.data_ptr<float>(), nw.data_ptr<float>(),
        dx.data_ptr<float>(), s.n, s.d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  auto [dnw, dnb] = norm_param_grads(dxn, x, stats, 1);
  // The layer's residual gradient: added after dx's rounding to x's dtype (the cpu kernel's bits), one
  // more pass over [N, D] here (not folded into layer_norm_bwd_kernel).
  Tensor dx_out = dx.to(x_in.scalar_type());
  if (grad_residual.has_value()) dx_out.add_(*grad_residual);
  return {dx_out, dnw.to(norm_weight.scalar_type()), dnb.to(norm_bias.scalar_type()), dw.to(uvqk_weight.scalar_type()),
          db.to(uvqk_bias.scalar_type())};
}

struct OutputShape {
  int64_t n, width, groups, k;
};

OutputShape output_shape(const Tensor& attn, const Tensor& u_pre, const Tensor& output_weight,
                         const Tensor& norm_weight, const Tensor& norm_bias, int64_t num_heads, bool group_norm,
                         bool concat_u, bool concat_x) {
  check_cuda_2d(attn, "attn");
  check_cuda_2d(output_weight, "output_weight");
  const int64_t width = attn.size(1);
  const int64_t k = width * (1 + (concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  TORCH_CHECK(u_pre.sizes() == attn.sizes(), "u_pre must be ", attn.sizes(), ", got ", u_pre.sizes());
  TORCH_CHECK(output_weight.size(0) == k, "output_weight must have ", k, " rows, got ", output_weight.sizes());
  TORCH_CHECK(num_heads >= 1 && width % num_heads == 0, "attn width ", width, " is not a multiple of num_heads ",
              num_heads);
  const int64_t groups = group_norm ? num_heads : 1;
  const int64_t norm_size = group_norm ? num_heads : width;
  TORCH_CHECK(norm_weight.numel() == norm_size && norm_bias.numel() == norm_size, "norm_weight / norm_bias must have ",
              norm_size, " elements");
  return {attn.size(0), width, groups, k};
}

ConcatRows concat_rows(const Tensor& a, const Tensor& u, const Tensor& stats, const Tensor& nw, const Tensor& nb,
                       const Tensor& mask, const OutputShape& shape, bool concat_u, bool concat_x, bool group_norm) {
  return {a.data_ptr<float>(), u.data_ptr<float>(), stats.data_ptr<float>(), nw.data_ptr<float>(), nb.data_ptr<float>(),
          mask.defined() ? mask.data_ptr<float>() : nullptr, shape.width, shape.k, shape.groups,
          shape.width / shape.groups, concat_u, concat_x, group_norm};
}

Tensor checked_mask(const std::optional<Tensor>& dropout_mask, const OutputShape& shape) {
  if (!dropout_mask.has_value()) return Tensor();
  TORCH_CHECK(dropout_mask->dim() == 2 && dropout_mask->size(0) == shape.n && dropout_mask->size(1) == shape.k,
              "dropout_mask must be [", shape.n, ", ", shape.k, "], got ", dropout_mask->sizes());
  return as_float(*dropout_mask);
}

std::tuple<Tensor, Tensor> hstu_output_fwd_cuda(const Tensor& attn_in, const Tensor& u_in, const Tensor& x_in,
                                                const Tensor& norm_weight, const Tensor& norm_bias, double eps,
                                                const Tensor& output_weight,
                                                const std::optional<Tensor>& output_bias,
                                                const std::optional<Tensor>& dropout_mask, int64_t num_heads,
                                                bool group_norm, bool concat_u, bool concat_x) {
  const auto shape = output_shape(attn_in, u_in, output_weight, norm_weight, norm_bias, num_heads, group_norm,
                                  concat_u, concat_x);
  check_cuda_2d(x_in, "x");
  const int64_t dim = x_in.size(1);
  TORCH_CHECK(x_in.size(0) == shape.n, "x must have ", shape.n, " rows, got ", x_in.sizes());
  TORCH_CHECK(output_weight.size(1) == dim, "output_weight must have ", dim, " columns, got ", output_weight.sizes());
  TORCH_CHECK(!output_bias.has_value() || output_bias->numel() == dim, "output_bias must have ", dim, " elements");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor a = as_float(attn_in), u = as_float(u_in), x = as_float(x_in);
  const Tensor nw = as_float(norm_weight), nb = as_float(norm_bias), w = as_float(output_weight);
  const Tensor ob = output_bias.has_value() ? as_float(*output_bias) : Tensor();
  const Tensor mask = checked_mask(dropout_mask, shape);
  const Tensor stats = norm_stats(a, shape.groups, eps);
  Tensor out = at::empty({shape.n, dim}, x.options());
  const ResidualStore store{x.data_ptr<float>(), ob.defined() ? ob.data_ptr<float>() : nullptr,
                            out.data_ptr<float>(), dim};
  fused_gemm(concat_rows(a, u, stats, nw, nb, mask, shape, concat_u, concat_x, group_norm), w.data_ptr<float>(), dim,
             shape.n, dim, shape.k, store);
  return {out.to(x_in.scalar_type()), stats};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> hstu_output_bwd_cuda(
    const Tensor& grad_out_in, const Tensor& attn_in, const Tensor& u_in, const Tensor& norm_weight,
    const Tensor& norm_bias, double eps, const Tensor& output_weight, bool has_output_bias,
    const std::optional<Tensor>& dropout_mask, const Tensor& stats_in, int64_t num_heads, bool group_norm,
    bool concat_u, bool concat_x) {
  const auto shape = output_shape(attn_in, u_in, output_weight, norm_weight, norm_bias, num_heads, group_norm,
                                  concat_u, concat_x);
  check_cuda_2d(grad_out_in, "grad_out");
  TORCH_CHECK(grad_out_in.size(0) == shape.n && grad_out_in.size(1) == output_weight.size(1), "grad_out must be [",
              shape.n, ", ", output_weight.size(1), "], got ", grad_out_in.sizes());
  TORCH_CHECK(stats_in.dim() == 2 && stats_in.size(0) == shape.n && stats_in.size(1) == 2 * shape.groups,
              "stats must be [", shape.n, ", ", 2 * shape.groups, "], got ", stats_in.sizes());
  const c10::cuda::CUDAGuard guard(attn_in.device());
  const Tensor g = as_float(grad_out_in), a = as_float(attn_in), u = as_float(u_in);
  const Tensor nw = as_float(norm_weight), nb = as_float(norm_bias), w = as_float(output_weight);
  const Tensor mask = checked_mask(dropout_mask, shape);
  const Tensor stats = as_float(stats_in);
  const auto opts = a.options();
  // c recomputed (the forward's prologue with its saved stats) for the weight gradient
  Tensor c = at::empty({shape.n, shape.k}, opts);
  write_prologue(concat_rows(a, u, stats, nw, nb, mask, shape, concat_u, concat_x, group_norm), c.data_ptr<float>(),
                 shape.n, shape.k);
  Tensor dw = at::mm(c.t(), g);
  Tensor dob = has_output_bias ? g.sum(0).to(output_weight.scalar_type()) : at::empty({0}, opts);
  Tensor dc = at::mm(g, w.t());
  Tensor dattn = at::empty({shape.n, shape.width}, opts), du = at::empty({shape.n, shape.width}, opts);
  Tensor dn = at::empty({shape.n, shape.width}, opts);
  const int64_t pairs = shape.n * shape.groups;
  if (pairs > 0) {
    output_bwd_rows_kernel<<<blocks_for(pairs, kNormWarps), kNormWarps * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dc.data_ptr<float>(), a.data_ptr<float>(), u.data_ptr<float>(), stats.data_ptr<float>(),
        nw.data_ptr<float>(), nb.data_ptr<float>(), mask.defined() ? mask.data_ptr<float>() : nullptr,
        dattn.data_ptr<float>(), du.data_ptr<float>(), dn.data_ptr<float>(), pairs, shape.groups,
        shape.width / shape.groups, shape.k, concat_u, concat_x, group_norm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  auto [dnw, dnb] = norm_param_grads(dn, a, stats, shape.groups);
  if (group_norm) {  // weight per head: the sums over each head's Lh elements
    dnw = dnw.view({shape.groups, -1}).sum(1);
    dnb = dnb.view({shape.groups, -1}).sum(1);
  }
  return {dattn.to(attn_in.scalar_type()), du.to(u_in.scalar_type()), dnw.to(norm_weight.scalar_type()),
          dnb.to(norm_bias.scalar_type()), dw.to(output_weight.scalar_type()), dob};
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) {
  m.impl("hstu_uvqk_fwd_native", &hstu_uvqk_fwd_cuda);
  m.impl("hstu_uvqk_bwd_native", &hstu_uvqk_bwd_cuda);
  m.impl("hstu_output_fwd_native", &hstu_output_fwd_cuda);
  m.impl("hstu_output_bwd_native", &hstu_output_bwd_cuda);
}

}  // namespace gem_kernels
