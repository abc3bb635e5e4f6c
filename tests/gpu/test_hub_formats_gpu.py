"""The fast engine on CUDA on the published quantized checkpoints (tests/data/hub/, docs/FORMATS.md).

Skips without CUDA. For each tiny checkpoint: the engine as `diffgemma.load` builds it (bf16 activations, f16 KV,
CUDA graphs, the experts in the engine's nvfp4 / q4 records converted at load) against the f32 reference on the
weights those records hold (`_record_weights`), and the graph replay bit-equal to the
captured run.
"""

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma  # noqa: E402
from diffgemma.model.reference import ReferenceModel  # noqa: E402
from diffgemma.ops.packed_weight import PackedWeight  # noqa: E402

from diffgemma.checkpoint import expected_tensors  # noqa: E402
from diffgemma.quant import codecs  # noqa: E402

DEV = "cuda"
HUB = Path(__file__).resolve().parents[1] / "data" / "hub"
NAMES = sorted(p.name for p in HUB.iterdir() if (p / "config.json").is_file())


def _record_weights(src, cfg) -> dict:
    """What the engine holds: experts decoded from the converted records, the rest as get() gives (f32)."""
    return {n: codecs.decode(src.kind(n), src.record(n), src.shape(n)) if src.kind(n) not in ("raw", "fp8")
            else src.get(n, torch.float32) for n in expected_tensors(cfg)}


@pytest.mark.parametrize("name", NAMES)
def test_engine_on_hub_checkpoint_matches_reference_on_its_weights(name):
    path = HUB / name
    eng = diffgemma.load(path, device=DEV)
    cfg = eng.config
    gu = eng.w.layers[0].experts_gu
    if "nvfp4" in name or "int4" in name or "w4a16" in name:
        assert isinstance(gu, PackedWeight), type(gu)
    held = _record_weights(diffgemma.loader.open_source(path), cfg)
    ref = ReferenceModel(cfg, {k: v.to(DEV) for k, v in held.items()}, device=DEV, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    V, C = cfg.vocab_size, cfg.canvas_length
    stats = []
    for _ in range(4):
        prompt = torch.randint(0, V, (13,), generator=gen).to(DEV)
        canvas = torch.randint(0, V, (C,), generator=gen).to(DEV)
        rc, ec = ref.new_cache(128), eng.new_cache(128)
        ref.prefill(rc, prompt)
        eng.prefill(ec, prompt)
        e = ref.denoise(rc, canvas)
        g1 = eng.denoise(ec, canvas)
        g = eng.denoise(ec, canvas)
        assert eng.graph_error is None, eng.graph_error
        assert torch.equal(g, g1)
        stats.append(torch.nn.functional.cosine_similarity(g.float().flatten(), e.flatten(), dim=0).item())
    print(f"\n[hub {name}] cosine vs f32 reference on the same weights: {[round(c, 5) for c in stats]}")
    # bf16 activations + f16 KV against f32 (tests/gpu/test_engine_gpu.py: tiny models, median over draws)
    assert sorted(stats)[len(stats) // 2] > 0.99 and min(stats) > 0.9, stats


@pytest.mark.parametrize("name", [n for n in NAMES if "nvfp4" in n])
def test_engine_nvfp4_experts_on_the_device_are_the_librarys_values(name):
    """The published NVFP4 experts as the CUDA engine holds them (nvfp4e records), decoded by the dequantize kernel in
    f32: the library's dequantization (HubSource.get, pinned to it in tests/test_hub_formats.py) bit for bit."""
    from diffgemma.ops.moe_packed import dequantize_triton

    eng = diffgemma.load(HUB / name, device=DEV)
    src = diffgemma.loader.open_source(HUB / name)
    for i, layer in enumerate(eng.w.layers):
        for w, stack in ((layer.experts_gu, "gate_up_proj"), (layer.experts_down, "down_proj")):
            assert isinstance(w, PackedWeight) and w.fmt == "nvfp4e"
            want = src.get(f"model.decoder.layers.{i}.experts.{stack}", torch.float32).to(DEV)
            assert torch.equal(dequantize_triton(w, torch.float32), want)
            assert torch.equal(w.dequantize(), want)
