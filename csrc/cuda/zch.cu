// CUDA kernel of the zch family: zch_remap_native on CUDA tensors (raw int64 ids -> slots, with
// admission, LRU / LFU / TTL eviction and the reset of a reused slot's row and optimizer state).
//
// Determinism: the same identity tables, eviction metadata and slots as the cpu kernel
// (csrc/cpu/zch.cpp) and gem_kernels/reference/zch.py, bit for bit. One thread owns one table's whole
// state and walks that table's ids in their order, the cpu's decomposition (tables in parallel, a
// table's ids serial): each id's decision (hit, admission, victim, the cell it lands in) depends on
// every earlier id of its table, and a fixed serial order is what makes the result the cpu's. There are
// no concurrent inserts into one table, so no atomics and no order to break ties. The algorithm is
// the reference's step for step (see its docstring for the layout): linear probing from
// mix64(id) bounded by max_probe, backward-shift deletion, a lazy min-heap of key snapshots for the
// victim (a slot used earlier in the batch is never one), bounded admission counts.
//
// Work decomposition: grid ceil(T / kTablesPerBlock) x kTablesPerBlock threads, thread = table. The
// host checks the values (id_offsets, layout, the state counters, now) on a host copy of the small
// tensors before the launch, as the cpu kernel checks them, and reads the kernel's corruption flags
// after it (a state no remap makes: a slot outside the table in the index or heap): two syncs.
//
// Roofline: 0 FLOPs. Minimum bytes as the cpu's: read 8 B per id and write 8 B per slot, one index
// probe (16 B) and one slot-metadata update (32 B) per id; a reused slot writes D weights and its
// state. Latency-bound (a serial chain per table): it runs where the tables are, which saves the
// round trip of the state to the host, not time per id.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>

#include "gem_kernels/checks.h"
#include "gem_kernels/zch_checks.h"

namespace gem_kernels {
namespace {

constexpr int kTablesPerBlock = 32;
// Codes of gem_kernels/reference/zch.py (POLICY_CODES, STATE_FIELDS, slot_meta's columns).
constexpr int64_t kLFU = 1, kTTL = 2;
constexpr int kUsed = 0, kSeq = 1, kHeapSize = 2, kLastNow = 3, kMaxProbe = 4, kProbeOverflows = 5, kEvictions = 6,
              kPendingReplacements = 7, kHits = 8, kLookups = 9, kUnadmitted = 10, kNumFields = 11;
constexpr int kId = 0, kCount = 1, kLastSeq = 2, kLastTime = 3, kMetaFields = 4;
constexpr uint64_t kPendingSalt = 0x5851F42D4C957F2DULL;

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct Params {
  const int64_t *ids, *off, *slot_off, *index_off, *pending_off;
  int64_t *meta, *heap, *index, *pending, *state, *out;
  int64_t* error;  // [T, 2]: the first corruption a table met (kind, slot), reported by the host after the launch
  int64_t T, policy, ttl, now, admit_threshold, max_probe;
  bool train, default_row, reset;
  const int64_t *w_off, *d_off, *r_off;
  const double* bounds;
  float *m1, *m2;
  int64_t m1_size, m2_size;
  uint64_t seed;
};

// One table's state (pointers into the packed buffers).
struct Table {
  int64_t slots, cap, pcap;
  int64_t *meta, *heap, *index, *pending, *st, *error;

  __device__ void record(int64_t kind, int64_t slot) {  // kinds: see kCorrupt in zch_remap_cuda
    if (error[0] == 0) {
      error[0] = kind;
      error[1] = slot;
    }
  }

  __device__ bool less(int64_t i, int64_t j) const {  // heap entry i's key < entry j's
    const int64_t *a = heap + 3 * i, *b = heap + 3 * j;
    return a[1] < b[1] || (a[1] == b[1] && a[2] < b[2]);
  }
  __device__ void swap(int64_t i, int64_t j) {
    for (int k = 0; k < 3; ++k) {
      const int64_t x = heap[3 * i + k];
      heap[3 * i + k] = heap[3 * j + k];
      heap[3 * j + k] = x;
    }
  }
  __device__ void sift_down(int64_t i, int64_t size) {
    while (true) {
      const int64_t l = 2 * i + 1, r = l + 1;
      int64_t m = i;
      if (l < size && less(l, m)) m = l;
      if (r < size && less(r, m)) m = r;
      if (m == i) return;
      swap(i, m);
      i = m;
    }
  }
  __device__ void sift_up(int64_t i) {
    while (i > 0 && less(i, (i - 1) / 2)) {
      swap(i, (i - 1) / 2);
      i = (i - 1) / 2;
    }
  }
  __device__ void key(int64_t policy, int64_t slot, int64_t& a, int64_t& b) const {
    const int64_t* m = meta + slot * kMetaFields;
    a = policy == kLFU ? m[kCount] : policy == kTTL ? m[kLastTime] : m[kLastSeq];
    b = m[kLastSeq];
  }
  __device__ int64_t home(int64_t id) const {
    return static_cast<int64_t>(mix64(static_cast<uint64_t>(id)) & static_cast<uint64_t>(cap - 1));
  }
  // The id's cell (>= 0), or -(first empty cell + 2), or -1 when max_probe cells hold neither.
  __device__ int64_t find(int64_t id, int64_t max_probe) {
    int64_t pos = home(id);
    for (int64_t d = 0; d < max_probe; ++d, pos = (pos + 1) & (cap - 1)) {
      const int64_t* cell = index + 2 * pos;
      if (cell[1] < 0 || cell[0] == id) {
        st[kMaxProbe] = st[kMaxProbe] > d + 1 ? st[kMaxProbe] : d + 1;
        return cell[1] < 0 ? -(pos + 2) : pos;
      }
    }
    return -1;
  }
  __device__ void erase(int64_t pos) {  // backward-shift deletion (Knuth's algorithm R)
    const int64_t mask = cap - 1;
    int64_t hole = pos, j = pos;
    while (true) {
      j = (j + 1) & mask;
      const int64_t* cell = index + 2 * j;
      if (cell[1] < 0) break;
      const int64_t k = home(cell[0]);
      if (hole <= j ? (hole < k && k <= j) : (hole < k || k <= j)) continue;
      index[2 * hole] = cell[0];
      index[2 * hole + 1] = cell[1];
      hole = j;
    }
    index[2 * hole] = 0;
    index[2 * hole + 1] = -1;
  }
  // Counts a sighting of an id not in the index: whether it is admitted; its count cell or -1.
  __device__ bool admit(const Params& p, int64_t id, int64_t& pending_pos) {
    pending_pos = -1;
    if (p.admit_threshold <= 1) return true;
    const int64_t mask = pcap - 1;
    const int64_t start = static_cast<int64_t>(mix64(static_cast<uint64_t>(id) ^ kPendingSalt) &
                                               static_cast<uint64_t>(mask));
    const int64_t window = p.max_probe < pcap ? p.max_probe : pcap;
    int64_t empty = -1, lowest = -1;
    for (int64_t d = 0; d < window; ++d) {
      const int64_t pos = (start + d) & mask;
      int64_t* cell = pending + 2 * pos;
      if (cell[1] == 0) {
        if (empty < 0) empty = pos;
        continue;
      }
      if (cell[0] == id) {
        if (p.train) cell[1] += 1;
        pending_pos = pos;
        return cell[1] >= p.admit_threshold;
      }
      if (lowest < 0 || cell[1] < pending[2 * lowest + 1]) lowest = pos;
    }
    if (!p.train) return false;
    int64_t pos = empty;
    if (pos < 0) {
      pos = lowest;
      st[kPendingReplacements] += 1;
    }
    pending[2 * pos] = id;
    pending[2 * pos + 1] = 1;
    pending_pos = pos;
    return 1 >= p.admit_threshold;
  }
  // The policy's victim now, or -1 (a stale top is refreshed and sifted down; a top used in this
  // batch ends the search, except LFU's, set aside behind the heap until the batch ends).
  __device__ int64_t victim(const Params& p, int64_t batch_start) {
    while (st[kHeapSize] > 0) {
      const int64_t size = st[kHeapSize], slot = heap[0];
      if (slot < 0 || slot >= slots) {  // a corrupt heap: no victim rather than a wild write
        record(2, slot);
        return -1;
      }
      int64_t a, b;
      key(p.policy, slot, a, b);
      if (a != heap[1] || b != heap[2]) {
        heap[1] = a;
        heap[2] = b;
        sift_down(0, size);
        continue;
      }
      const int64_t* m = meta + slot * kMetaFields;
      if (m[kLastSeq] > batch_start) {
        if (p.policy != kLFU) return -1;
        swap(0, size - 1);
        st[kHeapSize] = size - 1;
        sift_down(0, size - 1);
        continue;
      }
      if (p.policy == kTTL && p.now - m[kLastTime] < p.ttl) return -1;
      return slot;
    }
    return -1;
  }
};

template <typename scalar_t>
__device__ void reset_row(const Params& p, int64_t t, int64_t slot, int64_t id, scalar_t* weights) {
  const int64_t dim = p.d_off[t + 1] - p.d_off[t], start = p.w_off[t] + slot * dim;
  const double lo = p.bounds[2 * t], hi = p.bounds[2 * t + 1];
  const uint64_t base = mix64(static_cast<uint64_t>(id) ^ mix64(p.seed + static_cast<uint64_t>(t)));
  for (int64_t d = 0; d < dim; ++d) {
    const double u = static_cast<double>(mix64(base + static_cast<uint64_t>(d)) >> 40) * (1.0 / 16777216.0);
    weights[start + d] = static_cast<scalar_t>(static_cast<float>(lo + (hi - lo) * u));
  }
  if (p.m2_size > 0) {  // element-wise state (Adam), packed like the weights
    for (int64_t d = 0; d < dim; ++d) p.m1[start + d] = p.m2[start + d] = 0.f;
  } else if (p.m1_size > 0) {  // row-wise state (Adagrad)
    p.m1[p.r_off[t] + slot] = 0.f;
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kTablesPerBlock) _zch_remap_kernel(Params p, scalar_t* weights) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTablesPerBlock + threadIdx.x;
  if (t >= p.T) return;
  Table tab{p.slot_off[t + 1] - p.slot_off[t], p.index_off[t + 1] - p.index_off[t],
            p.pending_off[t + 1] - p.pending_off[t], p.meta + p.slot_off[t] * kMetaFields,
            p.heap + p.slot_off[t] * 3, p.index + p.index_off[t] * 2, p.pending + p.pending_off[t] * 2,
            p.state + t * kNumFields, p.error + 2 * t};
  int64_t* st = tab.st;
  const int64_t miss = p.default_row ? tab.slots : -1, batch_start = st[kSeq];
  for (int64_t i = p.off[t]; i < p.off[t + 1]; ++i) {
    const int64_t id = p.ids[i];
    p.out[i] = miss;
    st[kLookups] += 1;
    int64_t pos = tab.find(id, p.max_probe);
    if (pos >= 0) {
      const int64_t slot = tab.index[2 * pos + 1];
      if (slot >= tab.slots) {  // a corrupt index: never a write outside the table
        tab.record(1, slot);
        continue;
      }
      st[kHits] += 1;
      if (p.train) {
        int64_t* m = tab.meta + slot * kMetaFields;
        m[kCount] += 1;
        m[kLastSeq] = ++st[kSeq];
        m[kLastTime] = p.now;
      }
      p.out[i] = slot;
      continue;
    }
    int64_t pending_pos;
    if (!tab.admit(p, id, pending_pos) || !p.train) {
      st[kUnadmitted] += 1;
      continue;
    }
    if (pos == -1) {
      st[kProbeOverflows] += 1;
      st[kUnadmitted] += 1;
      continue;
    }
    const bool fresh = st[kUsed] < tab.slots;
    int64_t slot;
    if (fresh) {
      slot = st[kUsed]++;
    } else {
      slot = tab.victim(p, batch_start);
      const int64_t old = slot < 0 ? -1 : tab.find(tab.meta[slot * kMetaFields + kId], p.max_probe);
      if (old < 0) {  // no victim (or, in a corrupt state, its id not indexed): the id gets no slot
        if (slot >= 0) tab.record(3, slot);
        st[kUnadmitted] += 1;
        continue;
      }
      tab.erase(old);
      pos = tab.find(id, p.max_probe);  // the erase may have moved the first empty cell closer
      st[kEvictions] += 1;
    }
    const int64_t cell = -(pos + 2);
    tab.index[2 * cell] = id;
    tab.index[2 * cell + 1] = slot;
    if (pending_pos >= 0) tab.pending[2 * pending_pos + 1] = 0;
    int64_t* m = tab.meta + slot * kMetaFields;
    m[kId] = id;
    m[kCount] = 1;
    m[kLastSeq] = ++st[kSeq];
    m[kLastTime] = p.now;
    int64_t a, b;
    tab.key(p.policy, slot, a, b);
    const int64_t h = fresh ? st[kHeapSize]++ : 0;  // a fresh slot's new entry, or the victim's (the top)
    tab.heap[3 * h] = slot;
    tab.heap[3 * h + 1] = a;
    tab.heap[3 * h + 2] = b;
    if (fresh) {
      tab.sift_up(h);
    } else {
      tab.sift_down(0, st[kHeapSize]);
    }
    if (p.reset) reset_row<scalar_t>(p, t, slot, id, weights);
    p.out[i] = slot;
  }
  while (st[kHeapSize] < st[kUsed]) tab.sift_up(st[kHeapSize]++);  // LFU's set-aside entries go back
  if (p.train) st[kLastNow] = p.now;
}

at::Tensor zch_remap_cuda(const at::Tensor& ids, const at::Tensor& id_offsets, at::Tensor slot_meta, at::Tensor heap,
                          at::Tensor index, at::Tensor pending, at::Tensor table_state, const at::Tensor& layout,
                          int64_t policy, int64_t ttl, int64_t now, int64_t admit_threshold, int64_t max_probe,
                          bool train, bool default_row, at::Tensor weights, const at::Tensor& weights_offsets,
                          const at::Tensor& D_offsets, const at::Tensor& rows_offsets, at::Tensor momentum1,
                          at::Tensor momentum2, const at::Tensor& init_bounds, int64_t seed) {
  for (const at::Tensor* x :
       std::initializer_list<const at::Tensor*>{&ids, &id_offsets, &slot_meta, &heap, &index, &pending, &table_state,
                                                &layout}) {
    GK_CHECK_CUDA(*x);
    GK_CHECK_CONTIGUOUS(*x);
    TORCH_CHECK(x->scalar_type() == at::kLong, "zch_remap: every index/state tensor must be int64");
  }
  TORCH_CHECK(policy >= 0 && policy <= 2, "zch_remap: policy code must be 0..2, got ", policy);
  TORCH_CHECK(max_probe >= 1, "zch_remap: max_probe must be >= 1, got ", max_probe);
  const int64_t T = id_offsets.numel() - 1, N = ids.numel();
  TORCH_CHECK(T >= 1 && layout.dim() == 2 && layout.size(0) == 3 && layout.size(1) == T + 1,
              "zch_remap: layout must be [3, T+1] with T = id_offsets.numel() - 1");
  TORCH_CHECK(table_state.dim() == 2 && table_state.size(0) == T && table_state.size(1) == kNumFields,
              "zch_remap: table_state must be [T, ", kNumFields, "]");
  const c10::cuda::CUDAGuard guard(ids.device());
  // The values the checks read, on the host (one copy of T-sized tensors).
  const at::Tensor off_h = id_offsets.cpu(), lay_h = layout.cpu(), st_h = table_state.cpu();
  const int64_t *off = off_h.data_ptr<int64_t>(), *lay = lay_h.data_ptr<int64_t>(), *st = st_h.data_ptr<int64_t>();
  TORCH_CHECK(slot_meta.numel() == lay[T] * kMetaFields && heap.numel() == lay[T] * 3 &&
                  index.numel() == lay[2 * (T + 1) - 1] * 2 && pending.numel() == lay[3 * (T + 1) - 1] * 2,
              "zch_remap: state tensors do not match layout");
  zch_checks::check_tables(off, lay, st, T, N, now, train, admit_threshold);
  auto out = at::empty({N}, ids.options());
  auto error = at::zeros({T, 2}, ids.options());
  Params p{};
  p.error = error.data_ptr<int64_t>();
  p.ids = ids.data_ptr<int64_t>();
  p.off = id_offsets.data_ptr<int64_t>();
  p.slot_off = layout.data_ptr<int64_t>();
  p.index_off = p.slot_off + (T + 1);
  p.pending_off = p.slot_off + 2 * (T + 1);
  p.meta = slot_meta.data_ptr<int64_t>();
  p.heap = heap.data_ptr<int64_t>();
  p.index = index.data_ptr<int64_t>();
  p.pending = pending.data_ptr<int64_t>();
  p.state = table_state.data_ptr<int64_t>();
  p.out = out.data_ptr<int64_t>();
  p.T = T;
  p.policy = policy;
  p.ttl = ttl;
  p.now = now;
  p.admit_threshold = admit_threshold;
  p.max_probe = max_probe;
  p.train = train;
  p.default_row = default_row;
  p.seed = static_cast<uint64_t>(seed);
  p.reset = weights.numel() > 0;
  if (p.reset) {
    for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&weights, &weights_offsets, &D_offsets,
                                                                         &rows_offsets, &init_bounds, &momentum1,
                                                                         &momentum2}) {
      GK_CHECK_CUDA(*x);
      GK_CHECK_CONTIGUOUS(*x);
    }
    zch_checks::check_reset_tensors(T, weights_offsets, D_offsets, rows_offsets, init_bounds, momentum1, momentum2);
    const at::Tensor w_h = weights_offsets.cpu(), d_h = D_offsets.cpu(), r_h = rows_offsets.cpu();
    const int64_t *w_off = w_h.data_ptr<int64_t>(), *d_off = d_h.data_ptr<int64_t>(), *r_off = r_h.data_ptr<int64_t>();
    p.m1_size = momentum1.numel();
    p.m2_size = momentum2.numel();
    zch_checks::check_reset_values(T, lay, w_off, d_off, r_off, weights.numel(), p.m1_size, p.m2_size);
    p.w_off = weights_offsets.data_ptr<int64_t>();
    p.d_off = D_offsets.data_ptr<int64_t>();
    p.r_off = rows_offsets.data_ptr<int64_t>();
    p.bounds = init_bounds.data_ptr<double>();
    p.m1 = momentum1.data_ptr<float>();
    p.m2 = momentum2.data_ptr<float>();
  }
  const dim3 grid(static_cast<unsigned>((T + kTablesPerBlock - 1) / kTablesPerBlock));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.reset) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "zch_remap_cuda", [&] {
      _zch_remap_kernel<scalar_t><<<grid, kTablesPerBlock, 0, stream>>>(p, weights.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    _zch_remap_kernel<float><<<grid, kTablesPerBlock, 0, stream>>>(p, nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // A state no remap could have made (a direct call of the schema): raise as the cpu kernel does.
  const at::Tensor error_h = error.cpu();
  const int64_t* e = error_h.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t kind = e[2 * t], slot = e[2 * t + 1], slots = lay[t + 1] - lay[t];
    TORCH_CHECK(kind != 1, "zch_remap: index holds slot ", slot, " outside [0, ", slots, ")");
    TORCH_CHECK(kind != 2, "zch_remap: heap holds slot ", slot, " outside [0, ", slots, ")");
    TORCH_CHECK(kind != 3, "zch_remap: the id of slot ", slot, " is missing from the index");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m) { m.impl("zch_remap_native", &zch_remap_cuda); }

}  // namespace gem_kernels
