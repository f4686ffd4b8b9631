"""Argument checks of :class:`lck_ep.MoEExperts`: construction and ``forward``.

Each raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (shape, device, range, a group or
Buffer that does not fit) naming the argument, what was expected and what was given, prefixed by
``MoEExperts:`` or ``MoEExperts.forward:``. O(1) work (attribute reads), except the range check of
``topk_idx`` on CPU tensors (on CUDA the no-communication path asserts the range on the device, so
that no host synchronisation is needed; the Buffer path's dispatch checks it on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int64, torch.int32)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_int(where: str, name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{where}: {name} must be >= {low}, got {value}")
    return value


def check_group(where: str, group: Any) -> tuple[int, int]:
    """(rank, size) of ``group``; (0, 1) for None."""
    if group is None:
        return 0, 1
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{where}: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(f"{where}: group was given but torch.distributed is not initialised")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{where}: group does not contain this process (global rank {dist.get_rank()})")
    return rank, dist.get_world_size(group)


def check_buffer(where: str, buffer: Any, group: Any, num_experts: int, hidden_size: int) -> None:
    from lck_ep.buffer import Buffer

    if not isinstance(buffer, Buffer):
        raise TypeError(f"{where}: buffer must be an lck_ep.Buffer or None, got {type(buffer).__name__}")
    if buffer.num_experts != num_experts:
        raise ValueError(
            f"{where}: buffer was built for num_experts={buffer.num_experts}, but num_experts={num_experts}"
        )
    if buffer.hidden != hidden_size:
        raise ValueError(
            f"{where}: buffer was built for hidden={buffer.hidden}, but hidden_size={hidden_size}"
        )
    if group is not None and group is not buffer.group:
        same = dist.get_process_group_ranks(group) == dist.get_process_group_ranks(buffer.group)
        if not same:
            raise ValueError(
                f"{where}: group (ranks {dist.get_process_group_ranks(group)}) is not the buffer's group "
                f"(ranks {dist.get_process_group_ranks(buffer.group)}); pass one of them, or the same group"
            )


def check_dtype(where: str, dtype: Any) -> torch.dtype:
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{where}: dtype must be bfloat16, float16 or float32 (or None), got {dtype!r}")
    return dtype


def check_device(where: str, device: Any, buffer: Any, group: Any) -> torch.device:
    if device is None:
        if buffer is not None:
            return buffer.device
        if group is not None and dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{where}: device={device!r} is not a device") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device must be cpu or cuda, got {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if buffer is not None and (
        dev.type != buffer.device.type or (dev.index or 0) != (buffer.device.index or 0)
    ):
        raise ValueError(f"{where}: device={dev} differs from the buffer's device {buffer.device}")
    return dev


def check_alignment(where: str, dtype: torch.dtype, device: torch.device, hidden: int, ffn: int) -> None:
    """bf16 on CUDA runs torch._grouped_mm, whose operands need leading strides of whole 16-byte units."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        for name, v in (("hidden_size", hidden), ("ffn_hidden_size", ffn)):
            if v % 8:
                raise ValueError(
                    f"{where}: {name}={v} must be a multiple of 8 for bf16 on CUDA (torch._grouped_mm needs "
                    f"row strides of whole 16-byte units)"
                )


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (t.device.index or 0) == (device.index or 0)


def check_forward(
    x: Any, topk_idx: Any, topk_weights: Any, *, hidden: int, num_experts: int, dtype: torch.dtype,
    device: torch.device,
) -> None:  # fmt: skip
    """Shapes, dtypes and devices of ``forward``'s arguments (see :meth:`MoEExperts.forward`)."""
    where = "MoEExperts.forward"
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{where}: x must have the weights' dtype {_name(dtype)}, got {_name(x.dtype)}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{where}: x must have shape [tokens, {hidden}] (hidden_size), got {list(x.shape)}")
    if topk_idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{where}: topk_idx must be int64 or int32, got {_name(topk_idx.dtype)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.shape[1] < 1:
        raise ValueError(
            f"{where}: topk_idx must have shape [{x.shape[0]}, k] (x's tokens, k >= 1), got {list(topk_idx.shape)}"
        )
    if topk_weights.dtype not in WEIGHT_DTYPES:
        raise TypeError(
            f"{where}: topk_weights must be float32, bfloat16 or float16, got {_name(topk_weights.dtype)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise ValueError(
            f"{where}: topk_weights must have topk_idx's shape {list(topk_idx.shape)}, got {list(topk_weights.shape)}"
        )
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not _same_device(t, device):
            raise ValueError(f"{where}: {name} must be on the weights' device {device}, got {t.device}")
    if topk_idx.device.type == "cpu" and topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"{where}: topk_idx has entry {bad} outside [-1, {num_experts}) (expected -1 or a global expert index)"
            )
