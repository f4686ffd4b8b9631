"""Where one training step of ``lck demo``'s Megatron model spends its GPU time, stock and patched.

    python packages/lck-megatron/benchmarks/demo_step_profile.py [--shape llama3] [--steps 3] [--out DIR]

Builds the demo's ``GPTModel`` at a preset, runs a few warm-up steps (forward, backward, the demo's AdamW),
then profiles ``--steps`` more with ``torch.profiler`` and sorts every CUDA kernel into a bucket by its name
(GEMMs, softmax, the stock loss's log-softmax, lck's Triton kernels, the optimizer's multi-tensor kernels,
reductions, copies). Prints, per run, each bucket's GPU ms per step and its share, and
writes ``demo-step-profile-<gpu>-<date>.json`` with provenance and the 25 most expensive kernels.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from collections import defaultdict
from pathlib import Path

import torch

# Kernels sorted by their names (the profiler does not say which module launched a kernel): the local
# spec's attention shows as its softmax and masked fill around batched GEMMs, the loss as log-softmax/NLL (stock)
# or Triton kernels (lck), the optimizer as multi-tensor kernels.
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("log-softmax / NLL (stock loss)", ("logsoftmax", "nll_loss")),
    ("softmax (attention)", ("softmax",)),
    ("lck Triton kernels", ("_kernel", "triton")),
    ("optimizer (multi-tensor)", ("multi_tensor", "foreach", "adam")),
    ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90", "wgmma")),
    ("reductions", ("reduce",)),
    (
        "copies, casts, fills",
        ("copy", "cast", "fill", "cat", "index", "embedding", "elementwise", "vectorized"),
    ),
)


def _bucket(name: str) -> str:
    low = name.lower().replace("_", "") if "softmax" in name.lower() else name.lower()
    for bucket, keys in _RULES:
        if any(k in low for k in keys):
            return bucket
    return "other"


def _profile(model, step_fn, opt, data, warm: int, steps: int) -> tuple[dict[str, float], list, float]:
    from torch.profiler import ProfilerActivity, profile

    for i in range(warm):
        loss = step_fn(data[i, :, :-1], data[i, :, 1:])
        loss.backward()
        opt.step(i, warm + steps)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=False) as prof:
        start.record()
        for i in range(warm, warm + steps):
            loss = step_fn(data[i, :, :-1], data[i, :, 1:])
            loss.backward()
            opt.step(i, warm + steps)
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end) / steps
    buckets: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = evt.time_range.elapsed_us() / 1e3 / steps
        buckets[_bucket(evt.name)] += ms
        kernels[evt.name[:160]] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return dict(buckets), top, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()

    from lck_megatron._demo_models import (
        PRESETS,
        MasterWeightAdamW,
        apply_demo_patch,
        build_megatron_gpt,
        markov_batches,
        megatron_parallel,
        megatron_step_fn,
    )
    from lck_megatron.patch import revert_lck_from_megatron
    from lck_runtime.benchmarking import gpu_slug, provenance

    shape, _ = PRESETS[args.shape]
    n = args.warmup + args.steps
    data, _ = markov_batches(n, shape, 1234)
    data = data.cuda()
    runs = {}
    with megatron_parallel(1234):
        for name in ("megatron", "megatron+lck"):
            if name == "megatron+lck":
                apply_demo_patch(shape)
            try:
                model = build_megatron_gpt(shape, 1234)
                opt = MasterWeightAdamW(list(model.parameters()), lr=shape.lr)
                buckets, top, wall = _profile(
                    model, megatron_step_fn(model), opt, data, args.warmup, args.steps
                )
            finally:
                if name == "megatron+lck":
                    revert_lck_from_megatron()
            del model, opt
            torch.cuda.empty_cache()
            runs[name] = {"step_ms": wall, "gpu_ms_by_bucket": buckets, "top_kernels_ms": top}
            total = sum(buckets.values())
            print(f"\n{name}: {wall:.1f} ms per step (events), {total:.1f} ms of kernels")
            for b, ms in sorted(buckets.items(), key=lambda kv: -kv[1]):
                print(f"  {b:22s} {ms:8.2f} ms  {100 * ms / total:5.1f}%")
            print("  top kernels:")
            for label, ms in top[:12]:
                print(f"    {ms:7.2f} ms  {label}")
    args.out.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    path = args.out / f"demo-step-profile-{gpu_slug()}-{date}.json"
    payload = {"provenance": provenance(), "shape": args.shape, "steps": args.steps, "runs": runs}
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
