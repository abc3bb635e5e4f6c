"""Final-logit softcap plus the sampler's per-row statistics, in one pass over the logits.

softcap: logits = cap · tanh(raw / cap), returned as float32 (the denoise contract).
row stats of softmax(logits · inv_temp), without materialising the softmax:
  entropy  H = logsumexp(z) − Σ p·z            (nats)
  argmax   first index of the row maximum      (ties -> lower index, like torch.argmax)
  maxprob  p[argmax] = 1 / Σ exp(z − max)
  lse      logsumexp(z)                        (so a later kernel can form p without a second reduction)
The kernel keeps a running (max, Σe, Σe·z) per row and rescales when the max moves (online softmax).
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


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
    def _softcap_rowstats_kernel(raw_ptr, out_ptr, ent_ptr, amax_ptr, pmax_ptr, lse_ptr, n_cols, cap, inv_temp,
                                 STATS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = -float("inf")
        s = 0.0
        t = 0.0
        best = -float("inf")
        best_i = 0
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
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


def softcap_rowstats_triton(raw, cap, inv_temp, stats=True, block=2048):
    raw = raw.contiguous()
    rows, n = raw.shape
    out = torch.empty((rows, n), dtype=torch.float32, device=raw.device)
    ent = torch.empty(rows, dtype=torch.float32, device=raw.device)
    amax = torch.empty(rows, dtype=torch.int64, device=raw.device)
    pmax = torch.empty(rows, dtype=torch.float32, device=raw.device)
    lse = torch.empty(rows, dtype=torch.float32, device=raw.device)
    _softcap_rowstats_kernel[(rows,)](raw, out, ent, amax, pmax, lse, n, float(cap), float(inv_temp),
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


# ---------------------------------------------------------------------------------------------------
# The sampler's per-step statistics on already-softcapped f32 logits, divided by the step temperature.
#
# z = logits / T is a correctly rounded division (div_rn) so z, its max and its argmax are bit-identical to
# torch's `logits / T`; entropy and lse come from the online formula above (float-rounding away from the
# torch formula in sampling/stats.py, which stays the CPU path). One read of the [R, V] logits gives all of
# entropy, argmax, row max and lse; `tempered_survivors` is the second (and last) full read of a step: the
# sparse self-conditioning's survivor mask z >= thr[row], with per-row counts so the caller can size a
# sync-free nonzero.

def tempered_rowstats_ref(logits, temp):
    """-> (entropy [R] f32, argmax [R] int64, rowmax [R] f32, lse [R] f32) of z = logits / temp."""
    z = logits.float() / torch.full((), temp, dtype=torch.float32, device=logits.device)
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse[:, None]
    entropy = -(torch.exp(logp) * logp).sum(-1)
    return entropy, z.argmax(-1), z.max(-1).values, lse


def tempered_survivors_ref(logits, temp, thr):
    """-> (bool mask [R, V] of z >= thr[:, None], int32 counts [R]) with z = logits / temp."""
    z = logits.float() / torch.full((), temp, dtype=torch.float32, device=logits.device)
    mask = z >= thr[:, None]
    return mask, mask.sum(-1, dtype=torch.int32)


if HAVE_TRITON:

    @triton.jit
    def _tempered_rowstats_kernel(x_ptr, ent_ptr, amax_ptr, max_ptr, lse_ptr, n_cols, temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        # running over the columns seen so far: m = max z, s = sum e, u = sum e * (z - m), e = exp(z - m);
        # then H = log s - u / s, with no cancellation against m (lse - sum p*z loses ~1e-4 nats at |z| ~ 100)
        m = -float("inf")
        s = 0.0
        u = 0.0
        best_i = 0
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            z = tl.where(mask, tl.math.div_rn(x, temp), -float("inf"))
            cmax = tl.max(z, axis=0)
            # lowest column holding this block's max; strictly-greater keeps the earlier block on ties
            cidx = tl.min(tl.where(z == cmax, cols, n_cols), axis=0)
            best_i = tl.where(cmax > m, cidx, best_i)
            m_new = tl.maximum(m, cmax)
            alpha = tl.exp(m - m_new)
            d = tl.where(mask, z - m_new, 0.0)
            e = tl.where(mask, tl.exp(d), 0.0)
            # moving the reference from m to m_new: u' = alpha * (u + s * (m - m_new)); s == 0 before any column
            shift = s * (tl.where(s > 0.0, m, m_new) - m_new)
            u = alpha * (u + shift) + tl.sum(e * d, axis=0)
            s = s * alpha + tl.sum(e, axis=0)
            m = m_new
        lse = m + tl.log(s)
        tl.store(ent_ptr + row, tl.log(s) - u / s)
        tl.store(amax_ptr + row, best_i.to(tl.int64))
        tl.store(max_ptr + row, m)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _tempered_survivors_kernel(x_ptr, thr_ptr, mask_ptr, count_ptr, n_cols, temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        thr = tl.load(thr_ptr + row)
        count = 0
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            inside = cols < n_cols
            x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
            keep = (tl.math.div_rn(x, temp) >= thr) & inside
            tl.store(mask_ptr + row * n_cols + cols, keep.to(tl.int8), mask=inside)
            count += tl.sum(keep.to(tl.int32), axis=0)
        tl.store(count_ptr + row, count)


def tempered_rowstats_triton(logits, temp, block=2048):
    logits = logits.contiguous()
    rows, n = logits.shape
    dev = logits.device
    ent = torch.empty(rows, dtype=torch.float32, device=dev)
    amax = torch.empty(rows, dtype=torch.int64, device=dev)
    rowmax = torch.empty(rows, dtype=torch.float32, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    _tempered_rowstats_kernel[(rows,)](logits, ent, amax, rowmax, lse, n, float(temp), BLOCK=block, num_warps=8)
    return ent, amax, rowmax, lse


def tempered_survivors_triton(logits, temp, thr, block=2048):
    logits = logits.contiguous()
    rows, n = logits.shape
    mask = torch.empty((rows, n), dtype=torch.int8, device=logits.device)
    counts = torch.empty(rows, dtype=torch.int32, device=logits.device)
    _tempered_survivors_kernel[(rows,)](logits, thr.float().contiguous(), mask, counts, n, float(temp),
                                        BLOCK=block, num_warps=8)
    return mask.view(torch.bool), counts


def tempered_rowstats(logits, temp):
    """Row stats of logits / temp: -> (entropy, argmax, rowmax, lse); Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return tempered_rowstats_triton(logits, temp)
    return tempered_rowstats_ref(logits, temp)


def tempered_survivors(logits, temp, thr):
    """Survivor mask z >= thr[row] of z = logits / temp, and per-row counts; Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return tempered_survivors_triton(logits, temp, thr)
    return tempered_survivors_ref(logits, temp, thr)
