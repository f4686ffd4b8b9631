"""Locating the CUDA toolchain."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def find_nvcc() -> str | None:
    """``$LCK_NVCC``, then ``nvcc`` on PATH, then ``$CUDA_HOME/bin/nvcc``, then /usr/local/cuda."""
    explicit = os.environ.get("LCK_NVCC")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None
