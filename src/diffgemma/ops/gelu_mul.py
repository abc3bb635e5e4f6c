"""The gated activation of every MLP in the model: gelu_tanh(gate) · up, from one [M, 2F] GEMM output.

In f32, one rounding to the input dtype at the end (the torch chain of round 1 took five kernels:
two slices cast to f32, gelu, multiply, cast back).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._backend import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


def gelu_mul_ref(gu):
    f = gu.shape[-1] // 2
    return (F.gelu(gu[..., :f].float(), approximate="tanh") * gu[..., f:].float()).to(gu.dtype)


if HAVE_TRITON:

    @triton.jit
    def _gelu_mul_kernel(gu_ptr, out_ptr, Fh, C0: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < Fh
        g = tl.load(gu_ptr + row * 2 * Fh + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * Fh + Fh + cols, mask=ok, other=0.0).to(tl.float32)
        y = C0 * (g + 0.044715 * g * g * g)
        th = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)  # tanh, saturating cleanly at both ends
        tl.store(out_ptr + row * Fh + cols, (0.5 * g * (1.0 + th) * u).to(out_ptr.dtype.element_ty), mask=ok)


def gelu_mul_triton(gu, block: int = 1024):
    gu = gu.contiguous()
    M, F2 = gu.shape
    out = torch.empty(M, F2 // 2, dtype=gu.dtype, device=gu.device)
    if M:
        _gelu_mul_kernel[(M, triton.cdiv(F2 // 2, block))](gu, out, F2 // 2, C0=math.sqrt(2.0 / math.pi), BLOCK=block)
    return out


def gelu_mul(gu):
    return (gelu_mul_triton if use_triton(gu) else gelu_mul_ref)(gu)
