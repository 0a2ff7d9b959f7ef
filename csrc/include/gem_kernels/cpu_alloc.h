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

}  // namespace gem_kernels
