// CUDA kernels of the attention family: jagged attention (softmax and HSTU), forward and backward.
//
// Forward. Grid (B * H, cdiv(max_seq_len, kBlockM)); block (b*H+h, m) owns kBlockM query rows of
// sequence b, head h, and walks kBlockN-key tiles of that sequence only (flash-style: online softmax
// in fp32, the [L, L] matrix never exists). Every tile's visibility is computed from the (i, j) ids
// in-tile and a tile with no visible pair is skipped (__syncthreads_or) before its K/V loads;
// position and time biases are gathered in-tile. Q, K, V tiles, the score tile and the fp32 output
// accumulator live in shared memory (K and V rows at an odd pitch, kv_pitch: no bank conflicts where
// a warp's lanes read one column of 32 key rows); the products run on the CUDA cores in fp32 (a plain,
// portable kernel: no tensor cores yet). Blocks past a sequence's end exit at once.
//
// Cached forward (inference, cached_jagged_attention): the same kernel with AttnArgs::delta set; grid
// y covers the last delta rows of each sequence only, whose queries and outputs live in [B * delta]
// row tensors (delta * L pairs per sequence instead of L^2).
//
// Backward (FlashAttention-2 order, scores recomputed from q, k and the forward's lse; delta_i =
// <dO_i, O_i> is one ATen reduction before the kernels), the CPU kernel's semantics:
// - KV pass, grid (B * H, cdiv(max_seq_len, kBlockN)): block (b*H+h, n) owns kBlockN keys and walks
//   the query tiles of its sequence, accumulating dK = scale * dS^T Q and dV = P^T dO in shared
//   memory (no atomics), and the bias gradients of its tile: pos_bias by the diagonal sums of dS
//   (one per relative position of the tile), time_bias by bucket sums kept in shared memory.
//   deterministic=false: those sums go to dpos/dtime by fp32 atomicAdd (one per diagonal / bucket
//   per tile, not per pair). deterministic=true: no float atomics; the block adds its diagonal sums
//   into its own window of a pos scratch (read-modify-write ordered by the block's barriers) and
//   stores its bucket sums into a time scratch; pos_bias_grad_reduce_kernel and an ATen sum reduce
//   them in a fixed order (bit-identical run to run).
// - Q pass, grid (B * H, cdiv(max_seq_len, kBlockM)): block (b*H+h, m) owns kBlockM queries and walks
//   the key tiles, accumulating dQ = scale * dS K in shared memory (no atomics, whatever the flag).
// Fully masked tiles are skipped in both passes, as in the forward.
//
// Roofline: FLOPs 4 * sum(visible pairs) * H * D forward, 2.5x that backward (5 tile products, one of
// them the recomputed Q K^T; the Q pass recomputes Q K^T and dO V^T once more: 7 products run).
// Minimum bytes: forward N*H*(2*Dqk + 2*Dv)*s plus biases; backward reads q, k, v, out, dO and writes
// dq, dk, dv: N*H*(4*Dqk + 4*Dv)*s, plus biases, timestamps and the lse/delta rows (8*N*H).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "gem_kernels/attention.h"
#include "gem_kernels/attention_checks.h"
#include "gem_kernels/checks.h"
#include "gem_kernels/cuda_smem.h"

namespace gem_kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kBlockM = 16;  // 16 query rows x 32 keys: a 2 KiB score tile, 4 scores per thread
constexpr int kBlockN = 32;

struct AttnArgs {
  const int64_t* offsets;
  const int64_t* targets;  // nullptr: no targets
  const float* pos_bias;   // nullptr: absent
  const float* time_bias;  // nullptr: absent
  const int64_t* timestamps;
  const int64_t* query_timestamps;  // tq_i of bucket(tq_i - t_j): timestamps when not given
  const int64_t* thr;  // bucket thresholds [num_buckets]
  int64_t pos_heads, time_heads, num_buckets;
  int64_t H, D, Dv, M, contextual_len, max_attn_len;
  int64_t delta;  // the cached forward: queries are the last delta rows of every sequence; 0: every row
  float scale, inv_m;
  bool softmax, causal;
};

// Where the backward's bias gradients go (see the header comment).
struct BiasGradOut {
  float* dpos;               // [pos_heads, 2M-1], atomics (deterministic=false)
  float* dtime;              // [time_heads, num_buckets+1], atomics (deterministic=false)
  float* pos_scratch;        // deterministic: block (b, h, n) owns W = L + kBlockN - 1 floats at
  const int64_t* pos_bases;  //   pos_bases[b] + (h * cdiv(L, kBlockN) + n) * W; slot x is j - i = x - (L-1) + n*kBlockN
  float* time_scratch;       // deterministic: [B*H, key_blocks, num_buckets+1]
  int64_t key_blocks;
  bool deterministic;
};

__device__ __forceinline__ int64_t position_id(int64_t p, int64_t c, int64_t max_id) {
  const int64_t id = c > 0 ? max(p - c + 1, static_cast<int64_t>(0)) : p;
  return min(id, max_id);
}

// generative-recommenders' _get_valid_attn_mask for one pair.
__device__ __forceinline__ bool visible(int64_t i, int64_t j, int64_t max_id, const AttnArgs& a) {
  if (i == j) return true;
  const int64_t id_i = position_id(i, a.contextual_len, max_id);
  const int64_t id_j = position_id(j, a.contextual_len, max_id);
  int64_t d = id_i - id_j;
  if (!a.causal && d < 0) d = -d;
  if (d > 0 && (a.max_attn_len == 0 || d <= a.max_attn_len)) return true;
  return a.contextual_len > 0 && id_i == 0 && id_j < max_id;
}

__device__ __forceinline__ int64_t time_bucket(int64_t dt, const AttnArgs& a) {
  const int64_t x = dt < 0 ? -dt : dt;
  int64_t lo = 0, hi = a.num_buckets;  // number of thresholds <= x, by bisection
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a.thr[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// s_ij = scale * <q_i, k_j> + pos_bias + time_bias, in fp32; *bucket gets the pair's time bucket.
__device__ __forceinline__ float biased_score(const float* qr, const float* kc, int64_t i, int64_t j, int64_t start,
                                              int64_t hp, int64_t ht, const AttnArgs& a, int* bucket) {
  float s = 0.0f;
  for (int64_t d = 0; d < a.D; ++d) s += qr[d] * kc[d];
  s *= a.scale;
  if (a.pos_bias != nullptr) s += a.pos_bias[hp * (2 * a.M - 1) + (j - i + a.M - 1)];
  if (a.time_bias != nullptr) {
    const int64_t bkt = time_bucket(a.query_timestamps[start + i] - a.timestamps[start + j], a);
    *bucket = static_cast<int>(bkt);
    s += a.time_bias[ht * (a.num_buckets + 1) + bkt];
  }
  return s;
}

// dst[rows][pitch] <- rows row0.. of head h of a packed [N, H, width] tensor in fp32, zero past `valid`.
template <typename scalar_t>
__device__ __forceinline__ void load_rows(float* dst, const scalar_t* src, int64_t row0, int64_t rows, int64_t valid,
                                          int64_t H, int64_t h, int64_t width, int64_t pitch) {
  for (int64_t idx = threadIdx.x; idx < rows * width; idx += blockDim.x) {
    const int64_t r = idx / width, d = idx % width;
    dst[r * pitch + d] = r < valid ? static_cast<float>(src[((row0 + r) * H + h) * width + d]) : 0.0f;
  }
}

// Row pitch of the K and V tiles in shared memory: odd, so that the 32 lanes of a warp, which read
// column d of 32 different rows in the score loops (lane = key c), hit 32 different banks (a pitch
// of D = 128 put all 32 in one bank: a 32-way conflict on every load of the inner loop).
__host__ __device__ __forceinline__ int64_t kv_pitch(int64_t width) { return width | 1; }

// Whether any pair of the (i0.., j0..) tile is visible; a barrier for the whole block.
__device__ __forceinline__ bool tile_visible(int64_t i0, int64_t bm, int64_t j0, int64_t bn, int64_t max_id,
                                             const AttnArgs& a) {
  int any = 0;
  for (int idx = threadIdx.x; idx < kBlockM * kBlockN; idx += blockDim.x) {
    const int r = idx / kBlockN, c = idx % kBlockN;
    if (r < bm && c < bn && visible(i0 + r, j0 + c, max_id, a)) any = 1;
  }
  return __syncthreads_or(any) != 0;
}

// What a block owns (grid x: b * H + h, grid y: a tile of kTile rows, queries or keys): sequence b's
// rows [start, start + L) of the jagged tensors, head h, the tile's first row t0 (counted from
// L - delta in the cached forward, whose queries are the last delta rows only) and its row count
// (<= 0: the tile starts past the sequence's end and the block returns before any other load), the
// largest position id a key may be seen up to (max_id, see visible()) and the bias heads it reads.
struct BlockTile {
  int64_t b, h, start, L, t0, rows, max_id, hp, ht;
};

template <int kTile>
__device__ __forceinline__ BlockTile block_tile(const AttnArgs& a) {
  BlockTile t{};
  t.b = blockIdx.x / a.H;
  t.h = blockIdx.x % a.H;
  t.start = a.offsets[t.b];
  t.L = a.offsets[t.b + 1] - t.start;
  t.t0 = (a.delta > 0 ? t.L - a.delta : 0) + static_cast<int64_t>(blockIdx.y) * kTile;
  t.rows = min(static_cast<int64_t>(kTile), t.L - t.t0);
  if (t.rows <= 0) return t;
  const int64_t n_targets = a.targets != nullptr ? a.targets[t.b] : 0;
  t.max_id = t.L - n_targets + (a.contextual_len > 0 ? 1 - a.contextual_len : 0);
  t.hp = a.pos_heads > 1 ? t.h : 0;
  t.ht = a.time_heads > 1 ? t.h : 0;
  return t;
}

template <typename scalar_t>
__global__ void jagged_attention_fwd_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                            const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                                            float* __restrict__ lse, AttnArgs a) {
  extern __shared__ float smem[];
  const int64_t D = a.D, Dv = a.Dv, H = a.H;
  const int64_t kp = kv_pitch(D), vp = kv_pitch(Dv);
  float* sq = smem;                        // [kBlockM][D]
  float* sk = sq + kBlockM * D;            // [kBlockN][kp]
  float* sv = sk + kBlockN * kp;           // [kBlockN][vp]
  float* ss = sv + kBlockN * vp;           // [kBlockM][kBlockN]
  float* sacc = ss + kBlockM * kBlockN;    // [kBlockM][Dv]
  __shared__ float row_max[kBlockM], row_sum[kBlockM], row_alpha[kBlockM];
  // Which pairs of the tile are visible: the P V product selects by it, so an invisible value that
  // is inf or NaN adds nothing (a zero weight times it would add 0 * inf = NaN).
  __shared__ unsigned char svis[kBlockM * kBlockN];

  const auto [b, h, start, L, i0, bm, max_id, hp, ht] = block_tile<kBlockM>(a);
  if (bm <= 0) return;  // uniform over the block
  const float neg_inf = -INFINITY;
  // Row of q, out and lse that holds position i: start + i, or b * delta + i - (L - delta) when cached.
  const int64_t q_row0 = a.delta > 0 ? b * a.delta - (L - a.delta) : start;

  load_rows(sq, q, q_row0 + i0, kBlockM, bm, H, h, D, D);
  for (int64_t idx = threadIdx.x; idx < kBlockM * Dv; idx += blockDim.x) sacc[idx] = 0.0f;
  if (threadIdx.x < kBlockM) {
    row_max[threadIdx.x] = neg_inf;
    row_sum[threadIdx.x] = 0.0f;
  }
  __syncthreads();

  for (int64_t j0 = 0; j0 < L; j0 += kBlockN) {
    const int64_t bn = min(static_cast<int64_t>(kBlockN), L - j0);
    if (!tile_visible(i0, bm, j0, bn, max_id, a)) continue;  // fully masked tile: no loads, no maths
    load_rows(sk, k, start + j0, kBlockN, bn, H, h, D, kp);
    load_rows(sv, v, start + j0, kBlockN, bn, H, h, Dv, vp);
    __syncthreads();
    for (int idx = threadIdx.x; idx < kBlockM * kBlockN; idx += blockDim.x) {
      const int r = idx / kBlockN, c = idx % kBlockN;
      const int64_t i = i0 + r, j = j0 + c;
      const bool on = r < bm && c < bn && visible(i, j, max_id, a);
      int bucket = 0;
      const float s = on ? biased_score(sq + r * D, sk + c * kp, i, j, start, hp, ht, a, &bucket) : 0.0f;
      svis[idx] = on ? 1 : 0;
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
        // Keeps a NaN (fmaxf drops it): a NaN score poisons its whole row, lse included.
        for (int c = 0; c < kBlockN; ++c) mx = (mx != mx || row[c] <= mx) ? mx : row[c];
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
      const unsigned char* on = svis + r * kBlockN;
      for (int64_t c = 0; c < bn; ++c) acc += on[c] ? p[c] * sv[c * vp + d] : 0.0f;
      sacc[idx] = acc;
    }
    __syncthreads();
  }

  for (int64_t idx = threadIdx.x; idx < bm * Dv; idx += blockDim.x) {
    const int64_t r = idx / Dv, d = idx % Dv;
    float val = sacc[idx];
    // row_sum == 0: every visible score is -inf; out is then the accumulator (0, or NaN from a visible
    // inf value), as on the other backends. A NaN sum stays NaN.
    if (a.softmax && row_sum[r] != 0.0f) val /= row_sum[r];
    out[((q_row0 + i0 + r) * H + h) * Dv + d] = static_cast<scalar_t>(val);
  }
  if (lse != nullptr && threadIdx.x < bm) {
    const int r = threadIdx.x;
    lse[(q_row0 + i0 + r) * H + h] = row_max[r] + logf(row_sum[r]);
  }
}

// The backward's tile: P (softmax probabilities from the forward's lse, or the HSTU weights) into sp
// and dS into sds, fp32, zero where invisible or outside the sequence, and the pairs' visibility into
// svis (the products select by it: an Inf or NaN in q, k or dO of an invisible pair adds nothing);
// the pairs' time buckets into
// sbucket when it is given. Reads sq, sdo (the tile's query rows), sk, sv (its keys), row_lse and
// row_delta (softmax). Each thread owns whole pairs: no reduction across threads.
__device__ __forceinline__ void grad_tile(const float* sq, const float* sk, const float* sv, const float* sdo,
                                          const float* row_lse, const float* row_delta, float* sp, float* sds,
                                          unsigned char* svis, int* sbucket, int64_t i0, int64_t bm, int64_t j0,
                                          int64_t bn,
                                          int64_t start, int64_t hp, int64_t ht, int64_t max_id, const AttnArgs& a) {
  for (int idx = threadIdx.x; idx < kBlockM * kBlockN; idx += blockDim.x) {
    const int r = idx / kBlockN, c = idx % kBlockN;
    const int64_t i = i0 + r, j = j0 + c;
    float p = 0.0f, ds = 0.0f;
    int bucket = 0;
    const bool on = r < bm && c < bn && visible(i, j, max_id, a);
    svis[idx] = on ? 1 : 0;
    if (on) {
      const float s = biased_score(sq + r * a.D, sk + c * kv_pitch(a.D), i, j, start, hp, ht, a, &bucket);
      const float* dor = sdo + r * a.Dv;
      const float* vc = sv + c * kv_pitch(a.Dv);
      float dp = 0.0f;
      for (int64_t d = 0; d < a.Dv; ++d) dp += dor[d] * vc[d];
      if (a.softmax) {
        p = expf(s - row_lse[r]);
        ds = p * (dp - row_delta[r]);
      } else {
        const float sig = 1.0f / (1.0f + expf(-s));
        p = s * sig * a.inv_m;
        ds = dp * sig * (1.0f + s * (1.0f - sig)) * a.inv_m;
      }
    }
    sp[idx] = p;
    sds[idx] = ds;
    if (sbucket != nullptr) sbucket[idx] = bucket;
  }
}

// lse and delta of the tile's query rows into shared memory (softmax; zero past the sequence's end).
__device__ __forceinline__ void load_row_stats(float* row_lse, float* row_delta, const float* lse, const float* delta,
                                               int64_t row0, int64_t bm, int64_t H, int64_t h) {
  if (threadIdx.x < kBlockM) {
    const int r = threadIdx.x;
    // lse = -inf: every visible score was -inf, p = 0 (exp(-inf - -inf) would be NaN).
    const float l = r < bm ? lse[(row0 + r) * H + h] : 0.0f;
    row_lse[r] = l == -INFINITY ? INFINITY : l;
    row_delta[r] = r < bm ? delta[(row0 + r) * H + h] : 0.0f;
  }
}

template <typename scalar_t>
__global__ void jagged_attention_bwd_kv_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                               const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                                               const float* __restrict__ lse, const float* __restrict__ delta,
                                               scalar_t* __restrict__ dk, scalar_t* __restrict__ dv, AttnArgs a,
                                               BiasGradOut g) {
  extern __shared__ float smem[];
  const int64_t D = a.D, Dv = a.Dv, H = a.H;
  const bool has_time = a.time_bias != nullptr;
  const int64_t time_width = has_time ? a.num_buckets + 1 : 0;
  const int64_t kp = kv_pitch(D), vp = kv_pitch(Dv);
  float* sk = smem;                      // [kBlockN][kp]
  float* sv = sk + kBlockN * kp;         // [kBlockN][vp]
  float* sdk = sv + kBlockN * vp;        // [kBlockN][D]
  float* sdv = sdk + kBlockN * D;        // [kBlockN][Dv]
  float* sq = sdv + kBlockN * Dv;        // [kBlockM][D]
  float* sdo = sq + kBlockM * D;         // [kBlockM][Dv]
  float* sp = sdo + kBlockM * Dv;        // [kBlockM][kBlockN]
  float* sds = sp + kBlockM * kBlockN;   // [kBlockM][kBlockN]
  float* stime = sds + kBlockM * kBlockN;                           // [num_buckets+1] (time bias)
  int* sbucket = reinterpret_cast<int*>(stime + time_width);        // [kBlockM][kBlockN] (time bias)
  __shared__ float row_lse[kBlockM], row_delta[kBlockM];
  __shared__ unsigned char svis[kBlockM * kBlockN];

  const auto [b, h, start, L, j0, bn, max_id, hp, ht] = block_tile<kBlockN>(a);
  if (bn <= 0) return;  // uniform over the block
  // Deterministic pos window of this block (see BiasGradOut).
  const int64_t pos_width = L + kBlockN - 1;
  float* pos_window = nullptr;
  if (a.pos_bias != nullptr && g.deterministic) {
    const int64_t key_tiles = (L + kBlockN - 1) / kBlockN;
    pos_window = g.pos_scratch + g.pos_bases[b] + (h * key_tiles + blockIdx.y) * pos_width;
  }

  load_rows(sk, k, start + j0, kBlockN, bn, H, h, D, kp);
  load_rows(sv, v, start + j0, kBlockN, bn, H, h, Dv, vp);
  for (int64_t idx = threadIdx.x; idx < kBlockN * D; idx += blockDim.x) sdk[idx] = 0.0f;
  for (int64_t idx = threadIdx.x; idx < kBlockN * Dv; idx += blockDim.x) sdv[idx] = 0.0f;
  for (int64_t idx = threadIdx.x; idx < time_width; idx += blockDim.x) stime[idx] = 0.0f;
  __syncthreads();

  for (int64_t i0 = 0; i0 < L; i0 += kBlockM) {
    const int64_t bm = min(static_cast<int64_t>(kBlockM), L - i0);
    // Also the barrier that orders this tile's pos-window updates after the previous tile's.
    if (!tile_visible(i0, bm, j0, bn, max_id, a)) continue;
    load_rows(sq, q, start + i0, kBlockM, bm, H, h, D, D);
    load_rows(sdo, dout, start + i0, kBlockM, bm, H, h, Dv, Dv);
    if (a.softmax) load_row_stats(row_lse, row_delta, lse, delta, start + i0, bm, H, h);
    __syncthreads();
    grad_tile(sq, sk, sv, sdo, row_lse, row_delta, sp, sds, svis, has_time ? sbucket : nullptr, i0, bm, j0, bn,
              start, hp, ht, max_id, a);
    __syncthreads();
    // dV[c] += sum_r P[r, c] dO[r], dK[c] += scale * sum_r dS[r, c] Q[r]: each thread owns its outputs.
    for (int64_t idx = threadIdx.x; idx < kBlockN * Dv; idx += blockDim.x) {
      const int64_t c = idx / Dv, d = idx % Dv;
      float acc = 0.0f;
      for (int64_t r = 0; r < bm; ++r) acc += svis[r * kBlockN + c] ? sp[r * kBlockN + c] * sdo[r * Dv + d] : 0.0f;
      sdv[idx] += acc;
    }
    for (int64_t idx = threadIdx.x; idx < kBlockN * D; idx += blockDim.x) {
      const int64_t c = idx / D, d = idx % D;
      float acc = 0.0f;
      for (int64_t r = 0; r < bm; ++r) acc += svis[r * kBlockN + c] ? sds[r * kBlockN + c] * sq[r * D + d] : 0.0f;
      sdk[idx] += a.scale * acc;
    }
    if (a.pos_bias != nullptr) {
      // Diagonal e = c - r of the tile is relative position j - i = j0 - i0 + e: one sum per diagonal.
      for (int t = threadIdx.x; t < kBlockM + kBlockN - 1; t += blockDim.x) {
        const int e = t - (kBlockM - 1);
        float sum = 0.0f;
        for (int r = 0; r < kBlockM; ++r) {
          const int c = r + e;
          if (c >= 0 && c < kBlockN) sum += sds[r * kBlockN + c];
        }
        const int64_t rel = j0 - i0 + e;  // j - i
        if (g.deterministic) {
          const int64_t x = rel - j0 + L - 1;
          if (x >= 0 && x < pos_width) pos_window[x] += sum;  // this block's own floats, in tile order
        } else if (rel > -a.M && rel < a.M && sum != 0.0f) {
          atomicAdd(g.dpos + hp * (2 * a.M - 1) + rel + a.M - 1, sum);
        }
      }
    }
    if (has_time) {
      for (int64_t m = threadIdx.x; m < time_width; m += blockDim.x) {
        float sum = 0.0f;
        for (int idx = 0; idx < kBlockM * kBlockN; ++idx)
          if (sbucket[idx] == m) sum += sds[idx];
        stime[m] += sum;
      }
    }
    __syncthreads();  // the next tile overwrites sq, sdo, sp, sds
  }

  for (int64_t idx = threadIdx.x; idx < bn * D; idx += blockDim.x) {
    const int64_t c = idx / D, d = idx % D;
    dk[((start + j0 + c) * H + h) * D + d] = static_cast<scalar_t>(sdk[idx]);
  }
  for (int64_t idx = threadIdx.x; idx < bn * Dv; idx += blockDim.x) {
    const int64_t c = idx / Dv, d = idx % Dv;
    dv[((start + j0 + c) * H + h) * Dv + d] = static_cast<scalar_t>(sdv[idx]);
  }
  for (int64_t m = threadIdx.x; m < time_width; m += blockDim.x) {
    if (g.deterministic) {
      g.time_scratch[(static_cast<int64_t>(blockIdx.x) * g.key_blocks + blockIdx.y) * time_width + m] = stime[m];
    } else if (stime[m] != 0.0f) {
      atomicAdd(g.dtime + ht * time_width + m, stime[m]);
    }
  }
}

template <typename scalar_t>
__global__ void jagged_attention_bwd_q_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                              const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                                              const float* __restrict__ lse, const float* __restrict__ delta,
                                              scalar_t* __restrict__ dq, AttnArgs a) {
  extern __shared__ float smem[];
  const int64_t D = a.D, Dv = a.Dv, H = a.H;
  float* sq = smem;                      // [kBlockM][D]
  float* sdo = sq + kBlockM * D;         // [kBlockM][Dv]
  float* sdq = sdo + kBlockM * Dv;       // [kBlockM][D]
  const int64_t kp = kv_pitch(D), vp = kv_pitch(Dv);
  float* sk = sdq + kBlockM * D;         // [kBlockN][kp]
  float* sv = sk + kBlockN * kp;         // [kBlockN][vp]
  float* sp = sv + kBlockN * vp;         // [kBlockM][kBlockN]
  float* sds = sp + kBlockM * kBlockN;   // [kBlockM][kBlockN]
  __shared__ float row_lse[kBlockM], row_delta[kBlockM];
  __shared__ unsigned char svis[kBlockM * kBlockN];

  const auto [b, h, start, L, i0, bm, max_id, hp, ht] = block_tile<kBlockM>(a);
  if (bm <= 0) return;  // uniform over the block

  load_rows(sq, q, start + i0, kBlockM, bm, H, h, D, D);
  load_rows(sdo, dout, start + i0, kBlockM, bm, H, h, Dv, Dv);
  if (a.softmax) load_row_stats(row_lse, row_delta, lse, delta, start + i0, bm, H, h);
  for (int64_t idx = threadIdx.x; idx < kBlockM * D; idx += blockDim.x) sdq[idx] = 0.0f;
  __syncthreads();

  for (int64_t j0 = 0; j0 < L; j0 += kBlockN) {
    const int64_t bn = min(static_cast<int64_t>(kBlockN), L - j0);
    if (!tile_visible(i0, bm, j0, bn, max_id, a)) continue;
    load_rows(sk, k, start + j0, kBlockN, bn, H, h, D, kp);
    load_rows(sv, v, start + j0, kBlockN, bn, H, h, Dv, vp);
    __syncthreads();
    grad_tile(sq, sk, sv, sdo, row_lse, row_delta, sp, sds, svis, nullptr, i0, bm, j0, bn, start, hp, ht, max_id, a);
    __syncthreads();
    for (int64_t idx = threadIdx.x; idx < kBlockM * D; idx += blockDim.x) {
      const int64_t r = idx / D, d = idx % D;
      float acc = 0.0f;
      for (int64_t c = 0; c < bn; ++c) acc += svis[r * kBlockN + c] ? sds[r * kBlockN + c] * sk[c * kp + d] : 0.0f;
      sdq[idx] += a.scale * acc;
    }
    __syncthreads();  // the next tile overwrites sk, sv, sp, sds
  }

  for (int64_t idx = threadIdx.x; idx < bm * D; idx += blockDim.x) {
    const int64_t r = idx / D, d = idx % D;
    dq[((start + i0 + r) * H + h) * D + d] = static_cast<scalar_t>(sdq[idx]);
  }
}

// floor(x / y) for y > 0 and any sign of x.
__device__ __forceinline__ int64_t floor_div(int64_t x, int64_t y) { return x >= 0 ? x / y : -((-x + y - 1) / y); }

// Deterministic dpos: thread (rel, hp) sums the pos windows of every KV block that holds relative
// position rel - (M-1), over sequences b, heads h of group hp (all h when pos_heads == 1) and key
// blocks n, in that fixed order. FLOPs: one add per scratch float; bytes: the scratch once + dpos.
__global__ void pos_bias_grad_reduce_kernel(const float* __restrict__ scratch, const int64_t* __restrict__ bases,
                                            const int64_t* __restrict__ offsets, float* __restrict__ dpos,
                                            int64_t num_seqs, int64_t H, int64_t M, int64_t pos_heads) {
  const int64_t width = 2 * M - 1;
  const int64_t rel = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t hp = blockIdx.y;
  if (rel >= width) return;
  const int64_t dji = rel - (M - 1);  // j - i
  const int64_t h_lo = pos_heads == 1 ? 0 : hp, h_hi = pos_heads == 1 ? H : hp + 1;
  float acc = 0.0f;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t L = offsets[b + 1] - offsets[b];
    if (L == 0) continue;
    const int64_t key_tiles = (L + kBlockN - 1) / kBlockN, pos_width = L + kBlockN - 1;
    // Block n holds j - i at x = dji - n*kBlockN + L - 1, present when 0 <= x < pos_width.
    const int64_t n_lo = max(floor_div(dji, kBlockN), static_cast<int64_t>(0));
    const int64_t n_hi = min(floor_div(dji + L - 1, kBlockN), key_tiles - 1);
    for (int64_t h = h_lo; h < h_hi; ++h)
      for (int64_t n = n_lo; n <= n_hi; ++n)
        acc += scratch[bases[b] + (h * key_tiles + n) * pos_width + (dji - n * kBlockN + L - 1)];
  }
  dpos[hp * width + rel] = acc;
}

at::Tensor opt_float(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  GK_CHECK_CUDA((*t));
  return t->to(at::kFloat).contiguous();
}

// The kernels' arguments and the device tensors they point into (kept alive by this struct).
struct Prepared {
  AttnArgs a{};
  at::Tensor offsets, targets, pos_bias, time_bias, timestamps, query_timestamps, thr;
};

Prepared prepare(const at::Tensor& q, const at::Tensor& v, const at::Tensor& seq_offsets, int64_t max_seq_len,
                 c10::string_view kind, bool causal, double scale, const c10::optional<at::Tensor>& num_targets,
                 int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
                 const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
                 const c10::optional<at::Tensor>& query_timestamps_in) {
  Prepared p;
  AttnArgs& a = p.a;
  const int64_t N = q.size(0);
  p.offsets = seq_offsets.to(at::kLong).contiguous();
  a.offsets = p.offsets.data_ptr<int64_t>();
  if (num_targets.has_value() && num_targets->defined()) {
    GK_CHECK_CUDA((*num_targets));
    TORCH_CHECK(num_targets->numel() == seq_offsets.numel() - 1, "num_targets must be [B]");
    p.targets = num_targets->to(at::kLong).contiguous();
    a.targets = p.targets.data_ptr<int64_t>();
  }
  p.pos_bias = opt_float(pos_bias_in);
  p.time_bias = opt_float(time_bias_in);
  const auto given = [](const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); };
  attention_checks::biases(p.pos_bias, p.time_bias, given(timestamps_in), given(query_timestamps_in), q.size(1), N,
                           max_seq_len);
  if (p.pos_bias.defined()) {
    a.pos_bias = p.pos_bias.data_ptr<float>();
    a.pos_heads = p.pos_bias.size(0);
  }
  if (p.time_bias.defined()) {
    GK_CHECK_CUDA((*timestamps_in));
    p.timestamps = timestamps_in->to(at::kLong).contiguous();
    a.time_bias = p.time_bias.data_ptr<float>();
    a.time_heads = p.time_bias.size(0);
    a.num_buckets = p.time_bias.size(1) - 1;
    const auto table = bucket_thresholds(a.num_buckets);
    at::Tensor host = at::empty({static_cast<int64_t>(table.size()) + 1}, at::kLong);
    std::copy(table.begin(), table.end(), host.data_ptr<int64_t>());
    p.thr = host.to(p.offsets.device());
    a.timestamps = p.timestamps.data_ptr<int64_t>();
    a.query_timestamps = a.timestamps;
    if (query_timestamps_in.has_value() && query_timestamps_in->defined()) {
      GK_CHECK_CUDA((*query_timestamps_in));
      p.query_timestamps = query_timestamps_in->to(at::kLong).contiguous();
      a.query_timestamps = p.query_timestamps.data_ptr<int64_t>();
    }
    a.thr = p.thr.data_ptr<int64_t>();
  }
  a.H = q.size(1);
  a.D = q.size(2);
  a.Dv = v.size(2);
  a.M = max_seq_len;
  a.contextual_len = contextual_len;
  a.max_attn_len = max_attn_len;
  a.scale = static_cast<float>(scale);
  a.inv_m = max_seq_len > 0 ? 1.0f / static_cast<float>(max_seq_len) : 0.0f;
  a.softmax = kind == "softmax";
  a.causal = causal;
  return p;
}

// Where head dims past the cuda backend's shared memory can go (gem_kernels/triton/attention.py MAX_HEAD_DIM).
constexpr const char* kOtherBackends =
    "the triton backend takes head dims up to 1024 in fp16/bf16 and 512 in fp32, the reference backend any";

std::string head_dims(int64_t D, int64_t Dv) {
  return "head dims Dqk = " + std::to_string(D) + ", Dv = " + std::to_string(Dv);
}

// Grid axis y holds the query or key tiles of a sequence: CUDA stops it at 65535.
void check_tiles(int64_t max_seq_len, int64_t tile) {
  TORCH_CHECK_VALUE((max_seq_len + tile - 1) / tile <= 65535, "jagged_attention: max_seq_len ", max_seq_len,
                    " is above the cuda backend's limit of ", 65535 * tile, "; use the triton backend");
}

std::tuple<at::Tensor, at::Tensor> jagged_attention_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& seq_offsets,
    int64_t max_seq_len, c10::string_view kind, bool causal, double scale, const c10::optional<at::Tensor>& num_targets,
    int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
    const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
    const c10::optional<at::Tensor>& query_timestamps_in) {
  attention_checks::qkv(q_in, k_in, v_in, seq_offsets, kind, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Dv = v.size(2), B = seq_offsets.numel() - 1;
  const bool softmax = kind == "softmax";
  auto out = at::empty({N, H, Dv}, q.options());
  const std::vector<int64_t> lse_shape = softmax ? std::vector<int64_t>{N, H} : std::vector<int64_t>{0};
  auto lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
  if (N == 0 || B == 0 || H == 0) return {out, lse};
  check_tiles(max_seq_len, kBlockM);
  const Prepared p = prepare(q, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                             max_attn_len, pos_bias_in, time_bias_in, timestamps_in,
                             query_timestamps_in);

  const int64_t kp = kv_pitch(D), vp = kv_pitch(Dv);
  const size_t smem = sizeof(float) * (kBlockM * D + kBlockN * kp + kBlockN * vp + kBlockM * kBlockN + kBlockM * Dv);
  const dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((max_seq_len + kBlockM - 1) / kBlockM));
  if (grid.y == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "jagged_attention_fwd_cuda", [&] {
    auto kernel = jagged_attention_fwd_kernel<scalar_t>;
    prepare_dynamic_smem(kernel, smem, "jagged_attention", head_dims(D, Dv), kOtherBackends);
    kernel<<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        softmax ? lse.data_ptr<float>() : nullptr, p.a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

// generative-recommenders' delta_hstu_mha: delta_q [B * delta, H, D] holds the queries of the last delta
// rows of every sequence, k and v [N, H, *] the whole sequences; causal. The forward kernel with
// a.delta set: grid (B * H, cdiv(delta, kBlockM)), each block walking its sequence's key tiles, so the
// work is delta * L pairs per sequence instead of L^2 (FLOPs 4 * sum_b delta * L_b * H * D at most;
// minimum bytes (N * H * (Dqk + Dv) + 2 * B * delta * H * Dv) * s).
at::Tensor cached_jagged_attention_fwd_cuda(
    const at::Tensor& delta_q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& seq_offsets,
    int64_t max_seq_len, c10::string_view kind, double scale, const c10::optional<at::Tensor>& num_targets,
    int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
    const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
    const c10::optional<at::Tensor>& query_timestamps_in) {
  attention_checks::cached_qkv(delta_q_in, k_in, v_in, seq_offsets, kind, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(delta_q_in.device());
  const auto q = delta_q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t rows = q.size(0), H = q.size(1), D = q.size(2), Dv = v.size(2), B = seq_offsets.numel() - 1;
  const int64_t delta = B > 0 ? rows / B : 0;
  auto out = at::empty({rows, H, Dv}, q.options());
  if (delta == 0 || H == 0) return out;
  check_tiles(delta, kBlockM);
  // The kernel reads tq of position i at row start + i: the delta rows' tq go into a copy of timestamps.
  c10::optional<at::Tensor> query_timestamps = c10::nullopt;
  const bool has_time = time_bias_in.has_value() && time_bias_in->defined();
  if (has_time && query_timestamps_in.has_value() && query_timestamps_in->defined() && timestamps_in.has_value() &&
      timestamps_in->defined()) {
    GK_CHECK_CUDA((*query_timestamps_in));
    GK_CHECK_CUDA((*timestamps_in));
    TORCH_CHECK(query_timestamps_in->numel() == rows, "query_timestamps must be [B * delta]");
    const auto ends = seq_offsets.to(at::kLong).slice(0, 1).unsqueeze(1);
    const auto where = (ends - delta + at::arange(delta, ends.options())).reshape({-1});
    auto full = timestamps_in->to(at::kLong).contiguous().clone();
    full.index_put_({where}, query_timestamps_in->to(at::kLong).reshape({-1}));
    query_timestamps = full;
  }
  Prepared p = prepare(k, v, seq_offsets, max_seq_len, kind, /*causal=*/true, scale, num_targets, contextual_len,
                       max_attn_len, pos_bias_in, time_bias_in, timestamps_in, query_timestamps);
  p.a.delta = delta;

  const int64_t kp = kv_pitch(D), vp = kv_pitch(Dv);
  const size_t smem = sizeof(float) * (kBlockM * D + kBlockN * kp + kBlockN * vp + kBlockM * kBlockN + kBlockM * Dv);
  const dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((delta + kBlockM - 1) / kBlockM));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "cached_jagged_attention_fwd_cuda", [&] {
    auto kernel = jagged_attention_fwd_kernel<scalar_t>;
    prepare_dynamic_smem(kernel, smem, "cached_jagged_attention", head_dims(D, Dv), kOtherBackends);
    kernel<<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), nullptr,
        p.a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> jagged_attention_bwd_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& seq_offsets, int64_t max_seq_len,
    c10::string_view kind, bool causal, double scale, const c10::optional<at::Tensor>& num_targets,
    int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
    const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
    const c10::optional<at::Tensor>& query_timestamps_in, bool deterministic) {
  attention_checks::qkv(q_in, k_in, v_in, seq_offsets, kind, c10::DeviceType::CUDA);
  GK_CHECK_CUDA(grad_out_in);
  TORCH_CHECK(grad_out_in.sizes() == v_in.sizes(), "grad_out must be [N, H, Dv]");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const auto dout = grad_out_in.to(q.scalar_type()).contiguous();
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Dv = v.size(2), B = seq_offsets.numel() - 1;
  const bool softmax = kind == "softmax";
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const bool has_pos = pos_bias_in.has_value() && pos_bias_in->defined();
  const bool has_time = time_bias_in.has_value() && time_bias_in->defined();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dpos = has_pos ? at::zeros(pos_bias_in->sizes(), f32) : at::empty({0}, q.options());
  at::Tensor dtime = has_time ? at::zeros(time_bias_in->sizes(), f32) : at::empty({0}, q.options());
  const auto finish = [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    return {dq, dk, dv, has_pos ? dpos.to(pos_bias_in->scalar_type()) : dpos,
            has_time ? dtime.to(time_bias_in->scalar_type()) : dtime};
  };
  if (N == 0 || B == 0 || H == 0 || max_seq_len == 0) return finish();
  check_tiles(max_seq_len, kBlockM);
  const Prepared p = prepare(q, v, seq_offsets, max_seq_len, kind, causal, scale, num_targets, contextual_len,
                             max_attn_len, pos_bias_in, time_bias_in, timestamps_in,
                             query_timestamps_in);
  at::Tensor lse, delta;
  if (softmax) {
    GK_CHECK_CUDA(out_in);
    GK_CHECK_CUDA(lse_in);
    TORCH_CHECK(out_in.sizes() == v.sizes() && lse_in.numel() == N * H && lse_in.scalar_type() == at::kFloat,
                "softmax backward needs out [N, H, Dv] and fp32 lse [N, H]");
    lse = lse_in.contiguous();
    delta = (dout.to(at::kFloat) * out_in.to(at::kFloat)).sum(-1).contiguous();  // [N, H]
  }

  const int64_t key_blocks = (max_seq_len + kBlockN - 1) / kBlockN;
  const int64_t time_width = has_time ? p.a.num_buckets + 1 : 0;
  BiasGradOut g{};
  g.deterministic = deterministic;
  g.key_blocks = key_blocks;
  g.dpos = has_pos ? dpos.data_ptr<float>() : nullptr;
  g.dtime = has_time ? dtime.data_ptr<float>() : nullptr;
  at::Tensor pos_scratch, pos_bases, time_scratch;
  if (deterministic && has_pos) {
    // Sequence b (L, nt = cdiv(L, kBlockN) key blocks) takes H * nt * (L + kBlockN - 1) floats: the
    // scratch is 4 * H * sum_b nt_b (L_b + kBlockN - 1) bytes, ~H * sum_b L_b^2 / 8 bytes (jagged, no
    // padding to max_seq_len). Zeroed: the blocks add into it. One host copy of the offsets sizes it.
    const auto lengths = p.offsets.diff().cpu();
    const auto tiles = (lengths + (kBlockN - 1)).div(kBlockN, "floor");
    const auto sizes = H * tiles * (lengths + (kBlockN - 1));
    const auto bases_host = sizes.cumsum(0) - sizes;
    pos_bases = bases_host.to(q.device());
    pos_scratch = at::zeros({sizes.sum().item<int64_t>()}, f32);
    g.pos_scratch = pos_scratch.data_ptr<float>();
    g.pos_bases = pos_bases.data_ptr<int64_t>();
  }
  if (deterministic && has_time) {
    // [B*H, key_blocks, num_buckets+1]: 4 * B * H * cdiv(max_seq_len, kBlockN) * (num_buckets+1) bytes.
    // Zeroed: blocks past their sequence's end store nothing.
    time_scratch = at::zeros({B * H, key_blocks, time_width}, f32);
    g.time_scratch = time_scratch.data_ptr<float>();
  }

  const int64_t kp = kv_pitch(D), vp = kv_pitch(Dv);
  const size_t smem_kv = sizeof(float) * (kBlockN * (kp + D) + kBlockN * (vp + Dv) + kBlockM * D + kBlockM * Dv +
                                          2 * kBlockM * kBlockN + time_width) +
                         (has_time ? sizeof(int) * kBlockM * kBlockN : 0);
  const size_t smem_q = sizeof(float) * (2 * kBlockM * D + kBlockM * Dv + kBlockN * kp + kBlockN * vp +
                                         2 * kBlockM * kBlockN);
  const dim3 grid_kv(static_cast<unsigned>(B * H), static_cast<unsigned>(key_blocks));
  const dim3 grid_q(static_cast<unsigned>(B * H), static_cast<unsigned>((max_seq_len + kBlockM - 1) / kBlockM));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const float* lse_ptr = softmax ? lse.data_ptr<float>() : nullptr;
  const float* delta_ptr = softmax ? delta.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "jagged_attention_bwd_cuda", [&] {
    auto kv_kernel = jagged_attention_bwd_kv_kernel<scalar_t>;
    prepare_dynamic_smem(kv_kernel, smem_kv, "jagged_attention backward", head_dims(D, Dv), kOtherBackends);
    kv_kernel<<<grid_kv, kThreads, smem_kv, stream>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), lse_ptr,
        delta_ptr, dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), p.a, g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto q_kernel = jagged_attention_bwd_q_kernel<scalar_t>;
    prepare_dynamic_smem(q_kernel, smem_q, "jagged_attention backward", head_dims(D, Dv), kOtherBackends);
    q_kernel<<<grid_q, kThreads, smem_q, stream>>>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                                                   v.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), lse_ptr,
                                                   delta_ptr, dq.data_ptr<scalar_t>(), p.a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (deterministic && has_pos) {
    const int64_t width = 2 * max_seq_len - 1;
    const dim3 grid(static_cast<unsigned>((width + kThreads - 1) / kThreads), static_cast<unsigned>(p.a.pos_heads));
    pos_bias_grad_reduce_kernel<<<grid, kThreads, 0, stream>>>(pos_scratch.data_ptr<float>(),
                                                               pos_bases.data_ptr<int64_t>(),
                                                               p.offsets.data_ptr<int64_t>(), dpos.data_ptr<float>(),
                                                               B, H, max_seq_len, p.a.pos_heads);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (deterministic && has_time) {
    // ATen's sum reduces in a fixed order for a given shape: deterministic.
    const auto per_head = time_scratch.view({B, H, key_blocks, time_width}).sum(at::IntArrayRef{0, 2});
    dtime = p.a.time_heads == H ? per_head : per_head.sum(0, /*keepdim=*/true);
  }
  return finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) {
  m.impl("jagged_attention_fwd_native", &jagged_attention_fwd_cuda);
  m.impl("cached_jagged_attention_fwd_native", &cached_jagged_attention_fwd_cuda);
  m.impl("jagged_attention_bwd_native", &jagged_attention_bwd_cuda);
}

}  // namespace gem_kernels
