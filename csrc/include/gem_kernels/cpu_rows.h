// Row primitives of the CPU embedding kernels (embedding_bag.cpp, zch.cpp's fused remap + pooling):
// one home, so that a fused kernel pools bit for bit as the embedding-bag kernel does.
#pragma once

#include "gem_kernels/cpu_vec.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(CPU_CAPABILITY_AVX2)
#error "include gem_kernels/cpu_vec.h before any ATen header (else at::vec here is the scalar fallback)"
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

namespace gem_kernels {

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) __builtin_prefetch(p + byte);
}

// acc[0:D] += scale * row[0:D], row converted to fp32.
template <typename scalar_t>
inline void axpy_row(float* __restrict__ acc, const scalar_t* __restrict__ row, float scale, int64_t D) {
  using Vec = at::vec::Vectorized<float>;
  const Vec s(scale);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) {
    Vec x;
    if constexpr (std::is_same_v<scalar_t, float>) {
      x = Vec::loadu(row + d);
    } else {
      at::vec::load_to_float<scalar_t>(row + d, x);
    }
    at::vec::fmadd(x, s, Vec::loadu(acc + d)).store(acc + d);
  }
  for (; d < D; ++d) acc[d] += scale * static_cast<float>(row[d]);
}

// dst[0:D] = src[0:D] * scale, converted to scalar_t.
template <typename scalar_t>
inline void store_row(scalar_t* __restrict__ dst, const float* __restrict__ src, float scale, int64_t D) {
  using Vec = at::vec::Vectorized<float>;
  int64_t d = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    const Vec s(scale);
    for (; d + Vec::size() <= D; d += Vec::size()) (Vec::loadu(src + d) * s).store(dst + d);
  } else {
    const Vec s(scale);
    for (; d + 2 * Vec::size() <= D; d += 2 * Vec::size()) {
      at::vec::convert_from_float<scalar_t>(Vec::loadu(src + d) * s, Vec::loadu(src + d + Vec::size()) * s)
          .store(dst + d);
    }
  }
  for (; d < D; ++d) dst[d] = static_cast<scalar_t>(src[d] * scale);
}

}  // namespace gem_kernels
