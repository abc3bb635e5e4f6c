"""bench/hub_fixtures.py on CUDA: the bench converts each hub layout on the GPU (HubSource(convert_device="cuda"));
the loader converts on the host. Both must give the same bytes (for fp8, the same Fp8Weight), so the bench times
the records a user's load holds.

Skips without CUDA. The same host-made tensors converted on each device, at the tiny test's shapes and at the full
model's expert widths (H 2816, F 704: the down projection's K ends in a partial int4 group of 64); then a tiny
engine built in memory on CUDA against one loaded from the same tensors written to a checkpoint: equal logits.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma  # noqa: E402
from bench import hub_fixtures as hf  # noqa: E402
from diffgemma.config import ModelConfig  # noqa: E402
from diffgemma.quant.hub import scheme_of  # noqa: E402
from test_hub_fixtures import TEXT  # noqa: E402

WIDE = dict(TEXT, hidden_size=2816, moe_intermediate_size=704, intermediate_size=2112, vocab_size=256)


def _cfg(text):
    return ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": 8})


@pytest.mark.parametrize("text", [TEXT, WIDE], ids=["tiny", "wide"])
@pytest.mark.parametrize("layout", sorted(hf.LAYOUTS))
def test_records_converted_on_cuda_equal_the_hosts(layout, text):
    cfg = _cfg(text)
    tensors = hf.HubTensors(cfg, layout, "cpu")
    scheme = scheme_of(hf.LAYOUTS[layout][0], "config.json")
    host = hf.InMemoryHub(tensors.where, scheme, cfg, raw=tensors, convert_device="cpu")
    cuda = hf.InMemoryHub(tensors.where, scheme, cfg, raw=tensors, convert_device="cuda")
    compared = 0
    for name in sorted(host.keys()):
        kind = host.kind(name)
        if kind in ("q4", "nvfp4e"):
            got = cuda.record_tensor(name)
            assert got.is_cuda and torch.equal(got.cpu(), host.record_tensor(name)), name
        elif kind == "fp8":  # the FP8 engine's operands, made on each device
            got, want = cuda.fp8_weight(name, "cuda"), host.fp8_weight(name)
            assert torch.equal(got.weight.cpu().view(torch.uint8), want.weight.view(torch.uint8)), name
            assert torch.equal(got.scale.cpu(), want.scale), name
        else:
            continue
        compared += 1
    assert compared >= 2 * cfg.num_layers
    for name in ("model.decoder.layers.0.self_attn.q_proj.weight", "model.decoder.layers.1.mlp.down_proj.weight"):
        assert torch.equal(cuda.get(name, torch.float32).cpu(), host.get(name, torch.float32)), name


@pytest.mark.parametrize("layout", ["int4", "modelopt-nvfp4"])
def test_in_memory_engine_equals_the_loaded_checkpoints(layout, tmp_path):
    cfg = _cfg(TEXT)
    hf.write(hf.HubTensors(cfg, layout, "cuda"), tmp_path / layout)
    loaded = diffgemma.load(tmp_path / layout, device="cuda", engine="fast")
    mem, _ = hf.build(cfg, layout, "cuda")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (12,), generator=gen).cuda()
    canvas = torch.randint(0, cfg.vocab_size, (cfg.canvas_length,), generator=gen).cuda()
    out = []
    for eng in (mem, loaded):
        cache = eng.new_cache(64)
        eng.prefill(cache, prompt)
        out.append(eng.denoise(cache, canvas).float())
    assert torch.equal(out[0], out[1])
