"""The retained-forward stack: LIFO, bounded, no mutation on any rejected call."""

from __future__ import annotations

import threading

import pytest

from lck_runtime.stack import RetainedForwardStack


def test_lifo_order() -> None:
    s = RetainedForwardStack(3, "ctx")
    a, b, c = object(), object(), object()
    for e in (a, b, c):
        s.push(e)
    assert len(s) == 3 and s.peek() is c
    assert [s.pop(), s.pop(), s.pop()] == [c, b, a]
    assert len(s) == 0


def test_overflow_rejected_before_mutation() -> None:
    s = RetainedForwardStack(2, "MoE context for group 'ep'")
    a, b = object(), object()
    s.push(a)
    s.push(b)
    with pytest.raises(RuntimeError, match="max_inflight=2") as info:
        s.push(object())
    assert "MoE context for group 'ep'" in str(info.value) and "nothing was pushed" in str(info.value)
    assert len(s) == 2 and s.pop() is b and s.pop() is a


def test_pop_empty_and_peek_empty() -> None:
    s = RetainedForwardStack(1, "ctx")
    with pytest.raises(RuntimeError, match="no retained forward to pop"):
        s.pop()
    with pytest.raises(RuntimeError, match="no retained forward"):
        s.peek()


def test_pop_expected_mismatch_keeps_stack() -> None:
    s = RetainedForwardStack(2, "ctx")
    a, b = object(), object()
    s.push(a)
    s.push(b)
    with pytest.raises(RuntimeError, match="LIFO order"):
        s.pop(a)
    assert len(s) == 2
    assert s.pop(b) is b and s.pop(a) is a


def test_none_entry_and_bad_bound() -> None:
    s = RetainedForwardStack(1, "ctx")
    with pytest.raises(ValueError, match="entry must not be None"):
        s.push(None)
    assert len(s) == 0
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_inflight"):
            RetainedForwardStack(bad, "ctx")  # type: ignore[arg-type]


def test_drop_all_counts() -> None:
    s = RetainedForwardStack(3, "ctx")
    s.push(1)
    s.push(2)
    assert s.drop_all() == 2 and len(s) == 0


def test_concurrent_pushes_never_exceed_bound() -> None:
    s = RetainedForwardStack(50, "ctx")
    rejected = []

    def pusher() -> None:
        for i in range(20):
            try:
                s.push(i)
            except RuntimeError:
                rejected.append(i)

    threads = [threading.Thread(target=pusher) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(s) == 50 and len(rejected) == 30
