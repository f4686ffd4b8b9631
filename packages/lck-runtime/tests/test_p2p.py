"""The one-shot NVLink all-reduce (``lck_runtime.p2p``) and ``all_reduce_``'s algorithm choice.

CPU: the sizing rules, both kernels compiling for every supported architecture, and the algorithm
argument refused with the reason on the torch.distributed path. Two H200s: both kernels (the standard
one and the low-latency one) against a float64 reference and NCCL (sums, maxima, odd sizes, unaligned
tensors, one rank aligned and the other not, several slots per call), the same bits on both ranks,
back-to-back calls of both kinds with fresh data on two streams, and a peer that never arrives: NaN and
a diagnostic instead of a hang. Both kernels are loaded by ``configure``, before the first call (two
GPUs, and two PEs sharing one GPU under MPS).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from _observed import per_rank

from lck_runtime import p2p
from lck_runtime.testing import (
    SHARED_GPU_SKIP,
    SINGLE_HOST_NVSHMEM_ENV,
    error_text,
    mps_daemon_running,
    run_workers,
    shared_gpu_env,
)

SEED = 20261201
KERNELS = (p2p.KERNEL, p2p.KERNEL_LL)


def test_sizing_rules() -> None:
    # A capacity that fits the 64 MiB receive area is kept (rounded up to whole 4 KiB slots) ...
    assert p2p.slot_floats(2, 1000) == 1024 and p2p.slot_floats(2, 4096) == 4096
    # ... a larger one is cut to the area: 2 parities x 2 members x 4 Mi floats = 64 MiB at TP2.
    assert p2p.slot_floats(2, 8192 * 4096) == 4 << 20
    assert p2p.recv_numel(2, 4 << 20) * 4 == p2p.BUFFER_BYTES
    assert p2p.slot_floats(8, 8192 * 4096) == 1 << 20
    for size in (2, 3, 4, 8, 64):
        slot = p2p.slot_floats(size, 1 << 30)
        assert slot % p2p.SLOT_ALIGN == 0 and p2p.recv_numel(size, slot) * 4 <= p2p.BUFFER_BYTES
    assert p2p.flags_numel(4) == 4 * p2p.MAX_BLOCKS and p2p.ll_numel(4) == 2 * 4 * p2p.LL_SLOT
    # "auto": any size for two members; beyond two, only the low-latency sizes.
    assert p2p.auto_takes(2, 1 << 30) and p2p.auto_takes(8, p2p.LL_SLOT)
    assert not p2p.auto_takes(4, p2p.LL_SLOT + 1) and not p2p.auto_takes(8, 1 << 25)
    # Blocks depend on the element count only (every member launches the same grid).
    assert [p2p.blocks_for(n) for n in (1, 8192, 8193, 10**9)] == [1, 1, 2, p2p.MAX_BLOCKS]


@pytest.mark.nvcc
@pytest.mark.parametrize("kernel", [p2p.KERNEL, p2p.KERNEL_LL])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_kernel_compiles(tmp_path, arch: str, kernel: str) -> None:
    from lck_runtime.jit import Jit

    path = p2p.compile_kernel(arch, Jit(cache_dir=tmp_path), kernel)
    assert path.is_file() and path.stat().st_size > 0


def _cpu_algorithms(rank: int, world: int) -> dict[str, str]:
    import torch

    import lck_runtime as L

    L.configure(flsce=L.FusedLinearCrossEntropyConfig(16, 8, 32))
    ctx = L.flsce_context()
    try:
        t = torch.full((8,), float(rank + 1))
        out = {"p2p flag": str(ctx.p2p)}
        for algorithm in ("p2p", "nvshmem", "fast", 3):
            out[str(algorithm)] = error_text(ctx.all_reduce_, t, "sum", algorithm=algorithm)
        ctx.all_reduce_(t, "sum", algorithm="torch")
        out["torch"] = str(t.tolist())
        ctx.check_collectives()  # nothing to check on this path: returns
        return out
    finally:
        L.finalize()


def test_algorithm_choice_is_checked_on_the_torch_distributed_path() -> None:
    for o in run_workers(_cpu_algorithms, 2, env={"LCK_DISABLE_NVSHMEM": "1"}):
        assert o["p2p flag"] == "False"
        assert o["p2p"] == (
            "ValueError: all_reduce_: algorithm 'p2p' is not available: the context runs over "
            "torch.distributed (lck_runtime.configure returned False)"
        )
        assert o["nvshmem"].startswith("ValueError: all_reduce_: algorithm 'nvshmem' needs the NVSHMEM path")
        assert o["fast"] == (
            "ValueError: all_reduce_: algorithm must be one of ('auto', 'p2p', 'nvshmem', 'torch'), got 'fast'"
        )
        assert o["3"].startswith("ValueError: all_reduce_: algorithm must be one of")
        assert o["torch"] == str([3.0] * 8)


def _peerless_rank(rank: int, world: int) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    import lck_runtime as L
    from lck_runtime import fake_nvshmem

    fake_nvshmem.install(rank, world, peer_fails=rank == 1)  # the native path's bookkeeping on CPU
    F = L.FusedLinearCrossEntropyConfig
    pair = dist.new_group([0, 1])
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["native"] = L.configure(process_groups={"pair": pair}, flsce=F(16, 8, 8, group="pair"))
    out["warnings"] = [str(w.message) for w in caught if "one-shot" in str(w.message)]
    ctx = L.flsce_context("pair")
    out["p2p after"] = ctx.p2p
    # A later configure (a new name for the same members) does not try again: the context's epochs are
    # not restarted behind the other ranks' backs.
    L.configure(process_groups={"again": pair}, flsce=F(16, 8, 8, group="again"))
    out["p2p after again"] = (L.flsce_context("again") is ctx, ctx.p2p)
    out["forced"] = error_text(ctx.all_reduce_, __import__("torch").ones(4), "sum", algorithm="p2p")
    L.finalize()
    return out


def test_a_rank_without_peer_views_turns_the_one_shot_path_off_everywhere() -> None:
    for o, where in per_rank(run_workers(_peerless_rank, 2)):
        assert o["native"] is True, where
        assert len(o["warnings"]) == 1, where
        assert "bootstrap rank 1: RuntimeError: no load/store view of PE 0 (simulated)" in o["warnings"][0], (
            where
        )
        assert o["p2p after"] is False and o["p2p after again"] == (True, False), where
        assert o["forced"].startswith("ValueError: all_reduce_: algorithm 'p2p' is not available"), where


# ---------------------------------------------------------------------------------------------------------
# Two GPUs
# ---------------------------------------------------------------------------------------------------------


def _rand(rank: int, case: int, numel: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(SEED + 7919 * case + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float32) * 4.0).cuda()


def _loaded_here() -> list[bool]:
    """Whether each one-shot kernel is loaded on the current device (before this process's first call)."""
    import torch

    from lck_runtime.jit import detect_arch

    dev, arch = torch.cuda.current_device(), detect_arch()
    return [(k, arch) in p2p._kernels and dev in p2p._kernels[(k, arch)]._functions for k in KERNELS]


def _two_gpus(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import lck_runtime as L

    out: dict[str, Any] = {}
    # capacity 4 * 8192 = 32768 floats: one slot of 32768 at TP2 (the area allows far more)
    native = L.configure(flsce=L.FusedLinearCrossEntropyConfig(4096, 8, 16))
    try:
        ctx = L.flsce_context()
        out["native, p2p, slot"] = (native, ctx.p2p, ctx._p2p.slot if ctx.p2p else None)
        out["loaded at configure"] = _loaded_here()
        worst: dict[str, float] = {}
        same_bits = True
        case = 0
        # odd sizes, a size that is not a multiple of 4, sizes spanning 1, 2 and 128 blocks, the capacity
        # ll_max 0: every call takes the standard kernel; otherwise these sizes take the low-latency one
        for numel, ll_max in itertools.product(
            (1, 3, 1000, 8191, 8193, 65536 // 4 + 5, ctx.capacity), (p2p.LL_SLOT, 0)
        ):
            ctx._p2p.ll_max = ll_max
            for op in ("sum", "max"):
                # offset 1: a tensor 4 bytes off 16-byte alignment (scalar path); (0, 1): the ranks take
                # different paths over the same block ranges.
                for offsets in ((0, 0), (1, 1), (0, 1)):
                    case += 1
                    t = _rand(rank, case, numel + offsets[rank])[offsets[rank] :]
                    ref = torch.stack(
                        [_rand(r, case, numel + offsets[r])[offsets[r] :].double() for r in range(world)]
                    )
                    ref = ref.sum(0) if op == "sum" else ref.amax(0)
                    peer = t.clone()
                    ctx.all_reduce_(t, op, algorithm="p2p")
                    dist.all_reduce(peer, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
                    key = f"{op}"
                    worst[key] = max(worst.get(key, 0.0), float((t.double() - ref).abs().max()))
                    worst["vs nccl " + key] = max(
                        worst.get("vs nccl " + key, 0.0), float((t - peer).abs().max())
                    )
                    both = [torch.empty_like(t) for _ in range(world)]
                    dist.all_gather(both, t)
                    same_bits &= all(torch.equal(both[0], b) for b in both[1:])
        out["worst"], out["same bits on both ranks"] = worst, same_bits
        # Several slots in one call: a context whose slot is smaller than its capacity.
        ctx._p2p.slot, saved, ctx._p2p.ll_max = 4096, ctx._p2p.slot, 0
        case += 1
        t = _rand(rank, case, 3 * 4096 + 12)
        ref = _rand(0, case, t.numel()).double() + _rand(1, case, t.numel()).double()
        ctx.all_reduce_(t, "sum", algorithm="p2p")
        out["chunked"] = float((t.double() - ref).abs().max())
        ctx._p2p.slot = saved
        # Back to back, fresh data every call, alternating sizes and two streams (the receive area's two
        # parities are reused every other call).
        # 1000 and 7 floats take the low-latency kernel, 30000 the standard one: the two kinds interleave
        # over one epoch counter.
        ctx._p2p.ll_max = 5000
        side = torch.cuda.Stream()
        fails = 0
        for i in range(200):
            case += 1
            numel = (1000, 30000, 7)[i % 3]
            t = _rand(rank, case, numel)
            ref = _rand(0, case, numel).double() + _rand(1, case, numel).double()
            stream = side if i % 5 == 4 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                ctx.all_reduce_(t, "sum")  # auto: the one-shot path
            torch.cuda.current_stream().wait_stream(stream)
            fails += int(float((t.double() - ref).abs().max()) > 1e-4)
        out["back to back failures"] = fails
        ctx.check_collectives()
        out["auto vs nvshmem"] = error_text(
            ctx.all_reduce_, torch.ones(8, device="cuda"), "sum", algorithm="nvshmem"
        )
        # A peer that never arrives: rank 1 skips a call; rank 0 times out, gets NaN, and check raises.
        ctx._p2p.timeout_ns = int(2e9)
        dist.barrier()
        if rank == 0:
            t = torch.ones(5000, device="cuda")
            ctx.all_reduce_(t, "sum", algorithm="p2p")
            torch.cuda.synchronize()
            out["skipped peer: all NaN"] = bool(torch.isnan(t).all())
            out["skipped peer: check"] = error_text(ctx.check_collectives)
            # Broken for good: the next call (standard kernel) fails fast (NaN at once), not after another
            # timeout.
            ctx._p2p.ll_max = 0
            t = torch.ones(8, device="cuda")
            ctx.all_reduce_(t, "sum", algorithm="p2p")
            torch.cuda.synchronize()
            out["after failure"] = bool(torch.isnan(t).all())
        dist.barrier()
    finally:
        L.finalize()
    return out


@pytest.mark.multigpu(2)
def test_one_shot_all_reduce_on_two_gpus() -> None:
    outs = run_workers(_two_gpus, 2, backend="nccl", timeout=240, env=SINGLE_HOST_NVSHMEM_ENV)
    for o, where in per_rank(outs):
        assert o["native, p2p, slot"] == (True, True, 32768), where
        assert o["loaded at configure"] == [True, True], where
        w = o["worst"]
        assert w["max"] == 0.0 and w["vs nccl max"] == 0.0, where
        assert w["sum"] <= 1e-5 and w["vs nccl sum"] <= 1e-5, where  # two fp32 addends: at most one rounding
        assert o["same bits on both ranks"], where
        assert o["chunked"] <= 1e-5, where
        assert o["back to back failures"] == 0, where
        assert o["auto vs nvshmem"] == "<no error>", where
    o = outs[0]
    assert o["skipped peer: all NaN"] is True, o
    assert o["skipped peer: check"].startswith("BarrierError: member 0: team barrier timed out"), o
    assert "team member 1" in o["skipped peer: check"], o
    assert o["after failure"] is True, o


def _one_gpu(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import lck_runtime as L

    torch.cuda.set_device(0)
    out: dict[str, Any] = {}
    native = L.configure(flsce=L.FusedLinearCrossEntropyConfig(4096, 8, 16))
    try:
        ctx = L.flsce_context()
        out["native, p2p"] = (native, ctx.p2p)
        out["loaded at configure"] = _loaded_here()
        worst = 0.0
        for case, numel in enumerate((1000, 30000, 4 * 8192)):  # the low-latency kernel, then the standard
            ctx._p2p.ll_max = p2p.LL_SLOT if numel == 1000 else 0
            t = _rand(rank, case, numel)
            ref = _rand(0, case, numel).double() + _rand(1, case, numel).double()
            # torch's own kernels load lazily too: each rank runs the ones above before either waits in
            # the exchange (the hazard the runtime README describes for shared GPUs).
            torch.cuda.synchronize()
            dist.barrier()
            ctx.all_reduce_(t, "sum", algorithm="p2p")
            worst = max(worst, float((t.double() - ref).abs().max()))
        ctx.check_collectives()
        out["worst"] = worst
    finally:
        L.finalize()
    return out


@pytest.mark.gpu
def test_one_shot_kernels_load_at_configure_with_two_pes_on_one_gpu() -> None:
    """Two PEs on one GPU under MPS: configure has loaded both kernels on every member before any call
    (a member that loaded one at its first call could wait behind a peer spinning in it), and the
    exchange between the two PEs' peer views of one GPU's memory is exact."""
    if not mps_daemon_running():
        pytest.skip(SHARED_GPU_SKIP)
    env = {**SINGLE_HOST_NVSHMEM_ENV, **shared_gpu_env(2, 1)}
    for o, where in per_rank(run_workers(_one_gpu, 2, backend="gloo", timeout=240, env=env)):
        assert o["native, p2p"] == (True, True), where
        assert o["loaded at configure"] == [True, True], where
        assert o["worst"] <= 1e-5, where
