"""Attention of both passes, flash-style: no [queries × keys] score matrix in memory.

Shapes (the engine's layouts, so no copies around the call):
  q    [H, n, d]       head-major queries (qkv_prep writes them so)
  k, v [KV, rows, d]   the first `n_keys` rows are read (a cache buffer, or a dense K/V)
  kpos [n_keys] int    position of each key, -1 = not a key (empty ring slot, padded bucket row);
                       None (canvas only) = every key below n_keys and nlive is visible, or with
                       ring_length (a sliding layer's canvas): the ring's last window-1 positions and the canvas
  qpos [n] int         query positions (causal mode only)
  out  [n, H·d]        what the o projection reads
Scale is 1 (QK-norm folds it). Masks:
  bidirectional (denoise canvas): key j is visible iff kpos[j] >= 0 (the caller's per-key mask:
      live window slots, cache rows, the canvas itself);
  causal (prefill): kpos[j] >= 0 and qpos - window < kpos[j] <= qpos (window = a huge number
      on full layers);
  groups=(qgroup [n], kgroup [n_keys]) (prefill with images, twins only): also visible where
      qgroup == kgroup >= 0 (the tokens of one image see each other both ways, whatever the window).
GQA: the H/KV query heads of one KV head are folded into one row axis (row r = local head·n + t),
so one program's K/V tile serves every head of its group. Key blocks with no visible key for any
row of the program are skipped (the causal upper triangle, the window's far past, a CUDA graph's
padded bucket rows), so a padded bucket costs almost nothing.

The kernel and its tile configs live in ops/attention_flash.py.

  attention_ref     f32 twin, scores materialised per query block (tests, and the CPU path)
  attention_sdpa    torch SDPA with a boolean mask (for A/B on the GPU)
  attention_flash   the flash kernel (ops/attention_flash.py: Q resident, split-KV canvas; impl 'triton')
  attention_gemm    two cuBLAS GEMMs around a chunked softmax (ops/attention_gemm.py; impl 'gemm')
  attention_tiles   two Triton GEMMs, the softmax in the first's epilogue (ops/attention_tiles.py; impl 'tiles')
                    ('gemm' and 'tiles' serve the canvas on CUDA only, 'tiles' also a causal call: other calls
                    with them take the default)
  attention         dispatch: the kernel on CUDA, the twin elsewhere (`impl` overrides)

Top-k sparse attention (a generation setting, other math) is ops/attention_topk.py, called by the model for the full
layers when a cache asks for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import use_triton
from .attention_flash import NO_WINDOW, attention_flash, check_ring_length
from .attention_gemm import attention_gemm
from .attention_tiles import attention_tiles


def _mask(kpos, qpos, window, causal, rows, groups=None):
    kp = kpos[None, :].long()
    if not causal:
        return (kp >= 0).expand(rows, -1)
    qp = qpos[:, None].long()
    m = (kp >= 0) & (kp <= qp) & (kp > qp - window)
    if groups is not None:  # (this query block's groups, every key's group)
        qg, kg = groups[0][:, None].long(), groups[1][None, :].long()
        m = m | ((qg == kg) & (qg >= 0))
    return m


def _block_groups(groups, s, b, n_keys):
    return None if groups is None else (groups[0][s: s + b], groups[1][:n_keys])


def attention_ref(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None,
                  q_block: int = 1024, groups=None):
    H, n, d = q.shape
    KV = k.shape[0]
    kf = k[:, :n_keys].float().repeat_interleave(H // KV, 0)
    vf = v[:, :n_keys].float().masked_fill((kpos[:n_keys] < 0)[None, :, None], 0.0)  # never visible, never read
    vf = vf.repeat_interleave(H // KV, 0)
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    for s in range(0, n, q_block):
        qb = q[:, s: s + q_block].float()
        m = _mask(kpos[:n_keys], None if qpos is None else qpos[s: s + q_block], window, causal, qb.shape[1],
                  _block_groups(groups, s, q_block, n_keys))
        sc = (qb @ kf.transpose(1, 2)).masked_fill(~m[None], float("-inf"))
        o = torch.softmax(sc, -1) @ vf  # [H, b, d]
        out[s: s + q_block] = o.transpose(0, 1).reshape(-1, H * d).to(out.dtype)
    return out


def attention_sdpa(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None,
                   q_block: int = 2048, groups=None):
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
        m = _mask(kpos[:n_keys], qpos[s: s + q_block], window, True, min(q_block, n - s),
                  _block_groups(groups, s, q_block, n_keys))
        o = F.scaled_dot_product_attention(q[None, :, s: s + q_block], Kx, Vx, attn_mask=m[None, None], scale=1.0)
        out[s: s + q_block] = o[0].transpose(0, 1).reshape(-1, H * d)
    return out


def _all_visible(n_keys: int, nlive, device) -> torch.Tensor:
    """The kpos a twin needs for kpos=None: 0 (a key) below nlive (a device scalar, graph-safe), -1 past it."""
    ar = torch.arange(n_keys, device=device)
    if nlive is None:
        return torch.zeros_like(ar)
    return torch.where(ar < nlive, torch.zeros_like(ar), torch.full_like(ar, -1))


def ring_window_kpos(n_ring: int, n_keys: int, length: torch.Tensor, window: int) -> torch.Tensor:
    """The per-key mask a sliding canvas call with ring_length means (for the paths that take a mask): 0 for
    the ring slots holding the last window-1 positions before `length` (a device scalar, graph-safe) and for
    the canvas rows [n_ring, n_keys), -1 for the ring's other slots. Slot s holds position p when p % n_ring == s."""
    s = torch.arange(n_ring, device=length.device)
    p = length - 1 - torch.remainder(length - 1 - s, n_ring)  # the newest position below length that s can hold
    ring = torch.where((p >= 0) & (p > length - window), 0, -1)
    return torch.cat([ring, torch.zeros(n_keys - n_ring, dtype=ring.dtype, device=ring.device)])


def _canvas_call(path, causal_ok: bool = False):
    """A canvas path (attention_gemm, attention_tiles) under the kernels' calling convention: no window or ring
    (those keywords are ignored); qpos only for a path that takes causal calls (causal_ok)."""
    def call(q, k, v, kpos, n_keys, nlive=None, out_dtype=None, qpos=None, causal=False, window=NO_WINDOW, **_):
        extra = {"qpos": qpos, "window": window} if causal and causal_ok else {}
        return path(q, k, v, n_keys, kpos=kpos, nlive=nlive, out_dtype=out_dtype, **extra)
    return call


_KERNELS = {"triton": attention_flash, "gemm": _canvas_call(attention_gemm),
            "tiles": _canvas_call(attention_tiles, causal_ok=True)}
CANVAS_ONLY = ("gemm", "tiles")
# What takes over when a kernel cannot compile or launch here (e.g. a GPU with less shared memory than the one
# the tile configs were chosen on): the canvas paths fall back to the portable cuBLAS one first.
_FALLBACK = {"tiles": "gemm", "gemm": "triton", "triton": "sdpa"}
_triton_failed: dict = {}  # (head_dim, causal, impl) -> why the kernel could not compile/launch here


def _canvas_only_ok(q, causal: bool, impl: str) -> bool:
    """The GEMM forms serve the canvas on CUDA; the tile form also a causal call (kpos and qpos)."""
    return q.is_cuda and (not causal or impl == "tiles")


def attention(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None, impl=None,
              n_ring=0, base_pos=0, nlive=None, ring_length=None, groups=None, ring_end=None):
    """-> [n, H·d]. impl: None (kernel on CUDA, twin elsewhere), 'triton', 'gemm', 'tiles', 'sdpa' or 'ref'.
    groups: the image overlay of a causal call (module docstring); it runs on the torch twins (SDPA on CUDA).
    A kernel that fails outside graph capture is noted (with a warning, once) and the next in _FALLBACK runs
    from then on: never wrong, only slower. ring_length: a sliding canvas over the ring's live window (see
    attention_flash); the flash kernel visits only those keys, the other paths get its mask (ring_window_kpos).
    ring_end: a causal call's hint that lets the flash kernel skip ring blocks no query sees (attention_flash);
    the other paths read kpos alone."""
    if kpos is None and causal:
        raise ValueError("attention: kpos=None (every key visible) is for the bidirectional canvas, not causal")
    if ring_length is not None:  # refused here, not taken for a kernel failure below
        check_ring_length("attention", kpos, causal, nlive, n_ring, n_keys, window)
    if groups is not None:
        if not causal:
            raise ValueError("attention: groups (the image overlay) is for causal prefill calls")
        return (attention_sdpa if q.is_cuda else attention_ref)(q, k, v, kpos, n_keys, qpos=qpos, window=window,
                                                                causal=True, out_dtype=out_dtype, groups=groups)
    if impl in CANVAS_ONLY and not _canvas_only_ok(q, causal, impl):
        impl = None
    if impl is None:
        impl = "triton" if use_triton(q) else "ref"
    kw = dict(qpos=qpos, window=window, causal=causal, out_dtype=out_dtype)
    while impl in _KERNELS:
        if impl in CANVAS_ONLY and not _canvas_only_ok(q, causal, impl):  # a fallback the call cannot take
            impl = "triton"
        sig = (q.shape[-1], causal, impl)
        if sig in _triton_failed or (impl == "triton" and q.shape[-1] < 16):  # the flash kernel's tl.dot: K >= 16
            impl = _FALLBACK[impl]
            continue
        try:
            if ring_length is not None and impl == "triton":
                return attention_flash(q, k, v, None, n_keys, n_ring=n_ring, ring_length=ring_length, **kw)
            if ring_length is not None:
                kpos, ring_length = ring_window_kpos(n_ring, n_keys, ring_length, window), None
            hint = {"ring_end": ring_end} if impl == "triton" and ring_end is not None else {}
            return _KERNELS[impl](q, k, v, kpos, n_keys, n_ring=n_ring, base_pos=base_pos, nlive=nlive, **kw,
                                  **hint)
        except Exception as e:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            import warnings

            _triton_failed[sig] = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"diffgemma attention: kernel '{impl}' unavailable for head_dim {sig[0]} causal={causal}, "
                          f"using '{_FALLBACK[impl]}' ({_triton_failed[sig]})")
            impl = _FALLBACK[impl]
    if impl == "sdpa" and not q.is_cuda:
        impl = "ref"
    if ring_length is not None:
        kpos = ring_window_kpos(n_ring, n_keys, ring_length, window)
    elif kpos is None:  # the twins take an explicit mask
        kpos = _all_visible(n_keys, nlive, q.device)
    fn = {"sdpa": attention_sdpa, "ref": attention_ref}[impl]
    return fn(q, k, v, kpos, n_keys, **kw)
