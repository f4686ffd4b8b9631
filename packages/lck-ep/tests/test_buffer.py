"""Buffer in one process (a 1-rank gloo group): argument validation, output contracts, MoE context.

Multi-rank behaviour (routing, ordering, combine bits, agreement across ranks) is in test_reference.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _raising import raises_with

from lck_ep import Buffer, DispatchHandle
from lck_ep.handle import DispatchHandle as HandleType

H, K, E, TMAX = 40, 2, 4, 8


@pytest.fixture
def buf(group) -> Buffer:
    return Buffer(group, TMAX, H, K, E)


def _inputs(t: int = 6, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    idx = torch.rand(t, E, generator=g).argsort(1)[:, :K].contiguous()
    idx[1] = -1  # token 1 goes nowhere
    w = torch.rand(t, K, generator=g)
    return x, idx, w


# ------------------------------------------------------------------------------------------ construct


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragments"),
    [
        (dict(max_tokens_per_rank=0), ValueError, ["max_tokens_per_rank must be >= 1, got 0"]),
        (dict(hidden=2.5), TypeError, ["hidden must be an int, got float"]),
        (dict(num_topk=True), TypeError, ["num_topk must be an int, got bool"]),
        (dict(num_topk=5), ValueError, ["num_topk must be at most min(num_experts, 64) = 4, got 5"]),
        (dict(num_experts=-1), ValueError, ["num_experts must be >= 1"]),
        (dict(sync_free="yes"), TypeError, ["sync_free must be a bool"]),
        (dict(layout="fast"), ValueError, ["layout must be 'auto', 'kernel' or 'torch'"]),
        (dict(layout="kernel"), ValueError, ["layout='kernel' needs a cuda device"]),
        (dict(device="meta"), ValueError, ["device must be cpu or cuda"]),
        (dict(device="cuda"), ValueError, ["a gloo group moves CPU tensors, got device=cuda"]),
        (dict(device="gpu7"), ValueError, ["device='gpu7' is not a device"]),
    ],
)
def test_construction_validation(group, kwargs, exc, fragments) -> None:
    args = dict(max_tokens_per_rank=TMAX, hidden=H, num_topk=K, num_experts=E) | kwargs
    msg = raises_with(exc, fragments, lambda: Buffer(group, **args))
    assert msg.startswith("rank 0: Buffer:"), msg  # agreed across the group before raising


def test_group_must_be_a_process_group(group) -> None:
    raises_with(
        TypeError,
        ["group must be a torch.distributed ProcessGroup, got str"],
        lambda: Buffer("ep", TMAX, H, K, E),
    )


def test_repr_and_properties(buf: Buffer) -> None:
    assert buf.worst_case_tokens == TMAX
    assert (buf.rank, buf.num_ranks, buf.num_local_experts) == (0, 1, E)
    assert buf.device == torch.device("cpu") and not buf.use_kernel_layout
    assert (buf.num_hosts, buf.gpus_per_host) == (1, 1)
    assert "layout=torch" in repr(buf)


# ------------------------------------------------------------------------------------------ dispatch


def test_one_rank_dispatch_keeps_every_routed_token(buf: Buffer) -> None:
    x, idx, w = _inputs()
    out = buf.dispatch(x, idx, w)
    recv_x, recv_idx, recv_w, handle, event = out  # unpacks as a 5-tuple
    keep = [t for t in range(6) if t != 1]
    assert torch.equal(recv_x, x[keep])
    assert torch.equal(recv_idx, idx[keep])  # one rank: local indices are global ones
    assert torch.equal(recv_w, w[keep])
    assert isinstance(handle, HandleType) and handle is out.handle
    assert handle.recv_src_idx.tolist() == keep and handle.recv_src_rank.tolist() == [0] * 5
    assert out.num_recv_tokens_per_expert_list == torch.bincount(idx[keep].reshape(-1), minlength=E).tolist()
    assert out.num_recv_tokens_per_expert.dtype == torch.int32
    assert event.query() and event.cuda_event is None
    assert "seq=1" in repr(handle) and "synced" in repr(handle)
    # Without weights the weights output is None.
    assert buf.dispatch(x, idx).recv_topk_weights is None


def test_combine_sums_and_adds_bias_in_fp32(buf: Buffer) -> None:
    x, idx, w = _inputs(dtype=torch.float16)
    d = buf.dispatch(x, idx, w)
    b0, b1 = torch.randn(6, H).half(), torch.randn(6, H).half()
    out, event = buf.combine(d.recv_x, d.handle, bias=(b0, b1))
    want = torch.zeros(6, H)
    keep = [t for t in range(6) if t != 1]
    want[keep] = x[keep].float()
    want = ((want + b0.float()) + b1.float()).half()
    assert torch.equal(out, want)
    assert event.query()
    one, _ = buf.combine(d.recv_x, d.handle, bias=b0)
    assert torch.equal(one[1], b0[1])  # a token sent nowhere combines to its bias


def test_combine_input_off_the_native_backend_is_a_plain_tensor(group, buf: Buffer) -> None:
    x, idx, w = _inputs()
    for d in (buf.dispatch(x, idx, w), buf.dispatch(x, idx, w, expand=True, expert_alignment=4)):
        rows = d.recv_x.shape[0]
        for dtype in (torch.bfloat16, torch.float32):
            y = buf.combine_input(d.handle, dtype=dtype)
            assert y.shape == (rows, H) and y.dtype == dtype and y.device == buf.device
            y.copy_(d.recv_x)
            want, _ = buf.combine(d.recv_x.to(dtype), d.handle)
            got, _ = buf.combine(y, d.handle)
            assert torch.equal(got, want)
    raises_with(TypeError, ["combine_input: dtype must be one of bfloat16, float16, float32"],
                lambda: buf.combine_input(d.handle, dtype=torch.int32))  # fmt: skip
    raises_with(
        TypeError, ["combine_input: handle must be a DispatchHandle"], lambda: buf.combine_input(None)
    )
    other = Buffer(group, TMAX, H, K, E)
    raises_with(ValueError, ["combine_input: handle comes from another Buffer"],
                lambda: other.combine_input(d.handle))  # fmt: skip


def test_sync_free_buffer_sizes_by_capacity(group) -> None:
    buf = Buffer(group, TMAX, H, K, E, sync_free=True)
    x, idx, w = _inputs()
    d = buf.dispatch(x, idx, w)
    assert d.recv_x.shape == (TMAX, H) and d.handle.sync_free and d.handle.num_worst_tokens == TMAX
    assert int(d.handle.num_recv_tokens) == 5 and d.num_recv_tokens_per_expert_list is None
    assert torch.equal(d.recv_topk_idx[5:], torch.full((3, K), -1))
    comb, _ = buf.combine(d.recv_x, d.handle)
    synced = Buffer(group, TMAX, H, K, E)
    s = synced.dispatch(x, idx, w)
    assert torch.equal(comb, synced.combine(s.recv_x, s.handle)[0])


@pytest.mark.parametrize(
    ("call", "exc", "fragments"),
    [
        (
            lambda b, x, i, w: b.dispatch(x.tolist(), i, w),
            TypeError,
            ["dispatch: x must be a torch.Tensor, got list"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x.int(), i, w),
            TypeError,
            ["x must be bfloat16 or float16 or float32, got int32"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x[0], i, w),
            ValueError,
            ["x must be 2-D [num_tokens, hidden], got shape [40]"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x[:, :-1], i, w),
            ValueError,
            ["x has hidden size 39 but the Buffer was built for hidden=40"],
        ),
        (
            lambda b, x, i, w: b.dispatch(torch.cat([x, x]), torch.cat([i, i]), torch.cat([w, w])),
            ValueError,
            ["x has 12 tokens, more than the Buffer's max_tokens_per_rank=8"],
        ),
        (
            lambda b, x, i, w: b.dispatch(torch.cat([x, x], 1)[:, ::2], i, w),
            ValueError,
            ["x must be contiguous"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, None, w),
            ValueError,
            ["topk_idx is required unless a cached handle is given"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i[:, :1].contiguous(), w),
            ValueError,
            ["topk_idx must have shape [6, 2], got [6, 1]"],
        ),
        (lambda b, x, i, w: b.dispatch(x, i.float(), w), TypeError, ["topk_idx must be int64, got float32"]),
        (
            lambda b, x, i, w: b.dispatch(x, i, w.double()),
            TypeError,
            ["topk_weights must be float32, got float64"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i, w[:5]),
            ValueError,
            ["topk_weights must have shape [6, 2], got [5, 2]"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i.to("meta"), w),
            ValueError,
            ["topk_idx must be on cpu (the Buffer's device), got meta"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i, w, expert_alignment=4),
            ValueError,
            ["expert_alignment=4 only shapes the expanded layout"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i, w, expand=True, expert_alignment=0),
            ValueError,
            ["expert_alignment must be in [1, 4096], got 0"],
        ),
        (lambda b, x, i, w: b.dispatch(x, i, w, expand=1), TypeError, ["expand must be a bool, got int"]),
        (
            lambda b, x, i, w: b.dispatch(x, i, w, num_worst_tokens=9),
            ValueError,
            ["num_worst_tokens must be in [1, 8], got 9"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i, w, num_worst_tokens=-1),
            ValueError,
            ["num_worst_tokens must be in [1, 8], got -1"],
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i, w, handle=object()),
            TypeError,
            ["handle must be a DispatchHandle"],
        ),
    ],
)
def test_dispatch_validation(buf: Buffer, call, exc, fragments) -> None:
    x, idx, w = _inputs()
    raises_with(exc, fragments, lambda: call(buf, x, idx, w))
    # Nothing was dispatched: the next handle is still the first.
    assert buf.dispatch(x, idx, w).handle.seq == 1


def test_out_of_range_expert_is_refused_in_synced_mode(buf: Buffer) -> None:
    x, idx, w = _inputs()
    idx[2, 0] = E
    raises_with(
        ValueError,
        ["dispatch: topk_idx on rank 0 has entries outside [-1, 4)"],
        lambda: buf.dispatch(x, idx, w),
    )
    idx[2, 0] = -2
    raises_with(ValueError, ["outside [-1, 4)"], lambda: buf.dispatch(x, idx, w))


def test_handle_replay_rules(group, buf: Buffer) -> None:
    x, idx, w = _inputs()
    d = buf.dispatch(x, idx, w, expand=True, expert_alignment=4)
    raises_with(ValueError, ["pass either handle", "not both"], lambda: buf.dispatch(x, idx, handle=d.handle))
    raises_with(
        ValueError,
        ["expand=False contradicts the handle"],
        lambda: buf.dispatch(x, handle=d.handle, expand=False),
    )
    raises_with(
        ValueError,
        ["expert_alignment=8 contradicts the handle"],
        lambda: buf.dispatch(x, handle=d.handle, expert_alignment=8),
    )
    raises_with(
        ValueError, ["x must have shape [6, 40], got [5, 40]"], lambda: buf.dispatch(x[:5], handle=d.handle)
    )
    replay = buf.dispatch(x.float(), handle=d.handle)  # another dtype replays the same layout
    assert torch.equal(replay.recv_x, d.recv_x.float())
    other = Buffer(group, TMAX, H, K, E)
    raises_with(ValueError, ["handle comes from another Buffer"], lambda: other.dispatch(x, handle=d.handle))


def test_expanded_dispatch_on_one_rank(buf: Buffer) -> None:
    x, idx, w = _inputs(t=8, seed=3)
    d = buf.dispatch(x, idx, w, expand=True, expert_alignment=4)
    h = d.handle
    offsets = h.expert_offsets.tolist()
    counts = d.num_recv_tokens_per_expert_list
    assert all(o % 4 == 0 for o in offsets) and len(offsets) == E + 1
    assert [offsets[j + 1] - offsets[j] for j in range(E)] == [-(-c // 4) * 4 for c in counts]
    assert d.recv_x.shape == (offsets[-1], H) and h.num_expanded_rows == offsets[-1]
    for m, (n, k) in enumerate(zip(h.expanded_src_row.tolist(), h.expanded_slot.tolist())):
        if n < 0:
            assert not d.recv_x[m].any()
        else:
            j = next(j for j in range(E) if offsets[j] <= m < offsets[j + 1])
            assert int(d.recv_topk_idx[n, k]) == j and torch.equal(d.recv_x[m], x[h.recv_src_idx[n]])
            assert int(h.recv_expanded_index[n, k]) == m


@pytest.mark.parametrize(
    ("call", "exc", "fragments"),
    [
        (
            lambda b, d, de: b.combine(d.recv_x[:-1], d.handle),
            ValueError,
            ["combine: x must have one row per received rows: expected 5 rows, got 4"],
        ),
        (
            lambda b, d, de: b.combine(de.recv_x[:-1], de.handle),
            ValueError,
            ["one row per expanded rows (the handle is expanded)"],
        ),
        (
            lambda b, d, de: b.combine(d.recv_x.int(), d.handle),
            TypeError,
            ["x must be bfloat16 or float16 or float32"],
        ),
        (
            lambda b, d, de: b.combine(d.recv_x, "h"),
            TypeError,
            ["handle must be a DispatchHandle from Buffer.dispatch, got str"],
        ),
        (
            lambda b, d, de: b.combine(d.recv_x, d.handle, topk_weights=d.recv_topk_weights),
            ValueError,
            ["topk_weights weighs expanded rows", "not expanded"],
        ),
        (
            lambda b, d, de: b.combine(
                de.recv_x, de.handle, topk_weights=de.recv_topk_weights[:, :1].contiguous()
            ),
            ValueError,
            ["topk_weights must have shape [5, 2], got [5, 1]"],
        ),
        (
            lambda b, d, de: b.combine(d.recv_x, d.handle, bias=torch.zeros(6, H)),
            TypeError,
            ["bias must be bfloat16, got float32"],
        ),
        (
            lambda b, d, de: b.combine(d.recv_x, d.handle, bias=torch.zeros(5, H, dtype=torch.bfloat16)),
            ValueError,
            ["bias must have shape [6, 40], got [5, 40]"],
        ),
        (
            lambda b, d, de: b.combine(
                d.recv_x, d.handle, bias=(torch.zeros(6, H, dtype=torch.bfloat16),) * 3
            ),
            TypeError,
            ["bias must be None, a tensor or a tuple of two tensors"],
        ),
        (
            lambda b, d, de: b.combine(
                d.recv_x,
                d.handle,
                bias=(torch.zeros(6, H, dtype=torch.bfloat16), torch.zeros(6, 1, dtype=torch.bfloat16)),
            ),
            ValueError,
            ["bias[1] must have shape [6, 40]"],
        ),
    ],
)
def test_combine_validation(buf: Buffer, call, exc, fragments) -> None:
    x, idx, w = _inputs()
    d = buf.dispatch(x, idx, w)
    de = buf.dispatch(x, idx, w, expand=True)
    raises_with(exc, fragments, lambda: call(buf, d, de))


def test_get_dispatch_layout(buf: Buffer) -> None:
    _, idx, _ = _inputs()
    layout = buf.get_dispatch_layout(idx)
    assert layout.num_tokens_per_rank.tolist() == [5]
    raises_with(
        ValueError,
        ["more than max_tokens_per_rank=8"],
        lambda: buf.get_dispatch_layout(torch.zeros(9, K, dtype=torch.int64)),
    )
    raises_with(
        ValueError,
        ["get_dispatch_layout: topk_idx must have shape [6, 2], got [6, 1]"],
        lambda: buf.get_dispatch_layout(idx[:, :1].contiguous()),
    )


def test_public_names() -> None:
    import lck_ep

    assert lck_ep.DispatchHandle is DispatchHandle
    for name in lck_ep.__all__:
        assert getattr(lck_ep, name) is not None
    with pytest.raises(AttributeError):
        lck_ep.no_such_name  # noqa: B018


def test_moe_context_capacities_are_enforced(group) -> None:
    configure_mod = pytest.importorskip("lck_runtime.configure")
    from lck_runtime.config import MoEConfig
    from lck_runtime.lifecycle import finalize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "NVSHMEM unavailable, using torch.distributed" on CPU
        configure_mod.configure(moe=MoEConfig(max_tokens=TMAX, hidden_size=H, num_experts=E, top_k=K))
    try:
        ok = Buffer(group, TMAX, H, K, E)
        assert ok.moe_context is not None and (ok.num_hosts, ok.gpus_per_host) == (1, 1)
        raises_with(
            ValueError,
            ["max_tokens_per_rank=16 exceeds the configured MoEConfig capacity 8"],
            lambda: Buffer(group, 2 * TMAX, H, K, E),
        )
        raises_with(ValueError, ["hidden=41 exceeds"], lambda: Buffer(group, TMAX, H + 1, K, E))
        raises_with(
            ValueError,
            ["num_experts=8 differs from the configured MoEConfig.num_experts=4"],
            lambda: Buffer(group, TMAX, H, K, 2 * E),
        )
        smaller = Buffer(group, TMAX // 2, H // 2, 1, E)
        assert smaller.moe_context is not None
    finally:
        finalize()
    assert Buffer(group, 2 * TMAX, H, K, E).moe_context is None
