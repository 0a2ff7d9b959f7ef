"""TorchRec front door: KeyedJaggedTensor in, KeyedTensor / dict[str, JaggedTensor] out, one fused
embedding-bag call for all tables.

The only package of gem_kernels that imports torchrec (``import gem_kernels`` never does); reach it
as ``gem_kernels.torchrec`` or ``from gem_kernels.torchrec import FusedEmbeddingBagCollection``.
"""

INSTALL_HINT = (
    "gem_kernels.torchrec needs TorchRec. On a machine without a GPU install it next to the CPU build of "
    "FBGEMM: pip install fbgemm-gpu-cpu==1.9.0 tensordict==0.15.3 torchmetrics==1.0.3 pyre-extensions==0.0.32 "
    "tqdm==4.70.1 && pip install --no-deps torchrec==1.9.2 (plain `pip install torchrec` pulls the CUDA fbgemm-gpu)"
)

try:
    import torchrec  # noqa: F401
except ImportError as error:
    raise ImportError(f"{INSTALL_HINT}; importing torchrec failed with: {error}") from error

from .embedding_modules import (  # noqa: E402
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    PartitionedEmbeddingBagCollection,
    PartitionedEmbeddingCollection,
)
from .quant_embedding_modules import QuantEmbeddingBagCollection  # noqa: E402
from .sharding import (  # noqa: E402
    FusedEmbeddingBagCollectionSharder,
    FusedEmbeddingCollectionSharder,
    sharding_plan,
)
from .zch_modules import ZchEmbeddingBagCollection  # noqa: E402  (also registers its gk.swap converter)
from .zch_sharding import ZchEmbeddingBagCollectionSharder  # noqa: E402

__all__ = ["FusedEmbeddingBagCollection", "FusedEmbeddingCollection", "PartitionedEmbeddingBagCollection",
           "PartitionedEmbeddingCollection", "QuantEmbeddingBagCollection",
           "ZchEmbeddingBagCollection", "FusedEmbeddingBagCollectionSharder", "FusedEmbeddingCollectionSharder",
           "ZchEmbeddingBagCollectionSharder", "sharding_plan", "INSTALL_HINT"]
