"""Canvas (bidirectional) attention as two Triton GEMMs, the softmax split between them.

The full layers' denoise canvas (head dim 512, 2 KV heads, every cache row below `nlive` a key) is two large
GEMMs a call: at 32k context 137 GFLOP each. ops/attention_gemm.py runs them on cuBLAS, but the f32 scores make
a round trip through memory between them (written, read, P written, P read: ~1.6 GB a call at 32k). Here the
scores never leave the first GEMM:

  1. `_qk_tile_softmax_kernel`: S = Q·K^T for a [BM rows, TILE keys] tile (f32 accumulation), and in its
     epilogue the tile's row max m, P = exp(S - m) (f16, the V cache's dtype) and the row sum l. Only P (half
     the bytes of S) and the per-(row, tile) stats reach memory.
  2. `_tile_weights_kernel`: per row, M = max over tiles of m, L = Σ l·exp(m - M); each tile's weight
     f = exp(m - M) written over m, and 1/L.
  3. `_pv_scaled_kernel`: O = Σ_tiles (f ⊙ P)·V, f applied to P in registers before the MMA, then O / L in the
     output's layout ([n, H·d], the o projection's input): no partials to merge.

GQA is folded into the rows as in the other kernels (row r of KV head g: query head g·G + r // n, token r % n).
Keys at or past `nlive` (a device scalar: one CUDA graph serves every step of a bucket) or with kpos < 0 get
P = 0, and their V rows are not read, so even NaN garbage in the padded rows of a bucket cannot leak in. Tiles wholly
past `nlive` do no work, so a half-full bucket costs about half.
Numerics: f16 operands, f32 accumulation, f32 scores and stats; P rounded to f16 after the exponential, the tile
weight rounded to f16 and the product P·f rounded to f16 again; f32 PV accumulation. The flash kernel rounds P
to f16 once and rescales its f32 accumulator instead.

  attention_tiles       the three kernels (CUDA, or the CPU through TRITON_INTERPRET=1)
  attention_tiles_ref   their torch twin, the same tiles and roundings (kernels=False: any device, graph-safe)
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, TensorDescriptor, tma_available, use_triton
from .attention_flash import NO_WINDOW
from .attention_gemm import check_canvas_shapes, visible_keys


def check_causal(name: str, q, kpos, qpos) -> None:
    """A causal tiles call's contract: qpos [n] with kpos (the keys' positions), refused with a one-line message."""
    if qpos is not None and (kpos is None or qpos.shape != (q.shape[1],)):
        raise ValueError(f"{name}: qpos {list(qpos.shape)} with kpos {'None' if kpos is None else 'given'}: expected "
                         f"qpos [{q.shape[1]}] (one position per query) and kpos (each key's position)")

if HAVE_TRITON:
    import triton
    import triton.language as tl

LOG2E = 1.4426950408889634

# Tile configs (docs/ARCHITECTURE.md, 'Kernel configurations'); the CPU tests pass their own small ones.
QK_CONFIG = dict(BM=128, BK=64, num_warps=8, num_stages=3)
PV_CONFIG = dict(BM=64, BN=256, num_warps=4, num_stages=3)
# A causal call (a commit: 256 queries) has a quarter of the canvas' rows per KV head on the sliding layers: narrower
# column blocks give the PV kernel enough programs.
CAUSAL_PV_CONFIG = dict(PV_CONFIG, BN=128)
WEIGHTS_CONFIG = dict(BR=16, BT=128, num_warps=4)
TILE = 128  # keys a stats tile: the first kernel's N block and the PV kernel's K step


if HAVE_TRITON:

    @triton.jit
    def _qk_tile_softmax_kernel(q_ptr, k_ptr, p_ptr, m_ptr, l_ptr, nlive_ptr, kpos_ptr, qpos_ptr,
                                GR, n_keys, NP, KVGR, k_rows, n_q, window,
                                D: tl.constexpr, BM: tl.constexpr, TILE: tl.constexpr, BK: tl.constexpr,
                                HAS_NLIVE: tl.constexpr, KPOS: tl.constexpr, TMA: tl.constexpr,
                                CAUSAL: tl.constexpr):
        """Grid (row blocks, key tiles, KV heads): the row blocks of one key tile are neighbours, so a K tile is
        read from memory once. q [KV·GR, D] f16, k [KV·k_rows, D] (pointers, or tensor descriptors when TMA);
        P [KV, GR, NP] (NP = tiles · TILE); m, l [tiles, KV·GR]. A tile wholly at or past the live keys writes
        m = -1e30, l = 0 and no P (the PV kernel stops before it). CAUSAL (needs KPOS): row r's token t = r % n_q
        sees key j only where qpos[t] - window < kpos[j] <= qpos[t]."""
        LOG2E_: tl.constexpr = 1.4426950408889634
        pid_m, j, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        keys = j * TILE + tl.arange(0, TILE)
        row_ok = rows < GR
        stat = j * KVGR + g * GR + rows
        hi = n_keys
        if HAS_NLIVE:
            hi = tl.minimum(n_keys, tl.load(nlive_ptr).to(tl.int32))
        if j * TILE >= hi:
            tl.store(m_ptr + stat, tl.full((BM,), -1.0e30, tl.float32), mask=row_ok)
            tl.store(l_ptr + stat, tl.zeros((BM,), tl.float32), mask=row_ok)
            return
        acc = tl.zeros((BM, TILE), dtype=tl.float32)
        if TMA:  # rows past the head's own (the next head's, or past the tensor: zeros) are masked below
            for k0 in range(0, D, BK):
                a = q_ptr.load([g * GR + pid_m * BM, k0])
                b = k_ptr.load([g * k_rows + j * TILE, k0])
                acc = tl.dot(a, tl.trans(b), acc)
        else:
            ks = tl.arange(0, BK)
            q_rows = q_ptr + (g * GR + rows).to(tl.int64)[:, None] * D
            k_rows_p = k_ptr + (g.to(tl.int64) * k_rows + keys)[:, None] * D
            key_in = keys < n_keys
            for k0 in range(0, D, BK):
                a = tl.load(q_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
                b = tl.load(k_rows_p + (k0 + ks)[None, :], mask=key_in[:, None], other=0.0)
                acc = tl.dot(a, tl.trans(b), acc)
        ok = keys < hi
        if KPOS:
            kp = tl.load(kpos_ptr + keys, mask=ok, other=-1)
            ok = ok & (kp >= 0)
        if CAUSAL:
            qp = tl.load(qpos_ptr + rows % n_q, mask=row_ok, other=0)
            vis = ok[None, :] & (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window)
            s = tl.where(vis, acc * LOG2E_, -float("inf"))
        else:
            s = tl.where(ok[None, :], acc * LOG2E_, -float("inf"))
        m = tl.maximum(tl.max(s, axis=1), -1.0e30)  # finite: an all-masked tile gets P = 0, l = 0, weight 0
        p = tl.exp2(s - m[:, None])
        p_rows = p_ptr + (g * GR + rows).to(tl.int64)[:, None] * NP
        tl.store(p_rows + keys[None, :], p.to(p_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(m_ptr + stat, m, mask=row_ok)
        tl.store(l_ptr + stat, tl.sum(p, axis=1), mask=row_ok)

    @triton.jit
    def _tile_weights_kernel(m_ptr, l_ptr, invl_ptr, n_tiles, KVGR, BR: tl.constexpr, BT: tl.constexpr):
        """One program a block of BR rows (over every KV head): m [tiles, KV·GR] becomes f = exp2(m - M)."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        row_ok = rows < KVGR
        big = tl.full((BR,), -1.0e30, tl.float32)
        for t0 in range(0, n_tiles, BT):
            ts = t0 + tl.arange(0, BT)
            msk = (ts < n_tiles)[:, None] & row_ok[None, :]
            m = tl.load(m_ptr + ts[:, None] * KVGR + rows[None, :], mask=msk, other=-1.0e30)
            big = tl.maximum(big, tl.max(m, axis=0))
        total = tl.zeros((BR,), tl.float32)
        for t0 in range(0, n_tiles, BT):
            ts = t0 + tl.arange(0, BT)
            msk = (ts < n_tiles)[:, None] & row_ok[None, :]
            off = ts[:, None] * KVGR + rows[None, :]
            f = tl.exp2(tl.load(m_ptr + off, mask=msk, other=-1.0e30) - big[None, :])
            total += tl.sum(f * tl.load(l_ptr + off, mask=msk, other=0.0), axis=0)
            tl.store(m_ptr + off, f, mask=msk)
        # a row with no visible key (a padding row, a causal row whose keys are all masked) gets 0, not 1/0
        tl.store(invl_ptr + rows, tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0), mask=row_ok)

    @triton.jit
    def _pv_scaled_kernel(p_ptr, f_ptr, invl_ptr, v_ptr, o_ptr, nlive_ptr, kpos_ptr,
                          GR, n_q, n_keys, NP, KVGR, v_rows, o_row_stride,
                          G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          TILE: tl.constexpr, HAS_NLIVE: tl.constexpr, KPOS: tl.constexpr):
        """Grid (output column blocks, row blocks, KV heads): the column blocks of one row block are neighbours,
        so its P is read from memory once. Only the tiles below the live keys are visited. Writes
        out[t, h·D + cols] for row r = (h - g·G)·n + t."""
        pid_n, pid_m, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        kk = tl.arange(0, TILE)
        row_ok = rows < GR
        hi = n_keys
        if HAS_NLIVE:
            hi = tl.minimum(n_keys, tl.load(nlive_ptr).to(tl.int32))
        p_rows = p_ptr + (g * GR + rows).to(tl.int64)[:, None] * NP
        v_base = v_ptr + g.to(tl.int64) * v_rows * D
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for j in range(0, tl.cdiv(hi, TILE)):
            keys = j * TILE + kk
            f = tl.load(f_ptr + j * KVGR + g * GR + rows, mask=row_ok, other=0.0)
            v_ok = keys < hi  # P is 0 past the live keys; their V rows (a bucket's padding) are never used
            if KPOS:
                v_ok = v_ok & (tl.load(kpos_ptr + keys, mask=v_ok, other=-1) >= 0)
            p = tl.load(p_rows + keys[None, :], mask=row_ok[:, None], other=0.0)
            v = tl.load(v_base + keys.to(tl.int64)[:, None] * D + cols[None, :], mask=v_ok[:, None], other=0.0)
            # the tile weight on P in f16: f16 MMA operands, no rescale of the f32 accumulator per tile
            acc = tl.dot(p * f.to(p.dtype)[:, None], v, acc)
        acc = acc * tl.load(invl_ptr + g * GR + rows, mask=row_ok, other=0.0)[:, None]
        head = g * G + rows // n_q
        tok = rows % n_q
        out = o_ptr + tok.to(tl.int64)[:, None] * o_row_stride + (head * D)[:, None] + cols[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def attention_tiles_ref(q, k, v, n_keys: int, kpos=None, nlive=None, out_dtype=None, tile: int = TILE, qpos=None,
                        window: int = NO_WINDOW):
    """The kernels' math in torch, tile by tile, with their roundings (P to the V dtype after the exponential
    and again after the tile weight). No host reads, so a CUDA graph may capture it."""
    check_canvas_shapes("attention_tiles", q, k, v, n_keys)
    check_causal("attention_tiles", q, kpos, qpos)
    H, n, d = q.shape
    KV = k.shape[0]
    GR = (H // KV) * n
    n_tiles = -(-n_keys // tile)
    NP = n_tiles * tile
    key_ok = torch.zeros(NP, dtype=torch.bool, device=q.device)
    key_ok[:n_keys] = visible_keys(n_keys, nlive, kpos, q.device)
    qg = q.reshape(KV, GR, d).to(k.dtype).float()
    kf = torch.zeros(KV, NP, d, device=q.device)
    kf[:, :n_keys] = k[:, :n_keys].float()
    ok = key_ok
    if qpos is not None:  # [GR, NP]: row r is token r % n
        kp = torch.full((NP,), -1, dtype=torch.int64, device=q.device)
        kp[:n_keys] = kpos[:n_keys]
        qp = qpos.long().repeat(GR // n)[:, None]
        ok = key_ok[None, :] & (kp[None, :] <= qp) & (kp[None, :] > qp - window)
    s = ((qg @ kf.transpose(1, 2)) * LOG2E).masked_fill(~ok, -float("inf")).view(KV, GR, n_tiles, tile)
    m = s.amax(-1).clamp_min(-1.0e30)  # [KV, GR, tiles]
    e = torch.exp2(s - m[..., None])
    p = e.to(v.dtype)
    big = m.amax(-1, keepdim=True)
    f = torch.exp2(m - big)
    total = (f * e.sum(-1)).sum(-1)  # [KV, GR]
    a = (p.float() * f.to(v.dtype).float()[..., None]).to(v.dtype).float().reshape(KV, GR, NP)  # exact, then rounded
    vf = torch.zeros(KV, NP, d, device=q.device)
    vf[:, :n_keys] = v[:, :n_keys].float()
    vf = vf.masked_fill(~key_ok[None, :, None], 0.0)
    inv = torch.where(total > 0, 1.0 / torch.where(total > 0, total, 1.0), 0.0)  # no visible key: 0, as the kernel
    o = (a @ vf) * inv[..., None]  # [KV, GR, d], rows (local head, token)
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    out.copy_(o.reshape(H, n, d).transpose(0, 1).reshape(n, H * d))
    return out


def attention_tiles(q, k, v, n_keys: int, kpos=None, nlive=None, out_dtype=None, kernels: bool | None = None,
                    qk_config: dict | None = None, pv_config: dict | None = None, tile: int = TILE,
                    tma: bool | None = None, weights_config: dict | None = None, qpos=None, window: int = NO_WINDOW):
    """q [H, n, d], k/v [KV, rows, d] (the first n_keys rows read; rows contiguous, d wide) -> [n, H·d]. Key j is
    visible iff j < nlive (when given) and kpos[j] >= 0 (when given), and with qpos [n] (causal, which needs kpos)
    to query t only where qpos[t] - window < kpos[j] <= qpos[t]; scale 1. kernels: the Triton kernels (default: on
    CUDA), else the torch twin. tma: the QK kernel reads Q and K through tensor descriptors (default: on compute capability 9.0+),
    else through pointers (the same results)."""
    check_canvas_shapes("attention_tiles", q, k, v, n_keys)
    check_causal("attention_tiles", q, kpos, qpos)
    kernels = use_triton(q) if kernels is None else kernels
    if not kernels:
        return attention_tiles_ref(q, k, v, n_keys, kpos=kpos, nlive=nlive, out_dtype=out_dtype, tile=tile, qpos=qpos,
                                   window=window)
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("attention_tiles: k and v must be contiguous [KV, rows, d] (a cache buffer)")
    H, n, d = q.shape
    KV = k.shape[0]
    G, GR = H // KV, (H // KV) * n
    if d % 16 or d & (d - 1):
        raise ValueError(f"attention_tiles: head dim {d}: expected a power of two >= 16 (the tiles' MMA shapes)")
    qc = dict(QK_CONFIG, **(qk_config or {}))
    pc = dict(CAUSAL_PV_CONFIG if qpos is not None else PV_CONFIG, **(pv_config or {}))
    qc["BK"], pc["BN"] = min(qc["BK"], d), min(pc["BN"], d)
    n_tiles = -(-n_keys // tile)
    NP = n_tiles * tile
    qg = q.reshape(KV, GR, d).to(k.dtype).contiguous()
    p = torch.empty(KV, GR, NP, dtype=v.dtype, device=q.device)
    m = torch.empty(n_tiles, KV * GR, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    invl = torch.empty(KV * GR, dtype=torch.float32, device=q.device)
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    # a pointer for each mask the call does not use: an input, never an output buffer (the CPU interpreter copies
    # every tensor argument back after a kernel, so an output passed twice would get its stale second copy back)
    dummy = torch.empty(1, dtype=torch.int64, device=q.device)
    nl, kp = (nlive if nlive is not None else dummy), (kpos if kpos is not None else dummy)
    flags = dict(HAS_NLIVE=nlive is not None, KPOS=kpos is not None)
    qp = qpos if qpos is not None else dummy
    k_rows = k.shape[1]
    if tma is None:  # a descriptor needs 16-byte aligned bases (a cache slice at an odd offset takes pointers)
        tma = tma_available(q) and k.data_ptr() % 16 == 0
    if tma:
        qa = TensorDescriptor.from_tensor(qg.view(KV * GR, d), [qc["BM"], qc["BK"]])
        ka = TensorDescriptor.from_tensor(k.view(KV * k_rows, d), [tile, qc["BK"]])
    else:
        qa, ka = qg, k
    _qk_tile_softmax_kernel[(triton.cdiv(GR, qc["BM"]), n_tiles, KV)](
        qa, ka, p, m, l, nl, kp, qp, GR, n_keys, NP, KV * GR, k_rows, n, min(window, NO_WINDOW), D=d, TILE=tile,
        TMA=tma, CAUSAL=qpos is not None, **flags, **qc)
    wc = dict(WEIGHTS_CONFIG, **(weights_config or {}))
    _tile_weights_kernel[(triton.cdiv(KV * GR, wc["BR"]),)](m, l, invl, n_tiles, KV * GR, **wc)
    _pv_scaled_kernel[(d // pc["BN"], triton.cdiv(GR, pc["BM"]), KV)](
        p, m, invl, v, out, nl, kp, GR, n, n_keys, NP, KV * GR, k_rows, out.stride(0),
        G=G, D=d, TILE=tile, **flags, **pc)
    return out
