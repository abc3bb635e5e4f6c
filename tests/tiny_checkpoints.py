"""Tiny random DiffusionGemma checkpoints written by transformers, for parity and loading tests.

Weights are random with non-trivial norms and scales (norm weights, router scale, per-expert
scale and both layer_scalars drawn away from 1) so that a forward that forgets one of them fails.
"""

from __future__ import annotations

import torch

# A tiny vision tower: the default one is 650 MB and the text forward never reads it.
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=16)

S, FULL = "sliding_attention", "full_attention"

# Configs differ in GQA ratio, sliding vs global head_dim, layer pattern and experts/top-k.
CONFIGS = {
    "gqa2_mixed": dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                       sliding_window=5, layer_types=[S, FULL, S, FULL], num_experts=4, top_k_experts=2,
                       moe_intermediate_size=8),
    "mha_realsplit": dict(vocab_size=80, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                          sliding_window=7, layer_types=[S, S, FULL], num_experts=6, top_k_experts=3,
                          moe_intermediate_size=12),
    "gqa4_samehd": dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=4, global_head_dim=8, num_global_key_value_heads=2,
                        sliding_window=3, layer_types=[FULL, S, FULL], num_experts=8, top_k_experts=1,
                        moe_intermediate_size=4),
}

# Mid-size: the real model's head-dim ratio, RoPE kinds and a 6-layer pattern at GPU-test scale.
MID = dict(vocab_size=8192, hidden_size=512, intermediate_size=384, num_hidden_layers=6, num_attention_heads=8,
           num_key_value_heads=4, head_dim=128, global_head_dim=256, num_global_key_value_heads=2, sliding_window=128,
           layer_types=[S, S, FULL, S, S, FULL], num_experts=32, top_k_experts=4, moe_intermediate_size=128,
           rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})

# Dimensions chosen so every pack profile applies: K multiples of 32 for the experts, 16 for nvfp4 linears.
PACKABLE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=6,
                layer_types=[S, FULL], num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def build_model(text_config: dict, canvas_length: int = 8, seed: int | None = None):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    # seed=None: a fresh model from the global generator (tests/conftest.py seeds it per test, so it reproduces)
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, (1,))))
    cfg = DiffusionGemmaConfig(text_config=dict(text_config, max_position_embeddings=4096), vision_config=TINY_VISION,
                               canvas_length=canvas_length)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if "norm" in name or name.endswith("scale"):
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.25)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    return model


def save(model, directory, **kwargs) -> str:
    model.save_pretrained(str(directory), **kwargs)
    return str(directory)


def mid_engine(device, seed: int, canvas: int = 64, **options):
    """The GPU tests' mid-size model: MID's shapes with random weights (bench.fixtures.RandomSource, std 0.05), as
    a bf16 engine on `device` with a prefill chunk of 256 (options override the engine's)."""
    from bench.fixtures import RandomSource
    from diffgemma.config import ModelConfig
    from diffgemma.model.engine import build_engine

    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": canvas,
                                 "text_config": dict(MID, model_type="diffusion_gemma_text")})
    return build_engine(cfg, RandomSource(cfg, device, torch.bfloat16, seed=seed, std=0.05), device, torch.bfloat16,
                        **{"prefill_chunk": 256, **options})


def cache_state(cache):
    """What a prefill leaves in an engine cache, copied: (length, the device length, slot positions, live K/V)."""
    return cache.length, int(cache.length_t), cache.slot_pos.clone(), [t.clone() for t in cache.live_kv()]
