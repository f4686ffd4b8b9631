"""The data movement of :class:`lck_ep.Buffer` calls on the native backend (:mod:`lck_ep.native`).

The same outputs and handles as :mod:`lck_ep._exchange` builds over the reference backend, bit for bit.
The layout is the same kernel; the send slots are :func:`lck_ep.reference.send_slots` computed by a kernel;
each row is stored once in its sender's symmetric workspace and read by every destination straight into
its output (pulled; the hybrid state's senders push rows into the destinations' workspaces instead), laid
out by the receiver compact or (``expand=True``) expert-major with the expanded maps computed on the device;
combine reduces an expanded handle's rows with a kernel and sums the partials on the source, both in
the reference order; a compact handle's partials written where ``Buffer.combine_input`` put them are read
there by their sources, not copied (zero-copy).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lck_ep._construction import EARLY_RECEIVE_BYTES
from lck_ep._exchange import Dispatched, expanded_fields, fresh_handle
from lck_ep.buffer_view import BufferView
from lck_ep.checks import CombinePlan, DispatchPlan
from lck_ep.expanded import ExpandedMaps, expanded_capacity
from lck_ep.handle import DispatchHandle
from lck_ep.host_copy import to_device
from lck_ep.layout import DispatchLayout
from lck_ep.native import NativeEp, OutgoingPartials, OutgoingRows, expanded_tables

__all__ = [
    "EARLY_RECEIVE_BYTES",
    "Received",
    "combine",
    "dispatch",
    "receive",
    "receive_early",
    "receives_early",
    "replay",
    "send",
]


def _receive(buf: BufferView, rows: int, meta: bool, weights: bool) -> dict[str, Any]:
    """The receiving kernel's outputs; the int64 ones are views of one allocation (fewer host calls)."""
    dev, w, k = buf.device, buf.num_ranks, buf.num_topk
    cap = buf.worst_case_tokens
    sizes = [w, w + 1, 1] + ([rows, rows * k, rows, cap] if meta else [])
    ints = torch.empty(sum(sizes), dtype=torch.int64, device=dev).split(sizes)
    out: dict[str, Any] = {"recv_counts": ints[0], "recv_starts": ints[1], "num_recv": ints[2]}
    if meta:
        out["recv_src_idx"] = ints[3]
        out["recv_topk_idx"] = ints[4].view(rows, k)
        out["recv_topk_weights"] = torch.empty(rows, k, dtype=torch.float32, device=dev) if weights else None
        out["recv_src_rank"] = ints[5]
        out["slot_pos"] = ints[6]
    return out


def _row_bytes(x: torch.Tensor) -> int:
    return x.shape[1] * x.element_size()


def send(buf: BufferView, plan: DispatchPlan, layout: DispatchLayout) -> torch.Tensor:
    """The sending half of a fresh dispatch: the send slots (returned) and the sender, which need no counts, so
    that a synced dispatch enqueues them before the host reads its agreement's table."""
    with torch.cuda.device(buf.device):
        return _send(buf, plan, layout)


def _send(buf: BufferView, plan: DispatchPlan, layout: DispatchLayout) -> torch.Tensor:
    """:func:`send` on the Buffer's device, which the caller made current."""
    st: NativeEp = buf._native
    st.raise_if_failed()
    st.armed = None  # the staged rows overwrite a zero-copy input handed out before
    mask = layout.is_token_in_rank
    slots = st.send_slots(mask)
    sent = OutgoingRows(plan.x, mask, slots, layout.num_tokens_per_rank, plan.topk_idx, plan.topk_weights)
    st.send_rows(sent, buf.num_local_experts, buf.num_sms, buf.timeout_ns)
    return slots


class Received(NamedTuple):
    """The receiving half of a fresh dispatch as launched: the receiver's outputs, ``recv_x`` and the expanded
    layout's fields, for ``rows`` received rows at most; ``slots`` are the send slots."""

    out: dict[str, Any]
    recv_x: torch.Tensor
    fields: dict[str, Any]
    slots: torch.Tensor
    rows: int


def receives_early(buf: BufferView, plan: DispatchPlan) -> bool:
    """Whether a synced dispatch of ``plan`` launches its receiving half before the host reads its counts:
    compact (the expanded layout at capacity is K times larger) and small, so that its outputs sized for the
    most rows any rank may receive (``W * max_tokens_per_rank``) stay within the Buffer's
    ``early_receive_bytes`` (default :data:`EARLY_RECEIVE_BYTES`).
    Such calls are bound by latency, which the host's read between the halves would dominate. The same on
    every rank (the Buffer's shape and the agreed arguments)."""
    if plan.expand:
        return False
    # recv_x, then per row the routing (K int64 experts, K float32 weights), source index and rank, slot
    row = _row_bytes(plan.x) + plan.num_topk * 12 + 16
    return buf.worst_case_tokens * row <= buf.early_receive_bytes


def receive_early(buf: BufferView, plan: DispatchPlan, layout: DispatchLayout) -> Received:
    """The whole of a synced dispatch (:func:`receives_early`) launched before its counts are read: the
    kernels of a sync-free dispatch with outputs for ``W * max_tokens_per_rank`` rows, which no rank can
    exceed (each source sends at most ``max_tokens_per_rank`` rows to each rank); :func:`dispatch` then
    narrows them to the agreed counts."""
    return receive(buf, plan, layout, buf.worst_case_tokens, None, per_expert=False)


def receive(
    buf: BufferView,
    plan: DispatchPlan,
    layout: DispatchLayout,
    rows: int,
    m: int | None,
    per_expert: bool,
    slots: torch.Tensor | None = None,
) -> Received:
    """Launch the receiving half of a fresh dispatch (and its sending half first unless ``slots`` says
    :func:`send` did) for outputs of ``rows`` received rows and ``m`` expanded rows (``expand=True``);
    ``per_expert``: count every received entry per local expert on the device (sync-free)."""
    st: NativeEp = buf._native
    big_l, dev = buf.num_local_experts, buf.device
    with torch.cuda.device(dev):  # entered once: a sync-free dispatch sends here too
        if slots is None:
            slots = _send(buf, plan, layout)
        out = _receive(buf, rows, True, plan.topk_weights is not None)
        # Entries per local expert: every received row's (sync-free), the kept rows' (expanded maps); the
        # receiver's first launch zeroes them.
        hist = torch.empty(2 * big_l, dtype=torch.int32, device=dev) if per_expert or plan.expand else None
        out["per_expert"] = hist[:big_l] if hist is not None and per_expert else None
        out["kept_per_expert"] = hist[big_l:] if hist is not None and plan.expand else None
        st.receive(
            row_bytes=_row_bytes(plan.x), rows=rows, num_topk=plan.num_topk, has_meta=True,
            num_local_experts=big_l, cap=buf.max_tokens_per_rank, out=out, num_sms=buf.num_sms,
            timeout_ns=buf.timeout_ns,
        )  # fmt: skip
        fields: dict[str, Any] = {}
        if plan.expand:
            assert m is not None
            recv_x, fields = _expand(st, buf, plan.x, out, rows, m, plan.expert_alignment)
        else:
            recv_x = torch.empty(rows, plan.x.shape[1], dtype=plan.x.dtype, device=dev)
            st.copy_rows(plan.x, out["recv_starts"], None, recv_x, buf.num_sms, src_idx=out["recv_src_idx"])
    return Received(out, recv_x, fields, slots, rows)


def dispatch(
    buf: BufferView,
    plan: DispatchPlan,
    layout: DispatchLayout,
    counts: tuple[list[int], list[int], list[int]] | None,
    slots: torch.Tensor | None = None,
    received: Received | None = None,
    most_expanded: int | None = None,
) -> Dispatched:
    """A fresh dispatch; ``counts`` = (send, receive, per local expert) in synced mode, None sync-free;
    ``slots``: :func:`send` already launched the sending half and returned these (else it is launched here);
    ``received``: :func:`receive_early` already launched both halves (synced), whose outputs are narrowed
    here to the received count; ``most_expanded``: a synced expanded dispatch's most expanded rows on any
    rank (the handle's ``most_expanded_rows``)."""
    assert plan.topk_idx is not None
    dev = buf.device
    rows = sum(counts[1]) if counts is not None else plan.num_worst_tokens
    if received is None:
        a = plan.expert_alignment
        if counts is not None:
            m = sum((c + a - 1) // a * a for c in counts[2])
        else:
            m = expanded_capacity(rows, plan.num_topk, buf.num_local_experts, a)
        received = receive(buf, plan, layout, rows, m, counts is None, slots)
    out, recv_x, fields, slots = received.out, received.recv_x, received.fields, received.slots
    if received.rows != rows:  # launched at capacity (receive_early): the rows past the count are padding
        recv_x = recv_x[:rows]
        for name in ("recv_src_idx", "recv_topk_idx", "recv_topk_weights", "recv_src_rank"):
            if out[name] is not None:
                out[name] = out[name][:rows]
    if counts is not None:
        send_counts, recv, per_local = counts
        mode: dict[str, Any] = dict(
            send_counts=tuple(send_counts),
            recv_counts=tuple(recv),
            num_recv_tokens=rows,
            num_recv_tokens_per_expert=to_device(per_local, torch.int32, dev),
            num_recv_tokens_per_expert_list=per_local,
            most_expanded_rows=most_expanded,
        )
    else:
        mode = dict(
            send_counts=None,
            recv_counts=None,
            num_recv_tokens=out["num_recv"].reshape(()),
            num_recv_tokens_per_expert=out["per_expert"],
            num_recv_tokens_per_expert_list=None,
        )
    mode.update(
        sync_free=counts is None,
        num_worst_tokens=None if counts is not None else rows,
        send_token_idx=None,
        send_slot=slots,
        num_recv_rows=rows,
        recv_slot_pos=out["slot_pos"],
        backend="nvshmem",
        recv_counts_device=out["recv_counts"],
        recv_starts=out["recv_starts"],
    )
    received_rows = (out["recv_src_rank"], out["recv_src_idx"], out["recv_topk_idx"])
    handle = fresh_handle(buf, plan, layout, received_rows, fields, mode)
    return recv_x, out["recv_topk_idx"], out["recv_topk_weights"], handle


def _expand(
    st: NativeEp, buf: BufferView, x: torch.Tensor, out: dict[str, Any], rows: int, m: int, alignment: int
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The expanded rows and maps of a fresh dispatch, computed and written by the kernels."""
    dev, big_l, k = buf.device, buf.num_local_experts, buf.num_topk
    offsets = torch.empty(big_l + 1, dtype=torch.int64, device=dev)
    src_row = torch.empty(m, dtype=torch.int64, device=dev)
    slot = torch.empty(m, dtype=torch.int64, device=dev)
    index = torch.empty(rows, k, dtype=torch.int64, device=dev)
    st.expand_maps(out["recv_topk_idx"], out["kept_per_expert"], alignment, offsets, src_row, slot, index)
    recv_x = torch.empty(m, x.shape[1], dtype=x.dtype, device=dev)
    st.copy_rows(
        x, out["recv_starts"], src_row, recv_x, buf.num_sms, rows_end=offsets[big_l:], index=index,
        src_idx=out["recv_src_idx"],
    )  # fmt: skip
    maps = ExpandedMaps(
        counts=out["kept_per_expert"], offsets=offsets, src_row=src_row, slot=slot, index=index
    )
    return recv_x, expanded_fields(maps, m)


def replay(buf: BufferView, h: DispatchHandle, x: torch.Tensor) -> torch.Tensor:
    """``recv_x`` of a handle's dispatch replayed for new rows ``x`` (rows only, same slots; an expanded
    handle's rows go straight to their expanded places)."""
    st: NativeEp = buf._native
    st.raise_if_failed()
    st.armed = None
    with torch.cuda.device(buf.device):
        sent = OutgoingRows(x, h.is_token_in_rank, h.send_slot, h.num_tokens_per_rank, None, None)
        st.send_rows(sent, buf.num_local_experts, buf.num_sms, buf.timeout_ns)
        out = _receive(buf, h.num_recv_rows, False, False)
        st.receive(
            row_bytes=_row_bytes(x), rows=h.num_recv_rows, num_topk=h.num_topk, has_meta=False,
            num_local_experts=buf.num_local_experts, cap=buf.max_tokens_per_rank, out=out,
            num_sms=buf.num_sms, timeout_ns=buf.timeout_ns,
        )  # fmt: skip
        src_row = h.expanded_src_row if h.expand else None
        m = h.expanded_src_row.shape[0] if h.expanded_src_row is not None and h.expand else h.num_recv_rows
        recv_x = torch.empty(m, x.shape[1], dtype=x.dtype, device=buf.device)
        end = h.expert_offsets[-1:] if h.expand and h.expert_offsets is not None else None
        index = h.recv_expanded_index if src_row is not None else None
        idx = h.recv_src_idx
        st.copy_rows(
            x, out["recv_starts"], src_row, recv_x, buf.num_sms, rows_end=end, index=index, src_idx=idx
        )
    return recv_x


def combine(buf: BufferView, plan: CombinePlan) -> torch.Tensor:
    """``combined_x``: expanded rows reduced per received row (in the reference's order) and sent home, in one
    kernel on the native state (a reduction kernel, then the hybrid pair's sender, on the hybrid one), then the
    partials summed there in the reference order."""
    st: NativeEp = buf._native
    st.raise_if_failed()
    h = plan.handle
    in_place = st.takes_in_place(plan.x, h)  # a zero-copy input (Buffer.combine_input): read where it is
    st.armed = None
    with torch.cuda.device(buf.device):
        index = h.recv_expanded_index if h.expand else None
        assert index is not None or not h.expand
        if index is None or in_place:
            partial = plan.x.contiguous()
        else:
            partial = torch.empty(index.shape[0], plan.x.shape[1], dtype=plan.x.dtype, device=buf.device)
        sent = OutgoingPartials(partial, h.recv_counts_device, h.recv_starts)
        expanded = None
        w = plan.topk_weights.contiguous() if plan.topk_weights is not None else None
        # A zero-copy input stays where it is: the receiver's waiting launch publishes where its rows are (and
        # an expanded handle's maps, copied beside them, which its sources reduce the rows with).
        if index is None and not in_place:
            st.send_partials(sent, buf.num_sms, buf.timeout_ns)
        elif index is not None and in_place:
            row = plan.x.shape[1] * plan.x.element_size()
            tables = expanded_tables(h.most_expanded_rows, row, buf.worst_case_tokens, h.num_topk)
            st.publish_expanded_maps(index, w, tables)
            expanded = (tables, index.shape[0], h.num_topk, w is not None)
        elif index is not None:
            if st.fuses_expanded_combine:  # reduced into the sources' regions, own rows into partial
                st.send_expanded_partials(plan.x.contiguous(), index, w, sent, buf.num_sms, buf.timeout_ns)
            else:
                used = h.num_recv_tokens if h.sync_free else None  # a 0-d int64 device tensor
                st.reduce_expanded(plan.x.contiguous(), index, w, partial, rows_used=used)
                st.send_partials(sent, buf.num_sms, buf.timeout_ns)
        out = torch.empty(h.num_tokens, buf.hidden, dtype=partial.dtype, device=buf.device)
        st.reduce_partials(
            partial,
            h.recv_starts,
            out,
            h.is_token_in_rank,
            h.send_slot,
            plan.bias,
            buf.num_sms,
            buf.timeout_ns,
            pull=in_place,
            expanded=expanded,
        )
    return out
