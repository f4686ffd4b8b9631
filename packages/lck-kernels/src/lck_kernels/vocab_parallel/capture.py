"""The vocabulary-parallel ops' call agreement inside a CUDA graph.

Eagerly, ``group.agree`` gathers every rank's shapes, options and target digest and reads
them back to the host, so that a mismatch raises the same error on every rank. A CUDA graph cannot hold a
host read, and a replay reuses the captured shapes and options but not the captured targets. So:

- at capture time the ranks agree on what does not change between replays (each rank's input validity,
  shapes and options, and whether it agreed on them eagerly before) through a CPU all-reduce on a gloo
  group with the same members (:func:`host_rows`; ``lck_runtime.capture``: the group itself when it
  is gloo, else a mirror per membership, made here at the first eager agreement, outside any capture): a
  problem on any rank raises the same error on every rank, and nothing is captured;
- each eager agreement that passes is remembered (:func:`remember`: per group, a hash of the agreed
  shapes and options), and a captured call needs its own shapes and options there on every rank (a
  graph's warm-up calls agree on them; the warm-up also loads the kernels a capture must not load);
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

from lck_kernels.vocab_parallel import digest as D
from lck_runtime.capture import capturing as capturing  # the group looks it up here; tests patch it
from lck_runtime.capture import host_group

SIG_LIMBS = 4  # a 64-bit signature hash in 16-bit limbs, exact in float32
_WIDTH = SIG_LIMBS + D.TARGET_FIELDS * D.TARGET_LIMBS
_MAX_REMEMBERED = 256
# (group name, device, signature hash) -> the hash's limbs on that device, oldest first.
_agreed: OrderedDict[tuple[str, str, int], torch.Tensor] = OrderedDict()
# The limbs a capture has read, kept for good: the graph holds their address and replays read it, so an
# eviction from ``_agreed`` must not free them.
_pinned: dict[tuple[str, str, int], torch.Tensor] = {}
_loaded: set[str] = set()  # devices on which the verdict kernel has run (compiled and loaded) once


def _signature(values: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for v in values:
        h.update(int(v).to_bytes(16, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def host_rows(op: str, tp: Any, row: list[float]) -> list[list[float]]:
    """Every member's ``row`` (non-negative floats), gathered through the host as a max over a
    ``[size, len(row)]`` CPU tensor on the group's gloo mirror: legal during a capture, which it leaves
    untouched."""
    buf = torch.zeros(tp.size, len(row), dtype=torch.float32)
    buf[tp.rank] = torch.tensor(row, dtype=torch.float32)
    if tp.size > 1:
        host = host_group(tp.group, create=False)
        if host is None:  # no eager call on this membership in this process: the warm-up is missing
            raise RuntimeError(
                f"{op}: captured before any eager call on the tensor-parallel group {tp.name!r} in this "
                f"process: call the op once eagerly with the same shapes and options before capturing, as "
                f"a CUDA-graph warm-up does"
            )
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=host)
    return buf.tolist()


def agreed_before(group_name: str, values: Sequence[int], device: torch.device) -> bool:
    """Whether this process remembers an eager agreement of ``group_name`` on these shapes and options."""
    return (group_name, str(device), _signature(values)) in _agreed


def remember(
    group_name: str, values: Sequence[int], device: torch.device, group: dist.ProcessGroup | None = None
) -> None:
    """Record that the ranks of ``group_name`` agreed on a call with these encoded shapes and options
    (and, given the ``group``, make its gloo mirror for later captures if it has none)."""
    sig = _signature(values)
    key = (group_name, str(device), sig)
    if key in _agreed:  # the steady state of a training loop: one dict lookup
        _agreed.move_to_end(key)
        return
    # A membership's first agreement is a new key on every member alike (they make the same calls), so
    # the mirror, a collective over the members, is made at the same call everywhere; later new keys find it.
    if group is not None and dist.get_world_size(group) > 1:
        host_group(group, create=True)
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


def not_agreed_error(op: str, tp: Any, ranks: list[int]) -> RuntimeError:
    """The error every rank raises when ``ranks`` never agreed eagerly on the call being captured."""
    return RuntimeError(
        f"{op}: this call is being captured into a CUDA graph with shapes and options that rank(s) {ranks} "
        f"of the tensor-parallel group {tp.name!r} have not agreed on outside capture (the ranks agree "
        f"through a host read, which a graph cannot hold, and the warm-up loads the kernels): call the op "
        f"once eagerly with the same shapes and options before capturing, as a CUDA-graph warm-up does"
    )


def captured_agreement(
    op: str,
    tp: Any,
    values: Sequence[int],
    *,
    target: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """The agreement of a call being captured, once the ranks' host agreement passed: a 0-D float32 tensor
    on ``device``, 0.0 when, at replay, every rank has the same call signature and targets and the targets
    lie in ``[0, vocab_size)``, NaN otherwise."""
    key = (tp.name, str(device), _signature(values))
    sig = _agreed.get(key)
    if sig is None:  # the host agreement checked this on every rank
        raise not_agreed_error(op, tp, [tp.rank])
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
