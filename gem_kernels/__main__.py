"""`python -m gem_kernels info`: versions, backends, devices and build flags, for bug reports."""

import sys


def info() -> str:
    import platform

    import torch

    import gem_kernels
    from gem_kernels import _backend

    try:
        from gem_kernels._build_info import BUILD_INFO
    except ImportError:
        BUILD_INFO = {"note": "no build info (extension not built from this tree)"}
    lines = [
        f"gem_kernels {gem_kernels.__version__}",
        f"python {platform.python_version()} on {platform.platform()} ({platform.machine()})",
        f"torch {torch.__version__} (cuda {torch.version.cuda}), threads={torch.get_num_threads()}",
    ]
    try:
        import triton

        lines.append(f"triton {triton.__version__} (TRITON_INTERPRET={int(_backend.triton_interpret())})")
    except ImportError:
        lines.append("triton: not installed")
    try:
        import fbgemm_gpu  # noqa: F401

        lines.append(f"fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}")
    except Exception:
        lines.append("fbgemm_gpu: not installed")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
    else:
        lines.append("cuda devices: none")
    lines.append(f"build: {BUILD_INFO}")
    lines.append("backends:")
    for name in _backend.BACKENDS:
        reason = _backend.unavailable_reason(name)
        lines.append(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    lines.append(f"default backend: {_backend.get_backend()}")
    # What `auto` runs on CPU tensors, per family: a fused module on `reference` is plain PyTorch.
    cpu = torch.device("cpu")
    for family in _backend.FAMILIES:
        chosen = _backend.resolve_backend("auto", cpu, family)
        note = "  (NOT fused: the extension is not built here; see the cpu line above)" if chosen == "reference" else ""
        lines.append(f"auto on cpu tensors, {family}: {chosen}{note}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] in ([], ["info"]):
        print(info())
        return 0
    print("usage: python -m gem_kernels info", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
