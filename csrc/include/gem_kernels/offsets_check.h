// The bag offsets' data check of the CPU embedding kernels (embedding_bag.cpp, zch.cpp).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace gem_kernels {

// The data checks of gem_kernels._validate.check_offsets_values, same messages (ValueError in
// Python), done here for the cpu backend: one serial pass over T*B+1 offsets costs microseconds,
// three small ATen ops on them cost milliseconds of thread-pool wake-ups.
inline void check_offsets_values(const at::Tensor& offsets, int64_t total) {
  AT_DISPATCH_INDEX_TYPES(offsets.scalar_type(), "check_offsets_values", [&] {
    const index_t* off = offsets.data_ptr<index_t>();
    const int64_t n = offsets.numel();
    TORCH_CHECK_VALUE(off[0] == 0, "offsets[0] must be 0, got ", static_cast<int64_t>(off[0]));
    for (int64_t i = 1; i < n; ++i) {
      TORCH_CHECK_VALUE(off[i] >= off[i - 1], "offsets must be nondecreasing, but offsets[", i, "] = ",
                        static_cast<int64_t>(off[i]), " < offsets[", i - 1, "] = ", static_cast<int64_t>(off[i - 1]));
    }
    TORCH_CHECK_VALUE(off[n - 1] == total, "offsets[-1] must equal the number of rows ", total, ", got ",
                      static_cast<int64_t>(off[n - 1]));
  });
}

}  // namespace gem_kernels
