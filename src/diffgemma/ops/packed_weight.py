"""Packed (quantized) weights on the device, and the torch twin of their decode.

A `PackedWeight` is one pack record (ops/layouts.py byte layout) uploaded to the device as it is: one uint8
buffer, with zero-copy [R, row_bytes] views of its planes. Every plane is 64-byte aligned in the record, so
the kernels may use wide typed loads on it. On CUDA a q4 expert stack is re-laid at load into the kernels'
"q4-tiles" byte order (ops/q4_tiles.py) and an nvfp4e stack into the "nvfp4-tiles" order (below; its kernels:
ops/moe_nvfp4.py); PackedWeight.layout says which.

  nvfp4-tiles  codes: for each (expert, group of 32 codes along K) the stack's N rows are contiguous, int32 [E, K/32,
               N, 4]: a row's 32 codes as 4 words in ops/q4_tiles.py's slot order (slot r + 4h of word t: k = 16·(r//2)
               + 8·(r%2) + 2t + h), each code's e2m1 magnitude (bits 0..2) and sign (bit 3) placed by NVFP4_BITS
               (register r: slots r and r + 4, at (m, s) and (m + 16, s + 16)) so that the kernel's decode of
               register r is at most two shifts and two LOP3s (ops/moe_nvfp4.py). scales: for each (expert, pair of
               groups) the N rows are contiguous, one int32 word a row [E, K/64, N]: the row's e4m3 scales of k
               64j .. 64j+63 (4 bytes, in k order: the pack's own scale bytes 4j .. 4j+3). escale as nvfp4e. Made at
               load on CUDA (from_record), same planes and sizes as nvfp4e; K a multiple of 64. A gate ‖ up stack
               (glu) has its rows in ops/q4_tiles.glu_row_order's order (PackedWeight.glu): the 64 rows of a GEMM
               program, 32 gate rows then the up rows of the same columns, are contiguous, so a K step of them is
               one box a plane, for the plain GEMM (which stores each row at its logical column) and for gelu·up.

  dequantize   the whole tensor decoded in f32 by torch ops, device-agnostic: the twin every packed kernel
               (ops/moe_packed.py, ops/moe_q4.py, ops/q8_linear.py) is compared with
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON
from .layouts import E2M1_VALUES, pack_nibbles, record_planes, rows_k, unpack_bits, unpack_nibbles
from .q4_tiles import GROUP as CODE_GROUP  # noqa: F401  (the codes of a q4-tiles word group: 4 int32 words)
from .q4_tiles import TILE_N, glu_row_order, glu_row_positions, natural_planes, nibble_source

EXPERT_FORMATS = ("q4", "q5", "q6", "nvfp4", "nvfp4e")
NVFP4_TILES = "nvfp4-tiles"
# output rows of a program of the nvfp4-tiles GEMM (ops/moe_nvfp4.py): N must be a multiple. q4's tile, so that one
# glu row order (ops/q4_tiles.glu_row_order) serves both layouts
NVFP4_TILE_N = TILE_N
# nvfp4-tiles: for register r of a word (slots r and r + 4), the low half's (magnitude bit 0, sign bit) positions; the
# high half's are 16 above. Register 0 sits where the decode wants it (9..11 and 15), 1 one shift away, 2 and 3 two.
NVFP4_BITS = ((9, 15), (0, 6), (3, 7), (12, 8))


@dataclass
class PackedWeight:
    """One quantized tensor on a device: its whole record (uint8) and zero-copy views of its planes."""

    fmt: str
    shape: tuple  # the logical tensor shape, K last ([E, N, K] for an expert stack, [N, K] for a linear)
    record: torch.Tensor  # uint8 [record_nbytes]
    planes: dict  # plane name -> uint8 [R, row_bytes] view into `record`
    tscale: float = 1.0  # nvfp4's per-tensor scale (read once at load: it is a kernel argument)
    layout: str = "natural"  # the pack's byte order, "q4-tiles" or "nvfp4-tiles" (made on the device at load)
    # q4-tiles and nvfp4-tiles: a gate ‖ up stack whose 64-row tiles hold 32 gate rows then the up rows of the same
    # columns (ops/q4_tiles.glu_row_order), so the GEMM can make gelu·up in its epilogue
    # (ops/q4_tiles.to_tile_layout(glu=True), to_nvfp4_tiles(glu=True)); the logical shape is unchanged
    glu: bool = False
    # nvfp4e only: whether any expert's divisor is not 1 (read once at load: the kernels divide only then)
    divides: bool = False

    @classmethod
    def from_record(cls, fmt: str, shape, record: torch.Tensor, layout: str | None = None,
                    glu: bool = False) -> "PackedWeight":
        """The record (in its pack order) as a weight; layout None: an nvfp4e stack is re-laid in the nvfp4-tiles
        order where its kernels run (nvfp4_tiles_wanted), "natural": never. glu: the stack is gate ‖ up; re-laid,
        it takes the glu row order (to_nvfp4_tiles(glu=True))."""
        shape = tuple(int(s) for s in shape)
        planes = record_planes(fmt, shape, record)
        tscale, divides = 1.0, False
        if fmt == "nvfp4":  # the one f32 tensor scale: a kernel argument, read to the host once
            tscale = float(planes["tscale"].cpu().view(torch.float32)[0, 0])
        if fmt == "nvfp4e":
            divides = bool((planes["escale"].cpu().view(torch.float32)[:, 1] != 1.0).any())
        pw = cls(fmt, shape, record, planes, tscale, divides=divides)
        if layout is None and nvfp4_tiles_wanted(fmt, shape, record.device):
            pw = to_nvfp4_tiles(pw, glu=glu)
        return pw

    @property
    def escale(self) -> torch.Tensor:
        """nvfp4e's per-expert (multiplier, divisor) pairs, f32 [E, 2] on the weight's device (ops/layouts.py)."""
        return self.planes["escale"].view(torch.float32)

    @property
    def nbytes(self) -> int:
        return self.record.numel()

    @property
    def device(self) -> torch.device:
        return self.record.device

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


_E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
_AFFINE_HI_BITS = {"q5": 1, "q6": 2}


def dequantize(pw: PackedWeight, dtype=torch.float32) -> torch.Tensor:
    """The whole tensor, decoded in f32 on its own device, returned as `dtype` in its logical shape."""
    r, k = rows_k(pw.shape)
    if pw.layout == "natural":
        p = pw.planes
    else:
        p = nvfp4_natural_planes(pw) if pw.layout == NVFP4_TILES else natural_planes(pw)
    if pw.fmt in ("q4", "q5", "q6"):
        q = unpack_nibbles(p["codes" if pw.fmt == "q4" else "lo"])
        if pw.fmt in _AFFINE_HI_BITS:
            q = q | (unpack_bits(p["hi"], _AFFINE_HI_BITS[pw.fmt]) << 4)
        s = p["scale"].view(torch.float16).float().unsqueeze(-1)
        m = p["min"].view(torch.float16).float().unsqueeze(-1)
        w = q.reshape(r, k // 32, 32).float() * s + m
    elif pw.fmt == "q8":
        w = p["codes"].view(torch.int8).float() * p["scale"].view(torch.float32)
    elif pw.fmt == "nvfp4":
        val = _E2M1.to(pw.device)[unpack_nibbles(p["codes"]).long()].reshape(r, k // 16, 16)
        w = val * (p["scale"].view(torch.float8_e4m3fn).float() * pw.tscale).unsqueeze(-1)
    elif pw.fmt == "nvfp4e":
        w = nvfp4e_decode(p["codes"], p["scale"], pw.escale.repeat_interleave(r // pw.shape[0], 0))
    else:
        raise TensorError(f"cannot dequantize format {pw.fmt!r}")
    return w.reshape(pw.shape).to(dtype)


def nvfp4e_decode(codes: torch.Tensor, scale: torch.Tensor, row_escale: torch.Tensor) -> torch.Tensor:
    """Rows of an nvfp4e stack (uint8 codes [R, K/2], e4m3 scales [R, K/16], f32 [R, 2] the (multiplier, divisor)
    of each row's expert) as f32 [R, K]: e2m1 · fl(fl(e4m3 · mul) / div), each step one f32 rounding."""
    r, half = codes.shape
    val = _E2M1.to(codes.device)[unpack_nibbles(codes).long()].reshape(r, half // 8, 16)
    s = scale.contiguous().view(torch.float8_e4m3fn).float() * row_escale[:, :1] / row_escale[:, 1:]
    return (val * s.unsqueeze(-1)).reshape(r, half * 2)


# ------------------------------------------------------------------------------------------- nvfp4-tiles

def nvfp4_tiles_ok(fmt: str, shape) -> bool:
    """Whether a stack can take the nvfp4-tiles layout: nvfp4e [E, N, K], N a multiple of NVFP4_TILE_N (then a
    gate ‖ up stack's F = N/2 is a multiple of its half), K of two code groups (the scale words)."""
    return fmt == "nvfp4e" and len(shape) == 3 and shape[1] % NVFP4_TILE_N == 0 and shape[2] % (2 * CODE_GROUP) == 0


def nvfp4_tiles_wanted(fmt: str, shape, device) -> bool:
    """Whether a stack is loaded in the nvfp4-tiles layout: where its kernels run (CUDA with Triton)."""
    return HAVE_TRITON and torch.device(device).type == "cuda" and nvfp4_tiles_ok(fmt, shape)


def pack_nvfp4_words(q: torch.Tensor) -> torch.Tensor:
    """nvfp4 codes [..., 32] in slot order -> int32 words [..., 4] in NVFP4_BITS' placement."""
    q = q.reshape(*q.shape[:-1], 4, 8).to(torch.int64)
    w = torch.zeros(q.shape[:-1], dtype=torch.int64, device=q.device)
    for r, (m, s) in enumerate(NVFP4_BITS):
        for h in (0, 1):
            v = q[..., r + 4 * h]
            w |= ((v & 7) << (m + 16 * h)) | (((v >> 3) & 1) << (s + 16 * h))
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)  # the same bits as int32


def unpack_nvfp4_words(w: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nvfp4_words: int32 words [..., 4] -> uint8 codes [..., 32] in slot order."""
    w = w.to(torch.int64) & 0xFFFFFFFF
    q = torch.zeros(*w.shape, 8, dtype=torch.int64, device=w.device)
    for r, (m, s) in enumerate(NVFP4_BITS):
        for h in (0, 1):
            q[..., r + 4 * h] = ((w >> (m + 16 * h)) & 7) | (((w >> (s + 16 * h)) & 1) << 3)
    return q.reshape(*w.shape[:-1], 32).to(torch.uint8)


def to_nvfp4_tiles(pw: PackedWeight, experts_per_chunk: int = 4, glu: bool = False) -> PackedWeight:
    """The natural nvfp4e stack `pw` re-laid in the nvfp4-tiles order, in a new record on its device (pw is left as
    it is), `experts_per_chunk` experts at a time so the scratch stays small. glu: pw is a gate ‖ up stack, its rows
    put in glu_row_order's order first (for the GEMM's gelu·up epilogue)."""
    if not nvfp4_tiles_ok(pw.fmt, pw.shape) or pw.layout != "natural":
        raise TensorError(f"{NVFP4_TILES}: needs a natural-order nvfp4e stack [E, N, K] with N a multiple of "
                          f"{NVFP4_TILE_N} and K of {2 * CODE_GROUP}, got {pw.fmt} {list(pw.shape)} ({pw.layout})")
    E, N, K = pw.shape
    G = K // CODE_GROUP
    record = pw.record.clone()  # the escale plane and the padding as they are; codes and scales rewritten below
    out = replace(pw, record=record, planes=record_planes(pw.fmt, pw.shape, record), layout=NVFP4_TILES, glu=glu)
    words = out.planes["codes"].view(torch.int32).view(E, G, N, 4)
    scales = out.planes["scale"].view(E, G // 2, N, 4)
    perm = nibble_source(pw.device)
    order = glu_row_order(N, pw.device) if glu else slice(None)  # position -> logical row
    for e0 in range(0, E, experts_per_chunk):
        e1 = min(E, e0 + experts_per_chunk)
        codes, scale = (pw.planes[n][e0 * N:e1 * N].view(e1 - e0, N, -1)[:, order] for n in ("codes", "scale"))
        q = unpack_nibbles(codes).view(e1 - e0, N, G, CODE_GROUP)[..., perm]
        words[e0:e1].copy_(pack_nvfp4_words(q).permute(0, 2, 1, 3))
        scales[e0:e1].copy_(scale.reshape(e1 - e0, N, G // 2, 4).permute(0, 2, 1, 3))
    return out


def nvfp4_natural_planes(pw: PackedWeight) -> dict:
    """codes uint8 [E·N, K/2], scale uint8 [E·N, K/16] in the pack's own order (a glu weight's rows back in logical
    order), from an nvfp4-tiles weight."""
    check_nvfp4_tiles(pw)
    E, N, K = pw.shape
    G = K // CODE_GROUP
    inv = torch.argsort(nibble_source(pw.device))
    q = unpack_nvfp4_words(pw.planes["codes"].view(torch.int32).view(E, G, N, 4))[..., inv]
    codes = pack_nibbles(q).permute(0, 2, 1, 3)
    scale = pw.planes["scale"].view(E, G // 2, N, 4).permute(0, 2, 1, 3)
    if pw.glu:  # logical row glu_row_order[j] sits at position j
        back = glu_row_positions(N, pw.device)
        codes, scale = codes[:, back], scale[:, back]
    return {"codes": codes.reshape(E * N, K // 2), "scale": scale.reshape(E * N, K // 16),
            "escale": pw.planes["escale"]}


def check_nvfp4_tiles(w):
    """Refuse a weight that is not in the nvfp4-tiles layout (its kernels read nothing else)."""
    if getattr(w, "layout", None) != NVFP4_TILES:
        raise TensorError(f"{NVFP4_TILES} kernels need a weight made by to_nvfp4_tiles, got a {w.fmt} "
                          f"{list(w.shape)} in {w.layout} order")
