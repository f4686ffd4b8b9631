"""Signals between the members of a team through symmetric memory: a bounded, stream-ordered barrier.

The kernel (``csrc/team_signal.cu``, compiled by :mod:`lck_runtime.jit`) is one block: member ``i``
writes the epoch into slot ``i`` of every member's flag array (system-scope release), then waits until
all slots of its own array reach the epoch (system-scope acquire). It never hangs: after
``timeout_s`` it records a diagnostic in a small device ``status`` tensor and returns;
:func:`check_barrier_status` (or :meth:`TeamBarrier.check`) turns it into a :class:`BarrierError`
naming the member that did not arrive.

Flag arrays: each member owns ``team_size`` ``int64``/``uint64`` words of symmetric memory (NVSHMEM),
zeroed before the first barrier, and passes every member's array *as mapped in its own address
space* (``nvshmem.core.get_peer_tensor(flags, pe).data_ptr()``; its own local pointer at its own
index). Epochs are 1, 2, 3, ... in the same order on every member.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lck_runtime.jit import I32, U64, Jit, Kernel

if TYPE_CHECKING:
    import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "team_signal.cu"
HEADER = CSRC / "lck_sync.cuh"  # shared with p2p_all_reduce.cu; its contents are part of the cache key
KERNEL = "lck_team_barrier"
STATUS_WORDS = 5
OK, TIMED_OUT, OUT_OF_STEP = 0, 1, 2
MAX_TEAM = 1024  # one thread per member in one block

_jit: Jit | None = None
_kernels: dict[str, Kernel] = {}
_lock = threading.Lock()


class BarrierError(RuntimeError):
    """A team barrier failed: ``code`` (1 timed out, 2 epochs out of step), ``member`` (team index the
    diagnostic is about), ``seen`` (its slot's value), ``epoch`` (the awaited epoch), ``waited_ns``."""

    def __init__(self, message: str, code: int, member: int, seen: int, epoch: int, waited_ns: int):
        super().__init__(message)
        self.code, self.member, self.seen, self.epoch, self.waited_ns = code, member, seen, epoch, waited_ns


def _get_jit() -> Jit:
    global _jit
    if _jit is None:
        _jit = Jit(prefix="LCK")  # LCK_JIT_CACHE_DIR / _PRINT_COMPILER_COMMAND / _EXTRA_FLAGS
    return _jit


def compile_barrier(arch: str, jit: Jit | None = None) -> Path:
    """Compile (or find cached) the barrier cubin for ``arch`` without a GPU; returns its path."""
    return (jit or _get_jit()).compile_only(
        KERNEL, SOURCE.read_text(), KERNEL, arch=arch, headers=[HEADER], include_dirs=[CSRC]
    )


def barrier_kernel(jit: Jit | None = None) -> Kernel:
    """The barrier kernel for the current CUDA device's architecture (built once per process and arch)."""
    from lck_runtime.jit import detect_arch

    arch = detect_arch()
    with _lock:
        kernel = _kernels.get(arch)
        if kernel is None:
            kernel = (jit or _get_jit()).build(
                KERNEL, SOURCE.read_text(), KERNEL, arch=arch, headers=[HEADER], include_dirs=[CSRC]
            )
            _kernels[arch] = kernel
        return kernel


def new_barrier_status(device: Any = None) -> torch.Tensor:
    """A zeroed ``int64[STATUS_WORDS]`` status tensor on ``device`` (default: the current CUDA device)."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"new_barrier_status: device must be a CUDA device, got {dev}")
    return torch.zeros(STATUS_WORDS, dtype=torch.int64, device=dev)


def _check_int(value: Any, name: str, lo: int, hi: int, where: str = "team_barrier") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{where}: {name} must be in [{lo}, {hi}], got {value}")
    return value


def team_barrier(
    peer_flag_ptrs: torch.Tensor,
    my_index: int,
    epoch: int,
    stream: Any = None,
    *,
    status: torch.Tensor,
    timeout_s: float = 10.0,
) -> None:
    """Stream-ordered barrier over a team's symmetric flag arrays; collective over the team.

    ``peer_flag_ptrs``: CUDA ``int64[team_size]`` on the current device; entry ``m`` is the address of
    member ``m``'s flag array (``team_size`` 8-byte words) in this process's address space.
    ``my_index``: this member's index in ``[0, team_size)``. ``epoch``: 1 on the first barrier, then
    +1 per barrier, equal on every member. ``stream``: a ``torch.cuda.Stream`` (default: current).
    ``status``: CUDA ``int64[5]`` from :func:`new_barrier_status`; a failure (timeout after
    ``timeout_s`` seconds, or epochs out of step) is recorded there instead of hanging and is
    raised by :func:`check_barrier_status`. Asynchronous: returns after enqueueing the kernel.
    """
    import torch

    if not isinstance(peer_flag_ptrs, torch.Tensor):
        raise TypeError(
            f"team_barrier: peer_flag_ptrs must be a torch.Tensor, got {type(peer_flag_ptrs).__name__}"
        )
    if not isinstance(status, torch.Tensor):
        raise TypeError(f"team_barrier: status must be a torch.Tensor, got {type(status).__name__}")
    if not torch.cuda.is_available():
        raise ValueError("team_barrier: needs a CUDA device; none is visible")
    dev = torch.cuda.current_device()
    for name, t, shape in (("peer_flag_ptrs", peer_flag_ptrs, None), ("status", status, (STATUS_WORDS,))):
        if t.device != torch.device("cuda", dev):
            raise ValueError(
                f"team_barrier: {name} is on {t.device}, expected cuda:{dev} (the current device)"
            )
        if t.dtype != torch.int64:
            raise ValueError(f"team_barrier: {name} must be int64, got {t.dtype}")
        if t.dim() != 1 or not t.is_contiguous() or (shape is not None and tuple(t.shape) != shape):
            want = f"shape {shape}" if shape else "a contiguous 1-D tensor"
            raise ValueError(
                f"team_barrier: {name} must be {want}, got shape {tuple(t.shape)} stride {t.stride()}"
            )
    team_size = peer_flag_ptrs.numel()
    if not 1 <= team_size <= MAX_TEAM:
        raise ValueError(f"team_barrier: peer_flag_ptrs has {team_size} entries, expected 1 to {MAX_TEAM}")
    _check_int(my_index, "my_index", 0, team_size - 1)
    _check_int(epoch, "epoch", 1, 2**62)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
        raise ValueError(
            f"team_barrier: timeout_s must be a number of seconds in (0, 3600], got {timeout_s!r}"
        )
    kernel = barrier_kernel()
    threads = max(32, (team_size + 31) // 32 * 32)
    kernel.launch(
        1,
        threads,
        [peer_flag_ptrs, I32(team_size), I32(my_index), U64(epoch), U64(int(timeout_s * 1e9)), status],
        stream=stream,
    )


def check_barrier_status(status: torch.Tensor, my_index: int | None = None) -> None:
    """Synchronize ``status``'s device and raise :class:`BarrierError` if a barrier recorded a failure."""
    import torch

    if (
        not isinstance(status, torch.Tensor)
        or status.dtype != torch.int64
        or tuple(status.shape) != (STATUS_WORDS,)
    ):
        raise ValueError(f"check_barrier_status: status must be an int64 tensor of shape ({STATUS_WORDS},)")
    if status.is_cuda:
        torch.cuda.synchronize(status.device)
    code, member, seen, epoch, waited = (int(v) for v in status.tolist())
    if code == OK:
        return
    who = "" if my_index is None else f"member {my_index}: "
    if code == TIMED_OUT:
        msg = (
            f"{who}team barrier timed out after {waited / 1e6:.0f} ms waiting for epoch {epoch}: team member "
            f"{member} has announced epoch {seen} only (it never arrived: stopped, stuck, or skipped a barrier)"
        )
    elif code == OUT_OF_STEP:
        msg = (
            f"{who}team barrier epochs out of step: waiting for epoch {epoch} but team member {member} already "
            f"announced epoch {seen}; every member must pass epochs 1, 2, 3, ... in the same order"
        )
    else:
        msg = f"{who}team barrier status holds an unknown code {code} (status {status.tolist()})"
    raise BarrierError(msg, code, member, seen, epoch, waited)


class TeamBarrier:
    """A team barrier with its own device table, status and epoch counter.

    ``peer_flag_ptrs``: addresses (ints) of every member's flag array in this process's address space,
    8-byte aligned, distinct, in team order; ``my_index``: this member's position. Construct it on
    every member with the same team; each :meth:`wait` is collective over the team.
    """

    def __init__(
        self, peer_flag_ptrs: Sequence[int], my_index: int, *, device: Any = None, timeout_s: float = 10.0
    ):
        import torch

        if isinstance(peer_flag_ptrs, (str, bytes)) or not isinstance(peer_flag_ptrs, Sequence):
            raise TypeError(
                f"TeamBarrier: peer_flag_ptrs must be a sequence of ints, got {type(peer_flag_ptrs).__name__}"
            )
        ptrs = list(peer_flag_ptrs)
        if not 1 <= len(ptrs) <= MAX_TEAM:
            raise ValueError(f"TeamBarrier: peer_flag_ptrs has {len(ptrs)} entries, expected 1 to {MAX_TEAM}")
        for i, p in enumerate(ptrs):
            if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 2**63 or p % 8:
                raise ValueError(
                    f"TeamBarrier: peer_flag_ptrs[{i}] = {p!r} is not a non-null 8-byte-aligned address"
                )
        if len(set(ptrs)) != len(ptrs):
            raise ValueError(f"TeamBarrier: peer_flag_ptrs has repeated addresses: {[hex(p) for p in ptrs]}")
        _check_int(my_index, "my_index", 0, len(ptrs) - 1, "TeamBarrier")
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s <= 3600
        ):
            raise ValueError(
                f"TeamBarrier: timeout_s must be a number of seconds in (0, 3600], got {timeout_s!r}"
            )
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"TeamBarrier: device must be a CUDA device, got {dev}")
        self.my_index = my_index
        self.team_size = len(ptrs)
        self.timeout_s = float(timeout_s)
        self.device = dev
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=dev)
        self.status = new_barrier_status(dev)
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """The epoch of the last :meth:`wait` (0 before the first)."""
        return self._epoch

    def wait(self, stream: Any = None) -> None:
        """Enqueue the next barrier on ``stream`` (default: current); collective over the team."""
        import torch

        with torch.cuda.device(self.device):
            team_barrier(
                self.table,
                self.my_index,
                self._epoch + 1,
                stream,
                status=self.status,
                timeout_s=self.timeout_s,
            )
        self._epoch += 1

    __call__ = wait

    def check(self) -> None:
        """Synchronize and raise :class:`BarrierError` if any barrier so far failed."""
        check_barrier_status(self.status, self.my_index)
