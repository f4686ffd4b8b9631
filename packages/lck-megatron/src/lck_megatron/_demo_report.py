"""What ``lck demo`` prints and draws once both runs finished: the side-by-side table, the loss agreement
against a precision-dependent tolerance, and the PNG of both loss curves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lck_megatron._demo_run import RunResult


def _tolerance(shape: Any) -> float:
    import torch

    # Relative agreement of the last 10% of the curves: float32 runs differ only by summation order;
    # bf16 runs round differently at every step and drift apart chaotically, but stay on the same curve.
    return 2e-3 if shape.dtype == torch.float32 else 3e-2


def _report(results: list[RunResult], shape: Any, where: str, tol: float, floor: float) -> dict[str, Any]:
    import torch

    a, b = results
    deltas = [abs(x - y) for x, y in zip(a.losses, b.losses)]
    final_a, final_b = a.final_loss(), b.final_loss()
    rel = abs(final_a - final_b) / max(abs(final_a), 1e-12)
    rows = [
        ("first loss", f"{a.losses[0]:.4f}", f"{b.losses[0]:.4f}"),
        ("final loss (last 10%)", f"{final_a:.4f}", f"{final_b:.4f}"),
        ("tokens/s (median step)", f"{a.tokens_per_s:,.0f}", f"{b.tokens_per_s:,.0f}"),
        (f"peak memory, MiB ({a.peak_kind})", f"{a.peak_mib:,.0f}", f"{b.peak_mib:,.0f}"),
    ]
    w0 = max(len(r[0]) for r in rows) + 2
    w1 = max(12, len(a.name) + 2, *(len(r[1]) + 2 for r in rows))
    print(f"\nresults after {len(a.losses)} steps each:")
    print(f"{'':<{w0}}{a.name:>{w1}}{b.name:>{w1}}")
    for label, x, y in rows:
        print(f"{label:<{w0}}{x:>{w1}}{y:>{w1}}")
    speedup = b.tokens_per_s / a.tokens_per_s
    print(
        f"\nloss agreement: max |Δloss| over {len(deltas)} steps {max(deltas):.2e}; final losses differ by {rel:.2%}"
    )
    print(
        f"lck speed: {speedup:.2f}× tokens/s; memory: {b.peak_mib / max(a.peak_mib, 1e-9):.2f}× of {a.name}"
    )
    if shape.dtype == torch.float32 and where.startswith("CPU"):
        print(
            "(on the CPU, lck's speed is that of Triton's interpreter emulating the GPU kernels, not a measure of lck)"
        )
    if b.lck_calls:
        print("lck calls in the patched model: " + "; ".join(f"{k} {v}" for k, v in b.lck_calls.items()))
    print(
        f"(the corpus' floor is {floor:.3f} nats; a model that learned nothing stays at {math.log(shape.vocab):.3f})"
    )
    return {
        "max_abs_loss_delta": max(deltas),
        "corpus_floor": floor,
        "final_loss_rel_diff": rel,
        "tolerance": tol,
        "agree": rel <= tol,
        "speedup": speedup,
        "memory_ratio": b.peak_mib / max(a.peak_mib, 1e-9),
    }


def _plot(results: list[RunResult], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for r, style in zip(results, ("-", "--")):
        ax.plot(range(1, len(r.losses) + 1), r.losses, style, label=f"{r.name} ({r.tokens_per_s:,.0f} tok/s)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
