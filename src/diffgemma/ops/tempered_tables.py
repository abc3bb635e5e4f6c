"""z = logits / T as every pass over the sampler's rows forms it (ops/rowstats.py, ops/survivor_list.py).

z is a correctly rounded division (div_rn), so z, its max and its argmax are bit-identical to torch's
`logits / T`. A pass reads either f32 logits (already softcapped) and divides each value, or raw ones (bf16 or f16,
before the final softcap) and reads z from a table of 65536 f32 entries, one per 16-bit pattern: the softcap kernel's
result for that pattern (softcap_table), divided by T with the same correctly rounded division (tempered_table, made
once per step's temperature; lane_tables: one row per lane of a batched round, ops/lane_temps.py). So the values (z,
its max, argmax and the survivors) have the bits of the f32 path by construction, a pass does one cached load a value
instead of the softcap's two divisions and an exp and z's division, and no f32 [R, V] tensor exists (at full size the
softcap pass writes 256 MiB a step; the passes then read half the bytes). On the GPU the row sums (entropy, lse) may
round differently from the f32 input's: the compiler lays a 16-bit load out differently, and so orders the sums.

Here: the tables, the kernels that divide them, z_args (what a pass reads and how it forms z), the jitted readers
(tempered_z, lane_of_row) the passes' kernels call, and tempered_ref, the twins' z.
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, interpreting, use_triton
from .lane_temps import LaneTemps
from .rows_at import kernel_args
from .softcap import softcap_ref, softcap_rowstats_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

_TABLES: dict = {}
_TEMPERED: dict = {}


def _table_key(cap: float, raw: torch.Tensor) -> tuple:
    """(cap, dtype, device, whether the passes over `raw` run as kernels): what a table is kept by."""
    return float(cap), raw.dtype, raw.device, interpreting() or use_triton(raw)


def softcap_table(cap: float, raw: torch.Tensor) -> torch.Tensor:
    """f32 [65536] on raw's device: softcap(v, cap) for the value v of every bit pattern of raw's 16-bit dtype
    (index = bits as uint16), computed once by the softcap kernel where the passes over `raw` run as kernels (on
    CUDA, or interpreted), else by its twin: a lookup has the bits the softcap of that value has there."""
    if raw.dtype not in (torch.bfloat16, torch.float16):
        raise TensorError(f"softcap table: raw logits must be bfloat16 or float16, got {raw.dtype}")
    key = _table_key(cap, raw)
    table = _TABLES.get(key)
    if table is None:
        # pattern i at index i: the int16 of i - 65536 for the upper half (a cast of i itself need not wrap: CUDA's
        # saturates)
        i = torch.arange(1 << 16, dtype=torch.int32, device=raw.device)
        bits = torch.where(i >= 1 << 15, i - (1 << 16), i).to(torch.int16).view(raw.dtype).reshape(1, -1)
        if key[3]:  # the kernel's bits, on the GPU or interpreted (the tests compare the passes with it)
            table = softcap_rowstats_triton(bits, cap, 1.0, stats=False)[0]
        else:
            table = softcap_ref(bits, cap)
        table = _TABLES[key] = table.reshape(-1)
    return table


def divide_table(table: torch.Tensor, temp: float, kernel: bool) -> torch.Tensor:
    """table / temp (a 65536-entry table) as a new f32 tensor, each entry correctly rounded: the passes' division as a
    kernel (kernel), or torch's (the same bits)."""
    if not kernel:
        return table / torch.full((), temp, dtype=torch.float32, device=table.device)
    out = torch.empty_like(table)
    _tempered_table_kernel[(table.numel() // 1024,)](table, out, float(temp), BLOCK=1024, num_warps=4)
    return out


def tempered_table(cap: float, temp: float, raw: torch.Tensor) -> torch.Tensor:
    """f32 [65536]: softcap_table(cap, raw) / temp, each entry the correctly rounded quotient the passes would form
    (a kernel where they run as kernels, torch's division elsewhere: the same bits). The last temperature's table is
    kept per (cap, dtype, device): a generate step builds it once (a 65536-entry kernel) for all its passes."""
    key = _table_key(cap, raw)
    kept = _TEMPERED.get(key)
    if kept is None or kept[0] != float(temp):
        kept = _TEMPERED[key] = (float(temp), divide_table(softcap_table(cap, raw), temp, key[3]))
    return kept[1]


def lane_tables(cap: float, lanes: LaneTemps, raw: torch.Tensor) -> torch.Tensor:
    """f32 [B, 65536]: row b = softcap_table(cap, raw) / lanes.temps_dev[b] (lanes in row order), each entry the bits
    tempered_table(cap, that temperature, raw) has (the same correctly rounded division), in one launch. Kept on
    `lanes` per (cap, dtype, device): a step's passes over its lanes build them once."""
    key = _table_key(cap, raw)
    out = lanes.tables.get(key)
    if out is None:
        table = softcap_table(cap, raw)
        if key[3]:
            out = torch.empty(len(lanes), table.numel(), dtype=torch.float32, device=table.device)
            _lane_tables_kernel[(table.numel() // 1024, len(lanes))](table, out, lanes.temps_dev, BLOCK=1024,
                                                                      num_warps=4)
        else:
            out = table[None, :] / lanes.temps_dev[:, None]
        lanes.tables[key] = out
    return out


def softcap_lookup(raw: torch.Tensor, cap: float) -> torch.Tensor:
    """softcap(raw, cap) through the table, for a few values (a gather's): f32, raw's shape."""
    table = softcap_table(cap, raw)
    return table[raw.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF]


def tempered_ref(logits, temp, cap):
    """The twins' z = logits / temp in f32 (correctly rounded), the logits softcapped first when cap is given (raw).
    temp: a number, or a LaneTemps (each row divided by its lane's temperature: the same quotients)."""
    x = logits if cap is None else softcap_ref(logits, cap)
    if isinstance(temp, LaneTemps):
        return x.float() / temp.row_temps()[:, None]
    return x.float() / torch.full((), temp, dtype=torch.float32, device=logits.device)


if HAVE_TRITON:

    @triton.jit
    def _tempered_table_kernel(t_ptr, z_ptr, temp, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(z_ptr + i, tl.math.div_rn(tl.load(t_ptr + i), temp))

    @triton.jit
    def _lane_tables_kernel(t_ptr, z_ptr, temps_ptr, BLOCK: tl.constexpr):
        """Table row b = the softcap table divided by lane b's temperature (each entry as _tempered_table_kernel's)."""
        lane = tl.program_id(1).to(tl.int64)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(z_ptr + lane * 65536 + i, tl.math.div_rn(tl.load(t_ptr + i), tl.load(temps_ptr + lane)))

    @triton.jit
    def lane_of_row(row, lane_ptr, temps_ptr, table_ptr, temp, LANES: tl.constexpr):
        """(temp, table) of `row`: the pass's own (LANES off), else its lane's (ops/lane_temps.py) temperature and
        tempered table (row lane of the [B, 65536] tables)."""
        if LANES:
            lane = tl.load(lane_ptr + row).to(tl.int64)
            return tl.load(temps_ptr + lane), table_ptr + lane * 65536
        return temp, table_ptr

    @triton.jit
    def tempered_z(ptrs, mask, table_ptr, temp, TABLE: tl.constexpr, DIV: tl.constexpr, WHOLE: tl.constexpr = False):
        """z = logits / temp at ptrs (WHOLE: every one inside, mask unused). TABLE: ptrs hold raw logits' 16-bit
        patterns, and z is their entry in the tempered table; else the f32 logits' correctly rounded quotient (DIV
        off when temp is 1: x / 1 is x)."""
        if TABLE:
            if WHOLE:
                bits = tl.load(ptrs).to(tl.int32) & 0xFFFF
            else:
                bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
            return tl.load(table_ptr + bits)  # a pattern's entry; a row's values share a few cached lines
        if WHOLE:
            x = tl.load(ptrs).to(tl.float32)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if DIV:
            x = tl.math.div_rn(x, temp)
        return x


def z_args(logits, cap, temp) -> dict:
    """What a pass reads and how it forms z (tempered_z): f32 logits (a tensor or a RowsAt) with their own buffer as an
    unread placeholder table, or raw logits' bits as int16 and their tempered table. temp: a number, or a LaneTemps (a
    temperature per lane of rows, and one table per lane: row lane of lane_tables)."""
    lanes = isinstance(temp, LaneTemps)
    if lanes and temp.rows != logits.shape[0]:
        raise TensorError(f"tempered rows: LaneTemps covers {temp.rows} rows, the logits have {logits.shape[0]}")
    placeholder = kernel_args(logits)[0]
    args = dict(lane=temp.row_lane if lanes else placeholder, temps=temp.temps_dev if lanes else placeholder,
                LANES=lanes, temp=1.0 if lanes else float(temp))
    if cap is None:
        return dict(args, x=logits, table=placeholder, TABLE=False, DIV=lanes or float(temp) != 1.0)
    table = lane_tables(cap, temp, logits) if lanes else tempered_table(cap, temp, logits)
    return dict(args, x=logits.view(torch.int16), table=table, TABLE=True, DIV=False)
