"""Importing a test module must not initialise CUDA.

A multi-process test spawns workers that import its module (to unpickle the worker function) before each
worker picks its GPU. A CUDA tensor built at import time (a ``parametrize`` list computed from real
tensors, say) gives every worker a context on GPU 0 first: on two H200s under MPS each rank of GPU 1 also
held a context on GPU 0. Each module is imported in a fresh interpreter, with ``TRITON_INTERPRET`` unset
(so the modules pick ``"cuda"`` as their device), whose ``torch.cuda._lazy_init`` records its callers
instead of running; a control import that does touch CUDA shows the recorder works.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent

PROBE = r"""
import importlib, json, sys, traceback
import torch

calls = []

def record():
    calls.append("".join(traceback.format_stack(limit=6)[:-1]))
    raise RuntimeError("CUDA initialised at import")

torch.cuda._lazy_init = record
sys.path.insert(0, sys.argv[1])
found = {}
for name in sys.argv[2:]:
    before = len(calls)
    try:
        if name == "<control>":
            exec("torch.randn(1, device='cuda')")
        else:
            importlib.import_module(name)
    except RuntimeError as exc:
        if "CUDA initialised at import" not in str(exc):
            raise
    if len(calls) > before:
        found[name] = calls[before]
print(json.dumps(found))
"""


def test_importing_test_modules_initialises_no_cuda() -> None:
    modules = sorted(p.stem for p in HERE.glob("test_*.py") if p.stem != "test_module_imports")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = subprocess.run(
        [sys.executable, "-c", PROBE, str(HERE), "<control>", *modules],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    found = json.loads(got.stdout.strip().splitlines()[-1])
    assert "<control>" in found, "the recorder did not see the control's CUDA tensor"
    del found["<control>"]
    assert not found, "importing these modules initialises CUDA:\n" + "\n".join(
        f"{m}:\n{where}" for m, where in found.items()
    )
