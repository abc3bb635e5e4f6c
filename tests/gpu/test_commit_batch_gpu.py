"""GPU checks for the batched commit (Engine.commit_batch: the commits of lanes that end a block in one round as one
padded prefill forward; skips without CUDA).

- Each cache gets the bits its own commit writes (the graphed solo commit), for full and short blocks, contexts in
  and past the sliding window, under each batch_paths rule that keeps a batched denoise's lanes bit-identical.
- The next denoise over each cache gives the solo cache's logits, bit for bit.
- Through the engine core, a batch of requests whose blocks end in the same round commits them in one forward and
  every request keeps the tokens it gets alone.
"""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from dataclasses import replace  # noqa: E402

from diffgemma.batch import generate_batch  # noqa: E402
from diffgemma.config import ModelConfig  # noqa: E402
from diffgemma.generation import generate  # noqa: E402
from diffgemma.model import engine_batch  # noqa: E402
from diffgemma.model.engine import build_engine  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

from bench.fixtures import RandomSource  # noqa: E402
from tiny_checkpoints import MID  # noqa: E402

DEV = "cuda"
CANVAS = 64


@pytest.fixture(scope="module")
def engine():
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": CANVAS,
                                 "text_config": dict(MID, model_type="diffusion_gemma_text")})
    return build_engine(cfg, RandomSource(cfg, DEV, torch.bfloat16, seed=random.getrandbits(31), std=0.05), DEV,
                        torch.bfloat16, prefill_chunk=256)


def state(cache):
    return cache.length, int(cache.length_t), cache.slot_pos.clone(), [t.clone() for t in cache.live_kv()]


def caches(engine, contexts, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in contexts:
        cache = engine.new_cache(2048)
        engine.prefill(cache, torch.randint(0, engine.config.vocab_size, (n,), generator=g).to(DEV))
        out.append(cache)
    return out


@pytest.mark.parametrize("paths", ["lane", "wide"])
@pytest.mark.parametrize("lens", [(CANVAS,) * 4, (CANVAS, 17, 1, 40, CANVAS, 3, 9, 64)])
def test_batched_commit_is_each_solo_commit_bit_for_bit(engine, paths, lens):
    old = engine.options
    engine.options = replace(old, batch_paths=paths)
    try:
        V = engine.config.vocab_size
        contexts = [random.choice([30, 300, 700, 1500]) for _ in lens]  # 300+: the ring has wrapped
        blocks = [torch.randint(0, V, (k,), device=DEV) for k in lens]
        solo, batched = caches(engine, contexts, 1), caches(engine, contexts, 1)
        for cache, ids in zip(solo, blocks):
            engine.commit(cache, ids)
        runs, inner = [], engine_batch.prefill_padded_batch
        engine_batch.prefill_padded_batch = lambda fwd, cs, *a: (runs.append(len(cs)), inner(fwd, cs, *a))[1]
        try:
            engine.commit_batch(batched, blocks)
        finally:
            engine_batch.prefill_padded_batch = inner
        torch.cuda.synchronize()
        assert runs == [len(lens)]  # one forward for all lanes (one padded length: the canvas)
        canvas = torch.randint(0, V, (CANVAS,), device=DEV)
        for k, (a, b) in enumerate(zip(solo, batched)):
            la, ta, sa, kva = state(a)
            lb, tb, sb, kvb = state(b)
            assert (la, ta) == (lb, tb) and torch.equal(sa, sb), k
            assert all(torch.equal(x, y) for x, y in zip(kva, kvb)), (k, lens[k], contexts[k])
            assert torch.equal(engine.denoise(a, canvas), engine.denoise(b, canvas)), k
    finally:
        engine.options = old


def test_a_rounds_commits_run_as_one_forward_and_keep_each_requests_tokens(engine):
    s = GenerationSettings.resolve({}, env={}, overrides={"max_new_tokens": 2 * CANVAS, "max_denoising_steps": 6,
                                                          "stability_threshold": 0, "entropy_stop": 0.0,
                                                          "plateau_steps": 0, "confidence_trim": 0.0,
                                                          "empty_reply_retry": 0, "stop_ids": ()})
    V = engine.config.vocab_size
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (20, 90, 40, 300)]
    runs, inner = [], engine_batch.prefill_padded_batch
    engine_batch.prefill_padded_batch = lambda fwd, cs, *a: (runs.append(len(cs)), inner(fwd, cs, *a))[1]
    try:
        got = generate_batch(engine, prompts, seeds=[0, 1, 2, 3], settings=s, max_batch=4)
    finally:
        engine_batch.prefill_padded_batch = inner
    assert runs and max(runs) == 4
    for k, p in enumerate(prompts):
        solo = generate(engine, p, settings=s.replace(seed=k), cache=engine.new_cache(1024))
        assert got[k].tokens == solo.tokens, k
