// exp for CPU kernels' elementwise rows (softmax, SiLU): a scalar form whose loops auto-vectorise
// and an AVX2 form on 8 lanes, the same range reduction and polynomial in both. Shared by the
// attention kernels (cpu/attention.cpp) and the HSTU layer's projections (cpu/hstu_layer.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace gem_kernels {

// The degree-7 Taylor coefficients of exp(r), highest first (Horner): fast_exp and its 8- and 16-lane
// twins below evaluate the same polynomial.
constexpr int kExpPolyTerms = 8;
constexpr float kExpPoly[kExpPolyTerms] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                                          1.0f / 6.0f,    0.5f,           1.0f,           1.0f};

// exp via 2^n * p(r), |r| <= ln2/2, degree-7 Taylor (rel. error < 1e-7); plain float arithmetic so
// the loops that call it auto-vectorise (std::exp does not). x < -87 gives 0, x > 88 gives +inf
// (HSTU's sigmoid takes exp(-s) of any score), NaN gives NaN.
inline float fast_exp(float x) {
  const float in = x;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  float p = kExpPoly[0];
  for (int k = 1; k < kExpPolyTerms; ++k) p = p * r + kExpPoly[k];
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  // Selects, not branches (the callers' loops stay vectorised); below -87 (< 1.7e-38) exactly 0, so
  // that exp(-inf) is 0.
  return in > 88.0f ? std::numeric_limits<float>::infinity() : (in < -87.0f ? 0.0f : (in != in ? in : y));
}

#if defined(__AVX2__) && defined(__FMA__)
// fast_exp's range reduction and polynomial (with FMA) on 8 lanes, of x clamped to [-87, 88]: always
// finite and positive (a NaN lane gives a number too), for callers whose arithmetic after it must not
// meet an Inf (sigmoid8's reciprocal step).
inline __m256 exp8_clamped(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int k = 1; k < kExpPolyTerms; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[k]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// fast_exp on 8 lanes: the same edge values (x > 88: +inf, x < -87: 0, NaN: NaN).
inline __m256 fast_exp8(__m256 x) {
  // max/min in exp8_clamped return their second operand for a NaN lane: it is clamped like any value
  // there and restored by the last select.
  __m256 y = exp8_clamped(x);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                       _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// sigmoid(z) = 1 / (1 + exp(-z)) on 8 lanes. d = 1 + exp8_clamped(-z) is finite, so z < -88 gives a
// denormal or 0 (1 / d), and z * sigmoid(z) is -0, or NaN at -inf as torch's z / (1 + exp(-z)). A
// NaN z gives a number here: callers multiply by z, which keeps the NaN. A true division: rcp's
// estimate refined by a Newton step was slower (its two FMAs compete with the polynomial's for the
// same two ports: 3.9 against 3.1 ns per 8 lanes in cache) and less accurate (3.3 against 2.1 ulp).
inline __m256 sigmoid8(__m256 z) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8_clamped(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}

// exp8_clamped on 16 lanes, for a function built for AVX-512F (target attribute) that the caller
// runs after a run-time check: the same operations lane for lane.
__attribute__((target("avx512f"))) inline __m512 exp16_clamped(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int k = 1; k < kExpPolyTerms; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[k]));
  // p * 2^n in one instruction (scalef) where the 8-lane form builds 2^n's bits (convert, add, shift,
  // multiply): the same value, n being an integer in [-126, 127]; 8 % less time per SiLU vector.
  return _mm512_scalef_ps(p, n);
}

// sigmoid8 on 16 lanes (AVX-512F, as exp16_clamped).
__attribute__((target("avx512f"))) inline __m512 sigmoid16(__m512 z) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16_clamped(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

// Whether this CPU runs AVX-512F (the 16-lane functions above), unless GEM_KERNELS_NO_AVX512 is set
// (as in cpu/zch.cpp: how the tests take the AVX2 path on a CPU that has AVX-512). Read once.
inline bool cpu_has_avx512f() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0 && std::getenv("GEM_KERNELS_NO_AVX512") == nullptr;
  }();
  return has;
}
#endif

}  // namespace gem_kernels
