// The short-sequence path of the CPU HSTU attention (forward and backward of one (sequence, head)
// item of at most kShortMaxLen rows). Included by attention.cpp inside its anonymous namespace,
// after the helpers it shares (row_span, scores_tile, silu_row, silu_grad_row, add_by_bucket);
// attention.cpp's item loops call forward_item_short / backward_item_short first and take their
// tile loops when these return false.
//
// Why a separate path: the GEM model's sequences are short (~36 rows, at most 74, D = Dv = 16), so
// the general path's 128 x 128 tiles hand the BLAS products 36 x 36 x 16 shapes, where each sgemm
// call's fixed cost and a tile's full-width row passes outweigh the arithmetic. Here an item runs
// row by row on AVX2 over exactly the row's visible keys:
// - scores s[i, c] = q_i . k_c for the 8-column blocks that cover the row's span, from a transposed
//   copy of the item's keys (kt [D, Lp], Lp = L rounded up to 8): 4 blocks per pass, one FMA chain
//   per block;
// - scale, position and time bias: scores_tile over the whole item (one tile);
// - SiLU (and its derivative) over the same whole blocks, so no scalar tail;
// - the products with V (forward), K, Q and dO (backward) run over the row's visible keys only
//   ([begin, end) less a prefix mask's hole), with the weights broadcast against rows of the other
//   operand: a masked pair is never multiplied, so an Inf or NaN in an invisible row never reaches
//   an output (the rule the general path keeps with masked_mm).
// Work decomposition: one item = one (sequence, head), scheduled by for_each_item like the general
// path; the backward's dk and dv rows of the item accumulate in the workspace and are written once.
// FLOPs and minimum bytes: the general path's (attention.cpp's header).
//
// Taken when: kind hstu, the full forward (no cached delta rows), D and Dv multiples of 8, L <=
// kShortMaxLen, and a banded or prefix mask (every row's visible keys are one run, less at most one
// hole; the other masks ask visible() per pair and take the tile loops). Needs AVX2 (the build's
// default); other builds always take the tile loops.

// At most one 128-row tile, so the workspace's tiles hold the whole item.
constexpr int64_t kShortMaxLen = kBlockN;

#if GK_ATTENTION_AVX2

inline int64_t round8(int64_t n) { return (n + 7) & ~int64_t{7}; }

bool short_item(const Prepared& in, const Item& it, const SeqMask& mask) {
  const Params& p = in.p;
  return !p.softmax && in.delta == 0 && it.L <= kShortMaxLen && p.D % 8 == 0 && p.Dv % 8 == 0 &&
         (mask.banded || mask.prefix);
}

// dst[d * Lp + j] = rows[j * ld + d] for j < L, 0 for L <= j < Lp (padding columns stay finite).
void transpose_rows(const float* rows, int64_t ld, int64_t L, int64_t width, float* dst) {
  const int64_t Lp = round8(L);
  for (int64_t j = 0; j < L; ++j)
    for (int64_t d = 0; d < width; ++d) dst[d * Lp + j] = rows[j * ld + d];
  for (int64_t d = 0; d < width; ++d) std::fill(dst + d * Lp + L, dst + (d + 1) * Lp, 0.0f);
}

// out[c] = sum_d x[d] * t[d * ld + c] for c in the 8-column blocks [b0, b1).
void dot_blocks(const float* x, int64_t width, const float* t, int64_t ld, int64_t b0, int64_t b1, float* out) {
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* col = t + b * 8;
    for (int64_t d = 0; d < width; ++d) {
      const __m256 xd = _mm256_set1_ps(x[d]);
      const float* r = col + d * ld;
      a0 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r), a0);
      a1 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r + 8), a1);
      a2 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r + 16), a2);
      a3 = _mm256_fmadd_ps(xd, _mm256_loadu_ps(r + 24), a3);
    }
    _mm256_storeu_ps(out + b * 8, a0);
    _mm256_storeu_ps(out + b * 8 + 8, a1);
    _mm256_storeu_ps(out + b * 8 + 16, a2);
    _mm256_storeu_ps(out + b * 8 + 24, a3);
  }
  for (; b < b1; ++b) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < width; ++d) a = _mm256_fmadd_ps(_mm256_set1_ps(x[d]), _mm256_loadu_ps(t + d * ld + b * 8), a);
    _mm256_storeu_ps(out + b * 8, a);
  }
}

// acc[0, width) += sum_{c in [c0, c1)} w[c] * x[c * ldx + (0, width)] (width a multiple of 8).
void gather_rows(const float* w, const float* x, int64_t ldx, int64_t c0, int64_t c1, int64_t width, float* acc) {
  int64_t d = 0;
  for (; d + 16 <= width; d += 16) {
    // Two keys per step into separate accumulators: the FMA latency chain halves.
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 b0 = _mm256_setzero_ps(), b1 = b0;
    int64_t c = c0;
    for (; c + 2 <= c1; c += 2) {
      const __m256 w0 = _mm256_set1_ps(w[c]), w1 = _mm256_set1_ps(w[c + 1]);
      const float* x0 = x + c * ldx + d;
      const float* x1 = x0 + ldx;
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0), a0);
      a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + 8), a1);
      b0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1), b0);
      b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + 8), b1);
    }
    if (c < c1) {
      const __m256 w0 = _mm256_set1_ps(w[c]);
      a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + c * ldx + d), a0);
      a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + c * ldx + d + 8), a1);
    }
    _mm256_storeu_ps(acc + d, _mm256_add_ps(a0, b0));
    _mm256_storeu_ps(acc + d + 8, _mm256_add_ps(a1, b1));
  }
  if (d < width) {  // one 8-wide chunk left
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int64_t c = c0; c < c1; ++c) a = _mm256_fmadd_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(x + c * ldx + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
}

// out[c * width + (0, width)] += alpha * w[c] * x[(0, width)] for c in [c0, c1) (width a multiple of 8).
void scatter_rows(const float* w, float alpha, const float* x, int64_t c0, int64_t c1, int64_t width, float* out) {
  for (int64_t d = 0; d < width; d += 8) {
    const __m256 xd = _mm256_mul_ps(_mm256_set1_ps(alpha), _mm256_loadu_ps(x + d));
    for (int64_t c = c0; c < c1; ++c) {
      float* o = out + c * width + d;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(w[c]), xd, _mm256_loadu_ps(o)));
    }
  }
}

// The visible keys of row i as at most two runs [a0, a1) and [b0, b1): the span less its hole.
struct Runs {
  int64_t a0, a1, b0, b1;
};

inline Runs runs_of(const RowSpan& span) {
  if (span.hole_end > span.hole_begin) return {span.begin, span.hole_begin, span.hole_end, span.end};
  return {span.begin, span.end, span.end, span.end};
}

// Scores of every row of the item over the 8-column blocks covering its span, then scale and biases
// (scores_tile: the item is one tile).
void short_scores(const Prepared& in, const Item& it, Workspace& ws, int tile_kind, const float* kt) {
  const Params& p = in.p;
  const int64_t L = it.L, Lp = round8(L), qs = p.H * p.D;
  for (int64_t i = 0; i < L; ++i) {
    const RowSpan span = row_span(ws.mask, tile_kind, i, 0, L);
    if (span.end > span.begin)
      dot_blocks(it.q0 + i * qs, p.D, kt, Lp, span.begin / 8, round8(span.end) / 8, ws.s.data() + i * kBlockN);
  }
  scores_tile(p, ws.mask, ws, it.start, it.h, 0, L, 0, L, tile_kind);
}

bool forward_item_short(const Prepared& in, const Item& it, Workspace& ws, float* op) {
  if (!short_item(in, it, ws.mask)) return false;
  const Params& p = in.p;
  const int64_t L = it.L, H = p.H, D = p.D, Dv = p.Dv, vs = H * Dv;
  const float inv_m = p.M > 0 ? 1.0f / static_cast<float>(p.M) : 0.0f;
  ws.k_rows.resize(D * round8(L));
  transpose_rows(it.k0, H * D, L, D, ws.k_rows.data());
  const int tile_kind = ws.mask.classify(0, L, 0, L);
  short_scores(in, it, ws, tile_kind, ws.k_rows.data());
  for (int64_t i = 0; i < L; ++i) {
    float* dst = op + ((it.start + i) * H + it.h) * Dv;
    std::fill(dst, dst + Dv, 0.0f);
    const RowSpan span = row_span(ws.mask, tile_kind, i, 0, L);
    if (span.end <= span.begin) continue;
    float* w = ws.s.data() + i * kBlockN;
    const int64_t lo = span.begin & ~int64_t{7};
    silu_row(w + lo, round8(span.end) - lo, inv_m);  // whole blocks: the columns outside the runs are never read
    const Runs r = runs_of(span);
    gather_rows(w, it.v0, vs, r.a0, r.a1, Dv, dst);
    gather_rows(w, it.v0, vs, r.b0, r.b1, Dv, dst);
  }
  return true;
}

// The backward of one item: dq rows written (the item owns them; dq starts zeroed), dk and dv rows
// accumulated in the workspace and written, bias gradients added to the item's partials.
bool backward_item_short(const Prepared& in, const Item& it, Workspace& ws, const float* dout, float* dq,
                         float* dk, float* dv, float* pos_part_item, float* time_part_item) {
  if (!short_item(in, it, ws.mask)) return false;
  const Params& p = in.p;
  const int64_t L = it.L, Lp = round8(L), H = p.H, D = p.D, Dv = p.Dv, qs = H * D, vs = H * Dv;
  const float inv_m = p.M > 0 ? 1.0f / static_cast<float>(p.M) : 0.0f;
  ws.k_rows.resize(D * Lp);
  ws.v_rows.resize(Dv * Lp);
  transpose_rows(it.k0, qs, L, D, ws.k_rows.data());
  transpose_rows(it.v0, vs, L, Dv, ws.v_rows.data());
  const int tile_kind = ws.mask.classify(0, L, 0, L);
  short_scores(in, it, ws, tile_kind, ws.k_rows.data());
  const float* do0 = dout + (it.start * H + it.h) * Dv;
  float* dq0 = dq + (it.start * H + it.h) * D;
  float* dk_acc = ws.acc.data();
  float* dv_acc = ws.acc2.data();
  std::fill(dk_acc, dk_acc + L * D, 0.0f);
  std::fill(dv_acc, dv_acc + L * Dv, 0.0f);
  for (int64_t i = 0; i < L; ++i) {
    const RowSpan span = row_span(ws.mask, tile_kind, i, 0, L);
    if (span.end <= span.begin) continue;
    const int64_t lo = span.begin & ~int64_t{7}, hi = round8(span.end);
    const float* s = ws.s.data() + i * kBlockN;
    float* pr = ws.pr.data() + i * kBlockN;
    float* ds = ws.dp.data() + i * kBlockN;  // dP in, dS out
    const float* do_i = do0 + i * vs;
    dot_blocks(do_i, Dv, ws.v_rows.data(), Lp, lo / 8, hi / 8, ds);
    silu_grad_row(s + lo, pr + lo, ds + lo, hi - lo, inv_m);  // whole blocks, as in the forward
    const Runs r = runs_of(span);
    if (pos_part_item != nullptr) {
      float* dst = pos_part_item + (L - 1 - i);  // slot j - i + L - 1
      for (int64_t c = r.a0; c < r.a1; ++c) dst[c] += ds[c];
      for (int64_t c = r.b0; c < r.b1; ++c) dst[c] += ds[c];
    }
    if (time_part_item != nullptr) {
      const int32_t* bucket = ws.bucket.data() + i * kBlockN;
      add_by_bucket(bucket + r.a0, ds + r.a0, r.a1 - r.a0, time_part_item);
      add_by_bucket(bucket + r.b0, ds + r.b0, r.b1 - r.b0, time_part_item);
    }
    // dq_i = scale * sum_c ds[c] k_c (k rows at their [N, H, D] stride).
    float* dq_i = dq0 + i * qs;
    gather_rows(ds, it.k0, qs, r.a0, r.a1, D, dq_i);
    gather_rows(ds, it.k0, qs, r.b0, r.b1, D, dq_i);
    for (int64_t d = 0; d < D; ++d) dq_i[d] *= p.scale;
    // dk_c += scale * ds[c] q_i, dv_c += p[c] do_i.
    const float* q_i = it.q0 + i * qs;
    scatter_rows(ds, p.scale, q_i, r.a0, r.a1, D, dk_acc);
    scatter_rows(ds, p.scale, q_i, r.b0, r.b1, D, dk_acc);
    scatter_rows(pr, 1.0f, do_i, r.a0, r.a1, Dv, dv_acc);
    scatter_rows(pr, 1.0f, do_i, r.b0, r.b1, Dv, dv_acc);
  }
  float* dk0 = dk + (it.start * H + it.h) * D;
  float* dv0 = dv + (it.start * H + it.h) * Dv;
  for (int64_t c = 0; c < L; ++c) {
    std::copy(dk_acc + c * D, dk_acc + (c + 1) * D, dk0 + c * qs);
    std::copy(dv_acc + c * Dv, dv_acc + (c + 1) * Dv, dv0 + c * vs);
  }
  return true;
}

#else

bool forward_item_short(const Prepared&, const Item&, Workspace&, float*) { return false; }
bool backward_item_short(const Prepared&, const Item&, Workspace&, const float*, float*, float*, float*, float*,
                         float*) {
  return false;
}

#endif
