"""Several caches' chunks as one batched prefill (the engine's prefill_batch): the engine's batched padded prefill
writes each cache what its own commit writes (on the CPU to f32 rounding, its torch GEMMs being free to block rows
differently; bit for bit on CUDA: tests/gpu/test_prefill_batch_gpu.py); the core hands a round's commits
(core/lanes.commit_lanes) and a round's joining prompts (turn.prefill_chunks) to the model's prefill_batch, one call
a wave, each request keeping its solo tokens; a prompt the batch refuses fails alone."""

import pytest
import torch

import diffgemma
from diffgemma.core import EngineCore, Request
from diffgemma.errors import InputError
from diffgemma.events import DoneEvent, ErrorEvent
from diffgemma.generation import generate
from diffgemma.model.engine import Engine
from diffgemma.settings import GenerationSettings
from diffgemma.slots import Slot

from tiny_checkpoints import cache_state as state


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


@pytest.fixture(scope="module")
def engine(demo):
    eng = Engine.from_reference(demo, dtype=torch.float32, kv_dtype=torch.float32)
    eng.padded_prefill = True  # the CUDA engine's commit, on the CPU's torch path
    return eng




def caches_with_context(engine, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        cache = engine.new_cache(512)
        engine.prefill(cache, torch.randint(0, engine.config.vocab_size, (n,), generator=g))
        out.append(cache)
    return out


def test_prefill_batch_writes_each_cache_what_its_own_commit_writes(engine):
    V = engine.config.vocab_size
    contexts = [40, 7, 150, 23]  # 150: past the sliding window, the ring has wrapped
    blocks = [torch.randint(0, V, (k,)) for k in (64, 17, 1, 64)]
    solo, batched = caches_with_context(engine, contexts), caches_with_context(engine, contexts)
    for cache, ids in zip(solo, blocks):
        engine.commit(cache, ids)
    calls, inner = [], engine.forward.padded_lane
    engine.forward.padded_lane = lambda *a: (calls.append(a[1]), inner(*a))[1]
    try:
        engine.prefill_batch(batched, blocks)
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


def test_prefill_batch_refuses_what_it_cannot_serve(engine):
    a, b = caches_with_context(engine, [5, 5])
    with pytest.raises(InputError, match="prefill_batch: expected one chunk of ids for each of 2 different caches"):
        engine.prefill_batch([a, a], [torch.tensor([1]), torch.tensor([2])])
    with pytest.raises(InputError, match=r"prefill ids: ids must be in \[0, "):
        engine.prefill_batch([a, b], [torch.tensor([1]), torch.tensor([engine.config.vocab_size])])


class BatchCommits:
    """The demo model with a prefill_batch that records its lanes' chunk lengths and, as the engine's does, checks
    every lane's room before it prefills them one by one (the seam's test)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prefill_batch(self, caches, ids):
        self.calls.append([len(x) for x in ids])
        for cache, x in zip(caches, ids):
            cache.check_room(len(x))
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
    assert max(len(c) for c in model.calls[1:]) >= 2  # lanes that ended a block in the same round, in one call
    for k, end in enumerate(ends):
        solo = generate(demo, prompts[k], settings=s.replace(seed=k), cache=demo.new_cache(256))
        assert isinstance(end, DoneEvent) and end.result.tokens == solo.tokens


def settings_for(demo, **kw):
    return GenerationSettings.resolve(demo.generation_config, env={}, overrides={
        "max_new_tokens": 16, "max_denoising_steps": 4, "canvas_length": 16, "stability_threshold": 0,
        "entropy_stop": 0.0, "plateau_steps": 0, "confidence_trim": 0.0, **kw})


def test_the_core_prefills_a_rounds_prompts_in_one_call_a_chunk(demo):
    """Three prompts (12, 2 and 20 tokens) join together with a 16-token prefill chunk: the first wave takes one
    chunk of each in one prefill_batch call, the long prompt's last chunk runs alone, and every request gets the
    tokens it gets alone with that chunk."""
    model = BatchCommits(demo)
    prompts = [demo.tokenizer.encode(t) for t in ("What is 17 + 25?", "Hi", "Name three colours of the sky.")]
    assert [len(p) for p in prompts] == [12, 2, 20]
    s = settings_for(demo)
    reqs = [Request(s.replace(seed=k), prompt=p, slot=Slot(demo.new_cache(256))) for k, p in enumerate(prompts)]
    core = EngineCore(model, max_batch=3, prefill_chunk=16)
    ends = core.run(reqs)
    assert model.calls[0] == [12, 2, 16] and [4] not in model.calls
    assert core.counts["prefill_tokens"] == 34
    for k, end in enumerate(ends):
        alone = Request(s.replace(seed=k), prompt=prompts[k], slot=Slot(demo.new_cache(256)))
        solo, = EngineCore(demo, max_batch=1, prefill_chunk=16).run([alone])
        assert isinstance(end, DoneEvent) and end.result.tokens == solo.result.tokens


def test_a_prompt_the_batch_refuses_fails_alone(demo):
    """A prompt too long for its slot's cache, joining with two others: the batch refuses the wave before writing
    anything, each chunk runs alone, and only that request ends with an error naming the cache."""
    model = BatchCommits(demo)
    prompts = [demo.tokenizer.encode(t) for t in ("What is 17 + 25?", "What is 3 + 4?", "What is 40 + 2?")]
    s = settings_for(demo)
    sizes = [256, 8, 256]
    reqs = [Request(s.replace(seed=k), prompt=p, slot=Slot(demo.new_cache(n))) for k, (p, n) in
            enumerate(zip(prompts, sizes))]
    ends = EngineCore(model, max_batch=3).run(reqs)
    assert isinstance(ends[1], ErrorEvent) and "KV cache overflow" in str(ends[1].error)
    for k in (0, 2):
        solo = generate(demo, prompts[k], settings=s.replace(seed=k), cache=demo.new_cache(256))
        assert isinstance(ends[k], DoneEvent) and ends[k].result.tokens == solo.tokens
