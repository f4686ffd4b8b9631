"""Where the fused linear cross entropy's host time goes, on one CUDA GPU (about a minute).

    python packages/lck-kernels/benchmarks/host_linear_ce.py [--out DIR]

At 8192x4096->128256 bf16, for ``fused_linear_cross_entropy`` (mean) and ``fused_linear_scaled_cross_entropy``
(mean NLL, inverse temperature 1/0.7), through the C++ host path and through the Python Functions (the host path
turned off in-process): host ms (``lck_runtime.benchmarking.host_ms``: the GPU kept busy) of the forward alone
and of forward+backward, beside torch's ``F.cross_entropy(x @ w.T)``; then the CPU-side operator table of
``torch.profiler`` for one C++-path forward+backward of each op (ATen ops and CUDA runtime calls by self CPU
time); then the host ms of forward+backward (C++ path, and torch) by the number of calls timed behind one GPU
spin (5 to 40; ``host_ms`` answers None where a call waited for the GPU). Prints all and writes ``host-linear-ce-<gpu>-<date>.json`` with provenance.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

import torch

from lck_runtime.benchmarking import gpu_slug, host_ms, provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    import torch.nn.functional as F

    from lck_kernels import _host, fused_linear_cross_entropy, fused_linear_scaled_cross_entropy

    n, h, v, tau = 8192, 4096, 128256, 1 / 0.7
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,), device="cuda")
    ops = {
        "flce": lambda: fused_linear_cross_entropy(x, w, t),
        "flsce": lambda: fused_linear_scaled_cross_entropy(
            x, w, t, inverse_temperature=tau, reduction="mean"
        )[0],
        "torch": lambda: F.cross_entropy(x @ w.T, t),
    }
    ready = _host.ready
    results: dict[str, float | None] = {}
    for path in ("host", "python"):
        _host.ready = ready if path == "host" else (lambda *tensors: None)
        for name, fwd in ops.items():
            if name == "torch" and path == "python":
                continue
            results[f"{name} {path} fwd"] = host_ms(fwd, iters=10, warmup=2)
            results[f"{name} {path} fwd+bwd"] = host_ms(
                lambda f=fwd: torch.autograd.grad(f(), (x, w)), iters=10
            )
    _host.ready = ready
    queued: dict[str, dict[int, float | None]] = {}
    for name in ("flce", "torch"):
        fwd = ops[name]
        queued[name] = {
            calls: host_ms(lambda f=fwd: torch.autograd.grad(f(), (x, w)), iters=calls)
            for calls in (5, 10, 20, 40)
        }
        print(f"{name} host ms by calls queued: {queued[name]}", flush=True)
    for k, ms in results.items():
        print(f"{k:<28} {'—' if ms is None else f'{ms:.3f} ms'}", flush=True)
    tables = {}
    from torch.profiler import ProfilerActivity, profile

    for name in ("flce", "flsce"):
        fwd = ops[name]
        torch.autograd.grad(fwd(), (x, w))
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the GPU busy: only host work shows up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                torch.autograd.grad(fwd(), (x, w))
        torch.cuda.synchronize()
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(f"\n--- {name}: 5 forward+backward calls, CPU side\n{tables[name]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host-linear-ce-{gpu_slug()}-{_dt.date.today().isoformat()}.json"
    path.write_text(
        json.dumps(
            {"provenance": provenance(), "host_ms": results, "host_ms_by_calls": queued, "profiles": tables},
            indent=1,
        )
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
