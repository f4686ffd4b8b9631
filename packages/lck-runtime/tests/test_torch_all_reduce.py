"""torch_all_reduce_: the torch.distributed fallback of the runtime's all-reduce, and its host route for
CUDA tensors on gloo groups.

- CPU: sum and max over gloo against a float64 reference; ``reduces_on_host`` of the groups at hand.
- GPU (``gpu``): two gloo ranks sharing one GPU reduce CUDA tensors; every tensor gloo receives is a host
  tensor, the result is on the caller's device and equals the reference.
- Two GPUs (``multigpu(2)``): a rank on GPU 1 reduces a CUDA tensor over gloo and has opened no context
  on GPU 0 afterwards (gloo's own CUDA path opens one there; measured on two H200s).
"""

from __future__ import annotations

from typing import Any

import pytest

from lck_runtime.testing import run_workers

SEED = 99


def _inputs(rank: int, n: int, case: int, device: str = "cpu") -> Any:
    import torch

    g = torch.Generator().manual_seed(SEED + 100 * case + rank)
    return (torch.randn(n, generator=g, dtype=torch.float32) * 2.0).to(device)


def _reduce(rank: int, world: int, device: str) -> dict:
    import torch
    import torch.distributed as dist

    from lck_runtime import collectives

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    seen: list[str] = []
    real = dist.all_reduce

    def recording(t: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(t.device))
        return real(t, *args, **kwargs)

    dist.all_reduce = recording
    worst = {}
    try:
        for case, (n, op) in enumerate([(1, "sum"), (1000, "sum"), (4099, "max"), (3, "max")]):
            t = _inputs(rank, n, case, device)
            ref = torch.stack([_inputs(r, n, case).double() for r in range(world)])
            ref = ref.sum(0) if op == "sum" else ref.amax(0)
            out = collectives.torch_all_reduce_(t, op, dist.group.WORLD)
            assert out is t and str(t.device) == device, (out is t, t.device)
            worst[op] = max(worst.get(op, 0.0), float((t.cpu().double() - ref).abs().max()))
    finally:
        dist.all_reduce = real
    return {"worst": worst, "seen": sorted(set(seen)), "host": collectives.reduces_on_host(dist.group.WORLD)}


def _check(outs: list[dict], world: int) -> None:
    for o in outs:
        assert o["host"] is True
        assert o["seen"] == ["cpu"], o["seen"]  # gloo only ever got host tensors
        assert o["worst"]["max"] == 0.0, o  # a max picks one input exactly
        assert o["worst"]["sum"] <= 1e-5 * world, o  # float32 sums of a few values of size ~2


def test_sum_and_max_over_gloo_on_cpu() -> None:
    _check(run_workers(_reduce, 3, "cpu", timeout=120), 3)


@pytest.mark.gpu
def test_cuda_tensors_on_gloo_go_through_the_host() -> None:
    _check(run_workers(_reduce, 2, "cuda", timeout=180), 2)


def _contexts(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from cuda.bindings import driver as d

    from lck_runtime import collectives

    torch.cuda.set_device(rank)
    t = _inputs(rank, 4096, 0, f"cuda:{rank}")
    collectives.torch_all_reduce_(t, "sum", dist.group.WORLD)
    torch.cuda.synchronize()
    d.cuInit(0)
    active = [int(d.cuDevicePrimaryCtxGetState(d.cuDeviceGet(i)[1])[2]) for i in range(2)]
    return {"active": active, "sum": float(t.sum())}


@pytest.mark.multigpu(2)
def test_rank_on_gpu_1_opens_no_context_on_gpu_0() -> None:
    outs = run_workers(_contexts, 2, timeout=180)
    assert outs[0]["active"][0] == 1 and outs[1]["active"] == [0, 1], [o["active"] for o in outs]
    assert outs[0]["sum"] == outs[1]["sum"]
