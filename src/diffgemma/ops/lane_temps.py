"""A temperature per lane of a batch's sampler rows, so one launch of each row pass serves every lane.

A batched round's logits are the lanes' [C_i, V] row blocks. The row passes (ops/rowstats.py) run over one
[R, V] tensor of rows; `LaneTemps` says which lane each row belongs to and each lane's temperature, and a pass
given one divides row r by temps[lane[r]] (on raw logits: reads z from lane[r]'s tempered table). Every program
still reads one (row, segment) whose span depends only on the vocabulary, so a lane's numbers are the ones the
same pass gives that lane alone.

  LaneTemps      lane of each row and temperature of each lane, on the rows' device
  shared_rows    the one [R, V] tensor the lanes' row blocks lie in, and where each starts (or None)
"""

from __future__ import annotations

import torch

from ..errors import TensorError


def host_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device`, copied without waiting for the device (pinned, non-blocking) on CUDA."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


_ROW_LANES: dict = {}  # (blocks, rows, device) -> int32 [R]: a round's layout recurs step after step
# layouts kept (never dropped: a kept tensor may be read by work still queued); past this many, made anew each time
_ROW_LANES_KEPT = 256


def _row_lanes(blocks: tuple, rows: int, device) -> torch.Tensor:
    """int32 [rows]: block k's rows (blocks: (first row, length) in row order) hold k, the rows before the first 0."""
    key = (blocks, rows, str(device))
    lane = _ROW_LANES.get(key)
    if lane is None:
        host = torch.zeros(rows, dtype=torch.int32)
        for k, (a, n) in enumerate(blocks):
            host[a: a + n] = k
        lane = host_to_device(host, device)
        if len(_ROW_LANES) < _ROW_LANES_KEPT:
            _ROW_LANES[key] = lane
    return lane


class LaneTemps:
    """Lanes of rows with a temperature each: lane i holds rows starts[i] .. starts[i] + lengths[i] of an [R, V]
    tensor and divides them by temps[i]. Rows in no lane (a gap between lanes' blocks) count as a neighbour's; their
    results are computed and never read.

      temps       host floats, one per lane (what the solo pass would get as `temp`), in the caller's lane order
      temps_dev   f32 [B] on the device, in row order (the lanes sorted by first row): each the f32 rounding of a
                  lane's temperature, as a pass's scalar argument is; row_order_temps: the same as host floats
      row_lane    int32 [R] on the device: each row's index into temps_dev (and into lane_tables' rows), so one
                  tensor serves a layout whatever the order the caller lists its lanes in
      tables      the lanes' tempered tables, made once by the first pass over raw logits that asks
    """

    def __init__(self, temps, starts, lengths, rows: int, device):
        temps, starts, lengths = [float(t) for t in temps], [int(a) for a in starts], [int(n) for n in lengths]
        if not (len(temps) == len(starts) == len(lengths)) or not temps:
            raise TensorError(f"LaneTemps: expected one temperature, first row and length per lane, got "
                              f"{len(temps)} / {len(starts)} / {len(lengths)}")
        if any(not t > 0 for t in temps):
            raise TensorError(f"LaneTemps: temperatures must be positive, got {temps}")
        if any(a < 0 or n < 0 or a + n > rows for a, n in zip(starts, lengths)):
            raise TensorError(f"LaneTemps: lanes (first row, length) {list(zip(starts, lengths))} must lie within "
                              f"{rows} rows")
        self.temps, self.starts, self.lengths, self.rows = temps, starts, lengths, rows
        self.device = torch.device(device)
        order = sorted(range(len(temps)), key=lambda i: starts[i])
        self.row_order_temps = tuple(temps[i] for i in order)
        if len(temps) == 1:  # a fill, nothing to copy
            self.temps_dev = torch.full((1,), temps[0], dtype=torch.float32, device=device)
        else:
            self.temps_dev = host_to_device(torch.tensor(self.row_order_temps, dtype=torch.float32), device)
        self.row_lane = _row_lanes(tuple((starts[i], lengths[i]) for i in order), rows, device)
        self.tables: dict = {}  # ops/tempered_tables.lane_tables' tables of these lanes, by (cap, dtype, device)

    @classmethod
    def one(cls, temp: float, rows: int, device) -> "LaneTemps":
        """All `rows` rows in one lane."""
        return cls([temp], [0], [rows], rows, device)

    def __len__(self) -> int:
        return len(self.temps)

    def spans(self) -> list[slice]:
        """Each lane's rows as a slice of the [R, ...] results."""
        return [slice(a, a + n) for a, n in zip(self.starts, self.lengths)]

    def row_temps(self) -> torch.Tensor:
        """f32 [R]: the temperature of each row."""
        return self.temps_dev[self.row_lane.long()]


def shared_rows(lanes: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """(rows, starts): when the lanes' [C_i, V] rows are disjoint row blocks of one contiguous buffer (a batched
    forward's split), `rows` is the part of that buffer from the first lane's first row to the last lane's last row
    (no copy) and starts[i] the row lane i starts at; else None (a copy of all the lanes would cost more than the
    launches it saves)."""
    if not lanes:
        raise TensorError("shared_rows: expected at least one lane")
    V = lanes[0].shape[-1]
    if any(x.dim() != 2 or x.shape[1] != V or x.dtype != lanes[0].dtype or x.device != lanes[0].device
           for x in lanes):
        raise TensorError("shared_rows: lanes must be 2-D [C_i, V] of one V, dtype and device, got "
                          + ", ".join(f"{x.dtype} {list(x.shape)} on {x.device}" for x in lanes))
    storage = lanes[0].untyped_storage().data_ptr()
    one_buffer = all(x.is_contiguous() and x.untyped_storage().data_ptr() == storage for x in lanes)
    if one_buffer and V > 0:
        offs = [x.storage_offset() for x in lanes]
        base = min(offs)
        if all((o - base) % V == 0 for o in offs):
            starts = [(o - base) // V for o in offs]
            blocks = sorted((a, a + x.shape[0]) for a, x in zip(starts, lanes))
            if all(b[1] <= c[0] for b, c in zip(blocks, blocks[1:])):  # disjoint
                rows = max(end for _, end in blocks)
                first = lanes[offs.index(base)]
                return first.as_strided((rows, V), (V, 1), base), starts
    return None
