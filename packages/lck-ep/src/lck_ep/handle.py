"""The dispatch handle: everything combine and a cached dispatch need to replay one routing.

A :class:`DispatchHandle` is returned by :meth:`lck_ep.Buffer.dispatch` and is only meaningful to the
Buffer that produced it (a handle from another Buffer is rejected). Its tensors live on the Buffer's
device. Notation: ``W`` ranks, this rank ``r``; ``E`` experts, ``L = E / W`` local experts; ``T`` tokens
dispatched from this rank (``num_tokens``); ``N`` received rows (``num_recv_rows``: the exact received
count in synced mode, ``num_worst_tokens`` in sync-free mode, where rows past the received count are
padding); ``K`` = top-k; ``M`` expanded rows.

Order of received rows (``recv_x`` and every per-row tensor): by source rank ascending, then by the
token's index on its source rank ascending; in sync-free mode the valid rows come first, in the same
order, followed by padding rows.

Source side (this rank as sender):
    ``is_token_in_rank [T, W]`` bool, ``num_tokens_per_rank [W]`` int32, ``num_tokens_per_expert [E]``
    int32: the layout of this rank's routing. ``send_counts`` (synced) tuple of W ints: tokens sent to
    each destination. ``send_token_idx [S]`` int64 (synced): the token index of each sent row, grouped
    by destination ascending, token ascending within (``S = sum(send_counts)``). ``send_slot [T, W]``
    int64 (sync-free): the row of token t inside the fixed-size block sent to rank d, -1 if not sent.

Receive side (this rank as host of local experts):
    ``recv_counts`` (synced) tuple of W ints: tokens received from each source. ``num_recv_tokens``:
    the received count (an int in synced mode, a 0-d int64 device tensor in sync-free mode).
    ``recv_src_rank [N]``, ``recv_src_idx [N]`` int64: source rank and token index of each row (-1 on
    padding). ``recv_topk_idx [N, K]`` int64: local expert index (0..L-1) of each slot that targets
    this rank, -1 elsewhere and on padding. ``recv_slot_pos [W * max_tokens_per_rank]`` int64
    (sync-free): where each received block slot lands among the compacted rows (``num_worst_tokens``
    for an empty slot or one past the capacity). ``num_recv_tokens_per_expert [L]`` int32: exact
    (unpadded) (token, slot) entries per local expert; ``num_recv_tokens_per_expert_list`` the same as
    a Python list in synced mode, ``None`` in sync-free mode (reading it would need a host sync).

Expanded expert-major layout (``expand=True``), one row per (received token, slot targeting a local
expert), grouped by local expert ascending, within an expert by received row ascending then slot
ascending; expert j's rows are ``[expert_offsets[j], expert_offsets[j] + counts[j])`` and its segment
is padded with zero rows up to ``expert_offsets[j + 1]``, a multiple of ``expert_alignment`` past
``expert_offsets[j]``:
    ``expert_offsets [L + 1]`` int64, ``expanded_src_row [M]`` int64 (received row of each expanded
    row, -1 on padding), ``expanded_slot [M]`` int64 (its slot k, -1 on padding),
    ``recv_expanded_index [N, K]`` int64 (expanded row of each (row, slot), -1 where the slot is not
    local). ``M`` = ``expert_offsets[L]`` in synced mode, ``num_worst_tokens * K + L * (alignment - 1)``
    in sync-free mode (rows past ``expert_offsets[L]`` are capacity padding: ``-1`` in the maps, their
    ``recv_x`` rows unspecified, see :mod:`lck_ep.buffer`).

Native backend (``backend == "nvshmem"``): ``send_slot`` and ``recv_slot_pos`` are filled in both modes
(``send_token_idx`` is None), and ``recv_counts_device [W]`` / ``recv_starts [W + 1]`` (int64, device)
say where each source's rows start among the received rows; combine and replays use only these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DispatchHandle"]


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    buffer_uid: int
    seq: int  # the Buffer's dispatch counter when this routing was dispatched (same on every rank)
    num_tokens: int
    num_topk: int
    hidden: int
    sync_free: bool
    num_worst_tokens: int | None
    expand: bool
    expert_alignment: int
    # source side
    is_token_in_rank: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    send_counts: tuple[int, ...] | None
    send_token_idx: torch.Tensor | None
    send_slot: torch.Tensor | None
    # receive side
    recv_counts: tuple[int, ...] | None
    num_recv_tokens: int | torch.Tensor
    num_recv_rows: int
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_slot_pos: torch.Tensor | None
    num_recv_tokens_per_expert: torch.Tensor
    num_recv_tokens_per_expert_list: list[int] | None
    # expanded layout
    expert_offsets: torch.Tensor | None = None
    expanded_src_row: torch.Tensor | None = None
    expanded_slot: torch.Tensor | None = None
    recv_expanded_index: torch.Tensor | None = None
    num_expanded_rows: int | None = None
    # native synced expanded handles: the most expanded rows any rank holds for this routing (the same on every
    # rank), which sizes Buffer.combine_input's zero-copy input alike everywhere; None elsewhere
    most_expanded_rows: int | None = None
    # which backend moved the rows, and what the native one replays and combines with
    backend: str = "reference"
    recv_counts_device: torch.Tensor | None = None  # [W] int64 rows received from each source
    recv_starts: torch.Tensor | None = None  # [W + 1] int64 their prefix sums

    @property
    def num_rows_in(self) -> int:
        """Rows combine expects from this rank: expanded rows if expanded, else received rows."""
        return self.num_expanded_rows if self.expand else self.num_recv_rows  # type: ignore[return-value]

    def __repr__(self) -> str:
        mode = f"sync_free(num_worst_tokens={self.num_worst_tokens})" if self.sync_free else "synced"
        exp = (
            f", expanded(M={self.num_expanded_rows}, alignment={self.expert_alignment})"
            if self.expand
            else ""
        )
        return (
            f"DispatchHandle(seq={self.seq}, num_tokens={self.num_tokens}, num_recv_rows={self.num_recv_rows}, "
            f"num_topk={self.num_topk}, hidden={self.hidden}, {mode}{exp})"
        )
