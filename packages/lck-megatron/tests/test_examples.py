"""The two examples run as a user runs them: a fresh interpreter, real megatron-core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize(
    ("script", "expect"),
    [
        (
            "one_line_patch.py",
            ["swiglu: 3 sites", "final norm: LckMegatronRMSNorm", "lck SwiGLU calls: {'lck': 1"],
        ),
        (
            "hand_built_spec.py",
            ["mlp: LckSwiGLUMLP", "lck SwiGLU calls (layer 0): {'lck': 1", "'lck': 1, 'torch': 0"],
        ),
    ],
)
def test_example_runs(script: str, expect: list[str]) -> None:
    _run(script, expect, {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})  # the CPU run, on any machine


@pytest.mark.gpu
@pytest.mark.parametrize("script", ["one_line_patch.py", "hand_built_spec.py"])
def test_example_runs_cuda(script: str) -> None:
    """On a GPU the examples train a GPTModel and round-trip a distributed checkpoint."""
    _run(script, ["distributed checkpoint round trip: identical", "'fallback': 0", "step   4  loss"], {})


def _run(script: str, expect: list[str], extra_env: dict[str, str]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.update(extra_env)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    for line in expect:
        assert line in proc.stdout, f"{script}: {line!r} not in output:\n{proc.stdout}"
