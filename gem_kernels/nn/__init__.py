"""nn.Modules built on the gem_kernels ops, each with a ``backend`` switch."""

from .interaction import CrossNet, DotInteraction, WukongLayer, WukongStack

__all__ = ["CrossNet", "DotInteraction", "WukongLayer", "WukongStack"]
