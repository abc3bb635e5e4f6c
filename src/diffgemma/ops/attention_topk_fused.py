"""Top-k sparse attention as three Triton kernels: the fused form of ops/attention_topk.py's selection.

Same contract, shapes and selection as attention_topk_ref (its twin) and the gather form: each folded query row
attends to its k = clamp(n_visible // divisor, min_keys, max_keys) highest f32 scores (all of its visible keys where
k covers them), ties at the k-th score going to the lower key index, the softmax over that set only.

Per block of query rows (GQA folded: row r of KV head g is query head g·G + r // b, token r % b):

  1. `_scores_kernel`: S = Q·K^T per [BM rows × BN keys] tile, f32 accumulation, the visibility mask applied
     (invisible keys get -inf), written once as f32 [KV, rows, keys]; tiles wholly at or past `nlive` (a graph
     bucket's padding) do no work, and nothing reads them.
  2. `_select_kernel`, one program a row: the exact k-th largest score by a radix select on the scores' f32 bits
     mapped to an order-preserving unsigned key (u = bits | 2^31 for x >= 0, ~bits for x < 0, -0 as +0; an
     invisible key is u = 0, below every real score). A pass counts the entries per BITS-wide digit of u among
     those matching the digits fixed so far (a histogram in registers: integer counts, no atomics, so no order
     dependence); the digit holding the k-th largest is fixed and the count strictly above it leaves the budget
     (`need`: how many entries matching the fixed digits remain to take). The first pass reads the row (and counts
     its visible keys, for k). Then one more read of the row writes the keys above the first digit's bucket (all
     taken) and copies the bucket's entries (key, u) to a per-row scratch of CAP entries; the remaining passes
     search that copy. A pass whose bucket holds exactly `need` entries ends the search (all of them are taken);
     a bucket larger than CAP is searched over the row itself. The last pass writes, in entry order, the entries
     above the threshold and the first `need` equal to it (ties to the lower key index, the twin's rule). Out:
     the selected key indices [rows, kmax] (those above the first digit's bucket, then the rest, each in key
     order), their count, and the row's largest score. A row whose k covers its visible keys takes all of them.
  3. `_sparse_pv_kernel`, one program a (row, column block): p = exp(s - max) over the selected keys in key order,
     their V rows gathered, f32 products and sums in the selection's fixed order (bit-identical from run to run).

Why the scores go to memory once (docs/ARCHITECTURE.md, 'Attention'): the select reads a row's scores twice (up to
1 + ceil(32 / BITS) times where a first-digit bucket outgrows CAP). Recomputing them instead costs one Q·K^T GEMM per
read (2·rows·keys·d FLOPs: d = 512 makes
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

# Tile configs (docs/ARCHITECTURE.md, 'Kernel configurations'); the CPU tests pass small ones.
SCORES_CONFIG = dict(BM=128, BN=128, BK=32, num_warps=8, num_stages=3)
SELECT_CONFIG = dict(BLOCK=2048, BITS=11, CAP=4096, num_warps=8)
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
    def _keys_of(base, j, n, FROM_SCORES: tl.constexpr):
        """Order keys of entries j < n: from f32 scores (FROM_SCORES), else stored keys (a row's scratch)."""
        if FROM_SCORES:
            return _order_key(tl.load(base + j, mask=j < n, other=-float("inf")))
        return tl.load(base + j, mask=j < n, other=0).to(tl.uint32, bitcast=True)

    @triton.jit
    def _digit_hist(base, n, prefix, pmask, shift: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                    FROM_SCORES: tl.constexpr):
        """(counts per digit (u >> shift) & (2^BITS - 1) of the entries whose fixed bits (u & pmask) equal prefix,
        invisible ones (u = 0) left out; the entries' largest score, from scores)."""
        NB: tl.constexpr = 1 << BITS
        hist = tl.zeros((NB,), dtype=tl.int32)
        big = -float("inf")
        for c in range(0, n, BLOCK):
            j = c + tl.arange(0, BLOCK)
            if FROM_SCORES:
                sv = tl.load(base + j, mask=j < n, other=-float("inf"))
                big = tl.maximum(big, tl.max(sv, 0))
                u = _order_key(sv)
            else:
                u = _keys_of(base, j, n, False)
            ok = (u > 0) & ((u & pmask) == prefix)
            d = tl.where(ok, (u >> shift) & (NB - 1), 0).to(tl.int32)
            h = tl.histogram(d, NB)
            # the entries left out were counted in bin 0 (the histogram takes no mask on every Triton this runs on)
            hist += h - tl.where(tl.arange(0, NB) == 0, BLOCK - tl.sum(ok.to(tl.int32), 0), 0)
        return hist, big

    @triton.jit
    def _fix_digit(hist, need, prefix, pmask, hi: tl.constexpr, shift: tl.constexpr, BITS: tl.constexpr):
        """One pass's choice: the digit holding the need-th largest entry among those counted."""
        bins = tl.arange(0, 1 << BITS)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # entries with this digit or a larger one
        dstar = tl.max(tl.where(suffix >= need, bins, -1), 0)
        need -= tl.sum(tl.where(bins > dstar, hist, 0), 0)
        prefix = prefix | (dstar.to(tl.uint32) << shift)
        pmask = pmask | ((pmask * 0 + ((1 << (hi - shift)) - 1)) << shift)  # this digit's bits, as uint32
        return need, prefix, pmask, tl.sum(tl.where(bins == dstar, hist, 0), 0)

    @triton.jit
    def _radix_rest(base, n, need, prefix, pmask, done, BITS: tl.constexpr, BLOCK: tl.constexpr,
                    FROM_SCORES: tl.constexpr):
        """Passes 1.. of the search over n entries, until the bucket holds exactly `need` (done) or the last digit."""
        NPASS: tl.constexpr = (32 + BITS - 1) // BITS
        for p in tl.static_range(1, NPASS):
            hi = 32 - p * BITS
            shift = hi - BITS if hi > BITS else 0
            if not done:
                hist, _ = _digit_hist(base, n, prefix, pmask, shift, BITS, BLOCK, FROM_SCORES)
                need, prefix, pmask, bucket = _fix_digit(hist, need, prefix, pmask, hi, shift, BITS)
                done = bucket == need
        return need, prefix, pmask

    @triton.jit
    def _write_taken(base, n, keys_base, out_base, start, prefix, pmask, need, KCAP, BLOCK: tl.constexpr,
                     FROM_SCORES: tl.constexpr):
        """Writes to out_base[start + ...], in entry order, the keys of the entries with (u & pmask) > prefix and of
        the first `need` with (u & pmask) = prefix (visible ones only); -> how many. An entry's key is its index
        (FROM_SCORES), else keys_base[entry]."""
        taken = 0
        ties = 0
        for c in range(0, n, BLOCK):
            j = c + tl.arange(0, BLOCK)
            u = _keys_of(base, j, n, FROM_SCORES)
            key = j
            if not FROM_SCORES:
                key = tl.load(keys_base + j, mask=j < n, other=0)
            hb = u & pmask
            tie = ((hb == prefix) & (u > 0)).to(tl.int32)
            rank = ties + tl.cumsum(tie, 0) - 1
            take = ((hb > prefix) | ((tie > 0) & (rank < need))).to(tl.int32)
            pos = start + taken + tl.cumsum(take, 0) - 1
            tl.store(out_base + pos, key, mask=(take > 0) & (pos < KCAP))
            taken += tl.sum(take, 0)
            ties += tl.sum(tie, 0)
        return taken

    @triton.jit
    def _split_bucket(base, n, prefix, pmask, out_base, su_base, sk_base, KCAP, BLOCK: tl.constexpr):
        """One read of the row: the keys above the bucket (u & pmask) > prefix, all taken, to out_base in key order;
        the bucket's entries (u & pmask) = prefix to the scratch (order key, key) in key order. -> (above, bucket)."""
        above = 0
        inb = 0
        for c in range(0, n, BLOCK):
            j = c + tl.arange(0, BLOCK)
            u = _keys_of(base, j, n, True)
            hb = u & pmask
            up = ((hb > prefix) & (u > 0)).to(tl.int32)
            mid = ((hb == prefix) & (u > 0)).to(tl.int32)
            pa = above + tl.cumsum(up, 0) - 1
            tl.store(out_base + pa, j, mask=(up > 0) & (pa < KCAP))
            pb = inb + tl.cumsum(mid, 0) - 1
            tl.store(su_base + pb, u.to(tl.int32, bitcast=True), mask=mid > 0)
            tl.store(sk_base + pb, j, mask=mid > 0)
            above += tl.sum(up, 0)
            inb += tl.sum(mid, 0)
        return above, inb

    @triton.jit
    def _select_kernel(s_ptr, idx_ptr, cnt_ptr, max_ptr, nlive_ptr, su_ptr, sk_ptr, NK, KCAP, CAP, divisor, kmin,
                       kmax, BITS: tl.constexpr, BLOCK: tl.constexpr, HAS_NLIVE: tl.constexpr):
        """One program a row of s [rows, NK] (f32, -inf = invisible): its selected keys to idx [rows, KCAP] (the
        keys above the threshold's first digit, then the rest, each in key order), their count to cnt [rows], its
        largest score to max [rows]. HAS_NLIVE: only the keys below the device scalar nlive are read (those past it
        are invisible, and unwritten). su, sk [rows, CAP]: a scratch for the first digit's bucket.

        (prefix, pmask): the threshold's fixed high bits; `need`: how many entries matching them remain to take.
        After the first digit, a bucket of at most CAP entries is copied out (with the keys above it, in the same
        read of the row) and searched there; a larger one is searched over the row itself."""
        row = tl.program_id(0)
        base = s_ptr + row.to(tl.int64) * NK
        out = idx_ptr + row.to(tl.int64) * KCAP
        n = NK
        if HAS_NLIVE:
            n = tl.minimum(NK, tl.load(nlive_ptr).to(tl.int32))
        zero = tl.zeros((1,), dtype=tl.uint32).sum(0)
        hist, big = _digit_hist(base, n, zero, zero, 32 - BITS, BITS, BLOCK, True)
        n_vis = tl.sum(hist, 0)
        kk = tl.minimum(tl.maximum(n_vis // divisor, kmin), kmax)
        every = kk >= n_vis  # k covers the row: every visible key matches the empty prefix and is taken
        need = tl.where(every, n_vis, kk)
        prefix = zero
        pmask = zero
        bucket = n_vis
        if not every:
            need, prefix, pmask, bucket = _fix_digit(hist, need, zero, zero, 32, 32 - BITS, BITS)
        done = every | (bucket == need)
        if (not done) & (bucket <= CAP):
            su = su_ptr + row.to(tl.int64) * CAP
            sk = sk_ptr + row.to(tl.int64) * CAP
            above, nb = _split_bucket(base, n, prefix, pmask, out, su, sk, KCAP, BLOCK)
            need, prefix, pmask = _radix_rest(su, nb, need, prefix, pmask, done, BITS, BLOCK, False)
            taken = above + _write_taken(su, nb, sk, out, above, prefix, pmask, need, KCAP, BLOCK, False)
        else:
            need, prefix, pmask = _radix_rest(base, n, need, prefix, pmask, done, BITS, BLOCK, True)
            taken = _write_taken(base, n, base, out, 0, prefix, pmask, need, KCAP, BLOCK, True)
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
    each row's selection (module docstring), in a fixed order; idx past a row's count is unwritten. nlive (a
    device scalar): the keys at or past it are invisible and not read. select_config: BLOCK, BITS, CAP (the
    scratch entries a row: a first-digit bucket larger than CAP is searched over the row), num_warps."""
    rows, nk = scores.shape
    kcap = rule.candidates(nk) if kcap is None else kcap
    sc = dict(SELECT_CONFIG, **(select_config or {}))
    sc["BLOCK"] = min(sc["BLOCK"], next_pow2(nk))
    cap = sc.pop("CAP")
    idx = torch.empty(rows, kcap, dtype=torch.int32, device=scores.device)
    cnt = torch.empty(rows, dtype=torch.int32, device=scores.device)
    big = torch.empty(rows, dtype=torch.float32, device=scores.device)
    su = torch.empty(rows, max(cap, 1), dtype=torch.int32, device=scores.device)
    sk = torch.empty_like(su)
    nl = nlive if nlive is not None else torch.zeros(1, dtype=torch.int32, device=scores.device)
    _select_kernel[(rows,)](scores, idx, cnt, big, nl, su, sk, nk, kcap, cap, rule.divisor, rule.min_keys,
                            rule.max_keys, HAS_NLIVE=nlive is not None, **sc)
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
        # the scratch in at most a quarter of the scores' bytes (a first-digit bucket holds a few % of the keys)
        sel = dict(SELECT_CONFIG, **(select_config or {}))
        sel["CAP"] = min(sel["CAP"], max(nk // 8, 2 * kcap))
        idx, cnt, big = select_topk(scores.view(KV * R, nk), rule, kcap, sel, nlive if flags["HAS_NLIVE"] else None)
        _sparse_pv_kernel[(KV * R, d // pc["BD"])](
            scores, idx, cnt, big, v, out[s:e], R, nk, e - s, kcap, v.stride(0), out.stride(0), G=G, D=d, **pc)
    return out
