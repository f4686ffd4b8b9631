"""The native (NVSHMEM) backend: selection and its errors on CPU, kernels compiled with nvcc, and on a GPU
every output bit for bit equal to the reference backend's with 2, 4 and 8 PEs (several PEs share a GPU
under CUDA MPS where fewer GPUs are lent), CUDA-graph replay, 200 round trips, and a PE that stops
calling making the others raise within the bound.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from _native_gpu import gpu_env, need_gpus

from lck_runtime.testing import assert_every_rank_says, error_text, run_workers

TIMEOUT = 150


# ---------------------------------------------------------------------------------------- CPU: selection


def _selection(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer
    from lck_runtime import fake_nvshmem

    g = dist.group.WORLD
    out: dict[str, Any] = {}
    out["auto, unconfigured"] = Buffer(g, 8, 16, 2, 4 * world).backend
    out["nvshmem, unconfigured"] = error_text(Buffer, g, 8, 16, 2, 4 * world, backend="nvshmem")
    out["bad backend"] = error_text(Buffer, g, 8, 16, 2, 4 * world, backend="nccl")
    out["bad num_sms"] = error_text(Buffer, g, 8, 16, 2, 4 * world, num_sms=0)
    out["bad timeout"] = error_text(Buffer, g, 8, 16, 2, 4 * world, timeout_s=-1.0)
    out["bad early_receive_bytes"] = error_text(Buffer, g, 8, 16, 2, 4 * world, early_receive_bytes=-1)
    out["bool early_receive_bytes"] = error_text(Buffer, g, 8, 16, 2, 4 * world, early_receive_bytes=True)
    out["early_receive_bytes"] = [Buffer(g, 8, 16, 2, 4 * world, early_receive_bytes=v).early_receive_bytes
                                  for v in (None, 0, 1 << 30)]  # fmt: skip
    # Ranks that size the early receive differently would size their synced outputs differently.
    out["early disagree"] = error_text(
        Buffer, g, 8, 16, 2, 4 * world, early_receive_bytes=1 << 30 if rank == 1 else None
    )
    # A rank that asks for another backend than its peers is refused on every rank.
    out["disagree"] = error_text(
        Buffer, g, 8, 16, 2, 4 * world, backend="nvshmem" if rank == 1 else "reference"
    )
    fake_nvshmem.install(rank, world)
    assert L.configure(moe=L.MoEConfig(max_tokens=8, hidden_size=16, num_experts=4 * world, top_k=2))
    out["auto, native context on cpu"] = Buffer(g, 8, 16, 2, 4 * world).backend
    out["nvshmem on cpu"] = error_text(Buffer, g, 8, 16, 2, 4 * world, backend="nvshmem")
    out["gloo with cuda, reference"] = error_text(
        Buffer, g, 8, 16, 2, 4 * world, device="cuda:0", backend="reference"
    )
    L.finalize()
    return out


def test_backend_selection_and_its_errors_agree_on_every_rank() -> None:
    outs = run_workers(_selection, 2, timeout=TIMEOUT, env={"LCK_SETUP_TIMEOUT": "60"})
    want = {
        "auto, unconfigured": "reference",
        "nvshmem, unconfigured": "backend='nvshmem' cannot run: no MoE context is configured for this group",
        "bad backend": "backend must be one of 'auto', 'nvshmem', 'reference', got 'nccl'",
        "bad num_sms": "num_sms must be None or an int in [1, 1024], got 0",
        "bad timeout": "timeout_s must be a number of seconds in (0, 3600], got -1.0",
        "bad early_receive_bytes": "early_receive_bytes must be None or an int in [0, 2**50], got -1",
        "bool early_receive_bytes": "early_receive_bytes must be None or an int in [0, 2**50], got True",
        "early disagree": "early_receive_bytes",
        "auto, native context on cpu": "reference",
        "nvshmem on cpu": "the native kernels move CUDA tensors, got device=cpu",
        "gloo with cuda, reference": "a gloo group moves CPU tensors, got device=cuda:0",
    }
    assert_every_rank_says(outs, want)
    assert all(o["early_receive_bytes"] == [16 << 20, 0, 1 << 30] for o in outs), outs
    assert len({o["early disagree"] for o in outs}) == 1, outs
    disagree = {o["disagree"] for o in outs}
    assert len(disagree) == 1, disagree
    msg = disagree.pop()
    # rank 1 cannot build a native Buffer (no context yet): its reason reaches rank 0 too
    assert "rank 1: Buffer: backend='nvshmem' cannot run" in msg, msg


def test_native_problem_names_the_limit() -> None:
    from lck_ep.native import native_problem, row_layout
    from lck_runtime import MoEConfig

    cfg = MoEConfig(max_tokens=128, hidden_size=7168, num_experts=16, top_k=8)
    assert native_problem(hidden=7168, num_topk=8, num_ranks=2, max_tokens=128, config=cfg) is None
    assert native_problem(hidden=100, num_topk=1, num_ranks=2, max_tokens=1, config=cfg) is None
    msg = native_problem(hidden=7168, num_topk=8, num_ranks=2, max_tokens=129, config=cfg)
    assert msg is not None and "max_tokens_per_rank=129" in msg, msg
    big = MoEConfig(max_tokens=8, hidden_size=64, num_experts=16, top_k=1)
    msg = native_problem(hidden=64, num_topk=1, num_ranks=600, max_tokens=8, config=big)
    assert msg is not None and "at most 512 ranks" in msg, msg
    # every row the runtime sizes holds the hidden state and the routing of any smaller Buffer
    for h in (1, 2, 3, 7, 8, 100, 7168):
        for k in range(1, 9):
            lay = row_layout(4, h, k)
            assert lay.row_stride % 16 == 0
            assert (
                native_problem(hidden=h, num_topk=k, num_ranks=2, max_tokens=4, config=MoEConfig(4, h, 8, k))
                is None
            )


@pytest.mark.nvcc
def test_expanded_handle_fields_of_a_native_dispatch() -> None:
    """The host side of the native expanded dispatch, kernels stubbed: the handle's expanded fields are the
    tensors the kernels wrote (a GPU-only path, so a wrong call here would otherwise show only on a GPU)."""
    from types import SimpleNamespace

    import torch

    from lck_ep._native_exchange import _expand

    calls = {}

    class _Kernels:
        def expand_maps(self, topk_idx, kept, alignment, offsets, src_row, slot, index):
            calls["maps"] = (kept, alignment)
            offsets.copy_(torch.arange(offsets.numel()))
            src_row.fill_(3)
            slot.fill_(1)
            index.fill_(2)

        def copy_rows(self, x, starts, src_row, recv_x, num_sms, rows_end=None, index=None, src_idx=None):
            calls["rows"] = num_sms
            calls["src_idx"] = src_idx  # where a pulled row sits in its source's region
            calls["rows_end"] = (
                rows_end  # where the rows in use end: the maps' offsets[L], read on the device
            )
            calls["index"] = index  # each received row's expanded rows: the row is read once for all of them
            recv_x.fill_(7.0)

    buf = SimpleNamespace(device=torch.device("cpu"), num_local_experts=2, num_topk=3, num_sms=5)
    kept = torch.tensor([4, 1], dtype=torch.int32)
    out = {
        "recv_topk_idx": torch.zeros(4, 3, dtype=torch.int64),
        "kept_per_expert": kept,
        "recv_starts": None,
        "recv_src_idx": torch.zeros(4, dtype=torch.int64),
    }
    recv_x, fields = _expand(_Kernels(), buf, torch.ones(4, 8), out, rows=4, m=6, alignment=1)
    assert calls["maps"] == (kept, 1) and calls["rows"] == 5
    assert calls["rows_end"].shape == (1,) and int(calls["rows_end"]) == 2  # offsets[L] = arange(3)[2]
    assert calls["rows_end"].data_ptr() == fields["expert_offsets"][2:].data_ptr()
    assert calls["index"] is fields["recv_expanded_index"]
    assert calls["src_idx"] is out["recv_src_idx"]
    assert recv_x.shape == (6, 8) and bool((recv_x == 7.0).all())
    assert fields["num_expanded_rows"] == 6
    assert torch.equal(fields["expert_offsets"], torch.arange(3))
    assert torch.equal(fields["expanded_src_row"], torch.full((6,), 3))
    assert torch.equal(fields["expanded_slot"], torch.full((6,), 1))
    assert torch.equal(fields["recv_expanded_index"], torch.full((4, 3), 2))


def test_expanded_tables_sit_after_the_most_rows_alike_on_every_rank() -> None:
    from lck_ep.native import expanded_tables

    t = expanded_tables(most_rows=10, row_bytes=200, most_received=7, num_topk=3)
    assert t.index_offset == 2000 and t.index_offset % 16 == 0
    assert t.weights_offset == 2000 + 96 and t.weights_offset % 16 == 0  # 7 * 3 int32 = 84 -> 96
    assert t.end == t.weights_offset + 84
    # depends on nothing a rank holds alone (its own rows or received rows): the same offsets everywhere
    assert expanded_tables(10, 200, 7, 3) == t
    odd = expanded_tables(most_rows=3, row_bytes=14, most_received=1, num_topk=1)
    assert odd.index_offset == 48 and odd.weights_offset == 64 and odd.end == 68


def test_a_zero_copy_expanded_combine_publishes_its_maps_and_reduces_on_the_sources(monkeypatch) -> None:
    """The host side of a zero-copy combine of an expanded handle, kernels stubbed: the received rows' maps go
    into the workspace at the tables' offsets, nothing is sent, and the sources' launch gets the tables."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from lck_ep import _native_exchange
    from lck_ep.checks import CombinePlan
    from lck_ep.native import expanded_tables

    calls: dict = {}

    class _State:
        armed = None

        def raise_if_failed(self) -> None:
            pass

        def takes_in_place(self, x, handle) -> bool:
            return True

        def send_partials(self, *a, **k) -> None:
            calls["sent"] = True

        def send_expanded_partials(self, *a, **k) -> None:
            calls["sent"] = True

        def publish_expanded_maps(self, index, weights, tables) -> None:
            calls["maps"] = (index, weights, tables)

        def reduce_partials(self, partial, starts, out, mask, slot, bias, num_sms, timeout_ns, **kw) -> None:
            calls["reduce"] = (partial, kw)
            out.fill_(1.0)

    n, k, m, h = 5, 3, 11, 8
    handle = SimpleNamespace(
        expand=True, recv_expanded_index=torch.zeros(n, k, dtype=torch.int64), most_expanded_rows=16,
        num_topk=k, recv_counts_device=None, recv_starts=None, num_tokens=4, is_token_in_rank=None,
        send_slot=None, sync_free=False,
    )  # fmt: skip
    buf = SimpleNamespace(
        _native=_State(), device=torch.device("cpu"), hidden=h, num_sms=3, timeout_ns=1, worst_case_tokens=6
    )
    x = torch.randn(m, h, dtype=torch.bfloat16)
    w = torch.rand(n, k)
    plan = CombinePlan(x=x, handle=handle, topk_weights=w, bias=())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # a CPU stand-in
    out = _native_exchange.combine(buf, plan)
    assert "sent" not in calls  # the rows stay where the experts wrote them
    index, weights, tables = calls["maps"]
    assert index is handle.recv_expanded_index and torch.equal(weights, w)
    assert tables == expanded_tables(16, h * 2, 6, k)
    partial, kw = calls["reduce"]
    assert partial.data_ptr() == x.data_ptr() and kw["pull"] is True
    assert kw["expanded"] == (tables, n, k, True)
    assert out.shape == (4, h) and out.dtype == torch.bfloat16


def test_warmup_compiles_every_native_kernel(capsys: Any) -> None:
    """Built into the run's shared EP_JIT_CACHE_DIR, so later tests load instead of compiling again."""
    from pathlib import Path

    from lck_ep.cli import KERNEL_ROLES, main

    assert main(["warmup", "--arch", "sm_90a,sm_100a"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in KERNEL_ROLES:
        rows = [i for i, line in enumerate(lines) if line.startswith(name + " ")]
        assert len(rows) == 2, (name, lines)  # one per architecture, each with its role and cubin path
        assert KERNEL_ROLES[name] in lines[rows[0]]
        for i in rows:
            assert Path(lines[i + 1].strip()).is_file(), lines[i + 1]
    assert main(["warmup", "--arch", "sm_80"]) == 2


# ---------------------------------------------------------------------------------------- GPU: real NVSHMEM


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_native_equals_reference_bit_for_bit(world: int) -> None:
    from _native_worker import suite

    need_gpus(world)
    seed = random.randrange(1, 2**30)
    outs = run_workers(suite, world, seed, timeout=300, env=gpu_env(world))
    errors = [e for per_rank in outs for e in per_rank]
    assert not errors, f"seed {seed}:\n" + "\n".join(errors[:40])


@pytest.mark.gpu
def test_native_fp8_rows_equal_reference() -> None:
    from _native_worker import fp8

    need_gpus(2)
    seed = random.randrange(1, 2**30)
    outs = run_workers(fp8, 2, seed, timeout=TIMEOUT, env=gpu_env(2))
    errors = [e for per_rank in outs for e in per_rank]
    assert not errors, f"seed {seed}:\n" + "\n".join(errors[:40])


@pytest.mark.gpu
def test_a_combine_whose_ranks_take_their_input_differently_raises_on_every_rank() -> None:
    from _native_worker import mixed

    need_gpus(2)
    outs = run_workers(mixed, 2, 5.0, timeout=TIMEOUT, env=gpu_env(2))
    for r, o in enumerate(outs):
        assert o["backend"] == "nvshmem", (r, o)
        assert "must take its input the same way" in o.get("error", ""), (r, o)
        assert o["seconds"] < 5.0, (r, o)  # found at once, not after the wait's bound


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_native_with_the_group_agreement_equals_reference_bit_for_bit(world: int) -> None:
    """The whole suite with its synced calls agreeing over the process group (EP_DEVICE_AGREEMENT=0) instead
    of through the workspaces (the default, which the other suite runs)."""
    from _native_worker import suite

    need_gpus(world)
    seed = random.randrange(1, 2**30)
    env = gpu_env(world, {"EP_DEVICE_AGREEMENT": "0"})
    outs = run_workers(suite, world, seed, timeout=300, env=env)
    errors = [e for per_rank in outs for e in per_rank]
    assert not errors, f"seed {seed}:\n" + "\n".join(errors[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_the_device_agreement_raises_the_same_error_on_every_rank(world: int) -> None:
    """Synced calls agreeing through the workspaces (the default): refused arguments raise the same error on
    every rank, including the replay and the combine, whose launches are enqueued before the verdict is read
    (the device skips them), and the context stays usable after each refusal."""
    from _native_worker import agreement

    need_gpus(world)
    bound = 2.0
    outs = run_workers(agreement, world, bound, timeout=TIMEOUT, env=gpu_env(world))
    for r, o in enumerate(outs):
        assert o["backend"] == "nvshmem" and o["device_agreement"], (r, o)
        assert not o["errors"], o["errors"]
        assert "ranks disagree on expand (rank 0: False, rank 1: True" in o.get("disagree", ""), (r, o)
        assert o.get("local", "").startswith("TypeError: rank 0: dispatch: topk_idx"), (r, o)
        assert "outside [-1," in o.get("range", "") and "rank 1" in o.get("range", ""), (r, o)
        assert "ranks disagree on handle_seq" in o.get("replay", ""), (r, o)
        assert "ranks disagree on num_bias (rank 0: 1, rank 1: 0" in o.get("combine", ""), (r, o)
    for key in ("disagree", "local", "range", "replay", "combine"):
        assert len({o[key] for o in outs}) == 1, (key, [o[key] for o in outs])
    for r, o in enumerate(outs[:-1]):
        err = o.get("stop", "")
        assert err.startswith("NativeTimeoutError"), (r, o)
        assert "argument agreement, waiting for a member's arguments" in err, err
        assert f"group rank {world - 1}" in err, err
        assert o["seconds"] < bound + 15, o


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_stops_calling_makes_the_others_raise_within_the_bound(world: int) -> None:
    from _native_worker import stop

    need_gpus(world)
    bound = 2.0
    outs = run_workers(stop, world, bound, timeout=TIMEOUT, env=gpu_env(world))
    assert {o["backend"] for o in outs} == {"nvshmem"}
    for r, o in enumerate(outs[:-1]):
        err = o.get("error", "")
        assert err.startswith("NativeTimeoutError"), (r, o)
        assert "dispatch, waiting for a source's rows" in err and f"group rank {world - 1}" in err, err
        assert o["seconds"] < bound + 15, o
        assert o.get("later", "").startswith("NativeTimeoutError"), o
