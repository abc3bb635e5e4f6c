"""bench/hub_fixtures.py: a hub layout built in memory gives the engine exactly what loading the same tensors from a
checkpoint directory gives (the bench times full-size engines this way instead of writing 15-27 GB files).

Tiny shapes on the CPU: the down projection's K (160) ends in a partial int4 group of 128, as the full model's 704
does, and the dense MLP's (96) is shorter than a group.
"""

import pytest
import torch

import diffgemma
from bench import hub_fixtures as hf
from diffgemma.checkpoint import expected_tensors
from diffgemma.config import ModelConfig
from diffgemma.model.engine_weights import load_weights, upload_record
from diffgemma.ops.fp8_weight import Fp8Weight
from diffgemma.quant import codecs
from diffgemma.quant.hub import detect
from diffgemma.quant.hub_source import HubSource

S, FULL = "sliding_attention", "full_attention"
TEXT = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, global_head_dim=64, num_global_key_value_heads=1, sliding_window=6,
            num_experts=4, top_k_experts=2, moe_intermediate_size=160, final_logit_softcapping=30.0,
            layer_types=[S, FULL], max_position_embeddings=4096)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": 8})


@pytest.fixture(scope="module", params=sorted(hf.LAYOUTS))
def pair(request, cfg, tmp_path_factory):
    """(layout, the in-memory HubSource, the loader's source over the same tensors written to a directory)."""
    layout = request.param
    directory = tmp_path_factory.mktemp("hub") / layout
    hf.write(hf.HubTensors(cfg, layout), directory, shard_bytes=200_000)  # several shards
    loaded = diffgemma.loader.open_source(directory)
    assert isinstance(loaded, HubSource) and detect(directory) == loaded.scheme
    return layout, hf.hub_source(cfg, layout), loaded


def _same(a, b) -> bool:
    same_bytes = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.dtype == b.dtype and a.shape == b.shape and same_bytes


def test_written_checkpoint_holds_the_layouts_tensors(pair):
    layout, mem, loaded = pair
    assert mem.scheme == loaded.scheme
    raw = loaded.raw.source
    assert raw.keys() == mem.raw.source.keys()
    for name in sorted(raw.keys()):
        assert _same(raw.get(name), mem.raw.source.get(name)), name


def test_in_memory_records_and_tensors_equal_the_loaded_checkpoints(pair, cfg):
    """Every tensor the forward reads: the same kind, shape and bytes (records of the expert stacks; dequantized
    float32 of the rest)."""
    layout, mem, loaded = pair
    assert mem.keys() == loaded.keys()
    kinds = set()
    for name in expected_tensors(cfg):
        kind = loaded.kind(name)
        kinds.add(kind)
        assert mem.kind(name) == kind and mem.shape(name) == loaded.shape(name), name
        if kind == "fp8":
            a, b = mem.fp8_weight(name), loaded.fp8_weight(name)
            assert _same(a.weight, b.weight) and _same(a.scale, b.scale), name
        if kind in ("q4", "nvfp4e"):
            got = upload_record(mem, name, "cpu")  # the engine's own upload: record_tensor (in memory)
            want = upload_record(loaded, name, "cpu")  # ... and record (from the files)
            assert _same(got, want), name
        else:
            assert _same(mem.get(name, torch.float32), loaded.get(name, torch.float32)), name
    assert kinds == {"raw", {"nvfp4": "nvfp4e", "modelopt-nvfp4": "nvfp4e", "fp8": "fp8"}.get(layout, "q4")}
    assert not [n for n in mem.notes if "rounded" in n]  # gate and up share each expert's scale: exact


def test_engine_weights_equal(pair, cfg):
    """The fast engine's weights loaded from either source, tensor for tensor."""
    layout, mem, loaded = pair
    a, b = load_weights(cfg, mem, "cpu", torch.bfloat16), load_weights(cfg, loaded, "cpu", torch.bfloat16)

    def flat(x):
        if isinstance(x, Fp8Weight):
            return [x.weight, x.scale]
        if isinstance(x, dict):
            return [v for k in sorted(x) for v in flat(x[k])]
        if isinstance(x, (list, tuple)):
            return [v for item in x for v in flat(item)]
        if hasattr(x, "__dataclass_fields__"):
            return flat({k: getattr(x, k) for k in x.__dataclass_fields__})
        return [x]

    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb) and any(isinstance(x, torch.Tensor) for x in fa)
    for x, y in zip(fa, fb):
        assert (_same(x, y) if isinstance(x, torch.Tensor) else x == y)


def test_weights_have_the_std_asked_for(cfg):
    """The scales make weights of std ~0.02 in every layout (so activations stay O(1) at full size)."""
    for layout in hf.LAYOUTS:
        src = hf.hub_source(cfg, layout)
        for name in ("model.decoder.layers.0.experts.gate_up_proj", "model.decoder.layers.1.experts.down_proj"):
            kind = src.kind(name)
            w = src.get(name) if kind == "fp8" else codecs.decode(kind, src.record(name), src.shape(name))
            assert 0.014 < float(w.std()) < 0.028, (layout, name, float(w.std()))


def test_unknown_layout_is_refused(cfg):
    with pytest.raises(ValueError, match="layout 'gguf'"):
        hf.HubTensors(cfg, "gguf")
