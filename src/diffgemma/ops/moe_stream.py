"""The bf16 expert GEMM as a weight-streaming Triton kernel, for the denoise shape (few rows per expert).

    out[M, N] = xs @ W[g]^T for the rows of expert g (offs = cumulative ends, as torch._grouped_mm)

At denoise the canvas sends 256 x 8 = 2048 routes to 128 experts, ~16 rows each, so the GEMM is a stream of
45.7 GB of expert weights with little arithmetic per byte. torch._grouped_mm (CUTLASS) reads them at ~2.9 TB/s
on the H200 with balanced routing (bench/RESULTS.md, round 4) against ~4.3 TB/s available. This kernel is
the packed grouped GEMM of ops/moe_packed.py run with its RAW format (no decode): the product is computed transposed
(acc[BN, BM] = W_tile · x_tileᵀ, "swap AB") so the large N fills the MMA's wide side and the few rows its
narrow one; one program per (N tile, expert) loops over that expert's row tiles, so the grid is fixed by
shapes (graph-safe, no host sync) and every SM streams weights.

NOT the default: it is correct (tests: interpreter vs the twin, and tests/gpu at real shapes) but its speed
has not been measured yet. `DIFFGEMMA_EXPERT_GEMM=triton` selects it for bf16 expert stacks on CUDA when the
rows per expert are few (denoise); otherwise the engine uses torch._grouped_mm.

  grouped_mm_ref      the twin: torch._grouped_mm (or its per-expert loop on builds without it)
  grouped_mm_triton   the kernel
  grouped_mm          the dispatcher the expert FFN calls
"""

from __future__ import annotations

import os

import torch

from ..errors import TensorError
from . import moe_packed as mp
from ._backend import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton

# Above this many rows per expert (prefill: 8192 x 8 / 128 = 512) the GEMM is compute bound and CUTLASS's
# tiles win; the streaming kernel is for the denoise shape (~16).
STREAM_MAX_ROWS = 48
# (BN, BM, BK, num_warps, num_stages); bench/bench_pack.py times alternatives at the real shapes.
CONFIG = (64, 32, 128, 4, 4)


def grouped_mm_ref(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    from .moe import _grouped_mm

    return _grouped_mm(xs, w, offs)


def grouped_mm_triton(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """xs [M, K] (rows grouped by expert), w [E, N, K], offs int32 [E] -> [M, N] in xs.dtype."""
    if w.dim() != 3 or xs.dim() != 2 or xs.shape[1] != w.shape[2]:
        raise TensorError(f"grouped_mm: xs {list(xs.shape)} and w {list(w.shape)} do not make [M, K] x [E, N, K]")
    if w.dtype != xs.dtype:
        raise TensorError(f"grouped_mm: xs is {xs.dtype} but w is {w.dtype}; expected the same dtype")
    E, N, K = w.shape
    xs, w = xs.contiguous(), w.contiguous()
    M = xs.shape[0]
    out = torch.empty(M, N, dtype=xs.dtype, device=xs.device)
    if M == 0:
        return out
    BN, BM, BK, warps, stages = config or CONFIG
    offs = offs.to(torch.int32).contiguous()
    # the packed grouped GEMM with its RAW format: same grid and loops, the weight tile loaded as it is
    mp._packed_gmm_kernel[(triton.cdiv(N, BN), E)](xs, out, offs, w, w, w, w, 1.0, N, K, xs.stride(0), out.stride(0),
                                                   FMT=mp.RAW, GS=32, BN=BN, BM=BM, BK=BK,
                                                   num_warps=warps, num_stages=stages)
    return out


def grouped_mm(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if (use_triton(xs) and os.environ.get("DIFFGEMMA_EXPERT_GEMM", "cutlass") == "triton"
            and xs.shape[0] <= STREAM_MAX_ROWS * w.shape[0]):
        return grouped_mm_triton(xs, w, offs)
    return grouped_mm_ref(xs, w, offs)
