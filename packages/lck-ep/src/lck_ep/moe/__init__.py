"""The MoE experts layer of lck-ep: dispatch → grouped GEMM → fused SwiGLU with the routing weight →
grouped GEMM → combine, forward and backward (:class:`MoEExperts`).

Modules: ``module`` (the ``nn.Module``), ``function`` (the autograd function and retained forwards),
``permute`` (the local expert-major layout), ``grouped`` (grouped GEMMs), ``kernels`` / ``launch``
(Triton kernels and their launches), ``checks`` (argument checks), ``benchmark`` (``lck bench moe``),
``fused_gemm`` (an experiment the benchmark times: the first GEMM fused with the gather and the activation).
"""

from lck_ep.moe.module import MoEExperts

__all__ = ["MoEExperts"]
