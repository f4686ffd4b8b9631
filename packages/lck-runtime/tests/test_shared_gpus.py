"""Several bootstrap ranks on one GPU: refused unless every rank opts in with LCK_NVSHMEM_SHARED_GPUS=1.

The check itself is a pure function of the agreed reports (``plan_setup``), tested directly with
reports of ranks sharing a device; the agreement on the variable runs over gloo with the recorder in
place of nvshmem4py, so the native branch of ``configure`` is taken on CPU. The real shared-GPU runs
(4 and 8 PEs on two H200s) are in ``test_multigroup.py`` and lck-kernels' TP scaling tests.
"""

from __future__ import annotations

from typing import Any

import pytest
from _observed import same_text

from lck_runtime.testing import run_workers

TIMEOUT = 180


def _mps(server: bool = True, share: float | None = None, ignore: bool = False) -> dict[str, Any]:
    return {"server": server, "active thread percentage": share, "ignore percentage": ignore}


def _plan(devices: list[tuple[str, int | None]], shared: str | None, mps: list[Any] | None = None) -> Any:
    import torch

    from lck_runtime.agreement import Domain
    from lck_runtime.configure_checks import Request, plan_setup
    from lck_runtime.state import RuntimeState

    n = len(devices)
    mps = mps or [_mps(share=100 / n)] * n
    req = Request(device=torch.device("cpu"), native=True, shared_gpus=shared)
    facts = [
        {"ranks": {}, "host": host, "device index": index, "why not native": "", "MPS": m}
        for (host, index), m in zip(devices, mps)
    ]
    return plan_setup(RuntimeState(), Domain(group=None, ranks=tuple(range(n)), local_rank=0), req, facts)


def test_ranks_sharing_a_gpu_are_refused_by_default() -> None:
    for shared in (None, "", "0"):
        with pytest.raises(ValueError) as info:
            _plan([("h0", 0), ("h0", 1), ("h0", 0)], shared)
        msg = str(info.value)
        assert "bootstrap ranks [0, 2] share cuda:0 on host h0" in msg, msg
        assert "LCK_NVSHMEM_SHARED_GPUS=1" in msg, msg


def test_same_index_on_different_hosts_is_not_sharing() -> None:
    setup = _plan([("h0", 0), ("h1", 0)], None)
    assert setup.hosts == ["h0", "h1"]


def test_opt_in_allows_ranks_sharing_a_gpu_under_mps() -> None:
    setup = _plan([("h0", 0), ("h0", 1), ("h0", 0), ("h0", 1)], "1")
    assert setup.hosts == ["h0"] * 4 and setup.shared_gpus
    # cuda:1 is not shared: its rank needs no server
    _plan([("h0", 0), ("h0", 0), ("h0", 1)], "1", [_mps(share=50), _mps(share=50), _mps(server=False)])


def test_shared_gpu_without_mps_server_is_refused() -> None:
    devices = [("h0", 0), ("h0", 1), ("h0", 0), ("h0", 1)]
    mps = [_mps(share=50), _mps(share=50), _mps(server=False, share=50), _mps(share=50)]
    with pytest.raises(ValueError) as info:
        _plan(devices, "1", mps)
    msg = str(info.value)
    assert "bootstrap ranks [0, 2] share cuda:0 on host h0 but ranks [2] see no CUDA MPS server" in msg, msg
    assert "nvidia-cuda-mps-control -d" in msg, msg


def test_shared_gpu_shares_must_fit_one_gpu() -> None:
    devices = [("h0", 0)] * 4
    for shares in ([None] * 4, [25, 25, 25, 26], [50, 50, None, 25]):
        with pytest.raises(ValueError, match=r"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE .* set it to at most 25"):
            _plan(devices, "1", [_mps(share=s) for s in shares])
    _plan(devices, "1", [_mps(share=25)] * 4)
    _plan(devices, "1", [_mps(ignore=True)] * 4)  # NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1"])
def test_opt_in_takes_only_0_or_1(value: str) -> None:
    with pytest.raises(ValueError, match=f"LCK_NVSHMEM_SHARED_GPUS={value!r}: expected 0 or 1"):
        _plan([("h0", 0), ("h0", 0)], value)


def _agreement(rank: int, world: int) -> dict[str, Any]:
    import os

    import lck_runtime as L
    from lck_runtime import fake_nvshmem

    fake_nvshmem.install(rank, world)
    out: dict[str, Any] = {}
    F = L.FusedLinearCrossEntropyConfig
    os.environ["LCK_NVSHMEM_SHARED_GPUS"] = "1" if rank == 1 else "0"
    try:
        L.configure(flsce=F(8, 8, 8))
    except Exception as exc:
        out["disagree"] = f"{type(exc).__name__}: {exc}"
    os.environ["LCK_NVSHMEM_SHARED_GPUS"] = "on"
    try:
        L.configure(flsce=F(8, 8, 8))
    except Exception as exc:
        out["bad value"] = f"{type(exc).__name__}: {exc}"
    out["configured after"] = L.flsce_context(required=False) is not None
    os.environ["LCK_NVSHMEM_SHARED_GPUS"] = "1"
    out["agreed"] = L.configure(flsce=F(8, 8, 8))
    L.finalize()
    return out


def test_ranks_must_agree_on_the_opt_in() -> None:
    outs = run_workers(_agreement, 2, timeout=TIMEOUT, env={"LCK_SETUP_TIMEOUT": "60"})
    for key, want in (
        (
            "disagree",
            "ValueError: configure: ranks disagree on LCK_NVSHMEM_SHARED_GPUS: '0' on ranks [0], '1' on ranks [1]",
        ),
        ("bad value", "ValueError: configure: LCK_NVSHMEM_SHARED_GPUS='on': expected 0 or 1"),
    ):
        same_text(outs, key, want)
    assert [o["configured after"] for o in outs] == [False, False]
    assert [o["agreed"] for o in outs] == [True, True]


def _limited(rank: int, world: int) -> dict[str, Any]:
    import os

    import lck_runtime as L
    from lck_runtime import fake_nvshmem

    # NVSHMEM reports its limited mode (several PEs per GPU, no MPS) on rank 1 only: it decides per node.
    rec = fake_nvshmem.install(rank, world, init_status=3 if rank == 1 else 4)
    os.environ["LCK_NVSHMEM_SHARED_GPUS"] = "1"
    out: dict[str, Any] = {}
    try:
        L.configure(flsce=L.FusedLinearCrossEntropyConfig(8, 8, 8))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["calls"] = list(rec.calls)
    out["after"] = (L.flsce_context(required=False), L.is_native())
    return out


def test_limited_mode_is_refused_before_any_team() -> None:
    outs = run_workers(_limited, 2, timeout=TIMEOUT, env={"LCK_SETUP_TIMEOUT": "60"})
    text = same_text(
        outs,
        "error",
        "RuntimeError: configure: NVSHMEM came up in its limited several-PEs-per-GPU mode on bootstrap ranks [1]",
    )
    assert "restart them under an MPS server" in text, text
    for o in outs:
        assert o["calls"] == [], o["calls"]  # no team split, no allocation, no finalize
        assert o["after"] == (None, False), o["after"]


def test_shared_gpu_env_splits_each_gpu() -> None:
    from lck_runtime.testing import shared_gpu_env

    assert shared_gpu_env(8, 2) == {"LCK_NVSHMEM_SHARED_GPUS": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    assert shared_gpu_env(4, 2)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert shared_gpu_env(3, 2)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"  # 2 on the first GPU
    assert shared_gpu_env(2, 2)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    for bad in ((1, 2), (4, 0)):
        with pytest.raises(ValueError, match="need world_size >= num_gpus >= 1"):
            shared_gpu_env(*bad)


@pytest.mark.parametrize(
    ("script", "want"),
    [
        ("echo 1178", ["1178"]),  # a daemon with one server
        ("exit 0", []),  # a daemon, no server started yet
        ("exit 1", None),  # no daemon answers
        (None, None),  # no MPS on this machine
    ],
)
def test_mps_servers_asks_the_control_daemon(
    script: str | None, want: list[str] | None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lck_runtime.nvshmem import mps_servers

    if script is not None:
        fake = tmp_path / "nvidia-cuda-mps-control"
        fake.write_text(f"#!/bin/sh\ncat > /dev/null\n{script}\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert mps_servers(attempts=2) == want
