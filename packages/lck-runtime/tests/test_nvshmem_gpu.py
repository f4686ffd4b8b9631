"""The NVSHMEM path on real GPUs: bring-up, teams of two partitions, symmetric memory, all_reduce_, lifecycle.

Each test spawns NCCL processes (one GPU each) through ``run_workers`` and returns what every rank
saw; assertions run here with messages that say which rank saw what. Every worker finalizes in a
``finally`` so a failing check does not leave NVSHMEM up at process exit.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from lck_runtime.testing import SINGLE_HOST_NVSHMEM_ENV, error_text, run_workers

# The single-host settings; the bring-up test leaves them unset to check that configure applies them.
NVSHMEM_ENV = SINGLE_HOST_NVSHMEM_ENV
TIMEOUT = 240  # a hang fails the test well inside a device stage
SEED = 20261130


def _rand(rank: int, case: int, numel: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(SEED + 7919 * case + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float32) * 4.0).cuda()


def _check_reduce(ctx: Any, case: int, numel: int, op: str) -> float:
    """all_reduce_ a fresh random tensor; return the max abs error against a float64 reference."""
    import torch

    t = _rand(_global_rank(), case, numel)
    ref = torch.stack([_rand(r, case, numel).double() for r in ctx.ranks])
    ref = ref.sum(0) if op == "sum" else ref.amax(0)
    out = ctx.all_reduce_(t, op)
    assert out is t
    torch.cuda.synchronize()
    if not torch.isfinite(t).all():
        return float("inf")
    return float((t.double() - ref).abs().max())


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _bring_up(rank: int, world: int, preset: dict[str, str | None]) -> dict:
    import nvshmem.core as core
    import torch
    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime import nvshmem as nv
    from lck_runtime.state import STATE

    out: dict[str, Any] = {"status before": int(core.init_status())}
    pair = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    try:
        out["native"] = L.configure(
            process_groups={"tp2": pair, "tp1": singles[rank]},
            flsce=F(max_tokens=512, hidden_size=256, local_vocab_size=1024, group="tp2"),
            moe=M(max_tokens=64, hidden_size=128, num_experts=4, top_k=2, max_inflight=2, group="tp2"),
        )
        L.configure(flsce=F(max_tokens=256, hidden_size=256, local_vocab_size=1024, group="tp1"))
        out["is_native"] = L.is_native()
        st = nv.status()
        out["status"] = (st["init_status"], st["owned_by_lck"], st.get("n_pes"), st.get("my_pe"))
        out["applied"] = st.get("applied_env", {})
        out["env after"] = {k: os.environ.get(k) for k in preset}
        f2, f1, m = L.flsce_context("tp2"), L.flsce_context("tp1"), L.moe_context("tp2")
        # teams of two partitions: size 2 (both GPUs) and size 1 (each GPU alone)
        out["teams"] = [
            (c.native, c.team is not None, core.team_n_pes(c.team), core.team_my_pe(c.team), c.size, c.rank)
            for c in (f2, f1, m)
        ]
        out["same team for tp2"] = f2.team == m.team
        out["plan"] = STATE.pool.plan()
        scratch = f2.scratch
        out["scratch"] = (
            scratch.device.type,
            scratch.dtype == torch.float32,
            scratch.numel(),
            f1.scratch is scratch,
        )
        # symmetric memory written by rank 0 is visible through rank 1's peer view (and back)
        ws, sig = m.workspace, m.signals
        out["workspace"] = (ws.dtype == torch.uint8, ws.numel(), sig.dtype == torch.int64, sig.numel())
        pattern = (torch.arange(ws.numel(), device=ws.device) * 7 + 3).to(torch.uint8)
        if rank == 0:
            ws.copy_(pattern)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            out["peer read"] = bool(torch.equal(m.peer_workspace(0), pattern))
            m.peer_signals(0)[:4].copy_(torch.tensor([11, 22, 33, 44], device=sig.device))
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            out["peer write"] = sig[:4].tolist()
        # all_reduce_: float64 reference, sizes that need one and two scratch chunks, both ops
        errs: dict[str, float] = {}
        case = 0
        for ctx, name in ((f2, "tp2"), (f1, "tp1")):
            for numel in (1, 1000, ctx.capacity // 2 + 1, ctx.capacity):
                for op in ("sum", "max"):
                    case += 1
                    key = f"{name}/{op}"
                    errs[key] = max(errs.get(key, 0.0), _check_reduce(ctx, case, numel, op))
        # back to back with fresh data: a reused scratch must never leak an earlier call's values
        for i in range(40):
            case += 1
            op = "sum" if i % 3 else "max"
            numel = (1, 4099, f2.capacity)[i % 3]
            errs[f"stress/{op}"] = max(errs.get(f"stress/{op}", 0.0), _check_reduce(f2, case, numel, op))
        out["errors"] = errs
        # a second stream: the shared scratch orders itself after the first stream's use
        side = torch.cuda.Stream()
        case += 1
        with torch.cuda.stream(side):
            errs["side stream"] = _check_reduce(f2, case, 4096, "sum")
        out["validation"] = (
            error_text(f2.all_reduce_, torch.ones(4), "sum"),  # CPU tensor on the native path
            error_text(f2.all_reduce_, torch.ones(f2.capacity + 1, device="cuda"), "sum"),
        )
    finally:
        aliases = [L.flsce_context("tp2", required=False), L.moe_context("tp2", required=False)]
        L.finalize()
    out["after finalize"] = (
        L.is_native(),
        [a is not None and a.alive for a in aliases],
        error_text(lambda: aliases[0].all_reduce_(torch.ones(4, device="cuda"), "sum")),
        nv.status()["owned_by_lck"],
    )
    return out


@pytest.mark.multigpu(2)
def test_bring_up_teams_symmetric_memory_all_reduce_finalize() -> None:
    # Leave lck's single-host defaults unset (unless the machine sets them) to check configure applies them.
    preset = {k: os.environ.get(k) for k in NVSHMEM_ENV if k.startswith("NVSHMEM_")}
    env = {"LCK_SETUP_TIMEOUT": "120"}
    outs = run_workers(_bring_up, 2, preset, backend="nccl", timeout=TIMEOUT, env=env)
    for rank, o in enumerate(outs):
        where = f"rank {rank}: {o}"
        assert o["status before"] == 0, where
        assert o["native"] is True and o["is_native"] is True, where
        assert o["status"][0] >= 2 and o["status"][1:] == (True, 2, rank), where
        for key, value in preset.items():
            assert o["env after"][key] is not None, (key, where)
            assert (key in o["applied"]) == (value is None), (key, o["applied"], where)
        assert o["teams"][0] == (True, True, 2, rank, 2, rank), where
        assert o["teams"][1] == (True, True, 1, 0, 1, 0), where
        assert o["teams"][2] == (True, True, 2, rank, 2, rank), where
        assert o["same team for tp2"], where
        assert [label for label, _, _ in o["plan"]] == [
            "flsce.scratch",
            "flsce[2x1].p2p",  # the one-shot all-reduce of the TP2 context (none for the teams of one)
            "flsce[2x1].p2p_flags",
            "flsce[2x1].p2p_ll",
            "moe[2x1].workspace",
            "moe[2x1].signals",
        ]
        assert o["scratch"] == ("cuda", True, 512 * 256, True), where
        assert o["workspace"] == (True, 2 * 64 * 288, True, 2 * 32), where
        for key, err in o["errors"].items():
            limit = 0.0 if key.endswith("max") else 1e-4  # fp32 sum of 2 values of magnitude ~16
            assert err <= limit, f"rank {rank}: all_reduce_ {key}: max abs error {err} > {limit}"
        cpu_err, size_err = o["validation"]
        assert cpu_err.startswith("ValueError: all_reduce_: t must be on cuda:"), where
        assert "more than the context's capacity" in size_err, where
        native, alive, use_err, owned = o["after finalize"]
        assert (native, alive, owned) == (False, [False, False], False), where
        assert "invalidated by finalize()" in use_err, where
    assert outs[0]["plan"] == outs[1]["plan"]
    assert outs[1]["peer read"] is True, "rank 1 did not read rank 0's workspace through its peer view"
    assert outs[0]["peer write"] == [11, 22, 33, 44], "rank 0 did not see rank 1's store into its signals"


def _lifecycle(rank: int, world: int) -> dict:
    import nvshmem.core as core
    import torch
    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime.state import STATE

    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    pair = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    out: dict[str, Any] = {}
    try:
        L.configure(
            process_groups={"ep": pair, "solo": singles[rank]},
            flsce=F(128, 64, 64, group="ep"),
            moe=M(32, 64, 2, 1, max_inflight=2, group="ep"),
        )
        L.configure(moe=M(32, 64, 2, 1, group="solo"))
        m, ms = L.moe_context("ep"), L.moe_context("solo")
        if rank == 1:
            m.push_forward(("fwd", torch.ones(2, device="cuda")))
        out["refused"] = (error_text(L.destroy_team, "ep"), error_text(L.clear_pool), m.alive, m.inflight)
        if rank == 1:
            m.pop_forward()
        old_team = m.team
        L.destroy_team("ep")
        out["destroyed"] = (m.alive, error_text(m.peer_workspace, 0), L.flsce_context("ep", required=False))
        out["solo intact"] = (ms.alive, core.team_n_pes(ms.team))
        out["plan after destroy"] = [label for label, _, _ in STATE.pool.plan()]
        L.configure(flsce=F(128, 64, 64, group="ep"), moe=M(32, 64, 2, 1, group="ep"))
        f, m2 = L.flsce_context("ep"), L.moe_context("ep")
        out["recreated"] = (m2.alive, core.team_n_pes(m2.team), m2.team == f.team, old_team is not None)
        out["reduce after recreate"] = _check_reduce(f, 1, f.capacity, "sum")
        L.clear_pool()
        out["cleared"] = (f.alive, m2.alive, ms.alive, STATE.pool.plan())
        L.configure(flsce=F(256, 64, 64, group="ep"))  # larger than before the clear
        f3 = L.flsce_context("ep")
        out["reduce after clear"] = _check_reduce(f3, 2, f3.capacity, "max")
    finally:
        L.finalize()
    # bring NVSHMEM up again in the same process and use it
    try:
        out["reinit"] = L.configure(process_groups={"pair": pair}, flsce=F(64, 64, 64, group="pair"))
        out["reduce after reinit"] = _check_reduce(L.flsce_context("pair"), 3, 4096, "sum")
    except Exception as exc:  # reported with the checks above instead of replacing them
        out["reinit"] = f"{type(exc).__name__}: {exc}"
    finally:
        L.finalize()
    return out


@pytest.mark.multigpu(2)
def test_native_lifecycle_destroy_clear_reinit() -> None:
    outs = run_workers(_lifecycle, 2, backend="nccl", timeout=TIMEOUT, env=NVSHMEM_ENV)
    for rank, o in enumerate(outs):
        where = f"rank {rank}: {o}"
        d_err, c_err, alive, inflight = o["refused"]
        assert d_err.startswith("RuntimeError: destroy_team: MoE contexts still hold retained forwards"), (
            where
        )
        assert "bootstrap rank 1" in d_err and c_err.startswith("RuntimeError: clear_pool:"), where
        assert alive is True and inflight == (1 if rank == 1 else 0), where
        alive, peer_err, lookup = o["destroyed"]
        assert alive is False and lookup is None and "invalidated by destroy_team()" in peer_err, where
        assert o["solo intact"] == (True, 1), where
        assert o["plan after destroy"] == ["flsce.scratch", "moe[1x1].workspace", "moe[1x1].signals"], where
        assert o["recreated"] == (True, 2, True, True), where
        assert o["reduce after recreate"] <= 1e-4, where
        assert o["cleared"] == (False, False, False, []), where
        assert o["reduce after clear"] == 0.0, where
        assert o["reinit"] is True, f"rank {rank}: configure after finalize: {o['reinit']}"
        assert o["reduce after reinit"] <= 1e-4, where


def _disabled(rank: int, world: int) -> dict:
    import warnings

    import lck_runtime as L

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        native = L.configure(flsce=L.FusedLinearCrossEntropyConfig(64, 64, 64))
    try:
        ctx = L.flsce_context()
        err = _check_reduce(ctx, 5, ctx.capacity, "sum")
        return {
            "native": native,
            "ctx native": ctx.native,
            "err": err,
            "warnings": [str(w.message) for w in caught],
        }
    finally:
        L.finalize()


@pytest.mark.multigpu(2)
def test_disabled_nvshmem_uses_nccl() -> None:
    outs = run_workers(
        _disabled, 2, backend="nccl", timeout=TIMEOUT, env={**NVSHMEM_ENV, "LCK_DISABLE_NVSHMEM": "1"}
    )
    for o in outs:
        assert o["native"] is False and o["ctx native"] is False
        assert o["err"] <= 1e-4
        assert any("LCK_DISABLE_NVSHMEM is set" in w for w in o["warnings"]), o["warnings"]


def _single(rank: int, world: int) -> dict:
    import torch

    import lck_runtime as L

    try:
        native = L.configure(
            flsce=L.FusedLinearCrossEntropyConfig(64, 64, 64),
            moe=L.MoEConfig(16, 64, 2, 2),
        )
        f, m = L.flsce_context(), L.moe_context()
        t = torch.randn(1000, device="cuda")
        before = t.clone()
        f.all_reduce_(t, "sum")  # a one-member group: the identity
        view = m.peer_workspace(0)  # this PE's own copy, through nvshmem_ptr
        view[:8].copy_(torch.arange(8, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        return {
            "native": native,
            "identity": bool(torch.equal(t, before)),
            "self view": m.workspace[:8].tolist(),
            "sizes": (f.scratch.numel(), m.workspace.numel()),
        }
    finally:
        L.finalize()


@pytest.mark.gpu
def test_single_gpu_native_bring_up() -> None:
    (o,) = run_workers(_single, 1, backend="nccl", timeout=TIMEOUT, env=NVSHMEM_ENV)
    assert o["native"] is True
    assert o["identity"] is True
    assert o["self view"] == list(range(8))
    assert o["sizes"] == (64 * 64, 1 * 16 * 160)  # one member × 16 tokens × (64 bf16 + 2 × 12) → 160 B rows


def _foreign(rank: int, world: int) -> dict:
    import nvshmem.core as core
    import torch
    from cuda.core import Device

    import lck_runtime as L

    dev = Device(torch.cuda.current_device())
    dev.set_current()
    core.init(device=dev, uid=core.get_unique_id(), rank=0, nranks=1, initializer_method="uid")
    try:
        return {
            "error": error_text(L.configure, flsce=L.FusedLinearCrossEntropyConfig(8, 8, 8)),
            "is_native": L.is_native(),
        }
    finally:
        core.finalize()


@pytest.mark.gpu
def test_foreign_nvshmem_init_is_rejected() -> None:
    (o,) = run_workers(_foreign, 1, backend="nccl", timeout=TIMEOUT, env=NVSHMEM_ENV)
    assert o["error"].startswith("RuntimeError: configure: NVSHMEM is already initialised in this process"), o
    assert "lck did not start it" in o["error"] and o["is_native"] is False
