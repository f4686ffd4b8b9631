"""NVSHMEM ownership helpers that run anywhere (no GPU): support detection, env defaults, status, doctor."""

from __future__ import annotations

import os

import pytest
import torch

from lck_runtime import doctor
from lck_runtime import nvshmem as nv
from lck_runtime.symmetric import (
    SCRATCH_ALIGN,
    moe_agreement_bytes,
    moe_agreement_offset,
    moe_workspace_bytes,
    scratch_numel,
)


def test_native_support_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LCK_DISABLE_NVSHMEM", raising=False)
    ok, why = nv.native_support(torch.device("cpu"))
    assert not ok and why == "device is cpu, not CUDA"
    monkeypatch.setenv("LCK_DISABLE_NVSHMEM", "1")
    ok, why = nv.native_support(torch.device("cuda", 0))  # checked before touching the device
    assert not ok and why == "LCK_DISABLE_NVSHMEM is set"
    monkeypatch.setenv("LCK_DISABLE_NVSHMEM", "0")
    assert nv.native_support(torch.device("cpu"))[1] == "device is cpu, not CUDA"


def test_parse_size_reads_nvshmem_size_strings() -> None:
    assert nv.parse_size("1073741824") == 1 << 30
    assert nv.parse_size("4G") == nv.parse_size("4g") == 4 << 30
    assert nv.parse_size(" 512m ") == 512 << 20 and nv.parse_size("1.5k") == 1536
    assert nv.parse_size("2T") == 2 << 40
    for bad in (None, "", "G", "lots", "-1G", "0", "1Q", "inf"):
        assert nv.parse_size(bad) is None, bad


def test_env_defaults_and_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    small = nv.env_defaults(single_host=True, heap_bytes=nv.heap_for(10 << 20, 3))
    assert small == {
        "NVSHMEM_DISABLE_NVLS": "1",
        "NVSHMEM_SYMMETRIC_SIZE": str(1 << 30),
        "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
        "NVSHMEM_REMOTE_TRANSPORT": "none",
    }
    big = nv.env_defaults(single_host=False, heap_bytes=nv.heap_for(3 << 30, 2))
    assert set(big) == {"NVSHMEM_DISABLE_NVLS", "NVSHMEM_SYMMETRIC_SIZE"}
    size = int(big["NVSHMEM_SYMMETRIC_SIZE"])
    assert size >= (3 << 30) + 2 * nv.ALLOC_MARGIN + nv.HEAP_SLACK and size % (2 << 20) == 0
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "4G")
    monkeypatch.delenv("NVSHMEM_REMOTE_TRANSPORT", raising=False)
    monkeypatch.delenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", raising=False)
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    applied = nv.apply_env(small)
    assert "NVSHMEM_SYMMETRIC_SIZE" not in applied and os.environ["NVSHMEM_SYMMETRIC_SIZE"] == "4G"
    assert applied["NVSHMEM_REMOTE_TRANSPORT"] == "none" and os.environ["NVSHMEM_REMOTE_TRANSPORT"] == "none"


def test_status_without_a_gpu() -> None:
    s = nv.status()
    assert "importable" in s
    if s["importable"]:
        assert s["owned_by_lck"] is False
        assert s["init_status"] == 0 and s["init_status_name"] == "STATUS_NOT_INITIALIZED"
        assert nv.foreign_init_status() == 0
    assert nv.owner() is None


def test_doctor_reports_nvshmem_ownership() -> None:
    info = doctor.nvshmem_info()
    assert {"nvshmem4py", "library", "importable"} <= set(info)
    text = "\n".join(doctor._render_nvshmem(info))
    assert text.startswith("NVSHMEM")
    if info["importable"]:
        assert "not owned by lck" in text and "STATUS_NOT_INITIALIZED" in text


def test_reservation_sizes() -> None:
    assert scratch_numel(1) == SCRATCH_ALIGN and scratch_numel(SCRATCH_ALIGN + 1) == 2 * SCRATCH_ALIGN
    from lck_runtime.config import MoEConfig

    # 2 members × 8 tokens × (16 bf16 + 2 × (int64 + fp32)) rounded up to 16 bytes, then the agreement
    # mailbox: 2 sets × 2 slots × (1 sequence word + 32 header words + 2 members + 4 experts) int64
    cfg = MoEConfig(8, 16, 4, 2)
    assert moe_agreement_offset(cfg, 2) == 2 * 8 * 64
    assert moe_agreement_bytes(cfg, 2) == 2 * 2 * (1 + 32 + 2 + 4) * 8
    assert moe_workspace_bytes(cfg, 2) == 2 * 8 * 64 + 2 * 2 * 39 * 8
