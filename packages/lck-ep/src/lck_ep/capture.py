"""Cross-rank agreement of a dispatch or combine that is being captured into a CUDA graph.

Eagerly, a sync-free call reads nothing on the host, so its local checks raise on the failing rank alone
(the other ranks' all-to-alls then wait for it until the process group's timeout). A capture is where that
matters most: the healthy ranks would finish capturing, and the mistake would surface later as a hang at
replay. So a call made while the current stream is capturing first agrees through the host: every rank
all-gathers its local verdict and its call digest (:func:`lck_ep.agreement.agree`, CPU tensors) over a gloo
group with the Buffer group's members, and all of them raise the same error, or none does. That group is
the Buffer's group when it is gloo, else a mirror made at the first captured call of those members (every
member reaches it there: captures run the same program on every rank) and kept for the process.
Captures pay a host round trip; replays run no Python, and eager calls are unchanged.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lck_ep.agreement import DIGEST_FIELDS, agree
from lck_runtime.agreement import setup_timeout

__all__ = ["agree_in_capture", "capturing", "host_group"]

# Members (global ranks) -> the gloo group their captured calls agree through.
_mirrors: dict[tuple[int, ...], dist.ProcessGroup] = {}


def capturing(device: torch.device) -> bool:
    """Whether this call is on CUDA and the current stream is being captured into a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group with ``group``'s members: ``group`` itself when it is gloo, else a cached mirror
    (created collectively over the members only, on first use)."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    members = tuple(dist.get_process_group_ranks(group))
    if members not in _mirrors:
        _mirrors[members] = dist.new_group(
            list(members),
            backend="gloo",
            timeout=datetime.timedelta(seconds=setup_timeout()),
            use_local_synchronization=True,
        )
    return _mirrors[members]


def agree_in_capture(
    group: dist.ProcessGroup, local_error: BaseException | None, digest: Sequence[int] | None
) -> None:
    """Raise the same error on every rank of ``group`` when any rank's checks failed or the digests differ.

    Collective over ``group``, through the host only (nothing is launched on the capturing stream)."""
    agree(host_group(group), torch.device("cpu"), local_error, DIGEST_FIELDS, digest, None, 0)
