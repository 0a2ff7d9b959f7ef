"""nn.Modules built on the gem_kernels ops; every module takes a ``backend`` switch."""

from .attention import HSTULayer, JaggedMultiheadAttention
from .interaction import CrossNet, DotInteraction, WukongLayer, WukongStack

__all__ = ["CrossNet", "DotInteraction", "HSTULayer", "JaggedMultiheadAttention", "WukongLayer", "WukongStack"]
