"""The MoE experts layer of lck-ep: dispatch → grouped GEMM → fused SwiGLU with the routing weight →
grouped GEMM → combine, forward and backward (:class:`MoEExperts`).

Modules: ``module`` (the ``nn.Module``), ``function`` (the autograd function and retained forwards),
``permute`` (the local expert-major layout), ``grouped`` / ``gemm_kernels`` (grouped GEMMs: the forward's
Triton kernels, the first with the weighted SwiGLU as its epilogue, and their launches),
``kernels`` / ``launch`` (the row-wise Triton kernels and their launches), ``checks`` (argument checks),
``benchmark`` (``lck bench moe``).
"""

from lck_ep.moe.module import MoEExperts

__all__ = ["MoEExperts"]
