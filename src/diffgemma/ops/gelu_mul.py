"""The gated activation of every MLP in the model: gelu_tanh(gate) · up, from one [M, 2F] GEMM output.

In f32, one rounding to the input dtype at the end, in one kernel (the torch chain takes five: two slices
cast to f32, gelu, multiply, cast back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import HAVE_TRITON, use_triton
from .f16_operand import f16_operand_ref

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .f16_operand import f16_operand


def gelu_mul_ref(gu, as_f16=False):
    f = gu.shape[-1] // 2
    y = F.gelu(gu[..., :f].float(), approximate="tanh") * gu[..., f:].float()
    return f16_operand_ref(y) if as_f16 else y.to(gu.dtype)


if HAVE_TRITON:

    @triton.jit
    def gelu_tanh_mul(g, u):
        """gelu_tanh(g) · u in f32; also the expert GEMMs' GLU epilogue (glu_tile, ops/moe_packed.py, moe_q4.py): one
        formula, so both give the same bits."""
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi)
        th = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)  # tanh, saturating cleanly at both ends
        return 0.5 * g * (1.0 + th) * u

    @triton.jit
    def glu_tile(acc, BN: tl.constexpr, BM: tl.constexpr):
        """gelu_tanh(gate)·up of a GEMM tile acc f32 [BN, BM] whose top BN/2 rows are gate rows and whose bottom BN/2
        are the up rows of the same columns (the streaming expert GEMMs' GLU tiles) -> f32 [BN/2, BM]."""
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BN // 2, BM)), (1, 2, 0)))
        return gelu_tanh_mul(gate, up)

    @triton.jit
    def _gelu_mul_kernel(gu_ptr, out_ptr, Fh, BLOCK: tl.constexpr, F16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < Fh
        g = tl.load(gu_ptr + row * 2 * Fh + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * Fh + Fh + cols, mask=ok, other=0.0).to(tl.float32)
        y = gelu_tanh_mul(g, u)
        if F16:
            tl.store(out_ptr + row * Fh + cols, f16_operand(y), mask=ok)
        else:
            tl.store(out_ptr + row * Fh + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def gelu_mul_triton(gu, block: int = 1024, as_f16=False):
    gu = gu.contiguous()
    M, F2 = gu.shape
    out = torch.empty(M, F2 // 2, dtype=torch.float16 if as_f16 else gu.dtype, device=gu.device)
    if M:
        _gelu_mul_kernel[(M, triton.cdiv(F2 // 2, block))](gu, out, F2 // 2, BLOCK=block, F16=as_f16)
    return out


def gelu_mul(gu, as_f16=False):
    """gelu_tanh(gate) · up in gu's dtype; as_f16: as the f16 operand of its bf16 value (ops/f16_operand.py), for
    the q4 expert GEMM."""
    if use_triton(gu):
        return gelu_mul_triton(gu, as_f16=as_f16)
    return gelu_mul_ref(gu, as_f16)
