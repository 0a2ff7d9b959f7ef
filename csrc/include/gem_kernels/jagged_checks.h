// Argument checks shared by the CPU and CUDA jagged launchers (cpu/jagged.cpp, cuda/jagged.cu), the
// device type as a parameter. The Python front door (gem_kernels/ops/jagged.py) has already checked
// every argument with a precise message; these keep a direct torch.ops call from reading out of bounds.
#pragma once

#include <ATen/ATen.h>

#include "gem_kernels/checks.h"

namespace gem_kernels::jagged_checks {

// dense (values or padded) and offsets on one device of `type`, contiguous; offsets 1-D int32/int64, B + 1 long.
inline void dense_and_offsets(const at::Tensor& dense, const at::Tensor& offsets, c10::DeviceType type) {
  check_device(dense, "dense", type);
  check_device(offsets, "offsets", type);
  TORCH_CHECK(dense.device() == offsets.device(), "dense and offsets must be on the same device");
  GK_CHECK_CONTIGUOUS(dense);
  GK_CHECK_CONTIGUOUS(offsets);
  GK_CHECK_INDEX(offsets);
  GK_CHECK_DIM(offsets, 1);
  TORCH_CHECK(offsets.numel() >= 1, "offsets must have at least one element");
}

inline void to_padded(const at::Tensor& values, const at::Tensor& offsets, int64_t max_len, c10::DeviceType type) {
  dense_and_offsets(values, offsets, type);
  GK_CHECK_DIM(values, 2);
  TORCH_CHECK(max_len >= 0, "max_len must be >= 0, got ", max_len);
}

inline void to_jagged(const at::Tensor& padded, const at::Tensor& offsets, int64_t total_len, c10::DeviceType type) {
  dense_and_offsets(padded, offsets, type);
  GK_CHECK_DIM(padded, 3);
  TORCH_CHECK(padded.size(0) == offsets.numel() - 1, "padded.size(0) must equal offsets.numel() - 1");
  TORCH_CHECK(total_len >= 0, "total_len must be >= 0, got ", total_len);
}

}  // namespace gem_kernels::jagged_checks
