"""Several caches' chunks as one batched prefill (the engine's prefill_batch): the engine's batched padded prefill
writes each cache what its own commit writes (on the CPU to f32 rounding, its torch GEMMs being free to block rows
differently; bit for bit on CUDA: tests/gpu/test_prefill_batch_gpu.py); the core hands a round's commits
(core/lanes.commit_lanes) and a round's joining prompts (turn.prefill_chunks) to the model's prefill_batch, one call
a wave, each request keeping its solo tokens; a prompt the batch refuses fails alone."""

from dataclasses import replace

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


def test_a_short_batched_prefill_goes_to_the_graphs_lanes_in_ascending_key_rows(engine, monkeypatch):
    """Where graphs are on (made so here: the CPU engine runs the graph call as CUDA would) and
    options.batch_prefill_graphs is, a padded group of at most graph_rows rows is handed to the batched prefill graphs
    with its lanes sorted by their key rows, each lane's ids in its own N rows and its real-row count; a longer group,
    or one the graphs do not take, runs eagerly; either way every cache's host length advances by its chunk."""
    from diffgemma.model import engine_batch

    V, N = engine.config.vocab_size, engine.config.canvas_length
    handed, eager, took = [], [], [True]
    monkeypatch.setattr(engine._prefill_batch_graphs, "run_prefill",
                        lambda cs, rows, n, n_real, key_rows: handed.append((cs, rows, n, n_real, key_rows)) or took[0])
    inner = engine_batch.prefill_padded_batch
    monkeypatch.setattr(engine_batch, "prefill_padded_batch",
                        lambda fwd, cs, *a: (eager.append(cs), inner(fwd, cs, *a)))
    caches = [engine.new_cache(2048) for _ in range(3)]
    for c, n in zip(caches, (1500, 7, 600)):  # context buckets 2048, 1024, 1024
        engine.prefill(c, torch.randint(0, V, (n,)))
    blocks = [torch.randint(0, V, (k,)) for k in (N, 3, N - 1)]
    monkeypatch.setattr(engine, "_on_graphs", lambda run: run())
    assert engine_batch.graph_rows(engine) == 0  # options.batch_prefill_graphs off: eager, without asking the graphs
    engine.prefill_batch(caches[1:], blocks[1:])
    assert not handed and len(eager) == 1
    monkeypatch.setattr(engine, "options", replace(engine.options, batch_prefill_graphs=True))
    engine.prefill_batch(caches, blocks)
    (cs, rows, n, n_real, key_rows), = handed
    order = [1, 2, 0]  # by key rows: the lanes at 7 and 600 tokens read a 1024-row bucket, the one at 1500 2048
    assert [id(c) for c in cs] == [id(caches[i]) for i in order] and len(eager) == 1
    assert n == N and key_rows == [1024 + N, 1024 + N, 2048 + N]
    assert n_real == [len(blocks[i]) for i in order]
    for b, i in enumerate(order):
        assert torch.equal(rows[b * N: b * N + len(blocks[i])], blocks[i])
    assert [c.length for c in caches] == [1500 + N, 7 + 6, 600 + 2 * (N - 1)]
    took[0] = False  # the graphs did not take it: eager
    engine.prefill_batch(caches[1:], blocks[1:])
    assert len(handed) == 2 and len(eager) == 2
    monkeypatch.setattr(engine, "options", replace(engine.options, max_batch=2, prefill_pads=(N,)))
    assert engine_batch.graph_rows(engine) == 2 * N
    engine.prefill_batch(caches, blocks)  # more rows than the graphs hold: eager, without asking them
    assert len(handed) == 2 and len(eager) == 3
    assert [c.length for c in caches] == [1500 + 2 * N, 7 + 12, 600 + 4 * (N - 1)]


def test_a_batched_prefill_graph_feeds_each_lane_its_own_rows_in_any_membership(engine, monkeypatch):
    """engine_batch.BatchGraphs.run_prefill: a shape seen once runs eagerly (False); seen again it is captured over
    its caches' stores; another membership of that shape replays it, each cache first handed one of the graph's
    stores (its contents moved along), and the graph's lane holding a store gets that cache's ids and real-row
    count."""
    from diffgemma.model.engine_batch import BatchGraphs
    from diffgemma.model.engine_graph import BatchPrefillGraph

    V, N = engine.config.vocab_size, engine.config.canvas_length
    captured = []

    class NoGraph:  # the entry's graph: replays nothing
        def replay(self):
            pass

    def fake(caches):
        B = len(caches)
        return BatchPrefillGraph(NoGraph(), [c.store for c in caches], torch.zeros(B * N, dtype=torch.long),
                                 torch.zeros(B, dtype=torch.long))

    graphs = BatchGraphs(engine)
    monkeypatch.setattr(graphs, "_capture_prefill", lambda caches, *a: captured.append(len(caches)) or fake(caches))
    caches = caches_with_context(engine, [5, 9, 12, 30])
    prints = [c.fingerprint() for c in caches]
    a, b, c, d = caches

    def run(*lanes):
        ids = [torch.randint(0, V, (N,)) for _ in lanes]
        n_real = [3 + k for k in range(len(lanes))]
        key_rows = [engine.prefill_key_rows(x, N) for x in lanes]
        return graphs.run_prefill(list(lanes), torch.cat(ids), N, n_real, key_rows), dict(zip(lanes, zip(ids, n_real)))

    assert run(a, b)[0] is False and not captured
    assert run(c, d)[0] is True and captured == [2]
    entry = next(iter(graphs.graphs.values()))
    for lanes in ((b, a), (d, b), (a, c)):
        ran, fed = run(*lanes)
        assert ran is True and captured == [2]
        for j, store in enumerate(entry.stores()):
            holder = next(x for x in lanes if x.store is store)
            ids, n = fed[holder]
            assert torch.equal(entry.ids[j * N: (j + 1) * N], ids) and entry.n_real[j].item() == n
    assert [x.fingerprint() for x in caches] == prints  # every cache kept its contents
    assert graphs.counts == {"eager": 1, "captured": 1, "replayed": 3}


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
