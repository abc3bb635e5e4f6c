"""Per-token (per-row) FP8 quantization of activations, made on the fly before each FP8 GEMM.

Row r of x [M, K] becomes e4m3 values q[r] = saturate(x[r] · (1 / s[r])) (round to nearest even) and one float32
scale s[r] = ops/fp8_weight.row_scale(max |x[r]|) = max(amax / 448, eps), so x[r] ≈ q[r] · s[r]. The scale is the
weights' rule; the values are multiplied by the scale's reciprocal (one IEEE division a row, not one a value, as
vLLM's FP8 quantization kernels do), where a weight is divided by its scale. Everything is per row (the max, the
reciprocal), so a row's bits never depend on the other rows of x: a batched lane quantizes as it would alone.

  quantize_rows_ref     the twin: torch ops in float32
  quantize_rows_triton  one program per row (the whole row in registers); the two divisions (amax / 448, 1 / s)
                        round correctly (div_rn), the product is one f32 rounding and the cast to e4m3 rounds to
                        nearest even, so the kernel's bits equal the twin's. In the Triton interpreter, whose float
                        -> e4m3 cast does not round to nearest, the kernel writes its float32 products and torch
                        casts them
  quantize_rows         the dispatcher: the kernel on CUDA, the twin elsewhere
  fake_quant_rows       q · s in float32: what a reference forward multiplies instead of x
  Fp8Rows               (q, s): rows in that form, as a producer hands them to the next FP8 GEMM
  store_fp8_row         the rule inside a Triton kernel, on one f32 row: the rms norms write the next GEMM's
                        operand with it (ops/rmsnorm.py, fp8 options); fp8_row_buffers / fp8_rows_done around it
  gelu_mul_quant        quantize_rows(gelu_mul(gu)) in one kernel on CUDA (the gated MLPs' down-projection input):
                        gelu_tanh(gate)·up by ops/gelu_mul.py's formula, rounded to gu's dtype as gelu_mul stores it,
                        then quantized as above: the bits of the two kernels one after the other
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, interpreting, next_pow2, use_triton
from .fp8_weight import FP8_DTYPE, FP8_MAX, SCALE_MIN, row_scale
from .gelu_mul import gelu_mul_ref

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .gelu_mul import gelu_tanh_mul


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise TensorError(f"quantize_rows: expected a float tensor [M, K], got {x.dtype} {list(x.shape)}")


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M])."""
    _check(x)
    s = row_scale(x.float().abs().amax(dim=-1))
    # a tensor numerator: CUDA would take a Python 1.0 over s as a product, not the IEEE quotient the kernels compute
    inv = torch.ones((), dtype=torch.float32, device=s.device) / s
    q = (x.float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


class Fp8Rows(NamedTuple):
    """Rows quantized per token: e4m3 values q [M, K] and float32 scales s [M] (row r ≈ q[r] · s[r])."""

    q: torch.Tensor
    s: torch.Tensor


def fp8_row_buffers(M: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) for a kernel that quantizes M rows of K with store_fp8_row: q in e4m3, or float32 products in the
    Triton interpreter (its float -> e4m3 cast does not round to nearest even); fp8_rows_done casts those."""
    q = torch.empty(M, K, dtype=torch.float32 if interpreting() else FP8_DTYPE, device=device)
    return q, torch.empty(M, dtype=torch.float32, device=device)


def fp8_rows_done(q: torch.Tensor, s: torch.Tensor) -> Fp8Rows:
    return Fp8Rows(q if q.dtype == FP8_DTYPE else q.to(FP8_DTYPE), s)


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """x as its per-row FP8 form represents it, in float32: q · s (the twin's quantization)."""
    q, s = quantize_rows_ref(x)
    return q.float() * s[:, None]


if HAVE_TRITON:

    @triton.jit
    def store_fp8_row(x, ok, q_ptr, s_ptr, r, stride_q, k, FMAX: tl.constexpr, SMIN: tl.constexpr):
        """Row r's per-token FP8 form from its f32 values x (masked lanes 0): s = max(amax / 448, SMIN) and
        q = saturate(x · (1 / s)), both divisions IEEE (div_rn, once a row), q cast to q_ptr's type (e4m3, round to
        nearest even; float32 products in the interpreter, see fp8_row_buffers)."""
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FMAX), SMIN)
        q = tl.clamp(x * tl.math.div_rn(1.0, s), -FMAX, FMAX)
        tl.store(q_ptr + r * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + r, s)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BK: tl.constexpr,
                              FMAX: tl.constexpr, SMIN: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BK)
        ok = k < K
        x = tl.load(x_ptr + r * stride_x + k, mask=ok, other=0.0).to(tl.float32)
        store_fp8_row(x, ok, q_ptr, s_ptr, r, stride_q, k, FMAX, SMIN)


if HAVE_TRITON:

    @triton.jit
    def _gelu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, F, stride_gu, stride_q, BF: tl.constexpr, FMAX: tl.constexpr,
                               SMIN: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BF)
        ok = k < F
        g = tl.load(gu_ptr + r * stride_gu + k, mask=ok, other=0.0)
        u = tl.load(gu_ptr + r * stride_gu + F + k, mask=ok, other=0.0)
        y = gelu_tanh_mul(g.to(tl.float32), u.to(tl.float32)).to(g.dtype).to(tl.float32)  # as gelu_mul stores it
        store_fp8_row(y, ok, q_ptr, s_ptr, r, stride_q, k, FMAX, SMIN)


def gelu_mul_quant_ref(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows_ref(gelu_mul_ref(gu))


def gelu_mul_quant_triton(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(gu)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    M, F = gu.shape[0], gu.shape[1] // 2
    q, s = fp8_row_buffers(M, F, gu.device)
    if M:
        BF = next_pow2(F)
        _gelu_mul_quant_kernel[(M,)](gu, q, s, F, gu.stride(0), q.stride(0), BF=BF, FMAX=FP8_MAX, SMIN=SCALE_MIN,
                                     num_warps=4 if BF <= 1024 else 8)
    return tuple(fp8_rows_done(q, s))


def gelu_mul_quant(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [M, 2F] (gate ‖ up) -> the per-row FP8 form of gelu_mul(gu): (e4m3 [M, F], float32 scales [M])."""
    if use_triton(gu):
        return gelu_mul_quant_triton(gu)
    return gelu_mul_quant_ref(gu)


def quantize_rows_triton(x: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q, s = fp8_row_buffers(M, K, x.device) if out is None else _check_out(out, M, K)
    if M:
        BK = next_pow2(K)
        _quantize_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BK=BK, FMAX=FP8_MAX, SMIN=SCALE_MIN,
                                    num_warps=4 if BK <= 2048 else 8)
    return tuple(fp8_rows_done(q, s)) if out is None else (q, s)


def _check_out(out, M: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = out
    if tuple(q.shape) != (M, K) or tuple(s.shape) != (M,) or q.stride(-1) != 1 or s.dtype != torch.float32:
        raise TensorError(f"quantize_rows: out expects q [{M}, {K}] (rows contiguous) and float32 s [{M}], got "
                          f"{q.dtype} {list(q.shape)} and {s.dtype} {list(s.shape)}")
    return q, s


def quantize_rows(x: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M]): the kernel on CUDA, the twin elsewhere. out: a (q, s) pair of
    fp8_row_buffers' kind (row slices of a larger pair, too) written instead and returned as written: fp8_rows_done
    of the whole pair makes its Fp8Rows once every slice is in."""
    if use_triton(x):
        return quantize_rows_triton(x, out)
    if out is None:
        return quantize_rows_ref(x)
    q, s = _check_out(out, *x.shape)
    ref_q, ref_s = quantize_rows_ref(x)
    q.copy_(ref_q)
    s.copy_(ref_s)
    return q, s
