"""Typed kernel arguments: C types are explicit, ranges are checked, plain Python numbers are refused."""

from __future__ import annotations

import math

import pytest
import torch

from lck_runtime.jit import F32, I32, I64, U64, Ptr
from lck_runtime.jit.args import KIND_F32, KIND_I32, KIND_I64, KIND_PTR, KIND_U64, pack_args


@pytest.mark.parametrize(
    "cls, lo, hi",
    [(I32, -(2**31), 2**31 - 1), (I64, -(2**63), 2**63 - 1), (U64, 0, 2**64 - 1), (Ptr, 0, 2**64 - 1)],
)
def test_integer_ranges(cls, lo, hi):
    assert cls(lo).value == lo and cls(hi).value == hi
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\(\): {bad} is outside"):
            cls(bad)


@pytest.mark.parametrize("cls", [I32, I64, U64, Ptr])
@pytest.mark.parametrize("bad", [1.0, "3", True, None])
def test_integer_types_refuse_non_integers(cls, bad):
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\): expected an integer"):
        cls(bad)


class _Index:
    """An integer-like object (as numpy integers are): accepted through ``__index__``."""

    def __index__(self) -> int:
        return -5


def test_index_protocol_integers_are_integers():
    assert I32(_Index()).value == -5 and I64(_Index()).value == -5


def test_f32():
    assert F32(0.5).value == 0.5 and F32(3).value == 3.0 and F32(1.25).value == 1.25
    assert math.isnan(F32(float("nan")).value) and F32(float("-inf")).value == float("-inf")
    with pytest.raises(ValueError, match="overflows float32"):
        F32(1e39)
    for bad in (True, "1.0", None):
        with pytest.raises(TypeError, match="F32"):
            F32(bad)


def test_equality_and_repr():
    assert I32(3) == I32(3) and I32(3) != I64(3) and hash(U64(7)) == hash(U64(7))
    assert repr(Ptr(16)) == "Ptr(16)"


def test_pack_args_kinds_and_values():
    kinds, values = pack_args([I32(-1), I64(-(2**40)), U64(2**63), F32(2.5), Ptr(4096)], device_index=0)
    assert kinds == [KIND_I32, KIND_I64, KIND_U64, KIND_F32, KIND_PTR]
    assert values == [-1, -(2**40), 2**63, 2.5, 4096]


@pytest.mark.parametrize("bad", [5, 2.0, True])
def test_pack_args_refuses_plain_numbers(bad):
    with pytest.raises(TypeError, match=r"args\[1\] is a plain .*wrap it as I32"):
        pack_args([I32(1), bad], device_index=0, where="k.launch")


def test_pack_args_refuses_other_objects_and_non_sequences():
    with pytest.raises(TypeError, match=r"args\[0\] has unsupported type str"):
        pack_args(["x"], device_index=0)
    with pytest.raises(TypeError, match="args must be a list or tuple"):
        pack_args(I32(1), device_index=0)


def test_pack_args_refuses_cpu_tensor():
    with pytest.raises(ValueError, match=r"args\[0\] is a tensor on cpu, expected a CUDA tensor on cuda:0"):
        pack_args([torch.ones(2)], device_index=0)
