"""Per-row statistics of tempered logits: entropy (nats), argmax, max probability.

Entropy is computed from the normalised log-probabilities as -sum(p * log p), with log p clamped at
the dtype's most negative finite value so a zero-probability token contributes 0 rather than NaN
(the same arithmetic as torch.distributions.Categorical, which the hf semantics must match bit for
bit because the accept mask sorts on it).
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ..ops._backend import use_triton
from ..ops.lane_temps import LaneTemps, shared_rows
from ..ops.rowstats import tempered_rowstats
from ..ops.softcap import softcap
from ..ops.tempered_tables import softcap_lookup


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits - logits.logsumexp(dim=-1, keepdim=True)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) per row: [..., V] -> [...]."""
    logp = log_probs(logits)
    probs = torch.softmax(logp, dim=-1)
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp * probs).sum(dim=-1)


def max_prob(logits: torch.Tensor) -> torch.Tensor:
    """p_max per row of softmax(logits): [..., V] -> [...]."""
    return torch.exp(logits.max(dim=-1).values - logits.logsumexp(dim=-1))


def with_groups(logits: torch.Tensor, cap: float | None) -> bool:
    """Whether a row pass also stores its group maxima (the batched survivor passes' input, ops/survivor_list.py):
    for the engine's raw bfloat16 logits (softcapped as read), the form whose stats keep the plain pass's bits on the
    GPU (tests/gpu/test_survivor_list_gpu.py); other logits take the plain pass, and their batched plans the solo
    survivor mask."""
    return cap is not None and logits.dtype == torch.bfloat16


class LaneRows:
    """What a batch's StepStats share: `rows` [R, V] (every lane's logits in one tensor, raw while `cap` is set),
    `lanes` (ops/lane_temps.LaneTemps: which rows are whose, and their temperatures), `fields` (entropy, argmax, rowmax,
    lse of all R rows; each lane's are views of them), `groups` (the row pass's group maxima of all rows, which the
    sparse SC's survivor passes read: ops/survivor_list.py). `whole`: every row is some lane's (no gap rows)."""

    def __init__(self, rows: torch.Tensor, lanes: LaneTemps, cap: float | None, passed: tuple):
        self.rows, self.lanes, self.cap = rows, lanes, cap
        self.fields, self.groups = passed[:4], passed[4] if len(passed) > 4 else None
        self.whole = sum(lanes.lengths) == rows.shape[0]


class StepStats:
    """Row stats of one step's tempered logits z = logits / T, computed once and shared by the accept mask,
    the stop rules, the trim and self-conditioning.

    Two ways to get them, same fields:
    - torch (CPU, and anywhere Triton is off): z is materialised and entropy / argmax use the functions
      above, so the CPU path is bit-identical to the loop before fusion (the golden fixture pins it).
    - fused (CUDA + Triton, f32 logits): one kernel read of the logits gives entropy, argmax, row max and
      logsumexp (ops/rowstats.py); z exists only if someone asks for `processed` (exact SC, sampling).
      z, its max and argmax are bit-identical to the torch path; entropy and lse differ by float rounding.

    cap: `logits` are the raw ones before the final softcap (the engine's `denoise_raw`). The fused kernels then
    softcap them as they read (ops/tempered_tables.py; the bits of softcap(logits, cap)), and the step never holds the
    f32 [C, V] logits; the torch path softcaps them here first. `cap` stays set only while `logits` are raw.

    `StepStats.batch` makes every lane's stats of a batched round at once (one launch of the row pass for all lanes);
    a solo StepStats is the batch of its one lane, so each lane's fields are the bits it has alone.
    """

    def __init__(self, logits: torch.Tensor, temp: float, fused: bool | None = None, cap: float | None = None):
        self._setup(logits, temp, fused, cap)
        self._rowstats()

    def _rowstats(self) -> None:
        """entropy, argmax (and on the fused path rowmax, lse) of this lane alone."""
        if self.fused:
            lanes = LaneTemps.one(self.temp, self.logits.shape[0], self.logits.device)
            # the pass as a batch's (with group maxima where it makes them): one compiled form a lane alone or batched
            self.entropy, self.argmax, self.rowmax, self.lse = tempered_rowstats(
                self.logits, lanes, cap=self.cap, groups=with_groups(self.logits, self.cap))[:4]
        else:
            z = self.processed
            self.entropy = entropy(z)
            self.argmax = z.argmax(dim=-1)
            self.rowmax = self.lse = None

    def _setup(self, logits: torch.Tensor, temp: float, fused: bool | None, cap: float | None) -> None:
        """Everything but the row stats: which path, and the logits it reads (softcapped here off the fused path)."""
        if logits.dim() != 2:
            raise TensorError(f"StepStats: logits must be [C, V], got {list(logits.shape)}")
        self.temp = temp
        self._temp = None
        self._processed: torch.Tensor | None = None
        if fused is None:
            fused = use_triton(logits) and (logits.dtype == torch.float32 or cap is not None)
        if cap is not None and not (fused and logits.dtype in (torch.bfloat16, torch.float16)):
            logits, cap = softcap(logits, cap), None  # the torch path, or raw logits wider than the passes' table
        self.logits, self.cap = logits, cap
        self.fused = fused
        self.shared: LaneRows | None = None  # set by `batch`: the rows this lane shares with the others
        self.lane: int | None = None  # set by `batch`: this lane's index in shared.lanes

    @classmethod
    def batch(cls, logits, temps, cap: float | None = None, fused: bool | None = None) -> list["StepStats"]:
        """Every lane's StepStats of a batched round: lane i's logits are logits[i] (a [B, C, V] tensor, or a list of
        B [C_i, V] tensors of one V, dtype and device, e.g. the views a batched forward returns) at temperature
        temps[i]; cap as for one lane (the same for all: the model's).

        Exactness: every field of lane i (entropy, argmax, rowmax, lse, and what is derived from them: processed,
        max_prob, softcapped) has the bits of StepStats(logits[i], temps[i], fused, cap). On the fused path one
        launch of each row kernel serves all lanes (ops/lane_temps.py: the row pass with a temperature per lane, its
        programs one (row, segment) each, the same as a lane alone) when the lanes are disjoint row blocks of one
        buffer (a batched forward's output), read in place; other lanes, and the torch path, go lane by lane. The
        lanes' row stats are then views of one [R] result per field."""
        lanes = list(logits.unbind(0)) if isinstance(logits, torch.Tensor) and logits.dim() == 3 else list(logits)
        temps = [float(t) for t in temps]
        if not lanes or len(temps) != len(lanes):
            raise TensorError(f"StepStats.batch: expected one temperature per lane, got {len(temps)} for "
                              f"{len(lanes)} lanes")
        if any(x.dim() != 2 for x in lanes):
            raise TensorError("StepStats.batch: logits must be [B, C, V] or a list of [C, V] tensors, got "
                              + ", ".join(str(list(x.shape)) for x in lanes))
        out = [cls.__new__(cls) for _ in lanes]
        for s, x, t in zip(out, lanes, temps):
            s._setup(x, t, fused, cap)
        one = shared_rows([s.logits for s in out]) if all(s.fused for s in out) and len({s.cap for s in out}) == 1 \
            else None
        if one is None:  # lane by lane, each set up once
            for s in out:
                s._rowstats()
            return out
        rows, starts = one
        lane_temps = LaneTemps(temps, starts, [s.logits.shape[0] for s in out], rows.shape[0], rows.device)
        shared = LaneRows(rows, lane_temps, out[0].cap, tempered_rowstats(rows, lane_temps, cap=out[0].cap,
                                                                          groups=with_groups(rows, out[0].cap)))
        for i, (s, sl) in enumerate(zip(out, lane_temps.spans())):
            s.entropy, s.argmax, s.rowmax, s.lse = (f[sl] for f in shared.fields)
            s.shared, s.lane = shared, i
        return out

    @staticmethod
    def processed_batch(stats: list["StepStats"]) -> list[torch.Tensor]:
        """[s.processed for s in stats] (lanes that sample, or self-condition exactly, read it), the same bits: where
        `stats` are all the lanes of one StepStats.batch, one softcap (raw logits) and one division by each row's
        lane temperature over their shared rows (elementwise: each value is the one its lane alone makes)."""
        shared = stats[0].shared if stats else None
        if (shared is None or len(stats) != len(shared.lanes) or any(s.shared is not shared for s in stats)
                or any(s._processed is not None for s in stats)):
            return [s.processed for s in stats]
        rows = shared.rows if shared.cap is None else softcap(shared.rows, shared.cap)
        z = rows / shared.lanes.row_temps()[:, None]
        for s, sl in zip(stats, shared.lanes.spans()):
            s._processed = z[sl]
        return [s.processed for s in stats]

    def temp_tensor(self) -> torch.Tensor:
        """T as an f32 device scalar (a fill, not a copy), made when a division by it is first asked for (on the
        stream current then): the fused passes take T as a number, so a fused step launches nothing for it."""
        if self._temp is None:
            self._temp = torch.full((), self.temp, dtype=torch.float32, device=self.logits.device)
        return self._temp

    @property
    def processed(self) -> torch.Tensor:
        """logits / T (materialised on first use)."""
        if self._processed is None:  # raw logits: softcapped by the kernel that made the fused passes' table
            logits = self.logits if self.cap is None else softcap(self.logits, self.cap)
            self._processed = logits / self.temp_tensor()
        return self._processed

    def softcapped(self, values: torch.Tensor) -> torch.Tensor:
        """f32 logits from a few values gathered out of `self.logits`: those values, or with raw logits their softcap
        through the fused passes' table (the bits those passes read)."""
        return values if self.cap is None else softcap_lookup(values, self.cap)

    def max_prob(self) -> torch.Tensor:
        if self.fused:
            return torch.exp(self.rowmax - self.lse)
        return max_prob(self.processed)
