"""gem_kernels: fused Triton, CUDA and CPU kernels for large recommendation models.

Every op has four backends (see ``available_backends()``): ``reference`` (plain PyTorch, the
ground truth), ``cpu`` (C++), ``cuda`` (CUDA C++) and ``triton``. Pick one per call with
``backend=``, for a block with ``with use_backend(name):``, or globally with ``use_backend(name)``;
``auto`` (the default) takes cuda > triton on CUDA tensors (attention: triton > cuda, its tiles use the tensor
cores) and cpu > reference on CPU tensors; `gem_kernels._backend.FAMILIES` holds each family's order.
"""

from ._backend import (
    BACKENDS,
    BackendUnavailableError,
    available_backends,
    get_backend,
    use_backend,
)
from .ops.attention import jagged_attention
from .ops.cached_attention import cached_jagged_attention
from ._embedding_bag import TableLayout, TableMeta, pack_tables
from .ops.embedding_bag import embedding_bag
from .ops.interaction import cross_layer, dot_interaction, feature_mix_norm, fm_compress
from .ops.jagged import jagged_to_padded, padded_to_jagged
from .ops.linear import linear
from .ops.zch import ZchTables, zch_remap
from . import inference, nn, optim
from .nn.embedding_bag import FusedEmbeddingBag, TableSpec
from .ops.quant_embedding_bag import quant_embedding_bag
from .nn.quant_embedding_bag import QuantizedEmbeddingBag
from .nn.hashed_embedding_bag import HashedEmbeddingBag
from ._swap import SwapReport, SwapSkip, register, swap
from ._autograd import enable_eager_fast_paths as _enable_eager_fast_paths

_enable_eager_fast_paths()  # every op is defined by now (gem_kernels/_autograd.py: the eager fast path)

# `gem_kernels.swap` is the function (its engine is the private module _swap); register, SwapSkip and
# SwapReport are gem_kernels' own names, not attributes of the function.

__version__ = "0.1.0"


def __getattr__(name: str):
    # gk.torchrec is imported on first touch only, so `import gem_kernels` never needs TorchRec;
    # without it, the ImportError says how to install it.
    if name == "torchrec":
        import importlib

        return importlib.import_module(".torchrec", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "available_backends",
    "get_backend",
    "use_backend",
    "jagged_attention",
    "cached_jagged_attention",
    "jagged_to_padded",
    "padded_to_jagged",
    "dot_interaction",
    "cross_layer",
    "fm_compress",
    "feature_mix_norm",
    "linear",
    "FusedEmbeddingBag",
    "TableSpec",
    "embedding_bag",
    "quant_embedding_bag",
    "QuantizedEmbeddingBag",
    "TableMeta",
    "TableLayout",
    "pack_tables",
    "zch_remap",
    "ZchTables",
    "HashedEmbeddingBag",
    "swap",
    "SwapReport",
    "SwapSkip",
    "register",
    "inference",
    "nn",
    "optim",
    "__version__",
]
