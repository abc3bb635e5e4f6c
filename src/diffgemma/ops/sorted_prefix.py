"""The accept rule's sorted-prefix mask (sampling/accept.py) in one kernel: position i is accepted when the
entropies sorted before it (ascending, ties by index) sum to at most the bound.

The torch twin sorts, scans and scatters: eight kernels a step (a radix sort for a canvas of 256, then mostly
launch latency), on the critical path of every step. Here one program compares
every pair: j is before i when h_j < h_i, or h_j == h_i and j < i (the order of a stable sort, which the
CUDA radix sort is), and i's prefix is the sum of the h_j before it. That sum is a tree reduction, not the
twin's scan minus h_i, so the two round differently: they can disagree only where a prefix lies within
rounding of the bound. Frozen positions sort last as +inf (the twin's trick), and are accepted; a NaN
entropy is never accepted (the twin's prefix is NaN there).

Lanes (`sorted_prefix_lanes_triton`): one program per lane of a batch, each over its own entropies in one [R]
tensor with its own bound; a lane's program is the one-lane kernel's with the same BLOCK and JB, so its mask is the
bits that lane gets alone.
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _entropies(h_ptr, frozen_ptr, idx, C, HAS_FROZEN: tl.constexpr):
        ok = idx < C
        h = tl.load(h_ptr + idx, mask=ok, other=float("inf")).to(tl.float32)
        if HAS_FROZEN:
            h = tl.where(tl.load(frozen_ptr + idx, mask=ok, other=0) != 0, float("inf"), h)
        return h

    @triton.jit
    def _sorted_prefix_kernel(h_ptr, frozen_ptr, out_ptr, bound, C, lanes_ptr, HAS_FROZEN: tl.constexpr,
                              BLOCK: tl.constexpr, JB: tl.constexpr, LANES: tl.constexpr):
        """LANES: program p is lane p, whose (first index, length, bound bits) are lanes_ptr[3p .. 3p + 2] (int32)."""
        if LANES:
            at = tl.program_id(0) * 3
            first = tl.load(lanes_ptr + at).to(tl.int64)
            C = tl.load(lanes_ptr + at + 1)
            bound = tl.load(lanes_ptr + at + 2).to(tl.float32, bitcast=True)
            h_ptr += first
            out_ptr += first
        i = tl.arange(0, BLOCK)
        h = _entropies(h_ptr, frozen_ptr, i, C, HAS_FROZEN)
        prefix = tl.zeros((BLOCK,), dtype=tl.float32)
        for j0 in range(0, BLOCK, JB):  # [BLOCK, JB] pairs at a time (a [256, 256] tile would spill)
            j = j0 + tl.arange(0, JB)
            hj = _entropies(h_ptr, frozen_ptr, j, C, HAS_FROZEN)[None, :]
            before = (hj < h[:, None]) | ((hj == h[:, None]) & (j[None, :] < i[:, None]))
            prefix += tl.sum(tl.where(before, hj, 0.0), axis=1)
        accept = (prefix <= bound) & (h == h)
        if HAS_FROZEN:
            accept = accept | (tl.load(frozen_ptr + i, mask=i < C, other=0) != 0)
        tl.store(out_ptr + i, accept.to(tl.int8), mask=i < C)


def sorted_prefix_triton(entropy: torch.Tensor, bound: float, frozen: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [C]: the accepted positions (frozen ones included) for entropies [C]."""
    C = entropy.shape[0]
    out = torch.empty(C, dtype=torch.int8, device=entropy.device)
    h = entropy.contiguous()
    _sorted_prefix_kernel[(1,)](h, frozen.contiguous() if frozen is not None else h, out, float(bound), C, out,
                                HAS_FROZEN=frozen is not None, BLOCK=next_pow2(C), JB=min(32, next_pow2(C)),
                                LANES=False, num_warps=8)
    return out.view(torch.bool)


def lanes_table(starts, lengths, bounds) -> torch.Tensor:
    """int32 [B, 3] on the host: each lane's (first index, length, bound as f32 bits) for sorted_prefix_lanes_triton."""
    bits = torch.tensor([float(b) for b in bounds], dtype=torch.float32).view(torch.int32)
    return torch.stack([torch.tensor(starts, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32), bits], 1)


def sorted_prefix_lanes_triton(entropy: torch.Tensor, lanes: torch.Tensor, block: int) -> torch.Tensor:
    """Int8 [R] (bool view): lane b's accepted positions at its indices, for entropies [R] and `lanes` (lanes_table's
    [B, 3], on the device). block: next_pow2 of every lane's length (the one-lane kernel's BLOCK for each); indices in
    no lane are left unwritten."""
    out = torch.empty(entropy.shape[0], dtype=torch.int8, device=entropy.device)
    h = entropy.contiguous()
    _sorted_prefix_kernel[(lanes.shape[0],)](h, h, out, 0.0, 0, lanes, HAS_FROZEN=False, BLOCK=block,
                                             JB=min(32, block), LANES=True, num_warps=8)
    return out.view(torch.bool)
