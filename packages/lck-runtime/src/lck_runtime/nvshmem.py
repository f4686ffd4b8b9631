"""NVSHMEM ownership through nvshmem4py: one owner per process, uid bootstrap, env, teams, memory.

lck owns NVSHMEM in its process. It initialises NVSHMEM itself (a unique id from bootstrap rank 0,
shared over the bootstrap group, then ``nvshmem.core.init(..., initializer_method="uid")``), after
applying its environment defaults (NVSHMEM reads its environment once, at the first init), and it
finalizes explicitly. An NVSHMEM that someone else initialised (torch's NVSHMEM symmetric-memory
backend initialises inside its first allocation and never finalizes) is rejected with a clear error:
two owners would disagree about the heap, the teams and the finalize.

NVSHMEM PE ``i`` is bootstrap-local rank ``i``. Everything here that allocates, frees, splits or
destroys is an NVSHMEM collective; the callers (configure and the lifecycle calls) run those in the
same order on every rank after an agreement round.
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = [
    "NATIVE_ARCHS",
    "NvshmemOwner",
    "apply_env",
    "env_defaults",
    "foreign_init_status",
    "heap_for",
    "heap_needed",
    "mps_servers",
    "native_support",
    "owner",
    "parse_size",
    "status",
]

# Architectures the native paths are built for (sm_90a Hopper, sm_100a Blackwell).
# "a" targets run only on their exact chip: B300 (10.3) needs sm_103a, not sm_100a.
NATIVE_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
# NVSHMEM variables that must be equal on every rank (heap layout and transports are symmetric).
AGREED_ENV = (
    "NVSHMEM_SYMMETRIC_SIZE",
    "NVSHMEM_DISABLE_NVLS",
    "NVSHMEM_REMOTE_TRANSPORT",
    "NVSHMEM_DISABLE_CUDA_VMM",
)
# nvshmemx_init_status_t: several PEs share a GPU and no CUDA MPS server runs. NVSHMEM then refuses
# team creation (it exits the process), so lck stops before creating any team.
STATUS_LIMITED_MPG = 3
_MIN_HEAP = 1 << 30  # NVSHMEM's own default heap
HEAP_SLACK = 256 << 20  # room for NVSHMEM's internal symmetric state (team psyncs, signals)
# Per reservation, for the allocator's alignment and bookkeeping (a bound, not measured).
ALLOC_MARGIN = 1 << 20
_SIZE_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

_owner: NvshmemOwner | None = None
# NVSHMEM's init status right after lck's own finalize: a later configure may re-initialise from it,
# while any other non-zero status means someone else initialised NVSHMEM.
_status_after_finalize: int | None = None
# nvshmem4py keeps a process-wide registry of team names: never reuse one, even across re-inits.
_team_serial = 0


def _core() -> Any:
    import nvshmem.core

    return nvshmem.core


def importable() -> tuple[bool, str]:
    try:
        import cuda.core  # noqa: F401
        import nvshmem.core  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything on import
        return False, f"nvshmem4py/cuda.core not importable ({type(exc).__name__}: {exc})"
    return True, ""


def native_support(device: Any) -> tuple[bool, str]:
    """Whether this rank can run NVSHMEM on ``device`` (a ``torch.device``), and why not."""
    if os.environ.get("LCK_DISABLE_NVSHMEM", "") not in ("", "0"):
        return False, "LCK_DISABLE_NVSHMEM is set"
    if device.type != "cuda":
        return False, f"device is {device.type}, not CUDA"
    import torch

    cap = torch.cuda.get_device_capability(device)
    if cap not in NATIVE_ARCHS:
        return False, f"sm_{cap[0]}{cap[1]} is not a native target (sm_90a, sm_100a)"
    ok, why = importable()
    if not ok:
        return False, why
    return True, ""


def foreign_init_status() -> int:
    """NVSHMEM's init status when someone other than lck initialised it in this process, else 0."""
    if _owner is not None and _owner.alive:
        return 0
    ok, _ = importable()
    if not ok:
        return 0
    code = int(_core().init_status())
    return 0 if code == _status_after_finalize else code


def mps_servers(attempts: int = 8) -> list[str] | None:
    """The CUDA MPS servers the control daemon lists (``CUDA_MPS_PIPE_DIRECTORY`` as set), asked the way
    NVSHMEM asks when several PEs share a GPU: their PIDs, ``[]`` when the daemon answers with none, ``None``
    when no daemon answers. The daemon serves one query at a time and drops connections that arrive
    meanwhile (seen on H200 with eight ranks asking at once), so a failed or empty answer is asked again
    after a random pause before it counts."""
    import random
    import subprocess
    import time

    answered = False
    for attempt in range(attempts):
        try:
            got = subprocess.run(
                ["nvidia-cuda-mps-control"],
                input="get_server_list\n",
                capture_output=True,
                text=True,
                timeout=20,
            )
        except FileNotFoundError:
            return None  # no MPS on this machine
        except (OSError, subprocess.SubprocessError):
            got = None
        if got is not None and got.returncode == 0:
            answered = True
            if got.stdout.split():
                return got.stdout.split()
        if attempt + 1 < attempts:
            time.sleep(0.05 + 0.2 * random.random() * (attempt + 1))
    return [] if answered else None


def heap_needed(reserved_bytes: int, reservations: int) -> int:
    """The symmetric heap that ``reserved_bytes`` in ``reservations`` allocations need: those, a margin per
    allocation and NVSHMEM's own state."""
    return reserved_bytes + reservations * ALLOC_MARGIN + HEAP_SLACK


def heap_for(reserved_bytes: int, reservations: int) -> int:
    """The symmetric heap lck asks for when the first configure reserves ``reserved_bytes`` in
    ``reservations`` allocations: what they need (:func:`heap_needed`), at least NVSHMEM's default 1 GiB."""
    return max(_MIN_HEAP, heap_needed(reserved_bytes, reservations))


def parse_size(text: str | None) -> int | None:
    """Bytes of an ``NVSHMEM_SYMMETRIC_SIZE`` value (an optionally fractional number with an optional
    k/m/g/t suffix, powers of 1024, as NVSHMEM reads it); None when unset or not of that form."""
    if text is None:
        return None
    t = text.strip().lower()
    unit = 1
    if t and t[-1] in "kmgt":
        unit, t = _SIZE_SUFFIX[t[-1]], t[:-1]
    try:
        value = float(t)
    except ValueError:
        return None
    if not 0 < value < float("inf"):
        return None
    return math.ceil(value * unit)


def env_defaults(*, single_host: bool, heap_bytes: int) -> dict[str, str]:
    """The NVSHMEM settings lck applies where the user has not set them (``heap_bytes``: see heap_for)."""
    heap = heap_bytes
    heap = (heap + (2 << 20) - 1) // (2 << 20) * (2 << 20)  # the VMM granularity
    out = {
        # lck never uses NVLink multicast; NVLS setup also fails where the fabric manager forbids it.
        "NVSHMEM_DISABLE_NVLS": "1",
        "NVSHMEM_SYMMETRIC_SIZE": str(heap),
    }
    if single_host:
        # One machine: bootstrap over loopback and skip the IB transport probe (it can stall).
        out["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = "lo"
        out["NVSHMEM_REMOTE_TRANSPORT"] = "none"
    return out


def apply_env(defaults: dict[str, str]) -> dict[str, str]:
    """Set each default that is unset; returns what was applied. Before the first init only."""
    applied = {}
    for k, v in defaults.items():
        if k not in os.environ:
            os.environ[k] = v
            applied[k] = v
    return applied


def owner() -> NvshmemOwner | None:
    """The live owner, if lck initialised NVSHMEM in this process."""
    return _owner if _owner is not None and _owner.alive else None


class NvshmemOwner:
    """lck's handle on an initialised NVSHMEM: teams, symmetric tensors, peer views, finalize."""

    def __init__(self, n_pes: int, my_pe: int, device_index: int, applied_env: dict[str, str]):
        self.n_pes = n_pes
        self.my_pe = my_pe
        self.device_index = device_index
        self.applied_env = applied_env
        self.alive = True
        self.init_status = 0  # NVSHMEM's init status once up (2 one PE per GPU, 3/4 several, limited/full)

    # -- bring-up -------------------------------------------------------------------------------------
    @staticmethod
    def make_uid() -> bytes:
        """A fresh unique id (bootstrap rank 0 only), as bytes for the bootstrap broadcast."""
        return bytes(_core().get_unique_id()._data.tobytes())

    @classmethod
    def init(cls, uid: bytes, *, rank: int, nranks: int, device_index: int, applied_env: dict[str, str]):
        global _owner
        import numpy as np
        from cuda.core import Device

        core = _core()
        status = int(core.init_status())
        if status != 0 and status != _status_after_finalize:
            raise RuntimeError(
                f"NVSHMEM is already initialised in this process (init_status={status}) and lck did not "
                "start it; lck must own NVSHMEM (call lck_runtime.configure before anything else "
                "initialises it, e.g. torch symmetric memory with the NVSHMEM backend), or set "
                "LCK_DISABLE_NVSHMEM=1 to use the torch.distributed paths"
            )
        u = core.get_unique_id(empty=True)
        raw = np.frombuffer(uid, dtype=np.uint8)
        if raw.size != u._data.nbytes:
            raise RuntimeError(f"NVSHMEM unique id has {raw.size} bytes, expected {u._data.nbytes}")
        u._data.view(np.uint8)[:] = raw
        dev = Device(device_index)
        dev.set_current()
        core.init(device=dev, uid=u, rank=rank, nranks=nranks, initializer_method="uid")
        got = (int(core.init_status()), int(core.n_pes()), int(core.my_pe()))
        if got[0] < 2 or got[1] != nranks or got[2] != rank:
            raise RuntimeError(
                f"NVSHMEM init returned status {got[0]}, {got[1]} PEs, PE {got[2]}; expected status >= 2, "
                f"{nranks} PEs, PE {rank}"
            )
        _owner = cls(nranks, rank, device_index, applied_env)
        _owner.init_status = got[0]
        return _owner

    # -- teams ----------------------------------------------------------------------------------------
    def split_strided(self, start: int, stride: int, size: int) -> int | None:
        """Collective over all PEs: the team of PEs ``start + stride*i``; ``None`` on non-members."""
        global _team_serial
        core = _core()
        _team_serial += 1
        name = f"lck_{_team_serial}_{start}_{stride}_{size}"
        team = core.team_split_strided(
            core.Teams.TEAM_WORLD, start, stride, size, core.TeamConfig(), 0, new_team_name=name
        )
        if team is None:
            return None
        handle = int(team)
        n, me = int(core.team_n_pes(handle)), int(core.team_my_pe(handle))
        if n != size or me != (self.my_pe - start) // stride:
            raise RuntimeError(
                f"NVSHMEM team {name}: team_n_pes={n}, team_my_pe={me}; expected {size} and "
                f"{(self.my_pe - start) // stride}"
            )
        return handle

    def destroy_team(self, handle: int) -> None:
        """Collective over the team's members."""
        _core().team_destroy(int(handle))

    # -- symmetric memory -----------------------------------------------------------------------------
    def alloc(self, numel: int, dtype: Any) -> Any:
        """Collective over all PEs: a zeroed symmetric tensor of ``numel`` elements."""
        t = _core().tensor((numel,), dtype=dtype)
        t.zero_()
        return t

    def free(self, t: Any) -> None:
        """Collective over all PEs, in the same order everywhere."""
        _core().free_tensor(t)

    def peer(self, t: Any, pe: int) -> Any:
        """The NVLink view of PE ``pe``'s copy of the symmetric tensor ``t``."""
        try:
            return _core().get_peer_tensor(t, pe)
        except Exception as exc:
            raise RuntimeError(
                f"NVSHMEM PE {pe} has no load/store view of this symmetric buffer from PE {self.my_pe} "
                f"({type(exc).__name__}: {exc}); peers on other hosts are reached with puts, not views"
            ) from exc

    # -- teardown -------------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Collective over all PEs."""
        global _owner, _status_after_finalize
        self.alive = False
        _owner = None
        core = _core()
        core.finalize()
        _status_after_finalize = int(core.init_status())


def status() -> dict[str, Any]:
    """NVSHMEM as seen from this process: versions, init status, whether lck owns it."""
    info: dict[str, Any] = {}
    ok, why = importable()
    info["importable"] = ok
    if not ok:
        info["import_error"] = why
        return info
    core = _core()
    try:
        v = core.get_version()
        info["nvshmem4py_version"] = v.nvshmem4py_version
        info["libnvshmem_version"] = v.libnvshmem_version
    except Exception as exc:  # the host library may be missing even when the module imports
        info["version_error"] = f"{type(exc).__name__}: {exc}"
    try:
        code = int(core.init_status())
        info["init_status"] = code
        info["init_status_name"] = core.InitStatus(code).name
    except Exception as exc:
        info["init_status_error"] = f"{type(exc).__name__}: {exc}"
    live = owner()
    info["owned_by_lck"] = live is not None
    if live is not None:
        info["n_pes"] = live.n_pes
        info["my_pe"] = live.my_pe
        info["applied_env"] = dict(live.applied_env)
    info["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NVSHMEM_")}
    return info
