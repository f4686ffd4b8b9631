"""The JIT-compiled team barrier (``lck_runtime.signals``).

CPU: the kernel compiles for every target; arguments and diagnostics are validated and worded.
One GPU: a team of one, and a simulated silent or runaway peer (local memory standing in for it).
Two GPUs: the real thing over NVSHMEM symmetric buffers, brought up with raw nvshmem4py in two NCCL
processes: hundreds of epochs carrying data, a member that never arrives, and epochs out of step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from lck_runtime.jit import F32, I32, Jit, Ptr
from lck_runtime.jit.cubin import kernel_symbols
from lck_runtime.signals import (
    OUT_OF_STEP,
    STATUS_WORDS,
    TIMED_OUT,
    BarrierError,
    TeamBarrier,
    check_barrier_status,
    compile_barrier,
    new_barrier_status,
    team_barrier,
)
from lck_runtime.testing import run_workers

NVSHMEM_ENV = {
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NVSHMEM_SYMMETRIC_SIZE": "1G",
}

FILL_ROW = r"""
extern "C" __global__ void fill_row(float* dst, float base, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = base + (float)i;
}
"""


# ---------------------------------------------------------------------------------------------- CPU


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_barrier_compiles_for_each_target(tmp_path, arch):
    path = compile_barrier(arch, Jit(cache_dir=tmp_path / "cache"))
    assert kernel_symbols(path.read_bytes()) == ["lck_team_barrier"]


@pytest.mark.parametrize(
    "ptrs, index, exc, match",
    [
        ([], 0, ValueError, "has 0 entries, expected 1 to 1024"),
        ([4096, 0], 0, ValueError, r"peer_flag_ptrs\[1\] = 0 is not a non-null 8-byte-aligned address"),
        ([4096, 4100], 0, ValueError, r"peer_flag_ptrs\[1\] = 4100 is not a non-null"),
        ([4096, 4096], 0, ValueError, "repeated addresses"),
        ([4096, "8192"], 0, ValueError, r"peer_flag_ptrs\[1\] = '8192'"),
        ([4096, 8192], 2, ValueError, r"TeamBarrier: my_index must be in \[0, 1\], got 2"),
        ([4096, 8192], True, TypeError, "TeamBarrier: my_index must be an int"),
        (4096, 0, TypeError, "peer_flag_ptrs must be a sequence of ints"),
    ],
)
def test_team_barrier_object_validation(ptrs, index, exc, match):
    with pytest.raises(exc, match=match):
        TeamBarrier(ptrs, index)


def test_team_barrier_timeout_validation():
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds in \(0, 3600\]"):
        TeamBarrier([4096, 8192], 0, timeout_s=0)


def test_status_diagnostics_are_worded():
    check_barrier_status(torch.zeros(STATUS_WORDS, dtype=torch.int64))
    timed_out = torch.tensor([TIMED_OUT, 1, 4, 5, 250_000_000])
    with pytest.raises(
        BarrierError,
        match=r"member 0: team barrier timed out after 250 ms waiting for epoch 5: team member 1 has announced epoch 4 only",
    ) as err:
        check_barrier_status(timed_out, my_index=0)
    assert (err.value.code, err.value.member, err.value.seen, err.value.epoch) == (TIMED_OUT, 1, 4, 5)
    with pytest.raises(
        BarrierError,
        match=r"epochs out of step: waiting for epoch 2 but team member 3 already announced epoch 7",
    ):
        check_barrier_status(torch.tensor([OUT_OF_STEP, 3, 7, 2, 10]))
    with pytest.raises(ValueError, match=r"status must be an int64 tensor of shape \(5,\)"):
        check_barrier_status(torch.zeros(4, dtype=torch.int64))


# ------------------------------------------------------------------------------------- one GPU


@pytest.mark.gpu
@pytest.mark.nvcc
def test_team_of_one_many_epochs():
    flags = torch.zeros(1, dtype=torch.int64, device="cuda")
    barrier = TeamBarrier([flags.data_ptr()], 0, timeout_s=5)
    for _ in range(100):
        barrier.wait()
    barrier.check()
    assert barrier.epoch == 100 and flags.item() == 100


@pytest.mark.gpu
@pytest.mark.nvcc
def test_silent_peer_times_out_with_a_diagnostic():
    mine = torch.zeros(2, dtype=torch.int64, device="cuda")
    peer = torch.zeros(2, dtype=torch.int64, device="cuda")  # stands in for a member that never runs
    barrier = TeamBarrier([mine.data_ptr(), peer.data_ptr()], 0, timeout_s=0.3)
    t0 = time.monotonic()
    barrier.wait()
    with pytest.raises(
        BarrierError, match=r"timed out after \d+ ms waiting for epoch 1: team member 1 has announced epoch 0"
    ) as err:
        barrier.check()
    elapsed = time.monotonic() - t0
    assert err.value.code == TIMED_OUT and err.value.member == 1 and err.value.waited_ns >= 300_000_000
    assert elapsed < 10, f"the timed-out barrier took {elapsed:.1f} s to return"
    assert peer.tolist() == [1, 0], "our announcement must still reach the peer's slot 0"
    # The team is broken: later barriers return at once and the error stays.
    t0 = time.monotonic()
    for _ in range(5):
        barrier.wait()
    with pytest.raises(BarrierError, match="team member 1"):
        barrier.check()
    assert time.monotonic() - t0 < 0.3 * 5, "barriers after a failure must not each wait for the timeout"
    assert peer.tolist() == [1, 0]


@pytest.mark.gpu
@pytest.mark.nvcc
def test_runaway_peer_is_out_of_step():
    mine = torch.tensor([0, 3], dtype=torch.int64, device="cuda")  # member 1 already announced epoch 3
    peer = torch.zeros(2, dtype=torch.int64, device="cuda")
    barrier = TeamBarrier([mine.data_ptr(), peer.data_ptr()], 0, timeout_s=5)
    barrier.wait()
    with pytest.raises(
        BarrierError, match="out of step: waiting for epoch 1 but team member 1 already announced epoch 3"
    ):
        barrier.check()


@pytest.mark.gpu
@pytest.mark.nvcc
def test_team_barrier_argument_validation():
    flags = torch.zeros(2, dtype=torch.int64, device="cuda")
    table = torch.tensor([flags.data_ptr(), flags.data_ptr() + 8], dtype=torch.int64, device="cuda")
    status = new_barrier_status()
    cases = [
        (dict(peer_flag_ptrs=table.int()), ValueError, "peer_flag_ptrs must be int64"),
        (dict(peer_flag_ptrs=table.cpu()), ValueError, r"peer_flag_ptrs is on cpu, expected cuda:\d"),
        (dict(peer_flag_ptrs=table.view(2, 1)), ValueError, "peer_flag_ptrs must be a contiguous 1-D tensor"),
        (dict(peer_flag_ptrs=[1, 2]), TypeError, "peer_flag_ptrs must be a torch.Tensor"),
        (dict(status=status[:4]), ValueError, r"status must be shape \(5,\)"),
        (dict(status=status.float()), ValueError, "status must be int64"),
        (dict(my_index=2), ValueError, r"my_index must be in \[0, 1\], got 2"),
        (dict(epoch=0), ValueError, r"epoch must be in \[1, "),
        (dict(epoch=1.0), TypeError, "epoch must be an int"),
        (dict(timeout_s=-1), ValueError, "timeout_s must be a number of seconds"),
    ]
    for override, exc, match in cases:
        kwargs = dict(peer_flag_ptrs=table, my_index=0, epoch=1, status=status, timeout_s=1.0) | override
        with pytest.raises(exc, match=match):
            team_barrier(**kwargs)
    torch.cuda.synchronize()
    assert flags.tolist() == [0, 0] and status.tolist() == [0] * STATUS_WORDS, "a refused call touched state"


# ------------------------------------------------------------------------------ two GPUs, NVSHMEM


def _nvshmem_session(rank: int, world: int):
    """Bring NVSHMEM up in this worker the way lck does: unique id from rank 0 over torch.distributed."""
    import nvshmem.core as nvshmem
    import torch.distributed as dist

    try:
        from cuda.core import Device
    except ImportError:  # cuda-core < 0.4
        from cuda.core.experimental import Device

    device = Device(torch.cuda.current_device())
    device.set_current()
    uid = nvshmem.get_unique_id(empty=rank != 0)
    box = [uid]
    dist.broadcast_object_list(box, src=0)
    nvshmem.init(device=device, uid=box[0], rank=rank, nranks=world, initializer_method="uid")
    return nvshmem


def _symmetric_flags(nvshmem, world: int):
    import torch.distributed as dist

    flags = nvshmem.tensor((world,), dtype=torch.int64)
    flags.zero_()
    torch.cuda.synchronize()
    dist.barrier()  # every member's flags are zero before anyone announces an epoch
    ptrs = [nvshmem.get_peer_tensor(flags, pe).data_ptr() for pe in range(world)]
    return flags, ptrs


@contextmanager
def _flags_session(rank: int, world: int) -> Iterator[tuple[Any, torch.Tensor, list[int]]]:
    """NVSHMEM up in this worker, with zeroed symmetric flags and every member's address of them; the
    flags are freed when the body returns, NVSHMEM is finalized however it ends."""
    nvshmem = _nvshmem_session(rank, world)
    try:
        flags, ptrs = _symmetric_flags(nvshmem, world)
        yield nvshmem, flags, ptrs
        nvshmem.free_tensor(flags)
    finally:
        nvshmem.finalize()


def _exchange_worker(rank: int, world: int, epochs: int) -> dict:
    import torch.distributed as dist

    width = 256
    with _flags_session(rank, world) as (nvshmem, flags, ptrs):
        data = nvshmem.tensor((2, world, width), dtype=torch.float32)  # [parity, source member, :]
        data.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier()
        rows = [
            [nvshmem.get_peer_tensor(data, pe)[parity, rank].data_ptr() for pe in range(world)]
            for parity in (0, 1)
        ]
        fill = Jit(prefix="LCK").build("test_fill_row", FILL_ROW, "fill_row")
        barrier = TeamBarrier(ptrs, rank, timeout_s=30)
        history = torch.full((epochs, world, width), float("nan"), device="cuda")
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for e in range(1, epochs + 1):
            if rank == world - 1 and e % 5 == 0:
                torch.cuda._sleep(2_000_000)  # this member is late: the others must wait for its data
            for pe in range(world):
                fill.launch(1, width, [Ptr(rows[e % 2][pe]), F32(e * 1000.0 + rank * 300.0), I32(width)])
            barrier.wait()
            history[e - 1].copy_(data[e % 2])
        end.record()
        barrier.check()
        torch.cuda.synchronize()
        e = torch.arange(1, epochs + 1, device="cuda", dtype=torch.float32).view(-1, 1, 1)
        src = torch.arange(world, device="cuda", dtype=torch.float32).view(1, -1, 1)
        j = torch.arange(width, device="cuda", dtype=torch.float32).view(1, 1, -1)
        expected = e * 1000 + src * 300 + j
        bad = (history != expected).any(dim=2).nonzero().tolist()
        first_bad = None
        if bad:
            ep, s = bad[0]
            first_bad = f"epoch {ep + 1}, source {s}: got {history[ep, s, :4].tolist()}, expected {expected[ep, s, :4].tolist()}"
        dist.barrier()
        result = {
            "bad_rows": len(bad),
            "first_bad": first_bad,
            "flags": flags.tolist(),
            "epoch": barrier.epoch,
            "us_per_epoch": start.elapsed_time(end) * 1000 / epochs,
        }
        del history, rows
        nvshmem.free_tensor(data)
        return result


def _absent_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    with _flags_session(rank, world) as (_, flags, ptrs):
        out: dict = {}
        if rank == 0:  # rank 1 never arrives
            barrier = TeamBarrier(ptrs, rank, timeout_s=0.5)
            t0 = time.monotonic()
            barrier.wait()
            try:
                barrier.check()
                out["error"] = None
            except BarrierError as exc:
                out.update(
                    error=str(exc),
                    code=exc.code,
                    member=exc.member,
                    seen=exc.seen,
                    epoch=exc.epoch,
                    waited_ns=exc.waited_ns,
                )
            out["elapsed"] = time.monotonic() - t0
        dist.barrier()  # rank 0 has finished (and synchronized) its barrier
        out["flags"] = flags.tolist()
        dist.barrier()
        return out


def _out_of_step_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    with _flags_session(rank, world) as (_, _, ptrs):
        table = torch.tensor(ptrs, dtype=torch.int64, device="cuda")
        status = new_barrier_status()
        team_barrier(table, rank, 1, status=status, timeout_s=10)
        check_barrier_status(status, rank)  # epoch 1 is fine on both
        # Rank 0 jumps to epoch 4 while rank 1 goes on with epoch 2.
        team_barrier(table, rank, 4 if rank == 0 else 2, status=status, timeout_s=0.5)
        try:
            check_barrier_status(status, rank)
            out: dict = {"error": None}
        except BarrierError as exc:
            out = {"error": str(exc), "code": exc.code, "member": exc.member, "seen": exc.seen}
        dist.barrier()
        return out


@pytest.fixture(scope="module")
def worker_cache(tmp_path_factory):
    """One JIT cache for every worker process of this module: the ranks race for the first build."""
    return str(tmp_path_factory.mktemp("signals-jit"))


@pytest.mark.gpu
@pytest.mark.multigpu(2)
@pytest.mark.nvcc
def test_nvshmem_barrier_orders_data_over_many_epochs(worker_cache):
    epochs = 300
    results = run_workers(
        _exchange_worker,
        2,
        epochs,
        backend="nccl",
        timeout=400,
        env={**NVSHMEM_ENV, "LCK_JIT_CACHE_DIR": worker_cache},
    )
    for rank, r in enumerate(results):
        assert r["bad_rows"] == 0, (
            f"rank {rank}: {r['bad_rows']} rows arrived late or wrong; first: {r['first_bad']}"
        )
        assert r["epoch"] == epochs and r["flags"] == [epochs, epochs], f"rank {rank}: {r}"
    print(f"team barrier + 2 row stores, 2 x H200: {[round(r['us_per_epoch'], 1) for r in results]} us/epoch")


@pytest.mark.gpu
@pytest.mark.multigpu(2)
@pytest.mark.nvcc
def test_nvshmem_barrier_member_never_arrives(worker_cache):
    r0, r1 = run_workers(
        _absent_worker, 2, backend="nccl", timeout=300, env={**NVSHMEM_ENV, "LCK_JIT_CACHE_DIR": worker_cache}
    )
    assert r0["error"] is not None, "rank 0's barrier passed although rank 1 never arrived"
    assert (r0["code"], r0["member"], r0["seen"], r0["epoch"]) == (TIMED_OUT, 1, 0, 1), r0
    assert r0["waited_ns"] >= 500_000_000 and r0["elapsed"] < 20, r0
    assert "team member 1 has announced epoch 0" in r0["error"]
    # Rank 0 announced epoch 1 in slot 0 of both arrays (rank 1's over NVLink); nobody wrote slot 1.
    assert r0["flags"] == [1, 0] and r1["flags"] == [1, 0], (r0["flags"], r1["flags"])


@pytest.mark.gpu
@pytest.mark.multigpu(2)
@pytest.mark.nvcc
def test_nvshmem_barrier_epochs_out_of_step(worker_cache):
    r0, r1 = run_workers(
        _out_of_step_worker,
        2,
        backend="nccl",
        timeout=300,
        env={**NVSHMEM_ENV, "LCK_JIT_CACHE_DIR": worker_cache},
    )
    # Rank 1 (epoch 2) sees rank 0 already at 4; rank 0 (epoch 4) waits for rank 1 in vain.
    assert (r1["code"], r1["member"], r1["seen"]) == (OUT_OF_STEP, 0, 4), r1
    assert (r0["code"], r0["member"], r0["seen"]) == (TIMED_OUT, 1, 2), r0
