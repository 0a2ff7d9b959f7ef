// A CPU emulation of the CUDA execution model, for testing csrc/cuda/*.cu without a GPU.
//
// tests/cuda_emu/build.py rewrites each .cu file a little (kernel<<<...>>>(args) becomes
// ::emu::launch(kernel, ...)(args); `extern __shared__ T name[]` becomes a pointer to the launch's
// dynamic shared memory) and compiles it as C++ with this header forced in front. The kernels then
// run on CPU tensors, with CUDA's semantics where they matter for correctness:
// - every thread of a block is a fiber (ucontext) on one OS thread; a fiber runs until it reaches a
//   barrier (__syncthreads, __syncthreads_or, __syncwarp, a warp shuffle) or returns;
// - the fibers waiting at a barrier resume in a random order (fixed seed; GK_CUDA_EMU_SEED picks
//   another), and the blocks of a grid run in a random order: code that reads shared or global
//   memory another thread writes without a barrier in between sees a stale value in about half the
//   interleavings;
// - dynamic shared memory is filled with NaN before every block, so reading what no thread of
//   this block wrote gives NaN;
// - launches check CUDA's limits: no zero or oversized grid/block dimension, at most 1024 threads,
//   dynamic shared memory over 48 KiB only after cudaFuncSetAttribute allowed it (H100/H200 limit
//   227 KiB);
// - a warp shuffle or __syncwarp with a lane of the warp exited or missing, or a barrier some
//   threads never reach (deadlock), fails the launch with an exception.
// Thread-level memory races inside one barrier interval are not detected beyond that ordering.
#pragma once

#include <ucontext.h>

#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

inline dim3 threadIdx, blockIdx, blockDim, gridDim;
constexpr int warpSize = 32;

using std::max;
using std::min;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {
  size_t sharedSizeBytes;  // static __shared__ arrays: not measured here, reported as 0
};
struct cudaDeviceProp {
  size_t sharedMemPerBlockOptin;
};

#define C10_CUDA_CHECK(expr)                                                                   \
  do {                                                                                         \
    const cudaError_t emu_err_ = (expr);                                                       \
    TORCH_CHECK(emu_err_ == cudaSuccess, "CUDA emulation: ", #expr, " failed (", emu_err_, ")"); \
  } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() ((void)0)

namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
struct CUDAStream {};
inline CUDAStream getCurrentCUDAStream() { return {}; }
}  // namespace cuda
}  // namespace c10
namespace at {
namespace cuda {
using c10::cuda::getCurrentCUDAStream;
inline cudaDeviceProp* getCurrentDeviceProperties() {
  static cudaDeviceProp h200{227 * 1024};
  return &h200;
}
}  // namespace cuda
}  // namespace at

namespace emu {

constexpr int64_t kMaxThreads = 1024;
constexpr int64_t kDefaultSmem = 48 * 1024;
constexpr int64_t kMaxSmemOptIn = 227 * 1024;  // H100 / H200 dynamic shared memory per block
constexpr size_t kStackBytes = 256 * 1024;

// Dynamic shared memory opt-ins, per kernel function (cudaFuncSetAttribute).
inline std::unordered_map<const void*, int64_t>& smem_opt_in() {
  static std::unordered_map<const void*, int64_t> map;
  return map;
}

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  dim3 tid;
  int linear = 0;
  bool done = false;
};

struct Barrier {
  int arrived = 0;
  int any = 0;     // __syncthreads_or accumulator of this generation
  int result = 0;  // the last completed generation's OR
  std::vector<int> waiting;
};

// The block being run: its fibers, barriers and scheduler.
struct Block {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  std::deque<int> ready;
  int current = -1;
  int alive = 0;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<int> warp_alive;
  std::vector<uint64_t> shuffle_slots;  // one per thread
  std::mt19937_64 rng;
  std::string error;
  std::vector<unsigned char> dynamic_smem;
};

inline Block*& current_block() {
  static Block* block = nullptr;
  return block;
}

template <typename T>
T* dynamic_smem() {
  return reinterpret_cast<T*>(current_block()->dynamic_smem.data());
}

inline void fail(const std::string& message) {
  Block& blk = *current_block();
  if (blk.error.empty()) blk.error = message;
}

// Back to the scheduler; returns when this fiber is resumed.
inline void yield_to_scheduler() {
  Block& blk = *current_block();
  swapcontext(&blk.fibers[blk.current].ctx, &blk.scheduler);
}

inline void release(Barrier& bar) {
  Block& blk = *current_block();
  bar.result = bar.any;
  bar.any = 0;
  bar.arrived = 0;
  std::vector<int> order;
  order.swap(bar.waiting);
  std::shuffle(order.begin(), order.end(), blk.rng);
  for (int f : order) blk.ready.push_back(f);
}

// Arrive at `bar`, expecting `expected` threads, and wait for the others; returns the OR of preds.
inline int arrive_and_wait(Barrier& bar, int expected, int pred) {
  Block& blk = *current_block();
  bar.arrived += 1;
  bar.any |= pred != 0;
  bar.waiting.push_back(blk.current);
  if (bar.arrived == expected) release(bar);
  yield_to_scheduler();
  return bar.result;
}

inline int warp_of(int linear) { return linear / warpSize; }

inline int warp_size_of(const Block& blk, int warp) {
  const int n = static_cast<int>(blk.fibers.size());
  return std::min(warpSize, n - warp * warpSize);
}

inline void check_full_warp(unsigned mask, const char* what) {
  Block& blk = *current_block();
  const int w = warp_of(blk.fibers[blk.current].linear);
  if (mask != 0xffffffffu) fail(std::string(what) + ": only the full mask 0xffffffff is emulated");
  if (warp_size_of(blk, w) != warpSize) fail(std::string(what) + " with a full mask in a partial warp");
  if (blk.warp_alive[w] != warpSize) fail(std::string(what) + " with a full mask after lanes of the warp exited");
}

}  // namespace emu

inline void __syncthreads() {
  emu::Block& blk = *emu::current_block();
  emu::arrive_and_wait(blk.block_barrier, blk.alive, 0);
}

inline int __syncthreads_or(int pred) {
  emu::Block& blk = *emu::current_block();
  return emu::arrive_and_wait(blk.block_barrier, blk.alive, pred);
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::check_full_warp(mask, "__syncwarp");
  emu::Block& blk = *emu::current_block();
  const int w = emu::warp_of(blk.fibers[blk.current].linear);
  emu::arrive_and_wait(blk.warp_barriers[w], blk.warp_alive[w], 0);
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = warpSize) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a type wider than 8 bytes");
  emu::check_full_warp(mask, "__shfl_xor_sync");
  emu::Block& blk = *emu::current_block();
  const int me = blk.fibers[blk.current].linear;
  const int w = emu::warp_of(me), lane = me % warpSize;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  blk.shuffle_slots[me] = bits;
  emu::arrive_and_wait(blk.warp_barriers[w], blk.warp_alive[w], 0);
  int src = lane ^ lane_mask;
  if (width < warpSize && (src / width) != (lane / width)) src = lane;
  bits = blk.shuffle_slots[w * warpSize + src];
  emu::arrive_and_wait(blk.warp_barriers[w], blk.warp_alive[w], 0);  // nobody overwrites a slot still read
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// One OS thread runs all fibers and switches only at barriers, so plain read-modify-write is atomic.
template <typename T>
T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}

template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, Kernel) {
  attr->sharedSizeBytes = 0;
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > emu::kMaxSmemOptIn) {
    return cudaErrorInvalidValue;
  }
  emu::smem_opt_in()[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

namespace emu {

// GK_CUDA_EMU_SEED (default 0) picks another set of interleavings: rerun with a few seeds to try more.
inline uint64_t seed() {
  static const uint64_t value = [] {
    const char* env = std::getenv("GK_CUDA_EMU_SEED");
    return env != nullptr ? std::strtoull(env, nullptr, 10) : 0ull;
  }();
  return value;
}

inline uint64_t launch_count() {
  static uint64_t count = 0;
  return count++;
}

template <typename... Params>
class Launcher {
 public:
  using Kernel = void (*)(Params...);
  Launcher(Kernel kernel, dim3 grid, dim3 block, size_t smem)
      : kernel_(kernel), grid_(grid), block_(block), smem_(smem) {}

  template <typename... Args>
  void operator()(Args&&... args) {
    check_config();
    // Every thread gets its own copy of the arguments, converted as a kernel launch converts them.
    const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    const int64_t blocks = static_cast<int64_t>(grid_.x) * grid_.y * grid_.z;
    std::vector<int64_t> order(blocks);
    for (int64_t i = 0; i < blocks; ++i) order[i] = i;
    std::mt19937_64 rng((0x9E3779B97F4A7C15ull ^ launch_count()) + 0xD1B54A32D192ED03ull * seed());
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t linear : order) {
      dim3 bid(static_cast<unsigned>(linear % grid_.x), static_cast<unsigned>((linear / grid_.x) % grid_.y),
               static_cast<unsigned>(linear / (static_cast<int64_t>(grid_.x) * grid_.y)));
      run_block(bid, params, rng());
    }
  }

 private:
  void check_config() const {
    const auto bad = [](const std::string& what) { TORCH_CHECK(false, "CUDA emulation: invalid launch: ", what); };
    if (grid_.x == 0 || grid_.y == 0 || grid_.z == 0) {
      bad("grid (" + std::to_string(grid_.x) + ", " + std::to_string(grid_.y) + ", " + std::to_string(grid_.z) +
          ") has a zero dimension");
    }
    if (grid_.y > 65535 || grid_.z > 65535) bad("grid.y / grid.z above 65535");
    if (grid_.x > 2147483647u) bad("grid.x above 2^31 - 1");
    const int64_t threads = static_cast<int64_t>(block_.x) * block_.y * block_.z;
    if (threads == 0 || threads > kMaxThreads) bad("block of " + std::to_string(threads) + " threads");
    if (block_.z > 64) bad("block.z above 64");
    int64_t allowed = kDefaultSmem;
    const auto it = smem_opt_in().find(reinterpret_cast<const void*>(kernel_));
    if (it != smem_opt_in().end()) allowed = std::max<int64_t>(allowed, it->second);
    if (static_cast<int64_t>(smem_) > allowed) {
      bad(std::to_string(smem_) + " bytes of dynamic shared memory, " + std::to_string(allowed) +
          " allowed (cudaFuncSetAttribute raises the 48 KiB default up to 227 KiB)");
    }
  }

  struct Start {
    Launcher* self;
    const std::tuple<std::decay_t<Params>...>* params;
  };

  static void trampoline(unsigned hi, unsigned lo) {
    const uintptr_t p = (static_cast<uintptr_t>(hi) << 32) | static_cast<uintptr_t>(lo);
    Start* start = reinterpret_cast<Start*>(p);
    std::apply(start->self->kernel_, *start->params);  // copies: a kernel may change its parameters
    Block& blk = *current_block();
    Fiber& me = blk.fibers[blk.current];
    me.done = true;
    blk.alive -= 1;
    blk.warp_alive[warp_of(me.linear)] -= 1;
    // An exited thread no longer counts at the barriers its block or warp may be waiting at.
    if (!blk.block_barrier.waiting.empty() && blk.block_barrier.arrived == blk.alive) release(blk.block_barrier);
    const int w = warp_of(me.linear);
    Barrier& wb = blk.warp_barriers[w];
    if (!wb.waiting.empty() && wb.arrived == blk.warp_alive[w]) release(wb);
    swapcontext(&me.ctx, &blk.scheduler);
  }

  void run_block(dim3 bid, const std::tuple<std::decay_t<Params>...>& params, uint64_t seed) {
    const int n = static_cast<int>(block_.x * block_.y * block_.z);
    Block blk;
    blk.rng.seed(seed);
    blk.fibers.resize(n);
    blk.alive = n;
    const int warps = (n + warpSize - 1) / warpSize;
    blk.warp_barriers.resize(warps);
    blk.warp_alive.resize(warps);
    for (int w = 0; w < warps; ++w) blk.warp_alive[w] = warp_size_of(blk, w);
    blk.shuffle_slots.assign(n, 0);
    blk.dynamic_smem.resize(smem_);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (size_t i = 0; i + sizeof(float) <= smem_; i += sizeof(float)) {
      std::memcpy(&blk.dynamic_smem[i], &nan, sizeof(float));
    }

    Block* previous = current_block();
    current_block() = &blk;
    blockIdx = bid;
    blockDim = block_;
    gridDim = grid_;
    Start start{this, &params};
    const uintptr_t p = reinterpret_cast<uintptr_t>(&start);
    for (int t = 0; t < n; ++t) {
      Fiber& f = blk.fibers[t];
      f.linear = t;
      f.tid = dim3(t % block_.x, (t / block_.x) % block_.y, t / (block_.x * block_.y));
      f.stack.reset(new char[kStackBytes]);
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStackBytes;
      f.ctx.uc_link = &blk.scheduler;
      makecontext(&f.ctx, reinterpret_cast<void (*)()>(&trampoline), 2, static_cast<unsigned>(p >> 32),
                  static_cast<unsigned>(p & 0xffffffffu));
      blk.ready.push_back(t);
    }
    std::shuffle(blk.ready.begin(), blk.ready.end(), blk.rng);
    while (!blk.ready.empty() && blk.error.empty()) {
      blk.current = blk.ready.front();
      blk.ready.pop_front();
      threadIdx = blk.fibers[blk.current].tid;
      swapcontext(&blk.scheduler, &blk.fibers[blk.current].ctx);
    }
    current_block() = previous;
    std::string error = blk.error;
    if (error.empty() && blk.alive > 0) {
      error = std::to_string(blk.alive) + " of " + std::to_string(n) +
              " threads wait at a barrier the others never reach (deadlock)";
    }
    TORCH_CHECK(error.empty(), "CUDA emulation: block (", bid.x, ", ", bid.y, ", ", bid.z, "): ", error);
  }

  Kernel kernel_;
  dim3 grid_, block_;
  size_t smem_;
};

template <typename... Params, typename Stream = c10::cuda::CUDAStream>
Launcher<Params...> launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem = 0, Stream = {}) {
  return Launcher<Params...>(kernel, grid, block, smem);
}

}  // namespace emu
