"""The fused linear cross entropy's chunk budget: time against working set, on one GPU.

For each ``chunk_bytes`` budget, one forward+backward of ``fused_linear_cross_entropy`` (reduction mean; the
gradients-in-the-forward schedule) and of ``fused_linear_scaled_cross_entropy`` (reduction sum, what
lck-megatron's output-layer route runs) through ``torch.autograd.grad``, timed as every benchmark here is
(``lck_runtime.benchmarking``): GPU ms (calls queued behind a spin), host ms (the cost of enqueuing one) and
loop ms (calls back to back, what a training loop sees); and the peak memory beyond the inputs and the
gradients (the working set: the ``[chunk, vocab]`` logits buffer plus per-token rows). Shapes:
8192×4096→128256 (the issue's anchor) and 8192×2048→128256 (the demo's output layer), bf16. Prints a table
with each budget's loop time relative to the first budget's and writes ``flce-working-set-<gpu>-<date>.json``
(with provenance) into ``--out`` (default ``$OUT`` or the current folder).

    python packages/lck-kernels/benchmarks/flce_working_set.py [--budgets 512 256 128 64] [--iters 20]
        [--streams 1 2] [--shapes N] [--profile]

Each budget runs with the ``grad_W`` update on the caller's stream (``--streams 1``: tuning knob
``grad_streams=1``, which takes the Python path) and on a side stream (2, the default, the C++ path), and
the first row of each op is the reference of ``loop_relative_to_first``.

``--profile`` only profiles: for each budget, the GPU time of every kernel over three forward+backward
steps of the plain op at the first shape (``torch.profiler``), so that the cost of a smaller budget can be
pinned on the kernels that grow; written as ``flce-kernels-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
from pathlib import Path

import torch

from lck_runtime.benchmarking import gpu_slug, host_ms, provenance, time_cuda, time_loop

SHAPES = ((8192, 4096, 128256), (8192, 2048, 128256))


def _extra_peak(fn, grads_bytes: int) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base - grads_bytes


def _shape_rows(n: int, h: int, v: int, budgets: list[int], iters: int, streams: list[int]) -> list[dict]:
    import lck_kernels
    from lck_kernels._common import tuning

    x = (torch.randn(n, h, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda")
    grads_bytes = (x.numel() + w.numel()) * 2

    def plain(mib: int) -> torch.Tensor:
        return lck_kernels.fused_linear_cross_entropy(x, w, t, chunk_bytes=mib << 20)

    def scaled(mib: int) -> torch.Tensor:
        return lck_kernels.fused_linear_scaled_cross_entropy(x, w, t, reduction="sum", chunk_bytes=mib << 20)[
            0
        ]

    rows = []
    for name, op in (
        ("fused_linear_cross_entropy(mean)", plain),
        ("fused_linear_scaled_cross_entropy(sum)", scaled),
    ):
        base_ms = None
        for mib in budgets:
            for nstreams in streams:

                def step(mib: int = mib, op=op, nstreams: int = nstreams):
                    if nstreams == 2:  # the default: the C++ path where it serves the call
                        return torch.autograd.grad(op(mib), (x, w))
                    with tuning("fused_linear_cross_entropy", grad_streams=nstreams):  # the Python path
                        return torch.autograd.grad(op(mib), (x, w))

                gpu = statistics.median(time_cuda(step, warmup=3, iters=iters))
                host = host_ms(step, iters=10, warmup=2)
                loop = time_loop(step, iters=iters, warmup=2)
                extra = _extra_peak(step, grads_bytes)
                base_ms = loop if base_ms is None else base_ms
                row = {
                    "op": name,
                    "shape": f"{n}x{h}x{v}",
                    "chunk_mib": mib,
                    "grad_streams": nstreams,
                    "gpu_ms": gpu,
                    "host_ms": host,
                    "loop_ms": loop,
                    "loop_relative_to_first": loop / base_ms,
                    "extra_peak_mib": extra / 2**20,
                }
                rows.append(row)
                print(
                    f"{name:<40} {row['shape']:<18} chunk {mib:>4} MiB  streams {nstreams}  GPU {gpu:7.2f} ms  "
                    f"loop {loop:7.2f} ms ({row['loop_relative_to_first']:.3f}x)  "
                    f"working set {row['extra_peak_mib']:7.1f} MiB",
                    flush=True,
                )
    return rows


def _profiles(n: int, h: int, v: int, budgets: list[int]) -> dict[str, object]:
    import lck_kernels

    x = (torch.randn(n, h, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda")
    out: dict[str, object] = {}
    for mib in budgets:

        def step(mib: int = mib):
            return torch.autograd.grad(
                lck_kernels.fused_linear_cross_entropy(x, w, t, chunk_bytes=mib << 20), (x, w)
            )

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        kernels = {
            e.key: {"cuda_ms_per_step": e.self_device_time_total / 3e3, "calls_per_step": e.count / 3}
            for e in prof.key_averages()
            if e.self_device_time_total > 0
        }
        out[str(mib)] = kernels
        print(
            f"chunk {mib} MiB: {sum(k['cuda_ms_per_step'] for k in kernels.values()):.2f} ms of kernels per step"
        )
        for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["cuda_ms_per_step"])[:12]:
            print(f"  {k['cuda_ms_per_step']:8.3f} ms  x{k['calls_per_step']:5.1f}  {name[:110]}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 256, 192, 128, 96, 64], help="MiB")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--profile", action="store_true", help="only the per-kernel profile of each budget")
    p.add_argument(
        "--streams", type=int, nargs="+", default=[1, 2], choices=[1, 2],
        help="grad_W update on the caller's stream (1) or a side stream (2, the default)",
    )  # fmt: skip
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many shapes")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.profile:
        n, h, v = SHAPES[0]
        prof = {
            "provenance": provenance(),
            "shape": f"{n}x{h}x{v}",
            "kernels": _profiles(n, h, v, args.budgets),
        }
        out = args.out / f"flce-kernels-{gpu_slug()}-{_dt.date.today().isoformat()}.json"
        args.out.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(prof, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    rows = []
    for n, h, v in SHAPES[: args.shapes]:
        rows += _shape_rows(n, h, v, args.budgets, args.iters, args.streams)
        torch.cuda.empty_cache()
    out = args.out / f"flce-working-set-{gpu_slug()}-{_dt.date.today().isoformat()}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
