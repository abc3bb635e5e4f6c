"""The warm-up before serving (warmup.py; `serve --warmup`): it generates once in every context bucket of the cache,
leaves the cache empty, and changes no later token. On the CPU, through the fast engine's code path (its torch
twins); tests/gpu/test_generate_gpu.py checks on CUDA that the graphs it captures are the ones requests replay."""

import random
from dataclasses import replace

import pytest
import torch

import diffgemma
from diffgemma import generation
from diffgemma.errors import InputError
from diffgemma.model.engine import Engine
from diffgemma.settings import GenerationSettings
from diffgemma.warmup import bucket_lengths, warm_up, warm_up_batches


@pytest.fixture(scope="module")
def engine():
    return Engine.from_reference(diffgemma.load(), dtype=torch.float32)


@pytest.fixture(scope="module")
def settings(engine):
    return GenerationSettings.resolve(engine.generation_config, env={})


def buckets_seen(engine, monkeypatch) -> list:
    """The context bucket of every denoise the engine makes from now on."""
    seen = []
    inner = engine.denoise_raw

    def spy(cache, *a, **k):
        seen.append(engine.context_bucket(cache))
        return inner(cache, *a, **k)

    monkeypatch.setattr(engine, "denoise_raw", spy)
    return seen


@pytest.mark.parametrize("max_tokens,buckets", [(2500, [1024, 2048, 2500]), (900, [900]), (1025, [1024])])
def test_warm_up_denoises_in_every_bucket_and_empties_the_cache(engine, settings, monkeypatch, max_tokens, buckets):
    # 1025: the last bucket holds one length only, and a reply would carry the cache past it; it is skipped
    assert engine.context_buckets(engine.new_cache(max_tokens))[-1] == max_tokens
    seen = buckets_seen(engine, monkeypatch)
    cache = engine.new_cache(max_tokens)
    seconds = warm_up(engine, cache, settings)
    assert sorted(set(seen)) == buckets and seconds > 0
    assert cache.length == 0


def test_a_warmed_cache_gives_a_fresh_caches_tokens(engine, settings):
    s = settings.replace(seed=random.getrandbits(32), max_new_tokens=64)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}])
    fresh = generation.generate(engine, prompt, settings=s, cache=engine.new_cache(2100)).tokens
    warmed = engine.new_cache(2100)
    warm_up(engine, warmed, settings)
    assert generation.generate(engine, prompt, settings=s, cache=warmed).tokens == fresh and fresh


def test_warm_up_refuses_a_cache_in_use(engine, settings):
    cache = engine.new_cache(256)
    engine.prefill(cache, torch.tensor([2, 105]))
    with pytest.raises(InputError, match="holds 2 tokens"):
        warm_up(engine, cache, settings)
    assert cache.length == 2  # left as it was


def test_warm_up_empties_the_cache_when_a_generation_fails(engine, settings, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "denoise_raw", broken)
    cache = engine.new_cache(1500)
    with pytest.raises(RuntimeError, match="boom"):
        warm_up(engine, cache, settings)
    assert cache.length == 0


def test_warm_up_stops_between_buckets_when_asked(engine, settings, monkeypatch):
    seen = buckets_seen(engine, monkeypatch)
    cache = engine.new_cache(2500)
    asked = []
    warm_up(engine, cache, settings, should_stop=lambda: asked.append(1) or len(asked) > 1)
    assert sorted(set(seen)) == [1024] and cache.length == 0


def test_a_worker_interrupted_while_warming_stops_at_the_next_bucket(engine, settings, monkeypatch):
    """Ctrl-C while `serve` waits for the warm-up: the worker thread stops warming before its next bucket, so
    closing the worker does not wait for the rest of the warm-up."""
    from diffgemma.server import worker as worker_mod

    def interrupted(self):
        raise KeyboardInterrupt

    seen = buckets_seen(engine, monkeypatch)
    monkeypatch.setattr(worker_mod._Call, "result", interrupted)
    w = worker_mod.Worker(engine, slots=2, max_tokens=2500)
    try:
        with pytest.raises(KeyboardInterrupt):
            w.warm_up(settings)
    finally:
        w.close()
    assert set(seen) <= {1024}  # at most the bucket slot 0 had begun
    assert all(s is None or s.cache.length == 0 for s in w.slots)


def test_warm_up_batches_runs_each_batch_size_in_each_bucket_the_kept_graphs_hold(engine, settings, monkeypatch):
    """warm_up_batches, on the CPU engine made to say it keeps batch graphs (so the forwards run, eagerly): batched
    forwards of every size from 2 to the caches' number, twice each (seen, then captured), every lane in one context
    bucket at the settings' canvas, then (with options.batch_prefill_graphs) the batched commits of those canvases
    alike, each followed by a rewind to the bucket's length, bucket by bucket from the lowest while all sizes fit among
    the kept graphs; the caches are emptied after. An engine that keeps no batch graphs runs nothing."""
    caches = [engine.new_cache(2500) for _ in range(3)]
    calls = []
    denoise, commit = engine.denoise_batch_raw, engine.prefill_batch

    def lanes(cs, canvases):
        return len(cs), {engine.context_bucket(c) for c in cs}, {len(x) for x in canvases}

    def spy(cs, canvases, *a, **k):
        calls.append(("denoise", *lanes(cs, canvases)))
        return denoise(cs, canvases, *a, **k)

    def spy_commit(cs, blocks):
        calls.append(("commit", *lanes(cs, blocks), {c.length for c in cs}))
        commit(cs, blocks)

    monkeypatch.setattr(engine, "denoise_batch_raw", spy)
    monkeypatch.setattr(engine, "prefill_batch", spy_commit)
    assert warm_up_batches(engine, caches, settings) == 0.0 and not calls  # the CPU engine: no batch graphs
    monkeypatch.setattr(Engine, "keeps_batch_graphs", property(lambda self: True))
    C = settings.canvas_length or engine.config.canvas_length
    for kept, buckets, commits in ((32, (1024, 2048, 2500), False), (32, (1024, 2048, 2500), True),
                                   (5, (1024, 2048), True)):  # 5 kept: two buckets of sizes 2 and 3
        monkeypatch.setattr(engine._batch_graphs, "keep", kept)
        monkeypatch.setattr(engine, "options", replace(engine.options, batch_prefill_graphs=commits))
        calls.clear()
        assert warm_up_batches(engine, caches, settings) > 0
        lengths = dict(bucket_lengths(list(buckets)))
        assert calls == [x for bucket in buckets for x in
                         [("denoise", b, {bucket}, {C}) for b in (2, 2, 3, 3)]
                         + [("commit", b, {bucket}, {C}, {lengths[bucket]}) for b in (2, 2, 3, 3) if commits]]
        assert [c.length for c in caches] == [0, 0, 0]
    caches[1].truncate(0)
    engine.prefill(caches[1], torch.tensor([5, 6, 7]))
    with pytest.raises(InputError, match="expected empty caches"):
        warm_up_batches(engine, caches, settings)
