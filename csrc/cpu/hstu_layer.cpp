// CPU kernels of the HSTU layer's two projection halves (generative-recommenders' STULayer; the
// attention between them is cpu/attention.cpp). Maths in gem_kernels/reference/hstu_layer.py.
//
// Work decomposition: rows (tokens) in blocks of kBlockRows, handed out dynamically
// (parallel_ranges); one worker owns a block: it writes that block's prologue into its own scratch
// and runs the block's GEMM single-threaded (MKL inside an OpenMP region runs on one thread), so
// a normalised or concatenated row goes from the prologue into the GEMM while still in cache and
// no [N, K] intermediate exists in the forward.
//
//   uvqk forward: xn = LayerNorm(x) (prologue, per row) -> u_pre, v, q, k = xn @ W + b, written straight
//     into the four output tensors (one GEMM per slice: no split copy), SiLU on v, q, k in place when
//     silu_qkv (the HSTU paper's form; STULayer applies SiLU to u only, and u's SiLU is applied by the
//     output half's prologue, so the forward keeps no activation for its backward).
//     FLOPs 2*N*D*O; minimum bytes 4*(N*D + D*O + N*O).
//   output forward: c = [silu(u), a, silu(u) * Norm(a)] (prologue) -> out = x + c @ W (+ bias).
//     FLOPs 2*N*K*D; minimum bytes 4*(2*N*H*Lh + 2*N*D + K*D).
//   backward: what the backward recomputes instead of storing, per token (fp32):
//     - the normalised input xn (4*D bytes) from x and its two fp32 stats (8 bytes);
//     - the concat c (4*K bytes, K = 3*H*Lh for STULayer) and Norm(a) from attn, u_pre and the
//       attention norm's stats (8*G bytes, G = 1, or H with group_norm);
//     - silu(u) from u_pre; with silu_qkv, the pre-activations of v, q, k (one GEMM of N*D*(O-H*Lh)):
//       not stored (4*(O - H*Lh) bytes).
//     Weight gradients are full GEMMs over the recomputed [N, D] / [N, K] operands; norm-weight
//     gradients are per-block partial sums reduced in block order (bit-identical run to run and
//     across thread counts).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "gem_kernels/checks.h"
#include "gem_kernels/parallel.h"

namespace gem_kernels {
namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

// Rows per block: a block's prologue scratch (64 x K fp32, 48 KiB at K = 192) stays in L2, and a
// [64, D] x [D, O] GEMM is large enough for MKL's kernels to run at speed.
constexpr int64_t kBlockRows = 64;

// detach(): the GEMMs run on at::parallel_for's worker threads, which do not inherit the caller's
// below-autograd dispatch state; an operand that requires grad then made at::addmm_out raise
// ("functions with out=... arguments don't support automatic differentiation").
Tensor as_float(const Tensor& t) { return t.detach().to(at::kFloat).contiguous(); }

int64_t workers_for(int64_t work) { return work < kMinParallelWork ? 1 : at::get_num_threads(); }

// (mean, 1 / sqrt(var + eps)) of n floats, biased variance in two passes (like torch's norms).
inline std::pair<float, float> moments(const float* x, int64_t n, float eps) {
  auto add = [](Vec a, Vec b) { return a + b; };
  const float mean = at::vec::reduce_all<float>(add, x, n) / static_cast<float>(n);
  const float var = at::vec::map_reduce_all<float>(
                        [mean](Vec a) {
                          Vec d = a - Vec(mean);
                          return d * d;
                        },
                        add, x, n) /
                    static_cast<float>(n);
  return {mean, 1.0f / std::sqrt(var + eps)};
}

inline Vec silu_vec(Vec z) { return z / (Vec(1.0f) + z.neg().exp()); }

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// d silu(z) / dz = s * (1 + z * (1 - s)), s = sigmoid(z)
inline float silu_grad(float z) {
  const float s = sigmoid(z);
  return s * (1.0f + z * (1.0f - s));
}

void silu_inplace(float* z, int64_t n) {
  at::vec::map([](Vec a) { return silu_vec(a); }, z, z, n);
}

// Norm(a) over G groups of gs: (a - mean_g) * rstd_g * w + b, with w, b per element (G == 1, the
// LayerNorm over H*Lh) or per group (G == H, the GroupNorm).
struct NormSpec {
  int64_t groups, group_size;
  const float* weight;
  const float* bias;
  bool per_group;
  float weight_at(int64_t g, int64_t j) const { return per_group ? weight[g] : weight[g * group_size + j]; }
  float bias_at(int64_t g, int64_t j) const { return per_group ? bias[g] : bias[g * group_size + j]; }
};

// The output half's prologue for one row: writes c = [silu(u)], [a], silu(u) * Norm(a) (times the
// dropout mask row when given) into c_row, and Norm's stats into stats_row when not null (forward),
// or reads them from stats_row (backward: the forward's stats, not recomputed ones).
void output_prologue_row(const float* a, const float* u_pre, const NormSpec& ns, float eps, bool concat_u,
                         bool concat_x, const float* mask, float* stats_row, bool compute_stats, float* c_row) {
  const int64_t width = ns.groups * ns.group_size;
  float* cu = c_row;
  float* y = c_row + width * ((concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  // silu(u) goes to c's first part, or straight to y's slot, which is then scaled in place.
  float* s = concat_u ? cu : y;
  at::vec::map([](Vec z) { return silu_vec(z); }, s, u_pre, width);
  if (concat_x) std::copy(a, a + width, c_row + (concat_u ? width : 0));
  for (int64_t g = 0; g < ns.groups; ++g) {
    const float* ag = a + g * ns.group_size;
    float mean, rstd;
    if (compute_stats) {
      std::tie(mean, rstd) = moments(ag, ns.group_size, eps);
      stats_row[g] = mean;
      stats_row[ns.groups + g] = rstd;
    } else {
      mean = stats_row[g];
      rstd = stats_row[ns.groups + g];
    }
    for (int64_t j = 0; j < ns.group_size; ++j) {
      const int64_t e = g * ns.group_size + j;
      y[e] = s[e] * ((ag[j] - mean) * rstd * ns.weight_at(g, j) + ns.bias_at(g, j));
    }
  }
  if (mask != nullptr) {
    const int64_t k = width + (y - c_row);
    at::vec::map2([](Vec c, Vec m) { return c * m; }, c_row, c_row, mask, k);
  }
}

void check_cpu_2d(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, name, " must have 2 dims, got ", t.dim());
}

// ---------------------------------------------------------------------------------------------
// uvqk half
// ---------------------------------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> hstu_uvqk_fwd_cpu(const Tensor& x_in, const Tensor& norm_weight,
                                                                     const Tensor& norm_bias, double eps,
                                                                     const Tensor& uvqk_weight,
                                                                     const Tensor& uvqk_bias, int64_t num_heads,
                                                                     int64_t linear_dim, int64_t attention_dim,
                                                                     bool silu_qkv) {
  check_cpu_2d(x_in, "x");
  check_cpu_2d(uvqk_weight, "uvqk_weight");
  const int64_t n = x_in.size(0), d = x_in.size(1);
  const int64_t hl = num_heads * linear_dim, ha = num_heads * attention_dim, o = 2 * hl + 2 * ha;
  TORCH_CHECK(uvqk_weight.size(0) == d && uvqk_weight.size(1) == o, "uvqk_weight must be [", d, ", ", o, "], got ",
              uvqk_weight.sizes());
  TORCH_CHECK(uvqk_bias.numel() == o && norm_weight.numel() == d && norm_bias.numel() == d,
              "uvqk_bias / norm_weight / norm_bias sizes do not match the layer");
  const Tensor x = as_float(x_in), nw = as_float(norm_weight), nb = as_float(norm_bias);
  const Tensor w = as_float(uvqk_weight), b = as_float(uvqk_bias);
  const auto opts = x.options();
  Tensor outs[4] = {at::empty({n, hl}, opts), at::empty({n, hl}, opts), at::empty({n, ha}, opts),
                    at::empty({n, ha}, opts)};
  const int64_t starts[4] = {0, hl, 2 * hl, 2 * hl + ha}, widths[4] = {hl, hl, ha, ha};
  Tensor stats = at::empty({n, 2}, opts);
  const float* xp = x.data_ptr<float>();
  const float* nwp = nw.data_ptr<float>();
  const float* nbp = nb.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  parallel_ranges(blocks, 1, workers_for(n * d * o), [&](auto& claim) {
    Tensor xn = at::empty({kBlockRows, d}, opts);
    float* xnp = xn.data_ptr<float>();
    for (int64_t b0, b1; claim(b0, b1);) {
      const int64_t r0 = b0 * kBlockRows, rows = std::min(kBlockRows, n - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + (r0 + r) * d;
        auto [mean, rstd] = moments(xr, d, static_cast<float>(eps));
        sp[2 * (r0 + r)] = mean;
        sp[2 * (r0 + r) + 1] = rstd;
        float* out = xnp + r * d;
        for (int64_t j = 0; j < d; ++j) out[j] = (xr[j] - mean) * rstd * nwp[j] + nbp[j];
      }
      const Tensor xb = xn.narrow(0, 0, rows);
      for (int s = 0; s < 4; ++s) {
        Tensor dst = outs[s].narrow(0, r0, rows);
        at::addmm_out(dst, b.narrow(0, starts[s], widths[s]), xb, w.narrow(1, starts[s], widths[s]));
        if (silu_qkv && s > 0) silu_inplace(dst.data_ptr<float>(), rows * widths[s]);
      }
    }
  });
  const auto dtype = x_in.scalar_type();
  return {outs[0].to(dtype), outs[1].view({n, num_heads, linear_dim}).to(dtype),
          outs[2].view({n, num_heads, attention_dim}).to(dtype),
          outs[3].view({n, num_heads, attention_dim}).to(dtype), stats};
}

// Per-block fp64 partial sums [blocks, 2 * width] reduced in block order -> two separate fp32 [width]
// tensors (an op's outputs may not share storage).
std::pair<Tensor, Tensor> reduce_partials(const Tensor& partials, int64_t width) {
  const Tensor sums = partials.sum(0).to(at::kFloat);
  return {sums.narrow(0, 0, width).clone(), sums.narrow(0, width, width).clone()};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> hstu_uvqk_bwd_cpu(
    const Tensor& grad_u, const Tensor& grad_v, const Tensor& grad_q, const Tensor& grad_k, const Tensor& x_in,
    const Tensor& norm_weight, const Tensor& norm_bias, double eps, const Tensor& uvqk_weight,
    const Tensor& uvqk_bias, const Tensor& stats_in, int64_t num_heads, int64_t linear_dim, int64_t attention_dim,
    bool silu_qkv) {
  check_cpu_2d(x_in, "x");
  const int64_t n = x_in.size(0), d = x_in.size(1);
  const int64_t hl = num_heads * linear_dim, ha = num_heads * attention_dim, o = 2 * hl + 2 * ha;
  const Tensor x = as_float(x_in), nw = as_float(norm_weight), nb = as_float(norm_bias);
  const Tensor w = as_float(uvqk_weight), b = as_float(uvqk_bias), stats = as_float(stats_in);
  const Tensor grads[4] = {as_float(grad_u).view({n, hl}), as_float(grad_v).view({n, hl}),
                           as_float(grad_q).view({n, ha}), as_float(grad_k).view({n, ha})};
  const int64_t starts[4] = {0, hl, 2 * hl, 2 * hl + ha}, widths[4] = {hl, hl, ha, ha};
  const auto opts = x.options();
  Tensor xn = at::empty({n, d}, opts), dz = at::empty({n, o}, opts);
  const float* xp = x.data_ptr<float>();
  const float* nwp = nw.data_ptr<float>();
  const float* nbp = nb.data_ptr<float>();
  const float* sp = stats.data_ptr<float>();
  float* xnp = xn.data_ptr<float>();
  float* dzp = dz.data_ptr<float>();
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  // Pass 1: xn recomputed from the saved stats; dz = the four gradients side by side, times
  // silu'(z) for v, q, k when silu_qkv (z recomputed by the block's GEMM).
  parallel_ranges(blocks, 1, workers_for(n * (d + o) * (silu_qkv ? d : 1)), [&](auto& claim) {
    Tensor z = silu_qkv ? at::empty({kBlockRows, o - hl}, opts) : Tensor();
    for (int64_t b0, b1; claim(b0, b1);) {
      const int64_t r0 = b0 * kBlockRows, rows = std::min(kBlockRows, n - r0);
      for (int64_t r = r0; r < r0 + rows; ++r) {
        const float mean = sp[2 * r], rstd = sp[2 * r + 1];
        for (int64_t j = 0; j < d; ++j) xnp[r * d + j] = (xp[r * d + j] - mean) * rstd * nwp[j] + nbp[j];
        for (int s = 0; s < 4; ++s) {
          const float* g = grads[s].data_ptr<float>() + r * widths[s];
          std::copy(g, g + widths[s], dzp + r * o + starts[s]);
        }
      }
      if (silu_qkv) {
        Tensor zb = z.narrow(0, 0, rows);
        at::addmm_out(zb, b.narrow(0, hl, o - hl), xn.narrow(0, r0, rows), w.narrow(1, hl, o - hl));
        const float* zp = zb.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < o - hl; ++j) dzp[(r0 + r) * o + hl + j] *= silu_grad(zp[r * (o - hl) + j]);
      }
    }
  });
  Tensor dw = at::mm(xn.t(), dz);
  Tensor db = dz.sum(0);
  Tensor dxn = at::mm(dz, w.t());
  // Pass 2: LayerNorm backward per row; weight / bias gradients as per-block partials.
  Tensor dx = at::empty({n, d}, opts);
  // fp64 partials: a norm weight's gradient sums N terms; in fp32, summed row after row, it came out
  // several ulps off where torch's pairwise sum is within one (FlashAttention's rule failed).
  Tensor partials = at::zeros({std::max<int64_t>(blocks, 1), 2 * d}, opts.dtype(at::kDouble));
  const float* dxnp = dxn.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  double* pp = partials.data_ptr<double>();
  parallel_ranges(blocks, 1, workers_for(n * d * 4), [&](auto& claim) {
    for (int64_t b0, b1; claim(b0, b1);) {
      const int64_t r0 = b0 * kBlockRows, rows = std::min(kBlockRows, n - r0);
      double* dnw = pp + b0 * 2 * d;
      double* dnb = dnw + d;
      for (int64_t r = r0; r < r0 + rows; ++r) {
        const float mean = sp[2 * r], rstd = sp[2 * r + 1];
        const float* g = dxnp + r * d;
        const float* xr = xp + r * d;
        // The row's norm backward in fp64: dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat)) cancels,
        // and rstd amplifies what is left; in fp32 its error was up to 3x eager's (FlashAttention's rule).
        double m1 = 0.0, m2 = 0.0;
        for (int64_t j = 0; j < d; ++j) {
          const double xhat = (static_cast<double>(xr[j]) - mean) * rstd;
          const double gh = static_cast<double>(g[j]) * nwp[j];
          m1 += gh;
          m2 += gh * xhat;
          dnw[j] += g[j] * xhat;
          dnb[j] += g[j];
        }
        m1 /= static_cast<double>(d);
        m2 /= static_cast<double>(d);
        for (int64_t j = 0; j < d; ++j) {
          const double xhat = (static_cast<double>(xr[j]) - mean) * rstd;
          dxp[r * d + j] = static_cast<float>(rstd * (static_cast<double>(g[j]) * nwp[j] - m1 - xhat * m2));
        }
      }
    }
  });
  auto [dnw, dnb] = reduce_partials(partials, d);
  return {dx.to(x_in.scalar_type()), dnw.to(norm_weight.scalar_type()), dnb.to(norm_bias.scalar_type()), dw.to(uvqk_weight.scalar_type()),
          db.to(uvqk_bias.scalar_type())};
}

// ---------------------------------------------------------------------------------------------
// output half
// ---------------------------------------------------------------------------------------------

struct OutputShape {
  int64_t n, width, groups, k;
};

OutputShape output_shape(const Tensor& attn, const Tensor& output_weight, int64_t num_heads, bool group_norm,
                         bool concat_u, bool concat_x) {
  check_cpu_2d(attn, "attn");
  check_cpu_2d(output_weight, "output_weight");
  const int64_t width = attn.size(1);
  const int64_t k = width * (1 + (concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  TORCH_CHECK(output_weight.size(0) == k, "output_weight must have ", k, " rows, got ", output_weight.sizes());
  TORCH_CHECK(num_heads >= 1 && width % num_heads == 0, "attn width ", width, " is not a multiple of num_heads ",
              num_heads);
  return {attn.size(0), width, group_norm ? num_heads : 1, k};
}

std::tuple<Tensor, Tensor> hstu_output_fwd_cpu(const Tensor& attn_in, const Tensor& u_in, const Tensor& x_in,
                                               const Tensor& norm_weight, const Tensor& norm_bias, double eps,
                                               const Tensor& output_weight,
                                               const std::optional<Tensor>& output_bias,
                                               const std::optional<Tensor>& dropout_mask, int64_t num_heads,
                                               bool group_norm, bool concat_u, bool concat_x) {
  const auto shape = output_shape(attn_in, output_weight, num_heads, group_norm, concat_u, concat_x);
  const int64_t n = shape.n, width = shape.width, k = shape.k, dim = x_in.size(1);
  TORCH_CHECK(output_weight.size(1) == dim, "output_weight must have ", dim, " columns, got ", output_weight.sizes());
  const Tensor a = as_float(attn_in), u = as_float(u_in), x = as_float(x_in);
  const Tensor nw = as_float(norm_weight), nb = as_float(norm_bias), w = as_float(output_weight);
  const Tensor ob = output_bias.has_value() ? as_float(*output_bias) : Tensor();
  const Tensor mask = dropout_mask.has_value() ? as_float(*dropout_mask) : Tensor();
  const NormSpec ns{shape.groups, width / shape.groups, nw.data_ptr<float>(), nb.data_ptr<float>(), group_norm};
  const auto opts = a.options();
  Tensor out = at::empty({n, dim}, opts);
  Tensor stats = at::empty({n, 2 * shape.groups}, opts);
  const float* ap = a.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  float* sp = stats.data_ptr<float>();
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  parallel_ranges(blocks, 1, workers_for(n * k * dim), [&](auto& claim) {
    Tensor c = at::empty({kBlockRows, k}, opts);
    float* cp = c.data_ptr<float>();
    for (int64_t b0, b1; claim(b0, b1);) {
      const int64_t r0 = b0 * kBlockRows, rows = std::min(kBlockRows, n - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = r0 + r;
        output_prologue_row(ap + row * width, up + row * width, ns, static_cast<float>(eps), concat_u, concat_x,
                            mp ? mp + row * k : nullptr, sp + row * 2 * shape.groups, true, cp + r * k);
      }
      Tensor dst = out.narrow(0, r0, rows);
      at::addmm_out(dst, x.narrow(0, r0, rows), c.narrow(0, 0, rows), w);
      if (ob.defined()) {
        const float* obp = ob.data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          float* o = dst.data_ptr<float>() + r * dim;
          at::vec::map2([](Vec p, Vec q) { return p + q; }, o, o, obp, dim);
        }
      }
    }
  });
  return {out.to(x_in.scalar_type()), stats};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> hstu_output_bwd_cpu(
    const Tensor& grad_out_in, const Tensor& attn_in, const Tensor& u_in, const Tensor& norm_weight,
    const Tensor& norm_bias, double eps, const Tensor& output_weight, bool has_output_bias,
    const std::optional<Tensor>& dropout_mask, const Tensor& stats_in, int64_t num_heads, bool group_norm,
    bool concat_u, bool concat_x) {
  const auto shape = output_shape(attn_in, output_weight, num_heads, group_norm, concat_u, concat_x);
  const int64_t n = shape.n, width = shape.width, k = shape.k, groups = shape.groups;
  const int64_t gs = width / groups;
  const Tensor g = as_float(grad_out_in), a = as_float(attn_in), u = as_float(u_in);
  const Tensor nw = as_float(norm_weight), nb = as_float(norm_bias), w = as_float(output_weight);
  const Tensor mask = dropout_mask.has_value() ? as_float(*dropout_mask) : Tensor();
  const Tensor stats = as_float(stats_in);
  const NormSpec ns{groups, gs, nw.data_ptr<float>(), nb.data_ptr<float>(), group_norm};
  const auto opts = a.options();
  const float* ap = a.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const float* mp = mask.defined() ? mask.data_ptr<float>() : nullptr;
  float* sp = stats.data_ptr<float>();
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  // c recomputed (the forward's prologue with its saved stats) for the weight gradient.
  Tensor c = at::empty({n, k}, opts);
  float* cp = c.data_ptr<float>();
  parallel_ranges(blocks, 1, workers_for(n * k * 4), [&](auto& claim) {
    for (int64_t b0, b1; claim(b0, b1);) {
      for (int64_t row = b0 * kBlockRows; row < std::min(n, (b0 + 1) * kBlockRows); ++row)
        output_prologue_row(ap + row * width, up + row * width, ns, static_cast<float>(eps), concat_u, concat_x,
                            mp ? mp + row * k : nullptr, sp + row * 2 * groups, false, cp + row * k);
    }
  });
  Tensor dw = at::mm(c.t(), g);
  Tensor dob = has_output_bias ? g.sum(0).to(output_weight.scalar_type()) : at::empty({0}, opts);
  Tensor dc = at::mm(g, w.t());
  Tensor dattn = at::empty({n, width}, opts), du = at::empty({n, width}, opts);
  // Norm-weight partials in fp64 (see the uvqk backward), per element even with group_norm (weight
  // per head): the heads' sums over Lh are taken at the end.
  Tensor partials = at::zeros({std::max<int64_t>(blocks, 1), 2 * width}, opts.dtype(at::kDouble));
  float* dcp = dc.data_ptr<float>();
  float* dap = dattn.data_ptr<float>();
  float* dup = du.data_ptr<float>();
  double* pp = partials.data_ptr<double>();
  const int64_t y_off = width * ((concat_u ? 1 : 0) + (concat_x ? 1 : 0));
  parallel_ranges(blocks, 1, workers_for(n * k * 8), [&](auto& claim) {
    for (int64_t b0, b1; claim(b0, b1);) {
      double* dnw = pp + b0 * 2 * width;
      double* dnb = dnw + width;
      for (int64_t row = b0 * kBlockRows; row < std::min(n, (b0 + 1) * kBlockRows); ++row) {
        float* dcr = dcp + row * k;
        if (mp != nullptr) at::vec::map2([](Vec p, Vec q) { return p * q; }, dcr, dcr, mp + row * k, k);
        const float* ar = ap + row * width;
        const float* ur = up + row * width;
        const float* dy = dcr + y_off;
        float* dar = dap + row * width;
        float* dur = dup + row * width;
        for (int64_t grp = 0; grp < groups; ++grp) {
          const float mean = sp[row * 2 * groups + grp], rstd = sp[row * 2 * groups + groups + grp];
          // In fp64, as the uvqk backward's row norm (the same cancellation).
          double m1 = 0.0, m2 = 0.0;
          for (int64_t j = 0; j < gs; ++j) {
            const int64_t e = grp * gs + j;
            const double xhat = (static_cast<double>(ar[e]) - mean) * rstd;
            const float s = ur[e] * sigmoid(ur[e]);
            const double normed = xhat * ns.weight_at(grp, j) + ns.bias_at(grp, j);
            const double du_total = dy[e] * normed + (concat_u ? dcr[e] : 0.0f);
            dur[e] = static_cast<float>(du_total * silu_grad(ur[e]));
            const double dn = static_cast<double>(dy[e]) * s;
            dnw[e] += dn * xhat;
            dnb[e] += dn;
            const double dxh = dn * ns.weight_at(grp, j);
            m1 += dxh;
            m2 += dxh * xhat;
          }
          m1 /= static_cast<double>(gs);
          m2 /= static_cast<double>(gs);
          for (int64_t j = 0; j < gs; ++j) {
            const int64_t e = grp * gs + j;
            const double xhat = (static_cast<double>(ar[e]) - mean) * rstd;
            const double dxh = static_cast<double>(dy[e]) * (ur[e] * sigmoid(ur[e])) * ns.weight_at(grp, j);
            dar[e] = static_cast<float>(rstd * (dxh - m1 - xhat * m2)) +
                     (concat_x ? dcr[(concat_u ? width : 0) + e] : 0.0f);
          }
        }
      }
    }
  });
  const Tensor per_element = group_norm ? partials.view({partials.size(0), 2 * groups, gs}).sum(2) : partials;
  auto [dnw, dnb] = reduce_partials(per_element, nw.numel());
  return {dattn.to(attn_in.scalar_type()), du.to(u_in.scalar_type()), dnw.to(norm_weight.scalar_type()),
          dnb.to(norm_bias.scalar_type()), dw.to(output_weight.scalar_type()), dob};
}

}  // namespace

TORCH_LIBRARY_IMPL(gem_kernels, CPU, m) {
  m.impl("hstu_uvqk_fwd_native", &hstu_uvqk_fwd_cpu);
  m.impl("hstu_uvqk_bwd_native", &hstu_uvqk_bwd_cpu);
  m.impl("hstu_output_fwd_native", &hstu_output_fwd_cpu);
  m.impl("hstu_output_bwd_native", &hstu_output_bwd_cpu);
}

}  // namespace gem_kernels
