"""Per-rank bodies of the native-backend GPU tests: every output of ``backend="nvshmem"`` against the
reference backend on the same inputs, bit for bit.

Ranks run over gloo (NCCL refuses several ranks on one GPU), with NVSHMEM PEs sharing the GPUs under CUDA
MPS, or one per GPU where there are enough. The oracle is a reference Buffer on the CPU over the same
gloo group; expert outputs are computed once, on the GPU, and the same bits are handed to both combines.
Each body returns a list of failure strings (empty = pass).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from _routing import route

E_PER_RANK = 8
TOPK_CAP = 8
H_CAP = 7168


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    num_topk: int
    hidden: int
    dtype: torch.dtype
    alignment: int
    num_bias: int
    tokens: int = 48
    silent_rank: int | None = None
    all_minus_one_rank: int | None = None
    max_world: int = 64  # larger worlds skip the case (CPU oracle cost)


CASES = [
    Case("balanced_h7168_top8", "balanced", 8, 7168, torch.bfloat16, 128, 1),
    Case("skewed_h2880_top6_fp16", "skewed", 6, 2880, torch.float16, 16, 0),
    Case("minus_one_h100_top3", "minus_one", 3, 100, torch.bfloat16, 1, 2),
    Case("rank1_sends_nothing_top4", "balanced", 4, 256, torch.bfloat16, 8, 0, silent_rank=1),
    Case("top1_rank0_all_minus_one", "balanced", 1, 512, torch.bfloat16, 1, 1, all_minus_one_rank=0),
    Case("duplicates_top5_h72_fp16", "duplicates", 5, 72, torch.float16, 4, 1),
    Case("one_token_top7", "minus_one", 7, 1024, torch.bfloat16, 8, 0, tokens=1),
    Case("fp32_rows_h64_top2", "balanced", 2, 64, torch.float32, 4, 1),
    Case("tokens4096_h7168_top8", "balanced", 8, 7168, torch.bfloat16, 128, 0, tokens=4096, max_world=2),
]


def configure(world: int, max_tokens: int) -> None:
    import lck_runtime as L

    torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    cfg = L.MoEConfig(
        max_tokens=max_tokens, hidden_size=H_CAP, num_experts=E_PER_RANK * world, top_k=TOPK_CAP
    )
    if not L.configure(moe=cfg):
        raise RuntimeError("configure(moe=...) did not bring up the native (NVSHMEM) runtime")


def inputs(case: Case, world: int, rank: int, seed: int) -> tuple[torch.Tensor, ...]:
    """This rank's (x, topk_idx, topk_weights, bias0, bias1, x2) on the CPU, from ``seed`` alone."""
    g = torch.Generator().manual_seed(seed)
    out: tuple[torch.Tensor, ...] = ()
    for s in range(world):
        t = case.tokens if s == 0 else int(torch.randint(1, case.tokens + 1, (1,), generator=g))
        if s == case.silent_rank:
            t = 0
        x = torch.randn(t, case.hidden, generator=g).to(case.dtype)
        idx = route(case.kind, t, case.num_topk, E_PER_RANK * world, world, g)
        if s == case.all_minus_one_rank:
            idx = torch.full_like(idx, -1)
        w = torch.randn(t, case.num_topk, generator=g)
        b0 = torch.randn(t, case.hidden, generator=g).to(case.dtype)
        b1 = torch.randn(t, case.hidden, generator=g).to(case.dtype)
        x2 = torch.randn(t, case.hidden, generator=g).to(case.dtype)
        if s == rank:
            out = (x, idx, w, b0, b1, x2)
    return out


def expert(rows: torch.Tensor, offsets: torch.Tensor | None, rank: int) -> torch.Tensor:
    """A per-expert function of the rows (expanded: by segment), computed on the GPU only."""
    if offsets is None:
        return (rows.float() * (1.0 + 0.5 * rank) + 0.25).to(rows.dtype)
    m = torch.arange(rows.shape[0], device=rows.device)
    j = torch.searchsorted(offsets[1:].contiguous(), m, right=True).clamp(max=offsets.numel() - 2)
    return (rows.float() * (1.0 + 0.25 * j.float()).unsqueeze(1) - 0.125 * rank).to(rows.dtype)


class Compare:
    def __init__(self, rank: int, where: str):
        self.rank, self.where, self.errors = rank, where, []

    def __call__(self, name: str, got: Any, want: Any) -> None:
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
                self.errors.append(f"rank {self.rank} {self.where}: {name}: {type(got)} vs {type(want)}")
                return
            g = got.detach().cpu()
            if g.dtype != want.dtype or g.shape != want.shape:
                self.errors.append(
                    f"rank {self.rank} {self.where}: {name}: {g.dtype}{list(g.shape)} vs {want.dtype}{list(want.shape)}"
                )
            elif not torch.equal(g, want):
                bad = int((g != want).sum()) if g.numel() else 0
                self.errors.append(
                    f"rank {self.rank} {self.where}: {name}: {bad} of {g.numel()} elements differ"
                )
        elif got != want:
            self.errors.append(f"rank {self.rank} {self.where}: {name}: {got!r} vs {want!r}")


def in_use(recv_x: Any, handle: Any) -> Any:
    """The rows of ``recv_x`` (a tensor or the fp8 pair) that carry tokens: all of them in synced mode; in
    sync-free mode the received rows kept (compact) or those before ``expert_offsets[L]`` (expanded), the
    capacity padding after them being unspecified (the native backend does not write it)."""
    if not handle.sync_free:
        return recv_x
    if handle.expand:
        n = int(handle.expert_offsets[-1])
    else:
        n = min(int(handle.num_recv_tokens), handle.num_worst_tokens)
    return tuple(t[:n] for t in recv_x) if isinstance(recv_x, tuple) else recv_x[:n]


def _round(case: Case, nat: Any, ref: Any, data: tuple[torch.Tensor, ...], rank: int, cmp: Compare) -> None:
    dev = nat.device
    x, idx, w, b0, b1, x2 = data
    bias = (b0, b1)[: case.num_bias]
    # plain dispatch, combine with biases, and a cached-handle replay
    dn = nat.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    dr = ref.dispatch(x, idx, w)
    cmp("recv_x", in_use(dn.recv_x, dn.handle), in_use(dr.recv_x, dr.handle))
    for name in ("recv_topk_idx", "recv_topk_weights"):
        cmp(name, getattr(dn, name), getattr(dr, name))
    cmp("num_recv_tokens_per_expert", dn.num_recv_tokens_per_expert, dr.num_recv_tokens_per_expert)
    cmp(
        "num_recv_tokens_per_expert_list",
        dn.num_recv_tokens_per_expert_list,
        dr.num_recv_tokens_per_expert_list,
    )
    for name in ("recv_src_idx", "recv_src_rank", "recv_slot_pos"):
        if getattr(dr.handle, name) is not None:
            cmp(f"handle.{name}", getattr(dn.handle, name), getattr(dr.handle, name))
    n_recv = dn.handle.num_recv_tokens
    cmp(
        "num_recv_tokens",
        n_recv.cpu() if isinstance(n_recv, torch.Tensor) else n_recv,
        dr.handle.num_recv_tokens,
    )
    y = expert(dn.recv_x, None, rank)
    cn, _ = nat.combine(y, dn.handle, bias=tuple(b.to(dev) for b in bias) or None)
    cr, _ = ref.combine(y.cpu(), dr.handle, bias=bias or None)
    cmp("combine", cn, cr)
    # the same combine from the zero-copy input: the sources read the rows where they were written
    zy = nat.combine_input(dn.handle, dtype=y.dtype)
    # in place on the native state (also with no rows received), a plain tensor on the hybrid one
    cmp("combine_input in place", nat._native.takes_in_place(zy, dn.handle), nat._native.zero_copy_combine)
    zy.copy_(y)
    czn, _ = nat.combine(zy, dn.handle, bias=tuple(b.to(dev) for b in bias) or None)
    cmp("zero-copy combine", czn, cr)
    if nat._native.zero_copy_combine:  # used up by that combine: refused before anything runs, until handed
        try:  # out again (every rank here, an empty input too)
            nat.combine(zy, dn.handle)
            cmp.errors.append(f"rank {rank}: a second combine of one zero-copy input was not refused")
        except ValueError as exc:
            if "call combine_input(handle) again" not in str(exc):
                cmp.errors.append(f"rank {rank}: second zero-copy combine: {exc}")
    rn = nat.dispatch(x2.to(dev), handle=dn.handle)
    rr = ref.dispatch(x2, handle=dr.handle)
    cmp("replay recv_x", in_use(rn.recv_x, dn.handle), in_use(rr.recv_x, dr.handle))
    # expanded, aligned layout and the weighted combine
    en = nat.dispatch(x.to(dev), idx.to(dev), w.to(dev), expand=True, expert_alignment=case.alignment)
    er = ref.dispatch(x, idx, w, expand=True, expert_alignment=case.alignment)
    cmp("expanded recv_x", in_use(en.recv_x, en.handle), in_use(er.recv_x, er.handle))
    for name in ("expert_offsets", "expanded_src_row", "expanded_slot", "recv_expanded_index"):
        cmp(f"handle.{name}", getattr(en.handle, name), getattr(er.handle, name))
    ye = expert(en.recv_x, en.handle.expert_offsets, rank)
    cen, _ = nat.combine(
        ye, en.handle, topk_weights=en.recv_topk_weights, bias=tuple(b.to(dev) for b in bias) or None
    )
    cer, _ = ref.combine(ye.cpu(), er.handle, topk_weights=er.recv_topk_weights, bias=bias or None)
    cmp("expanded weighted combine", cen, cer)
    # the same from the zero-copy input (synced, where the largest expanded layout fits the workspace): each
    # source reduces its tokens' expanded rows where their experts wrote them
    _expanded_zero_copy(
        case, nat, en.handle, ye, (en.recv_topk_weights, er.recv_topk_weights), bias, cer, rank, cmp
    )
    cr_plain, _ = ref.combine(ye.cpu(), er.handle)
    _expanded_zero_copy(case, nat, en.handle, ye, None, (), cr_plain, rank, cmp)
    # an expanded handle replayed: the rows go straight to their expanded places
    ren = nat.dispatch(x2.to(dev), handle=en.handle)
    rer = ref.dispatch(x2, handle=er.handle)
    cmp("expanded replay recv_x", in_use(ren.recv_x, en.handle), in_use(rer.recv_x, er.handle))
    # the send slots the kernel computed
    cmp("handle.send_slot", en.handle.send_slot, reference_send_slots(en.handle.is_token_in_rank.cpu()))
    if nat.sync_free:
        # fewer output rows than a rank may receive: the excess is dropped alike, counted per expert, and
        # left out of the expanded layout
        nwt = max(1, case.tokens // 2)
        kw = dict(expand=True, expert_alignment=case.alignment, num_worst_tokens=nwt)
        dn2 = nat.dispatch(x.to(dev), idx.to(dev), w.to(dev), **kw)
        dr2 = ref.dispatch(x, idx, w, **kw)
        cmp("dropped: recv_x", in_use(dn2.recv_x, dn2.handle), in_use(dr2.recv_x, dr2.handle))
        for name in ("recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert"):
            cmp(f"dropped: {name}", getattr(dn2, name), getattr(dr2, name))
        for name in ("expert_offsets", "expanded_src_row", "expanded_slot", "recv_expanded_index"):
            cmp(f"dropped: handle.{name}", getattr(dn2.handle, name), getattr(dr2.handle, name))
        y2 = expert(dn2.recv_x, dn2.handle.expert_offsets, rank)
        c2n, _ = nat.combine(y2, dn2.handle, topk_weights=dn2.recv_topk_weights)
        c2r, _ = ref.combine(y2.cpu(), dr2.handle, topk_weights=dr2.recv_topk_weights)
        cmp("dropped: expanded weighted combine", c2n, c2r)
        cn3, _ = nat.combine(y2, dn2.handle)  # no weights: plain sums of the expanded rows
        cr3, _ = ref.combine(y2.cpu(), dr2.handle)
        cmp("dropped: expanded unweighted combine", cn3, cr3)
        # compact, from the zero-copy input: the dropped rows' slots add nothing
        dn4 = nat.dispatch(x.to(dev), idx.to(dev), w.to(dev), num_worst_tokens=nwt)
        dr4 = ref.dispatch(x, idx, w, num_worst_tokens=nwt)
        y4 = expert(dn4.recv_x, None, rank)
        z4 = nat.combine_input(dn4.handle, dtype=y4.dtype)
        z4.copy_(y4)
        c4n, _ = nat.combine(z4, dn4.handle)
        c4r, _ = ref.combine(y4.cpu(), dr4.handle)
        cmp("dropped: zero-copy combine", c4n, c4r)


def _expanded_zero_copy(
    case: Case,
    nat: Any,
    handle: Any,
    ye: torch.Tensor,
    weights: Any,
    bias: tuple[torch.Tensor, ...],
    want: torch.Tensor,
    rank: int,
    cmp: Compare,
) -> None:
    """An expanded combine from ``Buffer.combine_input``: in place exactly where the handle's largest expanded
    layout and its maps fit the workspace (synced only; the bound the same on every rank), equal to the
    reference's either way. ``weights``: (native, reference) routing weights, or None."""
    import torch.distributed as dist

    from lck_ep.native import expanded_tables

    st = nat._native
    most = handle.most_expanded_rows
    if nat.sync_free:
        cmp("sync-free: most_expanded_rows", most, None)
        fits = False
    else:
        every = [None] * nat.num_ranks
        dist.all_gather_object(every, handle.num_expanded_rows)
        cmp("most_expanded_rows is the largest rank's", most, max(every))
        tables = expanded_tables(most, case.hidden * ye.element_size(), nat.worst_case_tokens, case.num_topk)
        fits = st.zero_copy_combine and case.num_topk <= 32 and tables.end <= st._table_offset
    z = nat.combine_input(handle, dtype=ye.dtype)
    cmp("expanded combine_input in place", st.takes_in_place(z, handle), fits)
    z.copy_(ye)
    kw = dict(topk_weights=weights[0]) if weights is not None else {}
    got, _ = nat.combine(z, handle, bias=tuple(b.to(nat.device) for b in bias) or None, **kw)
    cmp(f"zero-copy expanded {'weighted ' if weights is not None else ''}combine", got, want)


def reference_send_slots(mask: torch.Tensor) -> torch.Tensor:
    from lck_ep.reference import send_slots

    return send_slots(mask)


def suite(rank: int, world: int, seed: int) -> list[str]:
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    errors: list[str] = []
    try:
        configure(world, max(c.tokens for c in CASES if world <= c.max_world))
        dev = torch.device("cuda", torch.cuda.current_device())
        group = dist.group.WORLD
        for i, case in enumerate(CASES):
            if world > case.max_world:
                continue
            # The large synced case also with its receiving half launched before the counts are read.
            modes = [(False, None), (True, None)] + ([(False, 1 << 40)] if case.tokens >= 4096 else [])
            for sync_free, early in modes:
                where = f"{case.name} {'sync-free' if sync_free else 'synced'}{' early' if early else ''}"
                cmp = Compare(rank, where)
                args = (group, case.tokens, case.hidden, case.num_topk, E_PER_RANK * world)
                # A generous bound: these runs check results, the stop test checks the bound.
                nat = Buffer(
                    *args, sync_free=sync_free, device=dev, backend="nvshmem", timeout_s=60.0,
                    early_receive_bytes=early,
                )  # fmt: skip
                ref = Buffer(*args, sync_free=sync_free, device="cpu", backend="reference")
                if nat.backend != "nvshmem" or ref.backend != "reference":
                    errors.append(f"rank {rank} {where}: backends {nat.backend}/{ref.backend}")
                try:
                    case_inputs = inputs(case, world, rank, seed + 1000 * i)
                    _round(case, nat, ref, case_inputs, rank, cmp)
                    if early:  # it took the early path: recv_x is a view of storage sized for the capacity
                        got = nat.dispatch(*(t.to(dev) for t in case_inputs[:3])).recv_x
                        cap = nat.worst_case_tokens * case.hidden * got.element_size()
                        if got.untyped_storage().nbytes() < cap:
                            cmp.errors.append(f"rank {rank} {where}: recv_x storage is not capacity-sized")
                except Exception:
                    cmp.errors.append(f"rank {rank} {where} raised:\n{traceback.format_exc()}")
                nat.check_errors()
                errors += cmp.errors
        errors += _graph_and_loop(rank, world, seed, dev)
        L.finalize()
    except Exception:
        errors.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    return errors


def _graph_and_loop(rank: int, world: int, seed: int, dev: torch.device) -> list[str]:
    """A sync-free round trip captured in a CUDA graph and replayed with new routings (checked against
    the eager reference), then 200 eager round trips back to back."""
    import torch.distributed as dist

    from lck_ep import Buffer

    case = CASES[2]
    args = (dist.group.WORLD, case.tokens, case.hidden, case.num_topk, E_PER_RANK * world)
    nat = Buffer(*args, sync_free=True, device=dev, backend="nvshmem", timeout_s=60.0)
    ref = Buffer(*args, sync_free=True, device="cpu", backend="reference")
    cmp = Compare(rank, "graph replay")
    x, idx, w, b0, _, _ = (t.to(dev) for t in inputs(case, world, rank, seed))
    sx, sidx, sw, sb = x.clone(), idx.clone(), w.clone(), b0.clone()

    def trip(buf: Any, xx: Any, ii: Any, ww: Any, bb: Any) -> tuple[Any, Any]:
        d = buf.dispatch(xx, ii, ww, expand=True, expert_alignment=case.alignment)
        y = expert(d.recv_x, d.handle.expert_offsets, rank)
        c, _ = buf.combine(y, d.handle, topk_weights=d.recv_topk_weights, bias=bb)
        p = buf.dispatch(xx, ii, ww)
        z = buf.combine_input(p.handle, dtype=p.recv_x.dtype)  # zero-copy: written in place, read there
        z.copy_(expert(p.recv_x, None, rank))
        c2, _ = buf.combine(z, p.handle)
        return c, c2

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        trip(nat, sx, sidx, sw, sb)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = trip(nat, sx, sidx, sw, sb)
    for trial in range(3):
        nx, nidx, nw, nb, _, _ = inputs(case, world, rank, seed + 77 * (trial + 1))
        t = sx.shape[0]
        pad = t - nx.shape[0]
        if pad > 0:  # same static shape: pad with tokens that go nowhere
            nx = torch.cat([nx, torch.randn(pad, case.hidden).to(case.dtype)])
            nidx = torch.cat([nidx, torch.full((pad, case.num_topk), -1, dtype=torch.int64)])
            nw = torch.cat([nw, torch.rand(pad, case.num_topk)])
            nb = torch.cat([nb, torch.zeros(pad, case.hidden, dtype=case.dtype)])
        nx, nidx, nw, nb = nx[:t], nidx[:t], nw[:t], nb[:t]
        for dst, src in ((sx, nx), (sidx, nidx), (sw, nw), (sb, nb)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        # the reference needs the same expert outputs: recompute them from its own (equal) rows
        d = ref.dispatch(nx, nidx, nw, expand=True, expert_alignment=case.alignment)
        y = expert(d.recv_x.to(dev), d.handle.expert_offsets.to(dev), rank).cpu()
        c, _ = ref.combine(y, d.handle, topk_weights=d.recv_topk_weights, bias=nb)
        p = ref.dispatch(nx, nidx, nw)
        c2, _ = ref.combine(expert(p.recv_x.to(dev), None, rank).cpu(), p.handle)
        cmp(f"replay {trial}: expanded weighted combine", out[0], c)
        cmp(f"replay {trial}: combine", out[1], c2)
    nat.check_errors()
    t0 = time.perf_counter()
    for _ in range(200):
        last = trip(nat, x, idx, w, b0)
    torch.cuda.synchronize()
    nat.check_errors()
    first = trip(nat, x, idx, w, b0)
    cmp("200 iterations: expanded combine stable", last[0], first[0].cpu())
    if time.perf_counter() - t0 > 120:
        cmp.errors.append(f"rank {rank}: 200 round trips took {time.perf_counter() - t0:.0f} s")
    return cmp.errors


def stop(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """The last rank never calls; the others' sync-free dispatch must give up within ``timeout_s``."""
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    configure(world, 16)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(
        dist.group.WORLD, 16, 64, 2, E_PER_RANK * world, sync_free=True, device=dev, timeout_s=timeout_s
    )
    out: dict[str, Any] = {"backend": buf.backend}
    dist.barrier()
    if rank != world - 1:
        x, idx = stalled_dispatch(buf, world, dev, out)
        try:  # every later call raises at once
            buf.dispatch(x, idx)
        except Exception as exc:
            out["later"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    L.finalize()
    return out


def mixed(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0 combines from the zero-copy input, the others from a plain tensor: every rank must raise."""
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    configure(world, 16)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(
        dist.group.WORLD, 16, 64, 2, E_PER_RANK * world, sync_free=True, device=dev, timeout_s=timeout_s
    )
    x = torch.randn(16, 64, device=dev).to(torch.bfloat16)
    idx = torch.arange(16 * 2, device=dev).reshape(16, 2) % (E_PER_RANK * world)
    d = buf.dispatch(x, idx)
    y = expert(d.recv_x, None, rank)
    if rank == 0:
        z = buf.combine_input(d.handle)
        z.copy_(y)
        y = z
    out: dict[str, Any] = {"backend": buf.backend}
    timed_failure(out, "error", lambda: (buf.combine(y, d.handle), buf.check_errors()))
    dist.barrier()
    L.finalize()
    return out


def agreement(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """Synced calls agreeing through the workspaces (the default): a dispatch and combine equal to the
    reference's; ranks asking for different layouts, one rank's bad argument, an out-of-range expert on one
    rank, replays of different handles and a combine with a bias on one rank only raise the same
    error on every rank, each followed by the same calls with agreeing arguments, still equal to the
    reference's (a refusal leaves the context usable); then the last rank stops calling and the others' next
    dispatch raises within the bound, naming the agreement."""
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    configure(world, 16)
    dev = torch.device("cuda", torch.cuda.current_device())
    args = (dist.group.WORLD, 16, 64, 2, E_PER_RANK * world)
    buf = Buffer(*args, device=dev, timeout_s=timeout_s)
    ref = Buffer(*args, device="cpu", backend="reference")
    out: dict[str, Any] = {"backend": buf.backend, "device_agreement": buf._gather is not None}
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, E_PER_RANK * world, (16, 2), generator=g)
    d, r = buf.dispatch(x.to(dev), idx.to(dev)), ref.dispatch(x, idx)
    cmp = Compare(rank, "device agreement")
    cmp("recv_x", d.recv_x, r.recv_x)
    cmp("recv_topk_idx", d.recv_topk_idx, r.recv_topk_idx)
    cmp("per-expert list", d.num_recv_tokens_per_expert_list, r.num_recv_tokens_per_expert_list)
    y = expert(d.recv_x, None, rank)
    cmp("combine", buf.combine(y, d.handle).combined_x, ref.combine(y.cpu(), r.handle).combined_x)
    out["errors"] = cmp.errors
    try:
        buf.dispatch(x.to(dev), idx.to(dev), expand=rank == 1)
    except ValueError as exc:
        out["disagree"] = str(exc)
    try:
        buf.dispatch(x.to(dev), (idx.int() if rank == 0 else idx).to(dev))
    except (TypeError, ValueError) as exc:
        out["local"] = f"{type(exc).__name__}: {exc}"
    wrong = idx.clone()
    if rank == 1:
        wrong[0, 0] = E_PER_RANK * world  # one past the last expert: refused through the agreement's flag
    try:
        buf.dispatch(x.to(dev), wrong.to(dev))
    except ValueError as exc:
        out["range"] = str(exc)
    cmp = Compare(rank, "after the refusals")
    d2, r2 = buf.dispatch(x.to(dev), idx.to(dev)), ref.dispatch(x, idx)
    cmp("recv_x", d2.recv_x, r2.recv_x)
    # A replay and a combine launch before their verdict is read: refused, they must not have run anywhere.
    try:
        buf.dispatch(x.to(dev), handle=d.handle if rank == 0 else d2.handle)
    except ValueError as exc:
        out["replay"] = str(exc)
    y2 = expert(d2.recv_x, None, rank)
    try:
        buf.combine(
            y2, d2.handle, bias=torch.ones(16, 64, dtype=torch.bfloat16, device=dev) if rank == 0 else None
        )
    except ValueError as exc:
        out["combine"] = str(exc)
    cmp("replay", buf.dispatch(x.to(dev), handle=d2.handle).recv_x, ref.dispatch(x, handle=r2.handle).recv_x)
    cmp("combine", buf.combine(y2, d2.handle).combined_x, ref.combine(y2.cpu(), r2.handle).combined_x)
    out["errors"] += cmp.errors
    dist.barrier()
    if rank != world - 1:
        timed_failure(out, "stop", lambda: buf.dispatch(x.to(dev), idx.to(dev)))
    dist.barrier()
    L.finalize()
    return out


def stalled_dispatch(buf: Any, world: int, dev: torch.device, out: dict[str, Any]) -> tuple[Any, Any]:
    """A sync-free dispatch of 16 rows that a stopped rank never answers: what ``check_errors`` raised
    goes to ``out["error"]``, the seconds until it did to ``out["seconds"]``; returns the inputs."""
    x = torch.randn(16, 64, device=dev).to(torch.bfloat16)
    idx = torch.arange(16 * 2, device=dev).reshape(16, 2) % (E_PER_RANK * world)
    timed_failure(out, "error", lambda: (buf.dispatch(x, idx), buf.check_errors()))
    return x, idx


def timed_failure(out: dict[str, Any], key: str, fn: Any) -> None:
    """Run ``fn``: what it raised goes to ``out[key]`` ("Type: message"), the seconds it took to
    ``out["seconds"]``."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:
        out[key] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - t0


def fp8(rank: int, world: int, seed: int) -> list[str]:
    """FP8 rows (e4m3 values, a float32 scale per 128 channels) through the native backend, against the
    reference: synced and sync-free, a cached-handle replay, the expanded layout."""
    import torch.distributed as dist

    import lck_runtime as L
    from lck_ep import Buffer

    errors: list[str] = []
    try:
        configure(world, 64)
        dev = torch.device("cuda", torch.cuda.current_device())
        case = CASES[0]
        g = torch.Generator().manual_seed(seed + rank)
        x, idx, _, _, _, _ = inputs(case, world, rank, seed)
        x8 = (x.float() * 4).to(torch.float8_e4m3fn)
        s = torch.rand(x.shape[0], case.hidden // 128, generator=g) + 0.5
        args = (dist.group.WORLD, case.tokens, case.hidden, case.num_topk, E_PER_RANK * world)
        for sync_free in (False, True):
            cmp = Compare(rank, f"fp8 {'sync-free' if sync_free else 'synced'}")
            nat = Buffer(*args, sync_free=sync_free, device=dev, backend="nvshmem", timeout_s=60.0)
            ref = Buffer(*args, sync_free=sync_free, device="cpu", backend="reference")
            dn = nat.dispatch((x8.to(dev), s.to(dev)), idx.to(dev))
            dr = ref.dispatch((x8, s), idx)
            got, want = in_use(dn.recv_x, dn.handle), in_use(dr.recv_x, dr.handle)
            cmp("recv fp8", got[0].view(torch.uint8), want[0].view(torch.uint8))
            cmp("recv scales", got[1], want[1])
            cmp("recv_topk_idx", dn.recv_topk_idx, dr.recv_topk_idx)
            rn = nat.dispatch((x8.to(dev), s.to(dev)), handle=dn.handle).recv_x
            rr = ref.dispatch((x8, s), handle=dr.handle).recv_x
            rn, rr = in_use(rn, dn.handle), in_use(rr, dr.handle)
            cmp("replay fp8", rn[0].view(torch.uint8), rr[0].view(torch.uint8))
            en = nat.dispatch((x8.to(dev), s.to(dev)), idx.to(dev), expand=True, expert_alignment=128)
            er = ref.dispatch((x8, s), idx, expand=True, expert_alignment=128)
            got, want = in_use(en.recv_x, en.handle), in_use(er.recv_x, er.handle)
            cmp("expanded fp8", got[0].view(torch.uint8), want[0].view(torch.uint8))
            cmp("expanded scales", got[1], want[1])
            nat.check_errors()
            errors += cmp.errors
        L.finalize()
    except Exception:
        errors.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    return errors
