// CPU kernels of the HSTU layer's two projection halves (generative-recommenders' STULayer; the
// attention between them is cpu/attention.cpp). Maths in gem_kernels/reference/hstu_layer.py.
//
// Work decomposition: each op is one pass over the jagged rows in equal chunks of at most kChunkRows
// (512) rows, a multiple of 4 of them (chunking(): balanced over 2 or 4 threads), handed out
// dynamically by parallel_ranges; a worker runs its chunk in equal blocks of at most
// block_rows(width) rows whose GEMM operands stay in L2 (512 at the small model's shape, 256 at
// D = 256, O = 1024),
// and per block: the prologue rows (LayerNorm, or the Norm(a) * silu(u) concat) into a block buffer,
// single-threaded BLAS sgemm on it (cpu_blas.h: no ATen dispatch per call), the epilogue rows (SiLU,
// the norm backward) while the block is in cache. Weight gradients are per-chunk partial GEMMs
// (xa^T @ dz, c^T @ g, accumulated over the chunk's blocks), summed in chunk order in fp64. No
// buffer of N rows exists besides the ops' inputs and outputs.
// Why chunks, not GEMMs over all N rows: at the small model's shape (D = 32, O = 128, N = 8.7k) the
// uvqk backward as ATen GEMMs over all rows (eight slice GEMMs, four [N, 32] temporaries, a scalar
// std::exp per element of silu') took 9-13 ms of one thread's CPU, 3.2-3.5 now (notes-hstu_layer.md).
// At D = 256 whole-row GEMMs once beat 64-row blocks run through ATen's mm (6.0 vs 3.4 ms);
// the blocks here call sgemm directly and are up to 256 rows at that width; there, with the partials
// summed by sum_partials, each projection op runs at 0.81-0.95x the CPU time of the eager op
// (notes-wideproj.md).
// At the small model's shape (N = 8704, D = 32, H = 2, dims 16, silu_qkv, no concat; one thread, sgemm
// peak 0.14-0.16 TFLOP/s): the uvqk forward (73.5 MFLOP, 0.84 M SiLU) takes ~1.03 ms and its backward
// (200 MFLOP with the recomputed pre-activations, 0.84 M silu') ~2.2 ms, of which the GEMMs are 0.57
// and 1.8 ms at MKL's rate on these skinny shapes; the output halves (17.8 and 35.7 MFLOP) took ~0.57
// and ~0.93 ms, mostly the per-row norm work, not their GEMMs (a profile: forward per-row prologue 43 %,
// GEMM 24 %; backward per-row work 49 %).
// Output half without concat at widths 16 and 32 (the small model's): one pass per row with the row in
// registers (OutputRows, hstu_layer_rows.inc, on AVX-512F or AVX2), in place of silu_block +
// output_prologue_row + norm_backward_row with their at::vec loops, calls and scratch round trips; on
// AVX-512F the [rows, 32] x [32, 32] GEMMs out = x + c @ W (forward) and dc = dout @ W^T (backward) in
// registers too (gemm_rows32). Measured at the small model's shape, 1 thread, thread CPU time, new / old
// build in alternating processes on this Xeon (busy shared host, load ~3; medians of 8 pairs,
// 2026-12-06 17:35 UTC): LayerNorm forward 0.60x (0.60 -> 0.35 ms), backward 0.72x (1.01 -> 0.73 ms)
// on AVX-512; 0.71x and 0.83x on AVX2 (GEM_KERNELS_NO_AVX512=1); group norm 0.59x / 0.67x (AVX-512),
// 0.71x / 0.79x (AVX2). Against the eager half in one process (scripts/hstu_layer_pieces.py, two runs
// each): forward 0.56-0.61x -> 0.37-0.40x, backward 0.65-0.75x -> 0.51-0.67x; the whole layer's
// fwd+bwd median 11.0-11.7 -> 9.7-10.1 ms (noisy: the output halves' own saving is ~0.5 ms of it).
// Predicted and measured along the way (AVX-512, same method unless said):
//   - the fused row pass alone (5 pairs): forward 0.72x, backward 0.75x (predicted -0.15 ms forward,
//     its row work from ~65 to ~25 cycles, and -0.3 ms backward, ~150 to ~50 cycles per row; got
//     -0.15 and -0.22 ms);
//   - x (+ bias) copied into out in the rows' pass, not by a memmove of each block after it (13 % of
//     the forward's samples; 5 pairs): forward 0.72x -> 0.65x;
//   - dnormed = dy * silu(u) in fp32 before widening (one fp64 conversion set fewer per row, ~11
//     operations of ~150; 5 pairs): backward 0.75x -> 0.70x (predicted ~4 %; the pairs' spread is as
//     large);
//   - the GEMMs in registers: see rows512::kGemmRows and dc_gemm (AVX-512 kept, AVX2 not).
// Measured and not kept:
//   - the norm stats 16 groups at a time (a transposing tree of shuffles for the 16 sums, one vector
//     sqrt and division), predicted to cut the per-row reductions' ~16 operations and the scalar
//     sqrt/division chain to ~4: the forward's row pass against the unchanged sgemm in the same profile
//     stayed 1.66 : 1 (1.657 before, 1.658 after): a miss, those reductions and that chain do not set
//     the row's time;
//   - rcp14 and a Newton step for the sigmoid's division (predicted: none, the divider is not the
//     limit): row pass : sgemm 1.74 against 1.66 forward, 2.51 against 2.55 backward.
//   The per-row time does not depend on N (forward 37-41 ns, backward ~76 ns per row from 2048 to 34816
//   rows: not memory-bound); PMU counters are not available on this VM, so the limit (likely the two
//   512-bit vector ports) is inferred, not counted.
//
// uvqk half at D = 32 with u, v, q, k in whole 16-lane vectors (the small model's layer): the forward's
// LayerNorm rows (uvqk_norm_rows: the row in 2 zmm / 4 ymm, stats and xa in one pass) and its split /
// SiLU rows (uvqk_split_rows: each z row read once, no silu_block / copy_row call per part) from
// hstu_layer_rows.inc on AVX-512F or AVX2; on AVX-512F the backward's xa recompute (the same rows, saved
// stats) and its norm backward (uvqk_norm_bwd_rows: norm_backward_row's fp64 formula with the row in
// registers, no scratch). Predicted: the forward's row work from ~160 to ~80 cycles per row (-0.2 ms of
// ~1.05), the backward's norm backward ~150 to ~50 (-0.3 ms of ~2.3). Measured (new / old build in
// alternating processes, 1 thread, thread CPU time, median of 40 calls each, busy shared host, load
// ~2-2.5, 2026-12-06 18:00-18:11 UTC; scripts like hstu_layer_pieces' uvqk pieces, caches flushed between
// calls): AVX-512 forward 0.88x (1.10 -> 0.94 ms; 11 pairs, 0.84-0.90x), backward 0.96x (2.28 -> 2.20 ms;
// 0.91-1.01x): both under the prediction, the GEMMs (sgemm at ~85 % of this core's fp32 peak) are most
// of what is left. AVX2 (GEM_KERNELS_NO_AVX512=1, 5 pairs): forward 0.98x (0.97-0.99x, kept);
// backward 1.02x (0.94-1.05x): measured and not kept, the AVX2 backward runs layer_norm_augmented and
// norm_backward_row as before.
//
// uvqk backward's dz at the small model's shape on AVX-512F (uvqk_dz_rows, hstu_layer_rows.inc): per
// 4-row tile the v, q, k pre-activations z = xa @ [W; b][:, H*Lh:] in 24 zmm accumulators (each weight
// vector loaded once for the 4 rows), then silu'(z) times the incoming gradient in the same registers,
// one store of dz per vector; u's gradient copied into dz in the same pass. It replaces the recompute's
// sgemm, silu_block's pass over the [rows, 96] block it wrote and the copy loop. Profile before
// (perf -e cpu-clock, 1 thread, L2 flushed between calls): sgemm NN (the recompute and dxn) 37 % of the
// op's samples, sgemm NT (dW) 26 %, silu_block 20 %, the norm backward rows 7 %, the xa rows 4 %, the
// copy of u's gradient 4 %. Predicted: the recompute at the FMA ports' rate (198 FMAs per row, ~100
// cycles) and silu' (6 vectors, ~130 vector operations, ~65 cycles): ~0.6 ms against ~1.0 ms for sgemm +
// silu_block + copy. The tile took 0.7-0.85 ms in the profiles, but the op gained less: 0.92-0.94x
// (old / new in one process, 8 runs of 60 interleaved calls, 1 thread, thread CPU time, L2 flushed
// between calls, busy shared host, load ~2, 2026-12-06 20:05 UTC: medians 2.56-2.82 -> 2.41-2.60 ms).
// Now (same profile): dz rows 34 %, sgemm NT (dW) 30 %, sgemm NN (dxn) 23 %, norm backward 8 %, xa 5 %.
// Per row the op issues ~940 operations to the two 512-bit ports (dz 198 FMAs + ~130 for silu', dxn 256,
// dW 264, norm backward ~75, xa ~15): ~470 cycles against ~600 measured (2.2 ms over 8704 rows at the
// ~2.3 GHz that sgemm's 0.14-0.16 TFLOP/s at 64 FLOP per cycle implies): ~75-80 %, so what is left needs
// fewer operations (storing silu'(z): see below; the fp32 GEMMs split into bf16 parts on this CPU's AMX
// tiles, untried), not better scheduling. Measured and not kept (same method, dz rows on):
//   - dW as rank-4 updates of the chunk's [33, 128] partial in L1 after each tile, no sgemm: the piece
//     took 0.85x of sgemm NT's samples in one interleaved profile, the op 0.98-1.04x (16 runs, median
//     1.01x): no gain;
//   - dxn = dz @ W^T in registers per tile (two sets of 8 accumulators) and the norm backward on it in
//     registers (no dxn block, no sgemm call): 0.98-1.00x (3 runs), no gain beyond the noise;
//   - software prefetch of the four gradients' and x's rows 16 or 64 rows ahead: 1.00-1.02x (3 runs each);
//   - db summed from the tile's dz rows (sgemm's dW then M = 32, not 33): 0.98-1.01x (4 runs);
//   - 2 or 3 rows per tile (no accumulator spill before the silu'): the op 0.97-1.00x (3 runs), the tile's
//     own samples 1.14x those of 4 rows in one interleaved profile: kept 4;
//   - the same on AVX2: see uvqk_dz_rows_fit;
//   - the forward's GEMM and split in registers (2 rows of 8 zmm accumulators, SiLU and the four stores
//     from them, no z block): 0.97-1.01x of sgemm + uvqk_split_rows (3 runs), its tile's samples 1.05x
//     theirs in one profile.
//
// Output backward's bias gradient (2026-12-07, helper uvqk11): g's column sums are row k of the chunk's
// dW partial (summed with it in chunk order in fp64 by sum_partials), in place of ATen's g.sum(0) over
// all N rows before the kernel (a second read of g, single-threaded in ATen: 0.08-0.09 ms alone at the
// small model's shape at 1 and at 2 threads). On AVX-512F at dim 32 (where the rows run the dc GEMM)
// the sums ride in output_bwd_rows, one add per vector a row from g's row in L1; else column_sums over
// the block's g rows after the dW GEMM. Predicted: -0.08 ms of ~0.84 (0.91x). Measured at the small
// model's shape (scripts like hstu_layer_pieces' output bwd piece, L2 flushed between calls, busy shared
// host, load ~2.5-3.5, 2026-12-07 08:20-08:40 UTC), against main's order reproduced in one process
// (g.sum(0), then this kernel without the bias: the same code as main's, 6 runs of 80 interleaved calls):
// 1 thread, thread CPU time: 0.936-0.955x (median ~0.945); 2 threads, wall, SCHED_FIFO under the
// measuring lock: 0.89-0.93x (median 0.92, 0.48 -> 0.44 ms). Against main's build in alternating
// processes (ABBA): 2 threads, wall, 12 pairs: 0.938x (0.889-1.027; the unchanged ops in the same
// processes 0.996-1.024x); 1 thread, CPU time, 10 pairs: 0.947x (0.816-1.039; unchanged ops 0.99-1.05x).
// Under the prediction: main's g.sum(0) also brought g into L2 for the kernel's dW GEMM (its net cost in
// the op was ~0.045 ms, not its 0.085 alone), and the sums cost something: the separate column_sums pass
// ~0.02 ms (~5 cycles a row re-reading the block's g from L2), the rows' one ~0.01. Measured and not
// kept: column_sums on the AVX-512 path too (no sums in the rows): the op 1.02-1.09x (median 1.05; 8
// runs of 80 interleaved calls, one process, an environment switch whose two os.environ writes a call
// were timed with it) the time of the rows' sums.
// Per-row time of the four ops does not depend on N (1 thread, no flush, 1024 to 34816 rows: uvqk
// forward 96-110 ns, backward 210-236 ns a row): compute-bound, as the output rows above. At 2 threads
// the output backward scales worst: 1.65x (8704 rows) and 1.77x (34816) its 1-thread wall time, against
// 1.83-1.97x for the other three (SCHED_FIFO, locked); in perf samples its row pass grows ~12 % against
// its sgemm at 2 threads; the cause is not found (no PMU counters on this VM).
//
//   uvqk forward: xa = [LayerNorm(x) | 1] (per row) -> z = xa @ [W; b] (one GEMM per block) -> z split
//     into the four output tensors, SiLU on v, q, k when silu_qkv (the HSTU paper's form; STULayer
//     applies SiLU to u only, and u's SiLU is applied by the output half's prologue, so the forward
//     keeps no activation for its backward).
//     FLOPs 2*N*D*O; minimum bytes 4*(N*D + D*O + N*O).
//   output forward: c = [silu(u), a, silu(u) * Norm(a)] (pass) -> out = x + c @ W (+ bias).
//     FLOPs 2*N*K*D; minimum bytes 4*(2*N*H*Lh + 2*N*D + K*D).
//   backward: what the backward recomputes instead of storing, per token (fp32):
//     - the normalised input xn (4*D bytes) from x and its two fp32 stats (8 bytes);
//     - the concat c (4*K bytes, K = 3*H*Lh for STULayer) and Norm(a) from attn, u_pre and the
//       attention norm's stats (8*G bytes, G = 1, or H with group_norm), in the same pass as the
//       norm's backward (one read of attn and u_pre);
//     - silu(u) from u_pre; with silu_qkv, the pre-activations of v, q, k (one GEMM of N*D*(O-H*Lh), in
//       registers at the small model's shape on AVX-512F: uvqk_dz_rows): not stored (4*(O - H*Lh) bytes). Measured against storing silu'(z) from the forward (384 B per token
//       at the small model's shape, 3.3 MB per layer; a prototype, 2026-12-06, 1 thread, interleaved in one
//       process, caches flushed between ops as in the training step, busy shared host): the backward took
//       0.93x (-0.23 ms: no GEMM, no exp) but the forward 1.20x (+0.34 ms: the extra write), a net loss of
//       ~0.1 ms per layer; only with the buffer still in cache (not the case in a step) a net gain of ~0.1 ms.
//     Weight gradients are per-chunk GEMMs over the block's recomputed operands (the four incoming
//     gradients gathered into the block's [rows, O] dz); weight and norm-weight gradients are
//     per-chunk partial sums reduced in chunk order (bit-identical run to run and across thread
//     counts).

#include "gem_kernels/cpu_vec.h"  // first: at::vec below is its AVX2 code, not the scalar fallback

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "gem_kernels/checks.h"
#include "gem_kernels/cpu_blas.h"
#include "gem_kernels/cpu_exp.h"
#include "gem_kernels/parallel.h"

namespace gem_kernels {
namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

// detach(): the GEMMs run on at::parallel_for's worker threads, which do not inherit the caller's
// below-autograd dispatch state; an operand that requires grad then made at::addmm_out raise
// ("functions with out=... arguments don't support automatic differentiation").
Tensor as_float(const Tensor& t) { return t.detach().to(at::kFloat).contiguous(); }

// A weight that arrives as nn.Linear's weight transposed (the layer passes `linear.weight.t()`): its
// transpose is contiguous, so the kernels read it in that layout and return its gradient in it, where
// the front door's `.contiguous()` copied it in the forward, the backward copied it back (W^T for its
// NN GEMM is nn.Linear's own weight) and AccumulateGrad copied the transposed gradient once more.
// Read from the strides, no t() view: each ATen call here is a dispatch of ~1 us on this machine.
// Measured (2026-12-07, helper fixed13; busy shared 2-core Xeon, SCHED_FIFO under the measuring lock):
// the small model's step with the weights passed as they come against main's contiguous copies, switched
// in one process per round of 8 batches, paired by round: batch 8, 1 thread (CPU time): -93 us (ratio
// 0.984, 80 rounds; -87 and -123 us, 0.990 and 0.985, for the first version below); batch 256, 2 threads
// (wall): +0.02 ms (1.001, 30 rounds; first version -0.77 and +0.19 ms): neutral, the copies are of
// weights, not of tokens. Per call (torch.profiler, batch 8, 1 thread, against main's build in
// alternating processes, 3 pairs, tests running beside): the ops within their noise (uvqk backward
// -20/+6/-1 us, output backward -6/+2/-2, uvqk forward -7/+15/+5), the output forward +3 to +6 us (its
// W [K, D] copy moved in here from the front door): the gain is the front door's two copies with their
// autograd nodes, and AccumulateGrad's two copies of the transposed gradients.
// Tried and not kept: a first version reading the layout through t() views and ATen's contiguous() /
// to() made these four ops 5-21 us slower each than main's; sgemm's NN kernel on the transposed output
// weight for the output backward's dc (no copy) gave other bits than NT on the contiguous one (at K =
// 45, D = 23), so that path copies (contiguous_rows).
bool transposed_layout(const Tensor& w) {
  return w.dim() == 2 && !w.is_contiguous() && w.stride(0) == 1 && w.stride(1) == w.size(0);
}

// w [rows, cols] as fp32, contiguous or transposed_layout (to() keeps a dense tensor's strides); a
// contiguous copy for any other layout.
Tensor float_rows(const Tensor& w) {
  if (!transposed_layout(w)) return as_float(w);
  const Tensor f = w.scalar_type() == at::kFloat ? w.detach() : w.detach().to(at::kFloat);
  return transposed_layout(f) ? f : f.contiguous();
}

// w (float_rows) as a contiguous [rows, cols] fp32 matrix: a transposing copy of a transposed one.
Tensor contiguous_rows(const Tensor& w) {
  if (w.is_contiguous()) return w;
  const int64_t rows = w.size(0), cols = w.size(1);
  Tensor out = at::empty({rows, cols}, w.options());
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) op[r * cols + c] = wp[c * rows + r];
  return out;
}

// W^T [cols, rows] contiguous of w (float_rows): the weight's own memory when it came transposed.
Tensor transposed_rows(const Tensor& w) { return transposed_layout(w) ? w.t() : w.t().contiguous(); }

// A weight gradient computed contiguous [rows, cols] in fp32 (row stride grad.stride(0)), returned in
// the weight's layout and dtype (the fake kernel's empty_like(weight)); the transposed layout by one
// transposing copy.
Tensor in_layout_of(const Tensor& grad, const Tensor& weight) {
  const auto dtype = weight.scalar_type();
  if (!transposed_layout(weight)) return dtype == at::kFloat ? grad : grad.to(dtype);
  const int64_t rows = grad.size(0), cols = grad.size(1), ld = grad.stride(0);
  Tensor out = at::empty_strided({rows, cols}, {1, rows}, grad.options());
  const float* gp = grad.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) op[c * rows + r] = gp[r * ld + c];
  return dtype == at::kFloat ? out : out.to(dtype);
}

// [w; b] as one [rows + 1, cols] fp32 matrix (w fp32 [rows, cols], contiguous or transposed_layout;
// b [cols]): two copies, in place of at::cat's dispatch (~6-10 us a call at the small model's 33 x 64).
Tensor append_row(const Tensor& w, const Tensor& b) {
  const int64_t rows = w.size(0), cols = w.size(1);
  Tensor out = at::empty({rows + 1, cols}, w.options());
  float* op = out.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  if (w.is_contiguous()) {
    std::memcpy(op, wp, sizeof(float) * rows * cols);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) op[r * cols + c] = wp[c * rows + r];
  }
  std::memcpy(op + rows * cols, b.contiguous().data_ptr<float>(), sizeof(float) * cols);
  return out;
}

int64_t workers_for(int64_t work) { return work < kMinParallelWork ? 1 : at::get_num_threads(); }

// (mean, 1 / sqrt(var + eps)) of n floats, biased variance in two passes (like torch's norms).
// AVX2 only: a 16-lane AVX-512 form (masked tail, _mm512_reduce_add_ps) made the small model's output
// forward 7 % slower: on 32-float rows the reductions, not the lanes, set the time. (That layer now
// takes OutputRows' fused pass, whose stats use _mm512_reduce_add_ps with the row in registers.)
inline std::pair<float, float> moments(const float* x, int64_t n, float eps) {
  auto add = [](Vec a, Vec b) { return a + b; };
  const float mean = at::vec::reduce_all<float>(add, x, n) / static_cast<float>(n);
  const float var = at::vec::map_reduce_all<float>(
                        [mean](Vec a) {
                          Vec d = a - Vec(mean);
                          return d * d;
                        },
                        add, x, n) /
                    static_cast<float>(n);
  return {mean, 1.0f / std::sqrt(var + eps)};
}

// sigmoid(z) on Vec's lanes: sigmoid8 (fast_exp's polynomial inlined) where the build has AVX2.
// ATen's Vectorized exp is a call to Sleef's (with its own range checks) per 8 floats: at the small
// model's shape (D = 32, O = 128) it took more of the uvqk forward's time than the GEMM.
#if defined(CPU_CAPABILITY_AVX2)
inline Vec sigmoid_vec(Vec z) { return Vec(sigmoid8(z)); }
#else
inline Vec sigmoid_vec(Vec z) { return Vec(1.0f) / (Vec(1.0f) + z.neg().exp()); }
#endif

// kOp on a block of `rows` rows of n floats at row strides ldz, ldg, ldo, ldo2 (out may alias z):
//   kForward: out = silu(z); kGrad: out = silu(z), out2 = silu'(z); kBackward: out = g * silu'(z).
// The rows are bound by the exp polynomial's FMAs: on AVX-512F where the CPU has it (a run-time check;
// the build targets AVX2), each row in 16-lane vectors, the last one masked; else in 8-lane vectors
// and a scalar tail. One dispatch per block, not per row: at the small model's shape a row is 16 or 32
// floats, and a call per row per output (each with its own check and tail loop) cost about as much as
// the row's arithmetic.
enum class SiluRow { kForward, kGrad, kBackward };

struct SiluBlock {
  const float* z;
  int64_t ldz;
  const float* g;
  int64_t ldg;
  float* out;
  int64_t ldo;
  float* out2;
  int64_t ldo2;
};

#if defined(CPU_CAPABILITY_AVX2)
// One 16-lane vector of silu_block at element i of row r: all 16 lanes (kTail false), or the lanes of
// m. Masked loads and stores in the last, partial vector only: a masked store is not forwarded to a
// load that reads it soon after (the output forward's prologue reads its silu(u) row at once; with
// every vector masked it ran 3 % slower).
template <bool kTail>
__attribute__((target("avx512f"))) inline __m512 load16(const float* p, __mmask16 m) {
  if constexpr (kTail) return _mm512_maskz_loadu_ps(m, p);
  return _mm512_loadu_ps(p);
}

template <bool kTail>
__attribute__((target("avx512f"))) inline void store16(float* p, __m512 v, __mmask16 m) {
  if constexpr (kTail) {
    _mm512_mask_storeu_ps(p, m, v);
  } else {
    _mm512_storeu_ps(p, v);
  }
}

template <SiluRow kOp, bool kTail>
__attribute__((target("avx512f"))) inline void silu_vector16(const SiluBlock& b, int64_t r, int64_t i, __mmask16 m) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 zv = load16<kTail>(b.z + r * b.ldz + i, m);
  const __m512 sig = sigmoid16(zv);
  float* out = b.out + r * b.ldo + i;
  if constexpr (kOp == SiluRow::kForward) {
    store16<kTail>(out, _mm512_mul_ps(zv, sig), m);
  } else {
    const __m512 slope = _mm512_add_ps(one, _mm512_mul_ps(zv, _mm512_sub_ps(one, sig)));
    if constexpr (kOp == SiluRow::kGrad) {
      store16<kTail>(out, _mm512_mul_ps(zv, sig), m);
      store16<kTail>(b.out2 + r * b.ldo2 + i, _mm512_mul_ps(sig, slope), m);
    } else {
      store16<kTail>(out, _mm512_mul_ps(_mm512_mul_ps(load16<kTail>(b.g + r * b.ldg + i, m), sig), slope), m);
    }
  }
}

template <SiluRow kOp>
__attribute__((target("avx512f"))) void silu_block_avx512(const SiluBlock& b, int64_t rows, int64_t n) {
  const int64_t nv = n - n % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - nv)) - 1u);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < nv; i += 16) silu_vector16<kOp, false>(b, r, i, tail);
    if (nv < n) silu_vector16<kOp, true>(b, r, nv, tail);
  }
}
#endif

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// One row of silu_block on Vec's lanes, the last n % Vec::size() elements one by one.
template <SiluRow kOp>
void silu_row_vec(const float* z, const float* g, float* out, float* out2, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec zv = Vec::loadu(z + i);
    const Vec sig = sigmoid_vec(zv);
    if constexpr (kOp == SiluRow::kForward) {
      (zv * sig).store(out + i);
    } else {
      const Vec slope = Vec(1.0f) + zv * (Vec(1.0f) - sig);
      if constexpr (kOp == SiluRow::kGrad) {
        (zv * sig).store(out + i);
        (sig * slope).store(out2 + i);
      } else {
        (Vec::loadu(g + i) * sig * slope).store(out + i);
      }
    }
  }
  for (; i < n; ++i) {
    const float sig = sigmoid(z[i]), slope = 1.0f + z[i] * (1.0f - sig);
    if constexpr (kOp == SiluRow::kForward) {
      out[i] = z[i] * sig;
    } else if constexpr (kOp == SiluRow::kGrad) {
      out[i] = z[i] * sig;
      out2[i] = sig * slope;
    } else {
      out[i] = g[i] * sig * slope;
    }
  }
}

template <SiluRow kOp>
void silu_block(const SiluBlock& b, int64_t rows, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx512f()) return silu_block_avx512<kOp>(b, rows, n);
#endif
  for (int64_t r = 0; r < rows; ++r)
    silu_row_vec<kOp>(b.z + r * b.ldz, b.g + r * b.ldg, b.out + r * b.ldo, b.out2 + r * b.ldo2, n);
}

// dst[0, n) = src[0, n), inline: the row copies here are 16-256 floats, for which a memmove call per
// row (one per output per row) cost as much as the copy.
inline void copy_row(const float* src, float* dst, int64_t n) {
  at::vec::map([](Vec v) { return v; }, dst, src, n);
}

// out = (x - mean) * rstd * w + b over n floats.
inline void normalize_row(const float* x, float mean, float rstd, const float* w, const float* b, float* out,
                          int64_t n) {
  at::vec::map3([mean, rstd](Vec xv, Vec wv, Vec bv) { return (xv - Vec(mean)) * Vec(rstd) * wv + bv; }, out, x, w,
                b, n);
}

using VecD = at::vec::Vectorized<double>;
constexpr int64_t kLanesD = VecD::size();

#if defined(CPU_CAPABILITY_AVX2)
inline VecD load_wide(const float* p) { return VecD(_mm256_cvtps_pd(_mm_loadu_ps(p))); }
inline void store_narrow(const VecD& v, float* p) { _mm_storeu_ps(p, _mm256_cvtpd_ps(v)); }
#else
inline VecD load_wide(const float* p) {
  double t[kLanesD];
  for (int64_t i = 0; i < kLanesD; ++i) t[i] = p[i];
  return VecD::loadu(t);
}
inline void store_narrow(const VecD& v, float* p) {
  double t[kLanesD];
  v.store(t);
  for (int64_t i = 0; i < kLanesD; ++i) p[i] = static_cast<float>(t[i]);
}
#endif

// One row group's norm backward in fp64, normed = xhat * w + b, xhat = (x - mean) * rstd, with
// dnormed = g * scale (scale null: 1): dx = rstd * (dxh - mean(dxh) - xhat * mean(dxh * xhat)),
// dxh = dnormed * w, plus dx_add when not null; dnw += dnormed * xhat, dnb += dnormed. fp64: the
// subtraction cancels and rstd amplifies what is left; in fp32 its error was up to 3x eager's
// (FlashAttention's rule). Vectorised over fp64 lanes, the last n % kLanesD elements one by one.
// The first pass keeps xhat and dxh in scratch (2 * n doubles) for the second: widening the row's
// floats to fp64 again there took 13 % more time (the conversions share one port). AVX2 only: an
// 8-lane fp64 AVX-512 form took 1.15x the time of this one on the small model's 32-float rows (that
// layer now takes OutputRows' fused pass, the whole row in registers).
void norm_backward_row(const float* g, const float* scale, const float* x, float mean, float rstd, const float* w,
                       double* dnw, double* dnb, float* dx, const float* dx_add, int64_t n, double* scratch) {
  const int64_t nv = n - n % kLanesD;
  double* xhats = scratch;
  double* dxhs = scratch + n;
  const VecD vmean(mean), vrstd(rstd);
  VecD m1(0.0), m2(0.0);
  double s1 = 0.0, s2 = 0.0;
  for (int64_t j = 0; j < nv; j += kLanesD) {
    const VecD xhat = (load_wide(x + j) - vmean) * vrstd;
    const VecD dn = scale ? load_wide(g + j) * load_wide(scale + j) : load_wide(g + j);
    (VecD::loadu(dnw + j) + dn * xhat).store(dnw + j);
    (VecD::loadu(dnb + j) + dn).store(dnb + j);
    const VecD dxh = dn * load_wide(w + j);
    xhat.store(xhats + j);
    dxh.store(dxhs + j);
    m1 = m1 + dxh;
    m2 = m2 + dxh * xhat;
  }
  for (int64_t j = nv; j < n; ++j) {
    const double xhat = (static_cast<double>(x[j]) - mean) * rstd;
    const double dn = scale ? static_cast<double>(g[j]) * scale[j] : static_cast<double>(g[j]), dxh = dn * w[j];
    dnw[j] += dn * xhat;
    dnb[j] += dn;
    xhats[j] = xhat;
    dxhs[j] = dxh;
    s1 += dxh;
    s2 += dxh * xhat;
  }
  alignas(32) double t1[kLanesD], t2[kLanesD];
  m1.store(t1);
  m2.store(t2);
  for (int64_t i = 0; i < kLanesD; ++i) {
    s1 += t1[i];
    s2 += t2[i];
  }
  const double mean1 = s1 / static_cast<double>(n), mean2 = s2 / static_cast<double>(n);
  const VecD vm1(mean1), vm2(mean2);
  for (int64_t j = 0; j < nv; j += kLanesD)
    store_narrow(vrstd * (VecD::loadu(dxhs + j) - vm1 - VecD::loadu(xhats + j) * vm2), dx + j);
  for (int64_t j = nv; j < n; ++j) dx[j] = static_cast<float>(rstd * (dxhs[j] - mean1 - xhats[j] * mean2));
  if (dx_add != nullptr) at::vec::map2([](Vec p, Vec q) { return p + q; }, dx, dx, dx_add, n);
}

// Norm(a) over G groups of gs: (a - mean_g) * rstd_g * w + b, with w, b per element (G == 1, the
// LayerNorm over H*Lh) or per group (G == H, the GroupNorm).
struct NormSpec {
  int64_t groups, group_size;
  const float* weight;
  const float* bias;
  bool per_group;
};

// The output half's prologue for one row: writes c = [silu(u)], [a], silu(u) * Norm(a) (times the
// dropout mask row when given) into c_row, and Norm's stats into stats_row when compute_stats
// (forward), or reads them from stats_row (backward: the forward's stats, not recomputed ones).
// s: silu(u), computed by the caller for the whole block (silu_block), either in c_row's own u or y
// slot (then scaled in place) or in a buffer of its own.
void output_prologue_row(const float* a, const float* s, const NormSpec& ns, float eps, bool concat_u, bool concat_x,
                         const float* mask, float* stats_row, bool compute_stats, float* c_row) {
  const int64_t width = ns.groups * ns.group_size, gs = ns.group_size;
  float* y = c_row + width * ((concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  if (concat_u && s != c_row) copy_row(s, c_row, width);
  if (concat_x) copy_row(a, c_row + (concat_u ? width : 0), width);
  for (int64_t g = 0; g < ns.groups; ++g) {
    const float* ag = a + g * gs;
    const float* sg = s + g * gs;
    float* yg = y + g * gs;
    float mean, rstd;
    if (compute_stats) {
      std::tie(mean, rstd) = moments(ag, gs, eps);
      stats_row[g] = mean;
      stats_row[ns.groups + g] = rstd;
    } else {
      mean = stats_row[g];
      rstd = stats_row[ns.groups + g];
    }
    if (ns.per_group) {
      const float w = ns.weight[g], b = ns.bias[g];
      for (int64_t j = 0; j < gs; ++j) yg[j] = sg[j] * ((ag[j] - mean) * rstd * w + b);
    } else {
      const float* w = ns.weight + g * gs;
      const float* b = ns.bias + g * gs;
      for (int64_t j = 0; j < gs; ++j) yg[j] = sg[j] * ((ag[j] - mean) * rstd * w[j] + b[j]);
    }
  }
  if (mask != nullptr) {
    const int64_t k = width + (y - c_row);
    at::vec::map2([](Vec c, Vec m) { return c * m; }, c_row, c_row, mask, k);
  }
}

// The output half's per-row work without concat_u / concat_x (the small model's layer), at widths 16
// and 32 in norm groups of 16 or 32 (the LayerNorm, or the group norm at head dims 16): one pass per row
// with the row's u, a and (backward) dc loaded once and held in registers through SiLU, the norm's stats,
// the gating and the norm backward; the norm weight and bias (per element) and the block's fp64
// norm-weight partials too. The code is hstu_layer_rows.inc, built twice: on 16-lane AVX-512F vectors
// (rows512, where the CPU has it: cpu_has_avx512f) and on 8-lane AVX2 ones (rows256). Other layers run
// output_prologue_row and norm_backward_row.
struct OutputRows {
  const float* a;      // [rows, width]
  const float* u;      // [rows, width]: u before its SiLU
  const float* mask;   // [rows, width] or null
  float* stats;        // [rows, 2 * groups]: written by the forward, read by the backward
  const float* we;     // [width]: the norm's weight per element
  const float* be;     // [width]: its bias per element
  float* c;            // [rows, width]: silu(u) * Norm(a) (times the mask)
  float* dc;           // backward: [rows, width], dout @ W^T (written by the rows where wt)
  const float* g;      // backward: [rows, 32], dout, where wt
  const float* wt;     // backward: [32, 32] or null: W^T where the rows run the dc GEMM
  float* da;           // backward: [rows, width]
  float* du;           // backward: [rows, width]
  double* dnw;         // backward: [width], the chunk's fp64 norm-weight partials
  double* dnb;         // backward: [width], its norm-bias partials
  const float* x;      // forward: [rows, dim], the residual
  const float* bias;   // forward: [dim] or null, the output bias
  float* out;          // forward: [rows, dim]
  int64_t dim;
  const float* w;      // forward: [width, 32] or null: the output weight where the rows run the GEMM
  float* gsum;         // backward: [32] or null: where wt, g's column sums over the rows (the output bias's
                       // gradient), written (gsum_first) or added (never today: at K = 32 a chunk is one block)
  bool gsum_first;
};

#if defined(CPU_CAPABILITY_AVX2)
namespace rows256 {
using V = __m256;
using VD = __m256d;
constexpr int kL = 8;
// The forward's GEMM stays sgemm's: in registers (2 rows at a time: 8 accumulators and 4 weight vectors
// of the 16 ymm) the output forward took 1.07x the time (6 interleaved pairs of processes, 1 thread).
constexpr int kGemmRows = 0;
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline float hsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline V sigmoid(V z) { return sigmoid8(z); }
inline VD widen(V v, int half) { return _mm256_cvtps_pd(half == 0 ? _mm256_castps256_ps128(v) : _mm256_extractf128_ps(v, 1)); }
inline VD widen_load(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline V narrow(VD lo, VD hi) { return _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo)); }
inline VD dload(const double* p) { return _mm256_loadu_pd(p); }
inline void dstore(double* p, VD v) { _mm256_storeu_pd(p, v); }
inline VD dset1(double x) { return _mm256_set1_pd(x); }
inline VD dadd(VD a, VD b) { return _mm256_add_pd(a, b); }
inline VD dsub(VD a, VD b) { return _mm256_sub_pd(a, b); }
inline VD dmul(VD a, VD b) { return _mm256_mul_pd(a, b); }
inline VD dfmadd(VD a, VD b, VD c) { return _mm256_fmadd_pd(a, b, c); }
inline VD dfnmadd(VD a, VD b, VD c) { return _mm256_fnmadd_pd(a, b, c); }
inline double dhsum(VD v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
// out[0, dim) = x (+ bias): the GEMM's accumulator, row by row in the rows' pass.
inline void residual_row(const float* x, const float* bias, float* out, int64_t dim) {
  if (bias != nullptr) {
    at::vec::map2([](Vec p, Vec q) { return p + q; }, out, x, bias, dim);
  } else {
    copy_row(x, out, dim);
  }
}
#include "hstu_layer_rows.inc"
}  // namespace rows256

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace rows512 {
using V = __m512;
using VD = __m512d;
constexpr int kL = 16;
// The forward's GEMM in registers, 8 rows at a time (16 accumulators, 2 weight vectors): the output
// forward took 0.89-0.96x the time of the same rows with sgemm after them (medians of 6 and 8
// interleaved pairs of processes, 1 thread, busy shared host): no copy of x into out, no read of c
// and out back from L2.
constexpr int kGemmRows = 8;
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline V sigmoid(V z) { return sigmoid16(z); }
inline VD widen(V v, int half) {
  return _mm512_cvtps_pd(half == 0 ? _mm512_castps512_ps256(v)
                                   : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline VD widen_load(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
inline V narrow(VD lo, VD hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo))),
                                             _mm256_castps_pd(_mm512_cvtpd_ps(hi)), 1));
}
inline VD dload(const double* p) { return _mm512_loadu_pd(p); }
inline void dstore(double* p, VD v) { _mm512_storeu_pd(p, v); }
inline VD dset1(double x) { return _mm512_set1_pd(x); }
inline VD dadd(VD a, VD b) { return _mm512_add_pd(a, b); }
inline VD dsub(VD a, VD b) { return _mm512_sub_pd(a, b); }
inline VD dmul(VD a, VD b) { return _mm512_mul_pd(a, b); }
inline VD dfmadd(VD a, VD b, VD c) { return _mm512_fmadd_pd(a, b, c); }
inline VD dfnmadd(VD a, VD b, VD c) { return _mm512_fnmadd_pd(a, b, c); }
inline double dhsum(VD v) { return _mm512_reduce_add_pd(v); }

// out[0, dim) = x (+ bias): the GEMM's accumulator, one row at a time in the rows' pass (a copy of the
// block after it, the memmove of 64 KiB from x not in cache, took 13 % of the output forward's samples).
inline void residual_row(const float* x, const float* bias, float* out, int64_t dim) {
  int64_t j = 0;
  for (; j + 16 <= dim; j += 16) {
    V v = load(x + j);
    if (bias != nullptr) v = add(v, load(bias + j));
    store(out + j, v);
  }
  if (j < dim) {
    const __mmask16 m = static_cast<__mmask16>((1u << (dim - j)) - 1u);
    V v = _mm512_maskz_loadu_ps(m, x + j);
    if (bias != nullptr) v = add(v, _mm512_maskz_loadu_ps(m, bias + j));
    _mm512_mask_storeu_ps(out + j, m, v);
  }
}

#include "hstu_layer_rows.inc"
}  // namespace rows512
#pragma GCC pop_options
#endif

// Which rows kernel serves a layer: (width / 16) * 10 + group size / 16 (22: width 32 in one LayerNorm
// group; 21: its group norm over two heads of 16), or 0 where none does (a concat, other widths or
// group sizes, a build without AVX2).
int output_rows_kind(int64_t width, int64_t group_size, bool concat_u, bool concat_x) {
#if defined(CPU_CAPABILITY_AVX2)
  if (concat_u || concat_x || (width != 16 && width != 32) || group_size % 16 != 0) return 0;
  return static_cast<int>(width / 16 * 10 + group_size / 16);
#else
  return 0;
#endif
}

// Whether the forward's rows run its GEMM too (rows512, at dim 32), or leave it to sgemm.
bool output_rows_run_gemm(int kind, int64_t dim) {
#if defined(CPU_CAPABILITY_AVX2)
  return kind != 0 && dim == 32 && cpu_has_avx512f();
#else
  return false;
#endif
}

void output_fwd_rows(int kind, const OutputRows& p, float eps, int64_t rows) {
#if defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx512f()) {
    switch (kind) {
      case 11: return rows512::output_fwd_rows<1, 1>(p, eps, rows);
      case 21: return rows512::output_fwd_rows<2, 1>(p, eps, rows);
      case 22: return rows512::output_fwd_rows<2, 2>(p, eps, rows);
    }
  } else {
    switch (kind) {
      case 11: return rows256::output_fwd_rows<2, 2>(p, eps, rows);
      case 21: return rows256::output_fwd_rows<4, 2>(p, eps, rows);
      case 22: return rows256::output_fwd_rows<4, 4>(p, eps, rows);
    }
  }
#endif
  TORCH_CHECK(false, "output_fwd_rows: no kernel of kind ", kind);
}

void output_bwd_rows(int kind, const OutputRows& p, int64_t rows) {
#if defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx512f()) {
    switch (kind) {
      case 11: return rows512::output_bwd_rows<1, 1>(p, rows);
      case 21: return rows512::output_bwd_rows<2, 1>(p, rows);
      case 22: return rows512::output_bwd_rows<2, 2>(p, rows);
    }
  } else {
    switch (kind) {
      case 11: return rows256::output_bwd_rows<2, 2>(p, rows);
      case 21: return rows256::output_bwd_rows<4, 2>(p, rows);
      case 22: return rows256::output_bwd_rows<4, 4>(p, rows);
    }
  }
#endif
  TORCH_CHECK(false, "output_bwd_rows: no kernel of kind ", kind);
}

// Whether the uvqk forward's rows (uvqk_norm_rows, uvqk_split_rows of hstu_layer_rows.inc) serve a layer:
// D = 32 (the small model's) and u, v, q, k widths in whole 16-lane vectors; else layer_norm_augmented
// and silu_block / copy_row.
bool uvqk_rows_fit(int64_t d, int64_t hl, int64_t ha) {
#if defined(CPU_CAPABILITY_AVX2)
  return d == 32 && hl % 16 == 0 && ha % 16 == 0;
#else
  return false;
#endif
}

bool uvqk_bwd_rows_fit(int64_t d, int64_t hl, int64_t ha) {
#if defined(CPU_CAPABILITY_AVX2)
  return uvqk_rows_fit(d, hl, ha) && cpu_has_avx512f();
#else
  return false;
#endif
}

void uvqk_norm_rows(const float* x, const float* nw, const float* nb, float eps, float* stats, bool compute_stats,
                    int64_t rows, float* xa) {
#if defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx512f()) return rows512::uvqk_norm_rows<2>(x, nw, nb, eps, stats, compute_stats, rows, xa);
  return rows256::uvqk_norm_rows<4>(x, nw, nb, eps, stats, compute_stats, rows, xa);
#endif
  TORCH_CHECK(false, "uvqk_norm_rows: not in this build");
}

void uvqk_split_rows(const float* z, int64_t rows, int64_t hl, int64_t ha, bool silu_qkv, float* u, float* v, float* q,
                     float* k) {
#if defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx512f()) return rows512::uvqk_split_rows(z, rows, hl, ha, silu_qkv, u, v, q, k);
  return rows256::uvqk_split_rows(z, rows, hl, ha, silu_qkv, u, v, q, k);
#endif
  TORCH_CHECK(false, "uvqk_split_rows: not in this build");
}

void uvqk_norm_bwd_rows(const float* dxn, const float* x, const float* stats, const float* nw, double* dnw, double* dnb,
                        float* dx, const float* dx_add, int64_t rows) {
#if defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx512f()) return rows512::uvqk_norm_bwd_rows<2>(dxn, x, stats, nw, dnw, dnb, dx, dx_add, rows);
  return rows256::uvqk_norm_bwd_rows<4>(dxn, x, stats, nw, dnw, dnb, dx, dx_add, rows);
#endif
  TORCH_CHECK(false, "uvqk_norm_bwd_rows: not in this build");
}

// Whether the uvqk backward's dz rows (uvqk_dz_rows, hstu_layer_rows.inc) serve a layer: the small
// model's (D = 32, u, v, q, k 32 wide each, silu_qkv), on AVX-512F. Else sgemm recomputes the
// pre-activations and silu_block / copy_row build dz. On AVX2 (GEM_KERNELS_NO_AVX512=1 on this Xeon,
// where MKL's sgemm still runs its AVX-512 kernels) the backward took 1.31-1.34x the time of sgemm +
// silu_block with one row of 12 ymm accumulators, 1.07-1.13x with 2 rows of 4 in three column passes
// (3 runs of 40 interleaved calls each, 1 thread): not kept; untried on a CPU without AVX-512.
bool uvqk_dz_rows_fit(int64_t d, int64_t hl, int64_t ha, bool silu_qkv) {
#if defined(CPU_CAPABILITY_AVX2)
  return silu_qkv && d == 32 && hl == 32 && ha == 32 && cpu_has_avx512f();
#else
  return false;
#endif
}

void uvqk_dz_rows(const float* xa, const float* wa, int64_t hl, int64_t ha, const float* gu, const float* gv,
                  const float* gq, const float* gk, int64_t rows, float* dz) {
#if defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx512f()) return rows512::uvqk_dz_rows<6, 4>(xa, wa, hl, ha, gu, gv, gq, gk, rows, dz);
#endif
  TORCH_CHECK(false, "uvqk_dz_rows: not in this build");
}

void check_cpu_2d(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, name, " must have 2 dims, got ", t.dim());
}

// Most rows of one chunk: the unit of dynamic scheduling and of the weight-gradient and norm-weight
// partial sums (their order, hence their bits, depends on the chunking and not on the thread count).
constexpr int64_t kChunkRows = 512;

// Most rows per block such that the block's [rows, width] GEMM output is at most 256 Ki floats
// (1 MiB, half of this Xeon's L2), a power of two in [32, kChunkRows].
int64_t block_rows(int64_t width) {
  int64_t rows = kChunkRows;
  while (rows > 32 && rows * width > (int64_t(1) << 18)) rows /= 2;
  return rows;
}

// How a pass splits its n rows: `count` chunks of `rows` rows (the last one fewer), each run in
// blocks of at most `block` rows (equal but for the last), all from n and the width alone.
struct Chunking {
  int64_t count, rows, block;
  int64_t begin(int64_t c) const { return c * rows; }
  int64_t end(int64_t c, int64_t n) const { return std::min(n, (c + 1) * rows); }
};

// More than one chunk: a multiple of 4 of equal ones, so that dynamic claims over 2 or 4 threads end
// together. 512-row chunks left the last one short: N = 2597 (the hstu_layer bench at history 1024)
// was 5 chunks and 37 rows, 3 chunks on one of 2 threads against 2 on the other, the projections
// 18 % over an even split, where eager's multi-threaded GEMMs split evenly (fwd+bwd 75.8 ms fused
// against 69.5 ms attn-only on the 2-thread quiet run, 0.92-0.95x at one thread); now 8 chunks of
// 325. The extra chunks cost one more weight-gradient partial each (sum_partials: one read of
// (D + 1) * O floats).
Chunking chunking(int64_t n, int64_t width) {
  int64_t count = (n + kChunkRows - 1) / kChunkRows;
  if (count > 1) count = (count + 3) / 4 * 4;
  if (count == 0) return {0, 0, 1};
  const int64_t rows = (n + count - 1) / count;
  const int64_t blocks = (rows + block_rows(width) - 1) / block_rows(width);
  // count recomputed: past a few hundred chunks, equal ones of `rows` can cover n in fewer.
  return {(n + rows - 1) / rows, rows, (rows + blocks - 1) / blocks};
}

// xa = [LayerNorm(x) | 1] for rows [r0, r0 + rows) into xa [rows, D + 1], each row's stats computed
// into stats (compute_stats) or read from it. The ones column carries the uvqk bias through the GEMM
// (xa @ [W; b]): no broadcast bias written and read back; in the backward db is the last row of the
// weight-gradient GEMM (xa^T @ dz) instead of a separate column-sum pass.
void layer_norm_augmented(const float* xp, const float* nwp, const float* nbp, float eps, float* sp,
                          bool compute_stats, int64_t r0, int64_t rows, int64_t d, float* xa) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = r0 + i;
    const float* xr = xp + r * d;
    if (compute_stats) std::tie(sp[2 * r], sp[2 * r + 1]) = moments(xr, d, eps);
    normalize_row(xr, sp[2 * r], sp[2 * r + 1], nwp, nbp, xa + i * (d + 1), d);
    xa[i * (d + 1) + d] = 1.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// uvqk half
// ---------------------------------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> hstu_uvqk_fwd_cpu(const Tensor& x_in, const Tensor& norm_weight,
                                                                     const Tensor& norm_bias, double eps,
                                                                     const Tensor& uvqk_weight,
                                                                     const Tensor& uvqk_bias, int64_t num_heads,
                                                                     int64_t linear_dim, int64_t attention_dim,
                                                                     bool silu_qkv) {
  check_cpu_2d(x_in, "x");
  check_cpu_2d(uvqk_weight, "uvqk_weight");
  const int64_t n = x_in.size(0), d = x_in.size(1);
  const int64_t hl = num_heads * linear_dim, ha = num_heads * attention_dim, o = 2 * hl + 2 * ha;
  TORCH_CHECK(uvqk_weight.size(0) == d && uvqk_weight.size(1) == o, "uvqk_weight must be [", d, ", ", o, "], got ",
              uvqk_weight.sizes());
  TORCH_CHECK(uvqk_bias.numel() == o && norm_weight.numel() == d && norm_bias.numel() == d,
              "uvqk_bias / norm_weight / norm_bias sizes do not match the layer");
  const Tensor x = as_float(x_in), nw = as_float(norm_weight), nb = as_float(norm_bias);
  const Tensor w = float_rows(uvqk_weight), b = as_float(uvqk_bias);
  const auto opts = x.options();
  Tensor outs[4] = {at::empty({n, hl}, opts), at::empty({n, hl}, opts), at::empty({n, ha}, opts),
                    at::empty({n, ha}, opts)};
  const int64_t starts[4] = {0, hl, 2 * hl, 2 * hl + ha}, widths[4] = {hl, hl, ha, ha};
  float* out_ptrs[4] = {outs[0].data_ptr<float>(), outs[1].data_ptr<float>(), outs[2].data_ptr<float>(),
                        outs[3].data_ptr<float>()};
  Tensor stats = at::empty({n, 2}, opts);
  const Tensor wa = append_row(w, b);
  const float* xp = x.data_ptr<float>();
  const float* nwp = nw.data_ptr<float>();
  const float* nbp = nb.data_ptr<float>();
  const float* wap = wa.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  const Chunking ch = chunking(n, o);
  const bool rows_fit = uvqk_rows_fit(d, hl, ha);
  parallel_ranges(ch.count, 1, workers_for(n * d * o * 2), [&](auto& claim) {
    const SingleThreadBlas single_thread;
    std::vector<float> xa(ch.block * (d + 1)), z(ch.block * o);
    for (int64_t c0, c1; claim(c0, c1);) {
      for (int64_t r0 = ch.begin(c0), r1 = ch.end(c0, n); r0 < r1; r0 += ch.block) {
        const int64_t rows = std::min(ch.block, r1 - r0);
        if (rows_fit) {
          uvqk_norm_rows(xp + r0 * d, nwp, nbp, static_cast<float>(eps), sp + 2 * r0, true, rows, xa.data());
        } else {
          layer_norm_augmented(xp, nwp, nbp, static_cast<float>(eps), sp, true, r0, rows, d, xa.data());
        }
        mm(false, false, rows, o, d + 1, 1.0f, xa.data(), d + 1, wap, o, 0.0f, z.data(), o);
        if (rows_fit) {
          uvqk_split_rows(z.data(), rows, hl, ha, silu_qkv, out_ptrs[0] + r0 * hl, out_ptrs[1] + r0 * hl,
                          out_ptrs[2] + r0 * ha, out_ptrs[3] + r0 * ha);
          continue;
        }
        // Epilogue: the block's [rows, O] product split into the four outputs, SiLU on v, q, k when
        // silu_qkv (u's SiLU is applied by the output half's prologue: the forward keeps no activation
        // for its backward).
        // Row by row, each row's four parts in turn: one output at a time over the block's rows
        // (silu_block over rows) measured 3 % slower here (1.06 against 1.03 ms, small model, 1 thread).
        for (int64_t i = 0; i < rows; ++i) {
          const float* zr = z.data() + i * o;
          for (int s = 0; s < 4; ++s) {
            float* dst = out_ptrs[s] + (r0 + i) * widths[s];
            if (silu_qkv && s > 0) {
              silu_block<SiluRow::kForward>({zr + starts[s], 0, nullptr, 0, dst, 0, nullptr, 0}, 1, widths[s]);
            } else {
              copy_row(zr + starts[s], dst, widths[s]);
            }
          }
        }
      }
    }
  });
  const auto dtype = x_in.scalar_type();
  return {outs[0].to(dtype), outs[1].view({n, num_heads, linear_dim}).to(dtype),
          outs[2].view({n, num_heads, attention_dim}).to(dtype),
          outs[3].view({n, num_heads, attention_dim}).to(dtype), stats};
}

// out[j] = the sum over parts c of partials[c * size + j], in part order, accumulated in fp64: the
// weight gradients' per-chunk partial GEMMs. Parallel over column blocks, each element's sum in the
// same order whatever the thread count; each partial read once. ATen's sum(0, kDouble) before it cast
// the partials to a double copy first, then summed and cast back: 3-4 ms of a 40 ms uvqk backward at
// D = 256, O = 1024, N = 4096 (8 MiB of partials), where eager's one GEMM over all rows has none.
void sum_partials(const float* partials, int64_t parts, int64_t size, float* out) {
  constexpr int64_t kCols = 1024;  // one block's fp64 accumulators: 8 KiB, in L1
  parallel_dynamic((size + kCols - 1) / kCols, parts * size, [&](int64_t block) {
    const int64_t j0 = block * kCols, cols = std::min(kCols, size - j0);
    const int64_t nv = cols - cols % kLanesD;
    alignas(64) double acc[kCols];
    std::fill(acc, acc + cols, 0.0);
    for (int64_t c = 0; c < parts; ++c) {
      const float* p = partials + c * size + j0;
      for (int64_t j = 0; j < nv; j += kLanesD) (VecD::loadu(acc + j) + load_wide(p + j)).store(acc + j);
      for (int64_t j = nv; j < cols; ++j) acc[j] += p[j];
    }
    for (int64_t j = 0; j < cols; ++j) out[j0 + j] = static_cast<float>(acc[j]);
  });
}

// acc[0, dim) = (first) or += (else) the column sums of g's rows [rows, dim]: the output bias's gradient,
// a chunk's partial beside its dW partial, summed per block while the block's g rows are in cache (the
// dW GEMM just read them). Even and odd rows in two sets of accumulators (two add chains per vector).
template <int kNV>
void column_sums_block(const float* g, int64_t rows, int64_t dim, int64_t j0, bool first, float* acc) {
  Vec even[kNV], odd[kNV];
  for (int v = 0; v < kNV; ++v) even[v] = odd[v] = Vec(0.0f);
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2)
    for (int v = 0; v < kNV; ++v) {
      even[v] = even[v] + Vec::loadu(g + r * dim + j0 + v * Vec::size());
      odd[v] = odd[v] + Vec::loadu(g + (r + 1) * dim + j0 + v * Vec::size());
    }
  if (r < rows)
    for (int v = 0; v < kNV; ++v) even[v] = even[v] + Vec::loadu(g + r * dim + j0 + v * Vec::size());
  for (int v = 0; v < kNV; ++v) {
    float* a = acc + j0 + v * Vec::size();
    const Vec sum = even[v] + odd[v];
    (first ? sum : sum + Vec::loadu(a)).store(a);
  }
}

void column_sums(const float* g, int64_t rows, int64_t dim, bool first, float* acc) {
  constexpr int64_t kV = Vec::size();
  const int64_t nv = dim - dim % kV;
  int64_t j0 = 0;
  for (; j0 + 4 * kV <= nv; j0 += 4 * kV) column_sums_block<4>(g, rows, dim, j0, first, acc);
  for (; j0 < nv; j0 += kV) column_sums_block<1>(g, rows, dim, j0, first, acc);
  for (int64_t j = nv; j < dim; ++j) {
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) sum += g[r * dim + j];
    acc[j] = first ? sum : acc[j] + sum;
  }
}

// Per-chunk fp64 partial sums [chunks, 2 * width] reduced in chunk order -> two separate fp32 [width]
// tensors (an op's outputs may not share storage).
// A plain loop, not ATen's partials.sum(0) + two narrow().clone(): at the small model's [20, 64] partials
// those were ~5 dispatched ops and ~10 us a call (torch.profiler, 2 threads) for ~1,300 adds.
std::pair<Tensor, Tensor> reduce_partials(const Tensor& partials_in, int64_t width) {
  const Tensor partials = partials_in.contiguous();
  const int64_t parts = partials.size(0);
  const double* pp = partials.data_ptr<double>();
  const auto opts = partials.options().dtype(at::kFloat);
  Tensor first = at::empty({width}, opts), second = at::empty({width}, opts);
  float* out[2] = {first.data_ptr<float>(), second.data_ptr<float>()};
  for (int64_t j = 0; j < 2 * width; ++j) {
    double sum = 0.0;
    for (int64_t c = 0; c < parts; ++c) sum += pp[c * 2 * width + j];
    out[j / width][j % width] = static_cast<float>(sum);
  }
  return {first, second};
}

// grad_residual (optional, [N, D] in x's dtype): the layer's residual gradient, which the eager fast path's
// layer node hands over (out = x + ..., so x's gradient is this dx plus grad_out). fp32: added to each dx
// row in the norm backward's last pass (uvqk_norm_bwd_rows / norm_backward_row's dx_add) while the row is in
// registers / L1, in place of a separate dx.add_(grad_out): that pass read dx and grad_out and wrote dx
// (3 x N x D x 4 bytes, 3.6 MB at the small model's 9358 rows); folded, grad_out is read once and dx
// written once (-2.4 MB). Measured (step15, 2026-12-07, 2-core AMD EPYC Zen 4, SCHED_FIFO under the
// measuring lock, busy shared host; the model's own arguments at batch 256, the two forms alternated call
// by call, 400 pairs): 2 threads 1526 -> 1503 and 1535 -> 1509 us (paired -23 / -26 us, ratio 0.985 /
// 0.983). Another dtype rounds dx first and adds after (at::add_'s bits).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> hstu_uvqk_bwd_cpu(
    const Tensor& grad_u, const Tensor& grad_v, const Tensor& grad_q, const Tensor& grad_k, const Tensor& x_in,
    const Tensor& norm_weight, const Tensor& norm_bias, double eps, const Tensor& uvqk_weight,
    const Tensor& uvqk_bias, const Tensor& stats_in, int64_t num_heads, int64_t linear_dim, int64_t attention_dim,
    bool silu_qkv, const std::optional<Tensor>& grad_residual) {
  check_cpu_2d(x_in, "x");
  const int64_t n = x_in.size(0), d = x_in.size(1);
  const bool has_residual = grad_residual.has_value();
  if (has_residual) {
    const Tensor& r = *grad_residual;
    TORCH_CHECK_VALUE(r.device() == x_in.device() && r.scalar_type() == x_in.scalar_type() && r.sizes() == x_in.sizes(),
                      "grad_residual must have x's shape ", x_in.sizes(), ", dtype ", x_in.scalar_type(),
                      " and device, got ", r.sizes(), " ", r.scalar_type(), " on ", r.device());
  }
  // fp32 x: the residual's gradient is added in the norm backward's last pass (dx written once). Another
  // dtype rounds dx to it first and adds there, as at::add_ of the two gradients would.
  const bool add_in_rows = has_residual && x_in.scalar_type() == at::kFloat;
  const Tensor residual = add_in_rows ? grad_residual->contiguous() : Tensor();
  const float* rp = add_in_rows ? residual.data_ptr<float>() : nullptr;
  const int64_t hl = num_heads * linear_dim, ha = num_heads * attention_dim, o = 2 * hl + 2 * ha;
  const Tensor x = as_float(x_in), nw = as_float(norm_weight), nb = as_float(norm_bias);
  const Tensor w = float_rows(uvqk_weight), b = as_float(uvqk_bias), stats = as_float(stats_in);
  const int64_t starts[4] = {0, hl, 2 * hl, 2 * hl + ha}, widths[4] = {hl, hl, ha, ha};
  const Tensor grads[4] = {as_float(grad_u), as_float(grad_v), as_float(grad_q), as_float(grad_k)};
  const float* grad_ptrs[4] = {grads[0].data_ptr<float>(), grads[1].data_ptr<float>(), grads[2].data_ptr<float>(),
                               grads[3].data_ptr<float>()};
  const auto opts = x.options();
  const Tensor wa = append_row(w, b);
  // W^T contiguous for dxn = dz @ W^T: sgemm's NN kernel on it took 7 % less time than its NT one on
  // W (0.58 against 0.63 ms over the small model's 8.7k rows, 1 thread). In the transposed layout it is
  // the weight as it came.
  const Tensor wt = transposed_rows(w);
  const float* wtp = wt.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* nwp = nw.data_ptr<float>();
  const float* nbp = nb.data_ptr<float>();
  const float* wap = wa.data_ptr<float>();
  const float* sp = stats.data_ptr<float>();
  const Chunking ch = chunking(n, o);
  const int64_t chunks = ch.count;
  Tensor dx = at::empty({n, d}, opts);
  float* dxp = dx.data_ptr<float>();
  // Per chunk: [dW; db] = xa^T @ dz over its rows (fp32, as one GEMM over them), and the norm
  // weight / bias gradients in fp64: a norm weight's gradient sums N terms; in fp32, summed row
  // after row, it came out several ulps off where torch's pairwise sum is within one
  // (FlashAttention's rule failed).
  // The backward's rows on AVX-512F only: on AVX2 they measured 1.02x (0.94-1.05x, 5 pairs) of
  // layer_norm_augmented + norm_backward_row (see the header).
  const bool rows_fit = uvqk_bwd_rows_fit(d, hl, ha);
  const bool dz_rows = uvqk_dz_rows_fit(d, hl, ha, silu_qkv);
  Tensor dwa_partials = at::empty({chunks, d + 1, o}, opts);
  Tensor norm_partials = at::zeros({std::max<int64_t>(chunks, 1), 2 * d}, opts.dtype(at::kDouble));
  float* dwp = dwa_partials.data_ptr<float>();
  double* pp = norm_partials.data_ptr<double>();
  parallel_ranges(chunks, 1, workers_for(n * d * o * 4), [&](auto& claim) {
    const SingleThreadBlas single_thread;
    std::vector<float> xa(ch.block * (d + 1)), dz(ch.block * o), dxn(ch.block * d);
    std::vector<double> norm_scratch(2 * d);
    for (int64_t c0, c1; claim(c0, c1);) {
      float* dw_chunk = dwp + c0 * (d + 1) * o;
      double* dnw = pp + c0 * 2 * d;
      double* dnb = dnw + d;
      const int64_t chunk_begin = ch.begin(c0);
      for (int64_t r0 = chunk_begin, r1 = ch.end(c0, n); r0 < r1; r0 += ch.block) {
        const int64_t rows = std::min(ch.block, r1 - r0);
        // xa = [xn | 1] recomputed from the saved stats; with silu_qkv the pre-activations of v, q, k
        // too (one GEMM), then dz = grad * silu'(z) in place.
        if (rows_fit) {
          uvqk_norm_rows(xp + r0 * d, nwp, nbp, static_cast<float>(eps), const_cast<float*>(sp) + 2 * r0, false,
                         rows, xa.data());
        } else {
          layer_norm_augmented(xp, nwp, nbp, static_cast<float>(eps), const_cast<float*>(sp), false, r0, rows, d,
                               xa.data());
        }
        if (dz_rows) {
          uvqk_dz_rows(xa.data(), wap, hl, ha, grad_ptrs[0] + r0 * hl, grad_ptrs[1] + r0 * hl, grad_ptrs[2] + r0 * ha,
                       grad_ptrs[3] + r0 * ha, rows, dz.data());
        } else if (silu_qkv) {
          mm(false, false, rows, o - hl, d + 1, 1.0f, xa.data(), d + 1, wap + hl, o, 0.0f, dz.data() + hl, o);
        }
        for (int s = 0; s < 4 && !dz_rows; ++s) {
          const float* g = grad_ptrs[s] + r0 * widths[s];
          float* dzs = dz.data() + starts[s];
          if (silu_qkv && s > 0) {
            silu_block<SiluRow::kBackward>({dzs, o, g, widths[s], dzs, o, nullptr, 0}, rows, widths[s]);
          } else {
            for (int64_t i = 0; i < rows; ++i) copy_row(g + i * widths[s], dzs + i * o, widths[s]);
          }
        }
        // dxn = dz @ W^T; [dW; db] += xa^T @ dz.
        mm(false, false, rows, d, o, 1.0f, dz.data(), o, wtp, d, 0.0f, dxn.data(), d);
        mm(true, false, d + 1, o, rows, 1.0f, xa.data(), d + 1, dz.data(), o, r0 == chunk_begin ? 0.0f : 1.0f,
           dw_chunk, o);
        if (rows_fit) {
          uvqk_norm_bwd_rows(dxn.data(), xp + r0 * d, sp + 2 * r0, nwp, dnw, dnb, dxp + r0 * d,
                             rp != nullptr ? rp + r0 * d : nullptr, rows);
          continue;
        }
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t r = r0 + i;
          norm_backward_row(dxn.data() + i * d, nullptr, xp + r * d, sp[2 * r], sp[2 * r + 1], nwp, dnw, dnb,
                            dxp + r * d, rp != nullptr ? rp + r * d : nullptr, d, norm_scratch.data());
        }
      }
    }
  });
  // Chunk partials summed in chunk order, in fp64 (zeros when there are none).
  const Tensor dwa = at::empty({d + 1, o}, opts);
  sum_partials(dwp, chunks, (d + 1) * o, dwa.data_ptr<float>());
  const Tensor dw = dwa.narrow(0, 0, d), db = dwa.select(0, d).clone();
  auto [dnw, dnb] = reduce_partials(norm_partials, d);
  Tensor dx_out = dx.to(x_in.scalar_type());
  if (has_residual && !add_in_rows) dx_out.add_(*grad_residual);
  return {dx_out, dnw.to(norm_weight.scalar_type()), dnb.to(norm_bias.scalar_type()), in_layout_of(dw, uvqk_weight),
          db.to(uvqk_bias.scalar_type())};
}

// ---------------------------------------------------------------------------------------------
// output half
// ---------------------------------------------------------------------------------------------

struct OutputShape {
  int64_t n, width, groups, k;
};

OutputShape output_shape(const Tensor& attn, const Tensor& output_weight, int64_t num_heads, bool group_norm,
                         bool concat_u, bool concat_x) {
  check_cpu_2d(attn, "attn");
  check_cpu_2d(output_weight, "output_weight");
  const int64_t width = attn.size(1);
  const int64_t k = width * (1 + (concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  TORCH_CHECK(output_weight.size(0) == k, "output_weight must have ", k, " rows, got ", output_weight.sizes());
  TORCH_CHECK(num_heads >= 1 && width % num_heads == 0, "attn width ", width, " is not a multiple of num_heads ",
              num_heads);
  return {attn.size(0), width, group_norm ? num_heads : 1, k};
}

std::tuple<Tensor, Tensor> hstu_output_fwd_cpu(const Tensor& attn_in, const Tensor& u_in, const Tensor& x_in,
                                               const Tensor& norm_weight, const Tensor& norm_bias, double eps,
                                               const Tensor& output_weight,
                                               const std::optional<Tensor>& output_bias,
                                               const std::optional<Tensor>& dropout_mask, int64_t num_heads,
                                               bool group_norm, bool concat_u, bool concat_x) {
  const auto shape = output_shape(attn_in, output_weight, num_heads, group_norm, concat_u, concat_x);
  const int64_t n = shape.n, width = shape.width, k = shape.k, dim = x_in.size(1);
  TORCH_CHECK(output_weight.size(1) == dim, "output_weight must have ", dim, " columns, got ", output_weight.sizes());
  const Tensor a = as_float(attn_in), u = as_float(u_in), x = as_float(x_in);
  // W [K, D] contiguous (the GEMM and the AVX-512 rows read it so): one transposing copy of nn.Linear's.
  const Tensor nw = as_float(norm_weight), nb = as_float(norm_bias);
  const Tensor w = contiguous_rows(float_rows(output_weight));
  const Tensor mask = dropout_mask.has_value() ? as_float(*dropout_mask) : Tensor();
  const NormSpec ns{shape.groups, width / shape.groups, nw.data_ptr<float>(), nb.data_ptr<float>(), group_norm};
  const auto opts = a.options();
  Tensor stats = at::empty({n, 2 * shape.groups}, opts);
  const float* ap = a.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  float* sp = stats.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const Tensor bias = output_bias.has_value() ? as_float(*output_bias) : Tensor();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  Tensor out = at::empty({n, dim}, opts);
  float* op = out.data_ptr<float>();
  const int64_t y_off = width * ((concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  const int rows_kind = output_rows_kind(width, ns.group_size, concat_u, concat_x);
  const bool fused_gemm = output_rows_run_gemm(rows_kind, dim);
  const Tensor w_elem = rows_kind && group_norm ? nw.repeat_interleave(ns.group_size) : nw;
  const Tensor b_elem = rows_kind && group_norm ? nb.repeat_interleave(ns.group_size) : nb;
  const Chunking ch = chunking(n, k);
  parallel_ranges(ch.count, 1, workers_for(n * k * dim * 2), [&](auto& claim) {
    const SingleThreadBlas single_thread;
    std::vector<float> c(ch.block * k);
    for (int64_t c0, c1; claim(c0, c1);) {
      for (int64_t r0 = ch.begin(c0), r1 = ch.end(c0, n); r0 < r1; r0 += ch.block) {
        const int64_t rows = std::min(ch.block, r1 - r0);
        if (rows_kind != 0) {
          OutputRows rp{};
          rp.a = ap + r0 * width;
          rp.u = up + r0 * width;
          rp.mask = mp ? mp + r0 * k : nullptr;
          rp.stats = sp + r0 * 2 * shape.groups;
          rp.we = w_elem.data_ptr<float>();
          rp.be = b_elem.data_ptr<float>();
          rp.c = c.data();
          rp.x = xp + r0 * dim;
          rp.bias = bp;
          rp.out = op + r0 * dim;
          rp.dim = dim;
          rp.w = fused_gemm ? wp : nullptr;
          output_fwd_rows(rows_kind, rp, static_cast<float>(eps), rows);
          if (fused_gemm) continue;
        }
        for (int64_t i = 0; i < rows && rows_kind == 0; ++i) {
          const int64_t row = r0 + i;
          // silu(u) into c's u slot (concat_u) or y slot (scaled in place by the prologue), row by row
          // (the row stays in L1 for the prologue: one silu_block over the block's rows first was 3 %
          // slower here).
          float* s_row = c.data() + i * k + (concat_u ? 0 : y_off);
          silu_block<SiluRow::kForward>({up + row * width, 0, nullptr, 0, s_row, 0, nullptr, 0}, 1, width);
          output_prologue_row(ap + row * width, s_row, ns, static_cast<float>(eps), concat_u, concat_x,
                              mp ? mp + row * k : nullptr, sp + row * 2 * shape.groups, true, c.data() + i * k);
        }
        // The residual (and the bias) as the GEMM's accumulator (output_fwd_rows writes it row by row):
        // the block's rows are contiguous in x and out, one copy for all of them (a copy per row was a
        // memmove call per 32 floats).
        float* oblock = op + r0 * dim;
        if (rows_kind == 0 && bp != nullptr) {
          for (int64_t i = 0; i < rows; ++i)
            at::vec::map2([](Vec p, Vec q) { return p + q; }, oblock + i * dim, xp + (r0 + i) * dim, bp, dim);
        } else if (rows_kind == 0) {
          std::copy(xp + r0 * dim, xp + (r0 + rows) * dim, oblock);
        }
        mm(false, false, rows, dim, k, 1.0f, c.data(), k, wp, dim, 1.0f, op + r0 * dim, dim);
      }
    }
  });
  return {out.to(x_in.scalar_type()), stats};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> hstu_output_bwd_cpu(
    const Tensor& grad_out_in, const Tensor& attn_in, const Tensor& u_in, const Tensor& norm_weight,
    const Tensor& norm_bias, double eps, const Tensor& output_weight, bool has_output_bias,
    const std::optional<Tensor>& dropout_mask, const Tensor& stats_in, int64_t num_heads, bool group_norm,
    bool concat_u, bool concat_x) {
  const auto shape = output_shape(attn_in, output_weight, num_heads, group_norm, concat_u, concat_x);
  const int64_t n = shape.n, width = shape.width, k = shape.k, groups = shape.groups;
  const int64_t gs = width / groups;
  const Tensor g = as_float(grad_out_in), a = as_float(attn_in), u = as_float(u_in);
  const Tensor nw = as_float(norm_weight), nb = as_float(norm_bias), w_in = float_rows(output_weight);
  const Tensor mask = dropout_mask.has_value() ? as_float(*dropout_mask) : Tensor();
  const Tensor stats = as_float(stats_in);
  const NormSpec ns{groups, gs, nw.data_ptr<float>(), nb.data_ptr<float>(), group_norm};
  const auto opts = a.options();
  const float* ap = a.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  float* sp = stats.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const Chunking ch = chunking(n, k);
  const int64_t chunks = ch.count;
  Tensor dattn = at::empty({n, width}, opts), du = at::empty({n, width}, opts);
  // Per chunk: dW = c^T @ g over its rows (fp32), with the output bias, g's column sums (fp32) as row k
  // (in place of a g.sum(0) pass over all N rows before the kernel); and the norm-weight partials in
  // fp64 (see the uvqk backward), per element even with group_norm (weight per head): the heads' sums
  // over Lh are taken at the end.
  const int64_t dw_rows = k + (has_output_bias ? 1 : 0);
  Tensor dw_partials = at::empty({chunks, dw_rows, w_in.size(1)}, opts);
  Tensor partials = at::zeros({std::max<int64_t>(chunks, 1), 2 * width}, opts.dtype(at::kDouble));
  float* dwp = dw_partials.data_ptr<float>();
  float* dap = dattn.data_ptr<float>();
  float* dup = du.data_ptr<float>();
  double* pp = partials.data_ptr<double>();
  const int64_t dim = w_in.size(1);
  const int64_t y_off = width * ((concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  // Norm's weight and bias per element (GroupNorm's per-head values repeated over the head's Lh).
  const Tensor w_elem = group_norm ? nw.repeat_interleave(gs) : nw, b_elem = group_norm ? nb.repeat_interleave(gs) : nb;
  const float* wep = w_elem.data_ptr<float>();
  const float* bep = b_elem.data_ptr<float>();
  const int rows_kind = output_rows_kind(width, gs, concat_u, concat_x);
  // dc = g @ W^T in registers by the rows (AVX-512, width and dim 32), 8 rows before their row work:
  // the output backward took 0.96x the time of the same rows after sgemm's dc (median of 8 interleaved
  // pairs of processes, 0.89-1.02, 1 thread).
  const bool dc_gemm = width == 32 && output_rows_run_gemm(rows_kind, dim);
  // The rows' dc GEMM reads W^T [D, K]: a transposed weight's own memory. sgemm's dc reads W [K, D] (NT):
  // its NN kernel on W^T gave other bits (at K = 45, D = 23), so a transposed weight is copied for it.
  const Tensor wt = dc_gemm ? transposed_rows(w_in) : Tensor();
  const Tensor w = dc_gemm ? w_in : contiguous_rows(w_in);
  const float* wp = w.data_ptr<float>();
  parallel_ranges(chunks, 1, workers_for(n * k * dim * 4), [&](auto& claim) {
    const SingleThreadBlas single_thread;
    std::vector<float> silu_buf(2 * ch.block * width), c(ch.block * k), dc(ch.block * k);
    std::vector<double> norm_scratch(2 * gs);
    for (int64_t c0, c1; claim(c0, c1);) {
      float* dw_chunk = dwp + c0 * dw_rows * dim;
      double* dnw = pp + c0 * 2 * width;
      double* dnb = dnw + width;
      const int64_t chunk_begin = ch.begin(c0);
      for (int64_t r0 = chunk_begin, r1 = ch.end(c0, n); r0 < r1; r0 += ch.block) {
        const int64_t rows = std::min(ch.block, r1 - r0);
        // dc = g @ W^T; then per row c recomputed (the forward's prologue with its saved stats) for
        // the weight gradient, and the gating / norm backward.
        if (!dc_gemm) mm(false, true, rows, k, dim, 1.0f, gp + r0 * dim, dim, wp, dim, 0.0f, dc.data(), k);
        float* s_block = silu_buf.data();
        float* sgrad_block = s_block + rows * width;
        if (rows_kind == 0)
          silu_block<SiluRow::kGrad>({up + r0 * width, width, nullptr, 0, s_block, width, sgrad_block, width}, rows,
                                     width);
        if (rows_kind != 0) {
          OutputRows rp{};
          rp.a = ap + r0 * width;
          rp.u = up + r0 * width;
          rp.mask = mp ? mp + r0 * k : nullptr;
          rp.stats = sp + r0 * 2 * groups;
          rp.we = wep;
          rp.be = bep;
          rp.c = c.data();
          rp.dc = dc.data();
          rp.da = dap + r0 * width;
          rp.du = dup + r0 * width;
          rp.dnw = dnw;
          rp.dnb = dnb;
          rp.g = gp + r0 * dim;
          rp.wt = dc_gemm ? wt.data_ptr<float>() : nullptr;
          rp.gsum = dc_gemm && has_output_bias ? dw_chunk + k * dim : nullptr;
          rp.gsum_first = r0 == chunk_begin;
          output_bwd_rows(rows_kind, rp, rows);
        }
        for (int64_t i = 0; i < rows && rows_kind == 0; ++i) {
          const int64_t row = r0 + i;
          const float* ar = ap + row * width;
          const float* s = s_block + i * width;
          const float* sgrad = sgrad_block + i * width;
          output_prologue_row(ar, s, ns, static_cast<float>(eps), concat_u, concat_x, mp ? mp + row * k : nullptr,
                              sp + row * 2 * groups, false, c.data() + i * k);
          float* dcr = dc.data() + i * k;
          if (mp != nullptr) at::vec::map2([](Vec p, Vec q) { return p * q; }, dcr, dcr, mp + row * k, k);
          const float* dy = dcr + y_off;
          float* dar = dap + row * width;
          float* dur = dup + row * width;
          for (int64_t grp = 0; grp < groups; ++grp) {
            const int64_t e0 = grp * gs;
            const float mean = sp[row * 2 * groups + grp], rstd = sp[row * 2 * groups + groups + grp];
            const float* we = wep + e0;
            const float* be = bep + e0;
            // du = (dy * Norm(a) + dc_u) * silu'(u), in fp32 as eager (no cancellation).
            for (int64_t j = 0; j < gs; ++j) {
              const float normed = (ar[e0 + j] - mean) * rstd * we[j] + be[j];
              dur[e0 + j] = (dy[e0 + j] * normed + (concat_u ? dcr[e0 + j] : 0.0f)) * sgrad[e0 + j];
            }
            norm_backward_row(dy + e0, s + e0, ar + e0, mean, rstd, we, dnw + e0, dnb + e0, dar + e0,
                              concat_x ? dcr + (concat_u ? width : 0) + e0 : nullptr, gs, norm_scratch.data());
          }
        }
        mm(true, false, k, dim, rows, 1.0f, c.data(), k, gp + r0 * dim, dim, r0 == chunk_begin ? 0.0f : 1.0f,
           dw_chunk, dim);
        if (has_output_bias && !dc_gemm)
          column_sums(gp + r0 * dim, rows, dim, r0 == chunk_begin, dw_chunk + k * dim);
      }
    }
  });
  // Chunk partials summed in chunk order, in fp64 (zeros when there are none).
  const Tensor dwb = at::empty({dw_rows, dim}, opts);
  sum_partials(dwp, chunks, dw_rows * dim, dwb.data_ptr<float>());
  const Tensor dw = dwb.narrow(0, 0, k);
  const Tensor dob =
      has_output_bias ? dwb.select(0, k).clone().to(output_weight.scalar_type()) : at::empty({0}, opts);
  const Tensor per_element = group_norm ? partials.view({partials.size(0), 2 * groups, gs}).sum(2) : partials;
  auto [dnw, dnb] = reduce_partials(per_element, nw.numel());
  return {dattn.to(attn_in.scalar_type()), du.to(u_in.scalar_type()), dnw.to(norm_weight.scalar_type()),
          dnb.to(norm_bias.scalar_type()), in_layout_of(dw, output_weight), dob};
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("hstu_uvqk_fwd_native", &hstu_uvqk_fwd_cpu);
  m.impl("hstu_uvqk_bwd_native", &hstu_uvqk_bwd_cpu);
  m.impl("hstu_output_fwd_native", &hstu_output_fwd_cpu);
  m.impl("hstu_output_bwd_native", &hstu_output_bwd_cpu);
}

}  // namespace gem_kernels
