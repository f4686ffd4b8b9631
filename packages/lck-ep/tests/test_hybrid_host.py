"""The hybrid backend's host side on the CPU (no GPU, kernels recorded, not run): what the dispatch launch
hands the kernels (host streams, first send slots, the dispatch/replay flag, also from a rank with no
tokens), and which member a timed-out wait for dispatch rows names when sources reach a rank through a
forwarder (the stop test's expectation: the stopped rank, not a live one whose forwarding it stalled).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from _launches import assert_launch, recording_launchers

import lck_ep._hybrid_exchange as hybrid_exchange
from lck_ep._hybrid_exchange import HybridEp
from lck_ep.codegen import NATIVE_KINDS
from lck_ep.hybrid import forwarder, stopped_member
from lck_ep.hybrid_codegen import HYBRID_KINDS
from lck_ep.native import NativeTimeoutError, OutgoingRows, meta_offset
from lck_ep.reference import send_slots
from lck_runtime.jit import I32, I64, U64, Ptr


def _state(world: int = 4, hosts: int = 2, me: int = 1) -> Any:
    ep = object.__new__(HybridEp)  # no context, no GPU: only what the launches and diagnostics read
    g = world // hosts
    ep.size, ep.me, ep.num_hosts, ep.g = world, me, hosts, g
    ep.layout = SimpleNamespace(region_bytes=1 << 20, row_stride=4608, cap=64)
    ep.plan = lambda num_sms: SimpleNamespace(channels=8, parts=3, q_cap=8, header_bytes=32)
    ep.options = SimpleNamespace(debug_reorder=False, debug_delay_us=0)
    ep.peer_ws, ep.peer_sig = torch.arange(world), torch.arange(world) + 10
    ep.workspace, ep.signals = torch.zeros(64, dtype=torch.uint8), torch.zeros(world * 32, dtype=torch.int64)
    ep.pack = torch.zeros(16, dtype=torch.uint8)
    ep.hybrid_base, ep.area_bytes = world << 20, 1 << 16
    ep.fwd_rows = torch.zeros((hosts - 1) * g + hosts, dtype=torch.int32)
    ep.done = torch.zeros(4, dtype=torch.int32)
    ep.tickets, ep.status = torch.zeros(4, dtype=torch.int32), torch.zeros(6, dtype=torch.int64)
    ep.launchers = recording_launchers(NATIVE_KINDS)
    ep.hybrid_launchers = recording_launchers(HYBRID_KINDS)
    ep._cache_addresses()
    ep._cache_hybrid_addresses()
    ep.launches = {"dispatch": 0, "combine": 0}
    return ep


# DispatchArgs order (hybrid_codegen._PARAMS["dispatch"]): the positions the checks below read.
_TOPK_IDX, _EXCL, _HOST_TOKENS, _HOST_ROWS, _NUM_TOKENS, _NUM_TOPK = 2, 6, 7, 8, 18, 19


def _rows(tokens: int, world: int, topk: int, routed: bool, seed: int = 0) -> OutgoingRows:
    g = torch.Generator().manual_seed(seed)
    experts = 4 * world
    idx = torch.randint(-1, experts, (tokens, topk), generator=g)
    mask = torch.zeros(tokens, world, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                mask[t, e // 4] = True
    x = torch.randn(tokens, 16, generator=g).to(torch.bfloat16)
    w = torch.rand(tokens, topk, generator=g)
    rows_to = mask.sum(0, dtype=torch.int32)
    return OutgoingRows(x, mask, send_slots(mask), rows_to, idx if routed else None, w if routed else None)


def _launch(ep: Any, rows: OutgoingRows) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
    """The dispatch launch's values, and the host streams it passed (``host_streams``' tensors, kept here:
    the launch only saw their addresses)."""
    made = []

    def record(*args: Any) -> Any:
        made.append(host_streams(*args))
        return made[-1]

    host_streams = hybrid_exchange.host_streams
    with mock.patch.object(hybrid_exchange, "host_streams", record):
        ep.send_rows(rows, 4, 24, 10**9)
    (_, values), *_ = ep.hybrid_launchers["dispatch"].calls[-1:]
    excl, host_tokens, host_rows = made[-1]
    assert values[_EXCL : _HOST_ROWS + 1] == [excl.data_ptr(), host_tokens.data_ptr(), host_rows.data_ptr()]
    return values, made[-1]


@pytest.mark.parametrize("routed", [True, False])
def test_dispatch_launch_arguments(routed: bool) -> None:
    """Every argument of the hybrid dispatch launch, in the order and kinds of its C signature."""
    ep = _state()
    ep.options = SimpleNamespace(debug_reorder=True, debug_delay_us=3)
    rows = _rows(5, 4, 3, routed=routed)
    _, (excl, host_tokens, host_rows) = _launch(ep, rows)
    assert ep.launches["dispatch"] == 1
    assert_launch(ep.hybrid_launchers["dispatch"], 0, 8, [
        rows.x, I64(32), rows.topk_idx if routed else Ptr(0), rows.topk_weights if routed else Ptr(0), rows.mask,
        rows.send_slot, excl, host_tokens, host_rows, rows.rows_to, ep.peer_ws, ep.peer_sig, ep.pack,
        I64(1 << 20), I64(4608), I64(meta_offset(32)), I64(4 << 20), I64(1 << 16), I32(5), I32(3 if routed else 0),
        I32(4), I32(1), I32(4), I32(2), I32(2), I32(8), I32(3), I32(8), I32(32), I32(64), I32(1), U64(3000),
        ep.fwd_rows, ep.tickets[0:2], ep.status, U64(10**9),
    ])  # fmt: skip


def test_a_rank_with_no_tokens_still_launches_a_routed_dispatch() -> None:
    """The rank1_sends_nothing failure: a rank with no tokens passes an empty topk_idx, whose address is 0
    like a replay's absent one. As a forwarder that rank reads the rows other hosts' sources staged for it,
    so the row format must come from an argument every rank passes alike (num_topk, 0 only on a replay),
    not from its own topk_idx pointer: read as replay rows, the sources' routing words became rank bits
    (rows to the wrong ranks and slots) and the final ranks' weights and local experts were never written."""
    ep = _state()
    empty = _rows(0, 4, 4, routed=True)
    assert empty.topk_idx is not None and empty.topk_idx.data_ptr() == 0  # null on the device as well
    args, _ = _launch(ep, empty)
    assert args[_NUM_TOKENS] == 0
    assert args[_NUM_TOPK] == 4, "a dispatch from a rank with no tokens must still say it is routed"
    full, _ = _launch(ep, _rows(5, 4, 4, routed=True))
    assert full[_NUM_TOPK] == 4
    replay, _ = _launch(ep, _rows(5, 4, 4, routed=False))
    assert replay[_TOPK_IDX] == 0 and replay[_NUM_TOPK] == 0


def test_the_kernels_take_the_row_format_from_num_topk() -> None:
    from lck_ep.codegen import CSRC_DIR

    text = (CSRC_DIR / "hybrid_common.cuh").read_text()
    assert "const bool routed = K > 0;" in text
    assert "topk_idx != nullptr" not in text  # the pointer of a rank without tokens is null too


@pytest.mark.parametrize(("world", "hosts"), [(4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("tokens", [0, 1, 7, 33])
def test_host_streams_and_first_slots_follow_the_reference(world: int, hosts: int, tokens: int) -> None:
    """host_tokens [NH, T]: the tokens bound for each host, in token order, then the rest; host_rows [NH];
    excl [T, W]: rows sent to each rank before each token, which equals the reference send slot of
    every token that goes there (a sub-part header's first slots)."""
    ep = _state(world, hosts)
    rows = _rows(tokens, world, 3, routed=True, seed=tokens + world)
    _, (excl, host_tokens, host_rows) = _launch(ep, rows)
    g = world // hosts
    mask = rows.mask
    for h in range(hosts):
        stream = [t for t in range(tokens) if bool(mask[t, h * g : (h + 1) * g].any())]
        assert int(host_rows[h]) == len(stream)
        assert host_tokens[h, : len(stream)].tolist() == stream
    assert excl.dtype == torch.int32 and excl.is_contiguous() and list(excl.shape) == [tokens, world]
    slots = send_slots(mask)
    assert torch.equal(excl.to(torch.int64)[mask], slots[mask])


# -------------------------------------------------------------------------- the stopped rank, named


def _arrived(world: int, g: int, me: int, stopped: int) -> list[bool]:
    """Which sources' counts reach ``me`` when ``stopped`` (on the last host) never calls: a source on this
    host publishes its own, also when its forwarding wait for ``stopped`` failed (the kernel publishes
    each part that completed); one on another host through its forwarder here, which forwards the other
    hosts in ascending order, so every host before the last one completes before the wait that fails."""
    host = me // g
    out = []
    for s in range(world):
        if s // g == host:
            out.append(s != stopped)
        else:
            out.append(s != stopped and forwarder(s, host, g) != stopped)
    return out


@pytest.mark.parametrize(("world", "hosts"), [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_the_stopped_rank_is_named(world: int, hosts: int) -> None:
    g = world // hosts
    stopped = world - 1
    for me in range(world - 1):
        arrived = _arrived(world, g, me, stopped)
        if all(arrived):
            continue  # nothing for this rank to wait on (not in the 2 x 2 test)
        for recorded in (s for s in range(world) if not arrived[s]):  # any missing lane may record first
            assert stopped_member(arrived, me, g, recorded) == stopped, (me, recorded, arrived)


def test_a_failed_forwarder_that_withheld_its_own_rows_would_be_named() -> None:
    """Why the kernel publishes a rank's own rows even when its forwarding wait failed: in the 2 x 2 stop
    test rank 1 forwards rank 3's rows; had it withheld its own too, rank 0 would miss both and could not
    tell a stopped rank 1 from a stopped rank 3 (the GPU run named group rank 1)."""
    arrived = [True, False, True, False]
    assert stopped_member(arrived, 0, 2, 1) == 1
    assert stopped_member(arrived, 0, 2, 3) == 1
    arrived[1] = True  # rank 1 published its own rows
    assert stopped_member(arrived, 0, 2, 3) == 3


def test_raise_names_the_stopped_rank_from_the_arrival_words() -> None:
    op = 7
    ep = _state(4, 2, me=2)
    ep.ctx = SimpleNamespace(ranks=[10, 11, 12, 13])
    words = torch.zeros(4, 32, dtype=torch.int64)
    for s, ok in enumerate([True, False, True, False]):  # rank 3 stopped: 3's rows and 1's (through 3)
        words[s, 0] = ((op if ok else op - 1) << 32) | 5
    ep.signals = words.view(-1)
    # the receiver recorded source 1 (its lane timed out first): its forwarder here, rank 3, stopped
    ep.status_host = torch.tensor([1, 2, 1, op - 1, op, 2_000_000_000], dtype=torch.int64)
    ep._status_word = ep.status_host.numpy()
    with pytest.raises(NativeTimeoutError) as err:
        ep.raise_if_failed()
    text = str(err.value)
    assert "for group rank 3 (global rank 13)" in text and "group rank 1 " not in text, text
    # rank 0: rank 1 published its own rows, rank 3's never came through it
    ep = _state(4, 2, me=0)
    ep.ctx = SimpleNamespace(ranks=[10, 11, 12, 13])
    words[1, 0] = (op << 32) | 5
    ep.signals = words.view(-1)
    ep.status_host = torch.tensor([1, 2, 3, op - 1, op, 2_000_000_000], dtype=torch.int64)
    ep._status_word = ep.status_host.numpy()
    with pytest.raises(NativeTimeoutError, match=r"for group rank 3 \(global rank 13\), whose rows reach"):
        ep.raise_if_failed()
