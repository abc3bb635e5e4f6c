"""The grouped GEMM and the dequantize kernel of q4 expert stacks in the q4-tiles layout (ops/q4_tiles.py).

The math. Each weight is decoded in registers to f16 with one rounding: w = fma(16 + q, s, c), c = f16(min − 16·s)
(fma.rn.f16x2: two weights an instruction). x goes to f16 in the kernel (exact for bf16 values inside the f16
range; outside it, clamped to ±65504 instead of overflowing), unless its producer already wrote it so
(ops/f16_operand.py: the engine's attn_finish and gelu·up do), and the f16 MMA accumulates in f32 on a
loop-carried accumulator. Where the device has a tensor-memory accelerator (TMA) the planes come through it (one bulk copy per
plane and K step), elsewhere through cp.async: the same words, the same bits. The weights keep 11 bits where the
twin (dequantize, then the bf16 GEMM) keeps 8 (plus the one rounding of each group's c), so the kernel's products
sit closer to the exact ones than the twin's do (tests hold both to them); ops/q4_tiles.decode_f16 is the kernel's
decode in torch.

  grouped_mm_q4_tiles    the grouped GEMM (swap-AB, one program per (tile, expert) looping over row tiles; glu: with
                         gelu·up in the epilogue)
  dequantize_q4_tiles    the decode as a kernel, bit-identical to ops/packed_weight.dequantize (prefill path)
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, TensorDescriptor, tma_available
from .grouped import route_count
from .moe_plan import order_operand
from .q4_tiles import (  # noqa: F401  (to_tile_layout, wanted: model/engine_weights.py's names, kept here)
    GROUP, LAYOUT, TILE_N, check_tiles, glu_row_positions, side_words, to_natural_layout, to_tile_layout, wanted)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .f16_operand import f16_clamped, f16_operand
    from .gelu_mul import glu_tile
    from .moe_plan import expert_rows

# ----------------------------------------------------------------------------------------- Triton

if HAVE_TRITON:

    @triton.jit
    def per_group(v, n: tl.constexpr):
        """[R, GC] -> [R, GC·n]: each group's value repeated over its n columns."""
        R: tl.constexpr = v.shape[0]
        GC: tl.constexpr = v.shape[1]
        return tl.reshape(tl.broadcast_to(v[:, :, None], (R, GC, n)), (R, GC * n))

    @triton.jit
    def _scale_min(sm):
        """scale|min words [R, GC] -> (scale, min) as f32 [R, GC]."""
        s = (sm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return s, ((sm >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def word_register(wd, r: tl.constexpr):
        """Register r's source bits moved so that its two codes sit at bits 6..9 and 22..25 (plain ops)."""
        if r == 0:
            return wd
        elif r == 1:
            return wd << 4
        elif r == 2:
            return wd >> 4  # arithmetic: the sign fills bits 28..31, which no code field reads
        else:
            return (wd << 8) | ((wd >> 24) & 0xFF)

    @triton.jit
    def k_order(o0, o1, o2, o3, GC: tl.constexpr):
        """Register r's pairs [R, 4GC] (lo: slot r, hi: slot r + 4, f16 bits) -> f16 [R, 32GC] in k order. The join /
        reshape / permute only renames registers: Triton carries the MMA operand layout back to the word load."""
        R: tl.constexpr = o0.shape[0]
        o = tl.join(tl.join(o0, o1), tl.join(o2, o3))  # [R, 4GC, u, c]: register r = 2c + u
        lo = (o & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (o >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        v = tl.reshape(tl.join(lo, hi), (R, GC, 4, 2, 2, 2))  # [R, j, t, u, c, h]
        v = tl.permute(v, (0, 1, 4, 3, 2, 5))  # [R, j, c, u, t, h]: k = 32j + 16c + 8u + 2t + h
        return tl.reshape(v, (R, 32 * GC))

    @triton.jit
    def pair_f16(t, s, c):
        """Plain-op twin of one LOP3 + fma.rn.f16x2: the f16 bits of (16 + q)·s + c for the codes at 6..9, 22..25."""
        lo = (((t >> 6) & 0xF).to(tl.float32) + 16.0) * s + c
        hi = (((t >> 22) & 0xF).to(tl.float32) + 16.0) * s + c
        lo = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return lo | (hi << 16)

    @triton.jit
    def _decode(wd, sm, GC: tl.constexpr, ASM: tl.constexpr):
        """GC groups of a row tile: words int32 [R, 4GC], scale|min words int32 [R, GC] -> f16 weights [R, 32GC].

        ASM: per (row, group) two PRMTs and an fma make (s, s) and (c, c); per register one shift (none for
        register 0), one LOP3 and one fma.rn.f16x2. Otherwise the same bits with plain ops (the interpreter)."""
        if ASM:
            s2, c2 = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 k, m;
                mov.b32 k, 0xcc00cc00;
                prmt.b32 $0, $2, 0, 0x1010;
                prmt.b32 m, $2, 0, 0x3232;
                fma.rn.f16x2 $1, $0, k, m;
                }""", constraints="=r,=r,r", args=[sm], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
            s2, c2 = per_group(s2, 4), per_group(c2, 4)
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, u;
                lop3.b32 u, $4, 0x03c003c0, 0x4c004c00, 0xea;
                fma.rn.f16x2 $0, u, $5, $6;
                shl.b32 t, $4, 4;
                lop3.b32 u, t, 0x03c003c0, 0x4c004c00, 0xea;
                fma.rn.f16x2 $1, u, $5, $6;
                shr.u32 t, $4, 4;
                lop3.b32 u, t, 0x03c003c0, 0x4c004c00, 0xea;
                fma.rn.f16x2 $2, u, $5, $6;
                shf.l.wrap.b32 t, $4, $4, 8;
                lop3.b32 u, t, 0x03c003c0, 0x4c004c00, 0xea;
                fma.rn.f16x2 $3, u, $5, $6;
                }""",
                constraints="=r,=r,=r,=r,r,r,r", args=[wd, s2, c2], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True, pack=1)
        else:
            s32, m32 = _scale_min(sm)
            s, c = per_group(s32, 4), per_group((m32 - 16.0 * s32).to(tl.float16).to(tl.float32), 4)
            o0 = pair_f16(word_register(wd, 0), s, c)
            o1 = pair_f16(word_register(wd, 1), s, c)
            o2 = pair_f16(word_register(wd, 2), s, c)
            o3 = pair_f16(word_register(wd, 3), s, c)
        return k_order(o0, o1, o2, o3, GC)

    @triton.jit
    def _chunk(words, side, gc, nl, BN: tl.constexpr, GC: tl.constexpr):
        """Groups gc .. gc+GC-1 of a row tile: its words [BN, 4GC] and scale|min words [BN, GC]."""
        c = tl.arange(0, 4 * GC)
        wd = tl.load(words + (gc + c // 4)[None, :] * (BN * 4) + nl[:, None] * 4 + (c % 4)[None, :])
        sm = tl.load(side + (gc + tl.arange(0, GC))[None, :] * BN + nl[:, None])
        return wd, sm

    @triton.jit
    def _chunk_tma(wdesc, sdesc, tile, gc, G, BN: tl.constexpr, GC: tl.constexpr):
        """_chunk through the tensor-memory accelerator: the words seen as rows of 64 int32 (a group of a tile is
        BN/16 such rows: 16 tile rows of 4 words each), the side words likewise (a group is one row); one bulk copy
        each, then the same [BN, 4GC] and [BN, GC] in registers (the permute renames, as in k_order)."""
        raw = wdesc.load([(tile * G + gc) * (BN // 16), 0])  # [GC·BN/16, 64]
        wd = tl.reshape(tl.permute(tl.reshape(raw, (GC, BN // 16, 16, 4)), (1, 2, 0, 3)), (BN, 4 * GC))
        return wd, tl.trans(sdesc.load([tile * G + gc, 0]))

    @triton.jit
    def pass_rows(x_ptr, src_ptr, m0, end, stride_x, BM: tl.constexpr, HAS_SRC: tl.constexpr):
        """A row pass's routes m0 .. m0 + BM (m, m_ok: those before `end`) and their rows of x; HAS_SRC: route m reads
        token row src[m] of x, the gather happening in the loads."""
        m = m0 + tl.arange(0, BM)
        m_ok = m < end
        if HAS_SRC:
            tok = tl.load(src_ptr + m, mask=m_ok, other=0).to(tl.int64)
        else:
            tok = m.to(tl.int64)
        return m, m_ok, x_ptr + tok[None, :] * stride_x

    @triton.jit
    def store_pass(acc, out_ptr, m, m_ok, n, stride_o, BN: tl.constexpr, BM: tl.constexpr, GLU: tl.constexpr,
                   GU_ROUND: tl.constexpr, F16_OUT: tl.constexpr):
        """Store a row pass's f32 [BN, BM] products at columns n of routes m: plain in out's dtype, or with GLU
        gelu·up of the gate and up halves, from the products rounded as the plain GEMM stores them (GU_ROUND: none /
        bf16 / f16), as the f16 operand of its bf16 value with F16_OUT (what gelu_mul(as_f16=True) writes)."""
        if GLU:
            if GU_ROUND == 1:
                acc = acc.to(tl.bfloat16).to(tl.float32)
            elif GU_ROUND == 2:
                acc = acc.to(tl.float16).to(tl.float32)
            y = glu_tile(acc, BN, BM)
            if F16_OUT:
                out = f16_operand(y)
            else:
                out = y.to(out_ptr.dtype.element_ty)
        else:
            out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m[None, :].to(tl.int64) * stride_o + n[:, None], out, mask=m_ok[None, :])

    @triton.jit
    def _rows_pass(x_ptr, src_ptr, out_ptr, words, side, tile, m0, end, n, nl, K, stride_x, stride_o,
                   BN: tl.constexpr, BM: tl.constexpr, GC: tl.constexpr, HAS_SRC: tl.constexpr, ASM: tl.constexpr,
                   TMA: tl.constexpr, GLU: tl.constexpr, GU_ROUND: tl.constexpr, F16_OUT: tl.constexpr):
        """Rows m0 .. min(m0 + BM, end) of one expert times row tile `tile` of the stack. TMA: words and side are
        the planes' tensor descriptors; else pointers to this tile's words and side words. GLU: the tile is 32 gate
        rows then the up rows of the same columns (to_tile_layout(glu=True)); the pass stores gelu·up of them at
        the BN/2 columns n, from the products rounded as the plain GEMM stores them (GU_ROUND: none / bf16 / f16),
        as the f16 operand of its bf16 value with F16_OUT (what gelu_mul(as_f16=True) writes for the down GEMM)."""
        G = K // 32
        m, m_ok, x_rows = pass_rows(x_ptr, src_ptr, m0, end, stride_x, BM, HAS_SRC)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for gc in range(0, G, GC):  # all three loads are pipelined (TMA or cp.async) by Triton
            if TMA:
                wd, sm = _chunk_tma(words, side, tile, gc, G, BN, GC)
            else:
                wd, sm = _chunk(words, side, gc, nl, BN, GC)
            xt = tl.load(x_rows + (gc * 32 + tl.arange(0, 32 * GC))[:, None], mask=m_ok[None, :], other=0.0)
            if xt.dtype != tl.float16:  # f16 operands; bf16 is exact in f16 inside its range, clamped outside
                xt = f16_clamped(xt.to(tl.float32))
            acc = tl.dot(_decode(wd, sm, GC, ASM), xt, acc)
        store_pass(acc, out_ptr, m, m_ok, n, stride_o, BN, BM, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _rows_loop(x_ptr, src_ptr, out_ptr, words, side, tile, start, end, n, nl, K, stride_x, stride_o,
                   BN: tl.constexpr, BM: tl.constexpr, GC: tl.constexpr, HAS_SRC: tl.constexpr, ASM: tl.constexpr,
                   TMA: tl.constexpr, GLU: tl.constexpr, GU_ROUND: tl.constexpr, F16_OUT: tl.constexpr):
        """Rows start:end, BM at a time."""
        for m0 in range(start, end, BM):
            _rows_pass(x_ptr, src_ptr, out_ptr, words, side, tile, m0, end, n, nl, K, stride_x, stride_o,
                       BN, BM, GC, HAS_SRC, ASM, TMA, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _q4_tiles_gmm_kernel(x_ptr, src_ptr, out_ptr, offs_ptr, order_ptr, codes, sides, N, K, stride_x, stride_o,
                             BN: tl.constexpr, BM: tl.constexpr, BM_FEW: tl.constexpr, GC: tl.constexpr,
                             HAS_SRC: tl.constexpr, HAS_ORDER: tl.constexpr, ASM: tl.constexpr, TMA: tl.constexpr,
                             GLU: tl.constexpr = False, GU_ROUND: tl.constexpr = 0, F16_OUT: tl.constexpr = False):
        """One program per (row tile, expert). An expert with at most BM_FEW rows takes them in one BM_FEW-wide
        pass (balanced routing at denoise: 16); a longer one goes BM at a time, so the weights are not streamed
        twice for 17..BM rows (0 < BM_FEW < BM; BM_FEW = 0: always BM). HAS_ORDER: the experts are taken in
        the order given (the most rows first: the longest programs start first instead of ending the grid).
        The one-pass case is not written as a loop of one trip (a K loop inside a row loop: the same bits, more work).
        TMA: codes and sides are tensor descriptors of the two planes (devices with TMA), else plain pointers."""
        e, start, end = expert_rows(offs_ptr, order_ptr, HAS_ORDER)
        nl = tl.arange(0, BN)
        if GLU:  # the result's columns: BN/2 of F = N/2
            n = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
        else:
            n = tl.program_id(0) * BN + nl
        tile = e * (N // BN) + tl.program_id(0)
        if TMA:
            words, side = codes, sides
        else:
            G = K // 32
            words = codes.to(tl.pointer_type(tl.int32)) + tile.to(tl.int64) * G * BN * 4
            side = sides + tile.to(tl.int64) * G * BN
        if BM_FEW > 0:
            if end - start > BM_FEW:
                _rows_loop(x_ptr, src_ptr, out_ptr, words, side, tile, start, end, n, nl, K, stride_x, stride_o,
                           BN, BM, GC, HAS_SRC, ASM, TMA, GLU, GU_ROUND, F16_OUT)
            elif end > start:  # an expert no route chose streams nothing
                _rows_pass(x_ptr, src_ptr, out_ptr, words, side, tile, start, end, n, nl, K, stride_x, stride_o,
                           BN, BM_FEW, GC, HAS_SRC, ASM, TMA, GLU, GU_ROUND, F16_OUT)
        else:
            _rows_loop(x_ptr, src_ptr, out_ptr, words, side, tile, start, end, n, nl, K, stride_x, stride_o,
                       BN, BM, GC, HAS_SRC, ASM, TMA, GLU, GU_ROUND, F16_OUT)

    @triton.jit
    def _q4_tiles_dequant_kernel(out_ptr, codes, sides, N, K, GC: tl.constexpr, BN: tl.constexpr,
                                 GLU: tl.constexpr = False):
        tile = tl.program_id(0).to(tl.int64)  # (expert, row tile) flattened: tiles are consecutive in the planes
        G = K // 32
        nl = tl.arange(0, BN)
        words = codes.to(tl.pointer_type(tl.int32)) + tile * G * BN * 4
        wd, sm = _chunk(words, sides + tile * G * BN, tl.program_id(1) * GC, nl, BN, GC)
        s, mn = _scale_min(sm)
        s, mn = per_group(s, 32), per_group(mn, 32)
        # the codes in k order through the GEMM's own renaming, carried as f16 integers (exact)
        one = tl.full(wd.shape, 1.0, tl.float32)
        less16 = tl.full(wd.shape, -16.0, tl.float32)  # (16 + q)·1 − 16 = q
        q = k_order(pair_f16(word_register(wd, 0), one, less16), pair_f16(word_register(wd, 1), one, less16),
                    pair_f16(word_register(wd, 2), one, less16), pair_f16(word_register(wd, 3), one, less16), GC)
        w = q.to(tl.float32) * s + mn  # the twin's f32 expression (moe_packed.dequantize)
        rows = tile * BN + nl
        if GLU:  # back to logical rows from the glu tile order (glu_row_order)
            t = tile % (N // BN)
            rows = (tile - t) * BN + t * (BN // 2) + nl % (BN // 2) + tl.where(nl >= BN // 2, N // 2, 0)
        k = tl.program_id(1) * GC * 32 + tl.arange(0, 32 * GC)
        tl.store(out_ptr + rows[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty))


def _planes(w):
    return w.planes["codes"], side_words(w)


def group_chunk(G: int, most: int = 4) -> int:
    """Groups a K-step: the most (≤ `most`, a power of 2) that divides G."""
    gc = most
    while G % gc:
        gc //= 2
    return gc


def _descriptors(w, GC: int):
    """Tensor descriptors of a q4-tiles stack's word and side-word planes, both seen as rows of 64 int32: a K step
    (GC groups of a tile) is GC·TILE_N/16 rows of words and GC rows of side words."""
    codes, sides = _planes(w)
    return (TensorDescriptor.from_tensor(codes.view(torch.int32).view(-1, 64), [GC * TILE_N // 16, 64]),
            TensorDescriptor.from_tensor(sides.view(-1, 64), [GC, 64]))


def tile_gemm_operands(name: str, x, w_shape, src, out_dtype, glu: bool, glu_f16: bool):
    """The tile GEMMs' shared checks and output (this kernel's and ops/moe_nvfp4.py's): x contiguous and [rows, K]
    for a [E, N, K] weight, the output [M, N] (glu: [M, N/2], f16 with glu_f16) in out_dtype (default x's), and the
    epilogue's rounding code for the gate and up products (GU_ROUND: 1 bf16, 2 f16, 0 none) -> (x, out, GU_ROUND)."""
    K, N = w_shape[2], w_shape[1]
    M = route_count(x, src)
    x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != K:
        raise TensorError(f"{name}: x must be [rows, {K}] for the weight {list(w_shape)}, got {list(x.shape)}")
    gu_dtype = out_dtype or x.dtype
    out = torch.empty(M, N // 2 if glu else N, dtype=torch.float16 if glu and glu_f16 else gu_dtype, device=x.device)
    return x, out, {torch.bfloat16: 1, torch.float16: 2}.get(gu_dtype, 0)


def grouped_mm_q4_tiles(x, w, offs, src=None, BM: int = 32, BM_FEW: int = 16, asm: bool | None = None,
                        order=None, tma: bool | None = None, out_dtype=None, glu: bool = False, glu_f16: bool = False):
    """x [M, K] (rows grouped by expert), or x [T, K] with src int [M] naming each route's row; w a q4-tiles
    [E, N, K] stack; offs int32 [E] cumulative ends -> [M, N] in x.dtype. BM: rows a program takes at once;
    an expert with at most BM_FEW rows takes them in one narrower pass (0: never). At denoise 2048 routes /
    128 experts give ~16 an expert, so 16 / 32 covers both balanced and ragged routing with one weight pass.
    order: int32 [E], a permutation of the experts to launch them in (ops/moe_plan.moe_plan_with_order: the
    most rows first); the result does not depend on it. asm: the PTX decode (default: on CUDA). tma: the planes
    read by the tensor-memory accelerator (default: where available), else by cp.async; the same bits. out_dtype:
    the result's (default x's; an f16 x, ops/f16_operand.py's copy of bf16 activations, wants bfloat16). glu: w was
    laid with to_tile_layout(glu=True); -> gelu_tanh(gate)·up [M, N/2] made in the epilogue from the products
    rounded to out_dtype (gelu_mul of the plain result, same bits), as f16 operands with glu_f16. Without glu a
    glu-laid weight's product comes out in the glu tile order and is put back in column order (a copy)."""
    check_tiles(w)
    E, N, K = w.shape
    x, out, gu_round = tile_gemm_operands("grouped_mm_q4_tiles", x, w.shape, src, out_dtype, glu, glu_f16)
    if glu and not w.glu:
        raise TensorError("grouped_mm_q4_tiles: glu needs a weight laid with to_tile_layout(glu=True)")
    if out.shape[0] == 0:
        return out
    # 4 groups a step where K allows (gate_up, K = 2816); K = 704 (down) has 22 groups: 2 a step. Stages: 3 through
    # TMA, 4 through cp.async (docs/ARCHITECTURE.md, 'Kernel configurations').
    GC = group_chunk(K // GROUP)
    tma = tma_available(x) if tma is None else tma
    planes = _descriptors(w, GC) if tma else _planes(w)
    offs = offs.to(torch.int32).contiguous()
    _q4_tiles_gmm_kernel[(N // TILE_N, E)](
        x, x if src is None else src.contiguous(), out, offs, order_operand(order, offs, E),
        *planes, N, K, x.stride(0), out.stride(0), BN=TILE_N, BM=BM, BM_FEW=BM_FEW if BM_FEW < BM else 0,
        GC=GC, HAS_SRC=src is not None, HAS_ORDER=order is not None,
        ASM=x.is_cuda if asm is None else asm, TMA=tma, GLU=glu,
        GU_ROUND=gu_round, F16_OUT=glu and glu_f16, num_warps=4, num_stages=3 if tma else 4)
    if w.glu and not glu:  # column j holds logical column glu_row_order[j]
        out = out.index_select(1, glu_row_positions(N, out.device))
    return out


def dequantize_q4_tiles(w, dtype=torch.bfloat16, out: torch.Tensor | None = None):
    """The whole q4-tiles stack decoded by a kernel into `out` (or a new tensor), in its logical [E, N, K] shape."""
    check_tiles(w)
    E, N, K = w.shape
    out = torch.empty(w.shape, dtype=dtype, device=w.device) if out is None else out
    GC = group_chunk(K // GROUP)
    _q4_tiles_dequant_kernel[(E * N // TILE_N, K // GROUP // GC)](out, *_planes(w), N, K, GC=GC, BN=TILE_N,
                                                                  GLU=w.glu, num_warps=4)
    return out
