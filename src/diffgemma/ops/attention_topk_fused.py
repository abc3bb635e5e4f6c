"""Top-k sparse attention as three Triton kernels: the fused form of ops/attention_topk.py's selection.

Same contract, shapes and selection as attention_topk_ref (its twin) and the gather form: each folded query row
attends to its k = clamp(n_visible // divisor, min_keys, max_keys) highest f32 scores (all of its visible keys where
k covers them), ties at the k-th score going to the lower key index, the softmax over that set only.

Per block of query rows (GQA folded: row r of KV head g is query head g·G + r // b, token r % b):

  1. `_scores_kernel`: S = Q·K^T per [BM rows × BN keys] tile, f32 accumulation, the visibility mask applied
     (invisible keys get -inf), written once as f32 [KV, rows, keys]; tiles wholly at or past `nlive` (a graph
     bucket's padding) do no work, and nothing reads them.
  2. `_select_kernel`, one program a row: the exact k-th largest score by a radix select on the scores' f32 bits
     mapped to an order-preserving unsigned key (u = bits | 2^31 for x >= 0, ~bits for x < 0; an invisible key is
     u = 0, below every real score). Pass p counts the row's keys per BITS-wide digit of u among those matching
     the digits fixed so far (a histogram in registers: integer counts, no atomics, so no order dependence); the
     digit holding the k-th largest is fixed and the count strictly above it leaves the budget. After
     ceil(32 / BITS) passes the threshold u* is exact, and `need` keys equal to it remain to take; a pass whose
     bucket holds exactly `need` keys ends the search sooner (all of them are taken: random scores need two
     11-bit passes). A last pass writes, in key order, the keys above the threshold and the first `need` equal to
     it (ties to the lower key index, the twin's rule): the selected key indices [rows, kmax], their count, and
     the row's largest score. A row whose k covers its visible keys takes all of them, with no digit pass.
  3. `_sparse_pv_kernel`, one program a (row, column block): p = exp(s - max) over the selected keys in key order,
     their V rows gathered, f32 products and sums in a fixed order (bit-identical from run to run).

Why the scores go to memory once (docs/ARCHITECTURE.md, 'Attention'): the select reads a row's scores up to 1 +
ceil(32 / BITS) times. Recomputing them instead costs one Q·K^T GEMM per read (2·rows·keys·d FLOPs: d = 512 makes
1024 FLOPs a score, against 4 bytes a score to read back), so at tensor-core rates the f32 round trip is the cheaper
of the two, and the only one whose cost does not grow with the head dim.

  fused_topk_blocks   the three kernels per block of query rows (CUDA, or the CPU through TRITON_INTERPRET=1);
                      ops/attention_topk.attention_topk_fused checks the call and picks the block
  select_topk         kernel 2 alone over a given f32 score matrix (the selection, for tests and benches)

`rule` is ops/attention_topk.TopKRule (read for divisor, min_keys, max_keys and candidates(keys)).
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, TensorDescriptor, next_pow2, tma_available

if HAVE_TRITON:
    import triton
    import triton.language as tl

# Tile configs (bench/longctx_sections.py times variants); the CPU tests pass small ones.
SCORES_CONFIG = dict(BM=128, BN=128, BK=32, num_warps=8, num_stages=3)
SELECT_CONFIG = dict(BLOCK=2048, BITS=11, num_warps=8)
PV_CONFIG = dict(BK=32, BD=256, num_warps=4)


if HAVE_TRITON:

    @triton.jit
    def _scores_kernel(q_ptr, k_ptr, s_ptr, kpos_ptr, qpos_ptr, nlive_ptr, R, NK, n_q, k_head_stride, k_rows,
                       D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       HAS_NLIVE: tl.constexpr, KPOS: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                       TMA: tl.constexpr = False):
        """Grid (row blocks, key blocks, KV heads). q [KV, R, D], k rows at k_head_stride per head, s [KV, R, NK].
        TMA: q and k are tensor descriptors over [KV·R, D] and [KV·k_rows, D] (rows past a head's own are another
        head's, or zeros past the tensor: masked below)."""
        pid_m, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hi = NK
        if HAS_NLIVE:  # the select reads no key at or past nlive: a tile wholly there does no work
            hi = tl.minimum(NK, tl.load(nlive_ptr).to(tl.int32))
            if pid_n * BN >= hi:
                return
        rows = pid_m * BM + tl.arange(0, BM)
        keys = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < R
        key_in = keys < NK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TMA:
            for k0 in range(0, D, BK):
                a = q_ptr.load([g * R + pid_m * BM, k0])
                b = k_ptr.load([g * k_rows + pid_n * BN, k0])
                acc = tl.dot(a, tl.trans(b), acc)
        else:
            ks = tl.arange(0, BK)
            q_rows = q_ptr + (g * R + rows).to(tl.int64)[:, None] * D
            k_base = k_ptr + g.to(tl.int64) * k_head_stride + keys.to(tl.int64)[:, None] * D
            for k0 in range(0, D, BK):
                a = tl.load(q_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
                b = tl.load(k_base + (k0 + ks)[None, :], mask=key_in[:, None], other=0.0)
                if IEEE:
                    acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
        ok = key_in & (keys < hi)
        if KPOS:
            kp = tl.load(kpos_ptr + keys, mask=key_in, other=-1)
            ok = ok & (kp >= 0)
            if CAUSAL:
                qp = tl.load(qpos_ptr + rows % n_q, mask=row_ok, other=0)
                vis = ok[None, :] & (kp[None, :] <= qp[:, None])
            else:
                vis = ok[None, :] & row_ok[:, None]
        else:
            vis = ok[None, :] & row_ok[:, None]
        s = tl.where(vis, acc, -float("inf"))
        out = s_ptr + (g * R + rows).to(tl.int64)[:, None] * NK + keys[None, :]
        tl.store(out, s, mask=row_ok[:, None] & key_in[None, :])

    @triton.jit
    def _order_key(s):
        """f32 -> uint32 in the same order (x < y iff key(x) < key(y), and -0 = +0 as the twin compares them);
        -inf (an invisible key) -> 0."""
        bits = s.to(tl.uint32, bitcast=True)
        bits = tl.where(bits == 0x80000000, 0, bits)  # -0.0 ties with +0.0
        u = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)
        return tl.where(s == -float("inf"), 0, u)

    @triton.jit
    def _digit_hist(row_base, NK, prefix, pmask, shift: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
        """Counts per digit (u >> shift) & (2^BITS - 1) of the row's visible keys whose fixed bits (u & pmask) equal
        prefix."""
        NB: tl.constexpr = 1 << BITS
        hist = tl.zeros((NB,), dtype=tl.int32)
        for c in range(0, NK, BLOCK):
            keys = c + tl.arange(0, BLOCK)
            u = _order_key(tl.load(row_base + keys, mask=keys < NK, other=-float("inf")))
            ok = (u > 0) & ((u & pmask) == prefix)
            d = tl.where(ok, (u >> shift) & (NB - 1), 0).to(tl.int32)
            h = tl.histogram(d, NB)
            # the keys left out were counted in bin 0 (the histogram takes no mask on every Triton this runs on)
            hist += h - tl.where(tl.arange(0, NB) == 0, BLOCK - tl.sum(ok.to(tl.int32), 0), 0)
        return hist

    @triton.jit
    def _select_kernel(s_ptr, idx_ptr, cnt_ptr, max_ptr, nlive_ptr, NK, KCAP, divisor, kmin, kmax,
                       BITS: tl.constexpr, BLOCK: tl.constexpr, HAS_NLIVE: tl.constexpr):
        """One program a row of s [rows, NK] (f32, -inf = invisible): its selected key indices, in key order, to
        idx [rows, KCAP]; their count to cnt [rows]; its largest score to max [rows]. HAS_NLIVE: only the keys
        below the device scalar nlive are read (those past it are invisible, and unwritten).

        (prefix, pmask): the threshold's fixed high bits; `need`: how many keys matching them remain to take.
        A pass stops the search early when the matching keys are exactly `need` (all of them are taken)."""
        NB: tl.constexpr = 1 << BITS
        NPASS: tl.constexpr = (32 + BITS - 1) // BITS
        row = tl.program_id(0)
        base = s_ptr + row.to(tl.int64) * NK
        hi_key = NK
        if HAS_NLIVE:
            hi_key = tl.minimum(NK, tl.load(nlive_ptr).to(tl.int32))
        bins = tl.arange(0, NB)
        zero = tl.zeros((1,), dtype=tl.uint32).sum(0)
        hist = _digit_hist(base, hi_key, zero, zero, 32 - BITS, BITS, BLOCK)
        n_vis = tl.sum(hist, 0)
        kk = tl.minimum(tl.maximum(n_vis // divisor, kmin), kmax)
        done = kk >= n_vis  # k covers the row: every visible key matches the empty prefix and is taken
        need = tl.where(done, n_vis, kk)
        prefix = zero
        pmask = zero
        for p in tl.static_range(NPASS):
            hi = 32 - p * BITS
            shift = hi - BITS if hi > BITS else 0
            if not done:
                if p > 0:
                    hist = _digit_hist(base, hi_key, prefix, pmask, shift, BITS, BLOCK)
                suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this digit or a larger one
                dstar = tl.max(tl.where(suffix >= need, bins, -1), 0)
                need -= tl.sum(tl.where(bins > dstar, hist, 0), 0)
                prefix = prefix | (dstar.to(tl.uint32) << shift)
                pmask = pmask | (((1 << (hi - shift)) - 1) << shift).to(tl.uint32)
                done = tl.sum(tl.where(bins == dstar, hist, 0), 0) == need
        taken = 0
        ties = 0
        big = -float("inf")
        for c in range(0, hi_key, BLOCK):
            keys = c + tl.arange(0, BLOCK)
            sv = tl.load(base + keys, mask=keys < hi_key, other=-float("inf"))
            big = tl.maximum(big, tl.max(sv, 0))
            u = _order_key(sv)
            hb = u & pmask
            tie = ((hb == prefix) & (u > 0)).to(tl.int32)
            rank = ties + tl.cumsum(tie, 0) - 1
            take = ((hb > prefix) | ((tie > 0) & (rank < need))).to(tl.int32)
            pos = taken + tl.cumsum(take, 0) - 1
            tl.store(idx_ptr + row.to(tl.int64) * KCAP + pos, keys, mask=(take > 0) & (pos < KCAP))
            taken += tl.sum(take, 0)
            ties += tl.sum(tie, 0)
        tl.store(cnt_ptr + row, tl.minimum(taken, KCAP))
        tl.store(max_ptr + row, big)

    @triton.jit
    def _sparse_pv_kernel(s_ptr, idx_ptr, cnt_ptr, max_ptr, v_ptr, o_ptr, R, NK, n_q, KCAP, v_head_stride,
                          o_row_stride, G: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
        """Grid (KV·R rows, D / BD column blocks): out[t, h·D + cols] = Σ_j softmax_j · V[idx_j, cols] over the
        row's selected keys, in their (key) order; a row with none writes 0."""
        row, cb = tl.program_id(0), tl.program_id(1)
        g = row // R
        r = row % R
        cnt = tl.load(cnt_ptr + row)
        m = tl.load(max_ptr + row)
        cols = cb * BD + tl.arange(0, BD)
        acc = tl.zeros((BD,), dtype=tl.float32)
        lsum = tl.zeros((BK,), dtype=tl.float32)
        vb = v_ptr + g.to(tl.int64) * v_head_stride
        for j in range(0, cnt, BK):
            jj = j + tl.arange(0, BK)
            ok = jj < cnt
            idx = tl.load(idx_ptr + row.to(tl.int64) * KCAP + jj, mask=ok, other=0)
            s = tl.load(s_ptr + row.to(tl.int64) * NK + idx, mask=ok, other=-float("inf"))
            p = tl.where(ok, tl.exp(s - m), 0.0)
            lsum += p
            v = tl.load(vb + idx.to(tl.int64)[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
            acc += tl.sum(p[:, None] * v.to(tl.float32), 0)
        total = tl.sum(lsum, 0)
        o = acc / tl.where(total > 0, total, 1.0)
        h = g * G + r // n_q
        t = r % n_q
        tl.store(o_ptr + t.to(tl.int64) * o_row_stride + h * D + cols, o.to(o_ptr.dtype.element_ty))


def select_topk(scores: torch.Tensor, rule, kcap: int | None = None, select_config: dict | None = None,
                nlive: torch.Tensor | None = None):
    """scores [rows, keys] f32 (-inf = invisible) -> (idx [rows, kcap] int32, count [rows] int32, row max [rows]):
    each row's selection (module docstring) in key order; idx past a row's count is unwritten. nlive (a device
    scalar): the keys at or past it are invisible and not read."""
    rows, nk = scores.shape
    kcap = rule.candidates(nk) if kcap is None else kcap
    sc = dict(SELECT_CONFIG, **(select_config or {}))
    sc["BLOCK"] = min(sc["BLOCK"], next_pow2(nk))
    idx = torch.empty(rows, kcap, dtype=torch.int32, device=scores.device)
    cnt = torch.empty(rows, dtype=torch.int32, device=scores.device)
    big = torch.empty(rows, dtype=torch.float32, device=scores.device)
    _select_kernel[(rows,)](scores, idx, cnt, big, nlive if nlive is not None else torch.zeros(1, dtype=torch.int32, device=scores.device), nk, kcap, rule.divisor,
                            rule.min_keys, rule.max_keys, HAS_NLIVE=nlive is not None, **sc)
    return idx, cnt, big


def fused_topk_blocks(q, k, v, kpos, n_keys, rule, block_rows: int, qpos=None, causal=False, out_dtype=None,
                      nlive=None, q_start: int | None = None, scores_config: dict | None = None,
                      select_config: dict | None = None, pv_config: dict | None = None, tma: bool | None = None):
    """-> [n, H·d]: the three kernels per block of `block_rows` query positions (module docstring); the call already
    checked (ops/attention_topk.attention_topk_fused). q_start (causal): query i is at position q_start + i and key
    row p holds position p, so a block reads only the keys up to its last position."""
    if not (k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride() == k.stride()):
        raise ValueError("attention_topk_fused: k and v must be [KV, rows, d] with rows d apart (a cache buffer)")
    H, n, d = q.shape
    KV = k.shape[0]
    G = H // KV
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    qg = q.view(KV, G, n, d).to(k.dtype)
    sc = dict(SCORES_CONFIG, **(scores_config or {}))
    sc["BK"] = min(sc["BK"], d)
    pc = dict(PV_CONFIG, **(pv_config or {}))
    pc["BD"] = min(pc["BD"], d)
    b = max(1, block_rows)
    k_rows = k.shape[1]
    if tma is None:  # descriptors: half operands (f32 keeps the pointer path's exact products), 16-byte aligned bases
        tma = (tma_available(q) and k.dtype != torch.float32 and k.data_ptr() % 16 == 0
               and k.stride(0) == k_rows * d)
    dummy = torch.zeros(1, dtype=torch.int64, device=q.device)
    flags = dict(HAS_NLIVE=nlive is not None and not causal, KPOS=kpos is not None, CAUSAL=causal,
                 IEEE=k.dtype == torch.float32)
    for s in range(0, n, b):
        e = min(n, s + b)
        nk = n_keys if not (causal and q_start is not None) else min(n_keys, q_start + e)
        R = G * (e - s)
        qb = qg[:, :, s:e].reshape(KV, R, d).contiguous()
        scores = torch.empty(KV, R, nk, dtype=torch.float32, device=q.device)
        qp = qpos[s:e] if causal else dummy
        qa, ka = qb, k
        if tma:
            qa = TensorDescriptor.from_tensor(qb.view(KV * R, d), [sc["BM"], sc["BK"]])
            ka = TensorDescriptor.from_tensor(k.view(KV * k_rows, d), [sc["BN"], sc["BK"]])
        _scores_kernel[(triton.cdiv(R, sc["BM"]), triton.cdiv(nk, sc["BN"]), KV)](
            qa, ka, scores, kpos if kpos is not None else dummy, qp, nlive if nlive is not None else dummy,
            R, nk, e - s, k.stride(0), k_rows, D=d, TMA=bool(tma), **flags, **sc)
        kcap = rule.candidates(nk)
        idx, cnt, big = select_topk(scores.view(KV * R, nk), rule, kcap, select_config,
                                    nlive if flags["HAS_NLIVE"] else None)
        _sparse_pv_kernel[(KV * R, d // pc["BD"])](
            scores, idx, cnt, big, v, out[s:e], R, nk, e - s, kcap, v.stride(0), out.stride(0), G=G, D=d, **pc)
    return out
