"""Small pieces the Megatron adapters share: one-time logging and "can an lck kernel run here?".

lck's kernels are Triton kernels: they run on CUDA tensors, and on CPU tensors only under Triton's
interpreter (``TRITON_INTERPRET=1``, which is how CPU CI runs them). Every adapter asks
:func:`kernel_unavailable_reason` before calling a kernel and hands the call back to Megatron's own
implementation, logging the reason once, when the answer is not ``None``.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading

import torch

logger = logging.getLogger("lck_megatron")


class LogOnce:
    """Logs each distinct message once per instance (thread-safe); remembers what it logged."""

    def __init__(self, log: logging.Logger = logger, level: int = logging.INFO):
        self._log, self._level = log, level
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, message: str) -> bool:
        """Log ``message`` unless it was logged before; return True when it was logged now."""
        with self._lock:
            if message in self._seen:
                return False
            self._seen.add(message)
        self._log.log(self._level, message)
        return True

    @property
    def seen(self) -> frozenset[str]:
        return frozenset(self._seen)

    # Modules holding a LogOnce must survive copy.deepcopy and pickling (EMA copies, torch.save(model)):
    # the lock is recreated rather than copied.
    def __getstate__(self) -> dict[str, object]:
        return {"log": self._log, "level": self._level, "seen": set(self._seen)}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._log, self._level, self._seen = state["log"], state["level"], state["seen"]  # type: ignore[assignment]
        self._lock = threading.Lock()


def is_default(value: object, default: object) -> bool:
    """Whether an argument's value equals its declared default (tensors and odd types never do)."""
    if value is default:
        return True
    if default is inspect.Parameter.empty or isinstance(value, torch.Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:  # e.g. an array whose == is elementwise
        return False


def kernel_unavailable_reason(t: torch.Tensor) -> str | None:
    """Why lck's Triton kernels cannot run on ``t``'s device, or None when they can."""
    if t.device.type == "cuda":
        return None
    if t.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "the tensor is on the CPU and TRITON_INTERPRET=1 is not set (Triton needs CUDA otherwise)"
    return f"the tensor is on device type {t.device.type!r}; lck's kernels need CUDA"
