// A CPU emulation of the CUDA execution model, for testing csrc/cuda/*.cu without a GPU.
//
// tests/cuda_emu/build.py rewrites each .cu file a little (kernel<<<...>>>(args) becomes
// ::emu::launch(kernel, ...)(args); `extern __shared__ T name[]` becomes a pointer to the launch's
// dynamic shared memory; each static `__shared__ T name[N]...;` in a __global__ function becomes a
// reference to the block's copy of it, see static_smem below) and compiles it as C++ with this
// header forced in front. The kernels then
// run on CPU tensors, with CUDA's semantics where they matter for correctness:
// - every thread of a block is a fiber (ucontext) on one OS thread; a fiber runs until it reaches a
//   barrier (__syncthreads, __syncthreads_or, __syncwarp, a warp shuffle), an atomicAdd, or returns;
// - the fibers waiting at a barrier resume in a random order, a fiber at an atomicAdd resumes at a
//   random place among the ready ones (so float atomics sum in a random order, as on the GPU), and
//   the blocks of a grid run in a random order: code that reads shared or global memory another
//   thread writes without a barrier in between sees a stale value in about half the interleavings.
//   The order is a function of GK_CUDA_EMU_SEED (default 0, read at every launch) and the number of
//   launches since the seed last changed: the same seed replays the same interleavings;
// - shared memory, dynamic and static, is poisoned before every block, so reading what no thread
//   of this block wrote gives NaN (float, double, Half, BFloat16 arrays) or bytes 0xA5 (integer and
//   other arrays: int32 -1515870811, uint8 165; the dynamic buffer is NaN as float throughout);
// - launches check CUDA's limits: no zero or oversized grid/block dimension, at most 1024 threads,
//   at most 48 KiB of static __shared__ arrays, static + dynamic shared memory at most 48 KiB
//   unless cudaFuncSetAttribute(MaxDynamicSharedMemorySize) raised the dynamic part, which it can
//   up to 227 KiB (H100/H200) less the static arrays; cudaFuncGetAttributes reports the static bytes;
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
#include <type_traits>
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
  size_t sharedSizeBytes;  // static __shared__ arrays (the sum of their sizes, each 16-byte aligned)
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
constexpr int64_t kMaxSmemOptIn = 227 * 1024;  // H100 / H200 shared memory per block (static + dynamic)
constexpr int64_t kMaxStaticSmem = 48 * 1024;  // ptxas refuses more static __shared__ per kernel
constexpr size_t kSmemAlign = 16;
constexpr size_t kStackBytes = 256 * 1024;

// Dynamic shared memory opt-ins, per kernel function (cudaFuncSetAttribute).
inline std::unordered_map<const void*, int64_t>& smem_opt_in() {
  static std::unordered_map<const void*, int64_t> map;
  return map;
}

inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The static __shared__ arrays of each kernel, registered while the library loads (see static_smem):
// kernel -> (declaration tag -> bytes). Their sum is the kernel's static shared memory.
inline std::unordered_map<const void*, std::unordered_map<const void*, size_t>>& static_smem_registry() {
  static std::unordered_map<const void*, std::unordered_map<const void*, size_t>> map;
  return map;
}

inline int64_t static_smem_bytes(const void* kernel) {
  const auto it = static_smem_registry().find(kernel);
  if (it == static_smem_registry().end()) return 0;
  size_t total = 0;
  for (const auto& decl : it->second) total += round_up(decl.second, kSmemAlign);
  return static_cast<int64_t>(total);
}

// What CUDA refuses for `kernel` launched with `dynamic` bytes of dynamic shared memory ("" if nothing).
inline std::string smem_limit_error(const void* kernel, int64_t dynamic) {
  const int64_t stat = static_smem_bytes(kernel);
  if (stat > kMaxStaticSmem) {
    return std::to_string(stat) + " bytes of static __shared__ arrays, above CUDA's 49152 per kernel";
  }
  const auto it = smem_opt_in().find(kernel);
  const bool opted_in = it != smem_opt_in().end();
  // The dynamic part may use what the static arrays leave of 48 KiB, or what the opt-in set instead.
  const int64_t max_dynamic = opted_in ? it->second : kDefaultSmem - stat;
  if (dynamic <= max_dynamic) return "";
  return std::to_string(stat) + " bytes of static __shared__ arrays + " + std::to_string(dynamic) +
         " bytes of dynamic shared memory, " + std::to_string(stat + max_dynamic) +
         " allowed (48 KiB for both by default; cudaFuncSetAttribute(MaxDynamicSharedMemorySize) raises the "
         "dynamic part up to 227 KiB less the static arrays)" +
         (opted_in ? "; opted in to " + std::to_string(it->second) + " bytes of dynamic" : "");
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
  const void* kernel = nullptr;
  std::vector<unsigned char> dynamic_smem;
  // The static __shared__ arrays this block reached so far: declaration tag -> storage.
  std::unordered_map<const void*, std::unique_ptr<unsigned char[]>> static_smem;
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

// What no thread wrote yet: NaN for floating-point elements, bytes 0xA5 for anything else.
template <typename E>
void poison(unsigned char* data, size_t bytes) {
  if constexpr (std::is_same_v<E, float> || std::is_same_v<E, double> || std::is_same_v<E, c10::Half> ||
                std::is_same_v<E, c10::BFloat16>) {
    const E nan = static_cast<E>(std::numeric_limits<float>::quiet_NaN());
    for (size_t i = 0; i + sizeof(E) <= bytes; i += sizeof(E)) std::memcpy(data + i, &nan, sizeof(E));
  } else {
    std::memset(data, 0xA5, bytes);
  }
}

// Registers the static __shared__ declaration D (a local struct that build.py writes next to it:
// D::type is the array type, D::kernel() the __global__ function it is in) while the library loads,
// so that launches and cudaFuncGetAttributes know each kernel's static shared memory beforehand.
template <typename D>
struct StaticSmemDecl {
  static const bool registered;
};
template <typename D>
const bool StaticSmemDecl<D>::registered =
    (static_smem_registry()[D::kernel()][&StaticSmemDecl<D>::registered] = sizeof(typename D::type), true);

// The storage of static __shared__ declaration D in the running block: poisoned when the first
// thread of the block reaches the declaration, the same for every thread of the block.
template <typename D>
typename D::type& static_smem() {
  using T = typename D::type;
  Block& blk = *current_block();
  const void* tag = &StaticSmemDecl<D>::registered;
  auto& slot = blk.static_smem[tag];
  if (slot == nullptr) {
    if (blk.kernel != D::kernel()) fail("a static __shared__ array of another kernel (an emulation bug)");
    slot.reset(new unsigned char[round_up(sizeof(T), kSmemAlign)]);
    poison<std::remove_cv_t<std::remove_all_extents_t<T>>>(slot.get(), sizeof(T));
  }
  return *reinterpret_cast<T*>(slot.get());
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

// A thread at an atomic resumes at a random place among the threads ready to run, so that atomics of
// one barrier interval interleave (and float sums round) in a random order, as on the GPU. One OS
// thread runs all fibers, so the read-modify-write after the switch is atomic.
template <typename T>
T atomicAdd(T* address, T value) {
  emu::Block& blk = *emu::current_block();
  std::uniform_int_distribution<size_t> place(0, blk.ready.size());
  blk.ready.insert(blk.ready.begin() + static_cast<std::ptrdiff_t>(place(blk.rng)), blk.current);
  emu::yield_to_scheduler();
  const T old = *address;
  *address = old + value;
  return old;
}

template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, Kernel kernel) {
  attr->sharedSizeBytes = static_cast<size_t>(emu::static_smem_bytes(reinterpret_cast<const void*>(kernel)));
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attr, int value) {
  const int64_t stat = emu::static_smem_bytes(reinterpret_cast<const void*>(kernel));
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value + stat > emu::kMaxSmemOptIn) {
    return cudaErrorInvalidValue;
  }
  emu::smem_opt_in()[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

namespace emu {

// The seed of the next launch's interleavings: GK_CUDA_EMU_SEED (default 0), read at every launch,
// mixed with the number of launches since it last changed, so that one seed replays one schedule.
inline uint64_t next_launch_seed() {
  static bool started = false;
  static uint64_t seed = 0, launches = 0;
  const char* env = std::getenv("GK_CUDA_EMU_SEED");
  uint64_t value = 0;
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    value = std::strtoull(env, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && *env != '-', "GK_CUDA_EMU_SEED must be a non-negative integer, got '", env,
                      "'");
  }
  if (!started || value != seed) {
    started = true;
    seed = value;
    launches = 0;
  }
  return (0x9E3779B97F4A7C15ull ^ launches++) + 0xD1B54A32D192ED03ull * seed;
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
    std::mt19937_64 rng(next_launch_seed());
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
    const std::string smem_error = smem_limit_error(reinterpret_cast<const void*>(kernel_), static_cast<int64_t>(smem_));
    if (!smem_error.empty()) bad(smem_error);
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
    blk.kernel = reinterpret_cast<const void*>(kernel_);
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
