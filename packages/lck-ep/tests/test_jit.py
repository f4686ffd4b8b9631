"""EP kernels through the runtime JIT with real nvcc (no GPU needed): knobs → -D flags → cache entries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lck_ep.knobs import INT_KNOBS, KnobError

pytestmark = pytest.mark.nvcc

KNOB_VALUES = {
    "EP_NUM_SUB_PARTS": (1, 4),
    "EP_MIN_SUB_TOKENS": (2, 64),
    "EP_SM100_MIN_SUB_TOKENS": (1, 30),
    "EP_NUM_TOPK_IDX_BITS": (32, 8),
}
ALL_ENV = [k.name for k in INT_KNOBS] + [
    "EP_HYBRID_KERNEL",
    "EP_JIT_EXTRA_FLAGS",
    "EP_JIT_PRINT_COMPILER_COMMAND",
    "EP_JIT_CACHE_DIR",
]
SRC = [str(Path(__file__).resolve().parents[2] / f"lck-{p}" / "src") for p in ("runtime", "ep")]


@pytest.fixture
def jit_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private EP cache with printing on and every EP_* knob unset."""
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "ep-cache"
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("EP_JIT_PRINT_COMPILER_COMMAND", "1")
    return cache


def _compile(capfd: pytest.CaptureFixture[str], arch: str = "sm_90a") -> tuple[Path, list[str]]:
    from lck_ep.jit import compile_layout_kernel

    capfd.readouterr()
    path = compile_layout_kernel(arch)
    err = capfd.readouterr().err
    commands = [ln for ln in err.splitlines() if ln.startswith("[EP JIT ep_layout]")]
    return path, commands


def _ep_defines(command: str) -> list[str]:
    return [tok for tok in command.split() if tok.startswith("-DEP_")]


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("ep_layout-*") if p.is_dir())


def test_unset_builds_print_no_knob_and_are_served_from_cache(jit_env: Path, capfd, monkeypatch) -> None:
    path, commands = _compile(capfd)
    assert len(commands) == 1, commands
    assert _ep_defines(commands[0]) == [], commands[0]
    assert "-gencode=arch=compute_90a,code=sm_90a" in commands[0]
    assert path.is_file() and path.read_bytes()[:4] == b"\x7fELF"
    # Unset again, and the explicit default variant: the same entry, nvcc does not run.
    again, commands = _compile(capfd)
    assert (again, commands) == (path, [])
    monkeypatch.setenv("EP_HYBRID_KERNEL", "unordered")
    monkeypatch.setenv("EP_NUM_SUB_PARTS", "")
    same, commands = _compile(capfd)
    assert (same, commands) == (path, [])
    assert _entries(jit_env) == [path.parent]


@pytest.mark.parametrize("name", list(KNOB_VALUES))
def test_each_knob_appears_only_when_set_with_one_entry_per_value(
    name: str, jit_env: Path, capfd, monkeypatch
) -> None:
    base, _ = _compile(capfd)
    paths = {"unset": base}
    for value in KNOB_VALUES[name]:
        monkeypatch.setenv(name, str(value))
        path, commands = _compile(capfd)
        assert len(commands) == 1, f"{name}={value}: expected one nvcc run, got {commands}"
        assert _ep_defines(commands[0]) == [f"-D{name}={value}"], commands[0]
        paths[str(value)] = path
        # Same value again: served from the cache.
        assert _compile(capfd) == (path, [])
    assert len(set(paths.values())) == 3, paths
    assert len(_entries(jit_env)) == 3
    monkeypatch.delenv(name)
    assert _compile(capfd) == (base, [])


def test_ordered_variant_is_a_distinct_entry_with_its_tag(jit_env: Path, capfd, monkeypatch) -> None:
    unordered, _ = _compile(capfd)
    monkeypatch.setenv("EP_HYBRID_KERNEL", "ordered")
    ordered, commands = _compile(capfd)
    assert len(commands) == 1 and _ep_defines(commands[0]) == []
    assert ordered != unordered
    assert 'LCK_EP_HYBRID_VARIANT "ordered"' in (ordered.parent / "ep_layout.cu").read_text()
    assert 'LCK_EP_HYBRID_VARIANT "unordered"' in (unordered.parent / "ep_layout.cu").read_text()


def test_extra_flags_knob_is_forwarded_once(jit_env: Path, capfd, monkeypatch) -> None:
    monkeypatch.setenv("EP_JIT_EXTRA_FLAGS", "-DEP_NUM_SUB_PARTS=4")
    path, commands = _compile(capfd)
    assert _ep_defines(commands[0]) == ["-DEP_NUM_SUB_PARTS=4"]
    monkeypatch.delenv("EP_JIT_EXTRA_FLAGS")
    monkeypatch.setenv("EP_NUM_SUB_PARTS", "4")
    via_var, commands = _compile(capfd)
    # Same flag list, same key: the variable and the extra flag are one build.
    assert (via_var, commands) == (path, [])


@pytest.mark.parametrize(
    ("env", "exc", "fragment"),
    [
        ({"EP_NUM_SUB_PARTS": "0"}, KnobError, "EP_NUM_SUB_PARTS=0"),
        ({"EP_MIN_SUB_TOKENS": "many"}, KnobError, "EP_MIN_SUB_TOKENS='many'"),
        ({"EP_SM100_MIN_SUB_TOKENS": "70000"}, KnobError, "EP_SM100_MIN_SUB_TOKENS=70000"),
        ({"EP_NUM_TOPK_IDX_BITS": "12"}, KnobError, "EP_NUM_TOPK_IDX_BITS=12"),
        ({"EP_HYBRID_KERNEL": "fifo"}, KnobError, "EP_HYBRID_KERNEL"),
        ({"EP_JIT_EXTRA_FLAGS": "-DEP_NUM_SUB_PARTS=40"}, KnobError, "EP_NUM_SUB_PARTS=40"),
        ({"EP_NUM_SUB_PARTS": "2", "EP_JIT_EXTRA_FLAGS": "-DEP_NUM_SUB_PARTS=3"}, KnobError, "contradicts"),
        ({"EP_JIT_EXTRA_FLAGS": "-O0"}, ValueError, "EP_JIT_EXTRA_FLAGS"),
    ],
)
def test_bad_values_are_refused_before_nvcc_runs(
    env, exc, fragment, jit_env: Path, capfd, monkeypatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capfd.readouterr()
    from lck_ep.jit import compile_layout_kernel

    with pytest.raises(exc) as info:
        compile_layout_kernel("sm_90a")
    assert fragment in str(info.value), str(info.value)
    assert "[EP JIT" not in capfd.readouterr().err
    assert not jit_env.exists() or _entries(jit_env) == []


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_narrow_topk_index_types_compile_for_both_targets(
    bits: int, jit_env: Path, capfd, monkeypatch
) -> None:
    monkeypatch.setenv("EP_NUM_TOPK_IDX_BITS", str(bits))
    hopper, _ = _compile(capfd, "sm_90a")
    blackwell, commands = _compile(capfd, "sm_100a")
    assert hopper != blackwell
    assert "-gencode=arch=compute_100a,code=sm_100a" in commands[0]
    assert f"-DEP_NUM_TOPK_IDX_BITS={bits}" in commands[0]


def test_four_concurrent_processes_leave_one_valid_entry(jit_env: Path) -> None:
    from lck_runtime.jit.cubin import kernel_symbols

    env = {k: v for k, v in os.environ.items() if k not in ALL_ENV}
    env.update(
        EP_JIT_CACHE_DIR=str(jit_env),
        EP_JIT_PRINT_COMPILER_COMMAND="1",
        EP_NUM_SUB_PARTS="3",
        PYTHONPATH=os.pathsep.join([*SRC, env.get("PYTHONPATH", "")]),
    )
    code = "from lck_ep.jit import compile_layout_kernel; print(compile_layout_kernel('sm_90a'))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a JIT process did not finish within 240 s")
        assert p.returncode == 0, err
        outs.append((out.strip(), err))
    paths = {o for o, _ in outs}
    assert len(paths) == 1, paths
    compiled = sum(e.count("[EP JIT ep_layout]") for _, e in outs)
    assert compiled == 1, f"nvcc ran {compiled} times for one entry"
    (entry,) = _entries(jit_env)
    cubin = Path(paths.pop())
    assert cubin.parent == entry
    assert "ep_layout_kernel" in kernel_symbols(cubin.read_bytes())
    assert not any((jit_env / ".tmp").iterdir())
