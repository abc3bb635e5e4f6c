"""The sampler pieces, each against a slow twin or transformers' own implementation of the same rule."""

import math
import random

import pytest
import torch

from diffgemma.sampling.accept import accept_mask, accept_mask_reference
from diffgemma.sampling.rng import LCG_INCREMENT, LCG_MULTIPLIER, Lcg, block_seed, categorical
from diffgemma.sampling.schedule import remaining, temperature
from diffgemma.sampling.self_condition import exact_soft_embed, sparse_error_bound, sparse_soft_embed, survivors
from diffgemma.sampling.stats import entropy, max_prob
from diffgemma.sampling.stops import CONFIDENT, ENTROPY, FILLER_ID, MAX_STEPS, PLATEAU, StopRules
from diffgemma.sampling.trim import trim_cut

hfgen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")


# ----------------------------------------------------------------------------------------- LCG

def test_lcg_contract_first_draw_and_seed_plus_one():
    seed = random.getrandbits(64)
    rng = Lcg(seed)
    assert rng.state == (seed + 1) % 2**64
    expected_state = ((seed + 1) * 6966169279 + 1039523323) % 2**64
    assert rng.next_u32() == expected_state >> 32
    assert rng.state == expected_state


def test_lcg_vectorised_draws_equal_one_at_a_time():
    seed = random.getrandbits(64)
    slow, fast = Lcg(seed), Lcg(seed)
    n1, n2 = random.randint(1, 300), random.randint(1, 40)
    ref = [slow.next_u32() for _ in range(n1 + n2)]
    got = fast.u32(n1).tolist() + fast.u32(n2).tolist()
    assert got == ref
    assert fast.state == slow.state


def test_lcg_randint_and_uniform_are_the_high_bits_scaled():
    seed, vocab = random.getrandbits(64), random.randint(2, 300_000)
    draws = [Lcg(seed).next_u32()]
    ref = Lcg(seed)
    ids = Lcg(seed).randint(64, vocab)
    words = [ref.next_u32() for _ in range(64)]
    assert ids.tolist() == [w * vocab >> 32 for w in words]
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab
    u = Lcg(seed).uniform(64)
    assert u.dtype == torch.float64 and u.tolist() == [w / 2**32 for w in words]
    assert words[0] == draws[0]


def test_lcg_randint_is_roughly_uniform():
    ids = Lcg(random.getrandbits(64)).randint(40_000, 8)
    counts = torch.bincount(ids, minlength=8).double()
    # each bin ~ Binomial(40000, 1/8): sd ~ 66; allow 5 sd
    assert (counts - 5000).abs().max() < 5 * math.sqrt(40_000 * (1 / 8) * (7 / 8))


def test_block_seed_spreads_blocks_and_attempts():
    seed = random.getrandbits(32)
    assert block_seed(seed, 0, 0) == seed
    seeds = {block_seed(seed, b, a) for b in range(5) for a in range(4)}
    assert len(seeds) == 20
    assert LCG_MULTIPLIER % 2 == 1 and LCG_INCREMENT % 2 == 1  # full-period LCG constants


def test_categorical_matches_inverse_cdf_twin_and_frequencies():
    vocab = 6
    probs = torch.softmax(torch.randn(1, vocab) * 2, dim=-1)
    probs[0, 2] = 0.0  # a zero-probability token must never be drawn
    probs = probs / probs.sum()
    rng = Lcg(random.getrandbits(64))
    n = 30_000
    u = rng.uniform(n)
    draws = categorical(probs.expand(n, vocab), u)
    # slow twin: walk the CDF
    cdf = probs[0].double().cumsum(0).tolist()
    for i in random.sample(range(n), 200):
        target = u[i].item() * cdf[-1]
        assert draws[i].item() == next(j for j, c in enumerate(cdf) if c > target)
    freq = torch.bincount(draws, minlength=vocab).double() / n
    assert freq[2] == 0
    sd = torch.sqrt(probs[0].double() * (1 - probs[0].double()) / n)
    assert ((freq - probs[0].double()).abs() <= 5 * sd + 1e-12).all()


# ------------------------------------------------------------------------------ schedule, stats

def test_temperature_schedule_endpoints_and_hf_bit_identity():
    n = random.randint(2, 64)
    t_min, t_max = random.uniform(0.05, 0.5), random.uniform(0.6, 1.5)
    assert temperature(n, n, t_min, t_max).item() == pytest.approx(t_max, rel=1e-6)
    assert temperature(1, n, t_min, t_max).item() == pytest.approx(t_min + (t_max - t_min) / n, rel=1e-6)
    assert [remaining(k, n) for k in (1, n)] == [n, 1]
    proc = hfgen.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=n)
    scores = torch.randn(3, 50) * 10
    for cur in range(1, n + 1):
        theirs = proc(None, scores, cur_step=torch.tensor(cur, dtype=torch.int32))
        assert torch.equal(scores / temperature(cur, n, t_min, t_max), theirs)


def test_entropy_matches_categorical_exactly_and_float64_closely():
    logits = torch.randn(16, 200) * torch.rand(16, 1) * 20
    logits[0, :] = -1e9
    logits[0, 3] = 5.0  # one-hot row: entropy 0, not NaN
    h = entropy(logits)
    assert torch.equal(h, torch.distributions.Categorical(logits=logits).entropy())
    p = torch.softmax(logits.double(), -1)
    ref = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    assert torch.allclose(h.double(), ref, atol=2e-5)
    assert h[0].item() == 0.0
    assert torch.allclose(max_prob(logits).double(), p.max(-1).values, atol=1e-6)


# ---------------------------------------------------------------------------------- accept mask

def test_accept_mask_matches_python_twin_and_transformers():
    for _ in range(20):
        c = random.randint(1, 64)
        logits = torch.randn(c, 40) * torch.rand(c, 1) * 12
        h = entropy(logits)
        bound = random.choice([0.0, 0.05, 0.1, 0.5, 3.0])
        mask = accept_mask(h, bound)
        twin = accept_mask_reference(h.tolist(), bound)
        # the mask's prefix sums are f32 (cumsum - h), the twin's float64: they may part only where the sum
        # before a position is within f32 rounding of the bound (at bound 0: a sum of ~1e-11 entropies that
        # cumsum - h cancels to exactly 0; about once in 3000 draws)
        hl = h.tolist()
        before, run = {}, 0.0
        for i in sorted(range(c), key=lambda i: hl[i]):
            before[i], run = run, run + hl[i]
        for i, (a, b) in enumerate(zip(mask.tolist(), twin)):
            assert a == b or abs(before[i] - bound) <= 4 * 2.0 ** -24 * (before[i] + hl[i]), (i, before[i], bound)
        assert mask[h.argmin()]  # the lowest is always accepted
        sampler = hfgen.EntropyBoundSampler(hfgen.EntropyBoundSamplerConfig(entropy_bound=float(bound) or 1e-9),
                                            canvas_length=c, vocab_size=40, max_denoising_steps=8)
        if bound > 0:
            sampler.accept_canvas(torch.zeros(1, c, dtype=torch.long), torch.ones(1, c, dtype=torch.long),
                                  logits[None], cur_step=1)
            assert torch.equal(sampler.accepted_token_mask[0], mask)


def test_accept_mask_bound_is_a_prefix_sum_of_sorted_entropy():
    h = torch.tensor([0.5, 0.01, 0.04, 0.03, 2.0])
    # sorted: 0.01, 0.03, 0.04, 0.5, 2.0 ; sums before: 0, .01, .04, .08, .58
    assert accept_mask(h, 0.1).tolist() == [True, True, True, True, False]
    assert accept_mask(h, 0.05).tolist() == [False, True, True, True, False]
    assert accept_mask(h, 0.0).tolist() == [False, True, False, False, False]
    assert not accept_mask(h, 10.0, final_step=True).any()


def test_accept_mask_freeze_keeps_frozen_and_spends_bound_on_the_rest():
    h = torch.tensor([0.0, 0.2, 0.3, 0.01])
    frozen = torch.tensor([False, True, False, False])
    got = accept_mask(h, 0.005, frozen=frozen)
    # free positions 0, 2, 3: sorted 0.0, 0.01, 0.3 -> sums before 0, 0, 0.01 -> accept 0 and 3
    assert got.tolist() == [True, True, False, True]
    assert accept_mask(h, 0.005, final_step=True, frozen=frozen).tolist() == frozen.tolist()


# ----------------------------------------------------------------------------------- stop rules

def _rules(**kw):
    base = dict(max_steps=48, stability_threshold=1, confidence_threshold=0.005)
    base.update(kw)
    return StopRules(**base)


def test_confident_needs_stable_argmax_and_low_entropy():
    rules = _rules()
    a = torch.randint(3, 50, (8,))
    m = torch.ones(8, dtype=torch.bool)
    assert rules.update(1, a, 0.001, m) is None  # nothing to be stable against yet
    assert rules.update(2, a, 0.01, m) is None  # stable, not confident
    assert rules.update(3, a, 0.004, m) == CONFIDENT
    rules = _rules(stability_threshold=2)
    assert rules.update(1, a, 0.0, m) is None
    assert rules.update(2, a, 0.0, m) is None  # only one previous canvas so far
    assert rules.update(3, a, 0.0, m) == CONFIDENT
    rules = _rules(stability_threshold=0)
    assert rules.update(1, a, 0.0, m) == CONFIDENT


def test_confident_rule_agrees_with_transformers_criterion():
    for thr in (0, 1, 2):
        ours = _rules(stability_threshold=thr, confidence_threshold=1.0)
        theirs = hfgen.StableAndConfidentStoppingCriteria(stability_threshold=thr, confidence_threshold=1.0)
        pool = [torch.randint(0, 5, (6,)) for _ in range(2)]
        for step in range(1, 30):
            argmax = random.choice(pool)
            logits = torch.randn(6, 12) * random.choice([1.0, 30.0])
            got = ours.update(step, argmax, float(entropy(logits).mean()), torch.ones(6, dtype=torch.bool))
            want = bool(theirs(argmax[None], logits[None])[0])
            assert (got == CONFIDENT) == want


def test_plateau_fires_after_n_identical_masks_only_when_entropy_is_low():
    a = lambda: torch.randint(3, 50, (8,))  # argmax keeps changing: never "confident"
    mask = torch.rand(8) > 0.5
    rules = _rules(plateau_steps=8, plateau_entropy=0.05)
    reasons = [rules.update(k, a(), 0.02, mask) for k in range(1, 9)]
    assert reasons == [None] * 7 + [PLATEAU]
    rules = _rules(plateau_steps=8, plateau_entropy=0.05)
    assert all(rules.update(k, a(), 0.06, mask) is None for k in range(1, 20))  # entropy too high
    rules = _rules(plateau_steps=8, plateau_entropy=0.05)
    for k in range(1, 8):
        assert rules.update(k, a(), 0.02, mask) is None
    assert rules.update(8, a(), 0.02, ~mask) is None  # the run restarts on a changed mask


def test_entropy_stop_waits_for_min_steps():
    rules = _rules(entropy_stop=0.05, entropy_stop_min_steps=12)
    reasons = [rules.update(k, torch.randint(3, 50, (8,)), 0.03, torch.rand(8) > 0.5) for k in range(1, 13)]
    assert reasons == [None] * 11 + [ENTROPY]


def test_pad_gate_refuses_all_pad_and_filler_argmax():
    pad = random.randint(0, 2)
    degenerate = torch.tensor([pad, FILLER_ID, pad, pad])
    for gate, expected in ((True, None), (False, CONFIDENT)):
        rules = _rules(pad_gate=gate, pad_ids=(pad, FILLER_ID), entropy_stop=0.05, entropy_stop_min_steps=1,
                       plateau_steps=2, plateau_entropy=0.05)
        rules.update(1, degenerate, 0.0, torch.ones(4, dtype=torch.bool))
        assert rules.update(2, degenerate, 0.0, torch.ones(4, dtype=torch.bool)) == expected
    rules = _rules(pad_gate=True, pad_ids=(pad, FILLER_ID), max_steps=3)
    for k in (1, 2):
        rules.update(k, degenerate, 0.0, torch.ones(4, dtype=torch.bool))
    assert rules.update(3, degenerate, 0.0, torch.ones(4, dtype=torch.bool)) == MAX_STEPS  # gate never blocks max
    rules = _rules(pad_gate=True, pad_ids=(pad, FILLER_ID))
    mixed = torch.tensor([pad, 7, pad, pad])
    rules.update(1, mixed, 0.0, torch.ones(4, dtype=torch.bool))
    assert rules.update(2, mixed, 0.0, torch.ones(4, dtype=torch.bool)) == CONFIDENT


# ---------------------------------------------------------------------------- self-conditioning

def test_exact_soft_embed_matches_float64_definition():
    v, h = 50, 12
    emb = torch.randn(v, h)
    logits = torch.randn(7, v) * 4
    ref = torch.softmax(logits.double(), -1) @ emb.double() * math.sqrt(h)
    assert torch.allclose(exact_soft_embed(logits, emb, math.sqrt(h)).double(), ref, atol=1e-5)


def test_sparse_soft_embed_within_stated_bound_of_exact(capsys):
    v, h, c = 4096, 64, 16
    emb = torch.randn(v, h) * 0.05
    # LM-like rows: a few strong candidates, a long tail a few nats below, varied sharpness
    logits = torch.randn(c, v) * 1.5
    logits[:, :8] += 10 + torch.rand(c, 1) * 8
    scale = math.sqrt(h)
    exact = exact_soft_embed(logits.double(), emb.double(), scale)
    sparse = sparse_soft_embed(logits, emb, scale, 10.0).double()
    delta = (sparse - exact).abs().max().item()
    bound = sparse_error_bound(logits, emb, scale, 10.0)
    kept = survivors(logits, 10.0).sum(-1).double().mean().item()
    with capsys.disabled():
        print(f"\n[sparse SC] V={v} survivors/row={kept:.0f}: max|sparse-exact|={delta:.3e} bound={bound:.3e}")
    assert delta <= bound + 1e-6  # + float32 accumulation
    assert 0 < kept < v
    # with every token surviving the two paths agree to float32 rounding
    assert torch.allclose(sparse_soft_embed(logits, emb, scale, 1e6).double(), exact, atol=1e-5)


# ----------------------------------------------------------------------------------------- trim

def test_trim_cuts_at_first_low_confidence_duplicate_row():
    ids = torch.tensor([5, 9, 9, 4, 4, 8, 8, 3])
    conf = torch.tensor([0.99, 0.99, 0.95, 0.99, 0.5, 0.99, 0.3, 0.2])
    assert trim_cut(ids, conf, 0.9, 8) == 4  # row 2 duplicates but is confident; row 4 is unsure + duplicate
    assert trim_cut(ids, conf, 0.9, 4) is None  # row 4 lies outside the answer region
    assert trim_cut(ids, conf, 0.0, 8) is None  # tau 0 disables
    lonely = torch.tensor([5, 6, 7, 8])
    assert trim_cut(lonely, torch.full((4,), 0.1), 0.9, 4) is None  # unsure but no duplicate: keep
    first = torch.tensor([5, 5, 6])
    assert trim_cut(first, torch.tensor([0.1, 0.99, 0.99]), 0.9, 3) is None  # row 0 is never cut
    nxt = torch.tensor([1, 2, 3, 3])
    assert trim_cut(nxt, torch.tensor([0.99, 0.99, 0.5, 0.99]), 0.9, 4) == 2  # duplicates its right neighbour
