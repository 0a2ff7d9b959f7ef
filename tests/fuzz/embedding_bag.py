"""Fuzz cases of embedding_bag, FusedEmbeddingBag, from_embedding_bags and state_dict."""

from __future__ import annotations

import torch

import gem_kernels as gk

from tests.fuzz.core import BF16, Case, F16, F32, INF, NAN, TOL, _dt, _gen, _offsets, _poke, _rand, _seed, add
from tests.fuzz.oracles import oracle_embedding_bag

# ---------------------------------------------------------------------------------------------
# embedding_bag, FusedEmbeddingBag, from_embedding_bags, state_dict
# ---------------------------------------------------------------------------------------------

TABLES = ((5, 3), (7, 4))  # (rows, dim)


def _ebc(device, dtype=F32, pooling="sum", tables=TABLES, optimizer=None, bounds_check="fatal", backend=None,
         seed=0):
    ebc = gk.FusedEmbeddingBag([gk.TableSpec(r, d) for r, d in tables], pooling=pooling, dtype=dtype, device=device,
                               optimizer=optimizer, bounds_check=bounds_check, backend=backend)
    with torch.no_grad():
        ebc.weights.copy_(torch.randn(ebc.weights.shape, generator=torch.Generator().manual_seed(seed)))
    return ebc


def _ebc_tables(weights, tables):
    out, start = [], 0
    for r, d in tables:
        out.append(weights[start:start + r * d].view(r, d))
        start += r * d
    return out


def embedding_bag_cases():
    def eb_make(bags=((0, 4, 4), (1,), (), (6, 0, 2)), B=2, dtype=F32, idx_dtype=torch.int64, psw=False,
                poke_w=None, poke_psw=None, tables=TABLES, name=""):
        """bags: T*B bags, table-major."""
        def make(device):
            g = _gen(name)
            sizes = [r * d for r, d in tables]
            weights = _rand(g, sum(sizes), dtype=dtype)
            if poke_w is not None:
                weights = _poke(weights, poke_w[0], poke_w[1])
            indices = torch.tensor([i for bag in bags for i in bag], dtype=idx_dtype)
            offsets = _offsets([len(bag) for bag in bags], idx_dtype)
            x = dict(weights=weights.to(device), indices=indices.to(device), offsets=offsets.to(device))
            if psw:
                w = _rand(g, indices.numel())
                if poke_psw is not None:
                    w = _poke(w, poke_psw[0], poke_psw[1])
                x["psw"] = w.to(device)
            return x
        return make

    def meta(tables, device):
        return gk.pack_tables([r for r, _ in tables], [d for _, d in tables]).meta(device)

    def eb_call(pooling, bounds_check="fatal", tables=TABLES):
        def call(x, backend):
            dims = [d for _, d in tables]
            out_dim = dims[0] if pooling == "none" else sum(dims)
            return gk.embedding_bag(x["weights"], meta(tables, x["weights"].device), x["indices"], x["offsets"],
                                    x.get("psw"), output_dim=out_dim, pooling=pooling, bounds_check=bounds_check,
                                    backend=backend)
        return call

    def eb_oracle(pooling, tables=TABLES):
        def oracle(x):
            return oracle_embedding_bag(_ebc_tables(x["weights"], tables), x["indices"], x["offsets"], x.get("psw"),
                                        pooling)
        return oracle

    same_dim = ((5, 4), (7, 4))
    for dtype in (F32, F16, BF16):
        for pooling in ("sum", "mean", "none"):
            tables = same_dim if pooling == "none" else TABLES
            edges = {
                "basic": {}, "int32": dict(idx_dtype=torch.int32), "all_empty": dict(bags=((), (), (), ())),
                "B0": dict(bags=(), B=0), "duplicates": dict(bags=((1, 1, 1), (1,), (3, 3), (3,))),
                "weights_nan": dict(poke_w=(4, NAN)), "weights_inf": dict(poke_w=(20, -INF)),
                "one_table": dict(tables=tables[:1], bags=((0, 2), (), (4,))),
            }
            if True:  # mean + per-sample weights = weighted sum / bag length (FBGEMM TBE)
                edges["psw"] = dict(psw=True)
                edges["psw_nan"] = dict(psw=True, poke_psw=(2, NAN))
                edges["psw_inf"] = dict(psw=True, poke_psw=(0, INF))
            for edge, kw in edges.items():
                tb = kw.pop("tables", tables)
                name = f"embedding_bag/{pooling}/{edge}/{_dt(dtype)}"
                grad = ("weights",) + (("psw",) if kw.get("psw") else ())
                add(Case(name, "value", eb_make(dtype=dtype, tables=tb, name=name, **kw), eb_call(pooling, tables=tb),
                         oracle=eb_oracle(pooling, tb), grad=grad))
            # bounds_check warn/skip: out-of-range ids dropped, like the batch without them
            for check in ("warn", "skip"):
                bad_bags = ((0, 5, 4), (-1,), (), (6, 7, 2**31 + 3)) if pooling != "none" else (
                    (0, 5, 3), (-1,), (), (6, 7, 2))
                name = f"embedding_bag/{pooling}/bounds_{check}/{_dt(dtype)}"
                add(Case(name, "value", eb_make(bags=bad_bags, dtype=dtype, tables=tables, name=name, psw=True),
                         eb_call(pooling, check, tables), oracle=eb_oracle(pooling, tables), grad=("weights", "psw")))

    def bad_eb(edge, change, names, pooling="sum", bounds_check="fatal", **call_kw):
        name = f"embedding_bag/bad/{edge}"
        base = eb_make(name=name)

        def make(device):
            x = base(device)
            w_off, d_off, r_off = meta(TABLES, device)
            x.update(w_off=w_off, d_off=d_off, r_off=r_off, output_dim=7, pooling=pooling, bounds_check=bounds_check,
                     kw=dict(call_kw))
            x.update(change(x, device))
            return x

        def call(x, backend):
            return gk.embedding_bag(x["weights"], gk.TableMeta(x["w_off"], x["d_off"], x["r_off"]), x["indices"],
                                    x["offsets"], x.get("psw"), output_dim=x["output_dim"], pooling=x["pooling"],
                                    bounds_check=x["bounds_check"], backend=backend, **x["kw"])
        add(Case(name, "bad", make, call, names=names))

    bad_eb("index_high", lambda x, d: dict(indices=_poke(x["indices"], 1, 5)), ("indices", "index", "table"))
    bad_eb("index_neg", lambda x, d: dict(indices=_poke(x["indices"], 0, -1)), ("indices", "index", "table"))
    bad_eb("index_huge", lambda x, d: dict(indices=_poke(x["indices"], 4, 2**62)), ("indices", "index", "table"))
    bad_eb("indices_float", lambda x, d: dict(indices=x["indices"].float()), ("indices",))
    bad_eb("indices_2d", lambda x, d: dict(indices=x["indices"][None]), ("indices",))
    # int32 offsets with int64 indices are valid (FBGEMM mixes them; cast once at the front door): a float is not.
    bad_eb("offsets_float", lambda x, d: dict(offsets=x["offsets"].float()), ("offsets",))
    bad_eb("offsets_not_TB", lambda x, d: dict(offsets=x["offsets"][:4]), ("offsets",))
    bad_eb("offsets_decreasing", lambda x, d: dict(offsets=torch.tensor([0, 3, 2, 4, 7], device=d)), ("offsets",))
    bad_eb("offsets_last", lambda x, d: dict(offsets=torch.tensor([0, 3, 4, 4, 9], device=d)), ("offsets",))
    bad_eb("offsets_first", lambda x, d: dict(offsets=torch.tensor([1, 3, 4, 4, 7], device=d)), ("offsets",))
    bad_eb("psw_length", lambda x, d: dict(psw=torch.ones(3, device=d)), ("per_sample_weights",))
    bad_eb("psw_int", lambda x, d: dict(psw=torch.ones(7, dtype=torch.int64, device=d)), ("per_sample_weights",))
    bad_eb("pooling", lambda x, d: dict(pooling="max"), ("pooling",))
    bad_eb("bounds_check", lambda x, d: dict(bounds_check="ignore"), ("bounds_check",))
    bad_eb("output_dim_wrong", lambda x, d: dict(output_dim=8), ("output_dim",))
    bad_eb("output_dim_2^63", lambda x, d: dict(output_dim=2**63), ("output_dim",))
    bad_eb("output_dim_float", lambda x, d: dict(output_dim=7.0), ("output_dim",))
    bad_eb("weights_2d", lambda x, d: dict(weights=x["weights"][None]), ("weights",))
    bad_eb("weights_noncontig", lambda x, d: dict(weights=torch.randn(94, device=d)[::2]), ("weights",))
    bad_eb("weights_int", lambda x, d: dict(weights=x["weights"].long()), ("weights",))
    bad_eb("weights_too_small", lambda x, d: dict(weights=x["weights"][:40]), ("weights", "table"))
    bad_eb("w_off_int32", lambda x, d: dict(w_off=x["w_off"].int()), ("weights_offsets",))
    bad_eb("d_off_len", lambda x, d: dict(d_off=x["d_off"][:2]), ("D_offsets",))
    bad_eb("d_off_zero_dim", lambda x, d: dict(d_off=torch.tensor([0, 3, 3], device=d), output_dim=3),
           ("D_offsets", "table"))
    bad_eb("r_off_decreasing", lambda x, d: dict(r_off=torch.tensor([0, 5, 4], device=d)), ("rows_offsets", "table"))
    bad_eb("w_off_overlap", lambda x, d: dict(w_off=torch.tensor([0, 3], device=d)), ("weights_offsets", "table"))
    bad_eb("w_off_negative", lambda x, d: dict(w_off=torch.tensor([-15, 15], device=d)), ("weights_offsets", "table"))
    bad_eb("optimizer_str", lambda x, d: dict(kw=dict(optimizer="sgd")), ("optimizer",))
    bad_eb("optimizer_no_step", lambda x, d: dict(kw=dict(optimizer=gk.optim.ExactSGD())), ("step",))
    bad_eb("adagrad_state_len", lambda x, d: dict(kw=dict(
        optimizer=gk.optim.ExactRowwiseAdagrad(), momentum1=torch.zeros(3, device=d),
        step=torch.zeros((), dtype=torch.int64, device=d))), ("momentum1",))
    bad_eb("adam_state_dtype", lambda x, d: dict(kw=dict(
        optimizer=gk.optim.ExactAdam(), momentum1=torch.zeros(43, dtype=torch.float64, device=d),
        momentum2=torch.zeros(43, device=d), step=torch.zeros((), dtype=torch.int64, device=d))), ("momentum1",))
    bad_eb("step_float", lambda x, d: dict(kw=dict(optimizer=gk.optim.ExactSGD(), step=torch.zeros((), device=d))),
           ("step",))

    # Optimizer configs
    for cls, field_, value in [
        (gk.optim.ExactSGD, "lr", NAN), (gk.optim.ExactSGD, "lr", INF), (gk.optim.ExactSGD, "lr", 0.0),
        (gk.optim.ExactSGD, "weight_decay", NAN), (gk.optim.ExactSGD, "weight_decay", -1.0),
        (gk.optim.ExactRowwiseAdagrad, "lr", NAN), (gk.optim.ExactRowwiseAdagrad, "eps", NAN),
        (gk.optim.ExactRowwiseAdagrad, "eps", INF), (gk.optim.ExactRowwiseAdagrad, "lr", "0.1"),
        (gk.optim.ExactAdam, "lr", -INF), (gk.optim.ExactAdam, "eps", NAN), (gk.optim.ExactAdam, "betas", 0.9),
        (gk.optim.ExactAdam, "betas", (0.9, NAN)), (gk.optim.ExactAdam, "betas", (1.0, 0.9)),
        (gk.optim.ExactAdam, "betas", (0.9,)), (gk.optim.ExactAdam, "weight_decay", INF),
    ]:
        name = f"optim/bad/{cls.__name__}.{field_}={value!r}"
        add(Case(name, "bad", lambda d: {}, lambda x, b, cls=cls, f=field_, v=value: cls(**{f: v}),
                 names=(field_,), backends=("reference",)))

    # FusedEmbeddingBag module: the same bags through the module on every optimizer, then one
    # backward after several forwards sharing the weights (each forward's update applies once).
    def module_case(opt_name, dtype, forwards):
        name = f"FusedEmbeddingBag/{opt_name}/{forwards}_forwards/{_dt(dtype)}"
        opts = dict(none=None, sgd=gk.optim.ExactSGD(lr=0.1), sgd_wd=gk.optim.ExactSGD(lr=0.1, weight_decay=0.01),
                    adagrad=gk.optim.ExactRowwiseAdagrad(lr=0.1), adam=gk.optim.ExactAdam(lr=0.1))
        batches = [((0, 4, 4), (1,), (), (6, 0, 2)), ((4,), (0, 0), (2, 2), ()), ((3,), (), (1,), (6,))][:forwards]

        def make(device):
            return dict(device=device, dtype=dtype)

        def run(x, backend):
            ebc = _ebc(x["device"], x["dtype"], optimizer=opts[opt_name], backend=backend, seed=_seed(name))
            outs = []
            for bags in batches:
                idx = torch.tensor([i for bag in bags for i in bag], device=x["device"])
                off = _offsets([len(bag) for bag in bags], device=x["device"])
                outs.append(ebc(idx, off))
            g = torch.Generator().manual_seed(_seed(name) + 7)
            loss = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)
            loss.backward()
            after = ebc.weights.detach() if opts[opt_name] is not None else ebc.weights.grad.detach()
            state = torch.cat([ebc.momentum1, ebc.momentum2, ebc.step.float().view(1)]).to(after.dtype)
            return torch.cat([torch.cat([o.detach().flatten() for o in outs]), after, state])
        add(Case(name, "value", make, run, target="reference"))

    for opt_name in ("none", "sgd", "sgd_wd", "adagrad", "adam"):
        for dtype in (F32, BF16):
            for forwards in (1, 3):
                module_case(opt_name, dtype, forwards)

    # from_embedding_bags with bad tables
    def bags_case(edge, bags_fn, names, kw=None):
        add(Case(f"from_embedding_bags/bad/{edge}", "bad", lambda d: dict(bags=bags_fn(d)),
                 lambda x, b, kw=kw or {}: gk.FusedEmbeddingBag.from_embedding_bags(x["bags"], backend=b, **kw),
                 names=names))

    E = torch.nn.EmbeddingBag
    bags_case("empty_list", lambda d: [], ("bags",))
    bags_case("not_bags", lambda d: [torch.nn.Linear(2, 2)], ("bags",))
    bags_case("embedding_not_bag", lambda d: [torch.nn.Embedding(3, 2)], ("bags",))
    bags_case("mode_max", lambda d: [E(4, 2, mode="max", device=d)], ("bags", "mode"))
    bags_case("modes_mixed", lambda d: [E(4, 2, mode="sum", device=d), E(4, 2, mode="mean", device=d)],
              ("bags", "mode"))
    bags_case("dtype_mixed", lambda d: [E(4, 2, device=d), E(4, 2, device=d, dtype=torch.float16)],
              ("bags", "dtype"))
    bags_case("dtype_f64", lambda d: [E(4, 2, device=d, dtype=torch.float64)], ("dtype",))
    bags_case("max_norm", lambda d: [E(4, 2, max_norm=1.0, device=d)], ("max_norm",))
    bags_case("padding_idx", lambda d: [E(4, 2, padding_idx=0, device=d)], ("padding_idx",))
    bags_case("zero_rows", lambda d: [E(0, 2, device=d)], ("num_embeddings",))
    bags_case("zero_dim", lambda d: [E(4, 0, device=d)], ("embedding_dim",))
    bags_case("optimizer_str", lambda d: [E(4, 2, device=d)], ("optimizer",), dict(optimizer="adam"))
    bags_case("bounds_check", lambda d: [E(4, 2, device=d)], ("bounds_check",), dict(bounds_check="none"))

    def from_bags_value(edge, bags_fn, psw=False):
        name = f"from_embedding_bags/{edge}"

        def make(device):
            torch.manual_seed(_seed(name))
            return dict(bags=bags_fn(device), device=device)

        def run(x, backend):
            bags = x["bags"]
            fused = gk.FusedEmbeddingBag.from_embedding_bags(bags, backend=backend)
            g = _gen(name)
            idx_t = [torch.randint(0, b.num_embeddings, (5,), generator=g) for b in bags]
            idx = torch.cat(idx_t).to(x["device"])
            lens = [2, 0, 3]
            off = _offsets(lens * len(bags), device=x["device"])
            out = fused(idx, off)
            ref = torch.cat([b(t.to(x["device"]), _offsets(lens, device=x["device"])[:-1]) for b, t in zip(bags, idx_t)],
                            1)
            torch.testing.assert_close(out, ref, equal_nan=True, **dict(zip(("atol", "rtol"), TOL[out.dtype])))
            return out
        add(Case(name, "value", make, run, target="reference"))

    from_bags_value("sum", lambda d: [E(5, 3, mode="sum", device=d), E(9, 2, mode="sum", device=d)])
    from_bags_value("mean", lambda d: [E(5, 3, mode="mean", device=d)])
    from_bags_value("nan_row", lambda d: [_with_nan_row(E(5, 3, mode="sum", device=d))])
    from_bags_value("bf16", lambda d: [E(5, 3, mode="sum", device=d, dtype=BF16)])

    # state_dict round trips, with bad tables loaded
    def state_case(edge, change, names):
        name = f"state_dict/bad/{edge}"

        def make(device):
            return dict(device=device)

        def call(x, backend):
            src = _ebc(x["device"], optimizer=gk.optim.ExactRowwiseAdagrad(), backend=backend)
            sd = src.state_dict()
            change(sd)
            dst = _ebc(x["device"], optimizer=gk.optim.ExactRowwiseAdagrad(), backend=backend, seed=1)
            dst.load_state_dict(sd)
            return dst.weights
        add(Case(name, "bad", make, call, names=names, errors=(RuntimeError,)))

    state_case("weights_short", lambda sd: sd.update(weights=sd["weights"][:-1]), ("weights",))
    state_case("weights_2d", lambda sd: sd.update(weights=sd["weights"][None]), ("weights",))
    state_case("momentum1_long", lambda sd: sd.update(momentum1=torch.zeros(13)), ("momentum1",))
    state_case("missing_step", lambda sd: sd.pop("step"), ("step",))
    state_case("extra_key", lambda sd: sd.update(bogus=torch.zeros(1)), ("bogus",))
    state_case("adam_state_into_adagrad", lambda sd: sd.update(momentum1=torch.zeros(43)), ("momentum1",))

    def state_value(edge, change, opt=None):
        name = f"state_dict/{edge}"

        def make(device):
            return dict(device=device)

        def run(x, backend):
            src = _ebc(x["device"], optimizer=opt, backend=backend, seed=_seed(name))
            sd = src.state_dict()
            change(sd)
            dst = _ebc(x["device"], optimizer=opt, backend=backend, seed=_seed(name) + 1)
            dst.load_state_dict(sd)
            idx = torch.tensor([0, 4, 4, 1, 6, 0, 2], device=x["device"])
            off = torch.tensor([0, 3, 4, 4, 7], device=x["device"])
            out = dst(idx, off)
            out.sum().backward()
            return torch.cat([out.detach().flatten(), dst.weights.detach(), dst.momentum1, dst.momentum2,
                              dst.step.view(1).float()])
        add(Case(name, "value", make, run, target="reference"))

    state_value("round_trip", lambda sd: None)
    state_value("round_trip_adam", lambda sd: None, gk.optim.ExactAdam(lr=0.1))
    state_value("nan_weights", lambda sd: sd["weights"].__setitem__(3, NAN), gk.optim.ExactSGD(lr=0.1))
    state_value("inf_weights", lambda sd: sd["weights"].__setitem__(20, INF), gk.optim.ExactRowwiseAdagrad(lr=0.1))
    state_value("f64_weights_cast", lambda sd: sd.update(weights=sd["weights"].double()))

    # TableSpec / module constructor
    for edge, spec, names in [
        ("rows0", (0, 3), ("num_embeddings",)), ("dim_neg", (4, -1), ("embedding_dim",)),
        ("rows_float", (4.0, 3), ("num_embeddings",)), ("rows_2^63", (2**63, 3), ("num_embeddings",)),
        ("dim_2^64", (3, 2**64), ("embedding_dim",)), ("size_overflow", (2**40, 2**40), ("num_embeddings",
                                                                                       "embedding_dim")),
    ]:
        add(Case(f"TableSpec/bad/{edge}", "bad", lambda d: {},
                 lambda x, b, spec=spec: gk.FusedEmbeddingBag([gk.TableSpec(*spec)], device="meta"),
                 names=names, backends=("reference",)))
    for edge, kw, names in [
        ("pooling", dict(pooling="max"), ("pooling",)), ("dtype", dict(dtype=torch.float64), ("dtype",)),
        ("optimizer", dict(optimizer=torch.optim.SGD), ("optimizer",)), ("tables_empty", dict(tables=[]), ("tables",)),
        ("tables_tuples", dict(tables=[(4, 3)]), ("tables",)),
        ("none_pooling_dims", dict(pooling="none", tables=[gk.TableSpec(4, 3), gk.TableSpec(4, 2)]),
         ("embedding_dim",)),
    ]:
        add(Case(f"FusedEmbeddingBag/bad/{edge}", "bad", lambda d: dict(device=d),
                 lambda x, b, kw=kw: gk.FusedEmbeddingBag(**{"tables": [gk.TableSpec(4, 3)], **kw},
                                                          device=x["device"], backend=b),
                 names=names))


def _with_nan_row(bag):
    with torch.no_grad():
        bag.weight[2, 1] = NAN
    return bag
