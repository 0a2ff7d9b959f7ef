"""Fuzz cases of jagged_to_padded / padded_to_jagged."""

from __future__ import annotations

import torch

import gem_kernels as gk

from tests.fuzz.core import BF16, Case, F16, F32, INF, NAN, _dt, _gen, _offsets, _poke, _rand, add
from tests.fuzz.oracles import oracle_jagged_to_padded, oracle_padded_to_jagged

# ---------------------------------------------------------------------------------------------
# jagged_to_padded / padded_to_jagged
# ---------------------------------------------------------------------------------------------


def jagged_cases():
    def j2p_inputs(lengths=(3, 0, 2), D=3, dtype=F32, off_dtype=torch.int64, one_d=False, scale=1.0, poke=None,
                   max_len=4, pad_value=0.0, name=""):
        def make(device):
            g = _gen(name)
            n = sum(lengths)
            values = _rand(g, n, dtype=dtype, scale=scale) if one_d else _rand(g, n, D, dtype=dtype, scale=scale)
            if poke is not None:
                values = _poke(values, poke[0], poke[1])
            return dict(values=values.to(device), offsets=_offsets(list(lengths), off_dtype, device),
                        max_len=max_len, pad_value=pad_value)
        return make

    def j2p_call(x, backend):
        return gk.jagged_to_padded(x["values"], x["offsets"], x["max_len"], x["pad_value"], backend=backend)

    def j2p_oracle(x):
        return oracle_jagged_to_padded(x["values"], x["offsets"], x["max_len"], x["pad_value"])

    edges = {
        "basic": {},
        "B0": dict(lengths=()),
        "all_empty": dict(lengths=(0, 0, 0)),
        "max_len0": dict(max_len=0),
        "truncate": dict(lengths=(7, 1, 5), max_len=3),
        "D0": dict(D=0),
        "D1_odd": dict(D=1, lengths=(5, 2, 0, 9), max_len=9),
        "one_d": dict(one_d=True),
        "int32_offsets": dict(off_dtype=torch.int32),
        "long_seq": dict(lengths=(97,), max_len=97),
        "pad_nan": dict(pad_value=NAN),
        "pad_-inf": dict(pad_value=-INF),
        "pad_big": dict(pad_value=3e38),
        "values_nan": dict(poke=((1, 2), NAN)),
        "values_inf": dict(poke=((4, 0), -INF)),
        "values_huge": dict(scale=1e37),
    }
    for dtype in (F32, F16, BF16):
        for edge, kw in edges.items():
            if edge == "pad_big" and dtype != F32:
                kw = dict(pad_value=6e4 if dtype == F16 else 3e38)
            if edge == "values_huge" and dtype == F16:
                kw = dict(scale=1e4)
            name = f"jagged_to_padded/{edge}/{_dt(dtype)}"
            add(Case(name, "value", j2p_inputs(dtype=dtype, name=name, **kw), j2p_call, oracle=j2p_oracle,
                     grad=("values",)))

    def p2j_make(B=3, max_len=4, D=3, lengths=(3, 0, 2), dtype=F32, total=True, poke=None, name=""):
        def make(device):
            g = _gen(name)
            padded = _rand(g, B, max_len, D, dtype=dtype)
            if poke is not None:
                padded = _poke(padded, poke[0], poke[1])
            return dict(padded=padded.to(device), offsets=_offsets(list(lengths), device=device),
                        total_len=sum(lengths) if total else None)
        return make

    def p2j_call(x, backend):
        return gk.padded_to_jagged(x["padded"], x["offsets"], x["total_len"], backend=backend)

    def p2j_oracle(x):
        return oracle_padded_to_jagged(x["padded"], x["offsets"])

    p2j_edges = {
        "basic": {},
        "no_total": dict(total=False),
        "B0": dict(B=0, lengths=()),
        "longer_than_max_len": dict(lengths=(6, 0, 9)),
        "max_len0": dict(max_len=0, lengths=(2, 0, 1)),
        "D0": dict(D=0),
        "nan": dict(poke=((0, 1, 2), NAN)),
        "nan_in_padding": dict(poke=((2, 3, 0), NAN)),
    }
    for dtype in (F32, F16, BF16):
        for edge, kw in p2j_edges.items():
            name = f"padded_to_jagged/{edge}/{_dt(dtype)}"
            add(Case(name, "value", p2j_make(dtype=dtype, name=name, **kw), p2j_call, oracle=p2j_oracle,
                     grad=("padded",)))

    # Bad inputs: (edge, make-kwargs override applied to the inputs, names)
    def bad_j2p(edge, change, names):
        name = f"jagged_to_padded/bad/{edge}"
        base = j2p_inputs(name=name)

        def make(device):
            x = base(device)
            x.update(change(x, device))
            return x
        add(Case(name, "bad", make, j2p_call, names=names))

    bad_j2p("values_int", lambda x, d: dict(values=x["values"].long()), ("values",))
    bad_j2p("values_f64", lambda x, d: dict(values=x["values"].double()), ("values",))
    bad_j2p("values_3d", lambda x, d: dict(values=x["values"][:, :, None]), ("values",))
    bad_j2p("values_0d", lambda x, d: dict(values=torch.tensor(1.0, device=d)), ("values",))
    bad_j2p("values_list", lambda x, d: dict(values=[[1.0]]), ("values",))
    bad_j2p("offsets_float", lambda x, d: dict(offsets=x["offsets"].float()), ("offsets",))
    bad_j2p("offsets_int16", lambda x, d: dict(offsets=x["offsets"].short()), ("offsets",))
    bad_j2p("offsets_2d", lambda x, d: dict(offsets=x["offsets"][None]), ("offsets",))
    bad_j2p("offsets_empty", lambda x, d: dict(offsets=x["offsets"][:0]), ("offsets",))
    bad_j2p("offsets_first", lambda x, d: dict(offsets=x["offsets"] + 1), ("offsets",))
    bad_j2p("offsets_decreasing", lambda x, d: dict(offsets=torch.tensor([0, 4, 3, 5], device=d)), ("offsets",))
    bad_j2p("offsets_last_short", lambda x, d: dict(offsets=torch.tensor([0, 3, 3, 4], device=d)), ("offsets",))
    bad_j2p("offsets_last_long", lambda x, d: dict(offsets=torch.tensor([0, 3, 3, 2**40], device=d)), ("offsets",))
    bad_j2p("offsets_negative", lambda x, d: dict(offsets=torch.tensor([0, -3, 3, 5], device=d)), ("offsets",))
    bad_j2p("offsets_int64_min", lambda x, d: dict(offsets=torch.tensor([0, -2**63, 3, 5], device=d)), ("offsets",))
    bad_j2p("max_len_neg", lambda x, d: dict(max_len=-1), ("max_len",))
    bad_j2p("max_len_float", lambda x, d: dict(max_len=4.0), ("max_len",))
    bad_j2p("max_len_bool", lambda x, d: dict(max_len=True), ("max_len",))
    bad_j2p("max_len_none", lambda x, d: dict(max_len=None), ("max_len",))
    bad_j2p("max_len_2^63", lambda x, d: dict(max_len=2**63), ("max_len",))
    bad_j2p("max_len_-2^70", lambda x, d: dict(max_len=-2**70), ("max_len",))
    bad_j2p("max_len_tensor", lambda x, d: dict(max_len=torch.tensor(4)), ("max_len",))
    bad_j2p("pad_value_str", lambda x, d: dict(pad_value="0"), ("pad_value",))
    bad_j2p("pad_value_none", lambda x, d: dict(pad_value=None), ("pad_value",))
    bad_j2p("pad_value_f32_overflow", lambda x, d: dict(pad_value=1e39), ("pad_value",))
    bad_j2p("pad_value_f16_overflow", lambda x, d: dict(values=x["values"].half(), pad_value=1e6), ("pad_value",))
    bad_j2p("pad_value_bf16_overflow", lambda x, d: dict(values=x["values"].bfloat16(), pad_value=-1e39),
            ("pad_value",))
    bad_j2p("pad_value_huge_int", lambda x, d: dict(pad_value=10**400), ("pad_value",))
    bad_j2p("offsets_dtype_mismatch_values_bool", lambda x, d: dict(values=x["values"] > 0), ("values",))

    def bad_p2j(edge, change, names):
        name = f"padded_to_jagged/bad/{edge}"
        base = p2j_make(name=name)

        def make(device):
            x = base(device)
            x.update(change(x, device))
            return x
        add(Case(name, "bad", make, p2j_call, names=names))

    bad_p2j("padded_1d", lambda x, d: dict(padded=x["padded"].flatten()), ("padded",))
    bad_p2j("padded_int", lambda x, d: dict(padded=x["padded"].int()), ("padded",))
    bad_p2j("B_mismatch", lambda x, d: dict(offsets=_offsets([3, 0], device=d)), ("offsets",))
    bad_p2j("total_len_wrong", lambda x, d: dict(total_len=4), ("offsets", "total_len"))
    bad_p2j("total_len_neg", lambda x, d: dict(total_len=-5), ("total_len",))
    bad_p2j("total_len_2^64", lambda x, d: dict(total_len=2**64), ("total_len",))
    bad_p2j("total_len_float", lambda x, d: dict(total_len=5.0), ("total_len",))
    bad_p2j("offsets_decreasing", lambda x, d: dict(offsets=torch.tensor([0, 3, 2, 5], device=d)), ("offsets",))
    bad_p2j("offsets_first", lambda x, d: dict(offsets=torch.tensor([1, 3, 3, 5], device=d)), ("offsets",))
    bad_p2j("offsets_float", lambda x, d: dict(offsets=x["offsets"].double()), ("offsets",))

    for edge, backend in (("unknown", "gpu"), ("none_str", "None"), ("number", 3)):
        name = f"jagged_to_padded/bad/backend_{edge}"
        add(Case(name, "bad", j2p_inputs(name=name),
                 lambda x, b, backend=backend: gk.jagged_to_padded(x["values"], x["offsets"], 4, backend=backend),
                 names=("backend",)))
