"""What every grouped-GEMM path of the expert FFN shares: its operands, the torch GEMM, gelu·up after it.

A grouped GEMM multiplies the rows of expert g (offs = cumulative ends, as torch._grouped_mm) by W[g]ᵀ. Its
input is x [M, K] with the rows grouped by expert, or x [T, K] with one row per token and src [M] naming
each route's token (the kernels gather in their loads; the torch paths gather first, `routed`).

  grouped_mm_torch   torch._grouped_mm (or a per-group loop on builds without it): the twin of every kernel
  routed             the routes' input rows: x, or x[src]
  route_count        the GEMM's row count M, checking src
  gelu_after         gelu·up of a gate ‖ up product, for the paths whose kernel has no fused epilogue
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from .gelu_mul import gelu_mul


def grouped_mm_torch(a, w, offs):
    """a [M, K] rows sorted by group, w [G, N, K] -> [M, N] with rows of group g multiplied by w[g]^T."""
    try:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError, AttributeError):
        # Older CPU builds have no grouped kernel: same result via a loop (host sync, CPU only).
        out = a.new_empty(a.shape[0], w.shape[1])
        start = 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ w[g].T
            start = end
        return out


def routed(x: torch.Tensor, src: torch.Tensor | None) -> torch.Tensor:
    """The routes' input rows grouped by expert: x itself, or x[src] when x holds one row per token."""
    return x if src is None else x.index_select(0, src)


def route_count(x: torch.Tensor, src: torch.Tensor | None) -> int:
    """Rows of the grouped GEMM: x's, or src's when src names one row of x per route. src must be a 1-D
    integer tensor on x's device (its values are not read here: that would cost a host sync; moe_plan makes them)."""
    if src is None:
        return x.shape[0]
    if src.dim() != 1 or src.dtype not in (torch.int32, torch.int64) or src.device != x.device:
        raise TensorError(f"grouped GEMM: src must be a 1-D int32/int64 tensor on {x.device}, got "
                          f"{src.dtype} {list(src.shape)} on {src.device}")
    return src.shape[0]


def gelu_after(out: torch.Tensor, glu: bool, as_f16: bool = False) -> torch.Tensor:
    """A grouped GEMM's result, or gelu·up of it (as f16 operands with as_f16) when the caller asked for glu and the
    path had no fused epilogue."""
    return gelu_mul(out, as_f16=as_f16) if glu else out
