// CPU kernels of the attention family: jagged attention (softmax and HSTU), forward and backward.
//
// Work decomposition: one work item is one (sequence, head) (a short HSTU sequence: all its heads,
// see attention_short.h); items are handed out longest first
// from an atomic counter to the at::parallel_for threads (dynamic scheduling: sequence lengths are
// skewed). An item walks flash-style tiles of kTileM queries x kTileN keys of its own sequence
// only (no padding work), with the online softmax in fp32: no [L, L] matrix exists, only a
// kTileM x kTileN score tile. A tile whose (i, j) ids make every pair invisible is skipped
// before any arithmetic; one whose pairs are all visible skips the per-element mask. The two tile
// products (Q K^T and P V; in the backward dO V^T, P^T dO, dS^T Q, dS K) run on the BLAS sgemm
// that libtorch links (MKL on x86). The softmax rows (max, exp and sum forward; exp and dS
// backward), the SiLU rows (weights forward; P and dS backward) and the time buckets run on AVX2
// (8 lanes, fast_exp8) where the build targets it, the exp and SiLU rows, the softmax row max and the
// time buckets of 32+ keys on AVX-512 (16 lanes, fast_exp16) where the CPU has it. Within a mixed
// tile of a banded mask (no contextual prefix, no targets:
// each query sees one contiguous run of keys, e.g. causal) a row touches only its run of columns,
// so the masked half of a diagonal tile costs no exp; a causal mask with a contextual prefix or
// targets (no window: the GEM model's) is a key prefix plus the query itself per row, handled the
// same way with the few keys between them zeroed, so no pair asks the visibility rule (measured on
// the small model's layer, 1 thread: HSTU fwd+bwd with both biases 26.3 -> 17.8 ms). The biases are
// added over a row's run only, and the products of such a mixed tile run in 32-row / 32-key strips
// bounded by the rows' runs (TileExtents), so a causal diagonal tile's products skip 3/8 of it.
// The Inf/NaN flags of the q, v and dO rows (the masked products' guard) and the softmax
// backward's delta = rowsum(dO * O) come from one contiguous sweep per tensor before the items (dO's
// flags and delta from the same one); the backward's k flags from each item's copy of its key rows.
// The backward walks key tiles outer, query tiles inner (FlashAttention-2), recomputing scores;
// an item's dq rows (each owned by one item) accumulate in its workspace over the key tiles, a key
// tile's dk and dv rows over the query tiles, and each row is written to the output once, whole
// (streamed for large outputs, kStreamRowsMinBytes; so is the forward's out), so no output is zero
// filled; bias gradients go to per-item partial buffers that are reduced in a fixed order: the
// backward is bit-identical run to run whatever the thread count or schedule.
//
// Where the time goes (bench's history 1024 case, softmax, 1 thread, perf): the sgemm products are
// ~75 % of the backward and ~60 % of the forward, and each runs at 90-100 % of MKL's 1-thread rate
// for its shape (256 x 256 x 128 full tiles 101-112 us, ~150-165 GFLOP/s); the rest is the exp and
// SiLU rows, the biases (HSTU), the Inf/NaN sweeps, the K/V row copies and the output writes, none
// above ~5 %. That case at 1 thread (2026-12-06, busy 2-core Xeon, medians of 5 interleaved rounds):
// softmax fwd 17.6 + bwd 40.0 ms = 100 GFLOP/s, 61 % of the 1-thread matmul peak (0.165 TFLOP/s);
// HSTU 19.7 + 47.7 ms = 86 GFLOP/s, 52 % (before the streamed rows and the merged sweeps: 57 % and 50 %).
// Measured and not kept (1 thread, interleaved A/B against the build before, 3 rounds): P^T dO and
// dS^T Q on transposed copies of P and dS (NN instead of transposed-A products: softmax backward
// 44.9 -> 47.7 ms; at the tiles' 1 KiB pitch MKL's transposed-A product is only ~10 % slower, 112
// vs 101 us, less than the two 256 x 256 transposes cost); kStrip = 128 (backward +3 %).
// Measured and not kept (2026-12-06 evening, 1 thread, CPU time, in-process on/off switch, 15 rounds,
// the 2-core Xeon shared with two helper sessions): a register-tiled AVX-512F softmax forward for
// unbiased causal/full items (8 query rows x 48 keys of scores in 24 zmm from Q K^T through the mask,
// the online softmax's max and exp to P; P V into the rows' output 32 columns at a time; K^T packed
// per item; query rows in 64-row super blocks sharing each key block; no sgemm call, no stored score
// tile). Softmax fwd, H = 4, D = 128, causal: L = 1024 75.6 vs 77.0 GFLOP/s (tile path), the bench's
// lengths [1024, 420, 435, 443] 70.4 vs 70.4. Its Q K^T loop alone runs at ~138 GFLOP/s (86 % of
// the core's FMA peak) from L1, but the whole kernel at ~87-94 standalone: the row softmax (two
// horizontal reductions and a scalar exp per row and key block), the output rows' reload and rescale
// per key block and the strided V rows take what MKL's packed products plus the row passes take here.
// Kept (2026-12-07, helper attnl9; the bench's 1024 case, 1 thread, CPU time, old and new builds in
// interleaved processes, the 2-core Xeon shared with two sessions at load 2-3.7): the softmax forward's
// 16-lane exp rows without the blends that cannot fire there (exp16_nonpositive: x - max <= 0), whole
// blocks unmasked and a masked tail, the row max on 16 lanes: softmax fwd 0.922x (8 rounds, 0.888-1.036;
// predicted ~0.97 from exp_shifted_sum16's 7 % of the forward in perf). The time-bias keys 16 at a time
// (time_bias_keys16): HSTU fwd 0.966x, bwd 0.996x (6 rounds, 0.86-1.05; predicted ~0.96 / ~0.97).
// Both against the session's start, 8 rounds: softmax fwd 16.19 vs 17.21 ms (0.927x), bwd 39.78 vs 40.43
// (0.988x: code unchanged, the noise), fwd+bwd 103 GFLOP/s = 62.5 % of the 1-thread peak (0.165
// TFLOP/s; was 60.7 %); HSTU fwd 18.77 vs 19.06 (0.963x), bwd 44.05 vs 45.61 (0.988x), 55.7 % (was 54.0 %).
// Measured and not kept (same method):
// - MKL's packed operands (cblas_sgemm_pack / cblas_sgemm_compute, exported by libtorch_cpu) for the
//   forward's full tiles: Q packed per query tile, K^T and V per key tile once per item. Standalone (1
//   thread, 256 x 256 x 128) Q K^T ran 97.6 -> 88.2 us with both packed, P V 105.5 -> 96.6 with V packed;
//   in the kernel softmax fwd 18.0 vs 18.0 ms, HSTU 20.2 vs 21.1 (2 rounds): perf showed the compute
//   packing its other operand in every call (MKL's scopy 6.8 -> 8.8 % of samples). Its buffers:
//   cblas_sgemm_pack_get_size asks ~7.6 MiB per 256 x 256 x 128 operand, of which a pack writes ~136 KiB
//   (zero-filled buffers made the forward 1.4x slower). interaction.cpp found no gain from it either.
// - The backward's softmax rows and both SiLU rows in the kept forward rows' form (whole blocks unmasked,
//   a NaN passed through the clamps instead of blended): HSTU fwd 1.033x, bwd 1.024x, softmax bwd 1.017x
//   (6 rounds): the SiLU rows wait on their divide (as attention_short.h found), and the softmax
//   backward's row is one small pass beside five products.
// - Not tried in the kernel, as standalone sgemm calls showed nothing: a query tile against up to 3 key
//   tiles in one product (256 x 768 x 128: 0.94-1.03x the separate calls), tile pitches of 264 or 272
//   floats instead of 256 (within +-3 %).
// Two threads (the bench's last 2-thread rows ran ~10 % below twice the 1-thread rate): the schedule,
// modelled from the measured 1-thread item costs (fwd 2.67 ms an L = 1024 item, 0.53-0.61 ms an L =
// 420-443 one; bwd 5.85 / 1.27-1.37 ms), is balanced: longest first, each thread takes two L = 1024
// items and six short ones (fwd 8.70 ms each), so splitting a long item's query tiles (forward) or key
// tiles (backward, plus a dq reduction) across threads predicts no gain on a quiet host, and was not
// made. Two 1-thread processes side by side ran at one alone's CPU times (fwd 17.6-18.2 vs 19.2 ms, bwd
// 39.3-42.3 vs 43.9): the cores do not slow each other. And in a quiet moment (03:10 UTC, 1-minute load
// 0.6-0.8, no other busy process) the native ops at 2 threads (4 alternating processes of 11 calls, wall
// medians, CPU time 2.0x wall) ran softmax fwd 7.70 + bwd 18.80 ms = 66 % of the bench's 2-thread peak
// (0.328 TFLOP/s; the session's start 8.30 + 20.12 ms, 62 %), HSTU 8.65 + 21.39 ms = 59 % (start 9.10 +
// 21.72, 57 %). So the kernel scales to two threads; what the bench's 2-thread rows lose besides is the
// host's (beside one busy process a 2-thread forward took 32 ms against 17.5 at 1 thread: OpenMP's waits)
// and the op's Python front door and autograd (~0.15-0.3 ms a forward, 0.4-0.7 ms fwd+bwd, measured on
// tiny calls), which run on one thread.
//
// Measured and not kept (2026-12-07, helper attn10; the bench's 1024 case, native ops, 2 threads under
// SCHED_FIFO and the measuring lock, old and new toggled by a temporary switch in one process, 10-16
// paired rounds over the bench's two input sets; the 2-core Xeon at load 1.4-6 from other sessions):
// - the forward's value rows copied per item like its key rows, their Inf/NaN flags taken from the
//   copy instead of nonfinite_rows(v)'s sweep (P V on rows at ld Dv): softmax fwd 1.039x, HSTU 1.032x,
//   fwd+bwd 1.005x / 0.996x (slower: the copy costs more than the sweep and P V's strided B operand);
// - the forward's key rows not copied (Q K^T on k at its H * D stride): 0.995-1.009x softmax,
//   0.976-1.001x HSTU (neutral, kept as it was);
// - P and dS zeroed outside a mixed tile's spans only where the strips' products read them (the row's
//   own strip, not the rest of the tile): fwd 0.997-1.010x, bwd 0.999-1.003x (the fills cost nothing);
// - the forward op's _check_values skipped for this backend, its checks made here in C++ instead: against
//   the ATen form of the check (eight small ops, ~20 us themselves) fwd+bwd through autograd ran 0.961-0.995x
//   (8 paired runs of 12 rounds; no page faults either way, and 30 us of Python spinning in the same place
//   cost nothing, so the ATen ops slow the kernel after them, by a mechanism not found); against main's
//   one-pass native summary (cd6e731, which landed meanwhile) 0.988-1.021x: that commit took the gain.
// Also measured: the two threads end the item loop within 0.01-0.04 ms of each other (fwd ~8.7 ms,
// bwd ~21 ms; 12 calls each), so the longest-first schedule loses nothing at this case; and Q K^T as
// a NN product on a transposed key copy (sgemm alone, 256 x 256 x 128): 130 vs 126 us, no gain.
//
// Where the time that is not sgemm goes (2026-12-07, helper attn12; the bench's 1024 case, native ops,
// a temporary build with rdtsc counters per phase and per product, SCHED_FIFO under the measuring lock,
// the 2-core Xeon at load 2-5 from other sessions; per call, thread-ms, 1 thread; the per-row counters
// themselves cost ~0.3 ms a call each, so the row phases below read high by about that):
// - HSTU fwd (23.7 ms counted): products 14.9 (Q K^T full tiles 4.48 at 121 GFLOP/s, its 64-row strips of
//   the diagonal tiles 3.75 at 96; P V 3.95 at 137, strips 2.71 at 132); scores_tile 3.74 (position bias
//   0.77, time bias 2.59, vis flags 0.38); the SiLU rows 1.66; nonfinite_rows(v) 0.86; the key-row copy
//   and tile flags 0.79; out rows 0.35; fills 0.10.
// - HSTU bwd (57.3): products 38.5 (Q K^T 4.86 + 4.26 strips at 112 / 84 GFLOP/s, dO V^T 4.75 + 3.93 at
//   114 / 91, dv 3.90 + 2.79 at 139 / 129, dk 4.66 + 2.77 at 116 / 129, dq 4.00 + 2.53 at 135 / 141);
//   scores_tile 4.54 (1.19 + 2.97 + 0.38); the row loop 6.71 (SiLU' rows, fills, position gradient 1.40,
//   add_by_bucket 1.66); the k and v row copies with their flags 2.33; the q and dO sweeps 1.25; dk and
//   dv rows out 1.34, dq rows 0.76; dq, dk, dv zero fills 0.51; the bias reduction 0.11.
// - softmax fwd (20.7): products 14.6 (Q K^T 127 / 97 GFLOP/s, P V 142 / 128); the exp rows 1.93; the key
//   copy 0.87; out rows 0.64; v sweep 0.53. softmax bwd (44.8): products (full tiles 132-165
//   GFLOP/s, Q K^T and dO V^T strips 91-96); the rows 3.62; copies 1.79; sweeps and delta 1.67; rows out
//   1.23; fills 0.47 (products 34.0 of the 44.8).
// - 2 threads (HSTU with the fused rows below): the threads' item times end within 0.01-0.55 ms of each
//   other and of the region (fwd ~9.1 ms, bwd ~21.7); the region starts ~0.1-0.7 ms before the first
//   item (thread wake-up, each call's new long-path workspace: its zero fills); sweeps 0.17-0.75 ms.
// - So of the ~40 % that is not sgemm at its standalone rate, about half is the products themselves
//   running below it in place: Q K^T and dO V^T (MKL's packing kernels for the transposed operand) at
//   111-144 GFLOP/s on full tiles and 84-115 on the 64-row strips, the others at 128-168, against
//   170-187 standalone; and the causal diagonal tiles' strips compute 0.358 GFLOP a product where
//   0.284 are visible (9 % more product FLOPs than the visible pairs over the call). The row passes
//   (biases, SiLU/exp, gradients) are ~10 % of softmax and ~20 % of HSTU; copies, sweeps and output
//   rows ~8 %.
// Kept: the HSTU rows in one pass a row on AVX-512F (hstu_fwd_rows, hstu_bwd_rows): the forward's
// position and time biases and SiLU, the backward's biases, SiLU', P, dS and position gradient, while
// the row is in L1, instead of scores_tile's pass over the 256 KiB tile and a second pass (the forward
// stores no time buckets: only the backward reads them). Predicted from the counters ~-1.5 ms forward
// (scores_tile's 3.7 ms plus the rows' 1.7 against the fused pass's 3.0-3.5, less ~0.9 ms of the
// counters' own) and ~-4 ms backward (11.3 against 5.4-6.1, less ~1.5); the backward gained less than
// that (the counters inflated its per-row phases more than estimated). Measured (native ops, a temporary switch in one
// process, old and new alternated, 10 paired rounds of 8 calls over the bench's two input sets): HSTU
// fwd 0.946x (0.91-0.98), bwd 0.960x (0.93-1.03) at 1 thread (fwd+bwd 66.1 -> 63.4 ms); at 2 threads
// fwd 0.943x (0.90-0.99), bwd 0.970x (0.94-1.02), fwd+bwd 33.7 -> 32.4 ms, 172 -> 179 GFLOP/s. Softmax,
// whose code did not change, read 1.01-1.05x in the same runs: the noise of this host. Through
// gk.jagged_attention with autograd (old and new builds in alternating processes, 4 rounds, each against
// the torch.mm 2048^3 peak measured in its own process): HSTU fwd+bwd at 2 threads 52.0-53.5 % of the
// peak (old 49.1-50.7 %), at 1 thread 50.1-55.0 % (old 49.6-52.6 %); softmax unchanged, 53-59 %. The forward's
// bits are unchanged; the backward's dq, dk and bias gradients move by rounding (~4e-9 on dq of ~0.1):
// a row of fewer than 32 keys took silu_grad_row's 8-lane and scalar forms, here the 16-lane one.
// Measured and not kept (same counters and switch, 1 thread unless said, 5-6 paired rounds):
// - the time buckets of a 16-key block that crosses a threshold by bucket_cells' table (two 8-lane
//   gathers, as attention_short.h's bucket_row8) instead of the walk: fwd 1.005x, bwd 1.012x (the
//   crossing blocks are few at the bench's sorted timestamps; the fused row is bound by its SiLU divide);
// - software prefetch (L2) of the next key rows in the per-item k and v copies, of the next tile's q and
//   dO rows during the backward's row pass, of the next key tile's v rows (or the next query tile's q
//   rows) during the forward's: copies 1.94 -> 1.98 ms, the Q K^T and dO V^T products no faster (fwd
//   0.98-1.01x, bwd 0.97-1.01x, softmax 0.98-0.99x: within the noise);
// - the score products (Q K^T, dO V^T) of a diagonal tile in 128-row strips (the union of two 64-row
//   strips' keys), the other products in 64-row ones: softmax fwd 1.023x, bwd 1.021x; HSTU 0.996x / 1.006x;
// - the long path's workspace kept on each thread from call to call (no zero fill of ~2.5 MB of tiles and
//   rows per thread per call): 0.98-1.02x at 1 and 2 threads;
// - the Inf/NaN flags of q, dO (HSTU) and v found per tile on first use, from the tile's own rows, and only
//   for mixed tiles, instead of the sweeps before the items: 0.98-1.03x at 1 and 2 threads.
//
// Why the products run below their standalone rate in place (2026-12-07, helper prod13; standalone C++
// on libtorch's sgemm_, 1 thread pinned, SCHED_FIFO under the measuring lock, CPU-time medians of 60
// calls, 2 rounds each, the 2-core Xeon at load 1-4 from other sessions; Q K^T = 256 x 256 x 128 NT
// into a 256-pitched tile, P V = 256 x 128 x 256 NN with beta 1):
// - Not the strides. With the operands warm, A (q) at its [N, H, D] row stride (ld 512, the 2 KiB
//   pitch that 4 KiB aliasing would hit) runs 173 GFLOP/s against 176-178 contiguous (ld 128) and 175
//   at a padded pitch (ld 144); P V on v rows at ld 512 178-183 against 177-179 contiguous. With
//   everything evicted (a 3 MiB sweep between calls) all three pitches read the same 130-137.
// - Not the diagonal strips' shape alone: 64-row strips (64 x 64..256 x 128) run 136-146 warm, 100-106
//   after the sweep; 32-row ones 121-126 warm.
// - What costs is what the rest of the tile loop does to the caches between products, and it is not
//   only the operands coming back from L3: after a 3 MiB sweep with A, B and C read back in just before
//   the call, Q K^T still runs 128-139 (warm 150-175 in the same runs), against 115-125 with them
//   cold; a sweep of 512 KiB between calls costs 145-160, 1 MiB 133-153, 1.5 MiB 130-137. The
//   kernel's rates (Q K^T 121-127 full tiles, strips 84-97) are the ~1-1.5 MiB points: the tile loop's
//   own row passes, copies and other products (s, P, dP, the bucket tile: 256 KiB each; the operand
//   tiles and accumulators 128 KiB each) pass over about that much between two calls, so MKL's
//   packing buffers and the operands' TLB entries are gone when the next product starts. A cold A
//   costs the strided layout more than a contiguous one (a new q tile each call: 139-141 at ld 512,
//   154-159 contiguous), but copying it costs the same (copy plus product 140-143).
//   madvise(MADV_HUGEPAGE) on every buffer (THP is madvise-only here): within the noise (+-5 %).
// Measured and not kept (the kernel, native ops, in-process switch, 10 paired rounds, SCHED_FIFO under
// the lock, load ~3.7): the backward's q and dO rows copied per item beside its k and v rows (the
// Q K^T, dO V^T, dk and dv products on contiguous rows): softmax bwd 1.013x (0.975-1.041) at 1 thread,
// 1.028x (0.977-1.062) at 2; HSTU 1.015x (0.986-1.047) / 1.031x (0.983-1.054); bits unchanged. The
// copies cost more than the strided operand does.

// On the 2-core AMD EPYC (Zen 4, 1 MiB L2 a core; 2026-12-07, helper attn15, bench/results/notes-attn15.md;
// the host at load 5-10, native ops, 2 threads, SCHED_FIFO under the measuring lock): the bench's 1024
// case reads HSTU fwd+bwd 69-72 % and softmax 75-78 % of the 0.19 TFLOP/s matmul peak; MKL
// (sgemm_kernel_0_zen plus its packing) is 78 % of the samples and runs the products at ~95 % of that
// peak in place. Knockouts (in-process switch, paired): the whole HSTU row 9.6 % of fwd+bwd, the time
// bias and its gradient 4.1 %. Measured and not kept (paired medians, the switch's own spread +-3 %):
// the whole-block time-bucket test by a block's two end keys where the item's timestamps are sorted
// (scalar pipes) with the time-bias gradient summed in the row (no bucket tile, no add_by_bucket pass):
// fwd+bwd 0.994 (0.968-1.010, five runs); plus the SiLU divide as rcp14 and a Newton step: 1.002, 0.985;
// 128 x 128 tiles with 32-row strips (alternating processes): median 0.975 (0.85-1.17, nine pairs),
// backward 0.962: open, it needs an in-process tile-size switch on a quiet host.

// The short path (attention_short.h; the GEM model's call): where its time goes by knockouts, its
// 33-entry time table, and its time buckets kept from call to call (BucketCache) are in that file's
// header (helper short14, 2026-12-07). A call that finds no kept buckets for its inputs copies its
// timestamps and stores its buckets as uint8 (first forward 1.02x at 1 thread, 1.04x at 2 threads). The
// calls after it that read them back then run 0.91-0.96x. A forward-only caller whose every batch is new
// pays the first figure on each call.

// Roofline: FLOPs = 4 * sum_b (visible pairs of b) * H * D forward (2 products), 2.5x that
// backward. Minimum bytes: q, k, v, out read/written once, N*H*(2*Dqk + 2*Dv)*s forward, plus
// biases and timestamps; backward adds dO, dq, dk, dv.
//
// Inputs in fp16/bf16 are converted to fp32 once per call; every statistic and accumulation is fp32.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// setup.py builds for x86-64-v3 (AVX2 + FMA) by default. A build for another target
// (GEM_KERNELS_CPU_ARCH, aarch64) takes the scalar loops. No runtime dispatch: the whole extension
// (at::vec, auto-vectorised loops) is compiled for the same -march, so a CPU without AVX2 could not
// run it anyway.
#define GK_ATTENTION_AVX2 1
#else
#define GK_ATTENTION_AVX2 0
#endif

#include "gem_kernels/attention.h"
#include "gem_kernels/attention_checks.h"
#include "gem_kernels/checks.h"
#include "gem_kernels/cpu_blas.h"
#include "gem_kernels/cpu_exp.h"  // fast_exp, fast_exp8
#include "gem_kernels/cpu_stream.h"
#include "gem_kernels/parallel.h"

namespace gem_kernels {
namespace {

// The short path's rows (attention_short.h): at most kBlockN keys, kBlockN-pitched in the workspace.
constexpr int64_t kBlockN = 128;
// The general path's tiles: kTileM queries x kTileN keys. 256 x 256: the score, probability and dP
// tiles (256 KiB each) and the operands' tiles (128 KiB each) stay in a 2 MiB L2, and MKL's sgemm
// (1 thread, this repo's 2-core Xeon) runs a 256x256x128 product at ~155 GFLOP/s against 118-146 at
// 128x128x128. Measured in the kernel (softmax and HSTU fwd+bwd at the bench's history 1024, 1
// thread, every size interleaved in one process): 128 x 128 tiles with 32-row strips 84.6 / 71.9
// GFLOP/s, 256 x 256 with 64-row strips 85.2 / 74.9, 128 x 512 85.1 / 74.3.
constexpr int64_t kTileM = 256;
constexpr int64_t kTileN = 256;

// The long path writes each row of its outputs (forward: out; backward: dq, dk, dv) once, from the
// workspace, with streaming stores when the call's outputs total this much: larger than this machine's
// L2 (2 MiB a core), where a normal store's read-for-ownership of the line mostly misses anyway.
// Measured at the bench's history 1024 (1 thread, interleaved, 3 rounds; outputs 4.75 MB each):
// backward 44.4 -> 42.0 ms softmax, 51.0 -> 48.1 ms HSTU.
constexpr size_t kStreamRowsMinBytes = size_t(4) << 20;

// max that keeps a NaN (std::max(a, NaN) drops it): a NaN score must reach its whole row.
inline float max_keep_nan(float a, float b) { return (a != a || b <= a) ? a : b; }

// One key of the time-bias walk: the bucket of |ti - tj| reached from bkt by stepping over the
// sorted thresholds (exact for any timestamps, ~free when they are sorted), its bias added to *row.
inline void walk_time_bucket(int64_t ti, int64_t tj, const int64_t* thr, int32_t nb, const float* bias, int32_t& bkt,
                             int32_t* bucket, float* row) {
  const int64_t dt = ti - tj;
  const int64_t x = dt < 0 ? -dt : dt;
  while (bkt < nb && x >= thr[bkt]) ++bkt;
  while (bkt > 0 && x < thr[bkt - 1]) --bkt;
  *bucket = bkt;
  *row += bias[bkt];
}

#if GK_ATTENTION_AVX2
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The exp and SiLU rows on 16 lanes where the CPU has AVX-512F (cpu_has_avx512f: a runtime check, as
// the build targets x86-64-v3; GEM_KERNELS_NO_AVX512=1 turns it off). They were ~a quarter of the
// forward at history 1024 (1 thread, per-piece CPU time); MKL's sgemm beside them already runs
// AVX-512. Each computes what its 8-lane twin below does, lane for lane (fast_exp16 is fast_exp8's
// steps), the tail under a mask; only the order of a row sum's partial sums differs.
#define GK_AVX512 __attribute__((target("avx512f")))

// fast_exp8 on 16 lanes: exp16_clamped (cpu_exp.h) and fast_exp8's edge values.
GK_AVX512 inline __m512 fast_exp16(__m512 x) {
  __m512 y = exp16_clamped(x);
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ), y,
                           _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), y, _mm512_setzero_ps());
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}

// The mask of lanes [c, n) of a 16-lane block at c.
GK_AVX512 inline __mmask16 tail_mask(int64_t c, int64_t n) {
  return n - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - c)) - 1u);
}

// exp(x - m) of a softmax row, where m >= every x (the row's max, so x - m <= 0) or NaN: fast_exp16's
// values without its edge blends that cannot fire there. The clamp keeps x - m >= -87 (max's operands
// in the order that passes a NaN through, so a NaN lane stays NaN through the polynomial and scalef),
// and one blend gives 0 below -87 (x = -inf included: a masked score). So it returns fast_exp16(x - m)
// lane for lane wherever m is not NaN (a NaN m makes the whole row NaN either way); 19 instead of 27
// vector uops a block, whose throughput on the two 512-bit ports bound the pass.
GK_AVX512 inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __m512 xc = _mm512_max_ps(lo, x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int k = 1; k < kExpPolyTerms; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[k]));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_scalef_ps(p, n), _mm512_setzero_ps());
}

// exp_shifted_sum's 16 lanes: whole blocks unmasked, the tail under a mask (lane l sums elements l,
// l + 16, ... in order, as before this form). Where m is NaN (the row's output is NaN whatever its
// weights) a masked score gives NaN here, 0 on 8 lanes.
GK_AVX512 __attribute__((noinline)) float exp_shifted_sum16(float* x, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + c), vm));
    _mm512_storeu_ps(x + c, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (c < n) {
    const __mmask16 k = tail_mask(c, n);
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + c), vm));
    _mm512_mask_storeu_ps(x + c, k, e);
    vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

// row_max on 16 lanes (the max is exact, so the same value as the 8-lane loop's).
GK_AVX512 __attribute__((noinline)) float row_max16(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = neg_inf;
  __mmask16 nan = 0;
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 v = _mm512_loadu_ps(x + c);
    vmax = _mm512_max_ps(vmax, v);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  if (c < n) {
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, tail_mask(c, n), x + c);
    vmax = _mm512_max_ps(vmax, v);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  return nan != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(vmax);
}

GK_AVX512 __attribute__((noinline)) void softmax_grad_row16(const float* s, float* p, float* ds, int64_t n, float lse,
                                                            float delta) {
  const __m512 vl = _mm512_set1_ps(lse), vd = _mm512_set1_ps(delta);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 k = tail_mask(c, n);
    const __m512 pv = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + c), vl));
    _mm512_mask_storeu_ps(p + c, k, pv);
    _mm512_mask_storeu_ps(ds + c, k, _mm512_mul_ps(pv, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, ds + c), vd)));
  }
}

GK_AVX512 __attribute__((noinline)) void silu_row16(float* x, int64_t n, float inv_m) {
  const __m512 one = _mm512_set1_ps(1.0f), vm = _mm512_set1_ps(inv_m);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 k = tail_mask(c, n);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + c);
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_mask_storeu_ps(x + c, k, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), vm));
  }
}

GK_AVX512 __attribute__((noinline)) void silu_grad_row16(const float* s, float* p, float* ds, int64_t n, float inv_m) {
  const __m512 one = _mm512_set1_ps(1.0f), vm = _mm512_set1_ps(inv_m);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 k = tail_mask(c, n);
    const __m512 x = _mm512_maskz_loadu_ps(k, s + c);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    _mm512_mask_storeu_ps(p + c, k, _mm512_mul_ps(_mm512_mul_ps(x, sig), vm));
    const __m512 g = _mm512_mul_ps(sig, _mm512_add_ps(one, _mm512_mul_ps(x, _mm512_sub_ps(one, sig))));
    _mm512_mask_storeu_ps(ds + c, k, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, ds + c), g), vm));
  }
}

// Whether all 16 |t_i - t_j| of keys tj[0..16) lie in bucket bkt's range [thr[bkt - 1], thr[bkt]) (vti:
// t_i in 8 lanes; vpabsq wraps |INT64_MIN| as the 8-key loop's blend did): the common case of sorted
// timestamps, where a block takes bkt's bias as one broadcast.
GK_AVX512 inline bool keys_in_bucket16(__m512i vti, const int64_t* tj, const int64_t* thr, int32_t nb, int32_t bkt) {
  const __m512i lo = _mm512_set1_epi64(bkt > 0 ? thr[bkt - 1] : std::numeric_limits<int64_t>::min());
  const __m512i hi = _mm512_set1_epi64(bkt < nb ? thr[bkt] : std::numeric_limits<int64_t>::max());
  const __m512i x0 = _mm512_abs_epi64(_mm512_sub_epi64(vti, _mm512_loadu_si512(tj)));
  const __m512i x1 = _mm512_abs_epi64(_mm512_sub_epi64(vti, _mm512_loadu_si512(tj + 8)));
  const __mmask8 in0 = _mm512_mask_cmplt_epi64_mask(_mm512_cmpge_epi64_mask(x0, lo), x0, hi);
  const __mmask8 in1 = _mm512_mask_cmplt_epi64_mask(_mm512_cmpge_epi64_mask(x1, lo), x1, hi);
  return (in0 & in1) == 0xFF;
}

// scores_tile's time-bias keys on 16 lanes (AVX-512F: 8 int64 |dt| a register by vpabsq, the compares
// into masks): from key c while 16 remain, returns where it stopped. Each block as the 8-key loop's:
// all 16 |dt| in the current bucket [thr[bkt - 1], thr[bkt]) (sorted timestamps: most blocks) takes
// that bucket and its bias as one broadcast, any other block the scalar walk from bkt. The same
// buckets and sums as the 8-key loop (vpabsq wraps |INT64_MIN| as its blend did).
GK_AVX512 __attribute__((noinline)) int64_t time_bias_keys16(int64_t ti, const int64_t* tj, int64_t c, int64_t c1,
                                                             const int64_t* thr, int32_t nb, const float* bias,
                                                             int32_t& bkt, int32_t* buckets, float* row) {
  const __m512i vti = _mm512_set1_epi64(ti);
  for (; c + 16 <= c1; c += 16) {
    if (keys_in_bucket16(vti, tj + c, thr, nb, bkt)) {
      _mm512_storeu_si512(buckets + c, _mm512_set1_epi32(bkt));
      _mm512_storeu_ps(row + c, _mm512_add_ps(_mm512_loadu_ps(row + c), _mm512_set1_ps(bias[bkt])));
      continue;
    }
    for (int64_t k = c; k < c + 16; ++k) walk_time_bucket(ti, tj[k], thr, nb, bias, bkt, buckets + k, row + k);
  }
  return c;
}

// The time bias of one 16-key block of hstu_fwd_row16 / hstu_bwd_row16 (x: the block's scores, lanes
// past c1 zero), from key c while bkt is the bucket of the key before: a whole block whose 16 |dt| stay
// in bucket bkt (sorted timestamps: most blocks) adds bias[bkt] as one broadcast, as time_bias_keys16's
// blocks; any other block (a threshold crossed, or the row's tail) walks its keys from bkt as
// walk_time_bucket does, through a stack copy of x. The same buckets and sums as scores_tile's walk.
// buckets: where the blocks' buckets go (null: not kept).
GK_AVX512 inline __m512 add_time_bias16(__m512 x, __mmask16 k, __m512i vti, int64_t ti, const int64_t* tj, int64_t c,
                                        int64_t c1, const int64_t* thr, int32_t nb, const float* bias, int32_t& bkt,
                                        int32_t* buckets) {
  if (k == static_cast<__mmask16>(0xFFFF) && keys_in_bucket16(vti, tj + c, thr, nb, bkt)) {
    if (buckets != nullptr) _mm512_storeu_si512(buckets + c, _mm512_set1_epi32(bkt));
    return _mm512_add_ps(x, _mm512_set1_ps(bias[bkt]));
  }
  alignas(64) float tmp[16];
  int32_t unused;
  _mm512_store_ps(tmp, x);
  for (int64_t j = c; j < std::min(c + 16, c1); ++j)
    walk_time_bucket(ti, tj[j], thr, nb, bias, bkt, buckets != nullptr ? buckets + j : &unused, tmp + (j - c));
  return _mm512_maskz_load_ps(k, tmp);
}

// x of one 16-key block of an HSTU row: the scores s[c..] (lanes past c1 zero), + pos[c] (null: no
// position bias), + the time bias (null bias: none; bkt: the bucket of the key before c; buckets: where
// add_time_bias16 stores the block's buckets, null: nowhere). hstu_fwd_row16's and hstu_bwd_row16's.
GK_AVX512 inline __m512 hstu_row_block16(const float* s, int64_t c, int64_t c1, __mmask16 k, const float* pos,
                                         __m512i vti, int64_t ti, const int64_t* tj, const int64_t* thr, int32_t nb,
                                         const float* bias, int32_t& bkt, int32_t* buckets) {
  __m512 x = _mm512_maskz_loadu_ps(k, s + c);
  if (pos != nullptr) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, pos + c));
  if (bias != nullptr) x = add_time_bias16(x, k, vti, ti, tj, c, c1, thr, nb, bias, bkt, buckets);
  return x;
}

// HSTU's forward row in one pass over [c0, c1) of row (the Q K^T product's scaled scores): x = row +
// pos[c] (pos: null without a position bias) + the time bias (bias: null without one; bkt: key c0's
// bucket), then row <- silu(x) * inv_m, 16 keys a register. scores_tile's bias passes and silu_row16
// make the same additions and products in the same order, so the same bits; here the row is not
// stored and reloaded between them, and the forward's time buckets are not stored at all (only the
// backward reads them).
GK_AVX512 __attribute__((noinline)) void hstu_fwd_row16(float* row, int64_t c0, int64_t c1, const float* pos,
                                                        int64_t ti, const int64_t* tj, const int64_t* thr, int32_t nb,
                                                        const float* bias, int32_t bkt, float inv_m) {
  const __m512 one = _mm512_set1_ps(1.0f), vm = _mm512_set1_ps(inv_m);
  const __m512i vti = _mm512_set1_epi64(ti);
  for (int64_t c = c0; c < c1; c += 16) {
    const __mmask16 k = tail_mask(c, c1);
    const __m512 v = hstu_row_block16(row, c, c1, k, pos, vti, ti, tj, thr, nb, bias, bkt, nullptr);
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_mask_storeu_ps(row + c, k, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), vm));
  }
}

// HSTU's backward row in one pass over [c0, c1): x as hstu_fwd_row16's from the raw scores s (not
// written), then p <- silu(x) * inv_m and ds <- dP * silu'(x) * inv_m (ds holds dP on entry) as
// silu_grad_row16, ds added to pos_grad[c] (null: no position bias), and the time buckets stored to
// buckets[c] for add_by_bucket. The same values as scores_tile + silu_grad_row16 + the position
// gradient's loop, without the scores' store and reload and the gradient's second pass over ds.
GK_AVX512 __attribute__((noinline)) void hstu_bwd_row16(const float* s, float* p, float* ds, int64_t c0, int64_t c1,
                                                        const float* pos, float* pos_grad, int64_t ti,
                                                        const int64_t* tj, const int64_t* thr, int32_t nb,
                                                        const float* bias, int32_t bkt, int32_t* buckets, float inv_m) {
  const __m512 one = _mm512_set1_ps(1.0f), vm = _mm512_set1_ps(inv_m);
  const __m512i vti = _mm512_set1_epi64(ti);
  for (int64_t c = c0; c < c1; c += 16) {
    const __mmask16 k = tail_mask(c, c1);
    const __m512 x = hstu_row_block16(s, c, c1, k, pos, vti, ti, tj, thr, nb, bias, bkt, buckets);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    _mm512_mask_storeu_ps(p + c, k, _mm512_mul_ps(_mm512_mul_ps(x, sig), vm));
    const __m512 g = _mm512_mul_ps(sig, _mm512_add_ps(one, _mm512_mul_ps(x, _mm512_sub_ps(one, sig))));
    const __m512 d = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, ds + c), g), vm);
    _mm512_mask_storeu_ps(ds + c, k, d);
    if (pos_grad != nullptr)
      _mm512_mask_storeu_ps(pos_grad + c, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, pos_grad + c), d));
  }
}

// y[c] <- fast_exp16(x[c]) over [0, n) (the tests' window on it, attention_fast_exp16).
GK_AVX512 __attribute__((noinline)) void fast_exp16_rows(const float* x, float* y, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 k = tail_mask(c, n);
    _mm512_mask_storeu_ps(y + c, k, fast_exp16(_mm512_maskz_loadu_ps(k, x + c)));
  }
}

// The row loops take the 16-lane twins where cpu_has_avx512f() and rows are at least kAvx512MinRow
// long (shorter ones, as most of the short path's, stay on the inlined 8-lane loops: the twins are
// out-of-line calls).
constexpr int64_t kAvx512MinRow = 32;
#endif

// max_keep_nan folded over x[0, n): NaN when any element is NaN, else the max (-inf when n = 0).
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t c = 0;
#if GK_ATTENTION_AVX2
  if (n >= kAvx512MinRow && cpu_has_avx512f()) return row_max16(x, n);
  if (n >= 8) {
    __m256 vmax = _mm256_set1_ps(m), vnan = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
      const __m256 v = _mm256_loadu_ps(x + c);
      vmax = _mm256_max_ps(vmax, v);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(vnan) != 0) return std::numeric_limits<float>::quiet_NaN();
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    m = _mm_cvtss_f32(h);
  }
#endif
  for (; c < n; ++c) m = max_keep_nan(m, x[c]);
  return m;
}

// x[c] <- exp(x[c] - m) for m = max_keep_nan of the row's scores (and earlier ones), exactly 0 where
// x[c] is -inf (a masked score, even when m is +inf; when m is NaN, on 8 lanes only: see
// exp_shifted_sum16); returns the sum of the new x[0, n).
inline float exp_shifted_sum(float* x, int64_t n, float m) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;
  int64_t c = 0;
#if GK_ATTENTION_AVX2
  if (n >= kAvx512MinRow && cpu_has_avx512f()) return exp_shifted_sum16(x, n, m);
  if (n >= 8) {
    const __m256 vm = _mm256_set1_ps(m), vneg_inf = _mm256_set1_ps(neg_inf);
    __m256 vsum = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
      const __m256 v = _mm256_loadu_ps(x + c);
      const __m256 e = _mm256_blendv_ps(fast_exp8(_mm256_sub_ps(v, vm)), _mm256_setzero_ps(),
                                        _mm256_cmp_ps(v, vneg_inf, _CMP_EQ_OQ));
      _mm256_storeu_ps(x + c, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum8(vsum);
  }
#endif
  for (; c < n; ++c) {
    const float e = x[c] == neg_inf ? 0.0f : fast_exp(x[c] - m);
    x[c] = e;
    sum += e;
  }
  return sum;
}

// The softmax backward of one row: p[c] <- exp(s[c] - lse), ds[c] <- p[c] * (ds[c] - delta) (ds
// holds dP on entry). lse = +inf gives p = 0 (the caller's stand-in for a row with nothing visible).
inline void softmax_grad_row(const float* s, float* p, float* ds, int64_t n, float lse, float delta) {
  int64_t c = 0;
#if GK_ATTENTION_AVX2
  if (n >= kAvx512MinRow && cpu_has_avx512f()) return softmax_grad_row16(s, p, ds, n, lse, delta);
  const __m256 vl = _mm256_set1_ps(lse), vd = _mm256_set1_ps(delta);
  for (; c + 8 <= n; c += 8) {
    const __m256 pv = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), vl));
    _mm256_storeu_ps(p + c, pv);
    _mm256_storeu_ps(ds + c, _mm256_mul_ps(pv, _mm256_sub_ps(_mm256_loadu_ps(ds + c), vd)));
  }
#endif
  for (; c < n; ++c) {
    const float pv = fast_exp(s[c] - lse);
    p[c] = pv;
    ds[c] = pv * (ds[c] - delta);
  }
}

// HSTU's weights of one row: x[c] <- silu(x[c]) * inv_m = x[c] / (1 + exp(-x[c])) * inv_m.
inline void silu_row(float* x, int64_t n, float inv_m) {
  int64_t c = 0;
#if GK_ATTENTION_AVX2
  if (n >= kAvx512MinRow && cpu_has_avx512f()) return silu_row16(x, n, inv_m);
  // gcc leaves the scalar loop below unvectorised (perf showed vmulss/vdivss in it).
  const __m256 one = _mm256_set1_ps(1.0f), vm = _mm256_set1_ps(inv_m);
  for (; c + 8 <= n; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_storeu_ps(x + c, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), vm));
  }
#endif
  for (; c < n; ++c) x[c] = x[c] / (1.0f + fast_exp(-x[c])) * inv_m;
}

// The HSTU backward of one row: p[c] <- silu(s[c]) * inv_m, ds[c] <- dP[c] * silu'(s[c]) * inv_m with
// silu'(x) = sig(x) (1 + x (1 - sig(x))) (ds holds dP on entry).
inline void silu_grad_row(const float* s, float* p, float* ds, int64_t n, float inv_m) {
  int64_t c = 0;
#if GK_ATTENTION_AVX2
  if (n >= kAvx512MinRow && cpu_has_avx512f()) return silu_grad_row16(s, p, ds, n, inv_m);
  const __m256 one = _mm256_set1_ps(1.0f), vm = _mm256_set1_ps(inv_m);
  for (; c + 8 <= n; c += 8) {
    const __m256 x = _mm256_loadu_ps(s + c);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, fast_exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(p + c, _mm256_mul_ps(_mm256_mul_ps(x, sig), vm));
    const __m256 g = _mm256_mul_ps(sig, _mm256_add_ps(one, _mm256_mul_ps(x, _mm256_sub_ps(one, sig))));
    _mm256_storeu_ps(ds + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(ds + c), g), vm));
  }
#endif
  for (; c < n; ++c) {
    const float x = s[c];
    const float sig = 1.0f / (1.0f + fast_exp(-x));
    p[c] = x * sig * inv_m;
    ds[c] = ds[c] * (sig * (1.0f + x * (1.0f - sig))) * inv_m;
  }
}

// part[bucket[c]] += ds[c] over c in [0, n). Buckets come in runs (sorted timestamps move |t_i - t_j|
// monotonically along a row): each run is summed in registers and added once, instead of a scalar
// read-modify-write per element whose store-to-load chain on one address serialised the loop. The
// run's end is found 8 buckets a compare (the scalar scan was ~2 % of HSTU's backward at history
// 1024, 1 thread, perf).
inline void add_by_bucket(const int32_t* bucket, const float* ds, int64_t n, float* part) {
  for (int64_t c = 0; c < n;) {
    const int32_t b = bucket[c];
    int64_t e = c + 1;
#if GK_ATTENTION_AVX2
    const __m256i vb = _mm256_set1_epi32(b);
    for (bool ended = false; !ended && e + 8 <= n;) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bucket + e));
      const unsigned same = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, vb))));
      ended = same != 0xFFu;
      e += ended ? __builtin_ctz(~same) : 8;
    }
#endif
    while (e < n && bucket[e] == b) ++e;
    float sum = 0.0f;
    int64_t k = c;
#if GK_ATTENTION_AVX2
    if (e - c >= 8) {
      __m256 acc = _mm256_setzero_ps();
      for (; k + 8 <= e; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(ds + k));
      sum = hsum8(acc);
    }
#endif
    for (; k < e; ++k) sum += ds[k];
    part[b] += sum;
    c = e;
  }
}

// out[r, :] += alpha * sum over visible c of w[r, c] * x[c, :] (w, vis: kTileN-pitched tiles). The
// masked products' slow path, taken for mixed tiles whose x rows hold an Inf or NaN: a BLAS product
// of the zeroed weights would add 0 * inf = NaN from keys the row cannot see.
void masked_mm(int64_t bm, int64_t bn, int64_t width, float alpha, const float* w, const uint8_t* vis,
               const float* x, int64_t ldx, float* out, int64_t ldo) {
  for (int64_t r = 0; r < bm; ++r)
    for (int64_t c = 0; c < bn; ++c) {
      if (!vis[r * kTileN + c]) continue;
      const float a = alpha * w[r * kTileN + c];
      const float* xr = x + c * ldx;
      float* o = out + r * ldo;
      for (int64_t d = 0; d < width; ++d) o[d] += a * xr[d];
    }
}

// out[c, :] += alpha * sum over visible r of w[r, c] * x[r, :]: the transposed form (dk, dv).
void masked_mm_t(int64_t bm, int64_t bn, int64_t width, float alpha, const float* w, const uint8_t* vis,
                 const float* x, int64_t ldx, float* out, int64_t ldo) {
  for (int64_t r = 0; r < bm; ++r)
    for (int64_t c = 0; c < bn; ++c) {
      if (!vis[r * kTileN + c]) continue;
      const float a = alpha * w[r * kTileN + c];
      const float* xr = x + r * ldx;
      float* o = out + c * ldo;
      for (int64_t d = 0; d < width; ++d) o[d] += a * xr[d];
    }
}

// bad[n * H + h] = whether row n, head h of x ([rows, H, width] contiguous fp32) holds an Inf or NaN:
// one contiguous sweep of every head at once. The backward's per-item check of one head's rows (at the
// H * width stride, inside the item) ran at memory latency: perf put its three backward passes at ~4 %
// of softmax fwd+bwd at 1024.
// Whether row[0, width) holds an Inf or NaN.
inline bool nonfinite_row(const float* row, int64_t width) {
  // |x| <= FLT_MAX is false exactly for inf and NaN; an integer OR reduction, so the loop
  // vectorises (std::isfinite's did not: ~4 % of the small model's attention time in perf).
  uint32_t b = 0;
  for (int64_t d = 0; d < width; ++d) b |= !(std::fabs(row[d]) <= std::numeric_limits<float>::max());
  return b != 0;
}

std::vector<uint8_t> nonfinite_rows(const at::Tensor& x) {
  const int64_t n = x.size(0) * x.size(1), width = x.size(2);
  std::vector<uint8_t> bad(n);
  const float* base = x.const_data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) bad[i] = nonfinite_row(base + i * width, width);
  });
  return bad;
}

// flags[t] = whether any of rows [t * block, (t+1) * block) of one item is bad (bad: that item's first
// row's flag in nonfinite_rows, rows at stride H).
void tile_flags(const uint8_t* bad, int64_t L, int64_t H, int64_t block, std::vector<uint8_t>& flags) {
  flags.assign((L + block - 1) / block, 0);
  for (int64_t i = 0; i < L; ++i) flags[i / block] |= bad[i * H];
}

// delta[n * H + h] = sum_d dO[n, h, d] * O[n, h, d] (the softmax backward's row term), one contiguous
// sweep like nonfinite_rows; 8 lanes of partial sums (the scalar loop's 128 dependent adds per row
// were ~2 % of the backward). With bad_dout, also nonfinite_rows(dout) in the same sweep.
std::vector<float> softmax_delta(const at::Tensor& dout, const at::Tensor& out, std::vector<uint8_t>* bad_dout) {
  if (bad_dout != nullptr) bad_dout->resize(dout.size(0) * dout.size(1));
  const int64_t n = dout.size(0) * dout.size(1), width = dout.size(2);
  std::vector<float> delta(n);
  const float* a = dout.const_data_ptr<float>();
  const float* b = out.const_data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* x = a + i * width;
      const float* y = b + i * width;
      float acc = 0.0f;
      int64_t d = 0;
#if GK_ATTENTION_AVX2
      if (width >= 8) {
        __m256 v = _mm256_setzero_ps();
        for (; d + 8 <= width; d += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d), v);
        acc = hsum8(v);
      }
#endif
      for (; d < width; ++d) acc += x[d] * y[d];
      delta[i] = acc;
      if (bad_dout != nullptr) (*bad_dout)[i] = nonfinite_row(x, width);
    }
  });
  return delta;
}

struct Params {
  int64_t H, D, Dv, M;
  bool softmax, causal;
  float scale;
  int64_t contextual_len, max_attn_len;
  const float* pos_bias = nullptr;  // [pos_heads, 2M-1] fp32
  int64_t pos_heads = 0;
  const float* time_bias = nullptr;  // [time_heads, num_buckets+1] fp32
  int64_t time_heads = 0, num_buckets = 0;
  // bucket(dt) = number of thresholds <= |dt| (see bucket_thresholds): a short search instead of a log.
  std::vector<int64_t> bucket_thr;
  // table_bucket's cells (see bucket_cells): 64 binary exponents x 16 mantissa steps of |dt|.
  std::vector<int32_t> cell_bucket;  // the bucket of the cell's smallest |dt|; -1: search thr instead
  std::vector<int64_t> cell_next;    // the cell's one threshold less 1 (INT64_MAX: none in the cell)
  // Both in one 64-bit entry for bucket_row8's one gather: bucket << 52 | min(next, 2^52 - 1) (its |dt|
  // are below 2^52, so the clamp keeps every compare); -1 where cell_bucket is, or the bucket >= 2^11.
  std::vector<int64_t> cell_packed;
  const int64_t* timestamps = nullptr;
  const int64_t* query_timestamps = nullptr;  // tq_i of bucket(tq_i - t_j): timestamps when not given
};

// Ids and the visibility rule of one sequence (generative-recommenders' _get_valid_attn_mask).
struct SeqMask {
  std::vector<int64_t> ids;
  int64_t max_id = 0;
  int64_t len = 0;
  // No contextual prefix and no targets: ids are the positions, and query i sees exactly the keys
  // of window(i) (see there).
  bool banded = false;
  // Causal, no window, a contextual prefix or targets: query i sees exactly the keys [0, prefix_end[i])
  // and itself (see prefix_rows), so a row's pairs need no per-pair visible() either.
  bool prefix = false;
  std::vector<int64_t> prefix_end;
  const Params* p = nullptr;

  void init(const Params& params, int64_t L, int64_t num_targets) {
    p = &params;
    len = L;
    const int64_t c = params.contextual_len;
    banded = c == 0 && num_targets == 0;
    max_id = L - num_targets + (c > 0 ? 1 - c : 0);
    ids.resize(L);
    for (int64_t pos = 0; pos < L; ++pos) {
      const int64_t id = c > 0 ? std::max<int64_t>(pos - c + 1, 0) : pos;
      // With n = 0 the clamp binds only when all ids are equal anyway (L < c - 1): same mask as GR's
      // unclamped ids for num_targets=None.
      ids[pos] = std::min(id, max_id);
    }
    prefix = !banded && params.causal && params.max_attn_len == 0;
    if (prefix) prefix_rows();
  }

  // visible(i, j) for j != i, causal, no window: ids[j] < ids[i] (a prefix of the keys, as ids are
  // nondecreasing), or, for a contextual query (ids[i] == 0), ids[j] < max_id (a prefix too).
  // The first key of id >= ids[i] by a pointer that only moves forward (ids[i] is nondecreasing in i),
  // not a binary search per row (SeqMask::init was ~4 % of the short path's forward, attention_short.h).
  void prefix_rows() {
    prefix_end.resize(len);
    const int64_t* id = ids.data();
    int64_t context_end = 0;  // first key of id >= max_id
    if (p->contextual_len > 0)
      while (context_end < len && id[context_end] < max_id) ++context_end;
    for (int64_t i = 0, j = 0; i < len; ++i) {
      if (id[i] <= 0) {
        prefix_end[i] = context_end;
        continue;
      }
      while (id[j] < id[i]) ++j;  // stops at j <= i
      prefix_end[i] = j;
    }
  }

  bool visible(int64_t i, int64_t j) const {
    if (i == j) return true;
    const int64_t a = ids[i], b = ids[j];
    int64_t d = a - b;
    if (!p->causal) d = d < 0 ? -d : d;
    if (d > 0 && (p->max_attn_len == 0 || d <= p->max_attn_len)) return true;
    return p->contextual_len > 0 && a == 0 && b < max_id;
  }

  // The keys [lo, hi) that query i sees under a banded mask: ids are positions (max_id = L never
  // binds), so visible() reads j == i or 0 < d <= max_attn_len (or any d > 0 when it is 0), with
  // d = i - j, or |i - j| when not causal.
  void window(int64_t i, int64_t& lo, int64_t& hi) const {
    const int64_t mal = p->max_attn_len;
    lo = mal > 0 ? std::max<int64_t>(i - mal, 0) : 0;
    hi = p->causal ? i + 1 : (mal > 0 ? std::min(i + mal + 1, len) : len);
  }

  // 0: no pair of the tile is visible; 2: every pair is; 1: mixed (ask visible()). From the id
  // ranges only (ids are nondecreasing in position), so it costs O(1) per tile.
  int classify(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    const int64_t dmin = ids[i0] - ids[j1 - 1], dmax = ids[i1 - 1] - ids[j0];
    const int64_t mal = p->max_attn_len;
    int64_t lo, hi;  // range of the distance the rule sees (|d| when not causal)
    if (p->causal) {
      lo = dmin;
      hi = dmax;
    } else if (dmin > 0) {
      lo = dmin;
      hi = dmax;
    } else if (dmax < 0) {
      lo = -dmax;
      hi = -dmin;
    } else {
      lo = 0;
      hi = std::max(-dmin, dmax);
    }
    if (lo > 0 && (mal == 0 || hi <= mal)) return 2;
    const bool diag = i0 < j1 && j0 < i1;
    const bool distance = hi > 0 && (mal == 0 || std::max<int64_t>(lo, 1) <= mal);
    const bool context = p->contextual_len > 0 && ids[i0] == 0 && ids[j0] < max_id;
    return (diag || distance || context) ? 1 : 0;
  }
};

// The columns [begin, end) of one row of a tile outside which no pair is visible, the columns
// [hole_begin, hole_end) within it that are not visible either (a prefix mask's keys between the
// prefix and the query itself: a target's other targets), and whether the remaining pairs still need
// their vis flag asked (a mixed tile of any other mask). Callers compute the whole span (vectorised)
// and then zero the hole.
struct RowSpan {
  int64_t begin, end, hole_begin, hole_end;
  bool ask;
};

RowSpan row_span(const SeqMask& mask, int tile_kind, int64_t i, int64_t j0, int64_t bn) {
  if (tile_kind == 2) return {0, bn, 0, 0, false};
  if (mask.prefix) {
    const int64_t hi = mask.prefix_end[i];
    const int64_t end = std::clamp<int64_t>((i >= hi ? i + 1 : hi) - j0, 0, bn);
    const int64_t hole_begin = std::clamp<int64_t>(hi - j0, 0, end);
    return {0, end, hole_begin, i > hi ? std::clamp<int64_t>(i - j0, hole_begin, end) : hole_begin, false};
  }
  if (!mask.banded) return {0, bn, 0, 0, true};
  int64_t lo, hi;
  mask.window(i, lo, hi);
  lo = std::clamp<int64_t>(lo - j0, 0, bn);
  return {lo, std::clamp<int64_t>(hi - j0, lo, bn), 0, 0, false};
}

// A mixed tile of a banded or prefix mask (causal: the diagonal tiles) is about half invisible. Its
// products run in strips of kStrip rows (Q K^T, dO V^T, P V, dS K: each row strip over the keys its
// rows see) or kStrip keys (P^T dO, dS^T Q: each key strip over the rows that see it), so a causal
// diagonal tile computes 1/2 + 1/8 of a full tile's pairs instead of all of them. The values outside
// a strip's extent are never read (the row loops fill them), so the extents only bound the products.
// 64: in a 256 x 256 diagonal tile, 32-row strips' products (M = 32) ran slower than 64-row ones
// that compute 1/16 of the tile more (MKL, 1 thread: Q K^T 141 vs 106 us, P V 121 vs 94 us).
constexpr int64_t kStrip = 64;

struct TileExtents {
  bool split = false;  // false: each product runs over the whole tile
  // Row strip s (rows [s * kStrip, (s + 1) * kStrip)) needs keys [col_lo[s], col_hi[s]); key strip t
  // needs rows [row_lo[t], row_hi[t]). Empty (lo >= hi) when nothing in the strip is visible.
  int64_t col_lo[kTileM / kStrip], col_hi[kTileM / kStrip];
  int64_t row_lo[kTileN / kStrip], row_hi[kTileN / kStrip];

  void init(const SeqMask& mask, int tile_kind, int64_t i0, int64_t bm, int64_t j0, int64_t bn) {
    split = tile_kind == 1 && (mask.banded || mask.prefix);
    if (!split) return;
    std::fill(std::begin(col_lo), std::end(col_lo), bn);
    std::fill(std::begin(col_hi), std::end(col_hi), int64_t{0});
    std::fill(std::begin(row_lo), std::end(row_lo), bm);
    std::fill(std::begin(row_hi), std::end(row_hi), int64_t{0});
    for (int64_t r = 0; r < bm; ++r) {
      const RowSpan span = row_span(mask, tile_kind, i0 + r, j0, bn);
      if (span.begin >= span.end) continue;
      const int64_t s = r / kStrip;
      col_lo[s] = std::min(col_lo[s], span.begin);
      col_hi[s] = std::max(col_hi[s], span.end);
      for (int64_t t = span.begin / kStrip; t <= (span.end - 1) / kStrip; ++t) {
        row_lo[t] = std::min(row_lo[t], r);
        row_hi[t] = std::max(row_hi[t], r + 1);
      }
    }
  }

  // fn(r0, r1, c0, c1) for each row strip's block (the whole tile when not split).
  template <typename Fn>
  void row_strips(int64_t bm, int64_t bn, Fn fn) const {
    if (!split) return fn(int64_t{0}, bm, int64_t{0}, bn);
    for (int64_t s = 0; s * kStrip < bm; ++s)
      if (col_lo[s] < col_hi[s]) fn(s * kStrip, std::min(bm, (s + 1) * kStrip), col_lo[s], col_hi[s]);
  }

  // fn(r0, r1, c0, c1) for each key strip's block (the whole tile when not split).
  template <typename Fn>
  void key_strips(int64_t bm, int64_t bn, Fn fn) const {
    if (!split) return fn(int64_t{0}, bm, int64_t{0}, bn);
    for (int64_t t = 0; t * kStrip < bn; ++t)
      if (row_lo[t] < row_hi[t]) fn(row_lo[t], row_hi[t], t * kStrip, std::min(bn, (t + 1) * kStrip));
  }
};

inline int32_t time_bucket(const Params& p, int64_t dt) {
  const int64_t x = dt < 0 ? -dt : dt;
  return static_cast<int32_t>(std::upper_bound(p.bucket_thr.begin(), p.bucket_thr.end(), x) - p.bucket_thr.begin());
}

// The cell of |dt| = x >= 0: its binary exponent e (x = 0 and 1 share cell 0) and the 4 bits after its
// leading one, as e * 16 + m. A cell spans 1/16 of an octave (a single integer below 16), and the log
// buckets are 0.301 / ln 2 = 0.43 octave wide, so a cell holds at most one threshold (the clamped
// INT64_MAX ones excepted: bucket_cells sends those cells to the search).
inline int64_t bucket_cell(uint64_t x) {
  const int e = 63 - __builtin_clzll(x | 1);
  const uint64_t m = e >= 4 ? x >> (e - 4) : x << (4 - e);
  return e * 16 + static_cast<int64_t>(m & 15);
}

// The cells' tables of Params from its thresholds: cell_bucket[c] = the number of thresholds <= the
// cell's smallest x, cell_next[c] = its threshold in (smallest, largest] less 1. A cell with more than one
// threshold (or none of whose x is an int64) gets -1.
void bucket_cells(Params& p) {
  const auto& thr = p.bucket_thr;
  const auto count_at_most_x = [&](uint64_t x) {
    return static_cast<int64_t>(std::upper_bound(thr.begin(), thr.end(), x,
                                                 [](uint64_t a, int64_t t) { return a < static_cast<uint64_t>(t); }) -
                                thr.begin());
  };
  p.cell_bucket.assign(64 * 16, -1);
  p.cell_next.assign(64 * 16, std::numeric_limits<int64_t>::max());
  for (int e = 0; e < 63; ++e)
    for (uint64_t m = 0; m < 16; ++m) {
      uint64_t lo, hi;
      if (e >= 4) {
        lo = (uint64_t{16} + m) << (e - 4);
        hi = lo + (uint64_t{1} << (e - 4)) - 1;
      } else {
        if (m % (uint64_t{16} >> e) != 0) continue;  // no x has these bits
        lo = hi = (uint64_t{1} << e) + (m >> (4 - e));
      }
      if (e == 0) lo = 0;  // x = 0 and 1
      const int64_t c = e * 16 + static_cast<int64_t>(m);
      const int64_t below = count_at_most_x(lo), within = count_at_most_x(hi) - below;
      if (within > 1) continue;
      p.cell_bucket[c] = static_cast<int32_t>(below);
      if (within == 1) p.cell_next[c] = thr[below] - 1;
    }
  constexpr int64_t kLow52 = (int64_t{1} << 52) - 1;
  p.cell_packed.assign(64 * 16, -1);
  for (int64_t c = 0; c < 64 * 16; ++c)
    if (p.cell_bucket[c] >= 0 && p.cell_bucket[c] < 2048)
      p.cell_packed[c] = (int64_t{p.cell_bucket[c]} << 52) | std::min(p.cell_next[c], kLow52);
}

// time_bucket by bucket_cells' tables: a table read and one compare instead of a search or a walk
// (the walk cost ~half of the GEM model's attention forward: its |dt| cross a bucket every few keys).
inline int32_t table_bucket(const Params& p, int64_t dt) {
  const uint64_t x = dt < 0 ? uint64_t{0} - static_cast<uint64_t>(dt) : static_cast<uint64_t>(dt);
  const int64_t c = bucket_cell(x);
  const int32_t b = p.cell_bucket[c];
  if (b < 0) return time_bucket(p, dt);  // x >= 2^63 (|INT64_MIN|) lands here too: e = 63
  return b + (static_cast<int64_t>(x) > p.cell_next[c] ? 1 : 0);
}

// Per-thread scratch: score, probability and mask tiles, accumulators.
struct Workspace {
  std::vector<float> s, pr, dp, acc, acc2, row_max, row_sum;
  std::vector<float> k_rows, v_rows;  // the backward's item keys and values, contiguous
  std::vector<float> dq_rows;         // the backward's item dq, contiguous (see there)
  std::vector<uint8_t> vis;
  std::vector<uint8_t> bad_q, bad_k, bad_v, bad_do;  // per tile of the item: rows with an Inf or NaN
  std::vector<int32_t> bucket;  // time bucket of every pair of the tile (when time_bias is given)
  SeqMask mask;
  // Sized for the short path (kBlockN x kBlockN); for_tiles grows it for the general path's tiles,
  // so that a batch of short sequences does not zero-fill the larger tiles on every call.
  Workspace(int64_t D, int64_t Dv)
      : s(kBlockN * kBlockN), pr(kBlockN * kBlockN), dp(kBlockN * kBlockN), acc(kBlockN * std::max(D, Dv)),
        acc2(kBlockN * std::max(D, Dv)), row_max(kBlockN), row_sum(kBlockN), vis(kBlockN * kBlockN),
        bucket(kBlockN * kBlockN) {}
  void for_tiles(int64_t D, int64_t Dv) {
    for (auto* t : {&s, &pr, &dp}) t->resize(kTileM * kTileN);
    acc.resize(std::max(kTileM, kTileN) * std::max(D, Dv));
    acc2.resize(kTileN * std::max(D, Dv));
    row_max.resize(kTileM);
    row_sum.resize(kTileM);
    vis.resize(kTileM * kTileN);
    bucket.resize(kTileM * kTileN);
  }
};

// s[r, c] <- s[r, c] + biases (the Q K^T product applied the scale as its alpha), and the
// visibility of every pair (when the tile is mixed).
// Returns whether the biases are present (the caller masks only mixed tiles).
void scores_tile(const Params& p, const SeqMask& mask, Workspace& ws, int64_t start, int64_t h, int64_t i0,
                 int64_t bm, int64_t j0, int64_t bn, int tile_kind) {
  float* s = ws.s.data();
  for (int64_t r = 0; r < bm; ++r) {
    float* row = s + r * kTileN;
    // Only the row's span: every caller zeroes (or never reads) the scores outside it, so a causal
    // tile pays the biases for its visible half alone.
    const RowSpan span = row_span(mask, tile_kind, i0 + r, j0, bn);
    const int64_t c0 = span.begin, c1 = span.end;
    if (p.pos_bias != nullptr) {
      const int64_t hb = p.pos_heads == 1 ? 0 : h;
      // j - i + M - 1 for j = j0 + c, i = i0 + r: a contiguous run of pos_bias.
      const float* bias = p.pos_bias + hb * (2 * p.M - 1) + (j0 - (i0 + r) + p.M - 1);
      for (int64_t c = c0; c < c1; ++c) row[c] += bias[c];
    }
    if (p.time_bias != nullptr) {
      const int64_t hb = p.time_heads == 1 ? 0 : h;
      const float* bias = p.time_bias + hb * (p.num_buckets + 1);
      const int64_t ti = p.query_timestamps[start + i0 + r];
      int32_t* buckets = ws.bucket.data() + r * kTileN;
      // Walk the bucket from the previous key's: exact for any timestamps, and ~free when they are
      // sorted (|t_i - t_j| then moves monotonically and rarely crosses a threshold).
      const int64_t* thr = p.bucket_thr.data();
      const int32_t nb = static_cast<int32_t>(p.num_buckets);
      const int64_t* tj = p.timestamps + start + j0;
      int32_t bkt = c1 > c0 ? time_bucket(p, ti - tj[c0]) : 0;
      const auto walk = [&](int64_t c) { walk_time_bucket(ti, tj[c], thr, nb, bias, bkt, buckets + c, row + c); };
      int64_t c = c0;
#if GK_ATTENTION_AVX2
      if (c1 - c0 >= kAvx512MinRow && cpu_has_avx512f())
        c = time_bias_keys16(ti, tj, c, c1, thr, nb, bias, bkt, buckets, row);
      // 8 keys at a time: when all 8 stay in the current bucket (the common case), one compare of
      // their |dt| against its two thresholds replaces 8 scalar walks, and its bias is added as one
      // broadcast instead of 8 dependent gathers; any other block takes the scalar walk.
      const __m256i vti = _mm256_set1_epi64x(ti), zero = _mm256_setzero_si256();
      const auto abs_dt = [&](const int64_t* t) {
        const __m256i d = _mm256_sub_epi64(vti, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
        return _mm256_blendv_epi8(d, _mm256_sub_epi64(zero, d), _mm256_cmpgt_epi64(zero, d));
      };
      for (; c + 8 <= c1; c += 8) {
        const __m256i lo = _mm256_set1_epi64x(bkt > 0 ? thr[bkt - 1] : std::numeric_limits<int64_t>::min());
        const __m256i hi = _mm256_set1_epi64x(bkt < nb ? thr[bkt] : std::numeric_limits<int64_t>::max());
        const __m256i x0 = abs_dt(tj + c), x1 = abs_dt(tj + c + 4);
        // lo <= x < hi in every lane; the edge cases (x = INT64_MAX, a wrapped |INT64_MIN|, empty
        // buckets) fail it or agree with the walk, which decides them as before.
        const __m256i in0 = _mm256_andnot_si256(_mm256_cmpgt_epi64(lo, x0), _mm256_cmpgt_epi64(hi, x0));
        const __m256i in1 = _mm256_andnot_si256(_mm256_cmpgt_epi64(lo, x1), _mm256_cmpgt_epi64(hi, x1));
        if (_mm256_movemask_epi8(_mm256_and_si256(in0, in1)) == -1) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(buckets + c), _mm256_set1_epi32(bkt));
          _mm256_storeu_ps(row + c, _mm256_add_ps(_mm256_loadu_ps(row + c), _mm256_set1_ps(bias[bkt])));
        } else {
          for (int64_t k = c; k < c + 8; ++k) walk(k);
        }
      }
#endif
      for (; c < c1; ++c) walk(c);
    }
    if (tile_kind == 1) {
      uint8_t* vis = ws.vis.data() + r * kTileN;
      if (span.ask) {
        for (int64_t c = 0; c < bn; ++c) vis[c] = mask.visible(i0 + r, j0 + c) ? 1 : 0;
      } else {  // the masked products' slow path still reads vis
        std::fill(vis, vis + span.begin, uint8_t{0});
        std::fill(vis + span.begin, vis + span.end, uint8_t{1});
        std::fill(vis + span.end, vis + bn, uint8_t{0});
        std::fill(vis + span.hole_begin, vis + span.hole_end, uint8_t{0});
      }
    }
  }
}

struct SeqInfo {
  int64_t start, len, targets;
};

std::vector<SeqInfo> sequences(const at::Tensor& offsets, const c10::optional<at::Tensor>& num_targets) {
  const auto off = offsets.to(at::kLong);
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t B = offsets.numel() - 1;
  at::Tensor nt;
  if (num_targets.has_value()) nt = num_targets->to(at::kLong).contiguous();
  std::vector<SeqInfo> seqs(B);
  for (int64_t b = 0; b < B; ++b) {
    seqs[b] = {o[b], o[b + 1] - o[b], nt.defined() ? nt.data_ptr<int64_t>()[b] : 0};
    TORCH_CHECK(seqs[b].len >= 0, "seq_offsets must be nondecreasing");
    TORCH_CHECK(seqs[b].targets >= 0 && seqs[b].targets <= seqs[b].len, "num_targets[", b, "] out of range");
  }
  return seqs;
}

// Runs fn(item, workspace) over items b * H + h, longest sequences first, on every thread.
// `queries`: query rows per sequence (its last ones), 0 = every row; only the thread count depends on it.
template <typename Fn>
void for_each_item(const std::vector<SeqInfo>& seqs, const Params& p, Fn fn, int64_t queries = 0) {
  const int64_t num_items = static_cast<int64_t>(seqs.size()) * p.H;
  std::vector<int64_t> order(num_items);
  int64_t max_len = 0;
  for (const auto& s : seqs) max_len = std::max(max_len, s.len);
  if (max_len <= 4 * num_items + 1024) {
    // A counting sort by length: the same order as the stable_sort below, in O(items + max_len)
    // (the merge sort of the model's 512 items was ~2 % of its short forward, attention_short.h).
    std::vector<int64_t> next(max_len + 2, 0);  // next[max_len - len]: where the items of len go
    for (const auto& s : seqs) next[max_len - s.len + 1] += p.H;
    for (int64_t k = 1; k <= max_len + 1; ++k) next[k] += next[k - 1];
    for (int64_t item = 0; item < num_items; ++item) order[next[max_len - seqs[item / p.H].len]++] = item;
  } else {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return seqs[x / p.H].len > seqs[y / p.H].len; });
  }
  // Small batches run on fewer threads: a parallel region costs a wake-up of every thread (and, on a
  // loaded machine, waiting for a descheduled one), worth it only past ~2^24 FLOPs per thread.
  double flops = 0.0;
  for (const auto& s : seqs)
    flops += 2.0 * static_cast<double>(queries > 0 ? queries : s.len) * s.len * p.H * (p.D + p.Dv);
  const int64_t by_work = static_cast<int64_t>(flops / static_cast<double>(1 << 24)) + 1;
  parallel_ranges(num_items, 1, by_work, [&](auto& claim) {
    const SingleThreadBlas single_thread;
    // The workspace outlives the call on its thread while it holds short-path tiles only (a call of
    // short sequences otherwise zero-fills and frees ~300 KB of tiles each time); the general path's
    // larger tiles are freed at the end of the call, as before. Its contents are stale either way
    // (every item already starts from the previous item's), and each path sizes the buffers whose
    // size depends on D and Dv before it uses them (for_tiles; the short backward's dk and dv rows).
    thread_local std::unique_ptr<Workspace> kept;
    std::unique_ptr<Workspace> ws = kept != nullptr ? std::move(kept) : std::make_unique<Workspace>(p.D, p.Dv);
    for (int64_t idx, end; claim(idx, end);) fn(order[idx], *ws);
    if (ws->s.size() <= static_cast<size_t>(kBlockN * kBlockN)) kept = std::move(ws);
  });
}

Params make_params(const at::Tensor& q, const at::Tensor& v, int64_t max_seq_len, c10::string_view kind, bool causal,
                   double scale, int64_t contextual_len, int64_t max_attn_len, const at::Tensor& pos_bias,
                   const at::Tensor& time_bias, const at::Tensor& timestamps,
                   const at::Tensor& query_timestamps) {
  attention_checks::biases(pos_bias, time_bias, timestamps, query_timestamps, q.size(1), q.size(0), max_seq_len);
  Params p;
  p.H = q.size(1);
  p.D = q.size(2);
  p.Dv = v.size(2);
  p.M = max_seq_len;
  p.softmax = kind == "softmax";
  p.causal = causal;
  p.scale = static_cast<float>(scale);
  p.contextual_len = contextual_len;
  p.max_attn_len = max_attn_len;
  if (pos_bias.defined()) {
    p.pos_bias = pos_bias.data_ptr<float>();
    p.pos_heads = pos_bias.size(0);
  }
  if (time_bias.defined()) {
    p.time_bias = time_bias.data_ptr<float>();
    p.time_heads = time_bias.size(0);
    p.num_buckets = time_bias.size(1) - 1;
    p.bucket_thr = bucket_thresholds(p.num_buckets);
    bucket_cells(p);
    p.timestamps = timestamps.data_ptr<int64_t>();
    p.query_timestamps = query_timestamps.defined() ? query_timestamps.data_ptr<int64_t>() : p.timestamps;
  }
  return p;
}

at::Tensor as_float(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  GK_CHECK_CPU((*t));
  return t->to(at::kFloat).contiguous();
}

at::Tensor as_long(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  GK_CHECK_CPU((*t));
  return t->to(at::kLong).contiguous();
}

// What the forward and the backward both start from: q, k, v and the biases as contiguous fp32,
// the timestamps as int64, the parameters, and the sequences (checked against N and max_seq_len).
// Params points into these tensors, so it lives beside them.
struct Prepared {
  at::Tensor q, k, v, pos_bias, time_bias, timestamps, query_timestamps;
  Params p;
  std::vector<SeqInfo> seqs;
  int64_t N = 0;      // rows of k and v (every sequence's rows)
  int64_t delta = 0;  // the cached forward: q holds the last delta rows of every sequence; 0: q has N rows
  std::vector<uint8_t> bad_v;  // nonfinite_rows(v), filled by forward()
};

Prepared prepare(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                 const at::Tensor& seq_offsets, int64_t max_seq_len, c10::string_view kind, bool causal,
                 double scale, const c10::optional<at::Tensor>& num_targets, int64_t contextual_len,
                 int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
                 const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
                 const c10::optional<at::Tensor>& query_timestamps_in, int64_t delta = 0) {
  Prepared in;
  in.delta = delta;
  in.q = q_in.to(at::kFloat).contiguous();
  in.k = k_in.to(at::kFloat).contiguous();
  in.v = v_in.to(at::kFloat).contiguous();
  in.pos_bias = as_float(pos_bias_in);
  in.time_bias = as_float(time_bias_in);
  in.timestamps = as_long(timestamps_in);
  in.query_timestamps = as_long(query_timestamps_in);
  in.p = make_params(in.k, in.v, max_seq_len, kind, causal, scale, contextual_len, max_attn_len, in.pos_bias,
                     in.time_bias, in.timestamps, in.query_timestamps);
  in.seqs = sequences(seq_offsets, num_targets);
  in.N = in.k.size(0);
  for (const auto& s : in.seqs) {
    TORCH_CHECK(s.start + s.len <= in.N, "seq_offsets out of range");
    TORCH_CHECK(s.len <= max_seq_len, "a sequence is longer than max_seq_len");
    TORCH_CHECK_VALUE(s.len >= delta, "every sequence must hold its delta = ", delta, " query rows");
  }
  return in;
}

// One work item: head h of one sequence (rows [start, start + L)); its query rows are [q_lo, L)
// (q_lo = L - delta in the cached forward, else 0) and live in q from row q_row0 on; q0, k0, v0 point
// at the item's first query row, key row and value row (row strides H * D and H * Dv).
struct Item {
  int64_t h, start, L, q_lo, q_row0;
  const float *q0, *k0, *v0;
};

// Fills `it` and the workspace's mask for item b * H + h; false when the sequence is empty.
bool begin_item(const Prepared& in, int64_t item, Workspace& ws, Item& it) {
  const Params& p = in.p;
  const SeqInfo& seq = in.seqs[item / p.H];
  if (seq.len == 0) return false;
  ws.for_tiles(p.D, p.Dv);
  it.h = item % p.H;
  it.start = seq.start;
  it.L = seq.len;
  it.q_lo = in.delta > 0 ? seq.len - in.delta : 0;
  it.q_row0 = in.delta > 0 ? item / p.H * in.delta : seq.start;
  it.q0 = in.q.const_data_ptr<float>() + (it.q_row0 * p.H + it.h) * p.D;
  it.k0 = in.k.const_data_ptr<float>() + (seq.start * p.H + it.h) * p.D;
  it.v0 = in.v.const_data_ptr<float>() + (seq.start * p.H + it.h) * p.Dv;
  ws.mask.init(p, seq.len, seq.targets);
  return true;
}

#include "attention_short.h"  // the short-sequence path: short_path, forward_seq_short, backward_seq_short

// Whether every sequence takes the short path, which needs no nonfinite-row flags (it multiplies
// visible pairs only) and writes every row of its outputs and gradients.
bool all_short(const Prepared& in) {
  return std::all_of(in.seqs.begin(), in.seqs.end(), [&](const SeqInfo& s) { return short_path(in, s); });
}

// Whether the sequences cover rows [0, N) (seq_offsets may start past 0 or end before N).
bool covers_rows(const Prepared& in) {
  if (in.seqs.empty()) return in.N == 0;
  return in.seqs.front().start == 0 && in.seqs.back().start + in.seqs.back().len == in.N;
}

#if GK_ATTENTION_AVX2
// The position and time biases of row r (query i0 + r, keys from j0) of item `it`, for the fused rows.
struct RowBiases {
  const float* pos = nullptr;   // pos_bias at key j0 (index c of the row), null without a position bias
  const float* time = nullptr;  // the head's time_bias row, null without one
  const int64_t* tj = nullptr;  // the keys' timestamps from key j0
  int64_t ti = 0;
  int32_t bkt = 0;  // the bucket of key c0

  RowBiases(const Params& p, const Item& it, int64_t i, int64_t j0, int64_t c0) {
    if (p.pos_bias != nullptr)
      pos = p.pos_bias + (p.pos_heads == 1 ? 0 : it.h) * (2 * p.M - 1) + (j0 - i + p.M - 1);
    if (p.time_bias != nullptr) {
      time = p.time_bias + (p.time_heads == 1 ? 0 : it.h) * (p.num_buckets + 1);
      tj = p.timestamps + it.start + j0;
      ti = p.query_timestamps[it.start + i];
      bkt = time_bucket(p, ti - tj[c0]);
    }
  }
};

// The HSTU forward's scores_tile and row loop in one pass a row (AVX-512F, hstu_fwd_row16): the biases
// and the SiLU of a row while it is in L1, instead of a bias pass and a SiLU pass over the 256 KiB tile.
// The same weights, vis flags and zeros as that form.
void hstu_fwd_rows(const Params& p, Workspace& ws, const Item& it, int64_t i0, int64_t bm, int64_t j0, int64_t bn,
                   int tile_kind, float inv_m) {
  const SeqMask& mask = ws.mask;
  for (int64_t r = 0; r < bm; ++r) {
    float* row = ws.s.data() + r * kTileN;
    const RowSpan span = row_span(mask, tile_kind, i0 + r, j0, bn);
    std::fill(row, row + span.begin, 0.0f);
    std::fill(row + span.end, row + bn, 0.0f);
    if (span.begin < span.end) {
      const RowBiases b(p, it, i0 + r, j0, span.begin);
      hstu_fwd_row16(row, span.begin, span.end, b.pos, b.ti, b.tj, p.bucket_thr.data(),
                     static_cast<int32_t>(p.num_buckets), b.time, b.bkt, inv_m);
    }
    if (tile_kind == 1) {
      uint8_t* vis = ws.vis.data() + r * kTileN;
      if (span.ask) {
        for (int64_t c = 0; c < bn; ++c) vis[c] = mask.visible(i0 + r, j0 + c) ? 1 : 0;
        for (int64_t c = span.begin; c < span.end; ++c) row[c] = vis[c] ? row[c] : 0.0f;
      } else {  // the masked products' slow path still reads vis
        std::fill(vis, vis + span.begin, uint8_t{0});
        std::fill(vis + span.begin, vis + span.end, uint8_t{1});
        std::fill(vis + span.end, vis + bn, uint8_t{0});
        std::fill(vis + span.hole_begin, vis + span.hole_end, uint8_t{0});
      }
    }
    std::fill(row + span.hole_begin, row + span.hole_end, 0.0f);
  }
}

// The HSTU backward's scores_tile and row loop in one pass a row (AVX-512F, hstu_bwd_row16), for a tile
// whose rows are each one run of visible keys (no per-pair flags, no hole: full tiles, causal or banded
// diagonal ones); false, having done nothing, for any other tile. P, dS (dP in ws.dp on entry), the vis
// flags, the position gradient and the time-bias gradient as that form's.
bool hstu_bwd_rows(const Params& p, Workspace& ws, const Item& it, int64_t i0, int64_t bm, int64_t j0, int64_t bn,
                   int tile_kind, float inv_m, float* pos_part_item, float* time_part_item) {
  const SeqMask& mask = ws.mask;
  RowSpan spans[kTileM];
  for (int64_t r = 0; r < bm; ++r) {
    spans[r] = row_span(mask, tile_kind, i0 + r, j0, bn);
    if (spans[r].ask || spans[r].hole_begin != spans[r].hole_end) return false;
  }
  for (int64_t r = 0; r < bm; ++r) {
    const float* row = ws.s.data() + r * kTileN;
    float* prow = ws.pr.data() + r * kTileN;
    float* drow = ws.dp.data() + r * kTileN;
    const int64_t c0 = spans[r].begin, c1 = spans[r].end;
    std::fill(prow, prow + c0, 0.0f);
    std::fill(prow + c1, prow + bn, 0.0f);
    std::fill(drow, drow + c0, 0.0f);
    std::fill(drow + c1, drow + bn, 0.0f);
    if (tile_kind == 1) {
      uint8_t* vis = ws.vis.data() + r * kTileN;
      std::fill(vis, vis + c0, uint8_t{0});
      std::fill(vis + c0, vis + c1, uint8_t{1});
      std::fill(vis + c1, vis + bn, uint8_t{0});
    }
    if (c0 >= c1) continue;
    const RowBiases b(p, it, i0 + r, j0, c0);
    int32_t* buckets = ws.bucket.data() + r * kTileN;
    // j - i + L - 1 in [0, 2L-2] within the item's slots.
    float* pos_grad = pos_part_item != nullptr ? pos_part_item + (j0 - (i0 + r) + it.L - 1) : nullptr;
    hstu_bwd_row16(row, prow, drow, c0, c1, b.pos, pos_grad, b.ti, b.tj, p.bucket_thr.data(),
                   static_cast<int32_t>(p.num_buckets), b.time, b.bkt, buckets, inv_m);
    if (time_part_item != nullptr) add_by_bucket(buckets + c0, drow + c0, c1 - c0, time_part_item);
  }
  return true;
}
inline bool fused_rows_available() { return cpu_has_avx512f(); }
#else
// Builds without AVX2 take scores_tile's passes.
inline bool fused_rows_available() { return false; }
void hstu_fwd_rows(const Params&, Workspace&, const Item&, int64_t, int64_t, int64_t, int64_t, int, float) {}
bool hstu_bwd_rows(const Params&, Workspace&, const Item&, int64_t, int64_t, int64_t, int64_t, int, float, float*,
                   float*) {
  return false;
}
#endif

// The forward of one item for its query rows [q_lo, L): every row in the full forward, the last
// delta rows in the cached one. A query row keeps its position i in the sequence (the mask, pos_bias
// and timestamps see i); it reads q row and writes out (and lse) row q_row0 + i - q_lo.
void forward_item(const Prepared& in, const Item& it, Workspace& ws, float* op, float* lp, bool stream) {
  const Params& p = in.p;
  const int64_t q_lo = it.q_lo, out_row0 = it.q_row0;
  const float* q_rows = it.q0;
  const int64_t H = p.H, D = p.D, Dv = p.Dv;
  const float inv_m = p.M > 0 ? 1.0f / static_cast<float>(p.M) : 0.0f;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t L = it.L, h = it.h;
  float* s = ws.s.data();
  float* acc = ws.acc.data();
  static_assert(kTileM == kTileN, "one tile grid for the nonfinite flags of rows and keys");
  tile_flags(in.bad_v.data() + it.start * H + h, L, H, kTileN, ws.bad_v);
  // Q K^T on contiguous key rows, as in the backward (see there). Not in the cached forward: its few
  // query rows would pay the copy of every key row.
  const float* k_rows = it.k0;
  int64_t k_ld = H * D;
  if (q_lo == 0) {
    ws.k_rows.resize(L * D);
    for (int64_t j = 0; j < L; ++j) std::copy(it.k0 + j * H * D, it.k0 + j * H * D + D, ws.k_rows.data() + j * D);
    k_rows = ws.k_rows.data();
    k_ld = D;
  }
  const bool fused_rows = !p.softmax && fused_rows_available();  // HSTU's rows in one pass (hstu_fwd_rows)
  for (int64_t i0 = q_lo; i0 < L; i0 += kTileM) {
    const int64_t bm = std::min(kTileM, L - i0);
    std::fill(acc, acc + bm * Dv, 0.0f);
    std::fill(ws.row_max.begin(), ws.row_max.end(), neg_inf);
    std::fill(ws.row_sum.begin(), ws.row_sum.end(), 0.0f);
    for (int64_t j0 = 0; j0 < L; j0 += kTileN) {
      const int64_t bn = std::min(kTileN, L - j0);
      const int tile_kind = ws.mask.classify(i0, i0 + bm, j0, j0 + bn);
      if (tile_kind == 0) continue;
      TileExtents ext;
      ext.init(ws.mask, tile_kind, i0, bm, j0, bn);
      ext.row_strips(bm, bn, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
        mm(false, true, r1 - r0, c1 - c0, D, p.scale, q_rows + (i0 - q_lo + r0) * H * D, H * D, k_rows + (j0 + c0) * k_ld,
           k_ld, 0.0f, s + r0 * kTileN + c0, kTileN);
      });
      if (fused_rows) {
        hstu_fwd_rows(p, ws, it, i0, bm, j0, bn, tile_kind, inv_m);
      } else {
        scores_tile(p, ws.mask, ws, it.start, h, i0, bm, j0, bn, tile_kind);
        for (int64_t r = 0; r < bm; ++r) {
          float* row = s + r * kTileN;
          const uint8_t* vis = ws.vis.data() + r * kTileN;
          const RowSpan span = row_span(ws.mask, tile_kind, i0 + r, j0, bn);
          // Outside the span the weights are 0 (the P V product takes the whole tile).
          std::fill(row, row + span.begin, 0.0f);
          std::fill(row + span.end, row + bn, 0.0f);
          if (p.softmax) {
            std::fill(row + span.hole_begin, row + span.hole_end, neg_inf);
            if (span.ask)
              for (int64_t c = span.begin; c < span.end; ++c) row[c] = vis[c] ? row[c] : neg_inf;
            const float new_max = max_keep_nan(ws.row_max[r], row_max(row + span.begin, span.end - span.begin));
            if (new_max == neg_inf) continue;  // nothing visible in this row yet
            const float alpha = ws.row_max[r] == neg_inf ? 0.0f : fast_exp(ws.row_max[r] - new_max);
            const float sum = exp_shifted_sum(row + span.begin, span.end - span.begin, new_max);
            ws.row_sum[r] = ws.row_sum[r] * alpha + sum;
            ws.row_max[r] = new_max;
            if (alpha != 1.0f) {
              float* a = acc + r * Dv;
              for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
            }
          } else {
            silu_row(row + span.begin, span.end - span.begin, inv_m);
            if (span.ask)
              for (int64_t c = span.begin; c < span.end; ++c) row[c] = vis[c] ? row[c] : 0.0f;
            std::fill(row + span.hole_begin, row + span.hole_end, 0.0f);
          }
        }
      }
      if (p.softmax) {
        // Rows with nothing visible yet hold -inf scores: zero them before the product.
        for (int64_t r = 0; r < bm; ++r)
          if (ws.row_max[r] == neg_inf)
            std::fill(s + r * kTileN, s + r * kTileN + bn, 0.0f);
      }
      if (tile_kind == 1 && ws.bad_v[j0 / kTileN])
        masked_mm(bm, bn, Dv, 1.0f, s, ws.vis.data(), it.v0 + j0 * H * Dv, H * Dv, acc, Dv);
      else
        ext.row_strips(bm, bn, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
          mm(false, false, r1 - r0, Dv, c1 - c0, 1.0f, s + r0 * kTileN + c0, kTileN, it.v0 + (j0 + c0) * H * Dv,
             H * Dv, 1.0f, acc + r0 * Dv, Dv);
        });
    }
    for (int64_t r = 0; r < bm; ++r) {
      const int64_t row_out = out_row0 + i0 - q_lo + r;
      float* a = acc + r * Dv;
      if (p.softmax) {
        // l == 0: every visible score is -inf (or none is visible): out 0, lse -inf. A NaN l stays NaN.
        const float l = ws.row_sum[r];
        const float inv = l == 0.0f ? 0.0f : 1.0f / l;
        for (int64_t d = 0; d < Dv; ++d) a[d] *= inv;
        lp[row_out * H + h] = l == 0.0f ? neg_inf : ws.row_max[r] + std::log(l);
      }
      copy_bytes(op + (row_out * H + h) * Dv, a, Dv * sizeof(float), stream);
    }
  }
  streaming_store_fence();
}

// out [rows, H, Dv] in `dtype` and fp32 lse [rows, H] (softmax; [0] for hstu), rows = q's rows.
std::tuple<at::Tensor, at::Tensor> forward(Prepared& in, at::ScalarType dtype) {
  if (!all_short(in)) in.bad_v = nonfinite_rows(in.v);
  const Params& p = in.p;
  const int64_t rows = in.q.size(0), H = p.H, Dv = p.Dv;
  auto out = at::empty({rows, H, Dv}, in.q.options());
  auto lse = p.softmax ? at::empty({rows, H}, in.q.options()) : at::empty({0}, in.q.options());
  float* op = out.data_ptr<float>();
  float* lp = p.softmax ? lse.data_ptr<float>() : nullptr;
  const bool stream = out.nbytes() >= kStreamRowsMinBytes;
  const BucketPlan buckets = in.delta == 0 ? bucket_plan(in) : BucketPlan{};
  for_each_item(in.seqs, p, [&](int64_t item, Workspace& ws) {
    // A short sequence is one item of all its heads (they share its mask and time buckets): its item
    // of head 0 runs it, the others have nothing to do.
    const SeqInfo& seq = in.seqs[item / H];
    if (short_path(in, seq)) {
      if (item % H == 0) forward_seq_short(in, seq, ws, op, buckets.of(item / H));
      return;
    }
    Item it;
    if (begin_item(in, item, ws, it)) forward_item(in, it, ws, op, lp, stream);
  }, in.delta);
  publish_buckets(buckets);
  return {dtype == at::kFloat ? out : out.to(dtype), lse};
}

std::tuple<at::Tensor, at::Tensor> jagged_attention_fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& seq_offsets,
    int64_t max_seq_len, c10::string_view kind, bool causal, double scale, const c10::optional<at::Tensor>& num_targets,
    int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
    const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
    const c10::optional<at::Tensor>& query_timestamps_in) {
  attention_checks::qkv(q_in, k_in, v_in, seq_offsets, kind, c10::DeviceType::CPU);
  Prepared in = prepare(q_in, k_in, v_in, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
                        contextual_len, max_attn_len, pos_bias_in, time_bias_in, timestamps_in, query_timestamps_in);
  return forward(in, q_in.scalar_type());
}

// generative-recommenders' delta_hstu_mha: delta_q [B * delta, H, D] holds the queries of the last
// delta rows of every sequence, k and v [N, H, *] the whole sequences; causal. The work is the
// full forward's restricted to those query rows: delta * L pairs per sequence instead of L^2.
at::Tensor cached_jagged_attention_fwd_cpu(
    const at::Tensor& delta_q, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& seq_offsets,
    int64_t max_seq_len, c10::string_view kind, double scale, const c10::optional<at::Tensor>& num_targets,
    int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
    const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
    const c10::optional<at::Tensor>& query_timestamps_in) {
  attention_checks::cached_qkv(delta_q, k_in, v_in, seq_offsets, kind, c10::DeviceType::CPU);
  const int64_t B = seq_offsets.numel() - 1, N = k_in.size(0);
  const int64_t delta = B > 0 ? delta_q.size(0) / B : 0;
  // No query rows (B = 0 or delta = 0): Prepared's delta = 0 would mean "every row is a query".
  if (delta == 0) return at::empty({0, delta_q.size(1), v_in.size(2)}, delta_q.options());
  // The kernel reads tq_i at row start + i of the sequence: query_timestamps [B * delta] go to their
  // rows of a copy of timestamps (the other rows' tq are never read).
  c10::optional<at::Tensor> query_timestamps = c10::nullopt;
  if (query_timestamps_in.has_value() && query_timestamps_in->defined() && timestamps_in.has_value() &&
      timestamps_in->defined()) {
    GK_CHECK_CPU((*query_timestamps_in));
    GK_CHECK_CPU((*timestamps_in));
    TORCH_CHECK(query_timestamps_in->numel() == B * delta, "query_timestamps must be [B * delta]");
    TORCH_CHECK(timestamps_in->numel() == N, "timestamps must be [N]");
    const auto off = seq_offsets.to(at::kLong).contiguous();
    const int64_t* o = off.const_data_ptr<int64_t>();
    auto full = timestamps_in->to(at::kLong).contiguous().clone();
    const auto tq = query_timestamps_in->to(at::kLong).contiguous();
    int64_t* dst = full.data_ptr<int64_t>();
    const int64_t* src = tq.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(o[b] <= o[b + 1] && o[b + 1] <= N && o[b + 1] - o[b] >= delta, "seq_offsets out of range");
      std::copy(src + b * delta, src + (b + 1) * delta, dst + o[b + 1] - delta);
    }
    query_timestamps = full;
  }
  Prepared in = prepare(delta_q, k_in, v_in, seq_offsets, max_seq_len, kind, /*causal=*/true, scale, num_targets,
                        contextual_len, max_attn_len, pos_bias_in, time_bias_in, timestamps_in, query_timestamps,
                        delta);
  return std::get<0>(forward(in, delta_q.scalar_type()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> jagged_attention_bwd_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& seq_offsets, int64_t max_seq_len,
    c10::string_view kind, bool causal, double scale, const c10::optional<at::Tensor>& num_targets,
    int64_t contextual_len, int64_t max_attn_len, const c10::optional<at::Tensor>& pos_bias_in,
    const c10::optional<at::Tensor>& time_bias_in, const c10::optional<at::Tensor>& timestamps_in,
    const c10::optional<at::Tensor>& query_timestamps_in, bool deterministic) {
  (void)deterministic;  // always: no atomics, fixed reduction order
  attention_checks::qkv(q_in, k_in, v_in, seq_offsets, kind, c10::DeviceType::CPU);
  const Prepared in = prepare(q_in, k_in, v_in, seq_offsets, max_seq_len, kind, causal, scale, num_targets,
                              contextual_len, max_attn_len, pos_bias_in, time_bias_in, timestamps_in,
                              query_timestamps_in);
  const Params& p = in.p;
  const auto& seqs = in.seqs;
  const int64_t N = in.N, H = p.H, D = p.D, Dv = p.Dv;
  const auto dout = grad_out_in.to(at::kFloat).contiguous();
  TORCH_CHECK(dout.sizes() == in.v.sizes(), "grad_out must be [N, H, Dv]");
  at::Tensor out, lse;
  if (p.softmax) {
    out = out_in.to(at::kFloat).contiguous();
    lse = lse_in.contiguous();
    TORCH_CHECK(out.sizes() == in.v.sizes() && lse.numel() == N * H && lse.scalar_type() == at::kFloat,
                "softmax backward needs out [N, H, Dv] and fp32 lse [N, H]");
  }
  const auto options = in.q.options();
  // Both paths write every row of their items' dq, dk and dv whole (accumulated in the workspace),
  // so when the sequences cover every row the zero fill is skipped: ~8 % of the short path's backward
  // at the model's shape. On the long path (history 1024, 1 thread) perf put the fill at ~3 %, but
  // skipping it alone measured within noise (the first writes of the rows then paid the misses); it
  // paid with the rows streamed (kStreamRowsMinBytes).
  const bool short_only = all_short(in);
  const auto alloc = [&](int64_t width) {
    return covers_rows(in) ? at::empty({N, H, width}, options) : at::zeros({N, H, width}, options);
  };
  auto dq = alloc(D);
  auto dk = alloc(D);
  auto dv = alloc(Dv);
  // Per-item bias-gradient partials: item (b, h) covers relative positions [-(L-1), L-1] of pos_bias
  // (2L-1 slots) and all time buckets.
  const int64_t num_items = static_cast<int64_t>(seqs.size()) * H;
  std::vector<int64_t> pos_part_offset(num_items + 1, 0);
  for (int64_t it = 0; it < num_items; ++it)
    pos_part_offset[it + 1] = pos_part_offset[it] + (p.pos_bias ? std::max<int64_t>(2 * seqs[it / H].len - 1, 0) : 0);
  std::vector<float> pos_part(pos_part_offset[num_items], 0.0f);
  const int64_t time_width = p.time_bias ? p.num_buckets + 1 : 0;
  std::vector<float> time_part(num_items * time_width, 0.0f);

  const float* dop = dout.data_ptr<float>();
  const float* lp = p.softmax ? lse.data_ptr<float>() : nullptr;
  float* dqp = dq.data_ptr<float>();
  float* dkp = dk.data_ptr<float>();
  float* dvp = dv.data_ptr<float>();
  const float inv_m = p.M > 0 ? 1.0f / static_cast<float>(p.M) : 0.0f;
  // The tile loops' masked-product guards: q's and dO's rows here (dO's in the softmax delta's sweep),
  // k's in each item's copy of its key rows (one sweep of k less: ~1 % of the backward each).
  std::vector<uint8_t> bad_q, bad_do;
  if (!short_only) {
    bad_q = nonfinite_rows(in.q);
    if (!p.softmax) bad_do = nonfinite_rows(dout);
  }
  const std::vector<float> delta = p.softmax ? softmax_delta(dout, out, short_only ? nullptr : &bad_do)
                                             : std::vector<float>();
  const bool stream = dq.nbytes() + dk.nbytes() + dv.nbytes() >= kStreamRowsMinBytes;
  const BucketPlan buckets = bucket_plan(in);

  for_each_item(seqs, p, [&](int64_t item, Workspace& ws) {
    const SeqInfo& seq = seqs[item / H];
    if (short_path(in, seq)) {  // as in the forward; its heads' partials are its items' (item + h)
      if (item % H == 0)
        backward_seq_short(in, seq, ws, dop, dqp, dkp, dvp, p.pos_bias ? pos_part.data() + pos_part_offset[item] : nullptr,
                           p.time_bias ? time_part.data() + item * time_width : nullptr, buckets.of(item / H));
      return;
    }
    Item it;
    if (!begin_item(in, item, ws, it)) return;
    const int64_t L = it.L, h = it.h;
    const int64_t qs = H * D, vs = H * Dv;  // row strides
    const float* q0 = it.q0;
    // K and V are the products' fixed operand within a key tile (Q K^T, dO V^T, dS K): read at
    // their [N, H, D] row stride, torch.mm (MKL) ran ~9% slower (1 thread, 128^3) than on contiguous rows.
    ws.k_rows.resize(L * D);
    ws.v_rows.resize(L * Dv);
    ws.bad_k.assign((L + kTileN - 1) / kTileN, 0);
    for (int64_t i = 0; i < L; ++i) {
      std::copy(it.k0 + i * qs, it.k0 + i * qs + D, ws.k_rows.data() + i * D);
      std::copy(it.v0 + i * vs, it.v0 + i * vs + Dv, ws.v_rows.data() + i * Dv);
      ws.bad_k[i / kTileN] |= nonfinite_row(ws.k_rows.data() + i * D, D);
    }
    const float *k0 = ws.k_rows.data(), *v0 = ws.v_rows.data();
    const float* do0 = dop + (it.start * H + h) * Dv;
    // dq accumulates over the key tiles in a contiguous [L, D] buffer, dk and dv over the query tiles
    // in [kTileN, D] / [kTileN, Dv] ones; each is written to its rows once, whole (zeros for a row that
    // sees nothing), so the outputs need no zero fill.
    ws.dq_rows.assign(L * D, 0.0f);
    float* dq_item = ws.dq_rows.data();
    float* dk_acc = ws.acc.data();
    float* dv_acc = ws.acc2.data();
    const float* delta0 = p.softmax ? delta.data() + it.start * H + h : nullptr;  // rows at stride H
    tile_flags(bad_q.data() + it.start * H + h, L, H, kTileM, ws.bad_q);
    tile_flags(bad_do.data() + it.start * H + h, L, H, kTileM, ws.bad_do);
    float* pos_part_item = p.pos_bias ? pos_part.data() + pos_part_offset[item] : nullptr;
    float* time_part_item = p.time_bias ? time_part.data() + item * time_width : nullptr;
    float* s = ws.s.data();
    float* pr = ws.pr.data();
    float* dpt = ws.dp.data();
    const bool fused_rows = !p.softmax && fused_rows_available();  // HSTU's rows in one pass (hstu_bwd_rows)
    for (int64_t j0 = 0; j0 < L; j0 += kTileN) {
      const int64_t bn = std::min(kTileN, L - j0);
      std::fill(dk_acc, dk_acc + bn * D, 0.0f);
      std::fill(dv_acc, dv_acc + bn * Dv, 0.0f);
      for (int64_t i0 = 0; i0 < L; i0 += kTileM) {
        const int64_t bm = std::min(kTileM, L - i0);
        const int tile_kind = ws.mask.classify(i0, i0 + bm, j0, j0 + bn);
        if (tile_kind == 0) continue;
        TileExtents ext;
        ext.init(ws.mask, tile_kind, i0, bm, j0, bn);
        ext.row_strips(bm, bn, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
          mm(false, true, r1 - r0, c1 - c0, D, p.scale, q0 + (i0 + r0) * qs, qs, k0 + (j0 + c0) * D, D, 0.0f,
             s + r0 * kTileN + c0, kTileN);
        });
        ext.row_strips(bm, bn, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
          mm(false, true, r1 - r0, c1 - c0, Dv, 1.0f, do0 + (i0 + r0) * vs, vs, v0 + (j0 + c0) * Dv, Dv, 0.0f,
             dpt + r0 * kTileN + c0, kTileN);
        });
        const bool fused = fused_rows && hstu_bwd_rows(p, ws, it, i0, bm, j0, bn, tile_kind, inv_m, pos_part_item,
                                                       time_part_item);
        // Otherwise the two passes: scores_tile's biases, then the row loop (softmax, other CPUs, tiles
        // with per-pair flags or a hole).
        if (!fused) scores_tile(p, ws.mask, ws, it.start, h, i0, bm, j0, bn, tile_kind);
        for (int64_t r = 0; !fused && r < bm; ++r) {
          const float* row = s + r * kTileN;
          const uint8_t* vis = ws.vis.data() + r * kTileN;
          float* prow = pr + r * kTileN;
          float* drow = dpt + r * kTileN;  // dP in, dS out
          const RowSpan span = row_span(ws.mask, tile_kind, i0 + r, j0, bn);
          const int64_t c0 = span.begin, c1 = span.end;
          // Outside the span P and dS are 0, selected: dP of an invisible pair may be inf or NaN (v = inf).
          std::fill(prow, prow + c0, 0.0f);
          std::fill(prow + c1, prow + bn, 0.0f);
          std::fill(drow, drow + c0, 0.0f);
          std::fill(drow + c1, drow + bn, 0.0f);
          if (p.softmax) {
            // lse = -inf: every visible score was -inf, p = 0 (exp(-inf - -inf) would be NaN).
            const float l0 = lp[(it.start + i0 + r) * H + h];
            const float l = l0 == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::infinity() : l0;
            softmax_grad_row(row + c0, prow + c0, drow + c0, c1 - c0, l, delta0[(i0 + r) * H]);
          } else {
            silu_grad_row(row + c0, prow + c0, drow + c0, c1 - c0, inv_m);
          }
          if (span.ask) {
            for (int64_t c = c0; c < c1; ++c) {
              prow[c] = vis[c] ? prow[c] : 0.0f;
              drow[c] = vis[c] ? drow[c] : 0.0f;
            }
          }
          std::fill(prow + span.hole_begin, prow + span.hole_end, 0.0f);
          std::fill(drow + span.hole_begin, drow + span.hole_end, 0.0f);
          if (pos_part_item != nullptr) {
            // j - i + L - 1 in [0, 2L-2] within the item's slots.
            float* dst = pos_part_item + (j0 - (i0 + r) + L - 1);
            for (int64_t c = c0; c < c1; ++c) dst[c] += drow[c];
          }
          if (time_part_item != nullptr) {
            add_by_bucket(ws.bucket.data() + r * kTileN + c0, drow + c0, c1 - c0, time_part_item);
          }
        }
        // Mixed tiles whose other operand holds an Inf or NaN take the masked path (see masked_mm).
        const bool mixed = tile_kind == 1;
        const uint8_t* vis = ws.vis.data();
        if (mixed && ws.bad_do[i0 / kTileM])
          masked_mm_t(bm, bn, Dv, 1.0f, pr, vis, do0 + i0 * vs, vs, dv_acc, Dv);
        else
          ext.key_strips(bm, bn, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
            mm(true, false, c1 - c0, Dv, r1 - r0, 1.0f, pr + r0 * kTileN + c0, kTileN, do0 + (i0 + r0) * vs, vs,
               1.0f, dv_acc + c0 * Dv, Dv);
          });
        if (mixed && ws.bad_q[i0 / kTileM])
          masked_mm_t(bm, bn, D, p.scale, dpt, vis, q0 + i0 * qs, qs, dk_acc, D);
        else
          ext.key_strips(bm, bn, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
            mm(true, false, c1 - c0, D, r1 - r0, p.scale, dpt + r0 * kTileN + c0, kTileN, q0 + (i0 + r0) * qs, qs,
               1.0f, dk_acc + c0 * D, D);
          });
        if (mixed && ws.bad_k[j0 / kTileN])
          masked_mm(bm, bn, D, p.scale, dpt, vis, k0 + j0 * D, D, dq_item + i0 * D, D);
        else
          ext.row_strips(bm, bn, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
            mm(false, false, r1 - r0, D, c1 - c0, p.scale, dpt + r0 * kTileN + c0, kTileN, k0 + (j0 + c0) * D, D,
               1.0f, dq_item + (i0 + r0) * D, D);
          });
      }
      float* dk_dst = dkp + ((it.start + j0) * H + h) * D;
      float* dv_dst = dvp + ((it.start + j0) * H + h) * Dv;
      for (int64_t c = 0; c < bn; ++c) {
        copy_bytes(dk_dst + c * qs, dk_acc + c * D, D * sizeof(float), stream);
        copy_bytes(dv_dst + c * vs, dv_acc + c * Dv, Dv * sizeof(float), stream);
      }
    }
    float* dq_dst = dqp + (it.start * H + h) * D;
    for (int64_t i = 0; i < L; ++i) copy_bytes(dq_dst + i * qs, dq_item + i * D, D * sizeof(float), stream);
    streaming_store_fence();
  });
  publish_buckets(buckets);

  // Fixed-order reduction of the bias partials (item order b * H + h).
  at::Tensor dpos = at::empty({0}, options);
  if (p.pos_bias != nullptr) {
    dpos = at::zeros({p.pos_heads, 2 * p.M - 1}, options);
    float* dst = dpos.data_ptr<float>();
    for (int64_t it = 0; it < num_items; ++it) {
      const int64_t L = seqs[it / H].len;
      if (L == 0) continue;
      float* row = dst + (p.pos_heads == 1 ? 0 : it % H) * (2 * p.M - 1) + (p.M - L);
      const float* src = pos_part.data() + pos_part_offset[it];
      for (int64_t x = 0; x < 2 * L - 1; ++x) row[x] += src[x];
    }
    dpos = dpos.to(pos_bias_in->scalar_type());
  }
  at::Tensor dtime = at::empty({0}, options);
  if (p.time_bias != nullptr) {
    dtime = at::zeros({p.time_heads, time_width}, options);
    float* dst = dtime.data_ptr<float>();
    for (int64_t it = 0; it < num_items; ++it) {
      float* row = dst + (p.time_heads == 1 ? 0 : it % H) * time_width;
      const float* src = time_part.data() + it * time_width;
      for (int64_t x = 0; x < time_width; ++x) row[x] += src[x];
    }
    dtime = dtime.to(time_bias_in->scalar_type());
  }
  const auto dtype = q_in.scalar_type();
  return {dq.to(dtype), dk.to(dtype), dv.to(dtype), dpos, dtime};
}

}  // namespace

bool attention_avx2() { return GK_ATTENTION_AVX2 != 0; }

bool attention_avx512() {
#if GK_ATTENTION_AVX2
  return cpu_has_avx512f();
#else
  return false;
#endif
}

at::Tensor attention_fast_exp16(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  TORCH_CHECK(attention_avx512(), "attention_fast_exp16 needs AVX-512 (attention_avx512())");
  const auto x = x_in.contiguous();
  auto y = at::empty_like(x);
#if GK_ATTENTION_AVX2
  fast_exp16_rows(x.const_data_ptr<float>(), y.data_ptr<float>(), x.numel());
#endif
  return y;
}

at::Tensor attention_fast_exp(const at::Tensor& x_in, bool vectorized) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  const auto x = x_in.contiguous();
  auto y = at::empty_like(x);
  const float* src = x.const_data_ptr<float>();
  float* dst = y.data_ptr<float>();
  const int64_t n = x.numel();
  int64_t i = 0;
#if GK_ATTENTION_AVX2
  if (vectorized)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fast_exp8(_mm256_loadu_ps(src + i)));
#else
  (void)vectorized;
#endif
  for (; i < n; ++i) dst[i] = fast_exp(src[i]);
  return y;
}

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("jagged_attention_fwd_native", &jagged_attention_fwd_cpu);
  m.impl("jagged_attention_bwd_native", &jagged_attention_bwd_cpu);
  m.impl("cached_jagged_attention_fwd_native", &cached_jagged_attention_fwd_cpu);
}

}  // namespace gem_kernels
