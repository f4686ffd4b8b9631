"""Forward and backward of the MoE experts layer as one ``torch.autograd.Function``.

Forward, for this rank's ``L`` experts:

1. rows into the expert-major layout, one per (token, slot) whose expert is here: a local sort by expert
   (:mod:`lck_ep.moe.permute`), or ``Buffer.dispatch(..., expand=True, expert_alignment=a)``;
2. ``h = x_e @ W1[j]`` per expert segment (grouped GEMM, :mod:`lck_ep.moe.grouped`);
3. ``act = w * silu(h[:, :F]) * h[:, F:]`` with each row's routing weight ``w`` (one Triton kernel);
4. ``y_e = act @ W2[j]`` (grouped GEMM);
5. back to tokens: ``out[t] = sum over k ascending of y_e[row of (t, k)]`` in float32, cast once (locally,
   or ``Buffer.combine`` without weights, whose documented order is the same on one rank and adds the
   ranks' partials in rank order), so results are reproducible bit for bit.

Where the Triton forward serves the operands (``grouped.forward_tiles``), steps 2 and 3 are one kernel
(the activation is its epilogue; it writes ``h`` only when a backward will need it) and step 4 is lck's
grouped GEMM. On the local path with no backward to follow, that kernel also does step 1's gather, reading
each row from the tokens as it needs it: no gathered copy is written.

Backward runs the same steps in reverse: the combine's backward is a dispatch of the output gradient with
the cached handle, the dispatch's backward a combine of the rows' input gradients. The routing weights'
gradient ``dw[row] = sum_j dact[row, j] * silu(g) * u`` comes out of the activation's backward kernel; on
the Buffer path it travels back to the token's rank through a second Buffer of width ``K`` (the main
Buffer combines rows of ``hidden`` values only).

Retained tensors: on the runtime's retained-forward stack of the group's MoE context when one is
configured (checked for room before anything runs; popped in LIFO order, an out-of-order backward is
refused and pops nothing), else saved through ``ctx.save_for_backward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lck_ep.moe import grouped, launch
from lck_ep.moe.permute import build_local_layout


@dataclass
class Plan:
    """What one forward call needs besides tensors (built by the module per call)."""

    num_experts: int  # experts this rank sees in topk_idx: all E on the local path, E on the Buffer path
    alignment: int
    buffer: Any = None  # lck_ep.Buffer or None (local path)
    weights_buffer: Any = None  # callable returning the K-wide Buffer for the routing-weight gradient
    context: Any = None  # the runtime's MoEContext holding retained forwards, or None
    retain: bool = True  # False when no backward can follow (grad mode off, nothing requires grad)


@dataclass(eq=False)
class Retained:
    """One forward's state awaiting its backward (identity matters: the stack pops by identity)."""

    tensors: tuple[torch.Tensor, ...]
    handle: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


def check_room(context: Any) -> None:
    """Refuse a forward before it launches anything when the context's stack is full."""
    if context is not None and context.inflight >= context.max_inflight:
        raise RuntimeError(
            f"MoEExperts.forward: the retained-forward stack of {context!r} holds max_inflight="
            f"{context.max_inflight} forward(s) awaiting backward; raise MoEConfig.max_inflight to count every "
            "MoE layer and microbatch in flight at once (nothing was run)"
        )


def _expanded_weights(recv_w: torch.Tensor, src_row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``w[m] = recv_w[src_row[m], slot[m]]`` (0 on padding rows) for the Buffer's expanded rows."""
    k = recv_w.shape[1]
    entry = src_row * k + slot
    flat = recv_w.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(src_row.shape[0], dtype=torch.float32, device=recv_w.device)
    return torch.where(src_row >= 0, flat.index_select(0, entry.clamp(min=0)), 0.0)


def _per_slot(dw_rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[t, k] = dw_rows[index[t, k]]`` float32, 0 where ``index`` is -1."""
    if dw_rows.numel() == 0:
        return torch.zeros(index.shape, dtype=torch.float32, device=index.device)
    picked = dw_rows.index_select(0, index.reshape(-1).clamp(min=0)).reshape(index.shape)
    return torch.where(index >= 0, picked, 0.0)


def _experts_fwd(
    x_e: torch.Tensor,
    w_e: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    tiles: grouped.Tiles | None,
    keep_h: bool,
    y_out: Any = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(h [M, 2F], y_e [M, H])``; ``act`` is not kept (the backward kernel writes it again), nor ``h``
    on the Triton forward when no backward follows (``keep_h`` false). ``y_out``: a callable giving the
    ``[M, H]`` tensor the Triton forward's second GEMM writes ``y_e`` into (the Buffer's zero-copy
    combine input), called only where that GEMM runs."""
    if tiles is not None and grouped.tma_rows(x_e):
        h, act = grouped.gemm_swiglu(x_e, w_e, w1, ends, tiles, keep_h)
        return h, grouped.mm_tiled(act, w2, ends, tiles, out=y_out() if y_out is not None else None)
    h = grouped.mm(x_e, w1, ends)
    act = launch.swiglu_weighted_fwd(h, w_e, ends)
    return h, grouped.mm(act, w2, ends)


def _experts_bwd(
    x_e: torch.Tensor,
    h: torch.Tensor,
    w_e: torch.Tensor,
    dy_e: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    need: tuple[bool, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx_e [M, H], dw_rows [M] float32, dw1 [L, H, 2F], dw2 [L, F, H])``, freeing each intermediate
    as soon as its last GEMM has been enqueued; a weight gradient that ``need`` (autograd's
    ``needs_input_grad``) does not ask for is not computed (frozen experts)."""
    dact = grouped.mm(dy_e, w2.transpose(1, 2), ends)
    dh, dw_rows, act = launch.swiglu_weighted_bwd(h, w_e, dact, ends)
    del dact
    dw2 = grouped.mm_weight_grad(act, dy_e, ends) if need[3] else None
    del act
    dx_e = grouped.mm(dh, w1.transpose(1, 2), ends)
    dw1 = grouped.mm_weight_grad(x_e, dh, ends) if need[2] else None
    return dx_e, dw_rows, dw1, dw2


class MoEFunction(torch.autograd.Function):
    """``apply(x, topk_weights, weight1, weight2, topk_idx, plan)`` → ``[T, H]``; inputs checked by the module."""

    @staticmethod
    def forward(ctx, x, topk_weights, w1, w2, topk_idx, plan: Plan):  # type: ignore[override]
        check_room(plan.context if plan.retain else None)
        k = topk_idx.shape[1]
        idx = topk_idx.to(torch.int64)
        tw = topk_weights.to(torch.float32).contiguous()
        buf = plan.buffer
        x = x.contiguous()
        tiles = grouped.forward_tiles(x, w1, w2)
        if buf is None:
            # On CUDA the layout asserts on the device that every id is in [-1, E) (no host read).
            layout = build_local_layout(idx, plan.num_experts, plan.alignment)
            handle = None
            if tiles is not None and not plan.retain:
                # No backward follows, so nothing needs the gathered rows: the first GEMM reads them from x.
                act = grouped.gemm_swiglu_gather(x, layout.entry, tw.reshape(-1), k, w1, layout.ends, tiles)
                y_e = grouped.mm_tiled(act, w2, layout.ends, tiles)
                del act
                saved = ()
            else:
                x_e, w_e = launch.gather_rows(x, layout.entry, k, tw.reshape(-1))
                assert w_e is not None
                h, y_e = _experts_fwd(x_e, w_e, w1, w2, layout.ends, tiles, plan.retain)
                saved = (x_e, h, w_e, layout.ends, layout.entry, layout.index)
            out = launch.reduce_rows(y_e, layout.index)
        else:
            d = buf.dispatch(x, idx.contiguous(), tw, expand=True, expert_alignment=plan.alignment)
            handle = d.handle
            ends = handle.expert_offsets[1:].to(torch.int32)
            w_e = _expanded_weights(d.recv_topk_weights, handle.expanded_src_row, handle.expanded_slot)
            # The second GEMM writes straight into the combine's input: on the native backend the workspace,
            # where the sources read and reduce the rows (zero-copy), else a new tensor as it would allocate.
            y_out = lambda: buf.combine_input(handle, dtype=x.dtype)
            h, y_e = _experts_fwd(d.recv_x, w_e, w1, w2, ends, tiles, plan.retain, y_out)
            out = buf.combine(y_e, handle).combined_x
            saved = (d.recv_x, h, w_e, ends, idx)
        del y_e
        ctx.plan = plan
        ctx.num_topk = k
        ctx.weights_dtype = topk_weights.dtype
        if not plan.retain:
            ctx.entry = None
            ctx.save_for_backward(w1, w2)
        elif plan.context is not None:
            entry = Retained(saved, handle)
            plan.context.push_forward(entry)
            ctx.entry = entry
            ctx.save_for_backward(w1, w2)
        else:
            ctx.entry = Retained((), handle)
            ctx.save_for_backward(w1, w2, *saved)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        plan: Plan = ctx.plan
        entry: Retained | None = ctx.entry
        if entry is None:
            raise RuntimeError("MoEExperts: backward of a forward that ran without gradients")
        if plan.context is not None:
            plan.context.pop_forward(entry)  # refuses (and pops nothing) when not the newest: LIFO only
            w1, w2 = ctx.saved_tensors
            saved = entry.tensors
            entry.tensors = ()  # the stack no longer holds them; free them when this backward ends
        else:
            w1, w2, *saved = ctx.saved_tensors
        dout = dout.contiguous()
        buf = plan.buffer
        if buf is None:
            x_e, h, w_e, ends, entry_rows, index = saved
            dy_e, _ = launch.gather_rows(dout, entry_rows, ctx.num_topk, None)
            dx_e, dw_rows, dw1, dw2 = _experts_bwd(x_e, h, w_e, dy_e, w1, w2, ends, ctx.needs_input_grad)
            dx = launch.reduce_rows(dx_e, index)
            dtw = _per_slot(dw_rows, index) if ctx.needs_input_grad[1] else None
        else:
            x_e, h, w_e, ends, idx = saved
            handle = entry.handle
            dy_e = buf.dispatch(dout, handle=handle).recv_x
            dx_e, dw_rows, dw1, dw2 = _experts_bwd(x_e, h, w_e, dy_e, w1, w2, ends, ctx.needs_input_grad)
            dx = buf.combine(dx_e, handle).combined_x
            dtw = None
            if ctx.needs_input_grad[1]:
                d_recv = _per_slot(dw_rows, handle.recv_expanded_index).contiguous()
                wbuf = plan.weights_buffer()
                # Same routing, so the same received rows in the same order as the main dispatch.
                routed = wbuf.dispatch(torch.zeros(idx.shape, dtype=torch.float32, device=idx.device), idx)
                dtw = wbuf.combine(d_recv, routed.handle).combined_x
        if dtw is not None:
            dtw = dtw.to(ctx.weights_dtype)
        return dx, dtw, dw1, dw2, None, None
