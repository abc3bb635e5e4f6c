"""The engine's batched denoise (Engine.denoise_batch; docs/ARCHITECTURE.md, 'Batching') on the CPU torch path.

- Each lane's logits equal its solo denoise's: lanes over other contexts (past the sliding window and not), other
  canvas lengths and each SC form (none / logits / embeds), in any order. f32 with an f32 KV cache; the CPU's GEMMs
  over more rows may re-associate, so within f32 rounding (a wiring fault, e.g. a lane reading another's cache or
  positions, is O(0.1-1)).
- generate_batch on the engine gives each request the tokens generate gives it alone, on tiny checkpoints and the
  demo model; a request that joins mid-way and one that leaves early included.
- The kernel-path rule (batch_paths): "lane" chooses by one lane's rows, "total" by all rows; a bad value and bad
  batched calls are one-line InputErrors.
"""

import pytest
import torch

import diffgemma
from diffgemma import generate, generate_batch
from diffgemma.errors import InputError
from diffgemma.model import forward as forward_mod
from diffgemma.model.engine import Engine
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ref(request, tmp_path_factory):
    hf = build_model(CONFIGS[request.param], canvas_length=8)
    return diffgemma.load(save(hf, tmp_path_factory.mktemp(request.param)))


def _gen():
    return torch.Generator().manual_seed(int(torch.randint(2**31, ())))  # from the test's seeded global generator


def _engine(ref, **kw):
    return Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32, **kw)


def _lanes(eng, gen):
    """Four lanes: contexts below and past the sliding window, canvas lengths C and C/2, each SC form."""
    cfg = eng.config
    V, C, W = cfg.vocab_size, cfg.canvas_length, cfg.sliding_window
    lanes = []
    for T, n, form in ((3, C, "none"), (3 * W + 1, C, "logits"), (W // 2 + 2, C // 2, "embeds"), (2 * W, C, "logits")):
        cache = eng.new_cache(T + 4 * C)
        eng.prefill(cache, torch.randint(0, V, (T,), generator=gen))
        canvas = torch.randint(0, V, (n,), generator=gen)
        lg = torch.randn(n, V, generator=gen) * 4 if form == "logits" else None
        em = eng.soft_embed(torch.softmax(torch.randn(n, V, generator=gen), -1)) if form == "embeds" else None
        lanes.append((cache, canvas, lg, em))
    return lanes


@pytest.mark.parametrize("paths", ["lane", "wide", "total"])
def test_each_lane_gets_its_solo_logits(ref, paths):
    eng = _engine(ref, batch_paths=paths)
    lanes = _lanes(eng, _gen())
    solo = [eng.denoise(c, x, sc_logits=lg, sc_embeds=em) for c, x, lg, em in lanes]
    for order in ([0, 1, 2, 3], [3, 1, 0], [2, 0]):
        pick = [lanes[i] for i in order]
        out = eng.denoise_batch([p[0] for p in pick], [p[1] for p in pick], sc_logits=[p[2] for p in pick],
                                sc_embeds=[p[3] for p in pick])
        for i, got in zip(order, out):
            assert got.shape == solo[i].shape and got.dtype == torch.float32
            err = (got - solo[i]).abs().max().item()
            assert err <= 1e-4, f"lane {i} in batch {order}: max |Δlogits| {err:.3g}"
    # the raw form is the softcap's input, as denoise_raw
    raw = eng.denoise_batch_raw([lanes[0][0], lanes[1][0]], [lanes[0][1], lanes[1][1]],
                                sc_logits=[None, lanes[1][2]])
    cap = eng.logit_softcap
    assert (cap * torch.tanh(raw[1].float() / cap) - solo[1]).abs().max().item() <= 1e-4


def test_a_batched_forward_reads_no_other_lane(ref):
    """Changing one lane's canvas and cache moves no other lane's logits beyond f32 rounding (the experts' row groups
    change with lane 1's routing, and the CPU's grouped GEMM may re-associate over them)."""
    eng = _engine(ref)
    gen = _gen()
    lanes = _lanes(eng, gen)
    caches, canvases = [p[0] for p in lanes], [p[1] for p in lanes]
    sc = [p[2] for p in lanes]
    em = [p[3] for p in lanes]
    before = eng.denoise_batch(caches, canvases, sc_logits=sc, sc_embeds=em)
    eng.prefill(caches[1], torch.randint(0, eng.config.vocab_size, (5,), generator=gen))
    canvases[1] = torch.randint(0, eng.config.vocab_size, (len(canvases[1]),), generator=gen)
    after = eng.denoise_batch(caches, canvases, sc_logits=sc, sc_embeds=em)
    assert (before[1] - after[1]).abs().max().item() > 1e-2
    for i in (0, 2, 3):
        err = (before[i] - after[i]).abs().max().item()
        assert err <= 1e-4, f"lane {i} moved by {err:.3g} when lane 1 changed"


def test_lane_paths_choose_kernels_by_one_lanes_rows(ref, monkeypatch):
    """batch_paths "lane": every kernel-path decision of a batched forward sees one lane's rows; "total" and (for a
    plain expert stack) "wide": all rows."""
    seen = []
    real = forward_mod.moe_paths.takes_f16_operand
    monkeypatch.setattr(forward_mod.moe_paths, "takes_f16_operand",
                        lambda w, routes, x: seen.append(routes) or real(w, routes, x))
    k, C = ref.config.top_k_experts, ref.config.canvas_length
    for paths, want in (("lane", C * k), ("wide", 3 * C * k), ("total", 3 * C * k)):
        eng = _engine(ref, batch_paths=paths)
        caches = [eng.new_cache(64) for _ in range(3)]
        for c in caches:
            eng.prefill(c, torch.tensor([2, 3, 4]))
        seen.clear()
        eng.denoise_batch(caches, [torch.arange(C)] * 3)
        assert seen and set(seen) == {want}, (paths, set(seen))


def test_bad_batched_calls_are_one_line_errors(ref):
    eng = _engine(ref, max_batch=2)
    C, V = eng.config.canvas_length, eng.config.vocab_size
    a, b, c = (eng.new_cache(64) for _ in range(3))
    for x in (a, b, c):
        eng.prefill(x, torch.tensor([2, 3]))
    ids = torch.arange(C)
    cases = [
        (lambda: eng.denoise_batch([a, b, c], [ids] * 3), "expected 1 to 2 caches"),
        (lambda: eng.denoise_batch([a, a], [ids] * 2), "a cache appears twice"),
        (lambda: eng.denoise_batch([a, b], [ids]), "one canvas per cache"),
        (lambda: eng.denoise_batch([a, b], [ids, torch.arange(C + 1)]), "canvas 1 of"),
        (lambda: eng.denoise_batch([a, b], [ids, ids], sc_logits=[None, torch.zeros(C, V + 1)]), "sc_logits 1"),
        (lambda: eng.denoise_batch([a, b], [ids, ids], sc_embeds=[torch.zeros(C, 3), None]), "sc_embeds 0"),
        (lambda: eng.denoise_batch([a, b], [ids, ids + V]), "canvas 1 ids: ids must be in"),
        (lambda: eng.denoiser([a, b, c]), "exceed this engine's max_batch"),
    ]
    for call, msg in cases:
        with pytest.raises(InputError, match=msg) as e:
            call()
        assert "\n" not in str(e.value)
    for bad in (dict(batch_paths="rows"), dict(max_batch=0)):
        with pytest.raises(InputError, match="Engine: "):
            _engine(ref, **bad)


PROMPTS = [[2, 5, 9], [2, 7, 7, 7, 1, 4], [2, 11], [2, 3, 3, 8, 9, 10, 12]]


def _result(r):
    return r.tokens, r.steps_per_block, r.stop_reasons, r.block_ends, r.retries, r.stop_token


def test_generate_batch_on_the_engine_joins_and_leaves(ref, monkeypatch):
    """max_batch 3 over 4 requests with other budgets: rounds run 3 lanes, then fewer as requests leave, the fourth
    joining when the first leaves; every request completes within its budget. (Tokens equal to generate's are checked
    on the demo model below: these random tiny models amplify f32 re-association into other near-tie picks.)"""
    eng = _engine(ref)
    lanes = []
    real = eng.denoise_batch_raw
    monkeypatch.setattr(eng, "denoise_batch_raw", lambda caches, *a, **k: lanes.append(len(caches)) or real(caches, *a, **k))
    budgets = [20, 20, 8, 20]
    settings = [diffgemma.GenerationSettings.resolve({}, env={}, overrides=dict(max_new_tokens=n, max_denoising_steps=5))
                for n in budgets]
    events = []
    results = generate_batch(eng, PROMPTS, seeds=[1, 2, 3, 4], settings=settings, max_batch=3,
                             on_event=lambda i, e: events.append((i, type(e).__name__)))
    assert max(lanes) == 3 and all(2 <= n <= 3 for n in lanes)
    assert all(len(r.tokens) <= n and r.forwards >= 1 for r, n in zip(results, budgets))
    first_done = next(i for i, kind in events if kind == "DoneEvent")
    assert events.index((first_done, "DoneEvent")) < min(k for k, (i, _) in enumerate(events) if i == 3)


def test_generate_batch_on_the_demo_engine_equals_generate():
    demo = diffgemma.load()
    eng = _engine(demo)
    tok = demo.tokenizer
    prompts = [tok.encode(p) for p in ("Name a colour.", "What is 2+2?", "Say hi.")]
    kw = dict(max_new_tokens=16, max_denoising_steps=6)
    batched = generate_batch(eng, prompts, seeds=[5, 6, 7], **kw)
    solo = [generate(eng, p, seed=s, **kw) for p, s in zip(prompts, [5, 6, 7])]
    assert [_result(r) for r in batched] == [_result(r) for r in solo]


def test_a_batch_graph_serves_every_membership_of_its_shape(ref, monkeypatch):
    """model/engine_batch.BatchGraphs: a shape seen once runs eagerly (None); seen again it is captured over its
    caches' stores; any later batch of that shape replays it, its caches handed the graph's stores first (each
    cache keeping its contents); least recently used graphs go past the bound; a graph whose store died is captured
    again; a cache of another geometry is not handed a store."""
    from diffgemma.model.engine_batch import BatchGraphs

    eng = _engine(ref)
    gen = _gen()
    captured = []

    class Fake:
        def __init__(self, caches):
            import weakref
            self.refs = [weakref.ref(c.store) for c in caches]
            self.ids = self.sc = self.has = self  # copy_ takes the inputs
            self.out = object()

        def copy_(self, x):
            pass

        def stores(self):
            return [r() for r in self.refs]

        def alive(self):
            return all(s is not None for s in self.stores())

        def replay(self):
            pass

    graphs = BatchGraphs(eng, keep=2)
    assert dict(graphs.counts) == {"eager": 0, "captured": 0, "replayed": 0}  # every key from the start (/metrics)
    monkeypatch.setattr(graphs, "_capture", lambda caches, *a: captured.append(len(caches)) or Fake(caches))
    caches = [eng.new_cache(32) for _ in range(5)]
    for i, c in enumerate(caches):
        eng.prefill(c, torch.randint(0, eng.config.vocab_size, (3 + i,), generator=gen))
    prints = [c.fingerprint() for c in caches]
    a, b, c, d, e = caches

    def run(*lanes, rows=16):
        z = torch.zeros(8 * len(lanes))
        return graphs.run(list(lanes), z, [8] * len(lanes), [rows] * len(lanes), z, z)

    assert run(a, b) is None and not captured  # a new shape: eager
    assert run(c, d) is not None and captured == [2]  # seen before: captured, over c's and d's stores
    held = graphs.graphs[next(iter(graphs.graphs))].stores()
    assert run(a, b) is not None and captured == [2]  # another membership replays it...
    assert {id(a.store), id(b.store)} == {id(s) for s in held}  # ...with a and b holding the graph's stores
    b_store = b.store
    _, perm = run(b, e)
    assert b.store is b_store and {id(b.store), id(e.store)} == {id(s) for s in held}  # b kept its lane
    assert held[perm.index(0)] is b.store and held[perm.index(1)] is e.store and captured == [2]
    assert [x.fingerprint() for x in caches] == prints  # every cache kept its contents
    assert graphs.counts == {"eager": 1, "captured": 1, "replayed": 2}
    assert run(a, b, c) is None and run(c, d, e) is not None and captured == [2, 3]
    assert run(a, b, rows=24) is None and run(a, b, rows=24) is not None and captured == [2, 3, 2]
    assert len(graphs.graphs) == 2 and run(d, e) is not None and captured == [2, 3, 2, 2]  # (2, 16) was dropped
    # a graph over a dead cache's store is captured again; the live caches keep their contents
    x, y, w = (eng.new_cache(32) for _ in range(3))
    for i, cache in enumerate((x, y, w)):
        eng.prefill(cache, torch.randint(0, eng.config.vocab_size, (4 + i,), generator=gen))
    kept = [y.fingerprint(), w.fingerprint()]
    assert run(x, y, rows=40) is None and run(x, y, rows=40) is not None and captured[-1] == 2
    n = len(captured)
    del x
    assert run(w, y, rows=40) is not None and len(captured) == n + 1
    assert [y.fingerprint(), w.fingerprint()] == kept
    # a cache of another geometry is not handed a store: the shape's graph is captured again over its own
    big = eng.new_cache(64)
    own = big.store
    assert run(y, big, rows=40) is not None and len(captured) == n + 2 and big.store is own
    # caches of other geometries that already hold their lanes' stores replay without exchanging anything
    assert run(y, big, rows=40) is not None and len(captured) == n + 2 and big.store is own
    other, ys = eng.new_cache(32), y.store
    assert run(other, big, rows=40) is not None and len(captured) == n + 2  # other takes y's store, not big's
    assert big.store is own and other.store is ys and y.store is not ys


def test_swapping_stores_keeps_contents_and_moves_graphs(ref):
    """Engine.swap_stores: two caches exchange buffers (contents stay with each cache, past a wrapped sliding ring
    too) and the solo / prefill graphs captured over those buffers follow them; each cache then denoises and grows
    exactly as an untouched twin with the same history does; caches of another geometry are refused."""
    eng = _engine(ref)
    gen = _gen()
    V, C = eng.config.vocab_size, eng.config.canvas_length
    pa_ids, pb_ids, more = (torch.randint(0, V, (n,), generator=gen) for n in (3 * C + 1, 2 * C + 3, C + 2))
    a, b, twin_a, twin_b = (eng.new_cache(8 * C) for _ in range(4))
    for cache, ids in ((a, pa_ids), (b, pb_ids), (twin_a, pa_ids), (twin_b, pb_ids)):
        eng.prefill(cache, ids)
    assert a.length > a.ring  # the ring has wrapped
    pa, pb, sa, sb = a.fingerprint(), b.fingerprint(), a.store, b.store
    ga, gb = {"key": "graph over a's store"}, {"key": "graph over b's store"}
    eng._graphs[a], eng._prefill_graphs[b] = ga, gb
    eng.swap_stores(a, b)
    assert (a.store, b.store) == (sb, sa) and (a.length, b.length) == (len(pa_ids), len(pb_ids))
    assert (a.fingerprint(), b.fingerprint()) == (pa, pb)
    assert eng._graphs.get(b) is ga and eng._graphs.get(a) is None
    assert eng._prefill_graphs.get(a) is gb and eng._prefill_graphs.get(b) is None
    assert sa.owner() is b and sb.owner() is a
    eng._graphs.pop(b), eng._prefill_graphs.pop(a)
    x = torch.randint(0, V, (C,), generator=gen)
    for cache, twin in ((a, twin_a), (b, twin_b)):
        assert torch.equal(eng.denoise(cache, x), eng.denoise(twin, x))
        eng.prefill(cache, more)
        eng.prefill(twin, more)
        assert cache.fingerprint() == twin.fingerprint()
        assert torch.equal(eng.denoise(cache, x), eng.denoise(twin, x))
    with pytest.raises(ValueError, match="geometry"):
        eng.swap_stores(a, eng.new_cache(4 * C))


def test_graph_capture_pauses_the_cyclic_collector(monkeypatch):
    """engine_graph.capture: no garbage collection inside a capture (a dead graph freed then would invalidate it),
    and the collector is back on after it, also when the capture raises; left off if it was off."""
    import contextlib
    import gc

    from diffgemma.model import engine_graph

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(engine_graph.torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with engine_graph.capture(object(), None):
        seen.append(gc.isenabled())
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        with engine_graph.capture(object(), None):
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with engine_graph.capture(object(), None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_dropped_engine_is_freed_without_the_cyclic_collector(ref):
    """No reference cycle holds an engine (BatchGraphs refers to it weakly): dropped, it goes at once, with its
    graphs, rather than whenever the cyclic collector runs (which could be during another engine's capture)."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        eng = _engine(ref)
        cache = eng.new_cache(32)
        eng.prefill(cache, torch.arange(5))
        eng.denoise(cache, torch.arange(eng.config.canvas_length))
        gone = weakref.ref(eng)
        del eng
        assert gone() is None
    finally:
        if enabled:
            gc.enable()
