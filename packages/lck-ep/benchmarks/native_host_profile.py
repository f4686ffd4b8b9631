"""Where the host time of a native dispatch and combine goes: cProfile over calls back to back, 2 PEs.

At 128 tokens per PE (DeepSeek-V3 rows: hidden 7168, top-8, 256 experts) the native kernels take ~0.2 ms of
GPU time while a sync-free dispatch costs the host ~0.7 ms (``lck bench ep --pes 2``), so a loop of them
waits on Python. This runs, on every PE at once, ``--iters`` sync-free dispatches, cached dispatches and
combines under ``cProfile`` (each kind its own profile, a device synchronisation after each batch) and
writes rank 0's statistics, by own time and by cumulative time, to ``<out>/native-host-profile-*.txt``.

    MPS=1 SCRIPT=packages/lck-ep/benchmarks/native_host_profile.py SCRIPT_ARGS="--out DIR" \\
        bash ci/device.sh script:120
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Any

SHAPE = ("dsv3", 128, 7168, 8, 256)


def _profile_rank(rank: int, world: int, iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep.benchmark_native import profile_setup

    _, x, idx, w, synced, _, free, df, _ = profile_setup(SHAPE, rank)
    se = synced.dispatch(x, idx, w, expand=True, expert_alignment=128)
    calls = {
        "dispatch_sync_free": lambda: free.dispatch(x, idx, w),
        "dispatch_cached_sync_free": lambda: free.dispatch(x, handle=df.handle),
        "combine_sync_free": lambda: free.combine(df.recv_x, df.handle),
        # the synced expanded path (the MoE layer's on a synced Buffer): its loop sits above its GPU time
        "dispatch_expanded_synced": lambda: synced.dispatch(x, idx, w, expand=True, expert_alignment=128),
        "combine_expanded_synced": lambda: synced.combine(se.recv_x, se.handle, se.recv_topk_weights),
    }
    out: dict[str, Any] = {}
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(iters):
            fn()
        prof.disable()
        host = (time.perf_counter() - t0) / iters * 1e3
        torch.cuda.synchronize()
        dist.barrier()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(35)
        out[name] = {"host_ms_profiled": host, "stats": text.getvalue()}
    free.check_errors()
    L.finalize()
    return out


def _section(name: str, rec: dict[str, Any]) -> list[str]:
    return [f"## {name}: {rec['host_ms_profiled']:.3f} ms per call under cProfile", rec["stats"]]


def main(argv: list[str] | None = None) -> int:
    from lck_ep.benchmark_native import profile_main

    return profile_main(argv, __doc__, _profile_rank, "host", SHAPE, _section, pes=2, iters=200)


if __name__ == "__main__":
    raise SystemExit(main())
