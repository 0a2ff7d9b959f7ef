"""A GEM-like recommendation model on gem_kernels' fused kernels or on eager PyTorch, with a synthetic
data generator and a training loop (`python -m model.train`).

    from model import GemConfig, GemModel, make_batch, train_step
    cfg = GemConfig.small()
    m = GemModel(cfg, kernels="fused")
    batch = make_batch(cfg, 256, device="cpu", seed=0)
    loss = train_step(m, batch, torch.optim.Adam(m.parameters(), lr=1e-2))
"""

from .config import GemConfig
from .data import Batch, make_batch
from .gem import GemModel, train_step

__all__ = ["Batch", "GemConfig", "GemModel", "make_batch", "train_step"]
