"""The oracle of the FP8 engine's tests: the reference forward on an FP8 source's dequantized weights, each GEMM
against an FP8 tensor fed its input fake-quantized per row (ops/fp8_quant.fake_quant_rows), as the engine quantizes
it per token."""

import torch

from diffgemma.model.engine_weights import fp8_by_default
from diffgemma.model.reference import ReferenceModel, matmul
from diffgemma.ops.fp8_quant import fake_quant_rows


class FakeQuantReference(ReferenceModel):
    """The reference forward whose GEMMs against the FP8 tensors (by storage) fake-quantize their input per row."""

    def __init__(self, cfg, names, source, device="cpu", quantized=fp8_by_default):
        """quantized(name): whether the engine holds that tensor in FP8 (a hub source: its kind is "fp8")."""
        w = {n: source.get(n, dtype=torch.float32, device=device) for n in names}
        super().__init__(cfg, w, device=device, dtype=torch.float32)
        self.fp8_storage = {w[n].untyped_storage().data_ptr() for n in w if quantized(n)}

    def _layer(self, layer, x, pos, attend, denoise, with_ffn=True, mm=matmul, pad=None):
        def fq_mm(a, w):
            quantized = w.untyped_storage().data_ptr() in self.fp8_storage
            return mm(fake_quant_rows(a) if quantized else a, w)

        return super()._layer(layer, x, pos, attend, denoise, with_ffn, fq_mm, pad)
