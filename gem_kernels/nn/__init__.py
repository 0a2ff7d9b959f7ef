"""nn.Modules built on the gem_kernels ops; every module takes a ``backend`` switch."""

from .attention import HSTULayer, JaggedMultiheadAttention, MultiheadAttention, TransformerEncoderLayer
from .embedding_bag import EmbeddingBag, FusedEmbeddingBag, TableSpec
from .interaction import (CrossNet, DotInteraction, FusedCrossNet, FusedInteractionArch, FusedLowRankCrossNet,
                          WukongLayer, WukongStack)
from .linear import MLP

__all__ = ["CrossNet", "DotInteraction", "EmbeddingBag", "FusedCrossNet", "FusedEmbeddingBag", "FusedInteractionArch",
           "FusedLowRankCrossNet", "HSTULayer", "JaggedMultiheadAttention", "MLP", "MultiheadAttention",
           "TableSpec",
           "TransformerEncoderLayer",
           "WukongLayer", "WukongStack"]
