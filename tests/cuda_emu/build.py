"""Build csrc/cuda/*.cu as C++ for the CUDA emulation (cuda_emu.h) and register it on CPU tensors.

`load()` rewrites each .cu file into a build folder (kernel launches, dynamic and static shared memory,
device checks), compiles them with torch.utils.cpp_extension into `gem_kernels_cuda_emu`, and loads it.
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
_EXTERN_SMEM = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w[\w:\s]*?)\s+(\w+)\s*\[\s*\]\s*;")
# `__global__ void [__launch_bounds__(...)] name(`
_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")
_TEMPLATE_HEAD = re.compile(r"template\s*<((?:[^<>]|<(?:[^<>]|<[^<>]*>)*>)*)>\s*$")
_STATIC_SMEM = re.compile(r"\b__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([^;{}]*);")
_DECLARATOR = re.compile(r"^\s*(?P<type>.*?)(?P<name>\w+)\s*(?P<dims>(?:\[[^\]]*\]\s*)*)$", re.S)


def rewrite(source: str) -> str:
    """The C++ text of one .cu file or header for the emulation."""
    out = _LAUNCH.sub(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)})(", source)
    out = _EXTERN_SMEM.sub(lambda m: f"{m.group(1)}* {m.group(2)} = ::emu::dynamic_smem<{m.group(1)}>();", out)
    out = _rewrite_static_smem(out)
    out = out.replace("TORCH_LIBRARY_IMPL(gem_kernels, CUDA, m)", "TORCH_LIBRARY_IMPL(gem_kernels, CPU, m)")
    out = out.replace(".is_cuda()", ".is_cpu()")
    out = out.replace("c10::DeviceType::CUDA", "c10::DeviceType::CPU")  # shared checks take the device type
    out = re.sub(r"#include <(c10/cuda|ATen/cuda)/[^>]*>", "// (CUDA header: cuda_emu.h stands in)", out)
    if "<<<" in out:
        raise RuntimeError("a kernel launch was not rewritten")
    return out


def _rewrite_static_smem(source: str) -> str:
    """Each `__shared__ T a[N], b[M];` in a __global__ function becomes, on the same line,
    `struct emu_smem_a { using type = T[N]; static const void* kernel() {...} }; auto& a =
    ::emu::static_smem<emu_smem_a>();` (and the same for b): a reference to the running block's copy,
    poisoned at the block's start, whose size cuda_emu.h registers for the kernel while the library
    loads (launch limits, cudaFuncGetAttributes). A static __shared__ anywhere else is refused."""
    code = _blank_comments_and_strings(source)  # same offsets, so positions found in it apply to source
    edits = []
    for kernel in _KERNEL.finditer(code):
        head = _TEMPLATE_HEAD.search(code, 0, kernel.start())
        pointer = "&" + kernel.group(1)
        if head is not None:
            pointer += "<" + ", ".join(_template_argument(p) for p in _split_top_level(head.group(1))) + ">"
        body_start = code.index("{", _matching(code, kernel.end() - 1, "(", ")"))
        body_end = _matching(code, body_start, "{", "}")
        for decl in _STATIC_SMEM.finditer(code, body_start, body_end):
            edits.append((decl.start(), decl.end(), _static_smem_text(decl, pointer)))
    out, last = [], 0
    for start, end, text in edits:
        out.append(source[last:start])
        out.append(text)
        last = end
    out.append(source[last:])
    result = "".join(out)
    stray = _STATIC_SMEM.search(_blank_comments_and_strings(result))
    if stray is not None:
        raise RuntimeError(f"a static __shared__ declaration outside a __global__ function is not emulated: "
                           f"{stray.group(0)!r}")
    return result


def _static_smem_text(decl: re.Match, pointer: str) -> str:
    parts = _split_top_level(decl.group(1))
    first = _DECLARATOR.match(parts[0])
    if first is None or not first.group("type").strip():
        raise RuntimeError(f"cannot emulate the static __shared__ declaration {decl.group(0)!r}")
    base = first.group("type").strip()
    out = []
    for part in parts:
        m = _DECLARATOR.match(part)
        if m is None or (part is not parts[0] and m.group("type").strip()):
            raise RuntimeError(f"cannot emulate the static __shared__ declaration {decl.group(0)!r}")
        name, dims = m.group("name"), m.group("dims").strip()
        out.append(f"struct emu_smem_{name} {{ using type = {base}{dims}; static const void* kernel() {{ return "
                   f"reinterpret_cast<const void*>({pointer}); }} }}; "
                   f"auto& {name} = ::emu::static_smem<emu_smem_{name}>();")
    return " ".join(out)


def _template_argument(parameter: str) -> str:
    """`typename T = float` -> `T`, `int kBlock` -> `kBlock`, `typename... Ts` -> `Ts...`."""
    declaration = _split_top_level(parameter, "=")[0]
    name = re.findall(r"\w+", declaration)[-1]
    return name + "..." if "..." in declaration else name


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return parts


def _matching(code: str, open_at: int, open_ch: str, close_ch: str) -> int:
    """The index just past the bracket that closes the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == open_ch:
            depth += 1
        elif code[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise RuntimeError(f"unbalanced {open_ch!r} at offset {open_at}")


def _blank_comments_and_strings(source: str) -> str:
    """`source` with comments and string/char literals replaced by spaces (newlines kept)."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), source)


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
    # The headers the same way (checks.h's GK_CHECK_CUDA and the shared *_checks.h accept CPU tensors, cuda_smem.h loses its
    # CUDA includes); the build finds these copies first.
    for header in (ROOT / "csrc" / "include" / "gem_kernels").glob("*.h"):
        _write_if_changed(build / "include" / "gem_kernels" / header.name, rewrite(header.read_text()))
    import gem_kernels.testing.native

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
    gem_kernels.testing.native.set_native_cpu_kernels("cuda")
    return library


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
