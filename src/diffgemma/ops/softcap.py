"""Final-logit softcap plus the sampler's per-row statistics, in one pass over the logits.

softcap: logits = cap · tanh(raw / cap), returned as float32 (the denoise contract).
row stats of softmax(logits · inv_temp), without materialising the softmax:
  entropy  H = logsumexp(z) − Σ p·z            (nats)
  argmax   first index of the row maximum      (ties -> lower index, like torch.argmax)
  maxprob  p[argmax] = 1 / Σ exp(z − max)
  lse      logsumexp(z)                        (so a later kernel can form p without a second reduction)
The kernel keeps a running (max, Σe, Σe·z) per row and rescales when the max moves (online softmax).
Its plain softcap (no stats) runs over the row segments every pass over the sampler's rows uses (row_segments);
it is also the kernel that fills the softcap tables of ops/tempered_tables.py.
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

# The sampler's rows are few and long (256 x 262144 at full size). One program per row leaves most of the
# GPU's memory parallelism idle, reading at a fraction of its bandwidth. So the
# column range of a row is cut into segments of SEGMENT columns, one program each; reductions write one
# partial per segment and a small kernel combines them. A row of at most SEGMENT columns (the demo
# model's 2048) is one segment, with the same arithmetic as one program per row.
SEGMENT = 16384


def row_segments(n_cols: int, block: int, segment: int) -> tuple[int, int]:
    """-> (segments per row, columns per segment: a whole number of blocks)."""
    span = max(block, segment // block * block)
    return -(-n_cols // span), span


def softcap_ref(raw, cap):
    return torch.tanh(raw.float() / cap) * cap


def rowstats_ref(logits, inv_temp):
    z = logits.float() * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse[:, None])
    entropy = lse - (p * z).sum(-1)
    amax = z.argmax(-1)
    maxprob = p.gather(1, amax[:, None])[:, 0]
    return entropy, amax, maxprob, lse


def softcap_rowstats_ref(raw, cap, inv_temp):
    logits = softcap_ref(raw, cap)
    return (logits, *rowstats_ref(logits, inv_temp))


if HAVE_TRITON:

    @triton.jit
    def _softcap_rowstats_kernel(raw_ptr, out_ptr, ent_ptr, amax_ptr, pmax_ptr, lse_ptr, n_cols, span, cap,
                                 inv_temp, STATS: tl.constexpr, BLOCK: tl.constexpr):
        # STATS needs the whole row in one program (span >= n_cols); the plain softcap runs per segment
        row = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * span
        last = tl.minimum(first + span, n_cols)
        offs = tl.arange(0, BLOCK)
        m = -float("inf")
        s = 0.0
        t = 0.0
        best = -float("inf")
        best_i = 0
        for start in range(first, last, BLOCK):
            cols = start + offs
            mask = cols < last
            x = tl.load(raw_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            y = x / cap
            # tanh via exp (portable to the interpreter); saturates cleanly: exp overflow -> 1
            th = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)
            lg = th * cap
            tl.store(out_ptr + row * n_cols + cols, lg, mask=mask)
            if STATS:
                z = tl.where(mask, lg * inv_temp, -float("inf"))
                cmax = tl.max(z, axis=0)
                # lowest column that holds this block's max; strictly-greater keeps the earlier block on ties
                cidx = tl.min(tl.where(z == cmax, cols, n_cols), axis=0)
                best_i = tl.where(cmax > best, cidx, best_i)
                best = tl.maximum(best, cmax)
                m_new = tl.maximum(m, cmax)
                alpha = tl.exp(m - m_new)
                e = tl.where(mask, tl.exp(z - m_new), 0.0)
                s = s * alpha + tl.sum(e, axis=0)
                t = t * alpha + tl.sum(e * tl.where(mask, z, 0.0), axis=0)
                m = m_new
        if STATS:
            lse = m + tl.log(s)
            tl.store(ent_ptr + row, lse - t / s)
            tl.store(amax_ptr + row, best_i.to(tl.int64))
            tl.store(pmax_ptr + row, 1.0 / s)
            tl.store(lse_ptr + row, lse)


def softcap_rowstats_triton(raw, cap, inv_temp, stats=True, block=2048, segment=SEGMENT):
    raw = raw.contiguous()
    rows, n = raw.shape
    n_seg, span = row_segments(n, block, segment) if not stats else (1, max(n, 1))
    out = torch.empty((rows, n), dtype=torch.float32, device=raw.device)
    ent = torch.empty(rows, dtype=torch.float32, device=raw.device)
    amax = torch.empty(rows, dtype=torch.int64, device=raw.device)
    pmax = torch.empty(rows, dtype=torch.float32, device=raw.device)
    lse = torch.empty(rows, dtype=torch.float32, device=raw.device)
    _softcap_rowstats_kernel[(rows, n_seg)](raw, out, ent, amax, pmax, lse, n, span, float(cap), float(inv_temp),
                                            STATS=stats, BLOCK=block, num_warps=8)
    return out, ent, amax, pmax, lse


def softcap(raw, cap):
    if use_triton(raw):
        return softcap_rowstats_triton(raw, cap, 1.0, stats=False)[0]
    return softcap_ref(raw, cap)


def softcap_rowstats(raw, cap, inv_temp):
    """-> (logits f32 [R,V], entropy [R], argmax [R] int64, maxprob [R], lse [R])."""
    if use_triton(raw):
        return softcap_rowstats_triton(raw, cap, inv_temp)
    return softcap_rowstats_ref(raw, cap, inv_temp)
