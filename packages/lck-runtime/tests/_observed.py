"""What the runtime's multi-process tests share: a worker's record of what a call raised, and each rank's
observations with the label the test's assertions print."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lck_runtime.testing import error_text


def raised(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """``'Type: message'`` of what ``fn(*args, **kwargs)`` raised; unlike ``error_text`` a call that
    raises nothing fails the worker at once, naming the call."""
    text = error_text(fn, *args, **kwargs)
    if text == "<no error>":
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise")
    return text


def per_rank(outs: list[Any]) -> Iterator[tuple[Any, str]]:
    """Each rank's observations, with ``'rank r: {observations}'`` for the assertions to print."""
    for rank, o in enumerate(outs):
        yield o, f"rank {rank}: {o}"


def same_text(outs: list[dict[str, Any]], key: str, prefix: str) -> str:
    """The one text every rank recorded under ``key`` (collective errors agree before they raise); it
    starts with ``prefix``."""
    texts = {o.get(key) for o in outs}
    assert len(texts) == 1, (key, texts)
    text = texts.pop()
    assert text is not None and text.startswith(prefix), (key, text)
    return text
