"""The flash attention kernel: Q resident per program, and the canvas's key range split across programs.

Same contract and layouts as `attention.py` (q [H, n, d] head-major, k/v [KV, rows, d], kpos per key,
-1 = not a key; scale 1; GQA folded into the query rows, row r of KV head g = query head g·G + r // n,
token r % n). Its design, and why:

* Q is loaded once per program ([BM, d], loop-invariant) instead of once per key block and head-dim
  chunk: re-reading the whole Q tile from L2 for every key block costs as many bytes as K.
* One QK^T dot over the whole head dim per key block (hd 512: a [BN, 512] K tile).
* Split-KV for the bidirectional canvas (flash-decoding). At batch 1 a canvas call is 16 heads ×
  256 queries: 8–32 programs of 64 rows, far fewer than a large GPU's SMs. Here each program also
  takes one of S slices of the key range and writes an unnormalised partial (acc, m, l); `_combine_kernel` merges the S
  partials. S is a function of the static key count (a graph's `key_rows` bucket), never of the live
  length: the device-scalar `nlive` only shortens each slice's loop (slices past it are empty and
  write m = -1e30, l = 0, which the merge weighs as 0), so one capture serves every step.
* Output head-dim halves (BD < d) are a grid axis: each half recomputes QK^T but keeps its f32
  accumulator at [BM, BD] in registers. hd 512 causal keeps the whole [64, 512] accumulator at 8 warps
  (128 registers a thread; no recompute), the canvas takes BM 128 and two halves (more rows a program). A short
  causal call (a block's commit: 64 programs) takes halves too (causal_columns), and at hd 512 4 warps
  (short_causal), which fills the SMs and keeps the bits. BM does not keep them: it sets the MMA's row tile.

Causal key ranges: keys [0, n_ring) are an unordered ring (masked per key), keys
[n_ring, n_keys) are position-ordered (key i holds position base_pos + i - n_ring); only the blocks
some row of the program can see are visited: the chunk's by position, the ring's by slot where the caller
says where the ring ends (ring_end; ring_blocks), else all of them. Of the position-ordered blocks, those whole
in every row's view (positions in (qmax - window, qmin]: the bulk of a long context's keys) run without the
mask and its per-key position load (interior; cfg interior=False masks every block). A visible key's score is
the same either way and the blocks keep their order, so the bits do not change.
"""

from __future__ import annotations

import functools

import torch

from ._backend import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

NO_WINDOW = 1 << 30


if HAVE_TRITON:

    @triton.jit
    def _flash_block(n0, m_i, l_i, acc, q, qp, kb, vb, kpos_ptr, n_keys, window, dq, dcols, first, n_live, n_ring,
                     HD: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, KPOS: tl.constexpr,
                     LIVE: tl.constexpr = False):
        LOG2E: tl.constexpr = 1.4426950408889634
        keys = n0 + tl.arange(0, BN)
        key_in = keys < n_keys
        rows = keys
        if LIVE:  # key i < n_live: ring slot (first + i) mod n_ring; past them the canvas rows from n_ring on
            slot = first + keys
            slot = tl.where(slot >= n_ring, slot - n_ring, slot)
            rows = tl.where(keys < n_live, slot, n_ring + keys - n_live)
        k = tl.load(kb + rows[:, None].to(tl.int64) * HD + dq[None, :], mask=key_in[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        if KPOS:
            kp = tl.load(kpos_ptr + keys, mask=key_in, other=-1)
            if CAUSAL:
                ok = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - window)
            else:
                ok = (kp >= 0)[None, :]
            v_ok = key_in & (kp >= 0)
        else:  # every key below the bound is visible: no per-key load (its second copy in V's layout stalled every step)
            ok = key_in[None, :]
            v_ok = key_in
        s = tl.where(ok, s * LOG2E, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p = 0 on masked keys, but 0·NaN would not be: masked V rows are not read
        v = tl.load(vb + rows[:, None].to(tl.int64) * HD + dcols[None, :], mask=v_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def ring_blocks(first, base_pos, ring_end_ptr, n_ring, BN: tl.constexpr, RING_END: tl.constexpr):
        """A causal program's ring key blocks -> two ascending runs of block starts [a_lo, a_hi), [b_lo, b_hi).
        Without RING_END every block, [0, n_ring). With it, the ring holds position p in slot p % n_ring, and the
        device scalar at ring_end_ptr is the position after its newest key (a kernel position x is the position
        x - base_pos + ring_end): only the blocks holding the positions [first, ring_end) go, where `first` is
        the oldest this program's rows see. Every block skipped is masked for all of the program's rows, and a
        masked block leaves (m, l, acc) exactly as they were (alpha = 1, p = 0), so the bits are the full scan's."""
        a_lo = 0
        a_hi = tl.where(first < base_pos, n_ring, 0)
        b_lo = 0
        b_hi = 0
        if RING_END:
            end = tl.load(ring_end_ptr).to(tl.int32)
            lo = tl.maximum(first - base_pos + end, 0)  # oldest position seen
            n = end - lo
            s_lo = lo % n_ring
            s_hi = (tl.maximum(end, 1) - 1) % n_ring  # newest slot (inclusive)
            blk_lo = (s_lo // BN) * BN
            blk_hi = (s_hi // BN + 1) * BN  # past the block holding s_hi
            wrap = s_lo > s_hi
            whole = (n >= n_ring) | (wrap & (blk_hi > blk_lo))  # every block, once
            a_lo = tl.where(wrap | whole, 0, blk_lo)
            a_hi = tl.where(whole, n_ring, blk_hi)
            b_lo = blk_lo
            b_hi = tl.where(wrap & ~whole, n_ring, blk_lo)
            none = n <= 0
            a_hi = tl.where(none, 0, a_hi)
            b_hi = tl.where(none, 0, b_hi)
        return a_lo, a_hi, b_lo, b_hi

    @triton.jit
    def _flash_kernel(q_ptr, k_ptr, v_ptr, kpos_ptr, qpos_ptr, nlive_ptr, ring_end_ptr, o_ptr, po_ptr, pml_ptr,
                      n_q, n_keys, k_head_stride, window, n_ring, base_pos, split_len,
                      G: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_NLIVE: tl.constexpr, SPLIT: tl.constexpr, RING: tl.constexpr,
                      KPOS: tl.constexpr, LIVE: tl.constexpr = False, RING_END: tl.constexpr = False,
                      INTERIOR: tl.constexpr = False):
        NDH: tl.constexpr = HD // BD
        g = tl.program_id(1)
        split = tl.program_id(2) // NDH
        dh = tl.program_id(2) % NDH
        R = G * n_q  # folded rows of one KV head
        pid = tl.program_id(0)
        if CAUSAL:  # the last rows see the most keys: launch them first, so the tail of the grid is short work
            pid = tl.num_programs(0) - 1 - pid
        rows = pid * BM + tl.arange(0, BM)
        row_ok = rows < R
        t = rows % n_q
        hrow = (g * R + rows).to(tl.int64)  # = head · n_q + t: the row of q (and of the partials)
        dq = tl.arange(0, HD)
        kb = k_ptr + g.to(tl.int64) * k_head_stride
        vb = v_ptr + g.to(tl.int64) * k_head_stride
        q = tl.load(q_ptr + hrow[:, None] * HD + dq[None, :], mask=row_ok[:, None], other=0.0).to(k_ptr.dtype.element_ty)
        dcols = dh * BD + tl.arange(0, BD)
        m_i = tl.full((BM,), -1.0e30, dtype=tl.float32)  # finite: an all-masked block leaves rows untouched
        l_i = tl.zeros((BM,), dtype=tl.float32)
        acc = tl.zeros((BM, BD), dtype=tl.float32)
        if CAUSAL:
            qp = tl.load(qpos_ptr + t, mask=row_ok, other=0)
            qmax = tl.max(tl.where(row_ok, qp, -1), axis=0)
            qmin = tl.min(tl.where(row_ok, qp, 2**30), axis=0)
            first = qmin - window + 1  # oldest position any row sees
            if RING:  # a constexpr: the full layers' keys are all position-ordered (one loop, fewer registers)
                # ring key blocks in slot order: all of them, or (RING_END) only those holding a position some row
                # of this program sees, in two ascending runs when that range wraps (ring_blocks)
                a_lo, a_hi, b_lo, b_hi = ring_blocks(first, base_pos, ring_end_ptr, n_ring, BN, RING_END)
                for n0 in range(a_lo, a_hi, BN):
                    m_i, l_i, acc = _flash_block(n0, m_i, l_i, acc, q, qp, kb, vb, kpos_ptr,
                                                 tl.minimum(n_keys, n_ring), window, dq, dcols, 0, 0, 0,
                                                 HD, BN, CAUSAL, KPOS)
                for n0 in range(b_lo, b_hi, BN):
                    m_i, l_i, acc = _flash_block(n0, m_i, l_i, acc, q, qp, kb, vb, kpos_ptr,
                                                 tl.minimum(n_keys, n_ring), window, dq, dcols, 0, 0, 0,
                                                 HD, BN, CAUSAL, KPOS)
            lo = n_ring + tl.maximum(first - base_pos, 0)
            hi = tl.minimum(n_keys, n_ring + qmax + 1 - base_pos)
            a = hi  # [a, b): the interior blocks, unmasked (INTERIOR); masked blocks before and after them
            b = hi
            if INTERIOR:  # whole blocks of positions in (qmax - window, qmin]: every row of the program sees them
                in_lo = n_ring + tl.maximum(qmax - window + 1 - base_pos, 0)
                in_hi = tl.minimum(hi, n_ring + qmin + 1 - base_pos)
                a = tl.minimum(lo + tl.cdiv(tl.maximum(in_lo - lo, 0), BN) * BN, hi)
                b = a + tl.maximum((in_hi - a) // BN, 0) * BN
            for n0 in range(lo, a, BN):
                m_i, l_i, acc = _flash_block(n0, m_i, l_i, acc, q, qp, kb, vb, kpos_ptr, hi, window, dq, dcols,
                                             0, 0, 0, HD, BN, CAUSAL, KPOS)
            for n0 in range(a, b, BN):
                m_i, l_i, acc = _flash_block(n0, m_i, l_i, acc, q, qp, kb, vb, kpos_ptr, hi, window, dq, dcols,
                                             0, 0, 0, HD, BN, False, False)
            for n0 in range(b, hi, BN):
                m_i, l_i, acc = _flash_block(n0, m_i, l_i, acc, q, qp, kb, vb, kpos_ptr, hi, window, dq, dcols,
                                             0, 0, 0, HD, BN, CAUSAL, KPOS)
        else:
            hi = n_keys
            first = 0
            n_live = 0
            if LIVE:  # nlive is the cache's length L: the ring's keys are its last window-1 positions, in order
                length = tl.load(nlive_ptr).to(tl.int32)
                n_live = tl.minimum(length, window - 1)
                first = tl.maximum(length - (window - 1), 0) % n_ring
                hi = n_live + n_keys - n_ring
            elif HAS_NLIVE:  # a device-side bound (CUDA graphs): keys past it are never visible
                hi = tl.minimum(n_keys, tl.load(nlive_ptr).to(tl.int32))
            lo = split * split_len
            hi = tl.minimum(hi, lo + split_len)
            for n0 in range(lo, hi, BN):
                m_i, l_i, acc = _flash_block(n0, m_i, l_i, acc, q, t, kb, vb, kpos_ptr, hi, window, dq, dcols,
                                             first, n_live, n_ring, HD, BN, CAUSAL, KPOS, LIVE)
        if SPLIT:  # unnormalised partials; the merge rescales them
            RT = R * tl.num_programs(1)  # rows of all heads
            pbase = split.to(tl.int64) * RT
            tl.store(po_ptr + (pbase + hrow)[:, None] * HD + dcols[None, :], acc, mask=row_ok[:, None])
            if dh == 0:  # every head-dim half computed the same m, l
                tl.store(pml_ptr + 2 * pbase + hrow, m_i, mask=row_ok)
                tl.store(pml_ptr + 2 * pbase + RT + hrow, l_i, mask=row_ok)
        else:
            o = acc / l_i[:, None]
            h = g * G + rows // n_q
            optr = o_ptr + t.to(tl.int64)[:, None] * (G * tl.num_programs(1) * HD) + (h * HD)[:, None] + dcols[None, :]
            tl.store(optr, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _combine_kernel(po_ptr, pml_ptr, o_ptr, n_q, RT, n_split, HD: tl.constexpr, BR: tl.constexpr,
                        BD: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)  # head-major rows, head · n_q + t
        ok = rows < RT
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        m = tl.full((BR,), -1.0e30, dtype=tl.float32)
        for s in range(0, n_split):
            m = tl.maximum(m, tl.load(pml_ptr + 2 * s * RT + rows, mask=ok, other=-1.0e30))
        num = tl.zeros((BR, BD), dtype=tl.float32)
        den = tl.zeros((BR,), dtype=tl.float32)
        for s in range(0, n_split):
            w = tl.exp2(tl.load(pml_ptr + 2 * s * RT + rows, mask=ok, other=-1.0e30) - m)
            den += w * tl.load(pml_ptr + 2 * s * RT + RT + rows, mask=ok, other=0.0)
            acc = tl.load(po_ptr + (s * RT + rows).to(tl.int64)[:, None] * HD + cols[None, :], mask=ok[:, None],
                          other=0.0)
            num += w[:, None] * acc
        o = num / den[:, None]
        h = rows // n_q
        t = rows % n_q
        optr = o_ptr + t.to(tl.int64)[:, None] * ((RT // n_q) * HD) + (h * HD)[:, None] + cols[None, :]
        tl.store(optr, o.to(o_ptr.dtype.element_ty), mask=ok[:, None])


# The SM count a CPU run (the Triton interpreter) plans its grids for: a large GPU's, so the tile and split choices
# the CPU tests exercise are the ones a GPU makes.
CPU_SM_COUNT = 132


@functools.lru_cache(maxsize=None)
def _sm_count(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if torch.cuda.is_available() else CPU_SM_COUNT


def device_sms(t: torch.Tensor) -> int:
    """The SMs a kernel on t's device plans its grid for (CPU_SM_COUNT off CUDA)."""
    return _sm_count(t.device.index or 0) if t.is_cuda else CPU_SM_COUNT


# A head-dim-512 causal call of at least `rows` queries over at least `keys` keys (a long prompt's later chunks) takes
# the tiles of the last row here it reaches (long_causal_tiles), rows in ascending keys
# (docs/ARCHITECTURE.md, 'Kernel configurations').
LONG_CAUSAL_TILES = (
    # (rows, keys, tiles)
    (2048, 32768, dict(BM=128, BN=32, BD=256, num_warps=8, num_stages=2)),
)


def flash_config(d: int, causal: bool, n_keys: int = 0, live: bool = False) -> dict:
    """Tile shapes per (head dim, mode, static key count): BM query rows × BN keys per step; BD output
    columns per program; waves = programs per SM the canvas split aims at (0 = never split).

    Per shape (docs/ARCHITECTURE.md, 'Kernel configurations'), each within the SM's shared memory and its registers
    without spilling:
      canvas hd 256 over the ring's live window: BM 64, BN 64, 4 warps, 3 stages, 2 splits;
      canvas hd 256 with the per-key mask (ring + canvas rows): BM 128, BN 64, 8 warps, 4 splits;
      canvas hd 512: BM 128, BN 32, two 256-wide output halves, 8 warps; one wave of splits up to 4k keys, two
          above;
      causal hd 512: BM 64, BN 32, the whole [64, 512] accumulator at 8 warps (no QK^T recompute); a long
          prompt's chunk: LONG_CAUSAL_TILES by its rows and keys (e.g. BM 128, two 256-wide output halves, each
          recomputing QK^T);
      causal hd 256 (window 1024): BM 64, BN 32, 4 warps (Q read once, not per key block).
    """
    if d >= 512:
        if causal:
            return dict(BM=64, BN=32, BD=512, num_warps=8, num_stages=2, waves=0)
        return dict(BM=128, BN=32, BD=256, num_warps=8, num_stages=2, waves=2 if n_keys > 4096 + 256 else 1)
    if causal:
        return dict(BM=64, BN=32, BD=d, num_warps=4, num_stages=2, waves=0)
    if live:
        return dict(BM=64, BN=64, BD=d, num_warps=4, num_stages=3, waves=1)
    return dict(BM=128, BN=64, BD=d, num_warps=8, num_stages=2, waves=1)


def long_causal_tiles(d: int, rows: int, n_keys: int) -> dict | None:
    """A causal call's tiles if it is a long prompt's chunk at head dim 512: those of the last LONG_CAUSAL_TILES row
    whose rows and keys it reaches; None otherwise (flash_config and short_causal decide)."""
    tiles = None
    if d >= 512:
        for min_rows, min_keys, t in LONG_CAUSAL_TILES:
            if rows >= min_rows and n_keys >= min_keys:
                tiles = t
    return tiles


def short_causal(c: dict, rows: int, kv_heads: int, d: int, sm_count: int) -> dict:
    """A causal call's output columns per program (causal_columns) and, for head dim 512 split so, 4 warps: at a
    commit's shape the same bits in less time (the warps change no row's MMA shape, unlike BM)."""
    bd = causal_columns(c, rows, kv_heads, d, sm_count)
    return dict(BD=bd, num_warps=4) if d >= 512 and bd < d else dict(BD=bd)


def causal_columns(c: dict, rows: int, kv_heads: int, d: int, sm_count: int) -> int:
    """A causal call's output columns per program: all of them, or half where that still leaves the programs within
    one wave (a short chunk, e.g. a block's commit: 64 programs). Each half recomputes QK^T, so a row's keys are
    visited in the same blocks and order: the same bits on twice the programs (the choice: docs/ARCHITECTURE.md,
    'Kernel configurations')."""
    programs = -(-rows // c["BM"]) * kv_heads * (d // c["BD"])
    return c["BD"] // 2 if 2 * programs <= sm_count and c["BD"] >= 128 else c["BD"]


def num_splits(n_keys: int, base_programs: int, BN: int, sm_count: int, waves: float) -> tuple[int, int]:
    """-> (S, keys per split). A function of static quantities only (the key-row bucket, the shapes, the
    device): enough slices to give every SM `waves` programs, but never slices under 2·BN keys."""
    if waves <= 0 or n_keys <= 0:
        return 1, max(n_keys, 1)
    want = max(1, int(sm_count * waves) // base_programs)  # rounded down: a partial last wave costs a whole one
    s = max(1, min(want, n_keys // (2 * BN)))
    per = -(-n_keys // s)
    per = -(-per // BN) * BN  # whole key blocks per slice
    return -(-n_keys // per), per


def check_ring_length(who: str, kpos, causal: bool, nlive, n_ring: int, n_keys: int, window: int) -> None:
    """A ring_length call is a sliding canvas: no per-key mask, no nlive bound, not causal, a ring and a window."""
    if kpos is not None or causal or nlive is not None or not 0 < n_ring <= n_keys or window >= NO_WINDOW:
        raise ValueError(f"{who}: ring_length is for a sliding canvas: kpos and nlive None, not causal, 0 < n_ring <= "
                         f"n_keys and a window (got n_ring {n_ring}, n_keys {n_keys}, window {window})")


def live_keys(n_keys: int, n_ring: int, window: int) -> int:
    """The most keys a sliding canvas with ring_length visits: the ring's last window-1 positions, then the canvas."""
    return min(n_ring, window - 1) + n_keys - n_ring


def attention_flash(q, k, v, kpos, n_keys, qpos=None, window=NO_WINDOW, causal=False, out_dtype=None,
                    n_ring=0, base_pos=0, nlive=None, splits=None, ring_length=None, ring_end=None, **cfg):
    """The kernel (+ the merge when the canvas key range is split). `splits` overrides the split count
    (tests); cfg overrides the tile config. kpos=None (canvas only): every key below n_keys (and nlive) is
    visible, so the kernel reads no per-key positions. ring_length (a sliding layer's canvas, kpos=None): the
    device scalar L of the cache; rows [0, n_ring) are a ring whose slot p % n_ring holds position p, and only
    its last window-1 positions are keys, visited in position order and split as such (the ring's other slots
    are neither read nor counted in a split), then rows [n_ring, n_keys), the canvas. ring_end (a causal call over
    a ring): a device scalar, the position after the ring's newest key, where slot p % n_ring holds position p and
    a kernel position x is the position x - base_pos + ring_end; the kernel then skips the ring's key blocks no row
    sees, with the full scan's bits (ring_blocks)."""
    if kpos is None and causal:
        raise ValueError("attention_flash: kpos=None (every key visible) is for the bidirectional canvas, not causal")
    live = ring_length is not None
    if live:
        check_ring_length("attention_flash", kpos, causal, nlive, n_ring, n_keys, window)
    H, n, d = q.shape
    KV = k.shape[0]
    assert q.is_contiguous() and k.stride(2) == 1 and k.stride(1) == d and v.stride() == k.stride()
    c = flash_config(d, causal, n_keys, live=live)
    G = H // KV
    long = long_causal_tiles(d, n, n_keys) if causal else None
    if long is not None and "BD" not in cfg:
        c.update(long)
    elif causal and "BD" not in cfg:
        c.update(short_causal(c, G * n, KV, d, device_sms(q)))
    c.update(cfg)
    interior = bool(causal and c.pop("interior", True))
    BM, BN, BD = c["BM"], c["BN"], c["BD"]
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    row_blocks = triton.cdiv(G * n, BM)
    visited = live_keys(n_keys, n_ring, window) if live else n_keys  # the keys the splits divide
    if causal or visited == 0:
        S, per = 1, max(visited, 1)
    elif splits is not None:
        per = -(-(-(-visited // splits)) // BN) * BN
        S = -(-visited // per)
    else:
        S, per = num_splits(visited, row_blocks * KV * (d // BD), BN,
                            device_sms(q), c["waves"])
    if S > 1:
        po = torch.empty(S, H * n, d, dtype=torch.float32, device=q.device)
        pml = torch.empty(S, 2, H * n, dtype=torch.float32, device=q.device)
    else:
        po = pml = out  # unused
    grid = (row_blocks, KV, S * (d // BD))
    kp = kpos if kpos is not None else k  # a pointer the kernel never reads when KPOS is off
    bound = ring_length if live else nlive
    ring = bool(causal and n_ring > 0)
    skip = ring and ring_end is not None
    _flash_kernel[grid](q, k, v, kp, qpos if causal else kp, bound if bound is not None else kp,
                        ring_end if skip else kp, out, po, pml,
                        n, n_keys, k.stride(0), int(min(window, NO_WINDOW)), int(n_ring), int(base_pos), per,
                        G=G, HD=d, BD=BD, BM=BM, BN=BN, CAUSAL=causal, HAS_NLIVE=nlive is not None, SPLIT=S > 1,
                        RING=ring, KPOS=kpos is not None, LIVE=live, RING_END=skip, INTERIOR=interior,
                        num_warps=c["num_warps"], num_stages=c["num_stages"])
    if S > 1:
        combine_partials(po, pml, out, n)
    return out


def combine_partials(po, pml, out, n_q: int) -> None:
    """out [n_q, H·d] <- the merge of S unnormalised partials: po [S, H·n_q, d] (f32 acc, rows head-major,
    head · n_q + t) and pml [S, 2, H·n_q] (the row max in log2 units, the row sum)."""
    S, RT, d = po.shape
    BR, BD = 32, min(d, 128)
    _combine_kernel[(triton.cdiv(RT, BR), d // BD)](po, pml, out, n_q, RT, S, HD=d, BR=BR, BD=BD, num_warps=4)
