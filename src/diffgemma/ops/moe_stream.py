"""The bf16 expert GEMM as a weight-streaming Triton kernel, for the denoise shape (few rows per expert).

    out[M, N] = xs @ W[g]^T for the rows of expert g (offs = cumulative ends, as torch._grouped_mm)

At denoise the canvas sends 256 x 8 = 2048 routes to 128 experts, ~16 rows each, so the GEMM is a stream of
45.7 GB of expert weights with little arithmetic per byte: a memory-bound shape, which this kernel is laid out
for (docs/ARCHITECTURE.md, 'Kernel configurations'). It is the packed grouped GEMM of
ops/moe_packed.py
run with its RAW format (no decode): the product is computed transposed
(acc[BN, BM] = W_tile · x_tileᵀ, "swap AB") so the large N fills the MMA's wide side and the few rows its
narrow one; one program per (N tile, expert) loops over that expert's row tiles, so the grid is fixed by
shapes (graph-safe, no host sync) and every SM streams weights.

ops/moe.py runs it for bf16 expert stacks on CUDA when the rows per expert are few (denoise; the down projection
also at a 1k prefill's 64), and torch._grouped_mm otherwise (ops/moe_paths.py, "stream"; `DIFFGEMMA_EXPERT_GEMM=
cutlass` turns it off). At the real shapes its results equal torch._grouped_mm's bit for bit, with every tile
config tried (tests/gpu/test_stream_gemm_gpu.py), so which of the two runs changes no token.

  grouped_mm_ref      the twin: torch._grouped_mm (or its per-expert loop on builds without it)
  grouped_mm_triton   the kernel
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from .grouped import grouped_mm_torch, route_count
from .moe_packed import RAW, launch_grouped
from .moe_paths import STREAM_MAX_ROWS, STREAM_SHORT_K

# (BN, BM, BK, num_warps, num_stages) at the real shapes (docs/ARCHITECTURE.md, 'Kernel configurations'). The down
# projection's short K (704) leaves few K steps a program, so it takes shorter K tiles over wider N tiles.
CONFIG = (64, 32, 128, 4, 4)
CONFIG_SHORT_K = (128, 32, 64, 8, 5)
# a down projection with more rows an expert than denoise's (moe_paths.STREAM_SHORT_K_MAX_ROWS): 64-row tiles
CONFIG_SHORT_K_WIDE = (64, 64, 64, 4, 3)


def grouped_mm_ref(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grouped_mm_torch(xs, w, offs)


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: tuple | None = None,
                      src: torch.Tensor | None = None, order: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """x [M, K] (rows grouped by expert), or x [T, K] with src int [M] naming each route's row (the gather is
    done by the kernel's x loads); w [E, N, K], offs int32 [E] -> [M, N] in x.dtype. order: int32 [E], the
    experts in the order their programs launch (ops/moe_plan.moe_plan_with_order); the result does not depend on it.
    glu: w is a gate ‖ up stack; -> gelu_tanh(gate)·up [M, N/2], made in the epilogue from the products rounded to
    x.dtype as the plain GEMM stores them (the same bits as gelu_mul after it, one kernel and one [M, N] trip fewer)."""
    if w.dim() != 3 or x.dim() != 2 or x.shape[1] != w.shape[2]:
        raise TensorError(f"grouped_mm: x {list(x.shape)} and w {list(w.shape)} do not make [M, K] x [E, N, K]")
    if w.dtype != x.dtype:
        raise TensorError(f"grouped_mm: x is {x.dtype} but w is {w.dtype}; expected the same dtype")
    E, N, K = w.shape
    x, w = x.contiguous(), w.contiguous()
    if config is None:
        wide = route_count(x, src) > STREAM_MAX_ROWS * E
        config = (CONFIG_SHORT_K_WIDE if wide else CONFIG_SHORT_K) if K <= STREAM_SHORT_K else CONFIG
    BN, BM, BK, warps, stages = config
    # the packed grouped GEMM with its RAW format: same grid and loops, the weight tile loaded as it is
    return launch_grouped(x, src, offs, order, E, N, K, BN, BM, BK, warps, stages, glu, w, w, w, w, tscale=1.0,
                          FMT=RAW, GS=32, PREFETCH=False)
