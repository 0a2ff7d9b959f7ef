// The integer codes of embedding_bag's string options, shared by the CPU and CUDA kernels. The Python
// side defines the same codes once, in gem_kernels/_embedding_bag.py;
// tests/test_embedding_bag.py::test_option_codes_agree_with_the_cpp_header compares the two.
#pragma once

#include <cstdint>

namespace gem_kernels {

constexpr int64_t kSum = 0, kMean = 1, kNone = 2;                                    // pooling
constexpr int64_t kFatal = 0, kWarn = 1, kSkip = 2;                                  // bounds_check
constexpr int64_t kOptNone = 0, kOptSgd = 1, kOptRowwiseAdagrad = 2, kOptAdam = 3;   // optimizer

}  // namespace gem_kernels
