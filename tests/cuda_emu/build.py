"""Build csrc/cuda/*.cu as C++ for the CUDA emulation (cuda_emu.h) and register it on CPU tensors.

`load()` rewrites each .cu file into a build folder (kernel launches, dynamic shared memory, device
checks), compiles them with torch.utils.cpp_extension into `gem_kernels_cuda_emu`, and loads it.
With GK_CUDA_EMU_ASAN=1 it builds them with AddressSanitizer (a separate build), so that a kernel's
read or write outside any allocation is reported. The process must then start with the ASan
runtime, and libstdc++ before it (else importing Triton aborts in ASan's __cxa_throw interceptor):
  LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
  ASAN_OPTIONS=detect_leaks=0 GK_CUDA_EMU=1 GK_CUDA_EMU_ASAN=1 python -m pytest tests -k "cpu and not triton"
(one command line).
Its `TORCH_LIBRARY_IMPL(gem_kernels, CPU, m)` blocks take over the CPU kernels of
`gem_kernels._C` for the rest of the process: every test of the `cpu` backend then runs the CUDA
kernels' code. tests/conftest.py does this when GK_CUDA_EMU=1.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# `kernel<T, U><<<grid, block, smem, stream>>>(` -> `::emu::launch(kernel<T, U>, grid, block, smem, stream)(`
_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<(?:[^<>;()]|<[^<>;()]*>)*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
_EXTERN_SMEM = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def rewrite(source: str) -> str:
    """The C++ text of one .cu file or header for the emulation."""
    out = _LAUNCH.sub(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)})(", source)
    out = _EXTERN_SMEM.sub(lambda m: f"{m.group(1)}* {m.group(2)} = ::emu::dynamic_smem<{m.group(1)}>();", out)
    out = out.replace("TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m)", "TORCH_LIBRARY_IMPL(gem_kernels, CPU, m)")
    out = out.replace(".is_cuda()", ".is_cpu()")
    out = re.sub(r"#include <(c10/cuda|ATen/cuda)/[^>]*>", "// (CUDA header: cuda_emu.h stands in)", out)
    if "<<<" in out:
        raise RuntimeError("a kernel launch was not rewritten")
    return out


def load(verbose: bool = False):
    """Compile (cached by torch.utils.cpp_extension) and load the emulated CUDA kernels."""
    from torch.utils import cpp_extension

    asan = os.environ.get("GK_CUDA_EMU_ASAN") == "1"
    default = ROOT / "build" / ("cuda_emu_asan" if asan else "cuda_emu")
    build = Path(os.environ.get("GK_CUDA_EMU_BUILD", default))
    (build / "src").mkdir(parents=True, exist_ok=True)
    (build / "include" / "gem_kernels").mkdir(parents=True, exist_ok=True)
    sources = []
    for cu in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        target = build / "src" / (cu.stem + ".cpp")
        _write_if_changed(target, rewrite(cu.read_text()))
        sources.append(str(target))
    # The headers the same way (checks.h's GK_CHECK_CUDA accepts CPU tensors, cuda_smem.h loses its
    # CUDA includes); the build finds these copies first.
    for header in (ROOT / "csrc" / "include" / "gem_kernels").glob("*.h"):
        _write_if_changed(build / "include" / "gem_kernels" / header.name, rewrite(header.read_text()))
    import gem_kernels._backend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel" for each op
        library = cpp_extension.load(
            name="gem_kernels_cuda_emu_asan" if asan else "gem_kernels_cuda_emu",
            sources=sources,
            extra_include_paths=[str(build / "include"), str(HERE)],
            extra_cflags=["-O1", "-g0", "-include", str(HERE / "cuda_emu.h"), "-Wno-unused-variable"]
            + (["-fsanitize=address", "-fno-omit-frame-pointer", "-g"] if asan else []),
            extra_ldflags=["-fsanitize=address"] if asan else [],
            build_directory=str(build),
            is_python_module=False,
            verbose=verbose,
        )
    gem_kernels._backend._native_cpu_kernels = "cuda"
    return library


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
