"""The data movement of :class:`lck_ep.Buffer` calls on the native backend (:mod:`lck_ep.native`).

The same outputs and handles as :mod:`lck_ep._exchange` builds over the reference backend, bit for bit:
the layout, send slots, the expanded maps and the expanded reduction are the same torch code; only the
rows move differently, stored by the kernels straight into the destination's symmetric workspace and
laid out there by the receiver, and combined on the source in the reference order.
"""

from __future__ import annotations

from typing import Any

import torch

from lck_ep import reference
from lck_ep._exchange import Dispatched, lay_out, maybe_expand
from lck_ep.buffer_view import BufferView
from lck_ep.checks import CombinePlan, DispatchPlan
from lck_ep.expanded import expanded_capacity, reduce_expanded
from lck_ep.handle import DispatchHandle
from lck_ep.layout import DispatchLayout
from lck_ep.native import NativeEp

__all__ = ["combine", "dispatch", "replay"]


def _receive(
    st: NativeEp, buf: BufferView, rows: int, width: int, dtype: torch.dtype, meta: bool, weights: bool
) -> dict[str, Any]:
    dev, w, k = buf.device, buf.num_ranks, buf.num_topk
    out: dict[str, Any] = {
        "recv_x": torch.empty(rows, width, dtype=dtype, device=dev),
        "recv_counts": torch.empty(w, dtype=torch.int64, device=dev),
        "recv_starts": torch.empty(w + 1, dtype=torch.int64, device=dev),
        "num_recv": torch.empty(1, dtype=torch.int64, device=dev),
    }
    if meta:
        out["recv_src_idx"] = torch.empty(rows, dtype=torch.int64, device=dev)
        out["recv_topk_idx"] = torch.empty(rows, k, dtype=torch.int64, device=dev)
        out["recv_topk_weights"] = torch.empty(rows, k, dtype=torch.float32, device=dev) if weights else None
        out["recv_src_rank"] = torch.empty(rows, dtype=torch.int64, device=dev)
        out["slot_pos"] = torch.empty(w * buf.max_tokens_per_rank, dtype=torch.int64, device=dev)
    return out


def dispatch(
    buf: BufferView,
    plan: DispatchPlan,
    layout: DispatchLayout,
    counts: tuple[list[int], list[int], list[int]] | None,
) -> Dispatched:
    """A fresh dispatch; ``counts`` = (send, receive, per local expert) in synced mode, None sync-free."""
    assert plan.topk_idx is not None
    st: NativeEp = buf._native
    st.raise_if_failed()
    big_l, dev = buf.num_local_experts, buf.device
    mask = layout.is_token_in_rank
    slots = reference.send_slots(mask)
    rows = sum(counts[1]) if counts is not None else plan.num_worst_tokens
    with torch.cuda.device(dev):
        st.send_rows(
            plan.x, mask, slots, layout.num_tokens_per_rank, plan.topk_idx, plan.topk_weights, big_l,
            buf.num_sms, buf.timeout_ns,
        )  # fmt: skip
        out = _receive(st, buf, rows, plan.x.shape[1], plan.x.dtype, True, plan.topk_weights is not None)
        out["per_expert"] = torch.zeros(big_l, dtype=torch.int64, device=dev) if counts is None else None
        st.receive_rows(
            plan.x, num_topk=plan.num_topk, has_meta=True, num_local_experts=big_l,
            cap=buf.max_tokens_per_rank, out=out, num_sms=buf.num_sms, timeout_ns=buf.timeout_ns,
        )  # fmt: skip
    got = reference.Received(
        recv_x=out["recv_x"],
        recv_topk_idx=out["recv_topk_idx"],
        recv_topk_weights=out["recv_topk_weights"],
        recv_src_idx=out["recv_src_idx"],
        recv_src_rank=out["recv_src_rank"],
    )
    a = plan.expert_alignment
    if counts is not None:
        send, recv, per_local = counts
        m = sum((c + a - 1) // a * a for c in per_local)
        mode: dict[str, Any] = dict(
            send_counts=tuple(send),
            recv_counts=tuple(recv),
            num_recv_tokens=rows,
            num_recv_tokens_per_expert=torch.tensor(per_local, dtype=torch.int32, device=dev),
            num_recv_tokens_per_expert_list=per_local,
        )
    else:
        m = expanded_capacity(rows, plan.num_topk, big_l, a)
        mode = dict(
            send_counts=None,
            recv_counts=None,
            num_recv_tokens=out["num_recv"].reshape(()),
            num_recv_tokens_per_expert=out["per_expert"].to(torch.int32),
            num_recv_tokens_per_expert_list=None,
        )
    recv_x, fields = lay_out(got, plan, big_l, m)
    handle = DispatchHandle(
        buffer_uid=buf.uid,
        seq=buf._next_seq(),
        num_tokens=plan.num_tokens,
        num_topk=plan.num_topk,
        hidden=buf.hidden,
        sync_free=counts is None,
        num_worst_tokens=None if counts is not None else rows,
        expand=plan.expand,
        expert_alignment=a,
        is_token_in_rank=mask,
        num_tokens_per_rank=layout.num_tokens_per_rank,
        num_tokens_per_expert=layout.num_tokens_per_expert,
        send_token_idx=None,
        send_slot=slots,
        num_recv_rows=rows,
        recv_src_rank=got.recv_src_rank,
        recv_src_idx=got.recv_src_idx,
        recv_topk_idx=got.recv_topk_idx,
        recv_slot_pos=out["slot_pos"],
        backend="nvshmem",
        recv_counts_device=out["recv_counts"],
        recv_starts=out["recv_starts"],
        **fields,
        **mode,
    )
    return recv_x, got.recv_topk_idx, got.recv_topk_weights, handle


def replay(buf: BufferView, h: DispatchHandle, x: torch.Tensor) -> torch.Tensor:
    """``recv_x`` of a handle's dispatch replayed for new rows ``x`` (rows only, same slots)."""
    st: NativeEp = buf._native
    st.raise_if_failed()
    with torch.cuda.device(buf.device):
        st.send_rows(
            x, h.is_token_in_rank, h.send_slot, h.num_tokens_per_rank, None, None, buf.num_local_experts,
            buf.num_sms, buf.timeout_ns,
        )  # fmt: skip
        out = _receive(st, buf, h.num_recv_rows, x.shape[1], x.dtype, False, False)
        st.receive_rows(
            x, num_topk=h.num_topk, has_meta=False, num_local_experts=buf.num_local_experts,
            cap=buf.max_tokens_per_rank, out=out, num_sms=buf.num_sms, timeout_ns=buf.timeout_ns,
        )  # fmt: skip
    return maybe_expand(out["recv_x"], h)


def combine(buf: BufferView, plan: CombinePlan) -> torch.Tensor:
    """``combined_x``: expanded rows reduced per received row (torch, as the reference), then the partials
    sent home and summed there in the reference order."""
    st: NativeEp = buf._native
    st.raise_if_failed()
    h = plan.handle
    partial = plan.x
    if h.expand:
        assert h.recv_expanded_index is not None
        partial = reduce_expanded(plan.x, h.recv_expanded_index, plan.topk_weights)
    with torch.cuda.device(buf.device):
        partial = partial.contiguous()
        st.send_partials(partial, h.recv_counts_device, h.recv_starts, buf.num_sms, buf.timeout_ns)
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
        )
    return out
