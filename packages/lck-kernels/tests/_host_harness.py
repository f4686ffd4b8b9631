"""The CPU harnesses of the C++ host path: an op family's ``csrc/host.h`` compiled into a test module (its
launches handed to the Triton interpreter or a stand-in), built once per machine into the LCK JIT cache."""

from __future__ import annotations

from types import ModuleType

import pytest

from lck_kernels._common import interpreting


def load_harness(name: str, template: str, label: str) -> ModuleType:
    """Build and import ``template`` (C++ with ``@HOST@`` / ``@PKG@`` standing for the ``_host`` and package
    folders); skip unless under ``TRITON_INTERPRET=1`` with a C++ compiler and CUDA's headers at hand."""
    if not interpreting():
        pytest.skip("compares with the Python Functions on CPU tensors under TRITON_INTERPRET=1")
    from lck_kernels._host import build

    source = template.replace("@HOST@", str(build.HERE)).replace("@PKG@", str(build.PKG))
    try:
        return build.load(name, source, label=label)
    except build.ToolchainMissing as exc:  # the real module cannot build here either
        pytest.skip(str(exc))
