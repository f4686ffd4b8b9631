"""Train a GPT twice, stock and with lck, and compare loss, tokens/s and peak memory.

``lck demo`` (or ``python -m lck_megatron.demo``) picks what the machine can run:
- a GPU with megatron-core importable: a Megatron-Core ``GPTModel`` (local spec, bf16), stock and after
  ``apply_lck_to_megatron(rms_norm=True, cross_entropy=True, swiglu=True, linear_cross_entropy=True,
  attention=True)``;
- a GPU without megatron-core: a plain-PyTorch GPT with torch modules vs lck's modules (bf16 autocast);
- no GPU: a tiny plain-PyTorch GPT in float32 on the CPU, with lck's Triton kernels running in Triton's
  interpreter (``TRITON_INTERPRET=1``, set before Triton is imported).
On a GPU the default shape (``--shape llama3``) has Llama-3's 128256-token vocabulary, hidden 2048 and
2048-token sequences; ``--shape`` picks another preset (``small`` is the earlier default). Both runs start from
the same weights and see the same batches of a synthetic, learnable corpus. The demo prints a side-by-side
table, writes ``demo.json`` and (with matplotlib) ``loss_curves.png`` into ``--out``, and exits 1 when the two
loss curves disagree by more than the precision allows.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lck_megatron._demo_report import _plot, _report, _tolerance
from lck_megatron._demo_run import RunResult, copy_weights, report_every, train

# The presets of lck_megatron._demo_models.PRESETS (named here so that parsing imports neither torch nor lck).
SHAPES = ("cpu", "small", "llama3", "llama3-8l", "moe")
_GPU_DEFAULT = "llama3"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lck demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the preset's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--backend",
        choices=("auto", "megatron", "torch"),
        default="auto",
        help="model family on the GPU (auto: Megatron-Core when importable)",
    )
    p.add_argument(
        "--shape",
        choices=("auto", *SHAPES),
        default="auto",
        help=f"model preset (auto: cpu without a GPU, {_GPU_DEFAULT} with one; small is the earlier GPU default)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="a Qwen3-MoE-like Megatron GPTModel (--shape moe), patched with moe=True too (GPU and megatron-core)",
    )
    p.add_argument("--out", default="lck-demo", help="folder for demo.json and loss_curves.png")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.moe and args.shape not in ("auto", "moe"):
        p.error(f"--moe trains the moe preset; --shape {args.shape} is a dense one")
    if args.moe and args.backend == "torch":
        p.error("--moe needs the Megatron-Core model (--backend auto or megatron)")
    if args.moe:
        args.shape, args.backend = "moe", "megatron"
    if args.steps is not None and args.steps < 2:
        p.error(f"--steps must be at least 2, got {args.steps}")
    return args


def _run_torch(shape: Any, data: Any, device: Any, seed: int, progress: Any) -> list[RunResult]:
    import torch

    from lck_megatron._demo_models import TinyGPT, torch_step_fn

    results = []
    torch.manual_seed(seed)
    stock = TinyGPT(shape, use_lck=False).to(device)
    init = {k: v.detach().clone() for k, v in stock.named_parameters()}
    results.append(train("torch", torch_step_fn(stock, device), stock, data, shape, device, progress))
    del stock
    lck = TinyGPT(shape, use_lck=True).to(device)
    copy_weights(lck, init)
    results.append(train("lck", torch_step_fn(lck, device), lck, data, shape, device, progress))
    return results


def _run_megatron(shape: Any, data: Any, device: Any, seed: int, progress: Any) -> list[RunResult]:
    import torch

    from lck_megatron._demo_models import (
        apply_demo_patch,
        build_megatron_gpt,
        megatron_parallel,
        megatron_step_fn,
    )
    from lck_megatron.patch import revert_lck_from_megatron

    results = []
    with megatron_parallel(seed):
        stock = build_megatron_gpt(shape, seed)
        init = {k: v.detach().clone() for k, v in stock.named_parameters()}
        results.append(train("megatron", megatron_step_fn(stock), stock, data, shape, device, progress))
        del stock
        torch.cuda.empty_cache()
        apply_demo_patch(shape)
        try:
            patched = build_megatron_gpt(shape, seed)  # the patch must precede the build (norms)
            copy_weights(patched, init)
            results.append(
                train("megatron+lck", megatron_step_fn(patched), patched, data, shape, device, progress)
            )
            results[-1].lck_calls = _lck_calls(patched)
        finally:
            revert_lck_from_megatron()
    return results


def _lck_calls(model: Any) -> dict[str, dict[str, int]]:
    """How often the patched model ran lck's kernels, and how often it handed a call back to Megatron."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import mlp

    from lck_megatron.attention import LckDotProductAttention
    from lck_megatron.patch import linear_cross_entropy_route, moe_route
    from lck_megatron.rms_norm import LckMegatronRMSNorm

    route = linear_cross_entropy_route()
    moe = moe_route()
    norms = {"lck": 0, "torch": 0}
    attention = {"lck": 0, "megatron": 0}
    for m in model.modules():
        if isinstance(m, LckMegatronRMSNorm):
            counts = norms
        elif isinstance(m, LckDotProductAttention):
            counts = attention
        else:
            continue
        for k in counts:
            counts[k] += m.calls[k]
    return {
        "swiglu": dict(getattr(mlp.bias_swiglu_impl, "calls", {})),
        "rms_norm": norms,
        "attention": attention,
        "cross_entropy": dict(getattr(tensor_parallel.vocab_parallel_cross_entropy, "calls", {})),
        "linear_cross_entropy": dict(route.calls) if route is not None else {},
        "moe_layers": dict(moe.layers) if moe is not None else {},
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
        # Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when lck_kernels is imported.
        loaded = sorted(m for m in sys.modules if m == "lck_kernels" or m.startswith("lck_kernels."))
        if loaded:
            print(
                f"lck demo: lck's kernels ({', '.join(loaded[:4])}) were imported before TRITON_INTERPRET=1 could "
                "be set; run the CPU demo in a fresh process (or set TRITON_INTERPRET=1 first)",
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

    from lck_megatron._demo_models import PRESETS

    preset = args.shape if args.shape != "auto" else ("cpu" if device.type == "cpu" else _GPU_DEFAULT)
    shape, preset_steps = PRESETS[preset]
    if device.type == "cpu" and shape.dtype != torch.float32:
        print(f"lck demo: --shape {preset} is a bf16 GPU preset; on the CPU use --shape cpu", file=sys.stderr)
        return 2
    steps = args.steps or preset_steps
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
    tied = ", tied embeddings" if shape.tied else ""
    print(
        f"model ({preset}): {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, ffn {shape.ffn}, "
        f"vocab {shape.vocab}{tied}, seq {shape.seq}, batch {shape.batch}, "
        f"{str(shape.dtype).replace('torch.', '')}; {steps} steps per run"
    )

    from lck_megatron._demo_models import markov_batches
    from lck_runtime.benchmarking import Progress, provenance

    data, floor = markov_batches(steps, shape, args.seed)
    if device.type == "cuda":
        data = data.pin_memory()
    progress = Progress(2 * (steps // report_every(steps)), "lck demo")
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
        "preset": preset,
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
