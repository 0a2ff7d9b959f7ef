// CUDA kernels of the attention family: jagged attention forward (softmax and HSTU).
// Forward only: the backward of the `cuda` backend is not implemented (the Python front door sends
// differentiable calls to triton and refuses backend="cuda" for them).
//
// Work decomposition: grid (B * H, cdiv(max_seq_len, kBlockM)); block (b*H+h, m) owns kBlockM query
// rows of sequence b, head h, and walks kBlockN-key tiles of that sequence only (flash-style: online
// softmax in fp32, the [L, L] matrix never exists). Every tile's visibility is computed from the (i, j)
// ids in-tile and a tile with no visible pair is skipped (__syncthreads_or) before its K/V loads;
// position and time biases are gathered in-tile. Q, K, V tiles, the score tile and the fp32 output
// accumulator live in shared memory; the products run on the CUDA cores in fp32 (a plain, portable
// kernel: no tensor cores yet). Blocks past a sequence's end exit at once.
//
// Roofline: FLOPs 4 * sum(visible pairs) * H * D; minimum bytes N*H*(2*Dqk + 2*Dv)*s plus biases.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "gem_kernels/attention.h"
#include "gem_kernels/checks.h"

namespace gem_kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kBlockM = 16;  // 16 query rows x 32 keys: a 2 KiB score tile, 4 scores per thread
constexpr int kBlockN = 32;

struct FwdArgs {
  const int64_t* offsets;
  const int64_t* targets;  // nullptr: no targets
  const float* pos_bias;   // nullptr: absent
  const float* time_bias;  // nullptr: absent
  const int64_t* timestamps;
  const int64_t* thr;  // bucket thresholds [num_buckets]
  int64_t pos_heads, time_heads, num_buckets;
  int64_t H, D, Dv, M, contextual_len, max_attn_len;
  float scale, inv_m;
  bool softmax, causal;
};

__device__ __forceinline__ int64_t position_id(int64_t p, int64_t c, int64_t max_id) {
  const int64_t id = c > 0 ? max(p - c + 1, static_cast<int64_t>(0)) : p;
  return min(id, max_id);
}

// generative-recommenders' _get_valid_attn_mask for one pair.
__device__ __forceinline__ bool visible(int64_t i, int64_t j, int64_t max_id, const FwdArgs& a) {
  if (i == j) return true;
  const int64_t id_i = position_id(i, a.contextual_len, max_id);
  const int64_t id_j = position_id(j, a.contextual_len, max_id);
  int64_t d = id_i - id_j;
  if (!a.causal && d < 0) d = -d;
  if (d > 0 && (a.max_attn_len == 0 || d <= a.max_attn_len)) return true;
  return a.contextual_len > 0 && id_i == 0 && id_j < max_id;
}

__device__ __forceinline__ int64_t time_bucket(int64_t dt, const FwdArgs& a) {
  const int64_t x = dt < 0 ? -dt : dt;
  int64_t lo = 0, hi = a.num_buckets;  // number of thresholds <= x, by bisection
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a.thr[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <typename scalar_t>
__global__ void jagged_attention_fwd_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                            const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                                            float* __restrict__ lse, FwdArgs a) {
  extern __shared__ float smem[];
  const int64_t D = a.D, Dv = a.Dv, H = a.H;
  float* sq = smem;                        // [kBlockM][D]
  float* sk = sq + kBlockM * D;            // [kBlockN][D]
  float* sv = sk + kBlockN * D;            // [kBlockN][Dv]
  float* ss = sv + kBlockN * Dv;           // [kBlockM][kBlockN]
  float* sacc = ss + kBlockM * kBlockN;    // [kBlockM][Dv]
  __shared__ float row_max[kBlockM], row_sum[kBlockM], row_alpha[kBlockM];

  const int64_t bh = blockIdx.x;
  const int64_t b = bh / H, h = bh % H;
  const int64_t start = a.offsets[b];
  const int64_t L = a.offsets[b + 1] - start;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kBlockM;
  if (i0 >= L) return;  // uniform over the block
  const int64_t n_targets = a.targets != nullptr ? a.targets[b] : 0;
  const int64_t max_id = L - n_targets + (a.contextual_len > 0 ? 1 - a.contextual_len : 0);
  const int64_t bm = min(static_cast<int64_t>(kBlockM), L - i0);
  const float neg_inf = -INFINITY;
  const int64_t hp = a.pos_heads > 1 ? h : 0, ht = a.time_heads > 1 ? h : 0;

  for (int64_t idx = threadIdx.x; idx < kBlockM * D; idx += blockDim.x) {
    const int64_t r = idx / D, d = idx % D;
    sq[idx] = r < bm ? static_cast<float>(q[((start + i0 + r) * H + h) * D + d]) : 0.0f;
  }
  for (int64_t idx = threadIdx.x; idx < kBlockM * Dv; idx += blockDim.x) sacc[idx] = 0.0f;
  if (threadIdx.x < kBlockM) {
    row_max[threadIdx.x] = neg_inf;
    row_sum[threadIdx.x] = 0.0f;
  }
  __syncthreads();

  for (int64_t j0 = 0; j0 < L; j0 += kBlockN) {
    const int64_t bn = min(static_cast<int64_t>(kBlockN), L - j0);
    int any = 0;
    for (int idx = threadIdx.x; idx < kBlockM * kBlockN; idx += blockDim.x) {
      const int r = idx / kBlockN, c = idx % kBlockN;
      if (r < bm && c < bn && visible(i0 + r, j0 + c, max_id, a)) any = 1;
    }
    if (!__syncthreads_or(any)) continue;  // fully masked tile: no loads, no maths
    for (int64_t idx = threadIdx.x; idx < kBlockN * D; idx += blockDim.x) {
      const int64_t c = idx / D, d = idx % D;
      sk[idx] = c < bn ? static_cast<float>(k[((start + j0 + c) * H + h) * D + d]) : 0.0f;
    }
    for (int64_t idx = threadIdx.x; idx < kBlockN * Dv; idx += blockDim.x) {
      const int64_t c = idx / Dv, d = idx % Dv;
      sv[idx] = c < bn ? static_cast<float>(v[((start + j0 + c) * H + h) * Dv + d]) : 0.0f;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < kBlockM * kBlockN; idx += blockDim.x) {
      const int r = idx / kBlockN, c = idx % kBlockN;
      const int64_t i = i0 + r, j = j0 + c;
      const bool on = r < bm && c < bn && visible(i, j, max_id, a);
      float s = 0.0f;
      if (on) {
        const float* qr = sq + r * D;
        const float* kc = sk + c * D;
        for (int64_t d = 0; d < D; ++d) s += qr[d] * kc[d];
        s *= a.scale;
        if (a.pos_bias != nullptr) s += a.pos_bias[hp * (2 * a.M - 1) + (j - i + a.M - 1)];
        if (a.time_bias != nullptr)
          s += a.time_bias[ht * (a.num_buckets + 1) +
                           time_bucket(a.timestamps[start + i] - a.timestamps[start + j], a)];
      }
      if (a.softmax) {
        ss[idx] = on ? s : neg_inf;
      } else {
        ss[idx] = on ? s / (1.0f + expf(-s)) * a.inv_m : 0.0f;
      }
    }
    __syncthreads();
    if (a.softmax) {
      if (threadIdx.x < kBlockM) {
        const int r = threadIdx.x;
        float* row = ss + r * kBlockN;
        float mx = row_max[r];
        for (int c = 0; c < kBlockN; ++c) mx = fmaxf(mx, row[c]);
        const float m_safe = mx == neg_inf ? 0.0f : mx;
        const float alpha = row_max[r] == neg_inf ? 0.0f : expf(row_max[r] - m_safe);
        float sum = 0.0f;
        for (int c = 0; c < kBlockN; ++c) {
          const float p = row[c] == neg_inf ? 0.0f : expf(row[c] - m_safe);
          row[c] = p;
          sum += p;
        }
        row_sum[r] = row_sum[r] * alpha + sum;
        row_max[r] = mx;
        row_alpha[r] = alpha;
      }
      __syncthreads();
    }
    for (int64_t idx = threadIdx.x; idx < kBlockM * Dv; idx += blockDim.x) {
      const int64_t r = idx / Dv, d = idx % Dv;
      float acc = sacc[idx];
      if (a.softmax) acc *= row_alpha[r];
      const float* p = ss + r * kBlockN;
      for (int64_t c = 0; c < bn; ++c) acc += p[c] * sv[c * Dv + d];
      sacc[idx] = acc;
    }
    __syncthreads();
  }

  for (int64_t idx = threadIdx.x; idx < bm * Dv; idx += blockDim.x) {
    const int64_t r = idx / Dv, d = idx % Dv;
    float val = sacc[idx];
    if (a.softmax) val /= row_sum[r];  // > 0: every row sees itself
    out[((start + i0 + r) * H + h) * Dv + d] = static_cast<scalar_t>(val);
  }
  if (a.softmax && threadIdx.x < bm) {
    const int r = threadIdx.x;
    lse[(start + i0 + r) * H + h] = row_max[r] + logf(row_sum[r]);
  }
}

at::Tensor opt_float(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  GK_CHECK_CUDA((*t));
  return t->to(at::kFloat).contiguous();
}

std::tuple<at::Tensor, at::Tensor> jagged_attention_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& seq_offsets,
    int64_t max_seq_len, c10::string_view kind, bool causal, double scale, const c10::optional<at::Tensor>& num_targets,
    int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
    const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in) {
  GK_CHECK_CUDA(q_in);
  GK_CHECK_CUDA(k_in);
  GK_CHECK_CUDA(v_in);
  GK_CHECK_CUDA(seq_offsets);
  GK_CHECK_INDEX(seq_offsets);
  GK_CHECK_DIM(q_in, 3);
  GK_CHECK_DIM(v_in, 3);
  TORCH_CHECK(k_in.sizes() == q_in.sizes(), "k must have q's shape");
  TORCH_CHECK(v_in.size(0) == q_in.size(0) && v_in.size(1) == q_in.size(1), "v must be [N, H, Dv]");
  TORCH_CHECK(kind == "softmax" || kind == "hstu", "kind must be softmax or hstu, got ", kind);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const auto offsets = seq_offsets.to(at::kLong).contiguous();
  const auto pos_bias = opt_float(pos_bias_in), time_bias = opt_float(time_bias_in);
  at::Tensor targets, timestamps, thr;
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Dv = v.size(2), B = offsets.numel() - 1;
  const bool softmax = kind == "softmax";
  auto out = at::empty({N, H, Dv}, q.options());
  const std::vector<int64_t> lse_shape = softmax ? std::vector<int64_t>{N, H} : std::vector<int64_t>{0};
  auto lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
  if (N == 0 || B == 0) return {out, lse};

  FwdArgs a{};
  a.offsets = offsets.data_ptr<int64_t>();
  if (num_targets.has_value() && num_targets->defined()) {
    targets = num_targets->to(at::kLong).contiguous();
    a.targets = targets.data_ptr<int64_t>();
  }
  if (pos_bias.defined()) {
    TORCH_CHECK(pos_bias.size(1) == 2 * max_seq_len - 1, "pos_bias must be [H or 1, 2*max_seq_len-1]");
    a.pos_bias = pos_bias.data_ptr<float>();
    a.pos_heads = pos_bias.size(0);
  }
  if (time_bias.defined()) {
    TORCH_CHECK(timestamps_in.has_value() && timestamps_in->numel() == N, "timestamps must be [N] with time_bias");
    timestamps = timestamps_in->to(at::kLong).contiguous();
    a.time_bias = time_bias.data_ptr<float>();
    a.time_heads = time_bias.size(0);
    a.num_buckets = time_bias.size(1) - 1;
    const auto table = bucket_thresholds(a.num_buckets);
    thr = at::empty({static_cast<int64_t>(table.size()) + 1}, offsets.options());
    at::Tensor host = at::empty({static_cast<int64_t>(table.size()) + 1}, at::kLong);
    std::copy(table.begin(), table.end(), host.data_ptr<int64_t>());
    thr.copy_(host);
    a.timestamps = timestamps.data_ptr<int64_t>();
    a.thr = thr.data_ptr<int64_t>();
  }
  a.H = H;
  a.D = D;
  a.Dv = Dv;
  a.M = max_seq_len;
  a.contextual_len = contextual_len;
  a.max_attn_len = max_attn_len;
  a.scale = static_cast<float>(scale);
  a.inv_m = max_seq_len > 0 ? 1.0f / static_cast<float>(max_seq_len) : 0.0f;
  a.softmax = softmax;
  a.causal = causal;

  const size_t smem = sizeof(float) * (kBlockM * D + kBlockN * D + kBlockN * Dv + kBlockM * kBlockN + kBlockM * Dv);
  const dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((max_seq_len + kBlockM - 1) / kBlockM));
  if (grid.y == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "jagged_attention_fwd_cuda", [&] {
    auto kernel = jagged_attention_fwd_kernel<scalar_t>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    kernel<<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        softmax ? lse.data_ptr<float>() : nullptr, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) {
  m.impl("jagged_attention_fwd_native", &jagged_attention_fwd_cuda);
}

}  // namespace gem_kernels
