"""The CPU emulation of CUDA (tests/cuda_emu) catches what it claims to catch.

A few small kernels, each with one classic bug, go through the same rewrite and header as
csrc/cuda/*.cu; the emulation must report every bug, and run the fixed kernel right.
"""

from __future__ import annotations

import os

import pytest
import torch

from .cuda_emu import build

SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

constexpr int kThreads = 64;

// out[b * 64 + t] = in[b * 64 + (t + 1) % 64] through shared memory, with or without the barrier.
template <bool kBarrier>
__global__ void rotate_kernel(const float* in, float* out) {
  extern __shared__ float tile[];
  const int t = threadIdx.x;
  tile[t] = in[blockIdx.x * kThreads + t];
  if (kBarrier) __syncthreads();
  out[blockIdx.x * kThreads + t] = tile[(t + 1) % kThreads];
}

// Sum of a warp by shuffles; lanes >= `live` exit first when `live` < 32.
__global__ void warp_sum_kernel(const float* in, float* out, int live) {
  if (static_cast<int>(threadIdx.x) >= live) return;
  float v = in[threadIdx.x];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) out[0] = v;
}

// Half of warp 0 waits at __syncwarp, every other thread at __syncthreads: neither barrier fills.
// (Threads that exit do not hold a barrier up, as on the GPU: that case is not a deadlock.)
__global__ void deadlock_kernel(float* out) {
  if (threadIdx.x >= 16 && threadIdx.x < 32) __syncwarp(); else __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// The OR of the threads' predicates, from every thread.
__global__ void any_kernel(const float* in, float* out) {
  out[threadIdx.x] = static_cast<float>(__syncthreads_or(in[threadIdx.x] > 0.0f));
}

at::Tensor rotate(const at::Tensor& in, bool barrier, int64_t smem, bool opt_in) {
  auto out = at::empty_like(in);
  const auto blocks = static_cast<unsigned>(in.numel() / kThreads);
  if (barrier) {
    if (opt_in) cudaFuncSetAttribute(rotate_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    rotate_kernel<true><<<blocks, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(in.data_ptr<float>(),
                                                                                      out.data_ptr<float>());
  } else {
    rotate_kernel<false><<<blocks, kThreads, smem>>>(in.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

at::Tensor warp_sum(const at::Tensor& in, int64_t live) {
  auto out = at::zeros({1}, in.options());
  warp_sum_kernel<<<1, 32>>>(in.data_ptr<float>(), out.data_ptr<float>(), static_cast<int>(live));
  return out;
}

at::Tensor deadlock(const at::Tensor& in) {
  auto out = at::zeros({64}, in.options());
  deadlock_kernel<<<1, 64>>>(out.data_ptr<float>());
  return out;
}

at::Tensor any_positive(const at::Tensor& in) {
  auto out = at::empty({64}, in.options());
  any_kernel<<<1, 64>>>(in.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY(gk_cuda_emu_selftest, m) {
  m.def("rotate", &rotate);
  m.def("warp_sum", &warp_sum);
  m.def("deadlock", &deadlock);
  m.def("any_positive", &any_positive);
}
"""


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    from torch.utils import cpp_extension

    folder = tmp_path_factory.mktemp("cuda_emu_selftest")
    source = folder / "selftest.cpp"
    source.write_text(build.rewrite(SOURCE))
    cpp_extension.load(name="gk_cuda_emu_selftest", sources=[str(source)], build_directory=str(folder),
                       extra_include_paths=[str(build.HERE)],
                       extra_cflags=["-O1", "-g0", "-include", str(build.HERE / "cuda_emu.h")], is_python_module=False,
                       verbose=False)
    return torch.ops.gk_cuda_emu_selftest


def test_rewrite_turns_launches_and_dynamic_shared_memory_into_calls():
    text = build.rewrite("""
        extern __shared__ float smem[];
        kernel<scalar_t, index_t, Vec16<scalar_t>><<<grid, kThreads, 0, stream>>>(a, b);
        other<<<B, dim3(32, 4)>>>(c);
        #include <c10/cuda/CUDAGuard.h>
        TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) { TORCH_CHECK(x.is_cuda()); }
    """)
    assert "float* smem = ::emu::dynamic_smem<float>();" in text
    assert "::emu::launch(kernel<scalar_t, index_t, Vec16<scalar_t>>, grid, kThreads, 0, stream)(a, b);" in text
    assert "::emu::launch(other, B, dim3(32, 4))(c);" in text
    assert "#include <c10/cuda" not in text
    assert "TORCH_LIBRARY_IMPL(gem_kernels, CPU, m)" in text and "x.is_cpu()" in text


def test_a_missing_barrier_reads_unwritten_shared_memory(ops):
    x = torch.arange(64 * 16, dtype=torch.float32)
    expected = x.view(16, 64).roll(-1, dims=1).reshape(-1)
    torch.testing.assert_close(ops.rotate(x, True, 64 * 4, False), expected, rtol=0, atol=0)
    racy = ops.rotate(x, False, 64 * 4, False)
    # Threads resume in a random order: some read a neighbour's slot before it is written (NaN fill).
    assert racy.isnan().any() and not racy.isnan().all()


def test_launch_limits(ops):
    x = torch.zeros(64 * 4)
    with pytest.raises(RuntimeError, match="zero dimension"):
        ops.rotate(torch.zeros(0), True, 256, False)
    with pytest.raises(RuntimeError, match="dynamic shared memory, 49152 allowed"):
        ops.rotate(x, True, 64 * 1024, False)
    ops.rotate(x, True, 64 * 1024, True)  # with cudaFuncSetAttribute's opt-in
    with pytest.raises(RuntimeError, match="failed|allowed"):
        ops.rotate(x, True, 228 * 1024, True)  # past the H200's 227 KiB even with it


def test_warp_shuffles_need_every_lane(ops):
    x = torch.arange(32, dtype=torch.float32)
    assert float(ops.warp_sum(x, 32)) == float(x.sum())
    with pytest.raises(RuntimeError, match="after lanes of the warp exited"):
        ops.warp_sum(x, 20)


def test_a_barrier_some_threads_never_reach_is_a_deadlock(ops):
    with pytest.raises(RuntimeError, match="deadlock"):
        ops.deadlock(torch.zeros(1))


def test_syncthreads_or(ops):
    x = torch.zeros(64)
    assert float(ops.any_positive(x).sum()) == 0
    x[37] = 1.0
    assert float(ops.any_positive(x).min()) == 1.0


@pytest.mark.skipif(os.environ.get("GK_CUDA_EMU") != "1", reason="the emulated gem_kernels build is loaded "
                    "only with GK_CUDA_EMU=1 (scripts/test.sh's second pass)")
def test_gem_kernels_cpu_tensors_run_the_cuda_kernels():
    """Under GK_CUDA_EMU=1 the native ops on CPU tensors are the CUDA kernels: fm_compress keeps no
    products (the C++ CPU kernel keeps them when asked)."""
    import gem_kernels._backend as backend

    assert backend.native_kernels("cpu") == "cuda"
    x, y = torch.randn(3, 4, 8), torch.randn(4, 2)
    w, b = torch.ones(8), torch.zeros(8)
    out, mean, rstd, products = torch.ops.gem_kernels.fm_compress_native(x, y, w, b, 1e-5, True)
    assert products.shape[0] == 0 and out.shape == (3, 8)
