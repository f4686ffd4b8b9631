"""The native scale-up backend's device state and kernel launches (``csrc/dispatch.cuh``, ``combine.cuh``).

One :class:`NativeEp` per configured MoE context (shared by every Buffer of that group): the addresses
of every member's symmetric workspace and signal words as mapped in this process, the kernels, a
diagnostic word and a pinned host mirror of it. The workspace is cut into one region per source member
of ``MoEConfig.max_tokens`` rows of ``row_stride`` bytes (the size the runtime reserves:
``lck_runtime.symmetric.moe_workspace_bytes``); the protocol and the row layout are in ``ep_native.cuh``.

A dispatch is send slots, sender, receiver (a one-block wait, then the routing laid out on every SM),
for ``expand=True`` the expanded maps, and the row copy (every SM) out of the sources' regions, where each
source staged its rows once (:attr:`NativeEp.pulls_rows`), which releases the workspaces for the next
operation; a combine is sender and receiver (a one-block wait, then the sums on
every SM), and for an expanded handle the sender reduces each received row's expanded rows itself, straight
into the source's region. ``num_sms`` sizes the senders, the kernels that write into other members'
workspaces; the receivers' local passes wait on nobody and take the whole GPU, like the torch ops they
replace.

Every kernel is bound once per state (``lck_runtime.jit.Kernel.bind``, with the kinds of its C signature,
:data:`lck_ep.codegen.NATIVE_KINDS`) and launched with a flat list of ints: tensors as ``data_ptr()``, the
state's constant buffers as addresses read once, absent tensors as 0. A per-call ``Kernel.launch`` (typed
wrappers, per-argument checks) had cost a dispatch more host time than its GPU time at small sizes.

A synced call's argument agreement runs here too (:meth:`NativeEp.agree_start`, unless ``EP_DEVICE_AGREEMENT=0``):
every member's vector through the mailbox at the end of each workspace (``csrc/agree.cuh``), then one host read.
The kernel reaches the host's verdict itself, so a synced call enqueues its launches before that read: when
the arguments are refused, every member's launches return at once and every member raises the same error.

Waits are bounded: a member that does not arrive within the Buffer's ``timeout_s`` leaves a diagnostic
instead of a hang; every later call on the context raises it (:class:`NativeTimeoutError`), and
:meth:`NativeEp.check` raises it after a synchronisation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lck_ep.agreement import DEVICE_AGREEMENT, RoutedCounts
from lck_ep.codegen import NATIVE_KERNELS, NATIVE_KINDS, NATIVE_THREADS, native_spec
from lck_ep.knobs import EpKnobs, read_knobs
from lck_runtime.jit import Jit
from lck_runtime.symmetric import moe_agreement_offset, moe_agreement_slot_words

__all__ = [
    "AGREE_HEAD",
    "DEFAULT_NUM_SMS",
    "EXPANDED_ZERO_COPY_TOPK",
    "NATIVE_DTYPES",
    "ExpandedTables",
    "NativeEp",
    "NativeTimeoutError",
    "bind_kernels",
    "build_native_kernels",
    "compile_native_kernels",
    "device_agreement_requested",
    "expanded_tables",
    "native_problem",
    "row_layout",
    "rows_head",
]

DEFAULT_NUM_SMS = 24  # channels (blocks) of the sending kernels unless the Buffer is given num_sms
# Row element types the kernels move (as bytes); combine sums bf16, fp16 and fp32 partials. A row must fit
# the workspace's rows, which the runtime sizes for 2-byte hidden states (:func:`row_fits`).
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_COMBINE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_THREADS = NATIVE_THREADS  # the block every native kernel is built for and launched with
_MAPS_BLOCKS = 1024  # expand_maps: one block per local expert up to this many, then grid-strided
_SHARED_EXPERTS = 1024  # dispatch.cuh's kSharedExperts: expand_chunks takes up to this many local experts
_MAPS_CHUNKS = 128  # expand_chunks: at most this many chunks (a block sums the counts before its own)
_MAPS_MIN_CHUNK = 4096  # and at least this many entries per chunk
_REDUCE_BLOCKS = 1024  # reduce_expanded: one warp per received row, grid-strided past this many blocks
# ep_dispatch_recv's optional outputs, in parameter order (0 where a call has none).
_RECV_OUTPUTS = (
    "recv_src_idx",
    "recv_topk_idx",
    "recv_topk_weights",
    "recv_src_rank",
    "recv_counts",
    "recv_starts",
    "slot_pos",
    "num_recv",
    "per_expert",
    "kept_per_expert",
)
_PHASES = {
    1: "dispatch, waiting for a destination to finish reading the previous operation",
    2: "dispatch, waiting for a source's rows",
    3: "combine, waiting for a source to finish reading the previous operation",
    4: "combine, waiting for a destination's partial rows",
    9: "a synced call's argument agreement, waiting for a member's arguments",
}
# Synced calls agree on their arguments through the workspaces' mailboxes (ep_agree) unless EP_DEVICE_AGREEMENT=0.
DEVICE_AGREEMENT_ENV = "EP_DEVICE_AGREEMENT"
# status[0] of a combine whose members took their input differently (ep_native.cuh)
_MIXED_COMBINE = 4
# status[0] after a synced call's agreement refused its arguments (agree.cuh): cleared once the host raises
_AGREE_REFUSED = 5
# The most head words (status and digest) ep_agree takes as arguments (agree.cuh: kAgreeHead).
AGREE_HEAD = 16
_NO_HEAD = (0,) * AGREE_HEAD
_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], dict[str, Any]] = {}
_STATES: dict[int, NativeEp] = {}


class NativeTimeoutError(RuntimeError):
    """A native dispatch or combine waited longer than its bound for a member (or saw it out of step)."""


class DeviceExchange:
    """An agreement's exchange enqueued by :meth:`NativeEp.agree_start` (:class:`lck_ep.agreement.Exchange`)."""

    def __init__(self, state: NativeEp, n: int) -> None:
        self._state, self._n = state, n

    def _status(self) -> torch.Tensor:
        # the kernel writes the context's status words after the table: one copy brings both
        st = self._state
        at = st.size * self._n
        return st._agree_host[at : at + st.status.numel()]

    def table(self) -> torch.Tensor:
        """The ``[W, n]`` table on the host, once the exchange (not what was launched after it) is done;
        raises :class:`NativeTimeoutError` when a member did not arrive."""
        st = self._state
        st._agree_done.synchronize()
        status = self._status()
        if int(status[0]) not in (0, _AGREE_REFUSED):
            st.status_host.copy_(status)
            st.raise_if_failed()
        return st._agree_host[: st.size * self._n].view(st.size, self._n).clone()

    def settle(self, refused: bool) -> None:
        """The host's verdict on the table: when refused, the device refused too (status code 5, which
        made the calls launched since return at once); clear it so that the context stays usable."""
        st = self._state
        gated = int(self._status()[0]) == _AGREE_REFUSED
        if refused != gated:
            raise RuntimeError(
                f"lck_ep: the device agreement's verdict ({'refused' if gated else 'agreed'}) differs from the "
                f"host's ({'refused' if refused else 'agreed'}) on the same table: a bug in lck_ep"
            )
        if refused:
            st._clear_refusal()


@dataclass(frozen=True)
class RowLayout:
    row_stride: int  # bytes per workspace row (16-byte aligned)
    region_bytes: int  # one source's region: cap rows
    cap: int  # rows per region (MoEConfig.max_tokens)


def row_layout(max_tokens: int, hidden_size: int, top_k: int) -> RowLayout:
    """The workspace geometry of a context's ``MoEConfig`` (its row as the runtime sized it)."""
    row = (hidden_size * 2 + top_k * 12 + 15) // 16 * 16
    return RowLayout(row, max_tokens * row, max_tokens)


# Slots per received row a zero-copy input of an expanded handle takes: one warp lane lists each of a token's
# expanded rows (combine.cuh's reduce_token_expanded).
EXPANDED_ZERO_COPY_TOPK = 32


@dataclass(frozen=True)
class ExpandedTables:
    """Where a zero-copy input of an expanded handle puts things in each member's workspace: its expanded rows
    from the start, then per received row its ``K`` expanded indices (int32) and routing weights (float32),
    placed after the most rows any member holds and sized for the most rows any member receives, so that every
    member's are at the same offsets. ``end``: the bytes all of it takes."""

    index_offset: int
    weights_offset: int
    end: int


def expanded_tables(most_rows: int, row_bytes: int, most_received: int, num_topk: int) -> ExpandedTables:
    """The :class:`ExpandedTables` of ``most_rows`` expanded rows of ``row_bytes`` bytes (the most of any
    member: the handle's ``most_expanded_rows``) and ``most_received`` received rows of ``num_topk`` slots."""
    index = (most_rows * row_bytes + 15) // 16 * 16
    weights = index + (most_received * num_topk * 4 + 15) // 16 * 16
    return ExpandedTables(index, weights, weights + most_received * num_topk * 4)


def meta_offset(row_bytes: int) -> int:
    """Where a row's routing starts: after its ``row_bytes`` bytes of values, 4-byte aligned."""
    return (row_bytes + 3) // 4 * 4


def row_fits(row_bytes: int, num_topk: int, layout: RowLayout) -> bool:
    """Whether a row of ``row_bytes`` bytes and its routing (``num_topk`` slots) fit a workspace row."""
    return meta_offset(row_bytes) + 4 + 6 * num_topk <= layout.row_stride


def native_problem(*, hidden: int, num_topk: int, num_ranks: int, max_tokens: int, config: Any) -> str | None:
    """Why a Buffer of this shape cannot run natively on a context with ``config``, or None."""
    if num_ranks > _THREADS:
        return f"the native kernels handle groups of at most {_THREADS} ranks, this one has {num_ranks}"
    lay = row_layout(config.max_tokens, config.hidden_size, config.top_k)
    if not row_fits(2 * hidden, num_topk, lay) or max_tokens > lay.cap:
        need = meta_offset(2 * hidden) + 4 + 6 * num_topk
        return (
            f"a row of hidden={hidden}, num_topk={num_topk} needs {need} bytes and max_tokens_per_rank="
            f"{max_tokens} rows, but the MoEConfig's workspace rows are {lay.row_stride} bytes, {lay.cap} per source"
        )
    return None


def device_agreement_requested() -> bool:
    """Whether ``EP_DEVICE_AGREEMENT`` lets synced native calls agree through the workspaces ("1", empty or
    unset), or sends them through the Buffer's process group ("0")."""
    value = os.environ.get(DEVICE_AGREEMENT_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{DEVICE_AGREEMENT_ENV} must be 0 or 1, got {value!r}")
    return value != "0"


def _jit() -> Any:
    return Jit(prefix="EP")


def compile_native_kernels(
    arch: str, knobs: EpKnobs | None = None, only: tuple[str, ...] = NATIVE_KERNELS
) -> dict[str, str]:
    """Compile the native kernels (all, or ``only`` these) for ``arch`` without a GPU; ``{name: cubin path}``."""
    knobs = read_knobs() if knobs is None else knobs
    jit = _jit()
    return {k: str(jit.compile_only(**native_spec(k, knobs).build_kwargs(), arch=arch)) for k in only}


def build_native_kernels(device_index: int, knobs: EpKnobs | None = None) -> dict[str, Any]:
    """Build (or fetch from the JIT cache) and load every native kernel onto ``device_index``.

    Loading happens here, at Buffer construction: a module loaded later could wait behind a peer's
    kernel spinning on the same GPU (CUDA MPS) and stall both until the timeout.
    """
    knobs = read_knobs() if knobs is None else knobs
    return load_kernels(
        _LOCK,
        _KERNELS,
        knobs,
        device_index,
        lambda jit: {k: jit.build(**native_spec(k, knobs).build_kwargs()) for k in NATIVE_KERNELS},
    )


def load_kernels(
    lock: Any, cache: dict[tuple[Any, ...], dict[str, Any]], knobs: EpKnobs, device_index: int, build: Any
) -> dict[str, Any]:
    """``build(jit)``'s kernels loaded onto ``device_index``, once per knobs, JIT flags and cache directory
    and device in ``cache`` (guarded by ``lock``)."""
    import os

    key = (
        knobs,
        os.environ.get("EP_JIT_EXTRA_FLAGS", ""),
        os.environ.get("EP_JIT_CACHE_DIR", ""),
        device_index,
    )
    with lock:
        kernels = cache.get(key)
        if kernels is None:
            kernels = build(_jit())
            for kernel in kernels.values():
                kernel.load(device_index)
            cache[key] = kernels
    return kernels


def bind_kernels(
    kernels: dict[str, Any], kinds: dict[str, tuple[type, ...]], device_index: int
) -> dict[str, Any]:
    """Each of ``kernels`` (loaded) bound to ``device_index``, :data:`_THREADS` threads and its ``kinds``
    (``lck_runtime.jit.Kernel.bind``: every check of a launch made once, here)."""
    return {name: k.bind(kinds[name], block=_THREADS, device=device_index) for name, k in kernels.items()}


def _addr(t: torch.Tensor | None) -> int:
    """A kernel's pointer argument: the tensor's address, or 0 (nullptr) for none."""
    return 0 if t is None else t.data_ptr()


def rows_head(rows: OutgoingRows, x_bytes: int) -> list[int]:
    """The arguments both dispatch senders (scale-up and hybrid) start with, in their order: the rows, their
    byte length, the routing (0 on a replay), the token-to-rank mask and the send slots."""
    return [
        rows.x.data_ptr(),
        x_bytes,
        _addr(rows.topk_idx),
        _addr(rows.topk_weights),
        rows.mask.data_ptr(),
        rows.send_slot.data_ptr(),
    ]


class OutgoingRows(NamedTuple):
    """What one dispatch or replay sends: the rows, where each goes, and their routing (None on a replay)."""

    x: torch.Tensor  # [T, H] rows
    mask: torch.Tensor  # [T, W] bool: row t goes to group rank w
    send_slot: torch.Tensor  # [T, W] int64 slots (send_slots)
    rows_to: torch.Tensor  # [W] rows per destination
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None


class OutgoingPartials(NamedTuple):
    """What one combine sends back: the partial rows and where each source's rows start among them."""

    partial: torch.Tensor  # [R, H] partial rows, in the order they were received
    recv_counts: torch.Tensor  # [W] rows from each source
    recv_starts: torch.Tensor  # [W] first row of each source


class NativeEp:
    """The native state of one MoE context on this rank; get it with :meth:`for_context`."""

    # An expanded handle's combine reduces and sends its rows in one launch (send_expanded_partials); a state
    # whose partials go through other senders (the hybrid pair) reduces first and sends the reduced rows.
    fuses_expanded_combine = True
    # Dispatched rows are pulled: the sender stores each row once, in its own region, and every member it goes
    # to reads it from there (dispatch_send / dispatch_rows with pull). Pushing stores it once per member, into
    # that member's region, to be read again there; a state with other senders (the hybrid pair) pushes.
    pulls_rows = True
    # Buffer.combine_input hands out this member's workspace for a compact handle's expert outputs, and the
    # combine's sources read them there (ep_combine_zero_copy): the hybrid pair's relays need them pushed.
    zero_copy_combine = True
    # The handle whose zero-copy input combine_input handed out since the last operation (or None).
    armed: Any = None
    # Synced calls agree on their arguments through the workspaces (agree_start; off with EP_DEVICE_AGREEMENT=0):
    # the hybrid pair's members on other hosts have no mapped workspace to write into.
    agrees_on_device = True

    def __init__(self, ctx: Any, device: torch.device) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self.me, self.size = ctx.rank, ctx.size
        self.layout = row_layout(cfg.max_tokens, cfg.hidden_size, cfg.top_k)
        self.device = device
        self.workspace = ctx.workspace
        self.signals = ctx.signals
        # Peer views stay referenced: their mappings back the addresses handed to the kernels.
        self._views = [
            (self.workspace, self.signals) if r == self.me else (ctx.peer_workspace(r), ctx.peer_signals(r))
            for r in range(self.size)
        ]
        self.peer_ws = torch.tensor([w.data_ptr() for w, _ in self._views], dtype=torch.int64, device=device)
        self.peer_sig = torch.tensor([s.data_ptr() for _, s in self._views], dtype=torch.int64, device=device)
        self.done = torch.zeros(4, dtype=torch.int32, device=device)  # one grid ticket per publishing kernel
        self.status = torch.zeros(6, dtype=torch.int64, device=device)
        self.status_host = torch.zeros(6, dtype=torch.int64, pin_memory=True)
        self._status_word = self.status_host.numpy()  # the same memory, read without a torch call
        # The agreement mailbox (lck_runtime.symmetric.moe_agreement_offset) and the agreements made so far.
        self.device_agreement = self.agrees_on_device and device_agreement_requested()
        self._mailbox = moe_agreement_offset(cfg, self.size)
        self._slot_words = moe_agreement_slot_words(cfg, self.size)
        self._agreements = 0
        self._agree_out: torch.Tensor | None = None  # the agreement's output and host copy, made on first use
        self._agree_host: torch.Tensor | None = None
        self._agree_done: Any = None
        self.kernels = build_native_kernels(device.index)
        self.launchers = bind_kernels(self.kernels, NATIVE_KINDS, device.index)
        self.device_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._cache_addresses()

    def _cache_addresses(self) -> None:
        """The addresses of the state's own buffers, read once: they live as long as the state, and every
        launch passes some of them. ``_done[i]``: grid ticket ``i`` (``done[i:i+1]``, without a view)."""
        self._ws = self.workspace.data_ptr()
        # A zero-copy combine's table: the last W int64 of the regions; its rows may fill what is before.
        self._table_offset = self.size * self.layout.region_bytes - 8 * self.size
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # combine_input's, by shape
        self._sig = self.signals.data_ptr()
        self._peer_ws = self.peer_ws.data_ptr()
        self._peer_sig = self.peer_sig.data_ptr()
        self._status = self.status.data_ptr()
        step = self.done.element_size()
        self._done = tuple(self.done.data_ptr() + i * step for i in range(self.done.numel()))

    # One state per context and class: a subclass (the hybrid backend) keeps its own registry.
    _states: dict[int, NativeEp] = _STATES

    @classmethod
    def for_context(cls, ctx: Any, device: torch.device) -> NativeEp:
        with _LOCK:
            state = cls._states.get(id(ctx))
            if state is not None and state.ctx is ctx:
                return state
        state = cls(ctx, device)
        with _LOCK:
            cls._states[id(ctx)] = state
        return state

    @property
    def signature(self) -> int:
        """What a Buffer's construction agrees on across ranks for this state: how synced calls agree
        (:data:`lck_ep.agreement.DEVICE_AGREEMENT`, or 1 through the process group)."""
        return DEVICE_AGREEMENT if self.device_agreement else 1

    # -- diagnostics ----------------------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Raise the diagnostic an earlier call left (no synchronisation: what has landed on the host)."""
        if self._status_word[0] == 0:
            return
        s = self.status_host
        code, phase, who, seen, want, waited = (int(v) for v in s.tolist())
        what = _PHASES.get(phase, f"phase {phase}")
        ranks = self.ctx.ranks
        if code == 1:
            detail = f"waited {waited / 1e9:.1f} s for group rank {who} (global rank {ranks[who]})"
        elif code == _AGREE_REFUSED:  # only seen if the host never read the refusing agreement's verdict
            raise NativeTimeoutError(
                f"lck_ep native backend on group rank {self.me}: a synced call's arguments were refused on the "
                "device and the call was interrupted before raising why; this context's native state is "
                "unusable now (finalize and configure again)"
            )
        elif code == _MIXED_COMBINE:
            how = ("a plain tensor", "Buffer.combine_input's zero-copy rows")
            raise NativeTimeoutError(
                f"lck_ep native backend on group rank {self.me}: {what}: group rank {who} (global rank "
                f"{ranks[who]}) combined {how[seen]} while this rank combined {how[want]}: every member of a "
                "combine must take its input the same way; this context's native state is unusable now "
                "(finalize and configure again)"
            )
        else:
            detail = f"group rank {who} (global rank {ranks[who]}) is at operation {seen}, expected {want}"
        raise NativeTimeoutError(
            f"lck_ep native backend on group rank {self.me}: {what}: {detail}. A member stopped calling "
            "dispatch/combine or called a different sequence; this context's native state is unusable now "
            "(finalize and configure again)"
        )

    def check(self) -> None:
        """Synchronise with the device and raise the diagnostic of a failed wait, if any."""
        torch.cuda.current_stream(self.device).synchronize()
        self._raise_from_device()

    def _raise_from_device(self) -> None:
        """Read the diagnostic word (the stream has finished the kernels that may set it) and raise it."""
        self.status_host.copy_(self.status)
        self.raise_if_failed()

    def _mirror(self) -> None:
        self.status_host.copy_(self.status, non_blocking=True)

    # -- launches -------------------------------------------------------------------------------------
    def send_slots(self, mask: torch.Tensor) -> torch.Tensor:
        """``[T, W]`` int64 send slots of ``mask`` (:func:`lck_ep.reference.send_slots`), by one kernel."""
        t, w = mask.shape
        slot = torch.empty(t, w, dtype=torch.int64, device=mask.device)
        if t:
            self.launchers["ep_send_slots"](w, [mask.data_ptr(), t, w, slot.data_ptr()])
        return slot

    def send_rows(self, rows: OutgoingRows, num_local_experts: int, num_sms: int, timeout_ns: int) -> None:
        """Store the rows (bytes; :func:`row_fits` checked by the caller) into the destinations' regions,
        their routing at :func:`meta_offset` of the row's bytes."""
        x, rows_to, topk_idx = rows.x, rows.rows_to, rows.topk_idx
        lay = self.layout
        k = topk_idx.shape[1] if topk_idx is not None else 0
        x_bytes = x.shape[1] * x.element_size()
        self.launchers["ep_dispatch_send"](
            num_sms,
            [
                *rows_head(rows, x_bytes),
                rows_to.data_ptr(),
                self._peer_ws,
                self._peer_sig,
                lay.region_bytes,
                lay.row_stride,
                meta_offset(x_bytes),
                x.shape[0],
                k,
                self.size,
                self.me,
                num_local_experts,
                self._done[0],
                self._status,
                timeout_ns,
                int(self.pulls_rows),
            ],
        )

    def receive(
        self,
        *,
        row_bytes: int,
        rows: int,
        num_topk: int,
        has_meta: bool,
        num_local_experts: int,
        cap: int,
        out: dict[str, torch.Tensor | None],
        num_sms: int,
        timeout_ns: int,
    ) -> None:
        """Wait for every source's rows and lay out their routing and counts into ``out`` (``rows`` output
        rows); the rows stay in the workspace until :meth:`copy_rows`, which releases it."""
        lay = self.layout
        head = [
            self._ws,
            self._sig,
            lay.region_bytes,
            lay.row_stride,
            meta_offset(row_bytes),
            cap,
            rows,
            self.size,
            self.me,
            num_topk,
            1 if has_meta else 0,
            num_local_experts,
            *[_addr(out.get(name)) for name in _RECV_OUTPUTS],
        ]
        launch = self.launchers["ep_dispatch_recv"]
        # Stage 0 waits (one block spins), stage 1 lays out on every SM: see dispatch.cuh.
        launch(1, [*head, 0, self._status, timeout_ns])
        launch(max(num_sms, self.device_sms), [*head, 1, self._status, timeout_ns])

    def expand_maps(
        self,
        recv_topk_idx: torch.Tensor,
        kept_counts: torch.Tensor,
        alignment: int,
        offsets: torch.Tensor,
        src_row: torch.Tensor,
        slot: torch.Tensor,
        index: torch.Tensor,
    ) -> None:
        """The expanded maps of the kept rows' routing (``recv_topk_idx`` [N, K], ``kept_counts`` [L]
        int32 from :meth:`receive`) into ``offsets`` [L + 1], ``src_row`` / ``slot`` [M], ``index``
        [N, K]: :func:`lck_ep.expanded.build_expanded`'s result.

        Up to ``_SHARED_EXPERTS`` local experts, two launches over chunks of the entries (a count, then the
        ranks, with an int32 scratch of chunks x experts); more, one block per expert over every entry."""
        big_l = kept_counts.shape[0]
        n = recv_topk_idx.numel()
        head = [
            recv_topk_idx.data_ptr(),
            kept_counts.data_ptr(),
            n,
            src_row.shape[0],
            recv_topk_idx.shape[1],
            big_l,
            alignment,
            offsets.data_ptr(),
            src_row.data_ptr(),
            slot.data_ptr(),
            index.data_ptr(),
            self._status,
        ]
        launch = self.launchers["ep_expand_maps"]
        if big_l > _SHARED_EXPERTS:
            launch(min(big_l, _MAPS_BLOCKS), [*head, 0, 0, 2])
            return
        # whole blocks of entries: expand_chunks steps through a chunk a block at a time
        chunk = -(-max(_MAPS_MIN_CHUNK, -(-n // _MAPS_CHUNKS)) // _THREADS) * _THREADS
        blocks = max(1, -(-n // chunk))
        counts = torch.empty(blocks * big_l, dtype=torch.int32, device=recv_topk_idx.device)
        for stage in (0, 1):
            launch(blocks, [*head, counts.data_ptr(), chunk, stage])

    def copy_rows(
        self,
        x: torch.Tensor,
        recv_starts: torch.Tensor,
        src_row: torch.Tensor | None,
        out: torch.Tensor,
        num_sms: int,
        rows_end: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
        src_idx: torch.Tensor | None = None,
    ) -> None:
        """``out[m]`` = received row ``src_row[m]`` (zero where -1) for ``m`` below ``rows_end[0]`` (the
        expanded rows in use, ``expert_offsets[L]``; all rows without it), or without ``src_row`` received
        row ``m`` for ``m`` below the rows received, straight from the workspace (or ``x`` for this member's
        own rows); later rows (a sync-free output's capacity padding) are not written. Then this member has
        finished reading the operation (the dispatch's publication). With the expanded maps' ``index``
        ([N, K], each received row's expanded rows) beside ``src_row``, each received row is read once and
        stored at every one of its expanded rows (without it, once per expanded row). ``src_idx`` (the
        received rows' source token indices, ``recv_src_idx``) says where a pulled row is in its source's region.

        It waits for nothing, so it may take every SM without stalling a peer (the channel limit
        ``num_sms`` is for the kernels that spin on other members), like a torch copy of the same rows."""
        if index is not None and src_row is None:
            raise ValueError("copy_rows: index (the expanded maps) needs src_row beside it")
        if self.pulls_rows and src_idx is None:
            raise ValueError("copy_rows: pulled rows need src_idx (the received rows' source token indices)")
        lay = self.layout
        x_bytes = x.shape[1] * x.element_size()
        self.launchers["ep_dispatch_rows"](
            max(num_sms, self.device_sms),
            [
                x.data_ptr(),
                self._ws,
                self._sig,
                lay.region_bytes,
                lay.row_stride,
                meta_offset(x_bytes),
                x_bytes,
                recv_starts.data_ptr(),
                _addr(src_row),
                _addr(rows_end),
                out.shape[0],
                self.size,
                self.me,
                out.data_ptr(),
                self._done[1],
                self._status,
                _addr(index),
                index.shape[0] if index is not None else 0,
                index.shape[1] if index is not None else 0,
                self._peer_ws,
                _addr(src_idx),
                int(self.pulls_rows),
            ],
        )
        self._mirror()

    def reduce_expanded(
        self,
        x: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor | None,
        partial: torch.Tensor,
        rows_used: torch.Tensor | None = None,
    ) -> None:
        """``partial[n]`` = float32 sum over slots k ascending of ``[weights[n, k] *] x[index[n, k]]`` (local
        slots only), rounded once: :func:`lck_ep.expanded.reduce_expanded`, bit for bit; only for ``n``
        below ``rows_used[0]`` (a sync-free handle's received count, on the device) when given: the rows
        after it are capacity padding that the combine does not read."""
        n = partial.shape[0]
        self.launchers["ep_reduce_expanded"](
            max(1, min((n + _THREADS // 32 - 1) // (_THREADS // 32), _REDUCE_BLOCKS)),
            [
                x.data_ptr(),
                index.data_ptr(),
                _addr(weights),
                partial.data_ptr(),
                n,
                _addr(rows_used),
                index.shape[1],
                partial.shape[1],
                _COMBINE_CODES[partial.dtype],
            ],
        )

    def partials_args(self, sent: OutgoingPartials) -> list[int]:
        """The leading launch values of every combine-send kernel (this one and the hybrid pair's): the
        partial rows, where each source's rows start, and the peers' regions."""
        partial, recv_counts, recv_starts = sent
        lay = self.layout
        return [
            partial.data_ptr(),
            partial.shape[1] * partial.element_size(),
            partial.shape[0],
            recv_counts.data_ptr(),
            recv_starts.data_ptr(),
            self._peer_ws,
            self._peer_sig,
            lay.region_bytes,
            lay.row_stride,
        ]

    def send_partials(self, sent: OutgoingPartials, num_sms: int, timeout_ns: int) -> None:
        self.launchers["ep_combine_send"](
            num_sms,
            [*self.partials_args(sent), self.size, self.me, self._done[2], self._status, timeout_ns],
        )

    def send_expanded_partials(
        self,
        x: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor | None,
        sent: OutgoingPartials,
        num_sms: int,
        timeout_ns: int,
    ) -> None:
        """The combine of an expanded handle's rows in one launch: :meth:`reduce_expanded`'s rows (the same
        bits) sent as :meth:`send_partials` sends ``sent.partial``'s, each reduced straight into its source's
        region; only this member's own rows are written to ``sent.partial`` (where :meth:`reduce_partials`
        reads them). Saves writing every reduced row and reading it back."""
        partial = sent.partial
        self.launchers["ep_combine_send_expanded"](
            num_sms,
            [
                *self.partials_args(sent),
                self.size,
                self.me,
                self._done[2],
                self._status,
                timeout_ns,
                x.data_ptr(),
                index.data_ptr(),
                _addr(weights),
                index.shape[1],
                partial.shape[1],
                _COMBINE_CODES[partial.dtype],
            ],
        )

    # -- argument agreement ----------------------------------------------------------------------------
    def agree_start(
        self,
        head: Sequence[int],
        timeout_ns: int,
        check_words: int,
        flag_word: int,
        routed: RoutedCounts | None = None,
        n: int | None = None,
    ) -> DeviceExchange:
        """Enqueue the all-gather of every member's vector (int64, the same length ``n`` everywhere, default
        ``head``'s) through the workspaces' mailboxes (ep_agree) and the copy of the ``[W, n]`` result to the
        host, without waiting. The vector is ``head`` (at most :data:`AGREE_HEAD` ints, passed to the kernel as
        arguments), then ``routed``'s words (:class:`lck_ep.agreement.RoutedCounts`, read by the kernel from
        the routing and the layout), then zeros. The kernel also reaches the host's verdict: when a member's
        status word (``head[0]``) is set, the next ``check_words - 1`` words differ between members, or word
        ``flag_word`` (>= 0) is set on any member, it records status code 5 on this member, so that every
        dispatch or combine launched after it returns at once, on every member alike, until
        :meth:`DeviceExchange.settle`. Collective over the context's members, in the same sequence of
        agreements everywhere; a member that does not arrive within ``timeout_ns`` makes
        :meth:`DeviceExchange.table` raise :class:`NativeTimeoutError`."""
        head_n = len(head)
        if head_n > AGREE_HEAD:
            raise ValueError(f"agree_start: a head of {head_n} words; the kernel takes at most {AGREE_HEAD}")
        n = head_n if n is None else n
        idx, per_rank, per_expert, hi = None, None, None, 0
        if routed is not None:
            idx, per_rank, per_expert, hi = (
                routed.topk_idx,
                routed.per_rank,
                routed.per_expert,
                routed.num_experts,
            )
            if 1 + per_rank.numel() + per_expert.numel() > n - head_n:
                raise ValueError(
                    f"agree_start: the routing's {1 + per_rank.numel() + per_expert.numel()} words do not fit the "
                    f"{n - head_n} words after the vector's head"
                )
        if n < head_n or n > self._slot_words - 1:
            raise ValueError(
                f"agree_start: a vector of {n} words does not fit the agreement mailbox's slots "
                f"({self._slot_words - 1} words)"
            )
        self.raise_if_failed()
        if self._agree_out is None:  # [W, slot_words] and the status after them, on the device and pinned
            words = self.size * self._slot_words + self.status.numel()
            self._agree_out = torch.empty(words, dtype=torch.int64, device=self.device)
            self._agree_host = torch.empty(words, dtype=torch.int64, pin_memory=True)
            self._agree_done = torch.cuda.Event()
        self._agreements += 1
        out = self._agree_out[: self.size * n + self.status.numel()]  # the table, then the status words
        self.launchers["ep_agree"](
            1,
            [
                *head,
                *_NO_HEAD[head_n:],
                head_n,
                n,
                _addr(idx),
                0 if idx is None else idx.numel(),
                hi,
                _addr(per_rank),
                0 if per_rank is None else per_rank.numel(),
                _addr(per_expert),
                0 if per_expert is None else per_expert.numel(),
                self._peer_ws,
                self._mailbox,
                self._slot_words,
                self.size,
                self.me,
                self._agreements,
                out.data_ptr(),
                self._status,
                timeout_ns,
                check_words,
                flag_word,
            ],
        )
        self._agree_host[: out.numel()].copy_(out, non_blocking=True)
        self._agree_done.record(torch.cuda.current_stream(self.device))
        return DeviceExchange(self, n)

    def _clear_refusal(self) -> None:
        """Clear status code 5 (a refused agreement): the launches it skipped have run, on every member."""
        stream = torch.cuda.current_stream(self.device)
        self.status.zero_()
        stream.synchronize()  # also lands every mirror of the status still in flight
        self.status_host.zero_()

    # -- zero-copy combine -----------------------------------------------------------------------------
    def combine_input(
        self,
        handle: Any,
        rows: int,
        hidden: int,
        dtype: torch.dtype,
        timeout_ns: int,
        max_rows: int,
        tables: ExpandedTables | None = None,
    ) -> Any:
        """``[rows, hidden]`` of ``dtype`` at the start of this member's workspace, for ``handle``'s expert
        outputs, once every member has finished reading the last operation (a one-block wait, stream-ordered
        before whatever writes the rows); None where ``dtype`` is not one combine sums or ``max_rows`` (the
        most any member can hold) would not fit before the table, with an expanded handle's ``tables`` after
        them: bounds the same on every member, so that they all take the same way. Arms the combine of
        ``handle`` to read them there (:meth:`reduce_partials`)."""
        key = (rows, hidden, dtype)
        view = self._views.get(key)
        if view is None or tables is not None:  # a cached view met the rows' bound; tables differ by handle
            if dtype not in _COMBINE_CODES:
                return None
            size = dtype.itemsize
            if max(rows, max_rows) * hidden * size > self._table_offset:
                return None
            if tables is not None and tables.end > self._table_offset:
                return None
        if view is None:
            view = self._views[key] = self.workspace[: rows * hidden * size].view(dtype).view(rows, hidden)
        self.launchers["ep_combine_zero_copy"](
            1, [self._peer_sig, self.size, self.me, self._status, timeout_ns]
        )
        self.armed = handle
        return view

    def takes_in_place(self, x: torch.Tensor, handle: Any) -> bool:
        """Whether ``x`` is the zero-copy input :meth:`combine_input` handed out for ``handle`` (a rank that
        received no rows has an empty one, with no address: it still combines in place, as its peers do)."""
        return self.armed is handle and (x.numel() == 0 or x.data_ptr() == self._ws)

    def aliases_workspace(self, x: torch.Tensor) -> bool:
        """Whether ``x`` lies in this member's workspace, or is a view :meth:`combine_input` handed out (an
        empty one has no address)."""
        if any(x is v for v in self._views.values()):
            return True
        return self._ws <= x.data_ptr() < self._ws + self.workspace.numel()

    def publish_expanded_maps(
        self, index: torch.Tensor, weights: torch.Tensor | None, tables: ExpandedTables
    ) -> None:
        """Copy an expanded handle's ``[N, K]`` index (as int32) and routing weights into this member's
        workspace at ``tables``' offsets, where the sources of a zero-copy combine read them (stream-ordered
        before the combine's waiting launch, which publishes them with the rows)."""
        n, k = index.shape
        if n == 0:
            return
        ws = self.workspace
        ws[tables.index_offset : tables.index_offset + n * k * 4].view(torch.int32).view(n, k).copy_(index)
        if weights is not None:
            at = tables.weights_offset
            ws[at : at + n * k * 4].view(torch.float32).view(n, k).copy_(weights)

    def reduce_partials(
        self,
        partial: torch.Tensor,
        recv_starts: torch.Tensor,
        out: torch.Tensor,
        mask: torch.Tensor,
        send_slot: torch.Tensor,
        bias: tuple[torch.Tensor, ...],
        num_sms: int,
        timeout_ns: int,
        pull: bool = False,
        expanded: tuple[ExpandedTables, int, int, bool] | None = None,
    ) -> None:
        """Wait for every member's partial rows and sum each token's in the reference order into ``out``;
        ``pull``: a zero-copy combine, where every member's rows stay in its own workspace (``partial`` here):
        the waiting launch first publishes where this member's are, then reads the others' there.
        ``expanded``: a zero-copy combine of an expanded handle, ``(tables, received rows, K, weighted)``:
        every member's expanded rows and maps are in its workspace (:meth:`publish_expanded_maps`), and each
        source reduces its tokens' rows there, member by member, in the reference order."""
        lay = self.layout
        head = [
            partial.data_ptr(),
            expanded[1] if expanded is not None else partial.shape[0],
            recv_starts.data_ptr(),
            self._ws,
            self._sig,
            lay.region_bytes,
            lay.row_stride,
            mask.data_ptr(),
            send_slot.data_ptr(),
            bias[0].data_ptr() if len(bias) > 0 else 0,
            bias[1].data_ptr() if len(bias) > 1 else 0,
            out.data_ptr(),
            out.shape[0],
            out.shape[1],
            self.size,
            self.me,
        ]
        tail = [_COMBINE_CODES[out.dtype], self._done[3], self._status, timeout_ns]
        tail += [self._peer_ws, self._peer_sig, self._table_offset]
        if expanded is not None:
            tables, _, k, weighted = expanded
            tail += [2, tables.index_offset, tables.weights_offset, k, int(weighted)]
        else:
            tail += [int(pull), 0, 0, 0, 0]
        launch = self.launchers["ep_combine_recv"]
        # Stage 0 waits (one block spins), stage 1 sums on every SM: see combine.cuh.
        launch(1, [*head, 0, *tail])
        launch(max(num_sms, self.device_sms), [*head, 1, *tail])
        self._mirror()
