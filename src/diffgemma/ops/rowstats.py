"""The sampler's per-step statistics on its rows of logits, divided by the step temperature: z = logits / T.

z is formed as every pass forms it (ops/tempered_tables.py: f32 logits divided with correct rounding, or raw 16-bit
ones read through a tempered softcap table), so z, its max and its argmax are bit-identical to torch's `logits / T`;
entropy and lse come from an online softmax (float-rounding away from the torch formula in sampling/stats.py, which
stays the CPU path). One read of the [R, V] logits gives all of entropy, argmax, row max and lse (and, with groups,
the group maxima from which ops/survivor_list.py counts and lists the survivors reading only the columns that may
hold one: a batched round's plans); `tempered_survivors` is a second full read: the sparse self-conditioning's
survivor mask z >= thr[row], with per-row counts so the caller can size a sync-free nonzero (a solo plan). Only when
the survivors are too many to gather (flat rows) does another read follow: `tempered_masked_probs` writes their
probabilities for one dense product. All of them cut a row into the segments of ops/softcap.py's row_segments, one
program each; the row-stats pass writes one partial per segment and a small kernel combines them.
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, use_triton
from .lane_temps import LaneTemps
from .rows_at import kernel_args
from .softcap import SEGMENT, row_segments
from .tempered_tables import tempered_ref, z_args

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .tempered_tables import lane_of_row, tempered_z

ROW_LANE = 8  # the row-stats pass's lanes: consecutive columns one thread reduces in registers (one 16-byte load)
GROUP = 32  # columns of a group maximum (ops/survivor_list.py): 4 lanes, 64 bytes of raw logits a block


def _row_counts(counts: torch.Tensor) -> torch.Tensor:
    """A pass's survivor counts per (row, segment) -> per row, int32."""
    return counts[:, 0] if counts.shape[1] == 1 else counts.sum(-1, dtype=torch.int32)


def tempered_rowstats_ref(logits, temp, cap=None):
    """-> (entropy [R] f32, argmax [R] int64, rowmax [R] f32, lse [R] f32) of z = logits / temp. With a LaneTemps
    each lane's rows are reduced on their own, as that lane alone would be."""
    if isinstance(temp, LaneTemps) and len(temp) > 1:
        parts = [tempered_rowstats_ref(logits[sl], t, cap) for t, sl in zip(temp.temps, temp.spans())]
        return tuple(_scatter_rows([p[k] for p in parts], temp) for k in range(4))
    z = tempered_ref(logits, temp, cap)
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse[:, None]
    entropy = -(torch.exp(logp) * logp).sum(-1)
    return entropy, z.argmax(-1), z.max(-1).values, lse


def group_maxima_ref(logits, temp, cap=None, block=2048, segment=SEGMENT) -> torch.Tensor:
    """f32 [R, n_seg, block // GROUP]: the row-stats pass's group maxima of z = logits / temp, NaNs left out (a group
    of NaNs only, or past the row's end: -inf)."""
    z = tempered_ref(logits, temp, cap)
    rows, n = z.shape
    n_seg, span = row_segments(n, block, segment)
    z = torch.nn.functional.pad(z, (0, n_seg * span - n), value=-float("inf"))
    z = torch.where(z.isnan(), -float("inf"), z)
    return z.view(rows, n_seg, span // block, block // GROUP, GROUP).amax(dim=(2, 4))


def _scatter_rows(parts: list, lanes: LaneTemps) -> torch.Tensor:
    """Per-lane results [C_i] placed at their lanes' rows of an [R] result (rows in no lane: 0)."""
    out = parts[0].new_zeros(lanes.rows)
    for p, sl in zip(parts, lanes.spans()):
        out[sl] = p
    return out


def tempered_survivors_ref(logits, temp, thr, cap=None):
    """-> (bool mask [R, V] of z >= thr[:, None], int32 counts [R]) with z = logits / temp."""
    z = tempered_ref(logits, temp, cap)
    mask = z >= thr[:, None]
    return mask, mask.sum(-1, dtype=torch.int32)


if HAVE_TRITON:

    @triton.jit
    def _tempered_rowstats_kernel(x_ptr, xoff_ptr, m_ptr, s_ptr, u_ptr, best_ptr, gmax_ptr, n_cols, span, temp,
                                  table_ptr, lane_ptr, temps_ptr, BLOCK: tl.constexpr, LANE: tl.constexpr,
                                  ADDR: tl.constexpr, TABLE: tl.constexpr, DIV: tl.constexpr, EVEN: tl.constexpr,
                                  LANES: tl.constexpr, GROUP: tl.constexpr):
        """Partials of one (row, segment): m = max z, s = sum e, u = sum e * (z - m) with e = exp(z - m), and
        the first column holding m. ADDR: the logits lie at x_ptr + *xoff_ptr (ops/rows_at.py). TABLE / DIV:
        tempered_z. EVEN: every segment is whole (no masks). LANES: the row's temperature and table are its lane's
        (lane_of_row).
        GROUP (0: off): also the segment's group maxima (ops/survivor_list.py), the max z of each group of GROUP
        columns at one offset in every block: the running maxima of GROUP // LANE lanes, combined. The maxima leave
        NaNs out; were one to reach a lane's running max, the group's maximum is +inf (the group is read).

        The columns of a block are BLOCK / LANE lanes of LANE consecutive columns (one thread's vector load). Each
        lane keeps its own running (max, s, u, first column of its max), reducing its LANE values in the thread; the
        lanes are combined once, at the segment's end: four cross-thread reductions per block would cost more than the
        pass's reads."""
        if ADDR:  # a multiple of 16 bytes (RowsAt.point_at checks): the loads stay as wide as the tensor's
            xb = x_ptr + tl.multiple_of(tl.load(xoff_ptr), 4)
        else:
            xb = x_ptr
        row = tl.program_id(0).to(tl.int64)
        temp, table_ptr = lane_of_row(row, lane_ptr, temps_ptr, table_ptr, temp, LANES)
        seg = tl.program_id(1)
        first = seg * span
        last = tl.minimum(first + span, n_cols)
        NL: tl.constexpr = BLOCK // LANE
        offs = tl.arange(0, NL)[:, None] * LANE + tl.arange(0, LANE)[None, :]
        BIG: tl.constexpr = 2147483647
        # running over the columns each lane has seen; H = log s - u / s needs no cancellation against m
        # (lse - sum p*z loses ~1e-4 nats at |z| ~ 100)
        m = tl.full((NL,), -float("inf"), tl.float32)
        s = tl.zeros((NL,), tl.float32)
        u = tl.zeros((NL,), tl.float32)
        best = tl.zeros((NL,), tl.int32)
        for start in range(first, last, BLOCK):
            cols = start + offs
            if EVEN:
                z = tempered_z(xb + row * n_cols + cols, None, table_ptr, temp, TABLE, DIV, WHOLE=True)
            else:
                mask = cols < last
                z = tl.where(mask, tempered_z(xb + row * n_cols + cols, mask, table_ptr, temp, TABLE, DIV),
                             -float("inf"))
            cmax = tl.max(z, axis=1)
            # the lane's lowest column holding its max; strictly-greater keeps the earlier block on ties
            best = tl.where(cmax > m, tl.min(tl.where(z == cmax[:, None], cols, BIG), axis=1), best)
            m_new = tl.maximum(m, cmax)
            ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # a lane with no finite value yet: no inf - inf
            alpha = tl.exp(m - ref)
            d = z - ref[:, None]
            e = tl.exp(d)
            if not EVEN:
                d = tl.where(mask, d, 0.0)
                e = tl.where(mask, e, 0.0)
            # moving the reference from m to m_new: u' = alpha * (u + s * (m - m_new)); s == 0 before any column
            u = alpha * (u + tl.where(s > 0.0, s * (m - ref), 0.0)) + tl.sum(e * d, axis=1)
            s = s * alpha + tl.sum(e, axis=1)
            m = m_new
        top = tl.max(m, axis=0)
        live = s > 0.0
        dm = tl.where(live, m - top, 0.0)
        a = tl.where(live, tl.exp(dm), 0.0)
        at = row * tl.num_programs(1) + seg
        tl.store(m_ptr + at, top)
        tl.store(s_ptr + at, tl.sum(a * s, axis=0))
        tl.store(u_ptr + at, tl.sum(a * (u + s * dm), axis=0))
        # the segment's first column holding its max (a segment of -inf only: column 0, as one running max gave)
        tl.store(best_ptr + at, tl.min(tl.where(m == top, best, BIG), axis=0).to(tl.int64))
        if GROUP:
            NG: tl.constexpr = BLOCK // GROUP
            gm = tl.max(tl.reshape(tl.where(m != m, float("inf"), m), (NG, GROUP // LANE)), axis=1)
            tl.store(gmax_ptr + at * NG + tl.arange(0, NG), gm)

    @triton.jit
    def _rowstats_combine_kernel(m_ptr, s_ptr, u_ptr, best_ptr, ent_ptr, amax_ptr, max_ptr, lse_ptr, n_seg,
                                 SEGS: tl.constexpr):
        """One row's segment partials -> entropy, argmax, row max, lse. With one segment every rescale factor
        is exp(0) = 1 and the results are the one-program kernel's, bit for bit."""
        row = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, SEGS)
        valid = idx < n_seg
        m = tl.load(m_ptr + row * n_seg + idx, mask=valid, other=-float("inf"))
        s = tl.load(s_ptr + row * n_seg + idx, mask=valid, other=0.0)
        u = tl.load(u_ptr + row * n_seg + idx, mask=valid, other=0.0)
        best = tl.load(best_ptr + row * n_seg + idx, mask=valid, other=0)
        top = tl.max(m, axis=0)
        live = valid & (s > 0.0)
        d = tl.where(live, m - top, 0.0)  # 0, not -inf - top, where a segment is padding: no 0 * inf
        a = tl.where(live, tl.exp(d), 0.0)
        s_all = tl.sum(a * s, axis=0)
        u_all = tl.sum(a * (u + s * d), axis=0)
        # the first segment holding the row max holds its first column (segments are in column order)
        first = tl.min(tl.where(valid & (m == top), idx, SEGS), axis=0)
        tl.store(ent_ptr + row, tl.log(s_all) - u_all / s_all)
        tl.store(amax_ptr + row, tl.sum(tl.where(idx == first, best, 0), axis=0))
        tl.store(max_ptr + row, top)
        tl.store(lse_ptr + row, top + tl.log(s_all))

    @triton.jit
    def _tempered_survivors_kernel(x_ptr, thr_ptr, mask_ptr, count_ptr, n_cols, span, temp, table_ptr, lane_ptr,
                                   temps_ptr, BLOCK: tl.constexpr, TABLE: tl.constexpr, DIV: tl.constexpr,
                                   LANES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        temp, table_ptr = lane_of_row(row, lane_ptr, temps_ptr, table_ptr, temp, LANES)
        seg = tl.program_id(1)
        first = seg * span
        last = tl.minimum(first + span, n_cols)
        offs = tl.arange(0, BLOCK)
        thr = tl.load(thr_ptr + row)
        count = 0
        for start in range(first, last, BLOCK):
            cols = start + offs
            inside = cols < last
            keep = (tempered_z(x_ptr + row * n_cols + cols, inside, table_ptr, temp, TABLE, DIV) >= thr) & inside
            tl.store(mask_ptr + row * n_cols + cols, keep.to(tl.int8), mask=inside)
            count += tl.sum(keep.to(tl.int32), axis=0)
        tl.store(count_ptr + row * tl.num_programs(1) + seg, count)

    @triton.jit
    def _tempered_masked_probs_kernel(x_ptr, xoff_ptr, thr_ptr, lse_ptr, out_ptr, count_ptr, n_cols, span, temp,
                                      table_ptr, lane_ptr, temps_ptr, BLOCK: tl.constexpr, COUNT: tl.constexpr,
                                      ADDR: tl.constexpr, TABLE: tl.constexpr, DIV: tl.constexpr, LANES: tl.constexpr):
        """COUNT: also the survivors of this (row, segment), as `_tempered_survivors_kernel` counts them. ADDR: the
        logits lie at x_ptr + *xoff_ptr (ops/rows_at.py). TABLE / DIV: tempered_z. LANES: lane_of_row."""
        if ADDR:  # a multiple of 16 bytes (RowsAt.point_at checks): the loads stay as wide as the tensor's
            xb = x_ptr + tl.multiple_of(tl.load(xoff_ptr), 4)
        else:
            xb = x_ptr
        row = tl.program_id(0).to(tl.int64)
        temp, table_ptr = lane_of_row(row, lane_ptr, temps_ptr, table_ptr, temp, LANES)
        seg = tl.program_id(1)
        first = seg * span
        last = tl.minimum(first + span, n_cols)
        offs = tl.arange(0, BLOCK)
        thr = tl.load(thr_ptr + row)
        lse = tl.load(lse_ptr + row)
        count = 0
        for start in range(first, last, BLOCK):
            cols = start + offs
            inside = cols < last
            z = tempered_z(xb + row * n_cols + cols, inside, table_ptr, temp, TABLE, DIV)
            keep = z >= thr
            p = tl.where(keep, tl.exp(z - lse), 0.0)
            tl.store(out_ptr + row * n_cols + cols, p.to(out_ptr.dtype.element_ty), mask=inside)
            if COUNT:
                count += tl.sum((keep & inside).to(tl.int32), axis=0)
        if COUNT:
            tl.store(count_ptr + row * tl.num_programs(1) + seg, count)


def tempered_rowstats_triton(logits, temp, block=2048, segment=SEGMENT, num_warps=4, cap=None, groups=False):
    """logits: a tensor, or a RowsAt naming one (ops/rows_at.py); raw ones with cap (ops/tempered_tables.py). groups:
    also return the group maxima f32 [R, n_seg, block // GROUP] (ops/survivor_list.py), from the same pass."""
    za = z_args(logits, cap, temp)
    x, xoff, addr = kernel_args(za["x"])
    rows, n = logits.shape
    dev = logits.device
    n_seg, span = row_segments(n, block, segment)
    m, s, u = (torch.empty(rows, n_seg, dtype=torch.float32, device=dev) for _ in range(3))
    best = torch.empty(rows, n_seg, dtype=torch.int64, device=dev)
    gmax = torch.empty(rows, n_seg, block // GROUP, dtype=torch.float32, device=dev) if groups else m
    # 4 warps, lanes of 8, chosen at [256, 262144] (docs/ARCHITECTURE.md, 'Kernel configurations')
    _tempered_rowstats_kernel[(rows, n_seg)](x, xoff, m, s, u, best, gmax, n, span, za["temp"], za["table"],
                                             za["lane"], za["temps"], BLOCK=block, LANE=ROW_LANE, ADDR=addr,
                                             TABLE=za["TABLE"], DIV=za["DIV"], EVEN=n % span == 0, LANES=za["LANES"],
                                             GROUP=GROUP if groups else 0, num_warps=num_warps)
    ent = torch.empty(rows, dtype=torch.float32, device=dev)
    amax = torch.empty(rows, dtype=torch.int64, device=dev)
    rowmax = torch.empty(rows, dtype=torch.float32, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    _rowstats_combine_kernel[(rows,)](m, s, u, best, ent, amax, rowmax, lse, n_seg,
                                      SEGS=triton.next_power_of_2(n_seg), num_warps=1)
    return (ent, amax, rowmax, lse, gmax) if groups else (ent, amax, rowmax, lse)


def tempered_survivors_triton(logits, temp, thr, block=2048, segment=SEGMENT, out=None, cap=None):
    """out: an int8 [rows, n] buffer for the mask (see _out_buffer), else a new one. cap: raw logits
    (ops/tempered_tables.py)."""
    logits = logits.contiguous()
    za = z_args(logits, cap, temp)
    rows, n = logits.shape
    n_seg, span = row_segments(n, block, segment)
    mask = _out_buffer(out, rows, n, torch.int8, logits.device)
    counts = torch.empty(rows, n_seg, dtype=torch.int32, device=logits.device)
    _tempered_survivors_kernel[(rows, n_seg)](za["x"], thr.float().contiguous(), mask, counts, n, span, za["temp"],
                                              za["table"], za["lane"], za["temps"], BLOCK=block, TABLE=za["TABLE"],
                                              DIV=za["DIV"], LANES=za["LANES"], num_warps=8)
    return mask.view(torch.bool), _row_counts(counts)


def tempered_masked_probs_ref(logits, temp, thr, lse, dtype, cap=None):
    """softmax(z) where z >= thr[row] and 0 elsewhere, as `dtype` [R, V]; z = logits / temp, lse its logsumexp."""
    z = tempered_ref(logits, temp, cap)
    return torch.where(z >= thr[:, None], torch.exp(z - lse[:, None]), 0.0).to(dtype)


def _out_buffer(out, rows: int, n: int, dtype, device) -> torch.Tensor:
    """A [rows, n] result buffer: `out` when given (contiguous, of `dtype`, e.g. a view of a dead scratch), else new."""
    if out is None:
        return torch.empty((rows, n), dtype=dtype, device=device)
    if tuple(out.shape) != (rows, n) or out.dtype != dtype or not out.is_contiguous() or out.device != device:
        raise TensorError(f"tempered rows: out must be a contiguous [{rows}, {n}] {dtype} tensor on {device}, got "
                          f"{out.dtype} {list(out.shape)} on {out.device}")
    return out


def _into(out, probs: torch.Tensor) -> torch.Tensor:
    """The twins' probabilities, copied into `out` when one is given (checked as the kernels check it)."""
    return probs if out is None else _out_buffer(out, *probs.shape, probs.dtype, probs.device).copy_(probs)


def tempered_masked_probs_triton(logits, temp, thr, lse, dtype, block=2048, segment=SEGMENT, count=False, out=None,
                                 cap=None):
    """count=True: -> (probs, int32 survivor counts [R]), the counts as tempered_survivors gives them. logits: a
    tensor, or a RowsAt naming one (ops/rows_at.py); raw ones with cap (ops/tempered_tables.py). out: write the
    probabilities there (see _out_buffer)."""
    za = z_args(logits, cap, temp)
    x, xoff, addr = kernel_args(za["x"])
    rows, n = logits.shape
    n_seg, span = row_segments(n, block, segment)
    out = _out_buffer(out, rows, n, dtype, logits.device)
    counts = torch.empty(rows, n_seg, dtype=torch.int32, device=logits.device) if count else out
    _tempered_masked_probs_kernel[(rows, n_seg)](x, xoff, thr.float().contiguous(), lse.float().contiguous(), out,
                                                 counts, n, span, za["temp"], za["table"], za["lane"], za["temps"],
                                                 BLOCK=block, COUNT=count, ADDR=addr, TABLE=za["TABLE"], DIV=za["DIV"],
                                                 LANES=za["LANES"], num_warps=8)
    if not count:
        return out
    return out, _row_counts(counts)


def tempered_counted_probs(logits, temp, thr, lse, dtype, out=None, cap=None):
    """tempered_masked_probs and the survivor counts of tempered_survivors, from one pass over the logits (no
    mask): the sparse SC's dense product started before the host has read the count (sampling/self_condition.py).
    out: where to write the probabilities (default: a new tensor). cap: raw logits, as for every pass here."""
    if use_triton(logits):
        return tempered_masked_probs_triton(logits, temp, thr, lse, dtype, count=True, out=out, cap=cap)
    probs = _into(out, tempered_masked_probs_ref(logits, temp, thr, lse, dtype, cap))
    return probs, tempered_survivors_ref(logits, temp, thr, cap)[1]


def tempered_rowstats(logits, temp, cap=None, groups=False):
    """Row stats of logits / temp: -> (entropy, argmax, rowmax, lse); Triton on CUDA, torch elsewhere. cap: the
    logits are raw, softcapped as they are read (the same numbers as passing softcap(logits, cap)). groups: and the
    group maxima (ops/survivor_list.py) as a fifth."""
    if use_triton(logits):
        return tempered_rowstats_triton(logits, temp, cap=cap, groups=groups)
    out = tempered_rowstats_ref(logits, temp, cap)
    return (*out, group_maxima_ref(logits, temp, cap)) if groups else out


def tempered_survivors(logits, temp, thr, out=None, cap=None):
    """Survivor mask z >= thr[row] of z = logits / temp, and per-row counts; Triton on CUDA, torch elsewhere.
    out: an int8 [R, V] buffer the kernel writes the mask to (the result is its bool view); the torch path ignores it.
    cap: raw logits (see tempered_rowstats)."""
    if use_triton(logits):
        return tempered_survivors_triton(logits, temp, thr, out=out, cap=cap)
    return tempered_survivors_ref(logits, temp, thr, cap)


def tempered_masked_probs(logits, temp, thr, lse, dtype, out=None, cap=None):
    """The survivors' probabilities (0 elsewhere) as `dtype`: the sparse SC's dense fallback, in one pass. out: where
    to write them (default: a new tensor). cap: raw logits (see tempered_rowstats)."""
    if use_triton(logits):
        return tempered_masked_probs_triton(logits, temp, thr, lse, dtype, out=out, cap=cap)
    return _into(out, tempered_masked_probs_ref(logits, temp, thr, lse, dtype, cap))
