"""q4 expert stacks in the kernels' own byte order ("q4-tiles"), and the grouped GEMM that streams them.

Why a second layout. The packed GEMM of ops/moe_packed.py reads the pack's row-major planes: per K-step each
of a tile's rows gives 32 bytes from a different place in memory, and Triton reads the codes back from shared
memory a byte at a time to put them into the MMA's operand order (~11 instructions a weight, RESULTS round 9).
This layout is made once on the device when a q4 stack is loaded (`to_tile_layout`; the pack file does not
change) so that both problems go away:

  codes        for each (expert, tile of TILE_N output rows, group of 32 codes along K) the tile's rows are
               contiguous, 16 bytes a row; a row's 16 bytes are 4 little-endian words, word t holding the
               8 codes that lane t of an MMA quad needs: nibble p = r + 4h of word t is the code of
               k = 16·(r // 2) + 8·(r % 2) + 2t + h. One LOP3 (mask, then OR the exponent of 128) turns a
               word's nibbles r and r + 4 into the bf16 pair (128 + q_k, 128 + q_k+1) of one operand register.
  scale, min   for each (expert, tile, group) the tile's TILE_N f16 values contiguous.

The math. With q as exact integers in the MMA, a group's scale and min apply to the accumulator instead of to
every weight:  Σ_k w·x = s·Σ_k (128 + q)·x + (min − 128·s)·Σ_k x  over the 32 k of a group. Σ_k x comes from
a second MMA with an all-ones operand. No weight is rounded to bf16 (the twin, which dequantizes and then runs
the bf16 GEMM, does round them), so the kernel sits closer to the f32 product than the twin does; tests hold
both to an f32 reference.

  to_tile_layout         a q4 PackedWeight [E, N, K] -> the same weight in this layout (new record, same size)
  to_natural_layout      the inverse (a new record); natural_planes: the inverse as torch tensors (the twins read them)
  grouped_mm_q4_tiles    the grouped GEMM (swap-AB, one program per (tile, expert) looping over row tiles)
  dequantize_q4_tiles    the decode as a kernel, bit-identical to ops.moe_packed.dequantize (prefill path)
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ..quant.codecs import pack_nibbles, unpack_nibbles
from ._backend import HAVE_TRITON, env_choice

if HAVE_TRITON:
    import triton
    import triton.language as tl

LAYOUT = "q4-tiles"
TILE_N = 64  # output rows of a layout tile = the kernel's BN (64: 2x the programs of 128, same speed on the H200)
GROUP = 32


def tile_layout_ok(fmt: str, shape) -> bool:
    """Whether a packed tensor can take this layout: a q4 expert stack [E, N, K] with N a multiple of TILE_N."""
    return fmt == "q4" and len(shape) == 3 and shape[1] % TILE_N == 0 and shape[2] % GROUP == 0


ENV_VAR = "DIFFGEMMA_Q4_LAYOUT"  # "q4-tiles" (default) or "natural"; settings.py knows it by name


def wanted(fmt: str, shape, device) -> bool:
    """Whether the engine should load a stack in this layout (CUDA with Triton; DIFFGEMMA_Q4_LAYOUT=natural
    keeps the pack's order, for A/B against ops/moe_packed.py's kernel)."""
    return (HAVE_TRITON and torch.device(device).type == "cuda" and tile_layout_ok(fmt, shape)
            and env_choice(ENV_VAR, (LAYOUT, "natural")) == LAYOUT)


def _nibble_source(device) -> torch.Tensor:
    """For each of the 32 nibble slots of a group (slot 8t + p), the k (0..31) whose code it holds."""
    src = []
    for t in range(4):
        for p in range(8):
            r, h = p % 4, p // 4
            src.append(16 * (r // 2) + 8 * (r % 2) + 2 * t + h)
    return torch.tensor(src, dtype=torch.long, device=device)


def to_tile_layout(pw, experts_per_chunk: int = 8):
    """The q4 stack `pw` re-laid for the kernel, in a new record on pw's device (pw is left as it is: a source may
    share its record). Works `experts_per_chunk` experts at a time so the scratch stays small."""
    from .moe_packed import PackedWeight

    if not tile_layout_ok(pw.fmt, pw.shape) or pw.layout != "natural":
        raise TensorError(f"{LAYOUT}: needs a natural-order q4 stack [E, N, K] with N a multiple of {TILE_N}, "
                          f"got {pw.fmt} {list(pw.shape)} ({pw.layout})")
    E, N, K = pw.shape
    G, T = K // GROUP, N // TILE_N
    out = PackedWeight.from_record(pw.fmt, pw.shape, torch.empty_like(pw.record))
    perm = _nibble_source(pw.device)
    for e0 in range(0, E, experts_per_chunk):
        e1 = min(E, e0 + experts_per_chunk)
        rows = slice(e0 * N, e1 * N)
        q = unpack_nibbles(pw.planes["codes"][rows]).view(e1 - e0, T, TILE_N, G, GROUP)[..., perm]
        tiles = out.planes["codes"][rows].view(e1 - e0, T, G, TILE_N, GROUP // 2)
        tiles.copy_(pack_nibbles(q).permute(0, 1, 3, 2, 4))
        for name in ("scale", "min"):
            v = pw.planes[name][rows].view(e1 - e0, T, TILE_N, G, 2)
            out.planes[name][rows].view(e1 - e0, T, G, TILE_N, 2).copy_(v.permute(0, 1, 3, 2, 4))
    out.layout = LAYOUT
    return out


def to_natural_layout(pw):
    """The inverse of to_tile_layout: the same q4 stack in the pack's own order, in a new record."""
    from .moe_packed import PackedWeight

    _check(pw)
    out = PackedWeight.from_record(pw.fmt, pw.shape, torch.empty_like(pw.record))
    for name, t in natural_planes(pw).items():
        out.planes[name].copy_(t.view(torch.uint8).view(out.planes[name].shape))
    return out


def natural_planes(pw) -> dict:
    """codes uint8 [E·N, K/2], scale / min f16 [E·N, K/32] in the pack's own order, from a q4-tiles weight."""
    E, N, K = pw.shape
    G, T = K // GROUP, N // TILE_N
    inv = torch.argsort(_nibble_source(pw.device))
    q = unpack_nibbles(pw.planes["codes"].view(E, T, G, TILE_N, GROUP // 2))[..., inv]
    codes = pack_nibbles(q).permute(0, 1, 3, 2, 4).reshape(E * N, K // 2)
    side = {name: pw.planes[name].view(E, T, G, TILE_N, 2).permute(0, 1, 3, 2, 4).reshape(E * N, G * 2)
            .view(torch.float16) for name in ("scale", "min")}
    return {"codes": codes, **side}


# ----------------------------------------------------------------------------------------- Triton

if HAVE_TRITON:

    @triton.jit
    def _words_to_bf16(wd, ASM: tl.constexpr):
        """int32 [R, 4] (a group's code words, layout order) -> bf16 [R, 32] of 128 + q, in k order.

        ASM: one shift and one LOP3 a register in PTX (the GPU path); otherwise the same bits with plain ops
        (the interpreter's twin). The join / permute / reshape only renames registers: Triton carries the MMA
        operand layout back through them to the word load."""
        if ASM:
            o0, o1, o2, o3 = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t;
                lop3.b32 $0, $4, 0x000f000f, 0x43004300, 0xea;
                shr.u32 t, $4, 4;
                lop3.b32 $1, t, 0x000f000f, 0x43004300, 0xea;
                shr.u32 t, $4, 8;
                lop3.b32 $2, t, 0x000f000f, 0x43004300, 0xea;
                shr.u32 t, $4, 12;
                lop3.b32 $3, t, 0x000f000f, 0x43004300, 0xea;
                }""",
                constraints="=r,=r,=r,=r,r", args=[wd], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                pack=1)
        else:
            o0 = (wd & 0x000F000F) | 0x43004300
            o1 = ((wd >> 4) & 0x000F000F) | 0x43004300
            o2 = ((wd >> 8) & 0x000F000F) | 0x43004300
            o3 = ((wd >> 12) & 0x000F000F) | 0x43004300
        o = tl.join(tl.join(o0, o1), tl.join(o2, o3))  # [R, 4 (t), 2 (u), 2 (c)]: register r = 2c + u
        lo = (o & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (o >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        v = tl.permute(tl.join(lo, hi), (0, 3, 2, 1, 4))  # [R, c, u, t, h]: k = 16c + 8u + 2t + h
        return tl.reshape(v, (v.shape[0], 32))

    @triton.jit
    def _col(t, j: tl.constexpr, GC: tl.constexpr):
        """Column j of t [R, GC] (GC a power of 2), by splits: no data moves when a thread holds whole rows."""
        if GC == 1:
            return tl.reshape(t, (t.shape[0],))
        else:
            a, b = tl.split(tl.reshape(t, (t.shape[0], GC // 2, 2)))
            if j % 2 == 0:
                return _col(a, j // 2, GC // 2)
            else:
                return _col(b, j // 2, GC // 2)

    @triton.jit
    def _side_chunk(base, gc, nl, BN: tl.constexpr, GC: tl.constexpr):
        """A tile's f16 scales (or mins) for groups gc .. gc+GC-1, as [BN, GC]."""
        return tl.load(base + (gc + tl.arange(0, GC))[None, :] * BN + nl[:, None])

    @triton.jit
    def _rows_pass(x_ptr, src_ptr, out_ptr, words, sbase, mbase, start, end, n, nl, K, stride_x, stride_o,
                   BN: tl.constexpr, BM: tl.constexpr, GC: tl.constexpr, HAS_SRC: tl.constexpr, ASM: tl.constexpr,
                   PREC: tl.constexpr):
        """Rows start:end of one expert times one row tile of its weights, BM rows at a time."""
        G = K // 32
        ones = tl.full((BN, 32), 1.0, x_ptr.dtype.element_ty)
        for m0 in range(start, end, BM):
            m = m0 + tl.arange(0, BM)
            m_ok = m < end
            if HAS_SRC:  # route m reads token row src[m] of x: the gather happens in the loads
                tok = tl.load(src_ptr + m, mask=m_ok, other=0).to(tl.int64)
            else:
                tok = m.to(tl.int64)
            x_rows = x_ptr + tok[None, :] * stride_x
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            # the side planes one chunk ahead: Triton leaves such small loads synchronous (see moe_packed._side_tile)
            s_next = _side_chunk(sbase, 0, nl, BN, GC)
            m_next = _side_chunk(mbase, 0, nl, BN, GC)
            for gc in range(0, G, GC):
                s = s_next.to(tl.float32)
                mn = m_next.to(tl.float32) - 128.0 * s
                ahead = tl.minimum(gc + GC, G - GC)  # the last chunk reloads itself instead of reading past the tile
                s_next = _side_chunk(sbase, ahead, nl, BN, GC)
                m_next = _side_chunk(mbase, ahead, nl, BN, GC)
                for j in tl.static_range(GC):
                    g = gc + j
                    xt = tl.load(x_rows + (g * 32 + tl.arange(0, 32))[:, None], mask=m_ok[None, :], other=0.0)
                    wd = tl.load(words + g * BN * 4 + nl[:, None] * 4 + tl.arange(0, 4)[None, :])
                    d = tl.dot(_words_to_bf16(wd, ASM).to(xt.dtype), xt, input_precision=PREC)
                    acc = tl.fma(d, _col(s, j, GC)[:, None], acc)
                    xs = tl.dot(ones.to(xt.dtype), xt, input_precision=PREC)
                    acc = tl.fma(xs, _col(mn, j, GC)[:, None], acc)
            tl.store(out_ptr + m[None, :].to(tl.int64) * stride_o + n[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=m_ok[None, :])

    @triton.jit
    def _q4_tiles_gmm_kernel(x_ptr, src_ptr, out_ptr, offs_ptr, codes, scale, mins, N, K, stride_x, stride_o,
                             BN: tl.constexpr, BM: tl.constexpr, BM_FEW: tl.constexpr, GC: tl.constexpr,
                             HAS_SRC: tl.constexpr, ASM: tl.constexpr, PREC: tl.constexpr):
        """One program per (row tile, expert). An expert with at most BM_FEW rows takes them in one BM_FEW-wide
        pass (balanced routing at denoise: 16); a longer one goes BM at a time, so the weights are not streamed
        twice for 17..BM rows (0 < BM_FEW < BM; BM_FEW = 0: always BM)."""
        e = tl.program_id(1)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
        end = tl.load(offs_ptr + e)
        nl = tl.arange(0, BN)
        n = tl.program_id(0) * BN + nl
        G = K // 32
        tile = e.to(tl.int64) * (N // BN) + tl.program_id(0)
        words = codes.to(tl.pointer_type(tl.int32)) + tile * G * BN * 4
        sbase = scale + tile * G * BN
        mbase = mins + tile * G * BN
        if BM_FEW > 0:
            if end - start <= BM_FEW:
                _rows_pass(x_ptr, src_ptr, out_ptr, words, sbase, mbase, start, end, n, nl, K, stride_x, stride_o,
                           BN, BM_FEW, GC, HAS_SRC, ASM, PREC)
            else:
                _rows_pass(x_ptr, src_ptr, out_ptr, words, sbase, mbase, start, end, n, nl, K, stride_x, stride_o,
                           BN, BM, GC, HAS_SRC, ASM, PREC)
        else:
            _rows_pass(x_ptr, src_ptr, out_ptr, words, sbase, mbase, start, end, n, nl, K, stride_x, stride_o,
                       BN, BM, GC, HAS_SRC, ASM, PREC)

    @triton.jit
    def _q4_tiles_dequant_kernel(out_ptr, codes, scale, mins, N, K, GC: tl.constexpr, BN: tl.constexpr,
                                 ASM: tl.constexpr):
        tile = tl.program_id(0).to(tl.int64)  # (expert, row tile) flattened: tiles are consecutive in the planes
        G = K // 32
        nl = tl.arange(0, BN)
        rows = tile * BN + nl
        words = codes.to(tl.pointer_type(tl.int32)) + tile * G * BN * 4
        for j in tl.static_range(GC):
            g = tl.program_id(1) * GC + j
            wd = tl.load(words + g * BN * 4 + nl[:, None] * 4 + tl.arange(0, 4)[None, :])
            q = _words_to_bf16(wd, ASM).to(tl.float32) - 128.0
            s = tl.load(scale + (tile * G + g) * BN + nl).to(tl.float32)
            mn = tl.load(mins + (tile * G + g) * BN + nl).to(tl.float32)
            w = q * s[:, None] + mn[:, None]  # the twin's f32 expression (moe_packed.dequantize)
            tl.store(out_ptr + rows[:, None] * K + g * 32 + tl.arange(0, 32)[None, :], w.to(out_ptr.dtype.element_ty))


def _check(w):
    if w.layout != LAYOUT:
        raise TensorError(f"{LAYOUT} kernels need a weight made by to_tile_layout, got a {w.fmt} {list(w.shape)} "
                          f"in {w.layout} order")


def _planes(w):
    p = w.planes
    return p["codes"], p["scale"].view(torch.float16), p["min"].view(torch.float16)


def grouped_mm_q4_tiles(x, w, offs, src=None, BM: int = 32, BM_FEW: int = 16, asm: bool | None = None):
    """x [M, K] (rows grouped by expert), or x [T, K] with src int [M] naming each route's row; w a q4-tiles
    [E, N, K] stack; offs int32 [E] cumulative ends -> [M, N] in x.dtype. BM: rows a program takes at once;
    an expert with at most BM_FEW rows takes them in one narrower pass (0: never). At denoise 2048 routes /
    128 experts give ~16 an expert, so 16 / 32 covers both balanced and ragged routing with one weight pass.
    asm: the PTX decode (default: on CUDA)."""
    from .moe_packed import route_count

    _check(w)
    E, N, K = w.shape
    M = route_count(x, src)
    x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != K:
        raise TensorError(f"grouped_mm_q4_tiles: x must be [rows, {K}] for the weight {list(w.shape)}, "
                          f"got {list(x.shape)}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    G = K // GROUP
    _q4_tiles_gmm_kernel[(N // TILE_N, E)](
        x, x if src is None else src.contiguous(), out, offs.to(torch.int32).contiguous(), *_planes(w), N, K,
        x.stride(0), out.stride(0), BN=TILE_N, BM=BM, BM_FEW=BM_FEW if BM_FEW < BM else 0, GC=2 if G % 2 == 0 else 1,
        HAS_SRC=src is not None,
        ASM=x.is_cuda if asm is None else asm, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3)
    return out


def dequantize_q4_tiles(w, dtype=torch.bfloat16, out: torch.Tensor | None = None, asm: bool | None = None):
    """The whole q4-tiles stack decoded by a kernel into `out` (or a new tensor), in its logical [E, N, K] shape."""
    _check(w)
    E, N, K = w.shape
    out = torch.empty(w.shape, dtype=dtype, device=w.device) if out is None else out
    G = K // GROUP
    GC = 4 if G % 4 == 0 else (2 if G % 2 == 0 else 1)
    _q4_tiles_dequant_kernel[(E * N // TILE_N, G // GC)](out, *_planes(w), N, K, GC=GC, BN=TILE_N,
                                                         ASM=w.device.type == "cuda" if asm is None else asm,
                                                         num_warps=4)
    return out
