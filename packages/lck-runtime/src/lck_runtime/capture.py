"""What the layers need around CUDA-graph capture: whether a call is being captured, and the gloo group
with the members of its process group, for agreements that must stay on the host.

A call being captured into a CUDA graph cannot read a device value, so the layers above agree on their
arguments through the host instead: a gloo all-gather among the same members. For a group that is gloo
already that is the group itself; for an NCCL (or other) group it is a *mirror*, one per membership for
the whole process, shared by every layer (the vocabulary-parallel ops, expert-parallel Buffers).

Creating a mirror is collective over the members only (``use_local_synchronization``: ranks outside the
group take no part, and torch's group counters do not move). Callers create it at a call that every member
makes at the same point of its program, so the members' registries stay identical.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from lck_runtime.agreement import setup_timeout

__all__ = ["capturing", "host_group"]


def capturing(device: torch.device) -> bool:
    """Whether a call on ``device`` is being captured: it is on CUDA and the current stream is capturing."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Members (global ranks, group order) -> their gloo mirror.
_mirrors: dict[tuple[int, ...], dist.ProcessGroup] = {}


def host_group(group: dist.ProcessGroup, *, create: bool = True) -> dist.ProcessGroup | None:
    """``group`` itself when its backend is gloo, else the gloo mirror of its members: the existing one,
    a new one when ``create`` (collective over the members), or ``None``."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    members = tuple(dist.get_process_group_ranks(group))
    if members not in _mirrors and create:
        _mirrors[members] = dist.new_group(
            list(members),
            backend="gloo",
            timeout=datetime.timedelta(seconds=setup_timeout()),
            use_local_synchronization=True,
        )
    return _mirrors.get(members)
