"""The JIT host module (pybind11 + CUDA driver API): built once, then served from the cache.

Building it costs ~10-20 s of host compilation, so this file builds it exactly once (in a child
process) and proves that a second process imports it from the cache without running nvcc.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
from test_jit_cache import compiles, make_nvcc_wrapper

from lck_runtime.jit import CudaError, Jit

pytestmark = pytest.mark.nvcc

_CHILD = r"""
import json, sys
from lck_runtime.jit import Jit
host = Jit(cache_dir=sys.argv[1], nvcc=sys.argv[2]).host()
print(json.dumps({
    "from_cache": host.from_cache, "path": str(host.path), "key": host.key, "command": host.command,
    "abi": host.module.ABI, "functions": sorted(n for n in dir(host.module) if not n.startswith("_")),
    "torch_imported": "torch" in sys.modules,
}))
"""


def _child(root, nvcc) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(nvcc)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_host_module_builds_once_and_is_cached(tmp_path_factory):
    work = tmp_path_factory.mktemp("host")
    nvcc, log = make_nvcc_wrapper(work)
    root = work / "cache"
    first = _child(root, nvcc)
    assert first["from_cache"] is False
    (build,) = compiles(log)
    assert "-shared" in build.split() and "--cudart" in build.split() and first["command"][0] == str(nvcc)
    assert first["abi"] == 1
    assert {
        "launch",
        "load_module",
        "get_function",
        "param_sizes",
        "set_attribute",
        "CudaDriverError",
    } <= set(first["functions"])
    assert first["torch_imported"] is False, "building or importing the host module must not import torch"

    second = _child(root, nvcc)
    assert second["from_cache"] is True and second["path"] == first["path"] and second["key"] == first["key"]
    assert len(compiles(log)) == 1, "the host module was rebuilt although it was cached"

    # In this process: imported once; the driver is opened lazily at the first driver call.
    host = Jit(cache_dir=root, nvcc=nvcc).host()
    assert host.from_cache and len(compiles(log)) == 1
    from lck_runtime.jit.host import call

    if _driver_present():
        assert call(host, "driver_version") >= 12000
    else:
        with pytest.raises(CudaError, match=r"cannot load the CUDA driver \(libcuda\.so\.1\)"):
            call(host, "driver_version")
