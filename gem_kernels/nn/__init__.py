"""nn.Modules built on the gem_kernels ops."""

from .embedding_bag import FusedEmbeddingBag, TableSpec

__all__ = ["FusedEmbeddingBag", "TableSpec"]
