"""bench/fp8_fidelity.py's pieces: its device-side q4 round trip is the codec's, and a tiny run's variants behave
(pinned routing keeps bf16's expert choice; FP8 weights and activations move the hidden state, bf16 does not)."""

from __future__ import annotations

import torch

from bench import fp8_fidelity as ff
from bench.runner import shapes
from diffgemma.quant import codecs


def test_q4_round_trip_is_the_codecs():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 16, 128, generator=gen) * torch.logspace(-3, 1, 48).view(3, 16, 1)
    w = w.to(torch.bfloat16)  # the fixtures' weights are bf16 values
    shape = tuple(w.shape)
    want = codecs.decode("q4", codecs.assemble("q4", shape, codecs.encode("q4", w)), shape)
    got = ff.q4_dequantized(w)
    # the codec rounds the group scale float64 -> float16 once; torch may round through float32 (a tie apart)
    same = (got == want).float().mean().item()
    assert same > 0.999, same
    assert torch.allclose(got, want, rtol=0, atol=1e-3 * w.float().abs().max().item())


def test_tiny_run_pins_routes_and_measures_each_variant():
    cfg, dev = shapes(True)
    out = ff.run_fixture(cfg, dev, "flat", ctx=8, seed=0, log=lambda *a: None)
    last = out["layers"][-1]
    for name in ("fp8_wa_pinned", "q4_pinned"):
        assert last[name]["route_agreement"] == 1.0
    final = out["final"]
    assert set(final) == {v.name for v in ff.VARIANTS}
    for name in ("fp8_w", "fp8_wa", "q4"):
        assert 0.5 < final[name]["logits"]["cos_mean"] < 1.0, name  # quantized: close, not equal
        assert final[name]["hidden"]["rel_err"] > 0
    # per-token activation quantization adds error to the weights' own (pinned routes: no flipped expert)
    assert final["fp8_wa_pinned"]["hidden"]["rel_err"] > 0
