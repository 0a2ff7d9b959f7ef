"""Issue 25: on the GPU image, C++ checks (TORCH_CHECK) of the cpu backend crashed the process instead
of raising. These tests pin both halves: setup.py's toolchain check refuses the settings that were
measured to break the checks (docs/gpu.md, "C++ exceptions"), and a check inside the built extension
raises a Python exception, in a fresh process, in a forked child under the fuzz's address-space
limit (tests/test_fuzz.py's conditions), and after CUDA was queried (a GPU machine's forkserver)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_module():
    spec = importlib.util.spec_from_file_location("gk_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() runs only under __main__
    return module


SETUP = _setup_module()
RUNTIME = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30"


def test_clean_toolchain_has_no_problem():
    assert SETUP.toolchain_problems("-O2 -D_GLIBCXX_USE_CXX11_ABI=1", True, RUNTIME, RUNTIME) == []
    assert SETUP.toolchain_problems("", False, None, None) == []


@pytest.mark.parametrize("flags,needle", [
    ("-O2 -static-libstdc++", "-static-libstdc++"),
    ("clang++ -stdlib=libc++", "-stdlib=libc++"),
    ("-fno-exceptions", "-fno-exceptions"),
    ("-D_GLIBCXX_USE_CXX11_ABI=0", "_GLIBCXX_USE_CXX11_ABI=0"),
])
def test_bad_flags_are_named(flags, needle):
    problems = SETUP.toolchain_problems(flags, True, RUNTIME, RUNTIME)
    assert len(problems) == 1 and needle in problems[0]


def test_abi_flag_matching_torch_is_fine():
    assert SETUP.toolchain_problems("-D_GLIBCXX_USE_CXX11_ABI=0", False, RUNTIME, RUNTIME) == []


def test_compiler_runtime_newer_than_the_process_one():
    newer = "/opt/gcc14/lib64/libstdc++.so.6.0.33"
    problems = SETUP.toolchain_problems("", True, newer, RUNTIME)
    assert len(problems) == 1 and "newer" in problems[0]
    assert SETUP.toolchain_problems("", True, RUNTIME, newer) == []  # an older compiler's output loads


def test_setup_refuses_a_bad_toolchain(monkeypatch):
    monkeypatch.setenv("CXXFLAGS", "-static-libstdc++")
    monkeypatch.delenv("GEM_KERNELS_ALLOW_TOOLCHAIN", raising=False)
    with pytest.raises(SystemExit, match="GEM_KERNELS_ALLOW_TOOLCHAIN"):
        SETUP.check_toolchain()
    monkeypatch.setenv("GEM_KERNELS_ALLOW_TOOLCHAIN", "1")
    SETUP.check_toolchain()  # warns, builds


def test_this_toolchain_passes():
    """The toolchain this suite was built with passes its own check (else the build refused it)."""
    facts = SETUP._toolchain_facts()
    assert SETUP.toolchain_problems(facts["flags"], facts["torch_cxx11_abi"], facts["compiler_runtime"],
                                    facts["process_runtime"]) == []


# The C++ check: jagged_to_padded_native's offsets check (csrc/cpu/jagged.cpp), called directly so no
# Python validation runs before it.
_CALL = textwrap.dedent("""
    import torch, gem_kernels
    def call():
        try:
            torch.ops.gem_kernels.jagged_to_padded_native(torch.zeros(5, 3), torch.tensor([0, 2, 9]), 4, 0.0)
        except (RuntimeError, ValueError, IndexError) as exc:
            return "raised " + type(exc).__name__ + ": " + str(exc).splitlines()[0]
        return "returned"
""")
_MODES = {
    "plain": "print(call())",
    # tests/test_fuzz.py's children: forked from a process that imported torch, address space limited
    "forked_rlimit": textwrap.dedent("""
        import os, resource
        torch.cuda.is_available()  # the fuzz's forkserver asks this on a GPU machine
        pid = os.fork()
        if pid == 0:
            with open("/proc/self/status") as f:
                vm = next(int(l.split()[1]) << 10 for l in f if l.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (1536 << 20),) * 2)
            torch.set_num_threads(1)
            print(call(), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status", status)
    """),
}


@pytest.mark.parametrize("mode", list(_MODES))
def test_cpp_check_raises_in_a_subprocess(mode):
    pytest.importorskip("gem_kernels._C", reason="the extension is not built")
    proc = subprocess.run([sys.executable, "-c", _CALL + _MODES[mode]], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"the process died (status {proc.returncode}): {proc.stderr[-2000:]}"
    assert "raised RuntimeError: offsets out of range at b=1" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    if mode == "forked_rlimit":
        assert "child status 0" in proc.stdout, proc.stdout
