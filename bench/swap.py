"""Bench of ``gk.swap`` on models this package did not build: TorchRec's own DLRM, and an
``nn.TransformerEncoder`` over padded user histories.

DLRM training step (issue 14): 26 tables with the Criteo Kaggle row counts capped to fit this
machine (``ROW_CAP``), dim D, B = 2048, bags of about 20 ids (RandomRecDataset: uniform 1..39),
13 dense features, dense arch [128, D], over arch [256, 1]; BCE loss. Impls of one step
(forward, backward, optimizer):
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
before timing it, from fresh models with the same weights: the first step's loss (or pooled
embeddings), the gradients of the dense parameters and, for the tables, their gradients (Adagrad
impls) or their updated rows (row-wise impls: against FBGEMM's row-wise rule applied to the
baseline's table gradients), plus a sample of untouched rows, which must not move. Before timing, the baseline and
swap_rowwise / swap_none train ``LOSS_STEPS`` steps from the same weights on the same batches: the
notes give their loss curves (swap_none must equal the baseline; swap_rowwise uses FBGEMM's
row-wise Adagrad, a different rule, so its curve is compared within noise).

Encoder: 2 layers of nn.TransformerEncoderLayer (d_model 64, 4 heads, FF 128, dropout 0,
batch_first) over B = 64 histories padded to L = 256, end padding at 30 % and 60 % density plus the
causal mask; forward+backward, eager vs swapped (the attention core on the jagged rows). Outputs
compared at valid positions (the swapped module writes zeros at padded ones).
"""

from __future__ import annotations

import copy
import os
import socket
import time
from typing import Iterator

import torch
from torch import nn

import gem_kernels as gk

from .harness import Case, SkipFamily, log, rotate

# Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features.
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
ROW_CAP = {False: 100_000, True: 5_000}
DIM = {False: 64, True: 16}
BATCH = {False: 2048, True: 256}
IDS_PER_FEATURE = 20  # RandomRecDataset draws bag lengths uniform in [1, 2 * 20 - 1]: mean 20
NUM_DENSE = 13
LOSS_STEPS = {False: 100, True: 10}
LOSS_SECONDS = {False: 150.0, True: 6.0}  # cap of the loss-curve run, so a busy machine still times
LR = 0.01  # 0.05 made the dense Adagrad overshoot (loss ~270 at step 3 in the 16:41 run)
# The whole family (loss curves + timing) in a few minutes; bench/__main__.py reads this.
FAMILY_BUDGET = {False: 330.0, True: 24.0}


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


def _batches(quick: bool, count: int, device: torch.device) -> list:
    from torchrec.datasets.random import RandomRecDataset

    rows = [min(r, ROW_CAP[quick]) for r in CRITEO_ROWS]
    data = RandomRecDataset(keys=[f"f{i}" for i in range(len(rows))], batch_size=BATCH[quick], hash_sizes=rows,
                            ids_per_feature=IDS_PER_FEATURE, num_dense=NUM_DENSE, manual_seed=0,
                            num_generated_batches=count)
    return [b.to(device) for _, b in zip(range(count), iter(data))]


def _step(model, optimizers, batch) -> float:
    logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()
    for o in optimizers:
        o.step()
    return loss.detach()


def _swapped(model, optimizer):
    model = copy.deepcopy(model)
    report = gk.swap(model, optimizer=optimizer)
    fused = set(report.fused_parameters)
    params = [p for n, p in model.named_parameters() if n not in fused]
    return model, [torch.optim.Adagrad(params, lr=LR)], report


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
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": LR, "eps": 1e-8})
    dmp = DistributedModelParallel(model, device=device)
    dmp.load_state_dict(state_dict)
    # The planner shards small tables data-parallel, and those get no optimizer in the backward
    # (only the fused TBE tables do): they need one of their own, the same row-wise rule, else they
    # never train (the verification caught exactly that). The optimizers: [dense, data-parallel tables].
    fused = set(dmp.fused_optimizer.params)
    tables = {n: p for n, p in dmp.named_parameters() if ".embedding_bags." in n}
    dense = [p for n, p in dmp.named_parameters() if n not in tables]
    data_parallel = [p for n, p in tables.items() if n not in fused]
    return dmp, [torch.optim.Adagrad(dense, lr=LR)] + ([RowWiseAdagrad(data_parallel, lr=LR, eps=1e-8)]
                                                        if data_parallel else [])


TABLE_PARAM = "sparse_arch.embedding_bag_collection.embedding_bags.t{}.weight"
ROWWISE = ("torchrec_dmp", "swap_rowwise")  # impls whose tables follow FBGEMM's row-wise Adagrad


def _fresh_models(quick: bool, device: torch.device, notes: list[str]) -> dict:
    """name -> (model, optimizers), every model with the same initial weights (_dlrm seeds)."""
    base = _dlrm(quick, device)
    models = {"torchrec_adagrad": (base, [torch.optim.Adagrad(base.parameters(), lr=LR)])}
    try:
        models["torchrec_dmp"] = _dmp(quick, device, base.state_dict())
    except Exception as exc:  # reported, the other impls still run
        notes.append(f"torchrec_dmp not timed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    models["swap_rowwise"] = _swapped(base, gk.optim.ExactRowwiseAdagrad(lr=LR, eps=1e-8))[:2]
    models["swap_none"] = _swapped(base, None)[:2]
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


def _state_readers(models: dict, batch, dense: bool) -> dict:
    """name -> reader of what the verification step changed. Adagrad impls: the gradients of the
    dense parameters (``dense``) and of the touched table rows; row-wise impls: the dense gradients
    and the updated rows. The baseline's reader also gives the row-wise update of its own table
    gradients (FBGEMM's EXACT_ROWWISE_ADAGRAD from zero state), which the row-wise impls must match.
    Updated rows under element-wise Adagrad are not compared: its first step is lr * sign(g), which
    float noise flips where g is near zero."""
    base = models["torchrec_adagrad"][0]
    touched, untouched = _touched(batch, [_table(base, t).shape[0] for t in range(len(CRITEO_ROWS))])
    initial = [_table(base, t)[rows].clone() for t, rows in enumerate(touched)]
    initial_free = [_table(base, t)[rows].clone() for t, rows in enumerate(untouched)]

    def reader(name, model):
        module = _module(name, model)

        def read():
            params = dict(module.named_parameters())
            state = {"untouched rows": [_table(model, t)[rows].clone() for t, rows in enumerate(untouched)]}
            if dense:
                state["dense grads"] = {n: p.grad.clone() for n, p in params.items()
                                        if not n.startswith("sparse_arch.") and p.grad is not None}
            if name in ROWWISE:
                state["rows (row-wise Adagrad)"] = [_table(model, t)[rows].clone() for t, rows in enumerate(touched)]
                return state
            state["table grads"] = [_table_grad(module, t)[rows].clone() for t, rows in enumerate(touched)]
            if name == "torchrec_adagrad":
                state["untouched rows"] = initial_free  # the expectation; its own rows are compared by the others
                rowwise = []
                for w0, g in zip(initial, state["table grads"]):
                    rowwise.append(w0 - LR * g / (g.pow(2).mean(dim=1, keepdim=True).sqrt() + 1e-8))
                state["rows (row-wise Adagrad)"] = rowwise
            return state
        return read

    return {name: reader(name, model) for name, (model, _) in models.items()}


def _loss_curves(base, swaps: dict, batches: list, quick: bool) -> list[str]:
    """Train the baseline and each swapped model the same steps on the same batches: notes."""
    models = {"torchrec_adagrad": (copy.deepcopy(base), None)} | swaps
    curves = {name: [] for name in models}
    optimizers = {name: opt or [torch.optim.Adagrad(m.parameters(), lr=LR)] for name, (m, opt) in models.items()}
    start = time.perf_counter()
    for step in range(LOSS_STEPS[quick]):
        batch = batches[step % len(batches)]
        for name, (model, _) in models.items():
            curves[name].append(float(_step(model, optimizers[name], batch)))
        if time.perf_counter() - start > LOSS_SECONDS[quick]:
            break
    steps = len(curves["torchrec_adagrad"])
    base_curve = torch.tensor(curves["torchrec_adagrad"])
    tail = max(1, steps // 10)
    notes = []
    for name, curve in curves.items():
        c = torch.tensor(curve)
        marks = ", ".join(f"{i + 1}: {c[i]:.4f}" for i in sorted({0, steps // 10, steps // 2, steps - 1}))
        text = f"loss curve {name} over {steps} steps ({marks}; mean of the last {tail} {c[-tail:].mean():.4f})"
        if name != "torchrec_adagrad":
            diff = (c - base_curve).abs()
            # Noise: how much the baseline's own loss moves between consecutive steps (batch to batch).
            noise = base_curve.diff().abs().median().item() if steps > 1 else 0.0
            text += (f"; vs baseline max |diff| {diff.max():.2e}, mean |diff| {diff.mean():.2e} (the baseline's "
                     f"step-to-step noise, median |delta|: {noise:.2e})")
        notes.append(text)
    log(f"[swap] loss curves over {steps} steps in {time.perf_counter() - start:.0f} s")
    return notes


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
    base = _dlrm(quick, device)
    rowwise = _swapped(base, gk.optim.ExactRowwiseAdagrad(lr=LR, eps=1e-8))
    none = _swapped(base, None)
    for name, (_, _, report) in (("swap_rowwise", rowwise), ("swap_none", none)):
        log(f"[swap] {name}: " + "; ".join(f"{p} {o} -> {n}" for p, o, n in report.replaced))
    notes = _loss_curves(base, {"swap_rowwise": rowwise[:2], "swap_none": none[:2]}, batches, quick)
    # Fresh models for the timing (the loss-curve run changed those above).
    models = _fresh_models(quick, device, notes)
    rows = sum(t.num_embeddings for t in _tables(quick))
    lookups = sum(b.sparse_features.values().numel() for b in batches) // len(batches)
    shape = (f"B={BATCH[quick]}, 26 tables, {rows / 1e6:.2f}M rows x D={DIM[quick]}, "
             f"{lookups / BATCH[quick] / 26:.1f} ids/bag")
    args = [(b,) for b in batches]
    yield Case(op="DLRM train step", shape=shape, dtype=torch.float32, flops=0, bytes=0,
               impls={name: rotate(args, lambda b, m=m, o=o: _step(m, o, b)) for name, (m, o) in models.items()},
               baseline="torchrec_adagrad", notes=notes, reference="torchrec_adagrad",
               state=_state_readers(models, batches[0], dense=True), tolerance=dict(atol=1e-4, rtol=1e-3))

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
               baseline="torchrec_adagrad", reference="torchrec_adagrad",
               state=_state_readers(models, batches[0], dense=False), tolerance=dict(atol=1e-4, rtol=1e-3))

    num_f = 26
    inter_inputs = [(torch.randn(BATCH[quick], DIM[quick], device=device, requires_grad=True),
                     torch.randn(BATCH[quick], num_f, DIM[quick], device=device, requires_grad=True))
                    for _ in range(2)]
    pairs = (num_f + 1) * num_f // 2
    inter_grad = torch.randn(BATCH[quick], DIM[quick] + pairs, device=device)

    def inter_step(module, dense, sparse):
        out = module(dense, sparse)
        return torch.autograd.grad(out, (dense, sparse), inter_grad)

    eager_inter = models["torchrec_adagrad"][0].inter_arch
    fused_inter = models["swap_none"][0].inter_arch
    yield Case(op="interaction fwd+bwd", shape=f"B={BATCH[quick]}, F=27, D={DIM[quick]}", dtype=torch.float32,
               flops=0, bytes=0,
               impls={"torchrec_adagrad": rotate(inter_inputs, lambda d, s: inter_step(eager_inter, d, s)),
                      "swap_none": rotate(inter_inputs, lambda d, s: inter_step(fused_inter, d, s))},
               baseline="torchrec_adagrad", reference="torchrec_adagrad", tolerance=dict(atol=1e-3, rtol=1e-3))


def _encoder_cases(quick: bool, device: torch.device) -> Iterator[Case]:
    batch, length = (16, 64) if quick else (64, 256)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True, device=device)
    eager = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    swapped = copy.deepcopy(eager)
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
        yield Case(op="TransformerEncoder fwd+bwd", shape=f"B={batch}, L={length}, density {real:.2f}, d=64, "
                                                         f"4 heads, 2 layers, causal",
                   dtype=torch.float32, flops=0, bytes=0,
                   impls={"eager": rotate(arg_sets, lambda x, p, v: fwd_bwd(eager, x, p, v)),
                          "swapped": rotate(arg_sets, lambda x, p, v: fwd_bwd(swapped, x, p, v))},
                   baseline="eager", reference="eager", tolerance=dict(atol=1e-3, rtol=1e-3))
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
