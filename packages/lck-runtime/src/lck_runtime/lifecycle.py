"""Lifecycle: destroy a partition's team, clear the symmetric pool, finalize. All collective.

Each call agrees first (same call, same runtime state on every bootstrap rank, no retained forwards
where they would dangle), then synchronises the device so no queued kernel still uses what goes
away, then frees and destroys in the same order on every rank, and invalidates the contexts (and
with them every Python alias) that depended on it.

- ``destroy_team(group)``: the team of ``group``'s partition; rejected while any rank's MoE context
  of that partition holds retained forwards. Frees that partition's MoE reservations; the names stay
  registered, so a later ``configure`` section on them splits a fresh team.
- ``clear_pool()``: every symmetric reservation and every context; rejected while any MoE context
  holds retained forwards. Teams stay cached; the next ``configure`` reserves anew and may choose new
  capacities.
- ``finalize()``: everything, then NVSHMEM itself. Retained forwards are dropped with their contexts.
"""

from __future__ import annotations

from typing import Any

from lck_runtime.agreement import agree
from lck_runtime.state import STATE, RuntimeState

__all__ = ["clear_pool", "destroy_team", "finalize"]


def _sync(st: RuntimeState) -> None:
    if st.device is not None and st.device.type == "cuda":
        import torch

        torch.cuda.synchronize(st.device)


def _inflight(st: RuntimeState, keys: list[tuple[int, int]]) -> dict[str, int]:
    return {f"{k[0]}x{k[1]}": len(st.moe[k]._stack) for k in keys if k in st.moe and len(st.moe[k]._stack)}


def _reject_inflight(op: str, facts: list[dict[str, int]], domain_ranks: tuple[int, ...]) -> None:
    holders = [(r, f) for r, f in enumerate(facts) if f]
    if holders:
        detail = "; ".join(
            f"bootstrap rank {r} (global {domain_ranks[r]}): "
            + ", ".join(f"{n} in the EP partition size×stride {k}" for k, n in sorted(f.items()))
            for r, f in holders
        )
        raise RuntimeError(
            f"{op}: MoE contexts still hold retained forwards awaiting backward ({detail}); run their "
            "backwards (or pop_forward them) first: their state lives in what this call frees"
        )


def _require_configured(op: str) -> RuntimeState:
    st = STATE
    if st.domain is None:
        raise RuntimeError(f"{op}: lck_runtime is not configured; call lck_runtime.configure(...) first")
    return st


def destroy_team(group: Any = None) -> None:
    """Destroy the team of ``group``'s partition (ProcessGroup, registered name, or None for the bootstrap group).

    Collective over the bootstrap group. Invalidates the FLSCE and MoE contexts of that partition.
    """
    st = _require_configured("destroy_team")
    domain = st.domain
    op = "destroy_team"
    error: BaseException | None = None
    key = None
    try:
        if group is None:
            ranks = domain.ranks
        elif isinstance(group, str):
            entry = st.registry.entries.get(group)
            if entry is None:
                raise ValueError(
                    f"{op}: no group named {group!r} is registered (known: {sorted(st.registry.entries)})"
                )
            ranks = entry.ranks
        else:
            ranks = st.registry.ranks_of(group, f"{op}: group")
        team = st.teams.get(ranks)
        if team is None:
            raise ValueError(
                f"{op}: the group with ranks {ranks} has no team (no context was configured on it)"
            )
        key = team.partition.key
    except Exception as exc:
        error = exc
    plan = {"partition (size, stride)": key, "runtime state": st.digest()}
    facts = agree(domain, op, error=error, plan=plan, facts=_inflight(st, [key]) if key else {})
    _reject_inflight(op, facts, domain.ranks)
    assert key is not None
    _sync(st)
    nvs = st.nvshmem if st.native else None
    why = f"destroy_team() of the partition size×stride {key[0]}x{key[1]}"
    for table in (st.flsce, st.moe):
        ctx = table.pop(key, None)
        if ctx is None:
            continue
        ctx._invalidate(why)
        own = [getattr(ctx, "_workspace", None), getattr(ctx, "_signals", None)]
        p2p_buffers = getattr(ctx, "_p2p_buffers", None)
        if p2p_buffers is not None:
            own += p2p_buffers[:-1]  # the three reservations; the last item is the slot size
        for res in own:
            if res is not None:
                st.pool.release(res, nvs)
    st.teams.destroy(key, nvs)


def clear_pool() -> None:
    """Free every symmetric reservation and invalidate every context. Collective over the bootstrap group."""
    st = _require_configured("clear_pool")
    op = "clear_pool"
    facts = agree(
        st.domain, op, error=None, plan={"runtime state": st.digest()}, facts=_inflight(st, sorted(st.moe))
    )
    _reject_inflight(op, facts, st.domain.ranks)
    _sync(st)
    _drop_contexts(st, "clear_pool()")
    st.pool.release_all(st.nvshmem if st.native else None)
    st.flsce_reserved = None
    st.moe_reserved = None


def finalize() -> None:
    """Free everything, destroy every team, finalize NVSHMEM; invalidate all contexts.

    Collective over the bootstrap group. A no-op in a process that is not configured.
    """
    st = STATE
    if st.domain is None:
        return
    domain = st.domain
    agree(domain, "finalize", error=None, plan={"runtime state": st.digest()})
    _sync(st)
    nvs = st.nvshmem if st.native else None
    _drop_contexts(st, "finalize()")
    try:
        st.pool.release_all(nvs)
        st.teams.destroy_all(nvs)
        if nvs is not None:
            nvs.finalize()
    finally:
        st.reset()


def _drop_contexts(st: RuntimeState, why: str) -> None:
    for table in (st.flsce, st.moe):
        for ctx in table.values():
            ctx._invalidate(why)
            stack = getattr(ctx, "_stack", None)
            if stack is not None:
                stack.drop_all()
        table.clear()
