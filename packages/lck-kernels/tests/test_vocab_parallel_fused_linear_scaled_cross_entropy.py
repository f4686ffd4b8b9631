"""vocab_parallel_fused_linear_scaled_cross_entropy against a float64 reference on the unsharded weight.

The reference: ``z = inverse_temperature · x @ Wᵀ`` over the whole vocabulary in float64, per-token NLL,
log-sum-exp and entropy (0 on ignored tokens), and their gradients for random per-token upstream gradients.
CPU variant: 2 and 4 gloo processes, Triton in its interpreter, small shapes, several chunks per call.
GPU variant (``multigpu(2)``): 2 NCCL processes, the runtime configured (NVSHMEM on H200), real sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
from _tolerances import assert_close
from _tp_helpers import (
    _expect_error,
    _poison_cached_memory,
    _same_targets,
    _sections,
    _timed,
    cpu_variant,
    gpu_tp2_test,
    run_side_by_side,
    run_world_tests,
    same_messages,
    world_test,
)
from test_fused_linear_scaled_cross_entropy import assert_no_worse_than_eager, eager_linear

OUTPUTS = ("nll", "lse", "entropy")


def _reference(x, w, target, tau, ignore_index, reduction):
    """float64 (nll, lse, entropy) on the whole vocabulary; ignored tokens give 0."""
    z = (x @ w.t()) * tau
    valid = target != ignore_index
    logp = z.log_softmax(-1)
    picked = logp.gather(-1, target.clamp(0, w.shape[0] - 1).unsqueeze(-1)).squeeze(-1)
    nll = torch.where(valid, -picked, 0.0)
    lse = torch.where(valid, z.logsumexp(-1), 0.0)
    entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    if reduction == "sum":
        nll = nll.sum()
    elif reduction == "mean":
        nll = nll.sum() / valid.sum()
    return nll, lse, entropy


def _check_collectives(group: object, where: str) -> None:
    """A one-shot all-reduce that timed out poisons its output with NaN: report its diagnostic (which
    member, which epochs) rather than the NaN it left."""
    from lck_runtime import flsce_context

    ctx = flsce_context(group, required=False)
    if ctx is not None:
        try:
            ctx.check_collectives()
        except Exception as exc:
            raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc


def _case(
    group,
    *,
    lead: tuple[int, ...],
    hidden: int,
    vocab: int,
    dtype=torch.float32,
    tau: float = 1.0,
    ignore_index: int = -100,
    targets: str = "random",
    reduction: str = "none",
    grads: tuple[str, ...] = OUTPUTS,
    x_grad: bool = True,
    w_grad: bool = True,
    chunk_bytes: int | None = None,
    seed: int = 0,
    device: str = "cpu",
) -> None:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce

    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    vs = vocab // tp
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (
        (torch.randn(*lead, hidden, generator=gen, dtype=torch.float64, device=device) * 1.5)
        .to(dtype)
        .double()
    )
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64, device=device) / math.sqrt(hidden)
    w = w.to(dtype).double()
    lo, hi = (vocab - vs, vocab) if targets == "last_shard" else (0, vocab)
    target = torch.randint(lo, hi, lead, generator=gen, device=device)
    if targets == "some_ignored":
        target.view(-1)[::4] = ignore_index
    elif targets == "all_ignored":
        target.fill_(ignore_index)
    ups = {
        "nll": torch.randn(lead, generator=gen, dtype=torch.float64, device=device)
        if reduction == "none"
        else torch.tensor(0.7, dtype=torch.float64, device=device),
        "lse": 0.3 * torch.randn(lead, generator=gen, dtype=torch.float64, device=device),
        "entropy": 0.5 * torch.randn(lead, generator=gen, dtype=torch.float64, device=device),
    }

    _poison_cached_memory(device)
    xs = x.to(dtype).requires_grad_(x_grad)
    ws = w[rank * vs : (rank + 1) * vs].to(dtype).requires_grad_(w_grad)
    outs = flsce(
        xs,
        ws,
        target,
        group,
        inverse_temperature=tau,
        ignore_index=ignore_index,
        return_entropy=True,
        reduction=reduction,
        chunk_bytes=chunk_bytes,
    )
    assert isinstance(outs, tuple) and len(outs) == 3, (
        f"return_entropy=True must give 3 outputs, got {len(outs)}"
    )
    _check_collectives(group, "forward")
    picked = [i for i, n in enumerate(OUTPUTS) if n in grads]
    torch.autograd.backward([outs[i] for i in picked], [ups[OUTPUTS[i]].float() for i in picked])
    _check_collectives(group, "backward")

    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    refs = _reference(xr, wr, target, tau, ignore_index, reduction)
    torch.autograd.backward([refs[i] for i in picked], [ups[OUTPUTS[i]] for i in picked])
    what = f"rank {rank}/{tp} lead={lead} H={hidden} V={vocab} {dtype} tau={tau} {reduction} grads={grads} {targets}"
    # Half precision on a GPU: the logits are rounded to x's dtype (as in any bf16 step), which plain torch in
    # that dtype suffers as much; the test holds the op to plain eager's error against float64 (see
    # test_fused_linear_scaled_cross_entropy). On CPU the interpreter truncates fp32 -> bf16 where GPUs round
    # to nearest, so there the small shapes keep the fixed tolerances.
    base = None
    if _against_eager(dtype, xs):
        base = _eager_baseline(x, w, target, tau, ignore_index, reduction, ups, grads, dtype)

    def check(got, want, key, name):
        if base is not None:
            assert_no_worse_than_eager(got, base[key], want, dtype, name=f"{name} ({what})")
        else:
            assert_close(got, want, dtype, name=f"{name} ({what})")

    for name, out, ref in zip(OUTPUTS, outs, refs):
        assert out.dtype == torch.float32 and out.shape == ref.shape, (
            f"{name} ({what}): {out.dtype} {out.shape}"
        )
        if ref.numel() == 0:
            continue
        if targets == "all_ignored" and reduction == "mean" and name == "nll":
            assert torch.isnan(out), f"{what}: mean over no targets must be NaN like the reference, got {out}"
            continue
        check(out, ref, name, name)
    if x_grad:
        if xr.grad is None or xr.grad.numel() == 0:
            assert xs.grad is None or xs.grad.numel() == 0 or not xs.grad.any(), f"{what}: unexpected grad_x"
        else:
            check(xs.grad, xr.grad, "grad x", "grad_x")
    else:
        assert xs.grad is None
    if w_grad:
        ref_w = wr.grad[rank * vs : (rank + 1) * vs]
        if ref_w.abs().max() == 0:  # all ignored: exactly zero, no NaN
            assert torch.count_nonzero(ws.grad) == 0, f"{what}: grad_weight must be 0"
        else:
            if base is not None:
                base["grad weight"] = base["grad weight"][rank * vs : (rank + 1) * vs]
            check(ws.grad, ref_w, "grad weight", "grad_weight_shard")
    else:
        assert ws.grad is None


def _against_eager(dtype: torch.dtype, x: torch.Tensor) -> bool:
    return dtype != torch.float32 and x.is_cuda


def _eager_baseline(x, w, target, tau, ignore_index, reduction, ups, grads, dtype) -> dict:
    """Plain torch eager in ``dtype`` on the whole vocabulary (``eager_linear``), shaped like the op's outputs."""
    assert ignore_index == -100, "eager_linear ignores -100"
    lead, hidden = tuple(x.shape[:-1]), x.shape[-1]

    def up(name):
        g = ups[name] if name in grads else torch.zeros_like(ups[name])
        return g.float().reshape(-1) if g.dim() > 0 else g.float()

    base = eager_linear(
        x.reshape(-1, hidden).to(dtype), w.to(dtype), target.reshape(-1), reduction=reduction,
        g_nll=up("nll"), g_lse=up("lse"), g_entropy=up("entropy"), inverse_temperature=tau,
    )  # fmt: skip
    for name in OUTPUTS:
        if base[name].dim() > 0:
            base[name] = base[name].view(lead)
    base["grad x"] = base["grad x"].view(*lead, hidden)
    return base


# ---------------------------------------------------------------------------------------------------------
# CPU: 2 processes
# ---------------------------------------------------------------------------------------------------------


def _reference_cases(group) -> None:
    row = 96 // 2 * 4  # bytes of one fp32 logits row of the local shard in most cases below
    for i, kw in enumerate(
        [
            dict(lead=(24,), hidden=32, vocab=96),
            # several chunks with a tail (24 = 5 + 5 + 5 + 5 + 4), temperature, some ignored
            dict(lead=(24,), hidden=32, vocab=96, tau=0.7, targets="some_ignored", chunk_bytes=5 * row),
            dict(lead=(3, 7), hidden=16, vocab=96, tau=1.6, targets="last_shard", chunk_bytes=4 * row),
            dict(lead=(16,), hidden=32, vocab=96, reduction="mean", grads=("nll",), targets="some_ignored"),
            dict(lead=(16,), hidden=32, vocab=96, reduction="sum", grads=("nll", "entropy")),
            # gradients prepared in the forward (several chunks, per-chunk reductions), frozen input
            dict(
                lead=(20,),
                hidden=32,
                vocab=96,
                reduction="sum",
                grads=("nll",),
                x_grad=False,
                chunk_bytes=6 * row,
            ),
            dict(
                lead=(20,), hidden=32, vocab=96, reduction="mean", tau=1.3, chunk_bytes=6 * row, w_grad=False
            ),
            dict(lead=(16,), hidden=32, vocab=96, grads=("entropy",)),  # entropy bonus only
            dict(lead=(16,), hidden=32, vocab=96, grads=("lse",), x_grad=False),  # z-loss, frozen input
            dict(lead=(16,), hidden=32, vocab=96, w_grad=False, ignore_index=7, targets="some_ignored"),
            dict(lead=(1,), hidden=8, vocab=64),
            dict(lead=(16,), hidden=32, vocab=128, dtype=torch.bfloat16, tau=0.5),
        ]
    ):
        _case(group, seed=i, **kw)


def _ignored_cases(group) -> None:
    for i, reduction in enumerate(("none", "sum", "mean")):
        grads = OUTPUTS if reduction == "none" else ("nll",)
        _case(
            group,
            lead=(12,),
            hidden=16,
            vocab=64,
            targets="all_ignored",
            reduction=reduction,
            grads=grads,
            seed=20 + i,
        )
    _case(group, lead=(0,), hidden=16, vocab=64, seed=30)


def _double_backward_case(group) -> None:
    """reduction="sum" scales the forward-prepared gradient in place: a second backward must fail loudly."""
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce

    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(45)
    x = torch.randn(6, 16, generator=gen, requires_grad=True)
    w = (torch.randn(64, 16, generator=gen) / 4)[rank * 32 : (rank + 1) * 32].requires_grad_(True)
    loss, _ = flsce(x, w, torch.randint(0, 64, (6,), generator=gen), group, reduction="sum")
    (2.0 * loss).backward(retain_graph=True)
    _expect_error(RuntimeError, lambda: loss.backward(), "modified by an inplace operation")


def _no_grad_cases(group) -> None:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce

    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(40)
    x, w = torch.randn(10, 16, generator=gen), torch.randn(64, 16, generator=gen) / 4
    target = torch.randint(0, 64, (10,), generator=gen)
    with torch.no_grad():
        nll, lse = flsce(x, w[rank * 32 : (rank + 1) * 32], target, group)
    ref = _reference(x.double(), w.double(), target, 1.0, -100, "none")
    assert_close(nll, ref[0], torch.float32, name="no-grad nll")
    assert_close(lse, ref[1], torch.float32, name="no-grad lse")


def _error_cases(group) -> dict[str, str]:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce

    rank = dist.get_rank(group)
    x, w = torch.randn(8, 16), torch.randn(32, 16)
    target = _same_targets(64, 8)
    m = {}
    m["shard"] = _expect_error(
        ValueError,
        lambda: flsce(x, torch.randn(32 + 8 * rank, 16), target, group),
        "local vocabulary",
        "rank 1: 40",
    )
    m["hidden"] = _expect_error(
        ValueError,
        lambda: flsce(torch.randn(8, 16 + rank), torch.randn(32, 16 + rank), target, group),
        "hidden",
    )
    m["tokens"] = _expect_error(
        ValueError, lambda: flsce(torch.randn(8 - rank, 16), w, target[: 8 - rank], group), "tokens"
    )
    m["temperature"] = _expect_error(
        ValueError, lambda: flsce(x, w, target, group, inverse_temperature=1.0 + rank), "inverse_temperature"
    )
    x_rg = x.clone().requires_grad_(rank == 0)
    m["requires_grad"] = _expect_error(ValueError, lambda: flsce(x_rg, w, target, group), "require gradients")
    m["dtype"] = _expect_error(
        ValueError,
        lambda: flsce(
            x.to(torch.float16 if rank else torch.float32),
            w.to(x.dtype if rank == 0 else torch.float16),
            target,
            group,
        ),
        "dtype",
    )
    m["targets_differ"] = _expect_error(
        ValueError, lambda: flsce(x, w, (target + rank) % 64, group), "target differs"
    )
    bad = target.clone()
    bad[5] = 64
    m["range"] = _expect_error(ValueError, lambda: flsce(x, w, bad, group), "64", "outside the vocabulary")
    # Local problems on one rank: every rank raises the same error quoting it.
    w_bad = w.to(torch.float16) if rank == 0 else w
    m["weight_dtype"] = _expect_error(
        TypeError, lambda: flsce(x, w_bad, target, group), "rank 0", "weight_shard", "float16"
    )
    m["weight_shape"] = _expect_error(
        ValueError,
        lambda: flsce(x, torch.randn(32, 8) if rank == 1 else w, target, group),
        "rank 1",
        "weight_shard",
    )
    m["temperature_range"] = _expect_error(
        ValueError, lambda: flsce(x, w, target, group, inverse_temperature=-1.0), "inverse_temperature", "> 0"
    )
    m["x_stride"] = _expect_error(
        ValueError, lambda: flsce(torch.randn(8, 32)[:, ::2], w, target, group), "x", "stride"
    )
    m["chunk"] = _expect_error(ValueError, lambda: flsce(x, w, target, group, chunk_bytes=0), "chunk_bytes")
    _expect_error(TypeError, lambda: flsce(x, w, target, "tp"), "group", "ProcessGroup")
    _expect_error(ValueError, lambda: flsce(x, w, target, group, reduction="avg"), "reduction")
    _case(group, lead=(8,), hidden=16, vocab=64, seed=50)  # the group still works
    return m


def _configured_cases(group) -> dict[str, str]:
    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce
    from lck_runtime import FusedLinearCrossEntropyConfig, configure, finalize, flsce_context

    assert (
        configure(
            process_groups={"tp": group},
            flsce=FusedLinearCrossEntropyConfig(
                max_tokens=24, hidden_size=32, local_vocab_size=48, group="tp"
            ),
        )
        is False
    )
    m = {}
    try:
        assert flsce_context(group).capacity == 24 * 32
        _case(
            group,
            lead=(24,),
            hidden=32,
            vocab=96,
            tau=0.8,
            targets="some_ignored",
            chunk_bytes=7 * 48 * 4,
            seed=60,
        )
        target = _same_targets(96, 25)
        m["tokens"] = _expect_error(
            ValueError,
            lambda: flsce(torch.randn(25, 32), torch.randn(48, 32), target, group),
            "max_tokens",
            "25",
        )
        m["hidden"] = _expect_error(
            ValueError,
            lambda: flsce(torch.randn(8, 40), torch.randn(48, 40), target[:8], group),
            "hidden_size",
            "40",
        )
        m["vocab"] = _expect_error(
            ValueError,
            lambda: flsce(torch.randn(8, 32), torch.randn(56, 32), target[:8], group),
            "local_vocab_size",
            "56",
        )
        _case(group, lead=(8,), hidden=32, vocab=96, seed=61)
    finally:
        finalize()
    return m


def _compile_cases(group) -> None:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce
    from lck_kernels.vocab_parallel import LckVocabParallelFusedLinearScaledCrossEntropy
    from lck_kernels.vocab_parallel.flsce_ops import _vp_flsce_fwd

    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(70)
    x = torch.randn(12, 16, generator=gen, requires_grad=True)
    w_full = torch.randn(64, 16, generator=gen) / 4
    w = w_full[rank * 32 : (rank + 1) * 32].clone().requires_grad_(True)
    target = torch.randint(0, 64, (12,), generator=gen)
    target[3] = -100

    def loss_fn(x, w, t):
        nll, lse, ent = flsce(x, w, t, group, inverse_temperature=0.9, return_entropy=True)
        return nll.mean() + 1e-2 * (lse**2).mean() - 0.1 * ent.mean()

    eager = loss_fn(x, w, target)
    ge = torch.autograd.grad(eager, (x, w))
    # aot_eager on CPU (inductor's CPU codegen does not take the interpreter's kernels); inductor on GPU.
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, target)
    gc = torch.autograd.grad(out, (x, w))
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gc, ge)

    def mean_fn(x, w, t):
        loss, lse = flsce(x, w, t, group, reduction="mean")
        return loss + 1e-2 * (lse**2).mean()

    eager = mean_fn(x, w, target)
    ge = torch.autograd.grad(eager, (x, w))
    out = torch.compile(mean_fn, fullgraph=True, backend="aot_eager")(x, w, target)
    gc = torch.autograd.grad(out, (x, w))
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gc, ge)
    for reduction in (0, 2):
        torch.library.opcheck(
            _vp_flsce_fwd, (x, w, target, group.group_name, 0.9, -100, 1 << 20, 3, reduction)
        )
    mod = LckVocabParallelFusedLinearScaledCrossEntropy(group, reduction="sum")
    nll, _ = mod(x, w, target)
    ref = _reference(x.double(), w_full.double(), target, 1.0, -100, "sum")[0]
    assert_close(nll, ref, torch.float32, name="module nll")


# One pair of processes runs every case above (spawning is the slow part); each test reads its cases.
test_matches_unsharded_reference_tp2 = world_test(
    _reference_cases, _ignored_cases, _no_grad_cases, _double_backward_case, _compile_cases
)
test_errors_and_capacities_agree_on_every_rank = world_test(
    _error_cases, _configured_cases, check=same_messages
)


@pytest.fixture(scope="module")
def world2() -> list[dict[str, object]]:
    return run_world_tests(
        test_matches_unsharded_reference_tp2, test_errors_and_capacities_agree_on_every_rank
    )


def test_chunk_rows() -> None:
    from lck_kernels.vocab_parallel import chunk_rows

    assert chunk_rows(8192, 64128, 2, 256 << 20) == 2048  # 2093 rows fit; whole 256-row tiles
    assert chunk_rows(100, 64128, 2, 256 << 20) == 100
    assert chunk_rows(8192, 1 << 30, 2, 1) == 1
    assert chunk_rows(0, 10, 4, 100) == 1


# ---------------------------------------------------------------------------------------------------------
# CPU: 4 processes, a TP=4 group and two TP=2 groups side by side, each with its own runtime context
# ---------------------------------------------------------------------------------------------------------


def _unconfigured_side_by_side(tp4, tp2, rank: int) -> None:
    _case(tp4, lead=(12,), hidden=16, vocab=128, tau=0.6, targets="last_shard", seed=1)
    _case(tp2, lead=(12,), hidden=16, vocab=64, targets="some_ignored", seed=2 + rank // 2)


def _configured_side_by_side(tp4, tp2, rank: int) -> dict[str, str]:
    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce

    _case(tp2, lead=(16,), hidden=16, vocab=64, chunk_bytes=6 * 32 * 4, seed=5 + rank // 2)
    _case(tp4, lead=(20,), hidden=16, vocab=128, targets="some_ignored", seed=7)  # > the TP=2 capacity
    target = _same_targets(64, 20)
    m = {
        "tp2_tokens": _expect_error(
            ValueError, lambda: flsce(torch.randn(20, 16), torch.randn(32, 16), target, tp2), "max_tokens"
        )
    }
    _case(tp2, lead=(8,), hidden=16, vocab=64, seed=8)
    return m


@cpu_variant
def test_tp4_and_tp2_groups_side_by_side() -> None:
    run_side_by_side(_unconfigured_side_by_side, _configured_side_by_side, hidden_size=16)


# ---------------------------------------------------------------------------------------------------------
# GPU: 2 NCCL processes, runtime configured (NVSHMEM on H200), real sizes
# ---------------------------------------------------------------------------------------------------------


def _world2_gpu(rank: int, world: int) -> dict[str, object]:
    """Two sections, each case once: the torch.distributed (NCCL) path, then the runtime configured on the
    TP=2 group and a TP=1 partition beside it (NVSHMEM, native on both ranks) with a chunk tail, the other
    dtypes, the TP=1 context, the inductor compile and a capacity error."""
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce
    from lck_runtime import FusedLinearCrossEntropyConfig, configure, finalize, flsce_context

    g = dist.group.WORLD
    dev = f"cuda:{torch.cuda.current_device()}"
    big = dict(hidden=4096, vocab=128256, dtype=torch.bfloat16, device=dev)
    mid = dict(hidden=2048, vocab=64000, dtype=torch.bfloat16, device=dev)

    def nccl() -> None:
        # the one full-vocabulary case: 2048 tokens x 4096 -> 128256 (shards of 64128)
        _timed(rank, "2048x4096x128256 bf16", lambda: _case(
            g, lead=(2048,), targets="some_ignored", tau=0.8, seed=1, **big
        ))  # fmt: skip
        # gradients prepared in the forward plus the recompute path for the entropy
        _timed(rank, "2048x2048x64000 bf16 sum", lambda: _case(
            g, lead=(2048,), reduction="sum", grads=("nll", "entropy"), seed=5, **mid
        ))  # fmt: skip

    def compiled() -> None:
        gen = torch.Generator(device=dev).manual_seed(9)  # the same x on every rank
        x = torch.randn(1024, 1024, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(16000, 1024, device=dev, generator=gen) / 32).to(torch.bfloat16).requires_grad_(True)
        t = torch.randint(0, 32000, (1024,), device=dev, generator=gen)

        def f(x, w, t):
            nll, _, ent = flsce(x, w, t, g, return_entropy=True)
            return nll.mean() - 0.01 * ent.mean()

        eager = f(x, w, t)
        ge = torch.autograd.grad(eager, (x, w))
        out = torch.compile(f, fullgraph=True)(x, w, t)  # inductor
        gc = torch.autograd.grad(out, (x, w))
        torch.testing.assert_close(out, eager)
        torch.testing.assert_close(gc, ge)

    # A TP=1 partition (each rank alone) next to the TP=2 group: two contexts side by side.
    singles = [dist.new_group([0]), dist.new_group([1])]
    tp1 = singles[rank]

    def native() -> bool:
        native = configure(
            process_groups={"tp": g, "tp1": tp1},
            flsce=FusedLinearCrossEntropyConfig(
                max_tokens=8192, hidden_size=4096, local_vocab_size=75968, group="tp"
            ),
        )
        configure(
            flsce=FusedLinearCrossEntropyConfig(
                max_tokens=4096, hidden_size=4096, local_vocab_size=64000, group="tp1"
            )
        )
        try:
            assert flsce_context(g).native == native and flsce_context(tp1).size == 1
            # A chunk tail: 2048 + 77 tokens in chunks of 512 rows of the 32000-column shard.
            _timed(rank, "2125x2048x64000 bf16 mean, chunk tail", lambda: _case(
                g, lead=(2125,), chunk_bytes=512 * 32000 * 2, reduction="mean", grads=("nll",), seed=2, **mid
            ))  # fmt: skip
            # 151936 / 2 = 75968: a shard exactly at the configured local_vocab_size capacity
            _timed(rank, "2x512x2048x151936 fp16", lambda: _case(
                g, lead=(2, 512), grads=("entropy",), seed=3, hidden=2048, vocab=151936, dtype=torch.float16,
                device=dev,
            ))  # fmt: skip
            _timed(rank, "512x1024x32000 fp32", lambda: _case(
                g, lead=(512,), targets="last_shard", seed=4, hidden=1024, vocab=32000, dtype=torch.float32,
                device=dev,
            ))  # fmt: skip
            _timed(rank, "TP=1 1024x2048x32000 bf16", lambda: _case(
                tp1, lead=(1024,), hidden=2048, vocab=32000, dtype=torch.bfloat16, device=dev, seed=10 + rank
            ))  # fmt: skip
            _timed(rank, "inductor compile", compiled)
            x = torch.randn(8193, 64, device=dev, dtype=torch.bfloat16)
            w = torch.randn(100, 64, device=dev, dtype=torch.bfloat16)
            t = torch.zeros(8193, dtype=torch.long, device=dev)
            _expect_error(ValueError, lambda: flsce(x, w, t, g), "max_tokens")
        finally:
            finalize()
        return native

    return _sections(rank, [("nccl", nccl), ("nvshmem", native)])


test_gpu_tp2_real_sizes_nccl_and_nvshmem = gpu_tp2_test(_world2_gpu)
