"""The source distribution is what `pip install gem_kernels-*.tar.gz` compiles: it must hold every
source file the extension's build reads (headers, .inc row kernels, CUDA sources), not only the
.cpp files setup.py names, and every module of the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked(prefix: str = "") -> list[str]:
    """The checkout's files (tracked, and new ones git does not ignore) under `prefix`."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", prefix or "."],
                             cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files to compare the sdist with")
    return [line for line in out.stdout.splitlines() if line]


def test_sdist_holds_every_extension_source_and_module(tmp_path):
    sources, modules = _tracked("csrc"), [p for p in _tracked("gem_kernels") if p.endswith(".py")]
    assert any(p.endswith(".h") for p in sources) and any(p.endswith(".cu") for p in sources)
    # From a copy of the checkout: an egg-info left in the checkout by an earlier build lists the files
    # that build saw (its SOURCES.txt), which would hide a file the manifest no longer takes.
    tree = tmp_path / "tree"
    for name in _tracked():
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    env = dict(os.environ, GEM_KERNELS_CUDA="0")
    # setup.py sdist, not `python -m build`: no isolated env to download (CI and the GPU image are offline).
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=tree, env=env,
                   check=True, capture_output=True)
    (archive,) = (tmp_path / "dist").glob("gem_kernels-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = sorted(set(sources + modules) - names)
    assert not missing, f"the sdist lacks {len(missing)} source files, e.g. {missing[:5]}"
    assert not any(name.endswith((".so", ".o")) for name in names)
