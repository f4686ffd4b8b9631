"""``configure``: the collective entry point that prepares groups, teams, reservations and contexts.

One call, on every rank of the bootstrap group, in the same order, with the same sections:

1. Each rank checks its own arguments (types, names, its memberships, its device) without raising:
   a failure travels with its report.
2. One agreement round (``agreement.agree``) gathers every rank's report, bounded by
   ``LCK_SETUP_TIMEOUT``. A local failure anywhere, or any disagreement (sections, names, runtime
   state, hardware, NVSHMEM settings), raises the same error on every rank.
3. Every rank validates the gathered memberships (uniform strided partitions), capacities (equal or
   smaller than the process-wide reservation; growth is rejected) and topology (hosts × GPUs per
   host) with the same pure functions, so these errors are identical everywhere too.
4. Only then does anything change: NVSHMEM bring-up on the first call (when usable), team splits,
   symmetric reservations in bootstrap-wide order, name registration, contexts.

When NVSHMEM cannot run (no CUDA device, an architecture other than sm_90/sm_100, nvshmem4py
missing, or ``LCK_DISABLE_NVSHMEM=1``) the same steps run over torch.distributed, ``configure`` warns
once per process and returns False.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lck_runtime import nvshmem as nv
from lck_runtime.agreement import Domain, agree, exchange, summarize_errors
from lck_runtime.config import FusedLinearCrossEntropyConfig, MoEConfig
from lck_runtime.contexts import FlsceContext, MoEContext
from lck_runtime.groups import GroupEntry, Partition, check_partition, membership
from lck_runtime.state import STATE, RuntimeState
from lck_runtime.symmetric import SIGNAL_WORDS_PER_PEER, moe_workspace_bytes, scratch_numel

__all__ = ["configure", "domain_of", "is_native", "resolve_device"]

_warned = False


def is_native() -> bool:
    """True once lck has brought NVSHMEM up in this process (and not finalized it)."""
    return STATE.native and nv.owner() is not None


def domain_of(bootstrap_group: Any, what: str) -> Domain:
    """The bootstrap domain: ``bootstrap_group``; when None, the configured domain, else WORLD.

    Local: raises before any agreement (without a domain there is nobody to agree with).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what}: torch.distributed is not initialised; call torch.distributed.init_process_group "
            "first (lck setup calls are collective over the bootstrap group)"
        )
    if bootstrap_group is None and STATE.domain is not None:
        return STATE.domain
    group = dist.group.WORLD if bootstrap_group is None else bootstrap_group
    ranks = membership(group, f"{what}: bootstrap_group")
    if STATE.domain is not None and STATE.domain.ranks == ranks:
        return STATE.domain
    return Domain(group=group, ranks=ranks, local_rank=ranks.index(dist.get_rank()))


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
class _Request:
    """One rank's view of a configure call, before agreement."""

    device: Any = None
    names: dict[str, Any] = field(default_factory=dict)  # name → ProcessGroup
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name → global ranks
    flsce: FusedLinearCrossEntropyConfig | None = None
    moe: MoEConfig | None = None
    native: bool = False
    native_reason: str = ""


def _local_request(
    st: RuntimeState,
    domain: Domain,
    process_groups: Any,
    device: Any,
    flsce: Any,
    moe: Any,
) -> tuple[_Request, dict[str, Any], dict[str, Any]]:
    """Validate this rank's arguments; returns the request, the plan to agree on and per-rank facts."""
    import torch

    req = _Request()
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
    }
    facts = {
        "ranks": {name: tuple(domain.ranks.index(r) for r in ranks) for name, ranks in req.ranks.items()},
        "host": socket.gethostname(),
        "device index": index,
        "why not native": req.native_reason,
    }
    return req, plan, facts


def _env(key: str) -> str | None:
    import os

    return os.environ.get(key)


@dataclass
class _Setup:
    """What the agreed request changes, computed identically on every rank."""

    partitions: dict[str, Partition] = field(default_factory=dict)  # new names → partition
    flsce_partition: Partition | None = None
    moe_partition: Partition | None = None
    moe_gpus_per_host: int = 0
    new_flsce: bool = False
    new_moe: bool = False
    hosts: list[str] = field(default_factory=list)


def _plan_setup(st: RuntimeState, domain: Domain, req: _Request, facts: list[dict[str, Any]]) -> _Setup:
    """Validate the gathered reports; raises the same error on every rank (pure function of agreed data)."""
    n = domain.size
    setup = _Setup(hosts=[f["host"] for f in facts])
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
    if req.native and not st.configured:
        seen: dict[tuple[str, int], int] = {}
        for r, f in enumerate(facts):
            if f["device index"] is None:  # not a CUDA device: nothing to share
                continue
            key = (f["host"], f["device index"])
            if key in seen:
                raise ValueError(
                    f"configure: bootstrap ranks {seen[key]} and {r} both use cuda:{key[1]} on host {key[0]}; "
                    "NVSHMEM needs one GPU per process"
                )
            seen[key] = r
    return setup


def _heap_bytes(req: _Request, setup: _Setup) -> int:
    total = 0
    if req.flsce is not None:
        total += scratch_numel(req.flsce.capacity) * 4
    if req.moe is not None and setup.moe_partition is not None:
        size = setup.moe_partition.size
        total += moe_workspace_bytes(req.moe, size) + SIGNAL_WORDS_PER_PEER * size * 8
    return total


def _bring_up(st: RuntimeState, domain: Domain, req: _Request, setup: _Setup) -> None:
    """NVSHMEM init over the bootstrap group (collective); every rank learns whether all succeeded."""
    applied = nv.apply_env(
        nv.env_defaults(single_host=len(set(setup.hosts)) == 1, heap_bytes=_heap_bytes(req, setup))
    )
    uid, error = None, None
    if domain.local_rank == 0:
        try:
            uid = nv.NvshmemOwner.make_uid()
        except Exception as exc:
            error = exc
    got = exchange(domain, "configure (NVSHMEM unique id)", (uid, None if error is None else repr(error)))
    uid, err0 = got[0]
    if err0 is not None:
        raise RuntimeError(f"configure: bootstrap rank 0 could not create an NVSHMEM unique id: {err0}")
    error = None
    try:
        st.nvshmem = nv.NvshmemOwner.init(
            uid,
            rank=domain.local_rank,
            nranks=domain.size,
            device_index=req.device.index,
            applied_env=applied,
        )
    except Exception as exc:
        error = exc
    got = exchange(
        domain, "configure (NVSHMEM init)", None if error is None else (type(error).__name__, str(error))
    )
    if any(g is not None for g in got):
        kind, message = summarize_errors(got)
        raise RuntimeError(f"configure: NVSHMEM init failed: {kind}: {message}")


def configure(
    *,
    process_groups: Mapping[str, Any] | None = None,
    bootstrap_group: Any = None,
    device: Any = None,
    flsce: FusedLinearCrossEntropyConfig | None = None,
    moe: MoEConfig | None = None,
) -> bool:
    """Prepare lck's runtime for the given groups and sections. Collective over ``bootstrap_group``.

    - ``process_groups``: name → ProcessGroup (Megatron: ``{"tp": pgc.tp, "ep": pgc.ep}``); each name
      is a uniform strided partition of the bootstrap group. Additive across calls; an existing name
      keeps its ordered membership.
    - ``bootstrap_group``: the NVSHMEM world (default: WORLD on the first call, then the configured
      bootstrap group).
    - ``device``: this process's CUDA device (default: the current one; CPU when CUDA is absent).
    - ``flsce`` / ``moe``: sections whose ``group`` names a registered group (``None``: the bootstrap
      group). Equal or smaller repeats reuse reservations; growth is rejected before any change.

    Returns True when NVSHMEM serves the contexts, False (with one warning per process) when the
    torch.distributed paths do. Every rank raises the same error on any invalid or inconsistent call;
    a rank that does not call makes the others fail after ``LCK_SETUP_TIMEOUT`` seconds.
    """
    global _warned
    st = STATE
    domain = domain_of(bootstrap_group, "configure")
    error: BaseException | None = None
    req, plan, facts = _Request(), {}, None
    try:
        req, plan, facts = _local_request(st, domain, process_groups, device, flsce, moe)
    except Exception as exc:  # travels with the report: every rank raises it
        error = exc
    gathered = agree(domain, "configure", error=error, plan=plan, facts=facts)
    setup = _plan_setup(st, domain, req, gathered)

    # Nothing has changed so far; from here on every rank performs the same collective steps.
    if not st.configured:
        st.domain, st.device = domain, req.device
        st.native, st.native_reason = req.native, req.native_reason
        if req.native:
            try:
                _bring_up(st, domain, req, setup)
            except BaseException:
                st.reset()
                raise
        else:
            reasons = sorted({f["why not native"] for f in gathered})
            st.native_reason = "; ".join(reasons)
    nvs = st.nvshmem if st.native else None
    for name, part in setup.partitions.items():
        if name not in st.registry.entries:
            st.registry.add(
                GroupEntry(name=name, group=req.names[name], ranks=req.ranks[name], partition=part)
            )
        else:
            st.registry.alias(req.names[name], req.ranks[name])
    allocated = False
    if req.flsce is not None and setup.flsce_partition is not None:
        part = setup.flsce_partition
        team = st.teams.ensure(part, domain.ranks, domain.local_rank, nvs)
        if setup.new_flsce:
            if st.flsce_reserved is None:
                st.flsce_reserved = req.flsce
            allocated |= st.pool.scratch is None
            scratch = st.pool.ensure_scratch(st.flsce_reserved.capacity, nvs)
            st.flsce[part.key] = FlsceContext(
                scratch=scratch,
                group=_group_for(st, req, req.flsce.group),
                team=team,
                config=req.flsce,
                device=st.device,
                native=st.native,
                label=_label(req.flsce.group),
            )
    if req.moe is not None and setup.moe_partition is not None:
        part = setup.moe_partition
        team = st.teams.ensure(part, domain.ranks, domain.local_rank, nvs)
        if setup.new_moe:
            if st.moe_reserved is None:
                st.moe_reserved = req.moe
            tag = f"moe[{part.size}x{part.stride}]"
            workspace = st.pool.reserve(
                f"{tag}.workspace", moe_workspace_bytes(req.moe, part.size), "uint8", nvs
            )
            signals = st.pool.reserve(f"{tag}.signals", SIGNAL_WORDS_PER_PEER * part.size, "int64", nvs)
            allocated = True
            st.moe[part.key] = MoEContext(
                gpus_per_host=setup.moe_gpus_per_host,
                workspace=workspace,
                signals=signals,
                group=_group_for(st, req, req.moe.group),
                team=team,
                config=req.moe,
                device=st.device,
                native=st.native,
                label=_label(req.moe.group),
            )
    if nvs is not None and allocated:
        # Peers write signals into this rank's fresh (zeroed) buffers as soon as they start: nobody
        # leaves configure before every rank's zeroing has finished.
        if st.device.type == "cuda":
            import torch

            torch.cuda.synchronize(st.device)
        exchange(domain, "configure (reservations ready)", None)
    if not st.native and not _warned:
        _warned = True
        warnings.warn(
            f"lck_runtime.configure: NVSHMEM is not used ({st.native_reason}); lck runs its "
            "torch.distributed paths",
            RuntimeWarning,
            stacklevel=2,
        )
    return st.native


def _label(name: str | None) -> str:
    return "<bootstrap>" if name is None else repr(name)


def _group_for(st: RuntimeState, req: _Request, name: str | None) -> Any:
    if name is None:
        return st.domain.group
    if name in req.names:
        return req.names[name]
    return st.registry.entries[name].group
