"""Pytest markers shared by every lck package; a package's ``tests/conftest.py`` imports these hooks.

- ``gpu``: needs a CUDA device (and no ``TRITON_INTERPRET``, which forces CPU tensors).
- ``multigpu(n)``: needs at least ``n`` CUDA devices; implies ``gpu``.
- ``nvcc``: needs the CUDA compiler.
- ``megatron``: needs megatron-core.

Missing hardware or tools skip with the reason; nothing fails for lack of a GPU. Tests without the ``gpu``
marker test the CPU paths: the fixture ``_mark_cpu_tests`` marks them (``LCK_TEST_CPU=1``) and
``run_workers`` then starts their ranks with no GPU visible, as on the CPU runners; on a GPU machine they
would otherwise pick CUDA devices. The test process keeps its own view: changing ``CUDA_VISIBLE_DEVICES``
after CUDA may have started would leave torch and the driver disagreeing. A package's
``tests/conftest.py`` imports the hooks and the fixture.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest


@functools.cache
def _cuda_count() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.cache
def _nvcc() -> str | None:
    from lck_runtime.toolchain import find_nvcc

    return find_nvcc()


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "gpu: needs a CUDA device",
        "multigpu(n): needs at least n CUDA devices",
        "nvcc: needs the CUDA compiler (nvcc)",
        "megatron: needs megatron-core",
    ):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        multi = item.get_closest_marker("multigpu")
        if multi is not None and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") is not None:
            need = int(multi.args[0]) if multi is not None and multi.args else 1
            have = _cuda_count()
            if have < need:
                why = (
                    "TRITON_INTERPRET=1 is set"
                    if os.environ.get("TRITON_INTERPRET") == "1"
                    else f"{have} visible"
                )
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s); {why}"))
        if item.get_closest_marker("nvcc") is not None and _nvcc() is None:
            item.add_marker(pytest.mark.skip(reason="needs nvcc (not on PATH, CUDA_HOME or /usr/local/cuda)"))
        if item.get_closest_marker("megatron") is not None and importlib.util.find_spec("megatron") is None:
            item.add_marker(pytest.mark.skip(reason="needs megatron-core"))


@pytest.fixture(autouse=True)
def _mark_cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("LCK_TEST_CPU", "1")
