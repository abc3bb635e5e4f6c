"""The benchmarks' balanced-routing switch (bench/balanced_routing.py): it must give every expert the same
number of rows, really reach the engine's router (else the bench would time the random model's routing and
say otherwise), and put the model's router back afterwards."""

import pytest
import torch

import diffgemma.model.forward as forward_module
from bench import balanced_routing
from bench.fixtures import RandomSource
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine


@pytest.mark.parametrize("T,k,E", [(256, 8, 128), (37, 3, 8), (5, 2, 6)])
def test_balanced_ids_are_distinct_per_row_and_even_per_expert(T, k, E):
    ids = balanced_routing.balanced_ids(T, k, E, "cpu")
    assert ids.shape == (T, k) and all(len(set(row.tolist())) == k for row in ids)
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert counts.max() - counts.min() <= 1


def test_routing_switch_reaches_the_engine_and_restores_it():
    tc = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"], num_experts=8, top_k_experts=2,
              moe_intermediate_size=16, model_type="diffusion_gemma_text")
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": tc, "canvas_length": 8})
    seed = int(torch.randint(0, 2**31, (1,)))
    eng = build_engine(cfg, RandomSource(cfg, "cpu", torch.float32, seed=seed, std=0.2), "cpu", torch.float32)
    cache = eng.new_cache(32)
    eng.prefill(cache, torch.randint(0, 64, (6,)))
    canvas = torch.randint(0, 64, (8,))
    seen = []
    inner = balanced_routing.balanced_route

    def spy(*a, **kw):
        out = inner(*a, **kw)
        seen.append(out[1])
        return out

    balanced_routing.balanced_route = spy
    try:
        with balanced_routing.routing("balanced"):
            balanced = eng.denoise(cache, canvas)
    finally:
        balanced_routing.balanced_route = inner
    assert forward_module.route_fused is balanced_routing.MODEL_ROUTE
    assert len(seen) == 2 and all(torch.equal(e, balanced_routing.balanced_ids(8, 2, 8, "cpu")) for e in seen)
    with balanced_routing.routing("model"):
        model = eng.denoise(cache, canvas)
    assert torch.equal(model, eng.denoise(cache, canvas))
    assert not torch.allclose(model, balanced)  # other experts were used: the switch changed the math
    with pytest.raises(ValueError, match="routing"):
        with balanced_routing.routing("random"):
            pass
