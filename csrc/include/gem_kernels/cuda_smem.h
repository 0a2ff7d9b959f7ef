// Dynamic shared memory of a CUDA kernel launch (CUDA sources only).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <string>

namespace gem_kernels {

// Makes `bytes` of dynamic shared memory launchable for `kernel` on the current device, or raises a
// ValueError naming `op` and the sizes (`what`) that need them, and which backend takes them (`instead`). Above 48 KiB a kernel needs an
// explicit opt-in, and that 48 KiB counts its static __shared__ arrays too, so any kernel with
// dynamic shared memory opts in to exactly what it launches with (a cheap, cached driver call). The
// opt-in limit is the device's (227 KiB on H100/H200, 163 KiB on A100) less the static arrays.
template <typename Kernel>
void prepare_dynamic_smem(Kernel kernel, size_t bytes, const char* op, const std::string& what,
                          const char* instead = "use the triton backend for these sizes") {
  if (bytes == 0) return;
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t optin = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  const size_t limit = optin > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  TORCH_CHECK_VALUE(bytes <= limit, op, ": ", what, " need ", bytes, " bytes of shared memory per block on the cuda "
                    "backend, above this GPU's ", limit, "; ", instead);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace gem_kernels
