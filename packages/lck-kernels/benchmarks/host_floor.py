"""Where a forward+backward's host time goes, piece by piece, on one CUDA GPU (a few seconds).

    python packages/lck-kernels/benchmarks/host_floor.py [--out DIR]

Issue 28 asks each lck op's host time per forward+backward to be at or below torch's own op's. This
measures the floors a Python implementation stands on, all with ``lck_runtime.benchmarking.host_ms`` (the
GPU kept busy, so only the host's enqueue cost is timed), at RMSNorm 8192x4096 bf16:

- torch's ``F.rms_norm`` fwd+bwd, and a single torch op (``x * 2``) through ``torch.autograd.grad``;
- an empty ``torch.autograd.Function`` (an ``empty_like`` each way) through ``Function.apply`` and through
  the C ``apply`` directly; the same with one pre-bound Triton launch each way;
- lck's ``rms_norm`` fwd+bwd (the C++ autograd Function of ``lck_kernels._host`` when it is built) and
  forward alone, the Python ``autograd.Function`` path, and the pieces of that path one by one.

Prints a table and writes ``host-floor-<gpu>-<date>.json`` with provenance.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from lck_runtime.benchmarking import gpu_slug, host_ms, provenance


@triton.jit
def _touch_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def _timeline(fn_cls, forward, inputs, dy, iters: int = 50) -> dict[str, float]:
    """Median ms of each part of ``grad(forward(), inputs, dy)`` with the GPU busy: the forward, the gap from
    calling ``grad`` to the Function's backward starting (on the autograd engine's device thread), the
    backward body, and the gap from its end to ``grad`` returning."""
    import statistics
    import time

    marks: list[float] = []
    original = fn_cls.backward

    def timed(ctx, *grads):
        marks.append(time.perf_counter())
        out = original(ctx, *grads)
        marks.append(time.perf_counter())
        return out

    fn_cls.backward = staticmethod(timed)
    parts: dict[str, list[float]] = {
        "forward": [],
        "to backward": [],
        "backward body": [],
        "after backward": [],
    }
    try:
        for _ in range(5):
            torch.autograd.grad(forward(), inputs, dy)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        for _ in range(iters):
            marks.clear()
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            torch.autograd.grad(y, inputs, dy)
            t2 = time.perf_counter()
            b0, b1 = marks
            for key, seconds in zip(parts, (t1 - t0, b0 - t1, b1 - b0, t2 - b1), strict=True):
                parts[key].append(seconds * 1e3)
        torch.cuda.synchronize()
    finally:
        fn_cls.backward = original
    return {k: statistics.median(v) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import torch.nn.functional as F

    from lck_kernels import rms_norm
    from lck_kernels._eager import launch_for, plain_eager, run_direct
    from lck_kernels.rms_norm.checks import check_rms_norm_inputs
    from lck_kernels.rms_norm.launch import launch_fwd
    from lck_kernels.rms_norm.ops import RMSNormFunction, rms_norm_apply

    def py_rms_norm(x, w):  # the Python autograd.Function path (what rms_norm ran before the C++ one)
        return rms_norm_apply(x, w, 1e-6, 0.0, "llama", False)

    rows, hidden = 8192, 4096
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    touch = launch_for(_touch_kernel, BLOCK=128)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            return torch.empty_like(g), torch.empty_like(w)

    class OneLaunch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y = torch.empty_like(x)
            touch.raw((1,), x, y, 128)
            return y

        @staticmethod
        def backward(ctx, g):
            dx = torch.empty_like(g)
            touch.raw((1,), g, dx, 128)
            return dx, None

    c_apply_empty = torch._C._FunctionBase.__dict__["apply"].__get__(None, Empty)
    c_apply_one = torch._C._FunctionBase.__dict__["apply"].__get__(None, OneLaunch)
    xd = x.detach()
    y2, rstd = torch.empty_like(xd), torch.empty(rows, device="cuda", dtype=torch.float32)
    partial, dw = torch.randn(264, hidden, device="cuda"), torch.randn(hidden, device="cuda")
    grad = torch.autograd.grad

    def one_launch_direct():
        return grad(c_apply_one(x, w), (x,), dy)

    steps = {
        "torch F.rms_norm fwd+bwd": lambda: grad(F.rms_norm(x, (hidden,), w, 1e-6), (x, w), dy),
        "torch x*2 fwd+bwd": lambda: grad(x * 2, (x,), dy),
        "empty Function, Function.apply": lambda: grad(Empty.apply(x, w), (x, w), dy),
        "empty Function, C apply": lambda: grad(c_apply_empty(x, w), (x, w), dy),
        "one launch each way, C apply, pre-bound": one_launch_direct,
        "lck rms_norm fwd+bwd": lambda: grad(rms_norm(x, w), (x, w), dy),
        "lck rms_norm fwd, no grad": lambda: rms_norm(xd, w.detach()),
        "lck rms_norm fwd+bwd, Python Function": lambda: grad(py_rms_norm(x, w), (x, w), dy),
        "check_rms_norm_inputs": lambda: check_rms_norm_inputs("rms_norm", x, w, 1e-6, 0.0, "llama"),
        "plain_eager((x, w))": lambda: plain_eager((x, w)),
        "torch.empty_like(x)": lambda: torch.empty_like(xd),
        "torch.empty((rows,), fp32)": lambda: torch.empty((rows,), dtype=torch.float32, device=xd.device),
        "launch_fwd (direct)": lambda: run_direct(launch_fwd, xd, w, y2, rstd, 1e-6, 0.0, 0),
        "pre-bound touch launch": lambda: touch.raw((1,), xd, y2, 128),
        "partial.sum(0) [264x4096 fp32]": lambda: partial.sum(0),
        ".to(bf16) of [4096] fp32": lambda: dw.to(torch.bfloat16),
    }
    results = {}
    timelines = {
        "lck rms_norm, Python Function": _timeline(RMSNormFunction, lambda: py_rms_norm(x, w), (x, w), dy),
        "empty Function": _timeline(Empty, lambda: Empty.apply(x, w), (x, w), dy),
    }
    for name, parts in timelines.items():
        print(f"timeline {name}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in parts.items()), flush=True)
    for name, fn in steps.items():
        ms = host_ms(fn, iters=50, warmup=5)
        results[name] = ms
        print(f"{name:45s} {'—' if ms is None else f'{ms * 1e3:8.1f} us'}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.date.today().isoformat()
    path = out / f"host-floor-{gpu_slug()}-{stamp}.json"
    path.write_text(
        json.dumps({"provenance": provenance(), "host_ms": results, "timelines_ms": timelines}, indent=1)
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
