// Host helpers shared by the CPU and CUDA attention kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace gem_kernels {

// generative-recommenders' log-time bucketing divisor.
constexpr double kTimeBucketDivisor = 0.301;

// bucket(dt) = min(num_buckets, floor(ln(max(|dt|, 1)) / 0.301)), evaluated in double.
inline int64_t time_bucket_formula(int64_t dt, int64_t num_buckets) {
  const double x = static_cast<double>(std::max<int64_t>(dt < 0 ? -dt : dt, 1));
  const int64_t bucket = static_cast<int64_t>(std::floor(std::log(x) / kTimeBucketDivisor));
  return std::min(bucket, num_buckets);
}

// thr[m-1] = the smallest |dt| whose bucket is >= m, m = 1..num_buckets, found with the formula itself
// so that "bucket = number of thresholds <= |dt|" agrees with it exactly (the formula is
// nondecreasing in |dt|). Kernels search this short table instead of taking a log per pair.
inline std::vector<int64_t> bucket_thresholds(int64_t num_buckets) {
  std::vector<int64_t> thr;
  for (int64_t m = 1; m <= num_buckets; ++m) {
    const double guess = std::exp(kTimeBucketDivisor * static_cast<double>(m));
    if (guess > 4.0e18) {
      thr.push_back(std::numeric_limits<int64_t>::max());
      continue;
    }
    int64_t x = std::max<int64_t>(1, static_cast<int64_t>(guess) - 2);
    while (time_bucket_formula(x, num_buckets) < m) ++x;
    while (x > 1 && time_bucket_formula(x - 1, num_buckets) >= m) --x;
    thr.push_back(x);
  }
  return thr;
}

}  // namespace gem_kernels
