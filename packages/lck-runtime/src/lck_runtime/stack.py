"""The retained-forward stack of one EP context: MoE forwards awaiting their backward.

A MoE forward keeps its dispatch state (received tokens, routing, handles) until its backward runs.
The stack bounds how many such forwards one EP context holds at once (``MoEConfig.max_inflight``:
count every layer and microbatch in flight) and hands them back in LIFO order, which is the order
autograd runs backwards within one context. Every check happens before any mutation, so a rejected
push or pop leaves the stack exactly as it was.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["RetainedForwardStack"]

_NOTHING = object()


class RetainedForwardStack:
    """A bounded LIFO of opaque entries; ``owner`` names the context in error messages."""

    def __init__(self, max_inflight: int, owner: str) -> None:
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        self._max = max_inflight
        self._owner = owner
        self._entries: list[Any] = []
        self._lock = threading.Lock()

    @property
    def max_inflight(self) -> int:
        return self._max

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, entry: Any) -> None:
        """Retain ``entry`` (not ``None``); raises ``RuntimeError`` when ``max_inflight`` are held."""
        if entry is None:
            raise ValueError(f"{self._owner}: push_forward(entry): entry must not be None")
        with self._lock:
            if len(self._entries) >= self._max:
                raise RuntimeError(
                    f"{self._owner}: retained-forward stack is full: it holds max_inflight="
                    f"{self._max} forward(s) awaiting backward; raise MoEConfig.max_inflight to count "
                    "every MoE layer and microbatch in flight at once (nothing was pushed)"
                )
            self._entries.append(entry)

    def pop(self, expected: Any = _NOTHING) -> Any:
        """Remove and return the newest entry.

        With ``expected``, the newest entry must be that very object (identity), else ``RuntimeError``
        and nothing is popped: a backward that runs out of LIFO order is caught, not mismatched.
        """
        with self._lock:
            if not self._entries:
                raise RuntimeError(f"{self._owner}: pop_forward(): no retained forward to pop")
            top = self._entries[-1]
            if expected is not _NOTHING and top is not expected:
                raise RuntimeError(
                    f"{self._owner}: pop_forward(expected=...): the newest retained forward is not the "
                    f"expected one ({len(self._entries)} held); backwards must run in LIFO order "
                    "within one EP context (nothing was popped)"
                )
            return self._entries.pop()

    def peek(self) -> Any:
        """The newest entry without removing it; ``RuntimeError`` when empty."""
        with self._lock:
            if not self._entries:
                raise RuntimeError(f"{self._owner}: no retained forward to peek at")
            return self._entries[-1]

    def drop_all(self) -> int:
        """Forget every entry (finalize only); returns how many were held."""
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            return n
