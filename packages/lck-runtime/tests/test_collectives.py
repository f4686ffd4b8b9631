"""FlsceContext.all_reduce_ over torch.distributed: numerics against a float64 reference, validation."""

from __future__ import annotations

from typing import Any

from _observed import raised

from lck_runtime.testing import run_workers

SEED = 1234
SHAPES = [(1,), (7,), (3, 5), (16, 8)]  # up to the capacity 16 * 8


def _inputs(rank: int, shape: tuple[int, ...], case: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(SEED + 1000 * case + rank)
    return torch.randn(shape, generator=g, dtype=torch.float32) * 3.0


def _reduce(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import lck_runtime as L

    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    ep = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    solo = [dist.new_group([r]) for r in range(world)][rank]
    F = L.FusedLinearCrossEntropyConfig
    L.configure(process_groups={"tp": tp, "ep": ep, "solo": solo}, flsce=F(16, 8, 32, group="tp"))
    for name in ("ep", "solo", None):
        L.configure(flsce=F(16, 8, 32, group=name))
    worst: dict[str, float] = {}
    case = 0
    for name in ("tp", "ep", "solo", None):
        ctx = L.flsce_context(name)
        for shape in SHAPES:
            for op in ("sum", "max"):
                case += 1
                t = _inputs(rank, shape, case)
                ref = torch.stack([_inputs(r, shape, case).double() for r in ctx.ranks])
                ref = ref.sum(0) if op == "sum" else ref.amax(0)
                out = ctx.all_reduce_(t, op)
                assert out is t, "all_reduce_ must return its argument"
                err = float((t.double() - ref).abs().max())
                key = f"{name}/{op}"
                worst[key] = max(worst.get(key, 0.0), err)
    ctx = L.flsce_context("tp")
    empty = torch.empty(0)
    errors = {
        "not a tensor": raised(ctx.all_reduce_, [1.0], "sum"),
        "dtype": raised(ctx.all_reduce_, torch.ones(4, dtype=torch.float64), "sum"),
        "device": raised(ctx.all_reduce_, torch.ones(4, device="meta"), "sum"),
        "contiguity": raised(ctx.all_reduce_, torch.ones(4, 6).t(), "sum"),
        "size": raised(ctx.all_reduce_, torch.ones(16 * 8 + 1), "sum"),
        "op": raised(ctx.all_reduce_, torch.ones(4), "min"),
    }
    # Inside CUDA-graph capture only NCCL is taken: on this gloo group both "auto" and a forced "torch" are
    # refused before anything is launched (capture is simulated: this test has no GPU).
    import lck_runtime.capture as C

    real, C.capturing = C.capturing, lambda device: True
    try:
        t = torch.ones(4)
        errors["captured auto"] = raised(ctx.all_reduce_, t, "sum")
        errors["captured torch"] = raised(lambda: ctx.all_reduce_(t, "sum", algorithm="torch"))
        errors["captured untouched"] = "ok" if bool((t == 1).all()) else "t was changed"
    finally:
        C.capturing = real
    return {"worst": worst, "errors": errors, "empty": ctx.all_reduce_(empty, "max") is empty}


def test_all_reduce_matches_float64_reference_on_three_partitions() -> None:
    outs = run_workers(_reduce, 4, timeout=300)
    for o in outs:
        for key, err in o["worst"].items():
            # max is exact; a sum of <= 4 fp32 values of magnitude ~10 rounds within a few ulps
            assert err <= (0.0 if key.endswith("max") else 1e-5), (key, err)
        e = o["errors"]
        assert e["not a tensor"] == "TypeError: all_reduce_: t must be a torch.Tensor, got list"
        assert e["dtype"] == "TypeError: all_reduce_: t must be float32, got torch.float64"
        assert e["device"].startswith("ValueError: all_reduce_: t must be on cpu")
        assert e["contiguity"].startswith("ValueError: all_reduce_: t must be contiguous, got shape (6, 4)")
        assert e["size"].startswith(
            "ValueError: all_reduce_: t has 129 elements, more than the context's capacity 128"
        )
        assert e["op"] == "ValueError: all_reduce_: op must be one of ('sum', 'max'), got 'min'"
        refused = (
            "ValueError: all_reduce_: inside CUDA-graph capture the all-reduce takes NCCL, but the group's "
            "backend is gloo"
        )
        assert e["captured auto"] == refused and e["captured torch"] == refused, e
        assert e["captured untouched"] == "ok"
        assert o["empty"]
