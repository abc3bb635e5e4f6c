"""The oracle of the FP8 engine's tests: the reference forward on an FP8 source's dequantized weights, each GEMM
against an FP8 tensor fed its input fake-quantized per row (ops/fp8_quant.fake_quant_rows), as the engine quantizes
it per token.

Per-token FP8 is a step function: a value on an e4m3 rounding boundary goes to either neighbour on a last-bit
difference, and the engine's f32 sums run in other orders than the reference's. Given the rows the engine quantized
(EngineQuantInputs, recorded on the CPU), the reference quantizes, in place of each row of its own, the engine's row
that equals it within SNAP_RTOL: both sides round the same values, so the two forwards differ by f32 re-association
alone, while the quantization (scale, rounding, per row) stays the oracle's own, and EngineQuantInputs.unmet() counts
the engine's rows that equal none of the reference's (a pre-quantization value off by more than SNAP_RTOL).
"""

import contextlib
import sys

import torch

from diffgemma.model.engine_weights import fp8_by_default
from diffgemma.model.reference import ReferenceModel, matmul
from diffgemma.ops import fp8_quant
from diffgemma.ops.fp8_quant import fake_quant_rows

# A row is the engine's where every value is within this fraction of the row's max |value|: above the f32
# re-association between the two forwards (a few 1e-6 of it on the tiny models), far below the distance to any other
# row they quantize (1e-2 of it and more) and to the next e4m3 value near the max (32/448 of it).
SNAP_RTOL = 1e-5


class EngineQuantInputs:
    """The rows an engine on the CPU quantizes per token (float32, by width), recorded while `recording()` is open.
    Off CUDA every FP8 operand the engine makes comes from ops/fp8_quant.quantize_rows_ref (the dispatchers' twin,
    the norms' and the expert FFN's), so that function is wrapped wherever a diffgemma module holds it.
    `snap` puts in place of a reference row the recorded row that equals it within SNAP_RTOL and marks every recorded
    row so equal as met: `unmet()` counts the engine's rows that equal no row the reference quantized."""

    def __init__(self):
        self.rows: dict[int, torch.Tensor] = {}
        self.met: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.rows)

    @contextlib.contextmanager
    def recording(self):
        quantize, seen = fp8_quant.quantize_rows_ref, {}

        def record(x):
            seen.setdefault(x.shape[-1], []).append(x.detach().float().clone())
            return quantize(x)

        holders = [(m, attr) for name, m in list(sys.modules.items()) if name.split(".")[0] == "diffgemma"
                   for attr, value in list(vars(m).items()) if value is quantize]
        for m, attr in holders:
            setattr(m, attr, record)
        try:
            yield self
        finally:
            for m, attr in holders:
                setattr(m, attr, quantize)
            for K, parts in seen.items():
                self.rows[K] = torch.cat([self.rows[K], *parts]) if K in self.rows else torch.cat(parts)
                self.met[K] = torch.zeros(len(self.rows[K]), dtype=torch.bool)

    def snap(self, a: torch.Tensor) -> torch.Tensor:
        """a [M, K] float32 with each row replaced by the nearest recorded row of width K within SNAP_RTOL of it (every
        value within SNAP_RTOL times the row's max |value|), where there is one."""
        theirs = self.rows.get(a.shape[-1])
        if theirs is None or not len(a):
            return a
        dist = (a[:, None, :] - theirs[None].to(a.device)).abs().amax(-1)
        close = dist <= SNAP_RTOL * a.abs().amax(-1, keepdim=True)
        self.met[a.shape[-1]] |= close.any(0).cpu()
        nearest = dist.argmin(-1)
        return torch.where(close.any(-1, keepdim=True), theirs.to(a.device)[nearest], a)

    def unmet(self) -> int:
        return sum(int((~m).sum()) for m in self.met.values())


class FakeQuantReference(ReferenceModel):
    """The reference forward whose GEMMs against the FP8 tensors (by storage) fake-quantize their input per row.
    engine_rows: an EngineQuantInputs; each input row is quantized as the engine's row it equals within SNAP_RTOL
    (EngineQuantInputs.snap), any other row as its own."""

    def __init__(self, cfg, names, source, device="cpu", quantized=fp8_by_default, engine_rows=None):
        """quantized(name): whether the engine holds that tensor in FP8 (a hub source: its kind is "fp8")."""
        w = {n: source.get(n, dtype=torch.float32, device=device) for n in names}
        super().__init__(cfg, w, device=device, dtype=torch.float32)
        self.fp8_storage = {w[n].untyped_storage().data_ptr() for n in w if quantized(n)}
        self.engine_rows = engine_rows

    def _layer(self, layer, x, pos, attend, denoise, with_ffn=True, mm=matmul, pad=None):
        def fq_mm(a, w):
            if w.untyped_storage().data_ptr() not in self.fp8_storage:
                return mm(a, w)
            a = a.float() if self.engine_rows is None else self.engine_rows.snap(a.float())
            return mm(fake_quant_rows(a), w)

        return super()._layer(layer, x, pos, attend, denoise, with_ffn, fq_mm, pad)
