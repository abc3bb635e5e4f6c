"""The sampler batched across a round's lanes in the engine core (core/lanes.py: lane_masks, lane_plans, lane_embeds):
a request's tokens are the ones it gets alone in a batch of 3 to 8 requests with mixed settings, and the round really
calls the batched sampler functions over several lanes. On the fused path (the Triton passes interpreted, tiny
shapes) the round's accept masks take one launch and the sparse-SC plans share one pass."""

import pytest
import torch

import diffgemma
from diffgemma.core import EngineCore, Request
from diffgemma.core import lanes as lanes_mod
from diffgemma.events import DoneEvent
from diffgemma.generation import generate
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.settings import GenerationSettings
from diffgemma.slots import Slot

TEXTS = ["What is 17 + 25?", "What is 3 + 4?", "What is 12 + 9?", "What is 40 + 2?", "What is 8 + 8?",
         "What is 21 + 30?", "What is 5 + 6?", "What is 99 + 1?"]  # the demo model answers these with text
# each lane's own settings: a batch mixes bounds, SC modes, the freeze, sampling, schedules, canvas lengths
MIXED = [{}, {"entropy_bound": 2.0}, {"sc_mode": "exact"}, {"freeze": True}, {"commit": "sample"},
         {"t_min": 0.3, "t_max": 1.0, "sc_sparse_log_ratio": 4.0}, {"canvas_length": 8}, {"semantics": "hf"}]


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def prompts(model):
    return [model.tokenizer.encode(text) for text in TEXTS]


def settings(model, k: int) -> GenerationSettings:
    base = GenerationSettings.resolve(model.generation_config, env={}, overrides={
        "max_new_tokens": 24, "max_denoising_steps": 4, "canvas_length": 16, "seed": 30 + k})
    return base.replace(**MIXED[k])


@pytest.fixture
def spied(monkeypatch):
    """The lane counts the round hands the batched sampler functions: {"masks": [...], "plans": [...],
    "embeds": [...]}."""
    seen = {"masks": [], "plans": [], "embeds": []}
    masks, batch, embeds = lanes_mod.accept_masks, SparsePlan.batch, SparsePlan.soft_embed_batch
    monkeypatch.setattr(lanes_mod, "accept_masks",
                        lambda h, *a, **kw: (seen["masks"].append(len(h)), masks(h, *a, **kw))[1])
    monkeypatch.setattr(SparsePlan, "batch",
                        staticmethod(lambda st, *a, **kw: (seen["plans"].append(len(st)), batch(st, *a, **kw))[1]))
    monkeypatch.setattr(SparsePlan, "soft_embed_batch",
                        staticmethod(lambda p, *a, **kw: (seen["embeds"].append(len(p)), embeds(p, *a, **kw))[1]))
    return seen


def run_batch(model, prompts, n: int):
    reqs = [Request(settings(model, k), prompt=prompts[k], slot=Slot(model.new_cache(256))) for k in range(n)]
    return EngineCore(model, max_batch=n).run(reqs)


@pytest.mark.parametrize("n", [3, 8])
def test_mixed_settings_lanes_get_their_solo_tokens_through_the_batched_sampler(model, prompts, spied, n):
    ends = run_batch(model, prompts, n)
    assert max(spied["masks"]) > 1 and max(spied["plans"]) > 1 and max(spied["embeds"]) > 1
    replies = 0
    for k, end in enumerate(ends):
        solo = generate(model, prompts[k], settings=settings(model, k), cache=model.new_cache(256))
        assert isinstance(end, DoneEvent) and end.result.tokens == solo.tokens, (k, MIXED[k])
        assert end.result.steps_per_block == solo.steps_per_block
        replies += len(set(solo.tokens)) > 2  # a reply, not one repeated id
    assert replies >= n // 2


@pytest.fixture
def kernels(monkeypatch):
    """The fused sampler path with its Triton kernels, interpreted; counts the batched kernels' launches."""
    from diffgemma.ops import rowstats, sc_gather, softcap, survivor_list, tempered_tables
    from diffgemma.sampling import accept
    from diffgemma.sampling import self_condition as sc_mod
    from diffgemma.sampling import stats as stats_mod

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod in (rowstats, softcap, tempered_tables, stats_mod, accept, sc_gather, survivor_list):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    launches = {"accept": [], "survivors": [], "counted": []}
    lanes_kernel, surv, counted = accept.sorted_prefix_lanes_triton, sc_mod.survivor_counts, \
        sc_mod.tempered_counted_probs
    monkeypatch.setattr(accept, "sorted_prefix_lanes_triton", lambda *a: launches["accept"].append(1) or
                        lanes_kernel(*a))
    monkeypatch.setattr(sc_mod, "survivor_counts", lambda x, lanes, *a, **kw: (  # the batch's gather-bet pass
        launches["survivors"].append(getattr(lanes, "lengths", None)), surv(x, lanes, *a, **kw))[1])
    monkeypatch.setattr(sc_mod, "tempered_counted_probs", lambda x, lanes, *a, **kw: (
        launches["counted"].append(getattr(lanes, "lengths", None)), counted(x, lanes, *a, **kw))[1])
    return launches


def test_the_fused_round_launches_each_sampler_pass_once_for_all_lanes(model, prompts, kernels):
    """Three lanes of one canvas length on the fused path: one accept-mask launch and one plan pass over all lanes'
    rows per round (the batch's LaneTemps), and every lane's tokens are its solo run's on the same path."""
    over = {"max_new_tokens": 8, "max_denoising_steps": 3, "canvas_length": 8, "confidence_trim": 0.0}
    reqs = [Request(GenerationSettings.resolve(model.generation_config, env={}, overrides={**over, "seed": 50 + k,
                                                                                          "entropy_bound": b}),
                    prompt=prompts[k], slot=Slot(model.new_cache(64))) for k, b in enumerate([0.1, 25.0, 0.1])]
    ends = EngineCore(model, max_batch=3).run(reqs)
    assert kernels["accept"]  # the round's masks in one launch
    assert [8, 8, 8] in kernels["survivors"] + kernels["counted"]  # a pass over all three lanes' rows
    batched = [r.end.result.tokens for r in reqs]
    for k, r in enumerate(reqs):
        solo = generate(model, prompts[k], settings=r.settings, cache=model.new_cache(64))
        assert isinstance(ends[k], DoneEvent) and batched[k] == solo.tokens, k


def test_lane_plans_leave_out_the_lanes_that_ask_none(kernels):
    """SparsePlan.batch over some lanes of a StepStats.batch (the others make no plan this step), listed out of lane
    order: each plan's mask, counts and soft embedding are its solo plan's bits, from one pass."""
    from diffgemma.sampling.stats import StepStats

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4 * 5, 300, generator=g) * 90).to(torch.bfloat16)  # raw logits: the pass makes group maxima
    temps = [0.5, 0.7, 0.9, 1.0]
    stats = StepStats.batch([x[5 * i: 5 * i + 5] for i in range(4)], temps, cap=30.0)
    pick = [2, 0, 3]  # lane 1 asks no plan
    plans = SparsePlan.batch([stats[i] for i in pick], [4.0, 6.0, 4.0])
    assert len(kernels["survivors"]) == 1 and all(p.shared is plans[0].shared for p in plans)
    counts = SparsePlan.counts_batch(plans)
    emb = torch.randn(300, 8, generator=g)
    got = SparsePlan.soft_embed_batch(plans, counts.tolist(), emb, 2.0)
    for i, p, n, e in zip(pick, plans, counts.tolist(), got):
        solo = SparsePlan(StepStats(x[5 * i: 5 * i + 5].clone(), temps[i], cap=30.0), {2: 4.0, 0: 6.0, 3: 4.0}[i])
        assert n == int(solo.count)
        assert torch.equal(p.row_counts, solo.row_counts)
        assert torch.equal(e, solo.soft_embed(n, emb, 2.0))
