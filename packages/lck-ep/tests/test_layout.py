"""The dispatch layout: torch reference vs explicit loops (CPU), JIT kernel vs torch bit for bit (GPU)."""

from __future__ import annotations

import pytest
import torch
from _routing import KINDS, assert_layout_equals_naive, route

from lck_ep.layout import get_dispatch_layout, layout_reference

CASES = [
    # (tokens, top-k, experts, ranks)
    (37, 8, 16, 2),
    (50, 1, 6, 3),
    (64, 4, 32, 4),
    (1, 2, 4, 4),
    (0, 3, 8, 2),
    (29, 6, 12, 1),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("t", "k", "e", "r"), CASES)
def test_reference_matches_loops(kind: str, t: int, k: int, e: int, r: int) -> None:
    g = torch.Generator().manual_seed(hash((kind, t, k, e, r)) % 2**31)
    idx = route(kind, t, k, e, r, g)
    assert_layout_equals_naive(layout_reference(idx, e, r), idx, e, r, f"{kind} {t}x{k} E={e} R={r}")


def test_out_of_range_entries_are_ignored_like_minus_one() -> None:
    idx = torch.tensor([[-7, 3, 8], [9, -1, 0], [2, 2, 100]])
    layout = layout_reference(idx, 8, 2)
    assert_layout_equals_naive(layout, idx, 8, 2)
    assert layout.num_tokens_per_expert.tolist() == [1, 0, 2, 1, 0, 0, 0, 0]
    assert layout.is_token_in_rank.tolist() == [[True, False], [True, False], [True, False]]


def test_a_token_counts_once_per_rank_but_once_per_slot_per_expert() -> None:
    idx = torch.tensor([[1, 0, 1, 5]])  # experts 0,1 on rank 0 (three slots), 5 on rank 1
    layout = layout_reference(idx, 8, 2)
    assert layout.num_tokens_per_rank.tolist() == [1, 1]
    assert layout.num_tokens_per_expert.tolist() == [1, 2, 0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize(
    ("args", "exc", "fragment"),
    [
        ((torch.zeros(4, 2, dtype=torch.int32), 8, 2), TypeError, "topk_idx must be int64"),
        ((torch.zeros(4, dtype=torch.int64), 8, 2), ValueError, "topk_idx must be 2-D"),
        ((torch.zeros(4, 0, dtype=torch.int64), 8, 2), ValueError, "at least one column"),
        ((torch.zeros(2, 4, dtype=torch.int64).t(), 8, 2), ValueError, "topk_idx must be contiguous"),
        (
            (torch.zeros(4, 2, dtype=torch.int64), 9, 2),
            ValueError,
            "num_experts (9) must be a multiple of num_ranks (2)",
        ),
        ((torch.zeros(4, 2, dtype=torch.int64), 0, 2), ValueError, "num_experts must be a positive int"),
        ((torch.zeros(4, 2, dtype=torch.int64), 8, True), ValueError, "num_ranks must be a positive int"),
        (([[0, 1]], 8, 2), TypeError, "topk_idx must be a torch.Tensor"),
    ],
)
def test_bad_arguments(args, exc, fragment) -> None:
    with pytest.raises(exc) as info:
        layout_reference(*args)
    assert fragment in str(info.value)


def test_kernel_needs_cuda_tensors() -> None:
    with pytest.raises(ValueError, match="use_kernel=True needs a CUDA topk_idx"):
        get_dispatch_layout(torch.zeros(3, 2, dtype=torch.int64), 4, 2, use_kernel=True)


# ---------------------------------------------------------------------------------------------- GPU

GPU_CASES = [
    # (tokens, top-k, experts, ranks): grid-stride (> 4 blocks/SM of 256), > 64 ranks (two mask chunks),
    # single token, empty, top-1, many experts
    (70_000, 8, 256, 8),
    (4096, 8, 256, 2),
    (513, 6, 192, 96),
    (1, 1, 4, 1),
    (0, 4, 16, 4),
    (3000, 1, 64, 64),
    (2048, 8, 4096, 16),
]


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize(
    ("bits", "t", "k", "e", "r"),
    # every case whose expert indices fit the index width (wider problems are refused, tested below)
    [(bits, *case) for bits in (64, 32, 16, 8) for case in GPU_CASES if case[2] <= 2 ** (bits - 1)],
)
@pytest.mark.usefixtures("no_ep_knobs")
def test_kernel_equals_torch_layout_bit_for_bit(bits, t, k, e, r, monkeypatch) -> None:
    from lck_ep.layout import layout_kernel

    if bits != 64:
        monkeypatch.setenv("EP_NUM_TOPK_IDX_BITS", str(bits))
    for kind in KINDS:
        g = torch.Generator().manual_seed(1000 * t + 10 * k + e + r + bits)
        idx = route(kind, t, k, e, r, g)
        if kind == "minus_one" and t:
            # also entries the host would reject: the kernel must ignore them like the reference does
            idx[1::7, 0] = e + 3
            idx[2::11, -1] = -5
        idx = idx.cuda()
        got = layout_kernel(idx, e, r)
        want = layout_reference(idx, e, r)
        what = f"{kind} T={t} K={k} E={e} R={r} bits={bits}"
        for name, a, b in zip(want._fields, got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {name} {a.dtype}{list(a.shape)}"
            assert torch.equal(a, b), f"{what}: {name} differs in {int((a != b).sum())} places"
        if t <= 600:
            assert_layout_equals_naive(got, idx, e, r, what)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.usefixtures("no_ep_knobs")
def test_kernel_writes_every_mask_element_and_adds_into_counts() -> None:
    """Launch the built kernel directly with a poisoned mask and nonzero counts."""
    from lck_ep.jit import build_layout_kernel
    from lck_runtime.jit import I32

    t, k, e, r = 1000, 4, 32, 8
    idx = route("minus_one", t, k, e, r, torch.Generator().manual_seed(7)).cuda()
    kernel = build_layout_kernel()
    mask = torch.ones(t, r, dtype=torch.bool, device="cuda")  # poison: all True
    per_rank = torch.full((r,), 5, dtype=torch.int32, device="cuda")
    per_expert = torch.full((e,), 3, dtype=torch.int32, device="cuda")
    kernel.launch(
        (2, 1, 1),
        (256, 1, 1),
        [idx, I32(t), I32(k), I32(e), I32(r), per_rank, per_expert, mask],
        shared_mem=4 * (e + r),
    )
    want = layout_reference(idx, e, r)
    assert torch.equal(mask, want.is_token_in_rank)
    assert torch.equal(per_rank, want.num_tokens_per_rank + 5)
    assert torch.equal(per_expert, want.num_tokens_per_expert + 3)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.usefixtures("no_ep_knobs")
def test_kernel_launch_has_no_host_sync() -> None:
    from lck_ep.layout import layout_kernel

    idx = route("balanced", 4096, 8, 64, 8, torch.Generator().manual_seed(3)).cuda()
    layout_kernel(idx, 64, 8)  # build and load outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = layout_kernel(idx, 64, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.is_token_in_rank, layout_reference(idx, 64, 8).is_token_in_rank)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.usefixtures("no_ep_knobs")
def test_kernel_refuses_what_it_cannot_hold(monkeypatch) -> None:
    from lck_ep.knobs import KnobError
    from lck_ep.layout import layout_kernel

    idx = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="shared memory"):
        layout_kernel(idx, 16384, 2)
    monkeypatch.setenv("EP_NUM_TOPK_IDX_BITS", "8")
    with pytest.raises(KnobError, match="num_experts=256"):
        layout_kernel(idx, 256, 2)
    monkeypatch.setenv("EP_NUM_TOPK_IDX_BITS", "7")
    with pytest.raises(KnobError, match="EP_NUM_TOPK_IDX_BITS=7"):
        layout_kernel(idx, 16, 2)


def _layout_on_each_gpu(rank: int, world: int) -> list[str]:
    """Each rank runs the kernel on its GPU over routings of its own and compares with the torch layout;
    the per-rank counts are then gathered, so the tokens every rank expects from the others add up to what
    the senders' masks say they send. Over NCCL rank r owns cuda:r (the cubin loads on a device other than
    0); over gloo every rank shares the current GPU and the counts are gathered through the host."""
    import torch.distributed as dist

    from lck_ep.layout import layout_kernel

    errors: list[str] = []
    e = 64
    for kind in KINDS:
        g = torch.Generator().manual_seed(7919 * rank + len(kind))
        idx = route(kind, 3000 + 17 * rank, 8, e, world, g).cuda()
        got, want = layout_kernel(idx, e, world), layout_reference(idx, e, world)
        for name, a, b in zip(want._fields, got, want):
            if a.device != idx.device or not torch.equal(a, b):
                errors.append(f"rank {rank} {kind}: {name} differs (device {a.device})")
        sent = got.num_tokens_per_rank.to(torch.int64)
        from_mask = got.is_token_in_rank.to(torch.int64).sum(0)
        if not torch.equal(sent, from_mask):
            errors.append(
                f"rank {rank} {kind}: tokens per rank {sent.tolist()} != mask sums {from_mask.tolist()}"
            )
        if dist.get_backend() == "gloo":
            sent = sent.cpu()
        table = [torch.empty_like(sent) for _ in range(world)]
        dist.all_gather(table, sent)
        mine = torch.stack(table)[:, rank].sum()  # what this rank receives from every sender
        want_recv = torch.stack([layout_reference(
            route(kind, 3000 + 17 * r, 8, e, world, torch.Generator().manual_seed(7919 * r + len(kind))),
            e, world,
        ).num_tokens_per_rank[rank] for r in range(world)]).sum()  # fmt: skip
        if int(mine) != int(want_recv):
            errors.append(
                f"rank {rank} {kind}: receives {int(mine)} rows, senders' reference says {int(want_recv)}"
            )
    return errors


@pytest.mark.multigpu(2)
@pytest.mark.nvcc
@pytest.mark.usefixtures("no_ep_knobs")
def test_kernel_equals_torch_layout_on_two_gpus() -> None:
    from lck_runtime.testing import run_workers

    outs = run_workers(_layout_on_each_gpu, 2, backend="nccl", timeout=600)
    assert outs == [[], []], outs


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.usefixtures("no_ep_knobs")
def test_kernel_layout_two_processes_share_one_gpu() -> None:
    """The two-GPU test's worker with both ranks on one GPU (gloo between them): two processes JIT-load and
    launch the kernel side by side and their counts agree across ranks; runs where one GPU is lent."""
    from lck_runtime.testing import run_workers

    outs = run_workers(_layout_on_each_gpu, 2, backend="gloo", timeout=600)
    assert outs == [[], []], outs
