// Dynamic scheduling for the CPU kernels.
//
// at::parallel_for (OpenMP) splits its range into one equal share per thread up front, so a call
// lasts as long as its slowest thread. On a shared host one thread is often slower (a descheduled
// or throttled core: the 2-core CI VM's per-core speed varies by up to 2x), and the others then
// wait at the barrier. Here each worker takes the next range of items from a shared counter until
// none is left, so a slow thread just takes fewer. Which worker runs which range changes from run
// to run: callers write each item's result to a place owned by the item (output rows, per-chunk
// partials), never to per-worker accumulators, so their results do not depend on the schedule.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace gem_kernels {

// Runs worker(claim) once on each of up to `max_workers` threads (fewer when there are fewer
// ranges; inline when one). `claim(begin, end)` hands the calling worker the next range of at most
// `grain` items of [0, total) and returns false once all are taken. A worker sets up its scratch
// once, then loops `for (int64_t b, e; claim(b, e);)`. Exceptions propagate as from
// at::parallel_for.
template <typename Worker>
void parallel_ranges(int64_t total, int64_t grain, int64_t max_workers, const Worker& worker) {
  if (total <= 0) return;
  grain = std::max<int64_t>(1, grain);
  std::atomic<int64_t> next{0};
  auto claim = [&](int64_t& begin, int64_t& end) {
    begin = next.fetch_add(grain, std::memory_order_relaxed);
    if (begin >= total) return false;
    end = std::min(total, begin + grain);
    return true;
  };
  const int64_t ranges = (total + grain - 1) / grain;
  const int64_t workers = std::clamp<int64_t>(std::min<int64_t>(max_workers, ranges), 1, at::get_num_threads());
  if (workers == 1) {
    worker(claim);
    return;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) worker(claim);
  });
}

// Below this many element operations one thread is faster than waking the others (which on a busy
// host can take milliseconds).
constexpr int64_t kMinParallelWork = int64_t(1) << 18;

// Runs body(item) for every item in [0, total), handed out one at a time in order; on one thread
// when the whole call is under kMinParallelWork element operations (`work`).
template <typename Body>
void parallel_dynamic(int64_t total, int64_t work, const Body& body) {
  const int64_t workers = work < kMinParallelWork ? 1 : at::get_num_threads();
  parallel_ranges(total, 1, workers, [&](auto& claim) {
    for (int64_t begin, end; claim(begin, end);) body(begin);
  });
}

}  // namespace gem_kernels
