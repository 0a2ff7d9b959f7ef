"""nn.Modules built on the gem_kernels ops; every module takes a ``backend`` switch."""

from .attention import HSTULayer, JaggedMultiheadAttention, MultiheadAttention, TransformerEncoderLayer
from .embedding_bag import EmbeddingBag, FusedEmbeddingBag, TableSpec
from .interaction import CrossNet, DotInteraction, WukongLayer, WukongStack

__all__ = ["CrossNet", "DotInteraction", "EmbeddingBag", "FusedEmbeddingBag", "HSTULayer", "JaggedMultiheadAttention", "MultiheadAttention",
           "TableSpec",
           "TransformerEncoderLayer",
           "WukongLayer", "WukongStack"]
