// The checks of a zch_remap_native call that read values (csrc/cpu/zch.cpp on its tensors,
// csrc/cuda/zch.cu on host copies of the small ones): one home for their conditions and messages.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>

namespace gem_kernels {
namespace zch_checks {

// table_state's columns these checks read (gem_kernels/reference/zch.py STATE_FIELDS).
constexpr int64_t kNumFields = 11, kUsed = 0, kSeq = 1, kHeapSize = 2, kLastNow = 3;

// id_offsets [T+1] (off), layout [3, T+1] (lay) and table_state [T, 11] (st): the segments cover
// the N ids, `now` never goes back in training, and what keeps a direct call of the schema inside
// its buffers: the layout and the state counters (the slots held in the index and heap are checked
// where they are read).
inline void check_tables(const int64_t* off, const int64_t* lay, const int64_t* st, int64_t T, int64_t N, int64_t now,
                         bool train, int64_t admit_threshold) {
  TORCH_CHECK_VALUE(off[0] == 0 && off[T] == N, "id_offsets must start at 0 and end at ids.numel() = ", N, ", got ",
                    off[0], " and ", off[T]);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(off[t] <= off[t + 1], "id_offsets must be non-decreasing, got id_offsets[", t, "] = ", off[t],
                      " > id_offsets[", t + 1, "] = ", off[t + 1]);
    const int64_t* ts = st + t * kNumFields;
    TORCH_CHECK_VALUE(!train || now >= ts[kLastNow], "now must not decrease: table ", t, " last saw now = ",
                      ts[kLastNow], ", got ", now);
  }
  const int64_t *slot_off = lay, *index_off = lay + (T + 1), *pending_off = lay + 2 * (T + 1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slots = slot_off[t + 1] - slot_off[t], cells = index_off[t + 1] - index_off[t];
    const int64_t pcells = pending_off[t + 1] - pending_off[t];
    TORCH_CHECK(slots >= 1 && cells >= 1 && (cells & (cells - 1)) == 0 && pcells >= 0 && (pcells & (pcells - 1)) == 0 &&
                    (admit_threshold <= 1 || pcells >= 1),
                "zch_remap: layout of table ", t, " is invalid (slots ", slots, ", index cells ", cells,
                ", pending cells ", pcells, ")");
    const int64_t* ts = st + t * kNumFields;
    TORCH_CHECK(ts[kUsed] >= 0 && ts[kUsed] <= slots && ts[kHeapSize] == ts[kUsed] && ts[kSeq] >= 0,
                "zch_remap: table_state of table ", t, " is inconsistent (used ", ts[kUsed], ", heap_size ",
                ts[kHeapSize], ", slots ", slots, ")");
  }
}

// The reset's tensors: shapes and dtypes (no values).
inline void check_reset_tensors(int64_t T, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                                const at::Tensor& rows_offsets, const at::Tensor& init_bounds,
                                const at::Tensor& momentum1, const at::Tensor& momentum2) {
  TORCH_CHECK(weights_offsets.numel() == T && D_offsets.numel() == T + 1 && rows_offsets.numel() == T + 1 &&
                  init_bounds.numel() == 2 * T && init_bounds.scalar_type() == at::kDouble &&
                  weights_offsets.scalar_type() == at::kLong && D_offsets.scalar_type() == at::kLong &&
                  rows_offsets.scalar_type() == at::kLong,
              "zch_remap: weights metadata / init_bounds do not match T = ", T);
  TORCH_CHECK(momentum1.scalar_type() == at::kFloat && momentum2.scalar_type() == at::kFloat,
              "zch_remap: optimizer state must be float32");
}

// The reset's values: every table's slots inside the weights, optimizer state of a known layout.
inline void check_reset_values(int64_t T, const int64_t* slot_off, const int64_t* w_off, const int64_t* d_off,
                               const int64_t* r_off, int64_t weights_numel, int64_t m1_size, int64_t m2_size) {
  TORCH_CHECK((m2_size == 0 && (m1_size == 0 || m1_size == r_off[T])) ||
                  (m1_size == weights_numel && m2_size == weights_numel),
              "zch_remap: momentum1/momentum2 sizes match no optimizer layout");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t dim = d_off[t + 1] - d_off[t], rows = r_off[t + 1] - r_off[t];
    const int64_t slots = slot_off[t + 1] - slot_off[t];
    TORCH_CHECK(dim >= 1 && r_off[t] >= 0 && rows >= slots && w_off[t] >= 0 && w_off[t] + rows * dim <= weights_numel,
                "zch_remap: table ", t, " (", rows, " rows x ", dim, " at ", w_off[t],
                ") does not hold its slots inside weights");
  }
}

}  // namespace zch_checks
}  // namespace gem_kernels
