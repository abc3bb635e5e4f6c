"""The sparse SC's survivors (z >= thr[row], z = logits / T) counted and listed without a pass over every column.

The row-stats pass (ops/rowstats.py, groups=True) leaves, per (row, segment), the group maxima: the max z of each
group, the GROUP columns at one offset of every BLOCK-column block of the segment (NaNs, which never survive, left
out). A survivor's group maximum is at least its z, so at least thr: only the columns of groups whose maximum reaches
thr can hold survivors, and the kernels here load only those (whole groups, masked loads; the other columns are never
read). A trained model's row keeps a few tokens, so they read a few groups a row, where a survivor pass reads every
column and writes a mask; a flat row reaches thr in most groups and is read whole, as before.

  survivor_counts   the survivors of each (row, segment), int32 [R, n_seg]; their sum over a row is
                    rowstats.tempered_survivors' count of that row
  survivor_list     (rows, cols) int64 [n] and their z: the survivors of the (row, segment)s whose count is not 0,
                    in row-major order, as nonzero lists the survivor mask with the other (row, segment)s cleared.
                    Each (row, segment) writes its survivors from its offset (the exclusive sum of the counts before
                    it), block by block in column order (a prefix sum over each block's keep flags)

Both read the logits as every tempered pass does (tempered_tables.z_args: f32, or raw 16-bit through a tempered
table; one temperature or a LaneTemps), cut into the segments and blocks of the row-stats pass that made the maxima.
The twins build the survivor mask in torch: the same comparisons, so the same counts and lists.
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, use_triton
from .rowstats import GROUP, tempered_survivors_ref
from .softcap import SEGMENT, row_segments
from .tempered_tables import tempered_ref, z_args

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .tempered_tables import lane_of_row, tempered_z

    @triton.jit
    def _kept_groups(thr_ptr, gmax_ptr, count_ptr, n_cols, span, temp, table_ptr, lane_ptr, temps_ptr,
                     LIST: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """This program's (row, segment): its row, threshold, temperature and table, which groups reach the threshold,
        their columns' offsets in a block, and the columns its loop runs over (none when no group reaches it, or, with
        LIST, when its count is 0)."""
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        at = row * tl.num_programs(1) + seg
        temp, table_ptr = lane_of_row(row, lane_ptr, temps_ptr, table_ptr, temp, LANES)
        NG: tl.constexpr = BLOCK // GROUP
        thr = tl.load(thr_ptr + row)
        g = tl.load(gmax_ptr + at * NG + tl.arange(0, NG))
        sel = g >= thr
        if LIST:  # the count as a [NG] tensor: a scalar's & a tensor would not be a bool mask in the interpreter
            sel = sel & ((tl.zeros((NG,), tl.int32) + tl.load(count_ptr + at)) > 0)
        first = seg * span
        last = tl.minimum(first + span, n_cols)
        stop = tl.where(tl.max(sel.to(tl.int32), axis=0) > 0, last, first)
        offs = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        return row, at, thr, temp, table_ptr, sel, offs, first, last, stop

    @triton.jit
    def _live(sel, cols, last, NG: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):
        """The columns a block reads: its kept groups' (EVEN: every segment whole, so a mask constant along a group,
        which keeps the loads wide)."""
        if EVEN:
            return tl.broadcast_to(sel[:, None], (NG, GROUP))
        return sel[:, None] & (cols < last)

    @triton.jit
    def _survivor_counts_kernel(x_ptr, thr_ptr, gmax_ptr, count_ptr, n_cols, span, temp, table_ptr, lane_ptr,
                                temps_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr, TABLE: tl.constexpr,
                                DIV: tl.constexpr, LANES: tl.constexpr, EVEN: tl.constexpr):
        NG: tl.constexpr = BLOCK // GROUP
        row, at, thr, temp, table_ptr, sel, offs, first, last, stop = _kept_groups(
            thr_ptr, gmax_ptr, count_ptr, n_cols, span, temp, table_ptr, lane_ptr, temps_ptr, False, LANES, BLOCK,
            GROUP)
        count = 0
        for start in range(first, stop, BLOCK):
            cols = start + offs
            live = _live(sel, cols, last, NG, GROUP, EVEN)
            z = tempered_z(x_ptr + row * n_cols + cols, live, table_ptr, temp, TABLE, DIV)
            count += tl.sum(tl.sum((live & (z >= thr)).to(tl.int32), axis=1), axis=0)
        tl.store(count_ptr + at, count)

    @triton.jit
    def _survivor_list_kernel(x_ptr, thr_ptr, gmax_ptr, count_ptr, ends_ptr, rows_ptr, cols_ptr, z_ptr, size, n_cols,
                              span, temp, table_ptr, lane_ptr, temps_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                              TABLE: tl.constexpr, DIV: tl.constexpr, LANES: tl.constexpr, EVEN: tl.constexpr):
        """ends: the inclusive sum of the counts (row-major), so this (row, segment)'s first slot is its end minus its
        count."""
        NG: tl.constexpr = BLOCK // GROUP
        row, at, thr, temp, table_ptr, sel, offs, first, last, stop = _kept_groups(
            thr_ptr, gmax_ptr, count_ptr, n_cols, span, temp, table_ptr, lane_ptr, temps_ptr, True, LANES, BLOCK,
            GROUP)
        base = tl.load(ends_ptr + at) - tl.load(count_ptr + at)
        for start in range(first, stop, BLOCK):
            cols = start + offs
            live = _live(sel, cols, last, NG, GROUP, EVEN)
            z = tempered_z(x_ptr + row * n_cols + cols, live, table_ptr, temp, TABLE, DIV)
            keep = (live & (z >= thr)).to(tl.int32)
            per = tl.sum(keep, axis=1)  # survivors per group, the groups in column order
            here = tl.sum(per, axis=0)
            if here > 0:
                pos = base + (tl.cumsum(per, axis=0) - per)[:, None] + tl.cumsum(keep, axis=1) - 1
                ok = (keep != 0) & (pos < size)
                tl.store(rows_ptr + pos, tl.zeros_like(pos) + row, mask=ok)
                tl.store(cols_ptr + pos, cols.to(tl.int64), mask=ok)
                tl.store(z_ptr + pos, z, mask=ok)
            base += here


def _check(logits, thr, gmax, counts, block: int, segment: int) -> tuple[int, int]:
    """-> (n_seg, span) of the row-stats pass the maxima came from; refuses shapes that are not its."""
    rows, n = logits.shape
    n_seg, span = row_segments(n, block, segment)
    want = (rows, n_seg, block // GROUP)
    if gmax is not None and tuple(gmax.shape) != want:
        raise TensorError(f"survivors: group maxima must be {list(want)} (the row-stats pass's for these logits), got "
                          f"{list(gmax.shape)}")
    if counts is not None and tuple(counts.shape) != (rows, n_seg):
        raise TensorError(f"survivors: counts must be [{rows}, {n_seg}], got {list(counts.shape)}")
    if thr.shape != (rows,):
        raise TensorError(f"survivors: thresholds must be [{rows}], got {list(thr.shape)}")
    return n_seg, span


def _launch(kernel, logits, temp, thr, gmax, cap, block, segment, *args):
    za = z_args(logits, cap, temp)
    n = logits.shape[1]
    n_seg, span = row_segments(n, block, segment)
    kernel[(logits.shape[0], n_seg)](za["x"], thr.float().contiguous(), gmax.contiguous(), *args, n, span, za["temp"],
                                     za["table"], za["lane"], za["temps"], BLOCK=block, GROUP=GROUP, TABLE=za["TABLE"],
                                     DIV=za["DIV"], LANES=za["LANES"], EVEN=n % span == 0, num_warps=4)


def survivor_counts_triton(logits, temp, thr, gmax, block=2048, segment=SEGMENT, cap=None) -> torch.Tensor:
    logits = logits.contiguous()
    n_seg, _ = _check(logits, thr, gmax, None, block, segment)
    counts = torch.empty(logits.shape[0], n_seg, dtype=torch.int32, device=logits.device)
    _launch(_survivor_counts_kernel, logits, temp, thr, gmax, cap, block, segment, counts)
    return counts


def survivor_list_triton(logits, temp, thr, gmax, counts, size: int, block=2048, segment=SEGMENT, cap=None,
                         padded=False):
    logits, counts = logits.contiguous(), counts.contiguous()
    _check(logits, thr, gmax, counts, block, segment)
    ends = counts.view(-1).cumsum(0, dtype=torch.int64)
    make = torch.zeros if padded else torch.empty
    rows = make(size, dtype=torch.int64, device=logits.device)
    cols = make(size, dtype=torch.int64, device=logits.device)
    z = torch.empty(size, dtype=torch.float32, device=logits.device)
    _launch(_survivor_list_kernel, logits, temp, thr, gmax, cap, block, segment, counts, ends, rows, cols, z, size)
    return rows, cols, z


def _segment_mask(logits, temp, thr, cap, block: int, segment: int) -> torch.Tensor:
    """The twins' survivor mask, bool [R, n_seg, span] (the columns past the row's end: False)."""
    mask = tempered_survivors_ref(logits, temp, thr, cap)[0]
    rows, n = mask.shape
    n_seg, span = row_segments(n, block, segment)
    return torch.nn.functional.pad(mask, (0, n_seg * span - n)).view(rows, n_seg, span)


def survivor_counts_ref(logits, temp, thr, block=2048, segment=SEGMENT, cap=None) -> torch.Tensor:
    return _segment_mask(logits, temp, thr, cap, block, segment).sum(-1, dtype=torch.int32)


def survivor_list_ref(logits, temp, thr, counts, size: int, block=2048, segment=SEGMENT, cap=None, padded=False):
    mask = _segment_mask(logits, temp, thr, cap, block, segment) & (counts > 0)[..., None]
    n_rows, n = logits.shape
    listed = torch.nonzero_static(mask.view(n_rows, -1)[:, :n], size=size, fill_value=0 if padded else -1)
    rows, cols = listed.unbind(1)
    return rows, cols, tempered_ref(logits, temp, cap)[rows, cols]


def survivor_counts(logits, temp, thr, gmax, cap=None) -> torch.Tensor:
    """int32 [R, n_seg]: the survivors z >= thr[row] of z = logits / temp in each segment of each row. gmax: the
    group maxima the row-stats pass gave for these logits at this temperature (tempered_rowstats(groups=True)).
    cap: raw logits, as for every tempered pass. Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return survivor_counts_triton(logits, temp, thr, gmax, cap=cap)
    _check(logits, thr, gmax, None, 2048, SEGMENT)
    return survivor_counts_ref(logits, temp, thr, cap=cap)


def survivor_list(logits, temp, thr, gmax, counts, size: int, cap=None, padded=False) -> tuple[torch.Tensor, ...]:
    """(rows, cols) int64 [size] and their z f32 [size]: the survivors of the (row, segment)s whose entry in `counts`
    (survivor_counts', some set to 0 to leave them out) is not 0, in row-major order; `size` is the sum of `counts`,
    or with `padded` a bound it may miss either way: the list is cut at `size`, and the slots past its end hold row 0
    and column 0 (valid indices; their z is not defined).
    z is the value the passes compared: on raw logits the tempered table's entry, which has the bits of the softcap
    table's entry divided by the temperature (tempered_tables.lane_tables)."""
    if use_triton(logits):
        return survivor_list_triton(logits, temp, thr, gmax, counts, size, cap=cap, padded=padded)
    _check(logits, thr, gmax, counts, 2048, SEGMENT)
    return survivor_list_ref(logits, temp, thr, counts, size, cap=cap, padded=padded)
