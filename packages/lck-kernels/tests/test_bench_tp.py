"""The tensor-parallel benchmark's bookkeeping (``lck_kernels.bench.tp``): argument checks and the verdicts it
stores. Pure Python on CPU; the timed runs themselves are GPU work (``ci/device.sh tp-bench``)."""

from __future__ import annotations

import pytest

from lck_kernels.bench import tp
from lck_runtime.benchmarking import Record


def _rec(provider: str, mode: str, ms: float) -> Record:
    return Record("flsce_tp", provider, mode, "8192x4096->128256", "bfloat16", median_ms=ms)


def test_share_of_run_stores_proxy_ratio_without_verdict():
    records = [
        _rec("lck_tp8share2_nvshmem", "fwd_bwd", 7.0),
        _rec("lck_tp8share2_nvshmem", "fwd_bwd", 6.5),  # the faster of two chunk budgets counts
        _rec("lck_tp8share2_nvshmem", "fwd", 2.0),
        _rec("lck_tp8share2_nccl", "fwd_bwd", 5.0),  # NCCL rows are controls, not the op under test
        _rec("lck_single", "fwd_bwd", 52.0),
        _rec("lck_tp8share2_nvshmem_sum", "fwd_bwd", 6.0),
        _rec("lck_single_sum", "fwd_bwd", 40.0),
    ]
    out = tp._share_targets(records, tp=2, share=8)
    assert set(out) == {
        "lck_tp8share2_nvshmem_over_lck_single_fwd_bwd",
        "lck_tp8share2_nvshmem_sum_over_lck_single_sum_fwd_bwd",
    }
    none = out["lck_tp8share2_nvshmem_over_lck_single_fwd_bwd"]
    assert none["value"] == pytest.approx(6.5 / 52.0)
    assert none["target"] == 0.2 and none["met"] is None and "2 GPU" in none["proxy"]
    assert out["lck_tp8share2_nvshmem_sum_over_lck_single_sum_fwd_bwd"]["value"] == pytest.approx(0.15)


def test_share_of_run_without_single_row_has_no_ratio():
    assert tp._share_targets([_rec("lck_tp4share1_runtime", "fwd_bwd", 13.0)], tp=1, share=4) == {}


def test_real_tp_run_gets_a_verdict():
    records = [_rec("lck_tp2_nvshmem", "fwd_bwd", 27.2), _rec("lck_single", "fwd_bwd", 51.7)]
    out = tp._targets(records, 2, 8192, 4096, 128256)
    verdict = out["lck_tp2_nvshmem_over_lck_single_fwd_bwd"]
    assert verdict["met"] is True and verdict["value"] == pytest.approx(27.2 / 51.7)
    assert out["vs_liger_cute_fwd_bwd"]["met"] is True  # 27.2 < 29.6


def test_loop_verdicts_read_loop_over_gpu_time():
    fast = _rec("lck_tp2_nvshmem", "fwd_bwd", 20.0)
    fast.extra.update(loop_ms=21.0, host_ms=0.4, chunk_mib=256)
    slow = _rec("lck_single", "fwd", 0.2)
    slow.extra.update(loop_ms=0.3, host_ms=0.28)
    tiny = _rec("lck_single", "fwd_bwd", 0.05)  # under 0.1 ms of GPU time: no loop target
    tiny.extra.update(loop_ms=0.2)
    peer = _rec("torch_single", "fwd", 1.0)  # peers are shown, not judged
    peer.extra.update(loop_ms=3.0)
    out = tp._loop_verdicts([fast, slow, tiny, peer])
    assert set(out) == {"loop_lck_tp2_nvshmem_fwd_bwd_chunk256", "loop_lck_single_fwd"}
    assert out["loop_lck_tp2_nvshmem_fwd_bwd_chunk256"]["met"] is True
    assert out["loop_lck_tp2_nvshmem_fwd_bwd_chunk256"]["host_ms"] == 0.4
    assert out["loop_lck_single_fwd"]["met"] is False
    assert out["loop_lck_single_fwd"]["value"] == pytest.approx(1.5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "2", "--share-of", "2"], "--share-of 2 must exceed --tp 2"),
        (["--tp", "1", "--share-of", "7"], "split --vocab 128256"),
        (["--tp", "5"], "--vocab 128256 must split into --tp 5"),
    ],
)
def test_bad_arguments_are_refused_before_any_worker(argv, message, monkeypatch, capsys):
    import torch

    # Pretend the GPUs are there: the argument checks come after the device count and must refuse alone.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr("lck_runtime.testing.run_workers", lambda *a, **k: pytest.fail("workers spawned"))
    assert tp.main(argv) == 2
    assert message in capsys.readouterr().err
