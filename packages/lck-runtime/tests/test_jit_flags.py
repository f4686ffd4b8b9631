"""``<PREFIX>_JIT_*`` environment parsing and ``-D`` define validation (no compiler needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lck_runtime.jit import Jit, JitConfigError, JitError
from lck_runtime.jit.flags import define_flags, parse_extra_flags, read_settings


def test_extra_flags_accepts_only_integer_defines():
    got = parse_extra_flags("EP_JIT_EXTRA_FLAGS", " -DA=1\t-DB_2=-30\n-D_c=0 ")
    assert got == (("A", 1), ("B_2", -30), ("_c", 0))
    assert parse_extra_flags("EP_JIT_EXTRA_FLAGS", "") == ()


@pytest.mark.parametrize(
    "item",
    [
        "-O0",
        "-DX",
        "-DX=",
        "-DX=1.5",
        "-DX=0x10",
        "-D1X=2",
        "-DX=a",
        "--use_fast_math",
        "-Xptxas=-v",
        "-DX=1;ls",
        "-I/tmp",
        "-UX",
    ],
)
def test_extra_flags_refuses_anything_else(item):
    with pytest.raises(JitConfigError, match=re.escape(f"EP_JIT_EXTRA_FLAGS: item '{item}' is not accepted")):
        parse_extra_flags("EP_JIT_EXTRA_FLAGS", f"-DOK=1 {item}")


def test_extra_flags_conflicting_repeat():
    assert parse_extra_flags("V", "-DA=1 -DA=1") == (("A", 1),)
    with pytest.raises(JitConfigError, match="A is set twice"):
        parse_extra_flags("V", "-DA=1 -DA=2")


def test_read_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("EP_JIT_PRINT_COMPILER_COMMAND", "1")
    monkeypatch.setenv("EP_JIT_EXTRA_FLAGS", "-DEP_NUM_SUB_PARTS=4")
    s = read_settings("EP")
    assert s.cache_dir == tmp_path / "c" and s.print_command is True
    assert s.extra_flags == ("-DEP_NUM_SUB_PARTS=4",)
    monkeypatch.setenv("EP_JIT_PRINT_COMPILER_COMMAND", "maybe")
    with pytest.raises(JitConfigError, match="EP_JIT_PRINT_COMPILER_COMMAND: expected 0 or 1"):
        read_settings("EP")
    monkeypatch.setenv("EP_JIT_PRINT_COMPILER_COMMAND", "0")
    monkeypatch.setenv("EP_JIT_CACHE_DIR", "  ")
    with pytest.raises(JitConfigError, match="EP_JIT_CACHE_DIR is set but empty"):
        read_settings("EP")


def test_default_cache_dir_is_per_prefix(monkeypatch, tmp_path):
    monkeypatch.delenv("ZZ_JIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert read_settings("ZZ").cache_dir == tmp_path / "lck" / "jit" / "zz"


@pytest.mark.parametrize("prefix", ["ep", "", "1EP", "E P", None])
def test_bad_prefix(prefix):
    with pytest.raises(JitConfigError, match="prefix must be an upper-case"):
        read_settings(prefix)


def test_define_flags_merge_and_override():
    assert define_flags({"A": 1, "B": True, "C": "128u", "D": False}) == [
        "-DA=1",
        "-DB=1",
        "-DC=128u",
        "-DD=0",
    ]
    # An environment extra replaces the caller's define of the same macro and comes last.
    assert define_flags({"A": 1, "B": 2}, (("A", 7),)) == ["-DB=2", "-DA=7"]
    assert define_flags(None) == []


@pytest.mark.parametrize(
    "defines, match",
    [
        ({"1A": 1}, "not a C macro name"),
        ({"A B": 1}, "not a C macro name"),
        ({"A": 1.5}, r"defines\['A'\] must be an int"),
        ({"A": "x y"}, r"defines\['A'\] must be an int"),
        ({"A": None}, r"defines\['A'\] must be an int"),
    ],
)
def test_define_flags_refuses_bad_values(defines, match):
    with pytest.raises(JitConfigError, match=match):
        define_flags(defines)


def test_define_flags_needs_a_mapping():
    with pytest.raises(TypeError, match="defines must be a mapping"):
        define_flags(["-DA=1"])


def _logging_nvcc(tmp_path: Path) -> tuple[Path, Path]:
    """A fake compiler that only records that it ran: the checks below must refuse before any nvcc call."""
    log = tmp_path / "nvcc.log"
    script = tmp_path / "nvcc"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n')
    script.chmod(0o755)
    return script, log


def test_bad_extra_flag_refused_at_construction_before_nvcc(monkeypatch, tmp_path):
    nvcc, log = _logging_nvcc(tmp_path)
    monkeypatch.setenv("EP_JIT_EXTRA_FLAGS", "-DEP_NUM_SUB_PARTS=2 -O0")
    with pytest.raises(JitConfigError, match=r"EP_JIT_EXTRA_FLAGS: item '-O0' is not accepted") as err:
        Jit(prefix="EP", cache_dir=tmp_path / "cache", nvcc=nvcc)
    assert isinstance(err.value, ValueError) and isinstance(err.value, JitError)
    assert not log.exists(), "nvcc ran although the extra flags were invalid"
    assert not (tmp_path / "cache").exists(), "the cache directory was touched before validation"


def test_jit_constructor_validation(tmp_path):
    with pytest.raises(JitConfigError, match=r"nvcc=.* is not a file"):
        Jit(nvcc=tmp_path / "missing-nvcc")
    with pytest.raises(JitConfigError, match="lock_timeout must be a positive"):
        Jit(lock_timeout=0)
    with pytest.raises(JitConfigError, match="compile_timeout must be a positive"):
        Jit(compile_timeout=float("inf"))
    with pytest.raises(JitConfigError, match="cache_dir must be a non-empty path"):
        Jit(cache_dir="")


def test_build_arguments_validated_before_nvcc(tmp_path):
    nvcc, log = _logging_nvcc(tmp_path)
    jit = Jit(cache_dir=tmp_path / "cache", nvcc=nvcc)
    src = 'extern "C" __global__ void k() {}'
    cases = [
        (dict(name="a/b", source=src, kernel="k", arch="sm_90a"), "name must be"),
        (dict(name="k", source="  ", kernel="k", arch="sm_90a"), "source must be non-empty"),
        (dict(name="k", source=src, kernel="k()", arch="sm_90a"), "kernel must be a C symbol"),
        (
            dict(name="k", source=src, kernel="k", arch="sm_80"),
            r"arch must be one of \['sm_100a', 'sm_103a', 'sm_90a'\]",
        ),
        (dict(name="k", source=src, kernel="k", arch=None), "compile_only: arch is required"),
        (
            dict(name="k", source=src, kernel="k", arch="sm_90a", headers=[tmp_path / "nope.cuh"]),
            "headers entry .*nope.cuh",
        ),
        (
            dict(name="k", source=src, kernel="k", arch="sm_90a", include_dirs=[tmp_path / "nodir"]),
            "include_dirs entry .*nodir",
        ),
        (dict(name="k", source=src, kernel="k", arch="sm_90a", defines={"X": 0.5}), r"defines\['X'\]"),
    ]
    for kwargs, match in cases:
        with pytest.raises(JitConfigError, match=match):
            jit.compile_only(**kwargs)
    with pytest.raises(TypeError, match="headers must be a sequence of paths"):
        jit.compile_only(name="k", source=src, kernel="k", arch="sm_90a", headers=str(tmp_path / "x.cuh"))
    assert not log.exists(), "nvcc ran although the build arguments were invalid"
