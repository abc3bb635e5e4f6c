"""The byte layout of a packed tensor record, as the kernels read it (quant/codecs.py writes it).

Byte layout of one quantized tensor record ("planes"). A record is a sequence of planes, each one a
row-major [R, row_bytes] array; every plane starts at a 64-byte aligned offset from the record start
(zero padding between planes), and the record itself starts 64-byte aligned in the blob, so every
plane is 64-byte aligned in absolute terms and a kernel may use wide typed loads on any of them.
All multi-byte values are little-endian.

  q4 (group 32, affine, codes 0..15)
    codes  uint8 [R, K/2]   element 2j in the LOW nibble, element 2j+1 in the HIGH nibble
    scale  f16   [R, K/32]
    min    f16   [R, K/32]            w = code * scale + min
  q5 (group 32, affine, codes 0..31)
    lo     uint8 [R, K/2]   low 4 bits of each code, nibble order as q4
    hi     uint8 [R, K/8]   bit 4 of each code: element 8j+b is bit b of byte j
    scale  f16   [R, K/32]
    min    f16   [R, K/32]            w = (lo | hi << 4) * scale + min
  q6 (group 32, affine, codes 0..63)
    lo     uint8 [R, K/2]   low 4 bits, nibble order as q4
    hi     uint8 [R, K/4]   bits 4-5 of each code: element 4j+b sits at bits 2b..2b+1 of byte j
    scale  f16   [R, K/32]
    min    f16   [R, K/32]            w = (lo | hi << 4) * scale + min
  q8 (per row, symmetric, codes -127..127)
    codes  int8  [R, K]
    scale  f32   [R]                  w = code * scale
  nvfp4 (fp4 e2m1 values, group 16, fp8 e4m3 group scales, one f32 tensor scale)
    codes  uint8 [R, K/2]   nibble order as q4; nibble = sign(bit 3) | e2m1 magnitude code (bits 0-2):
                            0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6
    scale  uint8 [R, K/16]  float8 e4m3fn (bias 7, max 448, no inf)
    tscale f32   [1]                  w = e2m1(code) * e4m3(scale) * tscale
  nvfp4e (an expert stack [E, N, K] in nvfp4 with one tensor scale PER EXPERT, as published checkpoints hold it)
    codes, scale            as nvfp4
    escale f32   [E, 2]     expert e's (multiplier, divisor):
                                      w = e2m1(code) * fl(fl(e4m3(scale) * mul_e) / div_e), each step one f32
                                      rounding: ModelOpt's weight_scale_2 is a multiplier (divisor 1),
                                      compressed-tensors' global scale a divisor (multiplier 1); nvfp4's one
                                      tensor scale is the case (tscale, 1) for every expert
  raw: the source bytes verbatim (no planes).

For an expert stack [E, N, K], expert e owns rows [e*N, (e+1)*N) of every plane, so a grouped-GEMM
kernel finds expert e's codes at plane.offset + e*N*row_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TensorError

ALIGN = 64  # byte alignment of every tensor record and of every plane inside one

QUANT_FORMATS = ("q4", "q5", "q6", "q8", "nvfp4")  # what the codecs encode and packs hold
CONVERTED_FORMATS = ("nvfp4e",)  # records made at load from published checkpoints (quant/hub_codecs.py), never packed
ALL_FORMATS = ("raw",) + QUANT_FORMATS

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude code 0..7


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Plane:
    name: str
    offset: int  # from the start of the tensor record, a multiple of ALIGN
    rows: int
    row_bytes: int
    dtype: str  # numpy dtype of its elements: "u1", "i1", "<f2", "<f4"

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def rows_k(shape) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1, 1
    r = 1
    for s in shape[:-1]:
        r *= s
    return r, shape[-1]


# ----------------------------------------------------------------------------------------------- layout

_PLANE_SPECS = {
    # name -> [(plane, bytes per row as a function of K, dtype)]
    "q4": [("codes", lambda k: k // 2, "u1"), ("scale", lambda k: k // 32 * 2, "<f2"), ("min", lambda k: k // 32 * 2, "<f2")],
    "q5": [("lo", lambda k: k // 2, "u1"), ("hi", lambda k: k // 8, "u1"),
           ("scale", lambda k: k // 32 * 2, "<f2"), ("min", lambda k: k // 32 * 2, "<f2")],
    "q6": [("lo", lambda k: k // 2, "u1"), ("hi", lambda k: k // 4, "u1"),
           ("scale", lambda k: k // 32 * 2, "<f2"), ("min", lambda k: k // 32 * 2, "<f2")],
    "q8": [("codes", lambda k: k, "i1"), ("scale", lambda k: 4, "<f4")],
    "nvfp4": [("codes", lambda k: k // 2, "u1"), ("scale", lambda k: k // 16, "u1")],  # + tscale, below
    "nvfp4e": [("codes", lambda k: k // 2, "u1"), ("scale", lambda k: k // 16, "u1")],  # + escale, below
}

GROUP = {"q4": 32, "q5": 32, "q6": 32, "nvfp4": 16, "nvfp4e": 16, "q8": 1}


def dims_problem(fmt: str, shape) -> str | None:
    """Why `fmt` cannot hold a tensor of `shape` (None when it can). Checked before any byte is written."""
    shape = tuple(shape)
    if fmt == "raw":
        return None
    if fmt not in QUANT_FORMATS + CONVERTED_FORMATS:
        return f"unknown format {fmt!r}"
    if fmt == "q8":
        return None if len(shape) == 2 else f"q8 needs a rank-2 tensor, got shape {list(shape)}"
    if fmt == "nvfp4e" and len(shape) != 3:
        return f"nvfp4e needs an expert stack [E, N, K], got shape {list(shape)}"
    if len(shape) < 2:
        return f"{fmt} needs a tensor of rank >= 2, got shape {list(shape)}"
    k = shape[-1]
    g = GROUP[fmt]
    if k % g:
        return f"{fmt} needs the last dimension (K={k}) to be a multiple of {g}"
    return None


def planes(fmt: str, shape) -> list[Plane]:
    """The plane layout of a `fmt` record for a tensor of `shape` (see the module docstring)."""
    problem = dims_problem(fmt, shape)
    if problem:
        raise TensorError(problem)
    r, k = rows_k(shape)
    out, off = [], 0
    for name, row_bytes, dt in _PLANE_SPECS[fmt]:
        p = Plane(name, off, r, row_bytes(k), dt)
        out.append(p)
        off = align_up(off + p.nbytes)
    if fmt == "nvfp4":
        out.append(Plane("tscale", off, 1, 4, "<f4"))
    if fmt == "nvfp4e":
        out.append(Plane("escale", off, int(shape[0]), 8, "<f4"))
    return out


def record_nbytes(fmt: str, shape, raw_nbytes: int | None = None) -> int:
    """Bytes of a tensor record (for raw: the source byte length, which the caller knows)."""
    if fmt == "raw":
        if raw_nbytes is None:
            raise ValueError("raw records need their source byte length")
        return raw_nbytes
    last = planes(fmt, shape)[-1]
    return last.offset + last.nbytes


def record_planes(fmt: str, shape, record: torch.Tensor) -> dict:
    """Zero-copy uint8 [rows, row_bytes] views of each plane of a record held in a uint8 tensor (any device)."""
    shape = tuple(int(s) for s in shape)
    need = record_nbytes(fmt, shape)
    if record.dtype != torch.uint8 or record.dim() != 1 or record.numel() != need:
        raise TensorError(f"{fmt} record for shape {list(shape)} must be {need} uint8 bytes, "
                          f"got {record.dtype} {list(record.shape)}")
    if record.data_ptr() % ALIGN:
        raise TensorError(f"{fmt} record for shape {list(shape)} is not {ALIGN}-byte aligned on {record.device}")
    return {p.name: record[p.offset:p.offset + p.nbytes].view(p.rows, p.row_bytes) for p in planes(fmt, shape)}


# ----------------------------------------------------------------------------------------- bit packing

def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 2B] codes -> uint8 [..., B]: element 2j in the low nibble of byte j, 2j + 1 in the high one."""
    pairs = q.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] -> uint8 [..., 2B], the inverse of pack_nibbles (any device)."""
    b = b.to(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def pack_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v int [R, K] with values < 2**bits; 8/bits values per byte, element j*per+b at bits b*bits."""
    per = 8 // bits
    r, k = v.shape
    v = v.to(torch.int32).reshape(r, k // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=v.device) * bits
    return (v << shifts).sum(-1).to(torch.uint8)


def unpack_bits(b: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, B] -> int32 [R, B * 8/bits], the inverse of pack_bits (any device)."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=b.device) * bits
    v = (b.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(b.shape[0], -1)
