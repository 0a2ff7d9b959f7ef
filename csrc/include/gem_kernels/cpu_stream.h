// Byte copies and fills for CPU kernels whose output is larger than the last-level cache.
//
// A normal store first reads the destination line into cache (read-for-ownership), so a kernel that
// only writes its output still moves its bytes twice. Non-temporal (streaming) stores skip that
// read and bypass the cache: right for outputs the cache cannot hold anyway, wrong for small ones
// that the next op would have found in cache, so callers choose with `use_streaming_stores`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gem_kernels {

// Above this output size the cache cannot hold the result for the next op anyway.
constexpr size_t kStreamingStoreMinBytes = size_t(32) << 20;

// Whether streaming stores beat normal ones on this machine for a large freshly allocated output
// (cpu/cpu_stream.cpp). It depends on the machine: a fresh page is zeroed by the OS at its first
// touch, and where that leaves the page in cache, normal stores hit it while streaming stores
// flush it (measured, jagged_to_padded at 537 MB: 52 ms normal vs 86 ms streaming on a 2-core Xeon
// VM, where a 2-core EPYC VM ran the streaming version faster than aten's normal stores). So it is
// measured once per process, on first use; GEM_KERNELS_STREAMING_STORES=0/1 decides instead.
bool streaming_stores_pay_off();

inline bool use_streaming_stores(size_t output_bytes) {
  return output_bytes >= kStreamingStoreMinBytes && streaming_stores_pay_off();
}

// The choice for an output written in short slices scattered over it (the embedding-bag forward's
// table-major bags: D floats per bag at a stride of the whole output row): streaming stores at
// kStreamingStoreMinBytes and above, unless the store kind is forced to normal
// (GEM_KERNELS_STREAMING_STORES=0 or set_streaming_stores(0)). The fresh-fill measurement above does
// not decide it: a normal store's read-for-ownership is then a random DRAM read, and its line evicts
// the table rows the kernel reads again; measured on the 2-core Xeon VM whose fill measurement picks
// normal stores, the embedding-bag bench's forward (41 MB fresh output, 1 thread, busy, interleaved):
// 148 ms normal vs 133 ms streaming, 160 vs 143, 92 vs 73 in three runs.
bool use_streaming_stores_for_scattered_output(size_t output_bytes);

// Copies `bytes` from src to dst (no overlap). Streams when `stream`, else memcpy.
inline void copy_bytes(void* dst, const void* src, size_t bytes, bool stream) {
#if defined(__AVX2__)
  if (stream && bytes >= 256) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
    std::memcpy(d, s, head);
    d += head, s += head, bytes -= head;
    for (; bytes >= 32; d += 32, s += 32, bytes -= 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    }
    std::memcpy(d, s, bytes);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Fills `count` elements of `elem_bytes` (1, 2, 4 or 8) at dst with the element at `value`.
inline void fill_elements(void* dst, const void* value, size_t count, size_t elem_bytes, bool stream) {
  auto* d = static_cast<char*>(dst);
  size_t bytes = count * elem_bytes;
#if defined(__AVX2__)
  if (stream && bytes >= 256) {
    alignas(32) char pattern[32];
    for (size_t i = 0; i < 32; i += elem_bytes) std::memcpy(pattern + i, value, elem_bytes);
    // dst is element-aligned and 32 is a multiple of elem_bytes, so the pattern stays in phase.
    const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
    std::memcpy(d, pattern, head);
    d += head, bytes -= head;
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(pattern));
    for (; bytes >= 32; d += 32, bytes -= 32) _mm256_stream_si256(reinterpret_cast<__m256i*>(d), v);
    std::memcpy(d, pattern, bytes);
    return;
  }
#endif
  for (size_t i = 0; i < bytes; i += elem_bytes) std::memcpy(d + i, value, elem_bytes);
}

// Orders this thread's streaming stores before what follows (call once at the end of a task).
inline void streaming_store_fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

}  // namespace gem_kernels
