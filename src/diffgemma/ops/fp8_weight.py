"""FP8 weights on the device: float8 e4m3 values with one float32 scale per output channel.

An `Fp8Weight` is what an FP8 checkpoint's linear (or expert stack) becomes when the engine keeps it in 8 bits:
`weight` holds the e4m3 values as published ([N, K] for a linear, [E, N, K] for an expert stack, K the input
dimension, last) and `scale` one float32 per output row ([N] or [E, N]); a per-tensor scale is expanded to every
row at load, so the kernels see one form. The real weight is `weight * scale[..., None]`.

  dequantize   the whole tensor in float32 (or the given dtype) by torch ops: the twin every FP8 kernel is
               compared with, and what the reference path runs
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TensorError

FP8_DTYPE = torch.float8_e4m3fn


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
