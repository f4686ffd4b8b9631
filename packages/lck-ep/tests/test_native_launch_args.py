"""Every native launch, and the hybrid pair's combine launch, passes its kernel the arguments in the order and
with the kinds the CUDA signatures take (dispatch.cuh's and combine.cuh's kernels, hybrid_common.cuh's), on
the CPU: the bound launches are recorded, not run. The expected arguments are written as the typed
arguments the kernels' C parameters read (``I32(n)``, a tensor for a pointer) and compared with the bound
call's kinds and flat values (:mod:`_launches`). Guards the Python plumbing between the exchange and the
launches (``OutgoingRows``, ``OutgoingPartials``, ``NativeEp.partials_args``, the addresses a state reads
once), which the GPU tests only see as a wrong answer or a hang.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _launches import assert_launch, recording_launchers

from lck_ep import native
from lck_ep._hybrid_exchange import HybridEp
from lck_ep.agreement import RoutedCounts
from lck_ep.codegen import CSRC_DIR, NATIVE_KINDS
from lck_ep.hybrid_codegen import HYBRID_KINDS
from lck_ep.native import NativeEp, OutgoingPartials, OutgoingRows, meta_offset
from lck_runtime.jit import I32, I64, U64, Ptr


def _state(cls: type) -> Any:
    ep = object.__new__(cls)  # no context, no GPU: only what the launches read
    ep.layout = SimpleNamespace(region_bytes=1 << 20, row_stride=4608, cap=64)
    ep.workspace, ep.signals = torch.zeros(64, dtype=torch.uint8), torch.zeros(16, dtype=torch.int64)
    ep.peer_ws, ep.peer_sig = torch.arange(4), torch.arange(4) + 10
    ep.size, ep.me, ep.device_sms = 4, 1, 132
    ep.done, ep.status = torch.zeros(4, dtype=torch.int32), torch.zeros(6, dtype=torch.int64)
    ep.status_host = torch.zeros(6, dtype=torch.int64)
    ep.launchers = recording_launchers(NATIVE_KINDS)
    ep._cache_addresses()
    return ep


def _rows(routed: bool) -> OutgoingRows:
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    mask = torch.rand(5, 4) > 0.5
    slot, rows_to = torch.randint(0, 5, (5, 4)), torch.randint(0, 5, (4,))
    idx = torch.randint(0, 8, (5, 2)) if routed else None
    w = torch.rand(5, 2) if routed else None
    return OutgoingRows(x, mask, slot, rows_to, idx, w)


def test_native_send_slots_arguments() -> None:
    ep, mask = _state(NativeEp), torch.rand(5, 4) > 0.5
    slot = ep.send_slots(mask)
    assert_launch(ep.launchers["ep_send_slots"], 0, 4, [mask, I32(5), I32(4), slot])
    ep.send_slots(mask[:0])
    assert len(ep.launchers["ep_send_slots"].calls) == 1  # no tokens: no launch


@pytest.mark.parametrize("pull", [True, False])
def test_native_send_rows_arguments(pull: bool) -> None:
    for routed in (True, False):
        ep, sent = _state(NativeEp), _rows(routed)
        ep.pulls_rows = pull
        ep.send_rows(sent, 3, 7, 9)
        assert_launch(ep.launchers["ep_dispatch_send"], 0, 7, [
            sent.x, I64(32), sent.topk_idx if routed else Ptr(0), sent.topk_weights if routed else Ptr(0),
            sent.mask, sent.send_slot, sent.rows_to, ep.peer_ws, ep.peer_sig, I64(1 << 20), I64(4608),
            I64(meta_offset(32)), I32(5), I32(2 if routed else 0), I32(4), I32(1), I32(3), ep.done[0:1],
            ep.status, U64(9), I32(int(pull)),
        ])  # fmt: skip


@pytest.mark.parametrize("meta", [True, False])
def test_native_receive_arguments(meta: bool) -> None:
    ep = _state(NativeEp)
    ints = torch.zeros(64, dtype=torch.int64)
    out: dict[str, Any] = {"recv_counts": ints[0:4], "recv_starts": ints[4:9], "num_recv": ints[9:10]}
    if meta:
        out.update(recv_src_idx=ints[10:16], recv_topk_idx=ints[16:28].view(6, 2), recv_topk_weights=None,
                   recv_src_rank=ints[28:34], slot_pos=ints[34:50], per_expert=None,
                   kept_per_expert=torch.zeros(3, dtype=torch.int32))  # fmt: skip

    def opt(name: str) -> Any:
        return out.get(name) if out.get(name) is not None else Ptr(0)

    ep.receive(row_bytes=34, rows=6, num_topk=2, has_meta=meta, num_local_experts=3, cap=64, out=out, num_sms=8,
               timeout_ns=5)  # fmt: skip
    launch = ep.launchers["ep_dispatch_recv"]
    assert len(launch.calls) == 2
    for call, (stage, blocks) in enumerate(((0, 1), (1, 132))):
        assert_launch(launch, call, blocks, [
            ep.workspace, ep.signals, I64(1 << 20), I64(4608), I64(meta_offset(34)), I64(64), I64(6), I32(4),
            I32(1), I32(2), I32(1 if meta else 0), I32(3), opt("recv_src_idx"), opt("recv_topk_idx"),
            opt("recv_topk_weights"), opt("recv_src_rank"), opt("recv_counts"), opt("recv_starts"),
            opt("slot_pos"), opt("num_recv"), opt("per_expert"), opt("kept_per_expert"), I32(stage), ep.status,
            U64(5),
        ])  # fmt: skip


def test_native_expand_maps_arguments() -> None:
    ep = _state(NativeEp)
    idx, kept = torch.zeros(6, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)
    offsets, src_row, slot = (torch.zeros(n, dtype=torch.int64) for n in (4, 20, 20))
    index = torch.zeros(6, 2, dtype=torch.int64)
    ep.expand_maps(idx, kept, 16, offsets, src_row, slot, index)
    launch = ep.launchers["ep_expand_maps"]
    head = [idx, kept, I64(12), I64(20), I32(2), I32(3), I32(16), offsets, src_row, slot, index, ep.status]
    counts = launch.calls[0][1][12]  # the chunks x experts scratch the method allocates, the same for both
    assert counts != 0
    for stage in (0, 1):  # count, then rank: one chunk of at least 4096 entries
        assert_launch(launch, stage, 1, [*head, Ptr(counts), I64(4096), I32(stage)])
    # Many entries: at most 128 chunks, each a multiple of the 512-thread block.
    big = torch.zeros(100000, 8, dtype=torch.int64)
    ep.expand_maps(big, kept, 16, offsets, src_row, slot, big)
    grid, values = launch.calls[2]
    chunk = values[13]
    assert chunk % 512 == 0 and grid == -(-800000 // chunk) <= 128 and values[14] == 0
    # The switch-over below is the kernel's own shared-memory limit.
    cuh = (CSRC_DIR / "dispatch.cuh").read_text()
    assert f"constexpr int kSharedExperts = {native._SHARED_EXPERTS};" in cuh
    # More local experts than the kernel's shared memory holds: one block per expert, every entry each.
    many, wide = torch.zeros(1025, dtype=torch.int32), torch.zeros(1026, dtype=torch.int64)
    ep.expand_maps(idx, many, 16, wide, src_row, slot, index)
    assert len(launch.calls) == 5
    assert_launch(launch, 4, 1024, [
        idx, many, I64(12), I64(20), I32(2), I32(1025), I32(16), wide, src_row, slot, index, ep.status, Ptr(0),
        I64(0), I32(2),
    ])  # fmt: skip


@pytest.mark.parametrize("pull", [True, False])
@pytest.mark.parametrize("expanded", [True, False])
def test_native_copy_rows_arguments(expanded: bool, pull: bool) -> None:
    ep = _state(NativeEp)
    ep.pulls_rows = pull
    x, starts = torch.randn(5, 16, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int64)
    src_row = torch.zeros(20, dtype=torch.int64) if expanded else None
    end = torch.zeros(4, dtype=torch.int64)[3:] if expanded else None
    index = torch.zeros(6, 3, dtype=torch.int64) if expanded else None
    src_idx = torch.zeros(6, dtype=torch.int64)
    out = torch.zeros(20, 16, dtype=torch.bfloat16)
    ep.copy_rows(x, starts, src_row, out, 200, rows_end=end, index=index, src_idx=src_idx)
    tail = [index, I64(6), I32(3)] if expanded else [Ptr(0), I64(0), I32(0)]
    assert_launch(ep.launchers["ep_dispatch_rows"], 0, 200, [
        x, ep.workspace, ep.signals, I64(1 << 20), I64(4608), I64(meta_offset(32)), I64(32), starts,
        src_row if expanded else Ptr(0), end if expanded else Ptr(0), I64(20), I32(4), I32(1), out,
        ep.done[1:2], ep.status, *tail, ep.peer_ws, src_idx, I32(int(pull)),
    ])  # fmt: skip
    if expanded:  # the row -> expanded rows map goes with the expanded rows' sources
        with pytest.raises(ValueError, match=r"index .* needs src_row"):
            ep.copy_rows(x, starts, None, out, 200, index=index, src_idx=src_idx)
    if pull:  # a pulled row is found through its source token index
        with pytest.raises(ValueError, match=r"pulled rows need src_idx"):
            ep.copy_rows(x, starts, src_row, out, 200, rows_end=end, index=index)


def test_hybrid_state_pushes_rows() -> None:
    # The hybrid pair's senders store rows in the destinations' regions, so its receiver must not pull.
    assert NativeEp.pulls_rows and not HybridEp.pulls_rows


@pytest.mark.parametrize(("dtype", "code"), [(torch.bfloat16, 0), (torch.float16, 1), (torch.float32, 2)])
def test_native_reduce_expanded_arguments(dtype: torch.dtype, code: int) -> None:
    ep = _state(NativeEp)
    x, index = torch.randn(30, 16).to(dtype), torch.zeros(100, 3, dtype=torch.int64)
    partial = torch.zeros(100, 16, dtype=dtype)
    weights, used = torch.rand(100, 3), torch.zeros((), dtype=torch.int64)
    ep.reduce_expanded(x, index, None, partial)
    ep.reduce_expanded(x, index, weights, partial, rows_used=used)
    launch = ep.launchers["ep_reduce_expanded"]
    # 100 rows, one warp each: 7 blocks of 16 warps
    assert_launch(launch, 0, 7, [x, index, Ptr(0), partial, I64(100), Ptr(0), I32(3), I32(16), I32(code)])
    assert_launch(launch, 1, 7, [x, index, weights, partial, I64(100), used, I32(3), I32(16), I32(code)])


def _partials() -> OutgoingPartials:
    return OutgoingPartials(torch.randn(6, 16, dtype=torch.bfloat16), torch.arange(4), torch.arange(4) * 2)


def test_native_send_partials_arguments() -> None:
    ep, sent = _state(NativeEp), _partials()
    ep.send_partials(sent, 5, 11)
    assert_launch(ep.launchers["ep_combine_send"], 0, 5, [
        sent.partial, I64(32), I64(6), sent.recv_counts, sent.recv_starts, ep.peer_ws, ep.peer_sig,
        I64(1 << 20), I64(4608), I32(4), I32(1), ep.done[2:3], ep.status, U64(11),
    ])  # fmt: skip


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize(("dtype", "code"), [(torch.bfloat16, 0), (torch.float16, 1), (torch.float32, 2)])
def test_native_send_expanded_partials_arguments(weighted: bool, dtype: torch.dtype, code: int) -> None:
    ep = _state(NativeEp)
    x, index = torch.randn(30, 16).to(dtype), torch.zeros(6, 3, dtype=torch.int64)
    sent = OutgoingPartials(torch.zeros(6, 16, dtype=dtype), torch.arange(4), torch.arange(4) * 2)
    weights = torch.rand(6, 3) if weighted else None
    ep.send_expanded_partials(x, index, weights, sent, 5, 11)
    assert_launch(ep.launchers["ep_combine_send_expanded"], 0, 5, [
        sent.partial, I64(16 * sent.partial.element_size()), I64(6), sent.recv_counts, sent.recv_starts,
        ep.peer_ws, ep.peer_sig, I64(1 << 20), I64(4608), I32(4), I32(1), ep.done[2:3], ep.status, U64(11), x,
        index, weights if weighted else Ptr(0), I32(3), I32(16), I32(code),
    ])  # fmt: skip


def _expanded_combine(cls: type, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """An expanded handle's combine through ``_native_exchange.combine`` on a recording state of ``cls``."""
    import contextlib

    from lck_ep import _native_exchange
    from lck_ep.checks import CombinePlan

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    ep = _state(cls)
    if cls is HybridEp:
        ep.send_partials = lambda sent, num_sms, timeout_ns: ep.sent.append((sent, num_sms, timeout_ns))
        ep.sent = []
    ep.raise_if_failed = lambda: None
    handle = SimpleNamespace(
        expand=True, recv_expanded_index=torch.zeros(6, 3, dtype=torch.int64), sync_free=True,
        num_recv_tokens=torch.zeros((), dtype=torch.int64), recv_counts_device=torch.arange(4),
        recv_starts=torch.arange(5) * 2, num_tokens=5, is_token_in_rank=torch.rand(5, 4) > 0.5,
        send_slot=torch.zeros(5, 4, dtype=torch.int64),
    )  # fmt: skip
    buf = SimpleNamespace(_native=ep, device=torch.device("cpu"), hidden=16, num_sms=7, timeout_ns=9)
    plan = CombinePlan(torch.randn(30, 16, dtype=torch.bfloat16), handle, torch.rand(6, 3), ())
    out = _native_exchange.combine(buf, plan)
    assert out.shape == (5, 16) and out.dtype == torch.bfloat16
    return ep, plan


def test_native_expanded_combine_reduces_in_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    ep, plan = _expanded_combine(NativeEp, monkeypatch)
    assert not ep.launchers["ep_reduce_expanded"].calls and not ep.launchers["ep_combine_send"].calls
    ((grid, values),) = ep.launchers["ep_combine_send_expanded"].calls
    partial_ptr = values[0]
    assert grid == 7 and values[14] == plan.x.data_ptr() and values[16] == plan.topk_weights.data_ptr()
    # the receiver reads this member's own reduced rows from the partial buffer the sender wrote them to
    assert len(ep.launchers["ep_combine_recv"].calls) == 2
    assert all(v[0] == partial_ptr for _, v in ep.launchers["ep_combine_recv"].calls)


def test_hybrid_expanded_combine_reduces_then_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    ep, plan = _expanded_combine(HybridEp, monkeypatch)
    assert not ep.launchers["ep_combine_send_expanded"].calls
    ((_, values),) = ep.launchers["ep_reduce_expanded"].calls
    ((sent, num_sms, timeout_ns),) = ep.sent
    assert values[3] == sent.partial.data_ptr() and (num_sms, timeout_ns) == (7, 9)
    assert values[5] == plan.handle.num_recv_tokens.data_ptr()  # sync-free: rows past the count are skipped


@pytest.mark.parametrize("num_bias", [0, 1, 2])
@pytest.mark.parametrize(("dtype", "code"), [(torch.bfloat16, 0), (torch.float32, 2)])
def test_native_reduce_partials_arguments(num_bias: int, dtype: torch.dtype, code: int) -> None:
    ep = _state(NativeEp)
    partial, starts = torch.randn(6, 16).to(dtype), torch.zeros(5, dtype=torch.int64)
    out, mask, slot = (
        torch.zeros(5, 16, dtype=dtype),
        torch.rand(5, 4) > 0.5,
        torch.zeros(5, 4, dtype=torch.int64),
    )
    bias = tuple(torch.randn(5, 16).to(dtype) for _ in range(num_bias))
    ep.reduce_partials(partial, starts, out, mask, slot, bias, 8, 13)
    b0 = bias[0] if num_bias > 0 else Ptr(0)
    b1 = bias[1] if num_bias > 1 else Ptr(0)
    launch = ep.launchers["ep_combine_recv"]
    assert len(launch.calls) == 2
    for call, (stage, blocks) in enumerate(((0, 1), (1, 132))):
        assert_launch(launch, call, blocks, [
            partial, I64(6), starts, ep.workspace, ep.signals, I64(1 << 20), I64(4608), mask, slot, b0, b1, out,
            I32(5), I32(16), I32(4), I32(1), I32(stage), I32(code), ep.done[3:4], ep.status, U64(13),
            ep.peer_ws, ep.peer_sig, I64((4 << 20) - 32), I32(0), I64(0), I64(0), I32(0), I32(0),
        ])  # fmt: skip


def test_native_reduce_partials_arguments_of_a_zero_copy_expanded_combine() -> None:
    """The sources' launch of an expanded handle's zero-copy combine: mode 2, the tables' offsets, K and
    whether the rows are weighted; the received rows (not the input's expanded rows) bound the table."""
    from lck_ep.native import expanded_tables

    ep = _state(NativeEp)
    x, starts = torch.randn(9, 16).to(torch.bfloat16), torch.zeros(5, dtype=torch.int64)
    out, mask, slot = (
        torch.zeros(5, 16, dtype=torch.bfloat16),
        torch.rand(5, 4) > 0.5,
        torch.zeros(5, 4).long(),
    )
    tables = expanded_tables(12, 32, 20, 3)
    ep.reduce_partials(x, starts, out, mask, slot, (), 8, 13, pull=True, expanded=(tables, 6, 3, False))
    launch = ep.launchers["ep_combine_recv"]
    for call, (stage, blocks) in enumerate(((0, 1), (1, 132))):
        assert_launch(launch, call, blocks, [
            x, I64(6), starts, ep.workspace, ep.signals, I64(1 << 20), I64(4608), mask, slot, Ptr(0), Ptr(0),
            out, I32(5), I32(16), I32(4), I32(1), I32(stage), I32(0), ep.done[3:4], ep.status, U64(13),
            ep.peer_ws, ep.peer_sig, I64((4 << 20) - 32), I32(2), I64(tables.index_offset),
            I64(tables.weights_offset), I32(3), I32(0),
        ])  # fmt: skip


def _compact_handle() -> Any:
    return SimpleNamespace(
        expand=False, recv_expanded_index=None, sync_free=False, recv_counts_device=torch.arange(4),
        recv_starts=torch.arange(5) * 2, num_tokens=5, is_token_in_rank=torch.rand(5, 4) > 0.5,
        send_slot=torch.zeros(5, 4, dtype=torch.int64),
    )  # fmt: skip


@pytest.mark.parametrize("zero_copy", [True, False])
def test_native_zero_copy_combine(monkeypatch: pytest.MonkeyPatch, zero_copy: bool) -> None:
    """combine_input waits and hands out the workspace's start; a combine of that very tensor sends nothing
    and its receiver publishes the rows' places and pulls; any other input (or the same one after another
    operation) is pushed as before."""
    import contextlib

    from lck_ep import _native_exchange
    from lck_ep.checks import CombinePlan

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    ep = _state(NativeEp)
    ep.workspace = torch.zeros(4096, dtype=torch.uint8)
    ep._cache_addresses()
    ep.armed, ep.raise_if_failed = None, lambda: None
    h = _compact_handle()
    y = ep.combine_input(h, 6, 16, torch.bfloat16, 21, 8)
    assert y.shape == (6, 16) and y.dtype == torch.bfloat16 and y.data_ptr() == ep.workspace.data_ptr()
    assert ep.takes_in_place(y, h) and not ep.takes_in_place(y.clone(), h) and ep.aliases_workspace(y)
    launch = ep.launchers["ep_combine_zero_copy"]
    assert_launch(launch, 0, 1, [ep.peer_sig, I32(4), I32(1), ep.status, U64(21)])
    x = y if zero_copy else y.clone()
    buf = SimpleNamespace(_native=ep, device=torch.device("cpu"), hidden=16, num_sms=7, timeout_ns=9)
    out = _native_exchange.combine(buf, CombinePlan(x, h, None, ()))
    assert out.shape == (5, 16) and ep.armed is None  # one combine per combine_input
    recv = ep.launchers["ep_combine_recv"].calls
    assert len(recv) == 2 and all(v[-5] == int(zero_copy) for _, v in recv)
    assert len(ep.launchers["ep_combine_send"].calls) == int(not zero_copy) and len(launch.calls) == 1
    assert combine_input_view_reused(ep, h, y)
    # a rank that received no rows combines in place too (its peers pull): an empty input has no address
    empty = ep.combine_input(h, 0, 16, torch.bfloat16, 21, 8)
    assert empty.shape == (0, 16) and ep.takes_in_place(empty, h) and ep.aliases_workspace(empty)
    assert not ep.aliases_workspace(torch.empty(0, 16, dtype=torch.bfloat16))
    ep.armed = None
    # rows that would reach the table, or a dtype combine does not sum, are not handed out
    assert ep.combine_input(h, 1 << 16, 32, torch.bfloat16, 21, 8) is None
    assert ep.combine_input(h, 6, 16, torch.float8_e4m3fn, 21, 8) is None
    # a member whose own rows would fit still refuses when another member's could not (the bound decides)
    assert ep.combine_input(h, 6, 32, torch.float32, 21, 1 << 16) is None
    assert len(launch.calls) == 3
    # an expanded handle's maps must fit behind the most rows too, even where its rows' view is cached
    from lck_ep.native import expanded_tables

    assert ep.combine_input(h, 6, 16, torch.bfloat16, 21, 8, expanded_tables(8, 32, 1 << 18, 8)) is None
    z = ep.combine_input(h, 6, 16, torch.bfloat16, 21, 8, expanded_tables(8, 32, 16, 8))
    assert z is y and ep.takes_in_place(z, h) and len(launch.calls) == 4


def test_combine_refuses_a_workspace_tensor_combine_input_did_not_hand_out() -> None:
    from lck_ep import Buffer
    from lck_ep.checks import CombinePlan

    ep = _state(NativeEp)
    ep.workspace = torch.zeros(4096, dtype=torch.uint8)
    ep._cache_addresses()
    h, other = _compact_handle(), _compact_handle()
    y = ep.combine_input(h, 6, 16, torch.bfloat16, 21, 8)
    buf = SimpleNamespace(_native=ep)
    Buffer._check_zero_copy(buf, CombinePlan(y, h, None, ()))  # handed out for h: taken in place
    Buffer._check_zero_copy(buf, CombinePlan(y.clone(), h, None, ()))  # a plain tensor: pushed
    for stale in (CombinePlan(y, other, None, ()), CombinePlan(y[1:], h, None, ())):
        with pytest.raises(ValueError, match=r"call combine_input\(handle\) again"):
            Buffer._check_zero_copy(buf, stale)
    ep.armed = None  # as after any other dispatch or combine of the group
    with pytest.raises(ValueError, match="not the input combine_input"):
        Buffer._check_zero_copy(buf, CombinePlan(y, h, None, ()))


def combine_input_view_reused(ep: Any, h: Any, y: torch.Tensor) -> bool:
    """The same shape hands out the same view again (no new tensor per call)."""
    return ep.combine_input(h, 6, 16, torch.bfloat16, 21, 8) is y


def test_hybrid_state_takes_no_zero_copy_input() -> None:
    assert NativeEp.zero_copy_combine and not HybridEp.zero_copy_combine


def test_hybrid_send_partials_arguments() -> None:
    ep, sent = _state(HybridEp), _partials()
    ep.hybrid_launchers = recording_launchers(HYBRID_KINDS)
    ep.plan = lambda num_sms: SimpleNamespace(channels=6)
    ep.options = SimpleNamespace(debug_reorder=True, debug_delay_us=2)
    ep.hybrid_base, ep.g, ep.num_hosts = 4096, 2, 2
    ep.pack, ep.fwd_rows = torch.zeros(16, dtype=torch.uint8), torch.zeros(4, dtype=torch.int32)
    ep.tickets, ep.launches = torch.zeros(4, dtype=torch.int32), {"combine": 0}
    ep._cache_hybrid_addresses()
    ep.send_partials(sent, 5, 11)
    assert ep.launches["combine"] == 1
    assert_launch(ep.hybrid_launchers["combine"], 0, 6, [
        sent.partial, I64(32), I64(6), sent.recv_counts, sent.recv_starts, ep.peer_ws, ep.peer_sig,
        I64(1 << 20), I64(4608), I64(4096), I32(4), I32(1), I32(2), I32(2), I32(6), I32(64), I32(1),
        U64(2000), ep.tickets[2:4], ep.status, U64(11),
    ])  # fmt: skip


def test_native_agreement_exchange_arguments_and_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device agreement: one block, this member's head as 16 arguments (no copy to the device), the
    mailbox's place and slots, the agreement's number (1, 2, ... on every member alike), the output read back
    [W, n] with the status words after it (one copy); a head or vector longer than the kernel or a slot takes
    is refused before anything is launched."""
    ep = _state(NativeEp)
    ep.device = torch.device("cpu")
    ep._mailbox, ep._slot_words, ep._agreements = 7 << 20, 40, 0
    ep._status_word = ep.status_host.numpy()
    # The buffers made on first use, made here on the CPU: the output with the status after it, its host
    # copy and the event.
    ep._agree_out = torch.zeros(4 * 40 + 6, dtype=torch.int64)
    ep._agree_host = torch.zeros(4 * 40 + 6, dtype=torch.int64)
    ep._agree_done = SimpleNamespace(record=lambda stream: None, synchronize=lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    head = list(range(100, 112))
    head_args = [I64(v) for v in head] + [I64(0)] * 4
    launch = ep.launchers["ep_agree"]
    for seq in (1, 2):
        ep._agree_out[4 * 39 : 4 * 39 + 6] = torch.arange(6) * 0  # the status words the kernel would copy
        exchange = ep.agree_start(head, 17, 0, -1, None, 39)  # an exchange without a verdict
        table = exchange.table()
        exchange.settle(False)
        assert table.shape == (4, 39) and table.dtype == torch.int64 and table.device.type == "cpu"
        assert_launch(launch, seq - 1, 1, [
            *head_args, I64(12), I64(39), Ptr(0), I64(0), I64(0), Ptr(0), I64(0), Ptr(0), I64(0), ep.peer_ws,
            I64(7 << 20), I64(40), I32(4), I32(1), U64(seq), ep._agree_out[: 4 * 39 + 6], ep.status, U64(17),
            I32(0), I32(-1),
        ])  # fmt: skip
    # the host reads the status words the kernel wrote after the table: a refusal it recorded there
    ep._agree_out[4 * 12] = 5
    exchange = ep.agree_start(head, 17, 12, 12)
    assert_launch(launch, 2, 1, [
        *head_args, I64(12), I64(12), Ptr(0), I64(0), I64(0), Ptr(0), I64(0), Ptr(0), I64(0), ep.peer_ws,
        I64(7 << 20), I64(40), I32(4), I32(1), U64(3), ep._agree_out[: 4 * 12 + 6], ep.status, U64(17), I32(12),
        I32(12),
    ])  # fmt: skip
    with pytest.raises(RuntimeError, match="differs from the host's"):
        exchange.settle(False)  # the device's refusal, read from the copied status words, against "agreed"
    ep._agree_out.zero_()
    exchange = ep.agree_start(head, 17, 12, 12)
    with pytest.raises(RuntimeError, match="differs from the host's"):
        exchange.settle(True)  # the (recorded, not run) kernel refused nothing
    # a fresh dispatch's: the head, the routing words read by the kernel after it (flag, W + E counts)
    idx = torch.zeros(6, 2, dtype=torch.int64)
    per_rank, per_expert = torch.zeros(4, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    ep.agree_start(head, 17, 12, 12, RoutedCounts(idx, 16, per_rank, per_expert), 12 + 21)
    assert_launch(launch, 4, 1, [
        *head_args, I64(12), I64(33), idx, I64(12), I64(16), per_rank, I64(4), per_expert, I64(16), ep.peer_ws,
        I64(7 << 20), I64(40), I32(4), I32(1), U64(5), ep._agree_out[: 4 * 33 + 6], ep.status, U64(17), I32(12),
        I32(12),
    ])  # fmt: skip
    with pytest.raises(
        ValueError, match="routing's 21 words do not fit the 20 words after the vector's head"
    ):
        ep.agree_start(head, 17, 12, 12, RoutedCounts(idx, 16, per_rank, per_expert), 12 + 20)
    with pytest.raises(ValueError, match="does not fit the agreement mailbox"):
        ep.agree_start(head, 17, 0, -1, None, 40)
    with pytest.raises(ValueError, match="a head of 17 words; the kernel takes at most 16"):
        ep.agree_start(list(range(17)), 17, 0, -1)
    assert len(launch.calls) == 5 and ep._agreements == 5


def test_only_the_scale_up_state_agrees_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from lck_ep.agreement import DEVICE_AGREEMENT, _show

    assert NativeEp.agrees_on_device and not HybridEp.agrees_on_device
    for value, want in (("", True), ("0", False), ("1", True)):
        monkeypatch.setenv("EP_DEVICE_AGREEMENT", value)
        assert native.device_agreement_requested() is want
    monkeypatch.setenv("EP_DEVICE_AGREEMENT", "yes")
    with pytest.raises(ValueError, match="EP_DEVICE_AGREEMENT must be 0 or 1, got 'yes'"):
        native.device_agreement_requested()
    ep = _state(NativeEp)
    for on, signature in ((False, 1), (True, DEVICE_AGREEMENT)):
        ep.device_agreement = on
        assert ep.signature == signature
    # what a Buffer's construction says when ranks differ
    assert _show("native", DEVICE_AGREEMENT) == "nvshmem"
    assert (_show("native", 0), _show("native", 1)) == ("reference", "nvshmem, EP_DEVICE_AGREEMENT=0")


def test_a_buffer_gathers_through_its_native_state_with_its_bound() -> None:
    """What a Buffer hands the agreement (``Buffer._device_gather``): the state's exchange, called the way
    :func:`lck_ep.agreement.start_agreement` calls it, with the Buffer's bound."""
    from lck_ep import Buffer

    calls: list[tuple[Any, ...]] = []
    state = SimpleNamespace(agree_start=lambda *args: calls.append(args) or "exchange")
    gather = Buffer._device_gather(SimpleNamespace(_native=state, timeout_ns=5_000))
    vec = torch.arange(3)
    assert gather(vec, None, 9, 12, -1) == "exchange"
    assert calls == [(vec, 5_000, 12, -1, None, 9)]


def test_a_deferred_verdict_is_read_after_the_launches_and_wins_over_their_errors() -> None:
    """``Buffer._then``: the launches first, then the verdict; a refusal is raised in place of an error the
    refused launches caused, and a launch's own error when the arguments agreed."""
    from lck_ep import Buffer

    order: list[str] = []

    def verdict(refused: bool) -> Any:
        def result() -> None:
            order.append("verdict")
            if refused:
                raise ValueError("ranks disagree")

        return SimpleNamespace(result=result)

    def launch() -> int:
        order.append("launch")
        return 7

    def broken() -> None:
        raise RuntimeError("launch failed")

    assert Buffer._then(verdict(False), launch) == 7 and order == ["launch", "verdict"]
    with pytest.raises(ValueError, match="ranks disagree"):
        Buffer._then(verdict(True), launch)
    with pytest.raises(ValueError, match="ranks disagree"):
        Buffer._then(verdict(True), broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        Buffer._then(verdict(False), broken)


@pytest.mark.parametrize("early", [False, True])
def test_a_fresh_synced_dispatch_sends_before_it_reads_the_counts(
    monkeypatch: pytest.MonkeyPatch, early: bool
) -> None:
    """A fresh synced dispatch on the native backend enqueues the sender (which needs no counts) after its
    agreement and before the host reads the agreement's table, and a small one (``receives_early``) its
    receiving half too; the rest then gets what was launched, the counts the table gave, and the flag word
    and counts in the agreed vector."""
    from lck_ep import Buffer, _native_exchange
    from lck_ep.agreement import Agreement
    from lck_ep.checks import DispatchPlan
    from lck_ep.layout import layout_reference

    order: list[str] = []
    buf = object.__new__(Buffer)
    buf.num_ranks, buf.num_experts, buf.num_local_experts, buf.rank = 2, 4, 2, 1
    buf._native, buf.device = SimpleNamespace(), torch.device("cpu")
    # outputs at capacity: 2 ranks x max_tokens_per_rank rows of 32 + 2 x 12 + 16 bytes
    buf.max_tokens_per_rank = 4 if early else _native_exchange.EARLY_RECEIVE_BYTES // 144 + 1
    buf.early_receive_bytes = _native_exchange.EARLY_RECEIVE_BYTES
    topk_idx = torch.tensor([[0, 3], [2, -1], [1, 1]])
    plan = DispatchPlan(torch.randn(3, 8), topk_idx, None, None, 3, 2, False, 1, 0)
    monkeypatch.setattr(Buffer, "_layout", lambda self, idx: layout_reference(idx, 4, 2))
    # the gathered extra part: [flag, tokens per rank (2), tokens per expert (4)] of ranks 0 and 1
    table = torch.tensor([[0, 2, 3, 1, 0, 2, 2], [0, 2, 2, 1, 2, 1, 1]])

    def agree(self: Any, error: Any, digest: Any, extra: torch.Tensor, flag: Any) -> Any:
        order.append("agree")
        assert error is None and digest == plan.digest()
        assert extra.words().tolist() == [0, 2, 2, 1, 2, 1, 1]  # no entry outside [-1, 4); this rank's layout
        return Agreement(lambda: order.append("table") or table, deferred=True)

    def send(b: Any, p: Any, layout: Any) -> str:
        order.append("send")
        return "sent"

    def receive_early(b: Any, p: Any, layout: Any) -> str:
        order.append("receive_early")
        return "received"

    def dispatch(
        b: Any, p: Any, layout: Any, counts: Any, sent: Any, received: Any, most_expanded: Any
    ) -> tuple[Any, ...]:
        order.append("dispatch")
        assert counts == ([2, 2], [3, 2], [3, 3])  # per local expert: columns 2 and 3
        assert most_expanded is None  # compact: no expanded layout to bound
        assert (sent, received) == ((None, "received") if early else ("sent", None))
        return torch.zeros(5, 8), None, None, None

    monkeypatch.setattr(Buffer, "_agree", agree)
    monkeypatch.setattr(_native_exchange, "send", send)
    monkeypatch.setattr(_native_exchange, "receive_early", receive_early)
    monkeypatch.setattr(_native_exchange, "dispatch", dispatch)
    Buffer._dispatch_synced(buf, plan, None)
    assert order == ["agree", "receive_early" if early else "send", "table", "dispatch"]
    # an entry outside [-1, E) sets the flag word, on either side of the range
    for bad in (4, -2, 1 << 62):
        order.clear()
        idx = topk_idx.clone()
        idx[2, 0] = bad

        def flagged(self: Any, error: Any, digest: Any, extra: torch.Tensor, flag: Any) -> Any:
            assert extra.words()[0].item() == 1
            raise ValueError("refused")

        monkeypatch.setattr(Buffer, "_agree", flagged)
        with pytest.raises(ValueError, match="refused"):
            Buffer._dispatch_synced(buf, DispatchPlan(plan.x, idx, None, None, 3, 2, False, 1, 0), None)
        assert order == []
    # expanded: the most expanded rows on any rank, from every source's counts per expert in the table
    # (totals 3, 1 | 3, 3; at alignment 2 the ranks hold 4 + 2 and 4 + 4 rows)
    got: list[Any] = []

    def expanded(
        b: Any, p: Any, layout: Any, counts: Any, sent: Any, received: Any, most_expanded: Any
    ) -> Any:
        got.append(most_expanded)
        return torch.zeros(5, 8), None, None, None

    monkeypatch.setattr(Buffer, "_agree", lambda self, *args: Agreement(lambda: table, deferred=True))
    monkeypatch.setattr(_native_exchange, "dispatch", expanded)
    monkeypatch.setattr(_native_exchange, "receives_early", lambda b, p: False)
    Buffer._dispatch_synced(buf, DispatchPlan(plan.x, topk_idx, None, None, 3, 2, True, 2, 0), None)
    assert got == [8]


def test_a_synced_dispatch_receives_early_only_when_small_and_compact() -> None:
    """``receives_early``: compact dispatches whose outputs at capacity (``W * max_tokens_per_rank`` rows of
    recv_x and routing) fit the Buffer's ``early_receive_bytes`` (default ``EARLY_RECEIVE_BYTES``); never an
    expanded one; with 0, none."""
    from lck_ep import _native_exchange as nx
    from lck_ep.checks import DispatchPlan

    x = torch.empty(2, 7168, dtype=torch.bfloat16)
    plan = DispatchPlan(x, torch.zeros(2, 8, dtype=torch.int64), None, None, 2, 8, False, 1, 0)
    row = 7168 * 2 + 8 * 12 + 16
    fits = nx.EARLY_RECEIVE_BYTES // (8 * row)  # tokens per rank at 8 ranks

    def buf(tokens_per_rank: int, limit: int = nx.EARLY_RECEIVE_BYTES) -> SimpleNamespace:
        return SimpleNamespace(worst_case_tokens=8 * tokens_per_rank, early_receive_bytes=limit)

    assert nx.receives_early(buf(fits), plan)
    assert not nx.receives_early(buf(fits + 1), plan)
    assert fits >= 128  # DeepSeek-V3's rows at 128 tokens per rank over 8 ranks take this path
    # A Buffer that allows more: 4096 tokens per rank over 8 ranks (about 473 MB at capacity) too.
    assert nx.receives_early(buf(4096, 8 * 4096 * row), plan)
    assert not nx.receives_early(buf(4096, 8 * 4096 * row - 1), plan)
    assert not nx.receives_early(buf(1, 0), plan)  # 0: never
    expanded = DispatchPlan(x, plan.topk_idx, None, None, 2, 8, True, 1, 0)
    assert not nx.receives_early(buf(1, 1 << 40), expanded)


@pytest.mark.parametrize("weights", [False, True])
def test_an_early_synced_dispatch_narrows_its_outputs_to_the_counts(weights: bool) -> None:
    """What ``receive_early`` launched at capacity (here: made up, 2 ranks x 4 rows) comes back from
    ``dispatch`` narrowed to the agreed received count, with a synced handle: the counts as Python ints, the
    per-expert counts from the table, the receiver's starts and slots as launched."""
    from lck_ep import _native_exchange as nx
    from lck_ep.checks import DispatchPlan
    from lck_ep.layout import layout_reference

    cap, k, hidden = 8, 2, 16
    idx = torch.tensor([[0, 3], [2, -1], [1, 1]])
    w = torch.rand(3, k) if weights else None
    plan = DispatchPlan(torch.randn(3, hidden), idx, w, None, 3, k, False, 1, 0)
    layout = layout_reference(idx, 4, 2)
    out: dict[str, Any] = {
        "recv_counts": torch.tensor([3, 2]), "recv_starts": torch.tensor([0, 3, 5]), "num_recv": torch.tensor([5]),
        "recv_src_idx": torch.arange(cap), "recv_topk_idx": torch.arange(cap * k).view(cap, k),
        "recv_topk_weights": torch.rand(cap, k) if weights else None, "recv_src_rank": torch.arange(cap) % 2,
        "slot_pos": torch.arange(2 * 4), "per_expert": None, "kept_per_expert": None,
    }  # fmt: skip
    recv_x, slots = torch.randn(cap, hidden), torch.zeros(3, 2, dtype=torch.int64)
    seq = iter(range(7, 9))
    buf = SimpleNamespace(device=torch.device("cpu"), uid=3, hidden=hidden, _next_seq=lambda: next(seq))
    received = nx.Received(dict(out), recv_x, {}, slots, cap)
    got_x, got_idx, got_w, h = nx.dispatch(buf, plan, layout, ([2, 2], [3, 2], [3, 3]), None, received)
    assert torch.equal(got_x, recv_x[:5]) and got_x.data_ptr() == recv_x.data_ptr()  # a view, no copy
    assert torch.equal(got_idx, out["recv_topk_idx"][:5])
    assert (got_w is None) if not weights else torch.equal(got_w, out["recv_topk_weights"][:5])
    assert torch.equal(h.recv_src_idx, out["recv_src_idx"][:5]) and torch.equal(
        h.recv_src_rank, out["recv_src_rank"][:5]
    )
    assert not h.sync_free and h.num_worst_tokens is None and h.num_recv_rows == 5 and h.num_recv_tokens == 5
    assert h.send_counts == (2, 2) and h.recv_counts == (3, 2) and h.num_recv_tokens_per_expert_list == [3, 3]
    assert (
        h.num_recv_tokens_per_expert.tolist() == [3, 3] and h.num_recv_tokens_per_expert.dtype == torch.int32
    )
    assert h.send_slot is slots and h.recv_starts is out["recv_starts"] and h.seq == 7
