"""The native scale-up backend's device state and kernel launches (``csrc/dispatch.cuh``, ``combine.cuh``).

One :class:`NativeEp` per configured MoE context (shared by every Buffer of that group): the addresses
of every member's symmetric workspace and signal words as mapped in this process, the kernels, a
diagnostic word and a pinned host mirror of it. The workspace is cut into one region per source member
of ``MoEConfig.max_tokens`` rows of ``row_stride`` bytes (the size the runtime reserves:
``lck_runtime.symmetric.moe_workspace_bytes``); the protocol and the row layout are in ``ep_native.cuh``.

A dispatch is send slots, sender, receiver (a one-block wait, then the routing laid out on every SM),
for ``expand=True`` the expanded maps, and the row copy out of the workspace (every SM), which releases
the workspace for the next operation; a combine is, for an expanded handle, the expanded reduction, then
sender and receiver (a one-block wait, then the sums on every SM). ``num_sms`` sizes the senders, the
kernels that write into other members' workspaces; the receivers' local passes wait on nobody and take
the whole GPU, like the torch ops they replace.

Waits are bounded: a member that does not arrive within the Buffer's ``timeout_s`` leaves a diagnostic
instead of a hang; every later call on the context raises it (:class:`NativeTimeoutError`), and
:meth:`NativeEp.check` raises it after a synchronisation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lck_ep.codegen import NATIVE_KERNELS, native_spec
from lck_ep.knobs import EpKnobs, read_knobs
from lck_runtime.jit import I32, I64, U64, Jit, Ptr  # typed launch arguments, imported once (hot path)

__all__ = [
    "DEFAULT_NUM_SMS",
    "NATIVE_DTYPES",
    "NativeEp",
    "NativeTimeoutError",
    "build_native_kernels",
    "compile_native_kernels",
    "native_problem",
    "row_layout",
]

DEFAULT_NUM_SMS = 24  # channels (blocks) of the sending kernels unless the Buffer is given num_sms
# Row element types the kernels move (as bytes); combine sums bf16, fp16 and fp32 partials. A row must fit
# the workspace's rows, which the runtime sizes for 2-byte hidden states (:func:`row_fits`).
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_COMBINE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_THREADS = 512
_MAPS_BLOCKS = 1024  # expand_maps: one block per local expert up to this many, then grid-strided
_REDUCE_BLOCKS = 1024  # reduce_expanded: one warp per received row, grid-strided past this many blocks
_PHASES = {
    1: "dispatch, waiting for a destination to finish reading the previous operation",
    2: "dispatch, waiting for a source's rows",
    3: "combine, waiting for a source to finish reading the previous operation",
    4: "combine, waiting for a destination's partial rows",
}
_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], dict[str, Any]] = {}
_STATES: dict[int, NativeEp] = {}


class NativeTimeoutError(RuntimeError):
    """A native dispatch or combine waited longer than its bound for a member (or saw it out of step)."""


@dataclass(frozen=True)
class RowLayout:
    row_stride: int  # bytes per workspace row (16-byte aligned)
    region_bytes: int  # one source's region: cap rows
    cap: int  # rows per region (MoEConfig.max_tokens)


def row_layout(max_tokens: int, hidden_size: int, top_k: int) -> RowLayout:
    """The workspace geometry of a context's ``MoEConfig`` (its row as the runtime sized it)."""
    row = (hidden_size * 2 + top_k * 12 + 15) // 16 * 16
    return RowLayout(row, max_tokens * row, max_tokens)


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
        self.kernels = build_native_kernels(device.index)
        self.device_sms = torch.cuda.get_device_properties(device).multi_processor_count

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
            self.kernels["ep_send_slots"].launch(w, _THREADS, [mask, I32(t), I32(w), slot])
        return slot

    def send_rows(self, rows: OutgoingRows, num_local_experts: int, num_sms: int, timeout_ns: int) -> None:
        """Store the rows (bytes; :func:`row_fits` checked by the caller) into the destinations' regions,
        their routing at :func:`meta_offset` of the row's bytes."""
        x, mask, send_slot, rows_to, topk_idx, topk_weights = rows
        lay = self.layout
        k = topk_idx.shape[1] if topk_idx is not None else 0
        self.kernels["ep_dispatch_send"].launch(
            num_sms,
            _THREADS,
            [
                x,
                I64(x.shape[1] * x.element_size()),
                topk_idx if topk_idx is not None else Ptr(0),
                topk_weights if topk_weights is not None else Ptr(0),
                mask,
                send_slot,
                rows_to,
                self.peer_ws,
                self.peer_sig,
                I64(lay.region_bytes),
                I64(lay.row_stride),
                I64(meta_offset(x.shape[1] * x.element_size())),
                I32(x.shape[0]),
                I32(k),
                I32(self.size),
                I32(self.me),
                I32(num_local_experts),
                self.done[0:1],
                self.status,
                U64(timeout_ns),
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

        def opt(name: str) -> Any:
            t = out.get(name)
            return Ptr(0) if t is None else t

        # Stage 0 waits (one block spins), stage 1 lays out on every SM: see dispatch.cuh.
        for stage, blocks in ((0, 1), (1, max(num_sms, self.device_sms))):
            self.kernels["ep_dispatch_recv"].launch(
                blocks,
                _THREADS,
                [
                    self.workspace,
                    self.signals,
                    I64(lay.region_bytes),
                    I64(lay.row_stride),
                    I64(meta_offset(row_bytes)),
                    I64(cap),
                    I64(rows),
                    I32(self.size),
                    I32(self.me),
                    I32(num_topk),
                    I32(1 if has_meta else 0),
                    I32(num_local_experts),
                    opt("recv_src_idx"),
                    opt("recv_topk_idx"),
                    opt("recv_topk_weights"),
                    opt("recv_src_rank"),
                    opt("recv_counts"),
                    opt("recv_starts"),
                    opt("slot_pos"),
                    opt("num_recv"),
                    opt("per_expert"),
                    opt("kept_per_expert"),
                    I32(stage),
                    self.status,
                    U64(timeout_ns),
                ],
            )

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
        [N, K]: :func:`lck_ep.expanded.build_expanded`'s result."""
        big_l = kept_counts.shape[0]
        self.kernels["ep_expand_maps"].launch(
            min(big_l, _MAPS_BLOCKS),
            _THREADS,
            [
                recv_topk_idx,
                kept_counts,
                I64(recv_topk_idx.numel()),
                I64(src_row.shape[0]),
                I32(recv_topk_idx.shape[1]),
                I32(big_l),
                I32(alignment),
                offsets,
                src_row,
                slot,
                index,
                self.status,
            ],
        )

    def copy_rows(
        self,
        x: torch.Tensor,
        recv_starts: torch.Tensor,
        src_row: torch.Tensor | None,
        out: torch.Tensor,
        num_sms: int,
        rows_end: torch.Tensor | None = None,
    ) -> None:
        """``out[m]`` = received row ``src_row[m]`` (zero where -1) for ``m`` below ``rows_end[0]`` (the
        expanded rows in use, ``expert_offsets[L]``; all rows without it), or without ``src_row`` received
        row ``m`` for ``m`` below the rows received, straight from the workspace (or ``x`` for this member's
        own rows); later rows (a sync-free output's capacity padding) are not written. Then this member has
        finished reading the operation (the dispatch's publication).

        It waits for nothing, so it may take every SM without stalling a peer (the channel limit
        ``num_sms`` is for the kernels that spin on other members), like a torch copy of the same rows."""
        lay = self.layout
        x_bytes = x.shape[1] * x.element_size()
        self.kernels["ep_dispatch_rows"].launch(
            max(num_sms, self.device_sms),
            _THREADS,
            [
                x,
                self.workspace,
                self.signals,
                I64(lay.region_bytes),
                I64(lay.row_stride),
                I64(meta_offset(x_bytes)),
                I64(x_bytes),
                recv_starts,
                Ptr(0) if src_row is None else src_row,
                Ptr(0) if rows_end is None else rows_end,
                I64(out.shape[0]),
                I32(self.size),
                I32(self.me),
                out,
                self.done[1:2],
                self.status,
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
        self.kernels["ep_reduce_expanded"].launch(
            max(1, min((n + _THREADS // 32 - 1) // (_THREADS // 32), _REDUCE_BLOCKS)),
            _THREADS,
            [
                x,
                index,
                weights if weights is not None else Ptr(0),
                partial,
                I64(n),
                Ptr(0) if rows_used is None else rows_used,
                I32(index.shape[1]),
                I32(partial.shape[1]),
                I32(_COMBINE_CODES[partial.dtype]),
            ],
        )

    def partials_args(self, sent: OutgoingPartials) -> list:
        """The leading launch arguments of every combine-send kernel (this one and the hybrid pair's): the
        partial rows, where each source's rows start, and the peers' regions."""
        partial, recv_counts, recv_starts = sent
        lay = self.layout
        return [
            partial,
            I64(partial.shape[1] * partial.element_size()),
            I64(partial.shape[0]),
            recv_counts,
            recv_starts,
            self.peer_ws,
            self.peer_sig,
            I64(lay.region_bytes),
            I64(lay.row_stride),
        ]

    def send_partials(self, sent: OutgoingPartials, num_sms: int, timeout_ns: int) -> None:
        self.kernels["ep_combine_send"].launch(
            num_sms,
            _THREADS,
            [
                *self.partials_args(sent),
                I32(self.size),
                I32(self.me),
                self.done[2:3],
                self.status,
                U64(timeout_ns),
            ],
        )

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
    ) -> None:
        lay = self.layout
        b0 = bias[0] if len(bias) > 0 else Ptr(0)
        b1 = bias[1] if len(bias) > 1 else Ptr(0)
        # Stage 0 waits (one block spins), stage 1 sums on every SM: see combine.cuh.
        for stage, blocks in ((0, 1), (1, max(num_sms, self.device_sms))):
            self.kernels["ep_combine_recv"].launch(
                blocks,
                _THREADS,
                [
                    partial,
                    I64(partial.shape[0]),
                    recv_starts,
                    self.workspace,
                    self.signals,
                    I64(lay.region_bytes),
                    I64(lay.row_stride),
                    mask,
                    send_slot,
                    b0,
                    b1,
                    out,
                    I32(out.shape[0]),
                    I32(out.shape[1]),
                    I32(self.size),
                    I32(self.me),
                    I32(stage),
                    I32(_COMBINE_CODES[out.dtype]),
                    self.done[3:4],
                    self.status,
                    U64(timeout_ns),
                ],
            )
        self._mirror()
