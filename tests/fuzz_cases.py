"""The cases of the bad-input fuzz (tests/test_fuzz.py): generated bad and edge inputs for every public
op, the nn modules, FusedEmbeddingBag's constructors and state_dict, and direct calls of the native
ops; each case knows what a right outcome is.

A case is one of three kinds:
  bad     the input is invalid: the right outcome is a ValueError/IndexError/TypeError whose message
          names one of `names` (the offending argument).
  value   the input is valid (an edge: empty batch, zero-length sequence, N = 0, NaN, Inf, huge
          magnitudes, fp16/bf16): the output and every gradient must equal the oracle's, a float64
          (or fp32, `oracle_dtype`) plain-PyTorch twin written here, or for jagged attention with
          non-finite inputs the reference backend's (helper attn owns that rule, issue 19); NaN and
          Inf must sit exactly where the oracle has them (the propagation rule of these ops: an
          output is non-finite exactly when the maths on its inputs is).
  native  a direct call of torch.ops.gem_kernels.*_native with malformed arguments, which bypasses
          the Python checks: any exception is fine, and so is a result; only a crash or hang fails.
          `check` (optional) then asserts what the result must be.

Cases are generated once, deterministically, at import; `run_case` runs one in the current process
and returns (outcome class, detail). tests/test_fuzz.py runs them in forked children.

The files: tests/fuzz/core.py (Case, outcome classes, run_case), tests/fuzz/oracles.py (the
float64 twins), and one file of cases per family (tests/fuzz/<family>.py); this module builds them
all and is what test_fuzz.py and the forkserver import.
"""

from __future__ import annotations

import torch

import gem_kernels as gk

from tests.fuzz import attention, embedding_bag, interaction, jagged, native
from tests.fuzz.core import CASES, FAIL_CLASSES, KNOWN_CLASSES, OK_CLASSES, Case, run_case

__all__ = ["CASES", "Case", "FAIL_CLASSES", "KNOWN_CLASSES", "OK_CLASSES", "cases_for", "run_case", "warm_up"]


def _build():
    jagged.jagged_cases()
    interaction.interaction_cases()
    embedding_bag.embedding_bag_cases()
    attention.attention_cases()
    interaction.interaction_module_cases()
    native.native_cases()


_build()


def cases_for(backend: str) -> list[str]:
    """Names of the cases that run on `backend`, in a fixed order."""
    return [name for name, case in CASES.items() if case.backends is None or backend in case.backends]


def warm_up() -> None:
    """Run one case of each family on the host backends, in this process: the first op call of a
    process pays seconds of lazy set-up (torch.library dispatch, autograd), which a forkserver
    does once for all the children it forks. One thread only, so that no OpenMP pool exists to fork."""
    import warnings

    if torch.cuda.is_available():
        # A backward here would start autograd's per-device threads, and forked children could then
        # run no autograd ("Unable to handle autograd's threading in combination with fork"), nor
        # CUDA: on a GPU machine each child pays its own set-up instead.
        return
    torch.set_num_threads(1)
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, case in CASES.items():
            family = (name.split("/")[0], name.split("/")[1] if case.kind == "value" else "", case.kind)
            if family in seen:
                continue
            seen.add(family)
            for backend in ("reference", "cpu"):
                if case.backends is None or backend in case.backends:
                    if gk._backend.unavailable_reason(backend) is None:
                        run_case(case, backend, "cpu")
