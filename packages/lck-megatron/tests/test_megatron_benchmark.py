"""The Megatron SwiGLU benchmark: its providers' call conventions, its summary, and a GPU smoke run."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from _helpers import kernel_device

from lck_megatron import benchmark
from lck_runtime.benchmarking import Record


@pytest.mark.parametrize("name", ["lck", "lck_in_place", "torch"])
def test_provider_passes_its_correctness_check(name: str) -> None:
    device = kernel_device()
    fn = benchmark._providers([name])[name]
    pristine = torch.randn(8, 2, 64, device=device, dtype=torch.bfloat16)
    dout = torch.randn(8, 2, 32, device=device, dtype=torch.bfloat16)
    benchmark._check(name, fn, pristine.clone().requires_grad_(True), pristine, dout)


def test_check_catches_a_wrong_provider() -> None:
    pristine = torch.randn(8, 64)
    with pytest.raises(AssertionError, match="differs from torch eager"):
        benchmark._check(
            "bad",
            lambda y: y[..., :32] * 2,
            pristine.clone().requires_grad_(True),
            pristine,
            torch.randn(8, 32),
        )


@pytest.mark.megatron
def test_megatron_provider_is_megatrons_function() -> None:
    fn = benchmark._providers(["megatron"])["megatron"]
    assert callable(fn)
    pristine = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    benchmark._check(
        "megatron",
        fn,
        pristine.clone().requires_grad_(True),
        pristine,
        torch.randn(8, 2, 32, dtype=torch.bfloat16),
    )


def test_summary_speedups_and_targets() -> None:
    def rec(prov: str, mode: str, n: int, ms: float, mib: float, loop: float | None = None) -> Record:
        return Record(
            benchmark.BENCH,
            prov,
            mode,
            f"2048x4x{2 * n}",
            "bfloat16",
            median_ms=ms,
            peak_mib=mib,
            extra={"ffn_local": n} | ({"loop_ms": loop} if loop is not None else {}),
        )

    records = [
        rec("megatron", "fwd_bwd", 32768, 6.0, 1536.0),
        rec("lck", "fwd_bwd", 32768, 1.0, 1536.0),
        rec("lck_in_place", "fwd_bwd", 32768, 1.0, 512.0),
        rec("megatron", "fwd_bwd", 4096, 0.6, 192.0, loop=0.9),
        rec("lck", "fwd_bwd", 4096, 0.2, 192.0, loop=0.2),
        Record(benchmark.BENCH, "torch", "fwd", "x", "bfloat16", error="boom", extra={"ffn_local": 4096}),
    ]
    lines, checks = benchmark.summarize_records(records)
    assert checks["fwd_bwd speed-up at ffn_local=32768"] == (6.0, 5.0, True)
    assert checks["fwd_bwd speed-up at ffn_local=4096"] == pytest.approx((3.0, 4.0, False))
    # Back to back (host dispatch included) is reported beside the GPU-time ratio, never instead of it.
    assert checks["fwd_bwd speed-up at ffn_local=4096, back to back"] == pytest.approx((4.5, 4.0, True))
    assert "fwd_bwd speed-up at ffn_local=32768, back to back" not in checks
    ratio, target, met = checks["in-place peak memory / megatron at ffn_local=32768"]
    assert ratio == pytest.approx(1 / 3) and target == 0.8 and met
    assert any("6.00x" in line for line in lines) and any("error: boom" in line for line in lines)


def test_arguments_and_cpu_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        benchmark.main(["--iters", "0"])
    with pytest.raises(SystemExit):
        benchmark.main(["--providers", "liger"])
    if not torch.cuda.is_available():
        assert benchmark.main(["--quick"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_quick_run_writes_results(tmp_path) -> None:
    assert benchmark.main(["--quick", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("swiglu-*-quick.json")
    payload = json.loads(json_path.read_text())
    recs = payload["records"]
    assert {r["provider"] for r in recs} >= {"lck", "lck_in_place", "torch"}
    assert all(r["error"] is None and r["median_ms"] > 0 and r["peak_mib"] is not None for r in recs), recs
    assert payload["provenance"]["gpu"]
    assert json_path.with_suffix(".csv").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert json_path.with_suffix(".png").exists()
