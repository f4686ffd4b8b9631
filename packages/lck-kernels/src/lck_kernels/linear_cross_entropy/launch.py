"""The chunked engine behind ``fused_linear_cross_entropy`` and ``fused_linear_scaled_cross_entropy``.

Logits ``x·Wᵀ (+ b)`` exist one chunk of tokens at a time, in one reused ``[chunk, vocab]`` buffer in ``x``'s
dtype (cuBLAS: bf16/fp16 in, fp32 accumulation, rounded once on output). The cross-entropy row kernels of
``lck_kernels.cross_entropy`` read that buffer and overwrite it with ``∂L/∂logits``, which then feeds the two
gradient GEMMs. Two schedules:

- **gradients in the forward** (``forward_chunked`` with ``needs``; reductions ``sum``/``mean``): per
  chunk, logits → loss and gradient → ``grad_x[chunk] = dlogits·W``, ``grad_W += dlogitsᵀ·x[chunk]``,
  ``grad_b += Σ_rows dlogits``. Three GEMMs per token, no second pass: the backward only multiplies the finished gradients
  by the (scalar) incoming gradient, on the device, exiting at once when it is 1.
- **recompute** (``forward_chunked`` + ``backward_recompute``; ``reduction="none"``, and the scaled op's
  lse/entropy outputs when they receive gradients): the
  incoming gradient is one value per token and is known only in the backward, and ``grad_W`` mixes tokens,
  so the forward keeps only each token's log-sum-exp (and entropy) and the backward recomputes the logits:
  four GEMMs per token.

Memory: the logits buffer (``plan_chunk_tokens``: a byte budget, default 512 MiB, gives the chunk length;
2048 tokens at a 128256 bf16 vocabulary) plus float32 rows. It does not grow with the token count beyond
the ``[tokens]`` rows and the gradients themselves. ``grad_W`` accumulates in ``W``'s dtype through
``addmm`` (fp32 inside each GEMM, one rounding per chunk): an fp32 accumulator would add ``4·V·H`` bytes
(2 GiB at 128256 × 4096), four times the logits budget, for little: measured against float64 on bf16
data (8192 tokens), the relative error of ``grad_W`` is 2.0e-3 / 2.6e-3 / 3.5e-3 / 4.8e-3 for 2 / 4 / 8 /
16 chunks, against 1.7e-3 for an fp32 accumulator (the final bf16 rounding alone), all well inside the
bf16 tolerance (1e-2) the tests hold it to. Large chunks also keep cuBLAS efficient: skinny GEMMs run far
below peak.

Both schedules run their chunks through ``run_chunks``, which can also (tuning knob ``overlap``) put each
chunk's row pass on a side stream between the GEMMs of the neighbouring chunks.

The ops and their ``torch.autograd.Function``s are in ``ops.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lck_kernels._common import cdiv, tuned
from lck_kernels._eager import Launch
from lck_kernels.cross_entropy.launch import (
    RESCALE_BLOCK,
    CEOptions,
    finalize_loss,
    host_fwd_plan,
    launch_bwd,
    launch_fwd,
    launch_reduction,
    rescale_flat_launches,
    rescale_grid,
)

Tensor = torch.Tensor

# 512 MiB: 2048 tokens of bf16 logits at a 128256 vocabulary. Smaller budgets cost time, all of it in cuBLAS:
# every chunk reads and rewrites all of grad_W with a K of only the chunk's tokens, and the logits and grad_x
# GEMMs get skinnier. Measured on one H200 at 8192x4096->128256 (benchmarks/flce_working_set.py):
# - loop time at 512 / 256 / 128 / 64 MiB: 39.85 / 41.53 / 45.22 / 54.75 ms (1.00 / 1.04 / 1.13 / 1.37x;
#   b55c2ce), with 501 / 251 / 125 / 63 MiB working sets;
# - GPU time per kernel (--profile, 6a366b2): at 128 MiB the grad_W updates take 15.9 ms against 12.3, the
#   logits GEMMs 12.6 against 11.3, the grad_x GEMMs 11.7 against 11.0; the row kernel 1.5 in both;
# - the grad_W update on a side stream (_run_with_grads) gives back little in place: 42.32 against 42.81 ms of
#   GPU time at 128 MiB, 37.18 against 37.29 at 512 MiB (loop 38.42 against 38.85; e07b4a2).
# So the default keeps 512 MiB; chunk_bytes picks a smaller working set at that cost.
DEFAULT_CHUNK_BYTES = 512 * 2**20
# Tuning knobs of tuning("fused_linear_cross_entropy", ...): overlap (run_chunks), grad_streams (_grad_streams).
KNOBS = {"overlap": 0, "grad_streams": 2}
CHUNK_ALIGN = 128  # chunk lengths are multiples of this where possible: whole GEMM tiles


def plan_chunk_tokens(
    n_tokens: int,
    vocab: int,
    element_size: int,
    *,
    chunk_bytes: int | None = None,
    max_chunk_tokens: int | None = None,
) -> int:
    """Tokens per chunk: the most whose ``[chunk, vocab]`` logits fit ``chunk_bytes``, balanced over chunks.

    The cap is rounded down to a multiple of 128 (when at least 128), optionally lowered to
    ``max_chunk_tokens``; the tokens are then split into equal chunks (rounded up to 128 where that stays
    under the cap), so 5000 tokens under a 2048 cap run as 1792 + 1792 + 1416, not 2048 + 2048 + 904.
    """
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    cap = max(1, budget // max(1, vocab * element_size))
    if cap >= CHUNK_ALIGN:
        cap -= cap % CHUNK_ALIGN
    if max_chunk_tokens is not None:
        cap = max(1, min(cap, max_chunk_tokens))
    if n_tokens <= cap:
        return max(1, n_tokens)
    even = cdiv(n_tokens, cdiv(n_tokens, cap))
    aligned = cdiv(even, CHUNK_ALIGN) * CHUNK_ALIGN
    return aligned if aligned <= cap else even


def _logits(x_c: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x_c, weight.t(), out=out)
    else:
        torch.addmm(bias, x_c, weight.t(), out=out)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def run_chunks(x, weight, bias, chunk: int, row_kernel, gemms=None) -> None:
    """For each chunk ``[s, e)`` of ``chunk`` tokens: ``logits = x[s:e]·Wᵀ (+ b)`` into a reused buffer, then
    ``row_kernel(s, e, logits)`` (the Triton row pass, which may overwrite ``logits`` with its gradient),
    then ``gemms(s, e, logits)`` (the gradient GEMMs), if given.

    Tuning knob ``tuning("fused_linear_cross_entropy", overlap=1)`` (CUDA, with ``gemms``): two buffers of
    half the chunk (the same memory), and the row pass of each chunk runs on a side stream, so that it can
    overlap the GEMMs of the neighbouring chunks (the row pass only moves bytes; the GEMMs only compute).
    Whether the GPU actually runs them side by side depends on cuBLAS leaving SMs free; measure it.
    """
    n, v = x.shape[0], weight.shape[0]
    overlap = tuned("fused_linear_cross_entropy", KNOBS)["overlap"] and x.is_cuda and gemms is not None
    if not overlap or n <= 1:
        buf = torch.empty((min(chunk, n), v), dtype=x.dtype, device=x.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = buf[: e - s]
            _logits(x[s:e], weight, bias, logits)
            row_kernel(s, e, logits)
            if gemms is not None:
                gemms(s, e, logits)
        return
    half = cdiv(chunk, 2)
    if half > CHUNK_ALIGN:
        half = cdiv(half, CHUNK_ALIGN) * CHUNK_ALIGN
    bounds = [(s, min(n, s + half)) for s in range(0, n, half)]
    bufs = [torch.empty((min(half, n), v), dtype=x.dtype, device=x.device) for _ in range(2)]
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)

    def logits_of(i: int) -> torch.cuda.Event:
        s, e = bounds[i]
        _logits(x[s:e], weight, bias, bufs[i % 2][: e - s])
        done = torch.cuda.Event()
        done.record(main)
        return done

    # Main stream: GEMM(0) | GEMM(1), wait row(0), grads(0) | GEMM(2), wait row(1), grads(1) | ...; side
    # stream: row(i) after GEMM(i). Buffer i % 2 is rewritten by GEMM(i + 2) only after grads(i), which
    # followed row(i) on the main stream, so no pass reads a buffer being rewritten. Everything the side
    # stream touches was allocated before on the main stream, which waits for the side stream's last pass:
    # later reuse of that memory is ordered after it.
    ready = logits_of(0)
    for i, (s, e) in enumerate(bounds):
        logits = bufs[i % 2][: e - s]
        side.wait_event(ready)
        with torch.cuda.stream(side):
            row_kernel(s, e, logits)
        row_done = torch.cuda.Event()
        row_done.record(side)
        if i + 1 < len(bounds):
            ready = logits_of(i + 1)
        main.wait_event(row_done)
        gemms(s, e, logits)


def _rows(n: int, device: torch.device, on: bool = True) -> torch.Tensor | None:
    return torch.empty(n, dtype=torch.float32, device=device) if on else None


def _accumulate_grads(
    dlogits: torch.Tensor,
    x_c: torch.Tensor,
    weight: torch.Tensor,
    first: bool,
    grad_x_c: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b32: torch.Tensor | None,
) -> None:
    if grad_x_c is not None:
        torch.mm(dlogits, weight, out=grad_x_c)
    if grad_w is not None:
        if first:  # no zero fill of a V×H buffer: the first chunk writes it
            torch.mm(dlogits.t(), x_c, out=grad_w)
        else:
            grad_w.addmm_(dlogits.t(), x_c)
    if grad_b32 is not None:
        grad_b32 += dlogits.sum(0, dtype=torch.float32)


class ChunkedProblem(NamedTuple):
    """One fused linear cross entropy, as both schedules see it: ``x`` ``[N, H]``, ``weight`` ``[V, H]``,
    ``target`` ``[N]``, optional ``bias`` and ``class_weight`` ``[V]``, the loss options, the reduction and
    the tokens per chunk (``plan_chunk_tokens``)."""

    x: Tensor
    weight: Tensor
    target: Tensor
    bias: Tensor | None
    class_weight: Tensor | None
    opts: CEOptions
    reduction: str
    chunk: int

    def reduction_terms(self) -> Tensor:
        """``launch_reduction``'s device-side denominators over the non-ignored targets."""
        mean = self.reduction == "mean"
        return launch_reduction(
            self.target,
            self.class_weight,
            self.weight.shape[0],
            self.opts.ignore_index,
            mean=mean,
            wrap=False,
        )


def _grad_streams(x: Tensor, need_w: bool) -> bool:
    """Whether each chunk's ``grad_W`` update runs on a side stream beside its ``grad_x`` GEMM (CUDA, ``grad_W``
    wanted, tuning knob ``grad_streams`` 2, the default; not with ``overlap``, which has its own streams)."""
    if not (x.is_cuda and need_w):
        return False
    knobs = tuned("fused_linear_cross_entropy", KNOBS)
    return knobs["grad_streams"] == 2 and not knobs["overlap"]


def _run_with_grads(p: ChunkedProblem, row_kernel, needs: tuple[bool, bool, bool]):
    """``run_chunks`` with each chunk's gradient GEMMs after its row pass: ``(grad_x, grad_w, grad_b)`` for
    ``needs = (need_x, need_w, need_b)``, unneeded ones empty. ``grad_b`` accumulates in float32 and takes
    the bias's dtype at the end; ``grad_w`` is zeroed when there are no tokens (no first chunk writes it).

    On CUDA the ``grad_W`` update (a read-modify-write of all of ``grad_W`` whose K is only the chunk's tokens,
    so it is bound by memory more than the other GEMMs) runs on a side stream while ``grad_x`` runs on the
    caller's: the two overlap, and the next chunk's logits GEMM, which rewrites the buffer both read, waits for
    both. The updates keep their order, so the bits are those of one stream. Measured on one H200 at
    8192×4096→128256 with 512-token chunks, the two gradient GEMMs alone took 26.9 ms against 29.1 on one
    stream (``flce-gemm-profile-h200-2026-12-02-b55c2ce.json``); inside the op the gain is smaller, 0.1-0.5 ms
    (see ``DEFAULT_CHUNK_BYTES``)."""
    x, weight, bias = p.x, p.weight, p.bias
    need_x, need_w, need_b = needs
    dev = x.device
    grad_x = torch.empty(x.shape if need_x else (0,), dtype=x.dtype, device=dev)
    grad_w = torch.empty(weight.shape if need_w else (0,), dtype=weight.dtype, device=dev)
    grad_b32 = torch.zeros(weight.shape[0] if need_b else 0, dtype=torch.float32, device=dev)
    two = _grad_streams(x, need_w)
    if two:
        main, side = torch.cuda.current_stream(dev), _side_stream(dev)
        # One pair per call, reused by every chunk (a wait takes the event's latest record).
        ready, done = torch.cuda.Event(), torch.cuda.Event()

    def gemms(s, e, logits):
        if not two:
            _accumulate_grads(
                logits, x[s:e], weight, s == 0, grad_x[s:e] if need_x else None, grad_w if need_w else None,
                grad_b32 if need_b else None,
            )  # fmt: skip
            return
        ready.record(main)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            _accumulate_grads(logits, x[s:e], weight, s == 0, None, grad_w, None)
        done.record(side)
        _accumulate_grads(
            logits,
            x[s:e],
            weight,
            s == 0,
            grad_x[s:e] if need_x else None,
            None,
            grad_b32 if need_b else None,
        )
        # The next chunk's logits GEMM rewrites the buffer grad_W read, and every later use of memory the side
        # stream touched (grad_W, the buffer once freed) is ordered after it.
        main.wait_event(done)

    run_chunks(x, weight, bias, p.chunk, row_kernel, gemms)
    if need_w and x.shape[0] == 0:
        grad_w.zero_()
    b_dtype = bias.dtype if bias is not None else torch.float32
    return grad_x, grad_w, grad_b32.to(b_dtype) if need_b else grad_b32.new_empty(0, dtype=b_dtype)


def forward_chunked(
    p: ChunkedProblem, *, entropy: bool, needs: tuple[bool, bool, bool] | None = None
) -> tuple[Tensor, ...]:
    """Both forward schedules.

    Without ``needs`` (the recompute schedule's forward, one GEMM per token): ``(loss, z_loss, lse,
    entropy)``, float32, ``entropy`` empty unless asked for. With ``needs = (need_x, need_w, need_b)``
    (reduction ``sum``/``mean``): the row pass overwrites each logits chunk with its gradient, which feeds the
    gradient GEMMs right away, and ``(grad_x, grad_w, grad_b)`` of the reduced loss follow (unneeded ones
    empty).
    """
    x, target, class_weight, opts = p.x, p.target, p.class_weight, p.opts
    n, dev = x.shape[0], x.device
    red = p.reduction_terms()
    ce, lse, zl = _rows(n, dev), _rows(n, dev), _rows(n, dev, opts.lse_square_scale > 0)
    ent = torch.empty(n if entropy else 0, dtype=torch.float32, device=dev)
    # The row kernel marks each row's applied scale; the fused schedule rescales whole buffers instead.
    applied = torch.empty(n, dtype=torch.float32, device=dev) if needs is not None else None

    def row_kernel(s, e, logits):
        launch_fwd(
            logits, target[s:e], class_weight, red, opts, loss=ce[s:e], lse=lse[s:e],
            zloss=zl[s:e] if zl is not None else None, entropy=ent[s:e] if entropy else None,
            grad=logits if needs is not None else None, applied=applied[s:e] if needs is not None else None,
            wrap=False,
        )  # fmt: skip

    grads: tuple[Tensor, ...] = ()
    if needs is None:
        run_chunks(x, p.weight, p.bias, p.chunk, row_kernel)
    else:
        grads = _run_with_grads(p, row_kernel, needs)
    loss, z = finalize_loss(ce, zl, red, p.reduction, wrap=False)
    return (loss, z, lse, ent, *grads)


def _row_slice(g: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    return g[s:e] if g is not None and g.dim() == 1 else g


def backward_recompute(
    p: ChunkedProblem,
    needs: tuple[bool, bool, bool],
    saved: tuple[Tensor, Tensor | None],
    upstream: tuple[Tensor | None, Tensor | None, Tensor | None],
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_w, grad_b) of ``Σ g_loss·loss + g_lse·lse + g_entropy·H`` by recomputing the logits.

    ``saved`` is the forward's ``(lse, entropy)`` rows (``entropy`` may be None); ``upstream`` is
    ``(g_loss, g_lse, g_entropy)``: ``g_loss`` is 0-D for ``sum``/``mean`` or ``[N]`` for ``none``,
    ``g_lse``/``g_entropy`` are ``[N]`` or ``None``. Unneeded gradients come back empty.
    """
    (lse, entropy), (g_loss, g_lse, g_entropy) = saved, upstream
    red = p.reduction_terms()

    def row_kernel(s, e, logits):
        launch_bwd(
            logits, logits, p.target[s:e], p.class_weight, red, p.opts, lse=lse[s:e],
            entropy=entropy[s:e] if entropy is not None else None, g_loss=_row_slice(g_loss, s, e),
            g_lse=_row_slice(g_lse, s, e), g_entropy=_row_slice(g_entropy, s, e), wrap=False,
        )  # fmt: skip

    return _run_with_grads(p, row_kernel, needs)


def empty_grads(x, weight, bias, need_x, need_w, need_b):
    return (
        x.new_empty(x.shape if need_x else (0,)),
        weight.new_empty(weight.shape if need_w else (0,)),
        x.new_empty(
            (weight.shape[0],) if need_b else (0,), dtype=bias.dtype if bias is not None else torch.float32
        ),
    )


def needs_grads(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[bool, bool, bool]:
    on = torch.is_grad_enabled()
    return on and x.requires_grad, on and weight.requires_grad, on and bias is not None and bias.requires_grad


def host_plans(slot: Callable[[Launch], int]) -> tuple[Callable[..., Any], ...]:
    """The callbacks of the C++ fused schedule (``csrc/host.h``), given ``slot`` (a Launch's C++ registry id):

    - ``chunks``: the tokens per chunk (``plan_chunk_tokens``) and the row kernel and grid ``launch_fwd`` runs
      with a gradient over a whole chunk and over the last one; None where it would run the split-row or CUDA
      cluster kernel (the Python path then runs);
    - ``rescale``: ``launch_rescale_flat``'s factor kernel and, for a buffer of ``n`` elements, its rescale
      kernel, grid and block count;
    - ``recompute``: the scaled op's recompute backward for gradients reaching lse or entropy (what
      ``lce_bwd`` runs), called from the C++ backward.

    ``chunks`` and ``rescale`` are asked once per shape; 0 stands for None in ``chunk_bytes`` and
    ``max_chunk_tokens``."""

    def chunks(
        n_tokens: int, vocab: int, element_size: int, device: int, chunk_bytes: int, max_chunk_tokens: int,
        has_weight: bool, smooth: bool, has_z: bool, has_softcap: bool, entropy: bool,
    ) -> tuple[int, int, int, int, int] | None:  # fmt: skip
        chunk = plan_chunk_tokens(
            n_tokens,
            vocab,
            element_size,
            chunk_bytes=chunk_bytes or None,
            max_chunk_tokens=max_chunk_tokens or None,
        )
        dev = torch.device("cuda", device)
        plan = [chunk]
        flags = (has_weight, smooth, has_z, has_softcap, entropy, True)
        for rows in (chunk, n_tokens - (cdiv(n_tokens, chunk) - 1) * chunk):
            row_plan = host_fwd_plan(rows, vocab, element_size, dev, flags)
            if row_plan is None:
                return None
            plan += [slot(row_plan[1]), row_plan[0][0]]
        return tuple(plan)  # type: ignore[return-value]

    def rescale(n: int, device: int) -> tuple[int, int, int, int]:
        factor, launch = rescale_flat_launches()
        grid = rescale_grid(n, RESCALE_BLOCK, torch.device("cuda", device))
        return slot(factor), slot(launch), grid[0], cdiv(n, RESCALE_BLOCK)

    def recompute(
        x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, lse: Tensor, entropy: Tensor | None,
        g_lse: Tensor | None, g_entropy: Tensor | None, ignore_index: int, inverse_temperature: float,
        reduction: str, need_x: bool, need_w: bool, need_b: bool, chunk: int,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        opts = CEOptions(ignore_index, 0.0, 0.0, 0.0, inverse_temperature)
        p = ChunkedProblem(x, weight, target, bias, None, opts, reduction, chunk)
        return backward_recompute(p, (need_x, need_w, need_b), (lse, entropy), (None, g_lse, g_entropy))

    return chunks, rescale, recompute
