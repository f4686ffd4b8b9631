"""The vocabulary-parallel ops' call agreement inside a CUDA graph.

Eagerly, ``_vocab_parallel_group.agree`` gathers every rank's shapes, options and target digest and reads
them back to the host, so that a mismatch raises the same error on every rank. A CUDA graph cannot hold a
host read, and a replay reuses the captured shapes and options but not the captured targets. So:

- each eager agreement that passes is remembered (:func:`remember`: per group, a hash of the agreed
  shapes and options), and a captured call must find its own shapes and options there, else it raises at
  capture time (a graph's warm-up calls agree on them);
- at every replay the ranks still gather that hash and their target digest, on the device, and
  ``target_verdict`` turns a difference between ranks, or a target outside the vocabulary, into a NaN
  that the op adds to its loss and log-sum-exp (:func:`captured_agreement`), where eager calls raise.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lck_kernels import _vocab_parallel_digest as D

SIG_LIMBS = 4  # a 64-bit signature hash in 16-bit limbs, exact in float32
_WIDTH = SIG_LIMBS + D.TARGET_FIELDS * D.TARGET_LIMBS
_MAX_REMEMBERED = 256
# (group name, device, signature hash) -> the hash's limbs on that device, oldest first.
_agreed: OrderedDict[tuple[str, str, int], torch.Tensor] = OrderedDict()
# The limbs a capture has read, kept for good: the graph holds their address and replays read it, so an
# eviction from ``_agreed`` must not free them.
_pinned: dict[tuple[str, str, int], torch.Tensor] = {}
_loaded: set[str] = set()  # devices on which the verdict kernel has run (compiled and loaded) once


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of this process is being captured (and the call is on CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _signature(values: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for v in values:
        h.update(int(v).to_bytes(16, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def remember(group_name: str, values: Sequence[int], device: torch.device) -> None:
    """Record that the ranks of ``group_name`` agreed on a call with these encoded shapes and options."""
    sig = _signature(values)
    key = (group_name, str(device), sig)
    if key in _agreed:
        _agreed.move_to_end(key)
        return
    if key in _pinned:  # agreed, captured, evicted, agreed again: captures keep reading one tensor
        _agreed[key] = _pinned[key]
    else:
        limbs = [float((sig >> (16 * k)) & 0xFFFF) for k in range(SIG_LIMBS)]
        _agreed[key] = torch.tensor(limbs, dtype=torch.float32, device=device)
    while len(_agreed) > _MAX_REMEMBERED:
        _agreed.popitem(last=False)
    if str(device) not in _loaded:
        # Compile and load the verdict kernel now: a first launch inside a capture would have to load a
        # module while the stream is being captured.
        D.target_verdict(torch.zeros(1, _WIDTH, device=device), SIG_LIMBS, 1, torch.empty((), device=device))
        _loaded.add(str(device))


def forget() -> None:
    """Drop every remembered agreement (tests; a captured call then needs a new eager warm-up). Limbs that
    captures read stay pinned: graphs may still replay them."""
    _agreed.clear()


def captured_agreement(
    op: str,
    tp: Any,
    values: Sequence[int],
    *,
    error: BaseException | None,
    target: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """The agreement of a call being captured: a 0-D float32 tensor on ``device``, 0.0 when, at replay,
    every rank has the same call signature and targets and the targets lie in ``[0, vocab_size)``, NaN
    otherwise. Raises (on this rank, at capture time) when this rank's inputs are invalid or its shapes
    and options were never agreed eagerly."""
    if error is not None:
        raise error  # a local problem: the other ranks cannot learn of it without a host read
    key = (tp.name, str(device), _signature(values))
    sig = _agreed.get(key)
    if sig is None:
        raise RuntimeError(
            f"{op}: this call is being captured into a CUDA graph with shapes and options that the ranks of "
            f"the tensor-parallel group {tp.name!r} have not agreed on outside capture (they agree through a "
            f"host read, which a graph cannot hold): call the op once eagerly with the same shapes and "
            f"options before capturing, as a CUDA-graph warm-up does"
        )
    _pinned.setdefault(key, sig)
    rows = torch.zeros(tp.size, _WIDTH, device=device, dtype=torch.float32)
    rows[tp.rank, :SIG_LIMBS].copy_(sig)
    # Into its own buffer, as the eager agreement does: the same pointer alignment, so the kernel compiled
    # and loaded by the warm-up is the one captured.
    digest = torch.empty(_WIDTH - SIG_LIMBS, device=device, dtype=torch.float32)
    D.target_digest(target, ignore_index, digest)
    rows[tp.rank, SIG_LIMBS:].copy_(digest)
    if tp.size > 1:
        dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=tp.group)
    verdict = torch.empty((), device=device, dtype=torch.float32)
    D.target_verdict(rows, SIG_LIMBS, vocab_size, verdict)
    return verdict
