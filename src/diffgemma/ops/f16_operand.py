"""The f16 operand of a bf16 activation: what the q4 expert GEMM multiplies (ops/moe_q4.py).

The q4 kernel's MMA takes f16 operands, so it converts each bf16 x tile in its inner loop: exact for values in
f16's normal range (bf16 keeps 8 mantissa bits, f16 10), clamped to ±65504 outside it. A producer that writes
the expert input (attn_finish for gate_up, gelu_mul for down) can write that f16 copy instead; it rounds its f32
value to bf16 first, so the GEMM sees the very bits it would have made itself, and the kernel's loop converts
nothing.

  f16_operand_ref(t)   torch: t rounded to bf16, clamped to ±65504, as f16
  f16_operand(v)       the same inside a Triton kernel, on an f32 value
  f16_clamped(v)       its last step, f32 -> f16 clamped to ±65504 (the q4 GEMM's own conversion of a bf16 x)
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON

F16_MAX = 65504.0


def f16_operand_ref(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float().clamp(-F16_MAX, F16_MAX).half()


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def f16_clamped(v):
        return tl.clamp(v, -65504.0, 65504.0).to(tl.float16)

    @triton.jit
    def f16_operand(v):
        return f16_clamped(v.to(tl.bfloat16).to(tl.float32))
