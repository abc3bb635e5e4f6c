"""Packed (quantized) weights on the device, and the torch twin of their decode.

A `PackedWeight` is one pack record (ops/layouts.py byte layout) uploaded to the device as it is: one uint8
buffer, with zero-copy [R, row_bytes] views of its planes. Every plane is 64-byte aligned in the record, so
the kernels may use wide typed loads on it. On CUDA a q4 expert stack is re-laid at load into the kernels'
"q4-tiles" byte order (ops/q4_tiles.py; PackedWeight.layout says which).

  dequantize   the whole tensor decoded in f32 by torch ops, device-agnostic: the twin every packed kernel
               (ops/moe_packed.py, ops/moe_q4.py, ops/q8_linear.py) is compared with
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TensorError
from .layouts import E2M1_VALUES, record_planes, rows_k, unpack_bits, unpack_nibbles
from .q4_tiles import natural_planes

EXPERT_FORMATS = ("q4", "q5", "q6", "nvfp4", "nvfp4e")


@dataclass
class PackedWeight:
    """One quantized tensor on a device: its whole record (uint8) and zero-copy views of its planes."""

    fmt: str
    shape: tuple  # the logical tensor shape, K last ([E, N, K] for an expert stack, [N, K] for a linear)
    record: torch.Tensor  # uint8 [record_nbytes]
    planes: dict  # plane name -> uint8 [R, row_bytes] view into `record`
    tscale: float = 1.0  # nvfp4's per-tensor scale (read once at load: it is a kernel argument)
    layout: str = "natural"  # the pack's byte order, or ops/q4_tiles.py's "q4-tiles" (made on the device at load)
    # q4-tiles only: a gate ‖ up stack whose layout tiles hold 32 gate rows then the up rows of the same columns, so
    # the GEMM can make gelu·up in its epilogue (ops/q4_tiles.to_tile_layout(glu=True)); the logical shape is unchanged
    glu: bool = False
    # nvfp4e only: whether any expert's divisor is not 1 (read once at load: the kernels divide only then)
    divides: bool = False

    @classmethod
    def from_record(cls, fmt: str, shape, record: torch.Tensor) -> "PackedWeight":
        shape = tuple(int(s) for s in shape)
        planes = record_planes(fmt, shape, record)
        tscale, divides = 1.0, False
        if fmt == "nvfp4":  # the one f32 tensor scale: a kernel argument, read to the host once
            tscale = float(planes["tscale"].cpu().view(torch.float32)[0, 0])
        if fmt == "nvfp4e":
            divides = bool((planes["escale"].cpu().view(torch.float32)[:, 1] != 1.0).any())
        return cls(fmt, shape, record, planes, tscale, divides=divides)

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
    p = pw.planes if pw.layout == "natural" else natural_planes(pw)
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
