"""Context lookups, shared contexts for equivalent groups, capacities, the MoE context's surface."""

from __future__ import annotations

from typing import Any

from _observed import raised

from lck_runtime.testing import run_workers


def _contexts(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import lck_runtime as L

    out: dict[str, Any] = {}
    out["before"] = (
        L.flsce_context(None, required=False),
        L.moe_context("ep", required=False),
        raised(L.flsce_context, "tp"),
    )
    pair = dist.new_group([0, 1])
    pair_again = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    L.configure(
        process_groups={"ep": pair, "tp": singles[rank]},
        flsce=L.FusedLinearCrossEntropyConfig(max_tokens=4, hidden_size=16, local_vocab_size=10, group="tp"),
        moe=L.MoEConfig(max_tokens=4, hidden_size=8, num_experts=2, top_k=1, max_inflight=2, group="ep"),
    )
    f, m = L.flsce_context("tp"), L.moe_context("ep")
    out["types"] = (
        type(f).__name__,
        type(m).__name__,
        isinstance(f, L.FlsceContext),
        isinstance(m, L.MoEContext),
    )
    # equivalent groups share one context: by name, by another ProcessGroup object, by None (bootstrap)
    out["shared"] = (
        L.moe_context(pair_again) is m,
        L.moe_context(None) is m,
        L.moe_context(dist.group.WORLD) is m,
    )
    out["group object"] = m.group is pair and f.group is singles[rank]
    out["missing"] = (
        L.flsce_context("ep", required=False),
        L.flsce_context("nope", required=False),
        raised(L.flsce_context, "ep"),
        raised(L.moe_context, "nope"),
        raised(L.moe_context, 3.5),
        raised(L.moe_context, singles[1 - rank]),
    )
    # check_tokens names the capacity it exceeds
    f.check_tokens(4, hidden=16, local_vocab=10)
    f.check_tokens(0)
    out["tokens"] = (
        raised(f.check_tokens, 5),
        raised(f.check_tokens, 4, hidden=17),
        raised(f.check_tokens, 4, local_vocab=11),
        raised(f.check_tokens, 4.0),
        raised(f.check_tokens, -1),
    )
    out["flsce"] = (f.ranks, f.size, f.rank, f.capacity, f.team, f.pes, f.scratch, f.native)
    out["moe"] = (m.ranks, m.rank, m.size, m.num_hosts, m.gpus_per_host, m.host_of(1), m.team, m.pes)
    out["moe symmetric"] = (m.workspace, m.signals, raised(m.peer_workspace, 0), raised(m.peer_signals, 2))
    out["host_of"] = raised(m.host_of, 2)
    # the stack through the context
    a, b = object(), object()
    m.push_forward(a)
    m.push_forward(b)
    out["stack"] = (
        m.inflight,
        m.peek_forward() is b,
        raised(m.pop_forward, a),
        m.inflight,
        m.pop_forward(b) is b,
    )
    out["stack tail"] = (m.pop_forward() is a, raised(m.pop_forward), raised(m.push_forward, None))
    out["repr"] = repr(m)
    return out


def test_context_lookups_and_surface() -> None:
    outs = run_workers(_contexts, 2, timeout=300)
    for rank, o in enumerate(outs):
        none_f, none_m, before = o["before"]
        assert none_f is None and none_m is None
        assert before.startswith("RuntimeError: flsce_context(group): lck_runtime is not configured")
        assert o["types"] == ("FlsceContext", "MoEContext", True, True)
        assert o["shared"] == (True, True, True) and o["group object"]
        f_ep, f_nope, e_ep, e_nope, e_bad, e_foreign = o["missing"]
        assert f_ep is None and f_nope is None
        assert e_ep.startswith("ValueError: flsce_context(group): no FLSCE context for group 'ep'")
        assert "registered names: ['ep', 'tp']" in e_ep
        assert e_nope.startswith("ValueError: moe_context(group): no MoE context for group 'nope'")
        assert e_bad.startswith(
            "TypeError: moe_context(group) must be a torch.distributed.ProcessGroup, got float"
        )
        assert e_foreign.startswith("ValueError: moe_context(group) is GroupMember.NON_GROUP_MEMBER")
        t_over, h_over, v_over, t_type, t_neg = o["tokens"]
        assert "n_tokens=5 exceeds FusedLinearCrossEntropyConfig.max_tokens=4" in t_over
        assert "hidden=17 exceeds FusedLinearCrossEntropyConfig.hidden_size=16" in h_over
        assert "local_vocab=11 exceeds FusedLinearCrossEntropyConfig.local_vocab_size=10" in v_over
        assert t_type.startswith("TypeError: check_tokens: n_tokens must be an int")
        assert t_neg.startswith("ValueError: check_tokens: n_tokens must be >= 0")
        assert o["flsce"] == ((rank,), 1, 0, 4 * 16, None, (rank,), None, False)
        assert o["moe"] == ((0, 1), rank, 2, 1, 2, 0, None, (0, 1))
        ws, sig, e_pw, e_ps = o["moe symmetric"]
        assert ws is None and sig is None
        assert "no symmetric memory on the torch.distributed path" in e_pw
        assert e_ps.startswith("ValueError: peer_signals: rank must be an int in [0, 2), got 2")
        assert "host_of: rank must be an int in [0, 2)" in o["host_of"]
        inflight, peek_ok, mismatch, inflight_after, popped_b = o["stack"]
        assert (inflight, peek_ok, inflight_after, popped_b) == (2, True, 2, True)
        assert "LIFO order" in mismatch and "nothing was popped" in mismatch
        popped_a, empty, none_entry = o["stack tail"]
        assert popped_a and "no retained forward to pop" in empty and "must not be None" in none_entry
        assert o["repr"] == "<MoEContext group='ep' ranks=(0, 1) native=False alive>"
