"""The dispatch layout of one rank's routing: which ranks and experts each token goes to.

``topk_idx`` ``[num_tokens, num_topk]`` int64 holds global expert indices, ``-1`` for "no expert".
Experts are placed contiguously: rank ``r`` of ``R`` hosts experts ``[r * E/R, (r + 1) * E/R)``. The
layout is

- ``num_tokens_per_rank`` ``[R]`` int32: tokens that must travel to each rank. A token goes once to
  each rank hosting any of its experts, however many of its slots point there;
- ``num_tokens_per_expert`` ``[E]`` int32: (token, slot) entries selecting each expert (a token that
  names an expert in two slots counts twice; ``torch.topk`` routings never do);
- ``is_token_in_rank`` ``[num_tokens, R]`` bool.

Entries outside ``[-1, E)`` are ignored like ``-1`` by both implementations below, so they agree on any
input; :class:`lck_ep.Buffer` rejects such entries where it can check them without a host sync.

Two implementations give bit-identical results: :func:`layout_reference` in plain torch (any device,
no host synchronisation) and the JIT-compiled CUDA kernel (:func:`layout_kernel`, built by :mod:`lck_ep.jit`), which
:func:`get_dispatch_layout` picks for CUDA tensors when asked to.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lck_ep import jit
from lck_ep.codegen import LAYOUT_BLOCK_THREADS
from lck_ep.knobs import EpKnobs

__all__ = ["DispatchLayout", "check_layout_args", "get_dispatch_layout", "layout_kernel", "layout_reference"]


class DispatchLayout(NamedTuple):
    num_tokens_per_rank: torch.Tensor  # [R] int32
    num_tokens_per_expert: torch.Tensor  # [E] int32
    is_token_in_rank: torch.Tensor  # [num_tokens, R] bool


def check_layout_args(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, *, where: str) -> None:
    """Validate the arguments of a layout computation (types, shape, dtype, placement of experts)."""
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"{where}: topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"{where}: topk_idx must be int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2:
        raise ValueError(
            f"{where}: topk_idx must be 2-D [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.shape[1] < 1:
        raise ValueError(
            f"{where}: topk_idx must have at least one column, got shape {tuple(topk_idx.shape)}"
        )
    if not topk_idx.is_contiguous():
        raise ValueError(f"{where}: topk_idx must be contiguous, got strides {topk_idx.stride()}")
    for name, v in (("num_experts", num_experts), ("num_ranks", num_ranks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {name} must be a positive int, got {v!r}")
    if num_experts % num_ranks:
        raise ValueError(
            f"{where}: num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks}) "
            "so that experts are placed contiguously, the same number per rank"
        )


def layout_reference(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> DispatchLayout:
    """The layout in plain torch ops, on ``topk_idx``'s device, without a host synchronisation."""
    check_layout_args(topk_idx, num_experts, num_ranks, where="layout_reference")
    num_tokens = topk_idx.shape[0]
    dev = topk_idx.device
    per_rank_experts = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    # Ignored entries land in one extra bin (expert E, rank R) that is cut off at the end.
    expert = torch.where(valid, topk_idx, torch.full_like(topk_idx, num_experts))
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    per_expert.scatter_add_(0, expert.reshape(-1), torch.ones(expert.numel(), dtype=torch.int64, device=dev))
    rank = torch.div(expert, per_rank_experts, rounding_mode="floor")
    in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=dev)
    in_rank.scatter_(1, rank, True)
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    return DispatchLayout(
        num_tokens_per_rank=is_token_in_rank.sum(0, dtype=torch.int32),
        num_tokens_per_expert=per_expert[:num_experts].to(torch.int32),
        is_token_in_rank=is_token_in_rank,
    )


def get_dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    *,
    use_kernel: bool = False,
    knobs: EpKnobs | None = None,
) -> DispatchLayout:
    """The layout of ``topk_idx``; with ``use_kernel`` (CUDA tensors only) through the JIT kernel, built under
    ``knobs`` (default: the ``EP_*`` environment variables, read on every call; a :class:`lck_ep.Buffer` passes
    those it read when it was made).

    Not collective. Raises ``ValueError``/``TypeError`` naming the argument for a bad ``topk_idx``,
    ``num_experts`` or ``num_ranks``, and ``ValueError`` for ``use_kernel`` on a CPU tensor.
    """
    check_layout_args(topk_idx, num_experts, num_ranks, where="get_dispatch_layout")
    if use_kernel:
        if topk_idx.device.type != "cuda":
            raise ValueError(
                f"get_dispatch_layout: use_kernel=True needs a CUDA topk_idx, got device {topk_idx.device}"
            )
        return _run_layout_kernel(topk_idx, num_experts, num_ranks, knobs)
    return layout_reference(topk_idx, num_experts, num_ranks)


def layout_kernel(topk_idx: Any, num_experts: int, num_ranks: int) -> Any:
    """The dispatch layout of ``topk_idx`` (CUDA, int64 ``[T, K]``) computed by the JIT layout kernel.

    Same contract and result as :func:`lck_ep.layout.layout_reference`; runs on the current stream
    without a host synchronisation (CUDA-graph safe once the kernel is loaded).
    """
    check_layout_args(topk_idx, num_experts, num_ranks, where="layout_kernel")
    if topk_idx.device.type != "cuda":
        raise ValueError(f"layout_kernel: topk_idx must be a CUDA tensor, got device {topk_idx.device}")
    return _run_layout_kernel(topk_idx, num_experts, num_ranks, None)


def _run_layout_kernel(topk_idx: Any, num_experts: int, num_ranks: int, knobs: EpKnobs | None) -> Any:
    # The arguments are checked (check_layout_args, a CUDA tensor); the knobs and the problem are checked here.
    num_tokens, num_topk = topk_idx.shape
    knobs = jit.check_layout_problem(
        num_experts=num_experts, num_ranks=num_ranks, num_topk=num_topk, knobs=knobs
    )
    dev = topk_idx.device
    # One zeroed allocation for both counters (one host call fewer): the kernel adds into them.
    counts = torch.zeros(num_ranks + num_experts, dtype=torch.int32, device=dev)
    per_rank, per_expert = counts[:num_ranks], counts[num_ranks:]
    mask = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=dev)
    if num_tokens == 0:
        return DispatchLayout(per_rank, per_expert, mask)
    bits = knobs.topk_idx_bits
    idx = topk_idx
    if bits != 64:
        # A narrower index type: map ignored entries to -1 first so the cast cannot wrap one of them
        # into a valid expert index.
        keep = (topk_idx >= -1) & (topk_idx < num_experts)
        idx = torch.where(keep, topk_idx, -1).to(getattr(torch, jit.TOPK_DTYPES[bits]))
    device_index = dev.index if dev.index is not None else torch.cuda.current_device()
    # Bound to device_index: it runs there, on that device's current stream, whichever device is current.
    launch = jit.layout_launcher(device_index, knobs, 4 * (num_experts + num_ranks))
    blocks = max(
        1,
        min(
            (num_tokens + LAYOUT_BLOCK_THREADS - 1) // LAYOUT_BLOCK_THREADS,
            4 * jit.num_sms(device_index),
        ),
    )
    launch(
        blocks,
        [
            idx.data_ptr(),
            num_tokens,
            num_topk,
            num_experts,
            num_ranks,
            per_rank.data_ptr(),
            per_expert.data_ptr(),
            mask.data_ptr(),
        ],
    )
    return DispatchLayout(per_rank, per_expert, mask)
