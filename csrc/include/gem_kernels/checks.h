// Shared argument checks for the native kernels. The Python front door (gem_kernels/ops/*) has
// already validated every argument with a precise message; these are the cheap second line that
// keeps a direct torch.ops call from reading out of bounds (extension-cpp style).
#pragma once

#include <ATen/ATen.h>

#define GK_CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")
#define GK_CHECK_CPU(x) TORCH_CHECK((x).device().is_cpu(), #x " must be a CPU tensor, got ", (x).device())
#define GK_CHECK_CUDA(x) TORCH_CHECK((x).device().is_cuda(), #x " must be a CUDA tensor, got ", (x).device())
#define GK_CHECK_DIM(x, d) TORCH_CHECK((x).dim() == (d), #x " must have ", d, " dims, got ", (x).dim())
#define GK_CHECK_INDEX(x)                                                                   \
  TORCH_CHECK((x).scalar_type() == at::kInt || (x).scalar_type() == at::kLong, #x          \
              " must be int32 or int64, got ", (x).scalar_type())

#include <cmath>
#include <limits>

namespace gem_kernels {

// GK_CHECK_CPU / GK_CHECK_CUDA for checks shared by the CPU and CUDA launchers (device as a parameter).
inline void check_device(const at::Tensor& t, const char* name, c10::DeviceType type) {
  TORCH_CHECK(t.device().type() == type, name, " must be a ", type == c10::DeviceType::CUDA ? "CUDA" : "CPU",
              " tensor, got ", t.device());
}

// A pad value that scalar_t can hold: +-inf, NaN, or a finite value within its range (torch's rule
// for filling with a Python scalar; the front door's check_pad_value). A cast would turn 1e6 into
// inf in fp16 without a word.
template <typename scalar_t>
inline void check_pad_value(double pad_value) {
  const double hi = static_cast<double>(std::numeric_limits<scalar_t>::max());
  TORCH_CHECK_VALUE(!std::isfinite(pad_value) || std::abs(pad_value) <= hi, "pad_value is out of range for ",
                    c10::CppTypeToScalarType<scalar_t>::value, " (finite values in [", -hi, ", ", hi, "]), got ",
                    pad_value);
}

}  // namespace gem_kernels
