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

Steps 1 and 3 (the checks) live in :mod:`lck_runtime.configure_checks`; this module runs the protocol
and step 4.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from lck_runtime import nvshmem as nv
from lck_runtime import p2p
from lck_runtime.agreement import Domain, agree, exchange, summarize_errors
from lck_runtime.config import FusedLinearCrossEntropyConfig, MoEConfig
from lck_runtime.configure_checks import (
    Request,
    Setup,
    check_heap,
    flsce_tag,
    local_request,
    moe_tag,
    one_host_per_group,
    plan_setup,
    planned_reservations,
    resolve_device,
)
from lck_runtime.contexts import FlsceContext, MoEContext
from lck_runtime.groups import GroupEntry, Partition, membership
from lck_runtime.state import STATE, RuntimeState

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


def _bring_up(st: RuntimeState, domain: Domain, req: Request, setup: Setup, heap_bytes: int) -> None:
    """NVSHMEM init over the bootstrap group (collective); every rank learns whether all succeeded."""
    applied = nv.apply_env(nv.env_defaults(single_host=len(set(setup.hosts)) == 1, heap_bytes=heap_bytes))
    st.heap_bytes = nv.parse_size(os.environ.get("NVSHMEM_SYMMETRIC_SIZE"))
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
    if setup.shared_gpus:
        # A safety net behind the MPS checks of plan_setup: in its limited mode NVSHMEM exits the process at
        # the first team split, and on two H200s its finalize there crashed two of four processes as well,
        # so stop before any team and leave it up.
        modes = exchange(domain, "configure (NVSHMEM mode)", st.nvshmem.init_status)
        limited = [r for r, m in enumerate(modes) if m == nv.STATUS_LIMITED_MPG]
        if limited:
            raise RuntimeError(
                f"configure: NVSHMEM came up in its limited several-PEs-per-GPU mode on bootstrap ranks {limited} "
                "(no usable CUDA MPS server), where it cannot create teams; NVSHMEM stays initialised but "
                "unusable in these processes: restart them under an MPS server or with one process per GPU"
            )


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
    req, plan, facts = Request(), {}, None
    try:
        req, plan, facts = local_request(st, domain, process_groups, device, flsce, moe)
    except Exception as exc:  # travels with the report: every rank raises it
        error = exc
    gathered = agree(domain, "configure", error=error, plan=plan, facts=facts)
    setup = plan_setup(st, domain, req, gathered)
    planned = planned_reservations(st, req, setup)
    # What lck asks NVSHMEM for on the first call, unless the user set (and every rank agreed on) a size.
    default_heap = nv.heap_for(sum(r.nbytes for r in planned), len(planned))
    if req.native:
        user = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
        first = default_heap if user is None else nv.parse_size(user)
        check_heap(st, planned, st.heap_bytes if st.configured else first)

    # Nothing has changed so far; from here on every rank performs the same collective steps.
    if not st.configured:
        st.domain, st.device = domain, req.device
        st.native, st.native_reason = req.native, req.native_reason
        if req.native:
            try:
                _bring_up(st, domain, req, setup, default_heap)
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
    # The reservations come from the plan the heap was checked against: sizes are computed there only.
    plan = {r.label: r for r in planned}
    allocated = bool(planned)
    if req.flsce is not None and setup.flsce_partition is not None:
        part = setup.flsce_partition
        team = st.teams.ensure(part, domain.ranks, domain.local_rank, nvs)
        if setup.new_flsce:
            st.flsce[part.key] = _new_flsce_context(st, req, part, team, plan, nvs)
    if req.moe is not None and setup.moe_partition is not None:
        part = setup.moe_partition
        team = st.teams.ensure(part, domain.ranks, domain.local_rank, nvs)
        if setup.new_moe:
            st.moe[part.key] = _new_moe_context(st, req, setup, part, team, plan, nvs)
    if nvs is not None and allocated:
        # Peers write signals into this rank's fresh (zeroed) buffers as soon as they start: nobody
        # leaves configure before every rank's zeroing has finished.
        if st.device.type == "cuda":
            import torch

            torch.cuda.synchronize(st.device)
        fresh, failed = _attach_p2p(st, nvs, domain.local_rank)
        reports = exchange(domain, "configure (reservations ready)", failed)
        if any(reports):
            # Every rank drops this call's one-shot all-reduces alike, for good (a rebuilt one would restart
            # its epochs over flags that hold later ones); their NVSHMEM reduction path stays.
            for ctx in fresh:
                ctx._p2p, ctx._p2p_off = None, True
            warnings.warn(
                "lck_runtime.configure: the NVLink one-shot all-reduce is off (a rank could not set it up: "
                f"{next(r for r in reports if r)}); FLSCE contexts use NVSHMEM's team reduction",
                RuntimeWarning,
                stacklevel=2,
            )
    if not st.native and not _warned:
        _warned = True
        warnings.warn(
            f"lck_runtime.configure: NVSHMEM is not used ({st.native_reason}); lck runs its "
            "torch.distributed paths",
            RuntimeWarning,
            stacklevel=2,
        )
    return st.native


def _attach_p2p(st: RuntimeState, nvs: Any, local_rank: int) -> tuple[list[Any], str | None]:
    """Build the one-shot all-reduce of every FLSCE context whose buffers this call reserved.

    Returns those contexts (the same ones on every rank: configure creates contexts uniformly) and the
    error text if this rank could not build one (no peer view, or its kernels did not build or load), else
    None.
    """
    fresh = [c for c in st.flsce.values() if c._p2p_buffers is not None and c._p2p is None and not c._p2p_off]
    for ctx in fresh:
        *buffers, slot = ctx._p2p_buffers  # receive area, flags, low-latency area
        team = ctx._team
        try:
            ptrs = [
                [
                    t.tensor.data_ptr() if pe == local_rank else nvs.peer(t.tensor, pe).data_ptr()
                    for pe in team.local
                ]
                for t in buffers
            ]
            tensors = [t.tensor for t in buffers]
            ctx._p2p = p2p.P2PAllReduce(*tensors, *ptrs, team.local.index(local_rank), slot)
        except Exception as exc:
            return fresh, f"bootstrap rank {local_rank}: {type(exc).__name__}: {exc}"
    return fresh, None


def _new_flsce_context(
    st: RuntimeState, req: Request, part: Partition, team: Any, plan: dict[str, Any], nvs: Any
) -> FlsceContext:
    """The context of a new FLSCE partition: the shared scratch (sized by the first reservation) and, where
    planned, its one-shot p2p buffers."""
    if st.flsce_reserved is None:
        st.flsce_reserved = req.flsce
    scratch = st.pool.ensure_scratch(st.flsce_reserved.capacity, nvs)
    p2p_buffers = None
    tag = flsce_tag(part)
    if f"{tag}.p2p" in plan:
        p2p_buffers = (
            st.pool.allocate(plan[f"{tag}.p2p"], nvs),
            st.pool.allocate(plan[f"{tag}.p2p_flags"], nvs),
            st.pool.allocate(plan[f"{tag}.p2p_ll"], nvs),
            p2p.slot_floats(part.size, st.flsce_reserved.capacity),
        )
    return FlsceContext(scratch=scratch, p2p_buffers=p2p_buffers, **_context_fields(st, req, req.flsce, team))


def _new_moe_context(
    st: RuntimeState, req: Request, setup: Setup, part: Partition, team: Any, plan: dict[str, Any], nvs: Any
) -> MoEContext:
    """The context of a new MoE partition: its own workspace and signal words."""
    if st.moe_reserved is None:
        st.moe_reserved = req.moe
    tag = moe_tag(part)
    return MoEContext(
        gpus_per_host=setup.moe_gpus_per_host,
        one_machine=one_host_per_group(setup, part),
        workspace=st.pool.allocate(plan[f"{tag}.workspace"], nvs),
        signals=st.pool.allocate(plan[f"{tag}.signals"], nvs),
        **_context_fields(st, req, req.moe, team),
    )


def _context_fields(
    st: RuntimeState, req: Request, config: FusedLinearCrossEntropyConfig | MoEConfig, team: Any
) -> dict[str, Any]:
    """What every context records besides its own buffers."""
    return dict(
        group=_group_for(st, req, config.group),
        team=team,
        config=config,
        device=st.device,
        native=st.native,
        label=_label(config.group),
    )


def _label(name: str | None) -> str:
    return "<bootstrap>" if name is None else repr(name)


def _group_for(st: RuntimeState, req: Request, name: str | None) -> Any:
    if name is None:
        return st.domain.group
    if name in req.names:
        return req.names[name]
    return st.registry.entries[name].group
