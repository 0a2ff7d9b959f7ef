// CUDA kernels of the jagged family: jagged <-> padded copies.
//
// Work decomposition: a 2-D grid. blockIdx.y walks sequences (grid-stride, so B may exceed the
// 65535 limit of gridDim.y), blockIdx.x owns kRowsPerBlock padded positions of that sequence; the
// block's threads stride over those rows' D elements in 16-byte vectors when D and the pointers
// allow it (one LDG.128 + one STG.128 per thread per step), else element by element. Each output
// element is written by exactly one thread; the sequence's offsets are read once per block.
//
// Roofline: 0 FLOPs. Minimum bytes, jagged_to_padded: read sum_b min(L_b, max_len)*D*s, write
// B*max_len*D*s. padded_to_jagged: read sum_b min(L_b, max_len)*D*s, write N*D*s. Bound by HBM
// bandwidth; the index math is 64-bit because B*max_len*D passes 2^31 for real batches.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "gem_kernels/checks.h"
#include "gem_kernels/jagged_checks.h"

namespace gem_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = 8;  // 8 rows x D: enough bytes per block to hide latency at D >= 64
constexpr int kMaxGridY = 65535;

template <typename T>
struct alignas(16) Vec16 {
  T v[16 / sizeof(T)];
};

// Copies rows [row0, row0 + rows) of D elements from src to dst (row-major, same D), filling with
// `fill` the rows at or after `valid_rows` (which are not read).
template <typename scalar_t, typename vec_t>
__device__ __forceinline__ void copy_rows(const scalar_t* __restrict__ src, scalar_t* __restrict__ dst,
                                          int64_t rows, int64_t valid_rows, int64_t D, scalar_t fill) {
  constexpr int kPerVec = sizeof(vec_t) / sizeof(scalar_t);
  const int64_t Dv = D / kPerVec;
  const int64_t total = rows * Dv;
  const vec_t* src_v = reinterpret_cast<const vec_t*>(src);
  vec_t* dst_v = reinterpret_cast<vec_t*>(dst);
  vec_t fill_v;
  scalar_t* fill_s = reinterpret_cast<scalar_t*>(&fill_v);
#pragma unroll
  for (int i = 0; i < kPerVec; ++i) fill_s[i] = fill;
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t r = i / Dv;
    dst_v[i] = r < valid_rows ? src_v[i] : fill_v;
  }
}

template <typename scalar_t, typename index_t, typename vec_t>
__global__ void jagged_to_padded_kernel(const scalar_t* __restrict__ values, const index_t* __restrict__ offsets,
                                        scalar_t* __restrict__ out, int64_t B, int64_t max_len, int64_t D,
                                        scalar_t pad) {
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  if (row0 >= max_len) return;
  const int64_t rows = min(static_cast<int64_t>(kRowsPerBlock), max_len - row0);
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    const int64_t start = offsets[b];
    const int64_t len = min(static_cast<int64_t>(offsets[b + 1]) - start, max_len);
    copy_rows<scalar_t, vec_t>(values + (start + row0) * D, out + (b * max_len + row0) * D, rows, len - row0, D,
                               pad);
  }
}

template <typename scalar_t, typename index_t, typename vec_t>
__global__ void padded_to_jagged_kernel(const scalar_t* __restrict__ padded, const index_t* __restrict__ offsets,
                                        scalar_t* __restrict__ out, int64_t B, int64_t max_len, int64_t D) {
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    const int64_t start = offsets[b];
    const int64_t full = static_cast<int64_t>(offsets[b + 1]) - start;
    // Every row of the sequence is written: rows past max_len get the zero gradient of truncation.
    for (int64_t r0 = row0; r0 < full; r0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
      const int64_t rows = min(static_cast<int64_t>(kRowsPerBlock), full - r0);
      const int64_t valid = min(max_len, full) - r0;
      copy_rows<scalar_t, vec_t>(padded + (b * max_len + r0) * D, out + (start + r0) * D, rows, valid, D,
                                 scalar_t(0));
    }
  }
}

template <typename scalar_t>
bool can_vectorize(const void* a, const void* b, int64_t D) {
  constexpr int64_t kPerVec = 16 / sizeof(scalar_t);
  return D % kPerVec == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

at::Tensor jagged_to_padded_cuda(const at::Tensor& values, const at::Tensor& offsets, int64_t max_len,
                                 double pad_value) {
  jagged_checks::to_padded(values, offsets, max_len, c10::DeviceType::CUDA);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "jagged_to_padded_cuda_pad",
                                  [&] { check_pad_value<scalar_t>(pad_value); });
  const c10::cuda::CUDAGuard guard(values.device());
  const int64_t B = offsets.numel() - 1;
  const int64_t D = values.size(1);
  auto out = at::empty({B, max_len, D}, values.options());
  if (out.numel() == 0) return out;
  const dim3 grid((max_len + kRowsPerBlock - 1) / kRowsPerBlock, std::min<int64_t>(B, kMaxGridY));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "jagged_to_padded_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "jagged_to_padded_cuda_idx", [&] {
      const auto pad = static_cast<scalar_t>(pad_value);
      if (can_vectorize<scalar_t>(values.data_ptr(), out.data_ptr(), D)) {
        jagged_to_padded_kernel<scalar_t, index_t, Vec16<scalar_t>><<<grid, kThreads, 0, stream>>>(
            values.data_ptr<scalar_t>(), offsets.data_ptr<index_t>(), out.data_ptr<scalar_t>(), B, max_len, D, pad);
      } else {
        jagged_to_padded_kernel<scalar_t, index_t, scalar_t><<<grid, kThreads, 0, stream>>>(
            values.data_ptr<scalar_t>(), offsets.data_ptr<index_t>(), out.data_ptr<scalar_t>(), B, max_len, D, pad);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

at::Tensor padded_to_jagged_cuda(const at::Tensor& padded, const at::Tensor& offsets, int64_t total_len) {
  jagged_checks::to_jagged(padded, offsets, total_len, c10::DeviceType::CUDA);
  const int64_t B = offsets.numel() - 1;
  const c10::cuda::CUDAGuard guard(padded.device());
  const int64_t max_len = padded.size(1);
  const int64_t D = padded.size(2);
  auto out = at::empty({total_len, D}, padded.options());
  if (out.numel() == 0 || B == 0) return out;
  // Sequences may be longer than max_len (their tail is zero-filled), so the x extent covers the
  // mean sequence length and the kernel loops for longer ones.
  const int64_t mean_len = std::max<int64_t>(1, (total_len + B - 1) / B);
  const int64_t blocks_x = (std::max(mean_len, std::min(max_len, total_len)) + kRowsPerBlock - 1) / kRowsPerBlock;
  const dim3 grid(std::min<int64_t>(blocks_x, 1 << 20), std::min<int64_t>(B, kMaxGridY));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, padded.scalar_type(), "padded_to_jagged_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "padded_to_jagged_cuda_idx", [&] {
      if (can_vectorize<scalar_t>(padded.data_ptr(), out.data_ptr(), D)) {
        padded_to_jagged_kernel<scalar_t, index_t, Vec16<scalar_t>><<<grid, kThreads, 0, stream>>>(
            padded.data_ptr<scalar_t>(), offsets.data_ptr<index_t>(), out.data_ptr<scalar_t>(), B, max_len, D);
      } else {
        padded_to_jagged_kernel<scalar_t, index_t, scalar_t><<<grid, kThreads, 0, stream>>>(
            padded.data_ptr<scalar_t>(), offsets.data_ptr<index_t>(), out.data_ptr<scalar_t>(), B, max_len, D);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) {
  m.impl("jagged_to_padded_native", &jagged_to_padded_cuda);
  m.impl("padded_to_jagged_native", &padded_to_jagged_cuda);
}

}  // namespace gem_kernels
