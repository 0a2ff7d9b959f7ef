"""The GEM-like recommendation model on gem_kernels' fused kernels or on TorchRec's eager modules,
with synthetic data from a planted teacher and a training loop (`python -m model.train`).

    from model import GemConfig, GemModel, SyntheticBatches
    cfg = GemConfig.tiny()
    model = GemModel(cfg, kernels="fused")
    optimizers = model.make_optimizers()
    loss = model.loss(SyntheticBatches(cfg)[0])
"""

from .config import GemConfig
from .data import Batch, SyntheticBatches
from .gem import GemModel, PhaseTimer

__all__ = ["Batch", "GemConfig", "GemModel", "PhaseTimer", "SyntheticBatches"]
