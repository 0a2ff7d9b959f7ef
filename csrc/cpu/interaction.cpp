// CPU kernels of the interaction family: DLRM dot interaction, DCNv2 cross layer, Wukong fm_compress
// and feature_mix_norm (the rest of a Wukong layer: LayerNorm_D(M X + concat(fm, 0))).
//
// Work decomposition. dot_interaction, fm_compress and feature_mix_norm: workers claim runs of consecutive samples
// from a shared counter (parallel_ranges, gem_kernels/parallel.h: a thread slowed by a busy host
// just takes fewer); a worker owns whole samples and keeps one sample's working set (X as fp32
// [F, D], the gram tiles, X^T Y) in a per-worker scratch that lives in L1/L2, so nothing
// [B, F, F]- or [B, D, k]-sized is ever written.
// Sample-independent sums (grad_y, LayerNorm grad_weight/grad_bias, cross layer grad_bias) go to
// per-chunk fp32 partials over fixed chunks of kSumChunk samples, summed at the end: accurate, and
// deterministic whatever the thread count. cross_layer in fp32 (the backward, the low-rank forward
// and the full-rank forward when W fits in 1 MiB): per block of rows, single-threaded sgemm then the epilogue (bias, product, residual; in
// the backward grad_z, grad_x0, grad_xl's product and, when the accumulators fit in L2, the weight
// gradients' per-block sums) on the block while it is in cache (cross_layer_forward_blocks_fp32,
// cross_layer_backward_fused / _fp32 below), the outputs written with streaming stores; a larger
// full-rank fp32 forward is one multi-threaded at::mm and one epilogue pass (bias in place, out
// streamed); other dtypes at::addmm/at::mm and one vectorised pass over [B, N].
//
// Inner loop: every product is a small GEMM `combine_rows` with 4-row x 16-column register tiles
// (broadcast one operand, FMA rows of the other; dot products are computed as X times a transposed
// copy, so no horizontal reductions) over fp32 buffers zero-padded to 4 rows and 16 columns (8 for
// fm_compress's rank: a last 8-wide column block runs in 8-row x 8-column tiles), so every tile is
// full. feature_mix_norm's per-row LayerNorms run eight rows at a time (layer_norm_rows). The tile is written with AVX2/FMA intrinsics (x86-64-v3, the build's target):
// ATen's at::vec::Vectorized only has its AVX2/AVX512 specialisations inside ATen's per-ISA builds
// (in an extension TU it is the scalar fallback), and GCC's `#pragma omp simd` version of the same
// tile left the accumulators in memory at a quarter of the speed.
// At D = 32 (the GEM model's Wukong layers) fm_compress and feature_mix_norm run their own row
// kernels (interaction_rows32.inc), built for 8 AVX2 lanes and for 16 AVX-512F lanes and picked at
// run time (cpu_has_avx512f; GEM_KERNELS_NO_AVX512=1 forces AVX2).
//
// Roofline (s = element size, P = number of pairs):
//   dot_interaction fwd: FLOPs 2*B*P*D, bytes B*(F*D + P)*s.  bwd: 2*B*(2P)*D FLOPs (sym(G) X),
//   bytes B*(P + 2*F*D)*s.
//   cross_layer fwd: 2*B*N*N (+3*B*N) FLOPs, bytes (3*B*N + N*N + N)*s; low rank 4*B*N*r.
//   fm_compress fwd: 4*B*F*D*k (+ ~8*B*F*k LayerNorm) FLOPs, bytes (B*F*D + B*F*k + F*k*3)*s, plus
//   4*B*(D + F)*k bytes of `products` when the backward will run. bwd with the products: 8*B*F*D*k
//   FLOPs (grad_A, grad_X twice, grad_Y) instead of 12 (recomputing X^T Y and S), for the
//   products' 8*B*(D + F)*k bytes written and read back (see SAVES_PRODUCTS in ops/interaction.py).
//   feature_mix_norm fwd: 2*B*O*F*D (+ ~8*B*O*D LayerNorm) FLOPs, bytes (B*F*D + B*O_fm*D + B*O*D + O*F + 2*D)*s;
//   bwd 4*B*O*F*D FLOPs (+ the recomputed S, 2*B*O*F*D), bytes about twice the forward's
//   (gem_kernels/flops.py feature_mix_norm; details at the feature_mix_norm section below).
//
// Wukong at the GEM model's shape (issue 26, branch wukong6, 2026-12-06 16:40-17:40 UTC; B = 1152,
// D = 32, k = 8, O = 16, O_fm = 8, fp32, one thread, CPU time; the 2-vCPU Xeon, AVX-512 path, host
// load 1-5). Roofs of one core: 7.4-7.6 zmm FMAs/ns = ~240 GFLOP/s (a register-only loop of 16
// independent FMA chains; the bench's matmul peak is 167 per core at 2 threads); copy 25.4 GB/s
// (bench). flops.py's FLOPs and minimum bytes against the quietest run (16:39 UTC, load 1.2):
//   op (F = 10 / 16)       us            % of 240 GFLOP/s   % of 167   % of 25.4 GB/s
//   fm_compress fwd        210 / 310     25 / 27            36 / 39    35 / 38
//   fm_compress bwd        312 / 439     33 / 37            47 / 54    42 / 48
//   feature_mix_norm fwd   277 / 382     25 / 26            36 / 37    71 / 61
//   feature_mix_norm bwd   542 / 684     24 / 27            34 / 39    56 / 54
// (the mix backward runs 33 / 39 % of 240 counting the S it recomputes). The mix backward is the
// largest gap: the most time, the lowest share of the FMA roof. Where its time goes (F = 16, each
// part measured by removing it from a build, interleaved, load 3-4): grad_M's sum over the chunk
// (cross32) ~25 %; the LayerNorm backward on the registers ~20 %, of which the two horizontal sums
// per row are nothing measurable (c1, c2 taken without them: the same time); the rest, S again and
// grad_X = M^T grad_S (1024 FMAs a sample) with the loads and stores around them, ~2.5 FMAs/ns,
// where the same rows32_product loop alone, L1-resident, runs 5.3 (4-row blocks) to 5.9 (8-row).
// Per sample, the increment from B = 32 to 128 rows (everything in L2) is ~450 ns, from 128 to
// 1152 (L3) ~580 ns; a call's fixed cost was 12-13 us (B = 1).
// Measured and not kept (1-thread CPU time, alternating processes, 3-6 rounds; on this host one
// build against itself reads 0.87-1.15):
// - grad_M / grad_Y fed to cross32's register blocks 4 samples at a time while their rows are in L1
//   (partials kept in memory between groups: the same bits), against once per 16-sample chunk at
//   its end, whose 2 KB sample stride puts a block's rows in a quarter of the L1 sets: predicted
//   8-12 % on the mix backward, measured 0.95-1.03x (mix bwd), 0.99-1.01x (fm bwd). Alone, the
//   cross loop at that stride runs 4.0-4.4 FMAs/ns over 16 samples and 4.7 with every sample at one
//   address: the stride is not what it loses (6.0 over 256 samples at one address: its per-call
//   end, 16 horizontal sums per block pair, is).
// - 8-row register blocks on 16 lanes (16 accumulators): everywhere, fm bwd F = 16 0.81-0.89x; in
//   the mix backward only, 0.98-0.99x at F = 10 and 1.04-1.11x at F = 16 (8 zmm spills in its
//   LayerNorm part). Within the noise.
// - software prefetch in the mix backward: the sample 2 ahead's X, grad_out and fm (prefetcht0
//   1.00-1.26x slower, prefetcht1 1.07-1.36x slower); 2 or 8 lines a page ahead in each input stream
//   (1.00-1.10x slower); the output rows a page ahead (0.9-1.05x): the L3 cost above is not a first
//   touch that a prefetch hides.
// - the mix backward's grad_w / grad_b summed in registers over a sample (one read-modify-write of
//   the chunk partial per sample, not per row): 1.03x (F = 10), 0.97-1.02x (F = 16).
// Kept: the four Wukong ops' per-call setup without ATen calls (fp32_padded, as_fp32, plain
// partial buffers: below). B = 1, one thread, 3 alternating runs: mix bwd 12.4-13.2 -> 6.9-7.1 us,
// fm bwd 9.4-10.0 -> 5.8-5.9, mix fwd 6.2-6.4 -> 3.9-4.1, fm fwd 7.3-7.7 -> 4.4-4.5 (predicted ~5 us
// on the mix backward): ~19 us less serial time in a step's Wukong backward (~1.7 % of its ~1.1 ms
// at 2 threads, p10 of `scripts/wukong_model_ops.py --single-calls`), ~11 us in its forward.
//
// At the model's call the inputs come from memory, not the caches (issue 26, branch wk8, 2026-12-06
// 23:00-00:30 UTC, the same 2-vCPU Xeon, 1 thread, CPU time, host load 1.5-3 from two other sessions).
// The calls captured from a `small` training step (B = 1113, fp32, contiguous; the same shapes as
// above) rotated over 32 input sets (~300 MB: `scripts/wukong_model_ops.py --cold 32`) cost 1.3-1.7x
// the cache-warm loop: per step (F = 10 + 16) mix bwd ~1.70 ms against 1.21 warm, fm bwd ~1.20 (0.67),
// mix fwd ~0.80 (0.58), fm fwd ~0.59 (0.43); a 1-thread torch.profiler of the step itself (wall time
// per op, with two other sessions on the host) read ~1.3x more still. At F = 16 the mix backward's
// bytes alone (a kernel that only reads X, grad_out and fm and writes grad_x and grad_fm, per sample
// in the same order) take 578 us cold and 350 warm; the kernel 900-950 cold and 690 warm; its
// arithmetic alone (inputs touched first) ~520: memory and arithmetic mostly add up instead of
// overlapping. Removing one part at a time from
// that arithmetic (warm, F = 16 / 10): grad_M's cross32 190 / 180 us, grad_X = M^T grad_S 190 / 170,
// the LayerNorm backward 140 / 140, S again 140 / 120.
// Kept: the fm_compress backward asks for the next sample's rows (kFmBackwardAhead). Against the
// build before it, 4 alternating rounds: cold 0.89-0.95x at F = 16 (median 721 -> 662 us) and
// 0.84-0.94x at F = 10 (461 -> 421); warm 0.93-1.14x (450 -> 462, F = 16), within that noise.
// Measured and not kept, at the model's call (cold, 32 sets; alternating processes, 3-4 rounds; one
// build's rounds spread +-5 % cold, +-8 % warm):
// - software prefetch in the mix backward of the sample 1, 2, 4 or 8 ahead (X, grad_out, fm;
//   prefetcht0, t1 or t2; with or without prefetchw of its grad_x and grad_fm rows), issued at the
//   sample's start or one line per k-step of its S and grad_X products: 0.93-1.26x, most settings
//   slower (one, a line per k-step 2 samples ahead, read 0.85-0.93x at F = 10 but 0.97-1.04x at
//   F = 16 in a single run; not confirmed). In the fm_compress backward it pays (kFmBackwardAhead);
//   adding prefetchw of that sample's grad_x rows there: 1.04-1.17x at F = 16, 0.91-1.04x at F = 10.
// - streaming stores of grad_x below the 32 MB threshold, both backwards: 0.96-1.10x.
// - the fm_compress forward's prefetch of X 2 samples ahead instead of 1: 1.02-1.12x at F = 16,
//   0.90-1.07x at F = 10; adding prefetchw of the next sample's products and output rows: 1.13-1.15x
//   and 1.01-1.20x. (Without its prefetch that forward runs 1.22-1.26x and 1.08-1.35x: it stays.)
// - grad_M per sample in registers without horizontal sums: grad_S's 16-row groups transposed (64
//   AVX-512 shuffles per 16 x 16), then one FMA per (d, f) of a 16-lane grad_S^T row and the broadcast
//   x[f, d] into F accumulators of lanes o, added into a per-chunk [F, O] partial (predicted: half of
//   cross32's 190 us): mix bwd F = 16 0.94-1.04x and F = 10 0.94-0.99x cold, 0.94-1.16x warm. Its loop
//   alone, L1-resident, runs 5.4 zmm FMAs/ns (7.1 the register-only peak measured this session), but
//   in the kernel its profile share was 13.1 % against cross32's 14.0 %.
// - fm_compress's LayerNorm row (n = F k = 80, 128) on the row kernels' lanes with four accumulators
//   per sum (layer_norm_row / layer_norm_row_backward run one 8-lane chain each): their profile share
//   10-17 % smaller, the ops 0.85-1.16x in 4 rounds, no consistent direction.
// - glibc's transparent huge pages for the heap (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; the host's
//   THP mode is madvise): the cold backwards 0.87-1.02x, but `python -m model.train --config small
//   --steps 30` at 1 thread 50.58 / 51.05 / 50.13 ms against 50.68 / 53.37 / 51.27 (0.99x).
// - recomputing the products in the fm_compress backward (save_products=False), cold: fwd+bwd F = 16
//   1110 us against 1073 saved, F = 10 698 against 674 (the products still pay at the model's call).
//
// Against the roofs at the model's call (issue 26, branch wukong11, 2026-12-07 08:00-08:40 UTC, the same
// 2-vCPU Xeon, 2 threads, SCHED_FIFO under the measuring lock, host load 2.5-3.6 from other sessions;
// `scripts/wukong_model_ops.py --cold 32`, alternating processes, main's build against this one; the
// bench's 2-thread copy peak 24.9 GB/s, the issue's matmul roof 0.439 TFLOP/s). Minimum bytes (fp32,
// inputs read and outputs written once) F = 10 / 16: fm fwd 3.4 / 4.7 MB, fm bwd 4.9 / 7.1, mix fwd
// 5.2 / 6.1, mix bwd 7.8 / 9.6; at 24.9 GB/s 136 / 190, 195 / 284, 207 / 243, 314 / 385 us, against
// main's 99 / 157, 176 / 296, 151 / 205, 368 / 485 us: main's mix backward ran at 79-85 % of the copy
// rate for its bytes, the other three at 96-137 % (past it where the rotating inputs still sit in the
// 480 MiB L3), all at 18-31 % of the matmul roof. At this call their time follows their bytes and how
// early those arrive, not their FMAs (an FMA-side change, below, did not move it). In the training
// step itself each call costs 1.15-1.6x more (torch.profiler self time, 2 threads, per step: mix fwd
// ~0.6 ms, mix bwd ~1.0, fm fwd ~0.37, fm bwd ~0.64) in main and this branch alike; an isolated mix
// fwd call preceded by a 1152 x 512 x 512 MKL matmul reads 1.2-1.35x its back-to-back time: the
// caches the step's other ops leave behind.
// Kept: both feature_mix_norm kernels ask for sample b + 2's X, fm (and grad_out) a part per row block
// (RowsAhead, kSpreadAhead) instead of main's burst of sample b + 1's rows at the sample's start
// (forward) or no prefetch (backward). Outputs and gradients have the same bits as main's (both vector
// paths, 1 and 2 threads, fp32/bf16/fp16). Cold, 2 runs of 3-4 alternating rounds, 2-thread wall
// medians (1-thread CPU): mix bwd 0.87-0.90x (0.83-0.87x) at F = 10 and 0.85x (0.82-0.86x) at F = 16,
// mix fwd 0.93x (0.91-0.93x) and 0.84-0.91x (0.83-0.89x); each call after a cache-evicting matmul (2 x
// 3 rounds): mix bwd 0.88-0.94x / 0.91-0.93x, mix fwd 0.89-0.96x / 0.84-0.89x; warm (inputs in cache)
// 0.92-1.01x. AVX2 path (GEM_KERNELS_NO_AVX512=1, 3 rounds): mix bwd 0.88-0.90x / 0.77-0.85x; its mix
// forward (2-row blocks) keeps main's burst: spread there read 1.04x at F = 10, 0.94x at F = 16.
// In the profiled step (9 alternating runs each) mix bwd 1.00 -> 0.97 ms median (runs 0.94-1.09 vs
// 0.84-1.03), mix fwd unresolved (0.51-0.71 in both): ~0.1 ms a step at best. Not measured on AMD.
// Measured and not kept (wukong11; in-process A/B = one process alternating the variants round by round
// on the same 32 input sets through a temporary switch, 6 rounds):
// - the same spread prefetch (X and grad_out two samples ahead, over grad_X's row blocks) in the
//   fm_compress backward: in-process cold 0.92x at F = 16, 0.96-1.00x at F = 10; alternating processes
//   0.97x / 0.96x (within the spread); after a cache-evicting matmul 1.00x / 0.98x. One sample ahead,
//   spread or in two halves (after the LayerNorm backward and after grad_X), read the same at F = 16
//   and 1.00-1.04x at F = 10.
// - spread prefetch in the fm_compress forward (X over the S rows): one ahead 1.05-1.17x slower, two
//   ahead 0.98-1.04x: main's burst of the next sample's X stays.
// - one sample ahead in the mix forward: 0.83-0.92x at F = 16 but 1.03-1.06x at F = 10 (a guess: its
//   last parts then come too late); whole-sample bursts in the mix backward, one ahead: 1.03-1.08x (as
//   wk8 found).
// - RowsAhead three or four samples ahead instead of two: mix bwd 1.01-1.05x, mix fwd 1.02-1.05x; the
//   mix backward's parts spread over its grad_X row blocks too (O + F parts, not O): 0.96-1.00x at 2
//   threads (within the rounds' spread), 0.93-0.96x at 1 (two in-process runs, 6 and 10 rounds).
// - the mix backward's grad_X = M^T grad_S in 8-row blocks on 16 lanes (16 zmm accumulators, the S and
//   LayerNorm part left at 4 rows: the spills that sank the 8-row blocks above were there): warm
//   1-thread CPU 0.96-0.97x, cold 2-thread 1.00x (F = 16) and 1.05x (F = 10): within the noise.
// - save_products=False at 2 threads, cold: the fm forward no faster for 1.5-1.8 MB less written
//   (1.01-1.03x), the backward 1.13-1.19x slower at F = 10 and 0.97-1.07x at F = 16.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "gem_kernels/checks.h"
#include "gem_kernels/cpu_blas.h"
#include "gem_kernels/cpu_exp.h"
#include "gem_kernels/cpu_stream.h"
#include "gem_kernels/interaction_checks.h"
#include "gem_kernels/parallel.h"

namespace gem_kernels {
namespace {

constexpr int64_t kRows = 4;   // register tile height (rows of X per tile)
constexpr int64_t kCols = 16;  // fp32 columns per register tile: two AVX2 vectors

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Copy rows x cols of src (row stride `cols`) into dst [rows_p, cols_p] as fp32, zero padding.
template <typename scalar_t>
void load_padded(const scalar_t* src, int64_t rows, int64_t cols, float* dst, int64_t rows_p, int64_t cols_p) {
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* s = src + r * cols;
    float* d = dst + r * cols_p;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<float>(s[c]);
    std::fill(d + cols, d + cols_p, 0.f);
  }
  std::fill(dst + rows * cols_p, dst + rows_p * cols_p, 0.f);
}

// C[m, :] (+)= sum_{k < K} A[m * lda + k * acs] * Bm[k, :] for m < M (a multiple of 4); Bm and C
// have row stride ld (a multiple of 8). A is only ever broadcast, so any strides work: acs = lda'
// with lda = 1 multiplies by the transpose of a row-major [K, lda'] matrix without copying it. A small GEMM with 4x16 register tiles: broadcast A, FMA rows of
// Bm, no horizontal reductions. `upper` skips the 16-column blocks wholly left of each 4-row block's
// diagonal (their C stays unwritten), for the upper triangle of a gram matrix.
#if defined(__AVX2__) && defined(__FMA__)
// Written with AVX2/FMA intrinsics: the same tile as `#pragma omp simd` over a float acc[4][16]
// array ran at ~20 GFLOP/s per core on the bench machine (GCC kept the accumulators in memory);
// eight ymm accumulators held in registers, two B loads and four broadcasts per eight FMAs, run
// these L1-resident products at ~70-90 GFLOP/s per core (Zen 3; the FMA latency x 2 pipes is 8).
// The last 8 columns of a C whose ld is 16 j + 8, R rows from m0: one 8-wide accumulator per row.
template <int R>
inline void combine_rows8(const float* __restrict__ a, int64_t K, int64_t lda, int64_t acs,
                          const float* __restrict__ bk, int64_t ld, float* __restrict__ c, bool accumulate) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = accumulate ? _mm256_loadu_ps(c + r * ld) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, bk += ld) {
    const __m256 b = _mm256_loadu_ps(bk);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + r * lda + k * acs), b, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(c + r * ld, acc[r]);
}

void combine_rows(const float* __restrict__ A, int64_t M, int64_t K, int64_t lda, const float* __restrict__ Bm,
                  int64_t ld, float* __restrict__ C, bool accumulate, bool upper = false, int64_t acs = 1) {
  // ld = 16 j + 8 (fm_compress's rank 8 and 8 j + 8): the 16-wide tiles, then the last 8 columns
  // eight rows at a time, so that eight independent accumulators still cover the FMA latency x 2 pipes.
  const int64_t ld16 = ld / kCols * kCols;
  if (ld16 < ld) {
    int64_t m0 = 0;
    for (; m0 + 2 * kRows <= M; m0 += 2 * kRows)
      combine_rows8<2 * kRows>(A + m0 * lda, K, lda, acs, Bm + ld16, ld, C + m0 * ld + ld16, accumulate);
    if (m0 < M) combine_rows8<kRows>(A + m0 * lda, K, lda, acs, Bm + ld16, ld, C + m0 * ld + ld16, accumulate);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const float* a = A + m0 * lda;
    for (int64_t d0 = upper ? m0 / kCols * kCols : 0; d0 < ld16; d0 += kCols) {
      float* c = C + m0 * ld + d0;
      __m256 acc[kRows][2];
      for (int r = 0; r < kRows; ++r) {
        acc[r][0] = accumulate ? _mm256_loadu_ps(c + r * ld) : _mm256_setzero_ps();
        acc[r][1] = accumulate ? _mm256_loadu_ps(c + r * ld + 8) : _mm256_setzero_ps();
      }
      const float* bk = Bm + d0;
      for (int64_t k = 0; k < K; ++k, bk += ld) {
        const __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps(bk + 8);
        for (int r = 0; r < kRows; ++r) {
          const __m256 g = _mm256_broadcast_ss(a + r * lda + k * acs);
          acc[r][0] = _mm256_fmadd_ps(g, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(g, b1, acc[r][1]);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        _mm256_storeu_ps(c + r * ld, acc[r][0]);
        _mm256_storeu_ps(c + r * ld + 8, acc[r][1]);
      }
    }
  }
}
#else
// Portable build (no AVX2/FMA target): the same tile for the compiler to vectorise.
void combine_rows(const float* __restrict__ A, int64_t M, int64_t K, int64_t lda, const float* __restrict__ Bm,
                  int64_t ld, float* __restrict__ C, bool accumulate, bool upper = false, int64_t acs = 1) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const float* a = A + m0 * lda;
    for (int64_t d0 = upper ? m0 / kCols * kCols : 0; d0 < ld; d0 += kCols) {
      const int64_t width = std::min<int64_t>(kCols, ld - d0);  // 8 in the last block when ld = 16 j + 8
      float acc[kRows][kCols];
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < width; ++c) acc[r][c] = accumulate ? C[(m0 + r) * ld + d0 + c] : 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const float* bk = Bm + k * ld + d0;
        const float* ak = a + k * acs;
        const float g0 = ak[0], g1 = ak[lda], g2 = ak[2 * lda], g3 = ak[3 * lda];
#pragma omp simd
        for (int c = 0; c < width; ++c) {
          acc[0][c] += g0 * bk[c];
          acc[1][c] += g1 * bk[c];
          acc[2][c] += g2 * bk[c];
          acc[3][c] += g3 * bk[c];
        }
      }
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < width; ++c) C[(m0 + r) * ld + d0 + c] = acc[r][c];
    }
  }
}
#endif

// Ask for the next sample's rows while this one computes: X streams from memory exactly once, and
// one sample's products are too short for the hardware prefetcher to run far enough ahead (the
// fm_compress forward spent half its non-GEMM time stalled in the copy of X).
template <typename T>
inline void prefetch_rows(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < count * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 2);
}

// A later sample's rows (up to three byte ranges: X, grad_out, fm) asked for a part at a time, spread
// over this sample's register blocks instead of in one burst at its start: `part(i0, i1, n)` asks
// for the lines [i0 / n, i1 / n) of every range (prefetcht1, as prefetch_rows). A D = 32 sample's
// rows are 40-70 lines; where the fm_compress backward issues them in one burst, a cpu-clock profile
// (cold inputs, F = 16) put 16 % of its samples on the prefetch instructions themselves (the likely
// cause, not measurable in this VM without a PMU: each miss holds a line fill buffer). Whole-sample
// bursts never paid in the feature_mix_norm backward (header); the same lines spread over the
// sample's row blocks, two samples ahead (kSpreadAhead), do (header, wukong11).
struct RowsAhead {
  const char* p[3] = {};
  int64_t lines[3] = {};
  template <typename T>
  void add(const T* rows, int64_t count) {
    for (int i = 0; i < 3; ++i)
      if (!p[i]) {
        p[i] = reinterpret_cast<const char*>(rows);
        lines[i] = (count * static_cast<int64_t>(sizeof(T)) + 63) / 64;
        return;
      }
  }
  void part(int64_t i0, int64_t i1, int64_t n) const {
    for (int r = 0; r < 3 && p[r]; ++r)
      for (int64_t l = lines[r] * i0 / n, e = lines[r] * i1 / n; l < e; ++l) __builtin_prefetch(p[r] + 64 * l, 0, 2);
  }
};

// How many samples ahead RowsAhead asks: 1 ahead read the same as 2 in the feature_mix_norm backward
// but 1.03-1.06x slower than main's burst in its forward at F = 10, where 2 ahead read 0.95x
// (in-process A/B, header).
constexpr int64_t kSpreadAhead = 2;

template <typename scalar_t>
void store_rows(const float* src, int64_t rows, int64_t cols, int64_t ld, scalar_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = static_cast<scalar_t>(src[r * ld + c]);
  }
}

// Eight-wide pieces of the per-sample epilogues (LayerNorm, transposes): GCC left the LayerNorm
// loops scalar despite `omp simd` (a quarter of the profile samples in the fm_compress backward's
// own code), so they are written out. Each loop below runs its full 8-lanes with these and the
// rest with the same scalar formula, which is also the whole loop in a build without AVX2.
#if defined(__AVX2__) && defined(__FMA__)
template <typename scalar_t>
inline __m256 load8(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {  // bf16 -> fp32 is a 16-bit shift
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  } else {  // double: not a dtype these kernels take beyond the dispatch macro; convert lane by lane
    alignas(32) float v[8];
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
    return _mm256_load_ps(v);
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block.
inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// Copies `rows` rows of `cols` floats between row strides lds and ldd. The per-sample reshuffles
// (S compacted for the LayerNorm, grad_S into [grad_S | Y], the products) are dozens of rows of
// 16-64 floats per sample: as libc memmove calls they were 7% of a cpu-clock profile of
// fm_compress forward + backward (no gain measurable through this host's noise after the change).
inline void copy_rows(const float* __restrict__ src, int64_t rows, int64_t cols, int64_t lds,
                      float* __restrict__ dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r, src += lds, dst += ldd) {
    int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; c + 8 <= cols; c += 8) _mm256_storeu_ps(dst + c, _mm256_loadu_ps(src + c));
#endif
    for (; c < cols; ++c) dst[c] = src[c];
  }
}

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols: 8 x 8 register blocks, scalar edges.
// Strided scalar copies of this kind were a fifth of the fm_compress backward.
void transpose(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst, int64_t ldd) {
  int64_t r0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; r0 + 8 <= rows; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) transpose8x8(src + r0 * lds + c0, lds, dst + c0 * ldd + r0, ldd);
    for (int64_t c = c0; c < cols; ++c)
      for (int64_t r = r0; r < r0 + 8; ++r) dst[c * ldd + r] = src[r * lds + c];
  }
#endif
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = r0; r < rows; ++r) dst[c * ldd + r] = src[r * lds + c];
}

// Start of row i of the packed upper triangle (pairs j >= i + off, off = 0 or 1).
inline int64_t pair_row_start(int64_t i, int64_t F, int64_t off) { return i * (F - off) - i * (i - 1) / 2; }

// Sums over the batch (cross layer grad_bias, fm_compress grad_y and LayerNorm grads) go to fp32
// partials over fixed chunks of kSumChunk rows (fewer, longer ones past kMaxSumChunks), which ATen
// sums at the end. A running fp32 sum over a thread's whole share of the batch lost 1e-5 relative
// in fm_compress's grad_y at B = 2048 (20x eager's error; 64-row chunks 2.3x, 16-row chunks 1.4x);
// chunks that do not depend on the thread count also give the same bits for any thread count.
constexpr int64_t kSumChunk = 16;
constexpr int64_t kMaxSumChunks = 1024;
inline int64_t sum_chunks(int64_t rows) {
  return std::clamp<int64_t>((rows + kSumChunk - 1) / kSumChunk, 1, kMaxSumChunks);
}

// The sum over chunks of fp32 partials [chunks, R, L], rows [row, row + rows) and columns < cols,
// in chunk order, as `dtype` ([rows, cols], or [cols] when `flat`). One pass in place of ATen's
// sum + narrow + contiguous per gradient: those ran after the parallel part of each backward,
// ~10 us of serial time per call (B = 1 cost 17-22 us against the forwards' 7).
at::Tensor sum_chunk_partials(const float* p, int64_t chunks, int64_t R, int64_t L, int64_t row, int64_t rows,
                              int64_t cols, bool flat, at::ScalarType dtype) {
  // at::empty, the first chunk's rows written as 0 + p (the same bits, -0 included, as at::zeros
  // followed by +=): no fill pass and no zero_ dispatch (three calls in each of the Wukong backwards).
  // Measured (torch.profiler per-call CPU time, small model, batch 8, 1 thread, main's build and this
  // one in alternating processes, 6 pairs, busy shared host, 2026-12-07, helper fixed13):
  // feature_mix_norm_backward -8 us a call (median of the pairs' differences; -10 to +0.5 us, ~60 us),
  // fm_compress_backward -2 us (-8.5 to +1.4, ~45 us). Too small to see in the step's noise.
  auto out = flat ? at::empty({cols}, at::kFloat) : at::empty({rows, cols}, at::kFloat);
  float* o = out.data_ptr<float>();
  if (chunks == 0) std::fill_n(o, rows * cols, 0.0f);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = p + (c * R + row + r) * L;
      float* dst = o + r * cols;
      if (c == 0) {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) dst[j] = 0.0f + src[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) dst[j] += src[j];
      }
    }
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor sum_chunk_partials(const at::Tensor& part, int64_t row, int64_t rows, int64_t cols, bool flat,
                              at::ScalarType dtype) {
  return sum_chunk_partials(part.data_ptr<float>(), part.size(0), part.size(1), part.size(2), row, rows, cols, flat,
                            dtype);
}

// The Wukong ops' per-call setup (issue 26): fp32 copies of their small parameters and the backwards'
// per-chunk partials as plain buffers, not ATen tensors. Each at::zeros / narrow / copy_ / t / to
// was a dispatcher call, ~0.5 us of serial time, a dozen per backward call (B = 1: mix backward
// 12.4-13.2 -> 6.9-7.1 us, header).
// t (contiguous, interaction_checks) as fp32: t itself when it is, else one conversion.
at::Tensor as_fp32(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }

// The fp32 [rows_p, cols] matrix of t [r, c] (cols = c), or of t^T (cols = r) when `transposed`,
// with zero rows past t's.
std::vector<float> fp32_padded(const at::Tensor& t, int64_t rows_p, bool transposed) {
  const at::Tensor tf = as_fp32(t);
  const int64_t r = tf.size(0), c = tf.size(1), cols = transposed ? r : c;
  const float* src = tf.data_ptr<float>();
  std::vector<float> out(rows_p * cols, 0.f);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) out[transposed ? j * cols + i : i * cols + j] = src[i * c + j];
  return out;
}

// Threads worth waking for `items` of `flops_per_item` each: one per 2^22 FLOPs, about 40 us of
// these kernels on one core. A second thread saves at most half a call, and waking it costs tens of
// us on a quiet host and up to a scheduler slice (ms) on a busy one, where the join waits for a
// descheduled worker. At 2^23 the GEM small model's F = 10 Wukong forwards (1152 rows, ~12 MFLOP,
// ~230 us) ran on one thread while its 2-thread training step had the second core idle
// (issue 26's per-op profile: feature_mix_norm forward 1.50x from 1 to 2 threads); batches of
// a few hundred rows still run on one.
int64_t workers_for(int64_t items, int64_t flops_per_item) {
  return std::max<int64_t>(1, items * std::max<int64_t>(1, flops_per_item) >> 22);
}

// Items a worker claims at a time (parallel_ranges) when `workers` threads share `items`: at most
// `most` (long runs of consecutive samples keep each thread's reads sequential for the hardware
// prefetcher: claims of one 16-sample chunk made the fm_compress backward 8% slower than a static
// split at B = 4096, F = 27, D = 64, k = 16, measured interleaved in one process; claims of 128
// samples ran within 1.5% of it), at least 4 per worker, and a multiple of `workers` of them,
// all of one size but the last. An odd count leaves the other workers waiting at the join while
// one runs the last claim: 9 claims of 128 of the model's 1152 rows made 2 threads at most 1.8x.
constexpr int64_t kClaimSamples = 128;
int64_t claim_size(int64_t items, int64_t most, int64_t workers) {
  workers = std::clamp<int64_t>(workers, 1, at::get_num_threads());
  if (workers == 1 || items <= workers) return most;
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t ranges = round_up(std::max(ceil_div(items, most), 4 * workers), workers);
  while (ranges < items && ceil_div(items, ceil_div(items, ranges)) % workers != 0) ranges += workers;
  return ceil_div(items, std::min(ranges, items));
}

// ------------------------------------------------------------------------------------------------
// dot_interaction
// ------------------------------------------------------------------------------------------------

at::Tensor dot_interaction_cpu(const at::Tensor& x, bool self_interaction) {
  GK_CHECK_CPU(x);
  interaction_checks::dot_interaction(x);
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2);
  const int64_t off = self_interaction ? 0 : 1;
  const int64_t P = self_interaction ? F * (F + 1) / 2 : F * (F - 1) / 2;
  auto out = at::empty({B, P}, x.options());
  if (out.numel() == 0) return out;
  // The gram's upper triangle as X X^T = combine_rows(X, X^T): rows of X^T [D, Fq] are FMA'd into
  // 4x16 register tiles of the gram [Fp, Fq], so no dot product needs a horizontal reduction.
  const int64_t Fp = round_up(F, kRows), Fq = round_up(F, kCols);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dot_interaction_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t workers = workers_for(B, P * D);
    parallel_ranges(B, claim_size(B, kClaimSamples, workers), workers, [&](auto& claim) {
      std::vector<float> xs(Fp * D, 0.f), xt(D * Fq, 0.f), gram(Fp * Fq);
      for (int64_t begin, end; claim(begin, end);)
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* xb = xp + b * F * D;
        if (b + 1 < end) prefetch_rows(xb + F * D, F * D);
        for (int64_t f = 0; f < F; ++f)
          for (int64_t d = 0; d < D; ++d) {
            const float v = static_cast<float>(xb[f * D + d]);
            xs[f * D + d] = v;
            xt[d * Fq + f] = v;
          }
        combine_rows(xs.data(), Fp, D, D, xt.data(), Fq, gram.data(), false, true);
        scalar_t* ob = op + b * P;
        for (int64_t i = 0; i < F; ++i) {
          const int64_t start = pair_row_start(i, F, off) - i - off;
          for (int64_t j = i + off; j < F; ++j) ob[start + j] = static_cast<scalar_t>(gram[i * Fq + j]);
        }
      }
    });
  });
  return out;
}

at::Tensor dot_interaction_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, bool self_interaction) {
  GK_CHECK_CPU(x);
  interaction_checks::dot_interaction_backward(grad_out, x, self_interaction);
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2);
  const int64_t P = interaction_checks::num_pairs(F, self_interaction);
  auto grad_x = at::empty_like(x);
  if (grad_x.numel() == 0) return grad_x;
  const int64_t Fp = round_up(F, kRows), Dp = round_up(D, kCols);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dot_interaction_backward_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = grad_out.data_ptr<scalar_t>();
    scalar_t* dxp = grad_x.data_ptr<scalar_t>();
    const int64_t workers = workers_for(B, 2 * P * D);
    parallel_ranges(B, claim_size(B, kClaimSamples, workers), workers, [&](auto& claim) {
      std::vector<float> xs(Fp * Dp), acc(Fp * Dp);
      std::vector<float> sym(Fp * F, 0.f);  // sym(G) = G + G^T, rows padded to Fp with zeros
      for (int64_t begin, end; claim(begin, end);)
      for (int64_t b = begin; b < end; ++b) {
        if (b + 1 < end) {
          prefetch_rows(xp + (b + 1) * F * D, F * D);
          prefetch_rows(gp + (b + 1) * P, P);
        }
        load_padded(xp + b * F * D, F, D, xs.data(), Fp, Dp);
        const scalar_t* gb = gp + b * P;
        int64_t p = 0;
        for (int64_t i = 0; i < F; ++i) {
          if (self_interaction) sym[i * F + i] = 2.f * static_cast<float>(gb[p++]);
          for (int64_t j = i + 1; j < F; ++j, ++p) {
            const float g = static_cast<float>(gb[p]);
            sym[i * F + j] = g;
            sym[j * F + i] = g;
          }
        }
        combine_rows(sym.data(), Fp, F, F, xs.data(), Dp, acc.data(), false);
        store_rows(acc.data(), F, D, Dp, dxp + b * F * D);
      }
    });
  });
  return grad_x;
}

// ------------------------------------------------------------------------------------------------
// cross_layer: out = x0 * z + xl, z = p U^T + b, p = xl V^T (p = xl when v is empty)
// ------------------------------------------------------------------------------------------------

// Elements per epilogue task: enough to amortise scheduling.
constexpr int64_t kEpilogueGrain = 16384;

// fp32 backward and low-rank forward: the matmuls run per block of rows on single-threaded sgemm
// inside the parallel region, and each block's epilogue runs right after its product, while the
// block's rows are still in L2: the unfused form wrote z and p (in the backward grad_z and grad_p)
// out and read them back once more from memory. Blocks are a fixed number of rows for a
// given B and N (not per thread count), so grad_bias's per-block partials give the same bits on any
// number of threads; 512 KB per [rows, N] operand (256 rows at N = 512, 128 at N = 1024).
// At least 8 blocks once B >= 32, so that a batch of few rows still spreads over the threads (their
// sgemm calls are single-threaded): B = 8 at N = 4096 would otherwise be one block on one core.
// 512 KB, not 256 KB as before: fwd+bwd (gk.cross_layer with autograd, B = 4096, one process, block
// sizes alternated per round, medians of 30, 2-core AMD EPYC Zen 4, 2026-12-07) N = 512 at 256 rows
// 35.35 / 36.17 ms against 36.22 / 36.89 at 128 (2 threads), 68.22 against 69.46 (1 thread), 64 rows
// slower still; low rank N = 1024, r = 64: 128 rows 23.70, 256 rows 23.49, 64 rows 24.57 ms.
inline int64_t cross_block_rows(int64_t B, int64_t N) {
  return std::clamp<int64_t>(std::min<int64_t>(131072 / std::max<int64_t>(N, 1), (B + 7) / 8), 4, 256) / 4 * 4;
}

// Whether rows of N floats at these bases can take 8-float streaming stores: N a multiple of 8 and
// every base 32-byte aligned (ATen's allocations are 64-byte aligned). Outputs the op writes and
// does not read again (out, z, grad_x0, grad_xl) go out with streaming stores: a normal store first
// reads the line from memory (read-for-ownership), a third more traffic on these memory-bound passes.
// Measured against the same code with normal stores (B = 4096, one process, variants alternated
// round by round, medians of 21-31, SCHED_FIFO on a busy host, freed heap kept as bench and
// model.train keep it; bench/results/notes-cross10.md): N = 512 fwd 0.93x, fwd+bwd 0.96x at 2
// threads, 0.92x at 1; N = 1024, r = 64 fwd 0.77x, fwd+bwd 0.84x at 2 threads, 0.84x at 1; three
// layers stacked (each out the next xl) fwd+bwd 0.97x and 0.85x; every output a fresh mapping
// (glibc's defaults) 0.98x and 0.87x. One exception, not understood: the bench's forward-only
// low-rank row read 0.4-1.7 ms slower with them in every run (5 runs, eager in the same processes
// slower too), where the fwd+bwd row gained; its rounds run only forwards on 2 input sets, so its
// data may stay in the L3, where a normal store hits a cached line (a guess: an in-process run with
// 2 sets and eager's forward interleaved still put streams at 0.76-0.86x).
// Small batches, whose outputs a cache could keep (N = 512, full rank and r = 64, through gk.cross_layer
// with autograd and the output read after each call; variants alternated over 40 rounds, 2 threads,
// SCHED_FIFO, busy host, 2026-12-07 06:20 UTC): B = 64 0.98-1.00x, B = 256 0.92-1.005x, B = 1024
// 0.91-0.98x, B = 4096 0.72-0.95x streamed against normal stores: no loss at any size, so no threshold.
inline bool can_stream_rows(int64_t N, std::initializer_list<const void*> bases) {
#if defined(__AVX2__)
  if (N % 8 != 0) return false;
  for (const void* base : bases)
    if (reinterpret_cast<uintptr_t>(base) % 32 != 0) return false;
  return true;
#else
  return false;
#endif
}

// The forward's epilogue on m rows: z = zs + b and out = x0 * z + xl (every pointer at the first row,
// row stride N). zs may be z itself (the full-rank forward adds the bias in place); the stores of z
// stream when `stream_z`, those of out when `stream_out` (can_stream_rows).
inline void cross_forward_rows(const float* zs, const float* b, const float* a, const float* r, int64_t m, int64_t N,
                               bool stream_z, bool stream_out, float* z, float* o) {
#if defined(__AVX2__)
  if (stream_out) {
    for (int64_t i = 0; i < m * N; i += N)
      for (int64_t n = 0; n < N; n += 8) {
        const __m256 zv = _mm256_add_ps(_mm256_loadu_ps(zs + i + n), _mm256_loadu_ps(b + n));
        if (stream_z) {
          _mm256_stream_ps(z + i + n, zv);
        } else {
          _mm256_storeu_ps(z + i + n, zv);
        }
        _mm256_stream_ps(o + i + n, _mm256_fmadd_ps(_mm256_loadu_ps(a + i + n), zv, _mm256_loadu_ps(r + i + n)));
      }
    streaming_store_fence();
    return;
  }
#endif
  for (int64_t i = 0; i < m * N; i += N) {
    _Pragma("omp simd")
    for (int64_t n = 0; n < N; ++n) {
      const float zv = zs[i + n] + b[n];
      z[i + n] = zv;
      o[i + n] = a[i + n] * zv + r[i + n];
    }
  }
}

// The fp32 forward per block of rows: z's block into the worker's scratch, then the epilogue from it
// while it is in cache, z and out streamed. Low rank: p = xl V^T (kept for the backward), then p U^T.
// Full rank: xl W^T, when W is at most 1 MiB and blocks have >= 64 rows (cross_fuses_weight_grads: then
// each block's sgemm repacks only an L2-sized W); otherwise cross_layer_cpu runs one multi-threaded mm
// and an epilogue pass. Full rank measured on the 2-core AMD EPYC (Zen 4; issue 26, branch crossfwd,
// 2026-12-07, one process, variants alternated per round, 2 threads unless said, medians of 30; the
// bench's B = 4096, N = 512): forward 12.47 / 12.87 ms per block against 13.10 / 14.74 for mm +
// epilogue, the bare mm 12.41 / 13.93 (so the epilogue is hidden); 1 thread 24.45 against 25.38. Where
// this was measured before, on the Intel Xeon with 128-row blocks, it was 9.50 per block against 9.81
// (within the noise), so it is kept on every CPU.
void cross_layer_forward_blocks_fp32(const at::Tensor& x0, const at::Tensor& xl, const at::Tensor& u,
                                     const at::Tensor& v, const at::Tensor& bias, bool low_rank, at::Tensor& out,
                                     at::Tensor& z, at::Tensor& p) {
  const int64_t B = x0.size(0), N = x0.size(1), K = low_rank ? u.size(1) : N;
  const int64_t rows = cross_block_rows(B, N), blocks = (B + rows - 1) / rows;
  const float *a = x0.data_ptr<float>(), *r = xl.data_ptr<float>(), *uw = u.data_ptr<float>(),
              *vw = low_rank ? v.data_ptr<float>() : nullptr, *b = bias.data_ptr<float>();
  float *o = out.data_ptr<float>(), *zz = z.data_ptr<float>(), *pp = low_rank ? p.data_ptr<float>() : nullptr;
  const bool stream = can_stream_rows(N, {o, zz});
  parallel_ranges(blocks, 1, workers_for(B, 2 * N * K), [&](auto& claim) {
    SingleThreadBlas single;
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(rows * N)) scratch.resize(rows * N);
    float* zs = scratch.data();
    for (int64_t blk, end; claim(blk, end);) {
      const int64_t r0 = blk * rows, m = std::min(rows, B - r0);
      if (low_rank) {
        float* pb = pp + r0 * K;
        mm(false, true, m, K, N, 1.f, r + r0 * N, N, vw, N, 0.f, pb, K);  // p = xl V^T
        mm(false, true, m, N, K, 1.f, pb, K, uw, K, 0.f, zs, N);          // p U^T (+ bias below)
      } else {
        mm(false, true, m, N, N, 1.f, r + r0 * N, N, uw, N, 0.f, zs, N);  // xl W^T (+ bias below)
      }
      cross_forward_rows(zs, b, a + r0 * N, r + r0 * N, m, N, stream, stream, zz + r0 * N, o + r0 * N);
    }
  });
}

// The per-block elementwise part of the fp32 backward on m rows from r0: grad_z = g * x0 into gz,
// grad_x0 = g * z (streamed when `stream`: can_stream_rows), gx = g (the block's product is added
// to it next) and grad_z's column sums into colsum. gz and gx point at the block's first row.
inline void cross_backward_rows(const float* g, const float* a, const float* zz, int64_t r0, int64_t m, int64_t N,
                                bool stream, float* gz, float* ga, float* gx, float* colsum) {
#if defined(__AVX2__)
  if (stream) {
    for (int64_t i = 0; i < m; ++i) {
      const int64_t base = (r0 + i) * N;
      float *gzr = gz + i * N, *gxr = gx + i * N;
      for (int64_t n = 0; n < N; n += 8) {
        const __m256 gv = _mm256_loadu_ps(g + base + n), dz = _mm256_mul_ps(gv, _mm256_loadu_ps(a + base + n));
        _mm256_storeu_ps(gzr + n, dz);
        _mm256_stream_ps(ga + base + n, _mm256_mul_ps(gv, _mm256_loadu_ps(zz + base + n)));
        _mm256_storeu_ps(gxr + n, gv);
        _mm256_storeu_ps(colsum + n, _mm256_add_ps(_mm256_loadu_ps(colsum + n), dz));
      }
    }
    streaming_store_fence();
    return;
  }
#endif
  for (int64_t i = 0; i < m; ++i) {
    const int64_t base = (r0 + i) * N;
    float *gzr = gz + i * N, *gxr = gx + i * N;
    _Pragma("omp simd")
    for (int64_t n = 0; n < N; ++n) {
      const float gv = g[base + n], dz = gv * a[base + n];
      gzr[n] = dz;
      ga[base + n] = gv * zz[base + n];
      gxr[n] = gv;
      colsum[n] += dz;
    }
  }
}

// Whether the fp32 backward sums the weight gradients per block too (cross_layer_backward_fused):
// when a worker's accumulators (grad_w [N, N]; low rank grad_u [N, r] and grad_v [r, N]) take at
// most half of its L2 (1 MiB of this machine's 2), and a block has the rows (the accumulating
// product's k) for the product to run near the GEMM's rate: 64-row blocks ran fwd+bwd 5 % slower than
// 128 at N = 512 (2 threads), 256 no faster. Past that, grad_u stays one MKL matmul over all rows
// after the pass (cross_layer_backward_fp32): per-block updates of a large accumulator would stream
// it through memory once per block.
constexpr int64_t kCrossFusedGradBytes = int64_t(1) << 20;
inline bool cross_fuses_weight_grads(int64_t B, int64_t N, int64_t K, bool low_rank) {
  return (low_rank ? 2 : 1) * N * K * int64_t(sizeof(float)) <= kCrossFusedGradBytes && cross_block_rows(B, N) >= 64;
}

// grad_z = g * x0 and grad_x0 = g * z per block, then grad_xl's block = g + grad_z @ U (through grad_p
// = grad_z @ U, [rows, r], and grad_p @ V when low rank) while grad_z is in cache; grad_z and grad_p
// are written out for the weight gradients' matmuls after it.
void cross_layer_backward_fp32(const at::Tensor& grad_out, const at::Tensor& x0, const at::Tensor& u,
                               const at::Tensor& v, const at::Tensor& z, bool low_rank, at::Tensor& grad_z,
                               at::Tensor& grad_p, at::Tensor& grad_x0, at::Tensor& grad_xl, at::Tensor& partial) {
  const int64_t B = x0.size(0), N = x0.size(1), K = u.size(1);
  const int64_t rows = cross_block_rows(B, N), blocks = (B + rows - 1) / rows;
  const float *g = grad_out.data_ptr<float>(), *a = x0.data_ptr<float>(), *zz = z.data_ptr<float>(),
              *uw = u.data_ptr<float>();
  const float* vw = low_rank ? v.data_ptr<float>() : nullptr;
  float *gz = grad_z.data_ptr<float>(), *ga = grad_x0.data_ptr<float>(), *gx = grad_xl.data_ptr<float>(),
        *part = partial.data_ptr<float>(), *gp = low_rank ? grad_p.data_ptr<float>() : nullptr;
  const bool stream = can_stream_rows(N, {ga});
  parallel_ranges(blocks, 1, workers_for(B, 2 * N * K), [&](auto& claim) {
    SingleThreadBlas single;
    for (int64_t blk, end; claim(blk, end);) {
      const int64_t r0 = blk * rows, m = std::min(rows, B - r0);
      cross_backward_rows(g, a, zz, r0, m, N, stream, gz + r0 * N, ga, gx + r0 * N, part + blk * N);
      if (low_rank) {
        mm(false, false, m, K, N, 1.f, gz + r0 * N, N, uw, K, 0.f, gp + r0 * K, K);
        mm(false, false, m, N, K, 1.f, gp + r0 * K, K, vw, N, 1.f, gx + r0 * N, N);
      } else {
        mm(false, false, m, N, N, 1.f, gz + r0 * N, N, uw, N, 1.f, gx + r0 * N, N);
      }
    }
  });
}

// The fp32 backward in one pass over the rows with the weight gradients summed per block
// (cross_fuses_weight_grads): grad_z, grad_p and grad_xl's block live in the worker's scratch (L2),
// grad_xl's block is streamed out once complete, and nothing reads grad_z and xl back from memory for
// a grad_u = grad_z^T xl afterwards. Each worker owns a contiguous run of blocks and adds each
// block's grad_z^T xl (low rank grad_z^T p and grad_p^T xl) into its own accumulator, worker 0's
// being the output itself; the others' are added at the end in worker order, so the weight gradients
// have the same bits run to run at a given thread count (not across thread counts).
// Bytes per fwd+bwd, T = one [B, N] fp32 tensor: the two-pass backward read g, x0, z and wrote
// grad_z, grad_x0 and grad_xl (each store also reading its line first), then read grad_z and xl back
// for grad_u: ~11 T; this pass reads g, x0, z, xl and writes grad_x0 and grad_xl once: 6 T. Measured
// against the two-pass form with normal stores in both (B = 4096, one process, alternating rounds, 2
// threads, SCHED_FIFO, load 3-6): fwd+bwd 0.95-0.97x at N = 512, 0.84x at N = 1024, r = 64.
void cross_layer_backward_fused(const at::Tensor& grad_out, const at::Tensor& x0, const at::Tensor& xl,
                                const at::Tensor& u, const at::Tensor& v, const at::Tensor& z, const at::Tensor& p,
                                bool low_rank, at::Tensor& grad_x0, at::Tensor& grad_xl, at::Tensor& grad_u,
                                at::Tensor& grad_v, at::Tensor& partial) {
  const int64_t B = x0.size(0), N = x0.size(1), K = u.size(1);
  const int64_t rows = cross_block_rows(B, N), blocks = (B + rows - 1) / rows;
  const int64_t workers = std::clamp<int64_t>(std::min(workers_for(B, 2 * N * K), blocks), 1, at::get_num_threads());
  const float *g = grad_out.data_ptr<float>(), *a = x0.data_ptr<float>(), *r = xl.data_ptr<float>(),
              *zz = z.data_ptr<float>(), *uw = u.data_ptr<float>();
  const float *vw = low_rank ? v.data_ptr<float>() : nullptr, *pp = low_rank ? p.data_ptr<float>() : nullptr;
  float *ga = grad_x0.data_ptr<float>(), *gx = grad_xl.data_ptr<float>(), *part = partial.data_ptr<float>();
  const bool stream = can_stream_rows(N, {ga, gx});
  const int64_t su = N * K, sv = low_rank ? K * N : 0;  // one worker's accumulators
  auto others = at::empty({(workers - 1) * (su + sv)}, x0.options());
  float* acc_rest = others.data_ptr<float>();
  at::parallel_for(0, workers, 1, [&](int64_t w_begin, int64_t w_end) {
    SingleThreadBlas single;
    thread_local std::vector<float> scratch;
    const int64_t need = rows * (2 * N + (low_rank ? K : 0));
    if (scratch.size() < static_cast<size_t>(need)) scratch.resize(need);
    float *gz = scratch.data(), *gxs = gz + rows * N, *gp = gxs + rows * N;
    for (int64_t w = w_begin; w < w_end; ++w) {
      float* acc_u = w == 0 ? grad_u.data_ptr<float>() : acc_rest + (w - 1) * (su + sv);
      float* acc_v = !low_rank ? nullptr : w == 0 ? grad_v.data_ptr<float>() : acc_rest + (w - 1) * (su + sv) + su;
      const int64_t first = w * blocks / workers, last = (w + 1) * blocks / workers;
      for (int64_t blk = first; blk < last; ++blk) {
        const int64_t r0 = blk * rows, m = std::min(rows, B - r0);
        const float beta = blk == first ? 0.f : 1.f;
        cross_backward_rows(g, a, zz, r0, m, N, stream, gz, ga, gxs, part + blk * N);
        if (low_rank) {
          mm(false, false, m, K, N, 1.f, gz, N, uw, K, 0.f, gp, K);              // grad_p = grad_z U
          mm(false, false, m, N, K, 1.f, gp, K, vw, N, 1.f, gxs, N);             // grad_xl = g + grad_p V
          mm(true, false, N, K, m, 1.f, gz, N, pp + r0 * K, K, beta, acc_u, K);  // grad_u += grad_z^T p
          mm(true, false, K, N, m, 1.f, gp, K, r + r0 * N, N, beta, acc_v, N);   // grad_v += grad_p^T xl
        } else {
          mm(false, false, m, N, N, 1.f, gz, N, uw, N, 1.f, gxs, N);             // grad_xl = g + grad_z U
          mm(true, false, N, N, m, 1.f, gz, N, r + r0 * N, N, beta, acc_u, N);   // grad_w += grad_z^T xl
        }
        copy_bytes(gx + r0 * N, gxs, m * N * sizeof(float), stream);
      }
      if (stream) streaming_store_fence();
    }
  });
  if (workers == 1) return;
  auto add_others = [&](float* dst, int64_t size, int64_t offset) {
    at::parallel_for(0, size, kEpilogueGrain, [&](int64_t begin, int64_t end) {
      for (int64_t w = 1; w < workers; ++w) {
        const float* src = acc_rest + (w - 1) * (su + sv) + offset;
        _Pragma("omp simd")
        for (int64_t i = begin; i < end; ++i) dst[i] += src[i];
      }
    });
  };
  add_others(grad_u.data_ptr<float>(), su, 0);
  if (low_rank) add_others(grad_v.data_ptr<float>(), sv, su);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_layer_cpu(const at::Tensor& x0, const at::Tensor& xl,
                                                               const at::Tensor& u, const at::Tensor& v,
                                                               const at::Tensor& bias) {
  GK_CHECK_CPU(x0);
  const bool low_rank = interaction_checks::cross_layer(x0, xl, u, v, bias);
  const int64_t B = x0.size(0), N = x0.size(1);
  // Full rank on the Intel Xeon, per block first measured 5-6 % slower than one multi-threaded mm and
  // the epilogue pass (B = 4096, N = 512, 1 and 2 threads, quiet, an unstreamed epilogue); low rank,
  // per block is faster (p's product is the small one). Again with the epilogue from an L2 scratch and z and out streamed
  // (issue 26, branch cross10, 2026-12-07, one process, alternating rounds, busy host under
  // SCHED_FIFO): fwd 9.50 ms per block vs 9.81 mm + streamed epilogue at 2 threads (load 6, within
  // the noise), 18.58 vs 18.60 at 1 thread; on the AMD EPYC per block is faster (see
  // cross_layer_forward_blocks_fp32), so it is the full-rank path now. Not the weight's repacking by every block's sgemm, as once thought:
  // packed once with MKL's packed-GEMM API (cblas_sgemm_pack / cblas_sgemm_compute, which libtorch_cpu
  // exports) and multiplied per block, the forward measured no faster (2 threads, quiet, one process,
  // 7 alternating rounds, 2026-12-06: fwd 8.99 ms packed per block, 9.06 unpacked per block, 8.51
  // addmm; fwd+bwd 26.94 / 26.76 / 26.43 ms; low rank r = 64, N = 1024: fwd 8.07 / 8.77 / 8.70 ms,
  // fwd+bwd 25.84 / 25.23 / 25.46 ms), nor at 1 thread. The packed API also gave the backward's per-block
  // grad_z U nothing measurable. Not kept.
  if (x0.scalar_type() == at::kFloat && low_rank) {
    auto out = at::empty_like(xl), z = at::empty_like(xl);
    auto p = at::empty({B, u.size(1)}, xl.options());
    if (B > 0) cross_layer_forward_blocks_fp32(x0, xl, u, v, bias, /*low_rank=*/true, out, z, p);
    return {out, z, p};
  }
  if (x0.scalar_type() == at::kFloat && cross_fuses_weight_grads(B, N, N, /*low_rank=*/false)) {
    auto out = at::empty_like(xl), z = at::empty_like(xl), p = at::empty({0}, xl.options());
    cross_layer_forward_blocks_fp32(x0, xl, u, v, bias, /*low_rank=*/false, out, z, p);
    return {out, z, p};
  }
  if (x0.scalar_type() == at::kFloat) {
    // One multi-threaded mm (no addmm: its broadcast copy of the bias into z is a pass over [B, N]
    // of its own), then the bias added in place and out streamed, rows split between the threads.
    at::Tensor z = at::mm(xl, u.t());
    auto out = at::empty_like(xl);
    if (out.numel() == 0) return {out, z, at::empty({0}, xl.options())};
    const float *a = x0.data_ptr<float>(), *r = xl.data_ptr<float>(), *b = bias.data_ptr<float>();
    float *zz = z.data_ptr<float>(), *o = out.data_ptr<float>();
    const bool stream = can_stream_rows(N, {o});
    at::parallel_for(0, B, std::max<int64_t>(1, kEpilogueGrain / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
      cross_forward_rows(zz + begin * N, b, a + begin * N, r + begin * N, end - begin, N, false, stream,
                         zz + begin * N, o + begin * N);
    });
    return {out, z, at::empty({0}, xl.options())};
  }
  at::Tensor p = low_rank ? at::mm(xl, v.t()) : at::empty({0}, xl.options());
  at::Tensor z = at::addmm(bias, low_rank ? p : xl, u.t());
  auto out = at::empty_like(xl);
  if (out.numel() == 0) return {out, z, p};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x0.scalar_type(), "cross_layer_cpu", [&] {
    const scalar_t* a = x0.data_ptr<scalar_t>();
    const scalar_t* zz = z.data_ptr<scalar_t>();
    const scalar_t* r = xl.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * N, kEpilogueGrain, [&](int64_t begin, int64_t end) {
      _Pragma("omp simd")
      for (int64_t i = begin; i < end; ++i)
        o[i] = static_cast<scalar_t>(static_cast<float>(a[i]) * static_cast<float>(zz[i]) + static_cast<float>(r[i]));
    });
  });
  return {out, z, p};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_layer_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x0, const at::Tensor& xl, const at::Tensor& u,
    const at::Tensor& v, const at::Tensor& z, const at::Tensor& p) {
  GK_CHECK_CPU(x0);
  const bool low_rank = interaction_checks::cross_layer_backward(grad_out, x0, xl, u, v, z, p);
  const int64_t B = x0.size(0), N = x0.size(1);
  auto grad_x0 = at::empty_like(x0);
  if (x0.scalar_type() == at::kFloat) {
    const int64_t rows = cross_block_rows(B, N), blocks = std::max<int64_t>(1, (B + rows - 1) / rows);
    auto partial = at::zeros({blocks, 1, N}, x0.options());
    auto grad_xl = at::empty_like(x0);
    if (B > 0 && cross_fuses_weight_grads(B, N, u.size(1), low_rank)) {
      auto grad_u = at::empty_like(u);
      auto grad_v = low_rank ? at::empty_like(v) : at::empty({0}, x0.options());
      cross_layer_backward_fused(grad_out, x0, xl, u, v, z, p, low_rank, grad_x0, grad_xl, grad_u, grad_v, partial);
      auto grad_bias = sum_chunk_partials(partial, 0, 1, N, /*flat=*/true, at::kFloat);
      return {grad_x0, grad_xl, grad_u, grad_v, grad_bias};
    }
    auto grad_z = at::empty_like(x0);
    auto grad_p = low_rank ? at::empty({B, u.size(1)}, x0.options()) : at::empty({0}, x0.options());
    if (B > 0) cross_layer_backward_fp32(grad_out, x0, u, v, z, low_rank, grad_z, grad_p, grad_x0, grad_xl, partial);
    auto grad_bias = sum_chunk_partials(partial, 0, 1, N, /*flat=*/true, at::kFloat);
    auto grad_u = at::mm(grad_z.t(), low_rank ? p : xl);
    auto grad_v = low_rank ? at::mm(grad_p.t(), xl) : at::empty({0}, x0.options());
    return {grad_x0, grad_xl, grad_u, grad_v, grad_bias};
  }
  // Column sums of grad_z over fixed row chunks (deterministic), in fp32.
  auto grad_z = at::empty_like(x0);
  const int64_t chunks = sum_chunks(B);
  auto partial = at::zeros({chunks, N}, x0.options().dtype(at::kFloat));
  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x0.scalar_type(), "cross_layer_backward_cpu", [&] {
      const scalar_t* g = grad_out.data_ptr<scalar_t>();
      const scalar_t* a = x0.data_ptr<scalar_t>();
      const scalar_t* zz = z.data_ptr<scalar_t>();
      scalar_t* gz = grad_z.data_ptr<scalar_t>();
      scalar_t* ga = grad_x0.data_ptr<scalar_t>();
      float* part = partial.data_ptr<float>();
      at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
        for (int64_t c = cb; c < ce; ++c) {
          float* colsum = part + c * N;
          for (int64_t row = c * B / chunks; row < (c + 1) * B / chunks; ++row) {
            const int64_t base = row * N;
            _Pragma("omp simd")
            for (int64_t n = 0; n < N; ++n) {
              const float gv = static_cast<float>(g[base + n]);
              const float dz = gv * static_cast<float>(a[base + n]);
              gz[base + n] = static_cast<scalar_t>(dz);
              ga[base + n] = static_cast<scalar_t>(gv * static_cast<float>(zz[base + n]));
              colsum[n] += dz;
            }
          }
        }
      });
    });
  }
  auto grad_bias = partial.sum(0).to(x0.scalar_type());
  at::Tensor grad_u, grad_v, grad_xl;
  if (low_rank) {
    grad_u = at::mm(grad_z.t(), p);
    auto grad_p = at::mm(grad_z, u);
    grad_v = at::mm(grad_p.t(), xl);
    grad_xl = at::addmm(grad_out, grad_p, v);
  } else {
    grad_u = at::mm(grad_z.t(), xl);
    grad_v = at::empty({0}, x0.options());
    grad_xl = at::addmm(grad_out, grad_z, u);
  }
  return {grad_x0, grad_xl, grad_u, grad_v, grad_bias};
}

// Rows of D = 32 floats (the GEM model's Wukong layers): a row is four ymm vectors, so a sample's
// products, LayerNorms and sums run on fixed-size register blocks with no padded copies, runtime
// loop bounds or transposes. At the model's shape (1152 rows, F = 10 and 16, O = 16, k = 8) the
// general kernels above spent most of their time around the products, not in them (notes-interaction.md).
#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kRow32 = 32;

// Every lane = the sum of v's eight lanes.
inline __m256 hsum_bcast(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm256_add_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
}

// One sample's X as fp32 rows of 32: fp32 input in place, other dtypes converted into xs [F, 32].
template <typename scalar_t>
inline const float* rows32_of(const scalar_t* xb, int64_t F, float* xs) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return xb;
  } else {
    for (int64_t i = 0; i < F * kRow32; i += 8) _mm256_storeu_ps(xs + i, load8(xb + i));
    return xs;
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// fm_compress: s = flatten(X (X^T Y)) per sample, out = LayerNorm(s) * w + b
// ------------------------------------------------------------------------------------------------

struct FmDims {
  int64_t B, F, D, k, Fp, Dp, kp, kq;
};

// Per-sample scratch: X [Fp, Dp], At = (X^T Y)^T [kp, Dp], its transpose A [D, kq], S = X A [Fp, kq]
// and S compacted to the flat [F*k] row that the LayerNorm (and `products`) use.
// The backward keeps grad_A^T [kp, Dp] right below At (`at_rows` = 2 kp), so that
// grad_X = [grad_S | Y] [At ; grad_A^T] is one product.
struct FmScratch {
  std::vector<float> xs, at, a, s, sf;
  FmScratch(const FmDims& d, int64_t at_rows)
      : xs(d.Fp * d.Dp), at(at_rows * d.Dp, 0.f), a(d.D * d.kq, 0.f), s(d.Fp * d.kq), sf(d.F * d.k) {}
};

// Fill scratch.xs, .at, .s and .sf for one sample; yt is Y^T fp32 [kp, F] (zero rows past k).
template <typename scalar_t>
void fm_sample(const FmDims& d, const scalar_t* xb, const float* yt, FmScratch& w) {
  load_padded(xb, d.F, d.D, w.xs.data(), d.Fp, d.Dp);
  combine_rows(yt, d.kp, d.F, d.F, w.xs.data(), d.Dp, w.at.data(), false);
  transpose(w.at.data(), d.k, d.D, d.Dp, w.a.data(), d.kq);  // columns k..kq of A stay zero
  combine_rows(w.xs.data(), d.Fp, d.D, d.Dp, w.a.data(), d.kq, w.s.data(), false);
  copy_rows(w.s.data(), d.F, d.k, d.kq, w.sf.data(), d.k);
}

// LayerNorm of one flat row s [n]: out = (s - mean) * rstd * w + bias. Returns {mean, rstd}.
template <typename scalar_t>
std::pair<float, float> layer_norm_row(const float* s, int64_t n, const float* w, const float* bias, float eps,
                                       scalar_t* out) {
  float sum = 0.f, sq = 0.f;
  int64_t e = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; e + 8 <= n; e += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(s + e));
  sum = hsum8(acc);
#endif
  for (; e < n; ++e) sum += s[e];
  const float mu = sum / n;
  e = 0;
#if defined(__AVX2__) && defined(__FMA__)
  acc = _mm256_setzero_ps();
  for (; e + 8 <= n; e += 8) {
    const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(s + e), _mm256_set1_ps(mu));
    acc = _mm256_fmadd_ps(c, c, acc);
  }
  sq = hsum8(acc);
#endif
  for (; e < n; ++e) sq += (s[e] - mu) * (s[e] - mu);
  const float rs = 1.f / std::sqrt(sq / n + eps);
  e = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m256 vmu = _mm256_set1_ps(mu), vrs = _mm256_set1_ps(rs);
    for (; e + 8 <= n; e += 8) {
      const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + e), vmu), vrs);
      _mm256_storeu_ps(out + e, _mm256_fmadd_ps(xh, _mm256_loadu_ps(w + e), _mm256_loadu_ps(bias + e)));
    }
  }
#endif
  for (; e < n; ++e) out[e] = static_cast<scalar_t>((s[e] - mu) * rs * w[e] + bias[e]);
  return {mu, rs};
}

// LayerNorm backward of one flat row s [n] with its forward's mean and rstd: with xhat = (s - mean)
// rstd and gh = g w, grad_s = rstd (gh - mean(gh) - xhat mean(gh xhat)); grad_w += g xhat and
// grad_b += g accumulate over the rows a task owns. xhat and gh are [n] scratch.
template <typename scalar_t>
void layer_norm_row_backward(const float* s, const scalar_t* g, const float* w, float mu, float rs, int64_t n,
                             float* xhat, float* gh, float* grad_w, float* grad_b, float* grad_s) {
  float c1 = 0.f, c2 = 0.f;
  int64_t e = 0;
#if defined(__AVX2__) && defined(__FMA__)
  {
    const __m256 vmu = _mm256_set1_ps(mu), vrs = _mm256_set1_ps(rs);
    __m256 a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    for (; e + 8 <= n; e += 8) {
      const __m256 gv = load8(g + e);
      const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + e), vmu), vrs);
      const __m256 hv = _mm256_mul_ps(gv, _mm256_loadu_ps(w + e));
      _mm256_storeu_ps(xhat + e, xh);
      _mm256_storeu_ps(gh + e, hv);
      _mm256_storeu_ps(grad_w + e, _mm256_fmadd_ps(gv, xh, _mm256_loadu_ps(grad_w + e)));
      _mm256_storeu_ps(grad_b + e, _mm256_add_ps(_mm256_loadu_ps(grad_b + e), gv));
      a1 = _mm256_add_ps(a1, hv);
      a2 = _mm256_fmadd_ps(hv, xh, a2);
    }
    c1 = hsum8(a1);
    c2 = hsum8(a2);
  }
#endif
  for (; e < n; ++e) {
    const float gv = static_cast<float>(g[e]);
    xhat[e] = (s[e] - mu) * rs;
    gh[e] = gv * w[e];
    grad_w[e] += gv * xhat[e];
    grad_b[e] += gv;
    c1 += gh[e];
    c2 += gh[e] * xhat[e];
  }
  c1 /= n;
  c2 /= n;
  e = 0;
#if defined(__AVX2__) && defined(__FMA__)
  {
    const __m256 vrs = _mm256_set1_ps(rs), vc1 = _mm256_set1_ps(c1), vc2 = _mm256_set1_ps(c2);
    for (; e + 8 <= n; e += 8) {
      const __m256 t = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(gh + e), vc1),
                                     _mm256_mul_ps(_mm256_loadu_ps(xhat + e), vc2));
      _mm256_storeu_ps(grad_s + e, _mm256_mul_ps(vrs, t));
    }
  }
#endif
  for (; e < n; ++e) grad_s[e] = rs * (gh[e] - c1 - xhat[e] * c2);
}

// LayerNorm of `rows` rows of n floats at once (feature_mix_norm's O rows of D per sample): rows
// s (stride ld >= round_up(n, 8), the columns past n readable) -> out (stride n), mean and rstd
// per row. One row at a time (layer_norm_row) is a chain of dependent reductions, two horizontal
// sums and a square root per row of only D = 32 floats: it was two thirds of the feature_mix_norm
// forward at the GEM model's shape. Here eight rows go together: their partial sums meet in one
// transposing reduction (hsum8x8) and one vector square root serves all eight.
#if defined(__AVX2__) && defined(__FMA__)
// Lane i = the sum of the eight lanes of v[i].
inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// All ones in lanes < rem.
inline __m256 lanes_below(int64_t rem) {
  return _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

template <typename scalar_t>
inline void store8(scalar_t* p, __m256 v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm256_storeu_ps(p, v);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    for (int i = 0; i < 8; ++i) p[i] = static_cast<scalar_t>(t[i]);
  }
}
#endif

template <typename scalar_t>
void layer_norm_rows(const float* s, int64_t rows, int64_t n, int64_t ld, const float* w, const float* bias,
                     float eps, scalar_t* out, float* mean, float* rstd) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t full = n / 8 * 8;
  const __m256 tail = lanes_below(n - full), inv_n = _mm256_set1_ps(1.f / n);
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t nr = std::min<int64_t>(8, rows - r0);
    __m256 acc[8];
    for (int64_t r = 0; r < 8; ++r) {
      __m256 a = _mm256_setzero_ps();
      const float* row = s + (r0 + r) * ld;
      if (r < nr) {
        for (int64_t e = 0; e < full; e += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(row + e));
        if (full < n) a = _mm256_add_ps(a, _mm256_and_ps(_mm256_loadu_ps(row + full), tail));
      }
      acc[r] = a;
    }
    alignas(32) float mu[8], rs[8];
    _mm256_store_ps(mu, _mm256_mul_ps(hsum8x8(acc), inv_n));
    for (int64_t r = 0; r < 8; ++r) {
      __m256 a = _mm256_setzero_ps();
      const float* row = s + (r0 + r) * ld;
      if (r < nr) {
        const __m256 m = _mm256_set1_ps(mu[r]);
        for (int64_t e = 0; e < full; e += 8) {
          const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(row + e), m);
          a = _mm256_fmadd_ps(c, c, a);
        }
        if (full < n) {
          const __m256 c = _mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(row + full), m), tail);
          a = _mm256_fmadd_ps(c, c, a);
        }
      }
      acc[r] = a;
    }
    const __m256 var = _mm256_fmadd_ps(hsum8x8(acc), inv_n, _mm256_set1_ps(eps));
    _mm256_store_ps(rs, _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_sqrt_ps(var)));
    for (int64_t r = 0; r < nr; ++r) {
      const float* row = s + (r0 + r) * ld;
      scalar_t* o = out + (r0 + r) * n;
      mean[r0 + r] = mu[r];
      rstd[r0 + r] = rs[r];
      const __m256 m = _mm256_set1_ps(mu[r]), v = _mm256_set1_ps(rs[r]);
      for (int64_t e = 0; e < full; e += 8) {
        const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + e), m), v);
        store8(o + e, _mm256_fmadd_ps(xh, _mm256_loadu_ps(w + e), _mm256_loadu_ps(bias + e)));
      }
      for (int64_t e = full; e < n; ++e) o[e] = static_cast<scalar_t>((row[e] - mu[r]) * rs[r] * w[e] + bias[e]);
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r)
    std::tie(mean[r], rstd[r]) = layer_norm_row(s + r * ld, n, w, bias, eps, out + r * n);
#endif
}

// The backward of layer_norm_rows, eight rows together for the same reason: rows s (stride ld, as
// in the forward), g (stride n) -> grad_s (stride ld; columns past n untouched); grad_w += g xhat
// and grad_b += g. Per row, with xhat = (s - mean) rstd and gh = g w:
// grad_s = rstd (gh - mean(gh) - xhat mean(gh xhat)). xhat and gh are recomputed in the second pass
// (two loads and four operations per element instead of two stores and two loads).
template <typename scalar_t>
void layer_norm_rows_backward(const float* s, int64_t ld, const scalar_t* g, const float* w, const float* mean,
                              const float* rstd, int64_t rows, int64_t n, float* grad_w, float* grad_b,
                              float* grad_s) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t full = n / 8 * 8;
  const float inv_n = 1.f / n;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t nr = std::min<int64_t>(8, rows - r0);
    __m256 a1[8], a2[8];
    // The scalar tails' parts of the two sums, and their g w kept as rounded: the second pass
    // recomputing g w - mean(g w) would let the compiler contract it into one FMA, whose unrounded
    // product leaves a rounding error where D = 1 must give exactly 0 (times rstd = 1/sqrt(eps)).
    float t1[8] = {}, t2[8] = {}, gh_tail[8][8];
    for (int64_t r = 0; r < 8; ++r) {
      __m256 h = _mm256_setzero_ps(), hx = _mm256_setzero_ps();
      if (r < nr) {
        const float* row = s + (r0 + r) * ld;
        const scalar_t* gr = g + (r0 + r) * n;
        const float mu = mean[r0 + r], rs = rstd[r0 + r];
        const __m256 m = _mm256_set1_ps(mu), v = _mm256_set1_ps(rs);
        for (int64_t e = 0; e < full; e += 8) {
          const __m256 gv = load8(gr + e);
          const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + e), m), v);
          const __m256 hv = _mm256_mul_ps(gv, _mm256_loadu_ps(w + e));
          _mm256_storeu_ps(grad_w + e, _mm256_fmadd_ps(gv, xh, _mm256_loadu_ps(grad_w + e)));
          _mm256_storeu_ps(grad_b + e, _mm256_add_ps(_mm256_loadu_ps(grad_b + e), gv));
          h = _mm256_add_ps(h, hv);
          hx = _mm256_fmadd_ps(hv, xh, hx);
        }
        for (int64_t e = full; e < n; ++e) {
          const float gv = static_cast<float>(gr[e]), xh = (row[e] - mu) * rs, hv = gv * w[e];
          grad_w[e] += gv * xh;
          grad_b[e] += gv;
          gh_tail[r][e - full] = hv;
          t1[r] += hv;
          t2[r] += hv * xh;
        }
      }
      a1[r] = h;
      a2[r] = hx;
    }
    alignas(32) float c1[8], c2[8];
    _mm256_store_ps(c1, _mm256_mul_ps(_mm256_add_ps(hsum8x8(a1), _mm256_loadu_ps(t1)), _mm256_set1_ps(inv_n)));
    _mm256_store_ps(c2, _mm256_mul_ps(_mm256_add_ps(hsum8x8(a2), _mm256_loadu_ps(t2)), _mm256_set1_ps(inv_n)));
    for (int64_t r = 0; r < nr; ++r) {
      const float* row = s + (r0 + r) * ld;
      const scalar_t* gr = g + (r0 + r) * n;
      float* ds = grad_s + (r0 + r) * ld;
      const float mu = mean[r0 + r], rs = rstd[r0 + r];
      const __m256 m = _mm256_set1_ps(mu), v = _mm256_set1_ps(rs), vc1 = _mm256_set1_ps(c1[r]),
                   vc2 = _mm256_set1_ps(c2[r]);
      for (int64_t e = 0; e < full; e += 8) {
        const __m256 xh = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + e), m), v);
        const __m256 hv = _mm256_mul_ps(load8(gr + e), _mm256_loadu_ps(w + e));
        _mm256_storeu_ps(ds + e, _mm256_mul_ps(v, _mm256_fnmadd_ps(xh, vc2, _mm256_sub_ps(hv, vc1))));
      }
      for (int64_t e = full; e < n; ++e) ds[e] = rs * (gh_tail[r][e - full] - c1[r] - (row[e] - mu) * rs * c2[r]);
    }
  }
#else
  std::vector<float> xhat(n), gh(n);
  for (int64_t r = 0; r < rows; ++r)
    layer_norm_row_backward(s + r * ld, g + r * n, w, mean[r], rstd[r], n, xhat.data(), gh.data(), grad_w, grad_b,
                            grad_s + r * ld);
#endif
}

// One sample's [F, D] rows from a [Fp, ld] fp32 tile into dst (row stride D). fp32 output goes out
// with copy_bytes, streaming when `stream` (an output the cache cannot keep anyway).
template <typename scalar_t>
void store_sample(const float* src, int64_t F, int64_t D, int64_t ld, scalar_t* dst, bool stream) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (D == ld) {
      copy_bytes(dst, src, F * D * sizeof(float), stream);
    } else {
      for (int64_t r = 0; r < F; ++r) copy_bytes(dst + r * D, src + r * ld, D * sizeof(float), stream);
    }
  } else {
    store_rows(src, F, D, ld, dst);
  }
}

struct MixDims {
  int64_t B, F, D, O, Ofm, Op, Dp, Fp, Fq;
};

MixDims mix_dims(const at::Tensor& x, const at::Tensor& mix, const at::Tensor& fm) {
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2), O = mix.size(0);
  return {B, F, D, O, fm.size(1), round_up(O, kRows), round_up(std::max<int64_t>(D, 1), kCols), round_up(F, kRows),
          round_up(F, kCols)};
}

#if defined(__AVX2__) && defined(__FMA__)
// The D = 32 row kernels (interaction_rows32.inc) on 8 lanes (AVX2) and on 16 (AVX-512F, a target
// pragma around its namespace: run only where cpu_has_avx512f()). Each namespace defines the vector
// primitives the file is written in.
namespace v8 {
using vec = __m256;
constexpr int kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
inline vec vhsum_bcast(vec v) { return hsum_bcast(v); }
inline float vfirst(vec v) { return _mm256_cvtss_f32(v); }
template <typename T>
inline vec vload_as(const T* p) { return load8(p); }
template <typename T>
inline void vstore_as(T* p, vec v) { store8(p, v); }
// 8 lanes with the same sum as v's.
inline __m256 vfold(vec v) { return v; }
// cross32's accumulator block: 4 x 2 of the 16 ymm registers.
constexpr int kCrossA = 4, kCrossB = 2;
#include "interaction_rows32.inc"
}  // namespace v8

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
namespace v16 {
using vec = __m512;
constexpr int kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline vec vhsum_bcast(vec v) { return _mm512_set1_ps(_mm512_reduce_add_ps(v)); }
inline float vfirst(vec v) { return _mm512_cvtss_f32(v); }
// fp16 / bf16 rows go through load8 / store8's conversions, eight lanes at a time (AVX-512F has no
// bf16 conversion of its own).
template <typename T>
inline vec vload_as(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m512d lo = _mm512_castps_pd(_mm512_castps256_ps512(load8(p)));
    return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(load8(p + 8)), 1));
  }
}
template <typename T>
inline void vstore_as(T* p, vec v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else {
    store8(p, _mm512_castps512_ps256(v));
    store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
}
inline __m256 vfold(vec v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
// cross32's accumulator block: 4 x 4 of the 32 zmm registers.
constexpr int kCrossA = 4, kCrossB = 4;
#include "interaction_rows32.inc"
}  // namespace v16
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// cross32 on the lanes this CPU runs.
inline void cross32(bool wide, const float* a, int64_t as, int64_t na, const float* b, int64_t bs, int64_t nb,
                    int64_t n, float* out, int64_t ld) {
  if (wide)
    v16::cross32(a, as, na, b, bs, nb, n, out, ld);
  else
    v8::cross32(a, as, na, b, bs, nb, n, out, ld);
}

// The fp32 rows of X from sample `first` on, as cross32 reads them: fp32 X in place, other dtypes the
// chunk's converted copy xsc.
template <typename scalar_t>
inline const float* chunk_rows32(const scalar_t* xp, int64_t first, int64_t F, const float* xsc) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return xp + first * F * kRow32;
  } else {
    return xsc;
  }
}

// Runs backward(out) for one sample's grad_X [F, 32]: out is its place in the output, or the dx
// scratch when the output streams (then written out as whole rows by store_sample).
template <typename scalar_t, typename Backward>
inline void grad_x_rows32(bool stream, float* dx, int64_t F, int64_t ld, scalar_t* dst, const Backward& backward) {
  if (stream) {
    backward(dx);
    store_sample(dx, F, kRow32, ld, dst, stream);
  } else {
    backward(dst);
  }
}
#endif

FmDims fm_dims(const at::Tensor& x, const at::Tensor& y) {
  const int64_t B = x.size(0), F = x.size(1), D = x.size(2), k = y.size(1);
  // kq: k columns padded to 8, not to a whole 16-wide tile (combine_rows takes ld = 16 j + 8): at the
  // GEM model's rank 8 a 16-wide S = X A and grad_Y were half padding.
  return {B, F, D, k, round_up(F, kRows), round_up(std::max<int64_t>(D, 1), kCols), round_up(k, kRows),
          round_up(k, kCols / 2)};
}

#if defined(__AVX2__) && defined(__FMA__)
// The shape fm_sample32 and fm_backward_sample32 take.
inline bool fm_rows32(const FmDims& d) { return d.D == kRow32 && d.k == 8; }
#endif

// How many samples ahead the D = 32 fm_compress backward asks for X, grad_out and the products
// (prefetch_rows: prefetcht1, into L2). At the model's call these come from memory (header, "At the
// model's call"); measured there (B = 1113, 32 input sets, 1 thread, CPU time, one build with the
// distance from the environment, 3-4 alternating rounds) against no prefetch: 1 ahead 0.81-0.88x at
// F = 10 and 0.91-0.92x at F = 16; 2 ahead 0.84-0.90x and 0.91-1.00x; 3 ahead 0.87-1.00x and
// 0.93-1.00x; 4 ahead into L1 (prefetcht0) 0.91-1.01x.
constexpr int64_t kFmBackwardAhead = 1;

// The (X^T Y)^T [k, D] and S [F, k] of one sample as `products` stores them: one fp32 row per sample.
inline int64_t products_row(const FmDims& d) { return d.k * d.D + d.F * d.k; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fm_compress_cpu(
    const at::Tensor& x, const at::Tensor& y, const at::Tensor& ln_weight, const at::Tensor& ln_bias, double eps,
    bool save_products) {
  GK_CHECK_CPU(x);
  interaction_checks::fm_compress(x, y, ln_weight, ln_bias);
  const FmDims d = fm_dims(x, y);
  const int64_t n = d.F * d.k;
  auto out = at::empty({d.B, n}, x.options());
  auto mean = at::empty({d.B}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({d.B}, x.options().dtype(at::kFloat));
  auto products = at::empty({save_products ? d.B : 0, products_row(d)}, x.options().dtype(at::kFloat));
  if (d.B == 0) return {out, mean, rstd, products};
  const std::vector<float> yt = fp32_padded(y, d.kp, /*transposed=*/true);
  const at::Tensor w32 = as_fp32(ln_weight), b32 = as_fp32(ln_bias);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fm_compress_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const float *ytp = yt.data(), *wp = w32.data_ptr<float>(), *bp = b32.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    float *mp = mean.data_ptr<float>(), *rp = rstd.data_ptr<float>();
    float* pp = save_products ? products.data_ptr<float>() : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
    const bool wide = cpu_has_avx512f();
#endif
    const int64_t workers = workers_for(d.B, 4 * d.F * d.D * d.k);
    parallel_ranges(d.B, claim_size(d.B, kClaimSamples, workers), workers, [&](auto& claim) {
      FmScratch w(d, d.kp);
      for (int64_t begin, end; claim(begin, end);)
      for (int64_t b = begin; b < end; ++b) {
        if (b + 1 < end) prefetch_rows(xp + (b + 1) * d.F * d.D, d.F * d.D);
#if defined(__AVX2__) && defined(__FMA__)
        if (fm_rows32(d)) {
          // At and S straight into the products row when the backward will read them.
          float* at = pp ? pp + b * products_row(d) : w.at.data();
          float* s = pp ? at + d.k * d.D : w.sf.data();
          const float* xr = rows32_of(xp + b * d.F * d.D, d.F, w.xs.data());
          if (wide)
            v16::fm_sample32(d.F, xr, ytp, at, s);
          else
            v8::fm_sample32(d.F, xr, ytp, at, s);
          std::tie(mp[b], rp[b]) = layer_norm_row(s, n, wp, bp, static_cast<float>(eps), op + b * n);
          continue;
        }
#endif
        fm_sample(d, xp + b * d.F * d.D, ytp, w);
        if (pp) {
          float* pb = pp + b * products_row(d);
          copy_rows(w.at.data(), d.k, d.D, d.Dp, pb, d.D);
          copy_rows(w.sf.data(), 1, n, n, pb + d.k * d.D, n);
        }
        std::tie(mp[b], rp[b]) = layer_norm_row(w.sf.data(), n, wp, bp, static_cast<float>(eps), op + b * n);
      }
    });
  });
  return {out, mean, rstd, products};
}

// grad_x rows of one sample added to dst (fm_compress_backward_accumulate): each value rounded to
// scalar_t first, then added in fp32 and rounded again, as at::add_ of the two scalar_t gradients
// does, so the sum has the bits of the engine's add.
template <typename scalar_t>
void accumulate_sample(const float* src, int64_t F, int64_t D, int64_t ld, scalar_t* dst) {
  for (int64_t r = 0; r < F; ++r) {
#pragma omp simd
    for (int64_t c = 0; c < D; ++c)
      dst[r * D + c] = static_cast<scalar_t>(static_cast<float>(dst[r * D + c]) +
                                             static_cast<float>(static_cast<scalar_t>(src[r * ld + c])));
  }
}

// fm_compress's backward into grad_x: written (accumulate false, grad_x fresh) or added to what it
// holds (accumulate true: Wukong's x gradient from feature_mix_norm, so x's two gradients are one
// write instead of two writes and the engine's add pass).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fm_compress_backward_into(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& y, const at::Tensor& ln_weight,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& products, at::Tensor& grad_x,
    bool accumulate) {
  const FmDims d = fm_dims(x, y);
  const int64_t n = d.F * d.k;
  const bool saved = products.numel() > 0;
  TORCH_CHECK(!saved || (products.scalar_type() == at::kFloat && products.is_contiguous() && products.dim() == 2 &&
                         products.size(0) == d.B && products.size(1) == products_row(d)),
              "products must be empty or contiguous fp32 [B, k*D + F*k]");
  // grad_x goes out while X, grad_out and the products come in: past the cache's size none of it
  // is still there for the next op, so grad_x skips the read-for-ownership of normal stores (not
  // when accumulating: grad_x is read).
  const bool stream = !accumulate &&
                      use_streaming_stores(grad_x.nbytes() + x.nbytes() + grad_out.nbytes() + products.nbytes());
  const int64_t chunks = sum_chunks(d.B);
  // Per-chunk fp32 partials of grad_y [Fp, kq], grad_w [n], grad_b [n].
  std::vector<float> part_y(chunks * d.Fp * d.kq, 0.f), part_wb(chunks * 2 * n, 0.f);
  if (d.B > 0) {
    const std::vector<float> yt = fp32_padded(y, d.kp, /*transposed=*/true);
    const at::Tensor w32 = as_fp32(ln_weight), y32 = as_fp32(y);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fm_compress_backward_cpu", [&] {
      const float* y32p = y32.data_ptr<float>();
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* gp = grad_out.data_ptr<scalar_t>();
      const float *ytp = yt.data(), *wp = w32.data_ptr<float>();
      const float *mp = mean.data_ptr<float>(), *rp = rstd.data_ptr<float>();
      const float* pp = saved ? products.data_ptr<float>() : nullptr;
      scalar_t* dxp = grad_x.data_ptr<scalar_t>();
      const int64_t workers = workers_for(d.B, 8 * d.F * d.D * d.k);
      parallel_ranges(chunks, claim_size(chunks, kClaimSamples / kSumChunk, workers), workers, [&](auto& claim) {
        FmScratch w(d, 2 * d.kp);
        float* dat = w.at.data() + d.kp * d.Dp;  // grad_A^T [kp, Dp]
        // [grad_S | Y] [Fp, 2 kp]: the grad_S half is rewritten per sample, Y is fixed.
        std::vector<float> xhat(n), gh(n), ds(n), dsy(d.Fp * 2 * d.kp, 0.f), dx(d.Fp * d.Dp), da(d.D * d.kq, 0.f);
        for (int64_t f = 0; f < d.F; ++f)
          for (int64_t j = 0; j < d.k; ++j) dsy[f * 2 * d.kp + d.kp + j] = static_cast<float>(ytp[j * d.F + f]);
#if defined(__AVX2__) && defined(__FMA__)
        const bool wide = cpu_has_avx512f();
        // A chunk's grad_At [8, 32] per sample, and its X as fp32 rows when X is not fp32 (cross32 reads both).
        const int64_t most = (d.B + chunks - 1) / chunks;
        std::vector<float> gatc(fm_rows32(d) ? most * 8 * kRow32 : 0);
        std::vector<float> xsc(fm_rows32(d) && !std::is_same_v<scalar_t, float> ? most * d.F * kRow32 : 0);
#endif
        for (int64_t cb, ce; claim(cb, ce);)
        for (int64_t c = cb; c < ce; ++c) {
          float* gy = part_y.data() + c * d.Fp * d.kq;
          float* gw = part_wb.data() + c * 2 * n;
          const int64_t last = (c + 1) * d.B / chunks;
#if defined(__AVX2__) && defined(__FMA__)
          if (fm_rows32(d)) {
            const int64_t first = c * d.B / chunks;
            for (int64_t b = first; b < last; ++b) {
              if (b + kFmBackwardAhead < d.B) {
                const int64_t q = b + kFmBackwardAhead;
                prefetch_rows(xp + q * d.F * d.D, d.F * d.D);
                prefetch_rows(gp + q * n, n);
                if (saved) prefetch_rows(pp + q * products_row(d), products_row(d));
              }
              const float* xr = rows32_of(xp + b * d.F * d.D, d.F, xsc.data() + (b - first) * d.F * kRow32);
              float* gat = gatc.data() + (b - first) * 8 * kRow32;
              const float *at = w.at.data(), *s = w.sf.data();
              if (saved) {
                at = pp + b * products_row(d);
                s = at + d.k * d.D;
              } else if (wide) {
                v16::fm_sample32(d.F, xr, ytp, w.at.data(), w.sf.data());
              } else {
                v8::fm_sample32(d.F, xr, ytp, w.at.data(), w.sf.data());
              }
              layer_norm_row_backward(s, gp + b * n, wp, mp[b], rp[b], n, xhat.data(), gh.data(), gw, gw + n,
                                      ds.data());
              const auto backward = [&](auto* out) {
                if (wide)
                  v16::fm_backward_sample32(d.F, xr, y32p, at, ds.data(), gat, out);
                else
                  v8::fm_backward_sample32(d.F, xr, y32p, at, ds.data(), gat, out);
              };
              if (accumulate) {
                backward(dx.data());
                accumulate_sample(dx.data(), d.F, kRow32, d.Dp, dxp + b * d.F * d.D);
              } else {
                grad_x_rows32(stream, dx.data(), d.F, d.Dp, dxp + b * d.F * d.D, backward);
              }
            }
            cross32(wide, chunk_rows32(xp, first, d.F, xsc.data()), d.F * kRow32, d.F, gatc.data(), 8 * kRow32, 8,
                    last - first, gy, d.kq);
            continue;
          }
#endif
          for (int64_t b = c * d.B / chunks; b < last; ++b) {
            if (b + 1 < last) {
              prefetch_rows(xp + (b + 1) * d.F * d.D, d.F * d.D);
              prefetch_rows(gp + (b + 1) * n, n);
              if (saved) prefetch_rows(pp + (b + 1) * products_row(d), products_row(d));
            }
            const float* s = w.sf.data();
            if (saved) {
              // The forward's (X^T Y)^T and S: only X is reloaded (4*F*D*k FLOPs saved per sample).
              const float* pb = pp + b * products_row(d);
              load_padded(xp + b * d.F * d.D, d.F, d.D, w.xs.data(), d.Fp, d.Dp);
              copy_rows(pb, d.k, d.D, d.D, w.at.data(), d.Dp);
              s = pb + d.k * d.D;
            } else {
              fm_sample(d, xp + b * d.F * d.D, ytp, w);
            }
            layer_norm_row_backward(s, gp + b * n, wp, mp[b], rp[b], n, xhat.data(), gh.data(), gw, gw + n,
                                    ds.data());
            copy_rows(ds.data(), d.F, d.k, d.k, dsy.data(), 2 * d.kp);
            // grad_A^T = (X^T dS)^T [kp, Dp]; grad_X = dS A^T + Y grad_A^T; grad_Y += X grad_A.
            // grad_A^T = grad_S^T X: grad_S read transposed in place (columns k..kp of its half are 0).
            combine_rows(dsy.data(), d.kp, d.F, 1, w.xs.data(), d.Dp, dat, false, false, 2 * d.kp);
            combine_rows(dsy.data(), d.Fp, 2 * d.kp, 2 * d.kp, w.at.data(), d.Dp, dx.data(), false);
            if (accumulate)
              accumulate_sample(dx.data(), d.F, d.D, d.Dp, dxp + b * d.F * d.D);
            else
              store_sample(dx.data(), d.F, d.D, d.Dp, dxp + b * d.F * d.D, stream);
            transpose(dat, d.k, d.D, d.Dp, da.data(), d.kq);
            combine_rows(w.xs.data(), d.Fp, d.D, d.Dp, da.data(), d.kq, gy, true);
          }
        }
        streaming_store_fence();
      });
    });
  }
  auto grad_y = sum_chunk_partials(part_y.data(), chunks, d.Fp, d.kq, 0, d.F, d.k, false, x.scalar_type());
  auto grad_w = sum_chunk_partials(part_wb.data(), chunks, 2, n, 0, 1, n, true, x.scalar_type());
  auto grad_b = sum_chunk_partials(part_wb.data(), chunks, 2, n, 1, 1, n, true, x.scalar_type());
  return {grad_y, grad_w, grad_b};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fm_compress_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& y, const at::Tensor& ln_weight,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& products) {
  GK_CHECK_CPU(x);
  interaction_checks::fm_compress_backward(grad_out, x, y, ln_weight, mean, rstd);
  auto grad_x = at::empty_like(x);
  auto [grad_y, grad_w, grad_b] =
      fm_compress_backward_into(grad_out, x, y, ln_weight, mean, rstd, products, grad_x, /*accumulate=*/false);
  return {grad_x, grad_y, grad_w, grad_b};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fm_compress_backward_accumulate_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& y, const at::Tensor& ln_weight,
    const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& products, at::Tensor& grad_x) {
  GK_CHECK_CPU(x);
  interaction_checks::fm_compress_backward(grad_out, x, y, ln_weight, mean, rstd);
  TORCH_CHECK_VALUE(grad_x.device() == x.device() && grad_x.scalar_type() == x.scalar_type() &&
                        grad_x.sizes() == x.sizes() && grad_x.is_contiguous(),
                    "grad_x must be a contiguous tensor of x's shape ", x.sizes(), ", dtype and device, got ",
                    grad_x.sizes(), " ", grad_x.scalar_type(), (grad_x.is_contiguous() ? "" : " non-contiguous"));
  return fm_compress_backward_into(grad_out, x, y, ln_weight, mean, rstd, products, grad_x, /*accumulate=*/true);
}

// ------------------------------------------------------------------------------------------------
// feature_mix_norm: S = M X_b [O, D] per sample, fm_b added to its first O_fm rows, then each row
// layer-normed over D. Eager runs a broadcast bmm (whose backward is two more, with a [B, O, F]
// intermediate summed over the batch), a pad, an add and a LayerNorm; here one sample's X, S and
// grad_S stay in L1/L2 and X, fm and grad_out stream through once per pass.
// FLOPs: forward 2*B*O*F*D (+ ~8*B*O*D LayerNorm); backward 6*B*O*F*D (S again, grad_X = M^T grad_S,
// grad_M += grad_S X^T). Bytes: forward (B*F*D + B*O_fm*D + B*O*D)*s; backward twice the inputs'.
// ------------------------------------------------------------------------------------------------

// S [Op, Dp] = M X_b plus fm_b on rows < O_fm; returns X_b as the fp32 [F, Dp] rows the products read
// (fp32 X with D a multiple of 16 in place, else converted into xs). mp is M fp32 [Op, F].
template <typename scalar_t>
const float* mix_sample(const MixDims& d, const scalar_t* xb, const scalar_t* fmb, const float* mp, float* xs,
                        float* s) {
  const float* xr = xs;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (d.D == d.Dp) xr = xb;
  }
  if (xr == xs) load_padded(xb, d.F, d.D, xs, d.F, d.Dp);
  combine_rows(mp, d.Op, d.F, d.F, xr, d.Dp, s, false);
  for (int64_t o = 0; o < d.Ofm; ++o) {
    float* row = s + o * d.Dp;
    const scalar_t* f = fmb + o * d.D;
#pragma omp simd
    for (int64_t c = 0; c < d.D; ++c) row[c] += static_cast<float>(f[c]);
  }
  return xr;
}


std::tuple<at::Tensor, at::Tensor, at::Tensor> feature_mix_norm_cpu(const at::Tensor& x, const at::Tensor& mix,
                                                                    const at::Tensor& fm, const at::Tensor& ln_weight,
                                                                    const at::Tensor& ln_bias, double eps) {
  GK_CHECK_CPU(x);
  interaction_checks::feature_mix_norm(x, mix, fm, ln_weight, ln_bias);
  const MixDims d = mix_dims(x, mix, fm);
  auto out = at::empty({d.B, d.O, d.D}, x.options());
  auto mean = at::empty({d.B, d.O}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({d.B, d.O}, x.options().dtype(at::kFloat));
  if (d.B == 0) return {out, mean, rstd};
  const std::vector<float> m32 = fp32_padded(mix, d.Op, /*transposed=*/false);
  const at::Tensor w32 = as_fp32(ln_weight), b32 = as_fp32(ln_bias);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "feature_mix_norm_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* fp = d.Ofm ? fm.data_ptr<scalar_t>() : nullptr;
    const float *mp = m32.data(), *wp = w32.data_ptr<float>(), *bp = b32.data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    float *meanp = mean.data_ptr<float>(), *rstdp = rstd.data_ptr<float>();
    const int64_t workers = workers_for(d.B, 2 * d.O * d.F * d.D);
    parallel_ranges(d.B, claim_size(d.B, kClaimSamples, workers), workers, [&](auto& claim) {
      std::vector<float> xs(d.F * d.Dp), s(d.Op * d.Dp);
#if defined(__AVX2__) && defined(__FMA__)
      std::vector<float> ssq(round_up(d.O, 8), 0.f), rs(round_up(d.O, 8));
      const bool wide = cpu_has_avx512f();
#endif
      for (int64_t begin, end; claim(begin, end);)
      for (int64_t b = begin; b < end; ++b) {
#if defined(__AVX2__) && defined(__FMA__)
        if (d.D == kRow32) {
          // The AVX2 rows (2-row blocks) keep main's burst: spread, 1.04x slower at F = 10 (header).
          RowsAhead ahead;
          if (wide && b + kSpreadAhead < end) {
            ahead.add(xp + (b + kSpreadAhead) * d.F * d.D, d.F * d.D);
            if (fp) ahead.add(fp + (b + kSpreadAhead) * d.Ofm * d.D, d.Ofm * d.D);
          } else if (!wide && b + 1 < end) {
            prefetch_rows(xp + (b + 1) * d.F * d.D, d.F * d.D);
            if (fp) prefetch_rows(fp + (b + 1) * d.Ofm * d.D, d.Ofm * d.D);
          }
          const float* xr = rows32_of(xp + b * d.F * d.D, d.F, xs.data());
          const scalar_t* fmb = fp ? fp + b * d.Ofm * d.D : fp;
          if (wide)
            v16::mix_norm_sample32(d, mp, xr, fmb, wp, bp, static_cast<float>(eps), s.data(), ssq.data(), rs.data(),
                                   op + b * d.O * d.D, meanp + b * d.O, rstdp + b * d.O, ahead);
          else
            v8::mix_norm_sample32(d, mp, xr, fmb, wp, bp, static_cast<float>(eps), s.data(), ssq.data(), rs.data(),
                                  op + b * d.O * d.D, meanp + b * d.O, rstdp + b * d.O, ahead);
          continue;
        }
#endif
        if (b + 1 < end) {
          prefetch_rows(xp + (b + 1) * d.F * d.D, d.F * d.D);
          if (fp) prefetch_rows(fp + (b + 1) * d.Ofm * d.D, d.Ofm * d.D);
        }
        mix_sample(d, xp + b * d.F * d.D, fp ? fp + b * d.Ofm * d.D : fp, mp, xs.data(), s.data());
        layer_norm_rows(s.data(), d.O, d.D, d.Dp, wp, bp, static_cast<float>(eps), op + b * d.O * d.D,
                        meanp + b * d.O, rstdp + b * d.O);
      }
    });
  });
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feature_mix_norm_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mix, const at::Tensor& fm,
    const at::Tensor& ln_weight, const at::Tensor& mean, const at::Tensor& rstd) {
  GK_CHECK_CPU(x);
  interaction_checks::feature_mix_norm_backward(grad_out, x, mix, fm, ln_weight, mean, rstd);
  const MixDims d = mix_dims(x, mix, fm);
  auto grad_x = at::empty_like(x);
  auto grad_fm = at::empty_like(fm);
  const bool stream = use_streaming_stores(grad_x.nbytes() + x.nbytes() + grad_out.nbytes() + fm.nbytes());
  const int64_t chunks = sum_chunks(d.B);
  // Per-chunk fp32 partials of grad_M [Op, Fq], grad_w [D] and grad_b [D].
  std::vector<float> part_m(chunks * d.Op * d.Fq, 0.f), part_wb(chunks * 2 * d.D, 0.f);
  if (d.B > 0) {
    const std::vector<float> m32 = fp32_padded(mix, d.Op, /*transposed=*/false);
    const std::vector<float> mt32 = fp32_padded(mix, d.Fp, /*transposed=*/true);  // M^T, zero rows past F
    const at::Tensor w32 = as_fp32(ln_weight);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "feature_mix_norm_backward_cpu", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* fp = d.Ofm ? fm.data_ptr<scalar_t>() : nullptr;
      const scalar_t* gp = grad_out.data_ptr<scalar_t>();
      const float *mp = m32.data(), *mtp = mt32.data(), *wp = w32.data_ptr<float>();
      const float *meanp = mean.data_ptr<float>(), *rstdp = rstd.data_ptr<float>();
      scalar_t* dxp = grad_x.data_ptr<scalar_t>();
      scalar_t* dfp = d.Ofm ? grad_fm.data_ptr<scalar_t>() : nullptr;
      const int64_t workers = workers_for(d.B, 6 * d.O * d.F * d.D);
      parallel_ranges(chunks, claim_size(chunks, kClaimSamples / kSumChunk, workers), workers, [&](auto& claim) {
        // grad_S [Op, Dp] and X^T [D, Fq] keep zero padding (rows past O, columns past F).
        std::vector<float> xs(d.F * d.Dp), s(d.Op * d.Dp), ds(d.Op * d.Dp, 0.f), dx(d.Fp * d.Dp),
            xt(d.D * d.Fq, 0.f);
#if defined(__AVX2__) && defined(__FMA__)
        const bool wide = cpu_has_avx512f();
        // A chunk's grad_S [O, 32] per sample, and its X as fp32 rows when X is not fp32 (cross32 reads both).
        const int64_t most = (d.B + chunks - 1) / chunks;
        std::vector<float> dsc(d.D == kRow32 ? most * d.O * kRow32 : 0);
        std::vector<float> xsc(d.D == kRow32 && !std::is_same_v<scalar_t, float> ? most * d.F * kRow32 : 0);
#endif
        for (int64_t cb, ce; claim(cb, ce);)
        for (int64_t c = cb; c < ce; ++c) {
          float* gm = part_m.data() + c * d.Op * d.Fq;
          float* gw = part_wb.data() + c * 2 * d.D;
          const int64_t last = (c + 1) * d.B / chunks;
#if defined(__AVX2__) && defined(__FMA__)
          if (d.D == kRow32) {
            const int64_t first = c * d.B / chunks;
            for (int64_t b = first; b < last; ++b) {
              RowsAhead ahead;
              if (b + kSpreadAhead < d.B) {
                ahead.add(xp + (b + kSpreadAhead) * d.F * d.D, d.F * d.D);
                ahead.add(gp + (b + kSpreadAhead) * d.O * d.D, d.O * d.D);
                if (fp) ahead.add(fp + (b + kSpreadAhead) * d.Ofm * d.D, d.Ofm * d.D);
              }
              const float* xr = rows32_of(xp + b * d.F * d.D, d.F, xsc.data() + (b - first) * d.F * kRow32);
              float* dsb = dsc.data() + (b - first) * d.O * kRow32;
              const scalar_t* fmb = fp ? fp + b * d.Ofm * d.D : fp;
              scalar_t* dfm = dfp ? dfp + b * d.Ofm * d.D : dfp;
              grad_x_rows32(stream, dx.data(), d.F, d.Dp, dxp + b * d.F * d.D, [&](auto* out) {
                if (wide)
                  v16::mix_backward_sample32(d, mp, xr, fmb, gp + b * d.O * d.D, wp, meanp + b * d.O,
                                             rstdp + b * d.O, gw, gw + d.D, dsb, dfm, out, ahead);
                else
                  v8::mix_backward_sample32(d, mp, xr, fmb, gp + b * d.O * d.D, wp, meanp + b * d.O,
                                            rstdp + b * d.O, gw, gw + d.D, dsb, dfm, out, ahead);
              });
            }
            cross32(wide, dsc.data(), d.O * kRow32, d.O, chunk_rows32(xp, first, d.F, xsc.data()), d.F * kRow32,
                    d.F, last - first, gm, d.Fq);
            continue;
          }
#endif
          for (int64_t b = c * d.B / chunks; b < last; ++b) {
            if (b + 1 < last) {
              prefetch_rows(xp + (b + 1) * d.F * d.D, d.F * d.D);
              prefetch_rows(gp + (b + 1) * d.O * d.D, d.O * d.D);
              if (fp) prefetch_rows(fp + (b + 1) * d.Ofm * d.D, d.Ofm * d.D);
            }
            const float* xr = mix_sample(d, xp + b * d.F * d.D, fp ? fp + b * d.Ofm * d.D : fp, mp, xs.data(),
                                         s.data());
            layer_norm_rows_backward(s.data(), d.Dp, gp + b * d.O * d.D, wp, meanp + b * d.O, rstdp + b * d.O, d.O,
                                     d.D, gw, gw + d.D, ds.data());
            if (dfp) store_rows(ds.data(), d.Ofm, d.D, d.Dp, dfp + b * d.Ofm * d.D);
            // grad_X = M^T grad_S [Fp, Dp]; grad_M += grad_S X^T [Op, Fq].
            combine_rows(mtp, d.Fp, d.O, d.O, ds.data(), d.Dp, dx.data(), false);
            store_sample(dx.data(), d.F, d.D, d.Dp, dxp + b * d.F * d.D, stream);
            transpose(xr, d.F, d.D, d.Dp, xt.data(), d.Fq);
            combine_rows(ds.data(), d.Op, d.D, d.Dp, xt.data(), d.Fq, gm, true);
          }
        }
        streaming_store_fence();
      });
    });
  }
  auto grad_mix = sum_chunk_partials(part_m.data(), chunks, d.Op, d.Fq, 0, d.O, d.F, false, x.scalar_type());
  auto grad_w = sum_chunk_partials(part_wb.data(), chunks, 2, d.D, 0, 1, d.D, true, x.scalar_type());
  auto grad_b = sum_chunk_partials(part_wb.data(), chunks, 2, d.D, 1, 1, d.D, true, x.scalar_type());
  return {grad_x, grad_mix, grad_fm, grad_w, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("dot_interaction_native", &dot_interaction_cpu);
  m.impl("dot_interaction_backward_native", &dot_interaction_backward_cpu);
  m.impl("cross_layer_native", &cross_layer_cpu);
  m.impl("cross_layer_backward_native", &cross_layer_backward_cpu);
  m.impl("fm_compress_native", &fm_compress_cpu);
  m.impl("fm_compress_backward_native", &fm_compress_backward_cpu);
  m.impl("fm_compress_backward_accumulate_native", &fm_compress_backward_accumulate_cpu);
  m.impl("feature_mix_norm_native", &feature_mix_norm_cpu);
  m.impl("feature_mix_norm_backward_native", &feature_mix_norm_backward_cpu);
}

}  // namespace gem_kernels
