"""FP8 weights on the device: float8 e4m3 values with one float32 scale per output channel.

An `Fp8Weight` is what an FP8 checkpoint's linear (or expert stack) becomes when the engine keeps it in 8 bits:
`weight` holds the e4m3 values as published ([N, K] for a linear, [E, N, K] for an expert stack, K the input
dimension, last) and `scale` one float32 per output row ([N] or [E, N]); a per-tensor scale is expanded to every
row at load, so the kernels see one form. The real weight is `weight * scale[..., None]`.

  dequantize   the whole tensor in float32 (or the given dtype) by torch ops: the twin every FP8 kernel is
               compared with, and what the reference path runs
  row_scale    the one scale rule, for weights and activations alike: amax / 448 per row in float32, at least
               float32's eps (an all-zero row gets a tiny positive scale, never a division by zero)
  has_fp8_mma, has_scaled_grouped_mm
               whether a device multiplies FP8 on its tensor cores (torch._scaled_mm; Triton's e4m3 tl.dot), and
               whether torch._scaled_grouped_mm runs there with row-wise scales (probed once, at tiny shapes)
  quantize_fp8 a bf16 / f32 weight [.., N, K] -> Fp8Weight, per output row by row_scale (round to nearest even,
               saturating at ±448): what the tests' FP8 weights are and what the fp8 quantize profile writes
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import TensorError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
SCALE_MIN = torch.finfo(torch.float32).eps


@dataclass
class Fp8Weight:
    """One FP8 tensor: e4m3 values [.., N, K] and float32 per-output-row scales [.., N]."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE:
            raise TensorError(f"Fp8Weight.weight: dtype {self.weight.dtype}; expected {FP8_DTYPE}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != tuple(self.weight.shape[:-1]):
            raise TensorError(f"Fp8Weight.scale: {self.scale.dtype} {tuple(self.scale.shape)}; expected "
                              f"torch.float32 {tuple(self.weight.shape[:-1])} (one scale per output row)")

    @property
    def shape(self) -> tuple:
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.weight.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """weight * scale per row, computed in float32 (exact: e4m3 times an f32 scale rounds once), then cast."""
        return (self.weight.float() * self.scale.unsqueeze(-1)).to(dtype)


def row_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-row scales from per-row max |values| (float32): amax / 448, at least SCALE_MIN."""
    # a 0-dim tensor on amax's device, not a Python number: CUDA divides by a host scalar as a product with its
    # reciprocal, which is not the IEEE quotient the kernels (div_rn) and the CPU compute
    return torch.clamp(amax.float() / torch.full((), FP8_MAX, device=amax.device), min=SCALE_MIN)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """w [.., N, K] (any float dtype) -> Fp8Weight with one scale per output row: e4m3(w / scale), saturated."""
    if w.dim() < 2 or not w.is_floating_point():
        raise TensorError(f"quantize_fp8: expected a float tensor [.., N, K], got {w.dtype} {list(w.shape)}")
    scale = row_scale(w.float().abs().amax(dim=-1))
    q = (w.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q, scale)


@functools.lru_cache(maxsize=None)
def has_fp8_mma(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores torch._scaled_mm and Triton use (CUDA, compute capability 8.9+)."""
    device = torch.device(device)
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


@functools.lru_cache(maxsize=None)
def has_scaled_grouped_mm(device: torch.device) -> bool:
    """Whether torch._scaled_grouped_mm runs on `device` with float32 row-wise scales: one call at tiny shapes, in
    the layout the expert path uses (x row-major [M, K], the stack's [E, N, K] values as its [E, K, N] transpose)."""
    device = torch.device(device)
    if not has_fp8_mma(device) or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    try:
        probe_scaled_grouped_mm(device)
        torch.cuda.synchronize(device)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def probe_scaled_grouped_mm(device: torch.device) -> torch.Tensor:
    """One torch._scaled_grouped_mm call at small shapes in the expert path's layout (raises where it does not run)."""
    q = torch.zeros(64, 128, dtype=FP8_DTYPE, device=device)
    w = torch.zeros(2, 128, 128, dtype=FP8_DTYPE, device=device)
    return torch._scaled_grouped_mm(q, w.transpose(-2, -1), scale_a=torch.ones(64, device=device),
                                    scale_b=torch.ones(2, 128, device=device),
                                    offs=torch.tensor([16, 64], dtype=torch.int32, device=device),
                                    out_dtype=torch.bfloat16)
