// CPU kernel of the quantized embedding bag (inference): T tables of FBGEMM IntNBit rows in one flat
// uint8 buffer, looked up and pooled in one call.
//
// Row format (gem_kernels/ops/quant_embedding_bag.py): int8/int4/int2 rows are [scale fp16][bias fp16]
// [packed codes, low bits first], fp16/fp32 rows the values, fp8 rows FBGEMM's HFP8 bytes; table t
// starts at byte weights_offsets[t], its rows row_bytes[t] apart.
//
// Work decomposition: items of (table, 128 consecutive bags), table-major, handed to the threads
// dynamically (parallel_dynamic, as the training forward); one item owns whole bags, so every output
// slice is written by one thread. A row is dequantized straight into AVX2 fp32 lanes (int4: a 16-byte
// load, nibbles split with a shift and a mask and interleaved back in order with unpacklo/hi; int2
// the same with four shifts; fp16 with F16C; fp8 by moving its bits into fp32's exponent and
// mantissa) and accumulated in registers in FBGEMM's order, acc = fma(w*scale, q, acc + w*bias),
// for D a multiple of 32 (D = 32/64/128 compiled with D known, so the accumulator never leaves the
// registers); other D, and builds without AVX2, take the scalar loop with the same arithmetic. The
// row 16 indices ahead is prefetched: lookups are random DRAM reads.
//
// Roofline: FLOPs 2 * N * D (pooled); minimum bytes N * row_bytes (rows read) + B * sum_t D_t * o
// (output written, o = output element size) + N * i + (T*B+1) * i (indices, offsets).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GK_QEB_AVX2 1
#endif

#include "gem_kernels/checks.h"
#include "gem_kernels/embedding_bag_codes.h"
#include "gem_kernels/parallel.h"
#include "gem_kernels/quant_embedding_bag_checks.h"

namespace gem_kernels {
namespace {

// FBGEMM's SparseType codes (gem_kernels/ops/quant_embedding_bag.py WEIGHT_TYPES).
constexpr int64_t kFP32 = 0, kFP16 = 1, kINT8 = 2, kINT4 = 3, kINT2 = 4, kFP8 = 6;
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kBagsPerChunk = 128;

inline int64_t bits_of(int64_t ty) {
  switch (ty) {
    case kFP32: return 32;
    case kFP16: return 16;
    case kINT8: case kFP8: return 8;
    case kINT4: return 4;
    case kINT2: return 2;
    default: return 0;
  }
}
constexpr bool has_scale_bias(int64_t ty) { return ty == kINT8 || ty == kINT4 || ty == kINT2; }

struct QMeta {
  const int64_t* w_off;
  const int64_t* d_off;
  const int64_t* r_off;
  const int64_t* tys;
  const int64_t* stride;
  int64_t T, B, max_D;
};

struct Fp8 {
  int32_t shift;     // 16 + exponent_bits: moves the 7 magnitude bits into fp32's exponent/mantissa
  float multiplier;  // 2^(127 - exponent_bias)
};

inline float fp8_to_float(uint8_t q, const Fp8& f) {
  uint32_t bits = static_cast<uint32_t>(q & 0x7F) << f.shift;
  float v;
  std::memcpy(&v, &bits, 4);
  v *= f.multiplier;
  return (q & 0x80) ? -v : v;
}

// Element j of a row of type ty, as FBGEMM reads it (codes, not yet scaled).
inline float element(const uint8_t* data, int64_t ty, int64_t j, const Fp8& f) {
  switch (ty) {
    case kFP32: { float v; std::memcpy(&v, data + 4 * j, 4); return v; }
    case kFP16: { c10::Half h; std::memcpy(&h, data + 2 * j, 2); return static_cast<float>(h); }
    case kFP8: return fp8_to_float(data[j], f);
    case kINT8: return static_cast<float>(data[j]);
    case kINT4: return static_cast<float>((data[j >> 1] >> ((j & 1) * 4)) & 0xF);
    default: return static_cast<float>((data[j >> 2] >> ((j & 3) * 2)) & 0x3);
  }
}

// (scale, bias) of a row times the lookup's weight w; (w, 0) for rows without them.
inline void row_scale_bias(const uint8_t* row, int64_t ty, float w, float& scale, float& bias) {
  if (has_scale_bias(ty)) {
    uint16_t s, b;
    std::memcpy(&s, row, 2);
    std::memcpy(&b, row + 2, 2);
#ifdef GK_QEB_AVX2
    scale = w * _cvtsh_ss(s);  // one F16C instruction per value, once per looked-up row
    bias = w * _cvtsh_ss(b);
#else
    scale = w * static_cast<float>(c10::Half(s, c10::Half::from_bits()));
    bias = w * static_cast<float>(c10::Half(b, c10::Half::from_bits()));
#endif
  } else {
    scale = w;
    bias = 0.f;
  }
}

// acc[0:D] = fma(scale, x, acc + bias), the scalar path (any D, any build).
inline void accumulate_scalar(float* acc, const uint8_t* row, int64_t ty, int64_t D, float scale, float bias,
                              const Fp8& f) {
  const uint8_t* data = row + (has_scale_bias(ty) ? 4 : 0);
  for (int64_t j = 0; j < D; ++j) acc[j] = std::fma(scale, element(data, ty, j, f), acc[j] + bias);
}

#ifdef GK_QEB_AVX2
// Elements [32c, 32c + 32) of a row's data as four vectors of 8 fp32 (codes for int types).
template <int64_t kTy>
inline void load32(const uint8_t* data, int64_t c, __m256 x[4], const Fp8& f) {
  if constexpr (kTy == kINT8) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 32 * c));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 32 * c + 16));
    x[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    x[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    x[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    x[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else if constexpr (kTy == kINT4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 16 * c));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m128i e0 = _mm_unpacklo_epi8(lo, hi);  // elements 0..15, in order
    const __m128i e1 = _mm_unpackhi_epi8(lo, hi);  // elements 16..31
    x[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e0));
    x[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e0, 8)));
    x[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e1));
    x[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e1, 8)));
  } else if constexpr (kTy == kINT2) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + 8 * c));
    const __m128i mask = _mm_set1_epi8(0x03);
    const __m128i q0 = _mm_and_si128(v, mask);
    const __m128i q1 = _mm_and_si128(_mm_srli_epi16(v, 2), mask);
    const __m128i q2 = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m128i q3 = _mm_and_si128(_mm_srli_epi16(v, 6), mask);
    const __m128i e = _mm_unpacklo_epi16(_mm_unpacklo_epi8(q0, q1), _mm_unpacklo_epi8(q2, q3));  // 0..15
    const __m128i g = _mm_unpackhi_epi16(_mm_unpacklo_epi8(q0, q1), _mm_unpacklo_epi8(q2, q3));  // 16..31
    x[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e));
    x[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e, 8)));
    x[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(g));
    x[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(g, 8)));
  } else if constexpr (kTy == kFP16) {
    for (int k = 0; k < 4; ++k)
      x[k] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 64 * c + 16 * k)));
  } else if constexpr (kTy == kFP32) {
    for (int k = 0; k < 4; ++k) x[k] = _mm256_loadu_ps(reinterpret_cast<const float*>(data) + 32 * c + 8 * k);
  } else {  // kFP8
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 32 * c));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 32 * c + 16));
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256i magnitude_mask = _mm256_set1_epi32(0x7F);
    const __m128i shift = _mm_cvtsi32_si128(f.shift);
    const __m256 multiplier = _mm256_set1_ps(f.multiplier);
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_cvtepu8_epi32(parts[k]);
      const __m256 magnitude =
          _mm256_mul_ps(_mm256_castsi256_ps(_mm256_sll_epi32(_mm256_and_si256(q, magnitude_mask), shift)), multiplier);
      const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(q, 7), 31);
      x[k] = _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
    }
  }
}

// acc += one row: kD > 0 is D known at compile time (the accumulator stays in registers), else D
// (a multiple of 32) at run time.
template <int64_t kTy, int kD>
inline void accumulate_avx2(__m256* acc, const uint8_t* row, int64_t D, float scale, float bias, const Fp8& f) {
  const uint8_t* data = row + (has_scale_bias(kTy) ? 4 : 0);
  const __m256 s = _mm256_set1_ps(scale), b = _mm256_set1_ps(bias);
  const int64_t chunks = (kD > 0 ? kD : D) / 32;
#pragma GCC unroll 4
  for (int64_t c = 0; c < chunks; ++c) {
    __m256 x[4];
    load32<kTy>(data, c, x, f);
    for (int k = 0; k < 4; ++k) {
      __m256& a = acc[4 * c + k];
      a = has_scale_bias(kTy) ? _mm256_fmadd_ps(s, x[k], _mm256_add_ps(a, b)) : _mm256_fmadd_ps(s, x[k], a);
    }
  }
}
#endif

template <typename out_t>
inline void store_out(out_t* dst, const float* src, float scale, int64_t D) {
  for (int64_t j = 0; j < D; ++j) dst[j] = static_cast<out_t>(src[j] * scale);
}

struct Lookup {
  const uint8_t* table;
  int64_t rows, stride, ty, D;
};

// Pools (or, for pooling none, writes row by row) the bags [b_begin, b_end) of table t.
template <int64_t kTy, int kD, typename index_t, typename out_t, typename OnBad>
void run_bags(const Lookup& L, const index_t* indices, const index_t* offsets, const float* psw, out_t* out,
              int64_t out_stride, int64_t col, int64_t t, int64_t B, int64_t b_begin, int64_t b_end,
              int64_t prefetch_stop, int64_t pooling, const Fp8& f, float* buf, const OnBad& on_bad) {
  const int64_t D = kD > 0 ? kD : L.D;
#ifdef GK_QEB_AVX2
  constexpr int kAccs = kD > 0 ? kD / 8 : 32;  // run-time D: up to 256 columns here, wider ones take the scalar loop
  __m256 acc[kAccs] = {};  // reset() clears the D / 8 in use per bag; the rest are never read
  const bool vector = D % 32 == 0 && D / 8 <= kAccs;
#else
  const bool vector = false;
#endif
  auto reset = [&] {
#ifdef GK_QEB_AVX2
    if (vector) {
      for (int64_t k = 0; k < D / 8; ++k) acc[k] = _mm256_setzero_ps();
      return;
    }
#endif
    std::fill(buf, buf + D, 0.f);
  };
  auto flush = [&](out_t* dst, float scale) {
#ifdef GK_QEB_AVX2
    if (vector) {
      for (int64_t k = 0; k < D / 8; ++k) _mm256_storeu_ps(buf + 8 * k, acc[k]);
    }
#endif
    store_out(dst, buf, scale, D);
  };
  for (int64_t b = b_begin; b < b_end; ++b) {
    const int64_t tb = t * B + b;
    const int64_t start = offsets[tb], stop = offsets[tb + 1];
    TORCH_CHECK_VALUE(start <= stop, "offsets must be nondecreasing, but offsets[", tb + 1, "] = ", stop,
                      " < offsets[", tb, "] = ", start);
    if (pooling != kNone) reset();
    int64_t kept = 0;
    for (int64_t p = start; p < stop; ++p) {
      if (p + kPrefetchDistance < prefetch_stop) {
        const int64_t ahead = indices[p + kPrefetchDistance];
        if (static_cast<uint64_t>(ahead) < static_cast<uint64_t>(L.rows)) {
          const char* line = reinterpret_cast<const char*>(L.table + ahead * L.stride);
          for (int64_t byte = 0; byte < L.stride; byte += 64) __builtin_prefetch(line + byte);
        }
      }
      const int64_t idx = indices[p];
      if (C10_UNLIKELY(static_cast<uint64_t>(idx) >= static_cast<uint64_t>(L.rows))) {
        on_bad(b, p, idx);
        if (pooling == kNone) std::fill(out + p * out_stride, out + p * out_stride + D, out_t(0));
        continue;
      }
      if (pooling == kNone) reset();
      const uint8_t* row = L.table + idx * L.stride;
      float scale, bias;
      row_scale_bias(row, kTy, psw ? psw[p] : 1.f, scale, bias);
#ifdef GK_QEB_AVX2
      if (vector) {
        accumulate_avx2<kTy, kD>(acc, row, D, scale, bias, f);
      } else
#endif
      {
        accumulate_scalar(buf, row, kTy, D, scale, bias, f);
      }
      if (pooling == kNone) flush(out + p * out_stride, 1.f);
      ++kept;
    }
    if (pooling != kNone) flush(out + b * out_stride + col, pooling == kMean && kept > 0 ? 1.f / kept : 1.f);
  }
}

template <int64_t kTy, typename index_t, typename out_t, typename OnBad>
void run_bags_d(const Lookup& L, const index_t* indices, const index_t* offsets, const float* psw, out_t* out,
                int64_t out_stride, int64_t col, int64_t t, int64_t B, int64_t b_begin, int64_t b_end,
                int64_t prefetch_stop, int64_t pooling, const Fp8& f, float* buf, const OnBad& on_bad) {
#define GK_QEB_RUN(KD) \
  run_bags<kTy, KD>(L, indices, offsets, psw, out, out_stride, col, t, B, b_begin, b_end, prefetch_stop, pooling, f, buf, on_bad)
  switch (L.D) {
    case 32: GK_QEB_RUN(32); break;
    case 64: GK_QEB_RUN(64); break;
    case 128: GK_QEB_RUN(128); break;
    default: GK_QEB_RUN(0);
  }
#undef GK_QEB_RUN
}

template <typename index_t, typename out_t>
void forward_kernel(const QMeta& m, const uint8_t* weights, const index_t* indices, const index_t* offsets,
                    const float* psw, out_t* out, int64_t output_dim, int64_t pooling, int64_t bounds_check,
                    const Fp8& f) {
  std::atomic<int64_t> dropped{0};
  std::mutex first_bad_mutex;
  std::string first_bad;
  const int64_t chunks = (m.B + kBagsPerChunk - 1) / kBagsPerChunk;
  const int64_t work = (static_cast<int64_t>(offsets[m.T * m.B]) + m.T * m.B) * m.max_D;
  parallel_dynamic(chunks * m.T, work, [&](int64_t item) {
    const int64_t t = item / chunks;
    const int64_t b_begin = (item % chunks) * kBagsPerChunk;
    const int64_t b_end = std::min(m.B, b_begin + kBagsPerChunk);
    thread_local std::vector<float> buf;
    buf.resize(std::max<int64_t>(m.max_D, 1));
    const Lookup L{weights + m.w_off[t], m.r_off[t + 1] - m.r_off[t], m.stride[t], m.tys[t], m.d_off[t + 1] - m.d_off[t]};
    const auto on_bad = [&](int64_t b, int64_t p, int64_t idx) {
      const std::string what = "indices[" + std::to_string(p) + "] = " + std::to_string(idx) +
                               " is out of range for table " + std::to_string(t) + " (num_embeddings=" +
                               std::to_string(L.rows) + ") in bag " + std::to_string(b);
      TORCH_CHECK_INDEX(bounds_check != kFatal, what);
      if (dropped.fetch_add(1) == 0) {
        std::lock_guard<std::mutex> lock(first_bad_mutex);
        first_bad = what;
      }
    };
    const int64_t stop = offsets[t * m.B + b_end];
    const int64_t col = pooling == kNone ? 0 : m.d_off[t];
#define GK_QEB_TYPE(TY) \
  run_bags_d<TY>(L, indices, offsets, psw, out, output_dim, col, t, m.B, b_begin, b_end, stop, pooling, f, buf.data(), on_bad)
    switch (L.ty) {
      case kINT8: GK_QEB_TYPE(kINT8); break;
      case kINT4: GK_QEB_TYPE(kINT4); break;
      case kINT2: GK_QEB_TYPE(kINT2); break;
      case kFP16: GK_QEB_TYPE(kFP16); break;
      case kFP32: GK_QEB_TYPE(kFP32); break;
      default: GK_QEB_TYPE(kFP8);
    }
#undef GK_QEB_TYPE
  });
  if (bounds_check == kWarn && dropped.load() > 0) {
    TORCH_WARN("embedding_bag: dropping ", dropped.load(), " out-of-range indices; first: ", first_bad);
  }
}

at::Tensor quant_embedding_bag_forward_cpu(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                           const at::Tensor& D_offsets, const at::Tensor& rows_offsets,
                                           const at::Tensor& weights_tys, const at::Tensor& row_bytes,
                                           const at::Tensor& indices, const at::Tensor& offsets,
                                           const at::Tensor& per_sample_weights, int64_t output_dim, int64_t pooling,
                                           int64_t bounds_check, at::ScalarType output_dtype,
                                           int64_t fp8_exponent_bits, int64_t fp8_exponent_bias) {
  const int64_t T = quant_embedding_bag_checks::args(
      weights, weights_offsets, D_offsets, rows_offsets, weights_tys, row_bytes, indices, offsets, per_sample_weights,
      pooling, output_dtype, fp8_exponent_bits, fp8_exponent_bias, c10::DeviceType::CPU);
  QMeta m{weights_offsets.data_ptr<int64_t>(), D_offsets.data_ptr<int64_t>(), rows_offsets.data_ptr<int64_t>(),
          weights_tys.data_ptr<int64_t>(), row_bytes.data_ptr<int64_t>(), T, (offsets.numel() - 1) / T, 0};
  // What keeps a direct call (no Python checks) inside its buffers.
  TORCH_CHECK(m.d_off[0] == 0 && m.r_off[0] == 0, "D_offsets[0] and rows_offsets[0] must be 0");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t D = m.d_off[t + 1] - m.d_off[t], rows = m.r_off[t + 1] - m.r_off[t], bits = bits_of(m.tys[t]);
    TORCH_CHECK(bits > 0, "weights_tys[", t, "] is not a supported type: ", m.tys[t]);
    TORCH_CHECK(D >= 1 && rows >= 1 && (D * bits) % 8 == 0, "table ", t, " has a bad D or rows");
    TORCH_CHECK(m.stride[t] >= D * bits / 8 + (has_scale_bias(m.tys[t]) ? 4 : 0), "row_bytes[", t, "] is too small");
    TORCH_CHECK(m.w_off[t] >= 0 && m.w_off[t] <= weights.numel() && rows <= (weights.numel() - m.w_off[t]) / m.stride[t],
                "table ", t, " does not fit in weights");
    TORCH_CHECK(pooling != kNone || D == output_dim, "pooling none needs D == output_dim");
    m.max_D = std::max(m.max_D, D);
  }
  TORCH_CHECK(pooling == kNone || m.d_off[T] == output_dim, "output_dim must equal D_offsets[-1]");
  const int64_t N = indices.numel();
  // Every bag's slice (an empty bag's zeros) and every pooling-none row (a dropped index's zeros) is written.
  auto out = at::empty({pooling == kNone ? N : m.B, output_dim}, weights.options().dtype(output_dtype));
  AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "quant_embedding_bag_forward_cpu", [&] {
    const index_t* off = offsets.data_ptr<index_t>();
    const int64_t n = offsets.numel();
    // gem_kernels._validate.check_offsets_values's checks and messages (ValueError in Python); the
    // nondecreasing check runs in the bag loop.
    TORCH_CHECK_VALUE(off[0] == 0, "offsets[0] must be 0, got ", static_cast<int64_t>(off[0]));
    TORCH_CHECK_VALUE(off[n - 1] == N, "offsets[-1] must equal the number of rows ", N, ", got ",
                      static_cast<int64_t>(off[n - 1]));
    for (int64_t i = 1; i < n; ++i) {
      TORCH_CHECK_VALUE(off[i] >= off[i - 1], "offsets must be nondecreasing, but offsets[", i, "] = ",
                        static_cast<int64_t>(off[i]), " < offsets[", i - 1, "] = ", static_cast<int64_t>(off[i - 1]));
    }
    if (m.B == 0) return;
    const Fp8 f{static_cast<int32_t>(16 + fp8_exponent_bits),
                std::ldexp(1.f, static_cast<int>(127 - fp8_exponent_bias))};
    const float* psw = per_sample_weights.numel() ? per_sample_weights.data_ptr<float>() : nullptr;
    const uint8_t* w = weights.data_ptr<uint8_t>();
    const index_t* idx = indices.data_ptr<index_t>();
    if (output_dtype == at::kFloat) {
      forward_kernel(m, w, idx, off, psw, out.data_ptr<float>(), output_dim, pooling, bounds_check, f);
    } else if (output_dtype == at::kHalf) {
      forward_kernel(m, w, idx, off, psw, out.data_ptr<at::Half>(), output_dim, pooling, bounds_check, f);
    } else {
      forward_kernel(m, w, idx, off, psw, out.data_ptr<at::BFloat16>(), output_dim, pooling, bounds_check, f);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("quant_embedding_bag_forward_native", &quant_embedding_bag_forward_cpu);
}

}  // namespace gem_kernels
