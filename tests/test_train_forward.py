"""The demo training forward (one pass over [prefix | canvas]) equals transformers' prefill + denoise.

transformers' DiffusionGemmaForBlockDiffusion is run the way generation runs it: the encoder writes the
prefix into a DynamicCache, then the decoder denoises the canvas against that cache. Our batched forward
right-aligns prefixes of different lengths in one tensor; each row must match its own transformers run.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

transformers = pytest.importorskip("transformers")
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

import train_demo as td  # noqa: E402

TINY = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "global_head_dim": 16, "num_global_key_value_heads": 1, "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
    "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": [1],
}
VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "position_embedding_size": 16}
CANVAS = 5


def _randomize(model: td.DemoModel):
    """Random values everywhere, including the norms, router scales and both sets of layer scalars."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def _pair():
    arch = td.Arch.from_dict(TINY)
    ours = td.DemoModel(arch)
    _randomize(ours)
    cfg = DiffusionGemmaConfig(text_config=dict(TINY), vision_config=dict(VISION), canvas_length=CANVAS)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    hf = DiffusionGemmaForBlockDiffusion(cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not [k for k in unexpected if "inv_freq" not in k], unexpected
    # everything the text model needs came from our state dict (encoder weights are tied to the decoder's)
    assert not [k for k in missing if not (k.startswith("model.encoder.vision_tower")
                                           or k.startswith("model.encoder.embed_vision")
                                           or k.startswith("model.encoder.language_model.") or k == "lm_head.weight")]
    hf.tie_weights()
    # the tied encoder copies must really be the decoder's tensors (and the layer scalars must differ)
    enc0 = hf.model.encoder.language_model.layers[0]
    assert torch.equal(enc0.self_attn.q_proj.weight, ours.model.decoder.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(enc0.layer_scalar, hf.model.decoder.layers[0].layer_scalar)
    return ours, hf


def _hf_logits(hf, prefix_ids, canvas_ids, sc_logits):
    cache = DynamicCache(config=hf.config.text_config)
    with torch.no_grad():
        hf.model.encoder(input_ids=prefix_ids[None], cache=cache)
        out = hf(cache=cache, decoder_input_ids=canvas_ids[None],
                 self_conditioning_logits=None if sc_logits is None else sc_logits[None])
    return out.logits[0]


@pytest.mark.parametrize("with_sc", [False, True])
def test_training_forward_matches_transformers(with_sc):
    torch.set_default_dtype(torch.float32)
    ours, hf = _pair()
    V = TINY["vocab_size"]
    # prefix lengths straddle the sliding window (6) so both the window and the padding are exercised
    lens = [3, 11, 7]
    B = len(lens)
    Lp = max(lens)
    prefix = torch.zeros(B, Lp, dtype=torch.long)
    seqs = [torch.randint(0, V, (n,)) for n in lens]
    for b, s in enumerate(seqs):
        prefix[b, Lp - len(s):] = s
    n_pad = torch.tensor([Lp - n for n in lens])
    canvas = torch.randint(0, V, (B, CANVAS))
    sc_logits = torch.randn(B, CANVAS, V) * 3 if with_sc else None
    sc = ours.soft_embed(sc_logits) if with_sc else None
    with torch.no_grad():
        got = ours(prefix, n_pad, canvas, sc)
    for b in range(B):
        want = _hf_logits(hf, seqs[b], canvas[b], None if sc_logits is None else sc_logits[b])
        err = (got[b] - want).abs().max().item()
        # f32 rounding amplified by the random model (heavy tail): over 15000 fresh rows median 3.3e-6, 0.1 % over
        # 2.2e-5, worst 6.9e-5 (the old bound was 1e-4). A wrong mask, position or padding is off by O(0.1-1).
        assert err < 1e-3, f"row {b} (prefix {lens[b]}): max |diff| {err}"
        assert want.abs().max() > 0.1  # a real signal, not two zero tensors


def test_masks_encode_the_two_attention_phases():
    n_pad = torch.tensor([2])
    m = td.build_masks(n_pad, Lp=6, C=3, window=3, device="cpu")
    full, slide = m[td.FULL][0, 0], m[td.SLIDING][0, 0]
    # prefix rows never see the canvas (slots 6..8) nor padding keys (slots 0, 1)
    assert not full[2:6, 6:].any() and not full[2:, :2].any()
    # a prefix row on a sliding layer sees [q-(W-1), q]
    assert slide[5].tolist() == [False] * 3 + [True] * 3 + [False] * 3
    # canvas rows: full layers see the whole real prefix and canvas; sliding the last W-1 prefix positions
    assert full[7].tolist() == [False] * 2 + [True] * 7
    assert slide[7].tolist() == [False] * 4 + [True] * 5


def test_batcher_blocks_cover_the_answer():
    # one example: prompt [5, 6, 7], target 9 tokens -> with C=4: blocks at k=0,1,2; the last padded
    d = {"tokens": torch.tensor([5, 6, 7] + list(range(10, 19)), dtype=torch.int16), "offset": torch.tensor([0]),
         "prompt_len": torch.tensor([3]), "target_len": torch.tensor([9])}
    b = td.Batcher(d, 4, "cpu")
    assert b.n_blocks.tolist() == [3]
    prefix, n_pad, canvas = b.block(torch.tensor([0, 0, 0]), torch.tensor([0, 4, 8]))
    assert canvas.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 0, 0, 0]]
    assert n_pad.tolist() == [8, 4, 0]
    assert prefix[2].tolist() == [5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17]
    assert prefix[0, 8:].tolist() == [5, 6, 7]
    # a mid-block start (the engine's commit trim): prefix = prompt + 6 answer tokens
    prefix, n_pad, canvas = b.block(torch.tensor([0]), torch.tensor([6]))
    assert prefix[0].tolist() == [5, 6, 7, 10, 11, 12, 13, 14, 15] and canvas[0].tolist() == [16, 17, 18, 0]
    g = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
    ex, start = b.draw(400, g, cut_prob=0.0)
    assert set(start.tolist()) == {0, 4, 8}
    ex, start = b.draw(400, g, cut_prob=1.0)
    assert set(start.tolist()) == set(range(9))


def test_train_step_learns_on_cpu():
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    arch = td.Arch.from_dict(TINY)
    model = td.DemoModel(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 96, (8, 6))
    n_pad = torch.zeros(8, dtype=torch.long)
    clean = (prefix[:, -1:] + torch.arange(CANVAS)) % 96  # a learnable function of the prefix
    losses = []
    for _ in range(60):
        loss, _ = td.train_step(model, prefix, n_pad, clean, gen, arch.vocab)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses[::10]
