"""Bench of ``gk.swap`` on models this package did not build: TorchRec's own DLRM, and an
``nn.TransformerEncoder`` over padded user histories.

DLRM training step (issue 14): 26 tables with the Criteo Kaggle row counts capped to fit this
machine (``ROW_CAP``), dim D, B = 2048, bags of 20 ids (RandomRecDataset: its minimum bag length
defaults to ids_per_feature; the case's shape gives the measured mean), 13 dense features, random
labels, dense arch [128, D], over arch [256, 1]; BCE loss. Impls of one step (forward,
backward, optimizer):
  torchrec_adagrad  TorchRec as the user has it: the unsharded EmbeddingBagCollection, dense
                    gradients, torch.optim.Adagrad on every parameter (the speedup baseline);
  torchrec_dmp      TorchRec's fused path: DistributedModelParallel on one process (gloo), FBGEMM's
                    TBE with fused row-wise Adagrad for the tables, TorchRec's RowWiseAdagrad for the
                    tables the planner shards data-parallel, Adagrad for the rest;
  swap_rowwise      gk.swap(model, optimizer=gk.optim.ExactRowwiseAdagrad): the tables update in the
                    backward, torch.optim.Adagrad on the dense parameters;
  swap_none         gk.swap(model) (optimizer=None): torch.optim.Adagrad on every parameter.
The same impls are timed per component (sparse arch forward+backward+update; interaction
forward+backward) so the step's time can be attributed. Each of these cases verifies every impl
before timing it, from fresh models with the same weights, by FlashAttention's rule against the
baseline's step run in float64 (at most twice the baseline's own error): the first step's loss (or
pooled embeddings), the gradients of the dense parameters and, for the tables, their gradients
(Adagrad impls) or their updated rows (row-wise impls: against FBGEMM's row-wise rule applied to the
baseline's table gradients), plus a sample of untouched rows, which must not move. The row-wise
impls start from a row-wise state of WARM_MOMENTUM (their first step from zero state, lr * g / rms(g)
per row, is not Lipschitz in the gradient); the element-wise Adagrad impls' updated weights are not
compared (their first step is lr * sign(g) wherever |g| >> eps), their gradients are.

Encoder: 2 layers of nn.TransformerEncoderLayer (d_model 64, 4 heads, FF 128, dropout 0,
batch_first) over B = 64 histories padded to L = 256, end padding at 30 % and 60 % density plus the
causal mask; forward+backward, eager vs swapped (the attention core on the jagged rows). Outputs
compared at valid positions (the swapped module writes zeros at padded ones).

Loss curves of the same DLRM trained by every impl: bench/swap_loss.py (``python -m bench.swap_loss``).
"""

from __future__ import annotations

import copy
import os
import socket
from typing import Callable, Iterator

import torch
from torch import nn

import gem_kernels as gk

from .embedding_bag import rowwise_adagrad_rows_
from .harness import Case, SkipFamily, log, rotate

# Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features.
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
ROW_CAP = {False: 100_000, True: 5_000}
DIM = {False: 64, True: 16}
BATCH = {False: 2048, True: 256}
IDS_PER_FEATURE = 20  # RandomRecDataset: bag lengths uniform in [min_ids_per_feature, 20], the min defaulting to 20
NUM_DENSE = 13
LR = 0.01  # 0.05 made the dense Adagrad overshoot (loss ~270 at step 3 in the 16:41 run)
EPS = 1e-8
# The row-wise impls' state at the verified step (see the docstring): about the mean squared gradient
# of a touched table row here (measured: row rms median 1.3e-4 in --quick, 1.5e-5 in the full run).
WARM_MOMENTUM = 1e-9
# The whole timed family in a few minutes; bench/__main__.py reads this.
FAMILY_BUDGET = {False: 600.0, True: 24.0}


def _tables(quick: bool):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM[quick], num_embeddings=min(rows, ROW_CAP[quick]),
                               feature_names=[f"f{i}"]) for i, rows in enumerate(CRITEO_ROWS)]


def _dlrm(quick: bool, device: torch.device):
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=_tables(quick), device=device)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[128, DIM[quick]],
                over_arch_layer_sizes=[256, 1], dense_device=device)


def _dataset(quick: bool, count: int, generated: int):
    from torchrec.datasets.random import RandomRecDataset

    rows = [min(r, ROW_CAP[quick]) for r in CRITEO_ROWS]
    return RandomRecDataset(keys=[f"f{i}" for i in range(len(rows))], batch_size=BATCH[quick], hash_sizes=rows,
                            ids_per_feature=IDS_PER_FEATURE, num_dense=NUM_DENSE, manual_seed=0,
                            num_batches=count, num_generated_batches=generated)


def _batches(quick: bool, count: int, device: torch.device) -> list:
    return [b.to(device) for b in _dataset(quick, count, count)]


def _step(model, optimizers, batch) -> float:
    logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.to(logits.dtype))
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()
    for o in optimizers:
        o.step()
    return loss.detach()


def _swapped(model, optimizer, lr: float = LR):
    model = copy.deepcopy(model)
    report = gk.swap(model, optimizer=optimizer)
    fused = set(report.fused_parameters)
    params = [p for n, p in model.named_parameters() if n not in fused]
    return model, [torch.optim.Adagrad(params, lr=lr)], report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dmp(quick: bool, device: torch.device, state_dict):
    """TorchRec DistributedModelParallel on this one process: FBGEMM TBE, fused row-wise Adagrad."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=0, world_size=1)
    model = _dlrm(quick, torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": LR, "eps": EPS})
    dmp = DistributedModelParallel(model, device=device)
    dmp.load_state_dict(state_dict)
    # The planner shards small tables data-parallel, and those get no optimizer in the backward
    # (only the fused TBE tables do): they need one of their own, the same row-wise rule, else they
    # never train (the verification caught exactly that). The optimizers: [dense, data-parallel tables].
    fused = set(dmp.fused_optimizer.params)
    tables = {n: p for n, p in dmp.named_parameters() if ".embedding_bags." in n}
    dense = [p for n, p in dmp.named_parameters() if n not in tables]
    data_parallel = [p for n, p in tables.items() if n not in fused]
    return dmp, [torch.optim.Adagrad(dense, lr=LR)] + ([RowWiseAdagrad(data_parallel, lr=LR, eps=EPS)]
                                                        if data_parallel else [])


def _warm_rowwise(name: str, model, optimizers) -> None:
    """Start a row-wise impl's table state at WARM_MOMENTUM: the fused collection's momentum1
    (swap_rowwise), or DMP's fused optimizer state (views of FBGEMM's TBE state, TorchRec's
    "<table>.momentum1") and the data-parallel tables' RowWiseAdagrad."""
    with torch.no_grad():
        if name == "swap_rowwise":
            for module in model.modules():
                if isinstance(getattr(module, "momentum1", None), torch.Tensor):
                    module.momentum1.fill_(WARM_MOMENTUM)
            return
        for state in model.fused_optimizer.state.values():
            for key, value in state.items():
                if key.endswith("momentum1"):
                    for shard in value.local_shards():
                        shard.tensor.fill_(WARM_MOMENTUM)
        for optimizer in optimizers[1:]:
            for p in (p for group in optimizer.param_groups for p in group["params"]):
                optimizer.state[p]["sum"] = torch.full_like(p, WARM_MOMENTUM)


TABLE_PARAM = "sparse_arch.embedding_bag_collection.embedding_bags.t{}.weight"
ROWWISE = ("torchrec_dmp", "swap_rowwise")  # impls whose tables follow FBGEMM's row-wise Adagrad


def _fresh_models(quick: bool, device: torch.device, notes: list[str]) -> dict:
    """name -> (model, optimizers), every model with the same initial weights (_dlrm seeds), the
    row-wise impls from WARM_MOMENTUM."""
    base = _dlrm(quick, device)
    models = {"torchrec_adagrad": (base, [torch.optim.Adagrad(base.parameters(), lr=LR)])}
    try:
        models["torchrec_dmp"] = _dmp(quick, device, base.state_dict())
    except Exception as exc:  # reported, the other impls still run
        notes.append(f"torchrec_dmp not timed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    for name, optimizer in (("swap_rowwise", gk.optim.ExactRowwiseAdagrad(lr=LR, eps=EPS)), ("swap_none", None)):
        model, optimizers, report = _swapped(base, optimizer)
        log(f"[swap] {name}: " + "; ".join(f"{p} {o} -> {n}" for p, o, n in report.replaced))
        models[name] = (model, optimizers)
    for name in ROWWISE:
        if name in models:
            _warm_rowwise(name, *models[name])
    return models


def _module(name: str, model):
    return model.module if name == "torchrec_dmp" else model


def _table(model, t: int) -> torch.Tensor:
    weight = model.state_dict()[TABLE_PARAM.format(t)]
    if hasattr(weight, "local_shards"):  # DMP on one process: one shard holds the whole table
        (shard,) = weight.local_shards()
        weight = shard.tensor
    return weight.detach()


def _table_grad(module, t: int) -> torch.Tensor:
    params = dict(module.named_parameters())
    name = TABLE_PARAM.format(t)
    if name in params:
        grad = params[name].grad
    else:  # gk's collection packs the tables into one parameter: table t's slice of its gradient
        ebc = module.sparse_arch.embedding_bag_collection
        layout = ebc.layout
        start, rows, dim = layout.weights_offsets[t], layout.rows[t], layout.dims[t]
        grad = ebc.weights.grad[start:start + rows * dim].view(rows, dim)
    return grad.to_dense() if grad.is_sparse else grad


def _touched(batch, num_rows: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per table: the row ids the batch looks up, and a sample of ids it does not (they must not move)."""
    features = batch.sparse_features.to_dict()
    touched, untouched = [], []
    for t, rows in enumerate(num_rows):
        ids = features[f"f{t}"].values().unique()
        touched.append(ids)
        free = torch.ones(rows, dtype=torch.bool, device=ids.device)
        free[ids] = False
        untouched.append(free.nonzero().flatten()[:64])
    return touched, untouched


def _rowwise_rows(initial: list[torch.Tensor], table_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Touched rows after FBGEMM's row-wise Adagrad from WARM_MOMENTUM, given their initial values and
    gradients (either dtype)."""
    rows = []
    for w0, g in zip(initial, table_grads):
        w, momentum = w0.clone(), torch.full((w0.shape[0],), WARM_MOMENTUM, dtype=w0.dtype, device=w0.device)
        rowwise_adagrad_rows_(w, momentum, torch.arange(w0.shape[0], device=w0.device), g, LR, EPS)
        rows.append(w)
    return rows


def _state_readers(models: dict, batch, dense: bool) -> tuple[dict, Callable[[Callable], dict]]:
    """(name -> reader of what the verification step changed, state(model) of a float64 run). Adagrad
    impls: the gradients of the dense parameters (``dense``) and of the touched table rows; row-wise
    impls: the dense gradients and the updated rows. The baseline's reader also gives the row-wise
    update of its own table gradients (FBGEMM's EXACT_ROWWISE_ADAGRAD from WARM_MOMENTUM), which the
    row-wise impls' rows must match. Updated rows under element-wise Adagrad are not compared: its
    first step is lr * sign(g), which float noise flips where g is near zero."""
    base = models["torchrec_adagrad"][0]
    touched, untouched = _touched(batch, [_table(base, t).shape[0] for t in range(len(CRITEO_ROWS))])
    initial = [_table(base, t)[rows].clone() for t, rows in enumerate(touched)]
    initial_free = [_table(base, t)[rows].clone() for t, rows in enumerate(untouched)]

    def state_of(name, model) -> dict:
        module = _module(name, model)
        params = dict(module.named_parameters())
        state = {"untouched rows": [_table(model, t)[rows].clone() for t, rows in enumerate(untouched)]}
        if dense:
            state["dense grads"] = {n: p.grad.clone() for n, p in params.items()
                                    if not n.startswith("sparse_arch.") and p.grad is not None}
        if name in ROWWISE:
            state["rows (row-wise Adagrad)"] = [_table(model, t)[rows].clone() for t, rows in enumerate(touched)]
            return state
        state["table grads"] = [_table_grad(module, t)[rows].clone() for t, rows in enumerate(touched)]
        if name == "torchrec_adagrad":  # the baseline: the expectations of the row-wise impls
            state["untouched rows"] = [w.to(state["table grads"][0].dtype) for w in initial_free]
            state["rows (row-wise Adagrad)"] = _rowwise_rows([w.to(g.dtype) for w, g in
                                                              zip(initial, state["table grads"])], state["table grads"])
        return state

    readers = {name: (lambda name=name, model=model: state_of(name, model)) for name, (model, _) in models.items()}
    return readers, lambda model: state_of("torchrec_adagrad", model)


def _baseline_fp64(initial: dict, quick: bool, device: torch.device, step: Callable, state_of: Callable):
    """The baseline's verified call in float64: a fresh DLRM from ``initial`` (the untrained
    state_dict) in float64, ``step(model)`` (its output), then ``state_of(model)``."""
    model = _dlrm(quick, device)
    model.load_state_dict(initial)
    model.double()
    out = step(model)
    return out, state_of(model)


def _double(batch):
    """A TorchRec Batch with float64 dense features (ids and labels as they are)."""
    return type(batch)(dense_features=batch.dense_features.double(), sparse_features=batch.sparse_features,
                       labels=batch.labels)


def _dlrm_cases(quick: bool, device: torch.device) -> Iterator[Case]:
    try:
        import torchrec  # noqa: F401
    except ImportError as exc:
        raise SkipFamily(f"torchrec is not installed ({exc})") from exc
    try:
        gk.torchrec.FusedEmbeddingBagCollection  # noqa: B018
    except (ImportError, AttributeError) as exc:
        raise SkipFamily(f"gem_kernels.torchrec is not available ({type(exc).__name__}: {exc})") from exc

    batches = _batches(quick, 4, device)
    notes = ["loss curves: python -m bench.swap_loss --loss-steps 100 (bench/results/swap-loss-<device>.md)"]
    models = _fresh_models(quick, device, notes)
    initial = {k: v.clone() for k, v in models["torchrec_adagrad"][0].state_dict().items()}
    rows = sum(t.num_embeddings for t in _tables(quick))
    lookups = sum(b.sparse_features.values().numel() for b in batches) // len(batches)
    shape = (f"B={BATCH[quick]}, 26 tables, {rows / 1e6:.2f}M rows x D={DIM[quick]}, "
             f"{lookups / BATCH[quick] / 26:.1f} ids/bag")
    args = [(b,) for b in batches]
    readers, state_fp64 = _state_readers(models, batches[0], dense=True)
    yield Case(op="DLRM train step", shape=shape, dtype=torch.float32, flops=0, bytes=0,
               impls={name: rotate(args, lambda b, m=m, o=o: _step(m, o, b)) for name, (m, o) in models.items()},
               baseline="torchrec_adagrad", notes=notes, reference="torchrec_adagrad", examples=BATCH[quick],
               state=readers, fp64=lambda: _baseline_fp64(initial, quick, device,
                                                           lambda m: _step(m, [], _double(batches[0])), state_fp64))

    def sparse_step(model, optimizers, batch, grad):
        out = model.sparse_arch(batch.sparse_features)
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        out.backward(grad)
        for o in optimizers:
            o.step()
        return out.detach()

    grads = [torch.randn(BATCH[quick], 26, DIM[quick], device=device) for _ in batches]
    # Fresh models again: the train-step case's timing moved each impl's weights its own way.
    models = _fresh_models(quick, device, [])
    initial = {k: v.clone() for k, v in models["torchrec_adagrad"][0].state_dict().items()}
    readers, state_fp64 = _state_readers(models, batches[0], dense=False)
    sparse_opts = {}
    for name, (model, _) in models.items():
        module = model.module if name == "torchrec_dmp" else model
        table_params = [p for n, p in module.sparse_arch.named_parameters()]
        if name == "torchrec_dmp":
            sparse_opts[name] = models[name][1][1:]  # the data-parallel tables' optimizer, if any
        else:
            sparse_opts[name] = [] if name == "swap_rowwise" else [torch.optim.Adagrad(table_params, lr=LR)]
    yield Case(op="sparse arch fwd+bwd+update", shape=shape, dtype=torch.float32, flops=0, bytes=0,
               impls={name: rotate([(b, g) for b, g in zip(batches, grads)],
                                   lambda b, g, m=(m.module if name == "torchrec_dmp" else m), o=sparse_opts[name]:
                                   sparse_step(m, o, b, g))
                      for name, (m, _) in models.items()},
               baseline="torchrec_adagrad", reference="torchrec_adagrad", examples=BATCH[quick],
               state=readers, fp64=lambda: _baseline_fp64(initial, quick, device,
                                                           lambda m: sparse_step(m, [], batches[0], grads[0].double()),
                                                           state_fp64))

    num_f = 26
    inter_inputs = [(torch.randn(BATCH[quick], DIM[quick], device=device, requires_grad=True),
                     torch.randn(BATCH[quick], num_f, DIM[quick], device=device, requires_grad=True))
                    for _ in range(2)]
    pairs = (num_f + 1) * num_f // 2
    inter_grad = torch.randn(BATCH[quick], DIM[quick] + pairs, device=device)

    def inter_step(module, dense, sparse, grad=inter_grad):
        out = module(dense, sparse)
        return out.detach(), torch.autograd.grad(out, (dense, sparse), grad)

    eager_inter = models["torchrec_adagrad"][0].inter_arch
    fused_inter = models["swap_none"][0].inter_arch
    inter64 = copy.deepcopy(eager_inter).double()
    inputs64 = [t.detach().double().requires_grad_() for t in inter_inputs[0]]
    yield Case(op="interaction fwd+bwd", shape=f"B={BATCH[quick]}, F=27, D={DIM[quick]}", dtype=torch.float32,
               flops=0, bytes=0,
               impls={"torchrec_adagrad": rotate(inter_inputs, lambda d, s: inter_step(eager_inter, d, s)),
                      "swap_none": rotate(inter_inputs, lambda d, s: inter_step(fused_inter, d, s))},
               baseline="torchrec_adagrad", reference="torchrec_adagrad",
               fp64=lambda: inter_step(inter64, *inputs64, inter_grad.double()), examples=BATCH[quick])

    # The rest of the step: the dense and over MLPs, the same eager modules in every impl (no swap
    # touches them), timed once so that the components add up to the step.
    over_in = [torch.randn(BATCH[quick], DIM[quick] + pairs, device=device, requires_grad=True) for _ in range(2)]
    dense_in = [b.dense_features for b in batches[:2]]
    mlps = models["torchrec_adagrad"][0]
    mlp_params = [*mlps.dense_arch.parameters(), *mlps.over_arch.parameters()]

    def mlp_step(dense, over):
        loss = mlps.dense_arch(dense).sum() + mlps.over_arch(over).sum()
        return torch.autograd.grad(loss, [over, *mlp_params])

    yield Case(op="dense + over arch fwd+bwd", shape=f"B={BATCH[quick]}, 13 -> [128, {DIM[quick]}], "
                                                     f"{DIM[quick] + pairs} -> [256, 1]",
               dtype=torch.float32, flops=0, bytes=0, examples=BATCH[quick],
               impls={"all impls (eager)": rotate(list(zip(dense_in, over_in)), mlp_step)},
               baseline="all impls (eager)",
               unverified="one impl: the same eager MLPs run in every impl; timed to attribute the step")


def _encoder_cases(quick: bool, device: torch.device) -> Iterator[Case]:
    batch, length = (16, 64) if quick else (64, 256)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True, device=device)
    eager = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    swapped = copy.deepcopy(eager)
    eager64 = copy.deepcopy(eager).double()
    report = gk.swap(swapped)
    mask = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)  # causal, bool like the padding
    for density in (0.3, 0.6):
        g = torch.Generator().manual_seed(1)
        # lengths uniform in [1, 2 * density * L] (capped at L): mean density about `density`
        top = min(length, int(2 * density * length))
        arg_sets = []
        for _ in range(2):
            lengths = torch.randint(1, top + 1, (batch,), generator=g)
            pad = (torch.arange(length).unsqueeze(0) >= lengths.unsqueeze(1)).to(device)
            x = torch.randn(batch, length, 64, generator=g).to(device)
            arg_sets.append((x, pad, (~pad).unsqueeze(-1).float()))
        real = sum(int((~a[1]).sum()) for a in arg_sets) / (len(arg_sets) * batch * length)

        def fwd_bwd(model, x, pad, valid):
            out = model(x, mask=mask, src_key_padding_mask=pad, is_causal=True) * valid
            grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
            return out.detach(), grads

        before = report.fallbacks
        x0, pad0, valid0 = arg_sets[0]
        yield Case(op="TransformerEncoder fwd+bwd", shape=f"B={batch}, L={length}, density {real:.2f}, d=64, "
                                                         f"4 heads, 2 layers, causal",
                   dtype=torch.float32, flops=0, bytes=0,
                   impls={"eager": rotate(arg_sets, lambda x, p, v: fwd_bwd(eager, x, p, v)),
                          "swapped": rotate(arg_sets, lambda x, p, v: fwd_bwd(swapped, x, p, v))},
                   baseline="eager", reference="eager", examples=batch,
                   fp64=lambda: fwd_bwd(eager64, x0.double(), pad0, valid0.double()))
        if report.fallbacks != before:
            log(f"[swap] !!! the swapped encoder fell back {report.fallbacks - before} times: "
                f"{report.fallback_reasons}")


def cases(quick: bool, device: torch.device) -> Iterator[Case]:
    yield from _encoder_cases(quick, device)
    try:
        yield from _dlrm_cases(quick, device)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
