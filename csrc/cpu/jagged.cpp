// CPU kernels of the jagged family: jagged <-> padded copies.
//
// Work decomposition: at::parallel_for over sequences; one task owns whole sequences, so every
// output row is written by exactly one thread. A sequence's rows are contiguous on both sides
// ([N, D] values and [B, max_len, D] padded), so each sequence is one memcpy of min(L, max_len)*D
// elements plus one fill of the padding: the copy runs at memcpy speed with no per-element index
// math.
//
// Roofline: 0 FLOPs. Minimum bytes, jagged_to_padded: read sum_b min(L_b, max_len)*D*s, write
// B*max_len*D*s (s = element size). padded_to_jagged: read sum_b min(L_b, max_len)*D*s, write N*D*s.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "gem_kernels/checks.h"
#include "gem_kernels/jagged_checks.h"
#include "gem_kernels/cpu_alloc.h"
#include "gem_kernels/cpu_stream.h"

namespace gem_kernels {
namespace {

// Enough bytes per task (~100 us of copying) that waking a second thread pays for itself: small
// batches run on the calling thread instead of waiting on a busy core.
constexpr int64_t kMinBytesPerTask = 1 << 20;

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, bytes_per_item));
}

at::Tensor jagged_to_padded_cpu(const at::Tensor& values, const at::Tensor& offsets, int64_t max_len,
                                double pad_value) {
  jagged_checks::to_padded(values, offsets, max_len, c10::DeviceType::CPU);
  const int64_t B = offsets.numel() - 1;
  const int64_t N = values.size(0);
  const int64_t D = values.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "jagged_to_padded_cpu_pad",
                                  [&] { check_pad_value<scalar_t>(pad_value); });
  auto out = empty_for_streaming_write({B, max_len, D}, values.options());
  if (out.numel() == 0) return out;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "jagged_to_padded_cpu", [&] {
    const scalar_t pad = static_cast<scalar_t>(pad_value);
    const scalar_t* src = values.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "jagged_to_padded_cpu_idx", [&] {
      const index_t* off = offsets.data_ptr<index_t>();
      const bool stream = use_streaming_stores(out.nbytes());
      at::parallel_for(0, B, grain_for(max_len * D * sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t start = off[b];
          const int64_t len = std::min<int64_t>(static_cast<int64_t>(off[b + 1]) - start, max_len);
          TORCH_CHECK(start >= 0 && len >= 0 && start + len <= N, "offsets out of range at b=", b);
          scalar_t* row = dst + b * max_len * D;
          copy_bytes(row, src + start * D, len * D * sizeof(scalar_t), stream);
          fill_elements(row + len * D, &pad, (max_len - len) * D, sizeof(scalar_t), stream);
        }
        streaming_store_fence();
      });
    });
  });
  return out;
}

at::Tensor padded_to_jagged_cpu(const at::Tensor& padded, const at::Tensor& offsets, int64_t total_len) {
  jagged_checks::to_jagged(padded, offsets, total_len, c10::DeviceType::CPU);
  const int64_t B = offsets.numel() - 1;
  const int64_t max_len = padded.size(1);
  const int64_t D = padded.size(2);
  auto out = empty_for_streaming_write({total_len, D}, padded.options());
  if (out.numel() == 0) return out;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, padded.scalar_type(), "padded_to_jagged_cpu", [&] {
    const scalar_t* src = padded.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "padded_to_jagged_cpu_idx", [&] {
      const index_t* off = offsets.data_ptr<index_t>();
      const int64_t mean_rows = std::max<int64_t>(1, total_len / std::max<int64_t>(1, B));
      const bool stream = use_streaming_stores(out.nbytes());
      const scalar_t zero(0);
      at::parallel_for(0, B, grain_for(mean_rows * D * sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t start = off[b];
          const int64_t full = static_cast<int64_t>(off[b + 1]) - start;
          TORCH_CHECK(start >= 0 && full >= 0 && start + full <= total_len, "offsets out of range at b=", b);
          const int64_t len = std::min(full, max_len);
          scalar_t* row = dst + start * D;
          copy_bytes(row, src + b * max_len * D, len * D * sizeof(scalar_t), stream);
          // Rows past max_len were truncated away by jagged_to_padded: their gradient is zero.
          fill_elements(row + len * D, &zero, (full - len) * D, sizeof(scalar_t), stream);
        }
        streaming_store_fence();
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("jagged_to_padded_native", &jagged_to_padded_cpu);
  m.impl("padded_to_jagged_native", &padded_to_jagged_cpu);
}

}  // namespace gem_kernels
