"""Top-k sparse attention through both engines (the cache's `attention_topk`): the fast engine's torch path against
the reference model on tiny random checkpoints, sparse differs from dense, and a rule covering every key is dense."""

import pytest
import torch

import diffgemma
from diffgemma.model.engine import Engine
from diffgemma.ops.attention_topk import TopKRule
from diffgemma.settings import GenerationSettings
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    name = sorted(CONFIGS)[0]
    hf = build_model(CONFIGS[name], canvas_length=8)
    return diffgemma.load(save(hf, tmp_path_factory.mktemp(name)))


def run(model, rule, prompt, canvas, sc, block, chunk_model=None):
    cache = model.new_cache(256)
    cache.attention_topk = rule
    model.prefill(cache, prompt)
    a = model.denoise(cache, canvas, sc_logits=sc)
    model.prefill(cache, block)
    b = model.denoise(cache, canvas)
    return a, b


def case(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    V, C = cfg.vocab_size, cfg.canvas_length
    T = 3 * cfg.sliding_window + 5
    return (torch.randint(0, V, (T,), generator=g), torch.randint(0, V, (C,), generator=g),
            torch.randn(C, V, generator=g) * 4, torch.randint(0, V, (C,), generator=g))


def test_engine_matches_reference_sparse(ref):
    rule = TopKRule(divisor=4, min_keys=2, max_keys=6)
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32, prefill_chunk=7)
    c = case(ref.config)
    sparse_ref, sparse_eng = run(ref, rule, *c), run(eng, rule, *c)
    dense_ref = run(ref, None, *c)
    for e, g, d in zip(sparse_ref, sparse_eng, dense_ref):
        assert (g - e).abs().max().item() <= 1e-3
        assert (e - d).abs().max().item() > 1e-2  # the rule bites: sparse is not dense


def test_rule_covering_every_key_is_dense(ref):
    big = TopKRule(divisor=1, min_keys=4096, max_keys=4096)
    c = case(ref.config, seed=1)
    for e, g in zip(run(ref, None, *c), run(ref, big, *c)):
        assert torch.equal(e, g)


def test_generate_with_a_sparse_cache_on_the_demo_model(monkeypatch):
    """generate with the topk_* settings: the request's cache gets their rule before its prompt is prefilled (so
    prefill and every denoise step run top-k); a rule covering every key gives dense's tokens, the default rule
    (64 keys a row here) runs end to end and is deterministic."""
    from diffgemma.generation import generate

    model = diffgemma.load()
    prompt = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    seen = []
    real_prefill = model.prefill

    def prefill(cache, ids, *a, **kw):
        seen.append(getattr(cache, "attention_topk", None))
        return real_prefill(cache, ids, *a, **kw)

    monkeypatch.setattr(model, "prefill", prefill)

    def tokens(**topk):
        seen.clear()
        out = generate(model, prompt, cache=model.new_cache(1024), max_new_tokens=8, max_denoising_steps=6, seed=3,
                       **topk).tokens
        assert seen and all(rule == TopKRule.from_settings(GenerationSettings(**topk)) for rule in seen), seen
        return out

    dense = tokens()
    assert tokens(topk_attention=True, topk_divisor=1, topk_min=1024, topk_max=1024) == dense
    sparse = tokens(topk_attention=True)
    assert tokens(topk_attention=True) == sparse and len(sparse) >= 1
