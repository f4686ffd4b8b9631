"""Configuration records: stdlib-only import, field validation, capacity."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from lck_runtime.config import FusedLinearCrossEntropyConfig, MoEConfig


def test_import_and_construct_without_torch() -> None:
    # torch (and nvshmem) made unimportable: the records and the package namespace must still work.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        sys.modules["nvshmem"] = None
        import lck_runtime.config as c
        f = c.FusedLinearCrossEntropyConfig(4096, 2048, 32000, group="tp")
        m = c.MoEConfig(8192, 4096, 128, 8, num_hosts=2, max_inflight=8, group="ep")
        from lck_runtime import FusedLinearCrossEntropyConfig, MoEConfig, configure
        assert FusedLinearCrossEntropyConfig is c.FusedLinearCrossEntropyConfig and MoEConfig is c.MoEConfig
        assert callable(configure)
        loaded = sorted(k for k, v in sys.modules.items() if v is not None and k.split(".")[0] in ("torch", "nvshmem"))
        print(f.capacity, m.max_inflight, loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(4096 * 2048), "8", "[]"]


def test_flsce_fields_and_capacity() -> None:
    c = FusedLinearCrossEntropyConfig(max_tokens=16, hidden_size=4, local_vocab_size=100)
    assert c.group is None
    assert c.capacity == 16 * 8  # at least 8 fp32 per token
    assert FusedLinearCrossEntropyConfig(16, 32, 100, group="tp").capacity == 16 * 32
    assert c.fields() == {"max_tokens": 16, "hidden_size": 4, "local_vocab_size": 100, "group": None}
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_tokens = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": "8"}, TypeError, "max_tokens must be an int, got str"),
        ({"max_tokens": True}, TypeError, "max_tokens must be an int, got bool"),
        ({"hidden_size": -1}, ValueError, "hidden_size must be >= 1"),
        ({"local_vocab_size": 2.0}, TypeError, "local_vocab_size must be an int, got float"),
        ({"group": 3}, TypeError, "group must be None"),
        ({"group": ""}, ValueError, "group must be a non-empty name"),
    ],
)
def test_flsce_rejects(kwargs: dict, exc: type, needle: str) -> None:
    base = {"max_tokens": 8, "hidden_size": 8, "local_vocab_size": 8}
    with pytest.raises(exc, match="FusedLinearCrossEntropyConfig") as info:
        FusedLinearCrossEntropyConfig(**{**base, **kwargs})
    assert needle in str(info.value)


def test_moe_defaults() -> None:
    m = MoEConfig(max_tokens=8, hidden_size=16, num_experts=4, top_k=2)
    assert (m.num_hosts, m.gpus_per_host, m.max_inflight, m.group) == (1, None, 1, None)
    assert m.fields()["top_k"] == 2


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"top_k": 5}, ValueError, "top_k must be <= num_experts (4), got 5"),
        ({"top_k": 0}, ValueError, "top_k must be >= 1"),
        ({"num_experts": 0}, ValueError, "num_experts must be >= 1"),
        ({"num_hosts": 0}, ValueError, "num_hosts must be >= 1"),
        ({"gpus_per_host": 0}, ValueError, "gpus_per_host must be >= 1"),
        ({"gpus_per_host": "2"}, TypeError, "gpus_per_host must be an int"),
        ({"max_inflight": 0}, ValueError, "max_inflight must be >= 1"),
        ({"max_tokens": None}, TypeError, "max_tokens must be an int, got NoneType"),
        ({"group": object()}, TypeError, "group must be None"),
    ],
)
def test_moe_rejects(kwargs: dict, exc: type, needle: str) -> None:
    base = {"max_tokens": 8, "hidden_size": 16, "num_experts": 4, "top_k": 2}
    with pytest.raises(exc, match="MoEConfig") as info:
        MoEConfig(**{**base, **kwargs})
    assert needle in str(info.value)
