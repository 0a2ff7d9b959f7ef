"""gem_kernels.testing.sync_counter: what it counts as a host sync on CPU tensors, and that it undoes itself."""

import pytest
import torch

import gem_kernels as gk
from gem_kernels.testing.sync_counter import SyncCounter

from .utils import offsets_from_lengths


def test_counts_each_would_be_sync_once():
    x = torch.tensor([1, 0, 3])
    with SyncCounter("cpu") as syncs:
        x[0].item()
        int(x[1])
        bool(x.sum() > 0)
        x.tolist()
        torch.nonzero(x)
        x[x > 0]
        x.repeat_interleave(x)
        x.repeat_interleave(x, output_size=4)  # the size is given: no sync
        (x + 1).sum()  # no read: no sync
    assert dict(syncs.by_kind) == {"item": 3, "tolist": 1, "nonzero": 1, "bool_index": 1, "repeat_interleave": 1}
    assert syncs.count == 7


def test_undoes_its_patches_and_mode():
    original = torch.Tensor.tolist
    with SyncCounter("cpu") as syncs:
        assert torch.Tensor.tolist is not original
    assert torch.Tensor.tolist is original
    torch.tensor([1.0]).item()  # outside: not counted
    assert syncs.count == 0


def test_sees_the_checks_inside_custom_ops():
    """A dispatch mode sees a Python custom op as one call; the counter runs its body under the mode,
    so the front door's value checks (offsets read in the forward op) count."""
    values, offsets = torch.randn(5, 2), offsets_from_lengths([2, 0, 3])
    with SyncCounter("cpu") as syncs:
        gk.jagged_to_padded(values, offsets, 3, backend="reference")
    # The forward op reads the offsets summary in one copy (gem_kernels/_validate.py).
    assert syncs.where["tolist"]["gem_kernels._validate"] == 1, dict(syncs.where)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="set_sync_debug_mode needs a GPU")
def test_cuda_mode_records_syncs():
    x = torch.ones(3, device="cuda")
    with SyncCounter("cuda") as syncs:
        x.sum().item()
        x * 2
    assert syncs.count == 1


def test_optimizer_step_counters_are_not_syncs():
    """Adam keeps `step` on the CPU even for GPU parameters (capturable=False): its .item() is free."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    with SyncCounter("cpu") as syncs:
        p.grad = torch.ones(3)
        opt.step()
    assert syncs.count == 0, dict(syncs.where)
