"""``lck demo``: a short run end to end on this machine, its outputs, and its refusals."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
import torch

from lck_megatron import demo


def _check_outputs(out, steps: int, names: tuple[str, str]) -> dict:
    payload = json.loads((out / "demo.json").read_text())
    runs = payload["runs"]
    assert [r["name"] for r in runs] == list(names)
    for r in runs:
        assert len(r["losses"]) == steps and all(x == x for x in r["losses"]), r["losses"]
        assert r["tokens_per_s"] > 0 and r["peak_mib"] > 0
    # Same weights, same first batch: the first losses agree before any update.
    assert abs(runs[0]["losses"][0] - runs[1]["losses"][0]) <= 1e-2 * abs(runs[0]["losses"][0])
    assert payload["summary"]["agree"] is True
    assert payload["provenance"]["torch"] == torch.__version__
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (out / "loss_curves.png").exists() == has_mpl
    return payload


def test_cpu_demo_short_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU configuration is chosen only without CUDA (the gpu tests cover CUDA)")
    assert demo.main(["--steps", "4", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "CPU: running a tiny configuration through the Triton interpreter" in printed
    assert "final loss" in printed and "tokens/s" in printed and "peak memory" in printed
    payload = _check_outputs(tmp_path, 4, ("torch", "lck"))
    # float32 on both sides: the curves agree to rounding, step after step.
    assert payload["summary"]["max_abs_loss_delta"] < 1e-3


def test_cuda_requested_without_cuda(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    assert demo.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_megatron_backend_needs_cuda(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--device", "cpu", "--backend", "megatron", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_kernels_imported_without_interpreter_are_refused(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(
        sys.modules, "lck_kernels.rms_norm", sys.modules.get("lck_kernels.rms_norm") or types.ModuleType("x")
    )
    assert demo.main(["--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "fresh process" in capsys.readouterr().err


def test_bad_steps() -> None:
    with pytest.raises(SystemExit):
        demo.main(["--steps", "1"])


@pytest.mark.gpu
def test_gpu_demo_torch_backend(tmp_path) -> None:
    assert demo.main(["--steps", "40", "--backend", "torch", "--out", str(tmp_path)]) == 0
    _check_outputs(tmp_path, 40, ("torch", "lck"))


@pytest.mark.gpu
@pytest.mark.megatron
def test_gpu_demo_megatron_backend(tmp_path) -> None:
    assert demo.main(["--steps", "40", "--backend", "megatron", "--out", str(tmp_path)]) == 0
    payload = _check_outputs(tmp_path, 40, ("megatron", "megatron+lck"))
    assert "Megatron-Core GPTModel" in payload["where"]
    calls = payload["runs"][1]["lck_calls"]
    # 4 layers: SwiGLU 4 calls a step, RMSNorm 2 per layer + the final one, the loss once.
    assert calls["swiglu"] == {"lck": 4 * 40, "fallback": 0}, calls
    assert calls["rms_norm"] == {"lck": 9 * 40, "torch": 0}, calls
    assert calls["cross_entropy"] == {"lck": 40, "fallback": 0}, calls
