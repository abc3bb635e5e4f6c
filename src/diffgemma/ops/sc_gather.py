"""The sparse self-conditioning sum: out[r] = Σ_k w[k] · E[cols[k]] over row r's survivors, in f32.

The survivors arrive row by row (rows ascending, as nonzero lists a mask), so row r's are the index range
starts[r] .. starts[r + 1]. On the CPU the sum is a chunked index_add_ (`segment_embed_ref`). On CUDA,
index_add_ adds with atomics, in an order that changes from run to run, so the same seed and prompt could
give different tokens (docs/ARCHITECTURE.md, 'Deterministic reductions, and why').

The kernels fix the order instead. Each row's survivors are cut into chunks of CHUNK (a flat row can keep
thousands of tokens, so one program per row would be one long serial loop); one program sums a chunk in index
order, and a second kernel adds each row's chunk sums in chunk order. Every add is a separately rounded
multiply and add (`mul.rn.f32` / `add.rn.f32` in PTX: the compiler would otherwise fuse them into an FMA,
and libdevice's versions flush denormals), so the result is the same on every run and equal, bit for bit,
to `segment_embed_chunked_ref`, the same chunked sum written in torch (the tests' twin). Both kernels derive
each row's survivor and chunk offsets from the row counts themselves, so a gather is two launches and no small
torch ops: a trained model keeps few survivors a row, which this reads directly, with neither an
index_add_ nor offsets made on the host (a sync).
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, interpreting, next_pow2, use_triton
from .rows_at import aligned

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


def segment_embed_chunked_ref(row_counts, cols, weights, embedding, chunk: int) -> torch.Tensor:
    """The kernels' arithmetic in torch: per row, chunks of `chunk` survivors summed in order from 0, then the
    row's chunk sums added in order from 0 (slow: a Python loop over survivors; for the tests)."""
    out = torch.zeros(row_counts.shape[0], embedding.shape[1], dtype=torch.float32, device=embedding.device)
    start = 0
    for r, c in enumerate(row_counts.tolist()):
        row = torch.zeros(embedding.shape[1], dtype=torch.float32, device=embedding.device)
        for j in range(start, start + c, chunk):
            part = torch.zeros_like(row)
            for k in range(j, min(j + chunk, start + c)):
                part = part + weights[k].float() * embedding[cols[k]].float()
            row = row + part
        out[r] = row
        start += c
    return out


CHUNK = 32  # survivors per program: bounds a program's serial loop whatever the rows' counts

if HAVE_TRITON:

    @triton.jit
    def _mul_add_rn(acc, w, e, PTX: tl.constexpr):
        """acc + w·e with both roundings (no FMA). PTX off: the interpreter's numpy, which never fuses."""
        if PTX:
            p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [tl.zeros_like(e) + w, e],
                                          dtype=tl.float32, is_pure=True, pack=1)
            return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [acc, p], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return acc + w * e

    @triton.jit
    def _row_chunks(counts_ptr, R, CHUNK: tl.constexpr, RP: tl.constexpr):
        """Every row's survivor count and chunk count, and the chunks through each row (inclusive), computed in
        the kernel from the counts alone: no offset arithmetic on the host (its small torch ops and their
        launches were most of a small gather's time)."""
        i = tl.arange(0, RP)
        cnt = tl.load(counts_ptr + i, mask=i < R, other=0).to(tl.int64)
        nch = (cnt + CHUNK - 1) // CHUNK
        return i, cnt, nch, tl.cumsum(nch, 0)

    @triton.jit
    def _chunk_sum_kernel(counts_ptr, cols_ptr, w_ptr, emb_ptr, part_ptr, R, H,
                          CHUNK: tl.constexpr, RP: tl.constexpr, BLOCK_H: tl.constexpr, PTX: tl.constexpr):
        """Program p: chunk p of all rows' chunks (the grid is an upper bound; programs past the last exit)."""
        p = tl.program_id(0)
        i, cnt, nch, ends = _row_chunks(counts_ptr, R, CHUNK, RP)
        if p < tl.sum(nch, axis=0):
            row = tl.sum((ends <= p).to(tl.int32), axis=0)  # rows whose chunks all come before p
            before = i < row
            start = tl.sum(tl.where(before, cnt, 0), axis=0)  # the row's first survivor
            lo = start + (p - tl.sum(tl.where(before, nch, 0), axis=0)) * CHUNK
            hi = tl.minimum(lo + CHUNK, start + tl.sum(tl.where(i == row, cnt, 0), axis=0))
            h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            ok = h < H
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for k in range(lo, hi):
                c = tl.load(cols_ptr + k).to(tl.int64)
                w = tl.load(w_ptr + k)
                e = tl.load(emb_ptr + c * H + h, mask=ok, other=0.0).to(tl.float32)
                acc = _mul_add_rn(acc, w, e, PTX)
            tl.store(part_ptr + p.to(tl.int64) * H + h, acc, mask=ok)

    @triton.jit
    def _row_sum_kernel(counts_ptr, part_ptr, out_ptr, R, H, CHUNK: tl.constexpr, RP: tl.constexpr,
                        BLOCK_H: tl.constexpr):
        r = tl.program_id(0)
        i, cnt, nch, ends = _row_chunks(counts_ptr, R, CHUNK, RP)
        first = tl.sum(tl.where(i < r, nch, 0), axis=0)
        last = first + tl.sum(tl.where(i == r, nch, 0), axis=0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = h < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for p in range(first, last):
            acc = acc + tl.load(part_ptr + p * H + h, mask=ok, other=0.0)  # p: int64 (from the counts)
        tl.store(out_ptr + r.to(tl.int64) * H + h, acc, mask=ok)


def segment_embed_triton(row_counts, cols, weights, embedding, chunk: int = CHUNK, block_h: int = 512) -> torch.Tensor:
    """row_counts int [R] (survivors per row, rows in order), cols / weights [n] in row order -> f32 [R, H].
    No host read and no offset arithmetic outside the kernels: the grid is sized by n (the host knows it) and R,
    an upper bound on the chunks."""
    R, n, H = row_counts.shape[0], cols.shape[0], embedding.shape[1]
    dev = embedding.device
    max_chunks = n // chunk + R  # Σ ceil(c_r / chunk) <= Σ (floor(c_r / chunk) + 1)
    part = torch.empty(max_chunks, H, dtype=torch.float32, device=dev)
    out = torch.empty(R, H, dtype=torch.float32, device=dev)
    hb = triton.cdiv(H, block_h)
    ptx = not interpreting()
    # CUDA's nonzero_static lays its [n, 2] result out as [2, n] storage, so the column list starts n int64s in:
    # aligned for even n only. Copied when odd, so lists of both parities run one compiled variant of the kernels
    # (a second would compile mid-run).
    counts, rp = aligned(row_counts), next_pow2(R)
    _chunk_sum_kernel[(max_chunks, hb)](counts, aligned(cols), aligned(weights.float()), embedding.contiguous(),
                                        part, R, H, CHUNK=chunk, RP=rp, BLOCK_H=block_h, PTX=ptx, num_warps=4)
    _row_sum_kernel[(R, hb)](counts, part, out, R, H, CHUNK=chunk, RP=rp, BLOCK_H=block_h, num_warps=4)
    return out


def segment_embed(rows, row_counts, cols, weights, embedding, cpu_chunk: int) -> torch.Tensor:
    """The survivors' weighted embedding rows summed per canvas row, f32 [R, H]: the kernels on CUDA (the same
    bits on every run), the index_add_ twin elsewhere (`cpu_chunk` survivors gathered at a time).
    rows / cols / weights: [n], rows ascending; row_counts: [R], their survivors per row."""
    if not (rows.shape == cols.shape == weights.shape and rows.dim() == 1):
        raise TensorError(f"segment_embed: rows / cols / weights must be 1-D of one length, got "
                          f"{list(rows.shape)} / {list(cols.shape)} / {list(weights.shape)}")
    if use_triton(embedding):
        return segment_embed_triton(row_counts, cols, weights, embedding)
    return segment_embed_ref(rows, cols, weights, embedding, row_counts.shape[0], cpu_chunk)
