"""Everything between the qkv GEMM and attention, in one launch: per-head norms, RoPE, KV-cache writes.

The qkv GEMM output row is [q heads ‖ k heads ‖ v heads] (full layers have no v_proj: their V heads
are read from the k columns, `v_off = nq`). One program per (token, head) of all three kinds:
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
                         HD: tl.constexpr, HALF: tl.constexpr, WRITE_CACHE: tl.constexpr, WRITE_DENSE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        kind = (j >= H).to(tl.int32) + (j >= H + KV).to(tl.int32)  # 0 = q, 1 = k, 2 = v
        hh = j - H * (kind >= 1).to(tl.int32) - KV * (kind == 2).to(tl.int32)
        col = tl.where(kind == 0, j * HD, tl.where(kind == 1, nq + hh * HD, v_off + hh * HD))
        d = tl.arange(0, HALF)
        base = qkv_ptr + t * row_stride + col
        x1 = tl.load(base + d).to(tl.float32)
        x2 = tl.load(base + HALF + d).to(tl.float32)
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD + eps)
        x1 = x1 * r * tl.load(nw_ptr + kind * HD + d)
        x2 = x2 * r * tl.load(nw_ptr + kind * HD + HALF + d)
        # V: angle 0 (cos 1, sin 0 exactly), i.e. no rotation
        ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + d) * tl.where(kind == 2, 0.0, 1.0)
        c = tl.cos(ang)
        s = tl.sin(ang)
        y1 = (x1 * c - x2 * s).to(q_ptr.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(q_ptr.dtype.element_ty)
        kd = tl.zeros((HALF,), dtype=tl.int32) + kind  # the kind as a vector: masks must be vectors
        is_q = kd == 0
        qo = q_ptr + (j.to(tl.int64) * T + t) * HD
        tl.store(qo + d, y1, mask=is_q)
        tl.store(qo + HALF + d, y2, mask=is_q)
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + t)
            cb = (hh.to(tl.int64) * cache_rows + tl.maximum(slot, 0)) * HD
            sd = tl.zeros((HALF,), dtype=tl.int64) + slot
            mk = (kd == 1) & (sd >= 0)
            mv = (kd == 2) & (sd >= 0)
            tl.store(kc_ptr + cb + d, y1.to(kc_ptr.dtype.element_ty), mask=mk)
            tl.store(kc_ptr + cb + HALF + d, y2.to(kc_ptr.dtype.element_ty), mask=mk)
            tl.store(vc_ptr + cb + d, y1.to(vc_ptr.dtype.element_ty), mask=mv)
            tl.store(vc_ptr + cb + HALF + d, y2.to(vc_ptr.dtype.element_ty), mask=mv)
        if WRITE_DENSE:
            kb = kv_ptr + ((tl.maximum(kind - 1, 0) * KV + hh).to(tl.int64) * T + t) * HD
            mkv = kd >= 1
            tl.store(kb + d, y1, mask=mkv)
            tl.store(kb + HALF + d, y2, mask=mkv)


def qkv_prep_triton(qkv, heads, kv_heads, hd, v_off, norm_w, inv_freq, positions, eps, out_dtype,
                    cache_k=None, cache_v=None, slots=None, dense_kv=False):
    assert hd == next_pow2(hd) and qkv.stride(1) == 1
    T = qkv.shape[0]
    q = torch.empty(heads, T, hd, dtype=out_dtype, device=qkv.device)
    kv = torch.empty(2, kv_heads, T, hd, dtype=out_dtype, device=qkv.device) if dense_kv else None
    write = cache_k is not None
    if write:
        assert cache_k.is_contiguous() and cache_v.is_contiguous() and cache_k.shape[0] == kv_heads
    _qkv_prep_kernel[(T, heads + 2 * kv_heads)](
        qkv, norm_w, inv_freq, positions, slots if write else positions, q,
        cache_k if write else q, cache_v if write else q, kv if dense_kv else q,
        T, qkv.stride(0), cache_k.shape[1] if write else 0, eps, heads, kv_heads, heads * hd, v_off,
        HD=hd, HALF=hd // 2, WRITE_CACHE=write, WRITE_DENSE=dense_kv)
    return q, kv


def qkv_prep(qkv, heads, kv_heads, hd, v_off, norm_w, inv_freq, positions, eps, out_dtype,
             cache_k=None, cache_v=None, slots=None, dense_kv=False):
    """-> (q [heads, T, hd], kv [2, kv_heads, T, hd] or None), both in out_dtype."""
    fn = qkv_prep_triton if use_triton(qkv) else qkv_prep_ref
    return fn(qkv, heads, kv_heads, hd, v_off, norm_w, inv_freq, positions, eps, out_dtype,
              cache_k=cache_k, cache_v=cache_v, slots=slots, dense_kv=dense_kv)
