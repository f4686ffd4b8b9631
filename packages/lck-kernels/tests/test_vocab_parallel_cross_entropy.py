"""vocab_parallel_cross_entropy against F.cross_entropy on the gathered logits (float64), over real process groups.

CPU variant: 2 and 4 gloo processes with Triton in its interpreter (``TRITON_INTERPRET=1``), small shapes.
Each spawned world runs many cases inside one worker (spawning costs far more than a case) and reports
per-section results, so one failing section names itself without hiding the others.
GPU variant (``multigpu(2)``): 2 NCCL processes, the runtime configured (NVSHMEM), real sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tolerances import assert_close
from _tp_helpers import (
    GPU_ENV,
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
    same_result,
    world_test,
)
from test_cross_entropy import assert_close_on_device
from test_fused_linear_scaled_cross_entropy import assert_no_worse_than_eager

from lck_runtime.testing import run_workers

# ---------------------------------------------------------------------------------------------------------
# One case: shard the same float64 logits on every rank, compare loss and this rank's gradient slice
# ---------------------------------------------------------------------------------------------------------


def _targets(kind: str, shape: tuple[int, ...], vocab: int, tp: int, ignore_index: int, gen) -> torch.Tensor:
    lo, hi = 0, vocab
    if kind == "last_shard":  # uneven: every target in the last rank's shard
        lo = vocab - vocab // tp
    elif kind == "first_shard":
        hi = vocab // tp
    t = torch.randint(lo, hi, shape, generator=gen, device=gen.device)
    if kind == "some_ignored":
        t.view(-1)[::3] = ignore_index
    elif kind == "all_ignored":
        t.fill_(ignore_index)
    return t


def _case(
    group,
    *,
    lead: tuple[int, ...],
    vocab: int,
    dtype=torch.float32,
    reduction: str = "none",
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    targets: str = "random",
    seed: int = 0,
    device: str = "cpu",
    scale: float = 4.0,
) -> None:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy

    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    # Generated on the test device (the same stream of numbers on every rank): fast at real sizes.
    gen = torch.Generator(device=device).manual_seed(seed)
    full = torch.randn(*lead, vocab, generator=gen, dtype=torch.float64, device=device)
    full = (full * scale).to(dtype).double()  # the inputs the op sees, exactly, in float64
    target = _targets(targets, lead, vocab, tp, ignore_index, gen)
    grad = torch.randn(lead, generator=gen, dtype=torch.float64, device=device)
    if reduction != "none":
        grad = torch.tensor(0.7, dtype=torch.float64, device=device)
    vs = vocab // tp
    shard = full[..., rank * vs : (rank + 1) * vs].to(dtype).requires_grad_(True)
    _poison_cached_memory(device)
    out = vocab_parallel_cross_entropy(
        shard,
        target,
        group,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
        reduction=reduction,
    )
    out.backward(grad.to(out.dtype))

    def torch_loss(logits: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
        """Plain torch's loss over the whole vocabulary, backpropagated with ``upstream``."""
        loss = F.cross_entropy(
            logits.reshape(-1, vocab),
            target.reshape(-1),
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
        )
        loss = loss.view(lead) if reduction == "none" else loss
        loss.backward(upstream)
        return loss

    ref_in = full.requires_grad_(True)
    ref = torch_loss(ref_in, grad)
    what = (
        f"rank {rank}/{tp} lead={lead} V={vocab} {dtype} {reduction} eps={label_smoothing} targets={targets}"
    )
    assert out.dtype == torch.float32 and out.shape == ref.shape, (
        f"{what}: got {out.dtype} {tuple(out.shape)}"
    )
    if ref.numel() == 0:  # no tokens: empty loss, empty gradient (assert_close needs elements)
        assert shard.grad.shape == shard.shape and shard.grad.numel() == 0, f"{what}: {shard.grad.shape}"
        return
    if targets == "all_ignored" and reduction == "mean":
        assert torch.isnan(out) and torch.isnan(ref), f"{what}: mean over no targets must be NaN, got {out}"
        assert torch.equal(shard.grad, torch.zeros_like(shard.grad)), f"{what}: gradient must be 0"
        return
    # Real sizes compare on the device, in row blocks (a CPU comparison of 10^8 float64 elements takes seconds).
    check = assert_close_on_device if shard.numel() > 2**22 else assert_close
    check(out, ref, dtype, name=f"loss ({what})")
    ref_grad = ref_in.grad[..., rank * vs : (rank + 1) * vs]
    if dtype in (torch.float16, torch.bfloat16):
        # A half-precision gradient holds probabilities down to ~1/V, partly subnormal in fp16: its
        # error is set by the storage format. Plain torch eager in the same dtype is the yardstick; on an
        # H200 (1 row, V=32000, fp16) eager was 8.36e-3 from float64 and lck 8.28e-3, 4.2x the fixed
        # tolerance, hence the wider bound on the baseline itself.
        eager_in = full.detach().to(dtype).requires_grad_(True)
        torch_loss(eager_in, grad.to(dtype))
        eager_grad = eager_in.grad[..., rank * vs : (rank + 1) * vs]
        assert_no_worse_than_eager(
            shard.grad, eager_grad, ref_grad, dtype, name=f"grad ({what})", baseline_factor=8.0
        )
    else:
        check(shard.grad, ref_grad, dtype, name=f"grad ({what})")
    if targets == "all_ignored":
        assert torch.count_nonzero(out) == 0 and torch.count_nonzero(shard.grad) == 0, f"{what}: must be 0"


# ---------------------------------------------------------------------------------------------------------
# CPU: 2 processes
# ---------------------------------------------------------------------------------------------------------


def _reference_cases(group) -> None:
    for i, kw in enumerate(
        [
            dict(lead=(16,), vocab=64),
            dict(lead=(16,), vocab=64, reduction="sum", targets="last_shard"),
            dict(lead=(13,), vocab=96, reduction="mean", targets="some_ignored", label_smoothing=0.1),
            dict(lead=(2, 8), vocab=64, targets="first_shard", label_smoothing=0.25),
            dict(lead=(16,), vocab=64, targets="some_ignored", ignore_index=5),  # an ignore_index inside V
            dict(lead=(1,), vocab=256, scale=20.0),  # one row, peaked softmax
            dict(lead=(16,), vocab=128, dtype=torch.bfloat16, reduction="mean"),
            dict(lead=(16,), vocab=64, dtype=torch.float16, targets="some_ignored"),
        ]
    ):
        _case(group, seed=i, **kw)


def _ignored_cases(group) -> None:
    for i, reduction in enumerate(("none", "sum", "mean")):
        _case(group, lead=(8,), vocab=64, reduction=reduction, targets="all_ignored", seed=10 + i)
    _case(group, lead=(0,), vocab=64, seed=20)  # no tokens at all


def _error_cases(group) -> dict[str, str]:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy as ce

    rank = dist.get_rank(group)
    logits = torch.randn(8, 32)
    target = _same_targets(64, 8)
    msgs = {}
    # Shard sizes differ between ranks: the same ValueError everywhere, naming the shard size.
    uneven = torch.randn(8, 32 + 8 * rank)
    msgs["shard"] = _expect_error(
        ValueError, lambda: ce(uneven, target, group), "local vocabulary size", "rank 1: 40"
    )
    msgs["tokens"] = _expect_error(
        ValueError,
        lambda: ce(torch.randn(8 + rank, 32), torch.zeros(8 + rank, dtype=torch.long), group),
        "tokens",
    )
    msgs["smoothing"] = _expect_error(
        ValueError, lambda: ce(logits, target, group, label_smoothing=0.1 * rank), "label_smoothing"
    )
    msgs["targets_differ"] = _expect_error(
        ValueError, lambda: ce(logits, (target + rank) % 64, group), "target differs"
    )
    bad = target.clone()
    bad[3] = 64  # == V: out of range
    msgs["range"] = _expect_error(ValueError, lambda: ce(logits, bad, group), "64", "outside the vocabulary")
    neg = target.clone()
    neg[0] = -7
    msgs["negative"] = _expect_error(
        ValueError, lambda: ce(logits, neg, group), "-7", "outside the vocabulary"
    )
    # A local problem on one rank only: every rank raises the same TypeError, quoting that rank's message.
    t_dtype = target.to(torch.int16) if rank == 1 else target
    msgs["dtype"] = _expect_error(TypeError, lambda: ce(logits, t_dtype, group), "rank 1", "target", "int16")
    wrong_shape = torch.randn(8, 32)[:, ::2] if rank == 0 else torch.randn(8, 16)
    msgs["stride"] = _expect_error(
        ValueError, lambda: ce(wrong_shape, target[:8] % 32, group), "rank 0", "stride"
    )
    msgs["target_shape"] = _expect_error(
        ValueError, lambda: ce(logits, target[: 8 - rank], group), "target", "shape"
    )
    msgs["smoothing_range"] = _expect_error(
        ValueError, lambda: ce(logits, target, group, label_smoothing=1.5), "label_smoothing", "[0, 1]"
    )
    # Local argument errors that need no collective.
    _expect_error(TypeError, lambda: ce(logits, target, None), "group", "ProcessGroup")
    _expect_error(ValueError, lambda: ce(logits, target, group, reduction="avg"), "reduction")
    _expect_error(TypeError, lambda: ce(logits.tolist(), target, group), "logits_shard")
    # The group still works after all of that (no rank is left behind in a collective).
    _case(group, lead=(8,), vocab=64, seed=30)
    return msgs


def _configured_cases(group) -> dict[str, str]:
    """Through the runtime's FLSCE context: same results; capacities enforced, same error everywhere."""
    from lck_kernels import vocab_parallel_cross_entropy as ce
    from lck_runtime import FusedLinearCrossEntropyConfig, configure, finalize, flsce_context

    native = configure(
        process_groups={"tp": group},
        flsce=FusedLinearCrossEntropyConfig(max_tokens=16, hidden_size=8, local_vocab_size=48, group="tp"),
    )
    assert native is False, "CPU: the runtime must take its torch.distributed path"
    assert flsce_context(group) is not None
    msgs = {}
    try:
        _case(group, lead=(16,), vocab=64, targets="some_ignored", seed=40)
        _case(group, lead=(4, 4), vocab=96, label_smoothing=0.1, seed=41)  # local vocab 48 = the capacity
        target = _same_targets(64, 17)
        msgs["tokens"] = _expect_error(
            ValueError, lambda: ce(torch.randn(17, 32), target, group), "max_tokens", "17"
        )
        msgs["vocab"] = _expect_error(
            ValueError, lambda: ce(torch.randn(16, 64), target[:16], group), "local_vocab_size", "64"
        )
        _case(group, lead=(16,), vocab=64, seed=42)  # still usable
    finally:
        finalize()
    assert flsce_context(group, required=False) is None
    return msgs


def _compile_cases(group) -> None:
    """torch.compile(fullgraph=True) traces the op and its autograd; opcheck; the nn.Module form."""
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy as ce
    from lck_kernels.vocab_parallel import LckVocabParallelCrossEntropy
    from lck_kernels.vocab_parallel.ops import _vp_cross_entropy_fwd

    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(50)
    full = torch.randn(12, 40 * tp, generator=gen)
    target = torch.randint(0, 40 * tp, (12,), generator=gen)
    target[2] = -100
    shard = full[:, rank * 40 : (rank + 1) * 40].clone().requires_grad_(True)

    def loss_fn(z, t):
        return ce(z, t, group, reduction="mean", label_smoothing=0.05) * 2.0

    eager = loss_fn(shard, target)
    (ge,) = torch.autograd.grad(eager, shard)
    # Under the interpreter the kernels run on CPU tensors, which inductor's codegen does not take;
    # aot_eager still traces the whole graph (fullgraph=True: no break around the ops or their autograd).
    # The gpu variant compiles with inductor.
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    out = compiled(shard, target)
    (gc,) = torch.autograd.grad(out, shard)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(gc, ge)
    torch.library.opcheck(
        _vp_cross_entropy_fwd, (shard.detach().requires_grad_(), target, group.group_name, 0.1, -100)
    )
    module_out = LckVocabParallelCrossEntropy(group, reduction="sum")(shard, target)
    torch.testing.assert_close(module_out, F.cross_entropy(full, target, reduction="sum"))


def _single_rank_cases(world) -> str:
    """Groups of one rank (TP=1, each rank alone): the unsharded loss; local problems raise at once; a
    target outside the vocabulary makes the loss and gradient NaN (no host read to raise from, as in
    ``cross_entropy``) instead of raising."""
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy as ce

    rank = dist.get_rank(world)
    singles = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group
    g = singles[rank]
    _case(g, lead=(12,), vocab=40, targets="some_ignored", seed=60 + rank)
    _case(g, lead=(3, 4), vocab=40, reduction="mean", label_smoothing=0.1, seed=62 + rank)
    gen = torch.Generator().manual_seed(64 + rank)
    z = torch.randn(8, 40, generator=gen).requires_grad_(True)
    t = torch.randint(0, 40, (8,), generator=gen)
    t[5] = -100
    for value in (40, -7):
        bad = t.clone()
        bad[3] = value
        loss = ce(z, bad, g, reduction="none")
        (grad,) = torch.autograd.grad(loss.sum(), z)
        kept = t != -100  # an ignored row keeps its zero gradient
        assert torch.isnan(loss).all() and torch.isnan(grad[kept]).all(), (value, loss, grad)
        assert torch.equal(grad[~kept], torch.zeros_like(grad[~kept])), grad
    # In range again (ignored entries included): finite and equal to torch.
    torch.testing.assert_close(ce(z, t, g, reduction="sum"), F.cross_entropy(z, t, reduction="sum"))
    return _expect_error(TypeError, lambda: ce(z, t.to(torch.int16), g), "rank 0", "target", "int16")


# One pair of processes runs every case above (spawning is the slow part); each test reads its cases.
test_reference_ignored_rows_and_compile_tp2 = world_test(_reference_cases, _ignored_cases, _compile_cases)
test_errors_and_capacities_agree_on_every_rank = world_test(
    _error_cases, _configured_cases, check=same_messages
)
test_group_of_one_rank_checks_targets_on_the_device = world_test(_single_rank_cases, check=same_result)


@pytest.fixture(scope="module")
def world2() -> list[dict[str, object]]:
    return run_world_tests(
        test_reference_ignored_rows_and_compile_tp2,
        test_errors_and_capacities_agree_on_every_rank,
        test_group_of_one_rank_checks_targets_on_the_device,
    )


def _single_rank_gpu(rank: int, world: int) -> None:
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy as ce
    from lck_kernels import vocab_parallel_fused_linear_scaled_cross_entropy as flsce

    g, dev = dist.group.WORLD, torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(70)
    z = torch.randn(4096, 32000, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
    x = torch.randn(2048, 1024, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(32000, 1024, device=dev, generator=gen) / 32).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, 32000, (4096,), device=dev, generator=gen)
    t[::7] = -100

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        a = ce(z, t, g, reduction="mean")
        nll, _ = flsce(x, w, t[:2048], g, reduction="mean")
        (a + nll).backward()
        return a, nll

    step()  # a warm-up: kernels compiled and loaded, the call's shapes agreed
    torch.cuda.synchronize()
    # A training step with TP=1 must not hold the host until the forward is done: any sync raises here.
    torch.cuda.set_sync_debug_mode("error")
    try:
        a, nll = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(a.double(), F.cross_entropy(z.double(), t), rtol=2e-2, atol=2e-2)
    ref = F.cross_entropy(x.double() @ w.double().T, t[:2048])
    torch.testing.assert_close(nll.double(), ref, rtol=2e-2, atol=2e-2)
    bad = t.clone()
    bad[9] = 32000
    assert torch.isnan(ce(z, bad, g, reduction="none")).all()


@pytest.mark.gpu
def test_gpu_group_of_one_rank_has_no_host_sync() -> None:
    run_workers(_single_rank_gpu, 1, backend="nccl", env=GPU_ENV, timeout=110)


# ---------------------------------------------------------------------------------------------------------
# CPU: 4 processes, a TP=4 group and two TP=2 groups side by side, one of each configured
# ---------------------------------------------------------------------------------------------------------


def _unconfigured_side_by_side(tp4, tp2, rank: int) -> None:
    _case(tp4, lead=(12,), vocab=64, targets="last_shard", seed=1)
    _case(tp2, lead=(12,), vocab=64, targets="some_ignored", seed=2 + rank // 2)  # pairs differ
    _case(tp4, lead=(12,), vocab=128, reduction="mean", label_smoothing=0.1, seed=4)


def _configured_side_by_side(tp4, tp2, rank: int) -> dict[str, str]:
    from lck_kernels import vocab_parallel_cross_entropy as ce

    _case(tp2, lead=(16,), vocab=64, targets="first_shard", seed=5)
    _case(tp4, lead=(24,), vocab=128, targets="some_ignored", seed=6)
    # 20 tokens: within the TP=4 context's capacity, beyond the TP=2 one's.
    _case(tp4, lead=(20,), vocab=128, seed=7)
    target = _same_targets(64, 20)
    msgs = {
        "tp2_tokens": _expect_error(ValueError, lambda: ce(torch.randn(20, 32), target, tp2), "max_tokens")
    }
    _case(tp2, lead=(8,), vocab=64, seed=8)
    return msgs


@cpu_variant
def test_tp4_and_tp2_groups_side_by_side() -> None:
    run_side_by_side(_unconfigured_side_by_side, _configured_side_by_side, hidden_size=8)


# ---------------------------------------------------------------------------------------------------------
# GPU: 2 NCCL processes, runtime configured (NVSHMEM on H200), real sizes
# ---------------------------------------------------------------------------------------------------------


def _world2_gpu(rank: int, world: int) -> dict[str, object]:
    """Two sections, each case once: the torch.distributed (NCCL) path, then the runtime configured on the
    group (NVSHMEM, native on both ranks) with the other cases, the inductor compile and a capacity error."""
    import torch.distributed as dist

    from lck_kernels import vocab_parallel_cross_entropy as ce
    from lck_runtime import FusedLinearCrossEntropyConfig, configure, finalize, flsce_context

    g = dist.group.WORLD
    dev = f"cuda:{torch.cuda.current_device()}"

    def nccl() -> None:
        # the one full-vocabulary case: 2048 x 128256 bf16 (shards of 64128)
        _timed(rank, "2048x128256 bf16", lambda: _case(
            g, lead=(2048,), vocab=128256, dtype=torch.bfloat16, targets="some_ignored", device=dev, seed=1
        ))  # fmt: skip
        _timed(rank, "1x32000 fp16", lambda: _case(
            g, lead=(1,), vocab=32000, dtype=torch.float16, targets="last_shard", device=dev, seed=4
        ))  # fmt: skip

    def compiled() -> None:
        gen = torch.Generator(device=dev).manual_seed(7)
        z = torch.randn(1024, 16000, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
        t = torch.randint(0, 32000, (1024,), device=dev, generator=gen)

        def f(z, t):
            return ce(z, t, g, reduction="mean", label_smoothing=0.05)

        eager = f(z, t)
        (ge,) = torch.autograd.grad(eager, z)
        out = torch.compile(f, fullgraph=True)(z, t)  # inductor
        (gc,) = torch.autograd.grad(out, z)
        torch.testing.assert_close(out, eager)
        torch.testing.assert_close(gc, ge)

    def native() -> bool:
        native = configure(
            process_groups={"tp": g},
            flsce=FusedLinearCrossEntropyConfig(
                max_tokens=8192, hidden_size=4096, local_vocab_size=75968, group="tp"
            ),
        )
        try:
            assert flsce_context(g).native == native
            # 151936 / 2 = 75968: a shard exactly at the configured local_vocab_size capacity
            _timed(rank, "2x512x151936 bf16 mean", lambda: _case(
                g, lead=(2, 512), vocab=151936, dtype=torch.bfloat16, reduction="mean", device=dev, seed=2
            ))  # fmt: skip
            _timed(rank, "4096x32000 fp32 smoothing", lambda: _case(
                g, lead=(4096,), vocab=32000, dtype=torch.float32, label_smoothing=0.1, device=dev, seed=3
            ))  # fmt: skip
            _timed(rank, "inductor compile", compiled)
            target = torch.zeros(8193, dtype=torch.long, device=dev)
            _expect_error(ValueError, lambda: ce(torch.randn(8193, 64, device=dev), target, g), "max_tokens")
        finally:
            finalize()
        return native

    return _sections(rank, [("nccl", nccl), ("nvshmem", native)])


test_gpu_tp2_real_sizes_nccl_and_nvshmem = gpu_tp2_test(_world2_gpu)


# ---------------------------------------------------------------------------------------------------------
# Inductor's fp64 float scalars (no processes, no GPU: see test_cross_entropy.compile_with_fp64_scalars)
# ---------------------------------------------------------------------------------------------------------

_VP = "lck_kernels.vocab_parallel.kernels"
_VP_POINTERS = {"z_ptr": "*bf16", "dz_ptr": "*bf16", "target_ptr": "*i64"}
_VP_FP64_SPECS = [
    (
        _VP, "_vp_shard_stats_kernel", ["scale"],
        {"BLOCK": 256, "SMOOTH": True, "ENTROPY": True, "EVICT": True, "NUM_STAGES": 1, "PREFETCH": True},
        _VP_POINTERS,
    ),
    (_VP, "_vp_combine_kernel", ["smooth_keep", "smooth_each"], {"BLOCK_R": 16, "BLOCK_TP": 2}, _VP_POINTERS),
    (
        _VP, "_vp_shard_grad_kernel", ["scale", "smooth_keep", "smooth_each"],
        {"HAS_G_LOSS": True, "HAS_G_LSE": True, "HAS_G_ENT": True, "SMOOTH": True, "BLOCK": 256, "EVICT": True,
         "NUM_STAGES": 1},
        _VP_POINTERS,
    ),
]  # fmt: skip


def test_kernels_compile_for_inductor_with_fp64_scalars() -> None:
    from test_cross_entropy import compile_with_fp64_scalars

    assert compile_with_fp64_scalars(_VP_FP64_SPECS) == []
