"""Writing a run's results: JSON (machine, peaks, rows), a markdown table and two figures.

Files: <out>/<device>-<timestamp>.{json,md,png} and <device>-<timestamp>-speedup.png, plus copies
<out>/latest-<device>.{json,md,png} and latest-<device>-speedup.png.
  <stem>-speedup.png  one panel per family: every impl's speedup over the case's baseline (log scale);
  <stem>.png          the roofline of each case's gem_kernels impl and its best peer, numbered, with a key.
``python -m bench.report RUN.json`` redraws the markdown and both figures from a run's JSON.
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


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_vector_rows(flags: set[str] | None = None, environ=os.environ) -> str:
    """Which rows gem_kernels' CPU kernels run here, decided as they decide it at run time
    (csrc/include/gem_kernels/cpu_exp.h): 16-lane AVX-512 rows where the CPU has AVX-512F and
    GEM_KERNELS_NO_AVX512 is not set (any value, "0" too, keeps AVX2), else 8-lane AVX2 rows. A run
    with the AVX2 rows forced is not the AVX-512 run of the same machine: the report says which it is."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"portable loops ({platform.machine()})"
    flags = _cpu_flags() if flags is None else flags
    if "avx512f" not in flags:
        return "AVX2 (no AVX-512F on this CPU)"
    if environ.get("GEM_KERNELS_NO_AVX512") is not None:
        return "AVX2 (AVX-512 off: GEM_KERNELS_NO_AVX512 is set)"
    return "AVX-512 where a kernel has 16-lane rows, else AVX2"


def machine_info(device: torch.device) -> dict:
    info = {
        "cpu_model": _cpu_model(),
        "cpu_vector_rows": cpu_vector_rows(),
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


COLUMNS = ("family", "op", "shape", "dtype", "impl", "ms", "p10-p90 ms", "n", "compile_s", "TFLOP/s", "GB/s (floor)",
           "GB/s (FBGEMM formula)", "% peak", "speedup", "faults/call", "verified")


def verified_text(row: dict) -> str:
    """The verification cell: failed (why), unverified (why), the impl it matched, or the reference itself."""
    if row.get("status") == "failed":
        return f"FAILED: {row['failed']}"
    if row.get("unverified"):
        return f"UNVERIFIED: {row['unverified']}"
    if row.get("verified_against"):
        return f"vs {row['verified_against']}"
    if "verified_against" in row:
        return "(is the reference)"
    return "?"  # a row from before verification was recorded


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        common = [r["family"], r["op"], r["shape"], r["dtype"], r["impl"]]
        compile_s = _fmt(r.get("compile_s"), ".1f")
        if r.get("ms") is None:
            cells = common + ["FAILED", "-", "-", compile_s] + ["-"] * 6 + [verified_text(r)]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
            continue
        speedup = _fmt(r["speedup_vs_baseline"], ".2f") + ("x" if r["speedup_vs_baseline"] is not None else "")
        pct = _fmt(r["pct_peak"], ".1f")
        if r["pct_peak"] is not None:
            pct += " (bw)" if r["peak"] == "bandwidth" else " (mm)"
        if r.get("pct_gather_peak") is not None:
            # "interleaved": against the roof timed round-robin with the impls (Case.gather_roof)
            pct += f"; {r['pct_gather_peak']:.1f} of gather{' (interleaved)' if r.get('gather_roof_ms') else ''}"
        if r.get("pct_gemm_roof") is not None:
            # against the case's GEMMs alone, timed round-robin with the impls (Case.gemm_roof)
            pct += f"; {r['pct_gemm_roof']:.1f} of its GEMMs (interleaved)"
        cells = common + [f"{r['ms']:.3f}", f"{r['ms_p10']:.3f}-{r['ms_p90']:.3f}",
                          f"{r['repeats']}{'*' if r['capped'] else ''}{' (few)' if r.get('few_repeats') else ''}",
                          compile_s, _fmt(r["tflops"], ".3g"), _fmt(r["gbps"], ".1f"), _fmt(r.get("gbps_formula"), ".1f"),
                          pct, f"{speedup} vs {r['baseline']}", _fmt(r.get("page_faults_per_call"), ".0f"),
                          verified_text(r)]
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
        return (" (above the core count: other processes compete for the CPU and the timings are noisy; "
                "multi-threaded calls, ours and the peers', also wait at OpenMP barriers for descheduled "
                "threads: bench/results/omp-wait-20261207T002709Z)")
    return ""


def _above_peak(rows: list[dict]) -> list[str]:
    """A line explaining rows above 100 % of their roof, if any: they are not errors of the op's count."""
    above = [r for r in rows if r.get("pct_peak") is not None and r["pct_peak"] > 100]
    if not above:
        return []
    kinds = sorted({r["peak"] for r in above})
    why = {"bandwidth": "bandwidth rows: the floor counts every distinct byte once from memory, and a working set "
                        "that fits in L2/L3 is served faster than the measured peak (a transfer far larger than the caches)",
           "matmul": "matmul rows: the matmul roof was measured low (load from other processes during both "
                     "measurements), or the op's matmuls are shaped better for the BLAS than the square one"}
    named = ", ".join(f"{r['op']} [{r['shape']}] {r['impl']} {r['pct_peak']:.0f} %" for r in above)
    return [f"- {len(above)} rows are above 100 % of their measured peak ({named}); "
            + "; ".join(why[k] for k in kinds)]


LEGEND = (
    "ms = median; n = timed repeats (* = stopped by the per-impl time cap; (few) = under 5: a noisy median, its "
    "speedup is used for no goal); compile_s = seconds a compiled impl took to compile and run once on every input "
    "set it is timed on, before timing (a compile during the timed calls fails the row); "
    "GB/s (floor) = the floor of bytes any implementation must move (each distinct byte read once, outputs written "
    "once: for embedding bags each distinct row once, gem_kernels.flops.embedding_bag_floor) / median time; "
    "GB/s (FBGEMM formula) = embedding bags only: FBGEMM's benchmark bytes (every lookup reads its row, "
    "B x sum(D) x L), comparable with FBGEMM's published numbers but not a floor; "
    "% peak of the measured copy bandwidth (bw, against the floor bytes) or the dtype's matmul peak (mm); "
    "'of gather' / 'of its GEMMs (interleaved)': the case's own roof (the same rows read; the same matrix products "
    "alone, at the op's shapes) timed round-robin with the impls, over the impl's time; "
    "speedup = baseline ms / impl ms; faults/call = minor page faults per call (CPU: first touches of fresh output "
    "pages, which glibc maps anew for every block over 32 MiB); verified = the impl whose output (and gradients, "
    "updated tables and optimizer state where the case has them) this impl matched before it was timed, "
    "(is the reference) for the impl the others were checked against, UNVERIFIED with the case's reason, or "
    "FAILED with why (not timed).")


def markdown(result: dict) -> str:
    m, p = result["machine"], result["peaks"]
    mm = ", ".join(f"{k} {v:.3f}" for k, v in p.get("matmul_tflops", {}).items())
    lines = [
        f"# gem_kernels bench: {m['device']} @ {result['timestamp']} (git {result['git_sha']})",
        "",
        f"- CPU: {m['cpu_model']}, {m['cpu_cores']} cores (torch threads {m['torch_threads']})"
        + (f"; gem_kernels' CPU rows: {m['cpu_vector_rows']}" if m.get("cpu_vector_rows") else "")
        + f"; GPU: {m['gpu'] or 'none'}",
        f"- torch {m['torch']} (cuda {m['torch_cuda']}), triton {m['triton']}, fbgemm_gpu {m['fbgemm_gpu']}, "
        f"gem_kernels {m['gem_kernels']} (backends {m['gem_kernels_backends']})",
        f"- measured peaks: matmul TFLOP/s {mm} (n={p['sizes']['matmul_n']}); copy {p['copy_gbps']:.1f} GB/s "
        f"({p['sizes']['copy_mib']} MiB, read+write counted){_measurements(p)}",
        f"- 1-min load average {result['loadavg_1min']['start']:.1f} at start, {result['loadavg_1min']['end']:.1f} at end"
        f"{_load_warning(result['loadavg_1min'], m['cpu_cores'])}; "
        f"THP_MEM_ALLOC_ENABLE={int(result.get('thp_mem_alloc', False))}; "
        f"malloc keeps {result.get('malloc_keep_mib', 0)} MiB of freed heap (0: glibc's defaults)",
        *_above_peak(result["rows"]),
        f"- mode: {'quick' if result['quick'] else 'full'}; families: "
        + ", ".join(f"{f['name']} {f['status']} ({f['seconds']:.1f} s)" for f in result["families"]),
        "- figures: `<run>-speedup.png` (speedup of every impl over its case's baseline, per family) and "
        "`<run>.png` (roofline of each case's gem_kernels impl and best peer, numbered; key below the plot)",
        "",
        LEGEND,
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
# Figures
# ---------------------------------------------------------------------------------------------

# Impl names that are gem_kernels itself (its backends and the models/modules built on it); every
# other impl of a case is a peer (eager PyTorch, torch.compile, SDPA, flex, FBGEMM, TorchRec, and
# gem_kernels' own padded reference twin, which is plain PyTorch).
GEM_KERNELS_IMPLS = ("cuda", "triton", "triton-det", "cpu", "fused", "fused+compile", "swap_rowwise", "swap_none",
                     "swapped", "attn-only", "gk-torchrec", "fp32-fused", "uncached", "alone")


def is_gem_kernels(impl: str) -> bool:
    """Whether an impl is gem_kernels' own: the names above, and the KV-cached ranking's "rank m=<m>[ warm]"
    (its uncached and one-candidate baselines are the fused model too; "attn-only" is torch ops around
    gem_kernels' attention)."""
    return impl in GEM_KERNELS_IMPLS or impl.startswith("rank m=")


def _timed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("ms") is not None]


def _cases(rows: list[dict]) -> list[list[dict]]:
    """Rows grouped by case (family, op, shape, dtype), in run order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["op"], r["shape"], r["dtype"]), []).append(r)
    return list(groups.values())


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def speedup_figure(result: dict, path: Path) -> None:
    """One panel per family; per case a group of horizontal bars, one per impl that is not the
    baseline, from 1x to its speedup (baseline ms / impl ms) on a log axis, the value written at the
    bar's end. gem_kernels impls are drawn solid, peers hatched; failed impls are named in red.
    Panels stack in two columns when one would be too tall to read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f["name"] for f in result["families"] if any(r["family"] == f["name"] for r in result["rows"])]
    impls = sorted({r["impl"] for r in result["rows"]}, key=lambda i: (not is_gem_kernels(i), i))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] + ["#444444", "#999933", "#882255", "#44aa99"]
    color = {impl: colors[i % len(colors)] for i, impl in enumerate(impls)}
    panels = []
    for family in families:
        cases = _cases([r for r in result["rows"] if r["family"] == family])
        bars = sum(max(2, len([r for r in c if r["impl"] != r["baseline"]])) for c in cases)
        panels.append((family, cases, 0.2 * bars + 0.22 * len(cases) + 0.8))
    if not panels:
        panels = [("no rows", [], 1.5)]
    total = sum(h for _, _, h in panels)
    columns: list[list] = [[]] if total < 16 or len(panels) == 1 else [[], []]
    for panel in sorted(panels, key=lambda p: -p[2]):  # greedy: the tallest first, into the shorter column
        min(columns, key=lambda c: sum(h for _, _, h in c)).append(panel)
    for column in columns:
        column.sort(key=lambda p: families.index(p[0]) if p[0] in families else 0)
    height = max(sum(h for _, _, h in c) for c in columns) + 0.4
    fig = plt.figure(figsize=(9 * len(columns), height))
    subfigs = fig.subfigures(1, len(columns), squeeze=False)[0]
    for sub, column in zip(subfigs, columns):
        spare = height - 0.4 - sum(h for _, _, h in column)
        ratios = [h for _, _, h in column] + ([spare] if spare > 0.05 else [])
        axes = sub.subplots(len(ratios), 1, squeeze=False, gridspec_kw={"height_ratios": ratios})[:, 0]
        if len(ratios) > len(column):
            axes[-1].axis("off")
        for ax, (family, cases, _) in zip(axes, column):
            _speedup_panel(ax, family, cases, color)
        sub.subplots_adjust(top=1 - 0.5 / height, bottom=0.3 / height, left=0.3, right=0.98)
    fig.suptitle("speedup over each case's baseline (log scale; right of the black line = faster than the baseline; "
                 "solid = gem_kernels, hatched = peers)", fontsize=9, y=1 - 0.1 / height)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _speedup_panel(ax, family: str, cases: list[list[dict]], color: dict) -> None:
    y, ticks, labels, values = 0.0, [], [], []
    for case in cases:
        baseline = case[0]["baseline"]
        others = [r for r in case if r["impl"] != baseline]
        top = y
        for r in others:
            value = r.get("speedup_vs_baseline")
            if r.get("ms") is None or value is None:
                why = "FAILED" if r.get("status") == "failed" else "no baseline time"
                ax.text(1.0, y, f" {r['impl']}: {why}", color="tab:red", va="center", fontsize=7)
            else:
                values.append(value)
                ax.barh(y, abs(value - 1) or 0.01, left=min(value, 1.0), height=0.8, color=color[r["impl"]],
                        hatch=None if is_gem_kernels(r["impl"]) else "///", edgecolor="white", lw=0)
                ax.text(value, y, f" {r['impl']} {value:.2f}x " if value >= 1 else f" {r['impl']} {value:.2f}x ",
                        va="center", ha="left" if value >= 1 else "right", fontsize=7)
            y += 1
        y = max(y, top + 2)  # two bars' height at least: the label has three lines
        ticks.append((top + y - 1) / 2)
        unverified = " (UNVERIFIED)" if case[0].get("unverified") else ""
        labels.append(_wrap(f"{case[0]['op']} {case[0]['dtype']}{unverified}", 40) + "\n"
                      + _wrap(case[0]["shape"], 48) + f"  (vs {baseline})")
        y += 0.5
    ax.set_xscale("log")
    lo = min(values + [1.0]) / 8  # room for the value labels left of bars under 1x
    hi = max(values + [1.0]) * 8  # and right of the others
    ax.set_xlim(lo, hi)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(ticks, labels, fontsize=6.5)
    ax.set_ylim(y - 0.4, -0.7)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{family}", fontsize=9, loc="left", fontweight="bold")


def _best(case: list[dict], mine: bool) -> dict | None:
    rows = [r for r in _timed(case) if is_gem_kernels(r["impl"]) == mine]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def roofline(result: dict, path: Path) -> None:
    """Per case, its fastest gem_kernels impl (filled) and its fastest peer (hollow), drawn as the
    case's number. Left: achieved TFLOP/s against arithmetic intensity (FLOP per floor byte), both
    log, under the measured roofs (copy bandwidth slope, one matmul ceiling per dtype). Right: ops
    without FLOPs (data movement) as GB/s (floor) against the copy peak, and ops without a byte
    count (a whole training step) as TFLOP/s. Below: the key, one line per number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    peaks = result["peaks"]
    bw = peaks["copy_gbps"]
    pairs = []  # (number, case's first row, gem_kernels row, peer row)
    for case in _cases(result["rows"]):
        mine, peer = _best(case, True), _best(case, False)
        if mine is not None or peer is not None:
            pairs.append((len(pairs) + 1, case[0], mine, peer))
    key_lines = [f"  #  {'case':<96}  {'gem_kernels':<24}  best peer"]
    for n, first, mine, peer in pairs:
        def cell(r):
            if r is None:
                return "-"
            value = (f"{r['tflops']:.3g} TFLOP/s" if first["flops"] else f"{r['gbps']:.3g} GB/s" if r["gbps"]
                     else f"{r['ms']:.3g} ms")
            return f"{r['impl']} {value}"
        faster = ""
        if mine is not None and peer is not None:
            faster = f"  ({peer['ms'] / mine['ms']:.2f}x)"
        case_text = f"{first['op']} {first['dtype']} [{first['shape']}]"
        case_text = case_text if len(case_text) <= 96 else case_text[:93] + "..."
        key_lines.append(f"{n:>3}  {case_text:<96}  {cell(mine):<24}  {cell(peer)}{faster}")
    key_lines.append("(x) = best peer's ms / gem_kernels' ms; filled number = gem_kernels, hollow = best peer")
    key_height = 0.125 * len(key_lines) + 0.2
    fig = plt.figure(figsize=(15, 6.5 + key_height))
    grid = fig.add_gridspec(2, 2, height_ratios=[6.5, key_height], width_ratios=[1.25, 1])
    ax, bx, kx = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    mine_color, peer_color = "tab:blue", "tab:orange"

    def mark(axis, x, y, n, filled):
        color = mine_color if filled else peer_color
        axis.scatter(x, y, s=150, marker="o", facecolors=color if filled else "white", edgecolors=color,
                     linewidths=1.2, zorder=3)
        axis.text(x, y, str(n), ha="center", va="center", fontsize=6, color="white" if filled else color,
                  zorder=4, fontweight="bold")

    compute = [(n, f, m, p) for n, f, m, p in pairs if f["flops"] and f["bytes"]]
    xs_all = [f["flops"] / f["bytes"] for _, f, _, _ in compute]
    lo = min(xs_all + [0.1]) / 4
    hi = max(xs_all + [1000.0]) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    matmul = peaks.get("matmul_tflops") or {"?": 1.0}
    top = max(matmul.values())
    ax.plot(xs, [min(top, x * bw / 1e3) for x in xs], color="black", lw=1.5, label=f"copy {bw:.0f} GB/s")
    for (name, peak), style in zip(matmul.items(), ("-", "--", "-.", ":")):
        ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], ls=style, lw=1, color="gray")
        ax.text(hi / 1.2, peak * 1.08, f"{name} matmul {peak:.2f} TFLOP/s", ha="right", va="bottom", fontsize=8)
    achieved = []
    for n, first, mine, peer in compute:
        # Cases of one op share an intensity: dodged by up to +-25 % (by number) so their marks part.
        x = first["flops"] / first["bytes"] * 1.125 ** ((n % 5) - 2)
        points = [(r, r is mine) for r in (mine, peer) if r is not None and r["tflops"]]
        if len(points) == 2:
            ax.plot([x, x], [points[0][0]["tflops"], points[1][0]["tflops"]], color="lightgray", lw=1, zorder=2)
        for r, filled in points:
            mark(ax, x, r["tflops"], n, filled)
            achieved.append(r["tflops"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(achieved + [top / 1e4]) / 3, top * 3)
    ax.set_xlabel("arithmetic intensity (FLOP / floor byte; marks dodged up to 25 % so that they part)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"roofline, {result['machine']['device']}: each case's gem_kernels impl (filled) and best peer "
                 f"(hollow)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")

    # Right: data movement (GB/s against the copy peak) and whole steps (TFLOP/s, no byte count).
    others = [(n, f, m, p) for n, f, m, p in pairs if not (f["flops"] and f["bytes"])]
    movement = [(n, f, m, p) for n, f, m, p in others if f["bytes"]]
    unplotted = [n for n, f, _, _ in others if not f["bytes"]]
    rows_y = []
    for i, (n, first, mine, peer) in enumerate(movement):
        rows_y.append((i, n))
        for r, filled in ((mine, True), (peer, False)):
            if r is not None and r["gbps"]:
                mark(bx, r["gbps"], i, n, filled)
    if movement:
        bx.axvline(bw, color="black", ls="--", lw=1)
        bx.text(bw, -0.7, f" copy peak {bw:.0f} GB/s", fontsize=8, va="bottom")
        bx.set_yticks([i for i, _ in rows_y], [f"#{n}" for _, n in rows_y], fontsize=8)
        bx.set_ylim(len(movement) - 0.4, -1.2)
        bx.set_xscale("log")
        values = [r["gbps"] for _, _, m, p in movement for r in (m, p) if r is not None and r["gbps"]] + [bw]
        bx.set_xlim(min(values) / 2, max(values) * 2)
        bx.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        bx.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        bx.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        bx.set_xlabel("GB/s (floor bytes / median time); dashed: measured copy peak")
        bx.grid(True, axis="x", which="both", alpha=0.3)
    else:
        bx.text(0.5, 0.5, "no 0-FLOP ops in this run", ha="center", va="center", transform=bx.transAxes)
        bx.set_xticks([])
        bx.set_yticks([])
    title = "data-movement ops (0 FLOPs)"
    if unplotted:
        title += f"\nnot plotted (no byte count; times in the key): {', '.join(f'#{n}' for n in unplotted)}"
    bx.set_title(title, fontsize=9)
    kx.axis("off")
    kx.text(0, 1, "\n".join(key_lines), family="monospace", fontsize=7.5, va="top", ha="left", transform=kx.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure_paths(json_path: Path) -> dict[str, Path]:
    stem = json_path.with_suffix("")
    return {"md": stem.with_suffix(".md"), "png": stem.with_suffix(".png"),
            "speedup_png": stem.parent / f"{stem.name}-speedup.png"}


def redraw(json_path: Path) -> dict[str, Path]:
    """Write the markdown and both figures of a run from its JSON, next to it; returns their paths."""
    import json

    result = json.loads(Path(json_path).read_text())
    paths = figure_paths(Path(json_path))
    paths["md"].write_text(markdown(result))
    roofline(result, paths["png"])
    speedup_figure(result, paths["speedup_png"])
    return paths


def write(result: dict, out_dir: Path) -> dict[str, Path]:
    """Write the JSON, markdown and both PNGs plus latest-<device> copies; returns the written paths."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['machine']['device']}-{result['timestamp']}"
    paths = {"json": out_dir / f"{stem}.json"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths.update(redraw(paths["json"]))
    latest = f"latest-{result['machine']['device']}"
    for key, path in list(paths.items()):
        shutil.copyfile(path, out_dir / path.name.replace(stem, latest))
    return paths


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.report",
                                     description="Redraw a bench run's markdown table and both figures "
                                                 "(<run>.png roofline, <run>-speedup.png) from its JSON, next to it.")
    parser.add_argument("json", type=Path, nargs="+", help="a run's JSON (bench/results/<device>-<timestamp>.json)")
    args = parser.parse_args(argv)
    for path in args.json:
        for written in redraw(path).values():
            print(written)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
