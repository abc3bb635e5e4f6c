"""The engine core (core/engine.py) on the demo model: each round's lanes get their StepStats from one call
(core/lanes.lane_stats, the seam a batched sampler fills), a request's visible state follows its events, and abort
stops one request of a batch while the others keep their solo tokens."""

import pytest

import diffgemma
from diffgemma.core import EngineCore, Request
from diffgemma.core import engine as engine_mod
from diffgemma.core.request import DENOISE, DONE
from diffgemma.events import BlockEvent, CancelledEvent, DoneEvent, StepEvent
from diffgemma.generation import generate
from diffgemma.settings import GenerationSettings
from diffgemma.slots import Slot
from test_tool_repair import live_equal

PROMPTS = [[2, 5, 9, 14], [2, 11, 12, 13, 14, 15], [2, 7, 7, 30, 31]]


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def base(model):
    return GenerationSettings.resolve(model.generation_config, env={}, overrides={"max_new_tokens": 24,
                                                                                  "max_denoising_steps": 4})


def requests(model, base, sinks):
    return [Request(base.replace(seed=10 + k), prompt=p, slot=Slot(model.new_cache(256)), sink=sinks[k].append)
            for k, p in enumerate(PROMPTS)]


def test_a_rounds_lanes_get_their_stats_from_one_call(model, base, monkeypatch):
    calls, real = [], engine_mod.lane_stats
    monkeypatch.setattr(engine_mod, "lane_stats", lambda asks, logits: (calls.append(len(asks)), real(asks, logits))[1])
    sinks = [[] for _ in PROMPTS]
    core = EngineCore(model, max_batch=3)
    ends = core.run(requests(model, base, sinks))
    assert len(calls) == core.counts["forwards"] and sum(calls) == core.counts["canvas_steps"]
    assert calls[0] == 3  # every lane of the first round in one call
    for end, p, k in zip(ends, PROMPTS, range(3)):
        solo = generate(model, p, settings=base.replace(seed=10 + k), cache=model.new_cache(256))
        assert isinstance(end, DoneEvent) and end.result.tokens == solo.tokens


def test_a_requests_visible_state_follows_its_events(model, base):
    seen = []
    request = Request(base.replace(seed=3), prompt=PROMPTS[0], slot=Slot(model.new_cache(256)))
    request.sink = lambda e: seen.append((type(e).__name__, request.phase, request.block, request.step,
                                          list(request.tokens)))
    core = EngineCore(model)
    core.add_request(request)
    assert request.phase == "queued"
    core.step()
    assert request.phase == DENOISE and request.step == 1
    while not request.done:
        core.step()
    assert request.phase == DONE and isinstance(request.end, DoneEvent)
    steps = [s for s in seen if s[0] == "StepEvent"]
    assert [s[3] for s in steps] == list(range(1, len(steps) + 1))  # a step counted as its event goes out
    blocks = [s for s in seen if s[0] == "BlockEvent"]
    assert [s[2] for s in blocks] == list(range(1, len(blocks) + 1))
    assert seen[-1][4] == request.end.result.tokens == request.tokens


def test_abort_stops_one_request_and_the_others_keep_their_tokens(model, base):
    sinks = [[] for _ in PROMPTS]
    reqs = requests(model, base, sinks)
    core = EngineCore(model, max_batch=3)
    for r in reqs:
        core.add_request(r)
    core.step()
    core.step()
    core.abort(reqs[1])
    while not all(r.done for r in reqs):
        core.step()
    end = reqs[1].end
    assert isinstance(end, CancelledEvent) and end.kept == len(PROMPTS[1])  # rewound to its prompt
    assert reqs[1].slot.ids is None or reqs[1].slot.cache.length == len(PROMPTS[1])
    assert sum(isinstance(e, StepEvent) for e in sinks[1]) <= 3
    for k in (0, 2):
        solo = generate(model, PROMPTS[k], settings=base.replace(seed=10 + k), cache=model.new_cache(256))
        assert reqs[k].end.result.tokens == solo.tokens
        assert [t for e in sinks[k] if isinstance(e, BlockEvent) for t in e.tokens] == solo.tokens


@pytest.mark.parametrize("cap", [None, 30.0])
def test_lane_stats_runs_the_rounds_row_pass_once_with_each_lanes_solo_bits(monkeypatch, cap):
    """lane_stats over the views of one [B, C, V] buffer (a batched forward's output): one launch of the row pass for
    every lane (the fused path, its kernels interpreted), each lane's fields the bits of its solo StepStats; lanes of
    separate tensors go lane by lane with the same bits."""
    import types

    import torch

    from diffgemma.core import lanes as lanes_mod
    from diffgemma.ops import rowstats, softcap, tempered_tables
    from diffgemma.sampling import stats as stats_mod
    from diffgemma.sampling.stats import StepStats

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod in (rowstats, softcap, tempered_tables, stats_mod):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    launches, real = [], stats_mod.tempered_rowstats
    monkeypatch.setattr(stats_mod, "tempered_rowstats", lambda *a, **kw: (launches.append(1), real(*a, **kw))[1])
    g = torch.Generator().manual_seed(7)
    raw = (torch.randn(3, 8, 384, generator=g) * 20).to(torch.bfloat16 if cap else torch.float32)
    temps = [0.5, 0.8, 1.0]
    asks = [types.SimpleNamespace(temp=t, den=types.SimpleNamespace(cap=cap)) for t in temps]
    for logits, want_launches in ((list(raw.unbind(0)), 1), ([x.clone() for x in raw.unbind(0)], 3)):
        launches.clear()
        got = lanes_mod.lane_stats(asks, logits)
        assert len(launches) == want_launches
        for st, x, t in zip(got, raw.unbind(0), temps):
            solo = StepStats(x.clone(), t, cap=cap)
            assert st.fused and solo.fused
            for name in ("entropy", "argmax", "rowmax", "lse"):
                assert torch.equal(getattr(st, name), getattr(solo, name)), name


def _last_commit_run(model, base, **request_kw):
    """Three requests to their ends; each sink notes its slot's cache length when the DoneEvent arrives."""
    at_done, reqs = {}, []
    for k, p in enumerate(PROMPTS):
        r = Request(base.replace(seed=10 + k), prompt=p, slot=Slot(model.new_cache(256)), **request_kw)
        r.sink = lambda e, r=r: at_done.setdefault(r.id, r.slot.cache.length) if isinstance(e, DoneEvent) else None
        reqs.append(r)
    EngineCore(model, max_batch=3).run(reqs)
    return reqs, at_done


def test_a_replys_end_goes_out_before_its_last_block_is_committed(model, base):
    """The last block's commit runs after the DoneEvent, at the round's end, with the same cache bits as a commit
    before it (a turn that may regenerate a tool call commits first); the cache holds prompt + reply either way."""
    reqs, at_done = _last_commit_run(model, base)
    first, first_done = _last_commit_run(model, base, turn=True, call_cut=lambda reply: None, tool_retries=1)
    for r, f, p in zip(reqs, first, PROMPTS):
        tokens = r.end.result.tokens
        assert tokens == f.end.result.tokens and len(r.end.result.block_ends) > 1
        assert r.slot.cache.length == f.slot.cache.length == len(p) + len(tokens)
        assert live_equal(r.slot.cache, f.slot.cache)
        assert at_done[r.id] < r.slot.cache.length  # the end went out before the last block was in
        assert first_done[f.id] == f.slot.cache.length  # the regenerable turn committed first


def _staggered(model, base, lengths, max_batch, steps=None):
    """Requests of PROMPTS (cycled) with whole-block replies of `lengths` tokens at `steps` denoise steps a block
    (default 4; no early stop), each on a slot of its own, and an engine core of max_batch."""
    fixed = dict(stability_threshold=0, entropy_stop=0.0, plateau_steps=0, confidence_trim=0.0, empty_reply_retry=0,
                 stop_ids=[])
    steps = steps or [4] * len(lengths)
    reqs = [Request(base.replace(seed=20 + k, max_new_tokens=n, max_denoising_steps=t, **fixed),
                    prompt=PROMPTS[k % len(PROMPTS)], slot=Slot(model.new_cache(512)))
            for k, (n, t) in enumerate(zip(lengths, steps))]
    return reqs, EngineCore(model, max_batch=max_batch)


def test_an_ended_requests_last_block_goes_with_the_batchs_next_commit(model, base, monkeypatch):
    """A request that ends while others still denoise has its last block committed with their next block commit (one
    commit_lanes), not at its own round's end; every cache ends as the same run's with each last block committed at
    once."""
    C = model.config.canvas_length
    calls, real = [], engine_mod.commit_lanes
    monkeypatch.setattr(engine_mod, "commit_lanes", lambda m, asks: (calls.append([a.last for a in asks]),
                                                                    real(m, asks))[1])
    reqs, core = _staggered(model, base, [C, 3 * C, 3 * C], 3, steps=[2, 4, 4])
    for r in reqs:
        core.add_request(r)
    waited = 0
    while not all(r.done for r in reqs):
        core.step()
        if reqs[0].done and not reqs[1].done:
            waited += reqs[0].slot.cache.length == len(PROMPTS[0])  # its last block not in yet
            assert not core.idle
    core.run([])
    assert waited >= 1
    # the first request ended in round 2; its last block rode with the other two's first block commit (round 4);
    # theirs ended together
    assert calls == [[False, False, True], [False, False], [True, True]], calls
    monkeypatch.setattr(EngineCore, "_last_may_wait", lambda self: False)
    ref, core = _staggered(model, base, [C, 3 * C, 3 * C], 3, steps=[2, 4, 4])
    core.run(ref)
    for r, f in zip(reqs, ref):
        assert r.end.result.tokens == f.end.result.tokens
        assert live_equal(r.slot.cache, f.slot.cache)
        assert r.slot.cache.length == len(r.prompt) + len(r.end.result.tokens)


def test_a_request_that_joins_finds_every_ended_cache_whole(model, base, monkeypatch):
    """While a request waits to join, no ended request's last block waits: it is committed before the scheduler
    admits anyone (the joiner may take that slot), also when the joiner comes while one waits; the core is idle only
    once every last block is in."""
    C = model.config.canvas_length
    reqs, core = _staggered(model, base, [C, 3 * C, 2 * C, C], 2, steps=[2, 4, 3, 4])
    late, _ = _staggered(model, base, [C, C], 2, steps=[3, 3])
    real, seen = core.scheduler.schedule, []

    def schedule():
        seen.append((bool(core.scheduler.waiting), len(core._last)))
        return real()

    monkeypatch.setattr(core.scheduler, "schedule", schedule)
    for r in reqs:
        core.add_request(r)
    joined = 0
    while not all(r.done for r in reqs + late):
        if core._last and joined < len(late):  # one waits: a request comes now, between rounds
            core.add_request(late[joined])
            joined += 1
        core.step()
    assert joined == len(late)
    assert all(n == 0 for waiting, n in seen if waiting)
    assert any(n for waiting, n in seen if not waiting)  # a last block did wait while nobody was queued
    core.run([])
    assert core.idle and not core._last
    for r in reqs + late:
        assert r.slot.cache.length == len(r.prompt) + len(r.end.result.tokens)
