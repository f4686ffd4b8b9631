"""What each rank of the tensor-parallel FLSCE benchmark (``bench.tp``) runs.

:func:`worker` builds the inputs, times every provider on every rank (the TP ones, then, on rank 0 alone,
the single-GPU ones over the whole vocabulary) and returns rank 0's records plus the correctness check.
``bench.tp`` describes the providers and the timing, spawns the ranks and writes the results.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import asdict
from typing import Any


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def _closures(op, x, w, target, g_nll, g_ent, entropy: bool):
    """(fwd, fwd_bwd) closures for ``op(x, w, target) -> nll or (nll, entropy)``."""
    import torch

    def fwd():
        return op(x, w, target)

    def fwd_bwd():
        out = op(x, w, target)
        nll = _first(out)
        # A reduced (0-d) loss gets the usual upstream gradient of 1; per-token outputs get random ones.
        g = None if nll.dim() == 0 else g_nll
        if entropy:
            return torch.autograd.grad((nll, out[1]), (x, w), (g, g_ent))
        return torch.autograd.grad(nll, (x, w), g)

    return fwd, fwd_bwd


def worker(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as vp_flsce
    from lck_runtime import FusedLinearCrossEntropyConfig, configure, finalize
    from lck_runtime.benchmarking import (
        Record,
        device_barrier,
        host_ms,
        peak_memory_mib,
        summarize,
        time_cuda,
        time_loop,
    )

    tokens, hidden, vocab, tau, entropy = (
        cfg["tokens"],
        cfg["hidden"],
        cfg["vocab"],
        cfg["tau"],
        cfg["entropy"],
    )
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    cpu = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=1800))
    barrier = lambda: dist.barrier(group=cpu)
    # The gloo barrier keeps the host loops in step; the device-side meeting point makes every rank's
    # events start together, so no rank times its wait for a late peer (see time_cuda's ``align``).
    align = device_barrier(group)
    # ``share_of`` = N > world: every rank holds the shard it would hold at TP=N (vocab / N rows), so the
    # group runs TP=N's per-rank work with this world's collectives; its targets fall in the group's rows.
    share = cfg.get("share_of") or world
    vs = vocab // share
    tag = f"tp{world}" if share == world else f"tp{share}share{world}"
    shape = f"{tokens}x{hidden}->{vocab}"
    gen = torch.Generator(device=dev).manual_seed(1234)
    x = torch.randn(tokens, hidden, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
    w_full = (torch.randn(vocab, hidden, device=dev, generator=gen) / hidden**0.5).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=dev, generator=gen)
    tp_target = (
        target if share == world else torch.randint(0, world * vs, (tokens,), device=dev, generator=gen)
    )
    g_nll = torch.randn(tokens, device=dev, generator=gen)
    g_ent = 0.1 * torch.randn(tokens, device=dev, generator=gen)
    w = w_full[rank * vs : (rank + 1) * vs].clone().requires_grad_(True)
    if rank != 0:
        del w_full
    torch.cuda.empty_cache()
    records: list[Record] = []
    flops = {"fwd": 2 * tokens * hidden * vocab, "fwd_bwd": 6 * tokens * hidden * vocab}
    providers = cfg["providers"]

    def gathered(times: list[float]) -> list[float]:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, times, group=cpu)
        return [max(ts) for ts in zip(*every)]  # a TP step lasts as long as its slowest rank

    def measure_tp(provider: str, op, extra: dict[str, Any]) -> None:
        if providers and provider not in providers:
            return
        fns = dict(zip(("fwd", "fwd_bwd"), _closures(op, x, w, tp_target, g_nll, g_ent, entropy)))
        for mode, fn in fns.items():
            rec = Record(
                "flsce_tp", provider, mode, shape, "bfloat16", extra={"tp": world, "share_of": share, **extra}
            )
            err, loop, host = None, None, None
            try:
                times = time_cuda(fn, warmup=cfg["warmup"], iters=cfg["iters"], barrier=barrier, align=align)
                peak = peak_memory_mib(fn)
                barrier()
                # Back to back, as in a training loop (each call's collectives keep the ranks in step).
                loop = time_loop(fn, iters=cfg["iters"], warmup=1)
                barrier()
                # The cost of enqueuing one call behind a GPU spin (every rank runs the same calls).
                host = host_ms(fn, iters=min(cfg["iters"], 10), warmup=1)
            except Exception as exc:  # a provider that fails is a record, not a crash (all ranks fail alike)
                err, times, peak = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", [], None
            errs: list[Any] = [None] * world
            dist.all_gather_object(errs, err, group=cpu)
            if any(errs):
                rec.error = next(e for e in errs if e)
                records.append(rec)
                continue
            rec.__dict__.update(summarize(gathered(times)))
            rec.extra["loop_ms"] = max(gathered([loop]))
            hosts: list[Any] = [None] * world
            dist.all_gather_object(hosts, host, group=cpu)
            # The slowest rank's enqueue cost; None where a rank's calls waited for its GPU (host_ms).
            rec.extra["host_ms"] = None if None in hosts else max(hosts)
            peaks: list[Any] = [None] * world
            dist.all_gather_object(peaks, peak, group=cpu)
            rec.peak_mib = max(peaks)
            rec.extra["tflop_per_s_per_gpu"] = flops[mode] / share / (rec.median_ms * 1e-3) / 1e12
            records.append(rec)
        torch.cuda.empty_cache()

    def lck_tp(chunk_mib: int, reduction: str = "none"):
        def op(x, w, t):
            out = vp_flsce(
                x,
                w,
                t,
                group,
                inverse_temperature=tau,
                return_entropy=entropy,
                reduction=reduction,
                chunk_bytes=chunk_mib << 20,
            )
            return (out[0], out[2]) if entropy else out[0]

        return op

    # Correctness once, outside timing: the TP NLL against the single-GPU ops on the whole vocabulary
    # (filled in on rank 0 by _single_gpu).
    check: dict[str, Any] = {} if share == world else {"skipped": f"share-of run (vocab / {share} per rank)"}

    # 1. torch.distributed (NCCL) reductions: no runtime context yet.
    for mib in cfg["chunk_mib"]:
        measure_tp(f"lck_{tag}_nccl", lck_tp(mib), {"chunk_mib": mib})
        measure_tp(f"lck_{tag}_nccl_sum", lck_tp(mib, "sum"), {"chunk_mib": mib})
    # 2. The runtime's context (NVSHMEM when it comes up).
    native = configure(
        process_groups={"tp": group},
        device=dev,
        flsce=FusedLinearCrossEntropyConfig(
            max_tokens=tokens, hidden_size=hidden, local_vocab_size=vs, group="tp"
        ),
    )
    label = f"lck_{tag}_{'nvshmem' if native else 'runtime'}"
    for mib in cfg["chunk_mib"]:
        measure_tp(label, lck_tp(mib), {"chunk_mib": mib, "native": native})
        measure_tp(f"{label}_sum", lck_tp(mib, "sum"), {"chunk_mib": mib, "native": native})
    with torch.no_grad():
        nll_tp = _first(lck_tp(cfg["chunk_mib"][0])(x, w, target)) if share == world else None
    # 3. Liger-Kernel's TP frontend (not in a share-of run: the comparison there is with the single GPU).
    LigerFusedLinearScaledCrossEntropyTPFunction = None
    if share == world:
        try:
            from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
                LigerFusedLinearScaledCrossEntropyTPFunction,
            )
        except ImportError:
            pass
    if LigerFusedLinearScaledCrossEntropyTPFunction is not None:
        try:
            import liger_kernel.ops.fused_linear_scaled_cross_entropy as lfs

            path = "native" if lfs._load_native_tp_function() is not None else "torch fallback"
        except Exception:
            path = "torch fallback"

        def liger_tp(x, w, t):
            return LigerFusedLinearScaledCrossEntropyTPFunction.apply(
                x, w, t, group, 1.0 / tau, -100, 1, entropy
            )

        measure_tp(f"liger_{tag}", liger_tp, {"path": path})
    finalize()
    # The NCCL path again (finalize dropped the runtime context): the GPUs' clocks drift over a long run, so
    # the NVSHMEM rows are compared with NCCL rows timed before and after them.
    for mib in cfg["chunk_mib"]:
        measure_tp(f"lck_{tag}_nccl_after", lck_tp(mib), {"chunk_mib": mib})

    # 4. Single GPU, whole vocabulary, rank 0 only (the others wait at the gloo barrier).
    if rank == 0:
        records += _single_gpu(cfg, x, w_full, target, g_nll, g_ent, shape, flops, check, nll_tp)
    barrier()
    if rank != 0:
        return None
    out = [asdict(r) for r in records]
    out.append({"check": check})
    return out


def _single_gpu(cfg, x, w_full, target, g_nll, g_ent, shape, flops, check, nll_tp) -> list[Any]:
    import torch

    from lck_runtime.benchmarking import Record, host_ms, peak_memory_mib, summarize, time_cuda, time_loop

    tau, entropy, providers = cfg["tau"], cfg["entropy"], cfg["providers"]
    w = w_full.clone().requires_grad_(True)
    singles: dict[str, Any] = {}
    try:
        from lck_kernels import fused_linear_scaled_cross_entropy as lck_single

        def lck_op(reduction):
            kw = {} if reduction == "none" else {"reduction": reduction}

            def op(x, w, t):
                out = lck_single(x, w, t, inverse_temperature=tau, return_entropy=entropy, **kw)
                return (out[0], out[-1]) if entropy else _first(out)

            return op

        singles["lck_single"] = lck_op("none")
        singles["lck_single_sum"] = lck_op("sum")
    except (ImportError, AttributeError) as exc:
        singles["lck_single"] = exc
    try:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
            LigerFusedLinearScaledCrossEntropyFunction,
        )

        singles["liger_single"] = lambda x, w, t: LigerFusedLinearScaledCrossEntropyFunction.apply(
            x, w, t, 1.0 / tau, -100, 1, entropy
        )
    except ImportError:
        pass

    def torch_op(x, w, t):
        z = (x @ w.t()).float() * tau
        logp = z.log_softmax(-1)
        nll = -logp.gather(-1, t[:, None]).squeeze(-1)
        return (nll, -(logp.exp() * logp).sum(-1)) if entropy else nll

    singles["torch_single"] = torch_op
    records = []
    for provider, op in singles.items():
        if providers and provider not in providers:
            continue
        if isinstance(op, Exception):
            for mode in ("fwd", "fwd_bwd"):
                records.append(
                    Record("flsce_tp", provider, mode, shape, "bfloat16", extra={"tp": 1}, error=repr(op))
                )
            continue
        fwd, fwd_bwd = _closures(op, x, w, target, g_nll, g_ent, entropy)
        for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            rec = Record("flsce_tp", provider, mode, shape, "bfloat16", extra={"tp": 1})
            try:
                rec.__dict__.update(summarize(time_cuda(fn, warmup=cfg["warmup"], iters=cfg["iters"])))
                rec.peak_mib = peak_memory_mib(fn)
                rec.extra["loop_ms"] = time_loop(fn, iters=cfg["iters"], warmup=1)
                rec.extra["host_ms"] = host_ms(fn, iters=min(cfg["iters"], 10), warmup=1)
                rec.extra["tflop_per_s_per_gpu"] = flops[mode] / (rec.median_ms * 1e-3) / 1e12
            except Exception as exc:
                rec.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            records.append(rec)
        if nll_tp is not None and provider in ("lck_single", "torch_single"):
            with torch.no_grad():
                ref = _first(op(x, w, target)).float()
            check[f"tp_vs_{provider}_nll_rel_err"] = ((nll_tp.float() - ref).norm() / ref.norm()).item()
            del ref
        torch.cuda.empty_cache()
    return records
