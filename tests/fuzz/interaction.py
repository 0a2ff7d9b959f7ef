"""Fuzz cases of the interaction ops and the interaction modules."""

from __future__ import annotations

import torch

import gem_kernels as gk

from tests.fuzz.core import BF16, Case, F16, F32, INF, NAN, _dt, _gen, _poke, _rand, _seed, add
from tests.fuzz.oracles import oracle_cross_layer, oracle_dot_interaction, oracle_feature_mix_norm, oracle_fm_compress

# ---------------------------------------------------------------------------------------------
# Interaction ops
# ---------------------------------------------------------------------------------------------


def interaction_cases():
    # dot_interaction
    def di_make(B=3, F_=5, D=4, dtype=F32, poke=None, scale=1.0, noncontig=False, name=""):
        def make(device):
            g = _gen(name)
            x = _rand(g, B, F_, D, dtype=dtype, scale=scale)
            if poke is not None:
                x = _poke(x, poke[0], poke[1])
            x = x.to(device)
            if noncontig:
                x = x.transpose(1, 2).contiguous().transpose(1, 2)
            return dict(x=x, self_interaction=False)
        return make

    def di_call(x, backend):
        return gk.dot_interaction(x["x"], x["self_interaction"], backend=backend)

    def di_self_call(x, backend):
        return gk.dot_interaction(x["x"], True, backend=backend)

    def di_oracle(x):
        return oracle_dot_interaction(x["x"], x["self_interaction"])

    di_edges = {
        "basic": {}, "B0": dict(B=0), "F1": dict(F_=1), "F0": dict(F_=0), "D0": dict(D=0), "D1": dict(D=1),
        "odd": dict(B=5, F_=27, D=13), "noncontig": dict(noncontig=True),
        "nan": dict(poke=((1, 2, 0), NAN)), "inf": dict(poke=((0, 0, 3), INF)),
        "inf_times_zero": dict(poke=((0, 1, 1), INF), scale=0.0),
    }
    for dtype in (F32, F16, BF16):
        for edge, kw in di_edges.items():
            name = f"dot_interaction/{edge}/{_dt(dtype)}"
            add(Case(name, "value", di_make(dtype=dtype, name=name, **kw), di_call, oracle=di_oracle, grad=("x",)))
        name = f"dot_interaction/self/{_dt(dtype)}"
        add(Case(name, "value", di_make(dtype=dtype, name=name), di_self_call,
                 oracle=lambda x: oracle_dot_interaction(x["x"], True), grad=("x",)))
    # overflow: fp16 products beyond 65504 must be inf like the fp32-accumulated oracle rounded to fp16
    name = "dot_interaction/overflow/float16"
    add(Case(name, "value", di_make(dtype=F16, name=name, scale=300.0), di_call, oracle=di_oracle,
             oracle_dtype=F32))
    for edge, x_fn, names in [
        ("2d", lambda d: torch.randn(3, 4, device=d), ("x",)),
        ("int", lambda d: torch.ones(3, 4, 2, dtype=torch.int64, device=d), ("x",)),
        ("f64", lambda d: torch.randn(3, 4, 2, dtype=torch.float64, device=d), ("x",)),
        ("not_tensor", lambda d: [[[1.0]]], ("x",)),
    ]:
        add(Case(f"dot_interaction/bad/{edge}", "bad", lambda d, x_fn=x_fn: dict(x=x_fn(d)),
                 lambda x, b: gk.dot_interaction(x["x"], backend=b), names=names))
    add(Case("dot_interaction/bad/self_interaction_int", "bad", lambda d: dict(x=torch.randn(2, 3, 4, device=d)),
             lambda x, b: gk.dot_interaction(x["x"], 1, backend=b), names=("self_interaction",)))

    # cross_layer
    def cl_make(B=4, N=6, rank=None, dtype=F32, poke=None, name=""):
        def make(device):
            g = _gen(name)
            x = dict(x0=_rand(g, B, N, dtype=dtype), xl=_rand(g, B, N, dtype=dtype), bias=_rand(g, N, dtype=dtype))
            if rank is None:
                x["w"] = _rand(g, N, N, dtype=dtype, scale=0.3)
            else:
                x["u"], x["v"] = _rand(g, N, rank, dtype=dtype, scale=0.5), _rand(g, rank, N, dtype=dtype, scale=0.5)
            if poke is not None:
                x[poke[0]] = _poke(x[poke[0]], poke[1], poke[2])
            return {k: v.to(device) for k, v in x.items()}
        return make

    def cl_weight(x):
        return x["w"] if "w" in x else (x["u"], x["v"])

    def cl_call(x, backend):
        return gk.cross_layer(x["x0"], x["xl"], cl_weight(x), x["bias"], backend=backend)

    def cl_oracle(x):
        return oracle_cross_layer(x["x0"], x["xl"], cl_weight(x), x["bias"])

    cl_edges = {
        "basic": {}, "B0": dict(B=0), "N0": dict(N=0), "N1": dict(N=1), "odd": dict(B=7, N=59),
        "x0_nan": dict(poke=("x0", (1, 2), NAN)), "bias_inf": dict(poke=("bias", 3, INF)),
        "xl_inf": dict(poke=("xl", (0, 0), -INF)),
    }
    for dtype in (F32, F16, BF16):
        for rank in (None, 2):
            for edge, kw in cl_edges.items():
                name = f"cross_layer/{'full' if rank is None else 'rank2'}/{edge}/{_dt(dtype)}"
                grad = ("x0", "xl", "bias") + (("w",) if rank is None else ("u", "v"))
                add(Case(name, "value", cl_make(dtype=dtype, rank=rank, name=name, **kw), cl_call, oracle=cl_oracle,
                         grad=grad))
    name = "cross_layer/rank1/N0_B0/float32"
    add(Case(name, "value", cl_make(B=0, N=0, rank=1, name=name), cl_call, oracle=cl_oracle,
             grad=("x0", "xl", "bias", "u", "v")))

    def bad_cl(edge, change, names, rank=None):
        name = f"cross_layer/bad/{edge}"
        base = cl_make(rank=rank, name=name)

        def make(device):
            x = base(device)
            x.update(change(x, device))
            return x

        def call(x, backend):
            weight = x["weight"] if "weight" in x else cl_weight(x)
            return gk.cross_layer(x["x0"], x["xl"], weight, x["bias"], backend=backend)
        add(Case(name, "bad", make, call, names=names))

    bad_cl("xl_shape", lambda x, d: dict(xl=x["xl"][:, :5]), ("xl",))
    bad_cl("xl_dtype", lambda x, d: dict(xl=x["xl"].half()), ("xl",))
    bad_cl("x0_1d", lambda x, d: dict(x0=x["x0"][0]), ("x0",))
    bad_cl("w_shape", lambda x, d: dict(w=x["w"][:5]), ("weight",))
    bad_cl("w_dtype", lambda x, d: dict(w=x["w"].double()), ("weight",))
    bad_cl("bias_shape", lambda x, d: dict(bias=x["bias"][None]), ("bias",))
    bad_cl("weight_triple", lambda x, d: dict(weight=(x["w"], x["w"], x["w"])), ("weight",))
    bad_cl("weight_str", lambda x, d: dict(weight="w"), ("weight",))
    bad_cl("u_rank0", lambda x, d: dict(u=x["u"][:, :0], v=x["v"][:0]), ("u",), rank=2)
    bad_cl("v_shape", lambda x, d: dict(v=x["v"][:, :5]), ("v",), rank=2)
    bad_cl("u_rows", lambda x, d: dict(u=x["u"][:5]), ("u",), rank=2)
    bad_cl("v_dtype", lambda x, d: dict(v=x["v"].bfloat16()), ("v",), rank=2)

    # fm_compress
    def fm_make(B=3, F_=4, D=5, k=2, dtype=F32, ln=True, eps=1e-5, poke=None, scale=1.0, name=""):
        def make(device):
            g = _gen(name)
            x = dict(x=_rand(g, B, F_, D, dtype=dtype, scale=scale), y=_rand(g, F_, k, dtype=dtype, scale=0.5))
            if ln:
                x["ln_weight"] = _rand(g, F_ * k, dtype=dtype)
                x["ln_bias"] = _rand(g, F_ * k, dtype=dtype)
            if poke is not None:
                x[poke[0]] = _poke(x[poke[0]], poke[1], poke[2])
            x = {k_: v.to(device) for k_, v in x.items()}
            x["eps"] = eps
            return x
        return make

    def fm_call(x, backend):
        return gk.fm_compress(x["x"], x["y"], x.get("ln_weight"), x.get("ln_bias"), x["eps"], backend=backend)

    def fm_oracle(x):
        F_, k = x["y"].shape
        w = x.get("ln_weight", x["x"].new_ones(F_ * k))
        b = x.get("ln_bias", x["x"].new_zeros(F_ * k))
        return oracle_fm_compress(x["x"], x["y"], w, b, x["eps"])

    fm_edges = {
        "basic": {}, "B0": dict(B=0), "F1": dict(F_=1), "k1": dict(k=1), "D0": dict(D=0), "no_ln": dict(ln=False),
        "odd": dict(B=2, F_=9, D=13, k=3), "x_nan": dict(poke=("x", (1, 0, 2), NAN)),
        "y_inf": dict(poke=("y", (0, 1), INF)), "eps_big": dict(eps=1e4), "constant_rows": dict(scale=0.0),
    }
    for dtype in (F32, F16, BF16):
        for edge, kw in fm_edges.items():
            name = f"fm_compress/{edge}/{_dt(dtype)}"
            ln = kw.get("ln", True)
            grad = ("x", "y") + (("ln_weight", "ln_bias") if ln else ())
            add(Case(name, "value", fm_make(dtype=dtype, name=name, **kw), fm_call, oracle=fm_oracle, grad=grad))
    # Beyond fp32's range inside the products: compare with fp32 arithmetic (the kernels' statistics dtype)
    name = "fm_compress/overflow/float32"
    add(Case(name, "value", fm_make(name=name, scale=1e13), fm_call, oracle=fm_oracle, oracle_dtype=F32))

    def bad_fm(edge, change, names):
        name = f"fm_compress/bad/{edge}"
        base = fm_make(name=name)

        def make(device):
            x = base(device)
            x.update(change(x, device))
            return x
        add(Case(name, "bad", make, fm_call, names=names))

    bad_fm("y_k0", lambda x, d: dict(y=x["y"][:, :0]), ("y",))
    bad_fm("y_rows", lambda x, d: dict(y=x["y"][:3]), ("y",))
    bad_fm("y_dtype", lambda x, d: dict(y=x["y"].half()), ("y",))
    bad_fm("x_2d", lambda x, d: dict(x=x["x"][0]), ("x",))
    bad_fm("ln_weight_shape", lambda x, d: dict(ln_weight=x["ln_weight"][:3]), ("ln_weight",))
    bad_fm("ln_bias_dtype", lambda x, d: dict(ln_bias=x["ln_bias"].double()), ("ln_bias",))
    bad_fm("eps_0", lambda x, d: dict(eps=0.0), ("eps",))
    bad_fm("eps_neg", lambda x, d: dict(eps=-1e-5), ("eps",))
    bad_fm("eps_nan", lambda x, d: dict(eps=NAN), ("eps",))
    bad_fm("eps_inf", lambda x, d: dict(eps=INF), ("eps",))
    bad_fm("eps_str", lambda x, d: dict(eps="1e-5"), ("eps",))

    # feature_mix_norm
    def fmn_make(B=3, F_=4, D=5, O=6, O_fm=2, dtype=F32, ln=True, eps=1e-5, poke=None, name=""):
        def make(device):
            g = _gen(name)
            x = dict(x=_rand(g, B, F_, D, dtype=dtype), mix=_rand(g, O, F_, dtype=dtype, scale=0.5))
            if O_fm is not None:
                x["fm"] = _rand(g, B, O_fm, D, dtype=dtype)
            if ln:
                x["ln_weight"], x["ln_bias"] = _rand(g, D, dtype=dtype), _rand(g, D, dtype=dtype)
            if poke is not None:
                x[poke[0]] = _poke(x[poke[0]], poke[1], poke[2])
            x = {k_: v.to(device) for k_, v in x.items()}
            x["eps"] = eps
            return x
        return make

    def fmn_call(x, backend):
        return gk.feature_mix_norm(x["x"], x["mix"], x.get("fm"), x.get("ln_weight"), x.get("ln_bias"), x["eps"],
                                   backend=backend)

    def fmn_oracle(x):
        D = x["x"].shape[2]
        return oracle_feature_mix_norm(x["x"], x["mix"], x.get("fm"), x.get("ln_weight", x["x"].new_ones(D)),
                                       x.get("ln_bias", x["x"].new_zeros(D)), x["eps"])

    fmn_edges = {
        "basic": {}, "B0": dict(B=0), "F1": dict(F_=1), "D1": dict(D=1), "O1": dict(O=1, O_fm=1),
        "no_fm": dict(O_fm=None), "fm_empty": dict(O_fm=0), "fm_full": dict(O_fm=6), "no_ln": dict(ln=False),
        "odd": dict(B=2, F_=7, D=33, O=9, O_fm=4), "x_nan": dict(poke=("x", (0, 1, 1), NAN)),
        "fm_inf": dict(poke=("fm", (2, 0, 3), -INF)), "mix_nan": dict(poke=("mix", (5, 2), NAN)),
    }
    for dtype in (F32, F16, BF16):
        for edge, kw in fmn_edges.items():
            name = f"feature_mix_norm/{edge}/{_dt(dtype)}"
            grad = ("x", "mix") + (("fm",) if kw.get("O_fm", 2) is not None else ()) + (
                ("ln_weight", "ln_bias") if kw.get("ln", True) else ())
            add(Case(name, "value", fmn_make(dtype=dtype, name=name, **kw), fmn_call, oracle=fmn_oracle, grad=grad))

    def bad_fmn(edge, change, names):
        name = f"feature_mix_norm/bad/{edge}"
        base = fmn_make(name=name)

        def make(device):
            x = base(device)
            x.update(change(x, device))
            return x
        add(Case(name, "bad", make, fmn_call, names=names))

    bad_fmn("mix_O0", lambda x, d: dict(mix=x["mix"][:0]), ("mix",))
    bad_fmn("mix_cols", lambda x, d: dict(mix=x["mix"][:, :3]), ("mix",))
    bad_fmn("fm_too_many", lambda x, d: dict(fm=torch.randn(3, 7, 5, device=d)), ("fm",))
    bad_fmn("fm_batch", lambda x, d: dict(fm=x["fm"][:2]), ("fm",))
    bad_fmn("fm_dtype", lambda x, d: dict(fm=x["fm"].half()), ("fm",))
    bad_fmn("x_F0", lambda x, d: dict(x=x["x"][:, :0]), ("x",))
    bad_fmn("x_D0", lambda x, d: dict(x=x["x"][:, :, :0]), ("x",))
    bad_fmn("ln_weight_shape", lambda x, d: dict(ln_weight=x["ln_weight"][:2]), ("ln_weight",))
    bad_fmn("eps_nan", lambda x, d: dict(eps=NAN), ("eps",))
    bad_fmn("eps_bool", lambda x, d: dict(eps=True), ("eps",))



def interaction_module_cases():
    def run_module(factory, shape, name):
        def make(device):
            return dict(device=device)

        def run(x, backend):
            torch.manual_seed(_seed(name))
            m = factory(backend).to(x["device"])
            inp = torch.randn(*shape, generator=_gen(name)).to(x["device"]).requires_grad_(True)
            out = m(inp)
            (out.float() * torch.randn(out.shape, generator=_gen(name + "g")).to(out.device)).sum().backward()
            grads = [inp.grad.flatten()] + [p.grad.flatten() for p in m.parameters() if p.grad is not None]
            return torch.cat([out.detach().flatten()] + grads)
        return make, run

    for edge, factory, shape in [
        ("DotInteraction/basic", lambda b: gk.nn.DotInteraction(backend=b), (3, 4, 5)),
        ("DotInteraction/B0", lambda b: gk.nn.DotInteraction(True, backend=b), (0, 4, 5)),
        ("CrossNet/full", lambda b: gk.nn.CrossNet(6, 2, backend=b), (3, 6)),
        ("CrossNet/low_rank", lambda b: gk.nn.CrossNet(6, 3, low_rank=2, backend=b), (3, 6)),
        ("CrossNet/B0", lambda b: gk.nn.CrossNet(6, 1, low_rank=1, backend=b), (0, 6)),
        ("WukongLayer/basic", lambda b: gk.nn.WukongLayer(4, 2, 3, 5, 2, 8, backend=b), (3, 4, 5)),
        ("WukongLayer/identity_residual", lambda b: gk.nn.WukongLayer(4, 0, 4, 5, 2, 8, backend=b), (2, 4, 5)),
        ("WukongLayer/B0", lambda b: gk.nn.WukongLayer(4, 2, 2, 5, 2, 8, backend=b), (0, 4, 5)),
        ("WukongStack/basic", lambda b: gk.nn.WukongStack(2, 4, 2, 1, 5, 2, [6, 4], backend=b), (2, 4, 5)),
    ]:
        name = f"nn.{edge}"
        make, run = run_module(factory, shape, name)
        add(Case(name, "value", make, run, target="reference"))
    for edge, fn, names in [
        ("CrossNet/in_features0", lambda b: gk.nn.CrossNet(0, 2, backend=b), ("in_features",)),
        ("CrossNet/low_rank0", lambda b: gk.nn.CrossNet(4, 2, low_rank=0, backend=b), ("low_rank",)),
        ("CrossNet/wrong_width", lambda b: gk.nn.CrossNet(4, 2, backend=b)(torch.randn(3, 5)), ("xl", "weight")),
        ("WukongLayer/dim0", lambda b: gk.nn.WukongLayer(4, 2, 3, 0, 2, 8, backend=b), ("dim",)),
        ("WukongLayer/no_outputs", lambda b: gk.nn.WukongLayer(4, 0, 0, 5, 2, 8, backend=b), ("num_fm_out",)),
        ("WukongLayer/wrong_features", lambda b: gk.nn.WukongLayer(4, 2, 3, 5, 2, 8, backend=b)(torch.randn(2, 3, 5)),
         ("y", "mix", "x")),
        ("WukongStack/layers0", lambda b: gk.nn.WukongStack(0, 4, 2, 1, 5, 2, 8, backend=b), ("num_layers",)),
        ("DotInteraction/bad_backend", lambda b: gk.nn.DotInteraction(backend="fast")(torch.randn(2, 3, 4)),
         ("backend",)),
    ]:
        add(Case(f"nn.{edge}/bad", "bad", lambda d: {}, lambda x, b, fn=fn: fn(b), names=names))
