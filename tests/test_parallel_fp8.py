"""Expert parallelism over FP8 expert stacks: a rank's share holds its experts' e4m3 values and their row scales
together, and the ranks' partial sums add up to the single engine's FP8 MoE (CPU, no process group)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from diffgemma.checkpoint import SafetensorsSource
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine
from diffgemma.model.engine_weights import DictSource, Fp8QuantizedSource
from diffgemma.ops.fp8_weight import Fp8Weight
from diffgemma.ops.moe import expert_ffn
from diffgemma.ops.rmsnorm import unpermute_ref
from diffgemma.parallel.expert import ExpertParallelForward, ExpertShard
from diffgemma.parallel.group import Group

from tiny_checkpoints import CONFIGS, build_model, save  # noqa: E402

GU, DOWN = "model.decoder.layers.0.experts.gate_up_proj", "model.decoder.layers.0.experts.down_proj"


def fp8_stacks(E=6, F=8, H=16, seed=0) -> Fp8QuantizedSource:
    gen = torch.Generator().manual_seed(seed)
    # rows of very different magnitude per expert, so a scale of the wrong expert or row changes the values
    gu = torch.randn(E, 2 * F, H, generator=gen) * torch.logspace(-2, 1, E * 2 * F).view(E, 2 * F, 1)
    down = torch.randn(E, H, F, generator=gen) * torch.logspace(1, -2, E * H).view(E, H, 1)
    return Fp8QuantizedSource(DictSource({GU: gu, DOWN: down}))


def test_shard_cuts_fp8_values_and_row_scales_together():
    source = fp8_stacks()
    for name in (GU, DOWN):
        full = source.fp8_weight(name)
        share = ExpertShard(source, 2, 2)
        got = share.fp8_weight(name)
        assert isinstance(got, Fp8Weight) and got.shape == (2,) + full.shape[1:] == tuple(share.shape(name))
        assert torch.equal(got.weight.view(torch.uint8), full.weight[2:4].view(torch.uint8))
        assert torch.equal(got.scale, full.scale[2:4])
        assert torch.equal(got.dequantize(), share.get(name, dtype=torch.float32))  # the same values both ways


def test_shard_of_a_source_without_fp8_has_no_fp8_weight():
    share = ExpertShard(DictSource({GU: torch.zeros(2, 4, 4)}), 0, 1)
    assert not hasattr(share, "fp8_weight")


def test_local_sums_of_fp8_ranks_add_up_to_the_engines_fp8_moe(tmp_path):
    """Each rank's ExpertParallelForward over its FP8 share; the G partial sums add up to the one forward's MoE."""
    path = Path(save(build_model(CONFIGS["mha_realsplit"], canvas_length=8), tmp_path))
    source = Fp8QuantizedSource(SafetensorsSource(path))
    cfg = ModelConfig.from_file(path / "config.json")
    engine = build_engine(cfg, source, "cpu", torch.float32, kv_dtype=torch.float32)
    lw = engine.w.layers[0]
    assert isinstance(lw.experts_gu, Fp8Weight)
    T, H, G = 11, cfg.hidden_size, 3
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    weights, src, inv, offs, order = engine.forward._route(lw, x)
    want = unpermute_ref(expert_ffn(x, lw.experts_gu, lw.experts_down, offs, src=src, order=order), inv, weights)
    total = torch.zeros(T, H)
    per = cfg.num_experts // G
    name = f"model.decoder.layers.{cfg.layers[0].index}.experts."
    for r in range(G):
        share = ExpertShard(source, r * per, per)
        mine = replace(lw, experts_gu=share.fp8_weight(name + "gate_up_proj"),
                       experts_down=share.fp8_weight(name + "down_proj"))
        f = ExpertParallelForward(cfg, engine.w, group=Group(r, G), device="cpu", dtype=torch.float32)
        part = f.local_expert_sum(mine, x, weights, src, inv, offs, order, x.dtype)
        assert part.abs().sum() > 0
        total += part
    assert (total - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
