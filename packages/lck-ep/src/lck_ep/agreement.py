"""Cross-rank agreement before a collective: every rank raises the same error, or none does.

Each rank validates its own arguments, then contributes one int64 vector to an all-gather over the
group: ``[status, digest fields..., extra...]``. ``status`` is 0 when the local checks passed; the
digest holds the call's host-known parameters (operation, hidden size, dtype, top-k, handle sequence
number, ...); ``extra`` carries device-computed values the caller needs from every rank anyway (the
dispatch counts, a flag for out-of-range expert indices), so the agreement costs no extra collective
on the dispatch path. After the gather every rank holds the same matrix and derives the same verdict:

- some rank failed locally: the failing ranks' messages are shared (``all_gather_object``, only on this
  error path) and every rank raises the same text with the lowest failing rank's kind of exception
  (``TypeError``, ``ValueError``, else ``RuntimeError`` naming the original type);
- the digests differ: every rank raises ``ValueError`` naming the first differing field and each
  rank's value.

The vector has the same length for every operation of a Buffer, so a rank calling ``combine`` while
another calls ``dispatch`` is reported as a disagreement on ``op``, not a mismatched collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["BUFFER_FIELDS", "DEVICE_AGREEMENT", "DIGEST_FIELDS", "OPS", "agree", "dtype_code"]

# The parameters of a dispatch or combine call that every rank must pass identically.
DIGEST_FIELDS = (
    "op",
    "hidden",
    "dtype",
    "num_topk",
    "cached",
    "handle_seq",
    "expand",
    "expert_alignment",
    "num_worst_tokens",
    "has_topk_weights",
    "num_bias",
)
# The construction parameters of a Buffer.
BUFFER_FIELDS = (
    "op",
    "max_tokens_per_rank",
    "hidden",
    "num_topk",
    "num_experts",
    "sync_free",
    "device_type",
    "native",
)
OPS = {1: "dispatch", 2: "combine", 3: "__init__"}
# BUFFER_FIELDS' "native": 0 reference, 1 native, this for a native state whose synced calls agree through the
# workspaces (EP_DEVICE_AGREEMENT=1), else the hybrid pair's settings (2 + a 48-bit hash: below this).
DEVICE_AGREEMENT = 1 << 62
_DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}
_DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in _DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.get(dtype, 0)


def _show(field: str, value: int) -> str:
    if field == "op":
        return OPS.get(value, str(value))
    if field == "dtype":
        return _DTYPE_NAMES.get(value, "other")
    if field == "device_type":
        return {0: "cpu", 1: "cuda"}.get(value, "other")
    if field == "native":
        names = {0: "reference", 1: "nvshmem", DEVICE_AGREEMENT: "nvshmem, EP_DEVICE_AGREEMENT=1"}
        return names.get(value, f"nvshmem, hybrid settings {value}")
    if field in ("cached", "expand", "has_topk_weights", "sync_free"):
        return str(bool(value))
    return str(value)


def agree(
    group: dist.ProcessGroup,
    device: torch.device,
    local_error: BaseException | None,
    fields: Sequence[str],
    digest: Sequence[int] | None,
    extra: torch.Tensor | None,
    extra_len: int,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """All-gather ``[status, digest, extra]`` and raise the same error everywhere on any problem.

    ``digest`` has one int per entry of ``fields`` (ignored when ``local_error`` is set; ``fields``
    must be the same sequence on every rank);
    ``extra`` is an int64 device tensor of ``extra_len`` elements or None (zeros are sent). Returns the
    gathered ``extra`` part, ``[world, extra_len]`` int64 on the CPU. Collective over ``group``; it
    synchronises the host with the device once (the ``.cpu()`` of the gathered matrix). ``gather``, when
    given, all-gathers the vector (built on ``device``) in place of the group's all-gather and returns the
    ``[world, n]`` matrix on the CPU (a native state's :meth:`lck_ep.native.NativeEp.all_gather`); the
    group then carries only the messages of a failure.
    """
    n = len(fields)
    head = [1 if local_error is not None else 0]
    head += [0] * n if local_error is not None or digest is None else [int(v) for v in digest]
    vec = torch.tensor(head, dtype=torch.int64, device=device)
    if extra_len:
        tail = (
            extra.to(device=device, dtype=torch.int64).reshape(-1)
            if extra is not None and local_error is None
            else torch.zeros(extra_len, dtype=torch.int64, device=device)
        )
        vec = torch.cat([vec, tail])
    world = dist.get_world_size(group)
    if gather is not None:
        table = gather(vec)
    else:
        gathered = vec.new_empty(world, vec.numel())
        dist.all_gather(list(gathered.unbind(0)), vec, group=group)
        table = gathered.cpu()
    # The verdicts read the status and digest columns as Python ints, converted at once: a torch op per
    # field and rank had cost the host several times the all-gather itself.
    heads = table[:, : 1 + n].tolist()
    failed = [r for r in range(world) if heads[r][0] != 0]
    if failed:
        local = None
        if local_error is not None:
            kind = "TypeError" if isinstance(local_error, TypeError) else "ValueError"
            if not isinstance(local_error, (TypeError, ValueError)):
                kind = "RuntimeError"
            local = (
                kind,
                f"{local_error}"
                if kind != "RuntimeError"
                else f"{type(local_error).__name__}: {local_error}",
            )
        messages: list[tuple[str, str] | None] = [None] * world
        dist.all_gather_object(messages, local, group=group)
        first = failed[0]
        kind, text = messages[first] or ("ValueError", "invalid arguments")
        also = f" (ranks {failed} failed their checks)" if len(failed) > 1 else ""
        exc_type = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
        # The local message already names the operation; prefix the rank so every rank reads the same.
        raise exc_type(f"rank {first}: {text}{also}")
    for i, field in enumerate(fields, start=1):
        if any(row[i] != heads[0][i] for row in heads):
            values = ", ".join(f"rank {r}: {_show(field, heads[r][i])}" for r in range(world))
            # Worded from the gathered table only, so that it reads the same on every rank.
            op = OPS.get(heads[0][1], "call")
            raise ValueError(
                f"Buffer.{op}: ranks disagree on {field} ({values}); every rank of the group must make "
                "the same call with the same parameters"
            )
    return table[:, 1 + n :]
