"""The lck CLI core: entry-point discovery, doctor, bench dispatch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lck_runtime import cli, doctor


def test_help_lists_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "doctor" in out and "usage: lck" in out


def test_no_arguments_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: lck" in capsys.readouterr().out


def test_unknown_command_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    assert "'frobnicate'" in capsys.readouterr().err


def test_doctor_json_reports_what_a_user_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("torch", "triton", "gpus", "nvcc", "nvshmem", "layers", "jit_cache_dir"):
        assert key in report, key
    assert report["layers"]["lck-runtime"] is not None
    assert isinstance(report["gpus"], list)


def test_doctor_text_mentions_nvshmem_and_cache() -> None:
    text = doctor._render(doctor.collect())
    assert "NVSHMEM" in text and "JIT cache" in text and "torch" in text


def test_doctor_summarizes_each_jit_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from lck_runtime.jit.cache import summarize
    from lck_runtime.jit.host import ENTRY_NAME

    root = tmp_path / "lck"
    monkeypatch.setenv("LCK_JIT_CACHE_DIR", str(root))
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "ep"))
    assert summarize(root, ENTRY_NAME) == {"path": str(root), "exists": False}
    root.mkdir(mode=0o700)
    for name, payload in (("_host-0123456789abcdef", 1000), ("scale-fedcba9876543210", 24)):
        (root / name).mkdir()
        (root / name / "meta.json").write_text("{}")
        (root / name / "payload").write_bytes(b"x" * payload)
    (root / "torn-0000000000000000").mkdir()  # no meta.json: not a published entry
    (root / ".tmp").mkdir()
    got = summarize(root, ENTRY_NAME)
    assert got == {
        "path": str(root),
        "exists": True,
        "private": True,
        "entries": 2,
        "bytes": 1028,
        "host_module": True,
    }
    text = doctor._render(doctor.collect())
    assert f"lck: {root}, 2 entries" in text and "host module built, private" in text
    assert f"lck-ep: {tmp_path / 'ep'} (not created yet" in text
    root.chmod(0o777)
    assert "NOT private" in doctor._render(doctor.collect())


def test_jit_cache_dir_follows_prefix(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from lck_runtime.paths import jit_cache_dir

    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "ep"))
    monkeypatch.delenv("LCK_JIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jit_cache_dir("EP") == tmp_path / "ep"
    assert jit_cache_dir("LCK") == tmp_path / "xdg" / "lck" / "jit" / "lck"


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lck_runtime.cli", "doctor"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "layers" in out.stdout


def test_bench_unknown_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.bench(["no-such-layer"]) == 2
    assert "no-such-layer" in capsys.readouterr().err


def test_a_checkout_on_the_path_still_has_doctor_and_says_how_to_run_the_rest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As on the GPU runners: the layers imported through PYTHONPATH, no distribution, no entry points."""
    import tomllib
    from importlib.metadata import PackageNotFoundError
    from pathlib import Path

    def missing(dist: str) -> str:
        raise PackageNotFoundError(dist)

    real = doctor._version
    monkeypatch.setattr(cli, "_group", lambda name: {})
    monkeypatch.setattr(cli, "version", missing)
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist.startswith("lck") else real(dist))
    assert cli.main(["--help"]) == 0
    assert "doctor" in capsys.readouterr().out
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'demo'" in err and "not installed" in err and "python -m lck_megatron.demo" in err
    assert cli.main(["bench", "kernels"]) == 2
    assert "python -m lck_kernels.bench" in capsys.readouterr().err
    assert cli.main(["doctor", "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    project = Path(cli.__file__).resolve().parents[2] / "pyproject.toml"
    declared = tomllib.loads(project.read_text())["project"]["version"]
    assert layers["lck"] is None
    assert (
        layers["lck-runtime"]
        == f"{declared} (source at {Path(cli.__file__).resolve().parent}, not installed)"
    )
