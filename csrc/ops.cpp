// Every native schema of gem_kernels, in one block. The public ops (gem_kernels::jagged_to_padded,
// ...) are defined in Python (gem_kernels/ops/<family>.py) with their fake kernels, autograd and
// backend dispatch; the `*_native` schemas below are the C++/CUDA kernels those ops call for the
// `cpu` and `cuda` backends. CPU impls live in cpu/<family>.cpp, CUDA impls in cuda/<family>.cu.

#include <torch/extension.h>
#include <torch/library.h>

TORCH_LIBRARY(gem_kernels, m) {
  // jagged: values [N, D] + offsets [B+1] <-> padded [B, max_len, D]
  m.def("jagged_to_padded_native(Tensor values, Tensor offsets, SymInt max_len, float pad_value) -> Tensor");
  m.def("padded_to_jagged_native(Tensor padded, Tensor offsets, SymInt total_len) -> Tensor");
  // HSTU input sequences [contextual | history | candidates] per user (gem_kernels/ops/jagged.py,
  // hstu_sequence_layout): -> (seq_offsets, rows, candidate_owner, timestamps, query_timestamps)
  m.def("hstu_sequence_layout_native(Tensor history_offsets, Tensor num_candidates, Tensor request_timestamps, "
        "Tensor history_timestamps, int contextual_len, SymInt num_rows) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Each jagged row prefixed with its sequence's dense row: dense [B, K], offsets [B+1], jagged [N, S] ->
  // [N, K + S]; the backward -> (grad_dense [B, K] segment sums, grad_jagged [N, S])
  m.def("jagged_broadcast_cat_native(Tensor dense, Tensor offsets, Tensor jagged) -> Tensor");
  m.def("jagged_broadcast_cat_backward_native(Tensor grad, Tensor offsets, int dense_width) -> (Tensor, Tensor)");
  // embedding_bag (TBE): packed tables + int64 metadata; codes in gem_kernels/_embedding_bag.py = include/gem_kernels/embedding_bag_codes.h
  m.def("embedding_bag_forward_native(Tensor weights, Tensor weights_offsets, Tensor D_offsets, Tensor rows_offsets, "
        "Tensor indices, Tensor offsets, Tensor per_sample_weights, int output_dim, int pooling, int bounds_check) "
        "-> Tensor");
  m.def("embedding_bag_backward_native(Tensor grad_output, Tensor weights, Tensor weights_offsets, Tensor D_offsets, "
        "Tensor rows_offsets, Tensor indices, Tensor offsets, Tensor per_sample_weights, int pooling) -> Tensor");
  m.def("embedding_bag_backward_fused_native(Tensor grad_output, Tensor(a!) weights, Tensor(b!) momentum1, "
        "Tensor(c!) momentum2, Tensor(d!) step, Tensor weights_offsets, Tensor D_offsets, Tensor rows_offsets, "
        "Tensor indices, Tensor offsets, Tensor per_sample_weights, int pooling, int optimizer, float lr, float eps, "
        "float beta1, float beta2, float weight_decay) -> ()");
  m.def("embedding_bag_per_sample_weights_backward_native(Tensor grad_output, Tensor weights, "
        "Tensor weights_offsets, Tensor D_offsets, Tensor rows_offsets, Tensor indices, Tensor offsets, int pooling) "
        "-> Tensor");
  // quant_embedding_bag (inference): flat uint8 FBGEMM IntNBit rows + int64 metadata (weights_offsets in bytes,
  // D_offsets, rows_offsets, weights_tys = FBGEMM SparseType codes, row_bytes); gem_kernels/ops/quant_embedding_bag.py
  m.def("quant_embedding_bag_forward_native(Tensor weights, Tensor weights_offsets, Tensor D_offsets, "
        "Tensor rows_offsets, Tensor weights_tys, Tensor row_bytes, Tensor indices, Tensor offsets, "
        "Tensor per_sample_weights, int output_dim, int pooling, int bounds_check, ScalarType output_dtype, "
        "int fp8_exponent_bits, int fp8_exponent_bias) -> Tensor");
  // attention: jagged q, k [N, H, Dqk], v [N, H, Dv] -> (out [N, H, Dv], fp32 lse [N, H] or [0] for hstu)
  m.def("jagged_attention_fwd_native(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, int max_seq_len, str kind, "
        "bool causal, float scale, Tensor? num_targets, int contextual_len, int max_attn_len, Tensor? pos_bias, "
        "Tensor? time_bias, Tensor? timestamps, Tensor? query_timestamps) -> (Tensor, Tensor)");
  // -> (dq, dk, dv, dpos_bias, dtime_bias); an absent bias gets an empty [0] gradient
  m.def("jagged_attention_bwd_native(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor seq_offsets, int max_seq_len, str kind, bool causal, float scale, Tensor? num_targets, "
        "int contextual_len, int max_attn_len, Tensor? pos_bias, Tensor? time_bias, Tensor? timestamps, "
        "Tensor? query_timestamps, bool deterministic) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // cached attention (inference): delta_q [B * delta, H, Dqk] = the last delta rows of every sequence,
  // k [N, H, Dqk], v [N, H, Dv] the whole sequences; causal -> out [B * delta, H, Dv]
  m.def("cached_jagged_attention_fwd_native(Tensor delta_q, Tensor k, Tensor v, Tensor seq_offsets, "
        "int max_seq_len, str kind, float scale, Tensor? num_targets, int contextual_len, int max_attn_len, "
        "Tensor? pos_bias, Tensor? time_bias, Tensor? timestamps, Tensor? query_timestamps) -> Tensor");

  // linear: out = relu?(concat(x, x2) W^T + b), x [R, K1] and x2 [R, K2] (rows may be strided), weight
  // [N, K1 + K2], bias [N]; the backward (out: the forward's output, read for the ReLU mask; empty
  // without relu) -> (grad_x, grad_x2, grad_weight, grad_bias)
  m.def("linear_native(Tensor x, Tensor x2, Tensor weight, Tensor bias, bool relu) -> Tensor");
  m.def("linear_backward_native(Tensor grad_out, Tensor x, Tensor x2, Tensor weight, Tensor out, bool relu) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  // interaction: dot interaction x [B, F, D] -> [B, P]; cross layer (u [N, N] or u [N, r] + v [r, N],
  // v empty for full rank) -> (out, z, p); fm_compress x [B, F, D], y [F, k] -> (out, mean, rstd)
  m.def("dot_interaction_native(Tensor x, bool self_interaction) -> Tensor");
  m.def("dot_interaction_backward_native(Tensor grad_out, Tensor x, bool self_interaction) -> Tensor");
  m.def("cross_layer_native(Tensor x0, Tensor xl, Tensor u, Tensor v, Tensor bias) -> (Tensor, Tensor, Tensor)");
  m.def("cross_layer_backward_native(Tensor grad_out, Tensor x0, Tensor xl, Tensor u, Tensor v, Tensor z, "
        "Tensor p) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // fm_compress also returns `products`: fp32 [B, k*D + F*k] ((X^T Y)^T and S per sample) when
  // save_products and the backend keeps them for its backward (CPU), else [0, k*D + F*k]: the
  // backward then recomputes them.
  m.def("fm_compress_native(Tensor x, Tensor y, Tensor ln_weight, Tensor ln_bias, float eps, bool save_products) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fm_compress_backward_native(Tensor grad_out, Tensor x, Tensor y, Tensor ln_weight, Tensor mean, "
        "Tensor rstd, Tensor products) -> (Tensor, Tensor, Tensor, Tensor)");
  // The same backward with grad_x added into the given tensor (x's shape, contiguous) -> (grad_y,
  // grad_ln_weight, grad_ln_bias): Wukong's x gradient from feature_mix_norm and fm_compress in one
  // write (CPU; gem_kernels/ops/interaction.py keeps the add elsewhere).
  m.def("fm_compress_backward_accumulate_native(Tensor grad_out, Tensor x, Tensor y, Tensor ln_weight, "
        "Tensor mean, Tensor rstd, Tensor products, Tensor(a!) grad_x) -> (Tensor, Tensor, Tensor)");
  // feature_mix_norm: x [B, F, D], mix [O, F], fm [B, O_fm, D] (O_fm <= O), ln_weight/ln_bias [D]
  // -> (out [B, O, D], mean [B, O] fp32, rstd [B, O] fp32); backward -> (grad_x, grad_mix, grad_fm,
  // grad_ln_weight, grad_ln_bias)
  m.def("feature_mix_norm_native(Tensor x, Tensor mix, Tensor fm, Tensor ln_weight, Tensor ln_bias, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("feature_mix_norm_backward_native(Tensor grad_out, Tensor x, Tensor mix, Tensor fm, Tensor ln_weight, "
        "Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // zch: raw int64 ids [N] in per-table segments (id_offsets [T+1]) -> slots [N] int64, mutating the
  // identity tables and eviction state (layout in gem_kernels/reference/zch.py); a slot given to a
  // new id gets fresh weights and zero optimizer state (weights empty: no reset).
  m.def("zch_remap_native(Tensor ids, Tensor id_offsets, Tensor(a!) slot_meta, Tensor(b!) heap, Tensor(c!) index, "
        "Tensor(d!) pending, Tensor(e!) table_state, Tensor layout, int policy, int ttl, int now, "
        "int admit_threshold, int max_probe, bool train, bool default_row, Tensor(f!) weights, "
        "Tensor weights_offsets, Tensor D_offsets, Tensor rows_offsets, Tensor(g!) momentum1, Tensor(h!) momentum2, "
        "Tensor init_bounds, int seed) -> Tensor");
  // The fused remap + pooling forward (sum/mean): ids [N] raw, offsets [T*B+1] (table t's bags at
  // t*B .. (t+1)*B) -> (out [B, output_dim], slots [N]); the remap's state as zch_remap_native's.
  m.def("zch_embedding_bag_forward_native(Tensor ids, Tensor offsets, Tensor per_sample_weights, "
        "Tensor(a!) slot_meta, Tensor(b!) heap, Tensor(c!) index, Tensor(d!) pending, Tensor(e!) table_state, "
        "Tensor layout, int policy, int ttl, int now, int admit_threshold, int max_probe, bool train, "
        "bool default_row, Tensor(f!) weights, Tensor weights_offsets, Tensor D_offsets, Tensor rows_offsets, "
        "Tensor(g!) momentum1, Tensor(h!) momentum2, Tensor init_bounds, int seed, int output_dim, int pooling) "
        "-> (Tensor, Tensor)");
}

// hstu_layer: the two projection halves around the HSTU attention (generative-recommenders' STULayer).
// uvqk: x [N, D] -> (u_pre [N, H*Lh], v [N, H, Lh], q [N, H, A], k [N, H, A], fp32 stats [N, 2]);
// output: attn, u_pre [N, H*Lh], x [N, D] -> (out [N, D], fp32 norm stats [N, 2*G]); backward
// -> (dattn, du_pre, dnorm_weight, dnorm_bias, doutput_weight, doutput_bias or [0]); x's gradient
// through the output half is grad_out itself (the residual), added by the autograd formula, or, given
// as uvqk's backward's grad_residual [N, D] (x's dtype), added into its dx (written once).
TORCH_LIBRARY_FRAGMENT(gem_kernels, m) {
  m.def("hstu_uvqk_fwd_native(Tensor x, Tensor norm_weight, Tensor norm_bias, float eps, Tensor uvqk_weight, "
        "Tensor uvqk_bias, int num_heads, int linear_dim, int attention_dim, bool silu_qkv) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hstu_uvqk_bwd_native(Tensor grad_u, Tensor grad_v, Tensor grad_q, Tensor grad_k, Tensor x, "
        "Tensor norm_weight, Tensor norm_bias, float eps, Tensor uvqk_weight, Tensor uvqk_bias, Tensor stats, "
        "int num_heads, int linear_dim, int attention_dim, bool silu_qkv, Tensor? grad_residual=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hstu_output_fwd_native(Tensor attn, Tensor u_pre, Tensor x, Tensor norm_weight, Tensor norm_bias, "
        "float eps, Tensor output_weight, Tensor? output_bias, Tensor? dropout_mask, int num_heads, bool group_norm, "
        "bool concat_u, bool concat_x) -> (Tensor, Tensor)");
  m.def("hstu_output_bwd_native(Tensor grad_out, Tensor attn, Tensor u_pre, Tensor norm_weight, Tensor norm_bias, "
        "float eps, Tensor output_weight, bool has_output_bias, Tensor? dropout_mask, Tensor stats, int num_heads, "
        "bool group_norm, bool concat_u, bool concat_x) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

namespace gem_kernels {
// cpu/attention.cpp: whether its softmax rows run on AVX2, and its exp (8 lanes at a time when
// `vectorized` and AVX2, else the scalar one), for the tests of its accuracy.
bool attention_avx2();
at::Tensor attention_fast_exp(const at::Tensor& x, bool vectorized);
// ... and whether its exp and SiLU rows take 16 AVX-512 lanes (a runtime check), and that exp.
bool attention_avx512();
at::Tensor attention_fast_exp16(const at::Tensor& x);
// cpu/cpu_stream.cpp: whether large outputs take streaming stores (measured once), and the override
// the tests use to run both paths; returns the previous mode (-1 = not decided yet).
bool streaming_stores_pay_off();
int64_t set_streaming_stores(int64_t mode);
// cpu/cpu_alloc.cpp: the cache of large CPU outputs (its limit of idle bytes, for tests and the bench).
int64_t set_output_cache_limit(int64_t bytes);
int64_t output_cache_idle_bytes();
// cpu/gather_peak.cpp: the bench's gather roof (bench/peaks.py): rows ids[t] of tables[t] read in
// order with a software prefetch distance; returns the XOR of their 8-byte words.
int64_t gather_rows_read(const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& ids,
                         int64_t prefetch_distance);
}  // namespace gem_kernels

namespace {

bool with_cuda() {
#ifdef GEM_KERNELS_WITH_CUDA
  return true;
#else
  return false;
#endif
}


// The data summary gem_kernels/ops/attention.py _check_values reads for CPU offsets: [offsets[0], the
// number of decreasing steps, offsets[-1], the longest and the shortest length (0 with no sequence),
// the number of sequences whose num_targets is outside [0, length]], in one serial pass. Its ATen
// form is ~10 small ops (~40 us a call at the GEM model's 256 sequences, measured); this is ~1 us.
// The caller checks dtypes, dims and sizes (1-D int32/int64, num_targets with one entry per sequence).
std::vector<int64_t> jagged_offsets_summary(const at::Tensor& offsets, const std::optional<at::Tensor>& num_targets) {
  TORCH_CHECK_VALUE(offsets.device().is_cpu() && offsets.dim() == 1 && offsets.numel() >= 1,
                    "jagged_offsets_summary: offsets must be a non-empty 1-D CPU tensor");
  const int64_t n = offsets.numel();
  const bool has_targets = num_targets.has_value() && num_targets->numel() > 0;
  if (has_targets) {
    TORCH_CHECK_VALUE(num_targets->device().is_cpu() && num_targets->dim() == 1 && num_targets->numel() == n - 1,
                      "jagged_offsets_summary: num_targets must be a 1-D CPU tensor of ", n - 1, " entries");
  }
  const at::Tensor o = offsets.to(at::kLong).contiguous();
  const at::Tensor t = has_targets ? num_targets->to(at::kLong).contiguous() : at::Tensor();
  const int64_t* op = o.data_ptr<int64_t>();
  const int64_t* tp = has_targets ? t.data_ptr<int64_t>() : nullptr;
  int64_t decreasing = 0, longest = 0, shortest = 0, bad = 0;
  for (int64_t i = 0; i + 1 < n; ++i) {
    const int64_t len = op[i + 1] - op[i];
    decreasing += len < 0;
    longest = i == 0 ? len : std::max(longest, len);
    shortest = i == 0 ? len : std::min(shortest, len);
    if (tp != nullptr) bad += tp[i] < 0 || tp[i] > len;
  }
  return {op[0], decreasing, op[n - 1], longest, shortest, bad};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gem_kernels native kernels (ops are registered under torch.ops.gem_kernels)";
  m.def("with_cuda", &with_cuda, "whether the CUDA kernels were compiled into this build");
  m.def("jagged_offsets_summary", &jagged_offsets_summary,
        "[offsets[0], decreasing steps, offsets[-1], longest, shortest, bad num_targets] of CPU offsets "
        "(gem_kernels/ops/attention.py _check_values)", pybind11::arg("offsets"), pybind11::arg("num_targets"));
  m.def("attention_avx2", &gem_kernels::attention_avx2, "whether the CPU attention rows run on AVX2");
  m.def("attention_fast_exp", &gem_kernels::attention_fast_exp, "the CPU attention kernel's exp (for tests)",
        pybind11::arg("x"), pybind11::arg("vectorized"));
  m.def("attention_avx512", &gem_kernels::attention_avx512,
        "whether the CPU attention's exp and SiLU rows take 16 AVX-512 lanes on this CPU");
  m.def("attention_fast_exp16", &gem_kernels::attention_fast_exp16,
        "the CPU attention kernel's 16-lane exp (for tests; needs attention_avx512())", pybind11::arg("x"));
  m.def("streaming_stores", &gem_kernels::streaming_stores_pay_off,
        "whether CPU kernels write outputs over 32 MiB with streaming stores (measured on first use, "
        "or GEM_KERNELS_STREAMING_STORES=0/1)");
  m.def("set_streaming_stores", &gem_kernels::set_streaming_stores,
        "force the CPU store kind: 0 normal, 1 streaming, -1 measure again; returns the previous mode",
        pybind11::arg("mode"));
  m.def("set_output_cache_limit", &gem_kernels::set_output_cache_limit,
        "set the idle-bytes limit of the CPU output cache (0: off; releases blocks beyond it); returns the previous one",
        pybind11::arg("bytes"));
  m.def("output_cache_idle_bytes", &gem_kernels::output_cache_idle_bytes,
        "bytes of freed large CPU outputs the output cache holds for reuse");
  m.def("gather_rows_read", &gem_kernels::gather_rows_read,
        "bench helper: read rows ids[t] of tables[t] in order, prefetching the row prefetch_distance ids ahead "
        "(0: none); returns the XOR of the rows' 8-byte words (a last partial word zero-extended)",
        pybind11::arg("tables"), pybind11::arg("ids"), pybind11::arg("prefetch_distance"));
}
