"""``lck bench ep --pes N``: the native backend with N NVSHMEM PEs, beside the reference and a plain copy.

N processes over gloo share the visible GPUs (several per GPU under CUDA MPS, which the caller starts:
``MPS=1 bash ci/device.sh ...``), so what is measured between PEs of one GPU is the kernels' own
efficiency at HBM speed, not NVLink (FACTS.md: a peer ``copy_`` runs at the local copy's rate there).
For each shape and provider every row has

- GPU time: :func:`lck_runtime.benchmarking.time_cuda` (the GPU spins ~2.5 ms while the host enqueues),
  aligned on the device before each call by a native dispatch of no rows (it returns once every PE's
  stream got there), after a host barrier;
- host time: what enqueuing one call costs the host;
- loop time: 20 calls back to back (the native protocol itself keeps the PEs in step).

Bytes are the rows a PE sends to other PEs (deduplicated: a token crosses once per destination rank);
``copy_peer`` copies those bytes into the next PE's symmetric workspace with ``Tensor.copy_``, all PEs at
once: the floor the kernels are held to. The reference backend moves CPU tensors over gloo here (NCCL
refuses two ranks on one GPU); its rows are for scale, not a peer.
"""

from __future__ import annotations

import statistics
from typing import Any

SHAPES = [  # (name, tokens per rank, hidden, top-k, experts): DeepSeek-V3's MoE rows
    ("dsv3", 4096, 7168, 8, 256),
    ("dsv3", 128, 7168, 8, 256),
]


def bench_rank(rank: int, world: int, iters: int, with_reference: bool) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    # Workspace rows for 9/8 of the most tokens per PE: room for a synced expanded dispatch's largest layout
    # (top-8 over 8 PEs holds about 6% more expanded rows than tokens per PE, with alignment 128) and its
    # maps, so that its combine can take the zero-copy input (Buffer.combine_input). The Buffers' own
    # capacities are the shapes' tokens.
    cap = max(s[1] for s in SHAPES) * 9 // 8
    _, _, hmax, kmax, experts = SHAPES[0]
    if not L.configure(moe=L.MoEConfig(max_tokens=cap, hidden_size=hmax, num_experts=experts, top_k=kmax)):
        raise RuntimeError("the native runtime did not come up (NVSHMEM unavailable)")
    group = dist.group.WORLD
    meet = Buffer(group, 1, 8, 1, experts, sync_free=True, device=dev)
    no_x = torch.empty(0, 8, dtype=torch.bfloat16, device=dev)
    no_idx = torch.empty(0, 1, dtype=torch.int64, device=dev)

    def align() -> None:  # a native operation of no rows: a device-side meeting point of every PE
        meet.dispatch(no_x, no_idx, num_worst_tokens=1)

    rows: list[dict[str, Any]] = []

    def attempt(bench: str, provider: str, label: str, fn: Any, nbytes: float, cuda: bool = True) -> None:
        def time_it(rec: dict[str, Any]) -> None:
            if cuda:
                time_row(rec, fn, iters, align, host=bench != "copy")
            else:  # wall time of a few calls, each after a barrier
                import time

                fn()
                times = []
                for _ in range(3):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e3)
                rec["times"] = times

        record_row(rows, bench, provider, label, nbytes, time_it)

    for shape in SHAPES:
        _bench_shape(shape, rank, world, dev, attempt, with_reference)
        torch.cuda.empty_cache()
    meet.check_errors()
    L.finalize()
    return rows


def _with(obj: Any, name: str, value: Any, fn: Any) -> Any:
    """``fn`` run with ``obj.name`` set to ``value``, then put back (an attribute ``obj`` did not hold itself
    is deleted again, so that its class's value shows through)."""

    def run() -> Any:
        own = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)
        try:
            return fn()
        finally:
            if own is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, own)

    return run


_MISSING = object()


def pushed(buf: Any, fn: Any) -> Any:
    """``fn`` run with ``buf``'s native state pushing dispatched rows instead of pulling them."""
    return _with(buf._native, "pulls_rows", False, fn)


def group_agreement(buf: Any, fn: Any) -> Any:
    """``fn`` run with ``buf``'s synced calls agreeing over its process group (``EP_DEVICE_AGREEMENT=0``)
    instead of through the native workspaces."""
    return _with(buf, "_gather", None, fn)


def blocking_wait(buf: Any, fn: Any) -> Any:
    """``fn`` run with ``buf``'s synced calls waiting for their agreement's table on a blocking-sync event
    (the host thread sleeps) instead of the default spinning one: under MPS, eight spinning hosts share the
    machine's cores with the processes still enqueueing."""
    import torch

    event = torch.cuda.Event(blocking=True)
    return _with(buf._native, "_agree_done", event, fn)


def _bench_shape(
    shape: tuple[str, int, int, int, int], rank: int, world: int, dev: Any, attempt: Any, with_reference: bool
) -> None:
    """Every provider on one shape (collective: every PE runs the same sequence)."""
    import torch
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    name, tokens, hidden, k, e = shape
    group = dist.group.WORLD
    label = f"{name} T{tokens} H{hidden} K{k} E{e} x{world} PEs"
    g, x, idx, w, synced, d, free, df, sent = dispatch_shape(shape, rank, dev)
    attempt("dispatch", "lck_nvshmem", label, lambda: synced.dispatch(x, idx, w), sent)
    # The synced dispatch receiving before the host reads its counts at any size (Buffer(early_receive_bytes=...):
    # outputs are views of capacity-sized tensors), where the default does so only up to 16 MiB of outputs.
    early = Buffer(group, tokens, hidden, k, e, device=dev, early_receive_bytes=1 << 40)
    early.dispatch(x, idx, w)
    attempt("dispatch", "lck_nvshmem_early_receive", label, lambda: early.dispatch(x, idx, w), sent)
    attempt("dispatch", "lck_nvshmem_sync_free", label, lambda: free.dispatch(x, idx, w), sent)
    attempt("dispatch_cached", "lck_nvshmem", label, lambda: synced.dispatch(x, handle=d.handle), sent)
    attempt(
        "dispatch_cached", "lck_nvshmem_sync_free", label, lambda: free.dispatch(x, handle=df.handle), sent
    )
    expanded = lambda: free.dispatch(x, idx, w, expand=True, expert_alignment=128)
    attempt("dispatch_expanded", "lck_nvshmem_sync_free", label, expanded, sent)
    # The same calls with rows pushed into the destinations' regions (the design before pulled rows), for
    # comparison; every PE switches at the same point of the sequence, so senders and receivers agree.
    attempt(
        "dispatch", "lck_nvshmem_sync_free_push", label, pushed(free, lambda: free.dispatch(x, idx, w)), sent
    )
    cached_push = pushed(free, lambda: free.dispatch(x, handle=df.handle))
    attempt("dispatch_cached", "lck_nvshmem_sync_free_push", label, cached_push, sent)
    attempt("dispatch_expanded", "lck_nvshmem_sync_free_push", label, pushed(free, expanded), sent)
    de = expanded()
    attempt("combine", "lck_nvshmem", label, lambda: synced.combine(d.recv_x, d.handle), sent)
    synced.combine_input(d.handle).copy_(d.recv_x)
    synced_zero_copy = lambda: synced.combine(synced.combine_input(d.handle), d.handle)
    attempt("combine", "lck_nvshmem_zero_copy", label, synced_zero_copy, sent)
    # The same synced calls agreeing over the process group (gloo here; EP_DEVICE_AGREEMENT=0) instead of
    # through the workspaces: the same Buffer switched on every PE at the same point, as pushed() switches rows.
    fresh = group_agreement(synced, lambda: synced.dispatch(x, idx, w))
    attempt("dispatch", "lck_nvshmem_group_agreement", label, fresh, sent)
    cached = group_agreement(synced, lambda: synced.dispatch(x, handle=d.handle))
    attempt("dispatch_cached", "lck_nvshmem_group_agreement", label, cached, sent)
    combine = group_agreement(synced, lambda: synced.combine(d.recv_x, d.handle))
    attempt("combine", "lck_nvshmem_group_agreement", label, combine, sent)
    # The same synced calls with the host asleep while it waits for the agreement's table.
    for bench, fn in (
        ("dispatch", lambda: synced.dispatch(x, idx, w)),
        ("dispatch_cached", lambda: synced.dispatch(x, handle=d.handle)),
        ("combine", lambda: synced.combine(d.recv_x, d.handle)),
    ):
        attempt(bench, "lck_nvshmem_blocking_wait", label, blocking_wait(synced, fn), sent)
    attempt("combine", "lck_nvshmem_sync_free", label, lambda: free.combine(df.recv_x, df.handle), sent)
    # The expert outputs written straight into the workspace (Buffer.combine_input, filled once here: the
    # expert kernel's own stores are not the combine's), read there by their sources.
    free.combine_input(df.handle).copy_(df.recv_x)

    def zero_copy() -> Any:
        return free.combine(free.combine_input(df.handle), df.handle)

    attempt("combine", "lck_nvshmem_sync_free_zero_copy", label, zero_copy, sent)
    combine_expanded = lambda: free.combine(de.recv_x, de.handle, topk_weights=de.recv_topk_weights)
    attempt("combine_expanded", "lck_nvshmem_sync_free", label, combine_expanded, sent)
    # Synced expanded: the dispatch, its combine pushed, and its combine from the zero-copy input (the expert
    # outputs written into the workspace, each source reducing its tokens' rows there), when that fits.
    synced_expanded = lambda: synced.dispatch(x, idx, w, expand=True, expert_alignment=128)
    attempt("dispatch_expanded", "lck_nvshmem", label, synced_expanded, sent)
    se = synced_expanded()
    weights = se.recv_topk_weights
    attempt(
        "combine_expanded", "lck_nvshmem", label, lambda: synced.combine(se.recv_x, se.handle, weights), sent
    )
    z = synced.combine_input(se.handle)
    z.copy_(se.recv_x)
    if synced._native.takes_in_place(z, se.handle):  # the same verdict on every PE (else nothing is armed)

        def expanded_zero_copy() -> Any:
            return synced.combine(synced.combine_input(se.handle), se.handle, weights)

        attempt("combine_expanded", "lck_nvshmem_zero_copy", label, expanded_zero_copy, sent)
    # The default keeps most SMs for overlapped compute; the same kernels on this PE's whole share:
    # Under MPS the multiprocessor count this process reads is already its share of the GPU.
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if sms > free.num_sms:
        wide = Buffer(group, tokens, hidden, k, e, sync_free=True, device=dev, num_sms=sms)
        dw = wide.dispatch(x, idx, w)
        attempt("dispatch", f"lck_nvshmem_sync_free_{sms}sms", label, lambda: wide.dispatch(x, idx, w), sent)
        attempt(
            "combine",
            f"lck_nvshmem_sync_free_{sms}sms",
            label,
            lambda: wide.combine(dw.recv_x, dw.handle),
            sent,
        )
        wide_expanded = lambda: wide.dispatch(x, idx, w, expand=True, expert_alignment=128)
        attempt("dispatch_expanded", f"lck_nvshmem_sync_free_{sms}sms", label, wide_expanded, sent)
        dwe = wide_expanded()
        attempt(
            "combine_expanded",
            f"lck_nvshmem_sync_free_{sms}sms",
            label,
            lambda: wide.combine(dwe.recv_x, dwe.handle, topk_weights=dwe.recv_topk_weights),
            sent,
        )
    # The same bytes as one copy_ into the next PE's workspace (and, for scale, within this PE).
    n = int(sent) // 2
    src = torch.randn(n, generator=g).to(torch.bfloat16).to(dev)
    peer = L.moe_context(group).peer_workspace((rank + 1) % world)[: 2 * n].view(torch.bfloat16)
    local = torch.empty_like(src)
    attempt("copy", "copy_peer", label, lambda: peer.copy_(src), sent)
    attempt("copy", "copy_local", label, lambda: local.copy_(src), sent)
    if with_reference:
        cpu = Buffer(group, tokens, hidden, k, e, device="cpu", backend="reference")
        xc, ic, wc = x.cpu(), idx.cpu(), w.cpu()
        dc = cpu.dispatch(xc, ic, wc)
        attempt("dispatch", "lck_reference_gloo_cpu", label, lambda: cpu.dispatch(xc, ic, wc), sent, False)
        attempt(
            "combine", "lck_reference_gloo_cpu", label, lambda: cpu.combine(dc.recv_x, dc.handle), sent, False
        )


def record_row(
    rows: list[dict[str, Any]], bench: str, provider: str, label: str, nbytes: float, time_it: Any
) -> None:
    """Append this PE's row of one (bench, provider, shape): ``time_it(row)`` fills its ``times`` (and
    ``host_ms``, ``loop_ms``); a failure becomes the row's ``error`` instead. Collective: every PE reaches
    the closing barrier either way, so one PE's failure does not hang the others' next row."""
    import torch
    import torch.distributed as dist

    from lck_runtime.benchmarking import summarize

    rec: dict[str, Any] = {"bench": bench, "provider": provider, "shape": label, "bytes": nbytes}
    try:
        time_it(rec)
        rec["summary"] = summarize(rec["times"])
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()
    dist.barrier()
    rows.append(rec)


def time_row(rec: dict[str, Any], fn: Any, iters: int, align: Any, host: bool = True) -> None:
    """GPU time (each call aligned on the device by ``align``), host time unless ``host`` is False, and loop
    time of ``fn`` into ``rec``. Collective."""
    import torch.distributed as dist

    from lck_runtime.benchmarking import host_ms, time_cuda, time_loop

    rec["times"] = time_cuda(fn, warmup=3, iters=iters, barrier=dist.barrier, align=align)
    rec["host_ms"] = host_ms(fn, iters=5, warmup=1) if host else None
    dist.barrier()
    rec["loop_ms"] = time_loop(fn, iters=20, warmup=2)


def dispatch_shape(shape: tuple[str, int, int, int, int], rank: int, dev: Any) -> tuple[Any, ...]:
    """One shape's inputs on this PE (bf16 rows, ``k`` distinct random experts and random weights per token,
    from a generator seeded by ``rank``), a synced and a sync-free Buffer over WORLD with one dispatch
    through each, and the bytes this PE sends to other PEs per dispatch: ``(generator, x, idx, w, synced,
    dispatched, sync_free, sync_free_dispatched, sent)``. Collective."""
    import torch
    import torch.distributed as dist

    from lck_ep import Buffer

    _, tokens, hidden, k, e = shape
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(tokens, e, generator=g).argsort(dim=1)[:, :k].contiguous().to(dev)
    w = torch.rand(tokens, k, generator=g).to(dev)
    synced = Buffer(group, tokens, hidden, k, e, device=dev)
    free = Buffer(group, tokens, hidden, k, e, sync_free=True, device=dev)
    d = synced.dispatch(x, idx, w)
    df = free.dispatch(x, idx, w)
    sent = float(sum(c for r, c in enumerate(d.handle.send_counts) if r != rank) * hidden * 2)
    return g, x, idx, w, synced, d, free, df, sent


def merge(per_rank: list[list[dict[str, Any]]], world: int) -> list[Any]:
    """One Record per (bench, provider, shape): medians over PEs of each PE's median; GB/s from bytes."""
    from lck_runtime.benchmarking import Record

    out = []
    for i, first in enumerate(per_rank[0]):
        recs = [r[i] for r in per_rank]
        rec = Record(first["bench"], first["provider"], "fwd", first["shape"], "bfloat16")
        errors = [r.get("error") for r in recs if r.get("error")]
        if errors:
            rec.error = errors[0]
            out.append(rec)
            continue
        for key in ("median_ms", "p20_ms", "p80_ms"):
            setattr(rec, key, statistics.median(r["summary"][key] for r in recs))
        rec.extra["world"] = world
        rec.extra["per_rank_median_ms"] = [r["summary"]["median_ms"] for r in recs]
        for key in ("host_ms", "loop_ms"):
            vals = [r.get(key) for r in recs if r.get(key) is not None]
            if vals:
                rec.extra[key] = statistics.median(vals)
        sent = statistics.median(r["bytes"] for r in recs)
        rec.extra["sent_mb_per_rank"] = sent / 1e6
        if rec.median_ms:
            rec.extra["gb_per_s"] = sent / (rec.median_ms * 1e-3) / 1e9
        if rec.extra.get("loop_ms"):
            rec.extra["loop_gb_per_s"] = sent / (rec.extra["loop_ms"] * 1e-3) / 1e9
        out.append(rec)
    # Each kernel row against the peer copy of the same bytes on the same shape.
    floor = {r.shape: r.extra.get("gb_per_s") for r in out if r.provider == "copy_peer"}
    for r in out:
        if r.provider.startswith("lck_nvshmem") and floor.get(r.shape) and r.extra.get("gb_per_s"):
            r.extra["of_copy_peer"] = r.extra["gb_per_s"] / floor[r.shape]
    return out


def main_native(args: Any) -> int:
    """Run ``bench_rank`` on ``args.pes`` PEs and write ``<gpu>-pes<N>-<date>-ep-native.{json,csv,png}``."""
    import datetime as _dt
    import sys
    import time

    import torch

    from lck_runtime.benchmarking import bar_plot, gpu_slug, write_results
    from lck_runtime.testing import run_workers

    if not torch.cuda.is_available() or not 2 <= args.pes <= 64:
        print("lck bench ep --pes N: needs a CUDA GPU and 2 <= N <= 64", file=sys.stderr)
        return 2
    env = pes_env(args.pes)
    iters = args.iters or (10 if args.quick else 30)
    t0 = time.monotonic()
    per_rank = run_workers(
        bench_rank,
        args.pes,
        iters,
        not args.no_reference,
        backend="gloo",
        timeout=3000,
        env=env,
    )
    records = merge(per_rank, args.pes)
    slug = gpu_slug()
    stem = f"{slug}-pes{args.pes}-{_dt.date.today().isoformat()}-ep-native"
    paths = write_results(
        records,
        args.out,
        stem,
        meta={
            "pes": args.pes,
            "gpus": torch.cuda.device_count(),
            "iters": iters,
            "shapes": SHAPES,
            "seconds": round(time.monotonic() - t0, 1),
            "env": {k: v for k, v in env.items() if k.startswith(("EP_", "NVSHMEM_", "CUDA_"))},
        },
        plot=lambda recs, path: bar_plot(
            [r for r in recs if r.error is None and not r.provider.startswith("lck_reference")],
            path,
            title=f"lck-ep native backend, {args.pes} PEs on {torch.cuda.device_count()} x {slug}",
        ),
    )
    print_records(records)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0 if not any(r.error for r in records) else 1


def profile_setup(shape: tuple[str, int, int, int, int], rank: int) -> tuple[Any, ...]:
    """A profiling PE's start (``benchmarks/native_*_profile.py``): its GPU, a native MoE context sized for
    ``shape``, then :func:`dispatch_shape`'s result. Collective."""
    import torch

    import lck_runtime as L

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    _, tokens, hidden, k, e = shape
    if not L.configure(moe=L.MoEConfig(max_tokens=tokens, hidden_size=hidden, num_experts=e, top_k=k)):
        raise RuntimeError("the native runtime did not come up (NVSHMEM unavailable)")
    return dispatch_shape(shape, rank, dev)


def profile_main(
    argv: list[str] | None,
    doc: str,
    worker: Any,
    kind: str,
    shape: tuple[str, int, int, int, int],
    section: Any,
    *,
    pes: int,
    iters: int,
) -> int:
    """A native profile script's ``main`` (``benchmarks/native_*_profile.py``): ``--out``, ``--pes`` and
    ``--iters`` (defaults ``pes``, ``iters``), ``worker(rank, world, iters)`` on every PE, then rank 0's
    records (``{name: record}``), each as the lines ``section(name, record)`` gives, under a header, into
    ``<out>/native-<kind>-profile-<gpu>-pes<N>-<date>-<commit>.txt``."""
    import argparse
    import datetime as _dt
    import os
    from pathlib import Path

    from lck_runtime.benchmarking import gpu_slug
    from lck_runtime.testing import run_workers

    title = doc.splitlines()[0]
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pes", type=int, default=pes)
    p.add_argument("--iters", type=int, default=iters)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    per_rank = run_workers(worker, args.pes, args.iters, backend="gloo", timeout=600, env=pes_env(args.pes))
    commit = os.environ.get("LCK_COMMIT", "unknown")[:7]
    date = _dt.date.today().isoformat()
    path = args.out / f"native-{kind}-profile-{gpu_slug()}-pes{args.pes}-{date}-{commit}.txt"
    lines = [
        f"# {title}",
        f"# commit {commit}, {args.pes} PEs, {shape}, {args.iters} calls per kind, rank 0",
        "",
    ]
    for name, rec in per_rank[0].items():
        lines += [*section(name, rec), ""]
    path.write_text("\n".join(lines))
    print("\n".join(lines)[:20000])
    print("wrote", path)
    return 0


def pes_env(pes: int) -> dict[str, str]:
    """The environment of ``pes`` benchmark PEs: NVSHMEM on one host, modules loaded eagerly, output
    unbuffered; PEs share GPUs under MPS where fewer than ``pes`` are visible."""
    import torch

    from lck_runtime.testing import SINGLE_HOST_NVSHMEM_ENV, shared_gpu_env

    env = {**SINGLE_HOST_NVSHMEM_ENV, "CUDA_MODULE_LOADING": "EAGER", "PYTHONUNBUFFERED": "1"}
    if torch.cuda.device_count() < pes:
        env.update(shared_gpu_env(pes, torch.cuda.device_count()))
    return env


def print_records(
    records: list[Any], provider_width: int = 34, shape_width: int = 36, of_copy: bool = True
) -> None:
    """The results table: per row bench, provider, shape, GPU / host / loop ms and GB/s, and with
    ``of_copy`` the fraction of the peer copy's rate; the error instead for a row that failed."""
    pw, sw = provider_width, shape_width
    head = (
        f"{'bench':<18}{'provider':<{pw}}{'shape':<{sw}}{'GPU ms':>9}{'host ms':>9}{'loop ms':>9}{'GB/s':>8}"
    )
    print(head + (f"{'of copy':>9}" if of_copy else ""))
    for r in records:
        if r.error:
            print(f"{r.bench:<18}{r.provider:<{pw}}{r.shape:<{sw}}  {r.error}")
            continue
        e = r.extra
        host = f"{e['host_ms']:9.3f}" if e.get("host_ms") is not None else f"{'':>9}"
        loop = f"{e['loop_ms']:9.3f}" if e.get("loop_ms") is not None else f"{'':>9}"
        frac = f"{e['of_copy_peer']:9.2f}" if e.get("of_copy_peer") is not None else f"{'':>9}"
        print(
            f"{r.bench:<18}{r.provider:<{pw}}{r.shape:<{sw}}{r.median_ms:9.3f}{host}{loop}"
            f"{e.get('gb_per_s', 0):8.1f}{frac if of_copy else ''}"
        )
