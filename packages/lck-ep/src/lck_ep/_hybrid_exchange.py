"""The hybrid backend's device state and its two sending launches (:mod:`lck_ep.hybrid`).

:class:`HybridEp` is a :class:`lck_ep.native.NativeEp` whose row-sending (``send_rows``) and partial-sending
(``send_partials``) launches are the hybrid pair's; every other step of a dispatch, replay or combine (send
slots, receive, expanded maps and rows, reductions) is the native kernels', driven by
:mod:`lck_ep._native_exchange` unchanged, because the hybrid kernels leave the workspace and the arrival
words exactly as the native senders do.

Per launch the host computes, with a few device ops and no host synchronisation, each host stream (the
tokens that go to a host, in token order: ``host_tokens [NH, T]``, ``host_rows [NH]``) and the rows sent to
every rank before each token (``excl [T, W]``, the first send slot a sub-part header carries). The pair is
bound once per state, like the native kernels (:func:`lck_ep.native.bind_kernels`, kinds
:data:`lck_ep.hybrid_codegen.HYBRID_KINDS`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from lck_ep.codegen import NATIVE_THREADS
from lck_ep.hybrid import (
    HybridBudgetError,
    HybridPlan,
    build_hybrid_kernels,
    forwarder,
    plan_hybrid,
    read_hybrid_options,
    stopped_member,
)
from lck_ep.hybrid_codegen import HYBRID_KINDS
from lck_ep.knobs import read_knobs
from lck_ep.native import (
    NativeEp,
    NativeTimeoutError,
    OutgoingPartials,
    OutgoingRows,
    bind_kernels,
    meta_offset,
    rows_head,
)

__all__ = ["HybridEp", "host_streams"]

_THREADS = NATIVE_THREADS  # the block the hybrid kernels are built for (hybrid_codegen)
_HYBRID_PHASES = {
    5: "hybrid dispatch, forwarder waiting for a source's sub-part puts",
    6: "hybrid dispatch, a sub-part header did not validate",
    7: "hybrid combine, forwarder waiting for a rank of its host to relay partials",
    8: "hybrid combine, source waiting for a forwarder's partial rows",
}
# The native receiver's wait for a source's dispatch rows (ep_native.cuh kPhaseDispatchArrive), and the signal
# word it waits on (kDispatchArrived: (op << 32) | rows).
_NATIVE_DISPATCH_ARRIVE = 2
_NATIVE_DISPATCH_ARRIVED = 0
_STATES: dict[int, HybridEp] = {}


def host_streams(
    mask: torch.Tensor, num_hosts: int, g: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(excl [T, W], host_tokens [NH, T], host_rows [NH])`` int32 of a dispatch's ``mask [T, W]``, by a
    few device ops (no host synchronisation): see the module docstring."""
    t = mask.shape[0]
    hmask = mask.view(t, num_hosts, g).any(2)
    host_rows = hmask.sum(0, dtype=torch.int32)
    # Tokens of each host stream first, in token order (a stable sort of "not going there").
    host_tokens = torch.argsort((~hmask).to(torch.int8), dim=0, stable=True).t().to(torch.int32).contiguous()
    as_int = mask.to(torch.int32)
    excl = (torch.cumsum(as_int, 0, dtype=torch.int32) - as_int).contiguous()
    return excl, host_tokens, host_rows


class HybridEp(NativeEp):
    """The hybrid state of one MoE context (``num_hosts > 1``) on this rank; get it with :meth:`for_context`."""

    hybrid = True
    fuses_expanded_combine = False  # its combine-send kernels take reduced partial rows
    pulls_rows = False  # its senders store rows in the destinations' regions
    zero_copy_combine = False  # its relays forward partial rows pushed to them
    agrees_on_device = False  # synced calls agree through the group (not built for the hybrid pair)
    _states = _STATES  # NativeEp.for_context's registry of this class

    def __init__(self, ctx: Any, device: torch.device) -> None:
        super().__init__(ctx, device)
        cfg = ctx.config
        self.knobs = read_knobs()
        self.options = read_hybrid_options()
        self.num_hosts = cfg.num_hosts
        self.g = ctx.gpus_per_host
        self.hybrid_base = self.size * self.layout.region_bytes
        self._plans: dict[int | None, HybridPlan] = {}
        # Validated once with the default channels; each num_sms is planned (and validated) on first use.
        base = self.plan(None)
        self.area_bytes = base.area_bytes
        self.pack = torch.empty(
            max(1, (self.num_hosts - 1) * self.area_bytes), dtype=torch.uint8, device=device
        )
        # Rows forwarded to each rank of this host per other host, then the kernel's per-block completion
        # counts (one per other host, one for this rank's own rows): DispatchArgs.fwd_rows.
        self.fwd_rows = torch.zeros(
            (self.num_hosts - 1) * self.g + self.num_hosts, dtype=torch.int32, device=device
        )
        self.tickets = torch.zeros(4, dtype=torch.int32, device=device)
        self.hybrid_kernels = build_hybrid_kernels(device.index, self.knobs)
        self.hybrid_launchers = bind_kernels(self.hybrid_kernels, HYBRID_KINDS, device.index)
        self._check_resident(base, device)
        self._cache_hybrid_addresses()
        self.launches = {"dispatch": 0, "combine": 0}  # the tests check that the hybrid pair ran

    def _cache_hybrid_addresses(self) -> None:
        """The hybrid buffers' addresses, read once (:meth:`NativeEp._cache_addresses`); ``_tickets[i]``:
        ``tickets[2 * i : 2 * i + 2]``, the dispatch's (0) and the combine's (1) pair of grid tickets."""
        self._pack = self.pack.data_ptr()
        self._fwd_rows = self.fwd_rows.data_ptr()
        step = 2 * self.tickets.element_size()
        self._tickets = (self.tickets.data_ptr(), self.tickets.data_ptr() + step)

    @property
    def signature(self) -> int:
        """The kernel pair and geometry as one int (the Buffer's construction agreement compares it across
        ranks: ranks with different EP_* hybrid settings would run different protocols)."""
        plan = self._plans[None]
        text = repr(
            (self.knobs.hybrid_kernel, sorted(self.knobs.defines().items()), plan.channels, plan.parts)
        )
        return 2 + int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)

    def plan(self, num_sms: int | None) -> HybridPlan:
        got = self._plans.get(num_sms)
        if got is None:
            got = plan_hybrid(
                config=self.ctx.config,
                num_ranks=self.size,
                num_sms=num_sms,
                knobs=self.knobs,
                options=self.options,
            )
            self._plans[num_sms] = got
        return got

    def _check_resident(self, plan: HybridPlan, device: torch.device) -> None:
        """Every block of a hybrid kernel must be resident at once: a channel waits for its peers' channel of
        the same operation, whose blocks may in turn wait for this one's. Under CUDA MPS a process gets
        its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` share of the SMs, and the device's multiprocessor count
        as this process reads it is already that share (an H200 with 8 PEs at 12%: some 16 SMs, not 132; scaling
        it again had refused 8 channels for "1 SM")."""
        props = torch.cuda.get_device_properties(device)
        sms = max(1, props.multi_processor_count)
        regs = max(k.attributes(device.index)["num_regs"] for k in self.hybrid_kernels.values())
        per_sm = max(
            1,
            min(
                props.max_threads_per_multi_processor // _THREADS,
                props.regs_per_multiprocessor // max(1, regs * _THREADS),
            ),
        )
        if plan.channels > sms * per_sm:
            raise HybridBudgetError(
                f"hybrid: {plan.channels} channels need {plan.channels} resident blocks but this process has "
                f"{sms} SMs of {per_sm} block(s) each (over by {plan.channels - sms * per_sm}); set "
                f"EP_HYBRID_CHANNELS to at most {sms * per_sm}"
            )

    def raise_if_failed(self) -> None:
        if self._status_word[0] == 0:
            return
        code, phase, who = (int(v) for v in self.status_host[:3].tolist())
        seen, want, waited = (int(v) for v in self.status_host[3:].tolist())
        if code == 1 and phase == _NATIVE_DISPATCH_ARRIVE:
            self._raise_arrival_timeout(who, want, waited)
        if phase not in _HYBRID_PHASES and code != 3:
            super().raise_if_failed()
            return
        ranks = self.ctx.ranks
        if code == 1:
            detail = f"waited {waited / 1e9:.1f} s for group rank {who} (global rank {ranks[who]})"
        elif code == 3:
            detail = f"from group rank {who} (global rank {ranks[who]}): word {seen:#x}, expected {want:#x}"
        else:
            detail = f"group rank {who} (global rank {ranks[who]}) is at {seen}, expected {want}"
        raise NativeTimeoutError(
            f"lck_ep hybrid backend on group rank {self.me}: {_HYBRID_PHASES.get(phase, f'phase {phase}')}: "
            f"{detail}. A member stopped calling dispatch/combine or called a different sequence; this "
            "context's native state is unusable now (finalize and configure again)"
        )

    def _raise_arrival_timeout(self, who: int, op: int, waited: int) -> None:
        """The native receiver timed out waiting for dispatch rows. It waits for every source at once and
        records one of those missing; over hosts a source's rows may come through a forwarder of this host,
        so name the member the missing counts point to (:func:`lck_ep.hybrid.stopped_member`), read from
        this rank's arrival words (a synchronisation: only on this failure path, never under capture)."""
        try:
            signals = self.signals
            if not (signals.is_cuda and torch.cuda.is_current_stream_capturing()):
                words = signals.view(self.size, -1)[:, _NATIVE_DISPATCH_ARRIVED].cpu().tolist()
                who = stopped_member([int(v) >> 32 == op for v in words], self.me, self.g, who)
        except Exception:  # the recorded source then: still a member the wait gave up on
            pass
        ranks = self.ctx.ranks
        detail = f"waited {waited / 1e9:.1f} s for group rank {who} (global rank {ranks[who]})"
        host = self.me // self.g
        if who // self.g != host:
            via = forwarder(who, host, self.g)
            detail += f", whose rows reach this host through group rank {via}, its forwarder here"
        raise NativeTimeoutError(
            f"lck_ep hybrid backend on group rank {self.me}: dispatch, waiting for a source's rows: {detail}. "
            "A member stopped calling dispatch/combine or called a different sequence; this context's native "
            "state is unusable now (finalize and configure again)"
        )

    # -- the two sending launches ---------------------------------------------------------------------
    def send_rows(self, rows: OutgoingRows, num_local_experts: int, num_sms: int, timeout_ns: int) -> None:
        x, mask, rows_to, topk_idx = rows.x, rows.mask, rows.rows_to, rows.topk_idx
        plan = self.plan(num_sms)
        lay = self.layout
        nh, g = self.num_hosts, self.g
        excl, host_tokens, host_rows = host_streams(mask, nh, g)
        x_bytes = x.shape[1] * x.element_size()
        # num_topk > 0 tells the kernels a dispatch's routed rows from a replay's (0), alike on every rank: a
        # rank with no tokens passes an empty topk_idx, whose address is 0 like a replay's missing one.
        k = topk_idx.shape[1] if topk_idx is not None else 0
        opt = self.options
        self.hybrid_launchers["dispatch"](
            plan.channels,
            [
                *rows_head(rows, x_bytes),
                excl.data_ptr(),
                host_tokens.data_ptr(),
                host_rows.data_ptr(),
                rows_to.data_ptr(),
                self._peer_ws,
                self._peer_sig,
                self._pack,
                lay.region_bytes,
                lay.row_stride,
                meta_offset(x_bytes),
                self.hybrid_base,
                self.area_bytes,
                mask.shape[0],
                k,
                self.size,
                self.me,
                num_local_experts,
                g,
                nh,
                plan.channels,
                plan.parts,
                plan.q_cap,
                plan.header_bytes,
                lay.cap,
                1 if opt.debug_reorder else 0,
                opt.debug_delay_us * 1000,
                self._fwd_rows,
                self._tickets[0],
                self._status,
                timeout_ns,
            ],
        )
        self.launches["dispatch"] += 1

    def send_partials(self, sent: OutgoingPartials, num_sms: int, timeout_ns: int) -> None:
        plan = self.plan(num_sms)
        lay = self.layout
        opt = self.options
        self.hybrid_launchers["combine"](
            plan.channels,
            [
                *self.partials_args(sent),
                self.hybrid_base,
                self.size,
                self.me,
                self.g,
                self.num_hosts,
                plan.channels,
                lay.cap,
                1 if opt.debug_reorder else 0,
                opt.debug_delay_us * 1000,
                self._tickets[1],
                self._status,
                timeout_ns,
            ],
        )
        self.launches["combine"] += 1
