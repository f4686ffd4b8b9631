"""destroy_team, clear_pool, finalize: rejection with retained forwards, invalidation of aliases, reconfiguration."""

from __future__ import annotations

from typing import Any

from _observed import raised

from lck_runtime.testing import run_workers


def _lifecycle(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime.state import STATE

    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    pair = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    out: dict[str, Any] = {"finalize unconfigured": L.finalize()}
    L.configure(
        process_groups={"ep": pair, "solo": singles[rank]},
        flsce=F(8, 8, 8, group="solo"),
        moe=M(8, 8, 2, 1, max_inflight=2, group="ep"),
    )
    m, f = L.moe_context("ep"), L.flsce_context("solo")
    # 1. a retained forward on rank 0 only: destroy and clear are refused on both ranks, nothing changes
    if rank == 0:
        m.push_forward("fwd-0")
    digest = STATE.digest()
    out["destroy refused"] = raised(L.destroy_team, "ep")
    out["clear refused"] = raised(L.clear_pool)
    out["unchanged"] = (STATE.digest() == digest, m.alive, m.inflight, f.alive)
    out["unknown"] = raised(L.destroy_team, "pp")
    # 2. after the backward, destroying the EP team invalidates its context and every alias of it
    if rank == 0:
        assert m.pop_forward() == "fwd-0"
    alias = m
    L.destroy_team(pair)
    out["after destroy"] = (
        alias.alive,
        raised(alias.push_forward, "x"),
        raised(lambda: alias.ranks),
        L.moe_context("ep", required=False),
        f.alive,
        [label for label, _, _ in STATE.pool.plan()],
        sorted(STATE.registry.entries),
    )
    out["destroy again"] = raised(L.destroy_team, "ep")
    # 3. the name stays registered: configuring it again splits a fresh team and context
    L.configure(moe=M(8, 8, 2, 1, max_inflight=2, group="ep"))
    m2 = L.moe_context("ep")
    out["recreated"] = (m2 is not alias, m2.alive, m2.ranks, m2.inflight)
    # 4. clear_pool invalidates every context; capacities may then change
    L.clear_pool()
    out["after clear"] = (
        m2.alive,
        f.alive,
        raised(f.all_reduce_, None, "sum"),
        raised(f.check_tokens, 1),
        STATE.pool.plan(),
        L.flsce_context("solo", required=False),
    )
    L.configure(flsce=F(32, 8, 8, group="solo"))  # larger than before: allowed after the clear
    f2 = L.flsce_context("solo")
    out["bigger"] = (f2.config.max_tokens, f2.alive)
    # 5. finalize invalidates everything and leaves an unconfigured process
    m3_err = raised(L.moe_context, "ep")
    L.finalize()
    out["after finalize"] = (
        f2.alive,
        raised(lambda: f2.capacity),
        L.is_native(),
        L.flsce_context("solo", required=False),
        STATE.configured,
        m3_err,
    )
    out["finalize twice"] = L.finalize()
    # 6. and configure works again, with new names
    out["again"] = L.configure(process_groups={"pair": pair}, flsce=F(8, 8, 8, group="pair"))
    out["again ctx"] = L.flsce_context("pair").ranks
    L.finalize()
    return out


def test_lifecycle_rules() -> None:
    outs = run_workers(_lifecycle, 2, timeout=300)
    for o in outs:
        assert o["finalize unconfigured"] is None
        assert o["destroy refused"].startswith(
            "RuntimeError: destroy_team: MoE contexts still hold retained forwards"
        )
        assert "bootstrap rank 0 (global 0): 1 in the EP partition size×stride 2x1" in o["destroy refused"]
        assert o["clear refused"].startswith(
            "RuntimeError: clear_pool: MoE contexts still hold retained forwards"
        )
        assert o["unknown"].startswith("ValueError: destroy_team: no group named 'pp' is registered")
        alive, push_err, ranks_err, lookup, f_alive, plan, names = o["after destroy"]
        assert alive is False and lookup is None and f_alive is True
        assert push_err.startswith(
            "RuntimeError: MoE context for group 'ep' (ranks (0, 1)) was invalidated by destroy_team()"
        )
        assert "fetch a fresh context with moe_context(group)" in push_err
        assert ranks_err.startswith("RuntimeError: MoE context for group 'ep'")
        assert plan == ["flsce.scratch"] and names == ["ep", "solo"]
        assert "has no team" in o["destroy again"]
        assert o["recreated"] == (True, True, (0, 1), 0)
        m2_alive, f_alive, reduce_err, tokens_err, plan, lookup = o["after clear"]
        assert (m2_alive, f_alive, plan, lookup) == (False, False, [], None)
        assert "invalidated by clear_pool()" in reduce_err and "invalidated by clear_pool()" in tokens_err
        assert o["bigger"] == (32, True)
        f2_alive, cap_err, native, lookup, configured, m3_err = o["after finalize"]
        assert (f2_alive, native, lookup, configured) == (False, False, None, False)
        assert "invalidated by finalize()" in cap_err
        assert m3_err.startswith("ValueError: moe_context(group): no MoE context for group 'ep'")
        assert o["finalize twice"] is None
        assert o["again"] is False and o["again ctx"] == (0, 1)
    assert outs[0]["destroy refused"] == outs[1]["destroy refused"]
    assert outs[0]["clear refused"] == outs[1]["clear refused"]
