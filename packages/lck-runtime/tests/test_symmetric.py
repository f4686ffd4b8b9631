"""Symmetric reservations: the pool's rules, and the bootstrap-wide order of NVSHMEM collectives.

The order test runs the native branches of configure and the lifecycle calls over gloo with a
recorder in place of nvshmem4py (the real library needs GPUs: tests/test_nvshmem_gpu.py). NVSHMEM
splits, allocations and frees are collectives over every PE, so the contract checked here is that
every rank issues exactly the same sequence of them, whatever its group memberships.
"""

from __future__ import annotations

from typing import Any

import pytest

from lck_runtime.p2p import LL_SLOT
from lck_runtime.symmetric import SymmetricPool
from lck_runtime.testing import run_workers


def test_pool_reuse_release_and_order() -> None:
    pool = SymmetricPool()
    s = pool.ensure_scratch(1000, None)
    assert s.numel == 1024 and s.tensor is None and pool.ensure_scratch(1024, None) is s
    with pytest.raises(RuntimeError, match="growth must be rejected before reserving"):
        pool.ensure_scratch(2000, None)
    w = pool.reserve("moe.workspace", 4096, "uint8", None)
    g = pool.reserve("moe.signals", 64, "int64", None)
    assert pool.plan() == [
        ("flsce.scratch", 1024, "float32"),
        ("moe.workspace", 4096, "uint8"),
        ("moe.signals", 64, "int64"),
    ]
    assert pool.nbytes == 1024 * 4 + 4096 + 64 * 8
    pool.release(w, None)
    pool.release(w, None)  # idempotent
    assert [r.label for r in pool.reservations] == ["flsce.scratch", "moe.signals"] and not w.alive
    pool.release_all(None)
    assert pool.plan() == [] and pool.scratch is None and not s.alive and not g.alive
    with pytest.raises(ValueError, match="dtype must be one of"):
        pool.reserve("x", 4, "float16", None)
    with pytest.raises(ValueError, match="numel must be >= 1"):
        pool.reserve("x", 0, "uint8", None)


def _order(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime import fake_nvshmem
    from lck_runtime.state import STATE

    rec = fake_nvshmem.install(rank, world)

    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    ep = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    solo = [dist.new_group([r]) for r in range(world)][rank]
    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    out: dict[str, Any] = {}
    out["native"] = L.configure(
        process_groups={"tp": tp, "ep": ep, "solo": solo},
        flsce=F(16, 8, 8, group="tp"),
        moe=M(8, 16, 4, 2, max_inflight=2, group="ep"),
    )
    out["is_native"] = L.is_native()
    L.configure(flsce=F(8, 8, 8, group="ep"), moe=M(8, 16, 4, 2, group="solo"))
    L.configure(flsce=F(16, 8, 8, group="tp"))  # a repeat: no split, no allocation
    m = L.moe_context("ep")
    out["ctx"] = (m.native, m.team is not None, m.workspace.numel(), m.peer_signals(1).numel())
    out["handles"] = sorted((key, t.handle is not None) for key, t in STATE.teams.by_partition.items())
    L.destroy_team("ep")
    L.configure(moe=M(8, 16, 4, 2, group="ep"))
    L.clear_pool()
    L.configure(flsce=F(32, 8, 8, group="solo"))
    L.finalize()
    out["calls"] = rec.calls
    return out


# A MoEConfig(8, 16, 4, 2) workspace: W members x 8 tokens x 64-byte rows, then the agreement mailbox (2 sets x W
# slots x (1 + 32 + W + 4 experts) int64).
EP_WS = 2 * 8 * 64 + 2 * 2 * (1 + 32 + 2 + 4) * 8
SOLO_WS = 8 * 64 + 2 * 1 * (1 + 32 + 1 + 4) * 8


def test_every_rank_issues_the_same_collective_sequence() -> None:
    outs = run_workers(_order, 4, timeout=300)
    calls = outs[0]["calls"]
    for rank, o in enumerate(outs):
        assert o["native"] is True and o["is_native"] is True
        assert o["ctx"] == (True, True, EP_WS, 2 * 32)
        assert o["handles"] == [((1, 1), True), ((2, 1), True), ((2, 2), True)]
        assert o["calls"] == calls, f"rank {rank} issued a different NVSHMEM collective sequence"
    tp_splits = [("split", 0, 1, 2), ("split", 2, 1, 2)]
    ep_splits = [("split", 0, 2, 2), ("split", 1, 2, 2)]
    solo_splits = [("split", r, 1, 1) for r in range(4)]
    scratch = ("alloc", 128, "torch.float32")
    ep_ws, ep_sig = ("alloc", EP_WS, "torch.uint8"), ("alloc", 64, "torch.int64")
    solo_ws, solo_sig = ("alloc", SOLO_WS, "torch.uint8"), ("alloc", 32, "torch.int64")
    # The one-shot all-reduce of each FLSCE context of two members: receive area (2 parities x 2 members x
    # one 1024-float slot), flags (2 members x 128 blocks), low-latency area (2 x 2 x LL_SLOT words).
    p2p = [
        ("alloc", 2 * 2 * 1024, "torch.float32"),
        ("alloc", 2 * 128, "torch.int64"),
        ("alloc", 2 * 2 * LL_SLOT, "torch.int64"),
    ]
    p2p_free = [("free", n, dtype) for _, n, dtype in p2p]
    expected = [
        *tp_splits, scratch, *p2p, *ep_splits, ep_ws, ep_sig,  # first configure: flsce(tp), moe(ep)
        *p2p, *solo_splits, solo_ws, solo_sig,  # second: flsce(ep) reuses team and scratch; moe(solo)
        *p2p_free, ("free", EP_WS, "torch.uint8"), ("free", 64, "torch.int64"),  # destroy ep: flsce, moe
        ("destroy_team",),
        *ep_splits, ep_ws, ep_sig,  # moe(ep) again
        ("free", 64, "torch.int64"), ("free", EP_WS, "torch.uint8"),  # clear_pool, newest first
        ("free", 32, "torch.int64"), ("free", SOLO_WS, "torch.uint8"),
        *reversed(p2p_free), ("free", 128, "torch.float32"),
        ("alloc", 256, "torch.float32"),  # a larger scratch after the clear (solo: no one-shot buffers)
        ("free", 256, "torch.float32"), ("destroy_team",), ("destroy_team",), ("destroy_team",), ("finalize",),
    ]  # fmt: skip
    assert calls == expected


def _heap(rank: int, world: int) -> dict:
    """NVSHMEM's heap is fixed at its init: the first configure sizes it (or checks the user's size) and a
    later section that does not fit is refused on every rank before anything changes."""
    import importlib
    import os

    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime import fake_nvshmem
    from lck_runtime import nvshmem as nv
    from lck_runtime.state import STATE

    rec = fake_nvshmem.install(rank, world)
    inits: list[dict] = []
    fake_init = nv.NvshmemOwner.init

    def init(cls: Any, uid: bytes, **kw: Any) -> Any:  # what NVSHMEM would read at its init
        inits.append({k: os.environ.get(k) for k in ("NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_DISABLE_NVLS")})
        return fake_init(uid, **kw)

    nv.NvshmemOwner.init = classmethod(init)
    C = importlib.import_module("lck_runtime.configure")  # the module (the package exports the function)
    planned: list = []  # (label, bytes) of each call's plan
    plan_of = C.planned_reservations

    def record_plan(*a: Any) -> Any:
        specs = plan_of(*a)
        planned.append([(r.label, r.nbytes) for r in specs])
        return specs

    C.planned_reservations = record_plan

    def err(fn: Any, **kw: Any) -> str:
        try:
            fn(**kw)
        except ValueError as exc:
            return str(exc)
        raise AssertionError("did not raise")

    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    solo = [dist.new_group([r]) for r in range(world)][rank]
    every = dist.new_group(list(range(world)))
    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    moe = M(max_tokens=1024, hidden_size=4084, num_experts=4, top_k=2, group="tp")  # 8 MiB per member
    first = {"process_groups": {"tp": tp}, "flsce": F(64, 32, 64, group="tp"), "moe": moe}
    out: dict[str, Any] = {}
    os.environ.pop("NVSHMEM_DISABLE_NVLS", None)
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = "260M"  # below 256 MiB of NVSHMEM state + 16 MiB workspace
    out["too small"] = err(L.configure, **first)
    out["after too small"] = (STATE.configured, len(inits), len(rec.calls))
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = "300M"
    L.configure(**first)
    out["env at init"] = inits
    out["heap"] = STATE.heap_bytes
    out["reserved as planned"] = [(r.label, r.nbytes) for r in STATE.pool.reservations] == planned[-1]
    out["planned"] = planned[-1]
    digest, calls = STATE.digest(), len(rec.calls)
    # A second EP section over all four ranks needs 32 MiB more: beyond what the 300 MiB heap has left.
    out["no room"] = err(L.configure, process_groups={"all": every}, moe=M(1024, 4084, 4, 2, group="all"))
    out["unchanged"] = STATE.digest() == digest and len(rec.calls) == calls
    L.configure(process_groups={"solo": solo}, flsce=F(64, 32, 64, group="solo"))  # reuses the scratch
    out["solo planned"] = planned[-1]
    L.finalize()
    return out


def test_heap_is_sized_at_init_and_later_sections_must_fit() -> None:
    from lck_runtime import nvshmem as nv

    outs = run_workers(_heap, 4, timeout=300)
    mib = 1 << 20
    for rank, o in enumerate(outs):
        assert o == {**outs[0], "env at init": o["env at init"]}, f"rank {rank} saw something else"
        assert "NVSHMEM_SYMMETRIC_SIZE is set" in o["too small"] and "at least" in o["too small"]
        assert o["after too small"] == (False, 0, 0), "a refused first configure initialised or split"
        # NVSHMEM reads its environment at init: lck's defaults must be in place by then.
        assert o["env at init"] == [{"NVSHMEM_SYMMETRIC_SIZE": "300M", "NVSHMEM_DISABLE_NVLS": "1"}]
        assert o["heap"] == 300 * mib and o["reserved as planned"]
        labels = [label for label, _ in o["planned"]]
        assert labels == [
            "flsce.scratch", "flsce[2x1].p2p", "flsce[2x1].p2p_flags", "flsce[2x1].p2p_ll",
            "moe[2x1].workspace", "moe[2x1].signals",
        ]  # fmt: skip
        # 2 members x 1024 rows of 4096 bytes, then the agreement mailbox (2 sets x 2 slots x 39 int64)
        assert dict(o["planned"])["moe[2x1].workspace"] == 2 * 8 * mib + 2 * 2 * (1 + 32 + 2 + 4) * 8
        assert "moe[4x1].workspace 32.0 MiB" in o["no room"] and "nothing was changed" in o["no room"]
        assert "sized by the first configure" in o["no room"] and o["unchanged"]
        assert o["solo planned"] == []
    # Without a user setting, the first configure asks for room for everything it reserves.
    need = sum(b for _, b in outs[0]["planned"])
    assert (
        nv.heap_for(need, 6) == 1 << 30
        and nv.heap_for(2 << 30, 6) == (2 << 30) + 6 * nv.ALLOC_MARGIN + nv.HEAP_SLACK
    )
