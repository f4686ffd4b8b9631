"""The JIT's compile and cache path with the real nvcc (no GPU needed).

nvcc is reached through a wrapper script that logs every invocation, so "served from cache" means
provably "nvcc did not compile" (the wrapper also sees ``nvcc --version`` probes; only compiles count).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shlex
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lck_runtime.jit import Jit, JitConfigError, JitError
from lck_runtime.jit.cache import compute_key, file_lock, get_or_create, read_entry
from lck_runtime.jit.cubin import kernel_symbols
from lck_runtime.toolchain import find_nvcc

pytestmark = pytest.mark.nvcc

SOURCE = r"""
#ifndef SCALE
#error "SCALE must be defined"
#endif
extern "C" __global__ void scale_kernel(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * SCALE;
}
"""

HEADER_SOURCE = r"""
#include "jit_test_header.cuh"
extern "C" __global__ void offset_kernel(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += JIT_TEST_OFFSET;
}
"""


def make_nvcc_wrapper(directory: Path) -> tuple[Path, Path]:
    """An ``nvcc`` that appends its argv to a log (one line per run) and runs the real nvcc."""
    real = find_nvcc()
    assert real is not None
    log = directory / "nvcc-calls.log"
    script = directory / "nvcc"
    script.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\nexec {shlex.quote(real)} "$@"\n')
    script.chmod(0o755)
    return script, log


def compiles(log: Path) -> list[str]:
    """Logged nvcc runs that compiled something (not ``--version`` probes)."""
    if not log.exists():
        return []
    return [line for line in log.read_text().splitlines() if "--version" not in line.split()]


@pytest.fixture
def nvcc(tmp_path):
    return make_nvcc_wrapper(tmp_path)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("LCK_JIT_EXTRA_FLAGS", "LCK_JIT_PRINT_COMPILER_COMMAND", "LCK_JIT_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compiles_each_target_to_a_cubin(tmp_path, nvcc, clean_env, arch):
    script, log = nvcc
    jit = Jit(cache_dir=tmp_path / "cache", nvcc=script)
    path = jit.compile_only("scale", SOURCE, "scale_kernel", arch=arch, defines={"SCALE": 3})
    image = path.read_bytes()
    assert image[:4] == b"\x7fELF" and kernel_symbols(image) == ["scale_kernel"]
    (call,) = compiles(log)
    compute = arch.replace("sm_", "compute_")
    assert f"-gencode=arch={compute},code={arch}" in call.split() and "-cubin" in call.split()
    meta = json.loads((path.parent / "meta.json").read_text())
    assert meta["arch"] == arch and meta["argv"][0] == str(script) and "-DSCALE=3" in meta["argv"]
    assert meta["nvcc_version"].startswith("Cuda compilation tools, release")


def test_cache_hit_on_repeat_without_nvcc(tmp_path, nvcc, clean_env):
    script, log = nvcc
    first = Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
        "scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 2}
    )
    assert not first.from_cache and len(compiles(log)) == 1
    # A new Jit (as in a new process): everything comes from disk.
    again = Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
        "scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 2}
    )
    assert again.from_cache and len(compiles(log)) == 1, "nvcc ran for an unchanged build"
    assert again.key == first.key and again.cubin_path == first.cubin_path and again.command == first.command
    assert entries(tmp_path / "cache") == [f"scale-{first.key[:16]}"]


def test_rejit_when_define_source_arch_or_extra_flag_changes(tmp_path, nvcc, clean_env):
    script, log = nvcc
    root = tmp_path / "cache"

    def build(source=SOURCE, defines=None, arch="sm_90a"):
        return Jit(cache_dir=root, nvcc=script).build(
            "scale", source, "scale_kernel", arch=arch, defines=defines or {"SCALE": 2}
        )

    base = build()
    keys = {base.key}
    for variant in (
        build(defines={"SCALE": 5}),
        build(source=SOURCE + "\n// a comment changes the source\n"),
        build(arch="sm_100a"),
    ):
        assert not variant.from_cache and variant.key not in keys
        keys.add(variant.key)
    assert len(compiles(log)) == 4
    # The environment's extra define is part of the flags, the key, and really reaches nvcc.
    guarded = SOURCE + "\n#if LCK_TEST_EXTRA != 3\n#error extra define missing\n#endif\n"
    clean_env.setenv("LCK_JIT_EXTRA_FLAGS", "-DLCK_TEST_EXTRA=3")
    extra = build(source=guarded)
    assert not extra.from_cache and "-DLCK_TEST_EXTRA=3" in extra.command
    clean_env.setenv("LCK_JIT_EXTRA_FLAGS", "-DLCK_TEST_EXTRA=4")
    with pytest.raises(JitError, match="extra define missing"):
        build(source=guarded)
    # An environment extra overrides the caller's define of the same macro.
    clean_env.setenv("LCK_JIT_EXTRA_FLAGS", "-DSCALE=7")
    overridden = build(source=SOURCE + "\n#if SCALE != 7\n#error override lost\n#endif\n")
    assert overridden.command.count("-DSCALE=7") == 1 and "-DSCALE=2" not in overridden.command
    clean_env.delenv("LCK_JIT_EXTRA_FLAGS")
    assert build().from_cache and build().key == base.key


def _rebuilt_on_edit(build: Callable[[], Any], header: Path, offset: str) -> Any:
    """``header`` defining JIT_TEST_OFFSET 1.0f: compiled, then cached; redefined to ``offset``: compiled
    again under another key. Returns the first build."""
    header.write_text("#define JIT_TEST_OFFSET 1.0f\n")
    one = build()
    assert not one.from_cache and build().from_cache
    header.write_text(f"#define JIT_TEST_OFFSET {offset}\n")
    two = build()
    assert not two.from_cache and two.key != one.key
    return one


def test_rejit_when_an_included_header_changes(tmp_path, nvcc, clean_env):
    script, log = nvcc
    inc = tmp_path / "include"
    inc.mkdir()
    header = inc / "jit_test_header.cuh"

    def build():
        return Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
            "offset", HEADER_SOURCE, "offset_kernel", arch="sm_90a", headers=[header], include_dirs=[inc]
        )

    one = _rebuilt_on_edit(build, header, "2.0f")
    header.write_text("#define JIT_TEST_OFFSET 1.0f\n")
    back = build()
    assert back.from_cache and back.key == one.key
    assert len(compiles(log)) == 2


def test_rejit_when_an_undeclared_nested_header_changes(tmp_path, nvcc, clean_env):
    """The key covers every header the build reads, not only those passed as ``headers``: here the source
    includes a header that includes another, and neither is declared."""
    script, log = nvcc
    inc = tmp_path / "include"
    (inc / "detail").mkdir(parents=True)
    (inc / "jit_test_header.cuh").write_text('#include "detail/offset_value.cuh"\n')
    nested = inc / "detail" / "offset_value.cuh"

    def build():
        return Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
            "offset", HEADER_SOURCE, "offset_kernel", arch="sm_90a", include_dirs=[inc]
        )

    _rebuilt_on_edit(build, nested, "3.0f")
    assert len(compiles(log)) == 2


def _race_worker(root: str, nvcc: str, barrier, results) -> None:
    try:
        barrier.wait(timeout=60)
        k = Jit(cache_dir=root, nvcc=nvcc).build(
            "race", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 9}
        )
        results.put(
            (os.getpid(), k.from_cache, str(k.cubin_path), k.cubin_path.read_bytes().hex()[:64], None)
        )
    except BaseException as exc:
        results.put((os.getpid(), None, None, None, f"{type(exc).__name__}: {exc}"))


def test_four_processes_build_one_entry(tmp_path, nvcc, clean_env):
    script, log = nvcc
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(str(tmp_path / "cache"), str(script), barrier, results))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    try:
        outs = [results.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [o[4] for o in outs if o[4]]
    assert not errors, errors
    assert sorted(o[1] for o in outs) == [False, True, True, True], "exactly one process must compile"
    assert len({o[2] for o in outs}) == 1 and len({o[3] for o in outs}) == 1
    assert len(compiles(log)) == 1
    root = tmp_path / "cache"
    assert len(entries(root)) == 1 and list((root / ".tmp").iterdir()) == []


@pytest.mark.parametrize(
    "damage", ["flip_cubin_byte", "truncate_meta", "delete_meta", "foreign_key", "delete_cubin"]
)
def test_damaged_entry_is_rebuilt(tmp_path, nvcc, clean_env, damage):
    script, log = nvcc

    def build():
        return Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
            "scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 2}
        )

    good = build()
    entry = good.cubin_path.parent
    meta_path = entry / "meta.json"
    if damage == "flip_cubin_byte":
        data = bytearray(good.cubin_path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        good.cubin_path.write_bytes(bytes(data))
    elif damage == "truncate_meta":
        meta_path.write_bytes(meta_path.read_bytes()[:40])
    elif damage == "delete_meta":
        meta_path.unlink()
    elif damage == "foreign_key":
        meta = json.loads(meta_path.read_text())
        meta["key"] = "0" * 64
        meta_path.write_text(json.dumps(meta))
    else:
        good.cubin_path.unlink()
    with pytest.warns(RuntimeWarning, match="is unusable"):
        rebuilt = build()
    assert not rebuilt.from_cache and len(compiles(log)) == 2
    assert rebuilt.cubin_path == good.cubin_path
    entry_ok, why = read_entry(entry, good.key)
    assert entry_ok is not None and why is None
    assert kernel_symbols(rebuilt.cubin_path.read_bytes()) == ["scale_kernel"]
    assert build().from_cache and len(compiles(log)) == 2


def test_print_compiler_command(tmp_path, nvcc, clean_env, capsys):
    script, _ = nvcc
    clean_env.setenv("LCK_JIT_PRINT_COMPILER_COMMAND", "1")
    k = Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
        "scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 2}
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[LCK JIT scale] ")
    assert shlex.split(err[0].split("] ", 1)[1]) == k.command and k.command[0] == str(script)
    # Served from cache: nvcc does not run, nothing is printed.
    Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
        "scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 2}
    )
    assert capsys.readouterr().err == ""
    clean_env.setenv("LCK_JIT_PRINT_COMPILER_COMMAND", "0")
    Jit(cache_dir=tmp_path / "cache", nvcc=script).build(
        "scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 8}
    )
    assert capsys.readouterr().err == ""


def test_cache_dir_from_env_created_private(tmp_path, nvcc, clean_env):
    script, _ = nvcc
    root = tmp_path / "deep" / "jit-cache"
    clean_env.setenv("LCK_JIT_CACHE_DIR", str(root))
    path = Jit(nvcc=script).compile_only("scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 2})
    assert path.is_relative_to(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for aux in (".locks", ".tmp", ".trash"):
        assert stat.S_IMODE((root / aux).stat().st_mode) == 0o700


def test_world_writable_cache_dir_refused(tmp_path, nvcc, clean_env):
    script, log = nvcc
    root = tmp_path / "open"
    root.mkdir()
    root.chmod(0o777)
    clean_env.setenv("LCK_JIT_CACHE_DIR", str(root))
    with pytest.raises(
        JitConfigError, match=r"LCK_JIT_CACHE_DIR: the JIT cache directory .* is writable by other users"
    ):
        Jit(nvcc=script).compile_only("scale", SOURCE, "scale_kernel", arch="sm_90a", defines={"SCALE": 2})
    assert compiles(log) == []


def test_nvcc_error_is_reported_and_nothing_published(tmp_path, nvcc, clean_env):
    script, _ = nvcc
    root = tmp_path / "cache"
    bad = 'extern "C" __global__ void broken(int* x) { x[0] = undefined_name_xyz; }'
    with pytest.raises(JitError, match=r"(?s)nvcc failed \(exit \d+\): .*undefined_name_xyz"):
        Jit(cache_dir=root, nvcc=script).compile_only("broken", bad, "broken", arch="sm_90a")
    assert entries(root) == [] and list((root / ".tmp").iterdir()) == []


def test_missing_kernel_symbol(tmp_path, nvcc, clean_env):
    script, _ = nvcc
    src = "__global__ void not_extern_c(int* x) { x[0] = 1; }"
    with pytest.raises(
        JitError, match=r"kernel 'not_extern_c' is not a __global__ function .*_Z12not_extern_cPi"
    ):
        Jit(cache_dir=tmp_path / "cache", nvcc=script).compile_only(
            "mangled", src, "not_extern_c", arch="sm_90a"
        )
    # The mangled name works.
    path = Jit(cache_dir=tmp_path / "cache", nvcc=script).compile_only(
        "mangled", src, "_Z12not_extern_cPi", arch="sm_90a"
    )
    assert path.is_file()


def test_hidden_nvcc_flag_variables_are_ignored(tmp_path, nvcc, clean_env):
    script, _ = nvcc
    clean_env.setenv("NVCC_APPEND_FLAGS", "-DLCK_HIDDEN_FLAG=1")
    src = SOURCE + "\n#ifdef LCK_HIDDEN_FLAG\n#error hidden flag leaked into the build\n#endif\n"
    Jit(cache_dir=tmp_path / "cache", nvcc=script).compile_only(
        "scale", src, "scale_kernel", arch="sm_90a", defines={"SCALE": 1}
    )


def test_lock_wait_is_bounded(tmp_path):
    root = tmp_path / "cache"
    for d in ("", ".locks", ".tmp", ".trash"):
        (root / d).mkdir(exist_ok=True)
    key = compute_key({"test": 1})

    def produce(tmp: Path) -> dict:
        (tmp / "payload.bin").write_bytes(b"data")
        return {"file": "payload.bin"}

    with file_lock(root / ".locks" / f"item-{key[:16]}.lock", timeout=1):
        with pytest.raises(JitError, match=r"waited 0.3 s for the JIT cache lock .*item-"):
            get_or_create(root, "item", key, produce, lock_timeout=0.3)
    assert not get_or_create(root, "item", key, produce, lock_timeout=5).from_cache


def test_publish_race_without_a_shared_lock(tmp_path):
    """A builder whose lock was not honoured (shared FS) finds the winner's entry at rename time."""
    key = compute_key({"race": 1})
    winner_root, loser_root = tmp_path / "winner", tmp_path / "loser"
    for root in (winner_root, loser_root):
        for d in ("", ".locks", ".tmp", ".trash"):
            (root / d).mkdir(exist_ok=True)

    def produce_winner(tmp: Path) -> dict:
        (tmp / "payload.bin").write_bytes(b"winner")
        return {"file": "payload.bin"}

    won = get_or_create(winner_root, "item", key, produce_winner, lock_timeout=5)

    def produce_loser(tmp: Path) -> dict:
        # While we compile, "another host" publishes the same entry.
        import shutil

        shutil.copytree(won.path, loser_root / won.path.name)
        (tmp / "payload.bin").write_bytes(b"loser")
        return {"file": "payload.bin"}

    got = get_or_create(loser_root, "item", key, produce_loser, lock_timeout=5)
    assert got.from_cache and got.payload == b"winner"
    assert list((loser_root / ".tmp").iterdir()) == []

    # If what the other host left is corrupt, ours replaces it.
    broken_root = tmp_path / "broken"
    for d in ("", ".locks", ".tmp", ".trash"):
        (broken_root / d).mkdir(exist_ok=True)

    def produce_after_corrupt_publish(tmp: Path) -> dict:
        import shutil

        dest = broken_root / won.path.name
        shutil.copytree(won.path, dest)
        (dest / "payload.bin").write_bytes(b"garbage")
        (tmp / "payload.bin").write_bytes(b"mine")
        return {"file": "payload.bin"}

    mine = get_or_create(broken_root, "item", key, produce_after_corrupt_publish, lock_timeout=5)
    assert not mine.from_cache and mine.payload == b"mine"
    assert read_entry(broken_root / won.path.name, key)[0].payload == b"mine"


def test_stale_build_folders_are_swept(tmp_path):
    root = tmp_path / "cache"
    for d in ("", ".locks", ".tmp", ".trash"):
        (root / d).mkdir(exist_ok=True)
    key = compute_key({"sweep": 1})
    name = f"item-{key[:16]}"
    old, fresh, other = (
        root / ".tmp" / f"{name}.dead",
        root / ".tmp" / f"{name}.live",
        root / ".tmp" / "other.dead",
    )
    for d in (old, fresh, other):
        d.mkdir()
        (d / "partial.cubin").write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    os.utime(other, (two_hours_ago, two_hours_ago))

    def produce(tmp: Path) -> dict:
        (tmp / "payload.bin").write_bytes(b"data")
        return {"file": "payload.bin"}

    get_or_create(root, "item", key, produce, lock_timeout=5)
    assert not old.exists(), "a dead builder's folder for this entry was left behind"
    assert fresh.exists() and other.exists(), "only this entry's stale folders may be swept"
