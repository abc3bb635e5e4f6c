"""The sparse self-conditioning sum: out[r] = Σ_k w[k] · E[cols[k]] over row r's survivors, in f32.

The survivors arrive row by row (rows ascending, as nonzero lists a mask), so row r's are the index range
starts[r] .. starts[r + 1]. The torch twin is the chunked index_add_ the CPU path uses. On CUDA, index_add_
adds with atomics, in an order that changes from run to run: the same seed and prompt gave different tokens
on the H200 whenever a step took the gather (bench/RESULTS.md, round 8). The kernel gives each (row, column
block) one program that adds its row's survivors in index order, the order of the CPU's index_add_, with
separately rounded multiplies and adds (`mul.rn.f32` / `add.rn.f32` in PTX: the compiler would otherwise
fuse them into an FMA, and libdevice's versions flush denormals). So it gives the same bits on every run,
and the CPU twin's bits.
"""

from __future__ import annotations

import os

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


def segment_embed_ref(rows, cols, weights, embedding, n_rows: int, chunk: int) -> torch.Tensor:
    """index_add_ of weights[k] · embedding[cols[k]] (as f32) into row rows[k], `chunk` survivors at a time
    (the gathered rows of a chunk are the only [chunk, H] temporaries)."""
    out = torch.zeros(n_rows, embedding.shape[1], dtype=torch.float32, device=embedding.device)
    for s in range(0, rows.shape[0], chunk):
        out.index_add_(0, rows[s: s + chunk], weights[s: s + chunk, None] * embedding[cols[s: s + chunk]].float())
    return out


if HAVE_TRITON:

    @triton.jit
    def _mul_add_rn(acc, w, e, PTX: tl.constexpr):
        """acc + w·e with both roundings (no FMA). PTX off: the interpreter's numpy, which never fuses."""
        if PTX:
            p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [tl.zeros_like(e) + w, e], dtype=tl.float32,
                                          is_pure=True, pack=1)
            return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [acc, p], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return acc + w * e

    @triton.jit
    def _segment_embed_kernel(starts_ptr, cols_ptr, w_ptr, emb_ptr, out_ptr, H, BLOCK_H: tl.constexpr,
                              PTX: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = h < H
        lo = tl.load(starts_ptr + r)
        hi = tl.load(starts_ptr + r + 1)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(lo, hi):
            c = tl.load(cols_ptr + k).to(tl.int64)
            w = tl.load(w_ptr + k)
            e = tl.load(emb_ptr + c * H + h, mask=ok, other=0.0).to(tl.float32)
            acc = _mul_add_rn(acc, w, e, PTX)
        tl.store(out_ptr + r.to(tl.int64) * H + h, acc, mask=ok)


def segment_embed_triton(row_counts, cols, weights, embedding, block_h: int = 512) -> torch.Tensor:
    """row_counts int [R] (survivors per row, rows in order), cols / weights [n] in row order -> f32 [R, H]."""
    n_rows = row_counts.shape[0]
    H = embedding.shape[1]
    starts = torch.zeros(n_rows + 1, dtype=torch.int64, device=embedding.device)
    torch.cumsum(row_counts, 0, out=starts[1:])
    out = torch.empty(n_rows, H, dtype=torch.float32, device=embedding.device)
    _segment_embed_kernel[(n_rows, triton.cdiv(H, block_h))](starts, cols.contiguous(), weights.float().contiguous(),
                                                              embedding.contiguous(), out, H, BLOCK_H=block_h,
                                                              PTX=os.environ.get("TRITON_INTERPRET", "0") != "1",
                                                              num_warps=4)
    return out


def segment_embed(rows, row_counts, cols, weights, embedding, chunk: int) -> torch.Tensor:
    """The survivors' weighted embedding rows summed per canvas row, f32 [R, H]: the kernel on CUDA (same bits on
    every run), the index_add_ twin elsewhere. rows / cols / weights: [n], rows ascending; row_counts: [R]."""
    if not (rows.shape == cols.shape == weights.shape and rows.dim() == 1):
        raise TensorError(f"segment_embed: rows / cols / weights must be 1-D of one length, got "
                          f"{list(rows.shape)} / {list(cols.shape)} / {list(weights.shape)}")
    if use_triton(embedding):
        return segment_embed_triton(row_counts, cols, weights, embedding)
    return segment_embed_ref(rows, cols, weights, embedding, row_counts.shape[0], chunk)
