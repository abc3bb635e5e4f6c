"""Exact boundaries of the KV cache and of prompt chunking.

A prefix reuse that ends exactly where the fast engine's sliding-window ring can still rewind (its slack) keeps
the prefix and gives the cache a straight prefill gives; one token deeper is a re-prefill from nothing, never a
cache reading overwritten slots. A prompt of exactly one prefill chunk is prefilled in one call, exactly two in
two, and the chunked generation's tokens equal the one-shot ones; the server's worker prefills such prompts in
exactly those chunks.
"""

import pytest
import torch

import diffgemma
from diffgemma.core import EngineCore, Request
from diffgemma.model.engine import Engine
from diffgemma.settings import GenerationSettings
from diffgemma.slots import Slot, reuse_prefix, usable_prefix
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf = build_model(CONFIGS["gqa2_mixed"], canvas_length=8, seed=5)
    ref = diffgemma.load(save(hf, tmp_path_factory.mktemp("tiny")))
    return Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32)


@pytest.mark.parametrize("slack", [2, 5])
def test_a_prefix_reuse_ending_exactly_at_the_rewind_limit(engine, slack):
    cfg = engine.config
    gen = torch.Generator().manual_seed(slack)
    V = cfg.vocab_size
    cached = torch.randint(0, V, (3 * cfg.sliding_window + 4,), generator=gen).tolist()
    tail = torch.randint(0, V, (6,), generator=gen).tolist()
    for depth, reusable in ((slack, True), (slack + 1, False)):
        cache = engine.new_cache(128, rewind_slack=slack)
        engine.prefill(cache, torch.tensor(cached))
        n = len(cached) - depth  # the next prompt shares exactly n leading ids
        ids = cached[:n] + [(cached[n] + 1) % V] + tail
        slot = Slot(cache, list(cached))
        assert cache.can_truncate(n) is reusable
        assert usable_prefix(slot, ids) == (n if reusable else 0)
        keep = reuse_prefix(cache, cached, ids)
        assert keep == (n if reusable else 0) and cache.length == keep
        engine.prefill(cache, torch.tensor(ids[keep:]))
        straight = engine.new_cache(128, rewind_slack=slack)
        engine.prefill(straight, torch.tensor(ids[:n]))
        engine.prefill(straight, torch.tensor(ids[n:]))
        if not reusable:
            straight = engine.new_cache(128, rewind_slack=slack)
            engine.prefill(straight, torch.tensor(ids))
        canvas = torch.randint(0, V, (cfg.canvas_length,), generator=gen)
        # f32 rounding of other prefill shapes only (the first call differs); a read of an overwritten ring slot
        # moves the logits by O(0.1)
        torch.testing.assert_close(engine.denoise(cache, canvas), engine.denoise(straight, canvas), rtol=1e-4,
                                   atol=1e-4)


# -- prefill chunks -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


def _prompt(demo, parity: int):
    """A chat prompt of the demo whose length has the given parity."""
    for n in range(1, 40):
        ids = demo.tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to " + "9" * n + "."}])
        if len(ids) % 2 == parity:
            return ids
    raise AssertionError("no prompt of that parity")


def _run(demo, ids, chunk, calls):
    real = demo.prefill

    def prefill(cache, chunk_ids, *a, **kw):
        calls.append(len(chunk_ids))
        return real(cache, chunk_ids, *a, **kw)

    demo.prefill = prefill
    try:
        slot = Slot(demo.new_cache(512))
        settings = GenerationSettings(seed=3, max_new_tokens=16)
        return EngineCore(demo).run([Request(settings, prompt=ids, slot=slot, prefill_chunk=chunk)])[0].result.tokens
    finally:
        del demo.prefill


def test_a_prompt_of_exactly_one_or_two_prefill_chunks(demo):
    ids = _prompt(demo, 0)
    L = len(ids)
    one_shot = _run(demo, ids, None, calls := [])
    assert calls[0] == L
    for chunk, want in ((L, [L]), (L // 2, [L // 2, L // 2]), (L - 1, [L - 1, 1]), (L + 1, [L]),
                        (L // 2 + 1, [L // 2 + 1, L // 2 - 1])):
        calls = []
        tokens = _run(demo, ids, chunk, calls)
        assert calls[:len(want)] == want, (chunk, calls)
        assert sum(calls[:len(want)]) == L
        assert tokens == one_shot, chunk


def test_the_worker_prefills_exactly_one_and_exactly_two_chunks(demo):
    pytest.importorskip("fastapi")
    from diffgemma.events import DoneEvent
    from diffgemma.server.worker import Worker

    ids = _prompt(demo, 0)
    L = len(ids)
    settings = GenerationSettings(seed=3, max_new_tokens=16)
    results = {}
    for chunk, want in ((L, [L]), (L // 2, [L // 2, L // 2])):
        trace: list = []
        worker = Worker(demo, slots=1, max_tokens=512, max_batch=1, prefill_chunk=chunk, trace=trace)
        try:
            job = worker.submit(ids, settings)
            event = job.get(timeout=120)
            while not isinstance(event, DoneEvent):
                event = job.get(timeout=120)
        finally:
            worker.close()
        assert [t[3] for t in trace if t[1] == "prefill"] == want
        results[chunk] = event.result.tokens
    assert results[L] == results[L // 2]
