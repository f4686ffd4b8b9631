"""``lck bench kernels``: time lck's kernels against torch eager, torch.compile and Liger-Kernel.

Runs every suite (or ``--only`` some) in one process on the current GPU and writes
``<out>/<gpu>-<date>-kernels.{json,csv,png}`` with provenance. ``--quick`` runs the small sweep.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import sys
from pathlib import Path

SUITES = ("rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy")
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def main(argv: list[str] | None = None) -> int:
    """Time lck's kernels against torch eager, torch.compile and Liger-Kernel."""
    import torch

    from lck_kernels.bench._harness import run_case
    from lck_runtime.benchmarking import Progress, gpu_slug, write_results

    parser = argparse.ArgumentParser(prog="lck bench kernels", description=main.__doc__)
    parser.add_argument(
        "--only", nargs="*", choices=SUITES, default=None, help="suites to run (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="a small sweep (a minute or two)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"result folder (default {DEFAULT_OUT})"
    )
    parser.add_argument("--providers", nargs="*", default=None, help="restrict to these providers")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("lck bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 2

    cases = []
    for suite in args.only or SUITES:
        try:
            mod = importlib.import_module(f"lck_kernels.bench.{suite}")
        except ModuleNotFoundError as exc:
            if exc.name == f"lck_kernels.bench.{suite}":
                continue  # suite not written yet in this version
            raise
        cases += mod.cases(args.quick)
    if args.providers:
        for c in cases:
            c.providers = {k: v for k, v in c.providers.items() if k in args.providers}
    progress = Progress(len(cases), "kernels")
    records = []
    for case in cases:
        records += run_case(case)
        progress.step(f"{case.bench} {case.shape}")
    stem = f"{gpu_slug()}-{_dt.date.today().isoformat()}-kernels" + ("-quick" if args.quick else "")
    if args.only:  # runs of different suites (e.g. side by side on two GPUs) must not overwrite each other
        stem += "-" + "-".join(args.only)
    paths = write_results(
        records,
        args.out,
        stem,
        meta={"suites": list(args.only or SUITES), "quick": args.quick},
        plot=_plot,
    )
    _print_table(records)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


def _plot(records, path: Path) -> None:
    """GPU time in ``<stem>.png``, back-to-back (loop) time in ``<stem>-loop.png``: a training loop sees the
    larger of the two, so a fast kernel behind a slow host shows up in the second."""
    import dataclasses

    from lck_runtime.benchmarking import bar_plot, gpu_slug

    bar_plot(records, path, title=f"lck kernels on {gpu_slug()}: GPU time")
    looped = [dataclasses.replace(r, median_ms=r.extra.get("loop_ms")) for r in records]
    bar_plot(
        looped,
        path.with_name(path.stem + "-loop.png"),
        title=f"lck kernels on {gpu_slug()}: loop time (back to back)",
    )


def _print_table(records) -> None:
    def ms(v) -> str:
        return f"{v:9.3f}" if v is not None else f"{'—':>9}"

    print(
        f"{'bench':<28}{'shape':<22}{'mode':<9}{'provider':<16}{'GPU ms':>9}{'host ms':>9}{'loop ms':>9}"
        f"{'GB/s':>8}{'MiB':>9}"
    )
    for r in records:
        gbps = r.extra.get("gb_per_s")
        gpu = ms(r.median_ms) if r.median_ms is not None else f"{'err':>9}"
        mib = f"{r.peak_mib:9.0f}" if r.peak_mib is not None else f"{'':>9}"
        print(
            f"{r.bench:<28}{r.shape:<22}{r.mode:<9}{r.provider:<16}{gpu}{ms(r.extra.get('host_ms'))}"
            f"{ms(r.extra.get('loop_ms'))}{(f'{gbps:8.0f}' if gbps else ''):>8}{mib}"
            + (f"  {r.error}" if r.error else "")
        )


if __name__ == "__main__":
    raise SystemExit(main())
