"""The grouped GEMM that reads packed expert stacks (q4 / q5 / q6 / nvfp4, in the pack's byte order) without a
bf16 copy, and the dequantize kernel.

  grouped_mm_packed_triton  out[M, N] = xs @ W[g]^T for the rows of expert g (offs = cumulative ends, as
                            torch._grouped_mm), W a packed [E, N, K] stack. The weight tile is dequantized in
                            registers and fed straight to tl.dot (f32 accumulation). The product is computed
                            transposed (acc[BN, BM] = W_tile · x_tileᵀ, "swap AB"): N is large and rows per expert
                            are few at denoise (2048 routes / 128 experts ≈ 16), so N fills the MMA's wide side.
                            One program per (N tile, expert) loops over that expert's row tiles, so the grid is
                            fixed by shapes (graph-safe, no host sync) and every SM streams weights.
  launch_grouped            that kernel for any format, RAW (plain weights in x's dtype) included: ops/moe_stream.py
  dequantize_triton         the decode as a kernel: the prefill path dequantizes one layer's stack into a bf16
                            scratch and runs the CUTLASS grouped GEMM (ops/moe_paths.py, "dequant")
  grouped_mm_packed_ref     the twin: dequantize (ops/packed_weight.py), then the bf16 grouped GEMM
  expert_ffn_packed_ref     the twin of the packed expert FFN

A q4 stack re-laid in the q4-tiles order has its own kernels (ops/moe_q4.py); ops/moe.py chooses between them.
An nvfp4e stack re-laid in the nvfp4-tiles order (ops/packed_weight.py, on CUDA) is handed to ops/moe_nvfp4.py's
kernels by the two entry points here (grouped_mm_packed_triton, dequantize_triton).
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON
from .gelu_mul import gelu_mul_ref
from .grouped import gelu_after, grouped_mm_torch, route_count
from .layouts import GROUP, rows_k
from .moe_paths import STREAM_MAX_ROWS
from .moe_plan import order_operand
from . import moe_nvfp4
from .packed_weight import (  # noqa: F401  (also model/'s names for them)
    NVFP4_TILES, EXPERT_FORMATS, PackedWeight, dequantize)

# model/ imports these from here; their homes are ops/moe_paths.py and ops/q8_linear.py
from .moe_paths import PREFILL_ROWS, dequantizes_for, takes_f16_operand  # noqa: F401
from .q8_linear import linear, linear_ref  # noqa: F401

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .gelu_mul import glu_tile
    from .moe_nvfp4 import e2m1_f32, e4m3_f32
    from .moe_plan import expert_rows

_FMT_ID = {"q4": 0, "q5": 1, "q6": 2, "nvfp4": 3, "nvfp4e": 3}  # nvfp4e: nvfp4 + ESCALE
RAW = 4  # the grouped GEMM's FMT for unquantized weights (the bf16 streaming path of ops/moe_stream.py)
def grouped_mm_packed_ref(xs, w: PackedWeight, offs):
    return grouped_mm_torch(xs, dequantize(w, xs.dtype), offs)


def expert_ffn_packed_ref(xs, gate_up: PackedWeight, down: PackedWeight, offs):
    return grouped_mm_packed_ref(gelu_mul_ref(grouped_mm_packed_ref(xs, gate_up, offs)), down, offs)


# ----------------------------------------------------------------------------------------- Triton

if HAVE_TRITON:

    @triton.jit
    def _side_tile(p1, p2, p3, rows, row_ok, k0, K, FMT: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr,
                   BK: tl.constexpr):
        """The per-group planes of rows `rows` x columns k0..k0+BK: (hi bits, scale, min); past K they load as 0.

        Split from the decode because Triton's pipeliner leaves these loads synchronous (a thread's share is
        one or two bytes, under cp.async's four): the GEMM loads them one K-step ahead by hand, so their
        latency hides behind the current step's decode and dot instead of stalling every step."""
        kg = k0 // GS + tl.arange(0, BK // GS)
        gmask = row_ok[:, None] & (kg < K // GS)[None, :]
        if FMT == 3:  # nvfp4: e4m3 group scales (bytes); no min, no hi bits
            s = tl.load(p2 + rows[:, None] * (K // 16) + kg[None, :], mask=gmask, other=0)
            m = s
            h = s
        else:  # affine: f16 scale and min per group of 32
            s = tl.load(p2 + rows[:, None] * (K // 32) + kg[None, :], mask=gmask, other=0.0)
            m = tl.load(p3 + rows[:, None] * (K // 32) + kg[None, :], mask=gmask, other=0.0)
            h = s
            if FMT == 1:  # q5: one hi byte per 8 elements
                kh = k0 // 8 + tl.arange(0, BK // 8)
                h = tl.load(p1 + rows[:, None] * (K // 8) + kh[None, :], mask=row_ok[:, None] & (kh < K // 8)[None, :],
                            other=0)
            if FMT == 2:  # q6: one hi byte per 4 elements
                kh = k0 // 4 + tl.arange(0, BK // 4)
                h = tl.load(p1 + rows[:, None] * (K // 4) + kh[None, :], mask=row_ok[:, None] & (kh < K // 4)[None, :],
                            other=0)
        return h, s, m

    @triton.jit
    def _decode_tile(p0, h, s, m, tscale, rows, row_ok, k0, K,
                     FMT: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                     ESCALE: tl.constexpr, TDIV: tl.constexpr, tdiv):
        """Rows `rows` (int64 [BR]) x columns k0..k0+BK of a packed [R, K] tensor, as f32 [BR, BK], from its
        codes (loaded here) and its side planes (h, s, m) = _side_tile(..., k0).

        Columns past K come back 0 (their codes, scales and mins load as 0). GS: the group size (nvfp4 16).
        nvfp4: tscale the one tensor scale; with ESCALE (nvfp4e), tscale and tdiv are f32 [BR], each row's
        expert's multiplier and divisor (_row_escale), the divide an IEEE one and made only where TDIV."""
        kb = k0 // 2 + tl.arange(0, BK // 2)
        c = tl.load(p0 + rows[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None] & (kb < K // 2)[None, :], other=0)
        c = c.to(tl.int32)
        q = tl.reshape(tl.join(c & 0xF, c >> 4), (BR, BK // GS, GS))  # element 2j low nibble, 2j+1 high
        if FMT == 1:  # q5: bit 4 of element 8j+b is bit b of hi byte j
            hb = (h.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
            q = q | (tl.reshape(hb, (BR, BK // GS, GS)) << 4)
        if FMT == 2:  # q6: bits 4-5 of element 4j+b are bits 2b..2b+1 of hi byte j
            hb = (h.to(tl.int32)[:, :, None] >> (2 * tl.arange(0, 4))[None, None, :]) & 3
            q = q | (tl.reshape(hb, (BR, BK // GS, GS)) << 4)
        if FMT == 3:  # nvfp4: sign bit 3, e2m1 magnitude code in bits 0-2; e4m3 group scales; f32 tensor scale
            v = e2m1_f32(q)
            sc = e4m3_f32(s.to(tl.int32))
            if ESCALE:
                sc = sc * tscale[:, None]
                if TDIV:
                    sc = tl.math.div_rn(sc, tl.broadcast_to(tdiv[:, None], (BR, BK // GS)))
            else:
                sc = sc * tscale
            w = v * sc[:, :, None]
        else:
            w = q.to(tl.float32) * s.to(tl.float32)[:, :, None] + m.to(tl.float32)[:, :, None]
        return tl.reshape(w, (BR, BK))

    @triton.jit
    def _dequant_tile(p0, p1, p2, p3, tscale, rows, row_ok, k0, K,
                      FMT: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                      ESCALE: tl.constexpr, TDIV: tl.constexpr, tdiv):
        """_decode_tile with its side planes loaded right here (the dequantize kernel has no K loop to hide them in)."""
        h, s, m = _side_tile(p1, p2, p3, rows, row_ok, k0, K, FMT, GS, BR, BK)
        return _decode_tile(p0, h, s, m, tscale, rows, row_ok, k0, K, FMT, GS, BR, BK, ESCALE, TDIV, tdiv)

    @triton.jit
    def _row_escale(es_ptr, tscale, rows, row_ok, per, ESCALE: tl.constexpr):
        """(multiplier, divisor) for plane rows `rows`: nvfp4e's f32 [E, 2] pairs of each row's expert (rows // per),
        1 past the edge; else tscale (twice: nvfp4's one multiplier, and no divisor is read)."""
        if ESCALE:
            e = rows // per
            mul = tl.load(es_ptr + 2 * e, mask=row_ok, other=1.0)
            div = tl.load(es_ptr + 2 * e + 1, mask=row_ok, other=1.0)
        else:
            mul = tscale
            div = tscale
        return mul, div

    @triton.jit
    def _expert_tile(offs_ptr, order_ptr, N, BN: tl.constexpr, HAS_ORDER: tl.constexpr):
        """This program's share of a grouped GEMM (grid: N tiles x experts): expert g's routes start:end
        (offs = cumulative ends), its output columns n (valid where n_ok), and their plane rows g·N + n.
        HAS_ORDER: the experts are taken in the order given (ops/moe_plan.moe_plan_with_order: most rows first)."""
        g, start, end = expert_rows(offs_ptr, order_ptr, HAS_ORDER)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        return start, end, n, n < N, g.to(tl.int64) * N + n

    @triton.jit
    def _glu_tile(offs_ptr, order_ptr, N, BN: tl.constexpr, HAS_ORDER: tl.constexpr):
        """_expert_tile for a gate ‖ up stack [E, N = 2F, K] whose product goes straight into gelu·up (grid: F tiles
        of BN/2 x experts): the tile's rows are BN/2 gate rows, then the BN/2 up rows of the same columns; n: its
        BN/2 output columns of the [M, F] result."""
        g, start, end = expert_rows(offs_ptr, order_ptr, HAS_ORDER)
        F = N // 2
        j = tl.arange(0, BN)
        col = tl.program_id(0) * (BN // 2) + j % (BN // 2)
        rows = g.to(tl.int64) * N + col + tl.where(j >= BN // 2, F, 0)
        n = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
        return start, end, n, n < F, col < F, rows

    @triton.jit
    def _packed_gmm_kernel(x_ptr, src_ptr, out_ptr, offs_ptr, order_ptr, p0, p1, p2, p3, tscale, es_ptr, N, K,
                           stride_x, stride_o, FMT: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                           BK: tl.constexpr, HAS_SRC: tl.constexpr, PREFETCH: tl.constexpr, HAS_ORDER: tl.constexpr,
                           GLU: tl.constexpr = False, ESCALE: tl.constexpr = False, TDIV: tl.constexpr = False):
        if GLU:  # the store's columns (BN/2 of F) differ from the rows loaded (gate and up)
            start, end, n, n_ok, row_ok, rows = _glu_tile(offs_ptr, order_ptr, N, BN, HAS_ORDER)
        else:
            start, end, n, row_ok, rows = _expert_tile(offs_ptr, order_ptr, N, BN, HAS_ORDER)
            n_ok = row_ok
        tmul, tdiv = _row_escale(es_ptr, tscale, rows, row_ok, N, ESCALE)
        for m0 in range(start, end, BM):
            m = m0 + tl.arange(0, BM)
            m_ok = m < end
            if HAS_SRC:  # route m reads token row src[m] of x: the gather happens in this load
                x_rows = x_ptr + tl.load(src_ptr + m, mask=m_ok, other=0).to(tl.int64)[None, :] * stride_x
            else:
                x_rows = x_ptr + m[None, :].to(tl.int64) * stride_x
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            if FMT == 4:  # RAW: plain [E·N, K] weights in x's dtype (ops/moe_stream.py), nothing to decode
                for k0 in range(0, K, BK):
                    kk = k0 + tl.arange(0, BK)
                    xt = tl.load(x_rows + kk[:, None], mask=(kk < K)[:, None] & m_ok[None, :], other=0.0)
                    w = tl.load(p0 + rows[:, None] * K + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
                    acc = tl.dot(w, xt, acc)
            elif PREFETCH:  # side planes one K-step ahead (see _side_tile)
                h, s, mn = _side_tile(p1, p2, p3, rows, row_ok, 0, K, FMT, GS, BN, BK)
                for k0 in range(0, K, BK):
                    kk = k0 + tl.arange(0, BK)
                    h_next, s_next, mn_next = _side_tile(p1, p2, p3, rows, row_ok, k0 + BK, K, FMT, GS, BN, BK)
                    xt = tl.load(x_rows + kk[:, None], mask=(kk < K)[:, None] & m_ok[None, :], other=0.0)
                    w = _decode_tile(p0, h, s, mn, tmul, rows, row_ok, k0, K, FMT, GS, BN, BK, ESCALE, TDIV, tdiv)
                    acc = tl.dot(w.to(xt.dtype), xt, acc)
                    h, s, mn = h_next, s_next, mn_next
            else:  # side planes loaded in the step that uses them (the twin of the prefetch, for tests and A/B)
                for k0 in range(0, K, BK):
                    kk = k0 + tl.arange(0, BK)
                    xt = tl.load(x_rows + kk[:, None], mask=(kk < K)[:, None] & m_ok[None, :], other=0.0)
                    w = _dequant_tile(p0, p1, p2, p3, tmul, rows, row_ok, k0, K, FMT, GS, BN, BK, ESCALE, TDIV, tdiv)
                    acc = tl.dot(w.to(xt.dtype), xt, acc)
            out = acc.to(out_ptr.dtype.element_ty)
            if GLU:  # gate rows on top, up rows below; each rounded as the plain GEMM would store it
                out = glu_tile(out.to(tl.float32), BN, BM).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + m[None, :].to(tl.int64) * stride_o + n[:, None], out, mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _dequant_kernel(out_ptr, p0, p1, p2, p3, tscale, es_ptr, R, K, per,
                        FMT: tl.constexpr, GS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                        ESCALE: tl.constexpr = False, TDIV: tl.constexpr = False):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        r_ok = r < R
        k0 = tl.program_id(1) * BK
        kk = k0 + tl.arange(0, BK)
        tmul, tdiv = _row_escale(es_ptr, tscale, r.to(tl.int64), r_ok, per, ESCALE)
        w = _dequant_tile(p0, p1, p2, p3, tmul, r.to(tl.int64), r_ok, k0, K, FMT, GS, BR, BK, ESCALE, TDIV, tdiv)
        tl.store(out_ptr + r[:, None].to(tl.int64) * K + kk[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & (kk < K)[None, :])


def _plane_args(w: PackedWeight):
    """(p0, p1, p2, p3) kernel pointers: codes/lo, hi, scale, min (unused slots repeat p0)."""
    p = w.planes
    if w.fmt == "q4":
        return p["codes"], p["codes"], p["scale"].view(torch.float16), p["min"].view(torch.float16)
    if w.fmt in ("q5", "q6"):
        return p["lo"], p["hi"], p["scale"].view(torch.float16), p["min"].view(torch.float16)
    if w.fmt in ("nvfp4", "nvfp4e"):
        return p["codes"], p["codes"], p["scale"], p["codes"]
    raise TensorError(f"no packed GEMM kernel for format {w.fmt!r} (expert formats: {', '.join(EXPERT_FORMATS)})")


def _check_natural(w: PackedWeight, name: str, q4_name: str):
    if w.layout != "natural":
        raise TensorError(f"{name} reads the pack's byte order; a {w.layout} weight goes to ops/moe_q4.{q4_name} "
                          "(ops/moe.py chooses)")


# (BN, BM, BK, num_warps, num_stages). "stream": few rows per expert, weight-byte bound; "compute": many rows.
# stream: with the side planes prefetched, BN 128 / BK 64 / 4 warps for both q4 projections
# (docs/ARCHITECTURE.md, 'Kernel configurations').
CONFIGS = {"stream": (128, 32, 64, 4, 4), "compute": (128, 64, 64, 8, 3)}


def pick_config(m: int, experts: int) -> tuple:
    return CONFIGS["stream" if m <= STREAM_MAX_ROWS * experts else "compute"]


def grouped_mm_packed_triton(x, w: PackedWeight, offs, config: tuple | None = None, src=None, prefetch: bool = True,
                             order=None, out_dtype=None, glu: bool = False, glu_f16: bool = False):
    """x [M, K] (rows grouped by expert), or x [T, K] with src int [M] naming each route's row (the gather is
    done by the kernel's x loads); w packed [E, N, K], offs int32 [E] -> [M, N] in x.dtype. prefetch=False
    loads the scales in the K-step that uses them (for tests and A/B). order: int32 [E], the experts in the order
    their programs launch (the most rows first, from ops/moe_plan.moe_plan_with_order); the result does not depend
    on it. out_dtype: the result's (default x's; x is converted to it). glu: w is a gate ‖ up stack and the result is gelu_tanh(gate)·up [M, N/2]
    (gelu_mul of the plain result), made in the kernel's epilogue; glu_f16: as the f16 operand of its bf16 value
    (gelu_mul(as_f16=True) after the kernel), for a down GEMM that takes one."""
    E, N, K = w.shape
    M = route_count(x, src)
    if w.layout == NVFP4_TILES:  # its own kernel (config: only the row tile is taken)
        return moe_nvfp4.grouped_mm_nvfp4_tiles(x, w, offs, src=src, BM=config[1] if config else None, order=order,
                                                out_dtype=out_dtype, glu=glu, glu_f16=glu_f16)
    _check_natural(w, "grouped_mm_packed_triton", "grouped_mm_q4_tiles")
    x = x.contiguous() if out_dtype in (None, x.dtype) else x.to(out_dtype)
    if x.shape[1] != K:
        raise TensorError(f"grouped_mm_packed: x has K={x.shape[1]}, the packed weight {list(w.shape)} wants {K}")
    BN, BM, BK, warps, stages = config or pick_config(M, E)
    fused = glu and not glu_f16  # this kernel's epilogue writes x's dtype; the f16-operand form is gelu_mul's
    out = launch_grouped(x, src, offs, order, E, N, K, BN, BM, BK, warps, stages, fused, *_plane_args(w),
                         tscale=float(w.tscale), FMT=_FMT_ID[w.fmt], GS=GROUP[w.fmt], PREFETCH=prefetch,
                         escale=w.escale if w.fmt == "nvfp4e" else None, divides=w.divides)
    return out if fused else gelu_after(out, glu, glu_f16)


def launch_grouped(x, src, offs, order, E, N, K, BN, BM, BK, warps, stages, glu, p0, p1, p2, p3, *, tscale, FMT, GS,
                   PREFETCH, escale=None, divides=False):
    """_packed_gmm_kernel over (N tiles, experts), or with glu over (F = N/2 tiles of BN/2, experts) -> [M, N or F].
    escale: nvfp4e's f32 [E, 2] per-expert (multiplier, divisor) pairs (then tscale is unused); divides: whether
    any divisor is not 1."""
    if glu and N % 2:
        raise TensorError(f"grouped GEMM: a gate ‖ up stack needs an even N, got {N}")
    M = route_count(x, src)
    out = torch.empty(M, N // 2 if glu else N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    offs = offs.to(torch.int32).contiguous()
    grid = (triton.cdiv(N // 2, BN // 2) if glu else triton.cdiv(N, BN), E)
    _packed_gmm_kernel[grid](x, x if src is None else src.contiguous(), out, offs, order_operand(order, offs, E),
                             p0, p1, p2, p3, tscale, p0 if escale is None else escale, N, K, x.stride(0),
                             out.stride(0), FMT=FMT, GS=GS, BN=BN, BM=BM, BK=BK, HAS_SRC=src is not None,
                             PREFETCH=PREFETCH, HAS_ORDER=order is not None, GLU=glu, ESCALE=escale is not None,
                             TDIV=escale is not None and divides, num_warps=warps, num_stages=stages)
    return out


def dequantize_triton(w: PackedWeight, dtype=torch.bfloat16, out: torch.Tensor | None = None, BR: int = 32, BK: int = 256):
    """The packed tensor decoded by a kernel into `out` (or a new tensor) of its logical shape."""
    if w.layout == NVFP4_TILES:
        return moe_nvfp4.dequantize_nvfp4_tiles(w, dtype, out)
    _check_natural(w, "dequantize_triton", "dequantize_q4_tiles")
    R, K = rows_k(w.shape)
    out = torch.empty(w.shape, dtype=dtype, device=w.device) if out is None else out
    es = w.fmt == "nvfp4e"
    _dequant_kernel[(triton.cdiv(R, BR), triton.cdiv(K, BK))](
        out, *_plane_args(w), float(w.tscale), w.escale if es else out, R, K, R // w.shape[0] if es else 1,
        FMT=_FMT_ID[w.fmt], GS=GROUP[w.fmt], BR=BR, BK=BK, ESCALE=es, TDIV=es and w.divides, num_warps=4)
    return out
