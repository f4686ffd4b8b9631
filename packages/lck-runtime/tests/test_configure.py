"""configure() over torch.distributed (gloo): registration, reuse, growth, disagreement, timeouts.

Each test spawns one small world and runs many cases inside it (2 CPU cores are shared), returning
what every rank saw; the assertions run here, over all ranks' observations.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from _observed import raised, same_text

from lck_runtime.testing import run_workers

TIMEOUT = 300


def _partitions_and_reuse(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime.state import STATE

    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    ep = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    solo = [dist.new_group([r]) for r in range(world)][rank]
    tp_again = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # same members, new object
    F, M = L.FusedLinearCrossEntropyConfig, L.MoEConfig
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["unconfigured lookup"] = L.flsce_context("tp", required=False)
        out["first"] = L.configure(
            process_groups={"tp": tp, "ep": ep},
            flsce=F(max_tokens=32, hidden_size=16, local_vocab_size=64, group="tp"),
            moe=M(max_tokens=32, hidden_size=16, num_experts=4, top_k=2, max_inflight=2, group="ep"),
        )
        f_tp, m_ep = L.flsce_context("tp"), L.moe_context("ep")
        out["tp"] = (f_tp.ranks, f_tp.rank, f_tp.size, f_tp.native, str(f_tp.device), f_tp.capacity)
        out["ep"] = (m_ep.ranks, m_ep.rank, m_ep.size, m_ep.num_hosts, m_ep.gpus_per_host, m_ep.max_inflight)
        out["lookup by group object"] = L.flsce_context(tp) is f_tp and L.moe_context(ep) is m_ep
        plan_after_first = STATE.pool.plan()
        # additive: a size-1 partition and an alias of tp, with a smaller FLSCE request
        out["additive"] = L.configure(
            process_groups={"solo": solo, "tp_again": tp_again},
            flsce=F(max_tokens=16, hidden_size=8, local_vocab_size=64, group="solo"),
        )
        f_solo = L.flsce_context("solo")
        out["solo"] = (f_solo.ranks, f_solo.size, f_solo.config.max_tokens, f_solo.capacity)
        out["alias shares context"] = (
            L.flsce_context("tp_again") is f_tp and L.flsce_context(tp_again) is f_tp
        )
        # equal request again: same context object, no new reservation
        L.configure(flsce=F(max_tokens=32, hidden_size=16, local_vocab_size=64, group="tp"))
        L.configure(moe=M(max_tokens=16, hidden_size=16, num_experts=4, top_k=2, max_inflight=1, group="ep"))
        out["reuse"] = (
            L.flsce_context("tp") is f_tp,
            L.moe_context("ep") is m_ep,
            f_tp.config.max_tokens,
            m_ep.config.max_inflight,
            STATE.pool.plan() == plan_after_first,
        )
        # growth and misuse: every rank raises, nothing changes
        before = STATE.digest()
        out["growth flsce"] = raised(L.configure, flsce=F(64, 16, 64, group="solo"))
        out["growth moe"] = raised(L.configure, moe=M(32, 16, 4, 2, max_inflight=3, group="ep"))
        out["growth hidden"] = raised(L.configure, flsce=F(32, 17, 64))
        out["unknown name"] = raised(L.configure, flsce=F(8, 8, 8, group="pp"))
        out["None value"] = raised(L.configure, process_groups={"dp": None})
        out["not a mapping"] = raised(L.configure, process_groups=[tp])
        out["bad section"] = raised(L.configure, flsce=M(8, 8, 4, 2))
        out["membership change"] = raised(L.configure, process_groups={"tp": ep})
        out["bad device"] = raised(L.configure, device="cuda:0")
        out["unchanged"] = STATE.digest() == before and L.flsce_context("tp") is f_tp and f_tp.alive
        out["plan"] = STATE.pool.plan()
        out["still works"] = L.configure(flsce=F(8, 8, 8, group="tp_again"))
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def test_partitions_registration_reuse_and_growth() -> None:
    outs = run_workers(_partitions_and_reuse, 4, timeout=TIMEOUT)
    for rank, o in enumerate(outs):
        assert o["unconfigured lookup"] is None
        assert o["first"] is False and o["additive"] is False and o["still works"] is False
        tp_ranks = (0, 1) if rank < 2 else (2, 3)
        ep_ranks = (0, 2) if rank % 2 == 0 else (1, 3)
        assert o["tp"] == (tp_ranks, rank % 2, 2, False, "cpu", 32 * 16)
        assert o["ep"] == (ep_ranks, rank // 2, 2, 1, 2, 2)
        assert o["lookup by group object"] and o["alias shares context"]
        assert o["solo"] == ((rank,), 1, 16, 16 * 8)
        assert o["reuse"] == (True, True, 32, 2, True)
        assert o["unchanged"]
        assert (
            "flsce.max_tokens=64 exceeds the process-wide FLSCE capacity max_tokens=32" in o["growth flsce"]
        )
        assert "nothing was changed" in o["growth flsce"]
        assert "moe.max_inflight=3 exceeds the process-wide MoE capacity max_inflight=2" in o["growth moe"]
        assert "flsce.hidden_size=17" in o["growth hidden"]
        assert o["unknown name"].startswith(
            "ValueError: configure: flsce.group='pp' is not a registered group name"
        )
        assert o["None value"].startswith("ValueError: configure: process_groups['dp'] is None")
        assert o["not a mapping"].startswith("TypeError: configure: process_groups must be a mapping")
        assert o["bad section"].startswith(
            "TypeError: configure: flsce must be a FusedLinearCrossEntropyConfig"
        )
        assert "keeps its ordered membership" in o["membership change"]
        assert o["bad device"].startswith("ValueError: configure: device=cuda:0 but CUDA is not available")
        # one warning per process, saying why
        assert len(o["warnings"]) == 1 and "NVSHMEM is not used" in o["warnings"][0]
        assert "device is cpu" in o["warnings"][0]
    # same error text on every rank, same reservation sequence on every rank
    for key in ("growth flsce", "growth moe", "unknown name", "None value", "membership change"):
        assert len({o[key] for o in outs}) == 1, key
    plans = [o["plan"] for o in outs]
    assert all(p == plans[0] for p in plans)
    assert [label for label, _, _ in plans[0]] == ["flsce.scratch", "moe[2x2].workspace", "moe[2x2].signals"]


def _split_domains(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import lck_runtime as L

    # Two independent bootstrap domains, {0, 1} and {2, 3}, configured at the same time.
    domains = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    boot = domains[rank // 2]
    out: dict[str, Any] = {}
    out["native"] = L.configure(
        bootstrap_group=boot,
        process_groups={"tp1": singles[rank], "tp2": boot},
        flsce=L.FusedLinearCrossEntropyConfig(8, 8, 8, group="tp2"),
        moe=L.MoEConfig(8, 8, 4, 1, num_hosts=2, group=None),  # two virtual hosts of one GPU
    )
    L.configure(flsce=L.FusedLinearCrossEntropyConfig(8, 8, 8, group="tp1"))
    f2, f1, m = L.flsce_context("tp2"), L.flsce_context("tp1"), L.moe_context(None)
    out["ranks"] = (f2.ranks, f1.ranks, m.ranks, m.num_hosts, m.gpus_per_host, m.host_of(1))
    out["bootstrap context is tp2"] = L.flsce_context(None) is f2
    t = torch.full((5,), float(rank + 1))
    out["sum"] = f2.all_reduce_(t, "sum").tolist()
    u = torch.full((5,), float(rank + 1))
    out["solo sum"] = f1.all_reduce_(u, "sum").tolist()
    # topology errors, raised on both ranks of each domain
    out["hosts"] = raised(L.configure, moe=L.MoEConfig(8, 8, 4, 1, num_hosts=3, group="tp2"))
    out["gph"] = raised(L.configure, moe=L.MoEConfig(8, 8, 4, 1, num_hosts=1, gpus_per_host=1, group="tp2"))
    out["experts"] = raised(L.configure, moe=L.MoEConfig(8, 8, 3, 1, group="tp2"))
    out["other domain"] = raised(L.configure, bootstrap_group=dist.group.WORLD)
    return out


def test_split_bootstrap_domains_with_two_partitions() -> None:
    outs = run_workers(_split_domains, 4, timeout=TIMEOUT)
    for rank, o in enumerate(outs):
        pair = (0, 1) if rank < 2 else (2, 3)
        assert o["native"] is False
        assert o["ranks"] == (pair, (rank,), pair, 2, 1, 1)
        assert o["bootstrap context is tp2"]
        assert o["sum"] == [float(sum(r + 1 for r in pair))] * 5
        assert o["solo sum"] == [float(rank + 1)] * 5
        assert "moe.num_hosts=3" in o["hosts"] and "!= EP group size 2" in o["hosts"]
        assert "gpus_per_host=1" in o["gph"] and "!= EP group size 2" in o["gph"]
        assert "moe.num_experts=3 is not divisible by the EP group size 2" in o["experts"]
        assert "finalize() before changing the bootstrap group" in o["other domain"]


def _disagreements(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import lck_runtime as L

    F = L.FusedLinearCrossEntropyConfig
    g01_2 = [dist.new_group([0, 1]), dist.new_group([2])]
    g0_12 = [dist.new_group([0]), dist.new_group([1, 2])]
    out: dict[str, Any] = {}
    out["capacity"] = raised(L.configure, flsce=F(16 if rank == 1 else 8, 8, 8))
    out["names"] = raised(
        L.configure, process_groups={"a": dist.group.WORLD, **({"b": dist.group.WORLD} if rank == 2 else {})}
    )
    uneven = g01_2[0] if rank < 2 else g01_2[1]
    out["uneven"] = raised(L.configure, process_groups={"x": uneven})
    # rank 0 passes {0, 1}; ranks 1 and 2 pass {1, 2}
    mixed = g01_2[0] if rank == 0 else g0_12[1]
    out["membership"] = raised(L.configure, process_groups={"x": mixed})
    out["one rank bad"] = raised(L.configure, process_groups={"x": "tp" if rank == 2 else dist.group.WORLD})
    # What a CPU rank cannot show for itself: a mixed job (another GPU model on rank 1) and NVSHMEM settings
    # that differ (a heap size set on rank 2 only), as the ranks would report them.
    import importlib

    C = importlib.import_module("lck_runtime.configure")  # the module (the package exports the function)
    real = C.local_request

    def reported(gpu: Any, settings: Any) -> Any:
        def local_request(*args: Any) -> Any:
            req, plan, facts = real(*args)
            return req, {**plan, "GPU (name, arch, SMs)": gpu, "NVSHMEM settings": settings}, facts

        return local_request

    h200, h100 = ("NVIDIA H200", "sm_90", 132), ("NVIDIA H100 80GB HBM3", "sm_90", 132)
    C.local_request = reported(h100 if rank == 1 else h200, None)
    out["hardware"] = raised(L.configure, flsce=F(8, 8, 8))
    C.local_request = reported(h200, {"NVSHMEM_SYMMETRIC_SIZE": "8G" if rank == 2 else None})
    out["nvshmem settings"] = raised(L.configure, flsce=F(8, 8, 8))
    C.local_request = real
    out["recovers"] = L.configure(flsce=F(8, 8, 8))
    return out


def test_disagreements_raise_the_same_error_everywhere() -> None:
    outs = run_workers(_disagreements, 3, timeout=TIMEOUT)
    expect = {
        "capacity": "ValueError: configure: ranks disagree on flsce:",
        "names": "ValueError: configure: ranks disagree on process_groups names: ['a'] on ranks [0, 1], ['a', 'b'] on ranks [2]",
        "uneven": "ValueError: configure: process_groups['x']: groups must all have one size, got sizes [1, 2]",
        "membership": "ValueError: configure: process_groups['x']: rank 0 reports the group (0, 1) but its member rank 1 reports (1, 2)",
        "one rank bad": "TypeError: configure: process_groups['x'] must be a torch.distributed.ProcessGroup, got str (on bootstrap rank [2])",
        "hardware": "ValueError: configure: ranks disagree on GPU (name, arch, SMs):",
        "nvshmem settings": "ValueError: configure: ranks disagree on NVSHMEM settings:",
    }
    for key, prefix in expect.items():
        same_text(outs, key, prefix)
    assert "'max_tokens': 16" in outs[0]["capacity"] and "on ranks [1]" in outs[0]["capacity"]
    assert "H100" in outs[0]["hardware"] and "on ranks [1]" in outs[0]["hardware"]
    assert "8G" in outs[0]["nvshmem settings"] and "on ranks [2]" in outs[0]["nvshmem settings"]
    assert all(o["recovers"] is False for o in outs)


def _missing_rank(rank: int, world: int) -> dict:
    import lck_runtime as L

    if rank == 1:
        return {}  # never calls configure
    t0 = time.monotonic()
    first = raised(L.configure, flsce=L.FusedLinearCrossEntropyConfig(8, 8, 8))
    elapsed = time.monotonic() - t0
    again = raised(L.configure, flsce=L.FusedLinearCrossEntropyConfig(8, 8, 8))
    return {"first": first, "elapsed": elapsed, "again": again, "configured": L.flsce_context(required=False)}


def test_rank_that_never_calls_fails_the_others_within_the_timeout() -> None:
    outs = run_workers(_missing_rank, 2, timeout=TIMEOUT, env={"LCK_SETUP_TIMEOUT": "8"})
    o = outs[0]
    assert o["first"].startswith(
        "RuntimeError: configure: timed out after 8 s waiting for bootstrap ranks [1]"
    )
    assert "LCK_SETUP_TIMEOUT" in o["first"]
    assert 7 < o["elapsed"] < 60
    assert "out of step" in o["again"] and o["configured"] is None


def _failure_then_finalize(rank: int, world: int) -> dict:
    import traceback

    import lck_runtime as L

    L.configure(flsce=L.FusedLinearCrossEntropyConfig(8, 8, 8))
    if rank == 1:
        return {}  # never reaches finalize
    try:
        try:
            raise KeyError("the training step's own failure")
        finally:
            L.finalize()  # cleanup in a finally: times out waiting for rank 1
    except RuntimeError:
        return {"shown": traceback.format_exc()}
    return {"shown": "finalize returned"}


def test_finalize_timeout_in_cleanup_keeps_the_original_failure_visible() -> None:
    """A job that fails on one rank and calls finalize() in a ``finally`` sees the timeout *and* its own
    failure: the timeout must not hide the error that led there."""
    outs = run_workers(_failure_then_finalize, 2, timeout=TIMEOUT, env={"LCK_SETUP_TIMEOUT": "4"})
    shown = outs[0]["shown"]
    assert 'KeyError: "the training step\'s own failure"' in shown, shown
    assert "During handling of the above exception, another exception occurred" in shown, shown
    assert "RuntimeError: finalize: timed out after 4 s waiting for bootstrap ranks [1]" in shown, shown
