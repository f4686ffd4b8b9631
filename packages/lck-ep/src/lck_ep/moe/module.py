"""``lck_ep.MoEExperts``: this rank's experts of an expert-parallel MoE layer, as one ``nn.Module``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lck_ep.moe import checks
from lck_ep.moe.function import MoEFunction, Plan

__all__ = ["MoEExperts"]


class MoEExperts(nn.Module):
    """The experts ``[r·E/W, (r+1)·E/W)`` of rank ``r`` of a ``W``-rank expert-parallel group.

    ``forward(x, topk_idx, topk_weights)`` returns, for every token t of this rank,
    ``y[t] = sum_k w[t,k] · (silu(x[t] W1_e[:, :F]) ⊙ (x[t] W1_e[:, F:])) W2_e`` with ``e = topk_idx[t,k]``
    (slots with -1 add nothing), in ``x``'s dtype. The router stays the caller's.

    Args:
        num_experts: ``E``, experts over the whole group (a multiple of the group size).
        hidden_size: ``H``, the token width.
        ffn_hidden_size: ``F``, each expert's intermediate width.
        group: the expert-parallel ``ProcessGroup``; ``None`` or a group of one rank runs without
            communication (tokens are sorted into the expert-major layout locally).
        buffer: an :class:`lck_ep.Buffer` over the group to move tokens through (always used when given,
            even on one rank). Without it, a group of several ranks gets one built at the first forward
            (collective) with ``max_tokens_per_rank`` (else the runtime's ``MoEConfig.max_tokens`` for the
            group, else the largest token count of that first call over the group) and the call's top-k.
        dtype: of the weights and of ``x`` (bf16, fp16 or fp32; default ``torch.get_default_dtype()``).
        device: of the weights; default the buffer's, ``cuda:<current>`` for an NCCL group, else ``cpu``.
        expert_alignment: pad each expert's segment of the expert-major layout to a multiple of this many
            rows (1..4096; torch's grouped GEMM needs none, so 1 wastes no compute).
        max_tokens_per_rank: capacity of a Buffer built here (see ``buffer``).

    Parameters: ``weight1`` ``[E/W, H, 2F]`` (gate columns ``[0, F)``, up columns ``[F, 2F)``) and
    ``weight2`` ``[E/W, F, H]``. Construction is local (not collective); arguments are validated with
    errors naming them.

    Retained forwards: when the runtime has an MoE context for the group (``lck_runtime.configure(moe=
    MoEConfig(..., max_inflight=n))``), each forward that needs a backward keeps its state on that
    context's stack: a forward beyond ``max_inflight`` raises ``RuntimeError`` before it runs anything,
    backwards must run in LIFO order (one out of order raises and pops nothing), and a graph dropped
    without its backward keeps its entry. Without a context, autograd saves the state as usual.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        group: dist.ProcessGroup | None = None,
        buffer: Any = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        expert_alignment: int = 1,
        max_tokens_per_rank: int | None = None,
    ) -> None:
        super().__init__()
        where = "MoEExperts"
        checks.check_int(where, "num_experts", num_experts)
        checks.check_int(where, "hidden_size", hidden_size)
        checks.check_int(where, "ffn_hidden_size", ffn_hidden_size)
        checks.check_int(where, "expert_alignment", expert_alignment)
        if expert_alignment > 4096:
            raise ValueError(f"{where}: expert_alignment must be in [1, 4096], got {expert_alignment}")
        if max_tokens_per_rank is not None:
            checks.check_int(where, "max_tokens_per_rank", max_tokens_per_rank)
        if buffer is not None:
            checks.check_buffer(where, buffer, group, num_experts, hidden_size)
            group = buffer.group
        rank, world = checks.check_group(where, group)
        if num_experts % world:
            raise ValueError(
                f"{where}: num_experts={num_experts} must be a multiple of the group size {world} "
                f"(each rank hosts num_experts / group size experts)"
            )
        dtype = checks.check_dtype(where, dtype)
        dev = checks.check_device(where, device, buffer, group)
        checks.check_alignment(where, dtype, dev, hidden_size, ffn_hidden_size)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.group = group
        self.rank, self.world_size = rank, world
        self.num_local_experts = num_experts // world
        self.expert_alignment = expert_alignment
        self.max_tokens_per_rank = max_tokens_per_rank
        self.buffer = buffer
        self._weights_buffer: Any = None
        big_l = self.num_local_experts
        self.weight1 = nn.Parameter(
            torch.empty(big_l, hidden_size, 2 * ffn_hidden_size, dtype=dtype, device=dev)
        )
        self.weight2 = nn.Parameter(torch.empty(big_l, ffn_hidden_size, hidden_size, dtype=dtype, device=dev))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``±1/sqrt(fan_in)`` per expert (``nn.Linear``'s default bound)."""
        with torch.no_grad():
            self.weight1.uniform_(-1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
            self.weight2.uniform_(-1 / math.sqrt(self.ffn_hidden_size), 1 / math.sqrt(self.ffn_hidden_size))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.num_local_experts} (rank {self.rank}/{self.world_size}), "
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"path={'local' if self._local else 'buffer'}, expert_alignment={self.expert_alignment}"
        )

    @property
    def _local(self) -> bool:
        return self.buffer is None and self.world_size == 1

    # ------------------------------------------------------------------ the runtime's context

    def _context(self) -> Any:
        if self.buffer is not None:
            ctx = getattr(self.buffer, "moe_context", None)
            return ctx if ctx is not None and ctx.alive else None
        if self.group is None:
            return None
        try:
            from lck_runtime.contexts import moe_context
        except ImportError:
            return None
        try:
            ctx = moe_context(self.group, required=False)
        except (ValueError, RuntimeError):  # a group the runtime does not know: no context
            return None
        return ctx if ctx is not None and ctx.alive else None

    # ------------------------------------------------------------------ Buffers (collective, built once)

    def _ensure_buffer(self, num_tokens: int, num_topk: int) -> Any:
        if self.buffer is not None:
            return self.buffer
        from lck_ep.buffer import Buffer

        cap = self.max_tokens_per_rank
        if cap is None:
            ctx = self._context()
            cap = ctx.config.max_tokens if ctx is not None else None
        if cap is None:
            dev = self.weight1.device
            t = torch.tensor([max(num_tokens, 1)], dtype=torch.int64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            cap = int(t.item())
        self.buffer = Buffer(
            self.group, cap, self.hidden_size, num_topk, self.num_experts, device=self.weight1.device
        )
        return self.buffer

    def _routing_weights_buffer(self) -> Any:
        """A Buffer of width ``K`` over the same group that brings the routing weights' gradient home."""
        if self._weights_buffer is None:
            from lck_ep.buffer import Buffer

            b = self.buffer
            self._weights_buffer = Buffer(
                b.group, b.max_tokens_per_rank, b.num_topk, b.num_topk, b.num_experts,
                sync_free=b.sync_free, device=b.device,
            )  # fmt: skip
        return self._weights_buffer

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` in the weights' dtype; ``topk_idx`` ``[T, K]`` int64/int32 global expert ids in
        ``[0, E)`` or -1; ``topk_weights`` ``[T, K]`` float32/bf16/fp16. Returns ``[T, H]`` in ``x.dtype``.

        Gradients flow to ``x``, ``weight1``, ``weight2`` and ``topk_weights``. With communication this is
        collective over the group (every rank calls it, in the same order); the Buffer agrees on its own
        arguments across ranks, while the checks here (dtypes against the weights, shapes) are local.
        """
        w1, w2 = self.weight1, self.weight2
        checks.check_forward(
            x, topk_idx, topk_weights, hidden=self.hidden_size, num_experts=self.num_experts, dtype=w1.dtype,
            device=w1.device,
        )  # fmt: skip
        retain = torch.is_grad_enabled() and (
            x.requires_grad or topk_weights.requires_grad or w1.requires_grad or w2.requires_grad
        )
        context = self._context() if retain else None
        if context is not None and context.inflight >= context.max_inflight:
            from lck_ep.moe.function import check_room

            check_room(context)  # before a Buffer is built or anything is dispatched
        buf = None if self._local else self._ensure_buffer(x.shape[0], topk_idx.shape[1])
        plan = Plan(
            num_experts=self.num_experts,
            alignment=self.expert_alignment,
            buffer=buf,
            weights_buffer=self._routing_weights_buffer,
            context=context,
            retain=retain,
        )
        return MoEFunction.apply(x, topk_weights, w1, w2, topk_idx, plan)
