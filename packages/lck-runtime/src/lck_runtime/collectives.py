"""The FLSCE context's in-place all-reduce: NVSHMEM team reduction when native, torch.distributed otherwise.

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

__all__ = ["all_reduce_", "check_all_reduce_args"]

_OPS = ("sum", "max")
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


def all_reduce_(ctx: Any, t: Any, op: str) -> Any:
    """Reduce ``t`` (contiguous float32 on the configured device) over ``ctx.group`` in place; returns ``t``.

    Collective over the context's group: every member calls it with the same shape and ``op``
    (``"sum"`` or ``"max"``), in the same order relative to its other collectives on that group.
    """
    check_all_reduce_args(ctx, t, op)
    if ctx.size == 1 or t.numel() == 0:
        return t
    if ctx.native:
        _nvshmem_all_reduce(ctx, t, op)
    else:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=ctx.group)
    return t


def _nvshmem_all_reduce(ctx: Any, t: Any, op: str) -> None:
    import torch
    from nvshmem import bindings

    fn = bindings.float_sum_reduce_on_stream if op == "sum" else bindings.float_max_reduce_on_stream
    scratch = ctx.scratch
    half = scratch.numel() // 2
    src, dst = scratch[:half], scratch[half : 2 * half]
    stream = torch.cuda.current_stream(t.device)
    capturing = torch.cuda.is_current_stream_capturing()
    last_stream, last_event = _last_use
    if not capturing and last_event is not None and last_stream != stream:
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
    if not capturing:
        event = torch.cuda.Event()
        event.record(stream)
        _last_use[0], _last_use[1] = stream, event
