"""x @ Wᵀ on FP8 tensor cores: W an Fp8Weight (e4m3 [N, K], float32 row scales [N]), x quantized per token.

    y[m, n] = (Σ_k q[m, k] · w[n, k]) · s_x[m] · s_w[n]     (f32 accumulation, rounded once to the output dtype)

with (q, s_x) = ops/fp8_quant.quantize_rows(x). Every factor is per row of x or per row of W, so a row of y depends
on its own row of x alone.

  fp8_linear_ref        the twin: the same quantized values, multiplied in float32 by torch
  fp8_linear_scaled_mm  torch._scaled_mm with row-wise scales (scale_a [M, 1], scale_b [1, N], bf16 out)
  fp8_linear            the dispatcher: torch._scaled_mm on a CUDA device that has FP8 tensor cores (compute
                        capability 8.9+) for bf16 activations, the twin's product elsewhere
  fp8_linear_quantized  the same GEMM on an input already quantized (q, s)
  linear                x @ Wᵀ for any weight the engine holds: an Fp8Weight here, a plain or packed one through
                        ops/q8_linear.linear
  gated_mlp             down(gelu_tanh(gate(x)) · up(x)) for any weights (gate ‖ up stacked); with an FP8 down
                        projection, gelu·up comes quantized per row from one kernel (ops/fp8_quant.gelu_mul_quant)
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from .fp8_quant import gelu_mul_quant, quantize_rows, quantize_rows_ref
from .fp8_weight import Fp8Weight, has_fp8_mma
from .gelu_mul import gelu_mul
from .q8_linear import linear as dense_or_packed_linear


def _check(x: torch.Tensor, w: Fp8Weight) -> None:
    if x.dim() != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[1]:
        raise TensorError(f"fp8_linear: x {list(x.shape)} and the FP8 weight {list(w.shape)} do not make "
                          "[M, K] x [N, K]")


def scaled_product_ref(q, s, wq, ws, out_dtype) -> torch.Tensor:
    """(q @ wqᵀ in f32) · s[:, None] · ws[None, :] -> out_dtype: the FP8 GEMM's math in torch (q, wq e4m3)."""
    acc = q.float() @ wq.float().T
    return (acc * s[:, None] * ws[None, :]).to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    _check(x, w)
    q, s = quantize_rows_ref(x)
    return scaled_product_ref(q, s, w.weight, w.scale, out_dtype or x.dtype)


def fp8_linear_scaled_mm(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    _check(x, w)
    q, s = quantize_rows(x)
    return torch._scaled_mm(q, w.weight.T, scale_a=s[:, None], scale_b=w.scale[None, :],
                            out_dtype=out_dtype or x.dtype)


def fp8_linear_quantized(q: torch.Tensor, s: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """(q e4m3 [M, K], s f32 [M]) @ (w.weight · w.scale)ᵀ -> [M, N] in out_dtype."""
    if (q.is_cuda and out_dtype == torch.bfloat16 and has_fp8_mma(q.device) and q.shape[1] % 16 == 0
            and w.shape[0] % 16 == 0):
        return torch._scaled_mm(q, w.weight.T, scale_a=s[:, None], scale_b=w.scale[None, :], out_dtype=out_dtype)
    return scaled_product_ref(q, s, w.weight, w.scale, out_dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ (w.weight · w.scale)ᵀ -> [M, N] in out_dtype (default x's), x quantized per row on the way."""
    _check(x, w)
    return fp8_linear_quantized(*quantize_rows(x), w, out_dtype or x.dtype)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [M, K] @ Wᵀ for an Fp8Weight, a plain [N, K] tensor or a packed one, in x's dtype."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w)
    return dense_or_packed_linear(x, w)


def gated_mlp(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """gelu_tanh(gate) · up -> down projection, gate ‖ up one [2F, K] weight; any weights linear takes."""
    h = linear(x, gate_up)
    if isinstance(down, Fp8Weight):
        return fp8_linear_quantized(*gelu_mul_quant(h), down, x.dtype)
    return linear(gelu_mul(h), down)
