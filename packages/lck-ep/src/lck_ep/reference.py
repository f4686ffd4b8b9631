"""The reference backend: dispatch and combine over ``torch.distributed.all_to_all_single``.

It runs wherever torch.distributed does (gloo on CPU, NCCL on GPU), is the oracle of the bit-exact
tests, and is the fallback where GPU kernels cannot run. Arguments arrive validated by
:class:`lck_ep.Buffer`; the functions here only move data. Each row travels as raw bytes (a ``uint8``
view of the row and its metadata, packed side by side), so one all-to-all carries a row with its
routing and no backend has to support bf16.

Synced mode sends exactly the rows each destination needs (split sizes known on the host, which costs
one host synchronisation per fresh dispatch, in the count exchange). Sync-free mode sends a fixed
block of ``max_tokens_per_rank`` rows to every destination (equal splits), carries the counts on the
device and compacts received rows to the front of a ``num_worst_tokens``-row output, so nothing
depends on a device value on the host and the sequence of launches is fixed (CUDA-graph safe).

Combine, on the source rank, for each token: ``acc = +0.0`` (float32); for each destination rank d in
ascending order that the token was sent to, ``acc += float32(partial from d)``; then ``acc += bias0``,
``acc += bias1`` (float32, when given); the result is cast to the dtype of the combine input. A token
sent nowhere combines to ``0 (+ bias)``. Both modes and every backend follow this order, so their
results agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lck_ep.layout import DispatchLayout

__all__ = ["Topology", "combine", "dispatch_sync_free", "dispatch_synced", "exchange_counts", "send_slots"]


@dataclass(frozen=True)
class Topology:
    group: dist.ProcessGroup
    rank: int
    world: int
    num_experts: int
    num_local_experts: int
    max_tokens_per_rank: int
    device: torch.device


@dataclass
class Received:
    """What a dispatch hands back to the Buffer (tensors on the Buffer's device)."""

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    recv_src_idx: torch.Tensor | None
    recv_src_rank: torch.Tensor | None
    send_token_idx: torch.Tensor | None = None
    send_slot: torch.Tensor | None = None
    recv_slot_pos: torch.Tensor | None = None
    num_recv_tokens: torch.Tensor | None = None  # sync-free: 0-d int64
    per_expert: torch.Tensor | None = None  # sync-free: [L] int64


def _row_bytes(t: torch.Tensor) -> int:
    n = t.element_size()
    for s in t.shape[1:]:
        n *= s
    return n


def _pack(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    return torch.cat([p.contiguous().view(torch.uint8).reshape(rows, _row_bytes(p)) for p in parts], dim=1)


def _unpack(buf: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    rows = buf.shape[0]
    out, col = [], 0
    for dtype, shape in specs:
        width = torch.empty((), dtype=dtype).element_size()
        for s in shape:
            width *= s
        # A fresh buffer (not .contiguous(), which keeps a one-row slice's stride and offset) so the
        # bytes can be viewed as a wider dtype.
        field = torch.empty(rows, width, dtype=torch.uint8, device=buf.device)
        field.copy_(buf[:, col : col + width])
        out.append(field.view(dtype).reshape(rows, *shape))
        col += width
    return out


def _dest_meta(
    topo: Topology,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    dest: torch.Tensor,
) -> list[torch.Tensor]:
    """Per-row routing as seen by its destination: local expert index or -1, weight or 0."""
    lo = (dest * topo.num_local_experts).unsqueeze(1)
    local = (topk_idx >= lo) & (topk_idx < lo + topo.num_local_experts)
    parts = [torch.where(local, topk_idx - lo, torch.full_like(topk_idx, -1))]
    if topk_weights is not None:
        parts.append(torch.where(local, topk_weights, torch.zeros_like(topk_weights)))
    return parts


def _meta_specs(num_topk: int, with_weights: bool) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    specs = [(torch.int64, (1,)), (torch.int64, (num_topk,))]
    if with_weights:
        specs.append((torch.float32, (num_topk,)))
    return specs


def exchange_counts(topo: Topology, layout: DispatchLayout) -> torch.Tensor:
    """Sync-free count exchange: ``[W, 1 + L]`` int64 on the device, row s = (tokens from s, per local
    expert entries from s). One equal-split all-to-all, no host synchronisation."""
    w, big_l = topo.world, topo.num_local_experts
    send = torch.cat(
        [
            layout.num_tokens_per_rank.to(torch.int64).reshape(w, 1),
            layout.num_tokens_per_expert.to(torch.int64).reshape(w, big_l),
        ],
        dim=1,
    ).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=topo.group)
    return recv


def dispatch_synced(
    topo: Topology,
    x: torch.Tensor,
    *,
    layout: DispatchLayout | None,
    send_counts: list[int],
    recv_counts: list[int],
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    send_token_idx: torch.Tensor | None = None,
) -> Received:
    """Exact-size dispatch. Fresh (``layout`` and ``topk_idx`` given) or replay (``send_token_idx``)."""
    hidden = x.shape[1]
    fresh = topk_idx is not None
    if fresh:
        assert layout is not None
        # nonzero walks the transposed mask row-major: destination ascending, then token ascending.
        pairs = layout.is_token_in_rank.t().nonzero()
        dest, send_token_idx = pairs[:, 0], pairs[:, 1]
    assert send_token_idx is not None
    num_send = send_token_idx.numel()
    num_recv = sum(recv_counts)
    parts = [x.index_select(0, send_token_idx)]
    specs: list[tuple[torch.dtype, tuple[int, ...]]] = [(x.dtype, (hidden,))]
    if fresh:
        assert topk_idx is not None
        w = topk_weights.index_select(0, send_token_idx) if topk_weights is not None else None
        parts += [
            send_token_idx.unsqueeze(1),
            *_dest_meta(topo, topk_idx.index_select(0, send_token_idx), w, dest),
        ]
        specs += _meta_specs(topk_idx.shape[1], topk_weights is not None)
    send = _pack(parts, num_send)
    recv = torch.empty(num_recv, send.shape[1], dtype=torch.uint8, device=x.device)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=list(recv_counts),
        input_split_sizes=list(send_counts),
        group=topo.group,
    )
    fields = _unpack(recv, specs)
    out = Received(
        recv_x=fields[0],
        recv_topk_idx=None,
        recv_topk_weights=None,
        recv_src_idx=None,
        recv_src_rank=None,
        send_token_idx=send_token_idx,
    )
    if fresh:
        out.recv_src_idx = fields[1].reshape(num_recv)
        out.recv_topk_idx = fields[2]
        out.recv_topk_weights = fields[3] if topk_weights is not None else None
        out.recv_src_rank = torch.repeat_interleave(
            torch.arange(topo.world, device=x.device),
            torch.tensor(recv_counts, device=x.device),
            output_size=num_recv,
        )
    return out


def dispatch_sync_free(
    topo: Topology,
    x: torch.Tensor,
    *,
    num_worst_tokens: int,
    layout: DispatchLayout | None = None,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    send_slot: torch.Tensor | None = None,
    recv_slot_pos: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> Received:
    """Fixed-size dispatch with no host synchronisation. Fresh (``layout`` and ``topk_idx``) or replay
    (``mask``, ``send_slot`` and ``recv_slot_pos`` from the handle)."""
    w, cap, hidden = topo.world, topo.max_tokens_per_rank, x.shape[1]
    dev = x.device
    fresh = topk_idx is not None
    if fresh:
        assert layout is not None
        mask = layout.is_token_in_rank
        send_slot = send_slots(mask)
    assert mask is not None and send_slot is not None
    specs: list[tuple[torch.dtype, tuple[int, ...]]] = [(x.dtype, (hidden,))]
    if fresh:
        assert topk_idx is not None
        specs += _meta_specs(topk_idx.shape[1], topk_weights is not None)
    row_bytes = sum(torch.empty((), dtype=d).element_size() * _prod(s) for d, s in specs)
    num_tokens = x.shape[0]
    # One block of `cap` rows per destination, plus a dump row that absorbs the tokens not sent there.
    send = torch.zeros(w * cap + 1, row_bytes, dtype=torch.uint8, device=dev)
    tok = torch.arange(num_tokens, device=dev)
    for d in range(w):
        target = torch.where(mask[:, d], d * cap + send_slot[:, d], w * cap)
        parts = [x]
        if fresh:
            assert topk_idx is not None
            dest = torch.full((num_tokens,), d, dtype=torch.int64, device=dev)
            parts += [tok.unsqueeze(1), *_dest_meta(topo, topk_idx, topk_weights, dest)]
        send.index_copy_(0, target, _pack(parts, num_tokens))
    recv = torch.empty(w * cap, row_bytes, dtype=torch.uint8, device=dev)
    out = Received(
        recv_x=x,
        recv_topk_idx=None,
        recv_topk_weights=None,
        recv_src_idx=None,
        recv_src_rank=None,
        send_slot=send_slot,
    )
    if fresh:
        assert layout is not None
        counts = exchange_counts(topo, layout)
        from_src = counts[:, 0]
        start = torch.cumsum(from_src, 0) - from_src
        i = torch.arange(cap, device=dev)
        valid = i.unsqueeze(0) < from_src.unsqueeze(1)
        # Rows past the capacity land in the dump row with the empty slots (documented overflow).
        recv_slot_pos = torch.where(valid, start.unsqueeze(1) + i.unsqueeze(0), num_worst_tokens)
        recv_slot_pos = recv_slot_pos.clamp(max=num_worst_tokens).reshape(-1)
        out.num_recv_tokens = from_src.sum()
        out.per_expert = counts[:, 1:].sum(0)
    assert recv_slot_pos is not None
    out.recv_slot_pos = recv_slot_pos
    dist.all_to_all_single(recv, send[: w * cap], group=topo.group)
    packed = torch.zeros(num_worst_tokens + 1, row_bytes, dtype=torch.uint8, device=dev)
    packed.index_copy_(0, recv_slot_pos, recv)
    fields = _unpack(packed[:num_worst_tokens], specs)
    out.recv_x = fields[0]
    if fresh:
        assert out.num_recv_tokens is not None
        rows = torch.arange(num_worst_tokens, device=dev)
        row_valid = rows < out.num_recv_tokens
        out.recv_src_idx = torch.where(row_valid, fields[1].reshape(-1), -1)
        out.recv_topk_idx = torch.where(row_valid.unsqueeze(1), fields[2], -1)
        out.recv_topk_weights = fields[3] if topk_weights is not None else None  # padding rows are 0
        ends = torch.cumsum(counts[:, 0], 0)
        out.recv_src_rank = torch.where(row_valid, torch.searchsorted(ends, rows, right=True), -1)
    return out


def send_slots(mask: torch.Tensor) -> torch.Tensor:
    """``[T, W]`` int64: the row of token t in the block sent to rank d (its rank among d's tokens, in
    token order), -1 where it is not sent. Both backends place rows by these slots."""
    return torch.where(mask, torch.cumsum(mask.to(torch.int64), 0) - 1, -1)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def combine(
    topo: Topology,
    partial: torch.Tensor,
    *,
    num_tokens: int,
    is_token_in_rank: torch.Tensor,
    sync_free: bool,
    send_counts: tuple[int, ...] | None = None,
    recv_counts: tuple[int, ...] | None = None,
    send_token_idx: torch.Tensor | None = None,
    send_slot: torch.Tensor | None = None,
    recv_slot_pos: torch.Tensor | None = None,
    num_worst_tokens: int | None = None,
    bias: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """Send each received row's partial back to its source and reduce there (order in module doc).

    ``partial`` ``[N, H]`` (one row per received row, in received order). Returns ``[num_tokens, H]``
    in ``partial.dtype``.
    """
    hidden, dtype, dev = partial.shape[1], partial.dtype, partial.device
    w = topo.world
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=dev)
    row_bytes = hidden * partial.element_size()
    if not sync_free:
        assert send_counts is not None and recv_counts is not None and send_token_idx is not None
        back = torch.empty(sum(send_counts), row_bytes, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(
            back,
            _pack([partial], partial.shape[0]),
            output_split_sizes=list(send_counts),
            input_split_sizes=list(recv_counts),
            group=topo.group,
        )
        rows = back.view(dtype).reshape(-1, hidden)
        start = 0
        for d in range(w):
            n = send_counts[d]
            if n:
                idx = send_token_idx[start : start + n]
                # Indices are unique within one destination: a plain (non-accumulating) index_put.
                acc[idx] = acc.index_select(0, idx) + rows[start : start + n].to(torch.float32)
            start += n
    else:
        assert send_slot is not None and recv_slot_pos is not None and num_worst_tokens is not None
        cap = topo.max_tokens_per_rank
        src = _pack([partial], partial.shape[0])
        filled = (recv_slot_pos < num_worst_tokens).unsqueeze(1)
        back_send = torch.where(
            filled, src.index_select(0, recv_slot_pos.clamp(max=num_worst_tokens - 1)), 0
        ).to(torch.uint8)
        back = torch.empty(w * cap, row_bytes, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(back, back_send, group=topo.group)
        rows = back.view(dtype).reshape(w, cap, hidden)
        for d in range(w):
            got = rows[d].index_select(0, send_slot[:, d].clamp(min=0)).to(torch.float32)
            # Adding +0.0 for tokens not sent to d leaves acc's bits unchanged (acc is never -0.0),
            # so this equals the synced path's skip.
            acc = acc + torch.where(is_token_in_rank[:, d : d + 1], got, 0.0)
    for b in bias:
        acc = acc + b.to(torch.float32)
    return acc.to(dtype)
