"""Per-rank body of the multi-process MoEExperts tests, and the float64 oracle they compare against.

Every rank rebuilds every rank's inputs and the whole group's expert weights from one seed, runs its
``MoEExperts`` (its slice of the weights) forward and backward, and compares the output and every
gradient with a float64 evaluation of the formula over all ranks' tokens (plain torch, no lck_ep code):
``y[t] = sum_k w[t,k] (silu(x[t] W1_e[:, :F]) * (x[t] W1_e[:, F:])) W2_e``. A weight's gradient sums over
the tokens of every rank, so each rank checks the gradient of its own experts. Workers return failure
strings per case (empty = pass), so one run of the processes covers every case.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

E, H, F, T_MAX = 8, 32, 16, 6
TOL = 2e-5  # float32 against float64, relative to the largest reference magnitude (at least 1)


@dataclass(frozen=True)
class Case:
    name: str
    num_topk: int
    alignment: int = 1
    empty_expert: int | None = 5  # no token of any rank picks this expert
    silent_rank: int | None = None  # this rank has no token at all
    minus_one: float = 0.25  # share of slots set to -1 (besides a fully -1 token per rank)


CASES = [
    Case("top1", 1),
    Case("top2_align4", 2, alignment=4),
    Case("top3_rank1_silent", 3, silent_rank=1),
    Case("top4", 4, empty_expert=0),
    Case("top5_align2", 5, alignment=2),
    Case("top6", 6, empty_expert=7),
    Case("top7_align8", 7, alignment=8, minus_one=0.4),
    Case("top8", 8, empty_expert=3, minus_one=0.1),
]
CASE_NAMES = [c.name for c in CASES]


def make_inputs(case: Case, world: int, seed: int) -> dict[str, Any]:
    """Every rank's (x, topk_idx, topk_weights, grad_out) and the group's weights, float64, CPU."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, H, 2 * F, generator=g, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, F, H, generator=g, dtype=torch.float64) / F**0.5
    ranks = []
    for r in range(world):
        t = int(torch.randint(2, T_MAX + 1, (1,), generator=g))
        if r == case.silent_rank:
            t = 0
        x = torch.randn(t, H, generator=g, dtype=torch.float64)
        idx = torch.rand(t, E, generator=g).argsort(dim=1)[:, : case.num_topk].contiguous()
        idx = torch.where(torch.rand(t, case.num_topk, generator=g) < case.minus_one, -1, idx)
        if t:
            idx[t // 2] = -1  # a token that goes to no expert
        if case.empty_expert is not None:
            idx = torch.where(idx == case.empty_expert, -1, idx)
        w = torch.rand(t, case.num_topk, generator=g, dtype=torch.float64)
        dy = torch.randn(t, H, generator=g, dtype=torch.float64)
        ranks.append((x, idx, w, dy))
    return {"w1": w1, "w2": w2, "ranks": ranks}


def reference(inputs: dict[str, Any]) -> dict[str, Any]:
    """Outputs and gradients of sum_r <dy_r, y_r> in float64, by the formula, over all ranks."""
    w1 = inputs["w1"].clone().requires_grad_()
    w2 = inputs["w2"].clone().requires_grad_()
    leaves, outs, loss = [], [], torch.zeros((), dtype=torch.float64)
    for x, idx, w, dy in inputs["ranks"]:
        x = x.clone().requires_grad_()
        w = w.clone().requires_grad_()
        h = torch.einsum("th,ehf->etf", x, w1)  # every expert on every token, [E, T, 2F]
        a = torch.nn.functional.silu(h[..., :F]) * h[..., F:]
        y_all = torch.einsum("etf,efh->eth", a, w2)  # [E, T, H]
        y = torch.zeros(x.shape[0], H, dtype=torch.float64)
        for k in range(idx.shape[1]):
            e = idx[:, k]
            sel = y_all[e.clamp(min=0), torch.arange(x.shape[0])]
            y = y + torch.where((e >= 0).unsqueeze(1), w[:, k : k + 1] * sel, 0.0)
        loss = loss + (y * dy).sum()
        leaves.append((x, w))
        outs.append(y.detach())
    loss.backward()
    return {
        "y": outs,
        "dx": [x.grad if x.grad is not None else torch.zeros_like(x) for x, _ in leaves],
        "dw": [w.grad if w.grad is not None else torch.zeros_like(w) for _, w in leaves],
        "dw1": w1.grad,
        "dw2": w2.grad,
    }


def _close(
    errors: list[str], where: str, name: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL
) -> None:
    got = got.detach().double().cpu()
    if got.shape != want.shape:
        errors.append(f"{where}: {name} has shape {list(got.shape)}, expected {list(want.shape)}")
        return
    if want.numel() == 0:
        return
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    if not err <= tol * scale:  # NaN fails too
        errors.append(f"{where}: {name} max error {err:.3e} > {tol * scale:.1e} against float64")


def _module(
    rank: int,
    world: int,
    group: Any,
    inputs: dict[str, Any],
    case: Case,
    buffer: Any = None,
    dtype: torch.dtype = torch.float32,
):
    from lck_ep import MoEExperts

    m = MoEExperts(E, H, F, group=group, buffer=buffer, dtype=dtype, expert_alignment=case.alignment)
    lo, hi = rank * E // world, (rank + 1) * E // world
    with torch.no_grad():
        m.weight1.copy_(inputs["w1"][lo:hi])
        m.weight2.copy_(inputs["w2"][lo:hi])
    return m


def run_layer(
    m: Any, rank: int, inputs: dict[str, Any], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    x, idx, w, dy = inputs["ranks"][rank]
    xf = x.to(dtype).requires_grad_()
    wf = w.float().requires_grad_()
    y = m(xf, idx, wf)
    y.backward(dy.to(dtype))
    return {"y": y.detach(), "dx": xf.grad, "dw": wf.grad, "dw1": m.weight1.grad, "dw2": m.weight2.grad}


def check_case(
    case: Case, rank: int, world: int, group: Any, seed: int, sync_free: bool = False
) -> list[str]:
    """One case against float64; ``sync_free`` moves tokens through a sync-free Buffer made here."""
    where = f"{case.name} (world {world}, rank {rank}, seed {seed}{', sync-free' if sync_free else ''})"
    errors: list[str] = []
    inputs = make_inputs(case, world, seed)
    ref = reference(inputs)
    buf = None
    if sync_free:
        from lck_ep import Buffer

        buf = Buffer(group, T_MAX, H, case.num_topk, E, sync_free=True)
    got = run_layer(_module(rank, world, group, inputs, case, buffer=buf), rank, inputs)
    lo, hi = rank * E // world, (rank + 1) * E // world
    _close(errors, where, "output", got["y"], ref["y"][rank])
    _close(errors, where, "x.grad", got["dx"], ref["dx"][rank])
    _close(errors, where, "topk_weights.grad", got["dw"], ref["dw"][rank])
    _close(errors, where, "weight1.grad", got["dw1"], ref["dw1"][lo:hi])
    _close(errors, where, "weight2.grad", got["dw2"], ref["dw2"][lo:hi])
    if case.empty_expert is not None and lo <= case.empty_expert < hi:
        j = case.empty_expert - lo
        if bool(got["dw1"][j].any()) or bool(got["dw2"][j].any()):
            errors.append(f"{where}: the expert without tokens has a nonzero weight gradient")
    return errors


def buffer_equals_local(rank: int, world: int, group: Any, seed: int) -> list[str]:
    """On one rank, a Buffer (reference backend; synced, and sync-free for every other case) gives the
    local path's results bit for bit: the same expert-major rows, GEMMs and order of every sum."""
    from lck_ep import Buffer

    errors: list[str] = []
    kw: dict[str, Any] = {}
    if "backend" in inspect.signature(Buffer).parameters:
        kw["backend"] = "reference"
    for i, case in enumerate(CASES):
        inputs = make_inputs(case, 1, seed + i)
        buf = Buffer(group, T_MAX, H, case.num_topk, E, sync_free=bool(i % 2), **kw)
        a = run_layer(_module(0, 1, group, inputs, case), 0, inputs)
        b = run_layer(_module(0, 1, group, inputs, case, buffer=buf), 0, inputs)
        for name in a:
            if not torch.equal(a[name], b[name]):
                errors.append(f"{case.name} (sync_free={buf.sync_free}): {name} differs from the local path")
    return errors


def cuda_buffer_equals_local(rank: int, world: int, seed: int) -> list[str]:
    """The same on CUDA in bf16 (one NCCL rank): torch._grouped_mm and the Triton kernels on both paths."""
    from lck_ep import Buffer, MoEExperts

    errors: list[str] = []
    dev = torch.device("cuda", torch.cuda.current_device())
    e, h, f, t = 16, 256, 128, 384
    kw: dict[str, Any] = {}
    if "backend" in inspect.signature(Buffer).parameters:
        kw["backend"] = "reference"
    for k, alignment in ((1, 1), (4, 16), (8, 8)):
        g = torch.Generator().manual_seed(seed + k)
        x = torch.randn(t, h, generator=g).bfloat16().to(dev)
        idx = torch.rand(t, e, generator=g).argsort(1)[:, :k]
        idx = torch.where(torch.rand(t, k, generator=g) < 0.2, -1, idx)
        idx = torch.where(idx == 3, -1, idx).to(dev)
        w = torch.rand(t, k, generator=g).to(dev)
        dy = torch.randn(t, h, generator=g).bfloat16().to(dev)
        outs = []
        for buf in (None, Buffer(dist.group.WORLD, t, h, k, e, **kw)):
            m = MoEExperts(e, h, f, buffer=buf, dtype=torch.bfloat16, device=dev, expert_alignment=alignment)
            torch.manual_seed(seed)
            m.reset_parameters()
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = m(xr, idx, wr)
            y.backward(dy)
            outs.append({"y": y, "dx": xr.grad, "dw": wr.grad, "dw1": m.weight1.grad, "dw2": m.weight2.grad})
        for name in outs[0]:
            if not torch.equal(outs[0][name], outs[1][name]):
                diff = float((outs[0][name].float() - outs[1][name].float()).abs().max())
                errors.append(
                    f"top{k} alignment {alignment}: {name} differs (max {diff:.3e}) from the local path"
                )
    return errors


def stack_contract(rank: int, world: int, group: Any, seed: int) -> list[str]:
    """max_inflight=2: a third forward is refused before it dispatches; an out-of-order backward is
    refused and pops nothing; in LIFO order both backwards run and empty the stack."""
    from lck_runtime.contexts import moe_context

    errors: list[str] = []
    case = CASES[3]
    inputs = make_inputs(case, world, seed)
    m = _module(rank, world, group, inputs, case)
    ctx = moe_context(group)
    x, idx, w, dy = inputs["ranks"][rank]
    xs = [x.float().requires_grad_() for _ in range(3)]
    y1 = m(xs[0], idx, w.float())
    y2 = m(xs[1], idx, w.float())
    calls = []
    buf = m.buffer
    if buf is not None:
        real = buf.dispatch
        buf.dispatch = lambda *a, **k: calls.append(1) or real(*a, **k)  # count dispatches from here on
    try:
        m(xs[2], idx, w.float())
        errors.append("a forward beyond max_inflight was not refused")
    except RuntimeError as exc:
        if "max_inflight=2" not in str(exc):
            errors.append(f"overflow message does not name max_inflight: {exc}")
    if calls:
        errors.append("the refused forward dispatched")
    if ctx.inflight != 2:
        errors.append(f"after the refused forward inflight={ctx.inflight}, expected 2")
    try:
        y1.backward(dy.float())
        errors.append("an out-of-order backward was not refused")
    except RuntimeError as exc:
        if "LIFO" not in str(exc):
            errors.append(f"out-of-order message does not say LIFO: {exc}")
    if ctx.inflight != 2:
        errors.append(f"after the refused backward inflight={ctx.inflight}, expected 2")
    y2.backward(dy.float())
    y1.backward(dy.float())
    if ctx.inflight != 0:
        errors.append(f"after both backwards inflight={ctx.inflight}, expected 0")
    if xs[0].grad is None or not torch.equal(xs[0].grad, xs[1].grad):
        errors.append("the two retained forwards of the same input gave different x gradients")
    with torch.no_grad():  # no backward can follow: nothing is retained
        m(xs[2], idx, w.float())
    if ctx.inflight != 0:
        errors.append(f"a forward under no_grad retained state (inflight={ctx.inflight})")
    return errors


def _configure_stack() -> None:
    from lck_runtime import MoEConfig, configure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NVSHMEM unavailable on CPU: the torch.distributed path
        configure(moe=MoEConfig(max_tokens=T_MAX, hidden_size=H, num_experts=E, top_k=8, max_inflight=2))


def _guard(results: dict[str, list[str]], key: str, fn: Any, *args: Any) -> None:
    try:
        results[key] = fn(*args)
    except Exception:
        results[key] = [f"{key} raised:\n{traceback.format_exc()}"]


def _experts_not_multiple(group: Any, world: int) -> list[str]:
    from lck_ep import MoEExperts

    try:
        MoEExperts(world + 2, H, F, group=group)
    except ValueError as exc:
        want = f"num_experts={world + 2} must be a multiple of the group size {world}"
        return [] if want in str(exc) else [f"unexpected message: {exc}"]
    return ["num_experts not a multiple of the group size was accepted"]


def worker(rank: int, world: int, seed: int) -> dict[str, list[str]]:
    """Keys ``"<group size>:<check>"``. One process: every case through the local path with the runtime's
    stack, the stack contract, the Buffer path equal to the local one. Four processes: every case on the
    4-rank world and on two 2-rank subgroups side by side (ordinary autograd saving), then, with the
    runtime configured, the stack contract and a case through the stack on the world."""
    results: dict[str, list[str]] = {}
    world_group = dist.group.WORLD
    if world == 1:
        _configure_stack()
        for i, case in enumerate(CASES):
            _guard(results, f"1:{case.name}", check_case, case, 0, 1, world_group, seed + 101 * i)
        _guard(results, "1:stack", stack_contract, 0, 1, world_group, seed)
        _guard(results, "1:buffer_equals_local", buffer_equals_local, 0, 1, world_group, seed)
        return results
    for i, case in enumerate(CASES):
        _guard(results, f"{world}:{case.name}", check_case, case, rank, world, world_group, seed + 101 * i)
    for i in (1, 6):  # two aligned cases through sync-free Buffers (capacity-sized expanded rows)
        case = CASES[i]
        key = f"{world}:sync_free_{case.name}"
        _guard(results, key, check_case, case, rank, world, world_group, seed + 11 * i, True)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    pair = pairs[rank // 2]
    for i, case in enumerate(CASES):
        _guard(results, f"2:{case.name}", check_case, case, rank % 2, 2, pair, seed + 101 * i + 7)
    _guard(results, f"{world}:experts_not_multiple", _experts_not_multiple, world_group, world)
    _configure_stack()
    _guard(results, f"{world}:stack", stack_contract, rank, world, world_group, seed)
    _guard(results, f"{world}:stack_case", check_case, CASES[-1], rank, world, world_group, seed + 3)
    return results


def native_equals_local(rank: int, world: int, seed: int) -> list[str]:
    """NVSHMEM PEs (several may share a GPU under MPS): the layer through a native-backend Buffer against
    the no-communication layer holding every expert, run here on every rank's tokens at once; outputs
    and gradients within bf16 tolerance, weight gradients of this rank's experts included."""
    import lck_runtime as L
    from lck_ep import Buffer, MoEExperts

    errors: list[str] = []
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    e, h, f, t_max, k = 8 * world, 256, 128, 256, 8
    # Workspace rows for 4 * t_max tokens per source: room for the synced layer's largest expanded layout, so
    # that its second GEMM writes into the workspace and the combine reads there (zero-copy).
    cfg = L.MoEConfig(max_tokens=4 * t_max, hidden_size=h, num_experts=e, top_k=k, max_inflight=2)
    if not L.configure(moe=cfg):
        return [f"rank {rank}: configure(moe=...) did not bring up the native (NVSHMEM) runtime"]
    try:
        g = torch.Generator().manual_seed(seed)
        w1 = (torch.randn(e, h, 2 * f, generator=g) / h**0.5).bfloat16().to(dev)
        w2 = (torch.randn(e, f, h, generator=g) / f**0.5).bfloat16().to(dev)
        per_rank = []
        for r in range(world):
            t = t_max if r == 0 else int(torch.randint(1, t_max + 1, (1,), generator=g))
            idx = torch.rand(t, e, generator=g).argsort(1)[:, :k]
            idx = torch.where(torch.rand(t, k, generator=g) < 0.2, -1, idx)
            idx = torch.where(idx == 1, -1, idx)  # expert 1 (on rank 0) gets no token
            per_rank.append(
                (
                    torch.randn(t, h, generator=g).bfloat16().to(dev),
                    idx.to(dev),
                    torch.rand(t, k, generator=g).to(dev),
                    torch.randn(t, h, generator=g).bfloat16().to(dev),
                )
            )

        def run(
            m: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
        ) -> dict[str, Any]:
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = m(xr, idx, wr)
            y.backward(dy)
            return {"y": y, "dx": xr.grad, "dw": wr.grad, "dw1": m.weight1.grad, "dw2": m.weight2.grad}

        local = MoEExperts(e, h, f, dtype=torch.bfloat16, device=dev)
        with torch.no_grad():
            local.weight1.copy_(w1)
            local.weight2.copy_(w2)
        cat = [torch.cat([p[i] for p in per_rank]) for i in range(4)]
        want = run(local, *cat)
        start = sum(p[0].shape[0] for p in per_rank[:rank])
        rows = slice(start, start + per_rank[rank][0].shape[0])
        lo, hi = rank * e // world, (rank + 1) * e // world
        want = {
            "y": want["y"][rows], "dx": want["dx"][rows], "dw": want["dw"][rows],
            "dw1": want["dw1"][lo:hi], "dw2": want["dw2"][lo:hi],
        }  # fmt: skip
        for sync_free in (False, True):
            buf = Buffer(dist.group.WORLD, t_max, h, k, e, sync_free=sync_free, device=dev, backend="nvshmem")
            m = MoEExperts(e, h, f, buffer=buf, dtype=torch.bfloat16, device=dev, expert_alignment=16)
            with torch.no_grad():
                m.weight1.copy_(w1[lo:hi])
                m.weight2.copy_(w2[lo:hi])
            in_place: list[bool] = []
            handed_out = buf.combine_input

            def spy(
                handle: Any, dtype: torch.dtype = torch.bfloat16, handed_out: Any = handed_out, buf: Any = buf,
                in_place: list[bool] = in_place,
            ) -> Any:  # fmt: skip
                z = handed_out(handle, dtype)
                in_place.append(buf._native.takes_in_place(z, handle))
                return z

            buf.combine_input = spy
            got = run(m, *per_rank[rank])
            if in_place != [
                not sync_free
            ]:  # the forward's combine only; the backward's has no GEMM writing it
                errors.append(f"rank {rank} sync_free={sync_free}: zero-copy combine inputs {in_place}")
            for name, ref in want.items():
                scale = max(1.0, float(ref.abs().max()))
                err = float((got[name].double() - ref.double()).abs().max())
                if not err <= 2e-2 * scale:
                    errors.append(
                        f"rank {rank} sync_free={sync_free}: {name} max error {err:.3e} against the local layer"
                    )
            if L.moe_context(dist.group.WORLD).inflight != 0:
                errors.append(f"rank {rank}: retained forwards left on the stack")
            buf.check_errors()
    except Exception:
        errors.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    finally:
        L.finalize()
    return errors
