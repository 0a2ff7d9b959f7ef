"""Builds gem_kernels._C: the C++ (CPU) kernels always, the CUDA kernels when possible.

Environment:
  GEM_KERNELS_CUDA        unset/"auto": build CUDA sources when nvcc and a CUDA build of torch exist;
                          "0": never; "1": always, and fail loudly when it cannot.
  GEM_KERNELS_CUDA_ARCHS  semicolon list of SM targets, default "80;90a".
  MAX_JOBS                parallel compile jobs (torch.utils.cpp_extension).
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _find_cuda_home() -> str | None:
    """CUDA_HOME, or the toolkit that `nvcc` really runs (it may be a wrapper script)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dry = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^#\$ _HERE_=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    bin_dir = match.group(1).strip() if match else os.path.dirname(os.path.realpath(nvcc))
    return os.path.dirname(bin_dir)


def _cuda_decision() -> tuple[bool, str]:
    mode = os.environ.get("GEM_KERNELS_CUDA", "auto").strip().lower()
    if mode in ("0", "false", "off", "no"):
        return False, "GEM_KERNELS_CUDA=0"
    import torch

    cuda_home = _find_cuda_home()
    why_not = None
    if torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is not a CUDA build"
    elif cuda_home is None or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        why_not = "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if why_not is None:
        os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
        return True, f"CUDA_HOME={cuda_home}"
    if mode in ("1", "true", "on", "yes"):
        sys.exit(f"GEM_KERNELS_CUDA=1 but the CUDA build is impossible: {why_not}")
    return False, why_not


def _gencode_flags(archs: str) -> list[str]:
    flags = []
    for arch in filter(None, (a.strip() for a in archs.split(";"))):
        num = arch.replace("sm_", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def _extra_cuda_includes() -> list[str]:
    """Headers torch's CUDA headers include (cusparse.h, cublas_v2.h...) that a trimmed toolkit may
    lack; torch's pip dependencies ship them under nvidia/cu*/include."""
    site = sysconfig.get_paths()["purelib"]
    return sorted(glob.glob(os.path.join(site, "nvidia", "cu[0-9]*", "include")))


def extensions():
    # Decide (and set CUDA_HOME) before torch.utils.cpp_extension is imported: it reads CUDA_HOME once.
    with_cuda, why = _cuda_decision()
    from torch.utils.cpp_extension import CppExtension

    print(f"gem_kernels: CUDA build {'on' if with_cuda else 'off'} ({why})", flush=True)
    _write_build_info(with_cuda=with_cuda, cuda_reason=why)
    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    include_dirs = [os.path.join(HERE, "csrc", "include")]
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp", _cpu_arch_flag()]
    if not with_cuda:
        return [
            CppExtension(
                "gem_kernels._C",
                sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx_flags},
                extra_link_args=["-fopenmp"],
            )
        ]
    from torch.utils.cpp_extension import CUDAExtension

    archs = os.environ.get("GEM_KERNELS_CUDA_ARCHS", "80;90a")
    nvcc_flags = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    nvcc_flags += _gencode_flags(archs)
    extra_inc = _extra_cuda_includes()
    return [
        CUDAExtension(
            "gem_kernels._C",
            sources + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=include_dirs + extra_inc,
            extra_compile_args={"cxx": cxx_flags + ["-DGEM_KERNELS_WITH_CUDA"],
                                "nvcc": nvcc_flags + ["-DGEM_KERNELS_WITH_CUDA"]},
            extra_link_args=["-fopenmp"],
        )
    ]


def _write_build_info(**info) -> None:
    """gem_kernels/_build_info.py: what `python -m gem_kernels info` reports about this build."""
    import torch

    info.update(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cpu_arch_flag=_cpu_arch_flag(),
        cuda_archs=os.environ.get("GEM_KERNELS_CUDA_ARCHS", "80;90a") if info["with_cuda"] else "",
        cuda_home=os.environ.get("CUDA_HOME", "") if info["with_cuda"] else "",
    )
    with open(os.path.join(HERE, "gem_kernels", "_build_info.py"), "w") as f:
        f.write("# Written by setup.py at build time; do not edit.\n")
        f.write(f"BUILD_INFO = {info!r}\n")


def _cpu_arch_flag() -> str:
    """AVX2+FMA (x86-64-v3) by default: every x86 server of the last decade runs it, and it is what
    at::vec::Vectorized needs for 256-bit lanes. GEM_KERNELS_CPU_ARCH=native tunes for this machine."""
    import platform

    arch = os.environ.get("GEM_KERNELS_CPU_ARCH")
    if platform.machine().lower() in ("x86_64", "amd64"):
        return f"-march={arch or 'x86-64-v3'}"
    return f"-mcpu={arch or 'native'}"


if __name__ == "__main__":
    ext_modules = extensions()
    from torch.utils.cpp_extension import BuildExtension

    setup(
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )
