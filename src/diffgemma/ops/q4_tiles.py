"""q4 expert stacks in the kernels' own byte order ("q4-tiles"): the layout and its conversions, in torch.

Why a second layout. The packed GEMM of ops/moe_packed.py reads the pack's row-major planes: per K-step each
of a tile's rows gives 32 bytes from a different place in memory, and Triton reads the codes back from shared
memory a byte at a time to put them into the MMA's operand order (about 11 instructions a weight).
This layout is made once on the device when a q4 stack is loaded (`to_tile_layout`; the pack file does not
change) so that both problems go away (ops/moe_q4.py holds the kernels that read it):

  codes        for each (expert, tile of TILE_N output rows, group of 32 codes along K) the tile's rows are
               contiguous, 16 bytes a row; a row's 16 bytes are 4 little-endian words, word t holding the 8 codes
               lane t of an MMA quad needs. Slot p = r + 4h of word t is the code of k = 16·(r // 2) + 8·(r % 2)
               + 2t + h, and its bits sit where one shift and one LOP3 put codes (slot r, slot r + 4) at bits
               6..9 and 22..25 of register r: under the exponent of 16.0, that is the f16 pair (16 + q, 16 + q').
               Register 0 needs no shift, 1 a shift left by 4, 2 right by 4, 3 a rotate by 8 (_BIT_RUNS).
  scale|min    for each (expert, tile, group) the tile's TILE_N words (f16 scale | f16 min << 16), contiguous,
               in the bytes the pack's scale and min planes held: one 4-byte load gives a row's pair.

  to_tile_layout         a q4 PackedWeight [E, N, K] -> the same weight in this layout (new record, same size);
                         glu=True for a gate ‖ up stack: each tile 32 gate rows then the matching up rows, so the
                         GEMM makes gelu·up in its epilogue (glu_row_order)
  to_natural_layout      the inverse (a new record); natural_planes: the inverse as torch tensors (the twins read them)
  decode_f16             the kernel's decode as torch ops: the f16 weights it multiplies (tests)
  side_words             the scale|min word plane of a q4-tiles weight, as int32
  wanted                 whether the loader re-lays a stack (CUDA with Triton; DIFFGEMMA_Q4_LAYOUT=natural: never)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, env_choice
from .layouts import pack_nibbles, record_planes, unpack_nibbles

LAYOUT = "q4-tiles"
TILE_N = 64  # output rows of a layout tile = the kernel's BN (64: twice the programs of 128, as fast)
GROUP = 32


def tile_layout_ok(fmt: str, shape) -> bool:
    """Whether a packed tensor can take this layout: a q4 expert stack [E, N, K] with N a multiple of TILE_N
    (then the scale and min planes are adjacent and equal: the combined word plane fits where they were)."""
    return fmt == "q4" and len(shape) == 3 and shape[1] % TILE_N == 0 and shape[2] % GROUP == 0


LAYOUT_ENV = "DIFFGEMMA_Q4_LAYOUT"  # "q4-tiles" (default) or "natural"; settings.py knows it by name


def wanted(fmt: str, shape, device) -> bool:
    """Whether the engine should load a stack in this layout (CUDA with Triton; DIFFGEMMA_Q4_LAYOUT=natural
    keeps the pack's order, for A/B against ops/moe_packed.py's kernel)."""
    return (HAVE_TRITON and torch.device(device).type == "cuda" and tile_layout_ok(fmt, shape)
            and env_choice(LAYOUT_ENV, (LAYOUT, "natural")) == LAYOUT)


def nibble_source(device) -> torch.Tensor:
    """For each of the 32 nibble slots of a group (slot 8t + p), the k (0..31) whose code it holds."""
    src = []
    for t in range(4):
        for p in range(8):
            r, h = p % 4, p // 4
            src.append(16 * (r // 2) + 8 * (r % 2) + 2 * t + h)
    return torch.tensor(src, dtype=torch.long, device=device)


# Where each slot's 4 code bits go in its word: (slot, code bits taken, shifted left by). Slot 3's code is split
# in two runs so that a rotate by 8 brings it to bits 6..9 (and slot 7's, at 14..17, to 22..25).
_BIT_RUNS = ((0, 0xF, 6), (4, 0xF, 22), (1, 0xF, 2), (5, 0xF, 18), (2, 0xF, 10), (6, 0xF, 26), (7, 0xF, 14),
             (3, 0x3, 30), (3, 0xC, -2))


def _signed(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative integers holding unsigned bit patterns of dtype's width -> dtype with the same bits."""
    bits = torch.iinfo(dtype).bits
    return torch.where(v >= 2 ** (bits - 1), v - 2 ** bits, v).to(dtype)


def pack_words(q: torch.Tensor) -> torch.Tensor:
    """Codes [..., 32] in slot order (slot 8t + p) -> int32 words [..., 4] in the bit placement above."""
    q = q.reshape(*q.shape[:-1], 4, 8).to(torch.int64)
    w = torch.zeros(q.shape[:-1], dtype=torch.int64, device=q.device)
    for slot, bits, shift in _BIT_RUNS:
        v = q[..., slot] & bits
        w |= (v << shift) if shift >= 0 else (v >> -shift)
    return _signed(w, torch.int32)


def unpack_words(w: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_words: int32 words [..., 4] -> uint8 codes [..., 32] in slot order."""
    w = w.to(torch.int64) & 0xFFFFFFFF
    q = torch.zeros(*w.shape, 8, dtype=torch.int64, device=w.device)
    for slot, bits, shift in _BIT_RUNS:
        q[..., slot] |= ((w >> shift) if shift >= 0 else (w << -shift)) & bits
    return q.reshape(*w.shape[:-1], 32).to(torch.uint8)


def side_words(pw) -> torch.Tensor:
    """int32 [E·T·G·TILE_N]: the scale|min word plane of a q4-tiles weight (the pack's two side planes' bytes)."""
    sc, mn = pw.planes["scale"], pw.planes["min"]
    start = sc.data_ptr() - pw.record.data_ptr()
    assert mn.data_ptr() - pw.record.data_ptr() == start + sc.numel() and mn.numel() == sc.numel()
    return pw.record[start:start + 2 * sc.numel()].view(torch.int32)


def glu_row_order(N: int, device=None) -> torch.Tensor:
    """The glu tile order of a gate ‖ up stack's N = 2F rows: tile t holds gate rows 32t..32t+31, then up rows
    F + 32t..F + 32t + 31 (position -> logical row). Any N the tile layout takes (a multiple of 64) has F a multiple
    of 32, so every q4-tiles gate ‖ up stack can take it."""
    F, half = N // 2, TILE_N // 2
    j = torch.arange(N, device=device)
    t, i = j // TILE_N, j % TILE_N
    return t * half + i % half + torch.where(i >= half, F, 0)


def glu_row_positions(N: int, device=None) -> torch.Tensor:
    """glu_row_order's inverse (logical row -> position): what puts a glu-laid stack's rows, or its plain product's
    columns, back in logical order."""
    return torch.argsort(glu_row_order(N, device))


def _with_record(pw, record: torch.Tensor, layout: str, glu: bool):
    """pw's weight (same format and shape) over another record, in `layout`."""
    return replace(pw, record=record, planes=record_planes(pw.fmt, pw.shape, record), layout=layout, glu=glu)


def to_tile_layout(pw, experts_per_chunk: int = 4, glu: bool = False):
    """The q4 stack `pw` re-laid for the kernel, in a new record on pw's device (pw is left as it is: a source may
    share its record). Works `experts_per_chunk` experts at a time so the scratch stays small. glu: pw is a
    gate ‖ up stack, laid in the glu tile order (glu_row_order) for the GEMM's gelu·up epilogue."""
    if not tile_layout_ok(pw.fmt, pw.shape) or pw.layout != "natural":
        raise TensorError(f"{LAYOUT}: needs a natural-order q4 stack [E, N, K] with N a multiple of {TILE_N}, "
                          f"got {pw.fmt} {list(pw.shape)} ({pw.layout})")
    E, N, K = pw.shape
    G, T = K // GROUP, N // TILE_N
    out = _with_record(pw, torch.empty_like(pw.record), LAYOUT, glu)
    words = out.planes["codes"].view(torch.int32)
    side = side_words(out)
    perm = nibble_source(pw.device)
    rows_in = glu_row_order(N, pw.device) if glu else None
    for e0 in range(0, E, experts_per_chunk):
        e1 = min(E, e0 + experts_per_chunk)
        rows = slice(e0 * N, e1 * N)
        planes = {n: pw.planes[n][rows] for n in ("codes", "scale", "min")}
        if glu:
            planes = {n: v.view(e1 - e0, N, -1)[:, rows_in].reshape(v.shape) for n, v in planes.items()}
        q = unpack_nibbles(planes["codes"]).view(e1 - e0, T, TILE_N, G, GROUP)[..., perm]
        words[rows].view(e1 - e0, T, G, TILE_N, 4).copy_(pack_words(q).permute(0, 1, 3, 2, 4))
        s, m = (planes[n].view(torch.int16).to(torch.int64) & 0xFFFF for n in ("scale", "min"))
        sm = (s | (m << 16)).view(e1 - e0, T, TILE_N, G).permute(0, 1, 3, 2)
        side[e0 * N * G: e1 * N * G].view(e1 - e0, T, G, TILE_N).copy_(_signed(sm, torch.int32))
    return out


def to_natural_layout(pw):
    """The inverse of to_tile_layout: the same q4 stack in the pack's own order, in a new record."""
    check_tiles(pw)
    out = _with_record(pw, torch.empty_like(pw.record), "natural", False)
    for name, t in natural_planes(pw).items():
        out.planes[name].copy_(t.view(torch.uint8).view(out.planes[name].shape))
    return out


def natural_planes(pw) -> dict:
    """codes uint8 [E·N, K/2], scale / min f16 [E·N, K/32] in the pack's own order, from a q4-tiles weight."""
    E, N, K = pw.shape
    G, T = K // GROUP, N // TILE_N
    inv = torch.argsort(nibble_source(pw.device))
    q = unpack_words(pw.planes["codes"].view(torch.int32).view(E, T, G, TILE_N, 4))[..., inv]
    codes = pack_nibbles(q).permute(0, 1, 3, 2, 4).reshape(E * N, K // 2)
    sm = side_words(pw).view(E, T, G, TILE_N).permute(0, 1, 3, 2).reshape(E * N, G)
    out = {"codes": codes, "scale": _f16_bits(sm & 0xFFFF), "min": _f16_bits((sm >> 16) & 0xFFFF)}
    if pw.glu:  # back from the glu tile order: logical row glu_row_order[j] sits at position j
        back = glu_row_positions(N, pw.device)
        out = {n: v.view(E, N, -1)[:, back].reshape(v.shape) for n, v in out.items()}
    return out


def _f16_bits(v: torch.Tensor) -> torch.Tensor:
    return _signed(v, torch.int16).view(torch.float16)


def decode_f16(pw) -> torch.Tensor:
    """The kernel's weights: f16 [E, N, K] with w = f16((16 + q)·s + f16(min − 16·s)) (f32 math, exact before the
    one rounding, as fma.rn.f16x2). The twin of the GEMM's decode, for tests."""
    p = natural_planes(pw)
    E, N, K = pw.shape
    q = unpack_nibbles(p["codes"]).view(E * N, K // GROUP, GROUP).float()
    s = p["scale"].float().unsqueeze(-1)
    c = (p["min"].float().unsqueeze(-1) - 16.0 * s).half().float()
    return ((16.0 + q) * s + c).half().view(E, N, K)


def check_tiles(w):
    """Refuse a weight that is not in this layout (the q4-tiles kernels read nothing else)."""
    if w.layout != LAYOUT:
        raise TensorError(f"{LAYOUT} kernels need a weight made by to_tile_layout, got a {w.fmt} {list(w.shape)} "
                          f"in {w.layout} order")
