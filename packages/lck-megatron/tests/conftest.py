"""Fixtures for lck-megatron's tests.

``megatron_tp1`` initialises torch.distributed (gloo, one rank, a file store) and Megatron's
``parallel_state`` with TP=1 in the test process itself, once per session: Megatron's modules need
its process groups even on one rank, and importing megatron-core costs 10–30 s per process on the CPU
machines, so single-rank tests do not spawn. TP=2 tests spawn real processes with ``run_workers``.
Every test ends with lck's patch reverted, so tests cannot leak patched state into each other.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

from lck_runtime.pytest_plugin import (  # noqa: F401
    _mark_cpu_tests,
    pytest_collection_modifyitems,
    pytest_configure,
)


@pytest.fixture(autouse=True)
def _revert_lck_patch() -> Iterator[None]:
    yield
    patch = sys.modules.get("lck_megatron.patch")
    if patch is not None:
        patch.revert_lck_from_megatron()


@pytest.fixture(scope="session")
def megatron_tp1() -> Iterator[None]:
    import torch.distributed as dist
    from _helpers import init_megatron_parallel

    created = False
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="lck-megatron-pg-")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        created = True
    init_megatron_parallel(1)
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
