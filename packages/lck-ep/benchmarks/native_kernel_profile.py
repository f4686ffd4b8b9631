"""Where the GPU time of a native dispatch and combine goes: every kernel's time per call, N PEs, 4096 tokens.

``lck bench ep --pes N`` gives one time per operation; this splits it by kernel (send slots, sender, the
receiver's wait and layout, the expanded maps, the row copy, the combine's sender and receiver) so that the
kernel worth changing is the one measured to take the time. Every PE runs ``--iters`` calls of each kind
(sync-free dispatch, cached dispatch, expanded dispatch, combine, zero-copy combine, expanded combine) under
``torch.profiler`` at the DeepSeek-V3 shape; rank 0's device time per call and kernel is written to
``<out>/native-kernel-profile-*.txt``. A sender's time includes its wait for the previous operation's readers
and a receiver's first stage its wait for the senders: under MPS the PEs share the GPU, so the split is of
this PE's stream, not of the GPU.

    MPS=1 SCRIPT=packages/lck-ep/benchmarks/native_kernel_profile.py SCRIPT_ARGS="--out DIR --pes 8" \\
        bash ci/device.sh script:150
"""

from __future__ import annotations

from typing import Any

SHAPE = ("dsv3", 4096, 7168, 8, 256)


def _kernel_table(prof: Any, iters: int) -> list[tuple[str, int, float]]:
    """(kernel, launches per call, device us per call) of one profile, largest first."""
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0.0)
        if us <= 0 or evt.device_type.name != "CUDA":
            continue
        rows.append((evt.key, round(evt.count / iters), us / iters))
    return sorted(rows, key=lambda r: -r[2])


def _profile_rank(rank: int, world: int, iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import lck_runtime as L
    from lck_ep.benchmark_native import profile_setup

    _, x, idx, w, _, _, free, df, _ = profile_setup(SHAPE, rank)
    de = free.dispatch(x, idx, w, expand=True, expert_alignment=128)
    free.combine_input(df.handle).copy_(df.recv_x)  # the zero-copy rows: not zeros
    calls = {
        "dispatch_sync_free": lambda: free.dispatch(x, idx, w),
        "dispatch_cached_sync_free": lambda: free.dispatch(x, handle=df.handle),
        "dispatch_expanded_sync_free": lambda: free.dispatch(x, idx, w, expand=True, expert_alignment=128),
        "combine_sync_free": lambda: free.combine(df.recv_x, df.handle),
        "combine_zero_copy_sync_free": lambda: free.combine(free.combine_input(df.handle), df.handle),
        "combine_expanded_sync_free": lambda: free.combine(
            de.recv_x, de.handle, topk_weights=de.recv_topk_weights
        ),
    }
    out: dict[str, Any] = {}
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dist.barrier()  # the profilers start at different times on different PEs
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
        dist.barrier()
        out[name] = {"ms_per_call": start.elapsed_time(end) / iters, "kernels": _kernel_table(prof, iters)}
    free.check_errors()
    L.finalize()
    return out


def _section(name: str, rec: dict[str, Any]) -> list[str]:
    lines = [f"## {name}: {rec['ms_per_call']:.3f} ms per call (events around the loop)"]
    lines.append(f"{'kernel':<60}{'launches':>9}{'us per call':>13}")
    lines += [f"{kernel[:60]:<60}{n:>9}{us:>13.1f}" for kernel, n, us in rec["kernels"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    from lck_ep.benchmark_native import profile_main

    return profile_main(argv, __doc__, _profile_rank, "kernel", SHAPE, _section, pes=8, iters=20)


if __name__ == "__main__":
    raise SystemExit(main())
