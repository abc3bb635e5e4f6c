"""The grouped GEMM and the dequantize kernel of nvfp4e expert stacks in the nvfp4-tiles layout (ops/packed_weight.py),
with the structure of ops/moe_q4.py's (its word order, decode renaming, row passes and launch order).

The math. A weight's block part w = e2m1(code) · e4m3(scale) is exact in f16: e2m1 = a/2 and e4m3 = b/512 with a of
at most 2 and b of at most 4 significant bits, so w is a multiple of 2^-10 of at most 5 significant bits and
|w| <= 6 · 448. The MMA multiplies these f16 weights with x in f16 (x converted in the kernel, clamped to ±65504
outside the f16 range, as ops/moe_q4.py does) and accumulates in f32; each expert's tensor scale pair (mul, div) of
ops/layouts.py's nvfp4e is applied once to the f32 accumulator: out = fl(fl(acc · mul) / div). The twin
(packed_weight.dequantize, then the GEMM) rounds fl(fl(e4m3 · mul) / div) per block instead: the two agree to f32
rounding of the scale, inside the f16 operand's tolerance.

The decode (ASM, CUDA): per register of two codes (q4-tiles' bit placement: codes at bits 6..9 and 22..25, sign at 9
and 25) two shifts and masks put the e2m1 magnitude under f16's exponent and mantissa (bits 9..11) and the sign at
bit 15, which reads e2m1 · 2^-14 (for e = 0 an f16 subnormal); one mul.f16x2 by 2^14 and one by the group's (s, s)
pair give w, both exact. The e4m3 scale becomes that f16 pair once per group (e4m3_f32, exact in f16). Elsewhere
(the interpreter) the same bits with plain f32 ops (_pair_e2m1).

  grouped_mm_nvfp4_tiles    the grouped GEMM (swap-AB, one program per (64-row tile, expert) looping over row tiles;
                            glu: gate and up rows of the same 32 columns, gelu·up in the epilogue)
  dequantize_nvfp4_tiles    the decode as a kernel, bit-identical to ops/packed_weight.dequantize (prefill path)
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON
from .grouped import route_count
from .moe_paths import PREFILL_ROWS, STREAM_MAX_ROWS
from .moe_plan import order_operand
from .moe_q4 import group_chunk
from .packed_weight import CODE_GROUP, NVFP4_TILE_N, check_nvfp4_tiles

if HAVE_TRITON:
    import triton.language as tl
    import triton

    from .f16_operand import f16_clamped
    from .moe_plan import expert_rows
    from .moe_q4 import k_order, pair_f16, pass_rows, per_group, store_pass, word_register

# ----------------------------------------------------------------------------------------- Triton

if HAVE_TRITON:

    @triton.jit
    def e2m1_f32(q):
        """nvfp4 nibbles (sign bit 3, e2m1 magnitude code in bits 0-2), int32 -> f32 values."""
        mag = q & 7
        e = mag >> 1
        mb = (mag & 1).to(tl.float32)
        v = tl.where(e == 0, 0.5 * mb, (2.0 + mb) * tl.exp2((e - 2).to(tl.float32)))
        return tl.where((q & 8) != 0, -v, v)

    @triton.jit
    def e4m3_f32(b):
        """e4m3 block scale bytes (bias 7, positive), int32 -> f32 values."""
        be = (b >> 3) & 0xF
        bm = (b & 7).to(tl.float32)
        return tl.where(be == 0, bm * 0.001953125, (8.0 + bm) * tl.exp2((be - 10).to(tl.float32)))

    @triton.jit
    def _f16_pair(v):
        """f32 values exact in f16 -> the f16x2 bits (v, v) as int32."""
        h = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return h | (h << 16)

    @triton.jit
    def _pair_e2m1(t, s):
        """Plain-op twin of the ASM decode of one register: codes at bits 6..9 and 22..25, f32 scale s -> the f16x2
        bits of (e2m1 · s, e2m1' · s) (exact in f16: one rounding that changes nothing)."""
        lo = (e2m1_f32((t >> 6) & 0xF) * s).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = (e2m1_f32((t >> 22) & 0xF) * s).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return lo | (hi << 16)

    @triton.jit
    def _register_w(t, s, s2, ASM: tl.constexpr):
        """One register's two weights as f16x2 bits; s the group's f32 scale [R, 4GC], s2 its (s, s) f16x2 bits."""
        if ASM:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 a, b, k;
                mov.b32 k, 0x74007400;
                shl.b32 a, $1, 3;
                and.b32 a, a, 0x0e000e00;
                shl.b32 b, $1, 6;
                and.b32 b, b, 0x80008000;
                or.b32 a, a, b;
                mul.rn.f16x2 a, a, k;
                mul.rn.f16x2 $0, a, $2;
                }""", constraints="=r,r,r", args=[t, s2], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return _pair_e2m1(t, s)

    @triton.jit
    def _decode(wd, sp, GC: tl.constexpr, ASM: tl.constexpr):
        """GC groups of 32 codes of R rows: words int32 [R, 4GC], scale pairs int32 [R, GC] (byte 0: k 0..15 of the
        group, byte 1: k 16..31) -> f16 weights e2m1 · e4m3 [R, 32GC] in k order. Registers 0, 1 hold codes of
        k 0..15 of their group, registers 2, 3 of k 16..31 (ops/q4_tiles.py's slot order)."""
        lo, hi = e4m3_f32(sp & 0xFF), e4m3_f32((sp >> 8) & 0xFF)
        s_lo, s_hi = per_group(lo, 4), per_group(hi, 4)
        if ASM:  # (s, s) f16x2 pairs made once a group, then spread over its registers
            p_lo, p_hi = per_group(_f16_pair(lo), 4), per_group(_f16_pair(hi), 4)
        else:
            p_lo, p_hi = wd, wd  # unused
        return k_order(_register_w(word_register(wd, 0), s_lo, p_lo, ASM),
                       _register_w(word_register(wd, 1), s_lo, p_lo, ASM),
                       _register_w(word_register(wd, 2), s_hi, p_hi, ASM),
                       _register_w(word_register(wd, 3), s_hi, p_hi, ASM), GC)

    @triton.jit
    def _words(words, gc, rows, N, GC: tl.constexpr):
        """Groups gc .. gc+GC-1 of an expert's rows `rows`: their words int32 [R, 4GC]."""
        c = tl.arange(0, 4 * GC)
        return tl.load(words + ((gc + c // 4)[None, :] * N + rows[:, None]) * 4 + (c % 4)[None, :])

    @triton.jit
    def _scale_pairs(scales, gc, rows, N, G, GC: tl.constexpr):
        """Their scale pairs int32 [R, GC] (0 past the last group). Two bytes a row and group: under cp.async's four,
        so the GEMM loads them one K step ahead by hand (as ops/moe_packed._side_tile's)."""
        g = gc + tl.arange(0, GC)
        return tl.load(scales + g[None, :] * N + rows[:, None], mask=(g < G)[None, :], other=0).to(tl.int32)

    @triton.jit
    def _rows_pass(x_ptr, src_ptr, out_ptr, words, scales, rows, m0, end, n, N, K, stride_x, stride_o, mul, div,
                   BN: tl.constexpr, BM: tl.constexpr, GC: tl.constexpr, HAS_SRC: tl.constexpr, ASM: tl.constexpr,
                   DIVIDES: tl.constexpr, GLU: tl.constexpr, GU_ROUND: tl.constexpr, F16_OUT: tl.constexpr):
        """Rows m0 .. min(m0 + BM, end) of one expert times its weight rows `rows`, stored at columns n. GLU: rows
        are BN/2 gate rows then the up rows of the same columns; the pass stores gelu·up (as ops/moe_q4._rows_pass)."""
        m, m_ok, x_rows = pass_rows(x_ptr, src_ptr, m0, end, stride_x, BM, HAS_SRC)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        G = K // 32
        sp = _scale_pairs(scales, 0, rows, N, G, GC)
        for gc in range(0, G, GC):
            sp_next = _scale_pairs(scales, gc + GC, rows, N, G, GC)
            wd = _words(words, gc, rows, N, GC)
            xt = tl.load(x_rows + (gc * 32 + tl.arange(0, 32 * GC))[:, None], mask=m_ok[None, :], other=0.0)
            if xt.dtype != tl.float16:
                xt = f16_clamped(xt.to(tl.float32))
            acc = tl.dot(_decode(wd, sp, GC, ASM), xt, acc)
            sp = sp_next
        acc = acc * mul
        if DIVIDES:
            acc = tl.math.div_rn(acc, tl.zeros((BN, BM), dtype=tl.float32) + div)
        store_pass(acc, out_ptr, m, m_ok, n, stride_o, BN, BM, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _rows_loop(x_ptr, src_ptr, out_ptr, words, scales, rows, start, end, n, N, K, stride_x, stride_o, mul, div,
                   BN: tl.constexpr, BM: tl.constexpr, GC: tl.constexpr, HAS_SRC: tl.constexpr, ASM: tl.constexpr,
                   DIVIDES: tl.constexpr, GLU: tl.constexpr, GU_ROUND: tl.constexpr, F16_OUT: tl.constexpr):
        """Rows start:end, BM at a time."""
        for m0 in range(start, end, BM):
            _rows_pass(x_ptr, src_ptr, out_ptr, words, scales, rows, m0, end, n, N, K, stride_x, stride_o, mul, div,
                       BN, BM, GC, HAS_SRC, ASM, DIVIDES, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _nvfp4_tiles_gmm_kernel(x_ptr, src_ptr, out_ptr, offs_ptr, order_ptr, codes, scale_plane, es_ptr, N, K,
                                stride_x, stride_o, BN: tl.constexpr, BM: tl.constexpr, BM_FEW: tl.constexpr,
                                GC: tl.constexpr, HAS_SRC: tl.constexpr, HAS_ORDER: tl.constexpr, ASM: tl.constexpr,
                                DIVIDES: tl.constexpr, GLU: tl.constexpr = False, GU_ROUND: tl.constexpr = 0,
                                F16_OUT: tl.constexpr = False):
        """One program per (row tile, expert), rows taken as ops/moe_q4._q4_tiles_gmm_kernel takes them (one BM_FEW
        pass for an expert with at most BM_FEW rows, else BM at a time; HAS_ORDER: the experts in the order given)."""
        e, start, end = expert_rows(offs_ptr, order_ptr, HAS_ORDER)
        nl = tl.arange(0, BN)
        if GLU:  # the result's BN/2 columns of F = N/2: their gate rows, then their up rows
            n = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
            rows = tl.program_id(0) * (BN // 2) + nl % (BN // 2) + tl.where(nl >= BN // 2, N // 2, 0)
        else:
            n = tl.program_id(0) * BN + nl
            rows = n
        G = K // 32
        words = codes.to(tl.pointer_type(tl.int32)) + e.to(tl.int64) * G * N * 4
        scales = scale_plane.to(tl.pointer_type(tl.int16)) + e.to(tl.int64) * G * N
        mul = tl.load(es_ptr + 2 * e)
        div = tl.load(es_ptr + 2 * e + 1)
        if BM_FEW > 0:
            if end - start > BM_FEW:
                _rows_loop(x_ptr, src_ptr, out_ptr, words, scales, rows, start, end, n, N, K, stride_x, stride_o,
                           mul, div, BN, BM, GC, HAS_SRC, ASM, DIVIDES, GLU, GU_ROUND, F16_OUT)
            elif end > start:  # an expert no route chose streams nothing
                _rows_pass(x_ptr, src_ptr, out_ptr, words, scales, rows, start, end, n, N, K, stride_x, stride_o,
                           mul, div, BN, BM_FEW, GC, HAS_SRC, ASM, DIVIDES, GLU, GU_ROUND, F16_OUT)
        else:
            _rows_loop(x_ptr, src_ptr, out_ptr, words, scales, rows, start, end, n, N, K, stride_x, stride_o,
                       mul, div, BN, BM, GC, HAS_SRC, ASM, DIVIDES, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _nvfp4_tiles_dequant_kernel(out_ptr, codes, scale_plane, es_ptr, N, K, GC: tl.constexpr, BN: tl.constexpr,
                                    DIVIDES: tl.constexpr):
        """Program (expert · N/BN + row tile, K chunk of GC groups): the twin's f32 values e2m1 · fl(fl(e4m3 · mul)
        / div), the codes brought to k order by the GEMM's own renaming (as f16 integers, exact)."""
        T = N // BN
        e = (tl.program_id(0) // T).to(tl.int64)
        rows = (tl.program_id(0) % T) * BN + tl.arange(0, BN)
        G = K // 32
        words = codes.to(tl.pointer_type(tl.int32)) + e * G * N * 4
        scales = scale_plane.to(tl.pointer_type(tl.int16)) + e * G * N
        wd = _words(words, tl.program_id(1) * GC, rows, N, GC)
        sp = _scale_pairs(scales, tl.program_id(1) * GC, rows, N, G, GC)
        one = tl.full(wd.shape, 1.0, tl.float32)
        less16 = tl.full(wd.shape, -16.0, tl.float32)  # (16 + q)·1 − 16 = q
        q = k_order(pair_f16(word_register(wd, 0), one, less16), pair_f16(word_register(wd, 1), one, less16),
                    pair_f16(word_register(wd, 2), one, less16), pair_f16(word_register(wd, 3), one, less16), GC)
        s = tl.reshape(tl.join(e4m3_f32(sp & 0xFF), e4m3_f32((sp >> 8) & 0xFF)), (BN, 2 * GC))  # [R, k // 16]
        s = s * tl.load(es_ptr + 2 * e)
        if DIVIDES:
            s = tl.math.div_rn(s, tl.zeros((BN, 2 * GC), dtype=tl.float32) + tl.load(es_ptr + 2 * e + 1))
        w = e2m1_f32(q.to(tl.int32)) * per_group(s, 16)
        k = tl.program_id(1) * GC * 32 + tl.arange(0, 32 * GC)
        tl.store(out_ptr + (e * N + rows)[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty))


def _planes(w):
    return w.planes["codes"], w.planes["scale"], w.escale


def row_tile(routes: int, experts: int) -> int:
    """Rows a pass (BM) for `routes` rows over `experts`, by ops/moe.q4_row_tile's rule (the same kernel structure):
    32 at denoise (~16 an expert), 64 below PREFILL_ROWS an expert, 128 above."""
    per_expert = routes / experts
    return 32 if per_expert <= STREAM_MAX_ROWS else 64 if per_expert < PREFILL_ROWS else 128


def grouped_mm_nvfp4_tiles(x, w, offs, src=None, BM: int | None = None, BM_FEW: int = 16, asm: bool | None = None,
                           order=None, out_dtype=None, glu: bool = False, glu_f16: bool = False):
    """x [M, K] (rows grouped by expert), or x [T, K] with src int [M] naming each route's row; w an nvfp4-tiles
    [E, N, K] stack; offs int32 [E] cumulative ends -> [M, N] (glu: gelu_tanh(gate)·up [M, N/2] made in the
    epilogue from the products rounded to out_dtype, as f16 operands with glu_f16) in out_dtype (default x's).
    BM (default row_tile's) / BM_FEW / order as ops/moe_q4.grouped_mm_q4_tiles'; asm: the PTX decode (default: on
    CUDA)."""
    check_nvfp4_tiles(w)
    E, N, K = w.shape
    M = route_count(x, src)
    x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != K:
        raise TensorError(f"grouped_mm_nvfp4_tiles: x must be [rows, {K}] for the weight {list(w.shape)}, "
                          f"got {list(x.shape)}")
    gu_dtype = out_dtype or x.dtype
    out = torch.empty(M, N // 2 if glu else N, dtype=torch.float16 if glu and glu_f16 else gu_dtype, device=x.device)
    if M == 0:
        return out
    offs = offs.to(torch.int32).contiguous()
    BM = BM or row_tile(M, E)
    _nvfp4_tiles_gmm_kernel[(N // NVFP4_TILE_N, E)](
        x, x if src is None else src.contiguous(), out, offs, order_operand(order, offs, E), *_planes(w), N, K,
        x.stride(0), out.stride(0), BN=NVFP4_TILE_N, BM=BM, BM_FEW=BM_FEW if BM_FEW < BM else 0,
        GC=group_chunk(K // CODE_GROUP), HAS_SRC=src is not None, HAS_ORDER=order is not None,
        ASM=x.is_cuda if asm is None else asm, DIVIDES=w.divides, GLU=glu,
        GU_ROUND={torch.bfloat16: 1, torch.float16: 2}.get(gu_dtype, 0), F16_OUT=glu and glu_f16,
        num_warps=4, num_stages=4)
    return out


def dequantize_nvfp4_tiles(w, dtype=torch.bfloat16, out: torch.Tensor | None = None):
    """The whole nvfp4-tiles stack decoded by a kernel into `out` (or a new tensor), in its logical [E, N, K] shape."""
    check_nvfp4_tiles(w)
    E, N, K = w.shape
    out = torch.empty(w.shape, dtype=dtype, device=w.device) if out is None else out
    GC = group_chunk(K // CODE_GROUP)
    _nvfp4_tiles_dequant_kernel[(E * N // NVFP4_TILE_N, K // CODE_GROUP // GC)](
        out, *_planes(w), N, K, GC=GC, BN=NVFP4_TILE_N, DIVIDES=w.divides, num_warps=4)
    return out
