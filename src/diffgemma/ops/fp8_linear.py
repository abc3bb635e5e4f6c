"""x @ Wᵀ on FP8 tensor cores: W an Fp8Weight (e4m3 [N, K], float32 row scales [N]), x quantized per token.

    y[m, n] = (Σ_k q[m, k] · w[n, k]) · s_x[m] · s_w[n]     (f32 accumulation, rounded once to the output dtype)

with (q, s_x) = ops/fp8_quant.quantize_rows(x). Every factor is per row of x or per row of W, so a row of y depends
on its own row of x alone.

  fp8_linear_ref        the twin: the same quantized values, multiplied in float32 by torch
  fp8_linear_scaled_mm  torch._scaled_mm with row-wise scales (scale_a [M, 1], scale_b [1, N], bf16 out)
  fp8_linear_triton     a Triton kernel of the same product whose tiles are fixed by N and K alone (the K tile and
                        the tensor cores' partial sums, promoted every K tile, are the same for any M), so a row's
                        bits never depend on how many rows come with it; the path where KERNEL is "triton"
  fp8_linear            the dispatcher: on a CUDA device with FP8 tensor cores (compute capability 8.9+) for bf16
                        activations torch._scaled_mm (KERNEL "scaled_mm") or the Triton kernel (KERNEL "triton"),
                        the twin's product elsewhere
  fp8_linear_quantized  the same GEMM on an input already quantized (q, s)
  linear                x @ Wᵀ for any weight the engine holds: an Fp8Weight here, a plain or packed one through
                        ops/q8_linear.linear; x may come already quantized per token (ops/fp8_quant.Fp8Rows, from
                        the norm that made it: ops/rmsnorm.py) for an Fp8Weight
  gated_mlp             down(gelu_tanh(gate(x)) · up(x)) for any weights (gate ‖ up stacked); with an FP8 down
                        projection, gelu·up comes quantized per row from one kernel (ops/fp8_quant.gelu_mul_quant)
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, use_triton
from .fp8_quant import Fp8Rows, gelu_mul_quant, quantize_rows, quantize_rows_ref
from .fp8_weight import Fp8Weight, has_fp8_mma
from .gelu_mul import gelu_mul
from .q8_linear import linear as dense_or_packed_linear

if HAVE_TRITON:
    import triton
    import triton.language as tl

# Which FP8 GEMM the dispatcher runs on CUDA: "scaled_mm" (torch._scaled_mm) or "triton" (fp8_linear_triton).
KERNEL = "scaled_mm"
# (BM, BN, BK, num_warps, num_stages) of fp8_linear_triton; its BK and IMPRECISE fix a row's bits (any BM, BN).
CONFIG = (64, 128, 128, 4, 4)
IMPRECISE = 128  # as ops/fp8_moe.IMPRECISE: the tensor cores' partial sums join the f32 accumulator every K tile


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


if HAVE_TRITON:

    @triton.jit
    def _fp8_linear_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, stride_q, stride_o, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, IMPRECISE: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            a = tl.load(q_ptr + rm[:, None].to(tl.int64) * stride_q + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :],
                        other=0.0)
            b = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=n_ok[None, :] & (kk < K)[:, None],
                        other=0.0)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
        sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + rn, mask=n_ok, other=0.0)
        y = acc * sx[:, None] * sw[None, :]
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_triton(q: torch.Tensor, s: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype = torch.bfloat16,
                      config: tuple | None = None) -> torch.Tensor:
    """(q e4m3 [M, K], s f32 [M]) @ (w.weight · w.scale)ᵀ -> [M, N] in out_dtype, by the Triton kernel."""
    M, K = q.shape
    N = w.shape[0]
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=q.device)
    if M == 0:
        return out
    BM, BN, BK, warps, stages = config or CONFIG
    _fp8_linear_kernel[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
        q, s.contiguous(), w.weight.contiguous(), w.scale.contiguous(), out, M, N, K, q.stride(0), out.stride(0),
        BM=BM, BN=BN, BK=BK, IMPRECISE=min(IMPRECISE, BK), num_warps=warps, num_stages=stages)
    return out


def fp8_linear_quantized(q: torch.Tensor, s: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """(q e4m3 [M, K], s f32 [M]) @ (w.weight · w.scale)ᵀ -> [M, N] in out_dtype."""
    if (q.is_cuda and out_dtype == torch.bfloat16 and has_fp8_mma(q.device) and q.shape[1] % 16 == 0
            and w.shape[0] % 16 == 0):
        if KERNEL == "triton" and use_triton(q):
            return fp8_linear_triton(q, s, w, out_dtype)
        return torch._scaled_mm(q, w.weight.T, scale_a=s[:, None], scale_b=w.scale[None, :], out_dtype=out_dtype)
    return scaled_product_ref(q, s, w.weight, w.scale, out_dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ (w.weight · w.scale)ᵀ -> [M, N] in out_dtype (default x's), x quantized per row on the way."""
    _check(x, w)
    return fp8_linear_quantized(*quantize_rows(x), w, out_dtype or x.dtype)


def linear(x, w, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ Wᵀ for an Fp8Weight, a plain [N, K] tensor or a packed one, in x's dtype. x may be an Fp8Rows
    (x quantized per token by the op that made it) for an Fp8Weight; then out_dtype (x's dtype) is required."""
    if isinstance(x, Fp8Rows):
        if not isinstance(w, Fp8Weight) or out_dtype is None:
            raise TensorError(f"linear: per-token FP8 rows multiply an Fp8Weight with an out_dtype given, got "
                              f"{type(w).__name__} and out_dtype {out_dtype}")
        return fp8_linear_quantized(x.q, x.s, w, out_dtype)
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w)
    return dense_or_packed_linear(x, w)


def gated_mlp(x, gate_up, down, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gelu_tanh(gate) · up -> down projection, gate ‖ up one [2F, K] weight; any weights linear takes (x an
    Fp8Rows as linear takes it, with out_dtype)."""
    out_dtype = out_dtype or x.dtype
    h = linear(x, gate_up, out_dtype)
    if isinstance(down, Fp8Weight):
        return fp8_linear_quantized(*gelu_mul_quant(h), down, out_dtype)
    return linear(gelu_mul(h), down)
