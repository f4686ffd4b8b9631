"""The completion event returned by dispatch and combine.

The reference backend runs on the caller's current stream (NCCL work is joined to it before the call
returns), so the event is recorded there after the last launch: waiting on it orders later work after
the operation without a host synchronisation. On CPU (gloo) everything has finished when the call
returns and the event is already complete.
"""

from __future__ import annotations

import torch

__all__ = ["Event"]


class Event:
    """``wait()`` makes a stream wait for the operation; ``synchronize()`` blocks the host until done."""

    def __init__(self, device: torch.device):
        self._event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    @property
    def cuda_event(self) -> torch.cuda.Event | None:
        return self._event

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for the operation; no-op on CPU."""
        if self._event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._event)

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        return True if self._event is None else bool(self._event.query())

    def __repr__(self) -> str:
        return f"Event({'cuda' if self._event is not None else 'cpu, complete'})"
