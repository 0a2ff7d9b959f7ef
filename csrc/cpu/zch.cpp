// CPU kernel of the zch family: zero-collision remap of raw int64 ids to table slots, with eviction
// (LRU / LFU / TTL), admission and the reset of a reused slot's row and optimizer state.
//
// The algorithm (the same, step for step, as gem_kernels/reference/zch.py, so that both give the
// same state bit for bit; see that file's docstring for the data layout):
//   - per table, a linear-probing hash index id -> slot (capacity >= 4 x slots, so it is at most
//     a quarter full when every slot is used), probes bounded by max_probe; deletion by backward shift
//     (no tombstones);
//   - slots filled in order 0, 1, ...; once full, a new id takes the slot of the policy's victim,
//     found in a lazy min-heap of (key, slot) snapshots (keys only grow, so a stale top is refreshed
//     and sifted down; a fresh top is the true minimum); a slot used earlier in this batch is never
//     a victim (LFU sets such tops aside until the batch ends; for LRU/TTL a touched top means no
//     victim exists);
//   - admission: an id needs `admit_threshold` sightings, counted in a bounded per-table table
//     (a window of max_probe cells from the id's hash; when full, the lowest count is replaced).
//
// Work decomposition: one task per table, handed out dynamically (parallel_dynamic: a thread slowed
// by a busy host takes fewer tables instead of holding the others at a barrier); one task owns a
// table's whole state and walks its ids in order, so the result does not depend on the thread count
// or the schedule. Within a table the walk is serial by design: the id -> slot decision of each id
// depends on every earlier one.
//
// Roofline: 0 FLOPs. Minimum bytes: read 8 B per id and write 8 B per slot, plus one index probe
// (16 B) and one slot-metadata update (32 B) per id; a reused slot writes D weights and its state.

#include "gem_kernels/cpu_vec.h"  // first: at::vec with its AVX2 implementation

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "gem_kernels/checks.h"
#include "gem_kernels/cpu_alloc.h"
#include "gem_kernels/cpu_rows.h"
#include "gem_kernels/embedding_bag_codes.h"
#include "gem_kernels/offsets_check.h"
#include "gem_kernels/parallel.h"
#include "gem_kernels/zch_checks.h"

namespace gem_kernels {
namespace {

// Codes of gem_kernels/reference/zch.py (POLICY_CODES, STATE_FIELDS).
enum Policy : int64_t { kLRU = 0, kLFU = 1, kTTL = 2 };
enum Field : int64_t {
  kUsed = 0, kSeq, kHeapSize, kLastNow, kMaxProbe, kProbeOverflows, kEvictions, kPendingReplacements, kHits,
  kLookups, kUnadmitted, kNumFields
};
enum Meta : int64_t { kId = 0, kCount, kLastSeq, kLastTime, kMetaFields };

inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
constexpr uint64_t kPendingSalt = 0x5851F42D4C957F2DULL;

struct TableView {
  int64_t slots, index_cap, pending_cap;
  int64_t* meta;     // [slots, 4]
  int64_t* heap;     // [slots, 3]: slot, key0, key1
  int64_t* index;    // [index_cap, 2]: id, slot (-1 empty)
  int64_t* pending;  // [pending_cap, 2]: id, count (0 empty)
  int64_t* state;    // [kNumFields]
};

struct Options {
  int64_t policy, ttl, now, admit_threshold, max_probe;
  bool train, default_row;
};

struct Key {
  int64_t a, b;
  bool operator<(const Key& o) const { return a < o.a || (a == o.a && b < o.b); }
  bool operator==(const Key& o) const { return a == o.a && b == o.b; }
};

inline Key slot_key(const TableView& t, int64_t policy, int64_t slot) {
  const int64_t* m = t.meta + slot * kMetaFields;
  if (policy == kLFU) return {m[kCount], m[kLastSeq]};
  if (policy == kTTL) return {m[kLastTime], m[kLastSeq]};
  return {m[kLastSeq], m[kLastSeq]};
}

inline Key heap_key(const TableView& t, int64_t i) { return {t.heap[3 * i + 1], t.heap[3 * i + 2]}; }

inline void heap_swap(TableView& t, int64_t i, int64_t j) {
  for (int k = 0; k < 3; ++k) std::swap(t.heap[3 * i + k], t.heap[3 * j + k]);
}

// Heap keys compare without branches: which child is smaller is a coin toss, and a mispredicted
// branch per level (13 levels at 8192 slots) was most of the remap's heap time.
inline bool key_less(int64_t a0, int64_t a1, int64_t b0, int64_t b1) { return (a0 < b0) | ((a0 == b0) & (a1 < b1)); }

// The entry at i moves down past every smaller child (the smaller of two; the left one on a tie),
// as repeated swaps would move it, but held in registers and written once where it stops.
void sift_down(TableView& t, int64_t i, int64_t size) {
  int64_t* h = t.heap;
  const int64_t e0 = h[3 * i], e1 = h[3 * i + 1], e2 = h[3 * i + 2];
  for (int64_t l = 2 * i + 1; l < size; l = 2 * i + 1) {
    // The entries two and three levels down (4 and 8 consecutive entries, 96 and 192 B): the walk is a
    // chain of dependent loads, and fetching ahead took the remap from 32 to 27 ms a step
    // (bench/hashed.py's stream, one thread; a third level ahead was slower again).
    for (int k = 0; k < 12; k += 8) __builtin_prefetch(h + 3 * (2 * l + 1) + k);
    for (int k = 0; k < 24; k += 8) __builtin_prefetch(h + 3 * (4 * l + 3) + k);
    int64_t m = l;
    if (l + 1 < size) {
      const int64_t* a = h + 3 * l;
      m = l + static_cast<int64_t>(key_less(a[4], a[5], a[1], a[2]));  // the right child when smaller
    }
    const int64_t* c = h + 3 * m;
    if (!key_less(c[1], c[2], e1, e2)) break;
    h[3 * i] = c[0];
    h[3 * i + 1] = c[1];
    h[3 * i + 2] = c[2];
    i = m;
  }
  h[3 * i] = e0;
  h[3 * i + 1] = e1;
  h[3 * i + 2] = e2;
}

// The entry at i moves up past every larger parent, written once where it stops.
void sift_up(TableView& t, int64_t i) {
  int64_t* h = t.heap;
  const int64_t e0 = h[3 * i], e1 = h[3 * i + 1], e2 = h[3 * i + 2];
  while (i > 0) {
    const int64_t p = (i - 1) / 2;
    const int64_t* c = h + 3 * p;
    if (!key_less(e1, e2, c[1], c[2])) break;
    h[3 * i] = c[0];
    h[3 * i + 1] = c[1];
    h[3 * i + 2] = c[2];
    i = p;
  }
  h[3 * i] = e0;
  h[3 * i + 1] = e1;
  h[3 * i + 2] = e2;
}

inline int64_t home(const TableView& t, int64_t id) {
  return static_cast<int64_t>(mix64(static_cast<uint64_t>(id)) & static_cast<uint64_t>(t.index_cap - 1));
}

// Position of `id` in the index (>= 0), or -(first empty cell + 2) when absent, or -1 when the
// probe bound ran out before either was found.
int64_t index_find(TableView& t, int64_t id, int64_t max_probe) {
  const int64_t mask = t.index_cap - 1;
  int64_t pos = home(t, id);
  for (int64_t d = 0; d < max_probe; ++d, pos = (pos + 1) & mask) {
    const int64_t* cell = t.index + 2 * pos;
    if (cell[1] < 0) {
      t.state[kMaxProbe] = std::max(t.state[kMaxProbe], d + 1);
      return -(pos + 2);
    }
    if (cell[0] == id) {
      t.state[kMaxProbe] = std::max(t.state[kMaxProbe], d + 1);
      return pos;
    }
  }
  return -1;
}

// Prefetch hints (they read the state only as a hint, so the remap's result never depends on
// them). A table's state is about 1 MiB at 8192 slots (index 512 KiB, metadata 256 KiB, heap 192 KiB):
// it fits L2 but is cold when the table's turn comes (the other tables' state passed through since),
// so prefetch_state streams it in first. Ahead of each id, prefetch_index brings its home cell and
// prefetch_slot, nearer, finds the id at home (most are: the index is at most a quarter full) and
// brings its slot's metadata.
constexpr int64_t kIndexAhead = 16;
constexpr int64_t kSlotAhead = 8;
constexpr int64_t kRowAhead = 16;  // the pooling's rows, by their slots
constexpr int64_t kOutAhead = 4;   // the pooling's output rows, in bags

template <typename scalar_t>
inline void prefetch_row_for_write(scalar_t* row, int64_t D) {
  char* p = reinterpret_cast<char*>(row);
  for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) __builtin_prefetch(p + byte, 1);
}
// An id's remap costs about as much as this many element operations (for parallel_dynamic's choice
// of running a small call on one thread).
constexpr int64_t kIdWork = 16;

inline void prefetch_state(const TableView& t) {
  auto lines = [](const int64_t* p, int64_t n) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(int64_t)); b += 64) __builtin_prefetch(c + b, 1);
  };
  lines(t.index, 2 * t.index_cap);
  lines(t.meta, kMetaFields * t.slots);
  lines(t.heap, 3 * t.slots);
}

inline void prefetch_index(const TableView& t, int64_t id) { __builtin_prefetch(t.index + 2 * home(t, id)); }

inline void prefetch_slot(const TableView& t, int64_t id) {
  const int64_t* cell = t.index + 2 * home(t, id);
  const int64_t slot = cell[1];
  if (cell[0] == id && slot >= 0 && slot < t.slots) __builtin_prefetch(t.meta + slot * kMetaFields, 1);
}

// Knuth's algorithm R: remove the cell at `pos` and shift later members of its cluster back.
void index_erase(TableView& t, int64_t pos) {
  const int64_t mask = t.index_cap - 1;
  int64_t hole = pos, j = pos;
  while (true) {
    j = (j + 1) & mask;
    int64_t* cell = t.index + 2 * j;
    if (cell[1] < 0) break;
    const int64_t k = home(t, cell[0]);
    const bool stays = hole <= j ? (hole < k && k <= j) : (hole < k || k <= j);
    if (stays) continue;
    t.index[2 * hole] = cell[0];
    t.index[2 * hole + 1] = cell[1];
    hole = j;
  }
  t.index[2 * hole + 1] = -1;
  t.index[2 * hole] = 0;
}

// Counts a sighting of an id not in the index; returns whether it has now been seen
// admit_threshold times (it stays counted until it gets a slot). `pending_pos` is set to its cell.
bool admit(TableView& t, const Options& o, int64_t id, int64_t& pending_pos) {
  pending_pos = -1;
  if (o.admit_threshold <= 1) return true;
  const int64_t mask = t.pending_cap - 1;
  const int64_t start = static_cast<int64_t>(mix64(static_cast<uint64_t>(id) ^ kPendingSalt) &
                                             static_cast<uint64_t>(mask));
  const int64_t window = std::min(o.max_probe, t.pending_cap);
  int64_t empty = -1, lowest = -1;
  for (int64_t d = 0; d < window; ++d) {
    const int64_t pos = (start + d) & mask;
    int64_t* cell = t.pending + 2 * pos;
    if (cell[1] == 0) {
      if (empty < 0) empty = pos;
      continue;
    }
    if (cell[0] == id) {
      if (o.train) cell[1] += 1;
      pending_pos = pos;
      return cell[1] >= o.admit_threshold;
    }
    if (lowest < 0 || cell[1] < t.pending[2 * lowest + 1]) lowest = pos;
  }
  if (!o.train) return false;
  int64_t pos = empty;
  if (pos < 0) {
    pos = lowest;
    t.state[kPendingReplacements] += 1;
  }
  t.pending[2 * pos] = id;
  t.pending[2 * pos + 1] = 1;
  pending_pos = pos;
  return 1 >= o.admit_threshold;
}

// The slot whose id the policy evicts now, or -1 when none may be (see the file comment).
int64_t find_victim(TableView& t, const Options& o, int64_t batch_start_seq) {
  int64_t& size = t.state[kHeapSize];
  while (size > 0) {
    const int64_t slot = t.heap[0];
    TORCH_CHECK(slot >= 0 && slot < t.slots, "zch_remap: heap holds slot ", slot, " outside [0, ", t.slots, ")");
    const Key current = slot_key(t, o.policy, slot);
    if (!(current == heap_key(t, 0))) {
      // The next top is a child of this one (it sinks): fetch their slots' metadata meanwhile.
      if (size > 2) {
        __builtin_prefetch(t.meta + t.heap[3] * kMetaFields);
        __builtin_prefetch(t.meta + t.heap[6] * kMetaFields);
      }
      t.heap[1] = current.a;
      t.heap[2] = current.b;
      sift_down(t, 0, size);
      continue;
    }
    const int64_t* m = t.meta + slot * kMetaFields;
    if (m[kLastSeq] > batch_start_seq) {
      if (o.policy != kLFU) return -1;
      // Set aside behind the heap until the batch ends (end_batch pushes it back).
      heap_swap(t, 0, size - 1);
      size -= 1;
      sift_down(t, 0, size);
      continue;
    }
    if (o.policy == kTTL && o.now - m[kLastTime] < o.ttl) return -1;
    return slot;
  }
  return -1;
}

// The fresh weights of one row, in fp32 (reference.zch.fresh_row: lo + (hi - lo) * u, in double,
// rounded to float). u's numerator (mix64 >> 40) is below 2**24, so it converts through int32: the
// same double, in a loop the compiler vectorises (a uint64 -> double conversion has no AVX2 form).
// The work is 2 64-bit multiplies per element (56k rows x 64 per step in bench/hashed.py): AVX2
// emulates them with 32-bit ones, AVX-512DQ has them, so the AVX-512 clone is taken where the CPU
// has it. Integer math is exact and both clones contract the same expression the same way, so
// every CPU writes the same bits (tests/test_zch.py checks them against the reference).
__attribute__((always_inline)) inline void fresh_row_loop(float* __restrict__ out, uint64_t base, double lo,
                                                          double hi, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) {
    const int32_t top = static_cast<int32_t>(mix64(base + static_cast<uint64_t>(d)) >> 40);
    const double u = static_cast<double>(top) * (1.0 / 16777216.0);
    out[d] = static_cast<float>(lo + (hi - lo) * u);
  }
}

void fresh_row_default(float* __restrict__ out, uint64_t base, double lo, double hi, int64_t dim) {
  fresh_row_loop(out, base, lo, hi, dim);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,avx512dq,avx512vl"))) void fresh_row_avx512(float* __restrict__ out, uint64_t base,
                                                                           double lo, double hi, int64_t dim) {
  fresh_row_loop(out, base, lo, hi, dim);
}
#endif

inline void fresh_row(float* out, uint64_t base, double lo, double hi, int64_t dim) {
#if defined(__x86_64__) && defined(__GNUC__)
  // GEM_KERNELS_NO_AVX512=1 takes the default clone on any CPU (how tests/test_zch.py checks it here).
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512vl") && std::getenv("GEM_KERNELS_NO_AVX512") == nullptr;
  if (avx512) return fresh_row_avx512(out, base, lo, hi, dim);
#endif
  fresh_row_default(out, base, lo, hi, dim);
}

template <typename scalar_t>
void reset_row(int64_t id, int64_t t_index, int64_t row, uint64_t seed, double lo, double hi, scalar_t* weights,
               int64_t w_offset, int64_t dim, int64_t global_row, float* momentum1, int64_t m1_size,
               float* momentum2, int64_t m2_size) {
  const uint64_t base = mix64(static_cast<uint64_t>(id) ^ mix64(seed + static_cast<uint64_t>(t_index)));
  scalar_t* w = weights + w_offset + row * dim;
  if constexpr (std::is_same_v<scalar_t, float>) {
    fresh_row(w, base, lo, hi, dim);
  } else {
    thread_local std::vector<float> row_f32;
    row_f32.resize(dim);
    fresh_row(row_f32.data(), base, lo, hi, dim);
    for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<scalar_t>(row_f32[d]);
  }
  if (m1_size > 0) {
    // Row-wise state (Adagrad: no momentum2) has one value per row; element-wise state (Adam) is
    // packed like the weights.
    if (m2_size > 0) {
      std::fill(momentum1 + w_offset + row * dim, momentum1 + w_offset + (row + 1) * dim, 0.0f);
    } else {
      momentum1[global_row] = 0.0f;
    }
  }
  if (m2_size > 0) std::fill(momentum2 + w_offset + row * dim, momentum2 + w_offset + (row + 1) * dim, 0.0f);
}

// The state tensors of one call, checked, as raw pointers; the layout of reference/zch.py.
struct State {
  int64_t T;
  const int64_t *slot_off, *index_off, *pending_off, *off;
  int64_t *meta, *heap, *index, *pending, *state;
  bool reset;  // weights given: a slot given to a new id gets fresh weights and zero optimizer state
  const int64_t *w_off, *d_off, *r_off;
  const double* bounds;
  float *m1, *m2;
  int64_t m1_size, m2_size;
};

State check_state(const at::Tensor& ids, const at::Tensor& id_offsets, at::Tensor& slot_meta, at::Tensor& heap,
                  at::Tensor& index, at::Tensor& pending, at::Tensor& table_state, const at::Tensor& layout,
                  int64_t policy, int64_t now, int64_t admit_threshold, int64_t max_probe, bool train,
                  at::Tensor& weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                  const at::Tensor& rows_offsets, at::Tensor& momentum1, at::Tensor& momentum2,
                  const at::Tensor& init_bounds) {
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&ids, &id_offsets, &slot_meta, &heap, &index, &pending, &table_state, &layout}) {
    GK_CHECK_CPU(*x);
    GK_CHECK_CONTIGUOUS(*x);
    TORCH_CHECK(x->scalar_type() == at::kLong, "zch_remap: every index/state tensor must be int64");
  }
  TORCH_CHECK(policy >= 0 && policy <= 2, "zch_remap: policy code must be 0..2, got ", policy);
  TORCH_CHECK(max_probe >= 1, "zch_remap: max_probe must be >= 1, got ", max_probe);
  const int64_t T = id_offsets.numel() - 1;
  TORCH_CHECK(T >= 1 && layout.dim() == 2 && layout.size(0) == 3 && layout.size(1) == T + 1,
              "zch_remap: layout must be [3, T+1] with T = id_offsets.numel() - 1");
  TORCH_CHECK(table_state.dim() == 2 && table_state.size(0) == T && table_state.size(1) == kNumFields,
              "zch_remap: table_state must be [T, ", kNumFields, "]");
  const int64_t* lay = layout.data_ptr<int64_t>();
  State s{};
  s.T = T;
  s.slot_off = lay;
  s.index_off = lay + (T + 1);
  s.pending_off = lay + 2 * (T + 1);
  TORCH_CHECK(slot_meta.numel() == s.slot_off[T] * kMetaFields && heap.numel() == s.slot_off[T] * 3 &&
                  index.numel() == s.index_off[T] * 2 && pending.numel() == s.pending_off[T] * 2,
              "zch_remap: state tensors do not match layout");
  const int64_t N = ids.numel();
  const int64_t* off = id_offsets.data_ptr<int64_t>();
  s.off = off;
  zch_checks::check_tables(off, lay, table_state.data_ptr<int64_t>(), T, N, now, train, admit_threshold);
  s.reset = weights.numel() > 0;
  if (s.reset) {
    GK_CHECK_CONTIGUOUS(weights);
    for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&weights_offsets, &D_offsets, &rows_offsets,
                                                                         &init_bounds, &momentum1, &momentum2}) {
      GK_CHECK_CPU(*x);
      GK_CHECK_CONTIGUOUS(*x);
    }
    zch_checks::check_reset_tensors(T, weights_offsets, D_offsets, rows_offsets, init_bounds, momentum1, momentum2);
    s.w_off = weights_offsets.data_ptr<int64_t>();
    s.d_off = D_offsets.data_ptr<int64_t>();
    s.r_off = rows_offsets.data_ptr<int64_t>();
    s.bounds = init_bounds.data_ptr<double>();
    s.m1 = momentum1.data_ptr<float>();
    s.m2 = momentum2.data_ptr<float>();
    s.m1_size = momentum1.numel();
    s.m2_size = momentum2.numel();
    zch_checks::check_reset_values(T, s.slot_off, s.w_off, s.d_off, s.r_off, weights.numel(), s.m1_size, s.m2_size);
  }
  s.meta = slot_meta.data_ptr<int64_t>();
  s.heap = heap.data_ptr<int64_t>();
  s.index = index.data_ptr<int64_t>();
  s.pending = pending.data_ptr<int64_t>();
  s.state = table_state.data_ptr<int64_t>();
  return s;
}

TableView table_view(const State& s, int64_t ti) {
  return TableView{s.slot_off[ti + 1] - s.slot_off[ti], s.index_off[ti + 1] - s.index_off[ti],
                   s.pending_off[ti + 1] - s.pending_off[ti], s.meta + s.slot_off[ti] * kMetaFields,
                   s.heap + s.slot_off[ti] * 3, s.index + s.index_off[ti] * 2, s.pending + s.pending_off[ti] * 2,
                   s.state + ti * kNumFields};
}

// The slot of one id of table ti (the miss value when it has none), admitting and evicting in
// training; a slot given to the id gets its fresh row (s.reset).
template <typename scalar_t>
int64_t remap_id(const State& s, TableView& t, const Options& o, int64_t ti, int64_t id, int64_t batch_start,
                 uint64_t seed, scalar_t* weights) {
  const int64_t miss = o.default_row ? t.slots : -1;
  t.state[kLookups] += 1;
  int64_t pos = index_find(t, id, o.max_probe);
  if (pos >= 0) {
    const int64_t slot = t.index[2 * pos + 1];
    TORCH_CHECK(slot < t.slots, "zch_remap: index holds slot ", slot, " outside [0, ", t.slots, ")");
    t.state[kHits] += 1;
    if (o.train) {
      int64_t* m = t.meta + slot * kMetaFields;
      m[kCount] += 1;
      m[kLastSeq] = ++t.state[kSeq];
      m[kLastTime] = o.now;
    }
    return slot;
  }
  int64_t pending_pos;
  if (!admit(t, o, id, pending_pos) || !o.train) {
    t.state[kUnadmitted] += 1;
    return miss;
  }
  if (pos == -1) {
    t.state[kProbeOverflows] += 1;
    t.state[kUnadmitted] += 1;
    return miss;
  }
  int64_t slot;
  const bool fresh = t.state[kUsed] < t.slots;
  if (fresh) {
    slot = t.state[kUsed]++;
  } else {
    slot = find_victim(t, o, batch_start);
    if (slot < 0) {
      t.state[kUnadmitted] += 1;
      return miss;
    }
    const int64_t old = index_find(t, t.meta[slot * kMetaFields + kId], o.max_probe);
    TORCH_CHECK(old >= 0, "zch_remap: the id of slot ", slot, " is missing from the index");
    index_erase(t, old);
    pos = index_find(t, id, o.max_probe);  // the erase may have moved the first empty cell closer
    TORCH_CHECK(pos <= -2, "zch_remap: the index changed under the insertion of id ", id);
    t.state[kEvictions] += 1;
  }
  const int64_t cell = -(pos + 2);
  t.index[2 * cell] = id;
  t.index[2 * cell + 1] = slot;
  if (pending_pos >= 0) t.pending[2 * pending_pos + 1] = 0;
  int64_t* m = t.meta + slot * kMetaFields;
  m[kId] = id;
  m[kCount] = 1;
  m[kLastSeq] = ++t.state[kSeq];
  m[kLastTime] = o.now;
  const Key key = slot_key(t, o.policy, slot);
  if (fresh) {  // a slot never used before: push its entry
    const int64_t h = t.state[kHeapSize]++;
    t.heap[3 * h] = slot;
    t.heap[3 * h + 1] = key.a;
    t.heap[3 * h + 2] = key.b;
    sift_up(t, h);
  } else {  // the victim is the top: its entry now carries the new id's key
    t.heap[1] = key.a;
    t.heap[2] = key.b;
    sift_down(t, 0, t.state[kHeapSize]);
  }
  if (s.reset) {
    const int64_t dim = s.d_off[ti + 1] - s.d_off[ti];
    reset_row<scalar_t>(id, ti, slot, seed, s.bounds[2 * ti], s.bounds[2 * ti + 1], weights, s.w_off[ti], dim,
                        s.r_off[ti] + slot, s.m1, s.m1_size, s.m2, s.m2_size);
  }
  return slot;
}

// End of a table's batch: the LFU entries set aside go back into the heap; the clock advances.
void end_batch(TableView& t, const Options& o) {
  while (t.state[kHeapSize] < t.state[kUsed]) {
    const int64_t h = t.state[kHeapSize]++;
    sift_up(t, h);
  }
  if (o.train) t.state[kLastNow] = o.now;
}

// One table's ids in order, out[i] the slot of ids[i] (begin <= i < end), then the table's batch end.
template <typename scalar_t>
void remap_table(const State& s, const Options& o, int64_t ti, const int64_t* ids, int64_t begin, int64_t end,
                 uint64_t seed, scalar_t* weights, int64_t* out) {
  TableView t = table_view(s, ti);
  prefetch_state(t);
  const int64_t batch_start = t.state[kSeq];
  for (int64_t i = begin; i < end; ++i) {
    if (i + kIndexAhead < end) prefetch_index(t, ids[i + kIndexAhead]);
    if (i + kSlotAhead < end) prefetch_slot(t, ids[i + kSlotAhead]);
    out[i] = remap_id(s, t, o, ti, ids[i], batch_start, seed, weights);
  }
  end_batch(t, o);
}

at::Tensor zch_remap_cpu(const at::Tensor& ids, const at::Tensor& id_offsets, at::Tensor slot_meta,
                         at::Tensor heap, at::Tensor index, at::Tensor pending, at::Tensor table_state,
                         const at::Tensor& layout, int64_t policy, int64_t ttl, int64_t now, int64_t admit_threshold,
                         int64_t max_probe, bool train, bool default_row, at::Tensor weights,
                         const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
                         const at::Tensor& rows_offsets, at::Tensor momentum1, at::Tensor momentum2,
                         const at::Tensor& init_bounds, int64_t seed) {
  const State s = check_state(ids, id_offsets, slot_meta, heap, index, pending, table_state, layout, policy, now,
                              admit_threshold, max_probe, train, weights, weights_offsets, D_offsets, rows_offsets,
                              momentum1, momentum2, init_bounds);
  auto slots_out = at::empty({ids.numel()}, ids.options());
  const int64_t* id_data = ids.data_ptr<int64_t>();
  int64_t* out = slots_out.data_ptr<int64_t>();
  const Options opts{policy, ttl, now, admit_threshold, max_probe, train, default_row};
  auto run = [&](auto* weights_ptr) {
    parallel_dynamic(s.T, ids.numel() * kIdWork, [&](int64_t ti) {
      remap_table(s, opts, ti, id_data, s.off[ti], s.off[ti + 1], static_cast<uint64_t>(seed), weights_ptr, out);
    });
  };
  if (s.reset) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "zch_remap_cpu",
                                    [&] { run(weights.data_ptr<scalar_t>()); });
  } else {
    run(static_cast<float*>(nullptr));
  }
  return slots_out;
}

// The fused remap + pooling forward: one call, one task per table (tables in parallel, as the
// remap): the table's ids are remapped (admitted, evicted, fresh rows written), then its bags pooled
// from the slots just written, still in L1/L2, each row prefetched by its slot. A slot used earlier
// in the batch is never a victim, so every row a bag reads stays that id's row to the end of the
// call: the output equals the remap followed by embedding_bag (whose row primitives,
// gem_kernels/cpu_rows.h, pool here too). Remapping the table first, rather than pooling each id as
// it is remapped, keeps the table's ~1 MiB of remap state in L2 while it is walked, without the
// rows' 2 MiB passing through, and gives the pooling exact prefetches: 59 -> 48 ms of CPU a step
// (bench/hashed.py's stream, one thread).
// Roofline: FLOPs 2 * N * D; bytes the remap's plus N * D * s rows read and B * sum_t D_t * s written.
std::tuple<at::Tensor, at::Tensor> zch_embedding_bag_forward_cpu(
    const at::Tensor& ids, const at::Tensor& offsets, const at::Tensor& per_sample_weights, at::Tensor slot_meta,
    at::Tensor heap, at::Tensor index, at::Tensor pending, at::Tensor table_state, const at::Tensor& layout,
    int64_t policy, int64_t ttl, int64_t now, int64_t admit_threshold, int64_t max_probe, bool train,
    bool default_row, at::Tensor weights, const at::Tensor& weights_offsets, const at::Tensor& D_offsets,
    const at::Tensor& rows_offsets, at::Tensor momentum1, at::Tensor momentum2, const at::Tensor& init_bounds,
    int64_t seed, int64_t output_dim, int64_t pooling) {
  GK_CHECK_CPU(offsets);
  GK_CHECK_CONTIGUOUS(offsets);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1, "zch_embedding_bag: offsets must be int64 [T*B+1]");
  TORCH_CHECK(weights.numel() > 0, "zch_embedding_bag: weights must not be empty");
  TORCH_CHECK(pooling == kSum || pooling == kMean, "zch_embedding_bag: pooling code must be sum or mean, got ", pooling);
  const int64_t T = layout.dim() == 2 ? layout.size(1) - 1 : 0;
  TORCH_CHECK(T >= 1 && (offsets.numel() - 1) % T == 0, "zch_embedding_bag: offsets must have T*B+1 elements");
  const int64_t B = (offsets.numel() - 1) / T;
  const int64_t* bag_off = offsets.data_ptr<int64_t>();
  check_offsets_values(offsets, ids.numel());
  // Table t's ids are offsets[t*B] .. offsets[(t+1)*B]: the remap's per-table segments.
  auto id_offsets = at::empty({T + 1}, offsets.options());
  for (int64_t t = 0; t <= T; ++t) id_offsets.data_ptr<int64_t>()[t] = bag_off[t * B];
  const State s = check_state(ids, id_offsets, slot_meta, heap, index, pending, table_state, layout, policy, now,
                              admit_threshold, max_probe, train, weights, weights_offsets, D_offsets, rows_offsets,
                              momentum1, momentum2, init_bounds);
  TORCH_CHECK(output_dim == s.d_off[T], "zch_embedding_bag: output_dim must be D_offsets[-1] = ", s.d_off[T]);
  const bool weighted = per_sample_weights.numel() > 0;
  if (weighted) {
    GK_CHECK_CPU(per_sample_weights);
    GK_CHECK_CONTIGUOUS(per_sample_weights);
    TORCH_CHECK(per_sample_weights.scalar_type() == at::kFloat && per_sample_weights.numel() == ids.numel(),
                "zch_embedding_bag: per_sample_weights must be float32 [N]");
  }
  auto slots_out = at::empty({ids.numel()}, ids.options());
  auto out = empty_for_streaming_write({B, output_dim}, weights.options());
  const int64_t* id_data = ids.data_ptr<int64_t>();
  int64_t* slots = slots_out.data_ptr<int64_t>();
  const float* psw = weighted ? per_sample_weights.data_ptr<float>() : nullptr;
  const Options opts{policy, ttl, now, admit_threshold, max_probe, train, default_row};
  auto run = [&](auto* w) {
    using scalar_t = std::remove_pointer_t<decltype(w)>;
    scalar_t* o = out.data_ptr<scalar_t>();
    parallel_dynamic(s.T, ids.numel() * (kIdWork + s.d_off[s.T] / s.T), [&](int64_t ti) {
      thread_local std::vector<float> acc;
      remap_table(s, opts, ti, id_data, s.off[ti], s.off[ti + 1], static_cast<uint64_t>(seed), w, slots);
      const int64_t D = s.d_off[ti + 1] - s.d_off[ti];
      const int64_t rows = s.r_off[ti + 1] - s.r_off[ti];
      const scalar_t* table = w + s.w_off[ti];
      const int64_t stop = s.off[ti + 1];
      acc.resize(D);
      scalar_t* out_t = o + s.d_off[ti];
      for (int64_t b = 0; b < B; ++b) {
        // The output row a few bags on, for writing: the table's slices of the [B, sum D] output are
        // a stride apart that the hardware prefetchers do not follow, and each store otherwise waits
        // for its line.
        if (b + kOutAhead < B) prefetch_row_for_write(out_t + (b + kOutAhead) * output_dim, D);
        std::fill(acc.begin(), acc.end(), 0.f);
        int64_t kept = 0;
        for (int64_t p = bag_off[ti * B + b]; p < bag_off[ti * B + b + 1]; ++p) {
          if (p + kRowAhead < stop) {
            const int64_t ahead = slots[p + kRowAhead];
            if (ahead >= 0 && ahead < rows) prefetch_row(table + ahead * D, D);
          }
          const int64_t slot = slots[p];
          if (slot < 0 || slot >= rows) continue;  // no row: left out of its bag ("zeros")
          axpy_row(acc.data(), table + slot * D, psw ? psw[p] : 1.f, D);
          ++kept;
        }
        const float scale = (pooling == kMean && kept > 0) ? 1.f / static_cast<float>(kept) : 1.f;
        store_row(out_t + b * output_dim, acc.data(), scale, D);
      }
    });
  };
  // The weights dtypes of the embedding-bag ops (the front door refuses the rest).
  AT_DISPATCH_SWITCH(weights.scalar_type(), "zch_embedding_bag_cpu",
                     AT_DISPATCH_CASE(at::kFloat, [&] { run(weights.data_ptr<scalar_t>()); })
                         AT_DISPATCH_CASE(at::kHalf, [&] { run(weights.data_ptr<scalar_t>()); })
                             AT_DISPATCH_CASE(at::kBFloat16, [&] { run(weights.data_ptr<scalar_t>()); }));
  return {out, slots_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("zch_remap_native", &zch_remap_cpu);
  m.impl("zch_embedding_bag_forward_native", &zch_embedding_bag_forward_cpu);
}

}  // namespace gem_kernels
