"""Per-rank body of the multi-process Buffer tests, and the single-process oracle it compares against.

Every rank rebuilds every rank's inputs from one shared seed, runs the Buffer collectively, and
compares what it received and combined with an oracle computed here from all ranks' inputs by plain
torch ops and loops (no lck_ep code). It returns, per case, a list of failure strings (empty = pass),
so one run of the processes covers every case and the parent test reports each case on its own.
The same body runs over gloo (CPU) and NCCL (GPU): tensors go to the Buffer's device, the oracle stays
on the CPU, and every comparison that the module docs promise to be exact uses ``torch.equal``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _routing import naive_layout, route

T_MAX = 12


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    num_topk: int
    local_experts: int
    hidden: int
    dtype: torch.dtype
    alignment: int = 4
    num_bias: int = 0
    silent_rank: int | None = None  # this rank dispatches zero tokens
    all_minus_one_rank: int | None = None  # this rank's tokens select no expert
    full_rank: int | None = 0  # this rank dispatches exactly T_MAX tokens


CASES = [
    Case("balanced_bf16_h100", "balanced", 2, 2, 100, torch.bfloat16, alignment=4, num_bias=1),
    Case("skewed_top4_h72", "skewed", 4, 3, 72, torch.bfloat16, alignment=8),
    Case("minus_one_fp16", "minus_one", 3, 2, 100, torch.float16, alignment=1, num_bias=2),
    Case("rank1_sends_nothing_fp32", "balanced", 2, 2, 64, torch.float32, silent_rank=1),
    Case("rank0_all_minus_one_top1", "balanced", 1, 1, 100, torch.bfloat16, all_minus_one_rank=0),
    Case("top8_bf16", "balanced", 8, 4, 100, torch.bfloat16, alignment=16),
    Case("skewed_top6_fp32", "skewed", 6, 3, 40, torch.float32, alignment=2),
    Case("duplicate_slots_fp32", "duplicates", 3, 2, 48, torch.float32, num_bias=1),
    Case("top5_fp16_h56", "balanced", 5, 3, 56, torch.float16, alignment=4),
    Case("minus_one_top7_bf16", "minus_one", 7, 2, 88, torch.bfloat16, alignment=8, num_bias=1),
]
CASE_NAMES = [c.name for c in CASES]
MISUSE = [
    "hidden_on_last_rank",
    "expand_on_rank0",
    "bad_expert_on_rank1",
    "int32_topk_on_rank0",
    "combine_rows_on_rank0",
    "buffer_hidden_on_rank1",
    "foreign_handle",
    "experts_not_multiple",
]


def local_experts(case: Case, world: int) -> int:
    """Experts per rank: the case's count, raised so a token can pick ``num_topk`` distinct experts
    even in a world of one rank."""
    return max(case.local_experts, -(-case.num_topk // world))


def make_inputs(case: Case, world: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, topk_idx, topk_weights) for every rank, on the CPU, from ``seed`` alone."""
    g = torch.Generator().manual_seed(seed)
    num_experts = local_experts(case, world) * world
    out = []
    for s in range(world):
        t = int(torch.randint(1, T_MAX + 1, (1,), generator=g))
        if s == case.full_rank:
            t = T_MAX
        if s == case.silent_rank:
            t = 0
        x = torch.randn(t, case.hidden, generator=g).to(case.dtype)
        idx = route(case.kind, t, case.num_topk, num_experts, world, g)
        if s == case.all_minus_one_rank:
            idx = torch.full_like(idx, -1)
        w = torch.rand(t, case.num_topk, generator=g)
        out.append((x, idx, w))
    return out


def expert_fn(x: torch.Tensor, rank: int) -> torch.Tensor:
    """What a rank 'computes' on a received row (non-expanded path): exact fp32 ops, cast back."""
    return (x.float() * (1.0 + 0.5 * rank) + 0.25).to(x.dtype)


def expert_fn_expanded(x: torch.Tensor, local_expert: int, rank: int) -> torch.Tensor:
    """What local expert j of a rank computes on one expanded row."""
    return (x.float() * (1.0 + 0.25 * local_expert) - 0.125 * rank).to(x.dtype)


# ------------------------------------------------------------------------------------------- oracle


def oracle_recv(inputs, r: int, world: int, num_local: int) -> dict[str, Any]:
    lo, hi = r * num_local, (r + 1) * num_local
    xs, idxs, ws, src_rank, src_idx = [], [], [], [], []
    for s, (x, idx, w) in enumerate(inputs):
        for t in range(x.shape[0]):
            row = idx[t].tolist()
            if any(lo <= e < hi for e in row):
                xs.append(x[t])
                idxs.append([e - lo if lo <= e < hi else -1 for e in row])
                ws.append([float(w[t, k]) if lo <= e < hi else 0.0 for k, e in enumerate(row)])
                src_rank.append(s)
                src_idx.append(t)
    k = inputs[0][1].shape[1]
    h, dtype = inputs[0][0].shape[1], inputs[0][0].dtype
    per_expert = [sum(row.count(j) for row in idxs) for j in range(num_local)]
    return {
        "x": torch.stack(xs) if xs else torch.empty(0, h, dtype=dtype),
        "idx": torch.tensor(idxs, dtype=torch.int64).reshape(-1, k),
        "w": torch.tensor(ws, dtype=torch.float32).reshape(-1, k),
        "src_rank": src_rank,
        "src_idx": src_idx,
        "per_expert": per_expert,
    }


def oracle_expanded(recv: dict[str, Any], num_local: int, alignment: int) -> dict[str, Any]:
    rows: list[int] = []
    slots: list[int] = []
    offsets = [0]
    for j in range(num_local):
        for n, row in enumerate(recv["idx"].tolist()):
            for k, e in enumerate(row):
                if e == j:
                    rows.append(n)
                    slots.append(k)
        pad = -(len(rows) - offsets[-1]) % alignment
        rows += [-1] * pad
        slots += [-1] * pad
        offsets.append(len(rows))
    return {"src_row": rows, "slot": slots, "offsets": offsets}


def oracle_combine(inputs, s: int, world: int, num_local: int, bias: list[torch.Tensor], *, expanded: bool):
    """Combined output of source rank ``s`` in the documented order; also a float64 reference."""
    x, idx, w = inputs[s]
    t_count, h = x.shape
    out = torch.empty(t_count, h, dtype=x.dtype)
    ref = torch.zeros(t_count, h, dtype=torch.float64)
    for t in range(t_count):
        acc = torch.zeros(h, dtype=torch.float32)
        for d in range(world):
            lo, hi = d * num_local, (d + 1) * num_local
            slots = [k for k, e in enumerate(idx[t].tolist()) if lo <= e < hi]
            if not slots:
                continue
            if expanded:
                p = torch.zeros(h, dtype=torch.float32)
                for k in slots:
                    y = expert_fn_expanded(x[t : t + 1], int(idx[t, k]) - lo, d)[0]
                    p = p + y.float() * w[t, k]
                    ref[t] += y.double() * float(w[t, k])
                partial = p.to(x.dtype)
            else:
                partial = expert_fn(x[t : t + 1], d)[0]
                ref[t] += partial.double()
            acc = acc + partial.float()
        for b in bias:
            acc = acc + b[t].float()
            ref[t] += b[t].double()
        out[t] = acc.to(x.dtype)
    return out, ref


# ------------------------------------------------------------------------------------------- checks


class Checker:
    def __init__(self, where: str):
        self.where = where
        self.errors: list[str] = []

    def eq(self, name: str, got: Any, want: Any) -> None:
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                self.errors.append(f"{self.where}: {name} is {type(got).__name__}, expected a tensor")
                return
            got = got.cpu()
            if got.dtype != want.dtype or got.shape != want.shape:
                self.errors.append(
                    f"{self.where}: {name} is {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
                )
            elif not torch.equal(got, want):
                bad = (
                    (got != want)
                    if not got.is_floating_point()
                    else ~((got == want) | (got.isnan() & want.isnan()))
                )
                self.errors.append(
                    f"{self.where}: {name} differs in {int(bad.sum())} of {got.numel()} elements"
                )
        elif got != want:
            self.errors.append(f"{self.where}: {name} = {got!r}, expected {want!r}")

    def close(self, name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
        tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}[dtype]
        g = got.cpu().double()
        if torch.isnan(g).any():
            self.errors.append(f"{self.where}: {name} has NaN")
            return
        scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
        err = (g - ref).abs().max().item() if ref.numel() else 0.0
        if err > tol * scale:
            self.errors.append(f"{self.where}: {name} max error {err:.3e} vs float64 > {tol * scale:.1e}")

    def true(self, name: str, cond: bool) -> None:
        if not cond:
            self.errors.append(f"{self.where}: {name}")


def _run_case(
    buf_cls, group, case: Case, world: int, rank: int, seed: int, device: torch.device, layout: str
) -> list[str]:
    import lck_ep.buffer as buffer_mod

    c = Checker(f"{case.name} (world {world}, rank {rank}, seed {seed})")
    num_local = local_experts(case, world)
    num_experts = num_local * world
    inputs = make_inputs(case, world, seed)
    x, idx, w = (t.to(device) for t in inputs[rank])
    g = torch.Generator().manual_seed(seed + 7)
    bias_all = [
        [torch.randn(inp[0].shape[0], case.hidden, generator=g).to(case.dtype) for _ in range(case.num_bias)]
        for inp in inputs
    ]
    bias = [b.to(device) for b in bias_all[rank]]
    bias_arg = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
    buf = buf_cls(group, T_MAX, case.hidden, case.num_topk, num_experts, layout=layout)
    if layout == "kernel":
        c.true("Buffer uses the layout kernel", buf.use_kernel_layout)
    want = oracle_recv(inputs, rank, world, num_local)
    n = len(want["src_rank"])

    # -- synced dispatch
    recv_x, recv_idx, recv_w, h, ev = buf.dispatch(x, idx, w)
    ev.synchronize()
    c.eq("recv_x", recv_x, want["x"])
    c.eq("recv_topk_idx", recv_idx, want["idx"])
    c.eq("recv_topk_weights", recv_w, want["w"])
    c.eq("recv_src_rank", h.recv_src_rank.tolist(), want["src_rank"])
    c.eq("recv_src_idx", h.recv_src_idx.tolist(), want["src_idx"])
    c.eq("num_recv_tokens_per_expert_list", h.num_recv_tokens_per_expert_list, want["per_expert"])
    c.eq(
        "num_recv_tokens_per_expert",
        h.num_recv_tokens_per_expert,
        torch.tensor(want["per_expert"], dtype=torch.int32),
    )
    c.eq("num_recv_tokens", h.num_recv_tokens, n)
    per_rank, per_expert, mask = naive_layout(idx.cpu(), num_experts, world)
    c.eq("layout num_tokens_per_rank", h.num_tokens_per_rank.tolist(), per_rank)
    c.eq("layout num_tokens_per_expert", h.num_tokens_per_expert.tolist(), per_expert)
    c.eq("layout is_token_in_rank", h.is_token_in_rank.tolist(), mask)
    c.eq("send_counts", list(h.send_counts), per_rank)
    c.eq("recv_counts", list(h.recv_counts), [want["src_rank"].count(s) for s in range(world)])

    # -- combine (non-expanded): bit exact in the documented order, close to float64, repeatable
    y = expert_fn(recv_x, rank)
    combined, ev = buf.combine(y, h, bias=bias_arg)
    ev.synchronize()
    want_c, ref_c = oracle_combine(inputs, rank, world, num_local, bias_all[rank], expanded=False)
    c.eq("combined_x", combined, want_c)
    c.close("combined_x", combined, ref_c, case.dtype)
    again, _ = buf.combine(y, h, bias=bias_arg)
    c.eq("combined_x on a repeated run", again, combined.cpu())

    # -- cached handle: replay equals a fresh dispatch of the same routing, without recomputing
    x2 = (
        (torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + rank + 99)) * 3)
        .to(case.dtype)
        .to(device)
    )
    fresh = buf.dispatch(x2, idx, w)
    saved = buffer_mod.get_dispatch_layout

    def _no_layout(*a: Any, **k: Any) -> Any:
        raise AssertionError("a cached dispatch recomputed the layout")

    buffer_mod.get_dispatch_layout = _no_layout
    try:
        replay = buf.dispatch(x2, handle=h)
    finally:
        buffer_mod.get_dispatch_layout = saved
    c.eq("replayed recv_x", replay.recv_x, fresh.recv_x.cpu())
    c.true("replay returns no routing", replay.recv_topk_idx is None and replay.recv_topk_weights is None)
    c.true("replay returns the same handle", replay.handle is h)

    # -- expanded layout with alignment, weighted combine
    a = case.alignment
    ex = buf.dispatch(x, idx, w, expand=True, expert_alignment=a)
    oe = oracle_expanded(want, num_local, a)
    he = ex.handle
    c.eq("expanded offsets", he.expert_offsets.tolist(), oe["offsets"])
    c.true("expanded offsets aligned", all(o % a == 0 for o in he.expert_offsets.tolist()))
    c.eq("expanded src_row", he.expanded_src_row.tolist(), oe["src_row"])
    c.eq("expanded slot", he.expanded_slot.tolist(), oe["slot"])
    c.eq("expanded num_recv_tokens_per_expert_list", ex.num_recv_tokens_per_expert_list, want["per_expert"])
    ex_rows = (
        torch.stack(
            [want["x"][s] if s >= 0 else torch.zeros(case.hidden, dtype=case.dtype) for s in oe["src_row"]]
        )
        if oe["src_row"]
        else torch.empty(0, case.hidden, dtype=case.dtype)
    )
    c.eq("expanded recv_x", ex.recv_x, ex_rows)
    c.eq("expanded recv_topk_idx", ex.recv_topk_idx, want["idx"])
    y_ex = _expert_outputs(ex.recv_x, he.expert_offsets.tolist(), he.expanded_src_row, rank)
    comb_ex, _ = buf.combine(y_ex, he, topk_weights=ex.recv_topk_weights)
    want_ex, ref_ex = oracle_combine(inputs, rank, world, num_local, [], expanded=True)
    c.eq("expanded weighted combined_x", comb_ex, want_ex)
    c.close("expanded weighted combined_x", comb_ex, ref_ex, case.dtype)
    ex_replay = buf.dispatch(x, handle=he)
    c.eq("expanded replay recv_x", ex_replay.recv_x, ex.recv_x.cpu())

    # -- sync-free: same valid rows, inert padding, bit-identical combine
    nwt = buf.worst_case_tokens
    sf = buf.dispatch(x, idx, w, num_worst_tokens=nwt)
    hs = sf.handle
    c.true(
        "sync-free handle",
        hs.sync_free and hs.num_recv_rows == nwt and hs.num_recv_tokens_per_expert_list is None,
    )
    c.eq("sync-free num_recv_tokens", int(hs.num_recv_tokens), n)
    c.eq("sync-free recv_x valid rows", sf.recv_x[:n], want["x"])
    c.eq("sync-free recv_x padding", sf.recv_x[n:], torch.zeros(nwt - n, case.hidden, dtype=case.dtype))
    c.eq(
        "sync-free recv_topk_idx",
        sf.recv_topk_idx,
        torch.cat([want["idx"], torch.full((nwt - n, case.num_topk), -1)]),
    )
    c.eq(
        "sync-free recv_topk_weights",
        sf.recv_topk_weights,
        torch.cat([want["w"], torch.zeros(nwt - n, case.num_topk)]),
    )
    c.eq("sync-free recv_src_rank", hs.recv_src_rank.tolist(), want["src_rank"] + [-1] * (nwt - n))
    c.eq("sync-free recv_src_idx", hs.recv_src_idx.tolist(), want["src_idx"] + [-1] * (nwt - n))
    c.eq(
        "sync-free num_recv_tokens_per_expert",
        hs.num_recv_tokens_per_expert,
        torch.tensor(want["per_expert"], dtype=torch.int32),
    )
    y_sf = torch.cat([y, torch.full((nwt - n, case.hidden), float("nan"), dtype=case.dtype, device=device)])
    comb_sf, _ = buf.combine(y_sf, hs, bias=bias_arg)
    c.eq("sync-free combined_x (== synced, padding rows ignored)", comb_sf, combined.cpu())
    sf_replay = buf.dispatch(x2, handle=hs)
    c.eq("sync-free replay recv_x valid rows", sf_replay.recv_x[:n], fresh.recv_x.cpu())

    sfe = buf.dispatch(x, idx, w, expand=True, expert_alignment=a, num_worst_tokens=nwt)
    hse = sfe.handle
    m_valid = oe["offsets"][-1]
    c.eq("sync-free expanded offsets", hse.expert_offsets.tolist(), oe["offsets"])
    c.eq("sync-free expanded recv_x valid rows", sfe.recv_x[:m_valid], ex_rows)
    c.eq(
        "sync-free expanded padding rows",
        sfe.recv_x[m_valid:],
        torch.zeros(sfe.recv_x.shape[0] - m_valid, case.hidden, dtype=case.dtype),
    )
    c.true("sync-free expanded capacity", sfe.recv_x.shape[0] == nwt * case.num_topk + num_local * (a - 1))
    y_sfe = _expert_outputs(sfe.recv_x, hse.expert_offsets.tolist(), hse.expanded_src_row, rank)
    comb_sfe, _ = buf.combine(y_sfe, hse, topk_weights=sfe.recv_topk_weights)
    c.eq("sync-free expanded weighted combined_x (== synced)", comb_sfe, comb_ex.cpu())

    # -- a capacity smaller than what arrives keeps the first rows, and says how many arrived
    small = buf.dispatch(x, idx, w, num_worst_tokens=1)
    c.eq(
        "num_worst_tokens=1 first row",
        small.recv_x[:1],
        want["x"][:1] if n else torch.zeros(1, case.hidden, dtype=case.dtype),
    )
    c.eq("num_worst_tokens=1 num_recv_tokens", int(small.handle.num_recv_tokens), n)
    return c.errors


def _expert_outputs(rows: torch.Tensor, offsets: list[int], src_row: torch.Tensor, rank: int) -> torch.Tensor:
    """Each local expert's output on its expanded segment; padding rows NaN (combine must ignore them)."""
    out = torch.full_like(rows, float("nan"))
    for j in range(len(offsets) - 1):
        seg = slice(offsets[j], offsets[j + 1])
        out[seg] = expert_fn_expanded(rows[seg], j, rank)
    pad = src_row < 0
    out[pad] = float("nan")
    return out


# ------------------------------------------------------------------------------------------- misuse


def _misuse(
    buf_cls, group, world: int, rank: int, seed: int, device: torch.device, layout: str
) -> dict[str, str]:
    """Each entry: 'ExcType: message' this rank raised (or 'no error')."""
    h_size, k, num_local = 24, 2, 2
    e = num_local * world
    buf = buf_cls(group, T_MAX, h_size, k, e, layout=layout)
    inputs = make_inputs(Case("m", "balanced", k, num_local, h_size, torch.float32), world, seed)
    x, idx, w = (t.to(device) for t in inputs[rank])
    out: dict[str, str] = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            out[name] = "no error"
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    last = world - 1
    wide = torch.zeros(x.shape[0], h_size + 1, device=device)
    attempt("hidden_on_last_rank", lambda: buf.dispatch(wide if rank == last else x, idx, w))
    attempt("expand_on_rank0", lambda: buf.dispatch(x, idx, w, expand=(rank == 0)))
    bad_idx = idx.clone()
    if rank == min(1, last) and bad_idx.numel():
        bad_idx[0, 0] = e
    attempt("bad_expert_on_rank1", lambda: buf.dispatch(x, bad_idx, w))
    attempt("int32_topk_on_rank0", lambda: buf.dispatch(x, idx.int() if rank == 0 else idx, w))
    d = buf.dispatch(x, idx, w)
    rows = d.recv_x if rank != 0 else torch.zeros(d.recv_x.shape[0] + 1, h_size, device=device)
    attempt("combine_rows_on_rank0", lambda: buf.combine(rows, d.handle))
    attempt(
        "buffer_hidden_on_rank1",
        lambda: buf_cls(group, T_MAX, h_size + 2 * (rank == min(1, last)), k, e, layout=layout),
    )
    attempt("experts_not_multiple", lambda: buf_cls(group, T_MAX, h_size, k, 2 * world + 1, layout=layout))
    other = buf_cls(group, T_MAX, h_size, k, e, layout=layout)
    attempt("foreign_handle", lambda: other.combine(d.recv_x, d.handle))
    # The group is still in lock step: a normal round trip works.
    ok = buf.dispatch(x, idx, w)
    comb, _ = buf.combine(ok.recv_x, ok.handle)
    expect = x.float() * ok.handle.is_token_in_rank.sum(1, keepdim=True).float()
    out["after_misuse_round_trip"] = (
        "ok" if torch.equal(comb.float(), expect) else "round trip after misuse is wrong"
    )
    return out


def _run_group(
    group, size: int, rank: int, seed: int, device: torch.device, layout: str, misuse: bool
) -> dict[str, Any]:
    from lck_ep import Buffer

    out: dict[str, Any] = {}
    for i, case in enumerate(CASES):
        try:
            out[case.name] = _run_case(Buffer, group, case, size, rank, seed + 1000 * i, device, layout)
        except Exception:  # this case's failure; the group's other ranks fail or time out with it
            out[case.name] = [f"{case.name} (world {size}, rank {rank}) raised:\n{traceback.format_exc()}"]
            return out
    if misuse:
        try:
            out["misuse"] = _misuse(Buffer, group, size, rank, seed, device, layout)
        except Exception:
            out["misuse"] = {"crash": traceback.format_exc()}
    return out


def worker(
    rank: int,
    world: int,
    seed: int,
    layout: str = "torch",
    misuse: bool = True,
    configs: list[list[list[int]]] | None = None,
) -> list[dict[str, Any]]:
    """Run every case (and the misuse checks) in each group this rank belongs to.

    ``configs``: a list of partitions of the world into groups (lists of global ranks), run one after
    the other; each group runs the cases on its own, concurrently with the others, through
    ``dist.new_group``. ``None`` runs on the whole world. Returns one record per group joined:
    ``{"size", "ranks", "cases": {case: [failures]}, "misuse": {check: message}}``.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    if device.type == "cpu":
        # Several ranks share two cores: intra-op threads only contend (tiny uint8 fills took ~25 ms
        # each with 2 threads on a loaded machine, 0.01 ms with one).
        torch.set_num_threads(1)
    records = []
    for cfg_index, partition in enumerate(configs or [[list(range(world))]]):
        mine = None
        for ranks in partition:
            # new_group is collective over the whole world: every process creates every group.
            g = dist.group.WORLD if configs is None else dist.new_group(ranks=ranks)
            if rank in ranks:
                mine = (g, ranks)
        if mine is not None:
            g, ranks = mine
            grank = dist.get_rank(g)
            result = _run_group(g, len(ranks), grank, seed + 7919 * cfg_index, device, layout, misuse)
            records.append(
                {
                    "size": len(ranks),
                    "ranks": ranks,
                    **{
                        "cases": {k: v for k, v in result.items() if k != "misuse"},
                        "misuse": result.get("misuse", {}),
                    },
                }
            )
        dist.barrier()
    return records
