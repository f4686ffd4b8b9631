"""What a call raised, as text a worker returns to the test (the runtime's multi-process tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lck_runtime.testing import error_text


def raised(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """``'Type: message'`` of what ``fn(*args, **kwargs)`` raised; unlike ``error_text`` a call that
    raises nothing fails the worker at once, naming the call."""
    text = error_text(fn, *args, **kwargs)
    if text == "<no error>":
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise")
    return text
