"""FLSCE and MoE contexts: what an operator needs about its group, prepared once by ``configure``.

A context belongs to one partition (groups with the same ordered membership share it) and holds this
rank's team, the capacities it was configured with, and its symmetric state. Contexts are looked up,
never created, on execution paths: ``flsce_context(group)`` / ``moe_context(group)`` accept a
ProcessGroup, a registered name, or ``None`` (the bootstrap group).

Team destruction, pool clear and finalize invalidate the contexts that depend on them. An invalid
context keeps answering ``alive`` (False); every other use raises ``RuntimeError`` saying what
invalidated it, instead of touching freed memory or a destroyed team.
"""

from __future__ import annotations

from typing import Any

from lck_runtime.config import FusedLinearCrossEntropyConfig, MoEConfig
from lck_runtime.stack import RetainedForwardStack
from lck_runtime.state import STATE
from lck_runtime.symmetric import Reservation
from lck_runtime.teams import Team

__all__ = ["FlsceContext", "MoEContext", "flsce_context", "moe_context"]


class _Context:
    _kind = "context"

    def __init__(self, *, group: Any, team: Team, config: Any, device: Any, native: bool, label: str):
        self._group = group
        self._team = team
        self._config = config
        self._device = device
        self._native = native
        self._label = label
        self._dead: str | None = None
        me = STATE.domain.ranks[STATE.domain.local_rank] if STATE.domain is not None else None
        self._rank = team.ranks.index(me)

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """False once a team destroy, pool clear or finalize invalidated this context."""
        return self._dead is None

    def _invalidate(self, why: str) -> None:
        if self._dead is None:
            self._dead = why

    def _check(self) -> None:
        if self._dead is not None:
            raise RuntimeError(
                f"{self._describe()} was invalidated by {self._dead}; call lck_runtime.configure(...) "
                f"again and fetch a fresh context with {self._lookup}(group)"
            )

    def _describe(self) -> str:
        return f"{self._kind} context for group {self._label} (ranks {self._team.ranks})"

    def __repr__(self) -> str:
        state = "alive" if self._dead is None else f"invalidated by {self._dead}"
        return f"<{type(self).__name__} group={self._label} ranks={self._team.ranks} native={self._native} {state}>"

    # -- the group ------------------------------------------------------------------------------------
    @property
    def group(self) -> Any:
        """The ProcessGroup (the first one registered with this membership)."""
        self._check()
        return self._group

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the members, in group-rank order."""
        self._check()
        return self._team.ranks

    @property
    def size(self) -> int:
        self._check()
        return self._team.size

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        self._check()
        return self._rank

    @property
    def native(self) -> bool:
        """True when the NVSHMEM paths serve this context."""
        self._check()
        return self._native

    @property
    def device(self) -> Any:
        self._check()
        return self._device

    @property
    def team(self) -> int | None:
        """The NVSHMEM team handle (``None`` on the torch.distributed path)."""
        self._check()
        return self._team.handle

    @property
    def pes(self) -> tuple[int, ...]:
        """NVSHMEM world PEs of the members (bootstrap-local ranks), in group-rank order."""
        self._check()
        return self._team.local


class FlsceContext(_Context):
    """Vocab-parallel (fused linear) cross entropy over one TP group."""

    _kind = "FLSCE"
    _lookup = "flsce_context"

    def __init__(self, *, scratch: Reservation, p2p_buffers: tuple[Any, ...] | None = None, **kw: Any):
        super().__init__(**kw)
        self._scratch = scratch
        # (receive area, flags, low-latency area, slot floats) reserved for the one-shot all-reduce; ``_p2p`` is built from
        # them once every rank's buffers exist (configure), or stays None (torch.distributed path, teams
        # of one, teams spanning hosts, or a rank without peer views).
        self._p2p_buffers = p2p_buffers
        self._p2p: Any = None
        self._p2p_off = False  # set on every rank when some rank could not build it

    @property
    def config(self) -> FusedLinearCrossEntropyConfig:
        self._check()
        return self._config

    @property
    def capacity(self) -> int:
        """fp32 elements one ``all_reduce_`` may carry: ``max_tokens * max(hidden_size, 8)``."""
        self._check()
        return self._config.capacity

    def check_tokens(self, n_tokens: int, hidden: int | None = None, local_vocab: int | None = None) -> None:
        """Raise ``ValueError`` naming the configured capacity that ``n_tokens``/``hidden``/``local_vocab`` exceed."""
        self._check()
        cfg = self._config
        for name, value, limit, field in (
            ("n_tokens", n_tokens, cfg.max_tokens, "max_tokens"),
            ("hidden", hidden, cfg.hidden_size, "hidden_size"),
            ("local_vocab", local_vocab, cfg.local_vocab_size, "local_vocab_size"),
        ):
            if value is None and name != "n_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"check_tokens: {name} must be an int, got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"check_tokens: {name} must be >= 0, got {value}")
            if value > limit:
                raise ValueError(
                    f"{self._describe()}: {name}={value} exceeds FusedLinearCrossEntropyConfig.{field}={limit}; "
                    f"configure a larger {field} (process-wide capacities are reserved by the first configure)"
                )

    def all_reduce_(self, t: Any, op: str, *, algorithm: str = "auto") -> Any:
        """In-place all-reduce of ``t`` over the group; see :func:`lck_runtime.collectives.all_reduce_`."""
        from lck_runtime.collectives import all_reduce_

        self._check()
        return all_reduce_(self, t, op, algorithm=algorithm)

    @property
    def p2p(self) -> bool:
        """True when ``all_reduce_`` can use the one-shot NVLink exchange (see :mod:`lck_runtime.p2p`)."""
        self._check()
        return self._p2p is not None

    def check_collectives(self) -> None:
        """Synchronize and raise ``BarrierError`` if a one-shot all-reduce of this context timed out
        waiting for a peer (its output was filled with NaN instead of hanging); no-op otherwise."""
        self._check()
        if self._p2p is not None:
            self._p2p.check()

    @property
    def scratch(self) -> Any:
        """The shared symmetric fp32 scratch (NVSHMEM path; ``None`` on the torch.distributed path)."""
        self._check()
        return self._scratch.tensor


class MoEContext(_Context):
    """Expert-parallel MoE over one EP group: topology, retained-forward stack, symmetric state."""

    _kind = "MoE"
    _lookup = "moe_context"

    def __init__(
        self,
        *,
        gpus_per_host: int,
        workspace: Reservation,
        signals: Reservation,
        one_machine: bool = True,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self._gpus_per_host = gpus_per_host
        self._one_machine = one_machine
        self._workspace = workspace
        self._signals = signals
        self._stack = RetainedForwardStack(self._config.max_inflight, self._describe())

    @property
    def config(self) -> MoEConfig:
        self._check()
        return self._config

    @property
    def num_hosts(self) -> int:
        self._check()
        return self._config.num_hosts

    @property
    def gpus_per_host(self) -> int:
        self._check()
        return self._gpus_per_host

    @property
    def one_machine(self) -> bool:
        """Whether every member runs on one machine, so each can map every other's symmetric memory (the
        hosts, if several, are virtual); agreed at ``configure``, the same on every rank."""
        self._check()
        return self._one_machine

    def host_of(self, rank: int) -> int:
        """The (possibly virtual) host index of group rank ``rank``."""
        self._check()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self._team.size:
            raise ValueError(f"host_of: rank must be an int in [0, {self._team.size}), got {rank!r}")
        return rank // self._gpus_per_host

    # -- retained forwards ----------------------------------------------------------------------------
    @property
    def max_inflight(self) -> int:
        self._check()
        return self._stack.max_inflight

    @property
    def inflight(self) -> int:
        """Retained forwards awaiting backward in this context."""
        self._check()
        return len(self._stack)

    def push_forward(self, entry: Any) -> None:
        """Retain a forward's state; ``RuntimeError`` (nothing pushed) when ``max_inflight`` are held."""
        self._check()
        self._stack.push(entry)

    def pop_forward(self, expected: Any = None) -> Any:
        """Pop the newest retained forward (LIFO). With ``expected``, it must be that object (else nothing is popped)."""
        self._check()
        if expected is None:
            return self._stack.pop()
        return self._stack.pop(expected)

    def peek_forward(self) -> Any:
        self._check()
        return self._stack.peek()

    # -- symmetric state (NVSHMEM path) ---------------------------------------------------------------
    @property
    def workspace(self) -> Any:
        """This rank's symmetric uint8 workspace (see ``symmetric.moe_workspace_bytes``), or ``None``."""
        self._check()
        return self._workspace.tensor

    @property
    def signals(self) -> Any:
        """This rank's symmetric int64 signal words (``SIGNAL_WORDS_PER_PEER`` per member), or ``None``."""
        self._check()
        return self._signals.tensor

    def peer_workspace(self, rank: int) -> Any:
        """NVLink view of group rank ``rank``'s workspace (NVSHMEM path, same host only)."""
        return self._peer(self._workspace, rank, "peer_workspace")

    def peer_signals(self, rank: int) -> Any:
        """NVLink view of group rank ``rank``'s signal words (NVSHMEM path, same host only)."""
        return self._peer(self._signals, rank, "peer_signals")

    def _peer(self, res: Reservation, rank: int, what: str) -> Any:
        self._check()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self._team.size:
            raise ValueError(f"{what}: rank must be an int in [0, {self._team.size}), got {rank!r}")
        if res.tensor is None or STATE.nvshmem is None:
            raise RuntimeError(
                f"{what}: {self._describe()} has no symmetric memory on the torch.distributed path"
            )
        return STATE.nvshmem.peer(res.tensor, self._team.local[rank])


def _resolve_ranks(group: Any, what: str) -> tuple[int, ...] | None:
    """Ordered global ranks for a ProcessGroup, a registered name or None; None for an unknown name."""
    st = STATE
    assert st.domain is not None
    if group is None:
        return st.domain.ranks
    if isinstance(group, str):
        entry = st.registry.entries.get(group)
        return None if entry is None else entry.ranks
    return st.registry.ranks_of(group, what)


def _lookup(kind: str, table: dict, group: Any, required: bool) -> Any:
    what = f"{kind}_context(group)"
    st = STATE
    if st.domain is None:
        if required:
            raise RuntimeError(
                f"{what}: lck_runtime is not configured; call lck_runtime.configure(...) on every rank first"
            )
        return None
    ranks = _resolve_ranks(group, what)
    team = None if ranks is None else st.teams.get(ranks)
    ctx = None if team is None else table.get(team.partition.key)
    if ctx is None and required:
        label = repr(group) if isinstance(group, str) or group is None else f"with ranks {ranks}"
        known = sorted(st.registry.entries)
        section = "flsce=FusedLinearCrossEntropyConfig" if kind == "flsce" else "moe=MoEConfig"
        raise ValueError(
            f"{what}: no {kind.upper() if kind == 'flsce' else 'MoE'} context for group {label}; configure it "
            f"with lck_runtime.configure({section}(..., group=<name>)) (registered names: {known})"
        )
    return ctx


def flsce_context(group: Any = None, *, required: bool = True) -> FlsceContext | None:
    """The FLSCE context of ``group`` (ProcessGroup, registered name, or None for the bootstrap group).

    Not collective. Raises ``ValueError`` when there is none and ``required``; returns ``None`` otherwise.
    """
    return _lookup("flsce", STATE.flsce, group, required)


def moe_context(group: Any = None, *, required: bool = True) -> MoEContext | None:
    """The MoE context of ``group`` (ProcessGroup, registered name, or None for the bootstrap group).

    Not collective. Raises ``ValueError`` when there is none and ``required``; returns ``None`` otherwise.
    """
    return _lookup("moe", STATE.moe, group, required)
