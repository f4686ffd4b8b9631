"""The bad-input test every kernel test module runs: each bad call raises, naming the argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _device import DEVICE

BadCalls = Callable[[str], list[tuple[str, type[BaseException], Callable[[], object]]]]


def bad_input_test(op: str, bad_calls: BadCalls, count_on: str) -> Callable[[int], None]:
    """A test over ``bad_calls(device)``, a list of (argument named in the error, exception type, call):
    call ``i`` must raise that type with a message starting ``"{op}: {argument}"``. The calls are counted
    on ``count_on`` (``cpu`` or ``meta``) so that collection creates no CUDA context, and built on
    ``DEVICE`` when the test runs."""

    @pytest.mark.parametrize("i", range(len(bad_calls(count_on))))
    def test_bad_input_names_the_argument(i: int) -> None:
        name, exc, call = bad_calls(DEVICE)[i]
        with pytest.raises(exc, match=rf"{op}: {name}\b"):
            call()

    return test_bad_input_names_the_argument
