"""Checks of :class:`lck_ep.Buffer` construction and what they settle.

The group (initialised, a ``ProcessGroup``, this process a member) is checked locally and raises at
once: without it there is nobody to agree with. The device and the other arguments are checked into an
error that the caller passes to the construction agreement (:mod:`lck_ep.agreement`), so every rank
raises the same one. Passing, they settle the dispatch layout (the JIT layout kernel or torch ops) and,
when the runtime has a configured MoE context for the group, its topology.
"""

from __future__ import annotations

import importlib.util
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "MAX_TOPK",
    "Settled",
    "check_args",
    "check_group",
    "kernel_layout_available",
    "resolve_device",
]

BACKENDS = ("auto", "nvshmem", "reference")

MAX_TOPK = 64
_WHERE = "Buffer"


# Buffer(early_receive_bytes=None): a synced compact dispatch whose outputs at the Buffer's capacity take at most
# this many bytes receives before the host reads its counts (lck_ep._native_exchange.receive_early).
EARLY_RECEIVE_BYTES = 16 << 20
_MAX_EARLY_RECEIVE_BYTES = 1 << 50


class Settled(NamedTuple):
    """What a Buffer's arguments decide beyond themselves."""

    use_kernel_layout: bool
    moe_context: Any  # the runtime's MoEContext for the group, or None
    num_hosts: int
    gpus_per_host: int
    backend: str  # "nvshmem" or "reference": what moves the rows
    early_receive_bytes: int  # the argument, None resolved to EARLY_RECEIVE_BYTES


def moe_context(group: dist.ProcessGroup) -> Any:
    """The runtime's configured MoE context for ``group``, or None (not configured / older runtime)."""
    try:
        from lck_runtime import moe_context  # type: ignore[attr-defined]
    except ImportError:
        try:
            from lck_runtime.contexts import moe_context
        except ImportError:
            return None
    return moe_context(group, required=False)


def kernel_layout_available() -> bool:
    """True when the layout kernel can be built here: nvcc found and the runtime JIT importable."""
    from lck_runtime.toolchain import find_nvcc

    return find_nvcc() is not None and importlib.util.find_spec("lck_runtime.jit") is not None


def check_group(group: Any) -> tuple[int, int, str]:
    """``(rank, world size, backend name in lower case)`` of ``group``; raises at once when it is unusable."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{_WHERE}: torch.distributed is not initialised; call init_process_group first")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{_WHERE}: group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{_WHERE}: this process (global rank {dist.get_rank()}) is not a member of group")
    return rank, dist.get_world_size(group), str(dist.get_backend(group)).lower()


def resolve_device(device: Any, backend: str) -> tuple[torch.device, torch.device, BaseException | None]:
    """``(home, device, error)``: the group's own device kind, the Buffer's device and why ``device`` is bad.

    The agreement always runs on ``home``, so that a bad ``device`` argument is reported (the same way on
    every rank) instead of breaking the collective that reports it; a bad one yields ``home`` as the
    device and the error to agree on.
    """
    home = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    error: BaseException | None = None
    try:
        dev = home if device is None else torch.device(device)
    except (TypeError, RuntimeError) as exc:
        dev = home
        error = ValueError(f"{_WHERE}: device={device!r} is not a device: {exc}")
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return home, dev, error


def check_args(
    group: dist.ProcessGroup,
    num_ranks: int,
    device: torch.device,
    backend: str,
    max_tokens: Any,
    hidden: Any,
    num_topk: Any,
    num_experts: Any,
    sync_free: Any,
    layout: Any,
    backend_choice: Any = "reference",
    num_sms: Any = None,
    timeout_s: Any = 5.0,
    early_receive_bytes: Any = None,
) -> Settled:
    """Validate the construction arguments (``TypeError``/``ValueError`` naming the argument)."""
    where = _WHERE
    if early_receive_bytes is None:
        early_receive_bytes = EARLY_RECEIVE_BYTES
    elif (
        isinstance(early_receive_bytes, bool)
        or not isinstance(early_receive_bytes, int)
        or not 0 <= early_receive_bytes <= _MAX_EARLY_RECEIVE_BYTES
    ):
        raise ValueError(
            f"{where}: early_receive_bytes must be None or an int in [0, 2**50], got {early_receive_bytes!r}"
        )
    for name, v in (
        ("max_tokens_per_rank", max_tokens),
        ("hidden", hidden),
        ("num_topk", num_topk),
        ("num_experts", num_experts),
    ):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{where}: {name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {v}")
    if not isinstance(sync_free, bool):
        raise TypeError(f"{where}: sync_free must be a bool, got {type(sync_free).__name__}")
    if backend_choice not in BACKENDS:
        raise ValueError(
            f"{where}: backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend_choice!r}"
        )
    if num_sms is not None and (
        isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 1 <= num_sms <= 1024
    ):
        raise ValueError(f"{where}: num_sms must be None or an int in [1, 1024], got {num_sms!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
        raise ValueError(f"{where}: timeout_s must be a number of seconds in (0, 3600], got {timeout_s!r}")
    if num_topk > min(num_experts, MAX_TOPK):
        raise ValueError(
            f"{where}: num_topk must be at most min(num_experts, {MAX_TOPK}) = {min(num_experts, MAX_TOPK)}, got {num_topk}"
        )
    if num_experts % num_ranks:
        raise ValueError(
            f"{where}: num_experts ({num_experts}) must be a multiple of the group size ({num_ranks}): "
            "experts are placed contiguously, the same number on every rank"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device must be cpu or cuda, got {device}")
    if "nccl" in backend and device.type != "cuda":
        raise ValueError(f"{where}: an NCCL group needs a cuda device, got device={device}")
    ctx = moe_context(group)
    if backend_choice != "reference" and ctx is not None and ctx.native and ctx.num_hosts > 1:
        from lck_ep.hybrid import plan_hybrid

        if ctx.size == num_ranks and ctx.one_machine:  # the channel and signal budget, before anything runs
            plan_hybrid(config=ctx.config, num_ranks=num_ranks, num_sms=num_sms)
    why_not = _native_problem(ctx, device, num_ranks, hidden, num_topk, max_tokens)
    if backend_choice == "nvshmem" and why_not is not None:
        raise ValueError(
            f"{where}: backend='nvshmem' cannot run: {why_not}; use backend='reference' or 'auto'"
        )
    chosen = "nvshmem" if backend_choice != "reference" and why_not is None else "reference"
    if backend == "gloo" and device.type != "cpu" and chosen != "nvshmem":
        raise ValueError(
            f"{where}: a gloo group moves CPU tensors, got device={device} (on the reference backend; "
            "CUDA tensors over gloo need the native one: configure(moe=...) on an NVSHMEM runtime)"
        )
    use_kernel = _choose_layout(layout, device, num_experts, num_ranks, num_topk)
    if ctx is None:
        return Settled(use_kernel, None, 1, num_ranks, chosen, early_receive_bytes)
    cfg = ctx.config
    for name, have, cap in (
        ("max_tokens_per_rank", max_tokens, cfg.max_tokens),
        ("hidden", hidden, cfg.hidden_size),
        ("num_topk", num_topk, cfg.top_k),
    ):
        if have > cap:
            raise ValueError(
                f"{where}: {name}={have} exceeds the configured MoEConfig capacity {cap} of this group"
            )
    if num_experts != cfg.num_experts:
        raise ValueError(
            f"{where}: num_experts={num_experts} differs from the configured MoEConfig.num_experts={cfg.num_experts}"
        )
    if ctx.size != num_ranks:
        raise ValueError(f"{where}: the MoE context has {ctx.size} ranks but group has {num_ranks}")
    return Settled(use_kernel, ctx, int(ctx.num_hosts), int(ctx.gpus_per_host), chosen, early_receive_bytes)


def _native_problem(
    ctx: Any, device: torch.device, num_ranks: int, hidden: int, num_topk: int, max_tokens: int
) -> str | None:
    """Why the native kernels cannot serve a Buffer of this group and shape, or None when they can."""
    if ctx is None:
        return (
            "no MoE context is configured for this group (call lck_runtime.configure(process_groups=..., "
            "moe=MoEConfig(..., group=...)) on every rank first)"
        )
    if not ctx.native:
        return "the group's MoE context runs on the torch.distributed path (NVSHMEM is not available here)"
    if device.type != "cuda":
        return f"the native kernels move CUDA tensors, got device={device}"
    if ctx.num_hosts > 1:  # the hybrid (scale-out) kernels: lck_ep.hybrid
        from lck_ep.hybrid import hybrid_problem

        why = hybrid_problem(
            num_ranks=num_ranks, num_topk=num_topk, config=ctx.config, one_machine=ctx.one_machine
        )
        if why is not None:
            return why
    from lck_runtime.toolchain import find_nvcc

    if find_nvcc() is None:
        return "nvcc was not found, so the native kernels cannot be compiled (install the CUDA toolkit)"
    if ctx.size != num_ranks:
        return f"the MoE context has {ctx.size} ranks but group has {num_ranks}"
    from lck_ep.native import native_problem

    return native_problem(
        hidden=hidden, num_topk=num_topk, num_ranks=num_ranks, max_tokens=max_tokens, config=ctx.config
    )


def _choose_layout(
    layout: Any, device: torch.device, num_experts: int, num_ranks: int, num_topk: int
) -> bool:
    """Whether the dispatch layout comes from the JIT layout kernel (True) or torch ops."""
    where = _WHERE
    if layout not in ("auto", "kernel", "torch"):
        raise ValueError(f"{where}: layout must be 'auto', 'kernel' or 'torch', got {layout!r}")
    if not (layout == "kernel" or (layout == "auto" and device.type == "cuda")):
        return False
    if device.type != "cuda":
        raise ValueError(f"{where}: layout='kernel' needs a cuda device, got {device}")
    available = kernel_layout_available()
    if layout == "kernel" and not available:
        raise ValueError(
            f"{where}: layout='kernel' needs nvcc and lck_runtime.jit; use layout='torch' or install them"
        )
    if not available:
        return False
    from lck_ep.jit import check_layout_problem
    from lck_ep.knobs import KnobError

    # Bad EP_* knob values are refused here, before any rank compiles anything. A problem too large
    # for the kernel's shared-memory counters is an error only when the kernel was asked for; "auto"
    # then uses the torch layout.
    try:
        check_layout_problem(num_experts=num_experts, num_ranks=num_ranks, num_topk=num_topk)
    except KnobError:
        raise
    except ValueError:
        if layout == "kernel":
            raise
        return False
    return True
