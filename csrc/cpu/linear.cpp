// CPU kernels of the linear family: nn.Linear with its bias and an optional ReLU fused, on one input
// or on two inputs whose concatenation is never built (gem_kernels/ops/linear.py):
//   out = act(concat(x, x2) W^T + b),  W = [W1 | W2] (nn.Linear's weight [N, K1 + K2])
//   backward: g = act'(out) * grad_out;  grad_x = g W1, grad_x2 = g W2, grad_W = g^T concat(x, x2),
//   grad_b = colsum(g).
//
// Work decomposition: the rows are split into one contiguous chunk per thread (at::parallel_for, at
// least kMinChunkRows rows a chunk, so a small batch runs on one thread); a worker multiplies its
// chunk in blocks of rows (one block at the GEM model's sizes, see block_rows) with single-threaded
// sgemm (cpu_blas.h) and runs the epilogue on each block right after its GEMM:
//   forward: block = x_blk W1^T (+ x2_blk W2^T), then bias and ReLU in place;
//   backward: g_blk = the ReLU mask applied to grad_out's block (a scratch, or grad_out itself without
//   ReLU) with its column sums added to the chunk's fp32 bias partial, then grad_x's block = g_blk W1
//   (and W2), and the chunk's grad_W partial += g_blk^T x_blk. The partials (one [N, K] per chunk
//   after the first, which writes grad_W itself) are summed at the end.
// What it replaces: torch's addmm (a broadcast copy of the bias into the output, then the GEMM reading
// it back), relu_, and in the backward threshold_backward, AddmmBackward's two mm and its bias `sum`:
// five passes over [R, N] besides the GEMMs, and each GEMM's operands cold from the previous pass.
// Sums: grad_W and grad_b are summed per chunk, so their rounding depends on the thread count (as
// MKL's own threaded GEMM does), not on anything else.
//
// Roofline (fp32, R rows, K = K1 + K2): FLOPs 2*R*N*K forward (+ 2*R*N epilogue), 4*R*N*K backward;
// minimum bytes forward 4*(R*K + N*K + N + R*N), backward 4*(R*N [grad] + R*N [out, the mask] + R*K
// [x] + N*K [W] + R*K [grad_x] + N*K + N [grad_W, grad_b]).
//
// Why (issue 26, branch gemm14, 2026-12-07 16:00-17:00 UTC; 2-vCPU Xeon (SPR, KVM), SCHED_FIFO under the
// measuring lock, host busy: 2048^3 sgemm peak 0.357 TFLOP/s at 2 threads, 0.165 at 1). The GEM small
// model's nn.Linear GEMMs (R ~ 1100-1170 rows: over arch [32 | 512] -> 128 -> 64, Wukong MLPs 80 / 128 ->
// 128 -> 256; 24 calls > 5 MFLOP a step) took 6.42 ms a step in the step at 2 threads (0.189 TFLOP/s,
// timed per call under a TorchDispatchMode); the same calls, same layouts, on fresh tensors: each one hot
// (50x in a row) 4.77 ms (0.255), the step's sequence back to back 5.85 (0.208), the sequence with 200 us
// of serial work between calls 6.48 (0.188), with a 16 MiB stream between calls 7.75 (0.157). So about
// 1.1 ms of the 1.65 ms gap is operands cold from the ops between (each GEMM's inputs were written
// by another op, the output is a fresh 0.6-2.4 MB), ~0.6 ms the worker thread idle between calls; MKL's
// weight packing and the outputs' allocation are in the hot figure too. Besides the GEMMs, torch's
// Linear + ReLU ran relu_, threshold_backward and AddmmBackward's bias `sum` as passes of their own
// (0.12 + 0.25 + 0.41 ms a step at 2 threads, profiler). This kernel attacks both: one op per layer
// and direction, each row block's epilogue (bias, ReLU; backward the mask and the bias sums) on the
// block in cache, and grad_x / grad_W from the masked block while it is there.
// Measured (same machine and hour): the model's seven R-row layers fwd+bwd back to back, natives vs
// torch's Linear + ReLU with autograd, paired in one process: 2 threads 5.55 vs 7.63 ms (0.73x), 1
// thread 10.14 vs 12.30 (0.82x); per layer 0.49x (64 -> 2) to 0.82x (128 -> 256, no ReLU). In the
// step the profiler gives 5.96 ms for the natives against 7.72 for the ops they replace (2 threads).
// The training step (scripts/linear_step_ab.py: gk.nn.MLP fused vs pinned to reference, alternated per
// round of 8 batches in one process, SCHED_FIFO under the lock, 2048^3 peak 0.30-0.33 TFLOP/s that
// hour): 2 threads -1.82 / -1.67 / -1.53 ms (paired medians; wall 0.948 / 0.955 / 0.947x of ~34-36 ms),
// 1 thread -1.28 / -0.67 ms (0.983 / 0.996x of ~52-54 ms).
// Measured and not kept: blocks sized to stay in L2 (~1 MiB of rows, the epilogue on data in cache): a
// few % slower than one sgemm per chunk (block_rows below). Bias sums in fp32: fast, but up to 2 ulps
// further from the exact sum than torch's cascade sum; in fp64 fused into the mask's loop, GCC left
// it scalar: +1.5 ms a step at 1 thread (kept in fp64, in a loop of its own). gk.nn.MLP calling the natives
// through a torch.autograd.Function of its own instead of the op (no dispatcher, no eager fast path):
// -0.01 to -0.7 ms a step more, within the noise of a busy hour, and a second fast path beside
// gem_kernels/_autograd.py's; not kept.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "gem_kernels/checks.h"
#include "gem_kernels/cpu_blas.h"

namespace gem_kernels {
namespace {

// A chunk of fewer rows is not worth a thread's wake-up (a 64-row block of the GEM model's widest
// layer is ~3 us of GEMM).
constexpr int64_t kMinChunkRows = 64;

// Rows of one GEMM block: each sgemm call repacks its weight operand and has a fixed cost, so blocks
// are large: the block's operands and results ((2N + 2K) floats a row: grad_out/out, x, grad_x rows)
// in about 8 MiB, so the GEM model's layers (R ~ 1100-1200) run one block per thread's chunk and only
// much larger batches are cut. Measured on the model's seven R-row layers fwd+bwd (2026-12-07, paired
// in one process): one block per chunk 0.63-0.67x torch's time at 2 threads and 0.76-0.81x at 1, blocks
// of ~1 MiB (195-1024 rows here) 0.70-0.74x and 0.81x; 128 or 256 rows no better.
int64_t block_rows(int64_t n, int64_t k) {
  const int64_t per_row = 4 * (2 * n + 2 * k);
  return std::clamp<int64_t>((int64_t{8} << 20) / std::max<int64_t>(per_row, 1), 64, 8192);
}

// grad_W = g^T x sums over rows, and a BLAS call's k-loop order is its own: for a small grad_W, MKL's
// path on a 2-core AMD EPYC (Zen 4) summed the 2100 rows of a [9, 15] grad_W in one chain, 3-4x the
// error of torch's own product of the same operands (past FlashAttention's rule, test_linear.py; a
// beta = 1 slice continues the same chain). So a grad_W of at most kSmallDw elements is summed as
// products over slices of kDwSliceRows rows (beta = 0, into a scratch) added in fp64: no chain longer
// than a slice. It costs an [N, K] add a slice, nothing beside such a small product's call; a larger
// grad_W goes through the BLAS's blocked path in one call a block (within the rule on both CPUs).
constexpr int64_t kSmallDw = 16384;
constexpr int64_t kDwSliceRows = 128;

int64_t num_chunks(int64_t rows) {
  return std::clamp<int64_t>(rows / kMinChunkRows, 1, at::get_num_threads());
}

int64_t row_stride(const at::Tensor& t) { return t.size(0) > 1 ? t.stride(0) : std::max<int64_t>(t.size(1), 1); }

// bias: nullptr in the backward (it does not read the bias).
void check_operands(const at::Tensor& x, const at::Tensor& x2, const at::Tensor& weight, const at::Tensor* bias) {
  GK_CHECK_CPU(x);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "linear_native (cpu): x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x2.dim() == 2 && weight.dim() == 2 && (bias == nullptr || bias->dim() == 1),
                    "linear_native: x, x2, weight must be 2-D and bias 1-D, got ", x.sizes(), ", ", x2.sizes(), ", ",
                    weight.sizes());
  for (const at::Tensor* t : {&x2, &weight, bias}) {
    if (t == nullptr) continue;
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->device() == x.device(),
                "linear_native (cpu): every operand must be a float32 tensor on x's device");
  }
  // Rows of x and x2 may be strided (a column slice of a wider tensor); their elements must be dense.
  TORCH_CHECK_VALUE((x.stride(1) == 1 || x.size(1) <= 1) && row_stride(x) >= x.size(1),
                    "linear_native: x's rows must be dense and not overlap, got strides ", x.strides());
  TORCH_CHECK_VALUE((x2.stride(1) == 1 || x2.size(1) <= 1) && row_stride(x2) >= x2.size(1),
                    "linear_native: x2's rows must be dense and not overlap, got strides ", x2.strides());
  TORCH_CHECK_VALUE(x2.size(0) == x.size(0), "linear_native: x2 must have x's ", x.size(0), " rows, got ", x2.size(0));
  TORCH_CHECK_VALUE(weight.is_contiguous() && (bias == nullptr || bias->is_contiguous()),
                    "linear_native: weight and bias must be contiguous");
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1) + x2.size(1), "linear_native: weight must have ", x.size(1) + x2.size(1),
              " columns (x's plus x2's), got ", weight.size(1));
  TORCH_CHECK_VALUE(bias == nullptr || bias->size(0) == weight.size(0), "linear_native: bias must have ", weight.size(0),
                    " elements, got ", bias == nullptr ? 0 : bias->size(0));
}

// out[r, :] = relu?(out[r, :] + bias) for the block's rows.
void bias_act_rows(float* out, int64_t rows, int64_t n, const float* bias, bool relu) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * n;
    if (relu) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = std::max(o[j] + bias[j], 0.0f);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] += bias[j];
    }
  }
}

// g[r, :] = out[r, :] > 0 ? grad[r, :] : 0 (ReLU's backward, torch's threshold_backward), and the
// column sums of g added to sums (in fp64: a chunk's sum runs over up to R / threads rows in order,
// where torch's sum is a cascade; in fp32 it measured up to ~2 ulps further from the exact sum than
// torch's at 97 rows).
void mask_colsum_rows(const float* grad, const float* out, float* g, int64_t rows, int64_t n, bool relu,
                      double* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = grad + r * n;
    if (relu) {
      const float* orow = out + r * n;
      float* grow = g + r * n;
#pragma omp simd
      // torch's threshold_backward: no gradient where out <= 0; a NaN output passes its gradient on.
      for (int64_t j = 0; j < n; ++j) grow[j] = orow[j] <= 0.0f ? 0.0f : gr[j];
      gr = grow;
    }
    // Its own loop: fused with the mask's, GCC left the fp64 sums scalar (1.5 ms a step at 1 thread).
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sums[j] += static_cast<double>(gr[j]);
  }
}

}  // namespace

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias,
                      bool relu) {
  check_operands(x, x2, weight, &bias);
  const int64_t R = x.size(0), K1 = x.size(1), K2 = x2.size(1), N = weight.size(0), K = K1 + K2;
  auto out = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return out;
  const float *xp = x.data_ptr<float>(), *x2p = x2.data_ptr<float>(), *w = weight.data_ptr<float>(),
              *b = bias.data_ptr<float>();
  const int64_t ldx = row_stride(x), ldx2 = row_stride(x2);
  float* o = out.data_ptr<float>();
  const int64_t chunks = num_chunks(R), block = block_rows(N, K);
  at::parallel_for(0, chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    SingleThreadBlas single;
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t r_end = R * (c + 1) / chunks;
      for (int64_t r0 = R * c / chunks; r0 < r_end; r0 += block) {
        const int64_t rows = std::min(block, r_end - r0);
        float* ob = o + r0 * N;
        if (K1 > 0) mm(false, true, rows, N, K1, 1.0f, xp + r0 * ldx, ldx, w, K, 0.0f, ob, N);
        if (K2 > 0) mm(false, true, rows, N, K2, 1.0f, x2p + r0 * ldx2, ldx2, w + K1, K, K1 > 0 ? 1.0f : 0.0f, ob, N);
        if (K == 0) std::fill(ob, ob + rows * N, 0.0f);
        bias_act_rows(ob, rows, N, b, relu);
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& x2, const at::Tensor& weight,
    const at::Tensor& out, bool relu) {
  check_operands(x, x2, weight, nullptr);
  const int64_t R = x.size(0), K1 = x.size(1), K2 = x2.size(1), N = weight.size(0), K = K1 + K2;
  GK_CHECK_CONTIGUOUS(grad_out);
  TORCH_CHECK_VALUE(grad_out.scalar_type() == at::kFloat && grad_out.dim() == 2 && grad_out.size(0) == R &&
                  grad_out.size(1) == N,
              "linear_backward_native: grad_out must be float32 [", R, ", ", N, "], got ", grad_out.sizes());
  if (relu) {
    GK_CHECK_CONTIGUOUS(out);
    TORCH_CHECK_VALUE(out.sizes() == grad_out.sizes() && out.scalar_type() == at::kFloat,
                "linear_backward_native: out must be float32 [", R, ", ", N, "] with relu, got ", out.sizes());
  }
  auto grad_x = at::empty({R, K1}, x.options()), grad_x2 = at::empty({R, K2}, x.options());
  auto grad_w = at::empty({N, K}, x.options());
  const int64_t chunks = num_chunks(R), block = block_rows(N, K);
  // Chunk c > 0 sums into partials[c - 1]; the bias sums of every chunk in fp64.
  auto partials = at::empty({chunks - 1, N, K}, x.options());
  auto bias_partials = at::empty({chunks, N}, x.options().dtype(at::kDouble));
  if (R == 0 || N == 0 || K == 0) {
    // No rows: zero weight and bias gradients; no weight columns: the bias gradient still sums grad_out.
    grad_w.zero_();
    auto grad_b = relu && R > 0 ? grad_out.masked_fill(out <= 0, 0.0f).sum(0) : grad_out.sum(0);
    return {grad_x.zero_(), grad_x2.zero_(), grad_w, grad_b.to(x.scalar_type())};
  }
  // Without ReLU the GEMMs read grad_out itself; with it, each block's masked rows go to this scratch.
  auto masked = relu ? at::empty({R, N}, x.options()) : grad_out;
  const float *go = grad_out.data_ptr<float>(), *op = relu ? out.data_ptr<float>() : nullptr,
              *xp = x.data_ptr<float>(), *x2p = x2.data_ptr<float>(), *w = weight.data_ptr<float>();
  const int64_t ldx = row_stride(x), ldx2 = row_stride(x2);
  float *g = masked.data_ptr<float>(), *gx = grad_x.data_ptr<float>(), *gx2 = grad_x2.data_ptr<float>();
  float *gw = grad_w.data_ptr<float>(), *parts = partials.data_ptr<float>();
  double* bsum = bias_partials.data_ptr<double>();
  at::parallel_for(0, chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    SingleThreadBlas single;
    const bool small_dw = N * K <= kSmallDw;
    std::vector<float> slice(small_dw ? N * K : 0);
    std::vector<double> dw64;
    for (int64_t c = c_begin; c < c_end; ++c) {
      float* dw = c == 0 ? gw : parts + (c - 1) * N * K;
      if (small_dw) dw64.assign(N * K, 0.0);
      const int64_t r_begin = R * c / chunks, r_end = R * (c + 1) / chunks;
      std::fill(bsum + c * N, bsum + (c + 1) * N, 0.0);
      for (int64_t r0 = r_begin; r0 < r_end; r0 += block) {
        const int64_t rows = std::min(block, r_end - r0);
        const float beta = r0 == r_begin ? 0.0f : 1.0f;
        const float* gb = g + r0 * N;
        mask_colsum_rows(go + r0 * N, relu ? op + r0 * N : nullptr, g + r0 * N, rows, N, relu, bsum + c * N);
        if (K1 > 0) mm(false, false, rows, K1, N, 1.0f, gb, N, w, K, 0.0f, gx + r0 * K1, K1);
        if (K2 > 0) mm(false, false, rows, K2, N, 1.0f, gb, N, w + K1, K, 0.0f, gx2 + r0 * K2, K2);
        if (small_dw) {
          for (int64_t s0 = 0; s0 < rows; s0 += kDwSliceRows) {
            const int64_t s_rows = std::min(kDwSliceRows, rows - s0);
            if (K1 > 0) mm(true, false, N, K1, s_rows, 1.0f, gb + s0 * N, N, xp + (r0 + s0) * ldx, ldx, 0.0f, slice.data(), K);
            if (K2 > 0) {
              mm(true, false, N, K2, s_rows, 1.0f, gb + s0 * N, N, x2p + (r0 + s0) * ldx2, ldx2, 0.0f, slice.data() + K1,
                 K);
            }
            for (int64_t i = 0; i < N * K; ++i) dw64[i] += slice[i];
          }
          continue;
        }
        if (K1 > 0) mm(true, false, N, K1, rows, 1.0f, gb, N, xp + r0 * ldx, ldx, beta, dw, K);
        if (K2 > 0) mm(true, false, N, K2, rows, 1.0f, gb, N, x2p + r0 * ldx2, ldx2, beta, dw + K1, K);
      }
      if (small_dw) {
        for (int64_t i = 0; i < N * K; ++i) dw[i] = static_cast<float>(dw64[i]);
      }
    }
  });
  if (chunks > 1) {
    // grad_W += the other chunks' partials, rows of grad_W split between the threads; likewise the bias.
    at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n_begin, int64_t n_end) {
      for (int64_t c = 1; c < chunks; ++c) {
        const float* p = parts + (c - 1) * N * K;
#pragma omp simd
        for (int64_t i = n_begin * K; i < n_end * K; ++i) gw[i] += p[i];
        for (int64_t n = n_begin; n < n_end; ++n) bsum[n] += bsum[c * N + n];
      }
    });
  }
  auto grad_b = at::empty({N}, x.options());
  float* gb = grad_b.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) gb[n] = static_cast<float>(bsum[n]);
  return {grad_x, grad_x2, grad_w, grad_b};
}

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("linear_native", &linear_cpu);
  m.impl("linear_backward_native", &linear_backward_cpu);
}

}  // namespace gem_kernels
