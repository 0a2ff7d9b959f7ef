// How the CPU embedding-bag forward (cpu/embedding_bag.cpp) and its gather roof's reader
// (cpu/gather_peak.cpp) read random table rows: the one switch both follow.
//
// "L2-wide" rows: every cache line of the row `distance` ids ahead prefetched into L2 (prefetcht1,
// not L1), and the row loaded in 64-byte AVX-512 vectors (not 32-byte ones). Measured on a 2-core AMD
// EPYC Zen 4 VM (KVM, 32 MiB L3), the bench's CPU case (26 tables, 0.91 GB fp32, D 64/128, B = 4096,
// Zipf 1.05), 1 thread, interleaved in one process (bench/results/notes-amdemb15.md): an experimental
// copy of the pooled forward 27.6 -> 22.7 ms (prefetcht1 alone 26.9, 64-byte loads alone ~0.92x);
// prefetching only part of a row's lines, or prefetchnta, was slower. The kernel itself, alternated bench
// processes with this switch off / on: 29.7 -> 19.0 ms at 1 thread, 16.1 -> 12.3 ms at 2. A likely reading: Zen 4's L1 has 24 miss buffers
// while its L2 tracks more misses, and a row in half the load uops leaves more of them in flight.
// It is the default on AMD CPUs with AVX-512F only: the Intel path (prefetcht0, 32-byte loads) is
// unchanged, as it was not measured here. GEM_KERNELS_EMB_L2_PREFETCH=1 forces it (on any AVX-512F
// CPU), =0 turns it off; GEM_KERNELS_NO_AVX512=1 turns it off. Read at every call (a getenv per call),
// so that a test or an A/B can switch it within one process.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace gem_kernels {

inline bool cpu_gather_l2_wide() {
  static const bool avx512 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  static const bool amd = __builtin_cpu_is("amd") != 0;
  if (!avx512 || std::getenv("GEM_KERNELS_NO_AVX512") != nullptr) return false;
  const char* force = std::getenv("GEM_KERNELS_EMB_L2_PREFETCH");
  if (force != nullptr && force[0] != '\0') return force[0] != '0';
  return amd;
}

// How many rows ahead the L2-wide reader prefetches, given the row-based `distance` (the embedding-bag
// forward's kPrefetchDistance, or the gather roof reader's): 256-byte rows (fp32 D = 64) twice as many
// rows as 512-byte ones, so that both keep about the same number of cache lines in flight. Measured on
// the 2-core AMD EPYC (Zen 4), the bench's case (26 tables, D 64 and 128), 2 threads, forward variants
// alternated with the gather roof in one process, 150 rounds each, 2026-12-07: 64 rows ahead at D = 64
// and 32 at D = 128 read 89.3-91.7 % of the (then row-based) roof where 32 at both read 87.4-88.7 %
// (0.97-0.98x the time); 16 at D = 128 or 16 at both slower, 48 / 96 and 64 / 128 no better. The roof's
// reader follows the same rule (gather_peak.cpp), so it stays the best reader known for the rows.
inline int64_t l2_wide_prefetch_rows(int64_t distance, int64_t row_bytes) {
  return row_bytes == 256 ? 2 * distance : distance;
}

// The order in which the L2-wide reader prefetches and loads a row's `lines` 64-byte cache lines: the
// k-th access goes to line l2_wide_line(k, lines), alternating between the row's two halves (0, 4, 1,
// 5, 2, 6, 3, 7 for 512-byte rows; 0, 2, 1, 3 for 256; 0, 1 for 128) instead of ascending. Each sum
// still adds its rows in the same order (only which line is touched first changes), so the same bits.
// Measured on the 2-core AMD EPYC (Zen 4), the bench's case, 2 threads, variants alternated in one
// process, 150 rounds, paired per-round ratios, 2026-12-08 (bench/results/notes-amd17.md): the
// forward's loads alone in this order 1.023-1.031x faster, loads and prefetches 1.033-1.054x; the
// roof's reader with its prefetches in this order 1.045x (its loads were already out of order: the
// compiler folds its XORs into a tree). A likely reading, unconfirmed (the VM has no PMU
// counters): an ascending run of a row's lines trains the hardware stream prefetchers, which then
// fetch the lines past the row's end, another row's, for nothing.
constexpr int l2_wide_line(int k, int lines) { return (k & 1) ? lines / 2 + k / 2 : k / 2; }

}  // namespace gem_kernels
