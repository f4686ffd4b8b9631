"""What the checks and the data movement read from a :class:`lck_ep.Buffer`, as a protocol.

``checks``, ``_exchange`` and ``_native_exchange`` are imported by ``buffer``; typing their argument with
this protocol instead of the Buffer class keeps them from importing ``buffer`` back.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["BufferView"]


class BufferView(Protocol):
    uid: int
    device: torch.device
    hidden: int
    num_topk: int
    num_ranks: int
    num_local_experts: int
    max_tokens_per_rank: int
    sync_free: bool
    num_sms: int
    timeout_ns: int
    early_receive_bytes: int
    _topo: Any  # lck_ep.reference.Topology
    _native: Any  # lck_ep.native.NativeEp or None

    @property
    def worst_case_tokens(self) -> int: ...

    def _next_seq(self) -> int: ...
