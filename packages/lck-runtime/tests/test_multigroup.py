"""Several TP and EP partitions of different sizes at once, on 2, 4 and 8 ranks: one scenario, two transports.

``_scenario(rank, world, backend_kind)`` is written once and runs

- over gloo on CPU (``backend_kind="gloo"``: the torch.distributed paths, ``configure`` returns False),
  with 2, 4 and 8 processes;
- over NCCL with real NVSHMEM (``backend_kind="nvshmem"``, ``multigpu(2)`` / ``multigpu(4)`` /
  ``multigpu(8)``: one H200 per process, ``configure`` returns True and every context is native);
- with real NVSHMEM on one or two GPUs for 4 and 8 ranks (``test_multigroup_nvshmem_shared_gpus``: the
  ranks round-robin over the GPUs with ``LCK_NVSHMEM_SHARED_GPUS=1`` under a CUDA MPS server,
  ``MPS=1 bash ci/device.sh``; torch.distributed over gloo since NCCL refuses two ranks on one GPU),
  where 4- and 8-GPU machines are not at hand.

Layouts (names of the process groups; every group is a uniform strided partition of WORLD):

- 8 ranks: TP2 × EP4 and TP4 × EP2 at once: ``tp2`` {0,1} {2,3} …, ``ep4`` {0,2,4,6} {1,3,5,7},
  ``tp4`` {0..3} {4..7}, ``ep2`` {0,4} {1,5} {2,6} {3,7};
- 4 ranks: TP2 × EP2 and TP4/EP4: ``tp2`` {0,1} {2,3}, ``ep2`` {0,2} {1,3}, ``tp4`` = ``ep4`` = {0..3}
  (two names, two ProcessGroup objects, one partition: they share their team and contexts);
- 2 ranks (the most a 2-GPU machine holds): ``tp2`` = ``ep2`` = {0,1} and ``tp1`` = ``ep1`` = {0} {1}: both
  layouts share a partition between their TP and EP names, so destroying either EP team takes a TP
  context with it (re-created before the final checks). Each half of the world is one rank, so the
  non-WORLD bootstrap domains hold one PE each.

Phase "world" (bootstrap domain WORLD): three ``configure`` calls with partial cache hits (repeated
sections and names reuse contexts and reservations, equivalent groups share a context, growth is
rejected with nothing changed), retained forwards pushed on the first EP context, then work on the
other contexts (all_reduce_ on both TP contexts, push/pop on the other EP context, destroy and
re-create of the second TP partition's team), ``destroy_team`` refused while the forwards are
retained, LIFO pops, then destroy and re-create of the first EP team and use of the new context, then
``finalize``. Phase "halves" (a non-WORLD bootstrap domain): each half of the world configures its
own domain with its own TP/EP partitions and FLSCE context on the bootstrap group, checks that its
contexts span its half only (global ranks, NVSHMEM PEs local to the half), reduces, retains and pops,
and finalizes. On NVSHMEM both phases also check every context's team through nvshmem4py
(``team_n_pes``/``team_my_pe``), every MoE context's peer views (workspace reads, signal stores) and
every FLSCE context's ``all_reduce_``.

Workers only observe (the same collective sequence runs on every rank whatever the values); the
assertions run here, naming the rank and the phase.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest

from lck_runtime.testing import SHARED_GPU_SKIP, error_text, mps_daemon_running, run_workers, shared_gpu_env

# Partition (size, stride) of each named group, in configure order: first layout (tpA, epA), second (tpB, epB).
LAYOUTS: dict[int, dict[str, tuple[int, int]]] = {
    8: {"tp2": (2, 1), "ep4": (4, 2), "tp4": (4, 1), "ep2": (2, 4)},
    4: {"tp2": (2, 1), "ep2": (2, 2), "tp4": (4, 1), "ep4": (4, 1)},
    2: {"tp2": (2, 1), "ep2": (2, 1), "tp1": (1, 1), "ep1": (1, 1)},
}
SEED = 20261207
CPU_ENV = {"LCK_SETUP_TIMEOUT": "120", "LCK_TEST_PG_TIMEOUT": "120"}
NVSHMEM_ENV = {
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NVLS": "1",
    # Set explicitly: NVSHMEM reads it once per process, and the second phase re-initialises NVSHMEM
    # over a half-size world in the same process. 1 GiB covers both phases' reservations many times.
    "NVSHMEM_SYMMETRIC_SIZE": str(1 << 30),
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "LCK_SETUP_TIMEOUT": "120",
    "LCK_TEST_PG_TIMEOUT": "180",
}
TIMEOUT = 300
SUM_TOL = 1e-4  # fp32 sum of at most 8 values of magnitude ~16; max is exact

# ---------------------------------------------------------------------------------------------------------
# Helpers shared by the workers and the checks
# ---------------------------------------------------------------------------------------------------------


def _groups(size: int, stride: int, n: int, offset: int = 0) -> list[tuple[int, ...]]:
    """The groups of the uniform strided partition (size, stride) of ranks [offset, offset + n)."""
    span = size * stride
    return [
        tuple(offset + b * span + o + stride * i for i in range(size))
        for b in range(n // span)
        for o in range(stride)
    ]


def _group_of(rank: int, groups: list[tuple[int, ...]]) -> tuple[int, ...]:
    return next(g for g in groups if rank in g)


def _names(world: int) -> tuple[str, str, str, str]:
    tp_a, ep_a, tp_b, ep_b = LAYOUTS[world]
    return tp_a, ep_a, tp_b, ep_b


def _half_layout(world: int) -> dict[str, tuple[int, int]]:
    """Partitions inside each half of the world: TP blocks of h/2 ranks, EP pairs at stride h/2 (one rank
    per half: everything is that rank)."""
    h = world // 2
    if h == 1:
        return {"tp": (1, 1), "ep": (1, 1), "boot": (1, 1)}
    return {"tp": (h // 2, 1), "ep": (2, h // 2), "boot": (h, 1)}


# ---------------------------------------------------------------------------------------------------------
# The scenario (runs in every worker)
# ---------------------------------------------------------------------------------------------------------


def _rand(rank: int, case: int, numel: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(SEED + 7919 * case + rank)
    return torch.randn(numel, generator=g, dtype=torch.float32) * 4.0


def _reduce_error(ctx: Any, case: int, numel: int, op: str) -> float:
    """all_reduce_ a fresh random tensor on the context's device; max abs error vs a float64 reference
    built from every member's input (inf for NaN or a result that is not ``t`` itself)."""
    import torch
    import torch.distributed as dist

    t = _rand(dist.get_rank(), case, numel).to(ctx.device)
    ref = torch.stack([_rand(r, case, numel).double() for r in ctx.ranks])
    ref = ref.sum(0) if op == "sum" else ref.amax(0)
    out = ctx.all_reduce_(t, op)
    if out is not t:
        return float("inf")
    got = t.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - ref).abs().max())


def _reduce_errors(contexts: dict[str, Any], first_case: int) -> dict[str, float]:
    """Per context and op, the worst error over 1 element, a third of the capacity and all of it (on NVSHMEM
    the full capacity crosses both halves of the scratch: two chunks)."""
    errs: dict[str, float] = {}
    case = first_case
    for label, ctx in contexts.items():
        for numel in (1, ctx.capacity // 3, ctx.capacity):
            for op in ("sum", "max"):
                case += 1
                key = f"{label}/{op}"
                errs[key] = max(errs.get(key, 0.0), _reduce_error(ctx, case, numel, op))
    return errs


def _ctx_facts(ctx: Any) -> dict[str, Any]:
    """What a context says about itself, and (NVSHMEM) what its team says through nvshmem4py."""
    facts = {
        "alive": ctx.alive,
        "native": ctx.native,
        "ranks": ctx.ranks,
        "rank": ctx.rank,
        "size": ctx.size,
        "pes": ctx.pes,
        "team": None,
    }
    if ctx.native:
        import nvshmem.core as core

        facts["team"] = (int(core.team_n_pes(ctx.team)), int(core.team_my_pe(ctx.team)))
        facts["team handle"] = int(ctx.team)
    if hasattr(ctx, "push_forward"):
        facts["moe"] = (ctx.num_hosts, ctx.gpus_per_host, [ctx.host_of(i) for i in range(ctx.size)])
        facts["max_inflight"] = ctx.max_inflight
        ws = ctx.workspace
        facts["workspace"] = None if ws is None else (str(ws.dtype), ws.numel(), ws.device.type)
    else:
        facts["capacity"] = ctx.capacity
        s = ctx.scratch
        facts["scratch"] = None if s is None else (str(s.dtype), s.numel(), s.device.type)
    return facts


def _ptr(t: Any) -> int | None:
    return None if t is None else int(t.data_ptr())


def _peer_check(ctx: Any) -> dict[str, Any]:
    """NVSHMEM: every member writes a pattern into its own workspace and reads every member's through
    its peer view; every member stores its global rank + 1 into word ``its group rank`` of every
    member's signals. torch.distributed: the peer views must refuse with a clear error."""
    import torch
    import torch.distributed as dist

    if not ctx.native:
        return {"refused": error_text(ctx.peer_workspace, 0), "workspace": ctx.workspace, "team": ctx.team}
    me = dist.get_rank()
    ws = ctx.workspace
    n = min(ws.numel(), 1 << 16)

    def pattern(r: int) -> Any:
        return ((torch.arange(n, device=ws.device) * (r + 3) + 7 * r) % 251).to(torch.uint8)

    ws[:n].copy_(pattern(me))
    torch.cuda.synchronize()
    dist.barrier()
    reads = [bool(torch.equal(ctx.peer_workspace(i)[:n], pattern(ctx.ranks[i]))) for i in range(ctx.size)]
    for i in range(ctx.size):
        ctx.peer_signals(i)[ctx.rank : ctx.rank + 1].fill_(me + 1)
    torch.cuda.synchronize()
    dist.barrier()
    got = ctx.signals[: ctx.size].tolist()
    dist.barrier()  # every read is done before anyone moves on to overwrite another context's memory
    return {"reads": reads, "signals": got}


def _labels(objs: dict[str, Any], names: list[Any], lookup: Any) -> list[str | None]:
    """For each name, which labelled context ``lookup(name, required=False)`` returns (None for none)."""
    by_id = {id(v): k for k, v in objs.items()}
    out: list[str | None] = []
    for name in names:
        ctx = lookup(name, required=False)
        out.append(None if ctx is None else by_id.get(id(ctx), f"<unknown {ctx!r}>"))
    return out


def _world_phase(rank: int, world: int, g: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    import torch

    import lck_runtime as L

    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    tp_a, ep_a, tp_b, ep_b = _names(world)
    again = f"{tp_a}_again"
    o: dict[str, Any] = {}
    o["unconfigured"] = (
        L.is_native(),
        L.flsce_context(tp_a, required=False),
        L.moe_context(ep_a, required=False),
    )

    # 1. The first layout: FLSCE on tpA, MoE on epA (two virtual hosts).
    f1 = F(max_tokens=64, hidden_size=32, local_vocab_size=128, group=tp_a)
    m1 = M(max_tokens=32, hidden_size=32, num_experts=8, top_k=2, num_hosts=2, max_inflight=3, group=ep_a)
    o["configure 1"] = L.configure(process_groups={tp_a: g[tp_a], ep_a: g[ep_a]}, flsce=f1, moe=m1)
    o["is_native"] = L.is_native()
    fa, ma = L.flsce_context(tp_a), L.moe_context(ep_a)
    scratch, ws_a = _ptr(fa.scratch), _ptr(ma.workspace)

    # 2. Partial hit: tpA repeated, the second layout's names added, an alias of tpA's membership; a new
    #    FLSCE context (tpB) on the shared scratch, the MoE section repeated exactly (same context).
    o["configure 2"] = L.configure(
        process_groups={tp_a: g[tp_a], tp_b: g[tp_b], ep_b: g[ep_b], again: g[again]},
        flsce=dataclasses.replace(f1, group=tp_b),
        moe=m1,
    )
    fb = L.flsce_context(tp_b)
    o["hits 2"] = {
        "flsce tpA same": L.flsce_context(tp_a) is fa,
        "moe epA same": L.moe_context(ep_a) is ma,
        "alias name → tpA context": L.flsce_context(again) is fa,
        "alias group → tpA context": L.flsce_context(g[again]) is fa,
        "epA group object → context": L.moe_context(g[ep_a]) is ma,
        "epA workspace kept": _ptr(ma.workspace) == ws_a,
        "tpB shares the scratch": _ptr(fb.scratch) == scratch,
    }
    o["moe epB before its section"] = L.moe_context(ep_b, required=False)

    # 3. Partial hit again: a smaller FLSCE request on tpA (reuses its context), a new MoE context on epB.
    m3 = M(max_tokens=16, hidden_size=32, num_experts=8, top_k=2, max_inflight=2, group=ep_b)
    o["configure 3"] = L.configure(
        flsce=F(max_tokens=32, hidden_size=16, local_vocab_size=64, group=tp_a), moe=m3
    )
    mb = L.moe_context(ep_b)
    o["hits 3"] = {
        "flsce tpA same": L.flsce_context(tp_a) is fa,
        "tpA keeps its config": fa.config == f1,
        "flsce tpB same": L.flsce_context(tp_b) is fb,
        "moe epA same": L.moe_context(ep_a) is ma,
        "epA workspace kept": _ptr(ma.workspace) == ws_a,
        "tpB shares the scratch": _ptr(fb.scratch) == scratch,
    }
    ctxs = {"fa": fa, "fb": fb, "ma": ma, "mb": mb}
    names = [tp_a, ep_a, tp_b, ep_b, again]
    o["lookups"] = {
        "flsce": _labels(ctxs, names, L.flsce_context),
        "moe": _labels(ctxs, names, L.moe_context),
        "flsce bootstrap": _labels(ctxs, [None], L.flsce_context)[0],
    }
    o["facts 1"] = {k: _ctx_facts(v) for k, v in ctxs.items()}

    # Growth of a live reservation: rejected on every rank before anything changes.
    o["growth flsce"] = error_text(L.configure, flsce=F(128, 32, 128, group=tp_b))
    o["growth moe"] = error_text(L.configure, moe=dataclasses.replace(m3, max_inflight=4))
    o["after growth"] = (L.flsce_context(tp_b) is fb, fb.alive, L.moe_context(ep_b) is mb, mb.max_inflight)

    # 4. Retained forwards on epA, then work on the other contexts.
    entries = [{"layer": i, "rank": rank} for i in range(3)]
    for e in entries:
        ma.push_forward(e)
    o["epA overflow"] = error_text(ma.push_forward, {"layer": 3})
    o["epA after overflow"] = (ma.inflight, ma.peek_forward() is entries[2])
    o["reduce while retained"] = _reduce_errors({"fa": fa, "fb": fb}, 0)
    x, y = {"mb": 0}, {"mb": 1}
    mb.push_forward(x)
    mb.push_forward(y)
    o["epB overflow"] = error_text(mb.push_forward, {"mb": 2})
    o["epB lifo"] = (mb.pop_forward() is y, mb.pop_forward() is x, mb.inflight)
    o["epB empty pop"] = error_text(mb.pop_forward)
    o["epA after switch"] = (ma.alive, ma.inflight, ma.peek_forward() is entries[2])

    # 5. Destroying epA's team (or clearing the pool) is refused while it retains forwards.
    o["destroy epA refused"] = error_text(L.destroy_team, ep_a)
    o["destroy epA group refused"] = error_text(L.destroy_team, g[ep_a])
    o["clear refused"] = error_text(L.clear_pool)
    o["after refusals"] = (
        ma.alive,
        ma.inflight,
        L.moe_context(ep_a) is ma,
        fa.alive,
        fb.alive,
        mb.alive,
    )

    # 6. Another partition's team may go and come back meanwhile: destroy tpB's team and re-create it.
    L.destroy_team(tp_b)
    o["tpB destroyed"] = {
        "fb alive": fb.alive,
        "fb use": error_text(fb.all_reduce_, torch.ones(4, device=fa.device), "sum"),
        "lookup": L.flsce_context(tp_b, required=False),
        "mb alive": mb.alive,
        "fa alive": fa.alive,
        "ma": (ma.alive, ma.inflight, ma.peek_forward() is entries[2]),
    }
    L.configure(flsce=dataclasses.replace(f1, group=tp_b))
    fb2 = L.flsce_context(tp_b)
    mb2 = mb
    if not mb.alive:  # tpB and epB share one partition (4 ranks): its MoE context went with the team
        L.configure(moe=m3)
        mb2 = L.moe_context(ep_b)
    o["tpB recreated"] = (fb2 is not fb, fb2.alive, fb2.ranks, mb2.alive, _ptr(fb2.scratch) == scratch)
    o["reduce after tpB recreate"] = _reduce_errors({"fb2": fb2}, 100)

    # 7. LIFO pops on epA, across all of that.
    o["epA out of order"] = error_text(ma.pop_forward, entries[0])
    o["epA lifo"] = [
        ma.pop_forward() is entries[2],
        ma.pop_forward(entries[1]) is entries[1],
        ma.pop_forward() is entries[0],
    ]
    o["epA empty"] = (ma.inflight, error_text(ma.pop_forward))

    # 8. Now epA's team can go: its context and every alias are invalidated; re-create and use it.
    alias = ma
    L.destroy_team(g[ep_a])
    o["epA destroyed"] = {
        "alive": alias.alive,
        "push": error_text(alias.push_forward, {"late": 1}),
        "ranks": error_text(lambda: alias.ranks),
        "lookup": L.moe_context(ep_a, required=False),
        "others alive": (fa.alive, fb2.alive, mb2.alive),
    }
    o["destroy epA again"] = error_text(L.destroy_team, ep_a)
    L.configure(moe=m1)
    ma2 = L.moe_context(ep_a)
    e = {"again": rank}
    ma2.push_forward(e)
    o["epA recreated"] = (ma2 is not ma, ma2.inflight, ma2.pop_forward() is e, ma2.inflight)
    fa2 = fa
    if not fa.alive:  # tpA and epA share one partition (2 ranks): its FLSCE context went with the team
        L.configure(flsce=f1)
        fa2 = L.flsce_context(tp_a)
        o["tpA recreated"] = (fa2 is not fa, fa2.alive, _ptr(fa2.scratch) == scratch)

    # 9. Every live context, as it stands: facts, reductions, peer views.
    live = {"fa": fa2, "fb": fb2, "ma": ma2, "mb": mb2}
    o["facts 2"] = {k: _ctx_facts(v) for k, v in live.items()}
    o["reduce final"] = _reduce_errors({"fa": fa2, "fb": fb2}, 200)
    o["peer"] = {k: _peer_check(live[k]) for k in ("ma", "mb")}

    L.finalize()
    o["after finalize"] = {
        "alive": [c.alive for c in (fa2, fb2, ma2, mb2)],
        "is_native": L.is_native(),
        "lookup": L.flsce_context(tp_a, required=False),
        "use": error_text(lambda: fa2.capacity),
    }
    return o


def _halves_phase(rank: int, world: int, boot: Any, h_tp: Any, h_ep: Any) -> dict[str, Any]:
    import torch.distributed as dist

    import lck_runtime as L

    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    o: dict[str, Any] = {}
    # With PEs sharing GPUs, NVSHMEM's setup may name host shared memory after PE numbers (its limited
    # mode does), the same in both halves' NVSHMEM jobs: the halves bring NVSHMEM up one after the other.
    stagger = os.environ.get("LCK_NVSHMEM_SHARED_GPUS") == "1"
    if stagger and rank >= world // 2:
        dist.barrier()
    o["configure 1"] = L.configure(
        bootstrap_group=boot,
        process_groups={"tp": h_tp, "ep": h_ep},
        flsce=F(max_tokens=48, hidden_size=16, local_vocab_size=32, group="tp"),
        moe=M(max_tokens=16, hidden_size=16, num_experts=4, top_k=1, max_inflight=2, group="ep"),
    )
    if stagger and rank < world // 2:
        dist.barrier()
    o["configure 2"] = L.configure(flsce=F(max_tokens=48, hidden_size=16, local_vocab_size=32))  # the half
    o["is_native"] = L.is_native()
    ft, fh, me = L.flsce_context("tp"), L.flsce_context(None), L.moe_context("ep")
    ctxs = {"ft": ft, "fh": fh, "me": me}
    o["facts"] = {k: _ctx_facts(v) for k, v in ctxs.items()}
    o["lookups"] = {
        "flsce": _labels(ctxs, ["tp", "ep", None, boot], L.flsce_context),
        "moe": _labels(ctxs, ["tp", "ep", None], L.moe_context),
    }
    o["reduce"] = _reduce_errors({"ft": ft, "fh": fh}, 300)
    a, b = {"half": 0}, {"half": 1}
    me.push_forward(a)
    me.push_forward(b)
    o["overflow"] = error_text(me.push_forward, {"half": 2})
    o["reduce while retained"] = _reduce_errors({"fh": fh}, 400)
    o["destroy refused"] = error_text(L.destroy_team, "ep")
    o["lifo"] = (me.pop_forward() is b, me.pop_forward() is a, me.inflight)
    # The world is not this process's bootstrap domain: refused on every rank of both halves.
    o["other domain"] = error_text(L.configure, bootstrap_group=dist.group.WORLD)
    o["peer"] = _peer_check(me)
    L.finalize()
    o["after finalize"] = ([c.alive for c in ctxs.values()], L.is_native())
    return o


def _phase(rank: int, fn: Any) -> tuple[str, Any]:
    """Run one phase; a failure is recorded with its traceback (and the runtime finalized) so that the
    other phase still runs and reports."""
    import lck_runtime as L

    try:
        return ("ok", fn())
    except Exception:
        tb = traceback.format_exc()
        try:
            L.finalize()
        except Exception as exc:
            tb += f"\n(finalize after the failure also failed: {type(exc).__name__}: {exc})"
        return ("fail", f"rank {rank}: {tb}")


def _scenario(rank: int, world: int, backend_kind: str) -> dict[str, Any]:
    """The multi-group scenario on ``world`` ranks (2, 4 or 8); ``backend_kind`` is "gloo" or "nvshmem"."""
    import torch.distributed as dist

    assert world in LAYOUTS and backend_kind in ("gloo", "nvshmem"), (world, backend_kind)
    if backend_kind == "nvshmem":  # round-robin: several ranks per GPU where the world exceeds the GPUs
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())

    def mine(groups: list[tuple[int, ...]]) -> Any:
        # new_group is collective over WORLD: every rank creates every group, in the same order.
        made = [dist.new_group(list(gr)) for gr in groups]
        return made[next(i for i, gr in enumerate(groups) if rank in gr)]

    g = {name: mine(_groups(*part, world)) for name, part in LAYOUTS[world].items()}
    tp_a = _names(world)[0]
    g[f"{tp_a}_again"] = mine(_groups(*LAYOUTS[world][tp_a], world))  # same members, new objects
    h = world // 2
    hl = _half_layout(world)
    boot = mine([tuple(range(h)), tuple(range(h, world))])
    h_tp = mine(_groups(*hl["tp"], h, 0) + _groups(*hl["tp"], h, h))
    h_ep = mine(_groups(*hl["ep"], h, 0) + _groups(*hl["ep"], h, h))
    return {
        "world": _phase(rank, lambda: _world_phase(rank, world, g)),
        "halves": _phase(rank, lambda: _halves_phase(rank, world, boot, h_tp, h_ep)),
    }


# ---------------------------------------------------------------------------------------------------------
# Checks (in the test process, over every rank's observations)
# ---------------------------------------------------------------------------------------------------------


def _ok(outs: list[dict[str, Any]], phase: str) -> list[dict[str, Any]]:
    fails = [o[phase][1] for o in outs if o[phase][0] == "fail"]
    assert not fails, f"phase {phase!r} failed:\n" + "\n".join(fails)
    return [o[phase][1] for o in outs]


def _same_everywhere(obs: list[dict[str, Any]], key: str, phase: str) -> str:
    texts = {o[key] for o in obs}
    assert len(texts) == 1, f"{phase}: ranks raised different errors for {key!r}: {texts}"
    return texts.pop()


def _check_reduce(errs: dict[str, float], where: str) -> None:
    assert errs, f"{where}: no reductions were checked"
    for key, err in errs.items():
        limit = 0.0 if key.endswith("/max") else SUM_TOL
        assert err <= limit, f"{where}: all_reduce_ {key}: max abs error {err} > {limit}"


def _check_facts(
    facts: dict[str, Any], rank: int, group: tuple[int, ...], local: tuple[int, ...], native: bool, where: str
) -> None:
    want = {
        "alive": True,
        "native": native,
        "ranks": group,
        "rank": group.index(rank),
        "size": len(group),
        "pes": local,
    }
    got = {k: facts[k] for k in want}
    assert got == want, f"{where}: context says {got}, expected {want}"
    if native:
        assert facts["team"] == (len(group), group.index(rank)), (
            f"{where}: nvshmem4py team_n_pes/team_my_pe = {facts['team']}, expected {(len(group), group.index(rank))}"
        )
    else:
        assert facts["team"] is None, f"{where}: a torch.distributed context has team {facts['team']}"
    kind = "workspace" if "moe" in facts else "scratch"
    if native:
        assert facts[kind] is not None and facts[kind][2] == "cuda", f"{where}: {kind} {facts[kind]}"
    else:
        assert facts[kind] is None, f"{where}: torch.distributed context has a symmetric {kind} {facts[kind]}"


def _check_peer(peer: dict[str, Any], rank: int, group: tuple[int, ...], native: bool, where: str) -> None:
    if native:
        assert peer["reads"] == [True] * len(group), (
            f"{where}: peer workspace reads {peer['reads']} (members {group})"
        )
        assert peer["signals"] == [r + 1 for r in group], (
            f"{where}: signals {peer['signals']}, expected each member's global rank + 1 {[r + 1 for r in group]}"
        )
    else:
        assert "no symmetric memory on the torch.distributed path" in peer["refused"], f"{where}: {peer}"
        assert peer["workspace"] is None and peer["team"] is None, f"{where}: {peer}"


def _check_world(outs: list[dict[str, Any]], world: int, native: bool) -> None:
    obs = _ok(outs, "world")
    layout = LAYOUTS[world]
    tp_a, ep_a, tp_b, ep_b = _names(world)
    part = {**layout, f"{tp_a}_again": layout[tp_a]}
    names = [tp_a, ep_a, tp_b, ep_b, f"{tp_a}_again"]
    for rank, o in enumerate(obs):
        w = f"world phase, rank {rank}/{world}"
        assert o["unconfigured"] == (False, None, None), f"{w}: {o['unconfigured']}"
        for key in ("configure 1", "configure 2", "configure 3"):
            assert o[key] is native, f"{w}: {key} returned {o[key]}, expected {native}"
        assert o["is_native"] is native, w
        for key in ("hits 2", "hits 3"):
            bad = [k for k, v in o[key].items() if not v]
            assert not bad, f"{w}: {key}: not reused/shared: {bad}"
        assert o["moe epB before its section"] is None, w
        # Lookups by name: a context belongs to a partition; names of one partition share it.
        want_f = [
            "fa" if part[n] == layout[tp_a] else "fb" if part[n] == layout[tp_b] else None for n in names
        ]
        want_m = [
            "ma" if part[n] == layout[ep_a] else "mb" if part[n] == layout[ep_b] else None for n in names
        ]
        boot_f = "fa" if layout[tp_a] == (world, 1) else "fb" if layout[tp_b] == (world, 1) else None
        assert o["lookups"] == {"flsce": want_f, "moe": want_m, "flsce bootstrap": boot_f}, (
            f"{w}: lookups {o['lookups']} for names {names}, expected flsce {want_f}, moe {want_m}, "
            f"bootstrap {boot_f}"
        )
        for facts_key in ("facts 1", "facts 2"):
            for label, name in (("fa", tp_a), ("fb", tp_b), ("ma", ep_a), ("mb", ep_b)):
                grp = _group_of(rank, _groups(*layout[name], world))
                f = o[facts_key][label]
                _check_facts(f, rank, grp, grp, native, f"{w}: {facts_key} {label} ({name})")
            fa, fb, ma, mb = (o[facts_key][k] for k in ("fa", "fb", "ma", "mb"))
            assert fa["capacity"] == 64 * 32 and fb["capacity"] == 64 * 32, (w, fa, fb)
            assert ma["max_inflight"] == 3 and mb["max_inflight"] == 2, (w, ma, mb)
            size_a = layout[ep_a][0]
            assert ma["moe"] == (2, size_a // 2, [i // (size_a // 2) for i in range(size_a)]), (w, ma)
            size_b = layout[ep_b][0]
            assert mb["moe"] == (1, size_b, [0] * size_b), (w, mb)
            if native:
                assert (
                    fa["scratch"] == ("torch.float32", 64 * 32, "cuda") and fb["scratch"] == fa["scratch"]
                ), f"{w}: scratch {fa['scratch']} / {fb['scratch']}: one fp32 scratch of the first capacity"
                for m, cfg_tokens, size in ((ma, 32, size_a), (mb, 16, size_b)):
                    # every member may send all its tokens: at least size × tokens × 32 bf16 bytes
                    assert (
                        m["workspace"][0] == "torch.uint8" and m["workspace"][1] >= size * cfg_tokens * 64
                    ), (
                        w,
                        m,
                    )
                for f_, m_, tp_name, ep_name in ((fa, ma, tp_a, ep_a), (fb, mb, tp_b, ep_b)):
                    if layout[tp_name] == layout[ep_name]:
                        assert f_["team handle"] == m_["team handle"], (
                            f"{w}: {tp_name} and {ep_name} are one partition with two teams"
                        )
        assert (
            "flsce.max_tokens=128 exceeds the process-wide FLSCE capacity max_tokens=64" in o["growth flsce"]
        ), f"{w}: {o['growth flsce']}"
        assert "moe.max_inflight=4 exceeds the process-wide MoE capacity max_inflight=3" in o["growth moe"], (
            f"{w}: {o['growth moe']}"
        )
        assert o["after growth"] == (True, True, True, 2), f"{w}: growth changed state {o['after growth']}"
        assert "retained-forward stack is full" in o["epA overflow"], f"{w}: {o['epA overflow']}"
        assert "max_inflight=3" in o["epA overflow"] and "nothing was pushed" in o["epA overflow"], w
        assert o["epA after overflow"] == (3, True), f"{w}: {o['epA after overflow']}"
        _check_reduce(o["reduce while retained"], f"{w}, epA retaining")
        assert "max_inflight=2" in o["epB overflow"], f"{w}: {o['epB overflow']}"
        assert o["epB lifo"] == (True, True, 0), f"{w}: epB pops {o['epB lifo']}"
        assert "no retained forward to pop" in o["epB empty pop"], f"{w}: {o['epB empty pop']}"
        assert o["epA after switch"] == (True, 3, True), f"{w}: {o['epA after switch']}"
        refused = o["destroy epA refused"]
        assert refused.startswith("RuntimeError: destroy_team: MoE contexts still hold retained forwards"), (
            f"{w}: {refused}"
        )
        size, stride = layout[ep_a]
        for r in range(world):
            held = f"bootstrap rank {r} (global {r}): 3 in the EP partition size×stride {size}x{stride}"
            assert held in refused, f"{w}: {held!r} missing from {refused}"
        assert o["destroy epA group refused"] == refused, f"{w}: {o['destroy epA group refused']}"
        assert o["clear refused"].startswith("RuntimeError: clear_pool: MoE contexts still hold retained"), (
            f"{w}: {o['clear refused']}"
        )
        assert o["after refusals"] == (True, 3, True, True, True, True), f"{w}: {o['after refusals']}"
        shared_b = layout[tp_b] == layout[ep_b]
        d = o["tpB destroyed"]
        assert d["fb alive"] is False and d["lookup"] is None, f"{w}: {d}"
        assert "invalidated by destroy_team()" in d["fb use"], f"{w}: {d['fb use']}"
        assert d["mb alive"] is (not shared_b), f"{w}: epB context alive={d['mb alive']}, shared={shared_b}"
        assert d["fa alive"] is True and d["ma"] == (True, 3, True), f"{w}: epA disturbed: {d}"
        grp_b = _group_of(rank, _groups(*layout[tp_b], world))
        assert o["tpB recreated"] == (True, True, grp_b, True, True), f"{w}: {o['tpB recreated']}"
        _check_reduce(o["reduce after tpB recreate"], f"{w}, re-created tpB")
        assert "not the expected one" in o["epA out of order"], f"{w}: {o['epA out of order']}"
        assert o["epA lifo"] == [True, True, True], f"{w}: epA pops {o['epA lifo']}"
        assert o["epA empty"][0] == 0 and "no retained forward" in o["epA empty"][1], f"{w}: {o['epA empty']}"
        d = o["epA destroyed"]
        shared_a = layout[tp_a] == layout[ep_a]
        assert (
            d["alive"] is False and d["lookup"] is None and d["others alive"] == (not shared_a, True, True)
        ), f"{w}: {d} (tpA shares epA's partition: {shared_a})"
        assert o.get("tpA recreated") == ((True, True, True) if shared_a else None), (
            f"{w}: tpA re-created {o.get('tpA recreated')}, shared with epA: {shared_a}"
        )
        for key in ("push", "ranks"):
            assert d[key].startswith(f"RuntimeError: MoE context for group '{ep_a}'"), f"{w}: {key}: {d[key]}"
            assert "invalidated by destroy_team()" in d[key], f"{w}: {key}: {d[key]}"
        assert "has no team" in o["destroy epA again"], f"{w}: {o['destroy epA again']}"
        assert o["epA recreated"] == (True, 1, True, 0), f"{w}: {o['epA recreated']}"
        _check_reduce(o["reduce final"], f"{w}, final")
        for label, name in (("ma", ep_a), ("mb", ep_b)):
            grp = _group_of(rank, _groups(*layout[name], world))
            _check_peer(o["peer"][label], rank, grp, native, f"{w}: peer views of {label} ({name})")
        f = o["after finalize"]
        assert f["alive"] == [False] * 4 and f["is_native"] is False and f["lookup"] is None, f"{w}: {f}"
        assert "invalidated by finalize()" in f["use"], f"{w}: {f['use']}"
    for key in ("growth flsce", "growth moe", "destroy epA refused", "clear refused"):
        _same_everywhere(obs, key, "world phase")


def _check_halves(outs: list[dict[str, Any]], world: int, native: bool) -> None:
    obs = _ok(outs, "halves")
    h = world // 2
    hl = _half_layout(world)
    for rank, o in enumerate(obs):
        w = f"halves phase, rank {rank}/{world}"
        offset = 0 if rank < h else h
        assert o["configure 1"] is native and o["configure 2"] is native and o["is_native"] is native, (
            f"{w}: configure returned {o['configure 1']}, {o['configure 2']}; is_native {o['is_native']}"
        )
        for label, key in (("ft", "tp"), ("fh", "boot"), ("me", "ep")):
            grp = _group_of(rank, _groups(*hl[key], h, offset))
            local = tuple(r - offset for r in grp)
            _check_facts(o["facts"][label], rank, grp, local, native, f"{w}: {label} ({key})")
        assert o["facts"]["ft"]["capacity"] == 48 * 16 and o["facts"]["fh"]["capacity"] == 48 * 16, w
        ep_is_half = hl["ep"] == hl["boot"]
        tp_is_half = hl["tp"] == hl["boot"]
        want_f = ["fh" if tp_is_half else "ft", "fh" if ep_is_half else None, "fh", "fh"]
        want_m = ["me" if hl["tp"] == hl["ep"] else None, "me", "me" if ep_is_half else None]
        assert o["lookups"] == {"flsce": want_f, "moe": want_m}, (
            f"{w}: lookups {o['lookups']}, expected flsce {want_f} for [tp, ep, None, boot], moe {want_m}"
        )
        _check_reduce(o["reduce"], w)
        _check_reduce(o["reduce while retained"], f"{w}, retaining")
        assert "retained-forward stack is full" in o["overflow"], f"{w}: {o['overflow']}"
        assert o["destroy refused"].startswith("RuntimeError: destroy_team: MoE contexts still hold"), (
            f"{w}: {o['destroy refused']}"
        )
        for r in range(h):
            assert (
                f"bootstrap rank {r} (global {offset + r}): 2 in the EP partition" in o["destroy refused"]
            ), f"{w}: bootstrap rank {r} missing from {o['destroy refused']}"
        assert o["lifo"] == (True, True, 0), f"{w}: {o['lifo']}"
        assert "finalize() before changing the bootstrap group" in o["other domain"], (
            f"{w}: {o['other domain']}"
        )
        grp = _group_of(rank, _groups(*hl["ep"], h, offset))
        _check_peer(o["peer"], rank, grp, native, f"{w}: peer views")
        assert o["after finalize"] == ([False, False, False], False), f"{w}: {o['after finalize']}"
    for lo in (0, h):
        _same_everywhere(obs[lo : lo + h], "destroy refused", f"halves phase, ranks {lo}..{lo + h - 1}")
    _same_everywhere(obs, "other domain", "halves phase")


def _run(world: int, backend_kind: str, *, shared_gpus: bool = False) -> None:
    if backend_kind == "gloo":
        outs = run_workers(_scenario, world, "gloo", timeout=TIMEOUT, env=CPU_ENV)
    elif shared_gpus:  # NCCL refuses two ranks on one GPU: torch.distributed over gloo, NVSHMEM as usual
        import torch

        env = {**NVSHMEM_ENV, **shared_gpu_env(world, torch.cuda.device_count())}
        outs = run_workers(_scenario, world, "nvshmem", backend="gloo", timeout=TIMEOUT, env=env)
    else:
        outs = run_workers(_scenario, world, "nvshmem", backend="nccl", timeout=TIMEOUT, env=NVSHMEM_ENV)
    native = backend_kind == "nvshmem"
    errors = []
    for check in (_check_world, _check_halves):  # report both phases' failures, not just the first
        try:
            check(outs, world, native)
        except AssertionError as exc:
            errors.append(f"{check.__name__}: {exc}")
    assert not errors, "\n\n".join(errors)


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


def test_layouts_are_uniform_strided_partitions() -> None:
    for world, layout in LAYOUTS.items():
        for name, (size, stride) in layout.items():
            groups = _groups(size, stride, world)
            members = sorted(r for gr in groups for r in gr)
            assert members == list(range(world)), (world, name, groups)
            assert all(len(gr) == size for gr in groups), (world, name, groups)
        tp_a, ep_a, tp_b, ep_b = _names(world)
        # The two layouts use different TP sizes and different EP sizes.
        assert layout[tp_a][0] != layout[tp_b][0] and layout[ep_a][0] != layout[ep_b][0]
    assert _groups(4, 2, 8) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert _groups(2, 4, 8) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert _groups(2, 2, 4, 4) == [(4, 6), (5, 7)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_multigroup_gloo(world: int) -> None:
    _run(world, "gloo")


@pytest.mark.multigpu(2)
def test_multigroup_nvshmem_2_gpus() -> None:
    _run(2, "nvshmem")


@pytest.mark.multigpu(4)
def test_multigroup_nvshmem_4_gpus() -> None:
    _run(4, "nvshmem")


@pytest.mark.multigpu(8)
def test_multigroup_nvshmem_8_gpus() -> None:
    _run(8, "nvshmem")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [4, 8])
def test_multigroup_nvshmem_shared_gpus(world: int) -> None:
    """The 4- and 8-PE layouts (TP2 × EP4 beside TP4 × EP2 at 8) through real NVSHMEM on the GPUs there
    are, several PEs per GPU (``LCK_NVSHMEM_SHARED_GPUS=1``; 2 or 4 on two GPUs, all of them on one):
    teams, symmetric memory, peer views and reductions of those sizes, not their speed."""
    if not mps_daemon_running():
        pytest.skip(SHARED_GPU_SKIP)
    _run(world, "nvshmem", shared_gpus=True)
