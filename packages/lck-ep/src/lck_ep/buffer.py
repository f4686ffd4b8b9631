"""``lck_ep.Buffer``: DeepEP-style expert-parallel dispatch and combine over one process group.

Placement: the group's ``W`` ranks host ``E`` experts contiguously, rank ``r`` holding experts
``[r * E/W, (r + 1) * E/W)`` (its ``L = E/W`` *local* experts, numbered 0..L-1 on that rank).

Dispatch sends each token once to every rank that hosts any of its experts (``-1`` slots select none).
A rank receives rows ordered by source rank ascending, then by token index on the source ascending,
with the routing re-expressed for the receiver: ``recv_topk_idx[n, k]`` is the local expert index of
slot k when that slot's expert lives on this rank, else -1; ``recv_topk_weights[n, k]`` is the slot's
weight there, else 0. With ``expand=True`` the received rows are laid out expert-major instead, one
row per (received token, local slot), each expert's segment padded to ``expert_alignment`` rows, ready
for a grouped GEMM (see :mod:`lck_ep.handle` for the exact layout and the maps back).

Combine returns to each source rank the sum, over the ranks its token went to, of those ranks' rows
for it. It does not weight: the caller weights the expert outputs before combine, except with an
expanded handle, where ``topk_weights`` (the ``recv_topk_weights`` of dispatch) may be passed and each
expanded row is multiplied by its slot's weight while the rows of one token are reduced on the
receiving rank. The order of every sum is fixed (:mod:`lck_ep.reference`, :mod:`lck_ep.expanded`), so
combine is bit for bit reproducible, across runs and between the synced and sync-free modes.

Modes. *Synced* (default): outputs have the exact received size and the counts are host lists; one
host synchronisation per fresh dispatch, in the count exchange, which also carries the cross-rank
argument check (on the native backend a small compact dispatch's outputs are views of tensors sized for
the Buffer's capacity, at most ``early_receive_bytes`` in all, 16 MiB by default: its kernels run before
the counts reach the host). *Sync-free* (``Buffer(..., sync_free=True)`` or
``dispatch(..., num_worst_tokens=n)``): outputs are sized by capacity (``num_worst_tokens``, default
``max_tokens_per_rank * W``), valid rows first and padding rows after (``-1`` indices and source rows,
``0`` weights; the padding rows of ``recv_x`` are unspecified: the native backend does not write them, as
DeepEP's ``num_worst_tokens`` mode does not, since zeroing a capacity-sized output moves more bytes than the
tokens do; the reference backend writes zeros there); counts stay on the device; nothing reads a device value on the host, so the call can be captured in a CUDA graph. Eagerly
this mode skips the per-call cross-rank check (it would need a host round trip): static parameters were
agreed when the Buffer was built, and local checks still raise before anything is launched. Under a
CUDA-graph capture the check runs through the host (:mod:`lck_ep.capture`), so a problem on one rank
raises the same error on every rank at capture time, not a hang at replay. A received count above
``num_worst_tokens`` drops the rows past it (``handle.num_recv_tokens`` tells).

Backends. Data moves over ``torch.distributed.all_to_all_single`` (gloo on CPU, NCCL on GPU; the
reference backend). On CUDA the dispatch layout comes from the JIT-compiled layout kernel
(``layout="auto"`` when nvcc and the runtime JIT are available, or ``"kernel"``), else from torch
ops; both give identical layouts. The construction checks live in :mod:`lck_ep._construction`, the
data movement after a call's agreement in :mod:`lck_ep._exchange`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lck_ep import _exchange, _native_exchange, capture, fp8, reference
from lck_ep._construction import check_args, check_group, resolve_device

# Re-exported: lck_ep.benchmark imports it from this module.
from lck_ep._construction import kernel_layout_available as kernel_layout_available
from lck_ep.agreement import BUFFER_FIELDS, DIGEST_FIELDS, Agreement, RoutedCounts, agree, start_agreement
from lck_ep.checks import (
    X_DTYPES,
    CombinePlan,
    DispatchPlan,
    check_combine,
    check_dispatch,
    check_handle,
    check_tensor,
)
from lck_ep.events import Event
from lck_ep.expanded import most_expanded_rows
from lck_ep.handle import DispatchHandle
from lck_ep.knobs import current_knobs
from lck_ep.layout import DispatchLayout, get_dispatch_layout
from lck_ep.native import DEFAULT_NUM_SMS, EXPANDED_ZERO_COPY_TOPK, NATIVE_DTYPES, expanded_tables, row_fits

__all__ = ["Buffer", "CombineOutput", "DispatchOutput"]

_UIDS = itertools.count(1)


class DispatchOutput(NamedTuple):
    """``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; unpacks as a 5-tuple."""

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a pair for FP8 rows
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    handle: DispatchHandle
    event: Event

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """``[L]`` int32 on the device: exact (token, slot) entries received per local expert."""
        return self.handle.num_recv_tokens_per_expert

    @property
    def num_recv_tokens_per_expert_list(self) -> list[int] | None:
        """The same as a host list (synced mode), ``None`` in sync-free mode."""
        return self.handle.num_recv_tokens_per_expert_list


class CombineOutput(NamedTuple):
    combined_x: torch.Tensor
    event: Event


class Buffer:
    """Expert-parallel dispatch/combine for one process group (collective construction).

    Args:
        group: the expert-parallel ``ProcessGroup``; every member constructs its Buffer with the same
            arguments, in the same order as its other collectives.
        max_tokens_per_rank: most tokens any rank dispatches in one call (capacity, >= 1).
        hidden: the hidden size of a token row.
        num_topk: slots per token in ``topk_idx`` (1..64, at most ``num_experts``).
        num_experts: experts over the whole group; a multiple of the group size.
        sync_free: size every dispatch by capacity, with no host synchronisation (see module doc).
        layout: ``"auto"``, ``"kernel"`` (the JIT layout kernel, CUDA only) or ``"torch"``.
        device: where tensors live; default ``cuda:<current>`` for an NCCL group, else ``cpu``.
        backend: ``"auto"`` (the native kernels when ``lck_runtime.configure(moe=...)`` prepared a native
            context for ``group`` and they can be built here, else the reference), ``"nvshmem"`` (the
            native kernels, or a ``ValueError`` saying why they cannot run) or ``"reference"``.
            :attr:`backend` says which one runs. The native backend moves bf16/fp16 rows; it also takes a
            gloo ``group`` with CUDA tensors (the agreement then runs through the host).
        num_sms: blocks (channels) of the native kernels that send rows to other ranks; default ``min(24,
            SMs)`` (the receivers' local passes wait on nobody and use the whole GPU). A runtime argument:
            any value reuses the same compiled kernels.
        timeout_s: how long a native kernel waits for a peer before it gives up and the call raises
            :class:`lck_ep.native.NativeTimeoutError` (naming the rank and the phase) instead of hanging.
            Over several (virtual) hosts the dispatch receiver waits twice this, since a source of its host
            may itself wait this long on a stopped rank of another host before it publishes.
        early_receive_bytes: on the native backend, a synced compact dispatch whose outputs at the Buffer's
            capacity (``W * max_tokens_per_rank`` rows of ``recv_x`` and routing) take at most this many
            bytes launches its receiving kernels before the host reads the counts, into tensors of that
            size, and returns views narrowed to the agreed counts (the storage behind them keeps the
            capacity). Larger calls otherwise leave the GPU idle while the host reads the counts; raising
            this trades that gap for memory. ``None``: 16 MiB (DeepSeek-V3's rows at 128 tokens per rank
            over 8 ranks); 0: never. The same on every rank.

    Validated (the same ``ValueError``/``TypeError`` on every rank): the group and its membership, the
    integer arguments and their relations, agreement of all of them across ranks, and, when the runtime
    has a configured MoE context for ``group``, that they fit its ``MoEConfig`` (``max_tokens``,
    ``hidden_size`` and ``top_k`` as capacities, ``num_experts`` exactly). With that context the Buffer
    takes its topology (``num_hosts``, ``gpus_per_host``); without it the group is one host.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        num_experts: int,
        *,
        sync_free: bool = False,
        layout: str = "auto",
        device: torch.device | str | None = None,
        backend: str = "auto",
        num_sms: int | None = None,
        timeout_s: float = 5.0,
        early_receive_bytes: int | None = None,
    ) -> None:
        rank, world, pg_backend = check_group(group)
        self.group, self.rank, self.num_ranks = group, rank, world
        home, self.device, error = resolve_device(device, pg_backend)
        self._home = home  # where the agreements run: the host for a gloo group
        settled = None
        self._native = None
        if error is None:
            try:
                settled = check_args(
                    group,
                    world,
                    self.device,
                    pg_backend,
                    max_tokens_per_rank,
                    hidden,
                    num_topk,
                    num_experts,
                    sync_free,
                    layout,
                    backend,
                    num_sms,
                    timeout_s,
                    early_receive_bytes,
                )
                if settled.backend == "nvshmem":
                    from lck_ep.native import NativeEp

                    state = NativeEp
                    if settled.num_hosts > 1:  # several (virtual) hosts: the hybrid kernels
                        from lck_ep._hybrid_exchange import HybridEp as state
                    self._native = state.for_context(settled.moe_context, self.device)
                    if settled.use_kernel_layout:
                        # Loaded now, not at the first dispatch: a module loaded while a peer sharing the GPU
                        # (MPS) spins in a native kernel can stall both until the timeout.
                        from lck_ep.jit import kernel_for
                        from lck_ep.knobs import read_knobs

                        kernel_for(self.device.index, read_knobs()).load(self.device.index)
            except (TypeError, ValueError) as exc:
                error = exc
            except Exception as exc:  # e.g. the kernels failed to build here: every rank raises it
                error = RuntimeError(
                    f"Buffer: the native backend could not start: {type(exc).__name__}: {exc}"
                )
        digest = None
        if error is None:
            digest = [
                3,
                max_tokens_per_rank,
                hidden,
                num_topk,
                num_experts,
                int(sync_free),
                int(self.device.type == "cuda"),
                # the hybrid kernels' geometry too: it must agree across ranks (EP_* knobs)
                getattr(self._native, "signature", 1)
                if settled is not None and settled.backend == "nvshmem"
                else 0,
                settled.early_receive_bytes if settled is not None else 0,
            ]
        agree(group, home, error, BUFFER_FIELDS, digest, None, 0)
        assert settled is not None
        self.backend = settled.backend
        if self._native is not None:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.num_sms = min(DEFAULT_NUM_SMS, sms) if num_sms is None else num_sms
        else:
            self.num_sms = num_sms or 0
        self.timeout_s = float(timeout_s)
        self.timeout_ns = int(self.timeout_s * 1e9)
        self.early_receive_bytes = settled.early_receive_bytes
        # Synced calls agree through the native workspaces on the Buffer's device, or through the group (on _home)
        # for the reference and hybrid backends and with EP_DEVICE_AGREEMENT=0 (the same on every rank: part of
        # the construction digest above).
        self._gather = None
        if self._native is not None and self._native.device_agreement:
            self._gather = self._device_gather()
        self.use_kernel_layout = settled.use_kernel_layout
        # The layout kernel's knobs, read once here (as the native kernels' are) instead of from the
        # environment on every dispatch (eight variables: about 20 us of host time a call).
        self._layout_knobs = current_knobs() if self.use_kernel_layout else None
        self.moe_context = settled.moe_context
        self.num_hosts, self.gpus_per_host = settled.num_hosts, settled.gpus_per_host
        self.max_tokens_per_rank = max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.num_experts = num_experts
        self.num_local_experts = num_experts // world
        self.sync_free = sync_free
        self.uid = next(_UIDS)
        self._seq = 0
        self._topo = reference.Topology(
            group=group,
            rank=rank,
            world=world,
            num_experts=num_experts,
            num_local_experts=self.num_local_experts,
            max_tokens_per_rank=max_tokens_per_rank,
            device=self.device,
        )

    # ------------------------------------------------------------------ properties

    @property
    def worst_case_tokens(self) -> int:
        """Most rows a rank can receive in one dispatch: ``max_tokens_per_rank * num_ranks``."""
        return self.max_tokens_per_rank * self.num_ranks

    def __repr__(self) -> str:
        return (
            f"Buffer(rank={self.rank}/{self.num_ranks}, max_tokens_per_rank={self.max_tokens_per_rank}, "
            f"hidden={self.hidden}, num_topk={self.num_topk}, num_experts={self.num_experts}, "
            f"sync_free={self.sync_free}, device={self.device}, layout={'kernel' if self.use_kernel_layout else 'torch'}, "
            f"backend={self.backend!r})"
        )

    # ------------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor) -> DispatchLayout:
        """The layout of this rank's routing (not collective, no host synchronisation).

        ``topk_idx`` ``[num_tokens, num_topk]`` int64 on the Buffer's device, ``num_tokens <=
        max_tokens_per_rank``. Returns ``num_tokens_per_rank [W]`` int32, ``num_tokens_per_expert [E]``
        int32, ``is_token_in_rank [num_tokens, W]`` bool (see :mod:`lck_ep.layout`).
        """
        where = "get_dispatch_layout"
        if (
            isinstance(topk_idx, torch.Tensor)
            and topk_idx.dim() == 2
            and topk_idx.shape[0] > self.max_tokens_per_rank
        ):
            raise ValueError(
                f"{where}: topk_idx has {topk_idx.shape[0]} tokens, more than max_tokens_per_rank={self.max_tokens_per_rank}"
            )
        n = topk_idx.shape[0] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() >= 1 else None
        check_tensor(
            topk_idx,
            "topk_idx",
            where=where,
            dtypes=(torch.int64,),
            shape=(n, self.num_topk),
            device=self.device,
        )
        return self._layout(topk_idx)

    def _layout(self, topk_idx: torch.Tensor) -> DispatchLayout:
        # This module's global, looked up per call: a test replaces it to prove that a replay skips it.
        return get_dispatch_layout(
            topk_idx,
            self.num_experts,
            self.num_ranks,
            use_kernel=self.use_kernel_layout,
            knobs=self._layout_knobs,
        )

    # ------------------------------------------------------------------ dispatch

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        handle: DispatchHandle | None = None,
        expand: bool | None = None,
        expert_alignment: int | None = None,
        num_worst_tokens: int | None = None,
    ) -> DispatchOutput:
        """Send each token to the ranks hosting its experts. Collective over the Buffer's group.

        Args:
            x: ``[num_tokens, hidden]`` bf16/fp16/fp32, contiguous, ``num_tokens <= max_tokens_per_rank``;
                or FP8 rows as a pair ``(x_fp8 [num_tokens, hidden] float8_e4m3fn, x_scales [num_tokens,
                hidden / 128] float32)`` (hidden a multiple of 128), returned as the same kind of pair.
            topk_idx: ``[num_tokens, num_topk]`` int64, global expert indices in ``[0, E)`` or -1.
            topk_weights: optional ``[num_tokens, num_topk]`` float32.
            handle: replay the layout of an earlier dispatch of this Buffer (then ``x`` must have that
                dispatch's ``num_tokens`` and ``topk_idx``/``topk_weights`` are not given): the layout
                and counts are not recomputed and only the rows move (a synced call still agrees on its
                arguments across ranks, one small all-gather). Returns ``None`` for the routing outputs.
            expand: return the expanded expert-major layout (see :mod:`lck_ep.handle`).
            expert_alignment: pad each expert's expanded segment to a multiple of this (1..4096;
                ``expand=True`` only).
            num_worst_tokens: make this call sync-free with outputs of this many rows
                (``1..max_tokens_per_rank * W``); default: the Buffer's mode.

        Returns :class:`DispatchOutput` ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``:
        ``recv_x`` ``[N, hidden]`` (or ``[M, hidden]`` expanded) in ``x.dtype``; ``recv_topk_idx``
        ``[N, num_topk]`` int64 local expert indices or -1; ``recv_topk_weights`` ``[N, num_topk]``
        float32 (0 where -1) or None without ``topk_weights``. In synced mode ``topk_idx`` entries outside
        ``[-1, E)`` are rejected (on every rank); in sync-free mode they are ignored like -1.
        """
        sync_free = (
            self.sync_free
            or (isinstance(handle, DispatchHandle) and handle.sync_free)
            or (num_worst_tokens is not None and num_worst_tokens != 0)
        )
        plan: DispatchPlan | None = None
        error: BaseException | None = None
        try:
            plan = check_dispatch(
                self, x, topk_idx, topk_weights, handle, expand, expert_alignment, num_worst_tokens
            )
            self._check_native_rows(plan, "dispatch")
        except (TypeError, ValueError) as exc:
            error = exc
        if plan is not None and plan.sync_free != sync_free:  # e.g. a synced handle on a sync-free Buffer
            sync_free = plan.sync_free
        if capture.capturing(self.device):
            self._agree_in_capture("dispatch", plan, error, sync_free)
            assert plan is not None
            return self._dispatch_sync_free(plan)
        if sync_free:
            if error is not None:
                raise error
            assert plan is not None
            return self._dispatch_sync_free(plan)
        return self._dispatch_synced(plan, error)

    def _device_gather(self) -> Any:
        """The native state's exchange through the workspaces (:meth:`lck_ep.native.NativeEp.agree_start`),
        with this Buffer's bound."""
        st, timeout_ns = self._native, self.timeout_ns
        assert st is not None
        return lambda head, routed, n, check_words, flag_word: st.agree_start(
            head, timeout_ns, check_words, flag_word, routed, n
        )

    def _agree(
        self,
        error: BaseException | None,
        digest: list[int] | None,
        extra: RoutedCounts | None,
        flag: Any = None,
    ) -> Agreement:
        """A synced call's agreement (:func:`lck_ep.agreement.start_agreement`): over the group, complete on
        return, or through the native workspaces on the Buffer's device when ``_gather`` is set, deferred:
        the call's launches may then be enqueued before :meth:`Agreement.result`, which the device skips on
        every rank when the arguments are refused."""
        home = self._home if self._gather is None else self.device
        agreement = start_agreement(
            self.group,
            home,
            error,
            DIGEST_FIELDS,
            digest,
            extra,
            1 + self.num_ranks + self.num_experts,
            self._gather,
            flag,
        )
        if error is not None:
            agreement.result()  # raises: this rank has nothing to launch
        return agreement

    @staticmethod
    def _then(agreement: Agreement, launch: Any) -> Any:
        """``launch()`` enqueued before a deferred agreement's verdict is read (before a complete one's, it
        has been), then the verdict: a refusal raises on every rank, the launches having returned at once."""
        try:
            out = launch()
        except BaseException:
            agreement.result()  # a refusal is why: raise it rather than what it caused
            raise
        agreement.result()
        return out

    def _check_native_rows(self, plan: DispatchPlan | CombinePlan, op: str) -> None:
        """The native kernels move rows as bytes within the workspace's rows (sized by the MoEConfig for
        2-byte hidden states): refuse, naming x, a dtype they do not take or a row that does not fit."""
        if self._native is None:
            return
        x = plan.x
        scales = getattr(plan, "x_scales", None)
        row = x.shape[1] * x.element_size() + (0 if scales is None else scales.shape[1] * 4)
        if x.dtype not in NATIVE_DTYPES or not row_fits(row, self.num_topk, self._native.layout):
            raise TypeError(
                f"{op}: x is {str(x.dtype).replace('torch.', '')} [*, {x.shape[1]}] ({row} bytes a row) but the "
                f"native backend's workspace rows hold {self._native.layout.row_stride} bytes with the routing "
                f"(MoEConfig.hidden_size={self._native.ctx.config.hidden_size} of 2-byte values); use bf16/fp16/"
                "fp8 rows, a larger MoEConfig, or backend='reference'"
            )

    def check_errors(self) -> None:
        """Synchronise and raise :class:`lck_ep.native.NativeTimeoutError` if a native wait of this
        Buffer's context gave up (a peer stopped calling); no-op on the reference backend."""
        if self._native is not None:
            self._native.check()

    def _agree_in_capture(
        self, op: str, plan: DispatchPlan | CombinePlan | None, error: BaseException | None, sync_free: bool
    ) -> None:
        """Under CUDA-graph capture: the same error on every rank for a problem on any (see
        :mod:`lck_ep.capture`), and a clear one for a synced call, which must read counts on the host."""
        capture.agree_in_capture(self.group, error, plan.digest() if plan is not None else None)
        if not sync_free:  # the digests agreed, so every rank is here
            raise ValueError(
                f"{op}: a synced {op} reads the received counts on the host, which a CUDA-graph capture "
                f"cannot do; capture sync-free calls (Buffer(..., sync_free=True) or dispatch(..., "
                f"num_worst_tokens=n)) instead"
            )

    def _dispatch_synced(self, plan: DispatchPlan | None, error: BaseException | None) -> DispatchOutput:
        w, e, big_l, r = self.num_ranks, self.num_experts, self.num_local_experts, self.rank
        layout = None
        extra: RoutedCounts | None = None
        if plan is not None and plan.handle is None:
            assert plan.topk_idx is not None
            try:
                layout = self._layout(plan.topk_idx)
            except Exception as exc:  # e.g. the layout kernel failed to build on this rank: tell every rank
                error, plan = exc, None
            else:
                # The flag and counts words: read by the device exchange's own kernel, else made by torch ops.
                extra = RoutedCounts(
                    plan.topk_idx, e, layout.num_tokens_per_rank, layout.num_tokens_per_expert
                )
        digest = plan.digest() if plan is not None else None
        if plan is not None and plan.handle is not None:  # a replay needs nothing from the table
            agreement = self._agree(error, digest, None)
            given, plan = plan, self._packed(plan)
            h = plan.handle
            if self._native is not None:
                recv_x = self._then(agreement, lambda: _native_exchange.replay(self, h, plan.x))
            else:
                recv_x = self._then(agreement, lambda: _exchange.replay_synced(self._topo, h, plan.x))
            return DispatchOutput(self._unpacked(recv_x, given), None, None, h, Event(self.device))

        def out_of_range(ranks: list[int]) -> str:
            return (
                f"dispatch: topk_idx on rank {ranks[0]} has entries outside [-1, {e}) "
                f"(expected -1 or a global expert index; ranks with such entries: {ranks})"
            )

        agreement = self._agree(error, digest, extra, out_of_range)
        assert plan is not None and layout is not None
        given, plan = plan, self._packed(plan)
        slots = early = None
        if self._native is not None:  # the sender needs no counts: it runs while the host waits for them
            packed = plan
            # Small, with the table still to come: the receiver too, at capacity (latency-bound calls)
            if agreement.deferred and _native_exchange.receives_early(self, packed):
                early = self._then(agreement, lambda: _native_exchange.receive_early(self, packed, layout))
            else:
                slots = self._then(agreement, lambda: _native_exchange.send(self, packed, layout))
        table = agreement.result()
        # Each rank's tokens per rank as Python ints at once (an op per element costs the host more).
        heads = table[:, : 1 + w].tolist()
        send_counts = heads[r][1:]
        recv_counts = [heads[s][1 + r] for s in range(w)]
        mine = 1 + w + r * big_l  # this rank's experts' columns
        per_local = table[:, mine : mine + big_l].sum(0).tolist()
        if self._native is not None:
            counts = (send_counts, recv_counts, per_local)
            most = None
            if plan.expand:  # every rank's expanded rows from the same table: a bound alike everywhere
                most = most_expanded_rows(table[:, 1 + w : 1 + w + e], w, plan.expert_alignment)
            got = _native_exchange.dispatch(self, plan, layout, counts, slots, early, most_expanded=most)
        else:
            got = _exchange.dispatch_synced(self, plan, layout, send_counts, recv_counts, per_local)
        return DispatchOutput(self._unpacked(got[0], given), *got[1:], Event(self.device))

    def _dispatch_sync_free(self, plan: DispatchPlan) -> DispatchOutput:
        given, plan = plan, self._packed(plan)
        h = plan.handle
        if h is not None:
            if self._native is not None:
                recv_x = _native_exchange.replay(self, h, plan.x)
            else:
                recv_x = _exchange.replay_sync_free(self._topo, h, plan.x, plan.num_worst_tokens)
            return DispatchOutput(self._unpacked(recv_x, given), None, None, h, Event(self.device))
        assert plan.topk_idx is not None
        if self._native is not None:
            got = _native_exchange.dispatch(self, plan, self._layout(plan.topk_idx), None)
        else:
            got = _exchange.dispatch_sync_free(self, plan, self._layout(plan.topk_idx))
        return DispatchOutput(self._unpacked(got[0], given), *got[1:], Event(self.device))

    @staticmethod
    def _packed(plan: DispatchPlan) -> DispatchPlan:
        """FP8 rows travel as one byte row per token (values, then scales): see :mod:`lck_ep.fp8`."""
        if plan.x_scales is None:
            return plan
        return dataclasses.replace(plan, x=fp8.pack(plan.x, plan.x_scales))

    def _unpacked(
        self, recv_x: torch.Tensor, plan: DispatchPlan
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return recv_x if plan.x_scales is None else fp8.unpack(recv_x, self.hidden)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ combine

    def combine_input(self, handle: DispatchHandle, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A ``[rows, hidden]`` tensor of ``dtype`` for ``handle``'s expert outputs, to write and then pass
        as :meth:`combine`'s ``x`` (``rows``: one per received row, or per expanded row for an expanded
        handle). Not collective.

        On the native scale-up backend it is this rank's symmetric workspace: the combine's sources read
        the rows where they were written instead of this rank copying them to each source (zero-copy, about
        half the bytes the combine moves; for an expanded handle each source also reduces its tokens' expanded
        rows itself, reading each once). It is handed out once every rank has finished reading the last
        dispatch or combine (a wait ordered on the current stream before whatever writes the rows) and stays
        valid until the next dispatch or combine of this group, which overwrites it; every rank's combine must
        then take its input this way (a rank combining a plain tensor instead makes every rank raise).
        Elsewhere it is a new tensor and :meth:`combine` copies as usual, alike on every rank: on the
        reference or hybrid backend; for a compact handle whose rows would not fit the workspace at the
        Buffer's capacity (``max_tokens_per_rank * W`` rows, as float32 rows of a wide hidden size may not);
        for an expanded handle that is sync-free, has more than 32 slots, or whose largest expanded layout on
        any rank (with each received row's maps) does not fit, as at ``top_k`` near the group size unless the
        ``MoEConfig``'s ``max_tokens`` leaves room above ``max_tokens_per_rank``.
        """
        handle = check_handle(self, handle, where="combine_input")
        if dtype not in X_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in X_DTYPES)
            raise TypeError(f"combine_input: dtype must be one of {names}, got {dtype}")
        rows = handle.num_rows_in
        st = self._native
        if st is not None and st.zero_copy_combine:
            most, tables = self.worst_case_tokens, None  # rows any rank may receive
            if handle.expand:  # the most expanded rows on any rank, and their maps after them
                most = handle.most_expanded_rows
                if most is not None and handle.num_topk <= EXPANDED_ZERO_COPY_TOPK:
                    row = self.hidden * dtype.itemsize
                    tables = expanded_tables(most, row, self.worst_case_tokens, handle.num_topk)
            if not handle.expand or tables is not None:
                st.raise_if_failed()
                with torch.cuda.device(self.device):
                    view = st.combine_input(handle, rows, self.hidden, dtype, self.timeout_ns, most, tables)
                if view is not None:
                    return view
        return torch.empty(rows, self.hidden, dtype=dtype, device=self.device)

    def _check_zero_copy(self, plan: CombinePlan) -> None:
        """Refuse a combine input inside the workspace that is not the live zero-copy input of this handle."""
        st = self._native
        if st is None or not st.aliases_workspace(plan.x) or st.takes_in_place(plan.x, plan.handle):
            return
        raise ValueError(
            "combine: x lies in this group's native workspace but is not the input combine_input(handle) "
            "handed out for this handle since the last dispatch or combine (which may have overwritten "
            "it); call combine_input(handle) again before writing the rows"
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> CombineOutput:
        """Return each received row's result to its source rank and sum there. Collective.

        Args:
            x: ``[N, hidden]`` (one row per received row of ``handle``'s dispatch, in that order) or,
                for an expanded handle, ``[M, hidden]`` (one row per expanded row; padding rows are
                ignored); bf16/fp16/fp32. The output has ``x``'s dtype. The tensor :meth:`combine_input`
                returned for ``handle`` is read in place on the native backend.
            handle: the handle returned by this Buffer's dispatch.
            topk_weights: expanded handles only: ``[N, num_topk]`` float32 (dispatch's
                ``recv_topk_weights``); each expanded row is multiplied by its slot's weight.
            bias: one or two ``[num_tokens, hidden]`` tensors in ``x``'s dtype, added after the sum.

        Returns :class:`CombineOutput` ``(combined_x [num_tokens, hidden], event)``. Order of the
        arithmetic: :mod:`lck_ep.expanded` (rows of a token on a receiver) then
        :mod:`lck_ep.reference` (partials over destination ranks, then bias).
        """
        sync_free = isinstance(handle, DispatchHandle) and handle.sync_free
        plan: CombinePlan | None = None
        error: BaseException | None = None
        try:
            plan = check_combine(self, x, handle, topk_weights, bias)
            self._check_native_rows(plan, "combine")
            self._check_zero_copy(plan)
        except (TypeError, ValueError) as exc:
            error = exc
        if capture.capturing(self.device):
            self._agree_in_capture("combine", plan, error, sync_free)
        elif sync_free:
            if error is not None:
                raise error
        else:
            agreement = self._agree(error, plan.digest() if plan is not None else None, None)
            assert plan is not None
            if self._native is not None:
                out = self._then(agreement, lambda: _native_exchange.combine(self, plan))
            else:
                out = self._then(agreement, lambda: _exchange.combine(self._topo, plan))
            return CombineOutput(out, Event(self.device))
        assert plan is not None
        if self._native is not None:
            return CombineOutput(_native_exchange.combine(self, plan), Event(self.device))
        return CombineOutput(_exchange.combine(self._topo, plan), Event(self.device))
