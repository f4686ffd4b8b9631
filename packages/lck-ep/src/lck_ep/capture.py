"""Cross-rank agreement of a dispatch or combine that is being captured into a CUDA graph.

Eagerly, a sync-free call reads nothing on the host, so its local checks raise on the failing rank alone
(the other ranks' all-to-alls then wait for it until the process group's timeout). A capture is where that
matters most: the healthy ranks would finish capturing, and the mistake would surface later as a hang at
replay. So a call made while the current stream is capturing first agrees through the host: every rank
all-gathers its local verdict and its call digest (:func:`lck_ep.agreement.agree`, CPU tensors) over a gloo
group with the Buffer group's members, and all of them raise the same error, or none does. That group is
the Buffer's group when it is gloo, else the members' mirror from ``lck_runtime.capture`` (shared with
the other layers), made at their first captured call if no layer made it before: every member reaches
that call at the same point, captures running the same program on every rank.
Captures pay a host round trip; replays run no Python, and eager calls are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lck_ep.agreement import DIGEST_FIELDS, agree
from lck_runtime.capture import capturing as capturing  # the Buffer looks it up here; tests patch it
from lck_runtime.capture import host_group

__all__ = ["agree_in_capture", "capturing"]


def agree_in_capture(
    group: dist.ProcessGroup, local_error: BaseException | None, digest: Sequence[int] | None
) -> None:
    """Raise the same error on every rank of ``group`` when any rank's checks failed or the digests differ.

    Collective over ``group``, through the host only (nothing is launched on the capturing stream)."""
    host = host_group(group)
    assert host is not None
    agree(host, torch.device("cpu"), local_error, DIGEST_FIELDS, digest, None, 0)
