"""The FLSCE context's in-place all-reduce: NVLink one-shot or NVSHMEM team reduction when native,
torch.distributed otherwise.

One-shot path (:mod:`lck_runtime.p2p`, ``algorithm="p2p"``): one kernel per receive-slot-sized chunk
pushes the tensor to the other members' symmetric receive areas and reduces there in member order (the
same bits on every member); bounded waits, NaN instead of a hang. ``"auto"`` takes it when the context
has one (single-host teams of two or more on the NVSHMEM path), the stream is not being captured (its
epochs are host counters, which a replayed graph would repeat) and ``p2p.auto_takes`` says so (any size
for two members; up to the low-latency sizes for more).

Inside CUDA-graph capture the all-reduce takes NCCL (``"auto"`` or ``"torch"`` on an NCCL group); forcing
``"nvshmem"``, or ``"auto"``/``"torch"`` on a group of another backend, raises ``ValueError`` before anything
is captured. The NVSHMEM path below goes through a scratch that every context of the process shares, ordered
across streams by host-side events that a replayed graph cannot keep, and a live graph holding NVSHMEM
team reductions keeps ``finalize()`` from returning (two H200s: no return within 60 s while such a graph
lived, 0.8 s once it was destroyed).

NVSHMEM path: the tensor goes through the shared symmetric scratch in chunks of half its length
(first half source, second half destination: NVSHMEM's reduction algorithms are not all safe in
place), one ``nvshmemx_float_<op>_reduce_on_stream`` per chunk on the current stream, then back.
OpenSHMEM semantics make this safe across ranks: on return from a team reduction the caller's source
may be reused and its destination is final, so the next chunk (or another team's reduction through
the same scratch) cannot overwrite data a peer still reads. Within this process the scratch is shared
by every FLSCE context, so a call on a different stream first waits for the previous call's work.

The validation is local (no agreement per call: this is an execution path). The checks depend only
on shapes and dtypes, which SPMD code keeps equal across the group.
"""

from __future__ import annotations

from typing import Any

from lck_runtime import p2p

__all__ = ["ALGORITHMS", "all_reduce_", "check_all_reduce_args", "reduces_on_host", "torch_all_reduce_"]

_OPS = ("sum", "max")
ALGORITHMS = ("auto", "p2p", "nvshmem", "torch")
# Where the previous native all-reduce left the shared scratch: (stream, event).
_last_use: list[Any] = [None, None]


def check_all_reduce_args(ctx: Any, t: Any, op: Any) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``t`` or ``op`` unless the call is well formed."""
    import torch

    if not isinstance(op, str) or op not in _OPS:
        raise ValueError(f"all_reduce_: op must be one of {_OPS}, got {op!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"all_reduce_: t must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"all_reduce_: t must be float32, got {t.dtype}")
    if t.device != ctx.device:
        raise ValueError(
            f"all_reduce_: t must be on {ctx.device} (the device lck_runtime.configure was given), got {t.device}"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"all_reduce_: t must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}"
        )
    if t.numel() > ctx.capacity:
        cfg = ctx.config
        raise ValueError(
            f"all_reduce_: t has {t.numel()} elements, more than the context's capacity {ctx.capacity} "
            f"(FusedLinearCrossEntropyConfig max_tokens={cfg.max_tokens} * max(hidden_size={cfg.hidden_size}, 8))"
        )


def all_reduce_(ctx: Any, t: Any, op: str, *, algorithm: str = "auto") -> Any:
    """Reduce ``t`` (contiguous float32 on the configured device) over ``ctx.group`` in place; returns ``t``.

    Collective over the context's group: every member calls it with the same shape, ``op`` (``"sum"`` or
    ``"max"``) and ``algorithm``, in the same order relative to its other collectives on that group.
    ``algorithm``: ``"auto"`` (default), or one path forced: ``"p2p"`` (the one-shot NVLink exchange),
    ``"nvshmem"`` (NVSHMEM's team reduction) or ``"torch"`` (``torch.distributed.all_reduce``); forcing a
    path the context does not have raises ``ValueError``. Inside CUDA-graph capture only NCCL is taken
    (see the module doc).
    """
    check_all_reduce_args(ctx, t, op)
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce_: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    from lck_runtime.capture import capturing as _capturing

    capturing = _capturing(t.device)
    if algorithm == "p2p" and (ctx._p2p is None or capturing):
        why = "it is being captured into a CUDA graph" if ctx._p2p is not None else _no_p2p_reason(ctx)
        raise ValueError(f"all_reduce_: algorithm 'p2p' is not available: {why}")
    if algorithm == "nvshmem" and not ctx.native:
        raise ValueError(
            "all_reduce_: algorithm 'nvshmem' needs the NVSHMEM path (lck_runtime.configure returned False)"
        )
    if capturing and algorithm == "nvshmem":
        raise ValueError(
            "all_reduce_: algorithm 'nvshmem' cannot be captured into a CUDA graph (a live graph holding "
            "NVSHMEM's team reduction keeps finalize() from returning): inside capture use 'auto' or 'torch' (NCCL)"
        )
    if ctx.size == 1 or t.numel() == 0:
        return t
    if capturing:
        if not _nccl(ctx):  # "auto" or "torch": both take torch.distributed, which captures only NCCL
            import torch.distributed as dist

            raise ValueError(
                f"all_reduce_: inside CUDA-graph capture the all-reduce takes NCCL, but the group's backend is "
                f"{dist.get_backend(ctx.group)}"
            )
        path = "torch"
    elif algorithm == "auto":
        one_shot = ctx._p2p is not None and p2p.auto_takes(ctx.size, t.numel())
        path = "p2p" if one_shot else "nvshmem" if ctx.native else "torch"
    else:
        path = algorithm
    if path == "p2p":
        ctx._p2p(t, op)
    elif path == "nvshmem":
        _nvshmem_all_reduce(ctx, t, op)
    else:
        torch_all_reduce_(t, op, ctx.group)
    return t


def reduces_on_host(group: Any) -> bool:
    """Whether ``group`` reduces CUDA tensors on the host: gloo is its only backend (no NCCL for CUDA)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    return "gloo" in backend and "nccl" not in backend


def torch_all_reduce_(t: Any, op: str, group: Any) -> Any:
    """``torch.distributed.all_reduce`` of ``t`` (``op`` "sum" or "max") over ``group`` in place; returns ``t``.

    A CUDA tensor on a group that reduces on the host (:func:`reduces_on_host`) is copied to the host,
    reduced there and copied back on the current stream: what gloo does anyway, without its CUDA path's
    own streams and events, and without the context that path opens on GPU 0 for a rank whose GPU is
    another one (measured on two H200s).
    """
    import torch.distributed as dist

    red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    if t.is_cuda and reduces_on_host(group):
        host = t.cpu()
        dist.all_reduce(host, op=red, group=group)
        t.copy_(host)
    else:
        dist.all_reduce(t, op=red, group=group)
    return t


def _nccl(ctx: Any) -> bool:
    import torch.distributed as dist

    return "nccl" in str(dist.get_backend(ctx.group)).lower()


def _no_p2p_reason(ctx: Any) -> str:
    if not ctx.native:
        return "the context runs over torch.distributed (lck_runtime.configure returned False)"
    if ctx.size == 1:
        return "the group has one member"
    return "the team spans hosts or a rank had no NVLink peer view (see configure's warning)"


def _nvshmem_all_reduce(ctx: Any, t: Any, op: str) -> None:
    import torch
    from nvshmem import bindings

    fn = bindings.float_sum_reduce_on_stream if op == "sum" else bindings.float_max_reduce_on_stream
    scratch = ctx.scratch
    half = scratch.numel() // 2
    src, dst = scratch[:half], scratch[half : 2 * half]
    stream = torch.cuda.current_stream(t.device)
    last_stream, last_event = _last_use  # never inside capture (all_reduce_ takes NCCL there)
    if last_event is not None and last_stream != stream:
        stream.wait_event(last_event)
    flat = t.view(-1)
    n = flat.numel()
    team = ctx.team
    for off in range(0, n, half):
        m = min(half, n - off)
        src[:m].copy_(flat[off : off + m])
        rc = fn(team, dst.data_ptr(), src.data_ptr(), m, stream.cuda_stream)
        if rc:
            raise RuntimeError(
                f"all_reduce_: NVSHMEM float_{op}_reduce_on_stream on team {team} returned {rc}"
            )
        flat[off : off + m].copy_(dst[:m])
    event = torch.cuda.Event()
    event.record(stream)
    _last_use[0], _last_use[1] = stream, event
