"""Which implementation an expert GEMM runs: the one rule ops/moe.py's dispatcher follows.

`expert_gemm_path(w, routes, x)` names the path for a GEMM of `routes` rows against the expert stack w:

  "torch"     a plain (bf16) stack where the streaming kernel does not apply: torch._grouped_mm (CUTLASS on CUDA)
  "stream"    a plain stack on CUDA with few rows per expert (denoise; a down projection also at a 1k prefill's 64):
              ops/moe_stream.py's weight-streaming kernel
  "twin"      a packed stack without Triton (CPU, DIFFGEMMA_NO_TRITON): dequantize in torch, then torch._grouped_mm
  "dequant"   a packed stack with many rows per expert (prefill): the layer's stack dequantized by a kernel into a
              bf16 scratch, then torch._grouped_mm: compute bound there, so each weight is decoded once a
              layer rather than once a row tile in the GEMM's loop
  "q4-tiles"  a q4 stack in the q4-tiles layout (ops/q4_tiles.py): ops/moe_q4.py's kernel
  "nvfp4-tiles" an nvfp4e stack in the nvfp4-tiles layout (ops/packed_weight.py): ops/moe_nvfp4.py's kernel
  "packed"    any other packed stack (q4 / q5 / q6 / nvfp4 in the pack's order): ops/moe_packed.py's kernel

An FP8 stack (ops/fp8_weight.Fp8Weight) takes one of fp8_expert_path's (ops/fp8_moe.py runs them):
  "fp8-triton" on a device with FP8 tensor cores, at every size: ops/fp8_moe.py's Triton kernel (its tiles by the
               rows per expert, torch._scaled_grouped_mm's bits; why: docs/ARCHITECTURE.md, 'FP8 GEMMs')
  "fp8-torch"  torch._scaled_grouped_mm: with DIFFGEMMA_EXPERT_GEMM=cutlass, or where Triton does not run
  "fp8-twin"   off CUDA, without Triton, or for an output dtype other than bf16: the torch twin

Two environment variables move the thresholds' choices for A/B: DIFFGEMMA_EXPERT_GEMM=cutlass sends plain stacks
to "torch" and FP8 stacks to "fp8-torch" at every size, DIFFGEMMA_PACKED_PREFILL=kernel keeps packed stacks in their
kernel at prefill.
"""

from __future__ import annotations

import os

import torch

from ._backend import env_choice, use_triton
from .fp8_weight import FP8_DTYPE, Fp8Weight, has_fp8_mma, has_scaled_grouped_mm
from .packed_weight import NVFP4_TILES, PackedWeight
from .q4_tiles import LAYOUT

# Up to this many rows per expert a grouped GEMM streams its weights (denoise: 2048 routes / 128 experts = 16);
# above it (prefill: 8192 x 8 / 128 = 512) it is compute bound. The bf16 stream kernel hands those shapes to
# CUTLASS; the packed kernel switches to its "compute" tiles.
STREAM_MAX_ROWS = 48

# A down projection (K <= STREAM_SHORT_K: the experts' 704) streams up to this many rows per expert: a 1k prompt's
# prefill chunk (1024 x 8 / 128 = 64), a batched denoise of 4 canvases, with a 64-row tile and torch._grouped_mm's
# bits; gate_up (K 2816) keeps the lower bound (the choice: docs/ARCHITECTURE.md, 'Kernel configurations').
STREAM_SHORT_K = 1024
STREAM_SHORT_K_MAX_ROWS = 64

# Rows per expert at and above which a packed expert GEMM dequantizes the layer's stack to a bf16 scratch and
# uses torch._grouped_mm (prefill: 8192 tokens x top-8 / 128 experts = 512). Below it (denoise: ~16) the
# in-kernel dequant streams the packed bytes once.
PREFILL_ROWS = 128

EXPERT_GEMM_ENV = "DIFFGEMMA_EXPERT_GEMM"  # "triton" (default) or "cutlass"; settings.py knows it by name
PACKED_PREFILL_ENV = "DIFFGEMMA_PACKED_PREFILL"  # "dequant" (default) or "kernel"; settings.py knows it by name


def tile_rows(routes: int, experts: int) -> int:
    """The tile GEMMs' rows a pass (BM; ops/moe_q4.py and ops/moe_nvfp4.py, one kernel structure) for `routes` rows
    over `experts`: 32 at denoise (~16 an expert), 64 up to PREFILL_ROWS an expert, 128 above (a batched denoise over
    several canvases: fewer passes over the decoded weights). By the actual rows, not the path's: the tile changes no
    bit of a row, only the passes."""
    per_expert = routes / experts
    return 32 if per_expert <= STREAM_MAX_ROWS else 64 if per_expert < PREFILL_ROWS else 128


def expert_gemm_choice() -> str:
    """The bf16 expert GEMM at denoise and the FP8 expert GEMMs: "triton" (the repo's kernels) or "cutlass" (torch's
    grouped kernels)."""
    return env_choice(EXPERT_GEMM_ENV, ("triton", "cutlass"))


def dequantizes_for(rows_per_expert: float) -> bool:
    """Whether a packed expert GEMM with this many rows per expert dequantizes to a bf16 scratch (on CUDA)."""
    return rows_per_expert >= PREFILL_ROWS and os.environ.get(PACKED_PREFILL_ENV, "dequant") != "kernel"


def expert_gemm_path(w, routes: int, x) -> str:
    """The path of a grouped GEMM of `routes` rows of x against the expert stack w (see the module docstring)."""
    if isinstance(w, Fp8Weight):
        return fp8_expert_path(w, routes, x, torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype)
    if not isinstance(w, PackedWeight):
        most = STREAM_SHORT_K_MAX_ROWS if w.shape[2] <= STREAM_SHORT_K else STREAM_MAX_ROWS
        if use_triton(x) and routes <= most * w.shape[0] and expert_gemm_choice() == "triton":
            return "stream"
        return "torch"
    if not use_triton(x):
        return "twin"
    if dequantizes_for(routes / w.shape[0]):
        return "dequant"
    return "q4-tiles" if w.layout == LAYOUT else "nvfp4-tiles" if w.layout == NVFP4_TILES else "packed"


def takes_f16_operand(w, routes: int, x) -> bool:
    """Whether the GEMM of x against w over `routes` rows runs ops/moe_q4.py's or ops/moe_nvfp4.py's kernel, whose
    MMA takes f16: then the producer of x may hand it the f16 operand of x's bf16 values (ops/f16_operand.py), same
    bits, less work."""
    return isinstance(w, PackedWeight) and expert_gemm_path(w, routes, x) in F16_PATHS


F16_PATHS = ("q4-tiles", "nvfp4-tiles")  # the paths whose kernels take an f16 operand as it is


def fp8_expert_path(w: Fp8Weight, routes: int, x, out_dtype) -> str:
    """The path of a grouped GEMM of `routes` rows of x (on its device) against the FP8 stack w, writing out_dtype."""
    if not x.is_cuda or out_dtype != torch.bfloat16 or not has_fp8_mma(x.device):
        return "fp8-twin"
    grouped = has_scaled_grouped_mm(x.device)
    if use_triton(x) and (expert_gemm_choice() == "triton" or not grouped):
        return "fp8-triton"
    return "fp8-torch" if grouped else "fp8-twin"
