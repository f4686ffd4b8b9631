"""Errors raised by the JIT engine."""

from __future__ import annotations


class JitError(RuntimeError):
    """A JIT build, cache or launch failed (nvcc error, unusable cache, bad launch)."""


class JitConfigError(JitError, ValueError):
    """A ``<PREFIX>_JIT_*`` setting or a ``Jit``/``build`` argument is invalid; raised before nvcc runs."""


class CudaError(JitError):
    """A CUDA driver call made by the host module failed.

    ``call`` is the driver function (``"cuLaunchKernelEx"``), ``code_name`` the error enum name
    (``"CUDA_ERROR_INVALID_VALUE"``); the message also carries the driver's error string.
    """

    def __init__(self, message: str, call: str = "", code_name: str = ""):
        super().__init__(message)
        self.call = call
        self.code_name = code_name
