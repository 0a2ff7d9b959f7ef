"""nn.Modules built on the gem_kernels ops; every module takes a ``backend`` switch."""

from .attention import HSTULayer, JaggedMultiheadAttention

__all__ = ["HSTULayer", "JaggedMultiheadAttention"]
