"""Train a small GPT twice, stock and with lck, and compare loss, tokens/s and peak memory.

``lck demo`` (or ``python -m lck_megatron.demo``) picks what the machine can run:
- a GPU with megatron-core importable: a Megatron-Core ``GPTModel`` (local spec, bf16), stock and after
  ``apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)``;
- a GPU without megatron-core: a plain-PyTorch GPT with torch modules vs lck's modules (bf16 autocast);
- no GPU: a tiny plain-PyTorch GPT in float32 on the CPU, with lck's Triton kernels running in Triton's
  interpreter (``TRITON_INTERPRET=1``, set before Triton is imported).
Both runs start from the same weights and see the same batches of a synthetic, learnable corpus. The
demo prints a side-by-side table, writes ``demo.json`` and (with matplotlib) ``loss_curves.png`` into
``--out``, and exits 1 when the two loss curves disagree by more than the precision allows.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lck_megatron._demo_report import _plot, _report, _tolerance

_KERNEL_MODULES = (
    "lck_kernels.rms_norm",
    "lck_kernels.swiglu",
    "lck_kernels.cross_entropy",
)


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_mib: float = 0.0
    peak_kind: str = ""
    tokens_per_step: int = 0
    warmup: int = 1
    lck_calls: dict[str, dict[str, int]] = field(default_factory=dict)  # Megatron path: what lck ran

    @property
    def tokens_per_s(self) -> float:
        timed = sorted(self.step_s[self.warmup :] or self.step_s)
        return self.tokens_per_step / timed[len(timed) // 2]

    def final_loss(self) -> float:
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return sum(tail) / len(tail)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lck demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default: 40 on CPU, 200 on GPU)"
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--backend",
        choices=("auto", "megatron", "torch"),
        default="auto",
        help="model family on the GPU (auto: Megatron-Core when importable)",
    )
    p.add_argument("--out", default="lck-demo", help="folder for demo.json and loss_curves.png")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        p.error(f"--steps must be at least 2, got {args.steps}")
    return args


def _cpu_shape() -> Any:
    import torch

    from lck_megatron._demo_models import ModelShape

    # Sized for the 2-core CPU machines: Triton's interpreter costs ~0.5 ms per program, and the kernels
    # launch about one program per row, so the batch is kept to 32 tokens.
    return ModelShape(
        layers=2, hidden=32, heads=2, ffn=64, seq=16, batch=2, vocab=64, dtype=torch.float32, lr=1e-2
    )


def _gpu_shape() -> Any:
    import torch

    from lck_megatron._demo_models import ModelShape

    return ModelShape(
        layers=4,
        hidden=1024,
        heads=16,
        ffn=4096,
        seq=1024,
        batch=8,
        vocab=32768,
        dtype=torch.bfloat16,
        lr=1e-3,
    )


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _train(
    name: str, step_fn: Any, model: Any, data: Any, shape: Any, device: Any, progress: Any
) -> RunResult:
    import torch

    from lck_megatron._demo_models import MasterWeightAdamW

    opt = MasterWeightAdamW(list(model.parameters()), lr=shape.lr)
    steps = data.shape[0]
    res = RunResult(name, tokens_per_step=shape.batch * shape.seq, warmup=max(2, steps // 10))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss = _rss_mib()
    for i in range(steps):
        batch = data[i].to(device, non_blocking=True)
        t0 = time.perf_counter()
        loss = step_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step(i, steps)
        if cuda:
            torch.cuda.synchronize()
        res.step_s.append(time.perf_counter() - t0)
        res.losses.append(float(loss.detach()))
        if not cuda:
            rss = max(rss, _rss_mib())
        if (i + 1) % _report_every(steps) == 0:
            progress.step(f"{name} step {i + 1} loss {res.losses[-1]:.3f}")
    if cuda:
        res.peak_mib, res.peak_kind = torch.cuda.max_memory_allocated() / 2**20, "CUDA peak allocated"
    else:
        res.peak_mib, res.peak_kind = rss, "process RSS"
    return res


def _report_every(steps: int) -> int:
    return max(1, steps // 20)  # about 20 progress lines per run


def _copy_weights(dst: Any, src_state: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        own = dict(dst.named_parameters())
        missing = sorted(set(own) - set(src_state))
        if missing:
            raise RuntimeError(f"lck demo: the lck model has parameters the stock model lacks: {missing[:5]}")
        for k, p in own.items():
            p.copy_(src_state[k])


def _run_torch(shape: Any, data: Any, device: Any, seed: int, progress: Any) -> list[RunResult]:
    import torch

    from lck_megatron._demo_models import TinyGPT, torch_step_fn

    results = []
    torch.manual_seed(seed)
    stock = TinyGPT(shape, use_lck=False).to(device)
    init = {k: v.detach().clone() for k, v in stock.named_parameters()}
    results.append(_train("torch", torch_step_fn(stock, device), stock, data, shape, device, progress))
    del stock
    lck = TinyGPT(shape, use_lck=True).to(device)
    _copy_weights(lck, init)
    results.append(_train("lck", torch_step_fn(lck, device), lck, data, shape, device, progress))
    return results


def _run_megatron(shape: Any, data: Any, device: Any, seed: int, progress: Any) -> list[RunResult]:
    import torch

    from lck_megatron._demo_models import build_megatron_gpt, megatron_parallel, megatron_step_fn
    from lck_megatron.patch import apply_lck_to_megatron, revert_lck_from_megatron

    results = []
    with megatron_parallel(seed):
        stock = build_megatron_gpt(shape, seed)
        init = {k: v.detach().clone() for k, v in stock.named_parameters()}
        results.append(_train("megatron", megatron_step_fn(stock), stock, data, shape, device, progress))
        del stock
        torch.cuda.empty_cache()
        apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True)
        try:
            patched = build_megatron_gpt(shape, seed)  # the patch must precede the build (norms)
            _copy_weights(patched, init)
            results.append(
                _train("megatron+lck", megatron_step_fn(patched), patched, data, shape, device, progress)
            )
            results[-1].lck_calls = _lck_calls(patched)
        finally:
            revert_lck_from_megatron()
    return results


def _lck_calls(model: Any) -> dict[str, dict[str, int]]:
    """How often the patched model ran lck's kernels, and how often it handed a call back to Megatron."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import mlp

    from lck_megatron.rms_norm import LckMegatronRMSNorm

    norms = {"lck": 0, "torch": 0}
    for m in model.modules():
        if isinstance(m, LckMegatronRMSNorm):
            for k in norms:
                norms[k] += m.calls[k]
    return {
        "swiglu": dict(getattr(mlp.bias_swiglu_impl, "calls", {})),
        "rms_norm": norms,
        "cross_entropy": dict(getattr(tensor_parallel.vocab_parallel_cross_entropy, "calls", {})),
    }


def main(argv: list[str] | None = None) -> int:
    """Train a small GPT stock and with lck side by side: loss agreement, tokens/s, peak memory, a plot."""
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    import torch

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        print("lck demo: --device cuda was asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda" if (args.device == "cuda" or (args.device == "auto" and cuda)) else "cpu")
    if device.type == "cpu" and args.backend == "megatron":
        print(
            "lck demo: the Megatron-Core model needs a CUDA device (its attention allocates on CUDA)",
            file=sys.stderr,
        )
        return 2
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        loaded = [m for m in _KERNEL_MODULES if m in sys.modules]
        if loaded:
            print(
                f"lck demo: lck's kernels ({', '.join(loaded)}) were imported before TRITON_INTERPRET=1 could be "
                "set; run the CPU demo in a fresh process (or set TRITON_INTERPRET=1 first)",
                file=sys.stderr,
            )
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before any lck kernel (and so any @triton.jit) is imported

    use_megatron = False
    if device.type == "cuda" and args.backend != "torch":
        try:
            importlib.import_module("megatron.core")
            use_megatron = True
        except ImportError as exc:
            if args.backend == "megatron":
                print(
                    f"lck demo: --backend megatron, but megatron-core is not importable ({exc})",
                    file=sys.stderr,
                )
                return 2

    shape = _cpu_shape() if device.type == "cpu" else _gpu_shape()
    steps = args.steps or (40 if device.type == "cpu" else 200)
    if device.type == "cpu":
        where = "CPU: running a tiny configuration through the Triton interpreter (TRITON_INTERPRET=1)"
    else:
        family = (
            "Megatron-Core GPTModel, stock vs apply_lck_to_megatron(...)"
            if use_megatron
            else "plain-PyTorch GPT, torch vs lck modules"
        )
        where = f"GPU ({torch.cuda.get_device_name()}): {family}"
    print(where)
    print(
        f"model: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, ffn {shape.ffn}, vocab {shape.vocab}, "
        f"seq {shape.seq}, batch {shape.batch}, {str(shape.dtype).replace('torch.', '')}; {steps} steps per run"
    )

    from lck_megatron._demo_models import markov_batches
    from lck_runtime.benchmarking import Progress, provenance

    data, floor = markov_batches(steps, shape, args.seed)
    if device.type == "cuda":
        data = data.pin_memory()
    progress = Progress(2 * (steps // _report_every(steps)), "lck demo")
    t0 = time.monotonic()
    run = _run_megatron if use_megatron else _run_torch
    results = run(shape, data, device, args.seed, progress)
    summary = _report(results, shape, where, _tolerance(shape), floor)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "loss_curves.png"
    plotted = _plot(results, png, where)
    payload = {
        "where": where,
        "shape": {k: str(v) if k == "dtype" else v for k, v in asdict(shape).items()},
        "steps": steps,
        "seed": args.seed,
        "seconds": time.monotonic() - t0,
        "summary": summary,
        "runs": [
            {
                "name": r.name,
                "losses": r.losses,
                "final_loss": r.final_loss(),
                "step_seconds": r.step_s,
                "tokens_per_s": r.tokens_per_s,
                "peak_mib": r.peak_mib,
                "peak_kind": r.peak_kind,
                "lck_calls": r.lck_calls,
            }
            for r in results
        ],
        "provenance": provenance(),
    }
    (out / "demo.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(
        f"\nwrote {out / 'demo.json'}"
        + (f" and {png}" if plotted else " (matplotlib not installed: no loss_curves.png)")
    )
    if not summary["agree"]:
        print(
            f"lck demo: the loss curves disagree: final losses differ by {summary['final_loss_rel_diff']:.2%} "
            f"(tolerance {summary['tolerance']:.1%})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
