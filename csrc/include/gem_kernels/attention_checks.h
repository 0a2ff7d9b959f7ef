// Argument checks shared by the CPU and CUDA attention launchers (cpu/attention.cpp,
// cuda/attention.cu), the device type as a parameter. The Python front door
// (gem_kernels/ops/attention.py) has already checked every argument with a precise message; these
// keep a direct torch.ops call from reading out of bounds.
#pragma once

#include <ATen/ATen.h>

#include "gem_kernels/checks.h"

namespace gem_kernels::attention_checks {

// Devices, index dtype and ranks of the operands of both forwards (q_name: the queries' name).
inline void operands(const at::Tensor& q, const char* q_name, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& seq_offsets, c10::string_view kind, c10::DeviceType type) {
  check_device(q, q_name, type);
  check_device(k, "k", type);
  check_device(v, "v", type);
  check_device(seq_offsets, "seq_offsets", type);
  GK_CHECK_INDEX(seq_offsets);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, q_name, ", k and v must be 3-D");
  GK_CHECK_DIM(seq_offsets, 1);
  TORCH_CHECK(seq_offsets.numel() >= 1, "seq_offsets must have at least one element");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), q_name, ", k, v dtypes differ");
  TORCH_CHECK(kind == "softmax" || kind == "hstu", "kind must be softmax or hstu, got ", kind);
}

inline void qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_offsets,
                c10::string_view kind, c10::DeviceType type) {
  operands(q, "q", k, v, seq_offsets, kind, type);
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape");
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1), "v must be [N, H, Dv]");
}

// The cached forward's operands: delta_q [B * delta, H, D] (the last delta rows of every sequence),
// k [N, H, D], v [N, H, Dv].
inline void cached_qkv(const at::Tensor& delta_q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& seq_offsets, c10::string_view kind, c10::DeviceType type) {
  operands(delta_q, "delta_q", k, v, seq_offsets, kind, type);
  const int64_t B = seq_offsets.numel() - 1;
  TORCH_CHECK(B > 0 ? delta_q.size(0) % B == 0 : delta_q.size(0) == 0, "delta_q must have B * delta rows");
  TORCH_CHECK(k.size(1) == delta_q.size(1) && k.size(2) == delta_q.size(2), "k must be [N, H, D] like delta_q");
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1), "v must be [N, H, Dv]");
}

// The optional biases (undefined tensors when absent) against H heads, N rows and max_seq_len.
inline void biases(const at::Tensor& pos_bias, const at::Tensor& time_bias, const at::Tensor& timestamps,
                   const at::Tensor& query_timestamps, int64_t H, int64_t N, int64_t max_seq_len) {
  if (pos_bias.defined()) {
    TORCH_CHECK(pos_bias.dim() == 2 && pos_bias.size(1) == 2 * max_seq_len - 1,
                "pos_bias must be [H or 1, 2*max_seq_len-1]");
    TORCH_CHECK(pos_bias.size(0) == 1 || pos_bias.size(0) == H, "pos_bias.size(0) must be 1 or H");
  }
  if (time_bias.defined()) {
    TORCH_CHECK(time_bias.dim() == 2 && time_bias.size(1) >= 1, "time_bias must be [H or 1, num_buckets+1]");
    TORCH_CHECK(time_bias.size(0) == 1 || time_bias.size(0) == H, "time_bias.size(0) must be 1 or H");
    TORCH_CHECK(timestamps.defined() && timestamps.numel() == N, "timestamps must be [N] with time_bias");
    TORCH_CHECK(!query_timestamps.defined() || query_timestamps.numel() == N, "query_timestamps must be [N]");
  }
}

}  // namespace gem_kernels::attention_checks
