"""Everything between the qkv GEMM and attention, in one launch: per-head norms, RoPE, KV-cache writes.

The qkv GEMM output row is [q heads ‖ k heads ‖ v heads] (full layers have no v_proj: their V heads
are read from the k columns, `v_off = nq`). One program per (token, a few heads) of all three kinds:
  Q: norm · q_norm weight, RoPE  -> q_out [heads, T, hd]   (head-major: attention reads it as is)
  K: norm · k_norm weight, RoPE  -> cache_k[:, slots[t]] and/or kv_out[0]
  V: no-scale norm, no RoPE      -> cache_v[:, slots[t]] and/or kv_out[1]
`norm_w` is [3, hd] f32: q_norm ‖ k_norm ‖ ones (V), stacked once at load. slots[t] = -1 writes
nothing (pad rows, ring positions a later token of the same write takes). kv_out [2, kv, T, hd]
(head-major) is the dense K/V the causal prefill of a sliding layer attends to before the ring
is updated. Same math as `rope_kv.norm_rope`, which stays the per-tensor twin.
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, next_pow2, use_triton
from .rope_kv import norm_rope_ref

if HAVE_TRITON:
    import triton
    import triton.language as tl


def qkv_prep_ref(qkv, heads, kv_heads, hd, v_off, norm_w, inv_freq, positions, eps, out_dtype,
                 cache_k=None, cache_v=None, slots=None, dense_kv=False):
    T = qkv.shape[0]
    nq = heads * hd
    q = norm_rope_ref(qkv[:, :nq].reshape(T, heads, hd), norm_w[0], inv_freq, positions, eps, out_dtype)
    k = norm_rope_ref(qkv[:, nq: nq + kv_heads * hd].reshape(T, kv_heads, hd), norm_w[1], inv_freq, positions, eps,
                      out_dtype, cache=cache_k, slots=slots)
    v = norm_rope_ref(qkv[:, v_off: v_off + kv_heads * hd].reshape(T, kv_heads, hd), None, None, positions, eps,
                      out_dtype, cache=cache_v, slots=slots)
    kv = torch.stack([k.transpose(0, 1), v.transpose(0, 1)]) if dense_kv else None
    return q.transpose(0, 1).contiguous(), kv


if HAVE_TRITON:

    @triton.jit
    def _qkv_prep_kernel(qkv_ptr, nw_ptr, f_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, kv_ptr,
                         T, row_stride, cache_rows, eps, H, KV, nq, v_off,
                         HD: tl.constexpr, HALF: tl.constexpr, NH: tl.constexpr, WRITE_CACHE: tl.constexpr,
                         WRITE_DENSE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * NH + tl.arange(0, NH)  # NH heads of the token: q heads, then k, then v
        j_ok = j < H + 2 * KV
        kind = (j >= H).to(tl.int32) + (j >= H + KV).to(tl.int32)  # 0 = q, 1 = k, 2 = v
        hh = j - H * (kind >= 1).to(tl.int32) - KV * (kind == 2).to(tl.int32)
        col = tl.where(kind == 0, j * HD, tl.where(kind == 1, nq + hh * HD, v_off + hh * HD))
        d = tl.arange(0, HALF)
        base = qkv_ptr + t * row_stride + col[:, None] + d[None, :]
        x1 = tl.load(base, mask=j_ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=j_ok[:, None], other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)
        w_off = kind[:, None] * HD + d[None, :]
        x1 = x1 * r[:, None] * tl.load(nw_ptr + w_off)
        x2 = x2 * r[:, None] * tl.load(nw_ptr + w_off + HALF)
        # one cos / sin per column for all the token's heads; V: angle 0 (cos 1, sin 0 exactly), no rotation
        ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + d)
        is_v = (kind == 2)[:, None]
        c = tl.where(is_v, 1.0, tl.cos(ang)[None, :])
        s = tl.where(is_v, 0.0, tl.sin(ang)[None, :])
        y1 = (x1 * c - x2 * s).to(q_ptr.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(q_ptr.dtype.element_ty)
        full = d[None, :] < HALF  # masks as whole [NH, HALF] tiles (the interpreter stores with no broadcast)
        is_q = ((kind == 0) & j_ok)[:, None] & full
        qo = q_ptr + (j.to(tl.int64) * T + t)[:, None] * HD + d[None, :]
        tl.store(qo, y1, mask=is_q)
        tl.store(qo + HALF, y2, mask=is_q)
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + t)
            cb = (hh.to(tl.int64) * cache_rows + tl.maximum(slot, 0))[:, None] * HD + d[None, :]
            written = j_ok & ((tl.zeros((NH,), dtype=tl.int64) + slot) >= 0)  # a vector: masks must be vectors
            mk = ((kind == 1) & written)[:, None] & full
            mv = ((kind == 2) & written)[:, None] & full
            tl.store(kc_ptr + cb, y1.to(kc_ptr.dtype.element_ty), mask=mk)
            tl.store(kc_ptr + cb + HALF, y2.to(kc_ptr.dtype.element_ty), mask=mk)
            tl.store(vc_ptr + cb, y1.to(vc_ptr.dtype.element_ty), mask=mv)
            tl.store(vc_ptr + cb + HALF, y2.to(vc_ptr.dtype.element_ty), mask=mv)
        if WRITE_DENSE:
            kb = kv_ptr + ((tl.maximum(kind - 1, 0) * KV + hh).to(tl.int64) * T + t)[:, None] * HD + d[None, :]
            mkv = ((kind >= 1) & j_ok)[:, None] & full
            tl.store(kb, y1, mask=mkv)
            tl.store(kb + HALF, y2, mask=mkv)


# A program takes several heads of one token (2048 values: 8 heads of 256, 4 of 512) and computes the token's
# cos / sin once for all of them. One program per (token, head) took two to three times the bytes' time at the
# denoise shape; this layout is close to it.
VALUES_PER_PROGRAM = 2048


def qkv_prep_triton(qkv, heads, kv_heads, hd, v_off, norm_w, inv_freq, positions, eps, out_dtype,
                    cache_k=None, cache_v=None, slots=None, dense_kv=False, heads_per_program: int | None = None):
    assert hd == next_pow2(hd) and qkv.stride(1) == 1
    T = qkv.shape[0]
    q = torch.empty(heads, T, hd, dtype=out_dtype, device=qkv.device)
    kv = torch.empty(2, kv_heads, T, hd, dtype=out_dtype, device=qkv.device) if dense_kv else None
    write = cache_k is not None
    if write:
        assert cache_k.is_contiguous() and cache_v.is_contiguous() and cache_k.shape[0] == kv_heads
    nh = heads_per_program or max(1, VALUES_PER_PROGRAM // hd)
    _qkv_prep_kernel[(T, triton.cdiv(heads + 2 * kv_heads, nh))](
        qkv, norm_w, inv_freq, positions, slots if write else positions, q,
        cache_k if write else q, cache_v if write else q, kv if dense_kv else q,
        T, qkv.stride(0), cache_k.shape[1] if write else 0, eps, heads, kv_heads, heads * hd, v_off,
        HD=hd, HALF=hd // 2, NH=nh, WRITE_CACHE=write, WRITE_DENSE=dense_kv)
    return q, kv


def qkv_prep(qkv, heads, kv_heads, hd, v_off, norm_w, inv_freq, positions, eps, out_dtype,
             cache_k=None, cache_v=None, slots=None, dense_kv=False):
    """-> (q [heads, T, hd], kv [2, kv_heads, T, hd] or None), both in out_dtype."""
    fn = qkv_prep_triton if use_triton(qkv) else qkv_prep_ref
    return fn(qkv, heads, kv_heads, hd, v_off, norm_w, inv_freq, positions, eps, out_dtype,
              cache_k=cache_k, cache_v=cache_v, slots=slots, dense_kv=dense_kv)
