"""What of TorchRec works on this machine (scripts/gpu_check.sh, step torchrec): versions, which FBGEMM
ops TorchRec calls have a CUDA kernel (before and after scripts/gpu_site's shim), and one
gem_kernels.torchrec forward + backward on CUDA against torchrec's own EmbeddingBagCollection.
Exits non-zero when TorchRec does not import or that check fails: the TorchRec steps then skip."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch

try:
    import fbgemm_gpu
    import torchrec
except Exception as exc:  # any import failure means: no TorchRec steps here
    print(f"TorchRec does not import: {type(exc).__name__}: {exc}")
    sys.exit(1)
print("torch", torch.__version__, "torchrec", getattr(torchrec, "__version__", "?"), "fbgemm_gpu",
      getattr(fbgemm_gpu, "__version__", "?"), "from", Path(fbgemm_gpu.__file__).parent)

# Every fbgemm op TorchRec's sources name, and whether CUDA can run it.
root = Path(torchrec.__file__).parent
names = sorted({m for f in root.rglob("*.py") if "test" not in f.name
                for m in re.findall(r"torch\.ops\.fbgemm\.([A-Za-z0-9_]+)", f.read_text(errors="replace"))})


def cuda_coverage() -> tuple[list[str], list[str]]:
    has, lacks = [], []
    for name in names:
        if not hasattr(torch.ops.fbgemm, name):
            continue
        keys = ("CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")
        ok = any(torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{name}", k) for k in keys)
        (has if ok else lacks).append(name)
    return has, lacks


has, lacks = cuda_coverage()
print(f"fbgemm ops TorchRec names: {len(names)}; with a CUDA kernel: {len(has)}; without: {' '.join(lacks)}")
sys.path.insert(0, str(Path(__file__).parent / "gpu_site"))
import gk_fbgemm_cuda  # noqa: E402

print("shim registered CUDA kernels for:", " ".join(gk_fbgemm_cuda.register()) or "nothing (FBGEMM has them)")
has, lacks = cuda_coverage()
print(f"after the shim, still without a CUDA kernel: {' '.join(lacks) or 'none'}")

if not torch.cuda.is_available():
    print("no CUDA device: the CUDA check is skipped")
    sys.exit(0 if os.environ.get("GK_PROBE_ALLOW_CPU") else 1)

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402

import gem_kernels.torchrec as gtr  # noqa: E402

torch.manual_seed(0)
tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16 * (i + 1), num_embeddings=97, feature_names=[f"f{i}"])
          for i in range(3)]
ref = EmbeddingBagCollection(tables=tables, device=torch.device("cuda"))
fused = gtr.FusedEmbeddingBagCollection(tables, device=torch.device("cuda"))
fused.load_state_dict(ref.state_dict())
lengths = torch.tensor([2, 0, 3, 1, 4, 2, 0, 1, 1], device="cuda")
kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.randint(0, 97, (14,), device="cuda"),
                                          lengths=lengths)
expected = ref(kjt).values()
got = fused(kjt).values()
got.sum().backward()
err = (got - expected).abs().max().item()
print(f"gem_kernels.torchrec FusedEmbeddingBagCollection on CUDA: max |fused - torchrec| = {err:.3g}")
sys.exit(0 if err <= 1e-5 else 1)
