// Argument checks shared by the CPU and CUDA quantized embedding-bag launchers
// (cpu/quant_embedding_bag.cpp, cuda/quant_embedding_bag.cu), the device type as a parameter. The
// Python op (gem_kernels/ops/quant_embedding_bag.py) has already checked every argument, the
// metadata values, offsets and bounds with precise messages; these keep a direct torch.ops call
// memory safe without reading a value (on CUDA that would be a host sync).
#pragma once

#include <ATen/ATen.h>

#include "gem_kernels/checks.h"
#include "gem_kernels/embedding_bag_codes.h"

namespace gem_kernels::quant_embedding_bag_checks {

// Shapes, dtypes, devices and codes; returns T, the number of tables.
inline int64_t args(const at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                    const at::Tensor& rows_offsets, const at::Tensor& weights_tys, const at::Tensor& row_bytes,
                    const at::Tensor& indices, const at::Tensor& offsets, const at::Tensor& per_sample_weights,
                    int64_t pooling, at::ScalarType output_dtype, int64_t fp8_exponent_bits,
                    int64_t fp8_exponent_bias, c10::DeviceType type) {
  const std::pair<const at::Tensor*, const char*> tensors[] = {
      {&weights, "weights"}, {&indices, "indices"}, {&offsets, "offsets"},
      {&per_sample_weights, "per_sample_weights"}, {&weights_offsets, "weights_offsets"},
      {&D_offsets, "D_offsets"}, {&rows_offsets, "rows_offsets"}, {&weights_tys, "weights_tys"},
      {&row_bytes, "row_bytes"}};
  for (auto [x, name] : tensors) {
    check_device(*x, name, type);
    TORCH_CHECK(x->device() == weights.device(), "every tensor must be on the weights' device");
    TORCH_CHECK(x->is_contiguous(), name, " must be contiguous");
  }
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.dim() == 1, "weights must be flat uint8");
  GK_CHECK_INDEX(indices);
  TORCH_CHECK(offsets.scalar_type() == indices.scalar_type(), "offsets must have indices' dtype");
  TORCH_CHECK(per_sample_weights.numel() == 0 ||
                  (per_sample_weights.scalar_type() == at::kFloat && per_sample_weights.numel() == indices.numel()),
              "per_sample_weights must be empty or fp32 [N]");
  for (const auto* x : {&weights_offsets, &D_offsets, &rows_offsets, &weights_tys, &row_bytes})
    TORCH_CHECK(x->scalar_type() == at::kLong, "metadata tensors must be int64");
  const int64_t T = weights_offsets.numel();
  TORCH_CHECK(T >= 1 && D_offsets.numel() == T + 1 && rows_offsets.numel() == T + 1 && weights_tys.numel() == T &&
                  row_bytes.numel() == T,
              "bad table metadata sizes");
  TORCH_CHECK(offsets.numel() >= 1 && (offsets.numel() - 1) % T == 0, "offsets must have T*B+1 elements");
  TORCH_CHECK(pooling >= kSum && pooling <= kNone, "bad pooling code ", pooling);
  TORCH_CHECK(output_dtype == at::kFloat || output_dtype == at::kHalf || output_dtype == at::kBFloat16,
              "output_dtype must be float32, float16 or bfloat16");
  TORCH_CHECK(fp8_exponent_bits >= 1 && fp8_exponent_bits <= 7 && fp8_exponent_bias >= 1 && fp8_exponent_bias <= 127,
              "bad fp8 format");
  return T;
}

}  // namespace gem_kernels::quant_embedding_bag_checks
