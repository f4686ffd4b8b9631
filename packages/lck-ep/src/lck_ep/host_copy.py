"""Small host-to-device copies that do not wait for the stream.

``torch.tensor(values, device=cuda)`` copies from pageable memory, and a copy from pageable memory waits for
every launch enqueued on the stream before it: a call that builds a small vector that way on its path stops
the host until the device has caught up. From pinned memory the copy is enqueued like any launch (torch's
pinned allocator keeps the staging memory until the copy has run).
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, enqueued without waiting on a CUDA device."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
