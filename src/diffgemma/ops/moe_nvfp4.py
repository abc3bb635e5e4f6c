"""The grouped GEMM and the dequantize kernel of nvfp4e expert stacks in the nvfp4-tiles layout (ops/packed_weight.py),
with the structure of ops/moe_q4.py's (its word order, decode renaming, row passes and launch order).

The math. A weight's block part w = e2m1(code) · e4m3(scale): e2m1 = a/2 and e4m3 = b/512 with a of at most 2 and
b of at most 4 significant bits (a subnormal e4m3 included), so w is a multiple of 2^-10 of at most 6 significant
bits, |w| <= 6 · 448. The MMA takes v = w · 2^-14 instead, which is exact in f16 too: a multiple of 2^-24 (f16's
subnormal step) of at most 6 significant bits, |v| <= 6 · 448 · 2^-14 < 0.17; below 2^-14 it is an f16 subnormal,
which f16 holds exactly (every multiple of 2^-24 there), above it 6 bits fit f16's 11. The MMA multiplies these f16
weights with x in f16 (x converted in the kernel, clamped to ±65504 outside the f16 range, as ops/moe_q4.py does)
and accumulates in f32. Every product v·x and partial sum is the one of w·x times 2^-14 (a power of two: f32 keeps
the same significand; the smallest product, 2^-24 · 2^-24, is far above f32's normal range), so multiplying the
accumulator by 2^14 gives the accumulator of the w operands bit for bit, and the rest of the epilogue is that of the
exact-w GEMM. Each expert's tensor scale pair (mul, div) of ops/layouts.py's nvfp4e is applied once to the f32
accumulator: out = fl(fl(acc · 2^14 · mul) / div) (acc · 2^14 exact). The twin (packed_weight.dequantize, then the
GEMM) rounds fl(fl(e4m3 · mul) / div) per block instead: the two agree to f32 rounding of the scale, inside the f16
operand's tolerance.

The decode (ASM, CUDA): the scale words (a row's four e4m3 bytes of two groups) become, per group, the f16x2 pair
(s_lo, s_hi) (_scale_f16x2: PRMT, shift, AND, one mul.f16x2 by 2^8, exact); per register of two codes at most two
shifts and two LOP3s put the e2m1 magnitudes under f16's exponent and mantissa (bits 9..11) and the signs at bit 15,
which reads e2m1 · 2^-14 (for e = 0 an f16 subnormal), and one mul.f16x2 by (s, s) gives v. Elsewhere (the
interpreter) the same values with plain f32 ops (_pair_w, _e4m3_pair).

The loads. Through a tensor-memory accelerator (TMA), where the device has one, the two planes come through tensor
descriptors (_descriptors), else through cp.async pointer loads: the same words, the same bits (which one runs by
default: default_tma; the pipeline depth: default_stages). The codes are seen as
[E·G, N/8, 32] int32 (a group's rows in runs of 8 rows × 4 words, one 128-byte line each) and a K step of a run of R
rows is one [GC, R/8, 32] box (an inner dimension of one swizzle line: one copy, where a [GC, 4R] box of the 2-D view
would be split into 4R/32 copies of a line's width); the scales as [E·G/2, N] int32, a [GC/2, R] box. A program's
rows are one run of R = BN: a gate ‖ up stack is laid in ops/q4_tiles.glu_row_order's order (packed_weight.py's
to_nvfp4_tiles(glu=True)), so its run is BN/2 gate rows then the up rows of the same columns, and the GEMM reads it
as it reads any other stack; the plain product of such a stack stores each row at its logical column (_glu_rows).

  grouped_mm_nvfp4_tiles    the grouped GEMM (swap-AB, one program per (64-row tile, expert) looping over row tiles;
                            glu: a glu-laid stack's gate and up rows of the same 32 columns, gelu·up in the epilogue)
  dequantize_nvfp4_tiles    the decode as a kernel, bit-identical to ops/packed_weight.dequantize (prefill path)
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, TensorDescriptor, tma_available
from .gelu_mul import gelu_mul_triton
from .moe_paths import tile_rows
from .moe_plan import order_operand
from .moe_q4 import group_chunk, tile_gemm_operands
from .packed_weight import CODE_GROUP, NVFP4_TILE_N, check_nvfp4_tiles

# The decode's PTX (tests/test_moe_nvfp4.py runs it through a small interpreter against the plain ops). A scale word's
# two groups -> their (s_lo, s_hi) f16x2 pairs:
SCALE_PTX = """{
.reg .b32 a, k;
mov.b32 k, 0x5c005c00;
prmt.b32 a, $2, 0, 0x4140;
shl.b32 a, a, 7;
and.b32 a, a, 0x3f803f80;
mul.rn.f16x2 $0, a, k;
prmt.b32 a, $2, 0, 0x4342;
shl.b32 a, a, 7;
and.b32 a, a, 0x3f803f80;
mul.rn.f16x2 $1, a, k;
}"""
# A word ($4) and its group's (s_lo, s_hi) pair ($5) -> the four registers' f16x2 weights (NVFP4_BITS' placement):
DECODE_PTX = """{
.reg .b32 a, b, l2, h2;
.reg .b16 l, h;
mov.b32 {l, h}, $5;
mov.b32 l2, {l, l};
mov.b32 h2, {h, h};
and.b32 a, $4, 0x8e008e00;
mul.rn.f16x2 $0, a, l2;
shl.b32 a, $4, 9;
and.b32 a, a, 0x8e008e00;
mul.rn.f16x2 $1, a, l2;
shl.b32 a, $4, 6;
shl.b32 b, $4, 8;
and.b32 b, b, 0x80008000;
lop3.b32 a, a, 0x0e000e00, b, 0xea;
mul.rn.f16x2 $2, a, h2;
shr.u32 a, $4, 3;
shl.b32 b, $4, 7;
and.b32 b, b, 0x80008000;
lop3.b32 a, a, 0x0e000e00, b, 0xea;
mul.rn.f16x2 $3, a, h2;
}"""

if HAVE_TRITON:
    import triton.language as tl
    import triton

    from .f16_operand import f16_clamped
    from .moe_plan import expert_rows
    from .moe_q4 import k_order, pass_rows, per_group, store_pass

    _SCALE_ASM = tl.constexpr(SCALE_PTX)
    _DECODE_ASM = tl.constexpr(DECODE_PTX)

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
    def _reg_codes(t, M: tl.constexpr, S: tl.constexpr):
        """Register codes (NVFP4_BITS: magnitude at M.., sign at S, the high half's 16 above) -> (lo, hi) nibbles."""
        lo = ((t >> M) & 7) | (((t >> S) & 1) << 3)
        hi = ((t >> (M + 16)) & 7) | (((t >> (S + 16)) & 1) << 3)
        return lo, hi

    @triton.jit
    def _f16x2_bits(lo, hi):
        """f32 values exact in f16 -> the f16x2 bits (lo, hi) as int32."""
        return ((lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
                | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16))

    @triton.jit
    def _pair_w(t, s, M: tl.constexpr, S: tl.constexpr):
        """Plain-op twin of one register of _decode's ASM: f16x2 bits of (e2m1 · s · 2^-14, e2m1' · s · 2^-14)."""
        lo, hi = _reg_codes(t, M, S)
        return _f16x2_bits(e2m1_f32(lo) * s * 0.00006103515625, e2m1_f32(hi) * s * 0.00006103515625)

    @triton.jit
    def _code_pair(t, M: tl.constexpr, S: tl.constexpr):
        """A register's two codes as f16 integers (f16x2 bits), for k_order's renaming."""
        lo, hi = _reg_codes(t, M, S)
        return _f16x2_bits(lo.to(tl.float32), hi.to(tl.float32))

    @triton.jit
    def _e4m3_pair(p):
        """Bytes 0 and 1 of p, e4m3 (sign dropped) -> f16x2 bits (plain ops)."""
        return _f16x2_bits(e4m3_f32(p & 0x7F), e4m3_f32((p >> 8) & 0x7F))

    @triton.jit
    def _scale_f16x2(sv, ASM: tl.constexpr):
        """Scale words [R, GC/2] -> the f16x2 bits (s_lo, s_hi) of each group's e4m3 pair [R, GC], exact. ASM: PRMT
        brings a group's two bytes under the halves' bits 0..7, << 7 makes e4m3 · 2^-8 in f16 bits (exponent and
        mantissa under f16's: a subnormal e4m3 becomes an f16 subnormal), one mul.f16x2 by 2^8; the sign bit is
        dropped, as e4m3_f32 does. Otherwise e4m3_f32 of the same bytes."""
        R: tl.constexpr = sv.shape[0]
        H: tl.constexpr = sv.shape[1]
        if ASM:
            even, odd = tl.inline_asm_elementwise(
                asm=_SCALE_ASM, constraints="=r,=r,r", args=[sv], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            even, odd = _e4m3_pair(sv), _e4m3_pair(sv >> 16)
        return tl.reshape(tl.join(even, odd), (R, 2 * H))

    @triton.jit
    def _decode(wd, sv, GC: tl.constexpr, ASM: tl.constexpr):
        """GC groups of 32 codes of R rows: words int32 [R, 4GC], scale words int32 [R, GC/2] -> f16 weights
        e2m1 · e4m3 · 2^-14 [R, 32GC] in k order (the GEMM multiplies its f32 result by 2^14).

        ASM: per register, the magnitudes brought to bits 9..11 and 25..27 and the signs to 15 and 31 (NVFP4_BITS:
        register 0 by one AND, 1 by a shift and an AND, 2 and 3 by two shifts, an AND and a LOP3), which reads
        e2m1 · 2^-14 (an f16 subnormal for e = 0), then one mul.f16x2 by the group half's (s, s) pair (a half of
        the group's (s_lo, s_hi) register, which ptxas takes as an operand swizzle); registers 0, 1 hold k 0..15
        of their group, 2, 3 k 16..31 (ops/q4_tiles.py's slot order)."""
        s2 = per_group(_scale_f16x2(sv, ASM), 4)
        if ASM:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                asm=_DECODE_ASM,
                constraints="=r,=r,=r,=r,r,r", args=[wd, s2], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True, pack=1)
        else:
            s_lo = (s2 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            s_hi = ((s2 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            o0 = _pair_w(wd, s_lo, 9, 15)
            o1 = _pair_w(wd, s_lo, 0, 6)
            o2 = _pair_w(wd, s_hi, 3, 7)
            o3 = _pair_w(wd, s_hi, 12, 8)
        return k_order(o0, o1, o2, o3, GC)

    @triton.jit
    def _words(words, gc, rows, N, GC: tl.constexpr):
        """Groups gc .. gc+GC-1 of an expert's rows `rows`: their words int32 [R, 4GC]."""
        c = tl.arange(0, 4 * GC)
        return tl.load(words + ((gc + c // 4)[None, :] * N + rows[:, None]) * 4 + (c % 4)[None, :])

    @triton.jit
    def _scale_words(scales, gc, rows, N, GC: tl.constexpr):
        """Groups gc .. gc+GC-1 (gc even) of rows `rows`: their scale words int32 [R, GC/2] (word j: the row's
        e4m3 scales of groups gc + 2j and gc + 2j + 1). Four bytes an element: Triton pipelines them with the codes."""
        j = gc // 2 + tl.arange(0, GC // 2)
        return tl.load(scales + j[None, :] * N + rows[:, None])

    @triton.jit
    def _words_tma(wdesc, eg, r0, R: tl.constexpr, GC: tl.constexpr):
        """_words through a descriptor of the codes seen as [E·G, N/8, 32]: rows r0 .. r0+R (r0 a multiple of 8) of
        code groups eg .. eg+GC-1 (eg = e·G + gc) in one [GC, R/8, 32] box, then [R, 4GC] (the permute renames)."""
        raw = wdesc.load([eg, r0 // 8, 0])
        return tl.reshape(tl.permute(tl.reshape(raw, (GC, R, 4)), (1, 0, 2)), (R, 4 * GC))

    @triton.jit
    def _scale_words_tma(sdesc, eg2, r0, R: tl.constexpr):
        """_scale_words through a descriptor of the scales seen as [E·G/2, N]: rows r0 .. r0+R of scale-word rows
        eg2 .. eg2+GC/2-1 (eg2 = (e·G + gc)/2) in one [GC/2, R] box, then [R, GC/2]."""
        return tl.trans(sdesc.load([eg2, r0]))

    @triton.jit
    def _glu_rows(t, N, BN: tl.constexpr):
        """The logical rows of positions t·BN .. t·BN+BN-1 of a glu-laid stack of N rows (ops/q4_tiles.glu_row_order):
        BN/2 gate rows from t·BN/2, then the up rows N/2 above them."""
        nl = tl.arange(0, BN)
        return t * (BN // 2) + nl % (BN // 2) + tl.where(nl >= BN // 2, N // 2, 0)

    @triton.jit
    def _chunk(words, scales, e, r0, gc, N, K, BN: tl.constexpr, GC: tl.constexpr, TMA: tl.constexpr):
        """Groups gc .. gc+GC-1 of the program's BN weight rows r0 .. r0+BN of expert e -> (words [BN, 4GC], scale
        words [BN, GC/2]). TMA: words and scales are the planes' descriptors (_descriptors), one box each; else
        pointers to expert e's planes."""
        if TMA:
            eg = e * (K // 32) + gc
            wd = _words_tma(words, eg, r0, BN, GC)
            sv = _scale_words_tma(scales, eg // 2, r0, BN)
        else:
            rows = r0 + tl.arange(0, BN)
            wd = _words(words, gc, rows, N, GC)
            sv = _scale_words(scales, gc, rows, N, GC)
        return wd, sv

    @triton.jit
    def _rows_pass(x_ptr, src_ptr, out_ptr, words, scales, e, r0, m0, end, n, N, K, stride_x, stride_o, mul,
                   div, BN: tl.constexpr, BM: tl.constexpr, GC: tl.constexpr, HAS_SRC: tl.constexpr,
                   ASM: tl.constexpr, TMA: tl.constexpr, DIVIDES: tl.constexpr, GLU: tl.constexpr,
                   GU_ROUND: tl.constexpr, F16_OUT: tl.constexpr):
        """Rows m0 .. min(m0 + BM, end) of expert e times its weight rows (_chunk's), stored at columns n. GLU: the
        rows are BN/2 gate rows then the up rows of the same columns; the pass stores gelu·up (as
        ops/moe_q4._rows_pass)."""
        m, m_ok, x_rows = pass_rows(x_ptr, src_ptr, m0, end, stride_x, BM, HAS_SRC)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for gc in range(0, K // 32, GC):  # the three loads pipelined by Triton (TMA or cp.async)
            wd, sv = _chunk(words, scales, e, r0, gc, N, K, BN, GC, TMA)
            xt = tl.load(x_rows + (gc * 32 + tl.arange(0, 32 * GC))[:, None], mask=m_ok[None, :], other=0.0)
            if xt.dtype != tl.float16:
                xt = f16_clamped(xt.to(tl.float32))
            acc = tl.dot(_decode(wd, sv, GC, ASM), xt, acc)
        acc = acc * 16384.0 * mul  # 2^14 first: exact (a power of two), so one rounding, as fl(acc · mul)
        if DIVIDES:
            acc = tl.math.div_rn(acc, tl.zeros((BN, BM), dtype=tl.float32) + div)
        store_pass(acc, out_ptr, m, m_ok, n, stride_o, BN, BM, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _rows_loop(x_ptr, src_ptr, out_ptr, words, scales, e, r0, start, end, n, N, K, stride_x, stride_o, mul,
                   div, BN: tl.constexpr, BM: tl.constexpr, GC: tl.constexpr, HAS_SRC: tl.constexpr,
                   ASM: tl.constexpr, TMA: tl.constexpr, DIVIDES: tl.constexpr, GLU: tl.constexpr,
                   GU_ROUND: tl.constexpr, F16_OUT: tl.constexpr):
        """Rows start:end, BM at a time."""
        for m0 in range(start, end, BM):
            _rows_pass(x_ptr, src_ptr, out_ptr, words, scales, e, r0, m0, end, n, N, K, stride_x, stride_o,
                       mul, div, BN, BM, GC, HAS_SRC, ASM, TMA, DIVIDES, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _nvfp4_tiles_gmm_kernel(x_ptr, src_ptr, out_ptr, offs_ptr, order_ptr, codes, scale_plane, es_ptr, N, K,
                                stride_x, stride_o, BN: tl.constexpr, BM: tl.constexpr, BM_FEW: tl.constexpr,
                                GC: tl.constexpr, HAS_SRC: tl.constexpr, HAS_ORDER: tl.constexpr, ASM: tl.constexpr,
                                TMA: tl.constexpr, DIVIDES: tl.constexpr, GLU_ORDER: tl.constexpr = False,
                                GLU: tl.constexpr = False, GU_ROUND: tl.constexpr = 0, F16_OUT: tl.constexpr = False):
        """One program per (row tile, expert), rows taken as ops/moe_q4._q4_tiles_gmm_kernel takes them (one BM_FEW
        pass for an expert with at most BM_FEW rows, else BM at a time; HAS_ORDER: the experts in the order given).
        TMA: codes and scale_plane are the planes' tensor descriptors (_descriptors), else the planes themselves.
        GLU_ORDER: the stack is glu-laid; GLU (on such a stack): gelu·up of the BN/2 columns of F = N/2 the tile's
        gate and up rows make, else each row's product at its logical column."""
        e, start, end = expert_rows(offs_ptr, order_ptr, HAS_ORDER)
        r0 = tl.program_id(0) * BN
        if GLU:
            n = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
        elif GLU_ORDER:
            n = _glu_rows(tl.program_id(0), N, BN)
        else:
            n = r0 + tl.arange(0, BN)
        if TMA:
            words, scales = codes, scale_plane
        else:
            G = K // 32
            words = codes.to(tl.pointer_type(tl.int32)) + e.to(tl.int64) * G * N * 4
            scales = scale_plane.to(tl.pointer_type(tl.int32)) + e.to(tl.int64) * (G // 2) * N
        mul = tl.load(es_ptr + 2 * e)
        div = tl.load(es_ptr + 2 * e + 1)
        if BM_FEW > 0:
            if end - start > BM_FEW:
                _rows_loop(x_ptr, src_ptr, out_ptr, words, scales, e, r0, start, end, n, N, K, stride_x,
                           stride_o, mul, div, BN, BM, GC, HAS_SRC, ASM, TMA, DIVIDES, GLU, GU_ROUND, F16_OUT)
            elif end > start:  # an expert no route chose streams nothing
                _rows_pass(x_ptr, src_ptr, out_ptr, words, scales, e, r0, start, end, n, N, K, stride_x,
                           stride_o, mul, div, BN, BM_FEW, GC, HAS_SRC, ASM, TMA, DIVIDES, GLU, GU_ROUND, F16_OUT)
        else:
            _rows_loop(x_ptr, src_ptr, out_ptr, words, scales, e, r0, start, end, n, N, K, stride_x, stride_o,
                       mul, div, BN, BM, GC, HAS_SRC, ASM, TMA, DIVIDES, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _nvfp4_tiles_dequant_kernel(out_ptr, codes, scale_plane, es_ptr, N, K, GC: tl.constexpr, BN: tl.constexpr,
                                    DIVIDES: tl.constexpr, GLU_ORDER: tl.constexpr):
        """Program (expert · N/BN + row tile, K chunk of GC groups): the twin's f32 values e2m1 · fl(fl(e4m3 · mul)
        / div), the codes brought to k order by the GEMM's own renaming (as f16 integers, exact), stored at their
        logical rows (GLU_ORDER: a glu-laid stack's, _glu_rows)."""
        T = N // BN
        e = (tl.program_id(0) // T).to(tl.int64)
        t = tl.program_id(0) % T
        rows = t * BN + tl.arange(0, BN)
        G = K // 32
        words = codes.to(tl.pointer_type(tl.int32)) + e * G * N * 4
        scales = scale_plane.to(tl.pointer_type(tl.int32)) + e * (G // 2) * N
        wd = _words(words, tl.program_id(1) * GC, rows, N, GC)
        sv = _scale_words(scales, tl.program_id(1) * GC, rows, N, GC)
        q = k_order(_code_pair(wd, 9, 15), _code_pair(wd, 0, 6), _code_pair(wd, 3, 7), _code_pair(wd, 12, 8), GC)
        b0, b1, b2, b3 = sv & 0x7F, (sv >> 8) & 0x7F, (sv >> 16) & 0x7F, (sv >> 24) & 0x7F
        s = tl.reshape(tl.join(tl.join(e4m3_f32(b0), e4m3_f32(b2)), tl.join(e4m3_f32(b1), e4m3_f32(b3))),
                       (BN, 2 * GC))  # [R, k // 16]
        s = s * tl.load(es_ptr + 2 * e)
        if DIVIDES:
            s = tl.math.div_rn(s, tl.zeros((BN, 2 * GC), dtype=tl.float32) + tl.load(es_ptr + 2 * e + 1))
        w = e2m1_f32(q.to(tl.int32)) * per_group(s, 16)
        k = tl.program_id(1) * GC * 32 + tl.arange(0, 32 * GC)
        if GLU_ORDER:
            rows = _glu_rows(t, N, BN)
        tl.store(out_ptr + (e * N + rows)[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty))


def _planes(w):
    return w.planes["codes"], w.planes["scale"], w.escale


def _descriptors(w, GC: int):
    """Tensor descriptors of an nvfp4-tiles stack's two planes, for a K step of GC code groups of a program's R =
    NVFP4_TILE_N rows: the codes as [E·G, N/8, 32] int32 (8 rows' words a line), boxes [GC, R/8, 32]; the scales as
    [E·G/2, N] int32, boxes [GC/2, R]."""
    codes, scales, _ = _planes(w)
    E, N, K = w.shape
    G = K // CODE_GROUP
    R = NVFP4_TILE_N
    return (TensorDescriptor.from_tensor(codes.view(torch.int32).view(E * G, N // 8, 32), [GC, R // 8, 32]),
            TensorDescriptor.from_tensor(scales.view(torch.int32).view(E * G // 2, N), [GC // 2, R]))


def default_tma(x, BM: int) -> bool:
    """Whether the GEMM reads the planes through TMA unless told: where the device has it (tma_available) and the row
    tile is below 128 rows (the denoise shapes, where the weights' bytes dominate and one bulk copy a plane and K step
    cuts the load instructions); at 128-row tiles (a batched denoise, a prefill) through cp.async, where the
    weights' bytes weigh less against the MMAs (docs/ARCHITECTURE.md, 'Kernel configurations')."""
    return tma_available(x) and BM < 128


def default_stages(tma: bool, BM: int) -> int:
    """The GEMM's pipeline stages unless given: through TMA 3, the depth ops/moe_q4.py's kernel of the same structure
    and about the same bytes a K step takes; through cp.async 4, and 3 at 128-row tiles, where the deeper pipeline's
    shared memory costs more than it hides."""
    return 3 if tma or BM >= 128 else 4


def grouped_mm_nvfp4_tiles(x, w, offs, src=None, BM: int | None = None, BM_FEW: int = 16, asm: bool | None = None,
                           order=None, out_dtype=None, glu: bool = False, glu_f16: bool = False, group_step: int = 4,
                           tma: bool | None = None, num_warps: int = 4, num_stages: int | None = None):
    """x [M, K] (rows grouped by expert), or x [T, K] with src int [M] naming each route's row; w an nvfp4-tiles
    [E, N, K] stack; offs int32 [E] cumulative ends -> [M, N] (glu: gelu_tanh(gate)·up [M, N/2] from the products
    rounded to out_dtype, as f16 operands with glu_f16) in out_dtype (default x's), columns in logical order.
    glu on a stack laid with to_nvfp4_tiles(glu=True) is made in the epilogue; on another, by the gelu·up kernel after
    the plain GEMM (the same bits, one more pass). BM (default moe_paths.tile_rows') / BM_FEW / order as
    ops/moe_q4.grouped_mm_q4_tiles'; asm: the PTX decode (default: on CUDA); group_step: the most code groups a K
    step (a power of 2; the most that divides K/32 is taken); tma: the planes read through tensor descriptors, else
    by cp.async, the same bits (default: default_tma's rule); num_warps / num_stages: the launch's (default stages:
    default_stages')."""
    check_nvfp4_tiles(w)
    E, N, K = w.shape
    fused = glu and w.glu
    x, out, gu_round = tile_gemm_operands("grouped_mm_nvfp4_tiles", x, w.shape, src, out_dtype, fused, glu_f16)
    M = out.shape[0]
    if M:
        offs = offs.to(torch.int32).contiguous()
        BM = BM or tile_rows(M, E)
        GC = group_chunk(K // CODE_GROUP, group_step)
        tma = default_tma(x, BM) if tma is None else tma
        planes = _descriptors(w, GC) if tma else _planes(w)[:2]
        _nvfp4_tiles_gmm_kernel[(N // NVFP4_TILE_N, E)](
            x, x if src is None else src.contiguous(), out, offs, order_operand(order, offs, E), *planes, w.escale, N,
            K, x.stride(0), out.stride(0), BN=NVFP4_TILE_N, BM=BM, BM_FEW=BM_FEW if BM_FEW < BM else 0,
            GC=GC, HAS_SRC=src is not None, HAS_ORDER=order is not None,
            ASM=x.is_cuda if asm is None else asm, TMA=tma, DIVIDES=w.divides, GLU_ORDER=w.glu, GLU=fused,
            GU_ROUND=gu_round, F16_OUT=fused and glu_f16,
            num_warps=num_warps, num_stages=num_stages or default_stages(tma, BM))
    return gelu_mul_triton(out, as_f16=glu_f16) if glu and not fused else out


def dequantize_nvfp4_tiles(w, dtype=torch.bfloat16, out: torch.Tensor | None = None):
    """The whole nvfp4-tiles stack decoded by a kernel into `out` (or a new tensor), in its logical [E, N, K] shape."""
    check_nvfp4_tiles(w)
    E, N, K = w.shape
    out = torch.empty(w.shape, dtype=dtype, device=w.device) if out is None else out
    GC = group_chunk(K // CODE_GROUP)
    _nvfp4_tiles_dequant_kernel[(E * N // NVFP4_TILE_N, K // CODE_GROUP // GC)](
        out, *_planes(w), N, K, GC=GC, BN=NVFP4_TILE_N, DIVIDES=w.divides, GLU_ORDER=w.glu, num_warps=4)
    return out
