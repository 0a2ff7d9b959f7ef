// CPU kernels of the embedding_bag family: fused multi-table embedding bags (TBE) and their
// backward with the optimizer fused in.
//
// Packed layout (FBGEMM TBE): table t is weights[weights_offsets[t] : + rows_t * D_t] viewed as
// [rows_t, D_t]; bag b of table t is indices[offsets[t*B+b] : offsets[t*B+b+1]].
//
// Forward work decomposition: items of (table, 128 consecutive bags), table-major, handed to the
// threads dynamically (parallel_dynamic); one item owns whole bags, so every output slice is
// written by one thread. The bag's rows are accumulated in fp32 (fp16/bf16 converted on load) with
// at::vec::Vectorized over D (in registers for D = 32/64/128), while the rows 32 indices ahead in
// the same table are prefetched: the lookups are random DRAM reads and the prefetch keeps several
// of them in flight per core. Pooling "none" writes one output row per position and splits by
// positions instead (forward_none_kernel).
// The pooled output is the one thing written: D values per bag at a stride of the output row. A
// large one (>= 32 MiB, empty_cached_output: an earlier output's memory, already faulted in, or a
// fresh mmap on huge pages) takes, in fp32, streaming stores from the sum's registers: no
// read-for-ownership of each slice's lines, no eviction of the hot table rows. Measured on the
// bench's case (26 tables, B = 4096, 41 MB output; 2-core Xeon VM, busy, 1 thread, interleaved):
// 10-16 ms saved of 100-160 in four runs (bench/results/notes-roofs.md, section 4).
// An item's bags run in one loop compiled per (D, per-sample weights, mean, store kind)
// (pool_bags_fixed_d): nothing is dispatched or checked per bag, a sum is not multiplied by 1, and no
// accumulator is spilled at D = 128 (sixteen 8-float registers). Where the time beyond the read-only
// gather roof goes (bench case, 2-core Xeon VM, 1 thread, CPU time, roof timed in the same process,
// 2026-12-07; bench/results/notes-emb9.md): the output's 41 MB of streaming stores ~5 % of the roof's
// time (the same kernel storing every bag into one L1 scratch slice: 94-96 % of the roof instead of
// 89-91 %), the per-bag work ~4.5 % (one bag per item: 97-100 %). The loop above took 91.1 -> 93.3 %
// of the roof (medians of 6 alternating process pairs; new/old forward time 0.973; with every id on
// one cached row, 1.03 -> 1.00x the reader's time).
// On AMD CPUs with AVX-512F the fixed-D fp32 rows go the "L2-wide" way (pool_bags_l2_wide: prefetcht1,
// 64-byte loads and streaming stores; gem_kernels/cpu_gather.h): on a 2-core Zen 4 EPYC VM, bench case,
// 29.7 -> 19.0 ms at 1 thread and 16.1 -> 12.3 ms at 2 (alternated bench processes, switch off / on;
// bench/results/notes-amdemb15.md). The Intel measurements here are of the prefetcht0 path, kept there.
// Measured and not kept (same setup): bags of a constant 20 lookups (a predictable loop exit), no
// change (either the exit mispredict is not the per-bag cost or this core does not learn a 20-trip
// loop: the VM has no PMU counters to tell); one 64-byte AVX-512 streaming store per
// line instead of two 32-byte ones, and 16 -> 1 scratch stores per bag, no change; the output written
// by rep movsb from an L1 buffer (fast-string stores without read-for-ownership): 72 % of the roof,
// against 91 %; prefetch distance 24 or 48 instead of 32, and prefetching a work item's first 32 rows
// before its first bag, within the noise (also in the reader); the reader without its prefetch
// guard and prefetch bounds check (5 fewer instructions a lookup), no change, so the instruction
// count a lookup is not what bounds the gather.
//
// Backward work decomposition, two phases:
//   1. per table (tables handed out dynamically): the kept (row, position) pairs, packed in one uint64, are
//      radix sorted by row (stable, so duplicates keep position order: deterministic sums), and the
//      runs of equal rows (segments, one per unique row) are recorded;
//   2. over slices of every table's segments (dynamically): the segment's gradient rows are summed in fp32,
//      then the row is written once: the dense gradient row, or the fused optimizer step on the
//      weight row and its state. No two threads touch the same row, so no atomics. For D = 32/64/128
//      the sum and the optimizer step stay in registers (for_each_row_gradient's fixed-D row sums,
//      optimizer_row_fixed): the same operations in the same order as the generic path, so the same bits.
// Where the time went at the GEM small model's two calls (2-core Xeon VM, shared; phase timers compiled in,
// 300 calls; bench/results/notes-sparse12.md): sequence embeddings (pooling none, 17692 ids in 2 tables,
// 3521 unique) and the pooled features (8 tables D = 32, 8213 ids in 2048 bags, 3030 unique), both
// row-wise Adagrad. At 1 thread, warm: the sort 75 / 48 us (std::vector zero-fill of the scratch 12 / 4,
// pairs 12 / 10, radix 45 / 30, segment scan 6 / 4), phase 2 195 / 165 us. Fitting phase 2 over the two
// calls gave ~50 ns a unique row and ~0 a lookup: the per-row code (thread_local buffers, a memcpy call,
// the accumulator and the weight row through memory, runtime-D loops), not the data (the rows were in L2).
// Kept, each predicted and then measured:
//   - the fixed-D register path above (predicted: phase 2 about halved). Phase 2 195 -> ~140 us (seq) and
//     165 -> ~80 us (pooled) at 1 thread; a unique row ~14 ns, a lookup ~5 ns after it;
//   - the scratch without zero-fill (Scratch; predicted -10 / -4 us): 0.94-0.97x of the call;
//   - the sort over tables on both threads (kSortWorkPerId; it was one thread below 2^18 / 8 ids; predicted
//     -25 us seq, where the 5-row action table's sort, a chain of increments on 5 counters, overlaps the item
//     table's; -24 us pooled): -21 us (0.85x) and -12 us (0.90x) at 2 threads, warm (cold 0.91x / 0.89x).
//     The pooled miss: 8 tables of ~6 us leave the second thread's wake-up and the tail uneven.
// The native op, before -> after, paired processes alternated (6 pairs, medians, in one harness that runs
// the model's forward calls between, all under the lock and SCHED_FIFO): warm 1 thread seq 316 -> 234 us
// (0.74x), pooled 300 -> 213 (0.71x); warm 2 threads 212 -> 143 (0.67x), 231 -> 135 (0.58x); cold (64 MB
// written before each call) 1 thread 402 -> 327 (0.81x), 373 -> 279 (0.75x); 2 threads 266 -> 197
// (0.75x), 272 -> 176 (0.65x). Outputs, weights and state bit for bit as before (336 cases of every
// optimizer, pooling, dtype, weight decay and per-sample weights, and the model's calls).
// Measured and not kept: one read counting the digits of every radix pass (and skipping a pass whose
// digit is constant), radix 45 -> 51 us seq, 30 -> 27 pooled, no change in the call (1.00 +- 0.02x);
// prefetching the momentum row beside the weight row (0.94-1.00x, within the noise, warm and cold); the
// weight row prefetch 2, 8 or 16 unique rows ahead instead of 4 (within 2 %, cold). Cold, the extra ~100 us
// of the pooled call is ~13k cache lines (2 weight + 1 state line per unique row, the 256 KB gradient)
// at ~100 ns with ~16 misses in flight (~80 us): the prefetch distance cannot buy it back.
//
// Roofline (FBGEMM's minimum bytes, s = weight element size, i = index size):
//   forward:  FLOPs 2 * N * D (pooled); bytes N * D * s (rows read) + B * sum_t D_t * s (output written)
//             + N * i + (T*B+1) * i.
//   backward + row-wise Adagrad: FLOPs ~ 2 * N * D + 6 * U * D (U unique rows); bytes: gradient read
//             B * sum D * s, U rows read and written (2 * U * D * s), U * 4 * 2 state, indices.

#include "gem_kernels/cpu_vec.h"  // first: at::vec with its AVX2 implementation

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gem_kernels/checks.h"
#include "gem_kernels/cpu_alloc.h"
#include "gem_kernels/cpu_gather.h"
#include "gem_kernels/cpu_rows.h"
#include "gem_kernels/cpu_stream.h"
#include "gem_kernels/embedding_bag_codes.h"
#include "gem_kernels/offsets_check.h"
#include "gem_kernels/parallel.h"
#include "gem_kernels/table_meta.h"

namespace gem_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;

// Weights are fp32, fp16 or bf16 (the front door rejects the rest).
#define GK_DISPATCH_WEIGHT_TYPES(TYPE, NAME, ...)                                                  \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                          \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)                       \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Rows prefetched ahead of the one being accumulated: enough random DRAM reads in flight per core to
// cover the latency. 32, the gather roof's best distance (bench.peaks.PREFETCH_DISTANCES) on the
// bench's case; measured against FBGEMM's 16 (2-core Xeon VM, busy, interleaved, streaming output):
// 82.8 vs 86.3 ms at 1 thread, 127.9 vs 147.9 ms at 2 threads.
constexpr int64_t kPrefetchDistance = 32;
// Bags per forward work item: ~20 lookups each, a few thousand rows per item.
constexpr int64_t kBagsPerChunk = 128;
// Work items per table in the backward (slices of its unique rows).
constexpr int64_t kSlicesPerTable = 16;
// Unique rows ahead whose destination row the backward prefetches (2, 4, 8 and 16 measured within 2 %
// of each other at the model's calls, cold; see the header).
constexpr int64_t kRowsAhead = 4;
// The backward's sort in element operations per id (for parallel_dynamic's one-thread cut): an id
// costs ~4 ns there (pair, two radix passes, segment scan), the time of ~64 streamed floats.
constexpr int64_t kSortWorkPerId = 64;

template <typename scalar_t>
inline void load_row(float* __restrict__ dst, const scalar_t* __restrict__ src, int64_t D) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, D * sizeof(float));
  } else {
    int64_t d = 0;
    for (; d + Vec::size() <= D; d += Vec::size()) {
      Vec x;
      at::vec::load_to_float<scalar_t>(src + d, x);
      x.store(dst + d);
    }
    for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

template <typename scalar_t>
inline Vec load_vec(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(p);
  } else {
    Vec x;
    at::vec::load_to_float<scalar_t>(p, x);
    return x;
  }
}

// The table metadata plus its widest table, its values checked: on the CPU a read is free.
struct Meta : TableMeta {
  int64_t max_D;
};

Meta read_meta(const at::Tensor& weights_offsets, const at::Tensor& D_offsets, const at::Tensor& rows_offsets,
               const at::Tensor& offsets, const at::Tensor& weights) {
  Meta m{table_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights), 0};
  // Output columns start at D_offsets[0] and optimizer state rows at rows_offsets[0]: both must be
  // 0 for a direct call (which skips the Python checks) to stay inside its buffers.
  TORCH_CHECK(m.d_off[0] == 0 && m.r_off[0] == 0, "D_offsets[0] and rows_offsets[0] must be 0");
  for (int64_t t = 0; t < m.T; ++t) {
    const int64_t D = m.d_off[t + 1] - m.d_off[t];
    const int64_t rows = m.r_off[t + 1] - m.r_off[t];
    // rows <= (numel - w_off) / D: rows * D itself may overflow int64 for garbage metadata.
    TORCH_CHECK(D >= 1 && rows >= 1 && m.w_off[t] >= 0 && m.w_off[t] <= weights.numel() &&
                    rows <= (weights.numel() - m.w_off[t]) / D,
                "table ", t, " does not fit in weights");
    TORCH_CHECK(rows < (int64_t(1) << 31), "table ", t, " has more than 2^31 rows");
    m.max_D = std::max(m.max_D, D);
  }
  return m;
}

void check_common(const at::Tensor& weights, const at::Tensor& indices, const at::Tensor& offsets,
                  const at::Tensor& per_sample_weights) {
  for (const auto* t : {&weights, &indices, &offsets, &per_sample_weights}) {
    GK_CHECK_CPU(*t);
    GK_CHECK_CONTIGUOUS(*t);
  }
  GK_CHECK_DIM(weights, 1);
  GK_CHECK_DIM(indices, 1);
  GK_CHECK_DIM(offsets, 1);
  GK_CHECK_INDEX(indices);
  TORCH_CHECK(offsets.scalar_type() == indices.scalar_type(), "offsets must have indices' dtype");
  TORCH_CHECK(offsets.numel() >= 1, "offsets must have at least one element");
  TORCH_CHECK(per_sample_weights.numel() == 0 ||
                  (per_sample_weights.scalar_type() == at::kFloat && per_sample_weights.numel() == indices.numel()),
              "per_sample_weights must be empty or fp32 [N]");
}

// grad_output of a backward: [B, D_offsets[-1]] pooled or [N, max D] for pooling none, as the forward
// wrote it; the Python op passes exactly that, a direct call may not.
void check_grad_output(const at::Tensor& grad_output, const at::Tensor& weights, const Meta& m, int64_t N,
                       int64_t pooling) {
  GK_CHECK_CPU(grad_output);
  GK_CHECK_CONTIGUOUS(grad_output);
  GK_CHECK_DIM(grad_output, 2);
  TORCH_CHECK(grad_output.scalar_type() == weights.scalar_type(), "grad_output must have weights' dtype");
  TORCH_CHECK(pooling >= kSum && pooling <= kNone, "bad pooling code ", pooling);
  TORCH_CHECK(grad_output.size(0) == (pooling == kNone ? N : m.B), "grad_output has ", grad_output.size(0),
              " rows, expected ", pooling == kNone ? N : m.B);
  TORCH_CHECK(grad_output.size(1) >= (pooling == kNone ? m.max_D : m.d_off[m.T]), "grad_output is too narrow");
}

// Forward-style work items: (table t, bags [b_begin, b_end) of kBagsPerChunk), table-major, handed
// out dynamically: the threads work through one table together (FBGEMM's table-by-table order), so
// that table's hot Zipf-head rows are shared in cache, and a thread slowed by the host takes fewer
// chunks. body(t, b_begin, b_end, D_t, rows_t, chunk_stop): chunk_stop ends the chunk's indices
// (row prefetches stay inside it).
template <typename index_t, typename Body>
void for_each_bag_chunk(const Meta& m, const index_t* offsets, int64_t work, const Body& body) {
  const int64_t chunks = (m.B + kBagsPerChunk - 1) / kBagsPerChunk;
  parallel_dynamic(chunks * m.T, work, [&](int64_t item) {
    const int64_t t = item / chunks;
    const int64_t b_begin = (item % chunks) * kBagsPerChunk;
    const int64_t b_end = std::min(m.B, b_begin + kBagsPerChunk);
    body(t, b_begin, b_end, m.d_off[t + 1] - m.d_off[t], m.r_off[t + 1] - m.r_off[t], offsets[t * m.B + b_end]);
  });
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

// A work item's bags of a table with D = kD known at compile time (the common 32/64/128): bag i sums
// rows indices[bag_offsets[i] : bag_offsets[i + 1]] into dst + i * dst_stride. The row sum lives in
// registers, the row prefetch and the D loop are unrolled, and the per-sample weights, the mean and the
// store kind are template arguments, so that nothing but the bag's own work runs per bag (no dispatch,
// no multiply by 1 for a sum, no spilled accumulator for D = 128 on AVX2's 16 registers). When most
// lookups hit the cache (Zipf-hot rows) these instructions are the cost. The sum (divided by the kept
// count for mean) goes from the registers to the output: with streaming stores when kStream (fp32
// only; every slice 32-byte aligned). on_bad(i, p, idx) handles an out-of-range index of bag i. The
// offsets were checked nondecreasing by the caller (check_offsets_values).
template <int kD, bool kHasPsw, bool kMean, bool kStream, typename scalar_t, typename index_t, typename OnBad>
void pool_bags_fixed_d(const scalar_t* __restrict__ table, int64_t rows, const index_t* __restrict__ indices,
                       const index_t* __restrict__ bag_offsets, int64_t num_bags, int64_t prefetch_stop,
                       const float* __restrict__ psw, scalar_t* __restrict__ dst, int64_t dst_stride,
                       const OnBad& on_bad) {
  constexpr int kV = kD / Vec::size();
  static_assert(kD % Vec::size() == 0, "kD must be a multiple of the vector width");
  static_assert(!kStream || std::is_same_v<scalar_t, float>, "streaming stores are for fp32 outputs");
  for (int64_t i = 0; i < num_bags; ++i, dst += dst_stride) {
    const int64_t start = bag_offsets[i];
    const int64_t stop = bag_offsets[i + 1];
    Vec acc[kV];
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) acc[v] = Vec(0.f);
    int64_t dropped = 0;  // out-of-range indices (warn mode): the kept count is stop - start - dropped
    for (int64_t p = start; p < stop; ++p) {
      if (p + kPrefetchDistance < prefetch_stop) {
        const int64_t ahead = indices[p + kPrefetchDistance];
        if (static_cast<uint64_t>(ahead) < static_cast<uint64_t>(rows)) {
          const char* line = reinterpret_cast<const char*>(table + ahead * kD);
#pragma GCC unroll 16
          for (int byte = 0; byte < kD * static_cast<int>(sizeof(scalar_t)); byte += 64) __builtin_prefetch(line + byte);
        }
      }
      const int64_t idx = indices[p];
      if (C10_UNLIKELY(static_cast<uint64_t>(idx) >= static_cast<uint64_t>(rows))) {
        on_bad(i, p, idx);
        ++dropped;
        continue;
      }
      const scalar_t* row = table + idx * kD;
      const Vec scale(kHasPsw ? psw[p] : 1.f);
#pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) {
        Vec x;
        if constexpr (std::is_same_v<scalar_t, float>) {
          x = Vec::loadu(row + v * Vec::size());
        } else {
          at::vec::load_to_float<scalar_t>(row + v * Vec::size(), x);
        }
        acc[v] = kHasPsw ? at::vec::fmadd(x, scale, acc[v]) : acc[v] + x;
      }
    }
    if constexpr (kMean) {
      const int64_t kept = stop - start - dropped;
      const Vec s(kept > 0 ? 1.f / static_cast<float>(kept) : 1.f);
#pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) acc[v] = acc[v] * s;
    }
    if constexpr (std::is_same_v<scalar_t, float>) {
#pragma GCC unroll 16
      for (int v = 0; v < kV; ++v) {
#if defined(__AVX2__)
        if constexpr (kStream) {
          static_assert(Vec::size() == 8, "streaming stores of 8-float vectors");
          _mm256_stream_ps(dst + v * Vec::size(), acc[v]);
          continue;
        }
#endif
        acc[v].store(dst + v * Vec::size());
      }
    } else {
#pragma GCC unroll 16
      for (int v = 0; v < kV; v += 2) {
        at::vec::convert_from_float<scalar_t>(acc[v], acc[v + 1]).store(dst + v * Vec::size());
      }
    }
  }
}

// pool_bags_fixed_d's fp32 rows the "L2-wide" way (gem_kernels/cpu_gather.h, cpu_gather_l2_wide: the
// default on AMD CPUs with AVX-512F): the rows kPrefetchDistance ids ahead (twice that at D = 64,
// l2_wide_prefetch_rows) prefetched into L2
// (prefetcht1), each row loaded in 64-byte vectors; a row's lines prefetched and loaded alternating
// between its two halves (l2_wide_line). The same sums in the same order as the 8-float path
// (each lane adds the same values in the same order; fmadd for per-sample weights, one multiply by
// 1 / kept for mean), so the same bits. Streaming stores: one 64-byte store per line where the bag's
// slice is 64-byte aligned (the bench's case: 19.3 against 22.1 ms with two 32-byte ones, 1 thread), else
// two 32-byte ones (slices are 32-byte aligned, not always 64).
template <int kD, bool kHasPsw, bool kMean, bool kStream, typename index_t, typename OnBad>
__attribute__((target("avx512f"))) void pool_bags_l2_wide(const float* __restrict__ table, int64_t rows,
                                                          const index_t* __restrict__ indices,
                                                          const index_t* __restrict__ bag_offsets, int64_t num_bags,
                                                          int64_t prefetch_stop, const float* __restrict__ psw,
                                                          float* __restrict__ dst, int64_t dst_stride,
                                                          const OnBad& on_bad) {
  constexpr int kV = kD / 16;
  static_assert(kD % 16 == 0, "kD must be a multiple of 16");
  const int64_t dist = l2_wide_prefetch_rows(kPrefetchDistance, kD * int64_t(sizeof(float)));
  for (int64_t i = 0; i < num_bags; ++i, dst += dst_stride) {
    const int64_t start = bag_offsets[i];
    const int64_t stop = bag_offsets[i + 1];
    __m512 acc[kV];
#pragma GCC unroll 8
    for (int v = 0; v < kV; ++v) acc[v] = _mm512_setzero_ps();
    int64_t dropped = 0;
    for (int64_t p = start; p < stop; ++p) {
      if (p + dist < prefetch_stop) {
        const int64_t ahead = indices[p + dist];
        if (static_cast<uint64_t>(ahead) < static_cast<uint64_t>(rows)) {
          const char* line = reinterpret_cast<const char*>(table + ahead * kD);
#pragma GCC unroll 8
          for (int k = 0; k < kV; ++k) _mm_prefetch(line + 64 * l2_wide_line(k, kV), _MM_HINT_T1);
        }
      }
      const int64_t idx = indices[p];
      if (C10_UNLIKELY(static_cast<uint64_t>(idx) >= static_cast<uint64_t>(rows))) {
        on_bad(i, p, idx);
        ++dropped;
        continue;
      }
      const float* row = table + idx * kD;
      if constexpr (kHasPsw) {
        const __m512 scale = _mm512_set1_ps(psw[p]);
#pragma GCC unroll 8
        for (int k = 0; k < kV; ++k) {
          const int v = l2_wide_line(k, kV);
          acc[v] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v), scale, acc[v]);
        }
      } else {
#pragma GCC unroll 8
        for (int k = 0; k < kV; ++k) {
          const int v = l2_wide_line(k, kV);
          acc[v] = _mm512_add_ps(acc[v], _mm512_loadu_ps(row + 16 * v));
        }
      }
    }
    if constexpr (kMean) {
      const int64_t kept = stop - start - dropped;
      const __m512 s = _mm512_set1_ps(kept > 0 ? 1.f / static_cast<float>(kept) : 1.f);
#pragma GCC unroll 8
      for (int v = 0; v < kV; ++v) acc[v] = _mm512_mul_ps(acc[v], s);
    }
    if constexpr (kStream) {
      if ((reinterpret_cast<uintptr_t>(dst) & 63) == 0) {  // a whole line per store (predictable per call)
#pragma GCC unroll 8
        for (int v = 0; v < kV; ++v) _mm512_stream_ps(dst + 16 * v, acc[v]);
        continue;
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < kV; ++v) {
      if constexpr (kStream) {
        _mm256_stream_ps(dst + 16 * v, _mm512_castps512_ps256(acc[v]));
        _mm256_stream_ps(dst + 16 * v + 8,
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[v]), 1)));
      } else {
        _mm512_storeu_ps(dst + 16 * v, acc[v]);
      }
    }
  }
}

// pool_bags_fixed_d with its run-time flags made template arguments.
template <int kD, typename scalar_t, typename index_t, typename OnBad>
void pool_bags_fixed(const scalar_t* table, int64_t rows, const index_t* indices, const index_t* bag_offsets,
                     int64_t num_bags, int64_t prefetch_stop, const float* psw, scalar_t* dst, int64_t dst_stride,
                     bool mean, bool stream, bool l2_wide, const OnBad& on_bad) {
  const auto run = [&](auto has_psw, auto is_mean, auto streamed) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (l2_wide) {
        return pool_bags_l2_wide<kD, decltype(has_psw)::value, decltype(is_mean)::value, decltype(streamed)::value>(
            table, rows, indices, bag_offsets, num_bags, prefetch_stop, psw, dst, dst_stride, on_bad);
      }
    }
    pool_bags_fixed_d<kD, decltype(has_psw)::value, decltype(is_mean)::value, decltype(streamed)::value>(
        table, rows, indices, bag_offsets, num_bags, prefetch_stop, psw, dst, dst_stride, on_bad);
  };
  const auto with_store = [&](auto has_psw, auto is_mean) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (stream) return run(has_psw, is_mean, std::true_type{});
    }
    run(has_psw, is_mean, std::false_type{});
  };
  const auto with_mean = [&](auto has_psw) {
    mean ? with_store(has_psw, std::true_type{}) : with_store(has_psw, std::false_type{});
  };
  psw ? with_mean(std::true_type{}) : with_mean(std::false_type{});
}

// Pooling "none": out[p] = w_p * W_t[indices[p]], each position on its own. The work splits by
// positions, not bags: a bag holds any number of independent rows here, and a KJT of one sample per
// key (the GEM model's sequence embeddings: two bags of ~9k ids, one of them in a 5-row table) would
// give a split by bags at most one busy thread per table. Rows kNonePrefetch ids ahead are
// prefetched (random reads, as the pooled path); without per-sample weights a row is copied as is.
constexpr int64_t kNonePositionsPerItem = 1024;
constexpr int64_t kNonePrefetch = 16;

template <typename scalar_t, typename index_t, typename OnBad>
void forward_none_kernel(const Meta& m, const scalar_t* weights, const index_t* indices, const index_t* offsets,
                         const float* psw, scalar_t* out, int64_t D, int64_t N, const OnBad& on_bad) {
  const int64_t num_bags = m.T * m.B;
  const int64_t items = (N + kNonePositionsPerItem - 1) / kNonePositionsPerItem;
  parallel_dynamic(items, N * D, [&](int64_t item) {
    thread_local std::vector<float> row;
    row.resize(D);
    const int64_t p_begin = item * kNonePositionsPerItem;
    const int64_t p_end = std::min(N, p_begin + kNonePositionsPerItem);
    // The bag holding p_begin: the last tb with offsets[tb] <= p_begin (offsets checked nondecreasing).
    int64_t tb = std::upper_bound(offsets, offsets + num_bags + 1, static_cast<index_t>(p_begin)) - offsets - 1;
    for (int64_t p = p_begin; p < p_end; ++p) {
      while (offsets[tb + 1] <= p) ++tb;
      const int64_t t = tb / m.B;
      const int64_t rows = m.r_off[t + 1] - m.r_off[t];
      const scalar_t* table = weights + m.w_off[t];
      // Prefetch within the same table only: the rows ahead in another table are elsewhere.
      const int64_t ahead_p = p + kNonePrefetch;
      if (ahead_p < p_end && ahead_p < offsets[(t + 1) * m.B]) {
        const int64_t ahead = indices[ahead_p];
        if (static_cast<uint64_t>(ahead) < static_cast<uint64_t>(rows)) prefetch_row(table + ahead * D, D);
      }
      const int64_t idx = indices[p];
      scalar_t* dst = out + p * D;
      if (C10_UNLIKELY(static_cast<uint64_t>(idx) >= static_cast<uint64_t>(rows))) {
        on_bad(t, tb % m.B, p, idx, rows);
        std::fill(dst, dst + D, scalar_t(0));
        continue;
      }
      if (psw == nullptr) {
        std::memcpy(dst, table + idx * D, D * sizeof(scalar_t));
      } else {
        load_row(row.data(), table + idx * D, D);
        store_row(dst, row.data(), psw[p], D);
      }
    }
  });
}

template <typename scalar_t, typename index_t>
void forward_kernel(const Meta& m, const scalar_t* weights, const index_t* indices, const index_t* offsets,
                    const float* psw, scalar_t* out, int64_t output_dim, int64_t pooling, int64_t bounds_check,
                    bool stream_out) {
  std::atomic<int64_t> dropped{0};
  std::mutex first_bad_mutex;
  std::string first_bad;
  // An out-of-range index: raise (fatal) or count it and remember the first (warn, skip).
  const auto report_bad = [&](int64_t t, int64_t b, int64_t p, int64_t idx, int64_t rows) {
    const std::string what = "indices[" + std::to_string(p) + "] = " + std::to_string(idx) +
                             " is out of range for table " + std::to_string(t) + " (num_embeddings=" +
                             std::to_string(rows) + ") in bag " + std::to_string(b);
    TORCH_CHECK_INDEX(bounds_check != kFatal, what);
    if (dropped.fetch_add(1) == 0) {
      std::lock_guard<std::mutex> lock(first_bad_mutex);
      first_bad = what;
    }
  };
  if (pooling == kNone) {
    forward_none_kernel(m, weights, indices, offsets, psw, out, output_dim, offsets[m.T * m.B], report_bad);
  } else {
    const bool l2_wide = cpu_gather_l2_wide();  // read once a call (a getenv)
    for_each_bag_chunk(m, offsets, (offsets[m.T * m.B] + m.T * m.B) * m.max_D,
                       [&](int64_t t, int64_t b_begin, int64_t b_end, int64_t D, int64_t rows, int64_t chunk_stop) {
      {
        const scalar_t* table = weights + m.w_off[t];
        // Every bag's slice of this table starts 32-byte aligned (the output is, see the caller).
        const bool stream = stream_out && (output_dim * sizeof(scalar_t)) % 32 == 0 &&
                            (m.d_off[t] * sizeof(scalar_t)) % 32 == 0;
        if (D == 32 || D == 64 || D == 128) {
          const auto on_bad = [&](int64_t i, int64_t p, int64_t idx) { report_bad(t, b_begin + i, p, idx, rows); };
          const index_t* bag_offsets = offsets + t * m.B + b_begin;
          scalar_t* dst = out + b_begin * output_dim + m.d_off[t];
          const bool mean = pooling == kMean;
          const int64_t bags = b_end - b_begin;
          if (D == 32) {
            pool_bags_fixed<32>(table, rows, indices, bag_offsets, bags, chunk_stop, psw, dst, output_dim, mean, stream,
                                l2_wide, on_bad);
          } else if (D == 64) {
            pool_bags_fixed<64>(table, rows, indices, bag_offsets, bags, chunk_stop, psw, dst, output_dim, mean, stream,
                                l2_wide, on_bad);
          } else {
            pool_bags_fixed<128>(table, rows, indices, bag_offsets, bags, chunk_stop, psw, dst, output_dim, mean,
                                 stream, l2_wide, on_bad);
          }
        } else {
          thread_local std::vector<float> acc;
          acc.resize(D);
          for (int64_t b = b_begin; b < b_end; ++b) {
            const int64_t tb = t * m.B + b;
            const int64_t start = offsets[tb];
            const int64_t stop = offsets[tb + 1];
            int64_t kept = 0;
            std::fill(acc.begin(), acc.begin() + D, 0.f);
            for (int64_t p = start; p < stop; ++p) {
              if (p + kPrefetchDistance < chunk_stop) {
                const int64_t ahead = indices[p + kPrefetchDistance];
                if (ahead >= 0 && ahead < rows) prefetch_row(table + ahead * D, D);
              }
              const int64_t idx = indices[p];
              if (idx < 0 || idx >= rows) {
                report_bad(t, b, p, idx, rows);
                continue;
              }
              axpy_row(acc.data(), table + idx * D, psw ? psw[p] : 1.f, D);
              ++kept;
            }
            const float scale = (pooling == kMean && kept > 0) ? 1.f / static_cast<float>(kept) : 1.f;
            store_row(out + b * output_dim + m.d_off[t], acc.data(), scale, D);
          }
        }
      }
      if (stream_out) streaming_store_fence();
    });
  }
  if (bounds_check == kWarn && dropped.load() > 0) {
    TORCH_WARN("embedding_bag: dropping ", dropped.load(), " out-of-range indices; first: ", first_bad);
  }
}

at::Tensor embedding_bag_forward_cpu(const at::Tensor& weights, const at::Tensor& weights_offsets,
                                     const at::Tensor& D_offsets, const at::Tensor& rows_offsets,
                                     const at::Tensor& indices, const at::Tensor& offsets,
                                     const at::Tensor& per_sample_weights, int64_t output_dim, int64_t pooling,
                                     int64_t bounds_check) {
  check_common(weights, indices, offsets, per_sample_weights);
  const Meta m = read_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights);
  TORCH_CHECK(pooling >= kSum && pooling <= kNone, "bad pooling code ", pooling);
  if (pooling == kNone) {
    for (int64_t t = 0; t < m.T; ++t) TORCH_CHECK(m.d_off[t + 1] - m.d_off[t] == output_dim, "pooling none needs D == output_dim");
  } else {
    TORCH_CHECK(m.d_off[m.T] == output_dim, "output_dim must equal D_offsets[-1]");
  }
  const int64_t N = indices.numel();
  check_offsets_values(offsets, N);
  auto out = empty_cached_output({pooling == kNone ? N : m.B, output_dim}, weights.options());
  // The pooled fp32 output's fixed-D slices take streaming stores (see the comment at the top).
  const bool stream_out = pooling != kNone && weights.scalar_type() == at::kFloat &&
                          use_streaming_stores_for_scattered_output(out.nbytes()) &&
                          reinterpret_cast<uintptr_t>(out.data_ptr()) % 32 == 0;
  GK_DISPATCH_WEIGHT_TYPES(weights.scalar_type(), "embedding_bag_forward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_bag_forward_cpu_idx", [&] {
      forward_kernel<scalar_t, index_t>(m, weights.data_ptr<scalar_t>(), indices.data_ptr<index_t>(),
                                        offsets.data_ptr<index_t>(),
                                        per_sample_weights.numel() ? per_sample_weights.data_ptr<float>() : nullptr,
                                        out.data_ptr<scalar_t>(), output_dim, pooling, bounds_check, stream_out);
    });
  });
  return out;
}

// ------------------------------------------------------------------------------------------------
// Backward, phase 1: per table, sort the kept (row, position) pairs by row and find the segments.
// ------------------------------------------------------------------------------------------------

// Stable LSD radix sort of `a` by bits [32, 32 + key_bits) (the row; the low 32 bits hold the
// position). Returns the buffer holding the result (a or tmp).
uint64_t* radix_sort_by_row(uint64_t* a, uint64_t* tmp, int64_t n, int key_bits) {
  if (n <= 1 || key_bits == 0) return a;
  const int passes = (key_bits + 10) / 11;
  const int digit_bits = (key_bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t(1) << digit_bits) - 1;
  std::vector<int64_t> count(size_t(1) << digit_bits);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 32 + pass * digit_bits;
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[(a[i] >> shift) & mask];
    int64_t sum = 0;
    for (auto& c : count) {
      const int64_t here = c;
      c = sum;
      sum += here;
    }
    for (int64_t i = 0; i < n; ++i) tmp[count[(a[i] >> shift) & mask]++] = a[i];
    std::swap(a, tmp);
  }
  return a;
}

// An array of n default-initialised elements: scratch that is written before it is read, so the
// zero-fill of a std::vector (~10 us for the model's 17692 positions) is not paid.
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> p;
  void resize(int64_t n) {
    p = std::make_unique_for_overwrite<T[]>(n);
  }
  T* data() const { return p.get(); }
  T& operator[](int64_t i) const { return p[i]; }
};

struct Segments {
  Scratch<uint64_t> buf_a, buf_b;           // [N] pairs; table t's live at [lo_t, lo_t + kept_t)
  std::vector<uint64_t*> sorted;            // per table: where its sorted pairs ended up
  Scratch<int64_t> seg_begin;               // [N + T]: table t's segment starts at [lo_t + t, ...]
  std::vector<int64_t> seg_prefix;          // [T + 1]: segments before table t
  Scratch<int32_t> bag_of;                  // [N] local bag of each position (pooled only)
  Scratch<float> bag_scale;                 // [T*B] 1 / kept length (mean only)
};

template <typename index_t>
Segments sort_segments(const Meta& m, const index_t* indices, const index_t* offsets, int64_t N, int64_t pooling) {
  Segments s;
  s.buf_a.resize(N);
  s.buf_b.resize(N);
  s.sorted.resize(m.T);
  s.seg_begin.resize(N + m.T);
  s.seg_prefix.assign(m.T + 1, 0);
  if (pooling != kNone) s.bag_of.resize(N);
  if (pooling == kMean) s.bag_scale.resize(m.T * m.B);
  std::vector<int64_t> seg_count(m.T, 0);
  parallel_dynamic(m.T, N * kSortWorkPerId, [&](int64_t t) {
    {
      const int64_t rows = m.r_off[t + 1] - m.r_off[t];
      const int64_t lo = offsets[t * m.B];
      const int64_t hi = offsets[(t + 1) * m.B];
      TORCH_CHECK(hi - lo < (int64_t(1) << 32), "table ", t, " has more than 2^32 indices in one batch");
      uint64_t* pairs = s.buf_a.data() + lo;
      int64_t n = 0;
      for (int64_t b = 0; b < m.B; ++b) {
        const int64_t start = offsets[t * m.B + b];
        const int64_t stop = offsets[t * m.B + b + 1];
        int64_t kept = 0;
        for (int64_t p = start; p < stop; ++p) {
          const int64_t idx = indices[p];
          if (idx < 0 || idx >= rows) continue;  // dropped: the forward already raised or warned
          pairs[n++] = (static_cast<uint64_t>(idx) << 32) | static_cast<uint64_t>(p - lo);
          if (pooling != kNone) s.bag_of[p] = static_cast<int32_t>(b);
          ++kept;
        }
        if (pooling == kMean) s.bag_scale[t * m.B + b] = kept > 0 ? 1.f / static_cast<float>(kept) : 0.f;
      }
      int key_bits = 0;
      while ((int64_t(1) << key_bits) < rows) ++key_bits;
      uint64_t* sorted = radix_sort_by_row(pairs, s.buf_b.data() + lo, n, key_bits);
      s.sorted[t] = sorted;
      int64_t* segs = s.seg_begin.data() + lo + t;
      int64_t count = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (i == 0 || (sorted[i] >> 32) != (sorted[i - 1] >> 32)) segs[count++] = i;
      }
      segs[count] = n;
      seg_count[t] = count;
    }
  });
  for (int64_t t = 0; t < m.T; ++t) s.seg_prefix[t + 1] = s.seg_prefix[t] + seg_count[t];
  return s;
}

// ------------------------------------------------------------------------------------------------
// Backward, phase 2: one task per segment (unique row): sum its gradient rows, then write the row.
// `write(t, row, D, grad)` receives the fp32 summed gradient of local row `row` of table t (scratch
// it may overwrite).
// ------------------------------------------------------------------------------------------------

// The segments [local_begin, local_end) of table t (its distinct rows, sorted), in order: prefetch(t, row)
// kRowsAhead segments ahead, then sum_row(row, each), where each(f) calls f(src, scale) for the segment's
// entries in their sorted order: the output-gradient row the entry reads (its own with pooling none, else its
// bag's slice of table t) and its scale (the per-sample weight, times 1 / bag size for mean), the row
// kPrefetchDistance entries ahead prefetched. The two row sums below (D known at compile time, any D) share it.
template <typename scalar_t, typename index_t, typename Prefetch, typename SumRow>
inline void walk_segments(const Meta& m, const Segments& s, int64_t t, int64_t local_begin, int64_t local_end,
                          const scalar_t* __restrict__ grad_output, int64_t grad_stride, const index_t* offsets,
                          const float* __restrict__ psw, int64_t pooling, int64_t D, const Prefetch& prefetch,
                          SumRow&& sum_row) {
  const int64_t lo = offsets[t * m.B];
  const int64_t* segs = s.seg_begin.data() + lo + t;
  const uint64_t* pairs = s.sorted[t];
  const int64_t slice_stop = segs[local_end];
  const int64_t d_off = m.d_off[t];
  const int32_t* bag_of = s.bag_of.data();
  const float* bag_scale = pooling == kMean ? s.bag_scale.data() + t * m.B : nullptr;
  const auto gradient_row = [&](int64_t p) {
    return pooling == kNone ? grad_output + p * grad_stride : grad_output + bag_of[p] * grad_stride + d_off;
  };
  for (int64_t local = local_begin; local < local_end; ++local) {
    const int64_t first = segs[local];
    const int64_t last = segs[local + 1];
    if (local + kRowsAhead < local_end) prefetch(t, static_cast<int64_t>(pairs[segs[local + kRowsAhead]] >> 32));
    sum_row(static_cast<int64_t>(pairs[first] >> 32), [&](auto&& f) {
      for (int64_t i = first; i < last; ++i) {
        if (i + kPrefetchDistance < slice_stop)  // the gradient row of an entry further on
          prefetch_row(gradient_row(lo + static_cast<int64_t>(pairs[i + kPrefetchDistance] & 0xffffffffu)), D);
        const int64_t p = lo + static_cast<int64_t>(pairs[i] & 0xffffffffu);
        float scale = psw ? psw[p] : 1.f;
        if (pooling == kMean) scale *= bag_scale[bag_of[p]];
        f(gradient_row(p), scale);
      }
    });
  }
}

// `prefetch(t, row)` prefetches local row `row` of table t's destination,
// kRowsAhead segments before it is written. D = 32, 64 or 128: a segment's gradient rows are summed in
// registers (the same fmadd per element as axpy_row, so the same sums) and
// write_fixed(t, row, Vec* acc, integral_constant<int, kD>) writes them; other widths write(t, row, D, float* g).
template <typename scalar_t, typename index_t, typename Prefetch, typename Write, typename WriteFixed>
void for_each_row_gradient(const Meta& m, const Segments& s, const scalar_t* grad_output, int64_t grad_stride,
                           const index_t* offsets, const float* psw, int64_t pooling, Prefetch prefetch,
                           Write write, WriteFixed write_fixed) {
  // Items are (table, slice of its unique rows), table-major, handed out dynamically as in the forward.
  parallel_dynamic(kSlicesPerTable * m.T, (offsets[m.T * m.B] + s.seg_prefix[m.T]) * m.max_D, [&](int64_t item) {
    const int64_t t = item / kSlicesPerTable;
    const int64_t slice = item % kSlicesPerTable;
    const int64_t count = s.seg_prefix[t + 1] - s.seg_prefix[t];
    const int64_t local_begin = count * slice / kSlicesPerTable;
    const int64_t local_end = count * (slice + 1) / kSlicesPerTable;
    const int64_t D = m.d_off[t + 1] - m.d_off[t];
    const auto fixed = [&](auto width) {
      constexpr int kD = decltype(width)::value;
      constexpr int kV = kD / Vec::size();
      static_assert(kD % Vec::size() == 0, "kD must be a multiple of the vector width");
      walk_segments(m, s, t, local_begin, local_end, grad_output, grad_stride, offsets, psw, pooling, kD, prefetch,
                    [&](int64_t row, auto&& each) {
                      Vec acc[kV];
#pragma GCC unroll 16
                      for (int v = 0; v < kV; ++v) acc[v] = Vec(0.f);
                      each([&](const scalar_t* src, float scale) {
                        const Vec sv(scale);
#pragma GCC unroll 16
                        for (int v = 0; v < kV; ++v)
                          acc[v] = at::vec::fmadd(load_vec(src + v * Vec::size()), sv, acc[v]);
                      });
                      write_fixed(t, row, acc, width);
                    });
    };
    if (D == 32) return fixed(std::integral_constant<int, 32>{});
    if (D == 64) return fixed(std::integral_constant<int, 64>{});
    if (D == 128) return fixed(std::integral_constant<int, 128>{});
    thread_local std::vector<float> acc;
    acc.resize(m.max_D);
    walk_segments(m, s, t, local_begin, local_end, grad_output, grad_stride, offsets, psw, pooling, D, prefetch,
                  [&](int64_t row, auto&& each) {
                    std::fill(acc.begin(), acc.begin() + D, 0.f);
                    each([&](const scalar_t* src, float scale) { axpy_row(acc.data(), src, scale, D); });
                    write(t, row, D, acc.data());
                  });
  });
}

// The kV = kD / 8 registers of acc stored to dst (converted to scalar_t).
template <int kD, typename scalar_t>
inline void store_vecs(scalar_t* __restrict__ dst, const Vec* acc) {
  constexpr int kV = kD / Vec::size();
  if constexpr (std::is_same_v<scalar_t, float>) {
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) acc[v].store(dst + v * Vec::size());
  } else {
#pragma GCC unroll 16
    for (int v = 0; v < kV; v += 2) {
      at::vec::convert_from_float<scalar_t>(acc[v], acc[v + 1]).store(dst + v * Vec::size());
    }
  }
}

at::Tensor embedding_bag_backward_cpu(const at::Tensor& grad_output, const at::Tensor& weights,
                                      const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                                      const at::Tensor& rows_offsets, const at::Tensor& indices,
                                      const at::Tensor& offsets, const at::Tensor& per_sample_weights,
                                      int64_t pooling) {
  check_common(weights, indices, offsets, per_sample_weights);
  const Meta m = read_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights);
  // The forward checked these for the Python op; a direct call of this op is checked here (one
  // serial pass over the offsets, microseconds).
  check_grad_output(grad_output, weights, m, indices.numel(), pooling);
  check_offsets_values(offsets, indices.numel());
  auto grad_weights = empty_for_streaming_write(weights.sizes(), weights.options()).zero_();
  GK_DISPATCH_WEIGHT_TYPES(weights.scalar_type(), "embedding_bag_backward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_bag_backward_cpu_idx", [&] {
      const index_t* off = offsets.data_ptr<index_t>();
      const Segments s = sort_segments<index_t>(m, indices.data_ptr<index_t>(), off, indices.numel(), pooling);
      scalar_t* grad = grad_weights.data_ptr<scalar_t>();
      for_each_row_gradient<scalar_t, index_t>(
          m, s, grad_output.data_ptr<scalar_t>(), grad_output.size(1), off,
          per_sample_weights.numel() ? per_sample_weights.data_ptr<float>() : nullptr, pooling,
          [&](int64_t t, int64_t row) {
            const int64_t D = m.d_off[t + 1] - m.d_off[t];
            prefetch_row(grad + m.w_off[t] + row * D, D);
          },
          [&](int64_t t, int64_t row, int64_t D, float* g) { store_row(grad + m.w_off[t] + row * D, g, 1.f, D); },
          [&](int64_t t, int64_t row, const Vec* acc, auto kd) {
            store_vecs<decltype(kd)::value>(grad + m.w_off[t] + row * decltype(kd)::value, acc);
          });
    });
  });
  return grad_weights;
}

// ------------------------------------------------------------------------------------------------
// Gradient of per_sample_weights: grad[p] = <the grad_output row p was pooled into, W_t[indices[p]]>
// (divided by the bag's kept length for mean pooling).
// Decomposition as in the forward (table-major chunks of bags, prefetching the rows ahead); the
// bag's gradient row stays in L1 while its rows stream by. FLOPs 2 * N * D; bytes N * D * s (rows)
// + B * sum D * s (gradient) + N * (4 + i).
// ------------------------------------------------------------------------------------------------

template <typename scalar_t>
inline float dot_row(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t D) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) acc = at::vec::fmadd(load_vec(a + d), load_vec(b + d), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < D; ++d) sum += static_cast<float>(a[d]) * static_cast<float>(b[d]);
  return sum;
}

at::Tensor embedding_bag_per_sample_weights_backward_cpu(const at::Tensor& grad_output, const at::Tensor& weights,
                                                         const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                                                         const at::Tensor& rows_offsets, const at::Tensor& indices,
                                                         const at::Tensor& offsets, int64_t pooling) {
  check_common(weights, indices, offsets, at::empty({0}, weights.options().dtype(at::kFloat)));
  GK_CHECK_CPU(grad_output);
  GK_CHECK_CONTIGUOUS(grad_output);
  GK_CHECK_DIM(grad_output, 2);
  TORCH_CHECK(grad_output.scalar_type() == weights.scalar_type(), "grad_output must have weights' dtype");
  TORCH_CHECK(pooling >= kSum && pooling <= kNone, "bad pooling code ", pooling);
  const Meta m = read_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights);
  const int64_t N = indices.numel();
  TORCH_CHECK(grad_output.size(0) == (pooling == kNone ? N : m.B), "grad_output has ", grad_output.size(0),
              " rows, expected ", pooling == kNone ? N : m.B);
  TORCH_CHECK(grad_output.size(1) >= (pooling == kNone ? m.max_D : m.d_off[m.T]), "grad_output is too narrow");
  check_offsets_values(offsets, N);
  auto grad_psw = at::empty({N}, weights.options().dtype(at::kFloat));
  GK_DISPATCH_WEIGHT_TYPES(weights.scalar_type(), "embedding_bag_per_sample_weights_backward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_bag_per_sample_weights_backward_cpu_idx", [&] {
      const scalar_t* w = weights.data_ptr<scalar_t>();
      const scalar_t* grad = grad_output.data_ptr<scalar_t>();
      const index_t* idx = indices.data_ptr<index_t>();
      const index_t* off = offsets.data_ptr<index_t>();
      float* out = grad_psw.data_ptr<float>();
      const int64_t stride = grad_output.size(1);
      for_each_bag_chunk(m, off, (N + m.T * m.B) * m.max_D, [&](int64_t t, int64_t b_begin, int64_t b_end, int64_t D,
                                                              int64_t rows, int64_t chunk_stop) {
        const scalar_t* table = w + m.w_off[t];
        for (int64_t b = b_begin; b < b_end; ++b) {
          const scalar_t* bag_grad = pooling == kNone ? nullptr : grad + b * stride + m.d_off[t];
          // Mean pooling divides the bag's weighted sum by its kept length, so every index's gradient too.
          float scale = 1.f;
          if (pooling == kMean) {
            int64_t kept = 0;
            for (int64_t p = off[t * m.B + b]; p < off[t * m.B + b + 1]; ++p) kept += (idx[p] >= 0 && idx[p] < rows);
            scale = kept > 0 ? 1.f / static_cast<float>(kept) : 0.f;
          }
          for (int64_t p = off[t * m.B + b]; p < off[t * m.B + b + 1]; ++p) {
            if (p + kPrefetchDistance < chunk_stop) {
              const int64_t ahead = idx[p + kPrefetchDistance];
              if (ahead >= 0 && ahead < rows) prefetch_row(table + ahead * D, D);
            }
            const int64_t row = idx[p];
            out[p] = (row < 0 || row >= rows)
                         ? 0.f
                         : scale * dot_row(pooling == kNone ? grad + p * stride : bag_grad, table + row * D, D);
          }
        }
      });
    });
  });
  return grad_psw;
}

// ------------------------------------------------------------------------------------------------
// Fused optimizers: one exact step on a touched row, in fp32. Weight decay is L2 (g += wd * w).
// ------------------------------------------------------------------------------------------------

struct OptimizerArgs {
  int64_t kind;
  float lr, eps, beta1, beta2, weight_decay;
  float step_size;        // Adam: lr / (1 - beta1^step)
  float inv_bias2_sqrt;   // Adam: 1 / sqrt(1 - beta2^step)
};

template <typename scalar_t>
void optimizer_row(const OptimizerArgs& o, scalar_t* w_row, float* g, float* w, float* m1_row, float* m2_row,
                   int64_t D) {
  load_row(w, w_row, D);
  if (o.weight_decay != 0.f) {
    for (int64_t d = 0; d < D; ++d) g[d] += o.weight_decay * w[d];
  }
  if (o.kind == kOptSgd) {
    for (int64_t d = 0; d < D; ++d) w[d] -= o.lr * g[d];
  } else if (o.kind == kOptRowwiseAdagrad) {
    Vec sq(0.f);
    int64_t d = 0;
    for (; d + Vec::size() <= D; d += Vec::size()) {
      const Vec x = Vec::loadu(g + d);
      sq = at::vec::fmadd(x, x, sq);
    }
    float sum_sq = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sq);
    for (; d < D; ++d) sum_sq += g[d] * g[d];
    const float state = *m1_row + sum_sq / static_cast<float>(D);
    *m1_row = state;
    const float multiplier = o.lr / (std::sqrt(state) + o.eps);
    for (int64_t e = 0; e < D; ++e) w[e] -= multiplier * g[e];
  } else {  // Adam
    const Vec b1(o.beta1), b2(o.beta2), one_b1(1.f - o.beta1), one_b2(1.f - o.beta2);
    const Vec eps(o.eps), step_size(o.step_size), inv_bias2(o.inv_bias2_sqrt);
    int64_t d = 0;
    for (; d + Vec::size() <= D; d += Vec::size()) {
      const Vec x = Vec::loadu(g + d);
      const Vec m1 = at::vec::fmadd(b1, Vec::loadu(m1_row + d), one_b1 * x);
      const Vec m2 = at::vec::fmadd(b2, Vec::loadu(m2_row + d), one_b2 * x * x);
      m1.store(m1_row + d);
      m2.store(m2_row + d);
      const Vec denom = m2.sqrt() * inv_bias2 + eps;
      (Vec::loadu(w + d) - step_size * m1 / denom).store(w + d);
    }
    for (; d < D; ++d) {
      const float m1 = o.beta1 * m1_row[d] + (1.f - o.beta1) * g[d];
      const float m2 = o.beta2 * m2_row[d] + (1.f - o.beta2) * g[d] * g[d];
      m1_row[d] = m1;
      m2_row[d] = m2;
      w[d] -= o.step_size * m1 / (std::sqrt(m2) * o.inv_bias2_sqrt + o.eps);
    }
  }
  store_row(w_row, w, 1.f, D);
}

// optimizer_row for D = kD with the gradient in registers: the same operations in the same order
// (the compiler contracts optimizer_row's `w -= lr * g` and `g += wd * w` into one fma each; here
// they are written as the fma), so the same bits.
template <int kD, typename scalar_t>
inline void optimizer_row_fixed(const OptimizerArgs& o, scalar_t* __restrict__ w_row, const Vec* grad,
                                float* __restrict__ m1_row, float* __restrict__ m2_row) {
  constexpr int kV = kD / Vec::size();
  Vec w[kV], g[kV];
#pragma GCC unroll 16
  for (int v = 0; v < kV; ++v) {
    w[v] = load_vec(w_row + v * Vec::size());
    g[v] = grad[v];
  }
  if (o.weight_decay != 0.f) {
    const Vec wd(o.weight_decay);
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) g[v] = at::vec::fmadd(wd, w[v], g[v]);
  }
  if (o.kind == kOptSgd) {
    const Vec neg_lr(-o.lr);
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) w[v] = at::vec::fmadd(neg_lr, g[v], w[v]);
  } else if (o.kind == kOptRowwiseAdagrad) {
    Vec sq(0.f);
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) sq = at::vec::fmadd(g[v], g[v], sq);
    const float sum_sq = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sq);
    const float state = *m1_row + sum_sq / static_cast<float>(kD);
    *m1_row = state;
    const Vec neg_multiplier(-(o.lr / (std::sqrt(state) + o.eps)));
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) w[v] = at::vec::fmadd(neg_multiplier, g[v], w[v]);
  } else {  // Adam
    const Vec b1(o.beta1), b2(o.beta2), one_b1(1.f - o.beta1), one_b2(1.f - o.beta2);
    const Vec eps(o.eps), step_size(o.step_size), inv_bias2(o.inv_bias2_sqrt);
#pragma GCC unroll 16
    for (int v = 0; v < kV; ++v) {
      const int d = v * Vec::size();
      const Vec x = g[v];
      const Vec m1 = at::vec::fmadd(b1, Vec::loadu(m1_row + d), one_b1 * x);
      const Vec m2 = at::vec::fmadd(b2, Vec::loadu(m2_row + d), one_b2 * x * x);
      m1.store(m1_row + d);
      m2.store(m2_row + d);
      const Vec denom = m2.sqrt() * inv_bias2 + eps;
      w[v] = w[v] - step_size * m1 / denom;
    }
  }
  store_vecs<kD>(w_row, w);
}

void embedding_bag_backward_fused_cpu(const at::Tensor& grad_output, const at::Tensor& weights,
                                      const at::Tensor& momentum1, const at::Tensor& momentum2, const at::Tensor& step,
                                      const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                                      const at::Tensor& rows_offsets, const at::Tensor& indices,
                                      const at::Tensor& offsets, const at::Tensor& per_sample_weights, int64_t pooling,
                                      int64_t optimizer, double lr, double eps, double beta1, double beta2,
                                      double weight_decay) {
  check_common(weights, indices, offsets, per_sample_weights);
  TORCH_CHECK(optimizer >= kOptSgd && optimizer <= kOptAdam, "bad optimizer code ", optimizer);
  const Meta m = read_meta(weights_offsets, D_offsets, rows_offsets, offsets, weights);
  check_grad_output(grad_output, weights, m, indices.numel(), pooling);  // as in embedding_bag_backward_cpu
  check_offsets_values(offsets, indices.numel());
  for (const auto* t : {&momentum1, &momentum2}) {
    GK_CHECK_CPU(*t);
    GK_CHECK_CONTIGUOUS(*t);
    TORCH_CHECK(t->scalar_type() == at::kFloat, "optimizer state must be fp32");
  }
  if (optimizer == kOptRowwiseAdagrad) {
    TORCH_CHECK(momentum1.numel() == m.r_off[m.T], "momentum1 must have rows_offsets[-1] elements");
  }
  if (optimizer == kOptAdam) {
    TORCH_CHECK(momentum1.numel() == weights.numel() && momentum2.numel() == weights.numel(),
                "Adam state must have weights.numel() elements");
  }
  GK_CHECK_CPU(step);
  TORCH_CHECK(step.scalar_type() == at::kLong && step.numel() == 1, "step must be an int64 scalar");
  const int64_t step_value = ++*step.data_ptr<int64_t>();
  OptimizerArgs o{optimizer, float(lr), float(eps), float(beta1), float(beta2), float(weight_decay), 0.f, 0.f};
  if (optimizer == kOptAdam) {
    o.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, double(step_value))));
    o.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, double(step_value))));
  }
  GK_DISPATCH_WEIGHT_TYPES(weights.scalar_type(), "embedding_bag_backward_fused_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "embedding_bag_backward_fused_cpu_idx", [&] {
      const index_t* off = offsets.data_ptr<index_t>();
      const Segments s = sort_segments<index_t>(m, indices.data_ptr<index_t>(), off, indices.numel(), pooling);
      scalar_t* w = weights.data_ptr<scalar_t>();
      float* m1 = momentum1.numel() ? momentum1.data_ptr<float>() : nullptr;
      float* m2 = momentum2.numel() ? momentum2.data_ptr<float>() : nullptr;
      for_each_row_gradient<scalar_t, index_t>(
          m, s, grad_output.data_ptr<scalar_t>(), grad_output.size(1), off,
          per_sample_weights.numel() ? per_sample_weights.data_ptr<float>() : nullptr, pooling,
          [&](int64_t t, int64_t row) {
            const int64_t D = m.d_off[t + 1] - m.d_off[t];
            prefetch_row(w + m.w_off[t] + row * D, D);
          },
          [&](int64_t t, int64_t row, int64_t D, float* g) {
            thread_local std::vector<float> w_buf;
            w_buf.resize(D);
            const int64_t element = m.w_off[t] + row * D;
            float* m1_row = optimizer == kOptRowwiseAdagrad ? m1 + m.r_off[t] + row
                            : optimizer == kOptAdam        ? m1 + element
                                                           : nullptr;
            float* m2_row = optimizer == kOptAdam ? m2 + element : nullptr;
            optimizer_row(o, w + element, g, w_buf.data(), m1_row, m2_row, D);
          },
          [&](int64_t t, int64_t row, const Vec* acc, auto kd) {
            constexpr int kD = decltype(kd)::value;
            const int64_t element = m.w_off[t] + row * kD;
            float* m1_row = optimizer == kOptRowwiseAdagrad ? m1 + m.r_off[t] + row
                            : optimizer == kOptAdam        ? m1 + element
                                                           : nullptr;
            float* m2_row = optimizer == kOptAdam ? m2 + element : nullptr;
            optimizer_row_fixed<kD>(o, w + element, acc, m1_row, m2_row);
          });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("embedding_bag_forward_native", &embedding_bag_forward_cpu);
  m.impl("embedding_bag_backward_native", &embedding_bag_backward_cpu);
  m.impl("embedding_bag_backward_fused_native", &embedding_bag_backward_fused_cpu);
  m.impl("embedding_bag_per_sample_weights_backward_native", &embedding_bag_per_sample_weights_backward_cpu);
}

}  // namespace gem_kernels
