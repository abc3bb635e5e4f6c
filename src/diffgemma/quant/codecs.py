"""Weight codecs: q4 / q5 / q6 (group-32 affine), q8 (per-row symmetric) and nvfp4, plus raw.

Every codec works on a tensor viewed as a row-major matrix [R, K]: K is the LAST dimension (the
reduction / "in" dimension of an [out, in] weight, also of the fused expert stacks [E, out, in]) and
R is the product of all the others. Groups run along K, so a GEMM kernel dequantizes exactly the
K-slice it is about to multiply. Nothing is transposed: the layout follows the checkpoint.

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
  raw: the source bytes verbatim (no planes).

For an expert stack [E, N, K], expert e owns rows [e*N, (e+1)*N) of every plane, so a grouped-GEMM
kernel finds expert e's codes at plane.offset + e*N*row_bytes. Per-group scales and mins are computed
in float64 and rounded once (correctly) to their storage type. float16 scales go subnormal below
6.1e-5 (group range < ~1e-3 for q4); the code stays valid, only coarser.

Every codec has a fast torch path (float32, vectorized, what the quantizer and the CPU loader use) and a
float64 numpy reference twin written independently (the oracle the tests compare the fast path with).
Rounding is round-half-to-even everywhere (torch.round / np.round; e2m1 and e4m3 ties go to the even
mantissa), so fast and reference agree except where float32 and float64 land on different sides of a
tie, which the tests bound.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import TensorError

ALIGN = 64  # byte alignment of every tensor record and of every plane inside one

QUANT_FORMATS = ("q4", "q5", "q6", "q8", "nvfp4")
ALL_FORMATS = ("raw",) + QUANT_FORMATS

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude code 0..7
E4M3_MAX = 448.0
NVFP4_MAX = 6.0


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
}

GROUP = {"q4": 32, "q5": 32, "q6": 32, "nvfp4": 16, "q8": 1}


def dims_problem(fmt: str, shape) -> str | None:
    """Why `fmt` cannot hold a tensor of `shape` (None when it can). Checked before any byte is written."""
    shape = tuple(shape)
    if fmt == "raw":
        return None
    if fmt not in QUANT_FORMATS:
        return f"unknown format {fmt!r}"
    if fmt == "q8":
        return None if len(shape) == 2 else f"q8 needs a rank-2 tensor, got shape {list(shape)}"
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
    return out


def record_nbytes(fmt: str, shape, raw_nbytes: int | None = None) -> int:
    """Bytes of a tensor record (for raw: the source byte length, which the caller knows)."""
    if fmt == "raw":
        if raw_nbytes is None:
            raise ValueError("raw records need their source byte length")
        return raw_nbytes
    last = planes(fmt, shape)[-1]
    return last.offset + last.nbytes


# -------------------------------------------------------------------------------------- fast: affine

_LEVELS = {"q4": 15, "q5": 31, "q6": 63}


def _affine_encode(x: torch.Tensor, levels: int):
    """x [R, K] float32 -> (codes uint8 [R, K], scale f16 [R, K/32], min f16 [R, K/32])."""
    r, k = x.shape
    g = x.reshape(r, k // 32, 32)
    mn, mx = g.amin(-1), g.amax(-1)
    # Per-group scalars in float64 (cheap: one per 32 weights), rounded to float16 by numpy: torch goes
    # float64 -> float32 -> float16, and that double rounding differs from a correct rounding near ties.
    scale16 = torch.from_numpy(((mx.double() - mn.double()) / levels).numpy().astype(np.float16))
    min16 = mn.to(torch.float16)
    if not (torch.isfinite(scale16).all() and torch.isfinite(min16).all()):
        raise TensorError("group range overflows float16 scales (|w| too large for an affine code)")
    s = scale16.float()
    s = torch.where(s > 0, s, 1.0).unsqueeze(-1)  # scale 0: every (x - min) rounds to code 0 anyway
    q = (g - min16.float().unsqueeze(-1)).div_(s).round_().clamp_(0, levels).to(torch.uint8).reshape(r, k)
    return q, scale16, min16


def _affine_decode(q: torch.Tensor, scale16: torch.Tensor, min16: torch.Tensor) -> torch.Tensor:
    r, k = q.shape
    g = q.reshape(r, k // 32, 32).float()
    return (g * scale16.float().unsqueeze(-1) + min16.float().unsqueeze(-1)).reshape(r, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 2B] codes -> uint8 [..., B]: element 2j in the low nibble of byte j, 2j + 1 in the high one."""
    pairs = q.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] -> uint8 [..., 2B], the inverse of pack_nibbles (any device)."""
    b = b.to(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def _pack_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v int [R, K] with values < 2**bits; 8/bits values per byte, element j*per+b at bits b*bits."""
    per = 8 // bits
    r, k = v.shape
    v = v.to(torch.int32).reshape(r, k // per, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (v << shifts).sum(-1).to(torch.uint8)


def _unpack_bits(b: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    v = (b.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(b.shape[0], -1)


# -------------------------------------------------------------------------------------- fast: nvfp4

_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E2M1_SIGNED = torch.cat((_E2M1, -_E2M1))  # indexed by the whole nibble: bit 3 is the sign


# Decision boundaries between neighbouring e2m1 magnitudes. bucketize counts the boundaries strictly
# below |y|; where the tie must go UP (to the even code) the boundary is pulled one float32 ulp down.
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_E2M1_BOUNDS[[1, 3, 5]] = torch.nextafter(_E2M1_BOUNDS[[1, 3, 5]], torch.zeros(3))


def _e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """Magnitude code 0..7 of |y| rounded to the e2m1 grid, ties to the even code (= even mantissa)."""
    return torch.bucketize(y.abs().float(), _E2M1_BOUNDS).to(torch.uint8)


def nvfp4_tensor_scale(amax: float) -> float:
    """The per-tensor f32 scale: maps the tensor's |max| onto e2m1 max (6) * e4m3 max (448)."""
    amax = float(amax)
    if not np.isfinite(amax):
        raise TensorError("tensor has non-finite values")
    return float(np.float32(amax / (NVFP4_MAX * E4M3_MAX))) if amax > 0 else 1.0


def _nvfp4_encode(x: torch.Tensor, tscale: float):
    r, k = x.shape
    g = x.reshape(r, k // 16, 16)
    t = torch.tensor(tscale, dtype=torch.float32)
    bscale = (g.abs().amax(-1).double() / (NVFP4_MAX * tscale)).clamp_(max=E4M3_MAX)  # float64: see affine
    s8 = bscale.to(torch.float8_e4m3fn)
    s = s8.float().unsqueeze(-1) * t
    y = g / torch.where(s > 0, s, 1.0)  # block scale 0: the block is all zeros (or underflows to them)
    y = torch.where(s > 0, y, 0.0) if not bool((s > 0).all()) else y
    mag = _e2m1_code(y)
    sign = ((y < 0) & (mag > 0)).to(torch.uint8) << 3
    codes = (mag | sign).reshape(r, k)
    return codes, s8.view(torch.uint8)


def _nvfp4_decode(codes: torch.Tensor, scale_u8: torch.Tensor, tscale: float) -> torch.Tensor:
    r, k = codes.shape
    val = _E2M1_SIGNED[codes.long()].reshape(r, k // 16, 16)
    s = scale_u8.contiguous().view(torch.float8_e4m3fn).float().unsqueeze(-1) * torch.tensor(tscale, dtype=torch.float32)
    return (val * s).reshape(r, k)


# ------------------------------------------------------------------------------------- fast: public

def _as_rows(x: torch.Tensor) -> torch.Tensor:
    r, k = rows_k(x.shape)
    x = x.reshape(r, k).float()
    if not torch.isfinite(x).all():
        raise TensorError("tensor has non-finite values (NaN or inf) and cannot be quantized")
    return x


def encode(fmt: str, x: torch.Tensor, tscale: float | None = None) -> dict[str, np.ndarray]:
    """Fast encoder: x (any float dtype, any shape, K last) -> {plane name: uint8 array [R, row_bytes]}.

    For nvfp4, `tscale` is the per-tensor scale (nvfp4_tensor_scale of the WHOLE tensor's |max|), so a
    tensor can be encoded in row chunks that all share it.
    """
    problem = dims_problem(fmt, x.shape)
    if problem or fmt == "raw":
        raise TensorError(problem or "raw tensors are not encoded")
    x = _as_rows(x)
    if fmt in _LEVELS:
        q, scale16, min16 = _affine_encode(x, _LEVELS[fmt])
        out = {"scale": scale16.view(torch.uint8), "min": min16.view(torch.uint8)}
        if fmt == "q4":
            out["codes"] = pack_nibbles(q)
        else:
            out["lo"] = pack_nibbles(q & 0xF)
            out["hi"] = _pack_bits(q >> 4, 1 if fmt == "q5" else 2)
    elif fmt == "q8":
        scale = (x.abs().amax(-1).double() / 127.0).float()
        q = torch.where(scale.unsqueeze(-1) > 0, torch.round(x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)), 0.0)
        out = {"codes": q.clamp_(-127, 127).to(torch.int8).view(torch.uint8), "scale": scale.reshape(-1, 1).view(torch.uint8)}
    else:  # nvfp4
        if tscale is None:
            tscale = nvfp4_tensor_scale(x.abs().max().item() if x.numel() else 0.0)
        codes, s8 = _nvfp4_encode(x, tscale)
        out = {"codes": pack_nibbles(codes), "scale": s8,
               "tscale": torch.tensor([[tscale]], dtype=torch.float32).view(torch.uint8)}
    return {name: t.contiguous().numpy() for name, t in out.items()}


def decode(fmt: str, data, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fast decoder: one whole record (bytes-like or uint8 array of record_nbytes) -> tensor of `shape`."""
    return decode_rows(fmt, plane_views(fmt, data, shape)).reshape(tuple(shape)).to(dtype)


def decode_rows(fmt: str, views: dict[str, np.ndarray], r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """Rows [r0, r1) of a record, from its plane views (plane_views), as float32 [r1 - r0, K].

    Every codec is row-local (nvfp4's one tensor scale aside), so a large tensor can be dequantized in
    row chunks with bounded memory.
    """
    first = next(iter(views.values()))
    r1 = first.shape[0] if r1 is None else r1
    with warnings.catch_warnings():  # read-only mmap views: we only ever read them
        warnings.simplefilter("ignore", UserWarning)
        t = {name: torch.from_numpy(v[r0:r1] if name != "tscale" else v) for name, v in views.items()}
    n = r1 - r0
    if fmt in _LEVELS:
        scale16, min16 = t["scale"].view(torch.float16), t["min"].view(torch.float16)
        if fmt == "q4":
            q = unpack_nibbles(t["codes"])
        else:
            q = unpack_nibbles(t["lo"]) | (_unpack_bits(t["hi"], 1 if fmt == "q5" else 2) << 4)
        return _affine_decode(q, scale16, min16)
    if fmt == "q8":
        return t["codes"].view(torch.int8).float() * t["scale"].view(torch.float32).reshape(n, 1)
    if fmt == "nvfp4":
        tscale = float(views["tscale"].view("<f4")[0, 0])
        return _nvfp4_decode(unpack_nibbles(t["codes"]), t["scale"], tscale)
    raise TensorError(f"cannot decode format {fmt!r}")


def plane_views(fmt: str, data, shape) -> dict[str, np.ndarray]:
    """Zero-copy uint8 [R, row_bytes] views of each plane of a record (read-only if `data` is)."""
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    need = record_nbytes(fmt, shape)
    if buf.size < need:
        raise TensorError(f"{fmt} record for shape {list(shape)} needs {need} bytes, got {buf.size}")
    return {p.name: buf[p.offset:p.offset + p.nbytes].reshape(p.rows, p.row_bytes) for p in planes(fmt, shape)}


def assemble(fmt: str, shape, encoded: dict[str, np.ndarray]) -> bytes:
    """A whole record (padding included) from encode()'s planes — for tests and small tensors."""
    out = bytearray(record_nbytes(fmt, shape))
    for p in planes(fmt, shape):
        out[p.offset:p.offset + p.nbytes] = encoded[p.name].tobytes()
    return bytes(out)


# ============================================================================ float64 reference twins
# Written independently of the fast path: per-group loops in float64 numpy, explicit grids, explicit
# bit formulas. Returned codes are plain integer arrays (not packed), so tests compare meaning, and
# ref_decode_* reconstructs from the fast path's packed bytes to pin the byte layout too.

def _f16(v):
    return np.asarray(v, dtype=np.float64).astype(np.float16).astype(np.float64)


def ref_encode_affine(x: np.ndarray, levels: int):
    """x float64 [R, K] -> (codes [R, K] int, scale [R, K/32] f64 (f16 values), min [R, K/32])."""
    x = np.asarray(x, dtype=np.float64)
    r, k = x.shape
    codes = np.zeros((r, k), dtype=np.int64)
    scales = np.zeros((r, k // 32))
    mins = np.zeros((r, k // 32))
    for i in range(r):
        for j in range(k // 32):
            grp = x[i, 32 * j:32 * j + 32]
            lo, hi = grp.min(), grp.max()
            s, m = _f16((hi - lo) / levels), _f16(lo)
            scales[i, j], mins[i, j] = s, m
            if s > 0:
                codes[i, 32 * j:32 * j + 32] = np.clip(np.round((grp - m) / s), 0, levels)
    return codes, scales, mins


def ref_decode_affine(codes, scales, mins) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.float64)
    r, k = codes.shape
    return codes * np.repeat(scales, 32, axis=1) + np.repeat(mins, 32, axis=1)


def ref_unpack_affine(fmt: str, data, shape):
    """Codes/scales/mins read back from packed record bytes with plain bit arithmetic."""
    v = plane_views(fmt, data, shape)
    r, k = rows_k(shape)
    lo_plane = v["codes"] if fmt == "q4" else v["lo"]
    codes = np.zeros((r, k), dtype=np.int64)
    for e in range(k):
        byte = lo_plane[:, e // 2].astype(np.int64)
        codes[:, e] = (byte >> (4 * (e % 2))) & 0xF
        if fmt == "q5":
            codes[:, e] |= ((v["hi"][:, e // 8].astype(np.int64) >> (e % 8)) & 1) << 4
        elif fmt == "q6":
            codes[:, e] |= ((v["hi"][:, e // 4].astype(np.int64) >> (2 * (e % 4))) & 3) << 4
    scales = v["scale"].copy().view("<f2").astype(np.float64)
    mins = v["min"].copy().view("<f2").astype(np.float64)
    return codes, scales, mins


def ref_encode_q8(x: np.ndarray):
    x = np.asarray(x, dtype=np.float64)
    scale = (np.abs(x).max(axis=1) / 127.0).astype(np.float32).astype(np.float64)
    codes = np.zeros(x.shape, dtype=np.int64)
    for i in range(x.shape[0]):
        if scale[i] > 0:
            codes[i] = np.clip(np.round(x[i] / scale[i]), -127, 127)
    return codes, scale


def ref_decode_q8(codes, scale) -> np.ndarray:
    return np.asarray(codes, dtype=np.float64) * np.asarray(scale, dtype=np.float64)[:, None]


def ref_e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round non-negative float64 values to float8 e4m3fn (RNE, saturating at 448)."""
    v = np.minimum(np.asarray(v, dtype=np.float64), E4M3_MAX)
    out = np.zeros_like(v)
    nz = v > 0
    e = np.maximum(np.floor(np.log2(v[nz])), -6)  # below 2**-6 the spacing stays 2**-9 (subnormals)
    step = 2.0 ** (e - 3)
    out[nz] = np.minimum(np.round(v[nz] / step) * step, E4M3_MAX)
    return out


def ref_e4m3_decode(byte: np.ndarray) -> np.ndarray:
    b = np.asarray(byte, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    val = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    val = np.where((e == 15) & (m == 7), np.nan, val)
    return sign * val


def ref_e2m1_round(y: np.ndarray) -> np.ndarray:
    """Signed e2m1 codes (magnitude code 0..7, sign as -) by nearest grid value, ties to even code."""
    grid = np.array(E2M1_VALUES)
    a = np.minimum(np.abs(y), NVFP4_MAX)
    d = np.abs(a[..., None] - grid)
    best = d.min(axis=-1, keepdims=True)
    tie_ok = d == best
    # among equally near candidates prefer the even code (even e2m1 mantissa)
    pref = np.where(tie_ok, np.where(np.arange(8) % 2 == 0, 0, 1), 9) * 8 + np.arange(8)
    mag = pref.argmin(axis=-1)
    return np.where((y < 0) & (mag > 0), -mag, mag)


def ref_encode_nvfp4(x: np.ndarray):
    """x float64 [R, K] -> (signed magnitude codes [R, K], block scales (e4m3 values) [R, K/16], tscale)."""
    x = np.asarray(x, dtype=np.float64)
    r, k = x.shape
    amax = np.abs(x).max() if x.size else 0.0
    tscale = float(np.float32(amax / (NVFP4_MAX * E4M3_MAX))) if amax > 0 else 1.0
    g = x.reshape(r, k // 16, 16)
    bscale = ref_e4m3_round(np.abs(g).max(axis=-1) / (NVFP4_MAX * tscale))
    s = bscale[..., None] * tscale
    y = np.divide(g, s, out=np.zeros_like(g), where=s > 0)
    return ref_e2m1_round(y).reshape(r, k), bscale, tscale


def ref_decode_nvfp4(codes, bscale, tscale) -> np.ndarray:
    codes = np.asarray(codes)
    r, k = codes.shape
    vals = np.sign(codes) * np.array(E2M1_VALUES)[np.abs(codes)]
    return (vals.reshape(r, k // 16, 16) * (np.asarray(bscale)[..., None] * tscale)).reshape(r, k)


def ref_unpack_nvfp4(data, shape):
    v = plane_views("nvfp4", data, shape)
    r, k = rows_k(shape)
    nib = np.zeros((r, k), dtype=np.int64)
    for e in range(k):
        nib[:, e] = (v["codes"][:, e // 2].astype(np.int64) >> (4 * (e % 2))) & 0xF
    codes = np.where(nib & 8, -(nib & 7), nib & 7)
    bscale = ref_e4m3_decode(v["scale"])
    tscale = float(v["tscale"].copy().view("<f4")[0, 0])
    return codes, bscale, tscale


def ref_unpack_q8(data, shape):
    v = plane_views("q8", data, shape)
    return v["codes"].view(np.int8).astype(np.int64), v["scale"].copy().view("<f4").reshape(-1).astype(np.float64)
