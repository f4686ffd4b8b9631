"""The CUDA cluster kernel of the loss+gradient forward (``_cross_entropy_cuda``, ``csrc/ce_fwd_grad.cu``).

Without a GPU: which rows it takes (``plan``) and that nvcc compiles every variant for sm_90a and sm_100a.
On a GPU: ``cross_entropy`` through the kernel against the float64 reference (cluster sizes 2/4/8, block
sizes, fewer rows than clusters, vocabularies not a multiple of the vector width, in place, every option it
handles), bit-identical repeats, agreement with the Triton kernel, and the Triton kernel taking over where
the cluster kernel does not apply.
"""

from __future__ import annotations

import pytest
import torch
from _tolerances import assert_close
from test_cross_entropy import assert_close_on_device, check_against_reference, make_case, reference_chunks

from lck_kernels._common import interpreting, tuning
from lck_kernels.cross_entropy import cross_entropy
from lck_kernels.cross_entropy import cuda as cc
from lck_kernels.cross_entropy import launch as _cross_entropy_launch

gpu = pytest.mark.gpu


@pytest.fixture
def taken(monkeypatch):
    """Turns the (opt-in) cluster kernel on and records whether each loss+gradient forward ran it (True) or
    fell back to the Triton kernel (False)."""
    calls: list[bool] = []
    real = _cross_entropy_launch.try_launch

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(_cross_entropy_launch, "try_launch", spy)
    with tuning("cross_entropy_fwd_grad", cuda=1):
        yield calls


# ---------------------------------------------------------------------------------------------------------
# Without a GPU
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_cols", "dtype", "want"),
    [
        (128256, torch.bfloat16, (4, 4, 32064)),  # 63 KiB slices: three per block in 188 KiB of shared memory
        (151936, torch.bfloat16, (8, 3, 18992)),  # 74 KiB slices would not fit three times
        (128256, torch.float32, (8, 4, 16032)),
        (256000, torch.bfloat16, (8, 4, 32000)),
        (50001, torch.float16, (2, 4, 25008)),  # slices rounded up to whole 16-byte vectors
        (32768, torch.bfloat16, (2, 2, 16384)),
        (256000, torch.float32, None),  # 125 KiB slices even at 8 blocks: the Triton kernel
        (20000, torch.bfloat16, None),  # 40 KiB rows: the per-row barrier would cost more than it saves
        (128256, torch.float64, None),
    ],
    ids=str,
)
def test_plan(n_cols, dtype, want):
    assert cc.plan(8192, n_cols, dtype, torch.device("cpu")) is None, "opt-in: off by default"
    with tuning("cross_entropy_fwd_grad", cuda=1):
        p = cc.plan(8192, n_cols, dtype, torch.device("cpu"))
    if want is None:
        assert p is None
        return
    assert (p["cluster"], p["vpt"], p["chunk"]) == want, p
    assert p["threads"] == 1024 and p["chunk"] % p["vec"] == 0
    assert p["chunk"] * p["cluster"] >= n_cols > p["chunk"] * (p["cluster"] - 1), "every block owns columns"
    assert p["threads"] * p["vpt"] * p["vec"] >= p["chunk"], "a block's vectors cover its slice"
    assert p["shared"] == 3 * p["chunk"] * dtype.itemsize <= 227 * 1024 - 1024


def test_plan_tuning():
    dev = torch.device("cpu")
    with tuning("cross_entropy_fwd_grad", cuda=0):
        assert cc.plan(8192, 128256, torch.bfloat16, dev) is None
    with tuning("cross_entropy_fwd_grad", cuda=1, cluster=8, threads=256):
        assert cc.plan(8192, 128256, torch.bfloat16, dev) == {
            "cluster": 8, "threads": 256, "vpt": 8, "chunk": 16032, "vec": 8, "shared": 3 * 16032 * 2,
        }  # fmt: skip
    with tuning("cross_entropy_fwd_grad", cuda=1, cluster=2):  # 125 KiB slices do not fit three times
        assert cc.plan(8192, 128256, torch.bfloat16, dev) is None
    with tuning("cross_entropy_fwd_grad", cuda=1):
        assert cc.plan(0, 128256, torch.bfloat16, dev) is None


@pytest.mark.skipif(not interpreting(), reason="CPU tensors reach the kernels only under TRITON_INTERPRET=1")
def test_cpu_tensors_never_take_the_cuda_kernel(taken):
    logits, target = make_case(3, 40000, torch.float32, seed=40, device="cpu")
    x = logits.clone().requires_grad_(True)
    cross_entropy(x, target).backward()
    assert taken == [], "the cluster kernel is tried only for CUDA tensors"


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_variant_compiles(arch, tmp_path):
    from lck_runtime.jit import Jit

    jit = Jit(prefix="LCK", cache_dir=tmp_path)
    source = cc.SOURCE.read_text()
    for dtype in (0, 1, 2):
        for softcap in (0, 1):
            path = jit.compile_only(
                "lck_ce_fwd_grad", source, "lck_ce_fwd_grad", arch=arch,
                defines={"LCK_CE_DTYPE": dtype, "LCK_CE_SOFTCAP": softcap},
            )  # fmt: skip
            assert path.stat().st_size > 0


# ---------------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------------

NO_WEIGHT_ALL = {"label_smoothing": 0.05, "lse_square_scale": 2e-4, "softcap": 6.0}
GPU_CASES = [
    # (rows, vocab, dtype, reduction, options, tuning overrides); sum/mean: the gradient is computed in the
    # forward (reduction "none" computes it in the backward, from the saved lse)
    (8192, 128256, torch.bfloat16, "mean", {}, {}),
    (4096, 151936, torch.bfloat16, "mean", NO_WEIGHT_ALL, {}),
    (2048, 128256, torch.float32, "mean", {"lse_square_scale": 1e-3}, {}),
    (1000, 256000, torch.bfloat16, "sum", {"label_smoothing": 0.1}, {}),
    (333, 50000, torch.float16, "sum", {"label_smoothing": 0.1}, {"cluster": 2, "threads": 256}),
    (3, 128256, torch.bfloat16, "mean", {"softcap": 4.0}, {"cluster": 8, "threads": 512}),
    (777, 65536, torch.float16, "sum", {"ignore_index": 0}, {"cluster": 4, "threads": 128}),
]


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}-{c[5]}")
def test_cluster_kernel_matches_float64_reference(case, taken, poisoned):
    n, v, dtype, reduction, options, params = case
    with tuning("cross_entropy_fwd_grad", cuda=1, **params):
        chunk = 512 if n * v > 2**24 else None
        check_against_reference(n, v, dtype, reduction, seed=41, rows_per_chunk=chunk, **options)
        # in place: the gradient is written over the logits themselves
        check_against_reference(
            n, v, dtype, reduction, seed=42, rows_per_chunk=chunk, in_place=True, **options
        )
    assert taken and all(taken), f"the cluster kernel did not run: {taken}"


@gpu
def test_partial_vectors_and_row_padding(taken):
    """An odd vocabulary in rows padded to a multiple of 8 (16-byte aligned rows): the last vector of the
    last block's slice is partial, and the padding between rows is never written."""
    n, v, pad = 513, 50001, 7
    gen = torch.Generator("cuda").manual_seed(43)
    base = (torch.randn(n, v + pad, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda", generator=gen)
    target[::5] = -100
    leaf = base.clone().requires_grad_(True)
    work = leaf * 1  # a non-leaf buffer with padded rows, which the in-place forward overwrites
    loss = cross_entropy(work[:, :v], target, reduction="sum", label_smoothing=0.1, in_place=True)
    assert taken == [True], taken
    assert torch.equal(work[:, v:], base[:, v:]), "the padding between rows was written"
    loss.backward()
    ((_, _, ref_rows, ref_grad),) = list(
        reference_chunks(
            base[:, :v], target, torch.tensor(1.0), reduction="sum", rows_per_chunk=n, label_smoothing=0.1
        )
    )
    assert_close(loss, ref_rows, torch.bfloat16, name="loss")
    assert_close_on_device(leaf.grad[:, :v], ref_grad, torch.bfloat16, name="gradient")
    assert torch.equal(leaf.grad[:, v:], torch.zeros_like(base[:, v:]))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_repeatable_and_close_to_the_triton_kernel(dtype, taken):
    """The same input twice gives the same bits (the cluster merge has a fixed order), and the Triton
    kernel's loss and gradient agree within the dtype's tolerance."""
    logits, target = make_case(2048, 128256, dtype, seed=44)
    out = []
    for cuda in (1, 1, 0):
        with tuning("cross_entropy_fwd_grad", cuda=cuda):
            x = logits.clone().requires_grad_(True)
            loss = cross_entropy(x, target, label_smoothing=0.05, lse_square_scale=1e-4)
            (g,) = torch.autograd.grad(loss, x)
            out.append((loss, g))
    assert taken == [True, True, False], taken
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]), "not bit-repeatable"
    assert_close(out[0][0], out[2][0], dtype, name="loss vs Triton")
    assert_close_on_device(out[0][1], out[2][1].to(dtype), dtype, name="gradient vs Triton")


@gpu
def test_falls_back_where_it_does_not_apply(taken):
    """Unaligned rows and class weights go to the Triton kernel, with correct results."""
    check_against_reference(64, 40003, torch.bfloat16, "mean", seed=45)  # odd row stride: 2-byte aligned rows
    w = torch.rand(128256, device="cuda", generator=torch.Generator("cuda").manual_seed(46)) + 0.5
    check_against_reference(64, 128256, torch.bfloat16, "mean", seed=46, weight=w)
    assert taken == [False, False], taken


@gpu
def test_disabled_by_environment(monkeypatch, taken):
    monkeypatch.setenv("LCK_KERNELS_CUDA", "0")
    check_against_reference(16, 128256, torch.bfloat16, "mean", seed=47)
    assert taken == [False]


@gpu
def test_resident_clusters_reported():
    kernel = cc.build(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cluster, threads, shared in ((4, 1024, 3 * 64128), (8, 512, 3 * 32064)):
        n = kernel.max_active_clusters(threads, cluster, shared_mem=shared)
        assert n is not None and 1 <= n and n * cluster <= sms * (2048 // threads), (cluster, n, sms)
    with pytest.raises(ValueError, match="shared_mem"):
        kernel.max_active_clusters(1024, 4, shared_mem=-1)
