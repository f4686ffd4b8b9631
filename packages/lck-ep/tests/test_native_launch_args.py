"""The native and hybrid sending launches pass their kernels' arguments in the order the CUDA signatures take
(dispatch.cuh's and combine.cuh's send kernels, hybrid_common.cuh's), on the CPU: the kernels are recorded,
not run. Guards the Python plumbing between the exchange and the launches (``OutgoingRows``,
``OutgoingPartials``, ``NativeEp.partials_args``), which the GPU tests only see as a wrong answer or a hang.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from lck_ep._hybrid_exchange import HybridEp
from lck_ep.native import NativeEp, OutgoingPartials, OutgoingRows, meta_offset
from lck_runtime.jit import I32, I64, U64, Ptr


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, list[Any]]] = []

    def launch(self, blocks: int, threads: int, args: list[Any]) -> None:
        self.calls.append((blocks, threads, args))


def _key(a: Any) -> Any:
    # Views made per call (``done[0:1]``) are new objects: compare tensors by storage, offset and shape.
    if isinstance(a, torch.Tensor):
        return ("tensor", a.data_ptr(), tuple(a.shape))
    return a


def _same(got: list[Any], want: list[Any]) -> None:
    assert [_key(a) for a in got] == [_key(a) for a in want]


def _state(cls: type) -> Any:
    ep = object.__new__(cls)  # no context, no GPU: only what the launches read
    ep.layout = SimpleNamespace(region_bytes=1 << 20, row_stride=4608, cap=64)
    ep.peer_ws, ep.peer_sig = torch.arange(4), torch.arange(4) + 10
    ep.size, ep.me = 4, 1
    ep.done, ep.status = torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    ep.kernels = {"ep_dispatch_send": _Recorder(), "ep_combine_send": _Recorder()}
    return ep


def _rows(routed: bool) -> OutgoingRows:
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    mask = torch.rand(5, 4) > 0.5
    slot, rows_to = torch.randint(0, 5, (5, 4)), torch.randint(0, 5, (4,))
    idx = torch.randint(0, 8, (5, 2)) if routed else None
    w = torch.rand(5, 2) if routed else None
    return OutgoingRows(x, mask, slot, rows_to, idx, w)


def test_native_send_rows_arguments() -> None:
    for routed in (True, False):
        ep, sent = _state(NativeEp), _rows(routed)
        ep.send_rows(sent, 3, 7, 9)
        (blocks, _, args), *_ = ep.kernels["ep_dispatch_send"].calls
        x = sent.x
        assert blocks == 7
        _same(args, [
            x, I64(32), sent.topk_idx if routed else Ptr(0), sent.topk_weights if routed else Ptr(0),
            sent.mask, sent.send_slot, sent.rows_to, ep.peer_ws, ep.peer_sig, I64(1 << 20), I64(4608),
            I64(meta_offset(32)), I32(5), I32(2 if routed else 0), I32(4), I32(1), I32(3), ep.done[0:1],
            ep.status, U64(9),
        ])  # fmt: skip


def _partials() -> OutgoingPartials:
    return OutgoingPartials(torch.randn(6, 16, dtype=torch.bfloat16), torch.arange(4), torch.arange(4) * 2)


def test_native_send_partials_arguments() -> None:
    ep, sent = _state(NativeEp), _partials()
    ep.send_partials(sent, 5, 11)
    (blocks, _, args), *_ = ep.kernels["ep_combine_send"].calls
    assert blocks == 5
    _same(args, [
        sent.partial, I64(32), I64(6), sent.recv_counts, sent.recv_starts, ep.peer_ws, ep.peer_sig,
        I64(1 << 20), I64(4608), I32(4), I32(1), ep.done[2:3], ep.status, U64(11),
    ])  # fmt: skip


def test_hybrid_send_partials_arguments() -> None:
    ep, sent = _state(HybridEp), _partials()
    ep.hybrid_kernels = {"combine": _Recorder()}
    ep.plan = lambda num_sms: SimpleNamespace(channels=6)
    ep.options = SimpleNamespace(debug_reorder=True, debug_delay_us=2)
    ep.hybrid_base, ep.g, ep.num_hosts = 4096, 2, 2
    ep.tickets, ep.launches = torch.zeros(4, dtype=torch.int64), {"combine": 0}
    ep.send_partials(sent, 5, 11)
    (blocks, _, args), *_ = ep.hybrid_kernels["combine"].calls
    assert blocks == 6 and ep.launches["combine"] == 1
    _same(args, [
        sent.partial, I64(32), I64(6), sent.recv_counts, sent.recv_starts, ep.peer_ws, ep.peer_sig,
        I64(1 << 20), I64(4608), I64(4096), I32(4), I32(1), I32(2), I32(2), I32(6), I32(64), I32(1),
        U64(2000), ep.tickets[2:4], ep.status, U64(11),
    ])  # fmt: skip
