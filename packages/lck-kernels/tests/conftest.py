"""Shared pytest plumbing of the kernel tests: the runtime's markers, and the ``poisoned`` fixture."""

import pytest
import torch
from _tolerances import poison

from lck_runtime.pytest_plugin import (  # noqa: F401
    _mark_cpu_tests,
    pytest_collection_modifyitems,
    pytest_configure,
)


@pytest.fixture
def poisoned(monkeypatch):
    """Every ``torch.empty`` in the test returns NaN-filled memory, so an element a kernel never writes fails."""
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real(*a, **k)))
