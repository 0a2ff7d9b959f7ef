// CPU kernels of the jagged family: jagged <-> padded copies, and the HSTU sequence layout (at the end).
//
// Work decomposition: at::parallel_for over sequences; one task owns whole sequences, so every
// output row is written by exactly one thread. A sequence's rows are contiguous on both sides
// ([N, D] values and [B, max_len, D] padded), so each sequence is one memcpy of min(L, max_len)*D
// elements plus one fill of the padding: the copy runs at memcpy speed with no per-element index
// math.
//
// Roofline: 0 FLOPs. Minimum bytes, jagged_to_padded: read sum_b min(L_b, max_len)*D*s, write
// B*max_len*D*s (s = element size). padded_to_jagged: read sum_b min(L_b, max_len)*D*s, write N*D*s.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "gem_kernels/checks.h"
#include "gem_kernels/jagged_checks.h"
#include "gem_kernels/cpu_alloc.h"
#include "gem_kernels/cpu_stream.h"
#include "gem_kernels/offsets_check.h"

namespace gem_kernels {
namespace {

// Enough bytes per task (~100 us of copying) that waking a second thread pays for itself: small
// batches run on the calling thread instead of waiting on a busy core.
constexpr int64_t kMinBytesPerTask = 1 << 20;

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kMinBytesPerTask / std::max<int64_t>(1, bytes_per_item));
}

at::Tensor jagged_to_padded_cpu(const at::Tensor& values, const at::Tensor& offsets, int64_t max_len,
                                double pad_value) {
  jagged_checks::to_padded(values, offsets, max_len, c10::DeviceType::CPU);
  const int64_t B = offsets.numel() - 1;
  const int64_t N = values.size(0);
  const int64_t D = values.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "jagged_to_padded_cpu_pad",
                                  [&] { check_pad_value<scalar_t>(pad_value); });
  auto out = empty_for_streaming_write({B, max_len, D}, values.options());
  if (out.numel() == 0) return out;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "jagged_to_padded_cpu", [&] {
    const scalar_t pad = static_cast<scalar_t>(pad_value);
    const scalar_t* src = values.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "jagged_to_padded_cpu_idx", [&] {
      const index_t* off = offsets.data_ptr<index_t>();
      const bool stream = use_streaming_stores(out.nbytes());
      at::parallel_for(0, B, grain_for(max_len * D * sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t start = off[b];
          const int64_t len = std::min<int64_t>(static_cast<int64_t>(off[b + 1]) - start, max_len);
          TORCH_CHECK(start >= 0 && len >= 0 && start + len <= N, "offsets out of range at b=", b);
          scalar_t* row = dst + b * max_len * D;
          copy_bytes(row, src + start * D, len * D * sizeof(scalar_t), stream);
          fill_elements(row + len * D, &pad, (max_len - len) * D, sizeof(scalar_t), stream);
        }
        streaming_store_fence();
      });
    });
  });
  return out;
}

at::Tensor padded_to_jagged_cpu(const at::Tensor& padded, const at::Tensor& offsets, int64_t total_len) {
  jagged_checks::to_jagged(padded, offsets, total_len, c10::DeviceType::CPU);
  const int64_t B = offsets.numel() - 1;
  const int64_t max_len = padded.size(1);
  const int64_t D = padded.size(2);
  auto out = empty_for_streaming_write({total_len, D}, padded.options());
  if (out.numel() == 0) return out;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, padded.scalar_type(), "padded_to_jagged_cpu", [&] {
    const scalar_t* src = padded.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "padded_to_jagged_cpu_idx", [&] {
      const index_t* off = offsets.data_ptr<index_t>();
      const int64_t mean_rows = std::max<int64_t>(1, total_len / std::max<int64_t>(1, B));
      const bool stream = use_streaming_stores(out.nbytes());
      const scalar_t zero(0);
      at::parallel_for(0, B, grain_for(mean_rows * D * sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          const int64_t start = off[b];
          const int64_t full = static_cast<int64_t>(off[b + 1]) - start;
          TORCH_CHECK(start >= 0 && full >= 0 && start + full <= total_len, "offsets out of range at b=", b);
          const int64_t len = std::min(full, max_len);
          scalar_t* row = dst + start * D;
          copy_bytes(row, src + b * max_len * D, len * D * sizeof(scalar_t), stream);
          // Rows past max_len were truncated away by jagged_to_padded: their gradient is zero.
          fill_elements(row + len * D, &zero, (full - len) * D, sizeof(scalar_t), stream);
        }
        streaming_store_fence();
      });
    });
  });
  return out;
}


// hstu_sequence_layout: user b's sequence is [c contextual rows, its history rows, its candidate rows];
// the source rows are [every user's contextual rows (user-major); the history; the candidates]. One
// pass over the users on the calling thread: a few int64 writes per row. Its plain-PyTorch twin
// (gem_kernels/reference/jagged.py) is ~40 small ATen ops, a fixed cost at small batches. Measured in
// the small model's training step (2-core Xeon, 2 threads, SCHED_FIFO, old and new alternated per round
// in one process, 2026-12-07): forward -0.16 / -0.22 ms at 8 users (of ~2.4), -0.35 ms at 256 (of ~9.7).
// 0 FLOPs; bytes: read 3*B + S int64, write B + 1 + 3*N + R int64 (N = B*c + S + R).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> hstu_sequence_layout_cpu(
    const at::Tensor& history_offsets, const at::Tensor& num_candidates, const at::Tensor& request_timestamps,
    const at::Tensor& history_timestamps, int64_t contextual_len, int64_t num_rows) {
  for (const auto* t : {&history_offsets, &num_candidates, &request_timestamps, &history_timestamps}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->scalar_type() == at::kLong,
                "hstu_sequence_layout: every tensor must be a 1-D int64 CPU tensor, got ", t->sizes(), " ",
                t->scalar_type(), " on ", t->device());
  }
  const int64_t B = num_candidates.size(0), S = history_timestamps.size(0), c = contextual_len;
  TORCH_CHECK_VALUE(history_offsets.size(0) == B + 1 && request_timestamps.size(0) == B,
                    "hstu_sequence_layout: history_offsets must have B+1 = ", B + 1,
                    " and request_timestamps B elements, got ", history_offsets.size(0), " and ",
                    request_timestamps.size(0));
  TORCH_CHECK_VALUE(c >= 0 && num_rows >= 0, "hstu_sequence_layout: contextual_len and num_rows must be >= 0, got ",
                    c, " and ", num_rows);
  const at::Tensor ho_t = history_offsets.contiguous(), nc_t = num_candidates.contiguous();
  const at::Tensor req_t = request_timestamps.contiguous(), hts_t = history_timestamps.contiguous();
  const int64_t *ho = ho_t.data_ptr<int64_t>(), *nc = nc_t.data_ptr<int64_t>();
  const int64_t *req = req_t.data_ptr<int64_t>(), *hts = hts_t.data_ptr<int64_t>();
  // Values first: every write below is in bounds once these hold.
  TORCH_CHECK_VALUE(ho[0] == 0, "hstu_sequence_layout: history_offsets[0] must be 0, got ", ho[0]);
  int64_t candidates = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(ho[b + 1] >= ho[b], "hstu_sequence_layout: history_offsets must be nondecreasing, got ",
                      ho[b], " then ", ho[b + 1], " at ", b);
    TORCH_CHECK_VALUE(nc[b] >= 0, "hstu_sequence_layout: num_candidates must be >= 0, got ", nc[b], " at ", b);
    candidates += nc[b];
  }
  TORCH_CHECK_VALUE(ho[B] == S, "hstu_sequence_layout: history_offsets[-1] must be the ", S,
                    " history timestamps, got ", ho[B]);
  TORCH_CHECK_VALUE(candidates == num_rows, "hstu_sequence_layout: num_candidates must sum to num_rows = ", num_rows,
                    ", got ", candidates);
  const int64_t context = B * c, total = context + S + num_rows;
  const auto opts = ho_t.options();
  at::Tensor seq_offsets = at::empty({B + 1}, opts), rows = at::empty({total}, opts);
  at::Tensor owner = at::empty({num_rows}, opts), ts = at::empty({total}, opts), qts = at::empty({total}, opts);
  int64_t *so = seq_offsets.data_ptr<int64_t>(), *row = rows.data_ptr<int64_t>(), *own = owner.data_ptr<int64_t>();
  int64_t *t = ts.data_ptr<int64_t>(), *q = qts.data_ptr<int64_t>();
  int64_t start = 0, cand = 0;
  so[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = req[b], h0 = ho[b], hl = ho[b + 1] - h0;
    for (int64_t j = 0; j < c; ++j) {
      row[b * c + j] = start + j;
      t[start + j] = q[start + j] = r;
    }
    for (int64_t j = 0; j < hl; ++j) {
      const int64_t dst = start + c + j;
      row[context + h0 + j] = dst;
      t[dst] = hts[h0 + j];
      // The next item of the user's own history; the request's for its last item.
      q[dst] = j + 1 < hl ? hts[h0 + j + 1] : r;
    }
    for (int64_t j = 0; j < nc[b]; ++j, ++cand) {
      const int64_t dst = start + c + hl + j;
      row[context + S + cand] = dst;
      own[cand] = b;
      t[dst] = q[dst] = r;
    }
    start += c + hl + nc[b];
    so[b + 1] = start;
  }
  return {seq_offsets, rows, owner, ts, qts};
}

// jagged_broadcast_cat: out[n] = [dense[b], jagged[n]] for n in offsets[b] : offsets[b+1]; its backward
// sums each sequence's gradient rows into dense's gradient (a segment sum) and copies jagged's columns.
// Work decomposition: at::parallel_for over sequences, one task owns whole sequences (forward: every
// output row, backward: every grad_dense row and grad_jagged row written by one thread). The segment
// sum adds a sequence's rows in row order in fp32 (bit-identical at any thread count, and to the
// reference twin's index_add on fp32). In the GEM model it builds the interaction arch's tokens
// [R, (T+1)*D + D] from the users' [B, (T+1)*D] non-sequence tokens and the candidates' [R, D] rows. Before
// it: a cat + index_select forward and ATen's index_select backward (index_add -> scatter_add_ of R*(T+2)
// rows into a zero fill, on one thread whatever the thread count). torch.profiler, small config, 2-core
// Xeon, 8 batches x 7 rounds (medians), 1 / 2 threads: the step's scatter_add_ 0.33 / 0.30 -> 0.11 / 0.11
// ms, index_select 0.43 / 0.24 -> 0.26 / 0.16 ms, for this op's forward 0.18 / 0.10 ms, backward 0.10 /
// 0.06 ms and its Python front door 0.13 / 0.11 ms. Alone at the model's shape (1097 rows of 288 + 32):
// forward 23 us warm / 82 us cold at 2 threads, backward 16 / 83 us, a clone of the same 1.4 MB 35 / 95
// us: at the copy's speed. Model step, the old gather and this op alternated step by step on the same
// batches (one process, SCHED_FIFO under the measuring lock, 96 pairs a run, busy host): 2 threads paired
// median -0.25 and -0.28 ms (0.993x, 0.991x) of ~32 ms, 1 thread -0.43 ms (0.992x).
// 0 FLOPs forward, N*K adds backward. Minimum bytes: forward read B*K + N*S, write N*(K+S) elements;
// backward read N*(K+S), write B*K + N*S.
void check_broadcast_cat_offsets(const at::Tensor& offsets, int64_t B, int64_t N) {
  TORCH_CHECK(offsets.device().is_cpu() && offsets.dim() == 1 && offsets.numel() == B + 1 &&
                  (offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong) && offsets.is_contiguous(),
              "jagged_broadcast_cat: offsets must be a contiguous 1-D int32/int64 CPU tensor of B+1 = ", B + 1,
              " elements, got ", offsets.sizes(), " ", offsets.scalar_type());
}

std::vector<int64_t> offsets_as_int64(const at::Tensor& offsets) {
  std::vector<int64_t> out(offsets.numel());
  AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "jagged_broadcast_cat_offsets", [&] {
    const index_t* off = offsets.data_ptr<index_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = off[i];
  });
  return out;
}

at::Tensor jagged_broadcast_cat_cpu(const at::Tensor& dense, const at::Tensor& offsets, const at::Tensor& jagged) {
  TORCH_CHECK(dense.device().is_cpu() && jagged.device().is_cpu() && dense.dim() == 2 && jagged.dim() == 2 &&
                  dense.scalar_type() == jagged.scalar_type() && dense.is_contiguous() && jagged.is_contiguous(),
              "jagged_broadcast_cat: dense [B, K] and jagged [N, S] must be contiguous 2-D CPU tensors of one dtype, "
              "got ", dense.sizes(), " ", dense.scalar_type(), " and ", jagged.sizes(), " ", jagged.scalar_type());
  const int64_t B = dense.size(0), K = dense.size(1), N = jagged.size(0), S = jagged.size(1);
  check_broadcast_cat_offsets(offsets, B, N);
  check_offsets_values(offsets, N);
  const std::vector<int64_t> off = offsets_as_int64(offsets);
  at::Tensor out = at::empty({N, K + S}, dense.options());
  if (out.numel() == 0) return out;
  const int64_t elem = dense.element_size();
  const char* dp = static_cast<const char*>(dense.data_ptr());
  const char* jp = static_cast<const char*>(jagged.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = (K + S) * elem;
  at::parallel_for(0, B, grain_for(std::max<int64_t>(1, N / std::max<int64_t>(1, B)) * row_bytes),
                   [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t n = off[b]; n < off[b + 1]; ++n) {
        char* row = op + n * row_bytes;
        std::memcpy(row, dp + b * K * elem, K * elem);
        if (S) std::memcpy(row + K * elem, jp + n * S * elem, S * elem);
      }
    }
  });
  return out;
}

// dst[k] += src[k] for k < n, in fp32 (auto-vectorised at -O3: the restrict pointers do not alias).
inline void add_row(float* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] += src[k];
}

// Sequences [begin, end) of the backward: grad_dense's rows (the sums, in opmath: fp32 for half and bf16)
// and grad_jagged's rows.
template <typename T>
void broadcast_cat_backward_rows(const T* gp, T* gd, T* gj, const int64_t* off, int64_t begin, int64_t end, int64_t K,
                                 int64_t S) {
  using acc_t = at::opmath_type<T>;
  std::vector<acc_t> acc(K);
  for (int64_t b = begin; b < end; ++b) {
    std::fill(acc.begin(), acc.end(), acc_t(0));
    for (int64_t n = off[b]; n < off[b + 1]; ++n) {
      const T* row = gp + n * (K + S);
      for (int64_t k = 0; k < K; ++k) acc[k] += static_cast<acc_t>(row[k]);
      if (S) std::memcpy(gj + n * S, row + K, S * sizeof(T));
    }
    for (int64_t k = 0; k < K; ++k) gd[b * K + k] = static_cast<T>(acc[k]);
  }
}

template <>
void broadcast_cat_backward_rows<float>(const float* gp, float* gd, float* gj, const int64_t* off, int64_t begin,
                                        int64_t end, int64_t K, int64_t S) {
  for (int64_t b = begin; b < end; ++b) {
    float* sum = gd + b * K;
    std::fill(sum, sum + K, 0.0f);
    for (int64_t n = off[b]; n < off[b + 1]; ++n) {
      const float* row = gp + n * (K + S);
      add_row(sum, row, K);
      if (S) std::memcpy(gj + n * S, row + K, S * sizeof(float));
    }
  }
}

std::tuple<at::Tensor, at::Tensor> jagged_broadcast_cat_backward_cpu(const at::Tensor& grad, const at::Tensor& offsets,
                                                                     int64_t dense_width) {
  TORCH_CHECK(grad.device().is_cpu() && grad.dim() == 2 && grad.is_contiguous() && dense_width >= 0 &&
                  dense_width <= grad.size(1),
              "jagged_broadcast_cat_backward: grad must be a contiguous 2-D CPU tensor [N, K + S] with 0 <= K = ",
              dense_width, " <= its width, got ", grad.sizes());
  const int64_t B = offsets.numel() - 1, N = grad.size(0), W = grad.size(1), K = dense_width, S = W - K;
  check_broadcast_cat_offsets(offsets, B, N);
  // The forward checked the offsets' values; this check keeps a direct call with other offsets from writing
  // out of range or leaving grad_jagged rows unwritten (offsets must cover [0, N) exactly).
  const std::vector<int64_t> off = offsets_as_int64(offsets);
  TORCH_CHECK_VALUE(off[0] == 0 && off[B] == N, "jagged_broadcast_cat_backward: offsets[0] must be 0 and offsets[-1] ",
                    "the number of gradient rows ", N, ", got ", off[0], " and ", off[B]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(off[b] <= off[b + 1], "jagged_broadcast_cat_backward: offsets must be nondecreasing, but offsets[",
                      b + 1, "] = ", off[b + 1], " < offsets[", b, "] = ", off[b]);
  }
  at::Tensor grad_dense = at::empty({B, K}, grad.options());
  at::Tensor grad_jagged = at::empty({N, S}, grad.options());
  if (B == 0) return {grad_dense, grad_jagged};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "jagged_broadcast_cat_backward", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* gd = grad_dense.data_ptr<scalar_t>();
    scalar_t* gj = grad_jagged.data_ptr<scalar_t>();
    at::parallel_for(0, B, grain_for(std::max<int64_t>(1, N / B) * W * sizeof(scalar_t)),
                     [&](int64_t begin, int64_t end) {
      broadcast_cat_backward_rows<scalar_t>(gp, gd, gj, off.data(), begin, end, K, S);
    });
  });
  return {grad_dense, grad_jagged};
}
}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("jagged_to_padded_native", &jagged_to_padded_cpu);
  m.impl("padded_to_jagged_native", &padded_to_jagged_cpu);
  m.impl("hstu_sequence_layout_native", &hstu_sequence_layout_cpu);
  m.impl("jagged_broadcast_cat_native", &jagged_broadcast_cat_cpu);
  m.impl("jagged_broadcast_cat_backward_native", &jagged_broadcast_cat_backward_cpu);
}

}  // namespace gem_kernels
