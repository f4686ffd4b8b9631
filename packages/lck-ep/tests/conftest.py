from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest

from lck_runtime.pytest_plugin import (  # noqa: F401
    _mark_cpu_tests,
    pytest_collection_modifyitems,
    pytest_configure,
)


@pytest.fixture(scope="module")
def group() -> Iterator[object]:
    """A 1-rank gloo group (WORLD) for the single-process tests of Buffer and MoEExperts."""
    import torch.distributed as dist

    if dist.is_initialized():  # another module of the session set it up
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


@pytest.fixture
def no_ep_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``EP_*`` knob unset, ``EP_JIT_EXTRA_FLAGS`` too: the generated kernels take their defaults."""
    from lck_ep.knobs import INT_KNOBS

    for name in [k.name for k in INT_KNOBS] + ["EP_HYBRID_KERNEL", "EP_JIT_EXTRA_FLAGS"]:
        monkeypatch.delenv(name, raising=False)
