"""The front-door cases of the bad-input fuzz (tests/test_fuzz.py, ``fuzz-front``): odd and bad input on
the surfaces a user meets first, tried as a demanding new user would (issue 30): ``gk.swap``, the
TorchRec collections (``gk.torchrec.*``), the sharders and ``sharding_plan`` (and DMP on one gloo
rank), ``python -m model.train`` and ``python -m bench``, and checkpoints (model.train's
checkpoint.pt and the distributed DCP directory).

Inputs are generated per surface from a seeded ``random.Random`` (the same cases on every run), from
pools of odd values (negative, zero, NaN, Inf, wrong types, paths that cannot be written, KJTs with
duplicate/missing/reordered keys, lengths that do not add up, empty batches ...).

A case is
  bad    the right outcome is a Python exception (ValueError/TypeError/IndexError/KeyError, or a
         command line's exit 2 from argparse) whose message names one of ``names``;
  valid  the right outcome is a result that ``check`` accepts: outputs and gradients equal to
         TorchRec's modules or eager PyTorch (same weights), plans that place every table, ...

Outcome classes: clear_error and valid_correct are right; silent_or_wrong (a bad input accepted, or
a valid one answered wrongly), rejected_valid, unclear_error (an exception that names none of
``names``), crash (the process died) and hang (no result within the case's time) fail the fuzz.

The command lines run in this process through their ``main``/``parse_args`` where they have one (a
fresh interpreter costs seconds); a few run as ``python -m`` subprocesses, to see the exit code and
message a shell user sees. Cases are built at import (cheap closures); ``run_case`` runs one.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import random
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import gem_kernels as gk

try:
    import torchrec  # noqa: F401

    import gem_kernels.torchrec as gtr
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    HAVE_TORCHREC = True
except ImportError:
    HAVE_TORCHREC = False

ROOT = Path(__file__).resolve().parents[1]
OK_CLASSES = ("clear_error", "valid_correct")
FAIL_CLASSES = ("silent_or_wrong", "rejected_valid", "unclear_error", "crash", "hang")
BAD_INPUT_ERRORS = (ValueError, TypeError, IndexError, KeyError)
SURFACES = ("swap", "torchrec", "sharding", "train_cli", "bench_cli", "checkpoint")


@dataclass
class FrontCase:
    name: str  # "<surface>/<what>"
    kind: str  # "bad" | "valid"
    run: Callable[[], Any]
    names: tuple = ()  # bad: the message must name one of these
    check: Callable[[Any], None] | None = None  # valid: asserts the result is right
    torchrec: bool = False  # needs TorchRec installed
    timeout_s: float = 30.0

    @property
    def surface(self) -> str:
        return self.name.split("/", 1)[0]


CASES: dict[str, FrontCase] = {}


def add(name: str, kind: str, run, names=(), check=None, torchrec=False, timeout_s=30.0) -> None:
    assert name not in CASES, name
    assert " at 0x" not in name, f"{name}: a case name must be the same in every process"
    assert name.split("/", 1)[0] in SURFACES, name
    CASES[name] = FrontCase(name, kind, run, tuple(names), check, torchrec, timeout_s)


def _label(value) -> str:
    """A value as a case name shows it, the same in every process (no addresses)."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_label, value)) + "]"
    return f"{type(value).__name__}()" if " at 0x" in repr(value) else repr(value)


def _rng(surface: str) -> random.Random:
    return random.Random(zlib.crc32(surface.encode()))


class Crash(Exception):
    """A subprocess that died of a signal."""


class Hang(Exception):
    """A subprocess that ran past its time."""


def _names_in(message: str, names: tuple) -> bool:
    import re

    return any(re.search(rf"(?<![A-Za-z0-9_-]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def run_case(case: FrontCase, backend: str = "", device: str = "cpu") -> tuple[str, str]:
    """(outcome class, detail) of one case, in this process (backend and device: the op fuzz's
    signature; the front door runs on the CPU). The files a case writes go to a temporary
    directory, removed after the case and its check."""
    global _TMP_ROOT
    with tempfile.TemporaryDirectory(prefix="gk-fuzz-front-") as _TMP_ROOT:
        return _classify(case)


def _classify(case: FrontCase) -> tuple[str, str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            result = case.run()
    except Crash as exc:
        return "crash", str(exc)[:300]
    except Hang as exc:
        return "hang", str(exc)[:300]
    except SystemExit as exc:  # argparse's parser.error: exit 2, the message on stderr
        message = err.getvalue().strip().splitlines()[-1:] or [""]
        if case.kind == "valid":
            return "rejected_valid", f"exit {exc.code}: {message[0][:300]}"
        if exc.code == 2 and _names_in(message[0], case.names):
            return "clear_error", ""
        return "unclear_error", f"exit {exc.code} naming none of {case.names}: {message[0][:300]}"
    except BAD_INPUT_ERRORS as exc:
        if case.kind == "valid":
            return "rejected_valid", f"{type(exc).__name__}: {str(exc)[:300]}"
        if _names_in(str(exc), case.names):
            return "clear_error", ""
        return "unclear_error", f"{type(exc).__name__} names none of {case.names}: {str(exc)[:300]}"
    except Exception as exc:
        if case.kind == "valid":
            return "rejected_valid", f"{type(exc).__name__}: {str(exc)[:300]}"
        return "unclear_error", f"{type(exc).__name__}: {str(exc)[:300]}"
    if case.kind == "bad":
        return "silent_or_wrong", f"accepted (expected an error naming {case.names}); returned {str(result)[:120]}"
    try:
        case.check(result)
    except AssertionError as exc:
        return "silent_or_wrong", f"wrong result: {str(exc)[:300]}"
    except Exception as exc:  # e.g. a key missing from the result
        return "silent_or_wrong", f"wrong result: the check failed with {type(exc).__name__}: {str(exc)[:300]}"
    return "valid_correct", ""


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 sums of a handful of rows: a wrong row or bag is off by O(0.1), rounding by O(1e-7)."""
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.numel():
        diff = float((actual.detach().double() - expected.detach().double()).abs().max())
        assert diff <= 1e-5, f"{what}: max |diff| {diff:.3g}"


def _subprocess(*argv: str, timeout: float = 80) -> None:
    """``python -m argv``; raises what a failed command line stands for (its last stderr line as
    the message), returns on exit 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise Hang(f"python -m {' '.join(argv)}: no exit after {timeout} s") from exc
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode < 0:
        raise Crash(f"python -m {' '.join(argv)} died of signal {-proc.returncode}: {last}")
    if proc.returncode == 2:
        print(last, file=sys.stderr)
        raise SystemExit(2)
    if proc.returncode != 0:  # an uncaught exception: its type and message are the traceback's last line
        kind, _, message = last.partition(": ")
        error = {e.__name__: e for e in BAD_INPUT_ERRORS}.get(kind, RuntimeError)
        raise error(message if error is not RuntimeError else f"exit {proc.returncode}: {last}")


_TMP_ROOT: str | None = None  # the running case's temporary directory, removed after it


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(dir=_TMP_ROOT))


def _blocked() -> Path:
    """A path no user can create, root included: a folder inside a regular file."""
    blocker = _tmp() / "a-file"
    blocker.write_text("")
    return blocker / "sub"


# Paths an output flag cannot use: inside a regular file, inside /proc (no new entries, root
# included), a regular file where a directory is wanted and the reverse.
UNWRITABLE = ("inside-a-file", "proc")


def _unwritable(kind: str, leaf: str) -> str:
    return str(_blocked() / leaf) if kind == "inside-a-file" else f"/proc/{leaf}"


# =============================================================================================
# gk.swap (needs no TorchRec)
# =============================================================================================


def _eb_model(mode="sum", num=10, dim=4, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.EmbeddingBag(num, dim, mode=mode), nn.EmbeddingBag(num, dim, mode=mode))


def _swap_cases() -> None:
    rng = _rng("swap")
    bad_args = {
        "model": [None, "model", nn.Linear, 3],
        "backend": ["bogus", "", 3, "CPU"],
        "include": [5, [1], b"x", [None]],
        "exclude": [5.0, [object()], {"a": 1}],
        "optimizer": ["sgd", torch.optim.SGD, 0.1, gk.optim.ExactSGD],
        "quantize": ["int3", 8, "INT8"],
    }
    for arg, pool in bad_args.items():
        for i, value in enumerate(rng.sample(pool, min(3, len(pool)))):
            def run(arg=arg, value=value):
                if arg == "model":
                    return gk.swap(value)
                return gk.swap(_eb_model(), **{arg: value})
            add(f"swap/{arg}={_label(value)}#{i}", "bad", run, names=(arg,))

    def filtered(kwargs, expect_replaced):
        def run():
            model = _eb_model()
            report = gk.swap(model, **kwargs)
            return model, report

        def check(result):
            model, report = result
            got = sorted(p for p, _, _ in report.replaced)
            assert got == expect_replaced, f"replaced {got}, expected {expect_replaced}"
            for i in ("0", "1"):
                swapped = type(getattr(model, i)) is not nn.EmbeddingBag
                assert swapped == (i in expect_replaced), f"module {i} swapped={swapped}"
        return run, check

    for label, kwargs, expect in [("include=[]", dict(include=[]), []), ("include='1'", dict(include="1"), ["1"]),
                                  ("exclude='*'", dict(exclude="*"), []), ("include=EmbeddingBag",
                                  dict(include="EmbeddingBag"), ["0", "1"]), ("backend=reference",
                                  dict(backend="reference"), ["0", "1"])]:
        run, check = filtered(kwargs, expect)
        add(f"swap/{label}", "valid", run, check=check)

    def twice():
        model = _eb_model()
        gk.swap(model)
        return gk.swap(model)
    add("swap/twice", "valid", twice, check=lambda report: _assert(not report.replaced,
                                                                    f"the second swap replaced {report.replaced}"))

    # Swapped nn.EmbeddingBag against the original on generated bags (outputs and weight gradients).
    for i in range(10):
        mode = rng.choice(["sum", "mean"])
        batch = rng.choice([0, 1, 3, 5])
        layout = rng.choice(["offsets", "2d", "last_offset"])
        weighted = mode == "sum" and rng.random() < 0.5
        index_dtype = rng.choice([torch.int64, torch.int32])
        width = rng.choice([0, 1, 3])  # 2-D: ids per bag (0: every bag empty, issue 30 item 7)
        lengths = [rng.randint(0, 4) for _ in range(batch)]
        seed = rng.randrange(1 << 30)

        def run(mode=mode, batch=batch, layout=layout, weighted=weighted, index_dtype=index_dtype, width=width,
                lengths=lengths, seed=seed):
            g = torch.Generator().manual_seed(seed)
            eager = nn.EmbeddingBag(10, 4, mode=mode, include_last_offset=layout == "last_offset")
            with torch.no_grad():
                eager.weight.copy_(torch.randn(10, 4, generator=g))
            holder = nn.Sequential(copy.deepcopy(eager))
            gk.swap(holder)
            if layout == "2d":
                ids = torch.randint(0, 10, (batch, width), generator=g, dtype=torch.int64).to(index_dtype)
                offsets = None
            else:
                ids = torch.randint(0, 10, (sum(lengths),), generator=g).to(index_dtype)
                offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(index_dtype)
                if layout == "offsets":
                    offsets = offsets[:-1]
            psw = torch.rand(ids.shape, generator=g) if weighted else None
            outs = []
            for module in (eager, holder[0]):
                if module is eager and layout == "2d" and width == 0:
                    # torch's own module fails here ("step must be nonzero"); issue 30 item 7: zeros
                    outs.append((torch.zeros(batch, 4), None))
                    continue
                out = module(ids, offsets, per_sample_weights=psw)
                (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
                outs.append((out.detach(), module.weight.grad))
            return outs

        def check(outs):
            (want, want_grad), (got, got_grad) = outs
            _close(got, want, "out")
            _close(torch.zeros(10, 4) if got_grad is None else got_grad,
                   torch.zeros(10, 4) if want_grad is None else want_grad, "weight.grad")
        add(f"swap/forward-{mode}-{layout}-B{batch}-w{width}{'-psw' if weighted else ''}-{str(index_dtype)[6:]}#{i}",
            "valid", run, check=check)

    # Swapped attention (MultiheadAttention, TransformerEncoderLayer) against the original: outputs
    # at the valid positions and the input's gradient there (padded positions hold zeros on the fused
    # path, as gk.nn.MultiheadAttention documents).
    for i in range(8):
        kind = rng.choice(["MultiheadAttention", "TransformerEncoderLayer"])
        batch_first = rng.random() < 0.7
        train = rng.random() < 0.5
        batch, length = rng.choice([1, 3]), rng.choice([1, 5])
        masks = rng.choice(["none", "pad", "causal", "pad+causal"])
        lengths = [rng.randint(1, length) if "pad" in masks else length for _ in range(batch)]

        def run(kind=kind, batch_first=batch_first, train=train, batch=batch, length=length, masks=masks,
                lengths=lengths, seed=i):
            torch.manual_seed(seed)
            eager = (nn.MultiheadAttention(8, 2, batch_first=batch_first) if kind == "MultiheadAttention" else
                     nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first))
            holder = nn.Sequential(copy.deepcopy(eager))
            gk.swap(holder)
            x = torch.randn(batch, length, 8) if batch_first else torch.randn(length, batch, 8)
            pad = torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None] if "pad" in masks else None
            causal = "causal" in masks
            attn_mask = nn.Transformer.generate_square_subsequent_mask(length) if causal else None
            valid = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
            outs = []
            for module in (eager, holder[0]):
                module.train(train)
                leaf = x.clone().requires_grad_(True)
                if kind == "MultiheadAttention":
                    out = module(leaf, leaf, leaf, key_padding_mask=pad, attn_mask=attn_mask, need_weights=False,
                                 is_causal=causal)[0]
                else:
                    out = module(leaf, src_mask=attn_mask, src_key_padding_mask=pad, is_causal=causal)
                rows = (out if batch_first else out.transpose(0, 1))[valid]
                (rows * torch.arange(rows.numel(), dtype=rows.dtype).view_as(rows).cos()).sum().backward()
                grad = leaf.grad if batch_first else leaf.grad.transpose(0, 1)
                outs.append((rows.detach(), grad[valid]))
            return outs

        def check(outs):
            (want, want_grad), (got, got_grad) = outs
            _close(got, want, "out at the valid positions")
            _close(got_grad, want_grad, "grad of x at the valid positions")
        add(f"swap/{kind}-{'batch_first' if batch_first else 'seq_first'}-{'train' if train else 'eval'}-B{batch}"
            f"-L{length}-{masks}#{i}", "valid", run, check=check)

    def mha_mask_shape():
        holder = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))
        gk.swap(holder)
        x = torch.randn(2, 3, 8)
        return holder[0](x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool), need_weights=False)
    add("swap/MultiheadAttention-key_padding_mask-shape", "bad", mha_mask_shape, names=("key_padding_mask",))
    # (batch_first=False modules are not swapped, "batch_first=False" in the report: torch's own stay.)

    # Bad forward inputs into the swapped module.
    def swapped(mode="sum"):
        holder = nn.Sequential(nn.EmbeddingBag(10, 4, mode=mode))
        gk.swap(holder)
        return holder[0]

    bad_forward = [
        ("id-too-large", lambda: swapped()(torch.tensor([1, 10, 2]), torch.tensor([0, 2])), ("input", "indices")),
        ("id-negative", lambda: swapped()(torch.tensor([1, -1]), torch.tensor([0, 1])), ("input", "indices")),
        ("offsets-past-end", lambda: swapped()(torch.tensor([1, 2, 3]), torch.tensor([0, 5])), ("offsets",)),
        ("offsets-not-from-0", lambda: swapped()(torch.tensor([1, 2, 3]), torch.tensor([1, 2])), ("offsets",)),
        ("offsets-decreasing", lambda: swapped()(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), ("offsets",)),
        ("float-ids", lambda: swapped()(torch.tensor([1.0, 2.0]), torch.tensor([0, 1])), ("input", "indices")),
        ("3d-ids", lambda: swapped()(torch.zeros(2, 2, 2, dtype=torch.long)), ("input",)),
        ("2d-with-offsets", lambda: swapped()(torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 1])), ("offsets",)),
        ("psw-shape", lambda: swapped()(torch.tensor([1, 2, 3]), torch.tensor([0, 1]),
                                         per_sample_weights=torch.ones(2)), ("per_sample_weights",)),
        ("psw-mean", lambda: swapped("mean")(torch.tensor([1, 2, 3]), torch.tensor([0, 1]),
                                               per_sample_weights=torch.ones(3)), ("per_sample_weights", "mode")),
        ("1d-no-offsets", lambda: swapped()(torch.tensor([1, 2, 3])), ("offsets",)),
    ]
    for label, run, names in bad_forward:
        add(f"swap/forward-{label}", "bad", run, names=names)

    def frozen():
        holder = nn.Sequential(nn.EmbeddingBag(10, 4, mode="sum"))
        holder[0].weight.requires_grad_(False)
        before = holder[0].weight.detach().clone()
        gk.swap(holder, optimizer=gk.optim.ExactSGD(lr=1.0))
        psw = torch.ones(3, requires_grad=True)
        holder[0](torch.tensor([1, 2, 3]), torch.tensor([0, 1]), per_sample_weights=psw).sum().backward()
        return before, holder[0].weight.detach(), holder[0].weight.requires_grad
    def meta_then_to_empty():
        eager = nn.EmbeddingBag(10, 4, mode="sum")
        holder = nn.Sequential(nn.EmbeddingBag(10, 4, mode="sum", device="meta"))
        gk.swap(holder)
        holder.to_empty(device="cpu")
        holder[0].load_state_dict(eager.state_dict())
        ids, offsets = torch.tensor([1, 9, 3]), torch.tensor([0, 0, 2])
        return holder[0](ids, offsets).detach(), eager(ids, offsets).detach()
    add("swap/meta-then-to_empty", "valid", meta_then_to_empty, check=lambda r: _close(r[0], r[1], "out"))

    add("swap/frozen-weight-with-fused-optimizer", "valid", frozen, check=lambda r: (
        _close(r[1], r[0], "frozen weight after a step"), _assert(not r[2], "requires_grad came back True")))

    class Custom(nn.Module):
        pass

    def none_converter():
        swap_module = sys.modules["gem_kernels._swap"]
        swap_module.register(Custom, lambda m, *, optimizer, backend: None)
        try:
            return gk.swap(nn.Sequential(Custom()))
        finally:
            swap_module._CONVERTERS.pop(Custom)
    add("swap/converter-returns-None", "bad", none_converter, names=("Custom", "SwapSkip"))


def _assert(condition: bool, message: str) -> None:
    assert condition, message


# =============================================================================================
# TorchRec collections
# =============================================================================================


def _configs(order=("t0", "t1"), pooling="SUM", dim=4, **changes):
    """t0 (10 rows, feature a) and t1 (6 rows, feature b), dim 4 (issue 30's snippets)."""
    rows = {"t0": 10, "t1": 6}
    feature = {"t0": "a", "t1": "b"}
    out = []
    for name in order:
        fields = dict(name=name, embedding_dim=dim, num_embeddings=rows[name], feature_names=[feature[name]],
                      pooling=getattr(PoolingType, pooling))
        fields.update(changes.get(name, {}))
        out.append(EmbeddingBagConfig(**fields))
    return out


def _seq_configs():
    return [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=6, feature_names=["b"])]


def _kjt(keys, lengths, values, weights=None):
    return KeyedJaggedTensor(keys=list(keys), values=torch.as_tensor(values, dtype=torch.int64),
                             lengths=torch.as_tensor(lengths, dtype=torch.int32),
                             weights=None if weights is None else torch.as_tensor(weights, dtype=torch.float32))


def _random_kjt(rng: random.Random, batch: int, keys=("a", "b"), weighted=False, empty=False):
    rows = {"a": 10, "b": 6}
    lengths = [0 if empty else rng.randint(0, 3) for _ in keys for _ in range(batch)]
    values, k = [], 0
    for key in keys:
        for _ in range(batch):
            values += [rng.randrange(rows[key]) for _ in range(lengths[k])]
            k += 1
    weights = [round(rng.uniform(0.1, 2.0), 3) for _ in values] if weighted else None
    return keys, lengths, values, weights


def _ebc_pair(pooling="SUM", weighted=False, optimizer=None, seed=0):
    """A TorchRec EBC and a FusedEmbeddingBagCollection holding the same tables."""
    torch.manual_seed(seed)
    theirs = EmbeddingBagCollection(tables=_configs(pooling=pooling), is_weighted=weighted)
    ours = gtr.FusedEmbeddingBagCollection(_configs(pooling=pooling), is_weighted=weighted, optimizer=optimizer)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _pooled_run(theirs, ours, features):
    outs = []
    for module in (theirs, ours):
        out = module(features).to_dict()
        loss = sum((v * torch.arange(v.numel(), dtype=v.dtype).view_as(v)).sum() for v in out.values())
        if loss.requires_grad:
            loss.backward()
        outs.append(out)
    grads = {}
    for i, name in enumerate(ours._table_names):
        g = ours.weights.grad
        grads[name] = (theirs.embedding_bags[name].weight.grad,
                       None if g is None else ours.layout.table(g, i))
    return outs, grads


def _pooled_check(result):
    (want, got), grads = result
    assert sorted(got) == sorted(want), f"keys {sorted(got)} != {sorted(want)}"
    for key in want:
        _close(got[key], want[key], f"out[{key!r}]")
    for name, (w, g) in grads.items():  # no gradient (an empty batch) counts as zero
        if w is not None or g is not None:
            _close(torch.zeros_like(w if g is None else g) if g is None else g,
                   torch.zeros_like(g) if w is None else w, f"grad of {name}")


def _torchrec_cases() -> None:
    rng = _rng("torchrec")
    # Construction: one bad field at a time.
    bad_fields = {"embedding_dim": [0, -1, 2.5, True], "num_embeddings": [0, -3, "10"]}
    for field_name, pool in bad_fields.items():
        for value in rng.sample(pool, 3):
            for cls in ("FusedEmbeddingBagCollection", "FusedEmbeddingCollection"):
                def run(field_name=field_name, value=value, cls=cls):
                    configs = _configs() if cls == "FusedEmbeddingBagCollection" else _seq_configs()
                    setattr(configs[1], field_name, value)
                    return getattr(gtr, cls)(configs)
                add(f"torchrec/{cls}-t1.{field_name}={value!r}", "bad", run, names=(field_name,), torchrec=True)
    bad_args = {"bounds_check": ["bogus", None, 1], "optimizer": ["adam", torch.optim.SGD, 0.1],
                "backend": ["bogus", 3], "tables": [[], None, "t0", [1]]}
    for arg, pool in bad_args.items():
        for value in pool:
            def run(arg=arg, value=value):
                if arg == "tables":
                    return gtr.FusedEmbeddingBagCollection(value)
                return gtr.FusedEmbeddingBagCollection(_configs(), **{arg: value})
            add(f"torchrec/FusedEmbeddingBagCollection-{arg}={_label(value)}", "bad", run, names=(arg,), torchrec=True)
    add("torchrec/duplicate-table-names", "bad",
        lambda: gtr.FusedEmbeddingBagCollection(_configs(order=("t0", "t0"))), names=("tables", "unique"),
        torchrec=True)
    add("torchrec/mixed-data-types", "bad", lambda: gtr.FusedEmbeddingBagCollection(
        _configs(t1=dict(data_type=torchrec.DataType.FP16))), names=("data_type",), torchrec=True)

    # Forward against TorchRec's EBC on generated KJTs (keys in order, reversed, empty batch ...).
    for i in range(12):
        pooling = rng.choice(["SUM", "MEAN"])
        weighted = pooling == "SUM" and rng.random() < 0.5  # TorchRec's CPU EBC refuses weighted MEAN
        batch = rng.choice([0, 1, 2, 4])
        keys = rng.choice([("a", "b"), ("b", "a")])
        empty = rng.random() < 0.2
        kjt = _random_kjt(rng, batch, keys, weighted, empty)

        def run(pooling=pooling, weighted=weighted, kjt=kjt, seed=i):
            theirs, ours = _ebc_pair(pooling, weighted, seed=seed)
            return _pooled_run(theirs, ours, _kjt(*kjt))
        add(f"torchrec/ebc-{pooling}{'-weighted' if weighted else ''}-B{batch}-{''.join(keys)}"
            f"{'-empty' if empty else ''}#{i}", "valid", run, check=_pooled_check, torchrec=True)

    # Unpooled collection against TorchRec's EC.
    for i in range(5):
        batch = rng.choice([0, 1, 3])
        keys = rng.choice([("a", "b"), ("b", "a")])
        kjt = _random_kjt(rng, batch, keys)

        def run(kjt=kjt, seed=i):
            torch.manual_seed(seed)
            theirs = EmbeddingCollection(tables=_seq_configs())
            ours = gtr.FusedEmbeddingCollection(_seq_configs())
            ours.load_state_dict(theirs.state_dict())
            return [{k: (jt.values().detach(), jt.lengths()) for k, jt in m(_kjt(*kjt)).items()}
                    for m in (theirs, ours)]

        def check(outs):
            want, got = outs
            assert sorted(got) == sorted(want), f"keys {sorted(got)} != {sorted(want)}"
            for key in want:
                _close(got[key][0], want[key][0], f"values of {key!r}")
                assert torch.equal(got[key][1].long(), want[key][1].long()), f"lengths of {key!r}"
        add(f"torchrec/ec-B{batch}-{''.join(keys)}#{i}", "valid", run, check=check, torchrec=True)

    # Bad KJTs into the pooled collection.
    def into_ebc(kjt_args, weighted=False):
        def run():
            _, ours = _ebc_pair(weighted=weighted)
            return ours(_kjt(*kjt_args))
        return run
    base = _random_kjt(rng, 3)
    keys, lengths, values, _ = base
    bad_kjts = [
        ("duplicate-keys", (["a", "a"], lengths, values), ("keys",)),
        ("missing-key", (["a"], lengths[:3], values[:sum(lengths[:3])]), ("keys", "features")),
        ("lengths-exceed-values", (keys, lengths[:-1] + [lengths[-1] + 2], values), ("lengths", "values")),
        ("values-exceed-lengths", (keys, lengths, values + [1, 2]), ("lengths", "values")),
        ("lengths-not-multiple-of-keys", (keys, lengths + [0], values), ("lengths", "keys")),
        ("negative-length", (keys, [-1, 1] + lengths[2:], values), ("lengths",)),
        ("id-past-table", (keys, [1] + [0] * 5, [10]), ("t0", "a", "indices", "values")),
        ("negative-id", (keys, [0] * 3 + [1] + [0] * 2, [-1]), ("t1", "b", "indices", "values")),
    ]
    for label, kjt_args, names in bad_kjts:
        add(f"torchrec/ebc-kjt-{label}", "bad", into_ebc(kjt_args), names=names, torchrec=True)
    add("torchrec/ebc-weighted-kjt-without-weights", "bad", into_ebc(base[:3], weighted=True),
        names=("weights", "is_weighted"), torchrec=True)

    def variable_batch(cls):
        def run():
            features = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]),
                                         lengths=torch.tensor([1, 1, 1]), stride_per_key_per_rank=[[1], [2]])
            configs = _configs() if cls == "FusedEmbeddingBagCollection" else _seq_configs()
            return getattr(gtr, cls)(configs)(features)
        return run
    add("torchrec/ebc-variable-batch-kjt", "bad", variable_batch("FusedEmbeddingBagCollection"),
        names=("variable-batch",), torchrec=True)
    add("torchrec/ec-variable-batch-kjt", "bad", variable_batch("FusedEmbeddingCollection"),
        names=("variable-batch",), torchrec=True)

    def extra_key():  # a key no table reads: TorchRec's EBC ignores it
        theirs, ours = _ebc_pair(seed=3)
        return _pooled_run(theirs, ours, _kjt(["c", "a", "b"], [2, 1, 0, 1, 1, 2], [0, 1, 7, 4, 2, 3, 1]))
    add("torchrec/ebc-kjt-extra-key", "valid", extra_key, check=_pooled_check, torchrec=True)

    def id_dtype(dtype):
        def run():
            theirs, ours = _ebc_pair(seed=5)
            features = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([9, 2, 5], dtype=dtype),
                                         lengths=torch.tensor([2, 1]))
            if dtype.is_floating_point or dtype == torch.bool:  # bad: TorchRec's own error is not the subject
                return ours(features)
            return _pooled_run(theirs, ours, features)
        return run
    for dtype in (torch.int32, torch.uint8, torch.int16):
        add(f"torchrec/ebc-kjt-{str(dtype)[6:]}-values", "valid", id_dtype(dtype), check=_pooled_check, torchrec=True)
    for dtype in (torch.float32, torch.bool):
        add(f"torchrec/ebc-kjt-{str(dtype)[6:]}-values", "bad", id_dtype(dtype), names=("features", "values"),
            torchrec=True)

    # Optimizer state.
    def load_state(value):
        def run():
            _, ours = _ebc_pair(optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1))
            return ours.load_optimizer_state_dict(value() if callable(value) else value)
        return run
    for label, value, names in [("None", None, ("state", "optimizer_state_dict")),
                                ("empty-dict", {}, ("state",)),
                                ("other-optimizer", lambda: _ebc_pair(optimizer=gk.optim.ExactAdam(lr=0.1))[1]
                                 .optimizer_state_dict(), ("state", "optimizer")),
                                ("other-rows", lambda: gtr.FusedEmbeddingBagCollection(
                                    _configs(t1=dict(num_embeddings=7)), optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1))
                                 .optimizer_state_dict(), ("tables", "t1"))]:
        add(f"torchrec/load_optimizer_state_dict-{label}", "bad", load_state(value), names=names, torchrec=True)

    def state_follows_names():
        rule = gk.optim.ExactRowwiseAdagrad(lr=0.1)
        src = gtr.FusedEmbeddingBagCollection(_configs(), optimizer=rule)
        src(_kjt(["a", "b"], [1, 1, 0, 1], [9, 0, 5])).values().sum().backward()
        dst = gtr.FusedEmbeddingBagCollection(_configs(order=("t1", "t0")), optimizer=rule)
        dst.load_optimizer_state_dict(src.optimizer_state_dict())
        return src, dst

    def check_state(result):
        src, dst = result
        for name in ("t0", "t1"):
            i, j = src._table_names.index(name), dst._table_names.index(name)
            a = src.momentum1[src.layout.rows_offsets[i]:src.layout.rows_offsets[i + 1]]
            b = dst.momentum1[dst.layout.rows_offsets[j]:dst.layout.rows_offsets[j + 1]]
            _close(b, a, f"momentum1 of {name}")
    add("torchrec/optimizer-state-into-other-table-order", "valid", state_follows_names, check=check_state,
        torchrec=True)

    # Module moves a TorchRec user makes: meta device then to_empty, .half() with a fused optimizer,
    # gk.swap of a frozen EBC.
    def meta_then_to_empty():
        theirs, _ = _ebc_pair()
        ours = gtr.FusedEmbeddingBagCollection(_configs(), device=torch.device("meta"))
        ours = ours.to_empty(device="cpu")
        ours.load_state_dict(theirs.state_dict())
        return _pooled_run(theirs, ours, _kjt(["a", "b"], [2, 0, 1, 1], [3, 9, 5, 0]))
    add("torchrec/meta-then-to_empty", "valid", meta_then_to_empty, check=_pooled_check, torchrec=True)

    def swap_meta_ebc():  # TorchRec's path before DMP: build on meta, swap, materialise, load
        theirs, _ = _ebc_pair(seed=4)
        holder = nn.Sequential(EmbeddingBagCollection(tables=_configs(), device=torch.device("meta")))
        gk.swap(holder)
        holder.to_empty(device="cpu")
        holder[0].load_state_dict(theirs.state_dict())
        return _pooled_run(theirs, holder[0], _kjt(["a", "b"], [1, 2, 2, 0], [3, 9, 5, 0, 1]))
    add("torchrec/swap-meta-ebc-then-to_empty", "valid", swap_meta_ebc, check=_pooled_check, torchrec=True)

    def half_with_optimizer():
        ours = gtr.FusedEmbeddingBagCollection(_configs(), optimizer=gk.optim.ExactRowwiseAdagrad(lr=0.1)).half()
        out = ours(_kjt(["a", "b"], [1, 1], [3, 5])).values()
        out.float().sum().backward()
        return ours
    add("torchrec/half-with-fused-optimizer", "valid", half_with_optimizer, check=lambda m: _assert(
        m.weights.dtype == torch.float16 and m.momentum1.dtype == torch.float32,
        f"weights {m.weights.dtype}, momentum1 {m.momentum1.dtype}"), torchrec=True)

    def frozen_ebc():
        holder = nn.Sequential(EmbeddingBagCollection(tables=_configs()))
        holder.requires_grad_(False)
        before = {k: v.clone() for k, v in holder.state_dict().items()}
        gk.swap(holder, optimizer=gk.optim.ExactSGD(lr=1.0))
        out = holder[0](_kjt(["a", "b"], [1, 1], [3, 5])).values()
        if out.requires_grad:
            out.sum().backward()
        return before, holder.state_dict()
    add("torchrec/swap-frozen-ebc-with-fused-optimizer", "valid", frozen_ebc, check=lambda r: [
        _close(r[1][k], v, k) for k, v in r[0].items()], torchrec=True)



# =============================================================================================
# Sharders, sharding_plan, DMP on one gloo rank
# =============================================================================================


class _Sparse(nn.Module):
    def __init__(self, collection):
        super().__init__()
        self.ebc = collection

    def forward(self, features):
        return self.ebc(features)


def _fused_model(seed=0):
    torch.manual_seed(seed)
    return _Sparse(gtr.FusedEmbeddingBagCollection(_configs()))


def _gloo() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _sharding_cases() -> None:
    rng = _rng("sharding")

    def plan_of(model=None, sharders=None, **kwargs):
        def run():
            m = model() if model is not None else _fused_model()
            s = sharders() if callable(sharders) else sharders
            return gtr.sharding_plan(m, [gtr.FusedEmbeddingBagCollectionSharder()] if s is None else s, **kwargs)
        return run

    for value in rng.sample(["bogus", "row_wise", 3, None], 3):
        add(f"sharding/plan={value!r}", "bad", plan_of(plan=value), names=("plan",), torchrec=True)
    for value in rng.sample([-1, 0, 1.5, True, "2"], 4):
        add(f"sharding/world_size={value!r}", "bad", plan_of(plan="table_wise", world_size=value),
            names=("world_size",), torchrec=True)
    for label, sharders in [("[]", []), ("class", lambda: [gtr.FusedEmbeddingBagCollectionSharder]),
                            ("None-in-list", [None]), ("not-a-list", lambda: gtr.FusedEmbeddingBagCollectionSharder())]:
        add(f"sharding/sharders={label}", "bad", plan_of(sharders=sharders, plan="table_wise", world_size=2),
            names=("sharders",), torchrec=True)
    add("sharding/unswapped-ebc-default-sharder", "bad",
        plan_of(model=lambda: _Sparse(EmbeddingBagCollection(tables=_configs())), plan="table_wise", world_size=2),
        names=("gk.swap", "module_type"), torchrec=True)
    for arg, value in [("bounds_check", "bogus"), ("optimizer", "sgd"), ("optimizer", torch.optim.SGD),
                       ("backend", "bogus")]:
        add(f"sharding/FusedEmbeddingBagCollectionSharder-{arg}={_label(value)}", "bad",
            lambda arg=arg, value=value: gtr.FusedEmbeddingBagCollectionSharder(**{arg: value}),
            names=(arg,), torchrec=True)

    def check_plan(kind, world):
        def check(plan):
            module_plan = plan.plan["ebc"]
            assert sorted(module_plan) == ["t0", "t1"], f"tables {sorted(module_plan)}"
            for table, spec in module_plan.items():
                assert spec.sharding_type == kind, f"{table}: {spec.sharding_type}"
                assert all(0 <= r < world for r in spec.ranks), f"{table}: ranks {spec.ranks}"
        return check
    for kind, world in [("table_wise", 2), ("column_wise", 2), ("table_wise", 1)]:
        add(f"sharding/plan-{kind}-world{world}", "valid", plan_of(plan=kind, world_size=world),
            check=check_plan(kind, world), torchrec=True)
    add("sharding/plan-auto-world1", "valid", plan_of(plan="auto", world_size=1), check=lambda plan: _assert(
        sorted(plan.plan["ebc"]) == ["t0", "t1"], f"planned {plan}"), torchrec=True)

    # DMP on one gloo rank against the unsharded collection, batch after batch (keys reordered
    # after the first batch: issue 30 item 3).
    def dmp(batches, sequence=False):
        """Each batch through DMP (the pooled or the sequence sharder) and through the unsharded
        collection: {key: output values} of both."""
        def run():
            from torchrec.distributed import DistributedModelParallel

            _gloo()
            torch.manual_seed(1)
            if sequence:
                model = _Sparse(gtr.FusedEmbeddingCollection(_seq_configs()))
                sharders = [gtr.FusedEmbeddingCollectionSharder()]
            else:
                model = _Sparse(gtr.FusedEmbeddingBagCollection(_configs()))
                sharders = [gtr.FusedEmbeddingBagCollectionSharder()]
            unsharded = copy.deepcopy(model.ebc)
            wrapped = DistributedModelParallel(model, device=torch.device("cpu"), sharders=sharders,
                                               plan=gtr.sharding_plan(model, sharders, "table_wise", world_size=1))

            def values(out):
                out = out.wait() if hasattr(out, "wait") else out
                return {k: jt.values() for k, jt in out.items()} if sequence else out.to_dict()
            return [(values(wrapped(_kjt(*kjt))), values(unsharded(_kjt(*kjt)))) for kjt in batches]
        return run

    def check_dmp(outs):
        for step, (got, want) in enumerate(outs):
            assert sorted(got) == sorted(want), f"batch {step}: keys {sorted(got)} != {sorted(want)}"
            for key in want:
                _close(got[key], want[key], f"batch {step} out[{key!r}]")

    def label(batches):
        return "-".join("".join(b[0]) + f"-B{len(b[1]) // 2}" for b in batches)

    for i in range(4):
        batches = [_random_kjt(rng, rng.choice([0, 1, 2]), keys, empty=rng.random() < 0.2)
                   for keys in [("a", "b"), rng.choice([("a", "b"), ("b", "a")])]]
        add(f"sharding/dmp-{label(batches)}#{i}", "valid", dmp(batches), check=check_dmp, torchrec=True)
    for i in range(2):
        batches = [_random_kjt(rng, rng.choice([1, 2]), keys) for keys in [("a", "b"), ("b", "a")]]
        add(f"sharding/dmp-sequence-{label(batches)}#{i}", "valid", dmp(batches, sequence=True), check=check_dmp,
            torchrec=True)
    for label, kjt, names in [("duplicate-keys", (["a", "a"], [1, 1], [1, 2]), ("keys",)),
                              ("missing-key", (["a"], [1, 1], [1, 2]), ("keys", "features")),
                              ("lengths-exceed-values", (["a", "b"], [1, 2], [1, 2]), ("lengths", "values")),
                              ("id-past-table", (["a", "b"], [1, 0], [10]), ("a", "t0")),
                              ("negative-id", (["a", "b"], [0, 1], [-2]), ("b", "t1")),
                              ("lengths-not-multiple-of-keys", (["a", "b"], [1, 0, 1], [1, 2]), ("lengths", "keys"))]:
        add(f"sharding/dmp-kjt-{label}", "bad", dmp([_random_kjt(rng, 1), kjt]), names=names, torchrec=True)


# =============================================================================================
# python -m model.train
# =============================================================================================

# On the CPU also on a GPU machine: the fuzz's children run under an address-space limit.
TINY = ["--config", "tiny", "--kernels", "fused", "--device", "cpu", "--batch-size", "4", "--no-progress",
        "--eval-batches", "1", "--warmup", "0"]


def _train_parse(argv):
    from model.train import parse_args

    return lambda: parse_args(argv)


def _train_main(argv):
    from model.train import main

    return lambda: main(TINY + argv)


def _train_cli_cases() -> None:
    rng = _rng("train_cli")
    flags = {"--steps": [0, -1], "--batch-size": [0, -4], "--eval-batches": [0, -2],
             "--eval-every": [-1], "--warmup": [-3], "--checkpoint-every": [-1], "--seed": [-1, 2**64, 10**23]}
    for flag, pool in flags.items():
        for value in rng.sample(pool + ["x", "1.5", "nan", ""], 3):
            add(f"train_cli/{flag}={value}", "bad", _train_parse([flag, str(value)]), names=(flag,))
    for flag, value in [("--config", "huge"), ("--kernels", "magic"), ("--device", "meta"), ("--device", "nonsense"),
                        ("--amp", "fp8"), ("--plan", "row_wise"), ("--interaction", "bogus")]:
        add(f"train_cli/{flag}={value}", "bad", _train_parse([flag, value]), names=(flag,))
    if not torch.cuda.is_available():
        add("train_cli/--device=cuda-without-cuda", "bad", _train_parse(["--device", "cuda"]), names=("--device",))
    add("train_cli/--resume-without-checkpoint", "bad", _train_parse(["--resume"]), names=("--resume",))
    for kind in UNWRITABLE:
        add(f"train_cli/--json-{kind}", "bad", lambda kind=kind: _train_parse(
            ["--json", _unwritable(kind, "out.json")])(), names=("--json",))
        add(f"train_cli/--checkpoint-{kind}", "bad", lambda kind=kind: _train_parse(
            ["--checkpoint", _unwritable(kind, "ckpt")])(), names=("--checkpoint",))
    add("train_cli/--checkpoint-is-proc", "bad", _train_parse(["--checkpoint", "/proc"]), names=("--checkpoint",))
    add("train_cli/--json-is-a-directory", "bad", lambda: _train_parse(["--json", str(_tmp())])(), names=("--json",))

    def check_parsed(args):
        assert (args.steps, args.warmup, args.eval_every, args.batch_size) == (3, 0, 0, 4), vars(args)
    add("train_cli/parse-valid", "valid", _train_parse(TINY + ["--steps", "3", "--eval-every", "0"]), check=check_parsed)

    def tiny_run():
        out = _tmp()
        result = _train_main(["--steps", "2", "--json", str(out / "r.json")])()
        return result, out / "r.json"

    def check_run(result):
        run, path = result
        assert len(run["losses"]) == 2 and all(math.isfinite(x) for x in run["losses"]), run["losses"]
        assert path.is_file() and '"losses"' in path.read_text(), "no --json written"
    add("train_cli/tiny-run", "valid", tiny_run, check=check_run, timeout_s=90)
    # A shell user's view, once (a fresh interpreter costs seconds; the corrupt checkpoint's is
    # tests/test_train_cli.py::test_corrupt_checkpoint_via_the_command_line).
    add("train_cli/subprocess---steps=0", "bad", lambda: _subprocess("model.train", "--steps", "0"),
        names=("--steps",), timeout_s=90)


# =============================================================================================
# python -m bench
# =============================================================================================


def _bench_cli_cases() -> None:
    rng = _rng("bench_cli")

    def parse(argv):
        from bench.__main__ import parse_args

        return lambda: parse_args(argv)
    for value in rng.sample(["nan", "inf", "-inf", "0", "-3", "x", ""], 5):
        add(f"bench_cli/--budget={value}", "bad", parse(["jagged", "--quick", f"--budget={value}"]), names=("--budget",))
    for value in rng.sample(["0", "-1", "x", "2.5"], 3):
        add(f"bench_cli/--repeats={value}", "bad", parse(["jagged", f"--repeats={value}"]), names=("--repeats",))
    add("bench_cli/unknown-family", "bad", parse(["jaged"]), names=("jaged", "FAMILY"))
    add("bench_cli/--device=tpu", "bad", parse(["--device", "tpu"]), names=("--device",))
    add("bench_cli/unknown-flag", "bad", parse(["--bogus-flag"]), names=("--bogus-flag",))
    for kind in UNWRITABLE:
        add(f"bench_cli/--out-{kind}", "bad", lambda kind=kind: parse(["jagged", "--out", _unwritable(kind, "res")])(),
            names=("--out",))

    def bench_main(argv):  # exits with main's code, as python -m bench does
        from bench.__main__ import main

        code = main(argv)
        if code:
            raise SystemExit(code)
        return code
    if not torch.cuda.is_available():
        add("bench_cli/--device=cuda-without-cuda", "bad", lambda: bench_main(
            ["jagged", "--quick", "--device", "cuda", "--out", str(_tmp())]), names=("--device",))

    def distributed(argv):
        from bench.distributed import main

        return lambda: main(argv)
    add("bench_cli/distributed-unknown-flag", "bad", distributed(["--bogus-flag"]), names=("--bogus-flag",))
    add("bench_cli/distributed---out-inside-a-file", "bad", lambda: distributed(
        ["--out", _unwritable("inside-a-file", "res")])(), names=("--out",))

    def swap_cli(argv):
        from bench.swap_loss import main

        return lambda: main(argv)
    for value in rng.sample(["0", "-2", "x"], 2):
        add(f"bench_cli/swap_loss---loss-steps={value}", "bad", swap_cli(["--loss-steps", value]), names=("--loss-steps",))
    add("bench_cli/swap_loss---out-proc", "bad", lambda: swap_cli(["--loss-steps", "1", "--out", "/proc/res"])(),
        names=("--out",))

    def check_parsed(args):
        assert (args.families, args.quick, args.budget, args.repeats) == (["jagged"], True, 5.0, 2), vars(args)
    add("bench_cli/parse-valid", "valid", lambda: parse(["jagged", "--quick", "--budget", "5", "--repeats", "2",
                                                         "--out", str(_tmp())])(), check=check_parsed)
    add("bench_cli/subprocess---budget=nan", "bad", lambda: _subprocess("bench", "jagged", "--budget", "nan"),
        names=("--budget",), timeout_s=90)


# =============================================================================================
# Checkpoints: model.train's checkpoint.pt, the distributed DCP directory
# =============================================================================================


def _checkpoint_cases() -> None:
    from model.train import CHECKPOINT_FILE

    def resume_from(write):
        """model.train --resume from a directory whose checkpoint.pt ``write(path)`` made."""
        def run():
            directory = _tmp()
            write(directory / CHECKPOINT_FILE)
            return _train_main(["--steps", "2", "--checkpoint", str(directory), "--resume"])()
        return run

    complete = {"step": 1, "kernels": "fused", "config": {}, "model": {}, "fused_optimizers": {}, "optimizers": [],
                "losses": [0.5]}

    def truncated(path):
        torch.save(complete, path)
        path.write_bytes(path.read_bytes()[:40])

    writers = [
        ("garbage", lambda p: p.write_bytes(b"not a checkpoint")),
        ("empty", lambda p: p.write_bytes(b"")),
        ("truncated", truncated),
        ("a-list", lambda p: torch.save([1, 2], p)),
        ("missing-keys", lambda p: torch.save({"step": 1}, p)),
        ("config-not-a-dict", lambda p: torch.save(dict(complete, config=[1]), p)),
        ("a-directory", lambda p: p.mkdir()),
    ]
    for label, write in writers:
        add(f"checkpoint/checkpoint.pt-{label}", "bad", resume_from(write), names=("checkpoint", "--checkpoint"),
            timeout_s=60)
    add("checkpoint/checkpoint.pt-of-another-batch-size", "bad", resume_from(
        lambda p: torch.save(dict(complete, config={"batch_size": 99}), p)), names=("batch_size",), timeout_s=60)

    def resume_below_the_step():
        directory = _tmp()
        _train_main(["--steps", "2", "--checkpoint", str(directory)])()
        return _train_main(["--steps", "1", "--checkpoint", str(directory), "--resume"])()
    add("checkpoint/resume-with---steps-below-the-checkpoint", "bad", resume_below_the_step, names=("--steps",),
        timeout_s=90)

    def resume_equals_uninterrupted():
        directory = _tmp()
        first = _train_main(["--steps", "1", "--checkpoint", str(directory)])()
        resumed = _train_main(["--steps", "2", "--checkpoint", str(directory), "--resume"])()
        whole = _train_main(["--steps", "2"])()
        return first, resumed, whole

    def check_resume(runs):
        first, resumed, whole = runs
        assert resumed["losses"] == whole["losses"], f"resumed {resumed['losses']} != uninterrupted {whole['losses']}"
        assert first["losses"] == whole["losses"][:1]
    add("checkpoint/resume-equals-uninterrupted", "valid", resume_equals_uninterrupted, check=check_resume,
        timeout_s=120)

    # The distributed checkpoint: model.distributed.load reads .metadata before any collective.
    def dcp_load(write):
        def run():
            from model.distributed import load

            directory = _tmp()
            write(directory)
            return load(directory, None, None)
        return run

    def other_state(directory):
        import torch.distributed.checkpoint as dcp

        dcp.save({"x": torch.ones(2)}, checkpoint_id=str(directory), no_dist=True)

    for label, write in [("garbage", lambda d: (d / ".metadata").write_bytes(b"not a pickle")),
                         ("empty", lambda d: (d / ".metadata").write_bytes(b"")),
                         ("missing", lambda d: None),
                         ("other-state", other_state)]:
        add(f"checkpoint/dcp-.metadata-{label}", "bad", dcp_load(write), names=("checkpoint",), torchrec=True)

    def published_staging():
        from model.distributed import published

        root = _tmp()
        (root / ".ckpt.staging").mkdir()
        (root / ".ckpt.staging" / ".metadata").write_bytes(b"")
        return published(root / "ckpt")
    add("checkpoint/dcp-staging-is-not-resumed", "valid", published_staging,
        check=lambda got: _assert(got is None, f"resumes {got}"), torchrec=True)


_swap_cases()
if HAVE_TORCHREC:
    _torchrec_cases()
    _sharding_cases()
_train_cli_cases()
_bench_cli_cases()
_checkpoint_cases()
