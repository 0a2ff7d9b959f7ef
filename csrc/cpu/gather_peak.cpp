// The gather roof of the bench (bench/peaks.py, gather_roof): the fastest this core can read a list
// of table rows in a given order. A pooled embedding-bag lookup cannot do less than this: it reads
// the same rows in the same order, and also keeps bags, writes outputs and checks indices.
//
// Work decomposition as the embedding-bag forward's (cpu/embedding_bag.cpp): items of (table, a
// chunk of kIdsPerChunk consecutive ids, about its 128 bags of ~20 lookups), table-major, handed out
// dynamically. Per id: prefetch every cache line of the row `prefetch_distance` ids ahead in the
// chunk (0: no software prefetch), then load the row in 32-byte vectors and XOR it into registers.
// The XOR is one cycle per vector, so the time is the reads'; the item's checksum goes to a slot
// owned by the item, so the loads cannot be elided and the result does not depend on the schedule.
//
// Where the forward reads rows the "L2-wide" way (gem_kernels/cpu_gather.h: AMD with AVX-512F by
// default), so does this reader (read_chunk_l2_wide), so that the roof is the faster reader there too.
//
// Roofline: FLOPs 0; bytes sum_t len(ids[t]) * row_bytes_t (every lookup's row, as FBGEMM counts).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <string>
#include <vector>

#include "gem_kernels/checks.h"
#include "gem_kernels/cpu_gather.h"
#include "gem_kernels/parallel.h"

namespace gem_kernels {
namespace {

// Ids per work item: kBagsPerChunk (128) bags of the bench's mean 20 lookups.
constexpr int64_t kIdsPerChunk = 2560;

using V4 = uint64_t __attribute__((vector_size(32)));

// XOR of a row's 8-byte words (a last partial word zero-extended): kBytes > 0 is the row size known
// at compile time (the common 128/256/512 bytes: fully unrolled), 0 reads `bytes` at run time.
template <int64_t kBytes>
inline void xor_row(const char* __restrict__ row, int64_t bytes, V4& acc0, V4& acc1, uint64_t& tail) {
  const int64_t n = kBytes > 0 ? kBytes : bytes;
  int64_t b = 0;
#pragma GCC unroll 16
  for (; b + 64 <= n; b += 64) {
    V4 x, y;
    std::memcpy(&x, row + b, 32);
    std::memcpy(&y, row + b + 32, 32);
    acc0 ^= x;
    acc1 ^= y;
  }
  for (; b + 8 <= n; b += 8) {
    uint64_t x;
    std::memcpy(&x, row + b, 8);
    tail ^= x;
  }
  if (b < n) {
    uint64_t x = 0;
    std::memcpy(&x, row + b, n - b);
    tail ^= x;
  }
}

template <int64_t kBytes, typename index_t>
uint64_t read_chunk(const char* table, int64_t rows, int64_t row_bytes, const index_t* ids, int64_t begin,
                    int64_t end, int64_t distance, int64_t& first_bad) {
  V4 acc0 = {0, 0, 0, 0}, acc1 = {0, 0, 0, 0};
  uint64_t tail = 0;
  const int64_t bytes = kBytes > 0 ? kBytes : row_bytes;
  for (int64_t p = begin; p < end; ++p) {
    if (distance > 0 && p + distance < end) {
      const int64_t ahead = ids[p + distance];
      if (static_cast<uint64_t>(ahead) < static_cast<uint64_t>(rows)) {
        const char* line = table + ahead * bytes;
#pragma GCC unroll 16
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(line + b);
      }
    }
    const int64_t idx = ids[p];
    if (C10_UNLIKELY(static_cast<uint64_t>(idx) >= static_cast<uint64_t>(rows))) {
      if (first_bad < 0) first_bad = p;
      continue;
    }
    xor_row<kBytes>(table + idx * bytes, bytes, acc0, acc1, tail);
  }
  const V4 acc = acc0 ^ acc1;
  return acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ tail;
}

// read_chunk the "L2-wide" way, as the embedding-bag forward reads where cpu_gather_l2_wide() (see
// gem_kernels/cpu_gather.h; the default on AMD CPUs with AVX-512F): prefetcht1 of every line of the
// row `distance` ids ahead (l2_wide_prefetch_rows: twice as far for 256-byte rows), the row XOR-ed in
// 64-byte vectors, its lines prefetched and loaded in l2_wide_line's order (the compiler may still
// reorder the loads: it folds the XORs into a tree). Row sizes that are not a multiple of 64
// bytes take read_chunk. The same checksum as read_chunk.
template <int64_t kBytes, typename index_t>
__attribute__((target("avx512f"))) uint64_t read_chunk_l2_wide(const char* table, int64_t rows, const index_t* ids,
                                                               int64_t begin, int64_t end, int64_t distance,
                                                               int64_t& first_bad) {
  static_assert(kBytes % 64 == 0, "64-byte vectors");
  constexpr int kLines = static_cast<int>(kBytes / 64);
  distance = l2_wide_prefetch_rows(distance, kBytes);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t p = begin; p < end; ++p) {
    if (distance > 0 && p + distance < end) {
      const int64_t ahead = ids[p + distance];
      if (static_cast<uint64_t>(ahead) < static_cast<uint64_t>(rows)) {
        const char* line = table + ahead * kBytes;
#pragma GCC unroll 16
        for (int k = 0; k < kLines; ++k) _mm_prefetch(line + 64 * l2_wide_line(k, kLines), _MM_HINT_T1);
      }
    }
    const int64_t idx = ids[p];
    if (C10_UNLIKELY(static_cast<uint64_t>(idx) >= static_cast<uint64_t>(rows))) {
      if (first_bad < 0) first_bad = p;
      continue;
    }
    const char* row = table + idx * kBytes;
#pragma GCC unroll 16
    for (int k = 0; k < kLines; ++k) acc = _mm512_xor_si512(acc, _mm512_loadu_si512(row + 64 * l2_wide_line(k, kLines)));
  }
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, acc);
  return w[0] ^ w[1] ^ w[2] ^ w[3] ^ w[4] ^ w[5] ^ w[6] ^ w[7];
}

}  // namespace

// XOR of the 8-byte words of rows ids[t] of tables[t] (each row's last partial word zero-extended),
// read in order with the given software prefetch distance; see the comment block above.
int64_t gather_rows_read(const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& ids,
                         int64_t prefetch_distance) {
  TORCH_CHECK_VALUE(tables.size() == ids.size(), "tables and ids must have the same length, got ", tables.size(),
                    " and ", ids.size());
  TORCH_CHECK_VALUE(prefetch_distance >= 0, "prefetch_distance must be >= 0, got ", prefetch_distance);
  std::vector<at::Tensor> id_tensors(ids.size());
  std::vector<int64_t> chunk_start{0};
  int64_t work = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    const at::Tensor& table = tables[t];
    TORCH_CHECK_VALUE(table.device().is_cpu() && ids[t].device().is_cpu(), "tables[", t, "] and ids[", t,
                      "] must be CPU tensors, got ", table.device(), " and ", ids[t].device());
    TORCH_CHECK_VALUE(table.dim() == 2 && table.is_contiguous(), "tables[", t,
                      "] must be a contiguous 2-D tensor, got sizes ", table.sizes());
    TORCH_CHECK_VALUE(ids[t].dim() == 1, "ids[", t, "] must be 1-D, got sizes ", ids[t].sizes());
    TORCH_CHECK_TYPE(ids[t].scalar_type() == at::kLong || ids[t].scalar_type() == at::kInt, "ids[", t,
                     "] must be int32 or int64, got ", ids[t].scalar_type());
    id_tensors[t] = ids[t].contiguous();
    const int64_t n = id_tensors[t].numel();
    chunk_start.push_back(chunk_start.back() + (n + kIdsPerChunk - 1) / kIdsPerChunk);
    work += n * table.size(1);
  }
  const int64_t items = chunk_start.back();
  std::vector<uint64_t> checksums(items, 0);
  std::vector<int64_t> first_bad(items, -1);
  const bool l2_wide = cpu_gather_l2_wide();
  parallel_dynamic(items, work, [&](int64_t item) {
    size_t t = 0;
    while (chunk_start[t + 1] <= item) ++t;
    const at::Tensor& table = tables[t];
    const int64_t row_bytes = table.size(1) * static_cast<int64_t>(table.element_size());
    const char* base = static_cast<const char*>(table.const_data_ptr());
    const int64_t begin = (item - chunk_start[t]) * kIdsPerChunk;
    const int64_t end = std::min(id_tensors[t].numel(), begin + kIdsPerChunk);
    AT_DISPATCH_INDEX_TYPES(id_tensors[t].scalar_type(), "gather_rows_read", [&] {
      const index_t* idx = id_tensors[t].const_data_ptr<index_t>();
      const int64_t rows = table.size(0);
      int64_t& bad = first_bad[item];
      if (l2_wide && (row_bytes == 128 || row_bytes == 256 || row_bytes == 512)) {
        checksums[item] =
            row_bytes == 128   ? read_chunk_l2_wide<128>(base, rows, idx, begin, end, prefetch_distance, bad)
            : row_bytes == 256 ? read_chunk_l2_wide<256>(base, rows, idx, begin, end, prefetch_distance, bad)
                               : read_chunk_l2_wide<512>(base, rows, idx, begin, end, prefetch_distance, bad);
        return;
      }
      checksums[item] =
          row_bytes == 128   ? read_chunk<128>(base, rows, row_bytes, idx, begin, end, prefetch_distance, bad)
          : row_bytes == 256 ? read_chunk<256>(base, rows, row_bytes, idx, begin, end, prefetch_distance, bad)
          : row_bytes == 512 ? read_chunk<512>(base, rows, row_bytes, idx, begin, end, prefetch_distance, bad)
                             : read_chunk<0>(base, rows, row_bytes, idx, begin, end, prefetch_distance, bad);
    });
  });
  uint64_t checksum = 0;
  size_t t = 0;
  for (int64_t item = 0; item < items; ++item) {
    while (chunk_start[t + 1] <= item) ++t;
    if (first_bad[item] >= 0) {
      const int64_t p = first_bad[item];
      const int64_t idx = id_tensors[t].scalar_type() == at::kLong ? id_tensors[t].const_data_ptr<int64_t>()[p]
                                                                   : id_tensors[t].const_data_ptr<int32_t>()[p];
      TORCH_CHECK_INDEX(false, "ids[", t, "][", p, "] = ", idx, " is out of range for tables[", t, "] with ",
                        tables[t].size(0), " rows");
    }
    checksum ^= checksums[item];
  }
  return static_cast<int64_t>(checksum);
}

}  // namespace gem_kernels
