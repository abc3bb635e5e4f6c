"""Per-head RMSNorm + RoPE, optionally writing the result into a KV cache.

One op covers all three attention inputs of a DiffusionGemma layer:
  Q: norm with q_norm weight, RoPE                      -> dense output
  K: norm with k_norm weight, RoPE                      -> dense output and/or cache rows
  V: no-scale norm (w=None), no RoPE (inv_freq=None)    -> dense output and/or cache rows

RoPE is split-half (pairs d, d + head_dim/2). `inv_freq` has head_dim/2 entries; the "proportional"
full-attention RoPE simply has zeros past its rotated prefix (cos=1, sin=0: identity), so the same
code serves both layer types. Angles are float32(position) · inv_freq, as transformers computes them.

Cache writes: `cache` is [heads, rows, head_dim] and `slots[t]` names the row token t goes to, or
-1 for a pad row, which writes nothing (a pad row past the prompt end must never clobber a ring
slot that still holds a live position). Ring wrap is the caller's slot arithmetic (pos % ring).
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, next_pow2, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


def norm_rope_ref(x, w, inv_freq, positions, eps, out_dtype=None, cache=None, slots=None):
    """x [T, heads, hd] -> [T, heads, hd] in out_dtype (default x.dtype); optionally cache[:, slots[t]] = row."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    if inv_freq is not None:
        ang = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, hd/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        half = y.shape[-1] // 2
        y1, y2 = y[..., :half], y[..., half:]
        y = torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1)
    out = y.to(out_dtype or x.dtype)
    if cache is not None:
        keep = slots >= 0
        cache[:, slots[keep]] = out[keep].transpose(0, 1).to(cache.dtype)
    return out


if HAVE_TRITON:

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, f_ptr, pos_ptr, out_ptr, cache_ptr, slot_ptr,
                          n_heads, cache_rows, eps,
                          HD: tl.constexpr, HALF: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr,
                          WRITE_CACHE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, HALF)
        base = (t * n_heads + h) * HD
        x1 = tl.load(x_ptr + base + d).to(tl.float32)
        x2 = tl.load(x_ptr + base + HALF + d).to(tl.float32)
        ms = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD
        r = 1.0 / tl.sqrt(ms + eps)
        x1 = x1 * r
        x2 = x2 * r
        if HAS_W:
            x1 = x1 * tl.load(w_ptr + d).to(tl.float32)
            x2 = x2 * tl.load(w_ptr + HALF + d).to(tl.float32)
        if ROPE:
            p = tl.load(pos_ptr + t).to(tl.float32)
            ang = p * tl.load(f_ptr + d)
            c = tl.cos(ang)
            s = tl.sin(ang)
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
        else:
            y1 = x1
            y2 = x2
        tl.store(out_ptr + base + d, y1.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + base + HALF + d, y2.to(out_ptr.dtype.element_ty))
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + t)
            if slot >= 0:
                # round through the dense output dtype first, so cache == out.to(cache dtype) exactly
                cb = (h * cache_rows + slot) * HD
                tl.store(cache_ptr + cb + d, y1.to(out_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))
                tl.store(cache_ptr + cb + HALF + d, y2.to(out_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty))


def norm_rope_triton(x, w, inv_freq, positions, eps, out_dtype=None, cache=None, slots=None):
    T, H, HD = x.shape
    assert HD == next_pow2(HD), "head_dim must be a power of two for the Triton kernel"
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    write = cache is not None
    if write:
        assert cache.is_contiguous() and cache.shape[0] == H and cache.shape[2] == HD
    _norm_rope_kernel[(T, H)](
        x, w if w is not None else x, inv_freq if inv_freq is not None else x, positions,
        out, cache if write else out, slots if write else positions,
        H, cache.shape[1] if write else 0, eps,
        HD=HD, HALF=HD // 2, HAS_W=w is not None, ROPE=inv_freq is not None, WRITE_CACHE=write,
    )
    return out


def norm_rope(x, w, inv_freq, positions, eps, out_dtype=None, cache=None, slots=None):
    fn = norm_rope_triton if use_triton(x) else norm_rope_ref
    return fn(x, w, inv_freq, positions, eps, out_dtype=out_dtype, cache=cache, slots=slots)
