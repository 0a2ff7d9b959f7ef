"""Builds gem_kernels._C: the C++ (CPU) kernels always, the CUDA kernels when possible.

Environment:
  GEM_KERNELS_CUDA        unset/"auto": build CUDA sources when nvcc and a CUDA build of torch exist;
                          "0": never; "1": always, and fail loudly when it cannot.
  GEM_KERNELS_CUDA_ARCHS  semicolon list of SM targets, default "80;90a".
  MAX_JOBS                parallel compile jobs (torch.utils.cpp_extension).
  GEM_KERNELS_ALLOW_TOOLCHAIN=1   build even when the toolchain check finds a problem (it then warns).

`python setup.py --toolchain-report` prints the compiler, its C++ runtime, the one torch runs with,
and the toolchain check's findings, and builds nothing.
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


# Toolchain settings that make a build whose C++ checks (TORCH_CHECK) do not reach Python as a clean
# exception, each measured with a one-op probe extension (docs/gpu.md, "C++ exceptions"):
#   -static-libstdc++   a second C++ runtime inside the extension: the check still raises, but its
#                       message loses the numbers formatted into it ("got -1" became "got ")
#   -stdlib=libc++      another C++ library: the extension does not load (undefined symbols)
#   _GLIBCXX_USE_CXX11_ABI other than torch's: the extension does not load (undefined symbols)
#   -fno-exceptions     TORCH_CHECK cannot throw: the sources do not compile
_BAD_FLAGS = {
    "-static-libstdc++": "links a second copy of the C++ runtime into the extension; exceptions cross two "
                         "runtimes and the checks' messages lose their formatted values",
    "-stdlib=libc++": "builds against libc++, torch uses libstdc++: the extension would not load",
    "-fno-exceptions": "TORCH_CHECK throws; the checks cannot raise without exceptions",
}


def toolchain_problems(flags: str, torch_cxx11_abi: bool, compiler_runtime: str | None,
                       process_runtime: str | None) -> list[str]:
    """What in this toolchain would build an extension whose C++ checks do not raise clean Python
    exceptions. ``flags``: CC, CXX, CFLAGS, CXXFLAGS and LDFLAGS joined; ``compiler_runtime``: the
    libstdc++.so.6 the compiler links against; ``process_runtime``: the one this Python process (with
    torch imported) has loaded. Paths resolved, or None when unknown."""
    problems = [f"{flag}: {why}" for flag, why in _BAD_FLAGS.items() if flag in flags.split()]
    for value in re.findall(r"-D_GLIBCXX_USE_CXX11_ABI=(\d+)", flags):
        if bool(int(value)) != torch_cxx11_abi:
            problems.append(f"-D_GLIBCXX_USE_CXX11_ABI={value}: torch is built with {int(torch_cxx11_abi)}; "
                            "the extension would not load")
    newer = _libstdcxx_version(compiler_runtime), _libstdcxx_version(process_runtime)
    if None not in newer and newer[0] > newer[1]:
        problems.append(f"the compiler's C++ runtime {compiler_runtime} is newer than the one Python runs with "
                        f"({process_runtime}): the extension may need symbols that runtime lacks; "
                        "build with the compiler that matches it, or run with LD_LIBRARY_PATH naming the newer one")
    return problems


def _libstdcxx_version(path: str | None) -> tuple[int, ...] | None:
    match = re.search(r"libstdc\+\+\.so\.(\d+(?:\.\d+)+)$", path or "")
    return tuple(int(x) for x in match.group(1).split(".")) if match else None


def _toolchain_facts() -> dict:
    import torch
    from torch.utils.cpp_extension import get_cxx_compiler

    cxx = get_cxx_compiler()
    flags = " ".join(os.environ.get(k, "") for k in ("CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS"))
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
        runtime = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
        runtime = os.path.realpath(runtime) if os.path.isabs(runtime) else None
    except (OSError, IndexError, subprocess.TimeoutExpired):
        version, runtime = "?", None
    loaded = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libstdc++.so" in line:
                loaded = os.path.realpath(line.split()[-1])
                break
    return {"cxx": cxx, "cxx_version": version, "flags": flags.strip(), "torch_cxx11_abi": torch._C._GLIBCXX_USE_CXX11_ABI,
            "compiler_runtime": runtime, "process_runtime": loaded}


def check_toolchain(report: bool = False) -> None:
    """Refuses a toolchain that would build crashing or garbled C++ checks (GEM_KERNELS_ALLOW_TOOLCHAIN=1:
    warn and build anyway)."""
    facts = _toolchain_facts()
    problems = toolchain_problems(facts["flags"], facts["torch_cxx11_abi"], facts["compiler_runtime"],
                                  facts["process_runtime"])
    if report:
        for key, value in facts.items():
            print(f"gem_kernels toolchain: {key} = {value}")
    for problem in problems:
        print(f"gem_kernels toolchain problem: {problem}", file=sys.stderr)
    if problems and not report and os.environ.get("GEM_KERNELS_ALLOW_TOOLCHAIN") != "1":
        sys.exit("gem_kernels: this toolchain would build an extension whose C++ checks do not raise clean Python "
                 "exceptions (above); fix it, or set GEM_KERNELS_ALLOW_TOOLCHAIN=1 to build anyway")


def extensions():
    # Decide (and set CUDA_HOME) before torch.utils.cpp_extension is imported: it reads CUDA_HOME once.
    with_cuda, why = _cuda_decision()
    check_toolchain()
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
    if "--toolchain-report" in sys.argv:
        check_toolchain(report=True)
        sys.exit(0)
    ext_modules = extensions()
    from torch.utils.cpp_extension import BuildExtension

    setup(
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )
