// The one-time choice between streaming and normal stores for large CPU outputs (cpu_stream.h).

#include "gem_kernels/cpu_stream.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>

#include "gem_kernels/cpu_alloc.h"

namespace gem_kernels {
namespace {

// -1: not decided yet; 0: normal stores; 1: streaming stores.
std::atomic<int> g_streaming{-1};
// Whether g_streaming was forced (GEM_KERNELS_STREAMING_STORES or set_streaming_stores) rather than measured.
std::atomic<bool> g_forced{false};

// Seconds to fill a fresh 48 MiB output the way the kernels write theirs: first touch of new
// (huge) pages, the threads over 2 MiB chunks. 48 MiB is past glibc's largest mmap threshold (32
// MiB), so every call maps new pages, as the kernels' large outputs do. About 10 ms a call.
double time_fresh_fill(bool stream) {
  constexpr int64_t kBytes = int64_t(48) << 20, kChunk = int64_t(2) << 20;
  at::Tensor out = empty_for_streaming_write({kBytes}, at::TensorOptions().dtype(at::kByte));
  char* data = static_cast<char*>(out.data_ptr());
  const float zero = 0.f;
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, kBytes / kChunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) fill_elements(data + c * kChunk, &zero, kChunk / 4, 4, stream);
    streaming_store_fence();
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int measure() {
  double best[2] = {1e30, 1e30};
  for (int trial = 0; trial < 2; ++trial) {
    for (int s = 0; s < 2; ++s) best[s] = std::min(best[s], time_fresh_fill(s == 1));
  }
  // Streaming must win clearly: normal stores leave the output in cache for the next op.
  return best[1] < 0.9 * best[0] ? 1 : 0;
}

}  // namespace

bool streaming_stores_pay_off() {
  int mode = g_streaming.load(std::memory_order_relaxed);
  if (mode < 0) {  // two threads may both measure: harmless, they store the same kind of answer
    const char* env = std::getenv("GEM_KERNELS_STREAMING_STORES");
    const bool forced = env && (env[0] == '0' || env[0] == '1') && env[1] == '\0';
    mode = forced ? env[0] - '0' : measure();
    g_forced.store(forced, std::memory_order_relaxed);
    g_streaming.store(mode, std::memory_order_relaxed);
  }
  return mode == 1;
}

int64_t set_streaming_stores(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "mode must be -1 (measure again on next use), 0 or 1, got ", mode);
  g_forced.store(mode >= 0, std::memory_order_relaxed);
  return g_streaming.exchange(static_cast<int>(mode));
}

bool use_streaming_stores_for_scattered_output(size_t output_bytes) {
  if (output_bytes < kStreamingStoreMinBytes) return false;
  if (g_streaming.load(std::memory_order_relaxed) < 0) {
    const char* env = std::getenv("GEM_KERNELS_STREAMING_STORES");
    if (env && env[0] == '0' && env[1] == '\0') return false;
  }
  return !g_forced.load(std::memory_order_relaxed) || g_streaming.load(std::memory_order_relaxed) == 1;
}

}  // namespace gem_kernels
