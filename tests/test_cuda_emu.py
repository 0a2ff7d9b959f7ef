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

// Block 0 writes the even slots of a static tile, every block reads all of it back: each block has its
// own static shared memory, so only block 0's even slots hold values; the rest is what no thread wrote.
__global__ void static_tile_kernel(const float* in, float* out, int* ints) {
  __shared__ float tile[kThreads];
  __shared__ int counts[kThreads];
  const int t = threadIdx.x;
  if (blockIdx.x == 0 && t % 2 == 0) tile[t] = in[t];
  __syncthreads();
  out[blockIdx.x * kThreads + t] = tile[t];
  ints[blockIdx.x * kThreads + t] = counts[t];
}

// 32 KiB of static shared memory next to the launch's dynamic shared memory.
template <int kFloats>
__global__ void big_static_kernel(float* out) {
  extern __shared__ float dyn[];
  __shared__ float big[kFloats];
  big[threadIdx.x] = 1.0f;
  dyn[threadIdx.x] = 2.0f;
  __syncthreads();
  out[threadIdx.x] = big[threadIdx.x] + dyn[threadIdx.x];
}

// Thread 0 adds 2^24 then -2^24 to one float, thread 1 adds 1 twice: the sum is 2 when thread 1's adds
// fall outside thread 0's pair, less when one lands between them (2^24 + 1 rounds to 2^24).
__global__ void atomic_order_kernel(float* out) {
  const float big = 16777216.0f;
  atomicAdd(out, threadIdx.x == 0 ? big : 1.0f);
  atomicAdd(out, threadIdx.x == 0 ? -big : 1.0f);
}

// The sum of `in` into out[0]: by float atomics (kAtomic), or per block by a tree in shared memory,
// which sums in one order whatever the schedule, then by block in a fixed order.
template <bool kAtomic>
__global__ void sum_kernel(const float* in, float* out, float* partials) {
  __shared__ float partial[kThreads];
  const int t = threadIdx.x;
  const float v = in[blockIdx.x * kThreads + t];
  if (kAtomic) {
    atomicAdd(out, v);
    return;
  }
  partial[t] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (t < s) partial[t] += partial[t + s];
    __syncthreads();
  }
  if (t == 0) partials[blockIdx.x] = partial[0];
}

at::Tensor static_tile(const at::Tensor& in, at::Tensor ints) {
  auto out = at::empty({ints.numel()}, in.options());
  static_tile_kernel<<<static_cast<unsigned>(ints.numel() / kThreads), kThreads>>>(
      in.data_ptr<float>(), out.data_ptr<float>(), ints.data_ptr<int>());
  return out;
}

// [cudaFuncGetAttributes' static bytes, cudaFuncSetAttribute's error code (0: none; not called
// when opt_in < 0), out[0]] of big_static_kernel launched with `dynamic` bytes.
at::Tensor big_static(const at::Tensor& like, int64_t dynamic, int64_t opt_in) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, big_static_kernel<8192>));
  int code = 0;
  if (opt_in >= 0) {
    code = cudaFuncSetAttribute(big_static_kernel<8192>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(opt_in));
  }
  auto out = at::zeros({kThreads}, like.options());
  if (code == 0) big_static_kernel<8192><<<1, kThreads, dynamic>>>(out.data_ptr<float>());
  return at::tensor({static_cast<float>(attr.sharedSizeBytes), static_cast<float>(code), out[0].item<float>()},
                    like.options());
}

at::Tensor atomic_order(const at::Tensor& like) {
  auto out = at::zeros({1}, like.options());
  atomic_order_kernel<<<1, 2>>>(out.data_ptr<float>());
  return out;
}

at::Tensor block_sum(const at::Tensor& in, bool atomic) {
  const auto blocks = static_cast<unsigned>(in.numel() / kThreads);
  auto out = at::zeros({1}, in.options());
  auto partials = at::empty({blocks}, in.options());
  if (atomic) {
    sum_kernel<true><<<blocks, kThreads>>>(in.data_ptr<float>(), out.data_ptr<float>(), partials.data_ptr<float>());
    return out;
  }
  sum_kernel<false><<<blocks, kThreads>>>(in.data_ptr<float>(), out.data_ptr<float>(), partials.data_ptr<float>());
  return partials.sum().reshape({1});
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
  m.def("static_tile", &static_tile);
  m.def("big_static", &big_static);
  m.def("atomic_order", &atomic_order);
  m.def("block_sum", &block_sum);
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


def test_rewrite_turns_static_shared_arrays_into_block_storage():
    text = build.rewrite("""
        template <typename T, int kN = 4>
        __global__ void __launch_bounds__(256) k(T* a) { __shared__ T x[kN][2], y; }
    """)
    assert "auto& x = ::emu::static_smem<emu_smem_x>();" in text and "using type = T[kN][2];" in text
    assert "auto& y = ::emu::static_smem<emu_smem_y>();" in text and "&k<T, kN>" in text
    with pytest.raises(RuntimeError, match="outside a __global__ function"):
        build.rewrite("__device__ void f() { __shared__ float x[4]; }")


def test_static_shared_memory_is_poisoned_per_block(ops):
    x = torch.arange(64, dtype=torch.float32)
    ints = torch.zeros(64 * 3, dtype=torch.int32)
    out = ops.static_tile(x, ints).view(3, 64)
    torch.testing.assert_close(out[0, ::2], x[::2], rtol=0, atol=0)
    assert out[0, 1::2].isnan().all() and out[1:].isnan().all()  # unwritten here, or written by block 0 only
    assert (ints == int.from_bytes(b"\xa5" * 4, "little", signed=True)).all()


def test_static_shared_memory_counts_toward_the_limits(ops):
    like = torch.zeros(1)
    static, code, value = ops.big_static(like, 16 * 1024, -1).tolist()  # 32 KiB + 16 KiB: exactly 48 KiB
    assert (static, code, value) == (32768, 0, 3.0)
    with pytest.raises(RuntimeError, match=r"32768 bytes of static __shared__ arrays \+ 16388 bytes of dynamic "
                       r"shared memory, 49152 allowed"):
        ops.big_static(like, 16 * 1024 + 4, -1)
    assert ops.big_static(like, 20 * 1024, 20 * 1024).tolist() == [32768, 0, 3.0]  # opted in
    with pytest.raises(RuntimeError, match="opted in to 20480 bytes"):
        ops.big_static(like, 20 * 1024 + 4, 20 * 1024)
    # The opt-in reaches 227 KiB less the static arrays, not more.
    assert ops.big_static(like, 195 * 1024, 195 * 1024).tolist() == [32768, 0, 3.0]
    assert ops.big_static(like, 0, 195 * 1024 + 4)[1] != 0


def test_float_atomics_sum_in_a_seeded_random_order(ops, monkeypatch):
    like = torch.zeros(1)

    def run(seeds, op):
        out = []
        for seed in seeds:
            monkeypatch.setenv("GK_CUDA_EMU_SEED", str(seed))
            out.append(op())
        return out

    # Two threads, two atomics each: the schedule interleaves them (2^24 + 1 rounds down in some orders).
    orders = run(range(16), lambda: float(ops.atomic_order(like)))
    assert set(orders) > {2.0}, orders
    assert run(range(16), lambda: float(ops.atomic_order(like))) == orders  # a seed replays its schedule
    # A float atomic reduction: its low bits depend on the seed; a tree reduction's do not.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 8, generator=g) * 10.0 ** torch.randint(-3, 4, (64 * 8,), generator=g)
    atomic = run(range(8), lambda: ops.block_sum(x, True).view(torch.int32).item())
    tree = run(range(8), lambda: ops.block_sum(x, False).view(torch.int32).item())
    assert len(set(atomic)) > 1 and len(set(tree)) == 1, (atomic, tree)
    monkeypatch.setenv("GK_CUDA_EMU_SEED", "-3")
    with pytest.raises(ValueError, match="GK_CUDA_EMU_SEED must be a non-negative integer, got '-3'"):
        ops.atomic_order(like)


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
