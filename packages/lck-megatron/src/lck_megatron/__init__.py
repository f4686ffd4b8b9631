"""lck-megatron."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lck-megatron")
except PackageNotFoundError:  # running from a source tree on PYTHONPATH (GPU runners)
    __version__ = "0.1.0"

__all__ = ["__version__"]
