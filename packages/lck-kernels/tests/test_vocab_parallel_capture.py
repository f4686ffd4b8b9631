"""The vocabulary-parallel ops inside CUDA graphs (``_vocab_parallel_capture``).

- The device-side verdict kernel alone: equal rows and in-range targets give 0, anything else NaN.
- CPU variant (2 gloo processes, Triton's interpreter): capture simulated by reporting the stream as
  capturing, so the capture path runs for real apart from the graph itself: a call with shapes the group
  never agreed on eagerly raises the same error on every rank; after a warm-up the results equal the eager
  ones; targets that differ between ranks or leave the vocabulary turn loss and lse into NaN; an invalid
  input, a differing option or a missing eager agreement on one rank alone raises the same error on both.
- GPU variant (``multigpu(2)``): both ops captured, forward and backward, into real CUDA graphs over NCCL
  and over the runtime's NVSHMEM context, replayed on fresh inputs against eager calls, and replayed with
  bad targets (NaN on both ranks); an invalid input on rank 1 alone during a real capture raises the same
  error on both ranks (agreed through the group's gloo mirror).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from _graphs import capture
from _tp_helpers import GPU_ENV, INTERPRET, _expect_error, _section, _sections, cpu_variant, run_cpu_world

from lck_kernels.vocab_parallel import capture as vp_capture
from lck_kernels.vocab_parallel.digest import TARGET_FIELDS, TARGET_LIMBS, target_digest, target_verdict
from lck_runtime.testing import run_workers

IGNORE = -100

# ---------------------------------------------------------------------------------------------------------
# The verdict kernel
# ---------------------------------------------------------------------------------------------------------


def _rows(targets: list[torch.Tensor], sig: float = 7.0) -> torch.Tensor:
    device = "cpu" if INTERPRET else "cuda"
    rows = torch.full((len(targets), 1 + TARGET_FIELDS * TARGET_LIMBS), float("nan"), device=device)
    for r, t in enumerate(targets):
        rows[r, 0] = sig
        target_digest(t.to(device), IGNORE, rows[r, 1:])
    return rows


def _verdict(rows: torch.Tensor, vocab: int) -> float:
    out = torch.full((), 123.0, device=rows.device)
    target_verdict(rows, 1, vocab, out)
    return float(out)


@pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1"
)
def test_verdict_kernel() -> None:
    t = torch.randint(0, 100, (37,), generator=torch.Generator().manual_seed(0))
    t[::5] = IGNORE
    assert _verdict(_rows([t, t.clone()]), 100) == 0.0
    assert _verdict(_rows([t]), 100) == 0.0  # a group of one
    other = t.clone()
    other[1] = (other[1] + 1) % 100
    assert math.isnan(_verdict(_rows([t, other]), 100))
    swapped = t.clone()
    swapped[[1, 2]] = torch.tensor([11, 12])
    swapped2 = swapped.clone()
    swapped2[[1, 2]] = torch.tensor([12, 11])  # same targets, another order
    assert math.isnan(_verdict(_rows([swapped, swapped2]), 100))
    rows = _rows([t, t])
    rows[1, 0] = 8.0  # another call signature
    assert math.isnan(_verdict(rows, 100))
    for bad in (100, -1, 10**12):
        b = t.clone()
        b[4] = bad
        assert math.isnan(_verdict(_rows([b, b]), 100)), bad
    edge = t.clone()
    edge[4], edge[6] = 0, 99
    assert _verdict(_rows([edge, edge]), 100) == 0.0
    ignored = torch.full((9,), IGNORE)
    assert _verdict(_rows([ignored, ignored]), 100) == 0.0  # no target to range-check


# ---------------------------------------------------------------------------------------------------------
# CPU: capture simulated on 2 gloo processes
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _simulated_capture():
    real = vp_capture.capturing
    vp_capture.capturing = lambda device: True
    try:
        yield
    finally:
        vp_capture.capturing = real


def _same(seed: int, n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _world2_cpu(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy as ce
    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce

    g = dist.group.WORLD
    n, vocab, hidden = 24, 64, 16
    local = vocab // world

    def logits(seed: int, tokens: int = n) -> torch.Tensor:
        full = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(seed)) * 3
        return full[:, rank * local : (rank + 1) * local].contiguous()

    def ce_call(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ce(z, t, g, label_smoothing=0.1)

    def cold() -> str:
        vp_capture.forget()
        with _simulated_capture():
            return _expect_error(RuntimeError, lambda: ce_call(logits(1), _same(1, n, vocab)), "warm-up")

    def warm() -> None:
        vp_capture.forget()
        t = _same(2, n, vocab)
        t[::4] = IGNORE
        ce_call(logits(2), t)  # the eager warm-up: the group agrees on these shapes and options
        for seed in (3, 4):  # fresh inputs, same shapes: the captured path gives the eager numbers
            z, t = logits(seed), _same(seed, n, vocab)
            eager = ce_call(z, t)
            with _simulated_capture():
                got = ce_call(z, t)
            assert torch.equal(got, eager), (got, eager)
        # What the captures read stays alive when the remembered agreements are evicted.
        pinned = dict(vp_capture._pinned)
        assert pinned, "a captured call must pin the signature it read"
        saved, vp_capture._MAX_REMEMBERED = vp_capture._MAX_REMEMBERED, 1
        try:
            ce_call(logits(9, n + 2), _same(9, n + 2, vocab))  # another signature evicts the first
        finally:
            vp_capture._MAX_REMEMBERED = saved
        assert len(vp_capture._agreed) == 1
        assert all(vp_capture._pinned[k] is v for k, v in pinned.items())
        ce_call(logits(10), _same(10, n, vocab))  # agreed again: the pinned limbs come back, not a copy
        assert all(vp_capture._agreed[k] is v for k, v in pinned.items())
        with _simulated_capture():  # 25 tokens were never agreed eagerly
            _expect_error(RuntimeError, lambda: ce_call(logits(5, n + 1), _same(5, n + 1, vocab)), "warm-up")
            # local problems still raise at capture time (here on both ranks, before any communication)
            _expect_error(TypeError, lambda: ce_call(logits(5), _same(5, n, vocab).float()), "target")

    def bad_targets() -> dict[str, bool]:
        vp_capture.forget()
        z = logits(6)
        ce_call(z, _same(6, n, vocab))
        out = {}
        with _simulated_capture():
            differ = _same(6, n, vocab)
            if rank == 1:
                differ[3] = (differ[3] + 1) % vocab
            out["differ"] = bool(torch.isnan(ce_call(z, differ)).all())
            outside = _same(6, n, vocab)
            outside[5] = vocab
            out["outside"] = bool(torch.isnan(ce_call(z, outside)).all())
            negative = _same(6, n, vocab)
            negative[0] = -1
            out["negative"] = bool(torch.isnan(ce_call(z, negative)).all())
            out["fine"] = bool(torch.isfinite(ce_call(z, _same(7, n, vocab))).all())
        return out

    def fused() -> None:
        vp_capture.forget()
        gen = torch.Generator().manual_seed(8)
        x = torch.randn(n, hidden, generator=gen)
        w = (torch.randn(vocab, hidden, generator=gen) * 0.3)[rank * local : (rank + 1) * local].contiguous()
        t = _same(8, n, vocab)
        for reduction in ("mean", "none"):
            xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            nll, lse = flsce(xs, ws, t, g, inverse_temperature=0.9, reduction=reduction)
            eager = (nll.detach(), lse.detach(), *torch.autograd.grad(nll.sum() + lse.sum(), (xs, ws)))
            with _simulated_capture():
                xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                nll, lse = flsce(xs, ws, t, g, inverse_temperature=0.9, reduction=reduction)
                got = (nll.detach(), lse.detach(), *torch.autograd.grad(nll.sum() + lse.sum(), (xs, ws)))
                for a, b in zip(got, eager):
                    assert torch.equal(a, b), (reduction, a, b)
                outside = t.clone()
                outside[2] = -5
                nll, lse = flsce(xs, ws, outside, g, inverse_temperature=0.9, reduction=reduction)
                assert torch.isnan(nll).all() and torch.isnan(lse).all(), (reduction, nll, lse)
                # another inverse temperature is another call signature
                _expect_error(
                    RuntimeError,
                    lambda xs=xs, ws=ws, r=reduction: flsce(
                        xs, ws, t, g, inverse_temperature=0.5, reduction=r
                    ),
                    "warm-up",
                )

    def one_rank_wrong() -> dict[str, str]:
        """Problems on rank 1 alone, met while capturing: every rank raises the same error, at capture."""
        vp_capture.forget()
        z, t = logits(11), _same(11, n, vocab)
        ce_call(z, t)
        out = {}
        with _simulated_capture():
            out["invalid input"] = _expect_error(
                TypeError, lambda: ce_call(z, t.float() if rank == 1 else t), "rank 1", "rejected", "target"
            )
            out["options differ"] = _expect_error(
                ValueError,
                lambda: ce(z, t, g, label_smoothing=0.2 if rank == 1 else 0.1),
                "disagree on label_smoothing",
            )
        if rank == 1:
            vp_capture.forget()  # rank 1 lost its eager agreement; rank 0 still has it
        with _simulated_capture():
            out["not agreed on one rank"] = _expect_error(RuntimeError, lambda: ce_call(z, t), "rank(s) [1]")
        return out

    return _sections(
        rank,
        [
            ("cold", cold),
            ("warm", warm),
            ("bad_targets", bad_targets),
            ("fused", fused),
            ("one_rank_wrong", one_rank_wrong),
        ],
    )


@pytest.fixture(scope="module")
def world2() -> list[dict[str, object]]:
    return run_cpu_world(_world2_cpu)


@cpu_variant
def test_capture_without_an_eager_agreement_raises_on_every_rank(world2) -> None:
    msgs = _section(world2, "cold")
    assert msgs[0] == msgs[1], msgs


@cpu_variant
def test_captured_path_equals_eager_after_a_warm_up(world2) -> None:
    _section(world2, "warm")


@cpu_variant
def test_bad_targets_in_a_capture_give_nan_on_every_rank(world2) -> None:
    for rank, out in enumerate(_section(world2, "bad_targets")):
        assert out == {"differ": True, "outside": True, "negative": True, "fine": True}, (rank, out)


@cpu_variant
def test_fused_linear_variant_captured_path(world2) -> None:
    _section(world2, "fused")


@cpu_variant
def test_a_problem_on_one_rank_during_capture_raises_the_same_error_on_every_rank(world2) -> None:
    outs = _section(world2, "one_rank_wrong")
    assert outs[0] == outs[1], outs


# ---------------------------------------------------------------------------------------------------------
# GPU: real CUDA graphs on 2 GPUs, NCCL and NVSHMEM
# ---------------------------------------------------------------------------------------------------------


def _replay(graph, static, fresh, outs) -> None:
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
        for o in outs:
            o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def _gpu_cases(g, rank: int, world: int) -> dict[str, bool]:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy as ce
    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce
    from lck_runtime import flsce_context

    dev = torch.device("cuda", torch.cuda.current_device())
    n, vocab, hidden = 2048, 32000, 1024
    local = vocab // world

    def gen(seed):
        return torch.Generator(device=dev).manual_seed(seed)

    def say(step: str) -> None:  # progress, so that a timeout's report shows where each rank was
        print(f"rank {rank} {'nvshmem' if flsce_context(g, required=False) else 'nccl'}: {step}", flush=True)

    def targets(seed):
        t = torch.randint(0, vocab, (n,), device=dev, generator=gen(1000 + seed))
        t[::7] = IGNORE
        return t

    def shard_logits(seed):
        full = torch.randn(n, vocab, device=dev, generator=gen(seed)) * 3
        return full[:, rank * local : (rank + 1) * local].to(torch.bfloat16)

    out: dict[str, bool] = {}
    # vocab-parallel cross entropy, mean over tokens, forward + backward in one graph
    z, t = shard_logits(0).requires_grad_(True), targets(0)
    cot = torch.tensor(0.6, device=dev, dtype=torch.bfloat16)  # made outside the graph: no host copy in it

    def ce_step():
        loss = ce(z, t, g, reduction="mean", label_smoothing=0.05)
        (grad,) = torch.autograd.grad(loss, (z,), cot)
        return loss.detach(), grad

    say("cross entropy: capture")
    graph, outs = capture(ce_step, mode="thread_local")
    say("cross entropy: replays")
    for seed in (1, 2):
        fresh = [shard_logits(seed), targets(seed)]
        _replay(graph, [z, t], fresh, outs)
        zr = fresh[0].clone().requires_grad_(True)
        ref = ce(zr, fresh[1], g, reduction="mean", label_smoothing=0.05)
        (ref_grad,) = torch.autograd.grad(ref, (zr,), cot)
        torch.testing.assert_close(outs[0], ref)
        torch.testing.assert_close(outs[1], ref_grad)
    bad = targets(3)
    if rank == 1:
        bad[10] = (bad[10] + 1) % vocab
    _replay(graph, [z, t], [shard_logits(3), bad], outs)
    out["ce_differ_nan"] = bool(torch.isnan(outs[0]))
    bad = targets(4)
    bad[11] = vocab + 3
    _replay(graph, [z, t], [shard_logits(4), bad], outs)
    out["ce_outside_nan"] = bool(torch.isnan(outs[0]))

    # vocab-parallel FLSCE: per-token outputs (recompute backward, grad_x all-reduce in the backward)
    # and the mean (gradients prepared in the forward), each forward + backward in one graph
    def flsce_inputs(seed):
        gg = gen(2000 + seed)
        x = torch.randn(n, hidden, device=dev, generator=gg).to(torch.bfloat16)
        w = (torch.randn(vocab, hidden, device=dev, generator=gg) * 0.05).to(torch.bfloat16)
        return [x, w[rank * local : (rank + 1) * local].contiguous(), targets(seed)]

    for reduction in ("none", "mean"):
        x, w, tt = flsce_inputs(0)
        x.requires_grad_(True)
        w.requires_grad_(True)

        def step(x=x, w=w, tt=tt, reduction=reduction):
            nll, lse = flsce(x, w, tt, g, inverse_temperature=0.8, reduction=reduction, chunk_bytes=16 << 20)
            loss = nll.sum() if reduction == "none" else nll
            gx, gw = torch.autograd.grad(loss * 0.5, (x, w))
            # detached: the replays overwrite these views of the op's outputs in place
            return nll.detach(), lse.detach(), gx, gw

        say(f"fused {reduction}: capture")
        graph, outs = capture(step, mode="thread_local")
        say(f"fused {reduction}: replays")
        for seed in (1, 2):
            fresh = flsce_inputs(seed)
            _replay(graph, [x, w, tt], fresh, outs)
            say(f"fused {reduction}: replayed {seed}")
            xr, wr = fresh[0].clone().requires_grad_(True), fresh[1].clone().requires_grad_(True)
            nll, lse = flsce(
                xr, wr, fresh[2], g, inverse_temperature=0.8, reduction=reduction, chunk_bytes=16 << 20
            )
            loss = nll.sum() if reduction == "none" else nll
            ref = (nll.detach(), lse.detach(), *torch.autograd.grad(loss * 0.5, (xr, wr)))
            for a, b in zip(outs, ref):
                torch.testing.assert_close(a, b)
        fresh = flsce_inputs(3)
        fresh[2][0] = -7
        _replay(graph, [x, w, tt], fresh, outs)
        out[f"flsce_{reduction}_outside_nan"] = bool(
            torch.isnan(outs[0]).all() and torch.isnan(outs[1]).all()
        )
    # A problem on rank 1 alone met while capturing: every rank raises the same error, nothing hangs.
    say("a problem on rank 1 alone, during capture")
    zc, tc = shard_logits(5), targets(5)
    ce(zc, tc, g, reduction="mean")  # the eager warm-up
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            ce(zc, tc.float() if rank == 1 else tc, g, reduction="mean")
        out["local_error"] = "<no error>"
    except TypeError as exc:
        out["local_error"] = str(exc)
    say("done")
    dist.barrier()
    return out


def _world2_gpu(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from lck_runtime import FusedLinearCrossEntropyConfig, configure, finalize

    g = dist.group.WORLD

    def nvshmem() -> dict[str, object]:
        native = configure(
            process_groups={"tp": g},
            flsce=FusedLinearCrossEntropyConfig(
                max_tokens=4096, hidden_size=1024, local_vocab_size=16000, group="tp"
            ),
        )
        try:
            return {"native": native, **_gpu_cases(g, rank, world)}
        finally:
            print(f"rank {rank}: finalize", flush=True)
            finalize()
            print(f"rank {rank}: finalized", flush=True)

    return _sections(rank, [("nccl", lambda: _gpu_cases(g, rank, world)), ("nvshmem", nvshmem)])


@pytest.mark.multigpu(2)
def test_gpu_tp2_cuda_graphs_nccl_and_nvshmem() -> None:
    results = run_workers(_world2_gpu, 2, backend="nccl", env=GPU_ENV, timeout=120)
    for name in ("nccl", "nvshmem"):
        outs = _section(results, name)
        for rank, out in enumerate(outs):
            flags = {k: v for k, v in out.items() if k not in ("native", "local_error")}
            assert all(flags.values()) and len(flags) == 4, (name, rank, out)
        errors = [out["local_error"] for out in outs]
        assert errors[0] == errors[1] and "rank 1 of the tensor-parallel group rejected" in errors[0], errors
    assert [r["nvshmem"][1]["native"] for r in results] == [True, True], results
