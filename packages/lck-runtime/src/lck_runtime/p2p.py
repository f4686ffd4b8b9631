"""One-shot all-reduce over NVLink peer views of symmetric memory (``csrc/p2p_all_reduce.cu``).

An FLSCE context on the NVSHMEM path owns one :class:`P2PAllReduce`: a symmetric receive area of
2 parities × team size × ``slot`` floats, a symmetric flag array, and the peer addresses of both on every
member. One call is one kernel launch per ``slot``-sized chunk: each block pushes its range to the other
members, signals them, waits for theirs (bounded) and reduces in member order, so every member gets the
same bits. Latency-bound sizes are where it beats a ring (one NVLink hop and one flag round trip); at TP2
it also moves the least data possible (each rank sends its tensor once).

Failure never hangs: a member whose peers do not arrive within ``timeout_s`` fills its output with NaN,
and :meth:`P2PAllReduce.check` (or ``FlsceContext.check_collectives``) raises the diagnostic.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lck_runtime.jit import I32, I64, U64, Jit, Kernel
from lck_runtime.signals import CSRC, HEADER

SOURCE = Path(__file__).resolve().parent / "csrc" / "p2p_all_reduce.cu"
_INCLUDE = {"headers": [HEADER], "include_dirs": [CSRC]}  # lck_sync.cuh, shared with the team barrier
KERNEL = "lck_p2p_all_reduce"
KERNEL_LL = "lck_p2p_all_reduce_ll"
LL_SLOT = 128 * 1024  # floats up to which a call takes the low-latency form (8-byte words with the epoch)
MAX_BLOCKS = 128  # flag words per member (MAX_BLOCKS in the kernel)
THREADS = 512
MIN_PER_BLOCK = 8192  # floats per block before another block is worth its flag round trip
BUFFER_BYTES = 64 << 20  # receive area per context (both parities, all slots)
SLOT_ALIGN = 1024  # floats: slots stay 4 KiB aligned

_kernels: dict[tuple[str, str], Kernel] = {}
_lock = threading.Lock()


def slot_floats(team_size: int, capacity: int) -> int:
    """Floats per slot: the capacity when the receive area allows it, else what ``BUFFER_BYTES`` holds."""
    budget = BUFFER_BYTES // (2 * team_size * 4) // SLOT_ALIGN * SLOT_ALIGN
    want = (capacity + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
    return max(SLOT_ALIGN, min(budget, want))


def recv_numel(team_size: int, slot: int) -> int:
    return 2 * team_size * slot


def flags_numel(team_size: int) -> int:
    return team_size * MAX_BLOCKS


def ll_numel(team_size: int) -> int:
    """8-byte words of the low-latency receive area: 2 parities x members x ``LL_SLOT``."""
    return 2 * team_size * LL_SLOT


def compile_kernel(arch: str, jit: Jit | None = None, kernel: str = KERNEL) -> Path:
    """Compile (or find cached) one of the two cubins for ``arch`` without a GPU; returns its path."""
    return (jit or Jit(prefix="LCK")).compile_only(kernel, SOURCE.read_text(), kernel, arch=arch, **_INCLUDE)


def _kernel(name: str) -> Kernel:
    from lck_runtime.jit import detect_arch

    arch = detect_arch()
    with _lock:
        k = _kernels.get((name, arch))
        if k is None:
            k = Jit(prefix="LCK").build(name, SOURCE.read_text(), name, arch=arch, **_INCLUDE)
            _kernels[(name, arch)] = k
        return k


def auto_takes(team_size: int, numel: int) -> bool:
    """Whether ``all_reduce_(algorithm="auto")`` takes the one-shot path for ``numel`` floats.

    With two members the exchange moves the fewest bytes possible and was measured faster than NVSHMEM's
    team reduction at every size (4 KiB to 128 MiB on two H200s). With more, each member sends its tensor
    to every other one, (n - 1) times a ring's share per member, so above the low-latency sizes NVSHMEM's
    reduction keeps them (not measured on more than two GPUs).
    """
    return team_size == 2 or numel <= LL_SLOT


def blocks_for(n: int) -> int:
    """Blocks of one launch over ``n`` floats: a function of ``n`` only, so equal on every member."""
    return max(1, min(MAX_BLOCKS, -(-n // MIN_PER_BLOCK)))


class P2PAllReduce:
    """The one-shot all-reduce of one team. Construct on every member with the same team.

    ``recv`` / ``flags`` / ``ll``: this member's symmetric receive area (float32, :func:`recv_numel`),
    flag array (int64, :func:`flags_numel`) and low-latency area (int64, :func:`ll_numel`), zeroed;
    ``recv_ptrs`` / ``flag_ptrs`` / ``ll_ptrs``: every member's copy of each, as mapped in this process,
    in team order; ``me``: this member's index. Calls of at most ``ll_max`` floats (default
    ``LL_SLOT``) take the low-latency kernel.
    """

    def __init__(
        self,
        recv: Any,
        flags: Any,
        ll: Any,
        recv_ptrs: Sequence[int],
        flag_ptrs: Sequence[int],
        ll_ptrs: Sequence[int],
        me: int,
        slot: int,
        *,
        timeout_s: float = 30.0,
    ) -> None:
        import torch

        n = len(recv_ptrs)
        if len(flag_ptrs) != n or len(ll_ptrs) != n or not 0 <= me < n or n > THREADS:
            raise ValueError(
                f"P2PAllReduce: {len(recv_ptrs)} receive and {len(flag_ptrs)} flag addresses, member {me}: "
                f"expected equal counts (at most {THREADS}) and 0 <= me < count"
            )
        if (
            slot < 1
            or slot % 4
            or recv.numel() != recv_numel(n, slot)
            or flags.numel() != flags_numel(n)
            or ll.numel() != ll_numel(n)
        ):
            raise ValueError(
                f"P2PAllReduce: slot {slot} (a positive multiple of 4), receive area {recv.numel()} "
                f"(want {recv_numel(n, slot)}), flags {flags.numel()} (want {flags_numel(n)}) and "
                f"low-latency area {ll.numel()} (want {ll_numel(n)}) do not fit"
            )
        self.recv, self.flags, self.me, self.size, self.slot = recv, flags, me, n, slot
        dev = recv.device
        self.peers = torch.tensor(list(recv_ptrs), dtype=torch.int64, device=dev)
        self.flag_table = torch.tensor(list(flag_ptrs), dtype=torch.int64, device=dev)
        self.ll_peers = torch.tensor(list(ll_ptrs), dtype=torch.int64, device=dev)
        self.ll, self.ll_max = ll, LL_SLOT
        self.status = torch.zeros(5, dtype=torch.int64, device=dev)
        self.timeout_ns = int(timeout_s * 1e9)
        self.epoch = 0
        self._last: tuple[Any, Any] = (None, None)  # (stream, event) of the previous call
        if dev.type == "cuda":
            # Load both kernels now, inside configure, before any member can wait in one: loading a module
            # may wait for the kernels running on the GPU (CUDA lazy loading), so a member loading it at its
            # first call while a peer on the same GPU (MPS) already spins in it would stall both until the
            # peer's timeout. A build that fails here (no nvcc) turns the one-shot path off at configure.
            for name in (KERNEL, KERNEL_LL):
                _kernel(name).load(dev.index)

    def __call__(self, t: Any, op: str) -> None:
        """Reduce the contiguous float32 CUDA tensor ``t`` in place over the team (``op``: sum or max)."""
        import torch

        stream = torch.cuda.current_stream(t.device)
        last_stream, last_event = self._last
        if last_event is not None and last_stream != stream:
            # Another stream's call may still read the receive area this one is about to refill.
            stream.wait_event(last_event)
        flat = t.view(-1)
        if flat.numel() <= self.ll_max:
            self.epoch += 1
            threads = 256
            _kernel(KERNEL_LL).launch(
                max(1, min(MAX_BLOCKS, -(-flat.numel() // threads))),
                threads,
                [
                    flat,
                    I64(flat.numel()),
                    self.ll_peers,
                    I32(self.size),
                    I32(self.me),
                    I64(LL_SLOT),
                    U64(self.epoch),
                    I32(1 if op == "max" else 0),
                    U64(self.timeout_ns),
                    self.status,
                ],
                stream=stream,
            )
            self._record(stream)
            return
        kernel = _kernel(KERNEL)
        for off in range(0, flat.numel(), self.slot):
            part = flat[off : off + self.slot]
            n = part.numel()
            vec4 = n % 4 == 0 and part.data_ptr() % 16 == 0
            self.epoch += 1
            kernel.launch(
                blocks_for(n),
                THREADS,
                [
                    part,
                    I64(n),
                    self.peers,
                    self.flag_table,
                    I32(self.size),
                    I32(self.me),
                    I64(self.slot),
                    U64(self.epoch),
                    I32(1 if op == "max" else 0),
                    I32(1 if vec4 else 0),
                    U64(self.timeout_ns),
                    self.status,
                ],
                stream=stream,
            )
        self._record(stream)

    def _record(self, stream: Any) -> None:
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        self._last = (stream, event)

    def check(self) -> None:
        """Synchronize and raise :class:`lck_runtime.signals.BarrierError` if an exchange failed."""
        from lck_runtime.signals import check_barrier_status

        check_barrier_status(self.status, self.me)
