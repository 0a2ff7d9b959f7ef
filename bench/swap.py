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

Loss curves (not part of the timed family: 100 steps take minutes on a CPU):

    python -m bench.swap --loss-steps 100 [--lr 0.01] [--quick] [--out DIR] [--device cpu|cuda]

trains every impl of LOSS_BASELINES from the same weights on the same fresh batches, with no time
cap, and writes ``swap-loss-<device>.json`` and ``.md`` (per-step losses, and per impl its step-1
difference, max per-step |diff| and tail-mean difference vs its baseline, and a verdict). The
batches are RandomRecDataset's ids and dense features with labels from a planted teacher
(``teacher_labels``): a fixed random score per id of the tables TEACHER_TABLES, summed over each
bag, so the labels can be learnt, and only by training those tables (RandomRecDataset's own labels
are coin flips: every curve goes to ln 2, tables trained or not, and the rule below could not fail).
The impls and the baseline each is held to (the same update rule):
  swap_none     gk.swap(model) + torch.optim.Adagrad on every parameter  vs torchrec_adagrad;
  swap_rowwise  gk.swap(model, optimizer=ExactRowwiseAdagrad) + Adagrad on the dense parameters
                vs torchrec_rowwise (TorchRec's RowWiseAdagrad on the tables, Adagrad on the rest);
  frozen_tables the negative control: gk.swap(model), Adagrad on the dense parameters only, the
                tables never move; vs torchrec_adagrad, and it must FAIL the rule.
The rule an impl must pass:
  1. step 1 equal to fp32 rounding: |loss_1 - baseline_1| <= STEP1_RTOL * |baseline_1|. Step 1 runs
     on the initial weights for every impl, so it compares the forward alone; the fused ops sum in
     another order than torch's, nothing else differs;
  2. every loss finite (no divergence);
  3. the curve within noise: over the last TAIL_FRACTION of the steps, |mean(impl) - mean(baseline)|
     <= 2 SE, SE = sqrt(var(impl tail) / n + var(baseline tail) / n): what the batch-to-batch noise of
     n steps alone moves a tail mean by.
The run passes (exit 0) when every impl passes and the control fails. The rule, not per-step
equality: per-step equality to 1e-4 over 100 steps is not a property of two correct fp32
implementations under Adagrad. Adagrad's first step, lr * g / (|g| + eps), does not scale with |g|:
a relative rounding error r of g becomes an absolute error of about lr * r in the parameter. The
fused embedding backward sums each row's contributions in another order than torch's, and where they
nearly cancel (|g| << its terms) r is large. Measured at full size on random labels, lr 0.01, after
step 1 (whose loss and dense gradients are bit-equal): 3.3M of 54M elements differ, those with
|g| >= 1e-7 by at most 1.5e-8 (the weights' rounding), those with |g| < 1e-9 by up to 3.6e-4
(0.04 lr). The trajectories then separate: the first element off by more than lr / 2 appears at
step 4, hundreds by step 12, and the per-step loss difference grows to ~1e-3, within the noise of
the tail means.
"""

from __future__ import annotations

import copy
import os
import socket
import time
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
# Loss-curve rule (see the module docstring).
STEP1_RTOL = 1e-5  # fp32 forward in another summation order; measured ~1e-7
TAIL_FRACTION = 0.2
# impl -> the baseline with its update rule (see the docstring); frozen_tables is the negative control.
LOSS_BASELINES = {"swap_none": "torchrec_adagrad", "swap_rowwise": "torchrec_rowwise",
                  "frozen_tables": "torchrec_adagrad"}
NEGATIVE_CONTROL = "frozen_tables"
# The planted teacher of the loss curves: the tables of 100 to 1,000 rows (105, 305, 583, 633): more
# rows than D, so that frozen random embeddings cannot represent a per-id score, and few enough that
# B x 20 lookups per step visit each row often (each is learnt in tens of steps at lr 0.01).
TEACHER_TABLES = tuple(t for t, rows in enumerate(CRITEO_ROWS) if 100 <= rows <= 1000)
TEACHER_SCALE = 5.0  # logit = 5 z, z ~ N(0, 1): P(label = 1) mostly far from 1/2
TEACHER_SEED = 1234


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
    notes = ["loss curves: python -m bench.swap --loss-steps 100 (bench/results/swap-loss-<device>.md)"]
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


# ---------------------------------------------------------------------------------------------
# Loss curves: python -m bench.swap --loss-steps N (see the module docstring)
# ---------------------------------------------------------------------------------------------


def _param_diff(model, base, lr: float) -> dict:
    """How far ``model``'s parameters are from ``base``'s (same state_dict keys): the max |diff|, how
    many elements differ, and how many by more than lr / 2 (an Adagrad step taken with the other sign)."""
    got, want = model.state_dict(), base.state_dict()
    max_diff, differing, flipped, total = 0.0, 0, 0, 0
    for key, w in want.items():
        if not (torch.is_tensor(w) and w.is_floating_point() and key in got):
            continue
        d = (got[key].detach().float() - w.detach().float()).abs()
        max_diff = max(max_diff, float(d.max()) if d.numel() else 0.0)
        differing += int((d > 0).sum())
        flipped += int((d > lr / 2).sum())
        total += d.numel()
    return dict(max_abs_diff=max_diff, elements_differing=differing, elements_off_by_more_than_half_lr=flipped,
                elements=total)


def _curve_stats(curve: list[float], base: list[float]) -> dict:
    c, b = torch.tensor(curve, dtype=torch.float64), torch.tensor(base, dtype=torch.float64)
    diff = (c - b).abs()
    steps = len(curve)
    n = max(2, round(steps * TAIL_FRACTION))
    tail_c, tail_b = c[-n:], b[-n:]
    tail_diff = float(tail_c.mean() - tail_b.mean())
    se = float((tail_c.var() / n + tail_b.var() / n).sqrt()) if steps >= 2 else 0.0
    step1 = float(diff[0])
    checks = {
        "step1_equal_to_fp32_rounding": step1 <= STEP1_RTOL * abs(base[0]),
        "finite": bool(c.isfinite().all()),
        "tail_within_noise": abs(tail_diff) <= 2 * se,
    }
    marks = sorted({s for s in (1, 2, 3, 5, 10, 20, 50, 100, steps) if s <= steps})
    return dict(step1_abs_diff=step1, step1_bound=STEP1_RTOL * abs(base[0]), max_abs_diff=float(diff.max()),
                max_abs_diff_step=int(diff.argmax()) + 1, diff_at_steps={s: float(diff[s - 1]) for s in marks},
                tail_steps=n, tail_mean=float(tail_c.mean()), tail_mean_diff=tail_diff, tail_se=se,
                checks=checks, verdict="pass" if all(checks.values()) else "FAIL")


class Teacher:
    """Labels with a learnable signal for RandomRecDataset's batches: per table of TEACHER_TABLES a
    fixed score u_t[id] ~ N(0, 1) of every id; z = sum over those tables and over the bag of
    u_t[id], scaled to unit variance; label ~ Bernoulli(sigmoid(TEACHER_SCALE * z)). Deterministic:
    the scores and the label draws come from their own seeded generators."""

    def __init__(self, quick: bool):
        g = torch.Generator().manual_seed(TEACHER_SEED)
        self.scores = {t: torch.randn(min(CRITEO_ROWS[t], ROW_CAP[quick]), generator=g) for t in TEACHER_TABLES}
        self.draws = torch.Generator().manual_seed(TEACHER_SEED + 1)

    def __call__(self, batch):
        features = batch.sparse_features.to_dict()
        size = batch.dense_features.shape[0]
        z = torch.zeros(size)
        for t, scores in self.scores.items():
            bags = features[f"f{t}"]
            owner = torch.repeat_interleave(torch.arange(size), bags.lengths().long())
            z.index_add_(0, owner, scores[bags.values().cpu()])
        z /= (IDS_PER_FEATURE * len(self.scores)) ** 0.5
        labels = torch.bernoulli(torch.sigmoid(TEACHER_SCALE * z), generator=self.draws)
        return type(batch)(dense_features=batch.dense_features, sparse_features=batch.sparse_features,
                           labels=labels.to(batch.labels.dtype).to(batch.labels.device))


def _loss_models(quick: bool, device: torch.device, lr: float) -> tuple[dict, dict, dict]:
    """(name -> (model, optimizers), name -> what gk.swap replaced, name -> its optimizers in words):
    the impls of the loss curves, copies of one set of untrained weights."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    base = _dlrm(quick, device)
    rowwise = copy.deepcopy(base)
    tables = [p for n, p in rowwise.named_parameters() if n.startswith("sparse_arch.")]
    dense = [p for n, p in rowwise.named_parameters() if not n.startswith("sparse_arch.")]
    models = {"torchrec_adagrad": (base, [torch.optim.Adagrad(base.parameters(), lr=lr)]),
              "torchrec_rowwise": (rowwise, [torch.optim.Adagrad(dense, lr=lr), RowWiseAdagrad(tables, lr=lr, eps=EPS)])}
    words = {"torchrec_adagrad": f"torch.optim.Adagrad(lr={lr}) on every parameter",
             "torchrec_rowwise": f"TorchRec's RowWiseAdagrad(lr={lr}, eps={EPS}) on the tables, "
                                 f"torch.optim.Adagrad(lr={lr}) on the rest",
             "swap_rowwise": f"gk.optim.ExactRowwiseAdagrad(lr={lr}, eps={EPS}) in the backward (tables), "
                             f"torch.optim.Adagrad(lr={lr}) on the dense parameters",
             "swap_none": f"torch.optim.Adagrad(lr={lr}) on every parameter",
             "frozen_tables": f"torch.optim.Adagrad(lr={lr}) on the dense parameters only (negative control)"}
    reports = {}
    for name, optimizer in (("swap_rowwise", gk.optim.ExactRowwiseAdagrad(lr=lr, eps=EPS)), ("swap_none", None),
                            ("frozen_tables", None)):
        model, opts, report = _swapped(base, optimizer, lr)  # copies of the untrained weights
        if name == NEGATIVE_CONTROL:
            opts = [torch.optim.Adagrad([p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")],
                                        lr=lr)]
        models[name] = (model, opts)
        reports[name] = [f"{p}: {o} -> {n}" for p, o, n in report.replaced]
    return models, reports, words


def loss_curves(steps: int, lr: float = LR, quick: bool = False, device: torch.device | None = None) -> dict:
    """Train the baselines and impls of LOSS_BASELINES ``steps`` steps from the same weights on the
    same fresh batches (one batch drawn per step, shared, labelled by the Teacher), with no time cap;
    the result dict that main() writes."""
    device = device or torch.device("cpu")
    models, reports, words = _loss_models(quick, device, lr)
    teacher = Teacher(quick)
    curves = {name: [] for name in models}
    step1_params = {}
    started = time.perf_counter()
    for step, batch in enumerate(_dataset(quick, steps, -1)):
        batch = teacher(batch).to(device)
        for name, (model, opts) in models.items():
            curves[name].append(float(_step(model, opts, batch)))
        if step == 0:
            step1_params = {name: _param_diff(models[name][0], models[base][0], lr)
                            for name, base in LOSS_BASELINES.items()}
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"[swap loss] step {step + 1}/{steps}: " + ", ".join(f"{n} {c[-1]:.5f}" for n, c in curves.items())
                + f" ({time.perf_counter() - started:.0f} s)")
    from bench import report as bench_report

    stats = {name: _curve_stats(curves[name], curves[base]) | {"baseline": base, "step1_params": step1_params[name]}
             for name, base in LOSS_BASELINES.items()}
    return dict(
        timestamp=bench_report.utc_timestamp(), git_sha=bench_report.git_sha(), device=device.type,
        torch_threads=torch.get_num_threads(), seconds=time.perf_counter() - started,
        config=dict(steps=steps, lr=lr, quick=quick, batch=BATCH[quick], dim=DIM[quick], row_cap=ROW_CAP[quick],
                    tables=len(CRITEO_ROWS), step1_rtol=STEP1_RTOL, tail_fraction=TAIL_FRACTION,
                    teacher=dict(tables=list(TEACHER_TABLES), scale=TEACHER_SCALE, seed=TEACHER_SEED),
                    optimizers=words),
        swapped=reports, curves=curves, stats=stats, negative_control=NEGATIVE_CONTROL,
        verdict=loss_verdict(stats))


def loss_verdict(stats: dict) -> str:
    """"pass" when every impl passes its baseline's rule and the negative control fails it."""
    impls_pass = all(s["verdict"] == "pass" for name, s in stats.items() if name != NEGATIVE_CONTROL)
    control_fails = stats[NEGATIVE_CONTROL]["verdict"] == "FAIL"
    return "pass" if impls_pass and control_fails else "FAIL"


def loss_table_lines(result: dict) -> list[str]:
    cfg, curves = result["config"], result["curves"]
    lines = [f"# gk.swap DLRM loss curves ({result['device']})", "",
             f"{cfg['steps']} steps, lr {cfg['lr']}, B={cfg['batch']}, {cfg['tables']} tables (rows capped at "
             f"{cfg['row_cap']:,}) x D={cfg['dim']}, same initial weights, same fresh batch per step, no time cap; "
             f"git {result['git_sha']}, {result['timestamp']}, {result['torch_threads']} torch threads, "
             f"{result['seconds']:.0f} s.", "",
             "Rule (bench/swap.py docstring): step-1 |diff| <= "
             f"{cfg['step1_rtol']:g} x |loss|, every loss finite, and over the last {cfg['tail_fraction']:.0%} of "
             "the steps |tail-mean diff| <= 2 SE (SE of the difference of the two tail means from their "
             "step-to-step variance).", "",
             f"Labels from a planted teacher (tables {cfg['teacher']['tables']}, scale {cfg['teacher']['scale']}); "
             f"{result['negative_control']} (frozen tables) is the negative control and must FAIL. "
             f"Run verdict: **{result['verdict']}**.", "",
             "| impl | baseline | step-1 abs diff | max per-step abs diff (step) | tail mean | baseline tail mean | "
             "tail-mean diff | 2 SE | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["stats"].items():
        base_tail = s["tail_mean"] - s["tail_mean_diff"]
        expected = " (expected: FAIL)" if name == result["negative_control"] else ""
        lines.append(f"| {name} | {s['baseline']} | {s['step1_abs_diff']:.2e} | {s['max_abs_diff']:.2e} "
                     f"({s['max_abs_diff_step']}) | {s['tail_mean']:.5f} | {base_tail:.5f} | "
                     f"{s['tail_mean_diff']:+.2e} | {2 * s['tail_se']:.2e} | {s['verdict']}{expected} |")
    lines += ["", "Per-step |diff| vs the baseline growing over the steps, and the parameters after step 1:", ""]
    for name, s in result["stats"].items():
        growth = ", ".join(f"{k}: {v:.1e}" for k, v in s["diff_at_steps"].items())
        p = s["step1_params"]
        lines.append(f"- {name}: {growth}; after step 1 max |param diff| {p['max_abs_diff']:.2e}, "
                     f"{p['elements_differing']:,} of {p['elements']:,} elements differ, "
                     f"{p['elements_off_by_more_than_half_lr']:,} by > lr/2")
    lines += ["", "| step | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for i in range(len(next(iter(curves.values())))):
        lines.append(f"| {i + 1} | " + " | ".join(f"{c[i]:.6f}" for c in curves.values()) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    from bench import report as bench_report
    from bench import unwritable

    parser = argparse.ArgumentParser(prog="python -m bench.swap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss-steps", type=int, required=True, help="training steps of the loss curves")
    parser.add_argument("--lr", type=float, default=LR, help=f"Adagrad learning rate of every impl (default {LR})")
    parser.add_argument("--quick", action="store_true", help="the small DLRM of the quick bench")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: bench/results)")
    args = parser.parse_args(argv)
    if args.loss_steps < 1:
        parser.error(f"--loss-steps must be >= 1, got {args.loss_steps}")
    out = Path(args.out or bench_report.DEFAULT_OUT)
    why = unwritable(out)
    if why:
        parser.error(f"--out {out}: {why}")
    result = loss_curves(args.loss_steps, args.lr, args.quick, torch.device(args.device))
    stem = out / f"swap-loss-{result['device']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = loss_table_lines(result)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:16 + 2 * len(result["stats"])]))
    print(f"results: {stem.with_suffix('.json')}, {stem.with_suffix('.md')}")
    return 0 if result["verdict"] == "pass" else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
