"""Fuzz cases calling the native ops directly: no crash, whatever the arguments."""

from __future__ import annotations

import torch

from tests.fuzz.core import Case, F16, F32, NAN, _offsets, add
from tests.fuzz.oracles import oracle_embedding_bag
from tests.fuzz.embedding_bag import _ebc_tables

# ---------------------------------------------------------------------------------------------
# Direct calls of the native ops: no crash, whatever the arguments
# ---------------------------------------------------------------------------------------------

NATIVE_BACKENDS = ("cpu", "cuda")


def native_cases():
    ops = torch.ops.gem_kernels
    if not hasattr(ops, "jagged_to_padded_native"):
        return

    def native(name, make, call, check=None):
        # The CUDA TBE kernels trust their metadata and offsets (the Python op checks them; a
        # developer note in csrc/cuda/embedding_bag.cu): a direct call with garbage may fault there.
        pending = "CUDA TBE native ops trust their arguments (issue 19)" if name.startswith("embedding_bag") else ""
        add(Case(f"native/{name}", "native", make, call, check=check, backends=NATIVE_BACKENDS,
                 pending_cuda=pending))

    def t(device, *a, **kw):
        return torch.tensor(*a, device=device, **kw)

    # jagged
    def j(off, values_shape=(5, 3), max_len=4, pad=0.0, dtype=F32):
        return (lambda d: dict(values=torch.randn(*values_shape, dtype=dtype, device=d) if dtype.is_floating_point
                               else torch.ones(*values_shape, dtype=dtype, device=d), offsets=t(d, off),
                               max_len=max_len, pad=pad))

    j2p = lambda x, b: ops.jagged_to_padded_native(x["values"], x["offsets"], x["max_len"], x["pad"])  # noqa: E731
    p2j = lambda x, b: ops.padded_to_jagged_native(x["values"].view(1, 5, 3) if x["values"].numel() == 15  # noqa: E731
                                                   else x["values"], x["offsets"], x["max_len"])
    for edge, off in [("ok", [0, 3, 5]), ("decreasing", [0, 4, 2]), ("past_end", [0, 3, 10**9]),
                      ("negative", [0, -7, 5]), ("first", [4, 4, 5]), ("int64_min", [0, -2**63, 5]),
                      ("int64_max", [0, 2**63 - 1, 5]), ("one", [0])]:
        native(f"jagged_to_padded/offsets_{edge}", j(off), j2p)
        native(f"padded_to_jagged/offsets_{edge}", j([0, 5] if edge == "ok" else off[:2], max_len=5), p2j)
    native("jagged_to_padded/max_len_neg", j([0, 3, 5], max_len=-1), j2p)
    native("jagged_to_padded/max_len_huge", j([0, 3, 5], max_len=2**62), j2p)
    native("jagged_to_padded/values_1d", j([0, 3, 5], values_shape=(5,)), j2p)
    native("jagged_to_padded/values_int", j([0, 3, 5], dtype=torch.int64), j2p)
    native("jagged_to_padded/values_noncontig", lambda d: dict(values=torch.randn(3, 5, device=d).t(),
                                                               offsets=t(d, [0, 3, 5]), max_len=4, pad=0.0), j2p)
    native("jagged_to_padded/offsets_float", lambda d: dict(values=torch.randn(5, 3, device=d),
                                                            offsets=t(d, [0.0, 5.0]), max_len=4, pad=0.0), j2p)
    native("jagged_to_padded/pad_f16_overflow", j([0, 3, 5], dtype=F16, pad=1e6), j2p)
    native("padded_to_jagged/total_neg", j([0, 5], max_len=-5), p2j)
    native("padded_to_jagged/total_huge", j([0, 5], max_len=2**62), p2j)
    native("padded_to_jagged/padded_2d", lambda d: dict(values=torch.randn(5, 3, device=d), offsets=t(d, [0, 5]),
                                                        max_len=5, pad=0.0),
           lambda x, b: ops.padded_to_jagged_native(x["values"], x["offsets"], 5))

    # embedding bag: a valid packed pair of tables, then one field broken at a time
    def eb(**change):
        def make(d):
            x = dict(weights=torch.randn(43, device=d), w_off=t(d, [0, 15]), d_off=t(d, [0, 3, 7]),
                     r_off=t(d, [0, 5, 12]), indices=t(d, [0, 4, 4, 1, 6, 0, 2]), offsets=t(d, [0, 3, 4, 4, 7]),
                     psw=torch.empty(0, device=d), output_dim=7, pooling=0, bounds_check=0,
                     grad=torch.randn(2, 7, device=d))
            for k, v in change.items():
                x[k] = v(d) if callable(v) else v
            return x
        return make

    fwd = lambda x, b: ops.embedding_bag_forward_native(  # noqa: E731
        x["weights"], x["w_off"], x["d_off"], x["r_off"], x["indices"], x["offsets"], x["psw"], x["output_dim"],
        x["pooling"], x["bounds_check"])
    bwd = lambda x, b: ops.embedding_bag_backward_native(  # noqa: E731
        x["grad"], x["weights"], x["w_off"], x["d_off"], x["r_off"], x["indices"], x["offsets"], x["psw"], x["pooling"])
    psw_bwd = lambda x, b: ops.embedding_bag_per_sample_weights_backward_native(  # noqa: E731
        x["grad"], x["weights"], x["w_off"], x["d_off"], x["r_off"], x["indices"], x["offsets"], x["pooling"])

    def fused(opt):
        def call(x, b):
            n = x["weights"].numel()
            m1 = torch.zeros({1: 0, 2: 12, 3: n}[opt], device=x["weights"].device)
            m2 = torch.zeros(n if opt == 3 else 0, device=x["weights"].device)
            step = torch.zeros((), dtype=torch.int64, device=x["weights"].device)
            ops.embedding_bag_backward_fused_native(x["grad"], x["weights"], x["m1"] if "m1" in x else m1, m2, step,
                                                    x["w_off"], x["d_off"], x["r_off"], x["indices"], x["offsets"],
                                                    x["psw"], x["pooling"], opt, 0.1, 1e-8, 0.9, 0.99, 0.0)
            return x["weights"]
        return call

    def skip_check(x, out):
        """bounds_check skip/warn: the bad ids dropped, the rest pooled exactly (fp32 sums of 3 rows)."""
        tables = _ebc_tables(x["weights"].cpu(), ((5, 3), (7, 4)))
        expected = oracle_embedding_bag(tables, x["indices"].cpu(), x["offsets"].cpu(), None, "sum")
        assert out.shape == expected.shape, f"shape {tuple(out.shape)}"
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)

    bad_ids = lambda d: t(d, [0, 5, -1, 1, 2**40, 0, 2])  # noqa: E731
    breaks = {
        "ok": {},
        "index_high_fatal": dict(indices=bad_ids),
        "offsets_past_end": dict(offsets=lambda d: t(d, [0, 3, 4, 4, 10**9])),
        "offsets_huge_middle": dict(offsets=lambda d: t(d, [0, 3, 10**12, 4, 7])),
        "offsets_decreasing": dict(offsets=lambda d: t(d, [0, 3, 2, 4, 7])),
        "offsets_negative": dict(offsets=lambda d: t(d, [0, -3, 4, 4, 7])),
        "offsets_not_TB": dict(offsets=lambda d: t(d, [0, 3, 4, 7])),
        "offsets_int32": dict(offsets=lambda d: t(d, [0, 3, 4, 4, 7], dtype=torch.int32)),
        "indices_int32": dict(indices=lambda d: t(d, [0, 4, 4, 1, 6, 0, 2], dtype=torch.int32)),
        "indices_float": dict(indices=lambda d: t(d, [0.0] * 7)),
        "w_off_past_end": dict(w_off=lambda d: t(d, [0, 40])),
        "w_off_negative": dict(w_off=lambda d: t(d, [-100, 15])),
        "d_off_huge": dict(d_off=lambda d: t(d, [0, 3, 2**62])),
        "d_off_overflow": dict(d_off=lambda d: t(d, [0, 2**61, 2**62 + 3]), r_off=lambda d: t(d, [0, 4, 8])),
        "d_off_decreasing": dict(d_off=lambda d: t(d, [0, 3, 1])),
        "r_off_huge": dict(r_off=lambda d: t(d, [0, 5, 2**40])),
        "r_off_negative": dict(r_off=lambda d: t(d, [0, -5, 12])),
        "meta_int32": dict(w_off=lambda d: t(d, [0, 15], dtype=torch.int32)),
        "meta_short": dict(d_off=lambda d: t(d, [0, 3])),
        "output_dim_wrong": dict(output_dim=5),
        "output_dim_neg": dict(output_dim=-7),
        "output_dim_huge": dict(output_dim=2**62),
        "pooling_code": dict(pooling=7),
        "pooling_neg": dict(pooling=-1),
        "bounds_code": dict(bounds_check=9, indices=bad_ids),
        "psw_short": dict(psw=lambda d: torch.ones(3, device=d)),
        "psw_f16": dict(psw=lambda d: torch.ones(7, dtype=F16, device=d)),
        "weights_2d": dict(weights=lambda d: torch.randn(43, 1, device=d)),
        "weights_empty": dict(weights=lambda d: torch.randn(0, device=d)),
        "weights_int": dict(weights=lambda d: torch.ones(43, dtype=torch.int64, device=d)),
        "grad_short": dict(grad=lambda d: torch.randn(1, 1, device=d)),
        "grad_narrow": dict(grad=lambda d: torch.randn(2, 3, device=d)),
        "grad_dtype": dict(grad=lambda d: torch.randn(2, 7, dtype=F16, device=d)),
        "grad_1d": dict(grad=lambda d: torch.randn(14, device=d)),
        "noncontig_indices": dict(indices=lambda d: t(d, [0, 9, 4, 9, 4, 9, 1, 9, 6, 9, 0, 9, 2, 9])[::2]),
    }
    for edge, change in breaks.items():
        native(f"embedding_bag_forward/{edge}", eb(**change), fwd)
        native(f"embedding_bag_backward/{edge}", eb(**change), bwd)
        native(f"embedding_bag_psw_backward/{edge}", eb(**change, psw=lambda d: torch.ones(7, device=d))
               if "psw" not in change else eb(**change), psw_bwd)
        for opt in (1, 2, 3):
            native(f"embedding_bag_backward_fused/{edge}/opt{opt}", eb(**change), fused(opt))
    for code in (1, 2):
        native(f"embedding_bag_forward/bad_ids_bounds{code}", eb(indices=bad_ids, bounds_check=code), fwd,
               check=skip_check)
    for opt in (0, 4, -1):
        native(f"embedding_bag_backward_fused/optimizer_code{opt}", eb(), fused(opt))
    native("embedding_bag_backward_fused/adagrad_state_short", eb(m1=lambda d: torch.zeros(3, device=d)), fused(2))

    # attention
    def at(lengths=(3, 2), H=2, D=4, Dv=3, **change):
        def make(d):
            n = sum(lengths)
            x = dict(q=torch.randn(n, H, D, device=d), k=torch.randn(n, H, D, device=d),
                     v=torch.randn(n, H, Dv, device=d), off=_offsets(list(lengths), device=d), msl=max(lengths),
                     kind="softmax", causal=True, nt=None, ctx=0, mal=0, pb=None, tb=None, ts=None, qts=None)
            for k_, v in change.items():
                x[k_] = v(d) if callable(v) else v
            return x
        return make

    def at_fwd(x, b):
        return ops.jagged_attention_fwd_native(x["q"], x["k"], x["v"], x["off"], x["msl"], x["kind"], x["causal"], 0.5,
                                               x["nt"], x["ctx"], x["mal"], x["pb"], x["tb"], x["ts"], x["qts"])

    def at_bwd(x, b):
        out, lse = ops.jagged_attention_fwd_native(x["q"], x["k"], x["v"], t(x["q"].device, [0, 3, 5]), 3, "softmax",
                                                   True, 0.5, None, 0, 0, None, None, None, None)
        if "out" in x:
            out = x["out"]
        if "lse" in x:
            lse = x["lse"]
        return ops.jagged_attention_bwd_native(out, x["q"], x["k"], x["v"], out, lse, x["off"], x["msl"], x["kind"],
                                               x["causal"], 0.5, x["nt"], x["ctx"], x["mal"], x["pb"], x["tb"],
                                               x["ts"], x["qts"], False)

    at_breaks = {
        "ok": {},
        "offsets_past_end": dict(off=lambda d: t(d, [0, 3, 10**9])),
        "offsets_decreasing": dict(off=lambda d: t(d, [0, 4, 2])),
        "offsets_negative": dict(off=lambda d: t(d, [0, -3, 5])),
        "max_seq_len_short": dict(msl=1),
        "max_seq_len_neg": dict(msl=-4),
        "max_seq_len_huge": dict(msl=2**62),
        "kind_bogus": dict(kind="linear"),
        "num_targets_huge": dict(nt=lambda d: t(d, [10**6, 0])),
        "num_targets_neg": dict(nt=lambda d: t(d, [-10**6, 0])),
        "num_targets_short": dict(nt=lambda d: t(d, [1])),
        "contextual_len_neg": dict(ctx=-5),
        "contextual_len_huge": dict(ctx=2**62),
        "max_attn_len_neg": dict(mal=-2),
        "pos_bias_narrow": dict(pb=lambda d: torch.zeros(2, 1, device=d)),
        "pos_bias_heads": dict(pb=lambda d: torch.zeros(7, 5, device=d)),
        "time_bias_no_ts": dict(tb=lambda d: torch.zeros(2, 3, device=d)),
        "timestamps_short": dict(tb=lambda d: torch.zeros(2, 3, device=d),
                                 ts=lambda d: torch.zeros(2, dtype=torch.int64, device=d)),
        "query_timestamps_short": dict(tb=lambda d: torch.zeros(2, 3, device=d),
                                       ts=lambda d: torch.zeros(5, dtype=torch.int64, device=d),
                                       qts=lambda d: torch.zeros(2, dtype=torch.int64, device=d)),
        "time_bias_empty": dict(tb=lambda d: torch.zeros(2, 0, device=d),
                                ts=lambda d: torch.zeros(5, dtype=torch.int64, device=d)),
        "k_shape": dict(k=lambda d: torch.randn(5, 2, 3, device=d)),
        "v_rows": dict(v=lambda d: torch.randn(2, 2, 3, device=d)),
        "q_f16": dict(q=lambda d: torch.randn(5, 2, 4, dtype=F16, device=d)),
        "q_noncontig": dict(q=lambda d: torch.randn(5, 4, 2, device=d).transpose(1, 2)),
        "lse_short": dict(lse=lambda d: torch.zeros(1, device=d)),
        "out_short": dict(out=lambda d: torch.zeros(1, 2, 3, device=d)),
    }
    for edge, change in at_breaks.items():
        native(f"jagged_attention_fwd/{edge}", at(**change), at_fwd)
        native(f"jagged_attention_bwd/{edge}", at(**change), at_bwd)

    # interaction
    def xi(**change):
        def make(d):
            x = dict(x=torch.randn(3, 4, 5, device=d), y=torch.randn(4, 2, device=d), lw=torch.ones(8, device=d),
                     lb=torch.zeros(8, device=d), x0=torch.randn(3, 6, device=d), u=torch.randn(6, 6, device=d),
                     v=torch.empty(0, device=d), bias=torch.zeros(6, device=d), mix=torch.randn(5, 4, device=d),
                     fm=torch.randn(3, 2, 5, device=d), lw5=torch.ones(5, device=d), lb5=torch.zeros(5, device=d),
                     eps=1e-5)
            for k, v in change.items():
                x[k] = v(d) if callable(v) else v
            return x
        return make

    interaction_calls = {
        "dot_interaction": lambda x, b: ops.dot_interaction_native(x["x"], False),
        "dot_interaction_backward": lambda x, b: ops.dot_interaction_backward_native(
            torch.randn(x["x"].shape[0], 6, device=x["x"].device), x["x"], False),
        "cross_layer": lambda x, b: ops.cross_layer_native(x["x0"], x["x0"], x["u"], x["v"], x["bias"]),
        "cross_layer_backward": lambda x, b: ops.cross_layer_backward_native(
            x["x0"], x["x0"], x["x0"], x["u"], x["v"], x["x0"], torch.empty(0, device=x["x0"].device)),
        "fm_compress": lambda x, b: ops.fm_compress_native(x["x"], x["y"], x["lw"], x["lb"], x["eps"], True),
        "fm_compress_backward": lambda x, b: ops.fm_compress_backward_native(
            torch.randn(x["x"].shape[0], 8, device=x["x"].device), x["x"], x["y"], x["lw"],
            torch.zeros(3, device=x["x"].device), torch.ones(3, device=x["x"].device),
            torch.zeros(0, 8 + 10, device=x["x"].device)),
        "feature_mix_norm": lambda x, b: ops.feature_mix_norm_native(x["x"], x["mix"], x["fm"], x["lw5"], x["lb5"],
                                                                     x["eps"]),
        "feature_mix_norm_backward": lambda x, b: ops.feature_mix_norm_backward_native(
            torch.randn(3, 5, 5, device=x["x"].device), x["x"], x["mix"], x["fm"], x["lw5"],
            torch.zeros(3, 5, device=x["x"].device), torch.ones(3, 5, device=x["x"].device)),
    }
    x_breaks = {
        "ok": {},
        "x_2d": dict(x=lambda d: torch.randn(3, 4, device=d)),
        "x_f64": dict(x=lambda d: torch.randn(3, 4, 5, dtype=torch.float64, device=d)),
        "x_int": dict(x=lambda d: torch.ones(3, 4, 5, dtype=torch.int64, device=d)),
        "x_noncontig": dict(x=lambda d: torch.randn(3, 5, 4, device=d).transpose(1, 2)),
        "x_empty": dict(x=lambda d: torch.randn(0, 4, 5, device=d)),
        "x_F0": dict(x=lambda d: torch.randn(3, 0, 5, device=d)),
        "x_big_F": dict(x=lambda d: torch.randn(1, 300, 1, device=d)),
        "y_rows": dict(y=lambda d: torch.randn(7, 2, device=d)),
        "y_k0": dict(y=lambda d: torch.randn(4, 0, device=d)),
        "lw_short": dict(lw=lambda d: torch.ones(2, device=d), lw5=lambda d: torch.ones(2, device=d)),
        "lw_f16": dict(lw=lambda d: torch.ones(8, dtype=F16, device=d), lw5=lambda d: torch.ones(5, dtype=F16,
                                                                                                device=d)),
        "eps_neg": dict(eps=-1.0),
        "eps_nan": dict(eps=NAN),
        "u_shape": dict(u=lambda d: torch.randn(6, 3, device=d)),
        "v_shape": dict(u=lambda d: torch.randn(6, 3, device=d), v=lambda d: torch.randn(2, 6, device=d)),
        "v_2d_empty": dict(v=lambda d: torch.randn(0, 6, device=d)),
        "bias_short": dict(bias=lambda d: torch.zeros(2, device=d)),
        "x0_1d": dict(x0=lambda d: torch.randn(6, device=d)),
        "mix_cols": dict(mix=lambda d: torch.randn(5, 9, device=d)),
        "mix_empty": dict(mix=lambda d: torch.randn(0, 4, device=d)),
        "fm_too_many": dict(fm=lambda d: torch.randn(3, 9, 5, device=d)),
        "fm_batch": dict(fm=lambda d: torch.randn(1, 2, 5, device=d)),
        "fm_dim": dict(fm=lambda d: torch.randn(3, 2, 2, device=d)),
    }
    for op_name, call in interaction_calls.items():
        for edge, change in x_breaks.items():
            native(f"{op_name}/{edge}", xi(**change), call)
