"""Where lck keeps files on disk."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_root() -> Path:
    """``$XDG_CACHE_HOME/lck`` (default ``~/.cache/lck``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lck"


def jit_cache_dir(prefix: str = "LCK") -> Path:
    """The JIT cache directory for a caller's environment prefix.

    ``<PREFIX>_JIT_CACHE_DIR`` wins (lck-ep uses ``EP_JIT_CACHE_DIR``); otherwise a per-prefix folder
    under the user cache root. The directory is not created here: the JIT creates it private (0700).
    """
    explicit = os.environ.get(f"{prefix}_JIT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return user_cache_root() / "jit" / prefix.lower()
