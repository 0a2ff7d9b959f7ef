// The table metadata of the embedding_bag family (gem_kernels/_embedding_bag.py TableMeta): T tables
// back to back in one flat weights buffer (FBGEMM TBE), as the launchers hand it to their kernels.
#pragma once

#include <ATen/ATen.h>

#include "gem_kernels/checks.h"

namespace gem_kernels {

struct TableMeta {
  const int64_t* w_off;  // weights_offsets [T]: element offset of table t in weights
  const int64_t* d_off;  // D_offsets [T+1]: column offset of table t in the pooled output
  const int64_t* r_off;  // rows_offsets [T+1]: cumulative rows (row offset of table t in row-wise state)
  int64_t T;             // tables
  int64_t B;             // bags per table: offsets has T*B+1 elements
};

// The three metadata tensors of a native schema, checked for what keeps a direct call memory safe
// without reading a value (on a GPU that would be a sync): int64, contiguous, on the weights'
// device, T >= 1 tables, offsets of T*B+1 elements.
inline TableMeta table_meta(const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                            const at::Tensor& rows_offsets, const at::Tensor& offsets, const at::Tensor& weights) {
  for (const auto* t : {&weights_offsets, &D_offsets, &rows_offsets}) {
    TORCH_CHECK(t->device() == weights.device(), "metadata tensors must be on the weights' device");
    GK_CHECK_CONTIGUOUS(*t);
    TORCH_CHECK(t->scalar_type() == at::kLong, "metadata tensors must be int64");
  }
  const int64_t T = weights_offsets.numel();
  TORCH_CHECK(T >= 1 && D_offsets.numel() == T + 1 && rows_offsets.numel() == T + 1, "bad table metadata sizes");
  TORCH_CHECK(offsets.numel() >= 1 && (offsets.numel() - 1) % T == 0, "offsets must have T*B+1 elements");
  return {weights_offsets.data_ptr<int64_t>(), D_offsets.data_ptr<int64_t>(), rows_offsets.data_ptr<int64_t>(), T,
          (offsets.numel() - 1) / T};
}

}  // namespace gem_kernels
