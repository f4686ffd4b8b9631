"""The pieces every kernel benchmark suite shares: a case, its providers, and how one is measured.

A suite module (``bench/<op>.py``) exposes ``cases(quick: bool) -> list[Case]``. A case makes fresh
random inputs and maps provider names to *builders*: ``builder(inputs) -> (fwd, fwd_bwd)`` closures,
either of which may be ``None`` when a provider lacks that mode. Providers that are not installed
(Liger-Kernel, megatron-core) are simply left out by the suite. The runner times each closure with
CUDA events (GPU time: L2 flushed, host dispatch hidden), measures peak memory above what was live before
the call, the host's own cost per call and the time per call back to back (``host_ms``, ``loop_ms`` in a
record's ``extra``), and records errors instead of aborting the sweep.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lck_runtime.benchmarking import Record, host_ms, peak_memory_mib, summarize, time_cuda, time_loop

Closure = Callable[[], Any]
Builder = Callable[[dict[str, Any]], tuple[Closure | None, Closure | None]]


@dataclass
class Case:
    bench: str  # "rms_norm", "swiglu_packed", ...
    shape: str  # "16384x4096"
    dtype: torch.dtype
    make_inputs: Callable[[], dict[str, Any]]
    providers: dict[str, Builder]
    # Fewest bytes each mode must move (each input read once, each output written once), for the
    # bandwidth column; FLOPs for matmul-bound cases. Either may be absent.
    bytes: dict[str, float] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    iters: int = 30
    warmup: int = 5


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile with the defaults a user would pick; compiled once per case, outside timing."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def run_case(case: Case, *, modes: tuple[str, ...] = ("fwd", "fwd_bwd")) -> list[Record]:
    records = []
    dtype = str(case.dtype).replace("torch.", "")
    # Each case compiles its own graphs: without a reset, suites that compile one function over many
    # shapes hit dynamo's recompile limit (fullgraph=True turns that into a hard failure).
    torch._dynamo.reset()
    for provider, builder in case.providers.items():
        inputs = case.make_inputs()
        try:
            closures = dict(zip(("fwd", "fwd_bwd"), builder(inputs)))
        except Exception as exc:  # a peer that cannot run this case is a record, not a crash
            for mode in modes:
                records.append(Record(case.bench, provider, mode, case.shape, dtype, error=_err(exc)))
            continue
        for mode in modes:
            fn = closures.get(mode)
            if fn is None:
                continue
            rec = Record(case.bench, provider, mode, case.shape, dtype)
            try:
                times = time_cuda(fn, warmup=case.warmup, iters=case.iters)
                rec.__dict__.update(summarize(times))
                rec.peak_mib = peak_memory_mib(fn)
                # What a training loop sees besides GPU time: the host's cost per call, and back-to-back
                # calls (slower than the GPU time when the host cannot keep ahead of the kernels).
                rec.extra["host_ms"] = host_ms(fn, iters=min(case.iters, 20))
                rec.extra["loop_ms"] = time_loop(fn, iters=case.iters, warmup=1)
                if mode in case.bytes:
                    rec.extra["gb_per_s"] = case.bytes[mode] / (rec.median_ms * 1e-3) / 1e9
                if mode in case.flops:
                    rec.extra["tflop_per_s"] = case.flops[mode] / (rec.median_ms * 1e-3) / 1e12
            except Exception as exc:
                rec.error = _err(exc)
            records.append(rec)
        del inputs, closures
        torch.cuda.empty_cache()
    return records


def _err(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"
