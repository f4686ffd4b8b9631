"""Per-rank bodies of the hybrid-backend GPU tests: a MoE context over virtual hosts (``num_hosts`` x
``gpus_per_host`` PEs sharing the GPU under CUDA MPS), every output of ``backend="nvshmem"`` (the hybrid
kernels) against the reference backend, bit for bit, on the native suite's routings and checks
(:func:`_native_worker._round`). Each body returns a list of failure strings (empty = pass).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
from _native_worker import CASES, E_PER_RANK, H_CAP, TOPK_CAP, Compare, _round, inputs, stalled_dispatch

# The routings each setting runs: a full-size row, an odd hidden with -1 slots and two biases, a rank that
# sends nothing, one token, fp16 duplicates, fp32 rows.
MAIN = (
    "balanced_h7168_top8",
    "minus_one_h100_top3",
    "rank1_sends_nothing_top4",
    "one_token_top7",
    "duplicates_top5_h72_fp16",
    "fp32_rows_h64_top2",
)
SWEEP = ("minus_one_h100_top3", "rank1_sends_nothing_top4", "balanced_h7168_top8")


def configure(world: int, num_hosts: int, max_tokens: int) -> None:
    import lck_runtime as L

    torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    cfg = L.MoEConfig(
        max_tokens=max_tokens,
        hidden_size=H_CAP,
        num_experts=E_PER_RANK * world,
        top_k=TOPK_CAP,
        num_hosts=num_hosts,
        gpus_per_host=world // num_hosts,
    )
    if not L.configure(moe=cfg):
        raise RuntimeError("configure(moe=...) did not bring up the native (NVSHMEM) runtime")


def _cases(names: tuple[str, ...]) -> list[tuple[int, Any]]:
    return [(i, c) for i, c in enumerate(CASES) if c.name in names]


def _run_cases(
    rank: int, world: int, seed: int, names: tuple[str, ...], modes: tuple[bool, ...], tag: str
) -> list[str]:
    import torch.distributed as dist

    from lck_ep import Buffer

    errors: list[str] = []
    dev = torch.device("cuda", torch.cuda.current_device())
    for i, case in _cases(names):
        for sync_free in modes:
            where = f"{tag} {case.name} {'sync-free' if sync_free else 'synced'}"
            cmp = Compare(rank, where)
            args = (dist.group.WORLD, case.tokens, case.hidden, case.num_topk, E_PER_RANK * world)
            nat = Buffer(*args, sync_free=sync_free, device=dev, backend="nvshmem", timeout_s=60.0)
            ref = Buffer(*args, sync_free=sync_free, device="cpu", backend="reference")
            state = nat._native
            if nat.backend != "nvshmem" or type(state).__name__ != "HybridEp":
                errors.append(f"rank {rank} {where}: backend {nat.backend}, state {type(state).__name__}")
                continue
            before = dict(state.launches)
            try:
                _round(case, nat, ref, inputs(case, world, rank, seed + 1000 * i), rank, cmp)
            except Exception:
                cmp.errors.append(f"rank {rank} {where} raised:\n{traceback.format_exc()}")
            try:
                nat.check_errors()
            except Exception as exc:
                cmp.errors.append(f"rank {rank} {where}: {type(exc).__name__}: {exc}")
            if (
                state.launches["dispatch"] == before["dispatch"]
                or state.launches["combine"] == before["combine"]
            ):
                cmp.errors.append(f"rank {rank} {where}: the hybrid kernels did not run ({state.launches})")
            errors += cmp.errors
    return errors


def _fresh_hybrid_state(env: dict[str, str]) -> None:
    """Switch this process to other hybrid knobs: a new HybridEp (kernels, options) for the same context,
    built by the next Buffer, with the hybrid signal words zeroed on every rank in between."""
    import torch.distributed as dist

    from lck_ep import _hybrid_exchange
    from lck_runtime.contexts import moe_context

    torch.cuda.synchronize()
    dist.barrier()
    for key in _VARIABLES:
        os.environ.pop(key, None)
    os.environ.update(env)
    _hybrid_exchange._STATES.clear()
    ctx = moe_context(None)
    ctx.signals.view(ctx.size, -1)[:, 3:].zero_()
    torch.cuda.synchronize()
    dist.barrier()


def suite(rank: int, world: int, num_hosts: int, seed: int) -> list[str]:
    """The main routings, synced and sync-free, under the environment's kernel pair."""
    import lck_runtime as L

    errors: list[str] = []
    try:
        configure(world, num_hosts, 48)
        pair = os.environ.get("EP_HYBRID_KERNEL", "unordered") or "unordered"
        errors += _run_cases(
            rank, world, seed, MAIN, (False, True), f"{num_hosts}x{world // num_hosts} {pair}"
        )
        L.finalize()
    except Exception:
        errors.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    return errors


# Sub-part geometry and the debug reorder, unordered pair first (the ordered pair's tails are op-tagged).
# Each EP_NUM_SUB_PARTS in {1, 2, 4} and EP_MIN_SUB_TOKENS in {1, 8} (2 and 1 are the defaults of the main
# runs and of the debug one); fewer channels make longer parts with more sub-parts.
SETTINGS = (
    {"EP_NUM_SUB_PARTS": "1", "EP_HYBRID_CHANNELS": "3"},
    {"EP_NUM_SUB_PARTS": "4", "EP_MIN_SUB_TOKENS": "8", "EP_HYBRID_CHANNELS": "2"},
    {"EP_NUM_SUB_PARTS": "4", "EP_MIN_SUB_TOKENS": "8"},
    {"EP_HYBRID_DEBUG_REORDER": "1", "EP_HYBRID_DEBUG_DELAY_US": "5", "EP_HYBRID_CHANNELS": "2"},
    {"EP_HYBRID_DEBUG_REORDER": "1", "EP_NUM_SUB_PARTS": "4", "EP_MIN_SUB_TOKENS": "8"},
    {"EP_HYBRID_KERNEL": "ordered", "EP_NUM_SUB_PARTS": "1", "EP_HYBRID_CHANNELS": "3"},
    {
        "EP_HYBRID_KERNEL": "ordered",
        "EP_NUM_SUB_PARTS": "4",
        "EP_MIN_SUB_TOKENS": "8",
        "EP_HYBRID_CHANNELS": "2",
    },
)
_VARIABLES = (
    "EP_HYBRID_KERNEL",
    "EP_NUM_SUB_PARTS",
    "EP_MIN_SUB_TOKENS",
    "EP_HYBRID_CHANNELS",
    "EP_HYBRID_NUM_PARTS",
    "EP_HYBRID_DEBUG_REORDER",
    "EP_HYBRID_DEBUG_DELAY_US",
)


def all_knobs() -> list[Any]:
    """Every distinct set of JIT knobs the GPU tests build (the main runs' two pairs, then the sweep's)."""
    from lck_ep.knobs import read_knobs

    out = [read_knobs({}), read_knobs({"EP_HYBRID_KERNEL": "ordered"})]
    for env in SETTINGS:
        k = read_knobs(env)
        if k not in out:
            out.append(k)
    return out


def sweep(rank: int, world: int, num_hosts: int, seed: int) -> list[str]:
    """Each setting of :data:`SETTINGS` on a few routings (synced), then a budget too small refused."""
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer
    from lck_runtime.testing import error_text

    errors: list[str] = []
    try:
        configure(world, num_hosts, 48)
        for env in SETTINGS:
            _fresh_hybrid_state(env)
            tag = " ".join(f"{k}={v}" for k, v in env.items())
            errors += _run_cases(rank, world, seed, SWEEP, (False,), tag)
        _fresh_hybrid_state({"EP_HYBRID_CHANNELS": "16", "EP_HYBRID_NUM_PARTS": "2"})
        dev = torch.device("cuda", torch.cuda.current_device())
        msg = error_text(
            Buffer, dist.group.WORLD, 8, 64, 2, E_PER_RANK * world, device=dev, backend="nvshmem"
        )
        if "over by 3" not in msg or "EP_HYBRID_CHANNELS=16" not in msg:
            errors.append(f"rank {rank}: a signal budget too small was not refused up front: {msg!r}")
        for key in _VARIABLES:
            os.environ.pop(key, None)
        L.finalize()
    except Exception:
        errors.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    return errors


def stop(rank: int, world: int, num_hosts: int, timeout_s: float) -> dict[str, Any]:
    """The last rank never calls; the others' sync-free dispatch must give up within ``timeout_s`` (in the
    hybrid kernels' waits or the native receiver's), naming that rank."""
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    configure(world, num_hosts, 16)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(
        dist.group.WORLD, 16, 64, 2, E_PER_RANK * world, sync_free=True, device=dev, timeout_s=timeout_s
    )
    out: dict[str, Any] = {"backend": buf.backend, "state": type(buf._native).__name__}
    dist.barrier()
    if rank != world - 1:
        stalled_dispatch(buf, world, dev, out)
    dist.barrier()
    L.finalize()
    return out
