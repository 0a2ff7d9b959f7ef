// Output allocation for CPU kernels that stream-write large tensors.
//
// A fresh multi-MiB CPU tensor is a new mmap: its first write takes one page fault per 4 KiB page,
// and on virtualised hosts those faults, not DRAM, bound a copy kernel (measured on the 2-core CI
// machine: 3 GB/s writing a fresh 1 GiB tensor vs 50 GB/s copying into a warm one). Advising the
// kernel to back the untouched range with transparent huge pages makes it one fault per 2 MiB.
// Advice only: where THP is off (or not Linux) nothing changes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace gem_kernels {

inline at::Tensor empty_for_streaming_write(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t end = begin + out.nbytes();
  const uintptr_t aligned_begin = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t aligned_end = end & ~(kHugePage - 1);
  if (out.nbytes() >= 4 * kHugePage && aligned_end > aligned_begin) {
    madvise(reinterpret_cast<void*>(aligned_begin), aligned_end - aligned_begin, MADV_HUGEPAGE);
  }
#endif
  return out;
}

// Outputs at least this large come from the output cache: glibc maps every block over 32 MiB fresh
// (and unmaps it on free), so without it each call pays the page faults and the OS zeroing again.
constexpr size_t kCachedOutputMinBytes = size_t(32) << 20;

// An uninitialised tensor for a kernel output written once in full, at kCachedOutputMinBytes and
// above a 2 MiB-aligned mmap advised for huge pages (cpu/cpu_alloc.cpp), or a block freed by an
// earlier output of the same (2 MiB-rounded) size: already faulted in, not zeroed again. Freed
// blocks are kept up to a limit of idle bytes (GEM_KERNELS_OUTPUT_CACHE_MIB, default
// kDefaultOutputCacheMiB; 0 turns the cache off); smaller outputs are empty_for_streaming_write's.
//
// Why it is on: a fresh output's first touch is a fault per 2 MiB page whose zeroing the OS does in
// the faulting thread, and it was the whole gap between the embedding-bag forward and its gather
// roof. Measured on the bench's case (41 MB output; 2-core Xeon VM, load 4-6, every impl interleaved
// with the roof): 60.1 -> 49.8 ms at 1 thread (76 -> 92 % of the roof), 95.2 -> 85.9 ms at 2; with
// every id on row 0, 25.0 -> 16.7 ms against the read-only reader's 14.0
// (bench/results/notes-gatherroof.md). An earlier A/B that found no gain set the limit per call
// between interleaved variants, so each "cache" call found the block released (21 faults per call,
// as a fresh output): the cache never hit there.
constexpr int64_t kDefaultOutputCacheMiB = 256;

at::Tensor empty_cached_output(at::IntArrayRef sizes, const at::TensorOptions& options);

// Sets the cache's limit of idle bytes (releasing blocks beyond it); returns the previous limit.
int64_t set_output_cache_limit(int64_t bytes);
// Bytes of freed blocks the cache holds now.
int64_t output_cache_idle_bytes();

}  // namespace gem_kernels
