"""Commits of lanes that end a block in one round, as one batched prefill (core/lanes.commit_lanes, the engine's
commit_batch): the engine's batched padded prefill writes each cache what its own commit writes (on the CPU to f32
rounding, its torch GEMMs being free to block rows differently; bit for bit on CUDA: tests/gpu/
test_commit_batch_gpu.py), and the core hands a round's commits to the model's commit_batch in one call, each
request keeping its solo tokens."""

import pytest
import torch

import diffgemma
from diffgemma.core import EngineCore, Request
from diffgemma.errors import InputError
from diffgemma.events import DoneEvent
from diffgemma.generation import generate
from diffgemma.model.engine import Engine
from diffgemma.settings import GenerationSettings
from diffgemma.slots import Slot


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


@pytest.fixture(scope="module")
def engine(demo):
    eng = Engine.from_reference(demo, dtype=torch.float32, kv_dtype=torch.float32)
    eng.padded_prefill = True  # the CUDA engine's commit, on the CPU's torch path
    return eng


def state(cache):
    return cache.length, int(cache.length_t), cache.slot_pos.clone(), [t.clone() for t in cache.live_kv()]


def caches_with_context(engine, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        cache = engine.new_cache(512)
        engine.prefill(cache, torch.randint(0, engine.config.vocab_size, (n,), generator=g))
        out.append(cache)
    return out


def test_commit_batch_writes_each_cache_what_its_own_commit_writes(engine):
    V = engine.config.vocab_size
    contexts = [40, 7, 150, 23]  # 150: past the sliding window, the ring has wrapped
    blocks = [torch.randint(0, V, (k,)) for k in (64, 17, 1, 64)]
    solo, batched = caches_with_context(engine, contexts), caches_with_context(engine, contexts)
    for cache, ids in zip(solo, blocks):
        engine.commit(cache, ids)
    calls, inner = [], engine.forward.padded_lane
    engine.forward.padded_lane = lambda *a: (calls.append(a[1]), inner(*a))[1]
    try:
        engine.commit_batch(batched, blocks)
    finally:
        del engine.forward.padded_lane
    assert calls == [engine.config.canvas_length] * 4  # every lane in the one padded forward
    for a, b in zip(solo, batched):
        la, ta, sa, kva = state(a)
        lb, tb, sb, kvb = state(b)
        assert (la, ta) == (lb, tb) and torch.equal(sa, sb)
        for x, y in zip(kva, kvb):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    # the next denoise reads the same context
    canvas = torch.randint(0, V, (16,))
    for a, b in zip(solo, batched):
        assert torch.allclose(engine.denoise(a, canvas), engine.denoise(b, canvas), rtol=1e-4, atol=1e-4)


def test_commit_batch_refuses_what_it_cannot_serve(engine):
    a, b = caches_with_context(engine, [5, 5])
    with pytest.raises(InputError, match="commit_batch: expected one block of ids for each of 2 different caches"):
        engine.commit_batch([a, a], [torch.tensor([1]), torch.tensor([2])])
    with pytest.raises(InputError, match=r"commit ids: ids must be in \[0, "):
        engine.commit_batch([a, b], [torch.tensor([1]), torch.tensor([engine.config.vocab_size])])


class BatchCommits:
    """The demo model with a commit_batch that records its lanes and commits them one by one (the seam's test)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def commit_batch(self, caches, ids):
        self.calls.append(len(caches))
        for cache, x in zip(caches, ids):
            self.model.prefill(cache, x)


def test_the_core_commits_a_rounds_blocks_in_one_call(demo):
    model = BatchCommits(demo)
    texts = ["What is 17 + 25?", "What is 3 + 4?", "What is 40 + 2?"]
    prompts = [demo.tokenizer.encode(t) for t in texts]
    s = GenerationSettings.resolve(demo.generation_config, env={}, overrides={
        "max_new_tokens": 32, "max_denoising_steps": 4, "canvas_length": 16, "stability_threshold": 0,
        "entropy_stop": 0.0, "plateau_steps": 0, "confidence_trim": 0.0})
    reqs = [Request(s.replace(seed=k), prompt=p, slot=Slot(demo.new_cache(256))) for k, p in enumerate(prompts)]
    ends = EngineCore(model, max_batch=3).run(reqs)
    assert model.calls and max(model.calls) >= 2  # lanes that ended a block in the same round, in one call
    for k, end in enumerate(ends):
        solo = generate(demo, prompts[k], settings=s.replace(seed=k), cache=demo.new_cache(256))
        assert isinstance(end, DoneEvent) and end.result.tokens == solo.tokens
