"""What the GPU tests of the native kernels (single-host and hybrid) need: the environment of their PEs,
and a skip where this machine cannot run them."""

from __future__ import annotations

import pytest
import torch

from lck_runtime.testing import SHARED_GPU_SKIP, SINGLE_HOST_NVSHMEM_ENV, mps_daemon_running, shared_gpu_env


def gpu_env(world: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """NVSHMEM on one host, modules loaded eagerly, ``extra`` on top; PEs share GPUs under MPS where
    fewer than ``world`` are visible."""
    env = {**SINGLE_HOST_NVSHMEM_ENV, "CUDA_MODULE_LOADING": "EAGER", **(extra or {})}
    if torch.cuda.device_count() < world:  # several PEs per GPU: under MPS, each with its share
        env.update(shared_gpu_env(world, torch.cuda.device_count()))
    return env


def need_gpus(world: int) -> None:
    """Skip unless a GPU, nvcc and either ``world`` GPUs or a running MPS daemon are here."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from lck_runtime.toolchain import find_nvcc

    if find_nvcc() is None:
        pytest.skip("needs nvcc for the native kernels")
    if torch.cuda.device_count() < world and not mps_daemon_running():
        pytest.skip(SHARED_GPU_SKIP)
