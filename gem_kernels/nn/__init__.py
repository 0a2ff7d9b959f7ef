"""nn.Modules built on the gem_kernels ops; every module takes a ``backend`` switch."""

from .attention import HSTULayer, JaggedMultiheadAttention
from .embedding_bag import FusedEmbeddingBag, TableSpec
from .interaction import CrossNet, DotInteraction, WukongLayer, WukongStack

__all__ = ["CrossNet", "DotInteraction", "FusedEmbeddingBag", "HSTULayer", "JaggedMultiheadAttention", "TableSpec",
           "WukongLayer", "WukongStack"]
