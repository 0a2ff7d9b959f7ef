"""`python -m bench`: run the benchmark families, print the table, write bench/results/."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from bench import unwritable

# gem_kernels.testing.malloc.DEFAULT_KEEP_MIB, written out: importing it imports torch, which must come
# after THP_MEM_ALLOC_ENABLE is set (tests/test_bench.py checks the two agree).
MALLOC_KEEP_MIB = 1024

FAMILIES = {
    "jagged": "bench.jagged",
    "embedding_bag": "bench.embedding_bag",
    "attention": "bench.attention",
    "interaction": "bench.interaction",
    "hstu_layer": "bench.hstu_layer",
    "model": "bench.model",
    "swap": "bench.swap",
    "inference": "bench.inference",
    "ranking": "bench.ranking",
    "hashed": "bench.hashed",
}

# Whole-run wall-clock budgets (seconds) for the timed part: the default run must finish within 10
# minutes on the 2-core dev CPU and --quick within 1 minute, imports and peaks included. Each family
# that imports gets at most FAMILY_BUDGET (or the family module's own FAMILY_BUDGET) and never more
# than an even share of what is left.
RUN_BUDGET = {False: 480.0, True: 32.0}
FAMILY_BUDGET = {False: 110.0, True: 9.0}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("families", nargs="*", metavar="FAMILY",
                        help=f"families to run (default: all): {', '.join(FAMILIES)}")
    parser.add_argument("--quick", action="store_true", help="small shapes and short timings (about a minute)")
    parser.add_argument("--list", action="store_true", help="list the families and their cases' ops, run nothing")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device to bench (default: cuda when available, else cpu)")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: bench/results)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="minimum timed repeats per impl (default 10, quick 5; the per-impl time cap still applies)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"wall-clock budget in seconds of the timed part of the run (default {RUN_BUDGET[False]:.0f}, "
                             f"quick {RUN_BUDGET[True]:.0f}); each family gets at most an even share of what is left. "
                             "SIGINT stops the run early and still writes what was measured")
    parser.add_argument("--no-thp", action="store_true",
                        help="CPU: keep PyTorch's default allocation (by default the bench sets THP_MEM_ALLOC_ENABLE=1 "
                             "unless it is already set, backing large tensors with transparent huge pages so that a "
                             "fresh output faults once per 2 MiB rather than once per 4 KiB page)")
    parser.add_argument("--malloc-keep-mib", type=int, default=MALLOC_KEEP_MIB, metavar="MIB",
                        help="CPU, glibc: keep up to MIB of freed heap mapped for reuse instead of returning it to "
                             "the OS (gem_kernels.testing.malloc; every impl of a comparison runs in this one "
                             f"process, so all get it); 0 keeps glibc's defaults (default {MALLOC_KEEP_MIB}, as "
                             "python -m model.train)")
    args = parser.parse_args(argv)
    if args.malloc_keep_mib < 0:
        parser.error(f"--malloc-keep-mib must be >= 0, got {args.malloc_keep_mib}")
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    # float() parses "nan" and "inf", and every comparison with nan is False: test finiteness first.
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        parser.error(f"--budget must be a finite number of seconds > 0, got {args.budget}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.out is not None and not args.list:
        why = unwritable(args.out)
        if why:
            parser.error(f"--out {args.out}: {why}")
    return args


def load_family(name: str):
    """The family's module, or (None, why) when it is missing or fails to import."""
    try:
        return importlib.import_module(FAMILIES[name]), None
    except ModuleNotFoundError as exc:
        if exc.name == FAMILIES[name]:
            return None, f"module {FAMILIES[name]} does not exist yet"
        return None, f"module {FAMILIES[name]} failed to import: {type(exc).__name__}: {exc}"
    except Exception as exc:
        return None, f"module {FAMILIES[name]} failed to import: {type(exc).__name__}: {exc}"


def list_families(names: list[str], quick: bool, device) -> int:
    from bench.harness import SkipFamily, dtype_name

    for name in names:
        module, why = load_family(name)
        if module is None:
            print(f"{name}: unavailable ({why})")
            continue
        print(f"{name}:")
        cases = module.cases(quick, device)
        try:
            for case in cases:
                check = f"verified vs {case.reference}" if case.reference else f"UNVERIFIED: {case.unverified}"
                compiled = f"; compiled: {', '.join(case.compiled)}" if case.compiled else ""
                print(f"  {case.op:<28} {dtype_name(case.dtype):<9} {case.shape}  impls: {', '.join(case.impls)}"
                      f"  (baseline {case.baseline}; {check}{compiled})")
                for note in case.notes:
                    print(f"    note: {note}")
        except SkipFamily as exc:
            print(f"  skipped: {exc}")
        except Exception as exc:
            print(f"  ERROR while building cases: {type(exc).__name__}: {exc}")
        finally:
            close = getattr(cases, "close", None)
            if close is not None:
                close()
    return 0


def main(argv: list[str] | None = None) -> int:
    # SIGINT must raise KeyboardInterrupt whatever disposition this process inherited: one started in
    # the background by a non-interactive shell (`python -m bench &` in a script, CI) inherits SIGINT
    # as *ignored*, Python then leaves it ignored, and `timeout -s INT` (scripts/gpu_check.sh) or a
    # Ctrl-C to the group cannot stop the run. Restored on return (tests call main in-process).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["distributed"]:  # gloo processes, not in-process cases: its own driver
        from bench import distributed

        return distributed.main(argv[1:])
    args = parse_args(argv)
    run_start = time.perf_counter()
    if not args.no_thp:
        # Read by PyTorch's CPU allocator once, at its first allocation: so before importing torch. A
        # fresh large output otherwise page-faults every 4 KiB page on every call (~4 us each on this
        # VM), which dwarfs the copy itself and hides the kernels' differences.
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from gem_kernels.testing.malloc import keep_freed_cpu_memory  # imports torch: after THP_MEM_ALLOC_ENABLE

    malloc_kept = keep_freed_cpu_memory(args.malloc_keep_mib)

    import torch

    from bench import harness, report
    from bench.peaks import measure_peaks, measure_peaks_again

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Every core unless the caller chose a thread count (CI runs the quick bench at 1 and 2
        # threads, so that a verification rule that depends on the reduction order fails there).
        torch.set_num_threads(os.cpu_count() or 1)
    names = args.families or list(FAMILIES)
    if args.list:
        return list_families(names, args.quick, device)

    timestamp = report.utc_timestamp()
    sha = report.git_sha()
    load_start = os.getloadavg()
    harness.log(f"[bench] {'quick' if args.quick else 'full'} run on {device}, families {names}, git {sha}; "
                f"load average {load_start[0]:.1f} on {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    peaks = measure_peaks(device, args.quick)
    settings = harness.Settings.for_run(args.quick, args.repeats)
    families = []
    modules = {}
    for name in names:
        module, why = load_family(name)
        if module is None and why.endswith("does not exist yet"):
            harness.log(f"[{name}] skipped: {why}")
            families.append(harness.FamilyResult(name, "skipped", notes=[f"skipped: {why}"]))
        elif module is None:
            harness.log(f"[{name}] ERROR: {why}")
            families.append(harness.FamilyResult(name, "failed", errors=[why]))
        else:
            modules[name] = module
    run_budget = RUN_BUDGET[args.quick] if args.budget is None else args.budget
    interrupted = False
    for i, (name, module) in enumerate(modules.items()):
        if interrupted:
            families.append(harness.FamilyResult(name, "skipped", notes=["skipped: the run was interrupted"]))
            continue
        left = run_budget - (time.perf_counter() - run_start)
        cap = getattr(module, "FAMILY_BUDGET", FAMILY_BUDGET)[args.quick]
        budget = harness.Budget(max(0.0, min(cap, left / (len(modules) - i))))
        harness.log(f"[{name}] start (budget {budget.seconds:.0f} s)")
        try:
            cases = module.cases(args.quick, device)
        except Exception as exc:
            traceback.print_exc()
            families.append(harness.FamilyResult(name, "failed", errors=[f"cases() failed: {exc}"]))
            continue
        fam = harness.run_family(name, cases, device, settings, budget, peaks, sha, timestamp)
        harness.log(f"[{name}] {fam.status}: {len(fam.rows)} rows in {fam.seconds:.1f} s")
        families.append(fam)
        interrupted = fam.status == "interrupted"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    families.sort(key=lambda f: names.index(f.name))
    if not interrupted:
        # Measured again after the kernels: a neighbour's load at the start would otherwise leave a
        # low roof and rows above 100 % of it. The roof is the better of the two measurements.
        peaks = measure_peaks_again(peaks, measure_peaks(device, args.quick))
        for f in families:
            for row in f.rows:
                row["pct_peak"] = harness.pct_of_peak(row, peaks)

    result = {
        "timestamp": timestamp,
        "git_sha": sha,
        "quick": args.quick,
        "argv": argv,
        "machine": report.machine_info(device),
        "peaks": peaks,
        "settings": vars(settings),
        # Other processes on the machine skew timings (a 2-core box shared by several people): recorded.
        "loadavg_1min": {"start": load_start[0], "end": os.getloadavg()[0]},
        "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
        "malloc_keep_mib": args.malloc_keep_mib if malloc_kept else 0,
        "families": [{"name": f.name, "status": f.status, "seconds": f.seconds, "notes": f.notes,
                      "errors": f.errors, "mismatches": f.mismatches, "peer_mismatches": f.peer_mismatches}
                     for f in families],
        "rows": [row for f in families for row in f.rows],
    }
    paths = report.write(result, args.out or report.DEFAULT_OUT)
    print("\n".join(report.table_lines(result["rows"])))
    for f in families:
        for note in f.notes:
            print(f"note [{f.name}]: {note}")
        for err in f.errors:
            print(f"ERROR [{f.name}]: {err}")
    print(f"results: {paths['json']} (+ .md, .png roofline, -speedup.png; latest-{device.type}.*), "
          f"{time.perf_counter() - run_start:.0f} s in all")
    mismatches = [m for f in families for m in f.mismatches]
    if mismatches:
        print(f"!!! {len(mismatches)} impl(s) gave WRONG ANSWERS and were not timed:", file=sys.stderr)
        for m in mismatches:
            print(f"!!!   {m}", file=sys.stderr)
    peers = [m for f in families for m in f.peer_mismatches]
    if peers:
        print(f"!!! {len(peers)} torch.compile'd peer(s) fell outside the rule and were not timed (not a failed "
              f"run: a compiled peer is not gem_kernels' code):", file=sys.stderr)
        for m in peers:
            print(f"!!!   {m}", file=sys.stderr)
    recompiled = [r for r in result["rows"] if (r.get("failed") or "").startswith("RecompileError")]
    for r in recompiled:
        print(f"!!! {r['failed']}", file=sys.stderr)
    failed = [f for f in families if f.status == "failed"]
    for f in failed:  # a family that crashed verified nothing: the run must not pass
        print(f"!!! family {f.name} failed: {'; '.join(f.errors)}", file=sys.stderr)
    if mismatches or recompiled or failed:
        return 1
    if interrupted:
        print("!!! interrupted: the results above and in the files are partial", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
