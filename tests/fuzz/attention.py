"""Fuzz cases of jagged_attention and the attention modules."""

from __future__ import annotations

import torch

import gem_kernels as gk

from tests.fuzz.core import BF16, Case, F16, F32, INF, NAN, _dt, _gen, _offsets, _poke, _rand, _seed, add
from tests.fuzz.oracles import oracle_attention

# ---------------------------------------------------------------------------------------------
# jagged_attention and the attention modules
# ---------------------------------------------------------------------------------------------


def attention_cases():
    def at_make(lengths=(3, 2), H=2, D=4, Dv=3, dtype=F32, max_seq_len=None, poke=None, scale=None, name="",
                extra=None):
        def make(device):
            g = _gen(name)
            n = sum(lengths)
            x = dict(q=_rand(g, n, H, D, dtype=dtype), k=_rand(g, n, H, D, dtype=dtype),
                     v=_rand(g, n, H, Dv, dtype=dtype))
            if poke is not None:
                x[poke[0]] = _poke(x[poke[0]], poke[1], poke[2])
            x = {k_: v.to(device) for k_, v in x.items()}
            x["seq_offsets"] = _offsets(list(lengths), device=device)
            x["max_seq_len"] = max(lengths, default=0) if max_seq_len is None else max_seq_len
            x["scale"] = D ** -0.5 if scale is None else scale
            x["kw"] = dict(extra or {})
            return x
        return make

    def at_call(kind, causal):
        def call(x, backend):
            kw = dict(x["kw"])
            for key in ("num_targets", "timestamps"):
                if key in kw and kw[key] is not None:
                    kw[key] = torch.as_tensor(kw[key], device=x["q"].device)
            for key in ("pos_bias", "time_bias"):
                if key in x:
                    kw[key] = x[key]
            return gk.jagged_attention(x["q"], x["k"], x["v"], x["seq_offsets"], x["max_seq_len"], kind=kind,
                                       causal=causal, scale=x["scale"], backend=backend, **kw)
        return call

    def at_oracle(kind, causal):
        def oracle(x):
            return oracle_attention(x["q"], x["k"], x["v"], x["seq_offsets"], x["max_seq_len"], kind, causal,
                                    x["scale"])
        return oracle

    for kind in ("softmax", "hstu"):
        for causal in (True, False):
            for dtype in (F32, F16, BF16):
                edges = {
                    "basic": {}, "B0": dict(lengths=()), "empty_seqs": dict(lengths=(0, 3, 0)),
                    "all_empty": dict(lengths=(0, 0)), "N1": dict(lengths=(1,), H=1, D=1, Dv=1),
                    "slack_max_len": dict(max_seq_len=9), "odd": dict(lengths=(13, 1, 6), H=3, D=5, Dv=7),
                }
                for edge, kw in edges.items():
                    name = f"jagged_attention/{kind}/{'causal' if causal else 'full'}/{edge}/{_dt(dtype)}"
                    add(Case(name, "value", at_make(dtype=dtype, name=name, **kw), at_call(kind, causal),
                             oracle=at_oracle(kind, causal), grad=("q", "k", "v")))
            # Non-finite inputs: the reference backend's result is the truth (issue 19, helper attn).
            for edge, kw in {
                "q_nan": dict(poke=("q", (0, 0, 1), NAN)), "k_nan": dict(poke=("k", (0, 0, 0), NAN)),
                "v_inf": dict(poke=("v", (1, 0, 0), INF)), "scale_nan": dict(scale=NAN),
                "scale_big": dict(scale=1e30),
            }.items():
                name = f"jagged_attention/{kind}/{'causal' if causal else 'full'}/{edge}/float32"
                add(Case(name, "value", at_make(name=name, **kw), at_call(kind, causal), target="reference",
                         grad=("q", "k", "v"), pending="issue 19: attention's NaN/Inf rule, helper attn"))
    # Visibility options: against the reference backend.
    for edge, extra, lengths in [
        ("targets", dict(num_targets=[1, 2]), (3, 2)), ("targets_all", dict(num_targets=[3, 0]), (3, 2)),
        ("context", dict(contextual_len=1), (3, 2)), ("window", dict(max_attn_len=1), (4, 3)),
        ("context_window_targets", dict(contextual_len=2, max_attn_len=2, num_targets=[1, 1]), (5, 3)),
        ("context_longer_than_seq", dict(contextual_len=7), (3, 2)),
    ]:
        for kind in ("softmax", "hstu"):
            name = f"jagged_attention/{kind}/{edge}/float32"
            add(Case(name, "value", at_make(lengths=lengths, name=name, extra=extra), at_call(kind, True),
                     target="reference", grad=("q", "k", "v")))

    def bias_make(name, with_time=False):
        base = at_make(name=name, extra=dict(timestamps=[5, 9, 100, 0, 7]) if with_time else None)

        def make(device):
            x = base(device)
            g = _gen(name + "bias")
            x["pos_bias"] = _rand(g, 2, 2 * x["max_seq_len"] - 1).to(device)
            if with_time:
                x["time_bias"] = _rand(g, 1, 5).to(device)
            return x
        return make

    for kind in ("softmax", "hstu"):
        add(Case(f"jagged_attention/{kind}/pos_bias/float32", "value", bias_make(f"pb{kind}"), at_call(kind, True),
                 target="reference", grad=("q", "k", "v", "pos_bias")))
        add(Case(f"jagged_attention/{kind}/time_bias/float32", "value", bias_make(f"tb{kind}", True),
                 at_call(kind, True), target="reference", grad=("q", "k", "v", "pos_bias", "time_bias")))

    def bad_at(edge, change, names):
        name = f"jagged_attention/bad/{edge}"
        base = at_make(name=name)

        def make(device):
            x = base(device)
            x.update(change(x, device))
            return x

        def call(x, backend):
            kw = dict(x["kw"])
            kw.setdefault("scale", x["scale"])
            return gk.jagged_attention(x["q"], x["k"], x["v"], x["seq_offsets"], x["max_seq_len"],
                                       backend=backend, **kw)
        add(Case(name, "bad", make, call, names=names))

    bad_at("q_2d", lambda x, d: dict(q=x["q"][:, 0]), ("q",))
    bad_at("k_shape", lambda x, d: dict(k=x["k"][:, :, :3]), ("k",))
    bad_at("v_rows", lambda x, d: dict(v=x["v"][:4]), ("v",))
    bad_at("v_dtype", lambda x, d: dict(v=x["v"].half()), ("v",))
    bad_at("q_int", lambda x, d: dict(q=x["q"].long(), k=x["k"].long(), v=x["v"].long()), ("q",))
    bad_at("head_dim0", lambda x, d: dict(q=x["q"][:, :, :0], k=x["k"][:, :, :0]), ("q", "head"))
    bad_at("offsets_last", lambda x, d: dict(seq_offsets=torch.tensor([0, 3, 4], device=d)), ("seq_offsets",))
    bad_at("offsets_decreasing", lambda x, d: dict(seq_offsets=torch.tensor([0, 3, 2, 5], device=d)),
           ("seq_offsets",))
    bad_at("offsets_float", lambda x, d: dict(seq_offsets=x["seq_offsets"].float()), ("seq_offsets",))
    bad_at("max_seq_len_short", lambda x, d: dict(max_seq_len=2), ("max_seq_len",))
    bad_at("max_seq_len_neg", lambda x, d: dict(max_seq_len=-3), ("max_seq_len",))
    bad_at("max_seq_len_2^63", lambda x, d: dict(max_seq_len=2**63), ("max_seq_len",))
    bad_at("max_seq_len_float", lambda x, d: dict(max_seq_len=3.0), ("max_seq_len",))
    bad_at("kind", lambda x, d: dict(kw=dict(kind="linear")), ("kind",))
    bad_at("causal_int", lambda x, d: dict(kw=dict(causal=1)), ("causal",))
    bad_at("scale_str", lambda x, d: dict(kw=dict(scale="0.5")), ("scale",))
    bad_at("contextual_len_neg", lambda x, d: dict(kw=dict(contextual_len=-1)), ("contextual_len",))
    bad_at("contextual_len_2^63", lambda x, d: dict(kw=dict(contextual_len=2**63)), ("contextual_len",))
    bad_at("max_attn_len_-2^64", lambda x, d: dict(kw=dict(max_attn_len=-2**64)), ("max_attn_len",))
    bad_at("num_targets_len", lambda x, d: dict(kw=dict(num_targets=torch.tensor([1], device=d))), ("num_targets",))
    bad_at("num_targets_too_many", lambda x, d: dict(kw=dict(num_targets=torch.tensor([4, 0], device=d))),
           ("num_targets",))
    bad_at("num_targets_neg", lambda x, d: dict(kw=dict(num_targets=torch.tensor([-1, 0], device=d))),
           ("num_targets",))
    bad_at("num_targets_float", lambda x, d: dict(kw=dict(num_targets=torch.tensor([1.0, 0.0], device=d))),
           ("num_targets",))
    bad_at("pos_bias_width", lambda x, d: dict(kw=dict(pos_bias=torch.zeros(2, 4, device=d))), ("pos_bias",))
    bad_at("pos_bias_heads", lambda x, d: dict(kw=dict(pos_bias=torch.zeros(3, 5, device=d))), ("pos_bias",))
    bad_at("time_bias_no_timestamps", lambda x, d: dict(kw=dict(time_bias=torch.zeros(2, 4, device=d))),
           ("timestamps",))
    bad_at("timestamps_len", lambda x, d: dict(kw=dict(time_bias=torch.zeros(2, 4, device=d),
                                                       timestamps=torch.zeros(3, dtype=torch.int64, device=d))),
           ("timestamps",))
    bad_at("timestamps_float", lambda x, d: dict(kw=dict(time_bias=torch.zeros(2, 4, device=d),
                                                         timestamps=torch.zeros(5, device=d))), ("timestamps",))

    # Modules
    def module_run(cls, kw, lengths, call_kw=None, name=""):
        def make(device):
            return dict(device=device)

        def run(x, backend):
            torch.manual_seed(_seed(name))
            m = cls(**kw, backend=backend).to(x["device"])
            n = sum(lengths)
            inp = torch.randn(n, 8, generator=_gen(name)).to(x["device"]).requires_grad_(True)
            out = m(inp, _offsets(list(lengths), device=x["device"]), max(lengths, default=0) if not call_kw else
                    call_kw.get("max_seq_len", max(lengths, default=0)),
                    **{k: torch.as_tensor(v, device=x["device"]) for k, v in (call_kw or {}).items()
                       if k != "max_seq_len"})
            out.sum().backward()
            return torch.cat([out.detach().flatten(), inp.grad.flatten()])
        return make, run

    for cls_name, cls, kw in [
        ("JaggedMultiheadAttention", gk.nn.JaggedMultiheadAttention, dict(embed_dim=8, num_heads=2)),
        ("JaggedMultiheadAttention_hstu_bias", gk.nn.JaggedMultiheadAttention,
         dict(embed_dim=8, num_heads=2, kind="hstu", max_seq_len=4)),
        ("HSTULayer", gk.nn.HSTULayer, dict(embed_dim=8, num_heads=2, linear_dim=3, attention_dim=4)),
    ]:
        for edge, lengths in (("basic", (3, 1)), ("empty_seqs", (0, 4, 0)), ("B0", ())):
            if "bias" in cls_name and edge != "basic":
                continue
            name = f"nn.{cls_name}/{edge}"
            make, run = module_run(cls, kw, lengths, dict(max_seq_len=4) if "bias" in cls_name else None, name=name)
            add(Case(name, "value", make, run, target="reference"))
    add(Case("nn.JaggedMultiheadAttention/bad/max_seq_len_vs_bias", "bad", lambda d: dict(device=d),
             lambda x, b: gk.nn.JaggedMultiheadAttention(8, 2, max_seq_len=4, backend=b)(
                 torch.randn(3, 8), _offsets([3]), 3), names=("max_seq_len",)))
    add(Case("nn.JaggedMultiheadAttention/bad/embed_dim", "bad", lambda d: {},
             lambda x, b: gk.nn.JaggedMultiheadAttention(9, 2, backend=b), names=("embed_dim",)))
    add(Case("nn.HSTULayer/bad/time_buckets_no_timestamps", "bad", lambda d: dict(device=d),
             lambda x, b: gk.nn.HSTULayer(8, 2, 3, 4, num_time_buckets=3, backend=b)(
                 torch.randn(3, 8), _offsets([3]), 3), names=("timestamps",)))
