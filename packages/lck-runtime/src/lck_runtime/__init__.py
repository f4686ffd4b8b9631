"""lck-runtime: NVSHMEM ownership, teams, symmetric memory, ``configure()``, the CUDA JIT, the CLI core.

Importing the package needs only the standard library: torch and nvshmem4py load inside the calls
that use them, so ``from lck_runtime import MoEConfig`` works where torch is not installed.
"""

from __future__ import annotations

from lck_runtime.config import FusedLinearCrossEntropyConfig, MoEConfig

# Bound after the submodule imports: `lck_runtime.configure` is the function, not the module.
from lck_runtime.configure import configure, is_native
from lck_runtime.contexts import FlsceContext, MoEContext, flsce_context, moe_context
from lck_runtime.lifecycle import clear_pool, destroy_team, finalize
from lck_runtime.packaging import distribution_version

__version__ = distribution_version("lck-runtime", source_tree="0.1.0")

__all__ = [
    "FlsceContext",
    "FusedLinearCrossEntropyConfig",
    "MoEConfig",
    "MoEContext",
    "__version__",
    "clear_pool",
    "configure",
    "destroy_team",
    "finalize",
    "flsce_context",
    "is_native",
    "moe_context",
]
