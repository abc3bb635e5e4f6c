"""Weight codecs: q4 / q5 / q6 (group-32 affine), q8 (per-row symmetric) and nvfp4, plus raw.

Every codec works on a tensor viewed as a row-major matrix [R, K]: K is the LAST dimension (the
reduction / "in" dimension of an [out, in] weight, also of the fused expert stacks [E, out, in]) and
R is the product of all the others. Groups run along K, so a GEMM kernel dequantizes exactly the
K-slice it is about to multiply. Nothing is transposed: the layout follows the checkpoint.

The byte layout of a record (its planes, nibble order, group sizes) is ops/layouts.py's: the kernels
read it, so it lives with them and the codecs import it. Per-group scales and mins are computed
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

import numpy as np
import torch

from ..errors import TensorError
from ..ops.layouts import (  # noqa: F401  (the record layout: codecs.planes etc. stay the pack's names)
    ALIGN, ALL_FORMATS, E2M1_VALUES, GROUP, QUANT_FORMATS, Plane, align_up, dims_problem, pack_bits, pack_nibbles,
    planes, record_nbytes, rows_k, unpack_bits, unpack_nibbles)
from ..ops.packed_weight import nvfp4e_decode

E4M3_MAX = 448.0
NVFP4_MAX = 6.0


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
    if problem or fmt in ("raw", "nvfp4e"):
        raise TensorError(problem or f"{fmt} tensors are not encoded (nvfp4e: converted from published checkpoints, "
                                     "quant/hub_codecs.py)")
    x = _as_rows(x)
    if fmt in _LEVELS:
        q, scale16, min16 = _affine_encode(x, _LEVELS[fmt])
        out = {"scale": scale16.view(torch.uint8), "min": min16.view(torch.uint8)}
        if fmt == "q4":
            out["codes"] = pack_nibbles(q)
        else:
            out["lo"] = pack_nibbles(q & 0xF)
            out["hi"] = pack_bits(q >> 4, 1 if fmt == "q5" else 2)
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
        t = {name: torch.from_numpy(v[r0:r1] if name not in ("tscale", "escale") else v) for name, v in views.items()}
    n = r1 - r0
    if fmt in _LEVELS:
        scale16, min16 = t["scale"].view(torch.float16), t["min"].view(torch.float16)
        if fmt == "q4":
            q = unpack_nibbles(t["codes"])
        else:
            q = unpack_nibbles(t["lo"]) | (unpack_bits(t["hi"], 1 if fmt == "q5" else 2) << 4)
        return _affine_decode(q, scale16, min16)
    if fmt == "q8":
        return t["codes"].view(torch.int8).float() * t["scale"].view(torch.float32).reshape(n, 1)
    if fmt == "nvfp4":
        tscale = float(views["tscale"].view("<f4")[0, 0])
        return _nvfp4_decode(unpack_nibbles(t["codes"]), t["scale"], tscale)
    if fmt == "nvfp4e":  # each row's expert: rows [e·N, (e+1)·N) are expert e's
        escale = t["escale"].view(torch.float32)
        per = first.shape[0] // escale.shape[0]
        return nvfp4e_decode(t["codes"], t["scale"], escale[torch.arange(r0, r1) // per])
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
