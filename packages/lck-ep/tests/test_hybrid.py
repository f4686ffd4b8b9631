"""The hybrid (scale-out) backend: options, the channel/signal budget, the parts and sub-parts geometry and
the virtual-host mapping on CPU; backend selection and its errors over gloo; both kernel pairs compiled with
nvcc; and on a GPU, PEs sharing it under CUDA MPS as virtual hosts (2 x 2, 2 x 4, 4 x 2), both pairs bit for
bit equal to the reference backend, every sub-part geometry of the sweep, the debug reorder of sub-part puts,
and a signal budget too small refused up front.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from _native_gpu import gpu_env, need_gpus

from lck_ep.hybrid import (
    SIGNAL_BUDGET,
    HybridBudgetError,
    HybridOptions,
    channel_bytes,
    channel_range,
    channel_sub_parts,
    forwarder,
    header_bytes,
    host_blocks,
    part_begin,
    parts_used,
    plan_hybrid,
    read_hybrid_options,
    sub_count,
)
from lck_ep.knobs import EpKnobs, KnobError
from lck_runtime import MoEConfig
from lck_runtime.symmetric import HYBRID_MAX_CHANNELS, moe_hybrid_area_bytes, moe_workspace_bytes
from lck_runtime.testing import assert_every_rank_says, error_text, run_workers

TIMEOUT = 150


# ------------------------------------------------------------------------------------- options, budget


def test_options_default_and_parse() -> None:
    assert read_hybrid_options({}) == HybridOptions()
    opts = read_hybrid_options(
        {
            "EP_HYBRID_CHANNELS": " 4 ",
            "EP_HYBRID_NUM_PARTS": "3",
            "EP_HYBRID_DEBUG_REORDER": "1",
            "EP_HYBRID_DEBUG_DELAY_US": "20",
        }
    )
    assert opts == HybridOptions(channels=4, parts=3, debug_reorder=True, debug_delay_us=20)
    assert read_hybrid_options({"EP_HYBRID_CHANNELS": ""}).channels is None


@pytest.mark.parametrize(
    ("name", "raw", "fragment"),
    [
        ("EP_HYBRID_CHANNELS", "0", "EP_HYBRID_CHANNELS=0 is out of range"),
        ("EP_HYBRID_CHANNELS", "four", "EP_HYBRID_CHANNELS='four' is not an integer"),
        ("EP_HYBRID_NUM_PARTS", "-1", "EP_HYBRID_NUM_PARTS=-1 is out of range"),
        (
            "EP_HYBRID_DEBUG_REORDER",
            "2",
            "EP_HYBRID_DEBUG_REORDER=2 is out of range; expected an integer in [0, 1]",
        ),
        ("EP_HYBRID_DEBUG_DELAY_US", "1.5", "not an integer"),
    ],
)
def test_bad_options_name_the_variable(name: str, raw: str, fragment: str) -> None:
    with pytest.raises(KnobError) as err:
        read_hybrid_options({name: raw})
    assert fragment in str(err.value)


def _cfg(world: int = 4, hosts: int = 2, tokens: int = 64) -> MoEConfig:
    return MoEConfig(max_tokens=tokens, hidden_size=256, num_experts=8 * world, top_k=4, num_hosts=hosts)


def test_default_plan_fits_the_budget() -> None:
    for num_sms in (None, 1, 3, 8, 24, 132):
        for variant in ("unordered", "ordered"):
            plan = plan_hybrid(
                config=_cfg(),
                num_ranks=4,
                num_sms=num_sms,
                knobs=EpKnobs(hybrid_kernel=variant),
                options=HybridOptions(),
            )
            assert plan.channels == 8  # the same on every rank, whatever its num_sms
            assert plan.signal_words <= SIGNAL_BUDGET
            assert plan.ordered == (variant == "ordered")
            assert plan.q_cap == -(-64 // plan.channels)


@pytest.mark.parametrize(
    ("opts", "variant", "fragments"),
    [
        (
            HybridOptions(channels=16, parts=2),
            "unordered",
            ["EP_HYBRID_CHANNELS=16 x EP_HYBRID_NUM_PARTS=2", "needs 32 but the limit is 29 (over by 3)"],
        ),
        (
            HybridOptions(channels=8, parts=4),
            "unordered",
            ["needs 32 but the limit is 29 (over by 3)", "at most 3 parts"],
        ),
        (HybridOptions(channels=30), "ordered", ["30 channels", "over by 1"]),
        (HybridOptions(channels=40), "unordered", ["EP_HYBRID_CHANNELS=40", "limit is 32 (over by 8)"]),
    ],
)
def test_budget_errors_name_the_limit_and_by_how_much(
    opts: HybridOptions, variant: str, fragments: list[str]
) -> None:
    with pytest.raises(HybridBudgetError) as err:
        plan_hybrid(
            config=_cfg(), num_ranks=4, num_sms=24, knobs=EpKnobs(hybrid_kernel=variant), options=opts
        )
    for f in fragments:
        assert f in str(err.value), str(err.value)


def test_ordered_pair_needs_one_word_per_channel() -> None:
    # 16 x 2 counting signals do not fit, 16 tails do
    plan = plan_hybrid(
        config=_cfg(),
        num_ranks=4,
        num_sms=24,
        knobs=EpKnobs(hybrid_kernel="ordered"),
        options=HybridOptions(channels=16, parts=2),
    )
    assert plan.signal_words == 16


def test_topology_limits() -> None:
    wide = MoEConfig(max_tokens=8, hidden_size=64, num_experts=66, top_k=2, num_hosts=2)
    with pytest.raises(
        HybridBudgetError, match=r"gpus_per_host .* needs 33 but the limit is 32 \(over by 1\)"
    ):
        plan_hybrid(config=wide, num_ranks=66, num_sms=8, knobs=EpKnobs(), options=HybridOptions())
    many = MoEConfig(max_tokens=8, hidden_size=64, num_experts=31, top_k=2, num_hosts=31)
    with pytest.raises(
        HybridBudgetError, match=r"num_hosts=31 .* needs 30 but the limit is 29 \(over by 1\)"
    ):
        plan_hybrid(config=many, num_ranks=31, num_sms=8, knobs=EpKnobs(), options=HybridOptions())
    with pytest.raises(ValueError, match="needs 2 or more"):
        plan_hybrid(config=_cfg(4, 1), num_ranks=4, num_sms=8, knobs=EpKnobs(), options=HybridOptions())


def test_hosts_on_separate_machines_keep_the_reference() -> None:
    """Virtual hosts (one machine) run the hybrid pair; real ones are refused with the reason, since the
    kernels reach other hosts through peer mappings only."""
    from lck_ep.hybrid import hybrid_problem

    cfg = _cfg(4, 2)
    assert hybrid_problem(num_ranks=4, num_topk=2, config=cfg, one_machine=True) is None
    why = hybrid_problem(num_ranks=4, num_topk=2, config=cfg, one_machine=False)
    assert why is not None and "2 hosts are separate machines" in why and "not built yet" in why


# ------------------------------------------------------------------------------------- virtual hosts


def test_host_blocks_and_forwarders() -> None:
    assert host_blocks(4, 2, 2) == [(0, 1), (2, 3)]
    assert host_blocks(8, 2, 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert host_blocks(8, 4, 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    with pytest.raises(ValueError, match="num_hosts=3 x gpus_per_host=2 != 8"):
        host_blocks(8, 3, 2)
    for hosts, g in ((2, 2), (2, 4), (4, 2)):
        blocks = host_blocks(hosts * g, hosts, g)
        for src in range(hosts * g):
            for h in range(hosts):
                f = forwarder(src, h, g)
                # the forwarder is on the destination host, with the source's local index
                assert f in blocks[h] and f % g == src % g


def test_workspace_has_a_hybrid_area_per_other_host() -> None:
    one = MoEConfig(max_tokens=48, hidden_size=7168, num_experts=64, top_k=8)
    assert moe_hybrid_area_bytes(one, 8) == 0
    for hosts in (2, 4):
        cfg = MoEConfig(max_tokens=48, hidden_size=7168, num_experts=64, top_k=8, num_hosts=hosts)
        area = moe_hybrid_area_bytes(cfg, 8)
        assert moe_workspace_bytes(cfg, 8) == moe_workspace_bytes(one, 8) + (hosts - 1) * area
        g, row = 8 // hosts, 7168 * 2 + 8 * 12
        assert area >= g * 48 * row  # the combine relay
        # every admissible plan's staging fits
        for channels in range(1, SIGNAL_BUDGET + 1):
            for parts in range(1, SIGNAL_BUDGET // channels + 1):
                for subs in (1, 2, 16):
                    q = -(-48 // channels)
                    assert channels * channel_bytes(q, parts, subs, row, header_bytes(g)) <= area
    assert HYBRID_MAX_CHANNELS >= SIGNAL_BUDGET


# ------------------------------------------------------------------------------------- geometry


def test_parts_are_non_empty_and_the_first_is_smallest() -> None:
    for q in range(1, 80):
        for parts in range(1, 9):
            p = parts_used(q, parts)
            bounds = [part_begin(q, p, j) for j in range(p + 1)]
            assert bounds[0] == 0 and bounds[-1] == q
            sizes = [b - a for a, b in itertools.pairwise(bounds)]
            assert all(s >= 1 for s in sizes), (q, parts, sizes)
            assert sizes[0] <= min(sizes), (q, parts, sizes)


def test_sub_parts_respect_the_knobs() -> None:
    for q in range(1, 70):
        for subs in (1, 2, 4, 16):
            for min_sub in (1, 8, 15):
                n = sub_count(q, subs, min_sub)
                assert 1 <= n <= subs
                if q >= min_sub:
                    assert q // n >= min_sub  # every sub-part carries at least min_sub rows
                else:
                    assert n == 1


@pytest.mark.parametrize("subs", [1, 2, 4])
@pytest.mark.parametrize("min_sub", [1, 8, 15])
def test_channel_sub_parts_tile_the_channel(subs: int, min_sub: int) -> None:
    """What the sender puts and the forwarder expects: the rows [0, m) exactly once, in order, each sub-part
    at a fixed place of the channel (its header then its rows, no overlap), the continuation flag set when
    rows follow the part, an empty channel as one header-only sub-part."""
    rng = random.Random(subs * 100 + min_sub)
    row, hb = 48, header_bytes(2)
    for _ in range(300):
        cap, channels, parts = rng.randint(1, 200), rng.randint(1, 8), rng.randint(1, 4)
        q = -(-cap // channels)
        n = rng.randint(0, cap)
        total = 0
        for c in range(channels):
            lo, hi = channel_range(n, c, channels)
            m = hi - lo
            assert 0 <= m <= q
            total += m
            sps = channel_sub_parts(m, q, parts, subs, min_sub, row, hb)
            if m == 0:
                assert [(s.part, s.index, s.rows) for s in sps] == [(0, 0, 0)]
                continue
            assert sps[0].first == 0 and sum(s.rows for s in sps) == m
            end = 0
            for s in sps:
                assert s.first == end and s.rows >= 1
                end += s.rows
                assert s.index < subs and s.part < parts
                assert s.more == (m > part_begin(q, parts_used(q, parts), s.part + 1))
            spans = sorted((s.offset, s.offset + hb + s.rows * row) for s in sps)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            assert spans[-1][1] <= channel_bytes(q, parts, subs, row, hb)
        assert total == n


# ------------------------------------------------------------------------------------- codegen


def test_codegen_keys_the_pairs_apart() -> None:
    from lck_ep.hybrid_codegen import hybrid_kernel_names, hybrid_source, hybrid_spec

    for role in ("dispatch", "combine"):
        u, o = hybrid_source(role, "unordered"), hybrid_source(role, "ordered")
        assert u != o and '#include "hybrid_unordered.cuh"' in u and '#include "hybrid_ordered.cuh"' in o
        assert hybrid_kernel_names("ordered")[role] == f"ep_hybrid_{role}_ordered"
        assert hybrid_spec(role, EpKnobs()).defines == {}
        spec = hybrid_spec(role, EpKnobs(num_sub_parts=4, min_sub_tokens=8, sm100_min_sub_tokens=32))
        assert spec.defines == {"EP_NUM_SUB_PARTS": 4, "EP_MIN_SUB_TOKENS": 8, "EP_SM100_MIN_SUB_TOKENS": 32}
    with pytest.raises(ValueError, match="hybrid_kernel must be one of unordered, ordered"):
        hybrid_source("dispatch", "sorted")


@pytest.mark.nvcc
@pytest.mark.parametrize("variant", ["unordered", "ordered"])
def test_both_pairs_compile_for_hopper_and_blackwell(variant: str) -> None:
    from pathlib import Path

    from lck_ep.hybrid import compile_hybrid_kernels

    seen: set[str] = set()
    for knobs in (
        EpKnobs(hybrid_kernel=variant),
        EpKnobs(hybrid_kernel=variant, num_sub_parts=4, min_sub_tokens=8),
        EpKnobs(hybrid_kernel=variant, num_sub_parts=1, sm100_min_sub_tokens=32),
    ):
        for arch in ("sm_90a", "sm_100a"):
            paths = compile_hybrid_kernels(arch, knobs)
            assert set(paths) == {f"ep_hybrid_dispatch_{variant}", f"ep_hybrid_combine_{variant}"}
            assert all(Path(p).is_file() for p in paths.values())
            seen |= set(paths.values())
    assert len(seen) == 3 * 2 * 2  # every knob set and architecture is its own cache entry


@pytest.mark.nvcc
def test_warmup_lists_the_hybrid_pair(capsys: Any, monkeypatch: Any, no_ep_knobs: None) -> None:
    from lck_ep.cli import main

    monkeypatch.setenv("EP_HYBRID_KERNEL", "ordered")
    assert main(["warmup", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    for role in ("dispatch", "combine"):
        line = next(x for x in out.splitlines() if x.startswith(f"ep_hybrid_{role}_ordered "))
        assert "hybrid" in line and role in line
    assert "ep_hybrid_dispatch_unordered" not in out


# ------------------------------------------------------------------------------------- CPU: selection


def _selection(rank: int, world: int) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer
    from lck_runtime import fake_nvshmem

    g = dist.group.WORLD
    out: dict[str, Any] = {}
    fake_nvshmem.install(rank, world)
    assert L.configure(
        moe=L.MoEConfig(max_tokens=8, hidden_size=16, num_experts=4 * world, top_k=2, num_hosts=2)
    )
    ctx = L.moe_context(None) if hasattr(L, "moe_context") else None
    if ctx is None:
        from lck_runtime.contexts import moe_context

        ctx = moe_context(None)
    out["hosts"] = [ctx.host_of(r) for r in range(world)]
    out["one machine"] = ctx.one_machine
    out["auto on cpu"] = Buffer(g, 8, 16, 2, 4 * world).backend
    out["nvshmem on cpu"] = error_text(Buffer, g, 8, 16, 2, 4 * world, backend="nvshmem")
    os.environ.update({"EP_HYBRID_CHANNELS": "16", "EP_HYBRID_NUM_PARTS": "2"})
    out["budget, nvshmem"] = error_text(Buffer, g, 8, 16, 2, 4 * world, backend="nvshmem")
    out["budget, auto"] = error_text(Buffer, g, 8, 16, 2, 4 * world)
    out["budget, reference"] = Buffer(g, 8, 16, 2, 4 * world, backend="reference").backend
    for knob in ("EP_HYBRID_CHANNELS", "EP_HYBRID_NUM_PARTS"):
        os.environ.pop(knob)
    L.finalize()
    return out


def test_selection_and_budget_errors_agree_on_every_rank() -> None:
    outs = run_workers(_selection, 4, timeout=TIMEOUT, env={"LCK_SETUP_TIMEOUT": "60"})
    assert [o["hosts"] for o in outs] == [[0, 0, 1, 1]] * 4
    assert all(o["one machine"] is True for o in outs)
    want = {
        "auto on cpu": "reference",
        "nvshmem on cpu": "the native kernels move CUDA tensors, got device=cpu",
        "budget, nvshmem": "EP_HYBRID_CHANNELS=16 x EP_HYBRID_NUM_PARTS=2 counting signals per peer slot",
        "budget, auto": "(over by 3)",
        "budget, reference": "reference",
    }
    assert_every_rank_says(outs, want)


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_hybrid_0_kernels_build_before_the_workers() -> None:
    """Every kernel the GPU tests load (the native receive side, the layout kernel and the hybrid pair, for
    each set of JIT knobs they use), compiled here in parallel into the run's JIT cache: the workers then
    load instead of queueing behind one compiler."""
    from concurrent.futures import ThreadPoolExecutor

    from _hybrid_worker import all_knobs

    from lck_ep.codegen import NATIVE_KERNELS
    from lck_ep.hybrid import compile_hybrid_kernels
    from lck_ep.jit import compile_layout_kernel
    from lck_ep.native import compile_native_kernels
    from lck_runtime.jit import detect_arch

    need_gpus(1)
    arch = detect_arch()
    jobs = []
    for knobs in all_knobs():
        jobs.append(lambda k=knobs: compile_hybrid_kernels(arch, k))
        jobs.append(lambda k=knobs: compile_layout_kernel(arch, knobs=k))
        jobs += [
            lambda k=knobs, n=name: compile_native_kernels(arch, k, only=(n,)) for name in NATIVE_KERNELS
        ]
    with ThreadPoolExecutor(max_workers=12) as pool:
        for f in [pool.submit(job) for job in jobs]:
            f.result()


def _suite(world: int, hosts: int, variant: str) -> None:
    from _hybrid_worker import suite

    need_gpus(world)
    seed = random.randrange(1, 2**30)
    env = gpu_env(world, {"EP_HYBRID_KERNEL": variant})
    outs = run_workers(suite, world, hosts, seed, timeout=TIMEOUT, env=env)
    errors = [e for per_rank in outs for e in per_rank]
    assert not errors, f"seed {seed}:\n" + "\n".join(errors[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unordered", "ordered"])
def test_hybrid_2x2_equals_reference_bit_for_bit(variant: str) -> None:
    _suite(4, 2, variant)


@pytest.mark.gpu
def test_hybrid_sub_part_sweep_debug_reorder_and_budget() -> None:
    """2 x 2: EP_NUM_SUB_PARTS in {1, 2, 4} x EP_MIN_SUB_TOKENS in {1, 8} over both pairs, the unordered
    pair with its puts held back and issued newest first, then a budget too small refused on every rank."""
    from _hybrid_worker import sweep

    need_gpus(4)
    seed = random.randrange(1, 2**30)
    outs = run_workers(sweep, 4, 2, seed, timeout=2 * TIMEOUT, env=gpu_env(4))
    errors = [e for per_rank in outs for e in per_rank]
    assert not errors, f"seed {seed}:\n" + "\n".join(errors[:40])


# ------------------------------------------------------------------------------- the protocol, simulated


def _simulate(
    world: int, hosts: int, tokens: list[int], topk: int, channels: int, parts: int, seed: int
) -> None:
    """The hybrid dispatch and combine as the kernels run them (host streams, channels, sub-parts at fixed
    staging offsets, forwarding with header base slots plus a running count, relaying, per-channel puts),
    with puts landing in a random order; checks that every row ends where the native receiver reads it."""
    rng = random.Random(seed)
    g, e_per_rank = world // hosts, 2
    experts = e_per_rank * world
    row, hb, subs, min_sub = 1, header_bytes(g), 2, 1
    cap = max(tokens)
    q = -(-cap // channels)
    routes = [[rng.sample(range(-1, experts), topk) for _ in range(n)] for n in tokens]
    mask = [
        [[any(0 <= e and e // e_per_rank == d for e in r) for d in range(world)] for r in rs] for rs in routes
    ]
    regions: dict[tuple[int, int], dict[int, int]] = {}  # (dest, src) -> {slot: token}
    counts: dict[tuple[int, int], int] = {}
    puts = []  # (forwarder, area, channel, sub-part, [(token, dest bits)], base slots)
    for m in range(world):
        host = m // g
        excl = [[sum(mask[m][u][d] for u in range(t)) for d in range(world)] for t in range(tokens[m])]
        for d in range(host * g, (host + 1) * g):  # scale-up: straight to the destination
            for t in range(tokens[m]):
                if mask[m][t][d]:
                    regions.setdefault((d, m), {})[excl[t][d]] = t
            counts[(d, m)] = sum(mask[m][t][d] for t in range(tokens[m]))
        for h in range(hosts):
            if h == host:
                continue
            stream = [t for t in range(tokens[m]) if any(mask[m][t][h * g : (h + 1) * g])]
            b = forwarder(m, h, g)
            area = host if host < h else host - 1
            for c in range(channels):
                lo, hi = channel_range(len(stream), c, channels)
                for sp in channel_sub_parts(hi - lo, q, parts, subs, min_sub, row, hb):
                    rows = stream[lo + sp.first : lo + sp.first + sp.rows]
                    base = [excl[rows[0]][h * g + i] if rows else 0 for i in range(g)]
                    bits = [[mask[m][t][h * g + i] for i in range(g)] for t in rows]
                    puts.append((b, area, c, sp, m, list(zip(rows, bits)), base))
    rng.shuffle(puts)  # the unordered pair: sub-parts land, and are forwarded, in any order
    for b, _, _, _, src, rows, base in puts:
        run = [0] * g
        for t, bits in rows:  # one warp per sub-part, rows in order, a running count per rank of the host
            for i in range(g):
                if bits[i]:
                    d = (b // g) * g + i
                    regions.setdefault((d, src), {})[base[i] + run[i]] = t
                    run[i] += 1
                    counts[(d, src)] = counts.get((d, src), 0) + 1
    for d in range(world):
        for s in range(world):
            want = [t for t in range(tokens[s]) if mask[s][t][d]]
            got = regions.get((d, s), {})
            assert counts.get((d, s), 0) == len(want), (d, s)
            assert [got.get(i) for i in range(len(want))] == want, (d, s, got, want)
    # combine: each destination's partial rows for a source, in its received order, relayed on the
    # destination's host and put per channel into the source's region for that destination
    back: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    for d in range(world):
        for s in range(world):
            recv = [t for t in range(tokens[s]) if mask[s][t][d]]  # d's rows from s, s's token order
            if s // g == d // g:
                back[(s, d)] = {i: (d, t) for i, t in enumerate(recv)}
                continue
            relay = recv  # into forwarder (host of d, local index of s): (area, local(d)) block, row i
            for c in range(channels):
                lo, hi = channel_range(len(relay), c, channels)
                for i in range(lo, hi):
                    back.setdefault((s, d), {})[i] = (d, relay[i])
    for s in range(world):
        for t in range(tokens[s]):
            for d in range(world):
                if mask[s][t][d]:
                    slot = sum(mask[s][u][d] for u in range(t))
                    assert back[(s, d)][slot] == (d, t)


@pytest.mark.parametrize(("world", "hosts"), [(4, 2), (8, 2), (8, 4), (6, 3)])
@pytest.mark.parametrize("channels", [1, 3, 8])
def test_protocol_simulated_puts_in_any_order(world: int, hosts: int, channels: int) -> None:
    rng = random.Random(world * 100 + hosts * 10 + channels)
    for trial in range(3):
        tokens = [rng.randint(0, 12) for _ in range(world)]
        tokens[0] = max(tokens[0], 1)
        _simulate(world, hosts, tokens, rng.randint(1, 3), channels, rng.randint(1, 4), trial)


@pytest.mark.gpu
def test_a_rank_that_stops_calling_makes_the_others_raise_within_the_bound() -> None:
    from _hybrid_worker import stop

    need_gpus(4)
    bound = 2.0
    outs = run_workers(stop, 4, 2, bound, timeout=TIMEOUT, env=gpu_env(4))
    assert {(o["backend"], o["state"]) for o in outs} == {("nvshmem", "HybridEp")}
    for r, o in enumerate(outs[:-1]):
        err = o.get("error", "")
        assert err.startswith("NativeTimeoutError"), (r, o)
        assert "group rank 3" in err, err
        assert o["seconds"] < bound + 15, o


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hosts", "variant"), [(2, "unordered"), (4, "unordered"), (2, "ordered"), (4, "ordered")]
)
def test_hybrid_8pes_equals_reference_bit_for_bit(hosts: int, variant: str) -> None:
    """8 PEs as 2 x 4 and 4 x 2 virtual hosts (run after the 2 x 2 tests: the slowest)."""
    _suite(8, hosts, variant)
