"""Launch configuration and launchers of the cross-entropy row kernels (``kernels.py``), shared by the three ops.

Each launcher takes preallocated outputs (so the fused linear ops can write one chunk of rows into slices of
whole-batch buffers) and ``wrap``: True inside a ``triton_op`` body, where kernels must be launched through
``torch.library.wrap_triton`` for ``torch.compile`` to see them; False inside opaque ``custom_op`` bodies.
Nothing here validates user input: the public functions do that before any launcher runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton

from lck_kernels._common import config_cache, interpreting, next_power_of_2, num_sms, tuned
from lck_kernels._eager import Launch, launch_for
from lck_kernels.cross_entropy import kernels as k
from lck_kernels.cross_entropy.cuda import enabled as cuda_enabled
from lck_kernels.cross_entropy.cuda import try_launch
from lck_kernels.cross_entropy.kernels import _DEFAULTS
from lck_kernels.cross_entropy.split import MAX_SPIN, _ce_fwd_split_kernel

_ELEMENTS_PER_THREAD_FLOOR = 8  # fewer warps for short rows: at least this many elements per thread
MAX_SPLIT = 8


def _floor_power_of_2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


@config_cache
def ce_launch_config(
    kernel: str, n_rows: int, n_cols: int, element_size: int, device: torch.device
) -> dict[str, Any]:
    """Tile width, warps, grid size and constexpr switches for one of the row kernels.

    The tile is ``block_bytes`` of logits (so fp32 rows take half the elements of bf16 rows), capped by
    the row length; warps shrink for short rows. The grid is ``programs_per_sm × SMs`` (a persistent grid) or one
    program per row, never more programs than rows. With ``split`` > 1 (loss+gradient kernel only) each row
    goes to a team of ``SPLIT`` consecutive programs (a power of two, at most the row's tiles and 8), each
    owning ``CHUNK`` columns (whole tiles); the grid is a whole number of teams, at most one per row.
    """
    cfg = tuned(kernel, dict(_DEFAULTS[kernel]))
    block = next_power_of_2(max(16, cfg["block_bytes"] // max(element_size, 1)))
    block = min(block, max(16, next_power_of_2(n_cols)))
    warps = next_power_of_2(max(1, min(cfg["warps"], block // (32 * _ELEMENTS_PER_THREAD_FLOOR))))
    per_sm = cfg["programs_per_sm"]
    sms = num_sms(device)
    tiles = triton.cdiv(n_cols, block)
    split = min(_floor_power_of_2(cfg.get("split", 1)), _floor_power_of_2(tiles), MAX_SPLIT)
    split = min(split, _floor_power_of_2(sms))  # a team must fit the GPU at once
    # sm_pct < 100 (persistent grids only): fewer programs than SMs, so fewer rows in flight between a tile's
    # two reads (a smaller L2 working set) at the price of fewer SMs streaming.
    pct = max(1, min(100, cfg.get("sm_pct", 100)))
    teams = n_rows if per_sm <= 0 else min(n_rows, max(1, per_sm * sms * pct // 100 // split))
    return {
        "BLOCK": block,
        "num_warps": warps,
        "grid": (max(1, teams) * split,),
        "EVICT": bool(cfg["evict"]),
        "NUM_STAGES": max(1, cfg["stages"]),
        "PREFETCH": max(0, min(2, int(cfg.get("prefetch", 0)))),
        "SPLIT": split,
        "CHUNK": triton.cdiv(tiles, split) * block,
        "REVERSE": bool(cfg.get("reverse", 0)),
        "GRAD_AHEAD": bool(cfg.get("grad_ahead", 0)),
        "WARP_MAX": bool(cfg.get("warp_max", 0)),
    }


def rescale_grid(n: int, block: int, device: torch.device) -> tuple[int]:
    """A persistent grid for the flat rescale: a few programs per SM, each striding over ``n``."""
    return (max(1, min(triton.cdiv(n, block), 8 * num_sms(device))),)


@dataclass(frozen=True)
class CEOptions:
    """Per-call constants of the loss. ``softcap`` 0 means no cap; ``scale`` multiplies logits first."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float = 0.0
    scale: float = 1.0

    def flags(self, has_weight: bool) -> dict[str, bool]:
        return {
            "HAS_WEIGHT": has_weight,
            "SMOOTH": self.label_smoothing > 0.0,
            "HAS_Z": self.lse_square_scale > 0.0,
            "HAS_SOFTCAP": self.softcap > 0.0,
        }

    def switches(self) -> tuple[bool, bool, bool]:
        """``SMOOTH``, ``HAS_Z``, ``HAS_SOFTCAP`` (the order of :meth:`flags` after ``HAS_WEIGHT``)."""
        return self.label_smoothing > 0.0, self.lse_square_scale > 0.0, self.softcap > 0.0

    def scalars(self) -> tuple[int, float, float, float, float]:
        softcap = self.softcap if self.softcap > 0.0 else 1.0  # unused without the cap; avoid a 0 divide
        return self.ignore_index, self.label_smoothing, self.lse_square_scale, self.scale, softcap


def _run(launch: Launch, wrap: bool, grid: tuple[int, ...], *args: Any) -> None:
    # wrap: inside a triton_op body (torch.compile must see the kernel); else an opaque custom_op body.
    if wrap:
        launch(grid, *args)
    else:
        launch.raw(grid, *args)


@config_cache
def _reduction_launch(mean: bool, has_weight: bool) -> Launch:
    return launch_for(k._ce_reduction_kernel, MEAN=mean, HAS_WEIGHT=has_weight, BLOCK=1024, num_warps=4)


def launch_reduction(
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    n_cols: int,
    ignore_index: int,
    *,
    mean: bool,
    wrap: bool,
) -> torch.Tensor:
    """``[Σ w_t, n_valid, cw, cz, Σ w_c]`` (float32, on device) over the non-ignored targets."""
    red = torch.empty(5, dtype=torch.float32, device=target.device)
    weight = class_weight if class_weight is not None else red
    launch = _reduction_launch(mean, class_weight is not None)
    _run(launch, wrap, (1,), target, weight, red, target.numel(), n_cols, ignore_index)
    return red


def launch_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    red: torch.Tensor,
    opts: CEOptions,
    *,
    loss: torch.Tensor,
    lse: torch.Tensor,
    zloss: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    applied: torch.Tensor | None = None,
    wrap: bool,
) -> None:
    """Per-row loss terms and lse of ``logits`` (2-D, unit column stride) into the given float32 rows.

    With ``grad`` (same shape and dtype as ``logits``, possibly ``logits`` itself) the gradient scaled by
    ``red``'s reduction factors is written in the same kernel and ``applied`` (float32 rows) is set to 1.
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    if grad is not None and logits.is_cuda and applied is not None:
        # The CUDA cluster kernel (one read of the logits instead of two) when turned on (opt-in) and it applies.
        if try_launch(
            logits, target, red, opts, loss=loss, lse=lse, zloss=zloss, grad=grad, applied=applied,
            has_class_weight=class_weight is not None, entropy=entropy is not None,
        ):  # fmt: skip
            return
    name = "cross_entropy_fwd_grad" if grad is not None else "cross_entropy_fwd"
    ignore_index, eps, z_scale, scale, softcap = opts.scalars()
    cfg = ce_launch_config(name, n_rows, n_cols, logits.element_size(), logits.device)
    if grad is not None and cfg["SPLIT"] > 1:
        # One record of 8 int64 words per (row, team member), zero = not yet published, and an abort flag.
        part = torch.zeros(n_rows * cfg["SPLIT"] * 8 + 1, dtype=torch.int64, device=logits.device)
        # On a GPU the team's programs run together and wait for each other's records inside one launch;
        # the interpreter runs programs one after another, so there the statistics pass (phase 1) and the
        # gradient pass (phase 2) are two launches of the same kernel.
        for phase in (1, 2) if interpreting() else (0,):
            launch = launch_for(
                _ce_fwd_split_kernel, BLOCK=cfg["BLOCK"], SPLIT=cfg["SPLIT"], **opts.flags(class_weight is not None),
                ENTROPY=entropy is not None, EVICT=cfg["EVICT"], NUM_STAGES=cfg["NUM_STAGES"],
                PREFETCH=cfg["PREFETCH"], PHASE=phase, MAX_SPIN=MAX_SPIN, WARP_MAX=cfg["WARP_MAX"],
                num_warps=cfg["num_warps"],
            )  # fmt: skip
            _run(
                launch, wrap, cfg["grid"], logits, logits.stride(0), grad, grad.stride(0), target,
                class_weight if class_weight is not None else lse, red, loss,
                zloss if zloss is not None else lse, lse, entropy if entropy is not None else lse,
                applied if applied is not None else lse, part, n_rows, n_cols, cfg["CHUNK"], ignore_index,
                eps, z_scale, scale, softcap,
            )  # fmt: skip
        return
    flags = (class_weight is not None, *opts.switches(), entropy is not None, grad is not None)
    grid, launch = _fwd_launch(name, n_rows, n_cols, logits.element_size(), logits.device, flags)
    _run(
        launch, wrap, grid, logits, logits.stride(0), grad if grad is not None else lse,
        grad.stride(0) if grad is not None else 0, target, class_weight if class_weight is not None else lse, red,
        loss, zloss if zloss is not None else lse, lse, entropy if entropy is not None else lse,
        applied if applied is not None else lse, n_rows, n_cols, ignore_index, eps, z_scale, scale, softcap,
    )  # fmt: skip


@config_cache
def _fwd_launch(name: str, n_rows: int, n_cols: int, element_size: int, device: torch.device, flags: tuple):
    cfg = ce_launch_config(name, n_rows, n_cols, element_size, device)
    has_weight, smooth, has_z, has_softcap, entropy, grad = flags
    launch = launch_for(
        k._ce_fwd_kernel, BLOCK=cfg["BLOCK"], HAS_WEIGHT=has_weight, SMOOTH=smooth, HAS_Z=has_z,
        HAS_SOFTCAP=has_softcap, ENTROPY=entropy, GRAD=grad, EVICT=cfg["EVICT"], NUM_STAGES=cfg["NUM_STAGES"],
        PREFETCH=cfg["PREFETCH"], REVERSE=cfg["REVERSE"], GRAD_AHEAD=cfg["GRAD_AHEAD"], WARP_MAX=cfg["WARP_MAX"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return cfg["grid"], launch


def row_arg(g: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A per-row upstream gradient as (pointer, row stride): 0-D and expanded tensors have stride 0."""
    if g is None:
        return dummy, 0
    return g, (g.stride(0) if g.dim() == 1 else 0)


def launch_bwd(
    logits: torch.Tensor,
    grad: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    red: torch.Tensor,
    opts: CEOptions,
    *,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_loss: torch.Tensor | None,
    g_lse: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    wrap: bool,
) -> None:
    """``grad`` (may be ``logits``) ← ∂L/∂logits from the saved lse (and entropy) of each row.

    ``L = Σ_i g_loss_i·loss_i + g_lse_i·lse_i + g_entropy_i·H_i``; each upstream gradient is ``None``
    (absent), a 0-D tensor (the same for every row) or one value per row; ``loss_i`` is normalised by
    ``red`` as in the forward.
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    ignore_index, eps, z_scale, scale, softcap = opts.scalars()
    gl, gl_stride = row_arg(g_loss, lse)
    gs, gs_stride = row_arg(g_lse, lse)
    ge, ge_stride = row_arg(g_entropy, lse)
    if g_entropy is not None and entropy is None:
        raise RuntimeError("launch_bwd: g_entropy needs the saved entropy")  # internal invariant
    flags = (
        class_weight is not None,
        *opts.switches(),
        g_loss is not None,
        g_lse is not None,
        g_entropy is not None,
    )
    grid, launch = _bwd_launch(n_rows, n_cols, logits.element_size(), logits.device, flags)
    _run(
        launch, wrap, grid, logits, logits.stride(0), grad, grad.stride(0), target,
        class_weight if class_weight is not None else lse, red, lse, entropy if entropy is not None else lse,
        gl, gl_stride, gs, gs_stride, ge, ge_stride, n_rows, n_cols, ignore_index, eps, z_scale, scale, softcap,
    )  # fmt: skip


@config_cache
def _bwd_launch(n_rows: int, n_cols: int, element_size: int, device: torch.device, flags: tuple):
    cfg = ce_launch_config("cross_entropy_bwd", n_rows, n_cols, element_size, device)
    has_weight, smooth, has_z, has_softcap, g_loss, g_lse, g_ent = flags
    launch = launch_for(
        k._ce_bwd_kernel, BLOCK=cfg["BLOCK"], HAS_WEIGHT=has_weight, SMOOTH=smooth, HAS_Z=has_z,
        HAS_SOFTCAP=has_softcap, HAS_G_LOSS=g_loss, HAS_G_LSE=g_lse, HAS_G_ENT=g_ent, EVICT=cfg["EVICT"],
        NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return cfg["grid"], launch


def launch_rescale_rows(grad: torch.Tensor, applied: torch.Tensor, g: torch.Tensor, *, wrap: bool) -> None:
    """Rows of ``grad`` ← rows × ``g / applied``; then ``applied`` ← ``g`` (0-D or one value per row)."""
    n_rows, n_cols = grad.shape
    if n_rows == 0:
        return
    g_arg, g_stride = row_arg(g, applied)
    grid, launch = _rescale_rows_launch(n_rows, n_cols, grad.device)
    _run(launch, wrap, grid, grad, grad.stride(0), applied, g_arg, g_stride, n_rows, n_cols)


@config_cache
def _rescale_rows_launch(n_rows: int, n_cols: int, device: torch.device) -> tuple[tuple[int], Launch]:
    block = min(4096, max(16, 1 << (n_cols - 1).bit_length()))
    grid = (max(1, min(n_rows, 8 * num_sms(device))),)
    return grid, launch_for(k._ce_rescale_rows_kernel, BLOCK=block, num_warps=8)


RESCALE_BLOCK = 4096  # elements per program step of launch_rescale_flat's kernel


def rescale_flat_launches() -> tuple[Launch, Launch]:
    """``launch_rescale_flat``'s factor kernel and rescale kernel (also launched by the C++ fused linear ops)."""
    return (
        launch_for(k._rescale_factor_kernel, num_warps=1),
        launch_for(k._rescale_kernel, BLOCK=RESCALE_BLOCK, num_warps=8),
    )


def launch_rescale_flat(
    tensors: list[torch.Tensor], applied: torch.Tensor, g: torch.Tensor, *, wrap: bool
) -> None:
    """Each contiguous tensor ← tensor × ``g / applied`` (``g`` and ``applied`` hold one value); then
    ``applied`` ← ``g``. Programs exit at once when the factor is exactly 1."""
    factor = torch.empty(1, dtype=torch.float32, device=applied.device)
    factor_launch, rescale = rescale_flat_launches()
    _run(factor_launch, wrap, (1,), g, applied, factor)
    block = RESCALE_BLOCK
    for t in tensors:
        if t.numel() == 0:
            continue
        n = t.numel()
        _run(rescale, wrap, rescale_grid(n, block, t.device), t, n, triton.cdiv(n, block), factor)


FINALIZE_BLOCK = 4096  # per-row terms summed per step by _ce_finalize_kernel's one program


@config_cache
def _finalize_launch(mean: bool, has_z: bool) -> Launch:
    return launch_for(k._ce_finalize_kernel, MEAN=mean, HAS_Z=has_z, BLOCK=FINALIZE_BLOCK, num_warps=8)


def finalize_loss(
    ce: torch.Tensor, zl: torch.Tensor | None, red: torch.Tensor, reduction: str, *, wrap: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, z-loss) in float32 from per-row terms and the device-side denominators of ``red``: for
    ``sum``/``mean`` one launch of ``_ce_finalize_kernel`` (a fixed summation order)."""
    if reduction == "none":
        if zl is None:
            return ce, torch.zeros_like(ce)
        return ce + zl, zl
    loss = torch.empty((), dtype=torch.float32, device=ce.device)
    z = torch.empty((), dtype=torch.float32, device=ce.device)
    launch = _finalize_launch(reduction == "mean", zl is not None)
    _run(launch, wrap, (1,), ce, zl if zl is not None else ce, red, loss, z, ce.shape[0])
    return loss, z


def host_fwd_plan(
    n_rows: int, n_cols: int, element_size: int, device: torch.device, flags: tuple
) -> tuple[tuple[int], Launch] | None:
    """``launch_fwd``'s (grid, launch) for a C++ host path (``flags`` as ``_fwd_launch`` takes them), or None where
    launch_fwd runs the split-row kernel (a scratch buffer, two launches under the interpreter) or the CUDA
    cluster kernel: those calls stay on the Python path."""
    grad = flags[-1]
    name = "cross_entropy_fwd_grad" if grad else "cross_entropy_fwd"
    if grad:
        cfg = ce_launch_config(name, n_rows, n_cols, element_size, device)
        if cfg["SPLIT"] > 1 or (cuda_enabled() and tuned(name, dict(_DEFAULTS[name]))["cuda"]):
            return None
    return _fwd_launch(name, n_rows, n_cols, element_size, device, flags)


def host_plans(slot: Callable[[Launch], int]) -> tuple[Callable[..., Any], ...]:
    """The plan callbacks of the C++ cross entropy (``csrc/host.h``), given ``slot`` (a Launch's C++ registry
    id): the launches and grids ``launch_reduction``, ``launch_fwd``, ``launch_bwd`` (a per-row loss gradient),
    ``launch_rescale_rows`` and ``finalize_loss`` would use, asked once per shape."""

    def reduction(mean: bool, has_weight: bool) -> int:
        return slot(_reduction_launch(mean, has_weight))

    def finalize(mean: bool, has_z: bool) -> int:
        return slot(_finalize_launch(mean, has_z))

    def fwd(
        n_rows: int, n_cols: int, element_size: int, device: int,
        has_weight: bool, smooth: bool, has_z: bool, has_softcap: bool, grad: bool,
    ) -> tuple[int, int] | None:  # fmt: skip
        flags = (has_weight, smooth, has_z, has_softcap, False, grad)
        plan = host_fwd_plan(n_rows, n_cols, element_size, torch.device("cuda", device), flags)
        return None if plan is None else (slot(plan[1]), plan[0][0])

    def bwd(
        n_rows: int, n_cols: int, element_size: int, device: int,
        has_weight: bool, smooth: bool, has_z: bool, has_softcap: bool,
    ) -> tuple[int, int]:  # fmt: skip
        flags = (has_weight, smooth, has_z, has_softcap, True, False, False)
        grid, launch = _bwd_launch(n_rows, n_cols, element_size, torch.device("cuda", device), flags)
        return slot(launch), grid[0]

    def rescale(n_rows: int, n_cols: int, device: int) -> tuple[int, int]:
        grid, launch = _rescale_rows_launch(n_rows, n_cols, torch.device("cuda", device))
        return slot(launch), grid[0]

    return reduction, fwd, bwd, rescale, finalize
