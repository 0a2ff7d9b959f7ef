// Argument checks shared by the CPU and CUDA interaction launchers (cpu/interaction.cpp,
// cuda/interaction.cu): one device, one dtype, contiguity and the shapes against each other. The
// launcher checks the first tensor's device type (GK_CHECK_CPU / GK_CHECK_CUDA) and then calls one
// of these. The Python front door (gem_kernels/ops/interaction.py) has already checked every
// argument with a precise message; these keep a direct torch.ops call from reading out of bounds.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <utility>

#include "gem_kernels/checks.h"

namespace gem_kernels::interaction_checks {

using Named = std::pair<const at::Tensor*, const char*>;

// Every tensor on `like`'s device, contiguous, with `like`'s dtype.
inline void floats_like(std::initializer_list<Named> tensors, const at::Tensor& like) {
  for (auto [t, name] : tensors) {
    TORCH_CHECK(t->device() == like.device(), name, " must be on ", like.device(), ", got ", t->device());
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(t->scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type());
  }
}

// LayerNorm statistics saved by a forward: contiguous fp32 of `shape`, on `like`'s device.
inline void fp32_stats(const at::Tensor& mean, const at::Tensor& rstd, at::IntArrayRef shape, const at::Tensor& like,
                       const char* shape_name) {
  for (auto [t, name] : {Named{&mean, "mean"}, Named{&rstd, "rstd"}})
    TORCH_CHECK(t->device() == like.device() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->sizes() == shape,
                name, " must be contiguous fp32 ", shape_name, " on ", like.device());
}

inline int64_t num_pairs(int64_t F, bool self_interaction) {
  return self_interaction ? F * (F + 1) / 2 : F * (F - 1) / 2;
}

inline void dot_interaction(const at::Tensor& x) {
  floats_like({{&x, "x"}}, x);
  GK_CHECK_DIM(x, 3);
}

inline void dot_interaction_backward(const at::Tensor& grad_out, const at::Tensor& x, bool self_interaction) {
  floats_like({{&x, "x"}, {&grad_out, "grad_out"}}, x);
  GK_CHECK_DIM(x, 3);
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == x.size(0) &&
                  grad_out.size(1) == num_pairs(x.size(1), self_interaction),
              "grad_out must be [B, P]");
}

// x0, xl [B, N]; u [N, N] (full rank, v an empty 1-D tensor) or [N, r] with v [r, N]; bias [N].
// Low rank is told by v's shape, not its size: a low-rank v [r, N] is itself empty when N = 0.
// Returns whether the layer is low rank.
inline bool cross_layer(const at::Tensor& x0, const at::Tensor& xl, const at::Tensor& u, const at::Tensor& v,
                        const at::Tensor& bias) {
  floats_like({{&x0, "x0"}, {&xl, "xl"}, {&u, "u"}, {&v, "v"}, {&bias, "bias"}}, x0);
  GK_CHECK_DIM(x0, 2);
  TORCH_CHECK(xl.sizes() == x0.sizes(), "xl must have x0's shape");
  const int64_t N = x0.size(1);
  const bool low_rank = v.dim() == 2;
  TORCH_CHECK(low_rank || v.numel() == 0, "v must be [r, N] (low rank) or an empty 1-D tensor (full rank)");
  TORCH_CHECK(u.dim() == 2 && u.size(0) == N && (low_rank || u.size(1) == N), "u must be [N, N] or [N, r]");
  TORCH_CHECK(!low_rank || (v.size(0) == u.size(1) && v.size(1) == N), "v must be [r, N]");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "bias must be [N]");
  return low_rank;
}

inline bool cross_layer_backward(const at::Tensor& grad_out, const at::Tensor& x0, const at::Tensor& xl,
                                 const at::Tensor& u, const at::Tensor& v, const at::Tensor& z, const at::Tensor& p) {
  floats_like({{&grad_out, "grad_out"}, {&x0, "x0"}, {&xl, "xl"}, {&u, "u"}, {&v, "v"}, {&z, "z"}, {&p, "p"}}, x0);
  GK_CHECK_DIM(x0, 2);
  TORCH_CHECK(grad_out.sizes() == x0.sizes() && xl.sizes() == x0.sizes() && z.sizes() == x0.sizes(),
              "grad_out, xl and z must have x0's shape");
  const int64_t B = x0.size(0), N = x0.size(1);
  const bool low_rank = v.dim() == 2;  // as in the forward
  TORCH_CHECK(u.dim() == 2 && u.size(0) == N && (low_rank ? v.size(0) == u.size(1) && v.size(1) == N
                                                          : v.numel() == 0 && u.size(1) == N),
              "u and v must be ([N, N], empty) or ([N, r], [r, N])");
  TORCH_CHECK(!low_rank || (p.dim() == 2 && p.size(0) == B && p.size(1) == u.size(1)), "p must be [B, r]");
  return low_rank;
}

// x [B, F, D], y [F, k], ln_weight and ln_bias [F*k].
inline void fm_compress(const at::Tensor& x, const at::Tensor& y, const at::Tensor& ln_weight,
                        const at::Tensor& ln_bias) {
  floats_like({{&x, "x"}, {&y, "y"}, {&ln_weight, "ln_weight"}, {&ln_bias, "ln_bias"}}, x);
  GK_CHECK_DIM(x, 3);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(1), "y must be [F, k]");
  const int64_t n = x.size(1) * y.size(1);
  TORCH_CHECK(ln_weight.numel() == n && ln_bias.numel() == n, "ln_weight and ln_bias must be [F*k]");
}

inline void fm_compress_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& y,
                                 const at::Tensor& ln_weight, const at::Tensor& mean, const at::Tensor& rstd) {
  floats_like({{&grad_out, "grad_out"}, {&x, "x"}, {&y, "y"}, {&ln_weight, "ln_weight"}}, x);
  GK_CHECK_DIM(x, 3);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(1), "y must be [F, k]");
  const int64_t n = x.size(1) * y.size(1);
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == x.size(0) && grad_out.size(1) == n && ln_weight.numel() == n,
              "grad_out must be [B, F*k] and ln_weight [F*k]");
  fp32_stats(mean, rstd, {x.size(0)}, x, "[B]");
}

// x [B, F, D], mix [O, F] with O >= 1, fm [B, O_fm, D] with O_fm <= O, ln_weight (and ln_bias) [D].
inline void feature_mix(const at::Tensor& x, const at::Tensor& mix, const at::Tensor& fm, const at::Tensor& ln_weight) {
  GK_CHECK_DIM(x, 3);
  TORCH_CHECK(mix.dim() == 2 && mix.size(1) == x.size(1) && mix.size(0) >= 1, "mix must be [O, F] with O >= 1");
  TORCH_CHECK(fm.dim() == 3 && fm.size(0) == x.size(0) && fm.size(1) <= mix.size(0) && fm.size(2) == x.size(2),
              "fm must be [B, O_fm, D] with O_fm <= O");
  TORCH_CHECK(ln_weight.dim() == 1 && ln_weight.size(0) == x.size(2), "ln_weight must be [D]");
}

inline void feature_mix_norm(const at::Tensor& x, const at::Tensor& mix, const at::Tensor& fm,
                             const at::Tensor& ln_weight, const at::Tensor& ln_bias) {
  floats_like({{&x, "x"}, {&mix, "mix"}, {&fm, "fm"}, {&ln_weight, "ln_weight"}, {&ln_bias, "ln_bias"}}, x);
  feature_mix(x, mix, fm, ln_weight);
  TORCH_CHECK(ln_bias.sizes() == ln_weight.sizes(), "ln_bias must be [D]");
}

inline void feature_mix_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mix,
                                      const at::Tensor& fm, const at::Tensor& ln_weight, const at::Tensor& mean,
                                      const at::Tensor& rstd) {
  floats_like({{&grad_out, "grad_out"}, {&x, "x"}, {&mix, "mix"}, {&fm, "fm"}, {&ln_weight, "ln_weight"}}, x);
  feature_mix(x, mix, fm, ln_weight);
  const int64_t B = x.size(0), O = mix.size(0);
  TORCH_CHECK(grad_out.dim() == 3 && grad_out.size(0) == B && grad_out.size(1) == O && grad_out.size(2) == x.size(2),
              "grad_out must be [B, O, D]");
  fp32_stats(mean, rstd, {B, O}, x, "[B, O]");
}

}  // namespace gem_kernels::interaction_checks
