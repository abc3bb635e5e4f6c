"""x @ Wᵀ for a q8 weight (per-row symmetric: W[n, k] = codes[n, k] · scale[n]), reading the int8 codes in the GEMM.

The SC MLP of a packed model is q8 (every quantization profile keeps it so). Its torch form converts the whole [N, K]
code matrix to the activations' dtype every call (the codes are exact there, |code| <= 127) and scales the product's
rows after: at the full-size SC shapes most of its time is those conversions. Here the
kernel loads the codes as they lie (half the bytes of bf16), converts each tile in registers, accumulates in f32 and
scales the accumulator once, rounding once at the end.

  q8_linear_ref      the twin: x @ codes.to(x.dtype)ᵀ, then the row scale in f32 (the torch form)
  q8_linear_triton   the kernel
  q8_linear          the dispatcher: the kernel on CUDA, the twin elsewhere
  linear             x @ Wᵀ for a plain weight or a packed one (ops/packed_weight.py): q8 through q8_linear, other
                     formats dequantized first (linear_ref: the twin, dequantize then multiply)
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, use_triton
from .packed_weight import PackedWeight, dequantize

if HAVE_TRITON:
    import triton
    import triton.language as tl

# (BM, BN, BK, warps, stages) at the SC MLP's denoise shapes (256 x 2816 -> 4224, 256 x 2112 -> 2816), against the
# torch form (dequantize, then matmul) (docs/ARCHITECTURE.md, 'Kernel configurations'). A bf16 copy of the weights for
# cuBLAS would hold twice the weight bytes.
CONFIG = (128, 64, 128, 8, 3)


def _check(x, codes, scale):
    if x.dim() != 2 or codes.dim() != 2 or x.shape[1] != codes.shape[1]:
        raise TensorError(f"q8_linear: x {list(x.shape)} and codes {list(codes.shape)} do not make [M, K] x [N, K]")
    if codes.dtype != torch.int8 or scale.dtype != torch.float32 or scale.numel() != codes.shape[0]:
        raise TensorError(f"q8_linear: expected int8 codes and {codes.shape[0]} f32 row scales, got {codes.dtype} "
                          f"codes and {scale.numel()} {scale.dtype} scales")


def q8_linear_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check(x, codes, scale)
    y = x @ codes.to(x.dtype).T
    return (y.float() * scale.reshape(1, -1)).to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _q8_linear_kernel(x_ptr, c_ptr, s_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                        other=0.0)
            c = tl.load(c_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rn < N)[:, None] & (rk < K)[None, :],
                        other=0)
            acc = tl.dot(a, tl.trans(c.to(a.dtype)), acc)  # int8 codes are exact in bf16 / f16
        s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        y = acc * s[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def q8_linear_triton(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, config: tuple | None = None):
    _check(x, codes, scale)
    x, codes = x.contiguous(), codes.contiguous()
    M, K = x.shape
    N = codes.shape[0]
    BM, BN, BK, warps, stages = config or CONFIG
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _q8_linear_kernel[grid](x, codes, scale.contiguous(), y, M, N, K, BM=BM, BN=BN, BK=BK, num_warps=warps,
                            num_stages=stages)
    return y


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """-> [M, N] in x.dtype: x [M, K] @ (codes [N, K] int8 · scale [N] f32)ᵀ."""
    if use_triton(x) and x.dtype in (torch.bfloat16, torch.float16):
        return q8_linear_triton(x, codes, scale)
    return q8_linear_ref(x, codes, scale)


def linear_ref(x, w):
    return x @ (dequantize(w, x.dtype) if isinstance(w, PackedWeight) else w).T


def linear(x, w):
    """x [M, K] @ W^T for a plain [N, K] tensor or a packed q8 per-row weight (other formats: dequantized)."""
    if not isinstance(w, PackedWeight):
        return x @ w.T
    if w.fmt != "q8":
        return linear_ref(x, w)
    return q8_linear(x, w.planes["codes"].view(torch.int8), w.planes["scale"].view(torch.float32).reshape(-1))
