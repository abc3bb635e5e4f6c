"""A kernel input named by its address in device memory, so a CUDA graph reads the caller's tensor without a copy.

A graph's kernels read fixed addresses. The denoise graph's SC input (the previous step's f32 logits, [256, 262144]
at full size: 268 MB) copied into a static buffer before every replay would cost twice that in memory traffic
each step. Instead the graph's kernels that read it load where it lies from a one-element int64 device tensor, and
the replay writes the caller's tensor's place there first (an 8-byte fill).

  RowsAt              [rows, cols] f32 rows that lie where `offset` says; point_at(t) names t
  kernel_args         a tensor's or a RowsAt's arguments for a kernel that reads either
  aligned             a tensor contiguous and starting on an ALIGN boundary (a copy where it does not)
"""

from __future__ import annotations

import torch

from ..errors import TensorError


ALIGN = 16  # bytes; the allocator's blocks start on 512


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and starting on an ALIGN-byte boundary (a copy where it does not): kernels that load 16-byte
    vectors need it, and Triton compiles a kernel once per pointer alignment, so a view at an odd offset would
    otherwise cost a second compile (ops/sc_gather.py)."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


class RowsAt:
    """Stands where a contiguous f32 [rows, cols] tensor would. The tensor point_at names must stay alive until the
    kernels that read it have run (stream order: until the caller's next use of its stream is enough).

    The kernels get a pointer of their own (`anchor`) and, in device memory, the named tensor's distance from it in
    elements (`offset`): anchor + offset is the tensor. Pointer arithmetic, so no integer-to-pointer cast."""

    dtype = torch.float32

    def __init__(self, rows: int, cols: int, device):
        self.shape = torch.Size((rows, cols))
        self.anchor = torch.zeros(1, dtype=self.dtype, device=device)
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)
        self.device = self.anchor.device  # "cuda" made concrete ("cuda:0"), as a tensor's device is

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def point_at(self, t: torch.Tensor) -> None:
        if t.shape != self.shape or t.dtype != self.dtype or t.device != self.device or not t.is_contiguous():
            raise TensorError(f"RowsAt: expected a contiguous {self.dtype} tensor of shape {list(self.shape)} on "
                              f"{self.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                              + ("" if t.is_contiguous() else " (not contiguous)"))
        gap = t.data_ptr() - self.anchor.data_ptr()
        if gap % ALIGN:  # the kernels load 16-byte vectors; a view at an odd offset must be copied first
            raise TensorError(f"RowsAt: the tensor's data must start on a {ALIGN}-byte boundary "
                              f"(address {t.data_ptr():#x}); pass a copy (t.clone())")
        self.offset.fill_(gap // t.element_size())


def kernel_args(x) -> tuple:
    """-> (pointer, offset pointer, ADDR flag) for a kernel that reads `x`, a tensor or a RowsAt, as
    `xb = x_ptr + tl.load(off_ptr)` when ADDR (x_ptr itself otherwise; off_ptr is then never read)."""
    if isinstance(x, RowsAt):
        return x.anchor, x.offset, True
    x = x.contiguous()
    return x, x, False
