"""Writing a run's results: JSON (machine, peaks, rows), a markdown table and a roofline PNG.

Files: <out>/<device>-<timestamp>.{json,md,png} plus copies <out>/latest-<device>.{json,md,png}.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "results"


def utc_timestamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def git_sha() -> str:
    """Short sha of the checkout the bench runs from, "+dirty" with uncommitted changes; "unknown"
    outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    info = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": None,
        "device": device.type,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device.type == "cuda" else 0)
        info["gpu"] = f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    for module in ("triton", "fbgemm_gpu", "gem_kernels"):
        try:
            info[module] = getattr(__import__(module), "__version__", "?")
        except Exception:
            info[module] = None
    try:
        import gem_kernels

        info["gem_kernels_backends"] = gem_kernels.available_backends()
    except Exception:
        info["gem_kernels_backends"] = None
    return info


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = ("family", "op", "shape", "dtype", "impl", "ms", "p10-p90 ms", "n", "TFLOP/s", "GB/s", "% peak",
           "speedup", "faults/call")


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        speedup = _fmt(r["speedup_vs_baseline"], ".2f") + ("x" if r["speedup_vs_baseline"] is not None else "")
        pct = _fmt(r["pct_peak"], ".1f")
        if r["pct_peak"] is not None:
            pct += " (bw)" if r["peak"] == "bandwidth" else " (mm)"
        cells = [r["family"], r["op"], r["shape"], r["dtype"], r["impl"], f"{r['ms']:.3f}",
                 f"{r['ms_p10']:.3f}-{r['ms_p90']:.3f}", f"{r['repeats']}{'*' if r['capped'] else ''}{' (few)' if r.get('few_repeats') else ''}",
                 _fmt(r["tflops"], ".3g"), _fmt(r["gbps"], ".1f"), pct, f"{speedup} vs {r['baseline']}",
                 _fmt(r.get("page_faults_per_call"), ".0f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _measurements(peaks: dict) -> str:
    if "measurements" not in peaks:
        return ""
    each = "; ".join(
        ", ".join(f"{k} {v:.3f}" for k, v in m["matmul_tflops"].items()) + f" TFLOP/s, {m['copy_gbps']:.1f} GB/s"
        for m in peaks["measurements"])
    return f"; the better of the measurements before and after the kernels ({each})"


def _load_warning(load: dict, cores) -> str:
    if cores and max(load["start"], load["end"]) > cores:
        return " (above the core count: other processes compete for the CPU and the timings are noisy)"
    return ""


def _above_peak(rows: list[dict]) -> list[str]:
    """A line explaining rows above 100 % of their roof, if any: they are not errors of the op's count."""
    above = [r for r in rows if r["pct_peak"] is not None and r["pct_peak"] > 100]
    if not above:
        return []
    kinds = sorted({r["peak"] for r in above})
    why = {"bandwidth": "bandwidth rows: the op's minimum bytes count every lookup or element once from memory, "
                        "and caches serve what repeats (hot embedding rows, a working set that fits in L2/L3)",
           "matmul": "matmul rows: the matmul roof was measured low (load from other processes during both "
                     "measurements), or the op's matmuls are shaped better for the BLAS than the square one"}
    named = ", ".join(f"{r['op']} [{r['shape']}] {r['impl']} {r['pct_peak']:.0f} %" for r in above)
    return [f"- {len(above)} rows are above 100 % of their measured peak ({named}); "
            + "; ".join(why[k] for k in kinds)]


def markdown(result: dict) -> str:
    m, p = result["machine"], result["peaks"]
    mm = ", ".join(f"{k} {v:.3f}" for k, v in p.get("matmul_tflops", {}).items())
    lines = [
        f"# gem_kernels bench: {m['device']} @ {result['timestamp']} (git {result['git_sha']})",
        "",
        f"- CPU: {m['cpu_model']}, {m['cpu_cores']} cores (torch threads {m['torch_threads']}); GPU: {m['gpu'] or 'none'}",
        f"- torch {m['torch']} (cuda {m['torch_cuda']}), triton {m['triton']}, fbgemm_gpu {m['fbgemm_gpu']}, "
        f"gem_kernels {m['gem_kernels']} (backends {m['gem_kernels_backends']})",
        f"- measured peaks: matmul TFLOP/s {mm} (n={p['sizes']['matmul_n']}); copy {p['copy_gbps']:.1f} GB/s "
        f"({p['sizes']['copy_mib']} MiB, read+write counted){_measurements(p)}",
        f"- 1-min load average {result['loadavg_1min']['start']:.1f} at start, {result['loadavg_1min']['end']:.1f} at end"
        f"{_load_warning(result['loadavg_1min'], m['cpu_cores'])}; "
        f"THP_MEM_ALLOC_ENABLE={int(result.get('thp_mem_alloc', False))}",
        *_above_peak(result["rows"]),
        f"- mode: {'quick' if result['quick'] else 'full'}; families: "
        + ", ".join(f"{f['name']} {f['status']} ({f['seconds']:.1f} s)" for f in result["families"]),
        "",
        "ms = median; n = timed repeats (* = stopped by the per-impl time cap; (few) = under 5: a noisy median, "
        "its speedup is used for no goal); GB/s = minimum bytes / median time; "
        "% peak of the measured copy bandwidth (bw) or the dtype's matmul peak (mm); "
        "speedup = baseline ms / impl ms; faults/call = minor page faults per call (CPU: first touches of fresh "
        "output pages, which glibc maps anew for every block over 32 MiB).",
        "",
        *table_lines(result["rows"]),
    ]
    notes = [n for f in result["families"] for n in f["notes"]]
    errors = [e for f in result["families"] for e in f["errors"]]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------------


def roofline(result: dict, path: Path) -> None:
    """Left: achieved TFLOP/s against arithmetic intensity (FLOP/byte), both log, under the measured
    roofs (copy bandwidth slope, one matmul ceiling per dtype), one point per (op, impl, shape,
    dtype). Right: 0-FLOP ops (pure data movement) as GB/s bars against the copy peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    peaks = result["peaks"]
    bw = peaks["copy_gbps"]
    compute = [r for r in rows if r["flops"] and r["bytes"]]
    movement = [r for r in rows if not r["flops"] and r["bytes"]]
    unplotted = [r for r in rows if not r["bytes"]]
    height = max(5.0, 0.28 * len(movement) + 1.5)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, height), gridspec_kw={"width_ratios": [1.2, 1]})

    intensities = [r["flops"] / r["bytes"] for r in compute]
    lo = min(intensities + [0.1]) / 4
    hi = max(intensities + [1000.0]) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    top = max(peaks["matmul_tflops"].values())
    ax.plot(xs, [min(top, x * bw / 1e3) for x in xs], color="black", lw=1.5, label=f"copy {bw:.0f} GB/s")
    for (name, peak), style in zip(peaks["matmul_tflops"].items(), ("-", "--", "-.", ":")):
        ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], ls=style, lw=1, color="gray")
        ax.text(hi / 1.2, peak * 1.08, f"{name} matmul {peak:.2f} TFLOP/s", ha="right", va="bottom", fontsize=8)
    achieved = [r["tflops"] for r in compute + unplotted if r["tflops"]]
    ax.set_ylim(min(achieved + [top / 1e4]) / 3, top * 3)
    ops = sorted({r["op"] for r in compute})
    impls = sorted({r["impl"] for r in compute})
    markers = "osD^v<>pP*Xh"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, x in zip(compute, intensities):
        ax.scatter(x, r["tflops"], marker=markers[impls.index(r["impl"]) % len(markers)],
                   color=colors[ops.index(r["op"]) % len(colors)], s=36, zorder=3)
        ax.annotate(f"{r['op']}/{r['impl']}", (x, r["tflops"]), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    # FLOPs but no byte count (a whole training step): achieved TFLOP/s as a dotted level.
    for r in unplotted:
        if r["tflops"]:
            ax.axhline(r["tflops"], ls=":", lw=1, color=colors[impls.index(r["impl"]) % len(colors)]
                       if r["impl"] in impls else "tab:purple")
            ax.text(lo * 1.2, r["tflops"] * 1.05, f"{r['op']}/{r['impl']} (no byte count)", fontsize=7, va="bottom")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP / minimum byte)")
    ax.set_ylabel("achieved TFLOP/s")
    title = f"roofline, {result['machine']['device']} ({len(compute)} points)"
    if unplotted:
        title += f"\ndotted levels: ops with FLOPs but no byte count ({len(unplotted)})"
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")

    if movement:
        labels = [f"{r['op']} {r['dtype']} [{r['impl']}]" for r in movement]
        ys = list(range(len(movement)))
        bx.barh(ys, [r["gbps"] for r in movement],
                color=[colors[sorted({m['op'] for m in movement}).index(r["op"]) % len(colors)] for r in movement])
        bx.set_yticks(ys, labels, fontsize=7)
        bx.invert_yaxis()
        bx.axvline(bw, color="black", ls="--", lw=1)
        bx.axvline(bw / 2, color="gray", ls=":", lw=1)
        bx.text(bw, -0.6, f" copy peak {bw:.0f}", fontsize=8, va="bottom")
    else:
        bx.text(0.5, 0.5, "no 0-FLOP ops in this run", ha="center", va="center", transform=bx.transAxes)
    bx.set_xlabel("GB/s = minimum bytes / median time\n(dashed: measured copy peak, dotted: half of it)")
    bx.set_title("data-movement ops (0 FLOPs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict, out_dir: Path) -> dict[str, Path]:
    """Write the JSON, markdown and PNG plus latest-<device> copies; returns the written paths."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['machine']['device']}-{result['timestamp']}"
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["md"].write_text(markdown(result))
    roofline(result, paths["png"])
    for ext, path in list(paths.items()):
        latest = out_dir / f"latest-{result['machine']['device']}.{ext}"
        shutil.copyfile(path, latest)
    return paths
