"""A stand-in for NVSHMEM that records collective calls, for CPU tests of the native path's bookkeeping.

``install(rank, world)`` patches ``lck_runtime.nvshmem`` in this (worker) process so that ``configure``
takes the native path on CPU: teams, symmetric allocations (CPU tensors) and peer views go through a
:class:`RecordingNvshmem`, which records every collective call in order. ``peer_fails=True`` makes this
rank's peer views fail, as on a machine whose GPUs cannot map each other's memory; ``init_status=3``
reports NVSHMEM's limited multiple-PEs-per-GPU mode.
"""

from __future__ import annotations

from typing import Any


class RecordingNvshmem:
    """Stands in for ``NvshmemOwner`` and records the collective calls one rank makes."""

    def __init__(self, rank: int, n: int, *, peer_fails: bool = False, init_status: int = 2) -> None:
        self.my_pe, self.n_pes, self.alive, self.applied_env = rank, n, True, {}
        self.init_status = init_status
        self.calls: list[tuple] = []
        self.peer_fails = peer_fails
        self._next = 100

    def split_strided(self, start: int, stride: int, size: int) -> int | None:
        self.calls.append(("split", start, stride, size))
        self._next += 1
        return self._next if self.my_pe in range(start, start + stride * size, stride) else None

    def destroy_team(self, handle: int) -> None:
        self.calls.append(("destroy_team",))

    def alloc(self, numel: int, dtype: Any) -> Any:
        import torch

        self.calls.append(("alloc", numel, str(dtype)))
        return torch.zeros(numel, dtype=dtype)

    def free(self, t: Any) -> None:
        self.calls.append(("free", t.numel(), str(t.dtype)))

    def peer(self, t: Any, pe: int) -> Any:
        if self.peer_fails:
            raise RuntimeError(f"no load/store view of PE {pe} (simulated)")
        return t

    def finalize(self) -> None:
        self.calls.append(("finalize",))
        self.alive = False


def install(rank: int, world: int, *, peer_fails: bool = False, init_status: int = 2) -> RecordingNvshmem:
    """Route this process's NVSHMEM owner to a fresh recorder; returns it. ``init_status`` is the NVSHMEM
    status the recorder reports (3: several PEs per GPU without MPS)."""
    from lck_runtime import nvshmem as nv

    rec = RecordingNvshmem(rank, world, peer_fails=peer_fails, init_status=init_status)
    nv.native_support = lambda device: (True, "")
    nv.foreign_init_status = lambda: 0
    nv.NvshmemOwner.make_uid = staticmethod(lambda: b"uid")
    nv.NvshmemOwner.init = classmethod(lambda cls, uid, **kw: rec)
    nv.owner = lambda: rec if rec.alive else None
    return rec
