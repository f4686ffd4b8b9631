"""The error check the single-process lck-ep tests share."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def raises_with(exc: type[BaseException], fragments: list[str], fn: Callable[[], object]) -> str:
    """Assert ``fn()`` raises ``exc`` whose message holds every fragment; return the message."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg
