"""Attention of both passes, flash-style: no [queries × keys] score matrix in memory.

Shapes (the engine's layouts, so no copies around the call):
  q    [H, n, d]       head-major queries (qkv_prep writes them so)
  k, v [KV, rows, d]   the first `n_keys` rows are read (a cache buffer, or a dense K/V)
  kpos [n_keys] int    position of each key, -1 = not a key (empty ring slot, padded bucket row)
  qpos [n] int         query positions (causal mode only)
  out  [n, H·d]        what the o projection reads
Scale is 1 (QK-norm folds it). Masks:
  bidirectional (denoise canvas): key j is visible iff kpos[j] >= 0 (the caller's per-key mask:
      live window slots, cache rows, the canvas itself);
  causal (prefill): kpos[j] >= 0 and qpos - window < kpos[j] <= qpos (window = a huge number
      on full layers).
GQA: the H/KV query heads of one KV head are folded into one row axis (row r = local head·n + t),
so one program's K/V tile serves every head of its group. Key blocks with no visible key for any
row of the program are skipped (the causal upper triangle, the window's far past, a CUDA graph's
padded bucket rows), so a padded bucket costs almost nothing.

The kernel tiles the output's head dim by BD (hd 512 → two programs per row block, each
recomputing QK over the full 512): it keeps the f32 accumulator at [BM, BD] in registers.

  attention_ref     f32 twin, scores materialised per query block (tests, and the CPU path)
  attention_sdpa    torch SDPA with a boolean mask (round 1's path; for A/B on the GPU)
  attention_triton  the round-2 kernel (impl 'triton1'; kept for A/B)
  attention_flash   the round-3 kernel (ops/attention_flash.py: Q resident, split-KV canvas; impl 'triton')
  attention         dispatch: the kernel on CUDA, the twin elsewhere (`impl` overrides)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import HAVE_TRITON, use_triton
from .attention_flash import attention_flash

if HAVE_TRITON:
    import triton
    import triton.language as tl

NO_WINDOW = 1 << 30


def _mask(kpos, qpos, window, causal, rows):
    kp = kpos[None, :].long()
    if not causal:
        return (kp >= 0).expand(rows, -1)
    qp = qpos[:, None].long()
    return (kp >= 0) & (kp <= qp) & (kp > qp - window)


def attention_ref(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None,
                  q_block: int = 1024):
    H, n, d = q.shape
    KV = k.shape[0]
    kf = k[:, :n_keys].float().repeat_interleave(H // KV, 0)
    vf = v[:, :n_keys].float().masked_fill((kpos[:n_keys] < 0)[None, :, None], 0.0)  # never visible, never read
    vf = vf.repeat_interleave(H // KV, 0)
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    for s in range(0, n, q_block):
        qb = q[:, s: s + q_block].float()
        m = _mask(kpos[:n_keys], None if qpos is None else qpos[s: s + q_block], window, causal, qb.shape[1])
        sc = (qb @ kf.transpose(1, 2)).masked_fill(~m[None], float("-inf"))
        o = torch.softmax(sc, -1) @ vf  # [H, b, d]
        out[s: s + q_block] = o.transpose(0, 1).reshape(-1, H * d).to(out.dtype)
    return out


def attention_sdpa(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None,
                   q_block: int = 2048):
    H, n, d = q.shape
    KV = k.shape[0]
    K, V = k[:, :n_keys], v[:, :n_keys]
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    if not causal:  # the mask depends only on the key: fold the GQA group into the query length
        qg = q.reshape(KV, (H // KV) * n, d)
        o = F.scaled_dot_product_attention(qg[None], K[None], V[None], attn_mask=(kpos[:n_keys] >= 0)[None, None, None],
                                           scale=1.0)
        out.copy_(o[0].reshape(H, n, d).transpose(0, 1).reshape(n, H * d))
        return out
    Kx, Vx = K.repeat_interleave(H // KV, 0)[None], V.repeat_interleave(H // KV, 0)[None]
    for s in range(0, n, q_block):
        m = _mask(kpos[:n_keys], qpos[s: s + q_block], window, True, min(q_block, n - s))
        o = F.scaled_dot_product_attention(q[None, :, s: s + q_block], Kx, Vx, attn_mask=m[None, None], scale=1.0)
        out[s: s + q_block] = o[0].transpose(0, 1).reshape(-1, H * d)
    return out


if HAVE_TRITON:

    @triton.jit
    def _attn_block(n0, m_i, l_i, acc, q_rows, row_ok, qp, kb, vb, kpos_ptr, n_keys, window,
                    dk, dcols, HD: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
        LOG2E: tl.constexpr = 1.4426950408889634
        keys = n0 + tl.arange(0, BN)
        key_in = keys < n_keys
        kp = tl.load(kpos_ptr + keys, mask=key_in, other=-1)
        s = tl.zeros((q_rows.shape[0], BN), dtype=tl.float32)
        for d0 in tl.static_range(0, HD, BK):
            qc = tl.load(q_rows + d0 + dk[None, :], mask=row_ok[:, None], other=0.0)
            kc = tl.load(kb + keys[:, None].to(tl.int64) * HD + d0 + dk[None, :], mask=key_in[:, None], other=0.0)
            s += tl.dot(qc, tl.trans(kc))
        if CAUSAL:
            ok = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window)
        else:
            ok = (kp >= 0)[None, :]
        s = tl.where(ok, s * LOG2E, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p = 0 on masked keys, but 0·NaN would not be: masked V rows are not read
        vt = tl.load(vb + keys[:, None].to(tl.int64) * HD + dcols[None, :], mask=(key_in & (kp >= 0))[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        return m_new, l_i, acc

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, nlive_ptr, o_ptr, n_q, n_keys, k_head_stride, window,
                     n_ring, base_pos,
                     G: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, HAS_NLIVE: tl.constexpr):
        g = tl.program_id(1)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)  # folded rows of KV head g
        row_ok = rows < G * n_q
        t = rows % n_q
        h = g * G + rows // n_q
        q_rows = q_ptr + (g * G * n_q + rows).to(tl.int64)[:, None] * HD
        dk = tl.arange(0, BK)
        dcols = tl.program_id(2) * BD + tl.arange(0, BD)
        kb = k_ptr + g.to(tl.int64) * k_head_stride
        vb = v_ptr + g.to(tl.int64) * k_head_stride
        m_i = tl.full((BM,), -1.0e30, dtype=tl.float32)  # finite: an all-masked block leaves rows untouched
        l_i = tl.zeros((BM,), dtype=tl.float32)
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        if CAUSAL:
            # keys [0, n_ring): an unordered ring (masked per key); keys [n_ring, n_keys): position-ordered,
            # key i at base_pos + i - n_ring. Loop only over what some row of this block can see.
            qp = tl.load(qpos_ptr + t, mask=row_ok, other=0)
            qmax = tl.max(tl.where(row_ok, qp, -1), axis=0)
            qmin = tl.min(tl.where(row_ok, qp, 2**30), axis=0)
            first = qmin - window + 1  # oldest position any row sees
            ring_hi = tl.where(first < base_pos, n_ring, 0)
            for n0 in range(0, ring_hi, BN):
                m_i, l_i, acc = _attn_block(n0, m_i, l_i, acc, q_rows, row_ok, qp, kb, vb, kpos_ptr,
                                            tl.minimum(n_keys, n_ring), window, dk, dcols, HD, BK, BN, CAUSAL)
            lo = n_ring + tl.maximum(first - base_pos, 0)
            hi = tl.minimum(n_keys, n_ring + qmax + 1 - base_pos)
            for n0 in range(lo, hi, BN):
                m_i, l_i, acc = _attn_block(n0, m_i, l_i, acc, q_rows, row_ok, qp, kb, vb, kpos_ptr,
                                            hi, window, dk, dcols, HD, BK, BN, CAUSAL)
        else:
            hi = n_keys
            if HAS_NLIVE:  # a device-side bound (CUDA graphs): keys past it are never visible
                hi = tl.minimum(n_keys, tl.load(nlive_ptr).to(tl.int32))
            for n0 in range(0, hi, BN):
                m_i, l_i, acc = _attn_block(n0, m_i, l_i, acc, q_rows, row_ok, t, kb, vb, kpos_ptr,
                                            hi, window, dk, dcols, HD, BK, BN, CAUSAL)
        o = acc / l_i[:, None]
        optr = o_ptr + t.to(tl.int64)[:, None] * (G * tl.num_programs(1) * HD) + (h * HD)[:, None] + dcols[None, :]
        tl.store(optr, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def _config(d, causal):
    # Measured on the H200 (bench/RESULTS.md, round 2 run 2). hd 512: BN=64 with a 2-stage pipeline asks for
    # 262 KB of shared memory (> 232 KB); BN=32 with 3 stages fits and was the fastest variant (canvas over
    # 8k / 32k keys: 0.90 / 3.28 ms vs SDPA 1.22 / 3.87). hd 256: 4 warps was the fastest variant.
    # BD caps the f32 accumulator at [64, 256] per program (hd 512: two output halves per row block).
    if d >= 512:
        return dict(BM=64, BN=32, BK=64, BD=256, num_warps=8, num_stages=3)
    return dict(BM=64, BN=64, BK=min(64, d), BD=min(d, 256), num_warps=4, num_stages=2)


def attention_triton(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None,
                     n_ring=0, base_pos=0, nlive=None, **cfg):
    """Kernel-only hints (the twins ignore them, they only bound the loops): causal keys [n_ring, n_keys)
    are position-ordered from base_pos; nlive (device scalar) bounds the visible keys of a bidirectional call."""
    H, n, d = q.shape
    KV = k.shape[0]
    assert q.is_contiguous() and k.stride(2) == 1 and k.stride(1) == d and v.stride() == k.stride()
    c = dict(_config(d, causal), **cfg)
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    G = H // KV
    grid = (triton.cdiv(G * n, c["BM"]), KV, d // c["BD"])
    _attn_kernel[grid](q, k, v, kpos, qpos if causal else kpos, nlive if nlive is not None else kpos, out, n, n_keys,
                       k.stride(0), int(min(window, NO_WINDOW)), int(n_ring), int(base_pos),
                       G=G, HD=d, BD=c["BD"], BK=c["BK"], BM=c["BM"], BN=c["BN"], CAUSAL=causal,
                       HAS_NLIVE=nlive is not None,
                       num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out


_KERNELS = {"triton": attention_flash, "triton1": attention_triton}
_triton_failed: dict = {}  # (head_dim, causal, impl) -> why the kernel could not compile/launch here; SDPA takes over


def attention(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None, impl=None,
              n_ring=0, base_pos=0, nlive=None):
    """-> [n, H·d]. impl: None (kernel on CUDA, twin elsewhere), 'triton' (round 3), 'triton1' (round 2),
    'sdpa' or 'ref'."""
    if impl is None:
        impl = "triton" if use_triton(q) else "ref"
    sig = (q.shape[-1], causal, impl)
    if impl in _KERNELS and (q.shape[-1] < 16 or sig in _triton_failed):  # tl.dot needs K >= 16
        impl = "sdpa" if q.is_cuda else "ref"
    kw = dict(qpos=qpos, window=window, causal=causal, out_dtype=out_dtype)
    if impl in _KERNELS:
        try:
            return _KERNELS[impl](q, k, v, kpos, n_keys, n_ring=n_ring, base_pos=base_pos, nlive=nlive, **kw)
        except Exception as e:  # never wrong, only slower: say why and use SDPA from now on
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            import warnings

            _triton_failed[sig] = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"diffgemma attention: Triton kernel {sig[2]} unavailable for head_dim {sig[0]} causal={sig[1]}, "
                          f"using SDPA ({_triton_failed[sig]})")
            impl = "sdpa"
    fn = {"sdpa": attention_sdpa, "ref": attention_ref}[impl]
    return fn(q, k, v, kpos, n_keys, **kw)
