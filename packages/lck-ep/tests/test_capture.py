"""Dispatch and combine called while a CUDA graph is being captured (:mod:`lck_ep.capture`).

A problem on one rank during a capture must raise the same error on every rank then, not leave the others
with a graph that hangs at replay. Each rank reports, per case, the error it raised; the test asserts one
message per case across the ranks, with the expected type and fragments.

- CPU (2 gloo processes): the capture is simulated by reporting the stream as capturing, so the agreement
  path runs for real (the group is gloo, so it agrees over the group itself); the agreed, correct calls
  give the same bits as eager sync-free calls.
- GPU (``multigpu(2)``, NCCL): real captures, agreeing over the group's gloo mirror; a correct call is
  captured after the failed ones and replayed against eager.
"""

from __future__ import annotations

import random
import traceback
from typing import Any

import pytest
import torch
from _routing import route

from lck_runtime.testing import run_workers

T_MAX, H, K, LOCAL = 16, 40, 2, 2

# case -> (exception type, fragments of the message every rank raises)
EXPECTED = {
    "hidden_on_rank1": ("ValueError", ["rank 1: dispatch: x has hidden size 41", f"hidden={H}"]),
    "too_many_tokens_on_rank0": (
        "ValueError",
        ["rank 0: dispatch: x has 17 tokens", f"max_tokens_per_rank={T_MAX}"],
    ),
    "worst_tokens_differ": ("ValueError", ["ranks disagree on num_worst_tokens", "rank 0: 20", "rank 1: 21"]),
    "synced_dispatch": ("ValueError", ["dispatch: a synced dispatch reads the received counts on the host"]),
    "combine_rows_on_rank1": ("ValueError", ["rank 1: combine: x must have one row per received rows"]),
}


def _inputs(rank: int, world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 31 + rank)
    t = int(torch.randint(1, T_MAX + 1, (1,), generator=g))
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    return x, route("balanced", t, K, LOCAL * world, world, g), torch.rand(t, K, generator=g)


def _worker(rank: int, world: int, seed: int, real: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from lck_ep import Buffer, capture

    out: dict[str, Any] = {}
    try:
        if real:
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device("cpu")
            capture.capturing = lambda device: True  # the simulated capture: the agreement path runs
        group = dist.group.WORLD
        free = Buffer(group, T_MAX, H, K, LOCAL * world, sync_free=True, layout="torch")
        synced = Buffer(group, T_MAX, H, K, LOCAL * world, layout="torch")
        x, idx, w = (t.to(dev) for t in _inputs(rank, world, seed))
        d = free.dispatch(x, idx, w)  # eager warm-up (and the handle combine cases use)
        if real:
            torch.cuda.synchronize()

        def captured(fn):
            if not real:
                return fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            return graph

        def attempt(name: str, fn) -> None:
            try:
                captured(fn)
                out[name] = "no error"
            except (TypeError, ValueError) as exc:
                out[name] = f"{type(exc).__name__}: {exc}"

        wide = torch.randn(x.shape[0], H + 1, device=dev).to(torch.bfloat16)
        many = torch.randn(T_MAX + 1, H, device=dev).to(torch.bfloat16)
        many_idx = torch.zeros(T_MAX + 1, K, dtype=torch.int64, device=dev)
        attempt("hidden_on_rank1", lambda: free.dispatch(wide if rank == 1 else x, idx, w))
        attempt(
            "too_many_tokens_on_rank0", lambda: free.dispatch(*((many, many_idx) if rank == 0 else (x, idx)))
        )
        attempt("worst_tokens_differ", lambda: free.dispatch(x, idx, w, num_worst_tokens=20 + rank))
        attempt("synced_dispatch", lambda: synced.dispatch(x, idx, w))
        short = d.recv_x[: max(0, d.recv_x.shape[0] - 1)] if rank == 1 else d.recv_x
        attempt("combine_rows_on_rank1", lambda: free.combine(short, d.handle))

        # The ranks are still in step: a correct round trip, captured (or agreed) then checked against eager.
        sx = x.clone()
        res: dict[str, torch.Tensor] = {}

        def round_trip() -> None:
            got = free.dispatch(sx, idx, w)
            res["recv"] = got.recv_x
            res["combined"] = free.combine(got.recv_x, got.handle)[0]

        round_trip()  # eager warm-up of the exact calls the capture records
        if real:
            torch.cuda.synchronize()
        graph = captured(round_trip)
        sx.copy_(torch.randn(sx.shape, generator=torch.Generator().manual_seed(seed + 7 * rank)).to(sx))
        if real:
            graph.replay()
            torch.cuda.synchronize()
        else:
            round_trip()
        want = free.dispatch(sx, idx, w)
        want_c = free.combine(want.recv_x, want.handle)[0]
        out["round_trip_equal"] = bool(torch.equal(res["recv"], want.recv_x)) and bool(
            torch.equal(res["combined"], want_c)
        )
    except Exception:
        out["crash"] = f"rank {rank}:\n{traceback.format_exc()}"
    return out


def _check(results: list[dict[str, Any]], seed: int) -> None:
    crashes = [r["crash"] for r in results if "crash" in r]
    assert not crashes, f"seed {seed}:\n" + "\n".join(crashes)
    for case, (kind, fragments) in EXPECTED.items():
        messages = {r[case] for r in results}
        assert len(messages) == 1, f"seed {seed}: {case}: the ranks raised different errors: {messages}"
        msg = messages.pop()
        assert msg.startswith(f"{kind}: "), f"seed {seed}: {case}: {msg}"
        for frag in fragments:
            assert frag in msg, f"seed {seed}: {case}: {frag!r} not in {msg!r}"
    assert all(r["round_trip_equal"] for r in results), (
        f"seed {seed}: a captured round trip differs from eager"
    )


def test_problem_on_one_rank_during_a_simulated_capture_raises_on_both() -> None:
    seed = random.randrange(1, 2**30)
    _check(run_workers(_worker, 2, seed, False, timeout=300), seed)


@pytest.mark.multigpu(2)
def test_problem_on_one_rank_during_a_real_capture_raises_on_both() -> None:
    seed = random.randrange(1, 2**30)
    _check(run_workers(_worker, 2, seed, True, backend="nccl", timeout=300), seed)
