"""The shared helpers in ``lck_kernels._common``: validation messages, row views, launch arithmetic, tuning
overrides and op registration. Pure Python: runs anywhere, with or without a GPU or the interpreter."""

from __future__ import annotations

import pytest
import torch

from lck_kernels import _common as C


def test_cdiv_and_next_power_of_2():
    assert [C.cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [C.next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65, 5120)] == [1, 1, 2, 4, 8, 64, 128, 8192]
    assert C.row_block(5120, 16384) == 8192 and C.row_block(20000, 16384) == 16384


@pytest.mark.parametrize("elements", [1, 100, 1024, 4096, 16384, 1 << 20])
@pytest.mark.parametrize("element_size", [2, 4])
def test_warps_for(elements, element_size):
    w = C.warps_for(elements, element_size)
    assert w & (w - 1) == 0 and 1 <= w <= 16
    assert C.warps_for(elements, element_size, lo=4, hi=8) in (4, 8)
    # Monotone: more elements never means fewer warps.
    assert C.warps_for(elements * 2, element_size) >= w


def test_warps_for_targets_four_vectors_per_thread():
    assert C.warps_for(4096, 2) == 4  # 4096 bf16 = 128 threads x 4 x 16 B
    assert C.warps_for(4096, 4) == 8


def test_row_stride_and_rows_view():
    t = torch.empty(4, 6, 8)
    assert C.row_stride(t) == 8 and C.rows_view("op", "t", t).shape == (24, 8)
    wide = torch.empty(4, 6, 20)[:, :, 2:10]  # a column slice: row stride 20, still one row stride
    assert C.row_stride(wide) == 20
    v = C.rows_view("op", "t", wide)
    assert v.shape == (24, 8) and v.stride() == (20, 1) and v.data_ptr() == wide.data_ptr()
    assert C.row_stride(torch.empty(1, 1, 8)[:, :, :5]) == 5  # one row: any stride will do
    assert C.row_stride(torch.empty(8)) == 8
    assert C.row_stride(torch.empty(4, 6, 8).transpose(0, 1)) is None
    with pytest.raises(ValueError, match=r"op: t with shape \(6, 4, 8\).*cannot be viewed as \[rows, 8\]"):
        C.rows_view("op", "t", torch.empty(4, 6, 8).transpose(0, 1))
    with pytest.raises(ValueError, match="op: t must have unit stride in its last dimension"):
        C.rows_view("op", "t", torch.empty(8, 4).t())
    with pytest.raises(ValueError, match="op: t must have at least 1 dimension"):
        C.rows_view("op", "t", torch.tensor(1.0))
    assert C.rows_view("op", "t", torch.empty(0, 3, 8)).shape == (0, 8)


def test_check_tensor_messages():
    dev = C.kernel_device_type()
    ok = torch.randn(2, 3, device=dev) if dev == "cpu" or torch.cuda.is_available() else None
    with pytest.raises(TypeError, match=r"myop: x must be a torch.Tensor, got list"):
        C.check_tensor("myop", "x", [1.0])
    with pytest.raises(
        TypeError, match=r"myop: x has dtype int32; expected one of float32, float16, bfloat16"
    ):
        C.check_tensor("myop", "x", torch.zeros(2, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=rf"myop: x is on device meta; expected a {dev} tensor"):
        C.check_tensor("myop", "x", torch.empty(2, device="meta"))
    if ok is not None:  # the remaining checks need a tensor on the kernel device
        assert C.check_tensor("myop", "x", ok, ndim=2) is ok
        with pytest.raises(ValueError, match=r"myop: x must be 1 or 3-D, got shape \(2, 3\) \(2-D\)"):
            C.check_tensor("myop", "x", ok, ndim=(1, 3))
        with pytest.raises(ValueError, match=r"myop: x must be contiguous"):
            C.check_tensor("myop", "x", ok.t(), contiguous=True)
        with pytest.raises(ValueError, match=r"myop: x must have unit stride in its last dimension"):
            C.check_tensor("myop", "x", ok.t(), last_dim_contiguous=True)


def test_check_scalars():
    C.check_float("op", "eps", 0.0, minimum=0.0)
    C.check_float("op", "offset", -3)
    for bad in (float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValueError, match=r"op: offset must be a finite number"):
            C.check_float("op", "offset", bad)
    with pytest.raises(ValueError, match=r"op: eps must be a finite number >= 0.0, got -1"):
        C.check_float("op", "eps", -1, minimum=0.0)
    C.check_choice("op", "mode", "a", ("a", "b"))
    with pytest.raises(ValueError, match=r"op: mode must be one of \['a', 'b'\], got 'c'"):
        C.check_choice("op", "mode", "c", ("a", "b"))


def test_check_same_device():
    C.check_same_device("op", a=torch.empty(1), b=torch.empty(1))
    with pytest.raises(ValueError, match="op: b is on meta but a is on cpu"):
        C.check_same_device("op", a=torch.empty(1), b=torch.empty(1, device="meta"))


def test_tuning_overrides_nest_and_restore():
    defaults = {"BLOCK": 64, "num_warps": 4}
    assert C.tuned("k", defaults) == defaults
    with C.tuning("k", num_warps=8):
        assert C.tuned("k", defaults) == {"BLOCK": 64, "num_warps": 8}
        with C.tuning("k", BLOCK=32):
            assert C.tuned("k", defaults) == {"BLOCK": 32, "num_warps": 4}
        assert C.tuned("k", defaults) == {"BLOCK": 64, "num_warps": 8}
        assert C.tuned("other", defaults) == defaults
    assert C.tuned("k", defaults) == defaults
    with (
        C.tuning("k", WARPS=8),
        pytest.raises(ValueError, match=r"tuning\('k'\): unknown parameter\(s\) \['WARPS'\]"),
    ):
        C.tuned("k", defaults)


def test_num_sms_on_cpu():
    assert C.num_sms(torch.device("cpu")) == 4


def test_registered_ops():
    import lck_kernels.rms_norm
    import lck_kernels.swiglu  # noqa: F401

    for name in (
        "rms_norm_fwd",
        "rms_norm_bwd",
        "rms_norm_bwd_",
        "swiglu_fwd",
        "swiglu_bwd",
        "swiglu_packed_fwd",
        "swiglu_packed_bwd",
        "swiglu_packed_bwd_",
    ):
        schema = str(getattr(torch.ops.lck, name).default._schema)
        assert schema.startswith(f"lck::{name}("), schema
        # The in-place ops declare what they write, so functionalisation and opcheck see the mutation.
        assert ("!)" in schema) == name.endswith("_"), schema


def test_public_names_are_the_ops():
    """``lck_kernels.rms_norm`` etc. are the functions, even though their modules carry the same names."""
    import types

    import lck_kernels

    for name in (
        "rms_norm",
        "swiglu",
        "swiglu_packed",
        "cross_entropy",
        "LckRMSNorm",
        "LckSwiGLUMLP",
        "LckSwiGLUPacked",
        "LckCrossEntropyLoss",
    ):
        value = getattr(lck_kernels, name)
        assert not isinstance(value, types.ModuleType) and callable(value), name
        assert name in lck_kernels.__all__
