"""The data movement of :class:`lck_ep.Buffer` calls, once their arguments are checked and agreed.

Each function runs the reference backend (:mod:`lck_ep.reference`), lays received rows out expert-major
when the call asks for it (:mod:`lck_ep.expanded`) and, for a fresh dispatch, builds the
:class:`~lck_ep.handle.DispatchHandle` that replays and combines it. The dispatch layout arrives from
the Buffer, which computes it (and, in synced mode, exchanges its counts in the agreement).
"""

from __future__ import annotations

from typing import Any

import torch

from lck_ep import reference
from lck_ep.buffer_view import BufferView
from lck_ep.checks import CombinePlan, DispatchPlan
from lck_ep.expanded import ExpandedMaps, build_expanded, expanded_capacity, gather_expanded, reduce_expanded
from lck_ep.handle import DispatchHandle
from lck_ep.host_copy import to_device
from lck_ep.layout import DispatchLayout

__all__ = [
    "Dispatched",
    "combine",
    "dispatch_sync_free",
    "dispatch_synced",
    "lay_out",
    "maybe_expand",
    "replay_sync_free",
    "replay_synced",
]

# (recv_x, recv_topk_idx, recv_topk_weights, handle) of a fresh dispatch.
Dispatched = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DispatchHandle]


def dispatch_synced(
    buf: BufferView,
    plan: DispatchPlan,
    layout: DispatchLayout,
    send_counts: list[int],
    recv_counts: list[int],
    per_local: list[int],
) -> Dispatched:
    """A fresh synced dispatch with the agreed counts: exact-size outputs, host-known counts."""
    assert plan.topk_idx is not None
    got = reference.dispatch_synced(
        buf._topo,
        plan.x,
        layout=layout,
        send_counts=send_counts,
        recv_counts=recv_counts,
        topk_idx=plan.topk_idx,
        topk_weights=plan.topk_weights,
    )
    assert got.recv_topk_idx is not None and got.recv_src_idx is not None and got.recv_src_rank is not None
    n = sum(recv_counts)
    a = plan.expert_alignment
    recv_x, fields = lay_out(got, plan, buf.num_local_experts, sum((c + a - 1) // a * a for c in per_local))
    mode = dict(
        sync_free=False,
        num_worst_tokens=None,
        send_counts=tuple(send_counts),
        send_token_idx=got.send_token_idx,
        send_slot=None,
        recv_counts=tuple(recv_counts),
        num_recv_tokens=n,
        num_recv_rows=n,
        recv_slot_pos=None,
        num_recv_tokens_per_expert=to_device(per_local, torch.int32, buf.device),
        num_recv_tokens_per_expert_list=per_local,
    )
    handle = fresh_handle(
        buf, plan, layout, (got.recv_src_rank, got.recv_src_idx, got.recv_topk_idx), fields, mode
    )
    return recv_x, got.recv_topk_idx, got.recv_topk_weights, handle


def dispatch_sync_free(buf: BufferView, plan: DispatchPlan, layout: DispatchLayout) -> Dispatched:
    """A fresh sync-free dispatch: capacity-size outputs, counts on the device, no host read."""
    assert plan.topk_idx is not None
    big_l, nwt = buf.num_local_experts, plan.num_worst_tokens
    got = reference.dispatch_sync_free(
        buf._topo,
        plan.x,
        num_worst_tokens=nwt,
        layout=layout,
        topk_idx=plan.topk_idx,
        topk_weights=plan.topk_weights,
    )
    assert got.recv_topk_idx is not None and got.per_expert is not None and got.num_recv_tokens is not None
    recv_x, fields = lay_out(
        got, plan, big_l, expanded_capacity(nwt, plan.num_topk, big_l, plan.expert_alignment)
    )
    mode = dict(
        sync_free=True,
        num_worst_tokens=nwt,
        send_counts=None,
        send_token_idx=None,
        send_slot=got.send_slot,
        recv_counts=None,
        num_recv_tokens=got.num_recv_tokens,
        num_recv_rows=nwt,
        recv_slot_pos=got.recv_slot_pos,
        num_recv_tokens_per_expert=got.per_expert.to(torch.int32),
        num_recv_tokens_per_expert_list=None,
    )
    handle = fresh_handle(
        buf, plan, layout, (got.recv_src_rank, got.recv_src_idx, got.recv_topk_idx), fields, mode
    )
    return recv_x, got.recv_topk_idx, got.recv_topk_weights, handle


def fresh_handle(
    buf: BufferView,
    plan: DispatchPlan,
    layout: DispatchLayout,
    received: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    expanded: dict[str, Any],
    mode: dict[str, Any],
) -> DispatchHandle:
    """The handle of a fresh dispatch: the fields every backend and mode fill alike (``received``: each
    received row's source rank, source token index and routing), then the expanded layout's and the mode's
    own."""
    recv_src_rank, recv_src_idx, recv_topk_idx = received
    return DispatchHandle(
        buffer_uid=buf.uid,
        seq=buf._next_seq(),
        num_tokens=plan.num_tokens,
        num_topk=plan.num_topk,
        hidden=buf.hidden,
        expand=plan.expand,
        expert_alignment=plan.expert_alignment,
        is_token_in_rank=layout.is_token_in_rank,
        num_tokens_per_rank=layout.num_tokens_per_rank,
        num_tokens_per_expert=layout.num_tokens_per_expert,
        recv_src_rank=recv_src_rank,
        recv_src_idx=recv_src_idx,
        recv_topk_idx=recv_topk_idx,
        **expanded,
        **mode,
    )


def replay_synced(topo: reference.Topology, h: DispatchHandle, x: torch.Tensor) -> torch.Tensor:
    """``recv_x`` of a synced handle's dispatch replayed for new rows ``x``; nothing else is exchanged."""
    assert h.send_counts is not None and h.recv_counts is not None
    got = reference.dispatch_synced(
        topo,
        x,
        layout=None,
        send_counts=list(h.send_counts),
        recv_counts=list(h.recv_counts),
        send_token_idx=h.send_token_idx,
    )
    return maybe_expand(got.recv_x, h)


def replay_sync_free(
    topo: reference.Topology, h: DispatchHandle, x: torch.Tensor, num_worst_tokens: int
) -> torch.Tensor:
    """``recv_x`` of a sync-free handle's dispatch replayed for new rows ``x``."""
    got = reference.dispatch_sync_free(
        topo,
        x,
        num_worst_tokens=num_worst_tokens,
        mask=h.is_token_in_rank,
        send_slot=h.send_slot,
        recv_slot_pos=h.recv_slot_pos,
    )
    return maybe_expand(got.recv_x, h)


def combine(topo: reference.Topology, plan: CombinePlan) -> torch.Tensor:
    """``combined_x``: expanded rows reduced per received row (if expanded), then summed on the sources."""
    h = plan.handle
    partial = plan.x
    if h.expand:
        assert h.recv_expanded_index is not None
        partial = reduce_expanded(plan.x, h.recv_expanded_index, plan.topk_weights)
    return reference.combine(
        topo,
        partial,
        num_tokens=h.num_tokens,
        is_token_in_rank=h.is_token_in_rank,
        sync_free=h.sync_free,
        send_counts=h.send_counts,
        recv_counts=h.recv_counts,
        send_token_idx=h.send_token_idx,
        send_slot=h.send_slot,
        recv_slot_pos=h.recv_slot_pos,
        num_worst_tokens=h.num_worst_tokens,
        bias=plan.bias,
    )


def maybe_expand(recv_x: torch.Tensor, h: DispatchHandle) -> torch.Tensor:
    if not h.expand:
        return recv_x
    assert h.expanded_src_row is not None
    return gather_expanded(recv_x, h.expanded_src_row)


def lay_out(
    got: reference.Received, plan: DispatchPlan, num_local: int, rows: int
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``recv_x`` as the caller asked for it and the handle fields of the expanded layout (none if not).

    Expanded: the ``rows`` expert-major rows and the maps back to received rows and slots.
    """
    if not plan.expand:
        return got.recv_x, {}
    assert got.recv_topk_idx is not None
    maps = build_expanded(got.recv_topk_idx, num_local, plan.expert_alignment, rows)
    return gather_expanded(got.recv_x, maps.src_row), expanded_fields(maps, rows)


def expanded_fields(maps: ExpandedMaps, rows: int) -> dict[str, Any]:
    """The handle fields of an expanded layout of ``rows`` rows (either backend's ``maps``)."""
    return dict(
        expert_offsets=maps.offsets,
        expanded_src_row=maps.src_row,
        expanded_slot=maps.slot,
        recv_expanded_index=maps.index,
        num_expanded_rows=rows,
    )
