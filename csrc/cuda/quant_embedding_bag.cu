// CUDA kernel of the quantized embedding bag (inference): FBGEMM IntNBit rows in one flat uint8 buffer.
//
// Work decomposition: one warp per (table, bag), kWarps bags per block (as the float forward,
// cuda/embedding_bag.cu). Lane l owns columns d = d0 + l + 32*j (j < kPerLane) of each 32*kPerLane
// column chunk; it walks the bag's indices, decodes its columns of each row from the bytes by the
// table's type (int8/int4/int2: bits [(d*n) % 8, +n) of byte 4 + d*n/8, times the row's fp16 scale
// plus its fp16 bias; fp16/fp32: the value's bytes; fp8: FBGEMM's HFP8) and accumulates in fp32
// registers in FBGEMM's order, acc = fma(w*scale, q, acc + w*bias); it writes its output columns once
// (pooling none: each looked-up row). Out-of-range indices are dropped (the host raised or warned
// before the launch). The fp32 result is cast to the output dtype afterwards (one rounding).
//
// Roofline: FLOPs 2 * N * D; bytes N * row_bytes + B * sum D * 4 + indices. Compiled, not run on a GPU
// (tests/cuda_emu runs it on the CPU).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gem_kernels/checks.h"
#include "gem_kernels/embedding_bag_codes.h"
#include "gem_kernels/quant_embedding_bag_checks.h"

namespace gem_kernels {
namespace {

constexpr int kWarps = 4;    // bags per block
constexpr int kPerLane = 4;  // columns per lane per chunk: 128 columns per warp pass
// FBGEMM's SparseType codes (gem_kernels/ops/quant_embedding_bag.py WEIGHT_TYPES).
constexpr int64_t kFP32 = 0, kFP16 = 1, kINT8 = 2, kINT4 = 3, kFP8 = 6;

struct QuantMeta {
  const int64_t* w_off;   // [T] byte offset of table t
  const int64_t* d_off;   // [T+1]
  const int64_t* r_off;   // [T+1]
  const int64_t* tys;     // [T] weight type codes
  const int64_t* stride;  // [T] row bytes
  int64_t T, B;
};

__device__ __forceinline__ float bits_to_float(uint32_t bits) {
  float v;
  memcpy(&v, &bits, 4);
  return v;
}

// IEEE fp16 bits -> fp32 (exact), without cuda_fp16.h so that the CPU emulation compiles it as is.
__device__ __forceinline__ float half_to_float(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {
    const float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // subnormal: mantissa * 2^-24
    return sign ? -v : v;
  }
  const uint32_t e = exponent == 31 ? 0xFFu : exponent + 112;  // inf/NaN keep their mantissa
  return bits_to_float(sign | (e << 23) | (mantissa << 13));
}

// Element d of a row's data: the code (int types) or the value (float types).
__device__ __forceinline__ float element(const uint8_t* row, int64_t ty, int64_t d, int32_t fp8_shift,
                                         float fp8_multiplier) {
  if (ty == kFP32) {
    uint32_t bits;
    memcpy(&bits, row + 4 * d, 4);
    return bits_to_float(bits);
  }
  if (ty == kFP16) return half_to_float(row[2 * d] | (static_cast<uint32_t>(row[2 * d + 1]) << 8));
  if (ty == kFP8) {
    const uint32_t q = row[d];
    const float magnitude = bits_to_float((q & 0x7Fu) << fp8_shift) * fp8_multiplier;
    return (q & 0x80u) ? -magnitude : magnitude;
  }
  const int64_t bits = ty == kINT8 ? 8 : ty == kINT4 ? 4 : 2;
  const int64_t bit = d * bits;
  return static_cast<float>((row[4 + bit / 8] >> (bit % 8)) & ((1 << bits) - 1));
}

template <typename index_t>
__global__ void quant_embedding_bag_fwd_kernel(const uint8_t* __restrict__ weights, const QuantMeta m,
                                               const index_t* __restrict__ indices,
                                               const index_t* __restrict__ offsets, const float* __restrict__ psw,
                                               float* __restrict__ out, int64_t output_dim, int64_t pooling,
                                               int32_t fp8_shift, float fp8_multiplier) {
  const int64_t tb = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y;
  if (tb >= m.T * m.B) return;
  const int64_t t = tb / m.B, b = tb - t * m.B;
  const int64_t D = m.d_off[t + 1] - m.d_off[t], rows = m.r_off[t + 1] - m.r_off[t];
  const int64_t ty = m.tys[t], stride = m.stride[t];
  const bool scaled = ty != kFP32 && ty != kFP16 && ty != kFP8;
  const uint8_t* table = weights + m.w_off[t];
  const int lane = threadIdx.x;
  const int64_t start = offsets[tb], stop = offsets[tb + 1];
  for (int64_t d0 = 0; d0 < D; d0 += 32 * kPerLane) {
    float acc[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) acc[j] = 0.f;
    int64_t kept = 0;
    for (int64_t p = start; p < stop; ++p) {
      const int64_t idx = indices[p];
      if (idx < 0 || idx >= rows) continue;
      const uint8_t* row = table + idx * stride;
      const float w = psw ? psw[p] : 1.f;
      float scale = w, bias = 0.f;
      if (scaled) {
        scale = w * half_to_float(row[0] | (static_cast<uint32_t>(row[1]) << 8));
        bias = w * half_to_float(row[2] | (static_cast<uint32_t>(row[3]) << 8));
      }
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int64_t d = d0 + lane + 32 * j;
        if (d >= D) continue;
        const float x = element(row, ty, d, fp8_shift, fp8_multiplier);
        if (pooling == kNone) {
          out[p * output_dim + d] = fmaf(scale, x, bias);
        } else {
          acc[j] = fmaf(scale, x, acc[j] + bias);
        }
      }
      ++kept;
    }
    if (pooling == kNone) continue;
    const float norm = (pooling == kMean && kept > 0) ? 1.f / static_cast<float>(kept) : 1.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = d0 + lane + 32 * j;
      if (d < D) out[b * output_dim + m.d_off[t] + d] = acc[j] * norm;
    }
  }
}

at::Tensor quant_embedding_bag_forward_cuda(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                            const at::Tensor& D_offsets, const at::Tensor& rows_offsets,
                                            const at::Tensor& weights_tys, const at::Tensor& row_bytes,
                                            const at::Tensor& indices, const at::Tensor& offsets,
                                            const at::Tensor& per_sample_weights, int64_t output_dim,
                                            int64_t pooling, int64_t bounds_check, at::ScalarType output_dtype,
                                            int64_t fp8_exponent_bits, int64_t fp8_exponent_bias) {
  // What keeps a direct call memory safe without reading a value on the host (that would be a sync);
  // the Python op checked the metadata values (check_quant_tables), offsets and bounds.
  const int64_t T = quant_embedding_bag_checks::args(
      weights, weights_offsets, D_offsets, rows_offsets, weights_tys, row_bytes, indices, offsets, per_sample_weights,
      pooling, output_dtype, fp8_exponent_bits, fp8_exponent_bias, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(weights.device());
  const QuantMeta m{weights_offsets.data_ptr<int64_t>(), D_offsets.data_ptr<int64_t>(),
                    rows_offsets.data_ptr<int64_t>(), weights_tys.data_ptr<int64_t>(), row_bytes.data_ptr<int64_t>(),
                    T, (offsets.numel() - 1) / T};
  // zeros: the rows of dropped indices (pooling none); every pooled slice is written
  auto out = at::zeros({pooling == kNone ? indices.numel() : m.B, output_dim}, weights.options().dtype(at::kFloat));
  if (m.T * m.B > 0 && out.numel() > 0) {
    const dim3 block(32, kWarps);
    const dim3 grid(static_cast<unsigned>((m.T * m.B + kWarps - 1) / kWarps));
    const int32_t fp8_shift = static_cast<int32_t>(16 + fp8_exponent_bits);
    const float fp8_multiplier = std::ldexp(1.f, static_cast<int>(127 - fp8_exponent_bias));
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "quant_embedding_bag_fwd_cuda", [&] {
      quant_embedding_bag_fwd_kernel<index_t><<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(
          weights.data_ptr<uint8_t>(), m, indices.data_ptr<index_t>(), offsets.data_ptr<index_t>(),
          per_sample_weights.numel() ? per_sample_weights.data_ptr<float>() : nullptr, out.data_ptr<float>(),
          output_dim, pooling, fp8_shift, fp8_multiplier);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return output_dtype == at::kFloat ? out : out.to(output_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) {
  m.impl("quant_embedding_bag_forward_native", &quant_embedding_bag_forward_cuda);
}

}  // namespace gem_kernels
