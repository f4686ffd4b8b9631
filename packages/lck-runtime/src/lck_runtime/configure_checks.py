"""The checking half of :func:`lck_runtime.configure`: steps 1 and 3 of its protocol.

:func:`local_request` checks one rank's arguments (types, names, its memberships, its device) and
returns its :class:`Request` with the plan every rank must agree on and the facts it reports;
:func:`plan_setup` validates the gathered reports (partitions, capacities, topology) into the
:class:`Setup` that ``configure`` then applies. Both only read the runtime state: a failure here
changes nothing. ``plan_setup`` is a pure function of agreed data, so it raises the same error on
every rank.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lck_runtime import nvshmem as nv
from lck_runtime import p2p
from lck_runtime.agreement import Domain
from lck_runtime.config import FusedLinearCrossEntropyConfig, MoEConfig
from lck_runtime.groups import Partition, check_partition, membership
from lck_runtime.state import RuntimeState
from lck_runtime.symmetric import (
    SCRATCH_LABEL,
    SIGNAL_WORDS_PER_PEER,
    Reservation,
    moe_workspace_bytes,
    scratch_numel,
)

__all__ = [
    "Request",
    "Setup",
    "check_heap",
    "flsce_tag",
    "local_request",
    "moe_tag",
    "one_host_per_group",
    "plan_setup",
    "planned_reservations",
    "resolve_device",
]


def resolve_device(device: Any) -> Any:
    """A ``torch.device`` with an index for CUDA; validates that it is this process's current device."""
    import torch

    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(
            f"configure: device must be None, an int, a str or a torch.device, got {type(device).__name__}"
        )
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"configure: device={device!r} is not a device ({exc})") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"configure: device must be cpu or cuda, got {dev}")
    if not torch.cuda.is_available():
        raise ValueError(f"configure: device={dev} but CUDA is not available in this process")
    current = torch.cuda.current_device()
    index = current if dev.index is None else dev.index
    if index != current:
        raise ValueError(
            f"configure: device={dev} but this process's current CUDA device is cuda:{current}; "
            f"call torch.cuda.set_device({index}) first (one GPU per process)"
        )
    return torch.device("cuda", index)


@dataclass
class Request:
    """One rank's view of a configure call, before agreement."""

    device: Any = None
    names: dict[str, Any] = field(default_factory=dict)  # name → ProcessGroup
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name → global ranks
    flsce: FusedLinearCrossEntropyConfig | None = None
    moe: MoEConfig | None = None
    native: bool = False
    native_reason: str = ""
    shared_gpus: str | None = None  # LCK_NVSHMEM_SHARED_GPUS as this rank read it (agreed in the plan)


def local_request(
    st: RuntimeState,
    domain: Domain,
    process_groups: Any,
    device: Any,
    flsce: Any,
    moe: Any,
) -> tuple[Request, dict[str, Any], dict[str, Any]]:
    """Validate this rank's arguments; returns the request, the plan to agree on and per-rank facts."""
    import torch

    req = Request()
    if st.domain is not None and st.domain.ranks != domain.ranks:
        raise ValueError(
            f"configure: bootstrap_group has ranks {domain.ranks} but lck_runtime is configured over "
            f"{st.domain.ranks}; call lck_runtime.finalize() before changing the bootstrap group"
        )
    req.device = resolve_device(device)
    if st.device is not None and req.device != st.device:
        raise ValueError(f"configure: device={req.device} but lck_runtime is configured on {st.device}")
    if process_groups is None:
        process_groups = {}
    if not isinstance(process_groups, Mapping):
        raise TypeError(
            "configure: process_groups must be a mapping name → ProcessGroup (e.g. {'tp': pgc.tp, "
            f"'ep': pgc.ep}}), got {type(process_groups).__name__}"
        )
    for name, pg in process_groups.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"configure: process_groups keys must be non-empty str names, got {name!r}")
        what = f"configure: process_groups[{name!r}]"
        ranks = membership(pg, what)
        outside = [r for r in ranks if r not in domain.ranks]
        if outside:
            raise ValueError(
                f"{what} has ranks {ranks}; ranks {outside} are outside the bootstrap group {domain.ranks}"
            )
        old = st.registry.entries.get(name)
        if old is not None and old.ranks != ranks:
            raise ValueError(
                f"{what} has ranks {ranks} but {name!r} is registered with ranks {old.ranks}; "
                "an existing name keeps its ordered membership"
            )
        req.names[name] = pg
        req.ranks[name] = ranks
    known = set(req.names) | set(st.registry.entries)
    for section, cfg, cls in (("flsce", flsce, FusedLinearCrossEntropyConfig), ("moe", moe, MoEConfig)):
        if cfg is None:
            continue
        if not isinstance(cfg, cls):
            raise TypeError(
                f"configure: {section} must be a {cls.__name__} or None, got {type(cfg).__name__}"
            )
        if cfg.group is not None and cfg.group not in known:
            raise ValueError(
                f"configure: {section}.group={cfg.group!r} is not a registered group name; pass it in "
                f"process_groups (known names: {sorted(known)}); None selects the bootstrap group"
            )
    req.flsce, req.moe = flsce, moe
    if st.configured:
        req.native, req.native_reason = st.native, st.native_reason
    else:
        req.native, req.native_reason = nv.native_support(req.device)
        if req.native:
            req.shared_gpus = _env(SHARED_GPUS_ENV)
            status = nv.foreign_init_status()
            if status:
                raise RuntimeError(
                    f"configure: NVSHMEM is already initialised in this process (init_status={status}) and "
                    "lck did not start it; lck must own NVSHMEM: call lck_runtime.configure before anything "
                    "else initialises it (e.g. torch symmetric memory with the NVSHMEM backend), or set "
                    "LCK_DISABLE_NVSHMEM=1 to use the torch.distributed paths"
                )
    hardware = None
    index = None
    if req.device.type == "cuda":
        p = torch.cuda.get_device_properties(req.device)
        hardware = (p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count)
        index = req.device.index
    plan = {
        "bootstrap ranks": domain.ranks,
        "runtime state": st.digest(),
        "process_groups names": sorted(req.names),
        "flsce": None if flsce is None else flsce.fields(),
        "moe": None if moe is None else moe.fields(),
        "device type": req.device.type,
        "GPU (name, arch, SMs)": hardware,
        "NVSHMEM usable": req.native,
        "NVSHMEM settings": {k: _env(k) for k in nv.AGREED_ENV} if req.native and not st.configured else None,
        SHARED_GPUS_ENV: req.shared_gpus,
    }
    facts = {
        "ranks": {name: tuple(domain.ranks.index(r) for r in ranks) for name, ranks in req.ranks.items()},
        "host": socket.gethostname(),
        "device index": index,
        "why not native": req.native_reason,
        "MPS": _mps_state(req.device) if req.shared_gpus == "1" and index is not None else None,
    }
    return req, plan, facts


# Opt-in to several bootstrap ranks per GPU (NVSHMEM's multiple-PEs-per-GPU mode), for running 4- and
# 8-PE layouts on a machine with fewer GPUs. NVSHMEM creates teams there only under a CUDA MPS server
# (configure checks for one before NVSHMEM starts); the processes of a GPU split it: for tests only.
SHARED_GPUS_ENV = "LCK_NVSHMEM_SHARED_GPUS"


def _env(key: str) -> str | None:
    import os

    return os.environ.get(key)


@dataclass
class Setup:
    """What the agreed request changes, computed identically on every rank."""

    partitions: dict[str, Partition] = field(default_factory=dict)  # new names → partition
    flsce_partition: Partition | None = None
    moe_partition: Partition | None = None
    moe_gpus_per_host: int = 0
    shared_gpus: bool = False  # several bootstrap ranks may share a GPU (LCK_NVSHMEM_SHARED_GPUS=1)
    new_flsce: bool = False
    new_moe: bool = False
    hosts: list[str] = field(default_factory=list)


def plan_setup(st: RuntimeState, domain: Domain, req: Request, facts: list[dict[str, Any]]) -> Setup:
    """Validate the gathered reports; raises the same error on every rank (pure function of agreed data)."""
    n = domain.size
    setup = Setup(hosts=[f["host"] for f in facts])
    for name in sorted(req.names):
        reports = [f["ranks"][name] for f in facts]
        part = check_partition(f"configure: process_groups[{name!r}]", reports, n)
        old = st.registry.entries.get(name)
        if old is not None and old.partition != part:  # unreachable after the local membership check
            raise ValueError(
                f"configure: process_groups[{name!r}] changes the registered partition of {name!r}"
            )
        setup.partitions[name] = part

    def partition_of(group: str | None) -> Partition:
        if group is None:
            return st.bootstrap_partition() if st.domain is not None else Partition(n, 1, (tuple(range(n)),))
        if group in setup.partitions:
            return setup.partitions[group]
        return st.registry.entries[group].partition

    if req.flsce is not None:
        cfg = req.flsce
        part = partition_of(cfg.group)
        setup.flsce_partition = part
        reserved = st.flsce_reserved
        if reserved is not None:
            for f in ("max_tokens", "hidden_size", "local_vocab_size"):
                if getattr(cfg, f) > getattr(reserved, f):
                    raise ValueError(
                        f"configure: flsce.{f}={getattr(cfg, f)} exceeds the process-wide FLSCE capacity "
                        f"{f}={getattr(reserved, f)} reserved by an earlier configure; live capacities cannot "
                        "grow: reserve the maximum up front, or clear_pool() first (nothing was changed)"
                    )
        setup.new_flsce = part.key not in st.flsce
    if req.moe is not None:
        cfg = req.moe
        part = partition_of(cfg.group)
        setup.moe_partition = part
        size = part.size
        if cfg.num_experts % size:
            raise ValueError(
                f"configure: moe.num_experts={cfg.num_experts} is not divisible by the EP group size {size}"
            )
        gph = cfg.gpus_per_host if cfg.gpus_per_host is not None else size // cfg.num_hosts
        if cfg.num_hosts * gph != size:
            raise ValueError(
                f"configure: moe.num_hosts={cfg.num_hosts} × gpus_per_host={cfg.gpus_per_host if cfg.gpus_per_host is not None else gph} "
                f"!= EP group size {size}; the group's members split into num_hosts blocks of gpus_per_host"
            )
        for g in part.groups:
            for h in range(cfg.num_hosts):
                block = g[h * gph : (h + 1) * gph]
                machines = sorted({setup.hosts[r] for r in block})
                if len(machines) > 1:
                    raise ValueError(
                        f"configure: moe host {h} of EP group {g} (bootstrap ranks {block}) spans machines "
                        f"{machines}; a (virtual) host must sit on one machine: check num_hosts/gpus_per_host"
                    )
        reserved = st.moe_reserved
        if reserved is not None:
            for f in ("max_tokens", "hidden_size", "num_experts", "top_k", "max_inflight"):
                if getattr(cfg, f) > getattr(reserved, f):
                    raise ValueError(
                        f"configure: moe.{f}={getattr(cfg, f)} exceeds the process-wide MoE capacity "
                        f"{f}={getattr(reserved, f)} reserved by an earlier configure; live capacities cannot "
                        "grow: reserve the maximum up front, or clear_pool() first (nothing was changed)"
                    )
        old = st.moe.get(part.key)
        if old is not None:
            old_cfg = old._config
            if (old_cfg.num_hosts, old._gpus_per_host) != (cfg.num_hosts, gph):
                raise ValueError(
                    f"configure: the MoE context of this EP partition was configured with num_hosts="
                    f"{old_cfg.num_hosts}, gpus_per_host={old._gpus_per_host}; got num_hosts={cfg.num_hosts}, "
                    f"gpus_per_host={gph}: a context's topology cannot change"
                )
            if cfg.max_inflight > old_cfg.max_inflight:
                raise ValueError(
                    f"configure: moe.max_inflight={cfg.max_inflight} exceeds max_inflight={old_cfg.max_inflight} "
                    "of the existing MoE context of this EP partition; live capacities cannot grow (nothing was changed)"
                )
        setup.new_moe = old is None
        setup.moe_gpus_per_host = gph
    setup.shared_gpus = req.native and not st.configured and _shared_gpus_allowed(req.shared_gpus)
    if req.native and not st.configured:
        _check_gpu_sharing(facts, setup.shared_gpus)
    return setup


def _check_gpu_sharing(facts: list[dict[str, Any]], allowed: bool) -> None:
    """One process per GPU, unless sharing is allowed and NVSHMEM can run it: an MPS server on every shared
    GPU with its processes' active thread percentages summing to at most 100 (NVSHMEM's own condition for
    its full multiple-PEs-per-GPU mode; in the limited one it exits the process at team creation)."""
    by_gpu: dict[tuple[str, int], list[int]] = {}
    for r, f in enumerate(facts):
        if f["device index"] is not None:  # not a CUDA device: nothing to share
            by_gpu.setdefault((f["host"], f["device index"]), []).append(r)
    for (host, index), ranks in by_gpu.items():
        if len(ranks) < 2:
            continue
        where = f"bootstrap ranks {ranks} share cuda:{index} on host {host}"
        if not allowed:
            raise ValueError(
                f"configure: {where}; NVSHMEM needs one GPU per process (for tests, {SHARED_GPUS_ENV}=1 on "
                "every rank runs several PEs per GPU under a CUDA MPS server)"
            )
        mps = [facts[r]["MPS"] for r in ranks]
        without = [r for r, m in zip(ranks, mps) if not m["server"]]
        if without:
            raise ValueError(
                f"configure: {where} but ranks {without} see no CUDA MPS server: NVSHMEM cannot create teams "
                "across PEs of one GPU without one; start it (nvidia-cuda-mps-control -d) before the processes "
                "use CUDA, or run one process per GPU"
            )
        shares = [
            100.0 if m["active thread percentage"] is None else m["active thread percentage"] for m in mps
        ]
        if sum(shares) > 100 and not all(m["ignore percentage"] for m in mps):
            raise ValueError(
                f"configure: {where} with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE {shares} (unset counts as 100), "
                "summing to more than 100: NVSHMEM's kernels need every PE of a GPU resident at once; set "
                f"it to at most {100 // len(ranks)} in each process"
            )


def _mps_state(device: Any) -> dict[str, Any]:
    """Whether this process sees a CUDA MPS server (asked the way NVSHMEM asks: the control daemon's server
    list, after this process has a context on ``device``, which starts its server), and its share."""
    import os

    import torch

    torch.cuda.synchronize(device)  # creates the context: MPS starts a server for its first client
    server = bool(nv.mps_servers())
    pct = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    try:
        share = None if pct is None else float(pct)
    except ValueError:
        share = None
    ignore = os.environ.get("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "") not in ("", "0")
    return {"server": server, "active thread percentage": share, "ignore percentage": ignore}


def _shared_gpus_allowed(value: str | None) -> bool:
    """The agreed ``LCK_NVSHMEM_SHARED_GPUS`` as a flag; any other value than unset/""/"0"/"1" is refused
    (after the agreement, so every rank raises the same error)."""
    if value in (None, "", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"configure: {SHARED_GPUS_ENV}={value!r}: expected 0 or 1")


def one_host_per_group(setup: Setup, part: Partition) -> bool:
    """Every group of ``part`` sits on one machine (its members can map each other's memory)."""
    return all(len({setup.hosts[r] for r in g}) == 1 for g in part.groups)


def planned_reservations(st: RuntimeState, req: Request, setup: Setup) -> list[Reservation]:
    """The symmetric reservations this configure call makes, in the order it makes them (not yet allocated).

    A pure function of agreed data, so it is the same list on every rank; ``configure`` checks it against
    the heap and then allocates exactly these entries, so the sizes are computed here only."""
    out: list[Reservation] = []
    if req.flsce is not None and setup.flsce_partition is not None and setup.new_flsce:
        part = setup.flsce_partition
        capacity = (st.flsce_reserved or req.flsce).capacity
        if st.pool.scratch is None:
            out.append(Reservation(SCRATCH_LABEL, scratch_numel(capacity), "float32"))
        if req.native and part.size > 1 and one_host_per_group(setup, part):
            tag, slot = flsce_tag(part), p2p.slot_floats(part.size, capacity)
            out += [
                Reservation(f"{tag}.p2p", p2p.recv_numel(part.size, slot), "float32"),
                Reservation(f"{tag}.p2p_flags", p2p.flags_numel(part.size), "int64"),
                Reservation(f"{tag}.p2p_ll", p2p.ll_numel(part.size), "int64"),
            ]
    if req.moe is not None and setup.moe_partition is not None and setup.new_moe:
        part = setup.moe_partition
        tag = moe_tag(part)
        out += [
            Reservation(f"{tag}.workspace", moe_workspace_bytes(req.moe, part.size), "uint8"),
            Reservation(f"{tag}.signals", SIGNAL_WORDS_PER_PEER * part.size, "int64"),
        ]
    return out


def flsce_tag(part: Partition) -> str:
    """Label prefix of an FLSCE partition's reservations."""
    return f"flsce[{part.size}x{part.stride}]"


def moe_tag(part: Partition) -> str:
    """Label prefix of an MoE partition's reservations."""
    return f"moe[{part.size}x{part.stride}]"


def check_heap(st: RuntimeState, planned: list[Reservation], heap_bytes: int | None) -> None:
    """Refuse, before anything changes, reservations that would not fit NVSHMEM's symmetric heap.

    NVSHMEM fixes its heap at init (the first configure), so later sections must fit what is left. A pure
    function of agreed data (the heap size is an agreed NVSHMEM setting, the pool's plan part of the agreed
    runtime state): every rank raises the same error. ``heap_bytes`` None: unknown, nothing to check."""
    need = sum(r.nbytes for r in planned)
    if heap_bytes is None or not need:
        return
    used = st.pool.nbytes
    total = nv.heap_needed(used + need, len(st.pool.reservations) + len(planned))
    if total <= heap_bytes:
        return
    mib = 1 << 20
    items = ", ".join(f"{r.label} {r.nbytes / mib:.1f} MiB" for r in planned)
    when = (
        "NVSHMEM_SYMMETRIC_SIZE is set"
        if not st.configured
        else "NVSHMEM's heap was sized by the first configure"
    )
    raise ValueError(
        f"configure: the symmetric reservations do not fit NVSHMEM's heap of {heap_bytes / mib:.0f} MiB "
        f"({when}): this call needs {need / mib:.1f} MiB ({items}) on top of {used / mib:.1f} MiB already "
        f"reserved, plus {nv.HEAP_SLACK / mib:.0f} MiB for NVSHMEM's own state and "
        f"{nv.ALLOC_MARGIN / mib:.0f} MiB per reservation; a heap of at least {total / mib:.0f} MiB is "
        "needed. Reserve the largest sections in the first configure, or set NVSHMEM_SYMMETRIC_SIZE on "
        "every rank before it (nothing was changed)"
    )
