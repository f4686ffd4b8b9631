"""An experiment, not used by :class:`MoEExperts`: the first expert GEMM as one Triton kernel that gathers
its rows from the tokens (no expert-major copy of ``x``), multiplies them by the expert's gate and up
columns, and writes both ``h`` (for the backward) and the weighted SwiGLU ``act``.

It replaces three passes of the layer's forward (row gather, ``torch._grouped_mm``, activation) and saves
about 0.7 GB of memory traffic at the Qwen3-30B-A3B shape, but it is a hand-written GEMM: ``lck bench moe``
times it against those three passes (rows ``gemm1_*``) so that the numbers decide whether the layer
should use it. Local layout without padding only (``expert_alignment=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fmt: off


@triton.jit
def _gather_gemm_swiglu_kernel(
    x_ptr, entry_ptr, w1_ptr, w_ptr, ends_ptr, cum_ptr, h_ptr, act_ptr, num_experts, hidden, ffn, num_topk,
    LOG2_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (t, n): tile t of the list of every expert's row tiles (``cum [E + 1]``: tiles before each
    expert), columns ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` of the gate and of the up half."""
    t = tl.program_id(0)
    if t >= tl.load(cum_ptr + num_experts):
        return
    lo = t * 0  # int32 scalars, the same type on every iteration
    hi = t * 0 + num_experts - 1
    for _ in range(LOG2_E):  # the expert j in [lo, hi] whose tiles hold t: cum[j] <= t < cum[j + 1]
        mid = (lo + hi) // 2
        go_right = tl.load(cum_ptr + mid + 1) <= t
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    j = lo
    start = tl.load(ends_ptr + j - 1, mask=j > 0, other=0)
    end = tl.load(ends_ptr + j)
    rows = start + (t - tl.load(cum_ptr + j)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tok = tl.load(entry_ptr + rows, mask=row_ok, other=0) // num_topk
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < ffn
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * hidden + ks[None, :]
    b_ptrs = w1_ptr + j.to(tl.int64) * hidden * 2 * ffn + ks[:, None] * (2 * ffn) + cols[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        k_ok = (k + ks) < hidden
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        bu = tl.load(b_ptrs + ffn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * 2 * ffn
    out_ok = row_ok[:, None] & col_ok[None, :]
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * (2 * ffn) + cols[None, :]
    g = acc_g.to(h_ptr.dtype.element_ty)
    u = acc_u.to(h_ptr.dtype.element_ty)
    tl.store(h_rows, g, mask=out_ok)
    tl.store(h_rows + ffn, u, mask=out_ok)
    gf = g.to(tl.float32)  # the activation of the stored (rounded) h, as the separate kernel computes it
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
    act = w[:, None] * (gf * tl.sigmoid(gf)) * u.to(tl.float32)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * ffn + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=out_ok)


# fmt: on


def gather_gemm_swiglu(
    x: torch.Tensor,
    entry: torch.Tensor,
    num_topk: int,
    w1: torch.Tensor,
    w_e: torch.Tensor,
    ends: torch.Tensor,
    *,
    block_m: int = 128,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h [M, 2F], act [M, F])`` for the local layout (``entry`` ``[M]``, ``ends`` ``[E]`` int32, no
    padding), as ``grouped.mm(gather_rows(x, entry), w1, ends)`` and ``swiglu_weighted_fwd`` give them;
    rows past ``ends[-1]`` undefined. No host synchronisation."""
    m, e = entry.numel(), w1.shape[0]
    hidden, ffn = w1.shape[1], w1.shape[2] // 2
    h = torch.empty(m, 2 * ffn, dtype=x.dtype, device=x.device)
    act = torch.empty(m, ffn, dtype=x.dtype, device=x.device)
    if m == 0:
        return h, act
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    cum = torch.zeros(e + 1, dtype=torch.int32, device=x.device)
    cum[1:] = torch.cumsum(torch.div(counts + block_m - 1, block_m, rounding_mode="floor"), 0)
    grid = (triton.cdiv(m, block_m) + e, triton.cdiv(ffn, block_n))
    _gather_gemm_swiglu_kernel[grid](
        x, entry, w1, w_e, ends, cum, h, act, e, hidden, ffn, num_topk,
        LOG2_E=max(1, (e - 1).bit_length()), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return h, act
