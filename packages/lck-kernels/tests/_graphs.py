"""Capturing a step into a CUDA graph the way training code does, for the CUDA-graph tests: warm-up calls
on a side stream (first launches, the vocab-parallel ops' eager agreement), then one capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(
    step: Callable[[], T], *, warmups: int = 2, mode: str = "global"
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``step`` ``warmups`` times on a side stream, then capture one call; returns (graph, its outputs).

    ``mode`` is ``torch.cuda.graph``'s ``capture_error_mode``: ``"thread_local"`` where another thread of
    the process (NCCL's watchdog) keeps querying events during the capture, as Megatron captures."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        outs = step()
    return graph, outs
