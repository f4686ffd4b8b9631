"""Local argument checks of :class:`lck_ep.Buffer` calls, run before any state is touched.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (shape, device, stride, range,
capacity, a handle that does not fit) with a message that names the argument, what was expected and
what was given, prefixed by the operation (``dispatch:``/``combine:``). The result is a plan: the
call's parameters in the form the cross-rank agreement digests (:mod:`lck_ep.agreement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lck_ep.agreement import dtype_code
from lck_ep.buffer_view import BufferView
from lck_ep.fp8 import FP8_BLOCK, FP8_DTYPE
from lck_ep.handle import DispatchHandle

__all__ = ["CombinePlan", "DispatchPlan", "check_combine", "check_dispatch", "check_tensor"]

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index == device.index


def check_tensor(
    t: Any,
    name: str,
    *,
    where: str,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
    device: torch.device,
) -> torch.Tensor:
    """``t`` is a contiguous tensor of one of ``dtypes``, on ``device``, with ``shape`` (None = any)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{where}: {name} must be {want}, got {str(t.dtype).replace('torch.', '')}")
    if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{where}: {name} must have shape {want}, got {list(t.shape)}")
    if not _same_device(t, device):
        raise ValueError(f"{where}: {name} must be on {device} (the Buffer's device), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous, got strides {t.stride()}")
    return t


def _check_int(v: Any, name: str, *, where: str, low: int, high: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(v).__name__}")
    if v < low or (high is not None and v > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{where}: {name} must be {rng}, got {v}")
    return v


def check_handle(buffer: BufferView, handle: Any, *, where: str) -> DispatchHandle:
    if not isinstance(handle, DispatchHandle):
        raise TypeError(
            f"{where}: handle must be a DispatchHandle from Buffer.dispatch, got {type(handle).__name__}"
        )
    if handle.buffer_uid != buffer.uid:
        raise ValueError(
            f"{where}: handle comes from another Buffer (its uid {handle.buffer_uid}, this Buffer's {buffer.uid}); "
            "a handle is only valid on the Buffer whose dispatch returned it"
        )
    return handle


@dataclass(frozen=True)
class DispatchPlan:
    x: torch.Tensor
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    handle: DispatchHandle | None
    num_tokens: int
    num_topk: int
    expand: bool
    expert_alignment: int
    num_worst_tokens: int  # 0 = synced
    x_scales: torch.Tensor | None = None  # FP8 rows: the float32 scales beside x (float8_e4m3fn)

    @property
    def sync_free(self) -> bool:
        return self.num_worst_tokens > 0

    def digest(self) -> list[int]:
        return [
            1,
            self.x.shape[1],
            dtype_code(self.x.dtype),
            self.num_topk,
            int(self.handle is not None),
            self.handle.seq if self.handle is not None else -1,
            int(self.expand),
            self.expert_alignment,
            self.num_worst_tokens,
            int(self.topk_weights is not None),
            0,
        ]


def check_dispatch(
    buffer: BufferView,
    x: Any,
    topk_idx: Any,
    topk_weights: Any,
    handle: Any,
    expand: Any,
    expert_alignment: Any,
    num_worst_tokens: Any,
) -> DispatchPlan:
    where = "dispatch"
    h, dev = buffer.hidden, buffer.device
    x, scales, dtypes = _split_fp8(x, h, where)
    if handle is not None:
        handle = check_handle(buffer, handle, where=where)
        if topk_idx is not None or topk_weights is not None:
            raise ValueError(
                f"{where}: pass either handle (replay a cached layout) or topk_idx/topk_weights, not both"
            )
        for name, given, have in (
            ("expand", expand, handle.expand),
            ("expert_alignment", expert_alignment, handle.expert_alignment),
            ("num_worst_tokens", num_worst_tokens, handle.num_worst_tokens or 0),
        ):
            if given is not None and given != have:
                raise ValueError(
                    f"{where}: {name}={given!r} contradicts the handle, which was dispatched with "
                    f"{name}={have!r}; leave it out when replaying"
                )
        x = check_tensor(x, "x", where=where, dtypes=dtypes, shape=(handle.num_tokens, h), device=dev)
        scales = _check_scales(scales, handle.num_tokens, h, where, dev)
        return DispatchPlan(
            x=x,
            topk_idx=None,
            topk_weights=None,
            handle=handle,
            num_tokens=handle.num_tokens,
            num_topk=handle.num_topk,
            expand=handle.expand,
            expert_alignment=handle.expert_alignment,
            num_worst_tokens=handle.num_worst_tokens or 0,
            x_scales=scales,
        )
    if topk_idx is None:
        raise ValueError(f"{where}: topk_idx is required unless a cached handle is given")
    expand = bool(_check_bool(expand, "expand", where=where)) if expand is not None else False
    alignment = (
        1
        if expert_alignment is None
        else _check_int(expert_alignment, "expert_alignment", where=where, low=1, high=4096)
    )
    if alignment != 1 and not expand:
        raise ValueError(
            f"{where}: expert_alignment={alignment} only shapes the expanded layout; pass expand=True or leave it at 1"
        )
    worst = buffer.worst_case_tokens
    if num_worst_tokens is None or num_worst_tokens == 0:
        nwt = worst if buffer.sync_free else 0
    else:
        nwt = _check_int(num_worst_tokens, "num_worst_tokens", where=where, low=1, high=worst)
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{where}: x must be a torch.Tensor, got {type(x).__name__} (FP8 rows go as an (x_fp8, x_scales) pair)"
        )
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be 2-D [num_tokens, hidden], got shape {list(x.shape)}")
    if x.shape[1] != h:
        raise ValueError(f"{where}: x has hidden size {x.shape[1]} but the Buffer was built for hidden={h}")
    n = x.shape[0]
    if n > buffer.max_tokens_per_rank:
        raise ValueError(
            f"{where}: x has {n} tokens, more than the Buffer's max_tokens_per_rank={buffer.max_tokens_per_rank}"
        )
    x = check_tensor(x, "x", where=where, dtypes=dtypes, shape=(n, h), device=dev)
    scales = _check_scales(scales, n, h, where, dev)
    topk_idx = check_tensor(
        topk_idx, "topk_idx", where=where, dtypes=(torch.int64,), shape=(n, buffer.num_topk), device=dev
    )
    if topk_weights is not None:
        topk_weights = check_tensor(
            topk_weights,
            "topk_weights",
            where=where,
            dtypes=(torch.float32,),
            shape=(n, buffer.num_topk),
            device=dev,
        )
    return DispatchPlan(
        x=x,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        handle=None,
        num_tokens=n,
        num_topk=buffer.num_topk,
        expand=expand,
        expert_alignment=alignment,
        num_worst_tokens=nwt,
        x_scales=scales,
    )


def _split_fp8(x: Any, h: int, where: str) -> tuple[Any, Any, tuple[torch.dtype, ...]]:
    """``(x, scales or None, accepted dtypes of x)``: an ``(x_fp8, x_scales)`` pair is FP8 rows."""
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        return x, None, X_DTYPES  # anything but a pair is checked (and refused) as a plain tensor
    if h % FP8_BLOCK:
        raise ValueError(
            f"{where}: FP8 rows carry one scale per {FP8_BLOCK} channels, so hidden must be a multiple of "
            f"{FP8_BLOCK}; the Buffer's hidden is {h}"
        )
    return x[0], x[1], (FP8_DTYPE,)


def _check_scales(scales: Any, n: int, h: int, where: str, dev: torch.device) -> torch.Tensor | None:
    if scales is None:
        return None
    return check_tensor(
        scales, "x_scales", where=where, dtypes=(torch.float32,), shape=(n, h // FP8_BLOCK), device=dev
    )


def _check_bool(v: Any, name: str, *, where: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {type(v).__name__}")
    return v


@dataclass(frozen=True)
class CombinePlan:
    x: torch.Tensor
    handle: DispatchHandle
    topk_weights: torch.Tensor | None
    bias: tuple[torch.Tensor, ...]

    def digest(self) -> list[int]:
        return [
            2,
            self.x.shape[1],
            dtype_code(self.x.dtype),
            self.handle.num_topk,
            1,
            self.handle.seq,
            int(self.handle.expand),
            self.handle.expert_alignment,
            self.handle.num_worst_tokens or 0,
            int(self.topk_weights is not None),
            len(self.bias),
        ]


def check_combine(buffer: BufferView, x: Any, handle: Any, topk_weights: Any, bias: Any) -> CombinePlan:
    where = "combine"
    dev, h = buffer.device, buffer.hidden
    handle = check_handle(buffer, handle, where=where)
    rows = handle.num_rows_in
    what = "expanded rows (the handle is expanded)" if handle.expand else "received rows"
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] != rows:
        raise ValueError(f"{where}: x must have one row per {what}: expected {rows} rows, got {x.shape[0]}")
    x = check_tensor(x, "x", where=where, dtypes=X_DTYPES, shape=(rows, h), device=dev)
    if topk_weights is not None:
        if not handle.expand:
            raise ValueError(
                f"{where}: topk_weights weighs expanded rows (one per (token, slot)); this handle is not "
                "expanded, so weight each received row before combine or dispatch with expand=True"
            )
        topk_weights = check_tensor(
            topk_weights,
            "topk_weights",
            where=where,
            dtypes=(torch.float32,),
            shape=(handle.num_recv_rows, handle.num_topk),
            device=dev,
        )
    if bias is None:
        biases: tuple[torch.Tensor, ...] = ()
    elif isinstance(bias, torch.Tensor):
        biases = (bias,)
    elif isinstance(bias, (tuple, list)) and len(bias) in (1, 2):
        biases = tuple(bias)
    else:
        raise TypeError(
            f"{where}: bias must be None, a tensor or a tuple of two tensors, got {type(bias).__name__}"
        )
    for i, b in enumerate(biases):
        check_tensor(
            b,
            f"bias[{i}]" if len(biases) > 1 else "bias",
            where=where,
            dtypes=(x.dtype,),
            shape=(handle.num_tokens, h),
            device=dev,
        )
    return CombinePlan(x=x, handle=handle, topk_weights=topk_weights, bias=biases)
