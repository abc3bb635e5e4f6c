"""The expert FFN on FP8 tensor cores: Fp8Weight expert stacks (e4m3 [E, N, K], float32 row scales [E, N]), the
activations quantized per token (ops/fp8_quant.py) before each grouped GEMM.

    out[m, n] = (Σ_k q[m, k] · W[g, n, k]) · s_x[m] · s_w[g, n]   for the rows m of expert g (offs: cumulative ends)

  grouped_mm_fp8_ref     the twin: per expert, the same e4m3 values multiplied in float32 by torch
  grouped_mm_fp8_torch   torch._scaled_grouped_mm (row-wise scales; W passed as its column-major transpose)
  grouped_mm_fp8_triton  the Triton kernel: the product is computed transposed (acc[BN, BM] = W_tile · x_tileᵀ,
                         "swap AB", as ops/moe_packed.py) with both operands e4m3 and f32 accumulation; one program
                         per (N tile, expert) loops over that expert's row tiles, so the grid is fixed by shapes
                         (graph-safe, no host sync). Few rows per expert take narrow row tiles and stream the weights;
                         many (a batch of canvases, a prefill) take 128-row tiles. The K tile depends on K alone and
                         every K tile's products join the f32 sum as torch's kernel joins them, so a row's bits do not
                         depend on the tiles or on how many rows share its expert, and equal torch's.
  grouped_mm_fp8         the dispatcher: the path ops/moe_paths.fp8_expert_path names
  expert_ffn_fp8         quantize per token -> gate ‖ up GEMM -> gelu·up quantized per route (one kernel) -> down GEMM

With src (one row of x per token, src [M] naming each route's token) the token rows are quantized once and the
kernel gathers them in its loads; the torch paths gather the quantized rows and their scales first.
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON
from .fp8_linear import scaled_product_ref
from .fp8_quant import Fp8Rows, gelu_mul_quant, quantize_rows, quantize_rows_ref
from .fp8_weight import FP8_DTYPE, Fp8Weight
from .gelu_mul import gelu_mul_ref
from .grouped import route_count, routed
from .moe_paths import STREAM_MAX_ROWS, STREAM_SHORT_K, fp8_expert_path
from .moe_plan import order_operand

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .moe_plan import expert_rows

# (BN, BM, BK, num_warps, num_stages). The K tile is chosen by K alone (a row's bits depend on the K tiling); the
# other tiles by the rows an expert gets: up to STREAM_MAX_ROWS, narrow row tiles (CONFIG, CONFIG_SHORT_K); above,
# WIDE_CONFIG's 128-row tiles, for gate_up and down alike (more rows a pass: fewer passes over the weights);
# docs/ARCHITECTURE.md, 'Kernel configurations'.
# IMPRECISE: the K-elements the tensor cores may sum in their own reduced-precision accumulator before the sum joins
# the f32 accumulator (tl.dot's max_num_imprecise_acc, at most the K tile): one K tile's, 128 (as FP8 GEMMs without
# fast accumulation promote). None: Triton's default for the device (with wgmma: never, the whole K in the tensor
# cores' accumulator).
CONFIG = (64, 32, 128, 4, 4)
CONFIG_SHORT_K = (128, 32, 128, 8, 4)
WIDE_CONFIG = (64, 128, 128, 4, 3)
IMPRECISE = 128


def _check(q, s, w, src):
    if not isinstance(w, Fp8Weight) or len(w.shape) != 3:
        raise TensorError(f"grouped_mm_fp8: expected an Fp8Weight expert stack [E, N, K], got {type(w).__name__}")
    if q.dtype != FP8_DTYPE or q.dim() != 2 or q.shape[1] != w.shape[2]:
        raise TensorError(f"grouped_mm_fp8: x {q.dtype} {list(q.shape)} does not make e4m3 [M, K] x {list(w.shape)}")
    if s.dtype != torch.float32 or tuple(s.shape) != (q.shape[0],):
        raise TensorError(f"grouped_mm_fp8: x scales {s.dtype} {list(s.shape)}; expected float32 [{q.shape[0]}]")
    return route_count(q, src)


def grouped_mm_fp8_ref(q, s, w: Fp8Weight, offs, src=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """q e4m3 [M or T, K] with f32 scales s, w Fp8Weight [E, N, K], offs int32 [E] -> [M, N] in out_dtype.
    A per-expert loop (reads offs on the host): the twin, and the CPU path."""
    _check(q, s, w, src)
    q, s = routed(q, src), routed(s, src)
    out = torch.empty(q.shape[0], w.shape[1], dtype=out_dtype, device=q.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = scaled_product_ref(q[start:end], s[start:end], w.weight[g], w.scale[g], out_dtype)
        start = end
    return out


def grouped_mm_fp8_torch(q, s, w: Fp8Weight, offs, src=None) -> torch.Tensor:
    """torch._scaled_grouped_mm -> bf16 [M, N]."""
    _check(q, s, w, src)
    q, s = routed(q, src), routed(s, src)
    return torch._scaled_grouped_mm(q, w.weight.transpose(-2, -1), scale_a=s, scale_b=w.scale,
                                    offs=offs.to(torch.int32), out_dtype=torch.bfloat16)


if HAVE_TRITON:

    @triton.jit
    def _fp8_gmm_kernel(q_ptr, sx_ptr, src_ptr, w_ptr, sw_ptr, out_ptr, offs_ptr, order_ptr, N, K, stride_q,
                        stride_o, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_SRC: tl.constexpr,
                        HAS_ORDER: tl.constexpr, IMPRECISE: tl.constexpr):
        g, start, end = expert_rows(offs_ptr, order_ptr, HAS_ORDER)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        n_ok = n < N
        rows = g.to(tl.int64) * N + n  # rows of the [E·N, K] weight and of the [E·N] scales
        ws = tl.load(sw_ptr + rows, mask=n_ok, other=0.0)
        for m0 in range(start, end, BM):
            m = m0 + tl.arange(0, BM)
            m_ok = m < end
            if HAS_SRC:  # route m reads token row src[m]: the gather happens in these loads
                xr = tl.load(src_ptr + m, mask=m_ok, other=0).to(tl.int64)
            else:
                xr = m.to(tl.int64)
            xs = tl.load(sx_ptr + xr, mask=m_ok, other=0.0)
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                xt = tl.load(q_ptr + xr[None, :] * stride_q + kk[:, None], mask=(kk < K)[:, None] & m_ok[None, :],
                             other=0.0)
                w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :],
                            other=0.0)
                acc = tl.dot(w, xt, acc, max_num_imprecise_acc=IMPRECISE)
            y = acc * xs[None, :] * ws[:, None]
            tl.store(out_ptr + m[None, :].to(tl.int64) * stride_o + n[:, None], y.to(out_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & m_ok[None, :])


def pick_config(routes: int, experts: int, K: int) -> tuple:
    if routes > STREAM_MAX_ROWS * experts:
        return WIDE_CONFIG
    return CONFIG_SHORT_K if K <= STREAM_SHORT_K else CONFIG


def grouped_mm_fp8_triton(q, s, w: Fp8Weight, offs, src=None, order=None, config: tuple | None = None,
                          out_dtype=torch.bfloat16, imprecise: int | None = IMPRECISE) -> torch.Tensor:
    """q e4m3 [M, K] (rows grouped by expert) or [T, K] with src [M]; s f32 scales of q's rows; w Fp8Weight
    [E, N, K]; offs int32 [E]; order: the experts' launch order (the result does not depend on it) -> [M, N]."""
    M = _check(q, s, w, src)
    E, N, K = w.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(M, N, dtype=out_dtype, device=q.device)
    if M == 0:
        return out
    BN, BM, BK, warps, stages = config or pick_config(M, E, K)
    offs = offs.to(torch.int32).contiguous()
    _fp8_gmm_kernel[(triton.cdiv(N, BN), E)](
        q, s.contiguous(), q if src is None else src.contiguous(), w.weight.contiguous(), w.scale.contiguous(), out,
        offs, order_operand(order, offs, E), N, K, q.stride(0), out.stride(0), BN=BN, BM=BM, BK=BK,
        HAS_SRC=src is not None, HAS_ORDER=order is not None,
        IMPRECISE=None if imprecise is None else min(imprecise, BK), num_warps=warps,
        num_stages=stages)
    return out


def grouped_mm_fp8(q, s, w: Fp8Weight, offs, src=None, order=None, out_dtype=torch.bfloat16,
                   path_routes: int | None = None) -> torch.Tensor:
    """The grouped FP8 GEMM by the path ops/moe_paths.fp8_expert_path names for `path_routes` (default: q's routes)."""
    routes = route_count(q, src) if path_routes is None else path_routes
    path = fp8_expert_path(w, routes, q, out_dtype)
    if path == "fp8-triton":
        return grouped_mm_fp8_triton(q, s, w, offs, src=src, order=order, out_dtype=out_dtype)
    if path == "fp8-torch":
        return grouped_mm_fp8_torch(q, s, w, offs, src=src)
    return grouped_mm_fp8_ref(q, s, w, offs, src=src, out_dtype=out_dtype)


def expert_ffn_fp8(x, gate_up: Fp8Weight, down: Fp8Weight, offs, src=None, order=None, out_dtype=None,
                   path_routes: int | None = None) -> torch.Tensor:
    """The expert FFN over routes grouped by expert (as ops/moe.expert_ffn): x [M, H], or [T, H] per token with
    src [M] -> [M, H] in out_dtype (default x's). Each GEMM's input is quantized per row on the way in; x may come
    so already (ops/fp8_quant.Fp8Rows, from the norm that made it: ops/rmsnorm.attn_finish), then with out_dtype."""
    out_dtype = out_dtype or x.dtype
    q, s = x if isinstance(x, Fp8Rows) else quantize_rows(x.to(out_dtype))
    gu = grouped_mm_fp8(q, s, gate_up, offs, src=src, order=order, out_dtype=out_dtype, path_routes=path_routes)
    q, s = gelu_mul_quant(gu)
    return grouped_mm_fp8(q, s, down, offs, order=order, out_dtype=out_dtype, path_routes=path_routes)


def expert_ffn_fp8_ref(x, gate_up: Fp8Weight, down: Fp8Weight, offs, src=None, out_dtype=None) -> torch.Tensor:
    """The twin of expert_ffn_fp8: the same steps by torch ops."""
    out_dtype = out_dtype or x.dtype
    q, s = quantize_rows_ref(x.to(out_dtype))
    h = gelu_mul_ref(grouped_mm_fp8_ref(q, s, gate_up, offs, src=src, out_dtype=out_dtype))
    q, s = quantize_rows_ref(h)
    return grouped_mm_fp8_ref(q, s, down, offs, out_dtype=out_dtype)
