"""generate with one host sync per denoise step: the device-side pieces against their host twins, the whole
loop against the pre-fusion host loop, and a count of every host read the loop makes.

- DeviceLcg / temperature_value / DeviceStopRules / the sync-free freeze mask / SparsePlan: bit-identical
  to Lcg / temperature() / StopRules / the subset freeze rule / sparse_soft_embed.
- The tempered row-stats and survivor kernels (Triton interpreter) against their torch twins.
- The loop: generate_stream with core/steps._denoise_block swapped for the host-sync loop it replaced gives the same
  events and results (torch path), and the fused (Triton-interpreted) path gives the same tokens.
- The sync count: every Python-level way to read a tensor on the host (item/tolist/bool/float/int/index/
  numpy, torch.equal, nonzero, boolean-mask indexing) is counted outside the model's own forward; between
  two steps of a block only the denoiser's `read_status` may read, once; per attempt a `BlockRead` reads once.
"""

import os
import random
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from diffgemma.core import steps as steps_mod
from diffgemma.errors import TensorError
from diffgemma.generation import BlockEvent, DoneEvent, StepEvent, generate_stream
from diffgemma.model import denoiser as denoiser_mod
from diffgemma.ops import rowstats, softcap, tempered_tables
from diffgemma.sampling import stats as stats_mod
from diffgemma.sampling.accept import accept_mask, accept_mask_frozen_reference
from diffgemma.sampling.rng import DeviceLcg, Lcg, categorical
from diffgemma.sampling.schedule import remaining, temperature, temperature_value
from diffgemma.sampling.self_condition import SparsePlan, sparse_soft_embed
from diffgemma.sampling.stats import StepStats, entropy, max_prob
from diffgemma.sampling.stops import REASONS, DeviceStopRules, StopRules
from diffgemma.settings import GenerationSettings
from stop_cases import random_rules


# ---------------------------------------------------------------------------------- device pieces

def test_device_lcg_draws_are_bit_identical_to_the_host_lcg():
    seeds = [0, 2**63 - 1, 2**63, 2**64 - 1] + [random.getrandbits(64) for _ in range(20)]
    for seed in seeds:
        host, dev = Lcg(seed), DeviceLcg(seed)
        for n, high in [(8, 96), (300, 262144), (5, 2**32), (7, 2**31 + 5), (1, 1), (600, 3)]:
            assert torch.equal(dev.randint(n, high), host.randint(n, high)), (seed, n, high)
        assert torch.equal(dev.uniform(33), host.uniform(33))
        assert dev.state == host.state


def test_device_lcg_moves_its_state_in_place():
    """The state tensor is written, never replaced: generate draws on two CUDA streams, and a replaced state would go
    back to the allocator while the other stream's read of it may still be queued (tests/gpu: the race itself)."""
    dev = DeviceLcg(random.getrandbits(64))
    state, ptr = dev._state, dev._state.data_ptr()
    dev.randint(300, 262144)
    dev.uniform(7)
    assert dev._state is state and dev._state.data_ptr() == ptr


def test_temperature_value_is_the_float32_schedule_bit_for_bit():
    for _ in range(3000):
        n = random.randint(1, 300)
        cur = random.randint(1, n)
        t_min, t_max = sorted(random.uniform(0.01, 3.0) for _ in range(2))
        assert temperature_value(cur, n, t_min, t_max) == float(temperature(cur, n, t_min, t_max))
    for cur in range(1, 49):
        assert temperature_value(cur, 48, 0.4, 0.8) == float(temperature(cur, 48, 0.4, 0.8))


def test_device_stop_rules_match_the_host_rules():
    for _ in range(300):
        kw = dict(random_rules(), max_steps=random.randint(1, 30))
        host, dev = StopRules(**kw), DeviceStopRules(**kw)
        pool = [torch.randint(0, 10, (6,)) for _ in range(2)] + [torch.tensor([0, 9, 0, 0, 9, 0])]
        masks = [torch.rand(6) > 0.5 for _ in range(2)]
        for step in range(1, kw["max_steps"] + 1):
            argmax, mask = random.choice(pool), random.choice(masks)
            h = torch.rand(6) * random.choice([0.001, 0.1, 1.0])
            want = host.update(step, argmax, float(h.mean()), mask)
            code = dev.update(step, argmax, h.mean().double(), mask)
            assert code.shape == () and code.dtype == torch.int64
            assert REASONS[int(code)] == want, (kw, step)
            if want:
                break


def test_device_stop_rules_compare_mean_entropy_in_float64():
    # the default 0.005 rounds DOWN to float32: a float32 mean equal to float32(0.005) is below 0.005 in
    # float64 (the host rule's comparison) but not in float32
    f32 = torch.tensor(0.005, dtype=torch.float32)
    assert float(f32) < 0.005 and not bool(f32 < f32)
    kw = dict(max_steps=10, stability_threshold=0, confidence_threshold=0.005)
    assert REASONS[int(DeviceStopRules(**kw).update(1, torch.zeros(3), f32.double(), torch.ones(3, dtype=torch.bool)))] \
        == StopRules(**kw).update(1, torch.zeros(3), float(f32), torch.ones(3, dtype=torch.bool)) == "confident"


def test_sync_free_freeze_mask_matches_the_subset_rule_with_ties():
    for _ in range(500):
        n = random.randint(1, 40)
        h = torch.rand(n) * random.random() * 0.3
        if random.random() < 0.5:
            h = h.round(decimals=2)  # many ties
        frozen = torch.rand(n) < random.random()
        bound = random.choice([0.0, 0.05, 0.1, 1.0])
        assert torch.equal(accept_mask(h, bound, frozen=frozen), accept_mask_frozen_reference(h, bound, frozen))
    assert accept_mask(torch.rand(4), 0.1, frozen=torch.ones(4, dtype=torch.bool)).all()


def _logits(rows, vocab, peaks=True):
    x = torch.tanh(torch.randn(rows, vocab) * 3) * 30
    if peaks:  # some confident rows, a tie, a flat row
        x[0, random.randrange(vocab)] = 30.0
        j, k = random.sample(range(vocab), 2)
        x[1, j] = x[1, k] = 29.0
        x[2] = random.uniform(-3, 3)
    return x


@pytest.mark.parametrize("vocab", [96, 3001])
def test_tempered_rowstats_kernel_matches_its_twin_and_the_loop_entropy(vocab):
    x = _logits(6, vocab)
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    got = rowstats.tempered_rowstats_triton(x, temp, block=1024)
    ent, amax, rmax, lse = rowstats.tempered_rowstats_ref(x, temp)
    z = x / torch.tensor(temp)
    assert torch.equal(got[1], amax) and torch.equal(got[1], z.argmax(-1))  # exact: correctly rounded z
    assert torch.equal(got[2], rmax) and torch.equal(got[2], z.max(-1).values)
    truth = entropy(z.double())
    assert (got[0].double() - truth).abs().max() < 2e-6  # tighter than the f32 torch formula
    assert (ent.double() - truth).abs().max() < 5e-5
    assert (got[3].double() - torch.logsumexp(z.double(), -1)).abs().max() < 1e-5
    thr = rmax - 10.0
    mask, counts = rowstats.tempered_survivors_triton(x, temp, thr, block=1024)
    want_mask, want_counts = rowstats.tempered_survivors_ref(x, temp, thr)
    assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)
    assert torch.equal(mask, z >= z.max(-1, keepdim=True).values - 10.0)


def test_segmented_row_kernels_match_their_twins_across_segment_boundaries():
    """Rows cut into segments (one program each, partials combined): the row max, its first column and the
    survivor mask stay exact, ties across segments resolve to the lower column, a max in the last (short)
    segment is found, and entropy / lse agree with one segment per row to float rounding."""
    vocab, block, segment = 3001, 256, 512  # 6 segments per row, the last one short
    x = _logits(6, vocab)
    x[3, 100] = x[3, 2900] = 40.0  # tie across segments 0 and 5: the lower column wins
    x[4, 2999] = 45.0  # the max in the short last segment
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    one = rowstats.tempered_rowstats_triton(x, temp, block=block, segment=vocab)
    many = rowstats.tempered_rowstats_triton(x, temp, block=block, segment=segment)
    ent, amax, rmax, lse = rowstats.tempered_rowstats_ref(x, temp)
    assert torch.equal(many[1], amax) and torch.equal(many[2], rmax)
    assert many[1][3].item() == 100 and many[1][4].item() == 2999
    z = (x / torch.tensor(temp)).double()
    assert (many[0].double() - entropy(z)).abs().max() < 2e-6 and (many[0] - one[0]).abs().max() < 2e-6
    assert (many[3].double() - torch.logsumexp(z, -1)).abs().max() < 1e-5

    thr = rmax - random.uniform(2.0, 12.0)
    mask, counts = rowstats.tempered_survivors_triton(x, temp, thr, block=block, segment=segment)
    want_mask, want_counts = rowstats.tempered_survivors_ref(x, temp, thr)
    assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)

    for dtype in (torch.float32, torch.bfloat16):
        probs = rowstats.tempered_masked_probs_triton(x, temp, thr, lse, dtype, block=block, segment=segment)
        want = rowstats.tempered_masked_probs_ref(x, temp, thr, lse, dtype)
        assert probs.dtype == dtype and torch.equal(probs == 0, want == 0)  # the same survivors
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # the kernel's exp vs torch's: ulps, then bf16 rounding
        assert ((probs.float() - want.float()).abs() <= tol * want.float().abs() + 1e-30).all()
        # the counting variant (the sparse SC's bet on the dense product): the same probabilities, and the
        # survivor kernel's counts
        counted, n_kept = rowstats.tempered_masked_probs_triton(x, temp, thr, lse, dtype, block=block, segment=segment,
                                                               count=True)
        assert torch.equal(counted, probs) and torch.equal(n_kept, want_counts)

    raw = torch.randn(3, vocab) * 40
    got = softcap.softcap_rowstats_triton(raw, 30.0, 1.0, stats=False, block=block, segment=segment)[0]
    torch.testing.assert_close(got, softcap.softcap_ref(raw, 30.0), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("segment", [512, 1 << 14])
def test_row_passes_softcap_raw_logits_as_they_read_them(segment):
    """cap=: each pass reads the raw bf16 logits (the engine's denoise_raw) and softcaps them itself with the softcap
    kernel's own function, so every result has the bits of the same pass over softcap(raw) as the softcap kernel
    stores it: the f32 logits generate no longer writes. The twins agree with their own softcap first."""
    vocab, block, cap = 3001, 256, 30.0
    raw = (torch.randn(5, vocab) * 20).to(torch.bfloat16)  # |raw| past the cap: tanh saturates on some
    raw[1, 7] = raw[1, 2000] = raw[1].float().max() + 1.0  # a tie, across segments when they are short
    raw[2, 11] = 300.0  # exp(2·raw/cap) overflows inside the softcap: 30.0 exactly
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    capped = softcap.softcap_rowstats_triton(raw, cap, 1.0, stats=False, block=block, segment=segment)[0]
    want = rowstats.tempered_rowstats_triton(capped, temp, block=block, segment=segment)
    got = rowstats.tempered_rowstats_triton(raw, temp, block=block, segment=segment, cap=cap)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[1][1].item() == 7 and got[2][2].item() == pytest.approx(cap / temp)
    thr = want[2] - random.uniform(1.0, 8.0)
    mask, counts = rowstats.tempered_survivors_triton(raw, temp, thr, block=block, segment=segment, cap=cap)
    want_mask, want_counts = rowstats.tempered_survivors_triton(capped, temp, thr, block=block, segment=segment)
    assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts) and 0 < int(counts.sum()) < raw.numel()
    for dtype in (torch.float32, torch.bfloat16):
        for count in (False, True):
            kw = dict(block=block, segment=segment, count=count)
            a = rowstats.tempered_masked_probs_triton(raw, temp, thr, want[3], dtype, cap=cap, **kw)
            b = rowstats.tempered_masked_probs_triton(capped, temp, thr, want[3], dtype, **kw)
            assert all(torch.equal(x, y) for x, y in zip(a, b)) if count else torch.equal(a, b)
    # the twins: cap= is their own softcap first, and the kernels stay within float rounding of them
    pats = torch.randperm(1 << 16)  # the table: every pattern's softcap as the kernel gives it, at any place
    vals = torch.where(pats >= 1 << 15, pats - (1 << 16), pats).to(torch.int16).view(torch.bfloat16).reshape(1, -1)
    torch.testing.assert_close(softcap.softcap_rowstats_triton(vals, cap, 1.0, stats=False, block=block)[0][0],
                               tempered_tables.softcap_table(cap, raw)[pats], rtol=0, atol=0, equal_nan=True)
    ref = softcap.softcap_ref(raw, cap)
    twin = rowstats.tempered_rowstats_ref(raw, temp, cap)
    assert all(torch.equal(x, y) for x, y in zip(twin, rowstats.tempered_rowstats_ref(ref, temp)))
    assert torch.equal(twin[1], got[1]) and (twin[3] - got[3]).abs().max() < 1e-4
    assert torch.equal(rowstats.tempered_survivors_ref(raw, temp, thr, cap)[0],
                       rowstats.tempered_survivors_ref(ref, temp, thr)[0])
    assert torch.equal(rowstats.tempered_masked_probs_ref(raw, temp, thr, want[3], torch.float32, cap),
                       rowstats.tempered_masked_probs_ref(ref, temp, thr, want[3], torch.float32))


def test_tempered_table_is_the_softcap_table_divided_and_kept_for_one_temperature():
    """Each entry is the correctly rounded quotient softcap(pattern) / T (what the passes formed per value before the
    table); a repeat call at the same T returns the kept table, another T makes a new one."""
    cap = random.choice([30.0, 15.0])
    raw = torch.randn(2, 64).to(torch.bfloat16)
    t1, t2 = (temperature_value(random.randint(1, 48), 48, 0.4, 0.8) for _ in range(2))
    t2 = t2 if t2 != t1 else t1 * 0.5
    soft = tempered_tables.softcap_table(cap, raw)
    a = tempered_tables.tempered_table(cap, t1, raw)
    torch.testing.assert_close(a, soft / torch.tensor(t1), rtol=0, atol=0, equal_nan=True)
    assert tempered_tables.tempered_table(cap, t1, raw) is a
    b = tempered_tables.tempered_table(cap, t2, raw)
    assert b is not a
    torch.testing.assert_close(b, soft / torch.tensor(t2), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("unit_temp", [False, True])
def test_row_stats_on_whole_segments_match_the_twin_and_the_masked_form(unit_temp):
    """A vocabulary that is a whole number of segments takes the row-stats kernel's unmasked form (the full-size
    shape); it gives the masked form's argmax and row max exactly and its sums to float rounding, from f32 logits,
    from raw logits through the table, and at T = 1 (no division in the pass: x / 1 is x)."""
    vocab, block, segment, cap = 2048, 256, 512, 30.0
    x = _logits(5, vocab)
    x[3, 5] = x[3, 1900] = 40.0  # a tie across segments: the lower column
    x[4, vocab - 1] = 45.0  # the max in the last block
    temp = 1.0 if unit_temp else temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    whole = rowstats.tempered_rowstats_triton(x, temp, block=block, segment=segment)
    ent, amax, rmax, lse = rowstats.tempered_rowstats_ref(x, temp)
    assert torch.equal(whole[1], amax) and torch.equal(whole[2], rmax)
    assert whole[1][3].item() == 5 and whole[1][4].item() == vocab - 1
    assert (whole[0] - ent).abs().max() < 5e-5 and (whole[3] - lse).abs().max() < 1e-5
    # one column short: the masked form, whose rows must not read into the next row (each row's own max at column 0)
    y = _logits(5, vocab - 1)
    y[:, 0] = 50.0
    masked = rowstats.tempered_rowstats_triton(y, temp, block=block, segment=segment)
    ref_m = rowstats.tempered_rowstats_ref(y, temp)
    assert torch.equal(masked[1], ref_m[1]) and torch.equal(masked[2], ref_m[2])
    assert (masked[0] - ref_m[0]).abs().max() < 5e-5 and (masked[3] - ref_m[3]).abs().max() < 1e-5
    raw = (x * random.uniform(0.3, 1.5)).to(torch.bfloat16)
    capped = softcap.softcap_rowstats_triton(raw, cap, 1.0, stats=False, block=block, segment=segment)[0]
    got = rowstats.tempered_rowstats_triton(raw, temp, block=block, segment=segment, cap=cap)
    want = rowstats.tempered_rowstats_triton(capped, temp, block=block, segment=segment)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    thr = want[2] - random.uniform(1.0, 8.0)
    for dtype in (torch.float32, torch.bfloat16):
        a = rowstats.tempered_masked_probs_triton(raw, temp, thr, want[3], dtype, cap=cap, block=block, segment=segment)
        b = rowstats.tempered_masked_probs_ref(capped, temp, thr, want[3], dtype)
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        assert torch.equal(a == 0, b == 0) and ((a.float() - b.float()).abs() <= tol * b.float().abs() + 1e-30).all()


def test_step_stats_and_sparse_sc_on_raw_logits_are_those_on_softcapped_logits(monkeypatch):
    """StepStats(raw, cap=) (what generate builds from the engine's denoise_raw) against StepStats(softcap(raw)):
    on the fused path (interpreted) every field, `processed`, the values at a gather and the sparse SC's count and
    soft embedding (gather and dense product) are the same bits; on the torch path it softcaps first. A scratch that
    is the raw logits' own storage is never lent to the SC's passes."""
    monkeypatch.setattr(stats_mod, "use_triton", lambda t: True)
    for mod in (rowstats, softcap, tempered_tables):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    vocab, hidden, cap = 700, 16, 30.0
    raw = (torch.randn(4, vocab) * 15).to(torch.bfloat16)
    emb = torch.randn(vocab, hidden)
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    a, b = StepStats(raw, temp, cap=cap), StepStats(softcap.softcap(raw, cap), temp)
    assert a.fused and b.fused and a.cap == cap and b.cap is None
    for f in ("entropy", "argmax", "rowmax", "lse"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.equal(a.processed, b.processed) and torch.equal(a.max_prob(), b.max_prob())
    rows, cols = torch.randint(0, 4, (50,)), torch.randint(0, vocab, (50,))
    assert torch.equal(a.softcapped(a.logits[rows, cols]), b.logits[rows, cols])
    ratio = random.uniform(2.0, 6.0)
    for limit in (None, 0):  # the gather, then the dense product
        if limit is not None:
            monkeypatch.setattr(SparsePlan, "gather_bytes_limit", limit)
        pa, pb = SparsePlan(a, ratio), SparsePlan(b, ratio)
        n = int(pb.count)
        assert int(pa.count) == n
        assert torch.equal(pa.soft_embed(n, emb, 4.0), pb.soft_embed(n, emb, 4.0))
    assert SparsePlan(a, ratio, scratch=raw)._lent() is None  # the raw logits themselves: never written
    other = torch.empty_like(raw)
    assert SparsePlan(a, ratio, scratch=other)._lent() is other
    monkeypatch.setattr(stats_mod, "use_triton", lambda t: False)
    for mod in (rowstats, softcap, tempered_tables):
        monkeypatch.setattr(mod, "use_triton", lambda t: False)
    c = StepStats(raw, temp, cap=cap)
    assert not c.fused and c.cap is None and torch.equal(c.logits, softcap.softcap_ref(raw, cap))


def test_dense_sc_fallback_is_the_masked_softmax_product():
    """SparsePlan's dense fallback (flat rows keep most of the vocabulary) on the fused data flow equals the
    survivors' softmax times the embedding, computed directly."""
    vocab, hidden = 500, 24
    x = _logits(5, vocab, peaks=False) * 0.05  # flat rows: every token survives a 10-nat window
    temp = 0.7
    stats = StepStats(x, temp, fused=True)
    plan = SparsePlan(stats, 10.0)
    plan.gather_bytes_limit = 0  # force the dense product
    emb = torch.randn(vocab, hidden)
    got = plan.soft_embed(int(plan.count), emb, 2.5)
    z = x / torch.tensor(temp)
    keep = z >= z.max(-1, keepdim=True).values - 10.0
    want = (torch.where(keep, torch.softmax(z, -1), 0.0) @ emb) * 2.5
    assert keep.float().mean() > 0.9
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_step_stats_torch_path_is_the_pre_fusion_arithmetic():
    x = _logits(8, 96)
    temp = temperature_value(7, 16, 0.4, 0.8)
    st = StepStats(x, temp, fused=False)
    processed = x / temperature(7, 16, 0.4, 0.8)
    assert torch.equal(st.processed, processed)
    assert torch.equal(st.entropy, entropy(processed)) and torch.equal(st.argmax, processed.argmax(-1))
    assert torch.equal(st.max_prob(), max_prob(processed))
    fused = StepStats(x, temp, fused=True)  # the fused data flow (torch twins of the kernels on the CPU)
    assert torch.equal(fused.argmax, st.argmax)
    assert torch.allclose(fused.entropy, st.entropy, atol=5e-5)
    assert torch.allclose(fused.max_prob(), st.max_prob(), atol=1e-5)


def test_sparse_plan_is_bit_identical_to_sparse_soft_embed():
    emb = torch.randn(300, 16)
    for ratio in (2.0, 10.0):
        x = _logits(8, 300)
        temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
        st = StepStats(x, temp, fused=False)
        plan = SparsePlan(st, ratio)
        n = int(plan.count)
        assert torch.equal(plan.soft_embed(n, emb, 4.0), sparse_soft_embed(st.processed, emb, 4.0, ratio))
        fused = SparsePlan(StepStats(x, temp, fused=True), ratio)
        assert int(fused.count) == n
        assert torch.allclose(fused.soft_embed(n, emb, 4.0), sparse_soft_embed(st.processed, emb, 4.0, ratio),
                              atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_sparse_plan_bet_on_the_dense_product_moves_work_not_results(monkeypatch, fused):
    """dense_dtype (the loop's bet that the count will call for the dense product) gives the plain plan's
    count and soft embedding bit for bit, whichever way the count goes: a won bet (the product started
    before the read, or not), a lost one (the product dropped, the mask built after the read). On the torch
    path there is nothing to bet with, so the plan ignores it."""
    emb = torch.randn(500, 24)
    x = _logits(8, 500)
    x[3:] = torch.randn(5, 500) * 0.5  # flat rows: many survivors
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    stats = StepStats(x, temp, fused=fused)
    n = int(SparsePlan(stats, 10.0).count)
    for limit in (0, SparsePlan.gather_bytes_limit):  # the count calls for: the dense product; the gather
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", limit)
        want = SparsePlan(stats, 10.0).soft_embed(n, emb, 4.0)
        for start in (False, True):
            bet = SparsePlan(stats, 10.0, dense_dtype=emb.dtype)
            assert bet.speculative == fused and int(bet.count) == n
            if start:
                bet.start(emb, 4.0)
            assert torch.equal(bet.soft_embed(n, emb, 4.0), want), (limit, start)
            assert bet.took_dense == (limit == 0) and bet.product is None and bet.probs is None


def test_status_read_runs_the_overlap_once_and_reads_the_values():
    calls = []
    status = torch.tensor([2.0, 0.25, 7.0], dtype=torch.float64)
    read = denoiser_mod.read_status
    assert read(lambda: status, lambda: calls.append(1)) == [2.0, 0.25, 7.0] and calls == [1]
    assert read(lambda: status) == [2.0, 0.25, 7.0]
    side = denoiser_mod.SideStream(torch.device("cpu"))  # off CUDA the side stream is a no-op
    assert read(lambda: status, lambda: calls.append(2), side, lambda: calls.append(3)) == [2.0, 0.25, 7.0]
    assert calls == [1, 2, 3]


def test_sparse_plan_product_scales_as_the_float_formula():
    """The dense product's in-place scale gives the bits of the three-op formula it replaced."""
    for _ in range(3):
        probs = torch.rand(6, 96).softmax(-1)
        emb = (torch.randn(96, 40) * torch.rand(()) * 4).to(torch.bfloat16)
        scale = float(torch.rand(()) * 60 + 1)
        want = ((probs.to(torch.bfloat16) @ emb).float() * scale).to(torch.bfloat16)
        assert torch.equal(SparsePlan._product(probs, emb, scale), want)


def test_sparse_plan_gathers_in_chunks_with_the_same_sums(monkeypatch):
    """The survivors' rows summed a few at a time (gather_chunk_bytes) give the one-chunk sum bit for bit on the
    CPU (index_add_ adds in index order), and chunk edges that split a row's survivors change nothing."""
    emb = torch.randn(400, 16)
    x = _logits(8, 400)
    x[4:] = torch.randn(4, 400) * 0.5  # flat rows: many survivors
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    plan = SparsePlan(StepStats(x, temp, fused=False), 10.0)
    n = int(plan.count)
    assert n > 100
    whole = plan.soft_embed(n, emb, 4.0)
    for rows_per_chunk in (1, 7, n - 1):
        monkeypatch.setattr(SparsePlan, "gather_chunk_bytes", rows_per_chunk * emb.shape[1] * 4)
        assert torch.equal(plan.soft_embed(n, emb, 4.0), whole), rows_per_chunk


@pytest.mark.parametrize("fused", [False, True])
def test_sparse_plan_dense_fallback_sums_the_same_survivors(monkeypatch, fused):
    # flat rows keep most of the vocabulary: above the gather budget the plan takes one dense product
    emb = torch.randn(500, 24)
    x = _logits(8, 500)
    x[3:] = torch.randn(5, 500) * 0.5  # flat rows: nearly everything survives
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    plan = SparsePlan(StepStats(x, temp, fused=fused), 10.0)
    n = int(plan.count)
    gathered = plan.soft_embed(n, emb, 4.0)
    monkeypatch.setattr(SparsePlan, "gather_bytes_limit", n * emb.shape[1] * 4 - 1)
    dense = plan.soft_embed(n, emb, 4.0)
    torch.testing.assert_close(dense, gathered, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- the loop on a tiny model

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    import diffgemma
    from tiny_checkpoints import CONFIGS, build_model, save

    return diffgemma.load(save(build_model(CONFIGS["gqa2_mixed"], canvas_length=8), tmp_path_factory.mktemp("sync")))


# settings arms: every branch of the step (SC modes, sample commit, freeze, hf, stop rules, trim, retries)
ARMS = [
    {},
    {"sc_mode": "exact"},
    {"semantics": "hf"},
    {"commit": "sample", "entropy_bound": 2.0},
    {"freeze": True, "confidence_trim": 0.0},
    {"stability_threshold": 0, "confidence_threshold": 3.0, "plateau_steps": 2, "plateau_entropy": 5.0},
    {"entropy_stop": 4.0, "entropy_stop_min_steps": 3, "confidence_trim": 0.99},
]


def _settings(model, **extra):
    base = dict(max_denoising_steps=6, max_new_tokens=20, seed=random.getrandbits(32))
    base.update(extra)
    return GenerationSettings.resolve(model.generation_config, env={}, overrides=base)


def _host_sync_block(model, cache, s, rng, length, block, attempt, batched=False, grammar=None, close_from=0):
    """The step loop as it was before the one-sync rewrite (host floats, torch.equal stops): the twin (of
    unconstrained generations: a grammar is not part of what it replaced)."""
    assert grammar is None
    device = model.embedding.device
    vocab = model.config.vocab_size
    hf = s.semantics == "hf"
    stops = StopRules.from_settings(s, model.config.pad_token_id, vocab)
    canvas = rng.randint(length, vocab, device)
    frozen = torch.zeros(length, dtype=torch.bool, device=device) if s.freeze else None
    sc_logits, sc_embeds = None, (model.embed(canvas) if s.sc_seed else None)
    reason, step = None, 0
    while reason is None:
        step += 1
        cur = remaining(step, s.max_denoising_steps)
        temp = temperature(cur, s.max_denoising_steps, s.t_min, s.t_max).to(device)
        logits = model.denoise(cache, canvas, sc_logits=sc_logits, sc_embeds=sc_embeds)
        processed = logits / temp
        h = entropy(processed)
        argmax = processed.argmax(dim=-1)
        if s.commit == "sample":
            proposal = categorical(torch.softmax(processed, dim=-1, dtype=torch.float32), rng.uniform(length, device))
        else:
            proposal = argmax
        if cur == 1 and not hf:
            mask = frozen.clone() if frozen is not None else torch.zeros(length, dtype=torch.bool)
        elif frozen is not None:
            mask = accept_mask_frozen_reference(h, s.entropy_bound, frozen)
        else:
            mask = accept_mask(h, s.entropy_bound)
        if frozen is not None:
            proposal = torch.where(frozen, canvas, proposal)
            frozen = mask
        canvas = torch.where(mask, proposal, rng.randint(length, vocab, device))
        mean_h = float(h.mean())
        reason = stops.update(step, argmax, mean_h, mask)
        yield StepEvent(block=block, attempt=attempt, step=step, temperature=float(temp), draft=argmax,
                        accepted=mask, mean_entropy=mean_h, stop_reason=reason)
        if reason is None:
            if s.sc_mode == "exact":
                sc_logits, sc_embeds = processed, None
            else:
                sc_logits = None
                sc_embeds = sparse_soft_embed(processed, model.embedding, model.config.embed_scale,
                                              s.sc_sparse_log_ratio)
    committed = argmax if frozen is None else torch.where(frozen, canvas, argmax)
    return steps_mod._Proposal(committed=committed, argmax=argmax, p_max=max_prob(processed), steps=step,
                                stop_reason=reason)


def _summary(events):
    out = []
    for e in events:
        if isinstance(e, StepEvent):
            out.append(("step", e.block, e.attempt, e.step, e.temperature, e.draft.tolist(), e.accepted.tolist(),
                        e.mean_entropy, e.stop_reason))
        elif isinstance(e, BlockEvent):
            out.append(("block", e.block, e.tokens, e.steps, e.stop_reason, e.end, e.attempts, e.stop_token,
                        e.trimmed_at))
        else:
            r = e.result
            out.append(("done", r.tokens, r.steps_per_block, r.stop_reasons, r.retries, r.stop_token, r.forwards,
                        r.block_ends))
    return out


@pytest.mark.parametrize("arm", range(len(ARMS)))
def test_one_sync_loop_equals_the_host_sync_loop(tiny_model, monkeypatch, arm):
    s = _settings(tiny_model, **ARMS[arm])
    for _ in range(4):
        # a run of one step compares little: arm 5 (stability 0) may stop at step 1 with a stop token in the first
        # block, which ends the turn (3 of 3000 fresh runs; 0 of 2400 for the other arms): then another prompt
        prompt = torch.randint(4, tiny_model.config.vocab_size, (random.randint(2, 7),))
        new = _summary(generate_stream(tiny_model, prompt, settings=s))
        if sum(1 for e in new if e[0] == "step") >= 2:
            break
    monkeypatch.setattr(steps_mod, "_denoise_block", _host_sync_block)
    old = _summary(generate_stream(tiny_model, prompt, settings=s))
    assert new == old
    assert sum(1 for e in new if e[0] == "step") >= 2


def test_degenerate_first_block_retries_through_the_block_read(tiny_model, monkeypatch):
    # every id is a stop id: each attempt opens "degenerate", so all re-rolls run and the turn ends empty
    s = _settings(tiny_model, stop_ids=list(range(tiny_model.config.vocab_size)), max_denoising_steps=3)
    new = _summary(generate_stream(tiny_model, torch.tensor([5, 6, 7]), settings=s))
    monkeypatch.setattr(steps_mod, "_denoise_block", _host_sync_block)
    assert new == _summary(generate_stream(tiny_model, torch.tensor([5, 6, 7]), settings=s))
    assert new[-1][4] == 3 and new[-1][1] == []  # three retries, no tokens


@pytest.mark.parametrize("sc_mode", ["exact", "sparse"])
def test_fused_triton_step_gives_the_torch_path_tokens(tiny_model, monkeypatch, sc_mode):
    """The fused path (Triton row stats + survivor kernels, interpreted on the CPU) vs the torch path.

    Exact SC sees bit-identical tempered logits on both paths, so everything must match. Sparse SC uses
    the kernel's lse (float rounding away), which the chaotic random model may amplify: there only the
    first step of each block is compared exactly."""
    s = _settings(tiny_model, sc_mode=sc_mode)
    prompt = torch.randint(4, tiny_model.config.vocab_size, (4,))
    torch_path = [e for e in generate_stream(tiny_model, prompt, settings=s)]
    monkeypatch.setattr(stats_mod, "use_triton", lambda t: True)
    for mod in (rowstats, softcap, tempered_tables):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    fused_path = [e for e in generate_stream(tiny_model, prompt, settings=s)]
    steps_a = [e for e in torch_path if isinstance(e, StepEvent)]
    steps_b = [e for e in fused_path if isinstance(e, StepEvent)]
    if sc_mode == "exact":
        assert torch_path[-1].result.tokens == fused_path[-1].result.tokens
        pairs = list(zip(steps_a, steps_b))
        assert len(steps_a) == len(steps_b)
    else:
        pairs = [(steps_a[0], steps_b[0])]
    for a, b in pairs:
        assert a.draft.tolist() == b.draft.tolist() and a.accepted.tolist() == b.accepted.tolist()
        assert a.mean_entropy == pytest.approx(b.mean_entropy, abs=1e-5)


@pytest.mark.parametrize("limit", [0, None])
def test_fused_loop_bets_change_no_event(tiny_model, monkeypatch, limit):
    """The loop's dense-product bet (SparsePlan dense_dtype) on the fused path, interpreted on the CPU: every
    event equals the loop's without bets. limit 0: every step takes the dense product, so the bets are won;
    the default limit: the tiny model always gathers, so every bet is lost."""
    s = _settings(tiny_model)
    prompt = torch.randint(4, tiny_model.config.vocab_size, (4,))
    monkeypatch.setattr(stats_mod, "use_triton", lambda t: True)
    for mod in (rowstats, softcap, tempered_tables):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    if limit is not None:
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", limit)
    bets = []
    real_init = SparsePlan.__init__

    def spy(self, stats, log_ratio, dense_dtype=None, scratch=None, **kw):
        bets.append(dense_dtype is not None)
        real_init(self, stats, log_ratio, dense_dtype, scratch, **kw)

    monkeypatch.setattr(SparsePlan, "__init__", spy)
    with_bets = _summary(generate_stream(tiny_model, prompt, settings=s))
    assert bets and all(bets) == (limit == 0) and bets[0]  # the first step of a block always bets
    monkeypatch.setattr(SparsePlan, "__init__", lambda self, stats, log_ratio, dense_dtype=None, scratch=None, **kw:
                        real_init(self, stats, log_ratio, None, scratch))
    assert with_bets == _summary(generate_stream(tiny_model, prompt, settings=s))


@pytest.mark.parametrize("fused", [False, True])
def test_engine_steps_on_raw_logits_give_the_softcapped_steps_events(tiny_model, monkeypatch, fused):
    """generate on the engine calls denoise_raw and leaves the softcap to the sampler (StepStats(cap=)): every
    event and result equals the loop on denoise's softcapped logits (softcap_in_sampler off), on the torch path
    and on the fused (interpreted) one, for the default sparse SC and exact SC."""
    from diffgemma.model.engine import Engine

    # bf16: raw logits the passes read through their softcap table (f32 ones are softcapped first)
    eng = Engine.from_reference(tiny_model, dtype=torch.bfloat16 if fused else torch.float32)
    if fused:
        monkeypatch.setattr(stats_mod, "use_triton", lambda t: True)
        for mod in (rowstats, softcap, tempered_tables):
            monkeypatch.setattr(mod, "use_triton", lambda t: True)
    softcapped = []  # the loop's calls of denoise (which itself calls denoise_raw)
    real = eng.denoise

    def spy(*a, **k):
        softcapped.append(1)
        return real(*a, **k)

    monkeypatch.setattr(eng, "denoise", spy)
    prompt = torch.randint(4, tiny_model.config.vocab_size, (4,))
    for arm in ({}, {"sc_mode": "exact"}):
        s = _settings(tiny_model, **arm)
        raw_path = _summary(generate_stream(eng, prompt, settings=s))
        assert not softcapped
        eng.options = replace(eng.options, softcap_in_sampler=False)
        assert raw_path == _summary(generate_stream(eng, prompt, settings=s))
        assert softcapped
        softcapped.clear()
        eng.options = replace(eng.options, softcap_in_sampler=True)


def test_loop_holds_one_steps_logits_at_a_time(tiny_model, monkeypatch):
    """When a step's forward starts, the previous step's logits are gone (nothing in the loop, e.g. the sparse SC's
    bet on the dense product, still holds them): at full size each is a 256 MiB f32 [C, V]."""
    import weakref

    s = _settings(tiny_model)
    monkeypatch.setattr(stats_mod, "use_triton", lambda t: True)  # the fused path, where the loop bets
    for mod in (rowstats, softcap, tempered_tables):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 0)  # every bet won: the product is started
    inner = tiny_model.denoise
    alive = []

    def denoise(*a, **k):
        assert all(r() is None for r in alive), "a previous step's logits are still alive"
        out = inner(*a, **k)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(tiny_model, "denoise", denoise)
    list(generate_stream(tiny_model, torch.randint(4, tiny_model.config.vocab_size, (4,)), settings=s))
    assert len(alive) >= 3


# ------------------------------------------------------------------------------------ sync count

class SyncCounter:
    """Counts Python-level host reads of tensors, except inside `quiet()` (the model, the allowed reads)."""

    METHODS = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero",
               "__array__", "cpu"]

    def __init__(self, monkeypatch):
        self.count = 0
        self.where: list[str] = []
        self._quiet = 0
        for name in self.METHODS:
            self._wrap(monkeypatch, torch.Tensor, name)
        for name in ["equal", "nonzero", "unique", "masked_select", "isin"]:
            self._wrap(monkeypatch, torch, name)
        original_getitem = torch.Tensor.__getitem__

        def getitem(t, idx):  # boolean-mask indexing is a nonzero in disguise
            items = idx if isinstance(idx, tuple) else (idx,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
                self._hit("__getitem__[bool]")
            return original_getitem(t, idx)

        monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)

    def _hit(self, name):
        if not self._quiet:
            self.count += 1
            self.where.append(name)

    def _wrap(self, monkeypatch, owner, name):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self._hit(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    @contextmanager
    def quiet(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def silence(self, monkeypatch, owner, name, calls: list | None = None):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if calls is not None:
                calls.append(name)
            with self.quiet():
                return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("arm", range(len(ARMS)))
def test_one_host_read_per_step_and_one_per_block_attempt(tiny_model, monkeypatch, arm):
    model = tiny_model
    s = _settings(model, **ARMS[arm])
    prompt = torch.randint(4, model.config.vocab_size, (5,))
    counter = SyncCounter(monkeypatch)
    status_reads, block_reads = [], []
    for name in ("denoise", "prefill", "embed"):  # the forward is not the loop's to count
        counter.silence(monkeypatch, model, name)
    counter.silence(monkeypatch, denoiser_mod, "read_status", status_reads)
    counter.silence(monkeypatch, steps_mod.BlockRead, "run", block_reads)

    stream = generate_stream(model, prompt, settings=s)
    first = next(stream)  # prompt checks (range of input ids) happen before the first step: call-level
    assert isinstance(first, StepEvent)
    counter.count, counter.where = 0, []
    prev = first
    reads_at_prev = len(status_reads)
    steps, attempts = 1, 1
    assert reads_at_prev == 1
    for event in stream:
        if isinstance(event, StepEvent):
            steps += 1
            if (event.block, event.attempt) == (prev.block, prev.attempt):
                assert counter.count == 0, counter.where  # nothing else read between two steps of a block
                assert len(status_reads) - reads_at_prev == 1  # exactly one status read per step
            else:
                attempts += 1
            reads_at_prev = len(status_reads)
            prev = event
        elif isinstance(event, DoneEvent):
            result = event.result
    assert counter.count == 0, counter.where  # block bookkeeping reads only through its BlockRead
    assert len(status_reads) == steps == result.forwards
    assert len(block_reads) == attempts == len(result.steps_per_block) + result.retries


def test_the_counter_sees_the_reads_it_claims_to(monkeypatch):
    counter = SyncCounter(monkeypatch)
    t = torch.rand(4)
    float(t[0]), bool(t.any()), t.tolist(), torch.equal(t, t), t[t > 0.5], t.nonzero(), int(t.argmax())
    assert counter.count == 7, counter.where
    with counter.quiet():
        t[0].item()
    assert counter.count == 7


def test_dense_sc_writes_its_probabilities_into_a_lent_scratch(monkeypatch):
    """SparsePlan(scratch=): the dense fallback's probabilities go into the lent buffer (the engine's dead raw-logits
    buffer) on the bet path and after the read alike, with the same soft embedding bit for bit; a buffer of the wrong
    dtype or shape is not used; the kernels' out= refuses a wrong buffer by name."""
    monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 0)  # every count calls for the dense product
    vocab, hidden = 500, 24
    x = _logits(6, vocab, peaks=False) * 0.05
    stats = StepStats(x, 0.7, fused=True)
    emb = torch.randn(vocab, hidden)
    n = int(SparsePlan(stats, 10.0).count)
    want = SparsePlan(stats, 10.0).soft_embed(n, emb, 2.5)
    for dense_dtype in (None, emb.dtype):  # after the read / the bet before it
        scratch = torch.full((6, vocab), float("nan"))
        plan = SparsePlan(stats, 10.0, dense_dtype=dense_dtype, scratch=scratch)
        assert torch.equal(plan.soft_embed(n, emb, 2.5), want)
        assert not scratch.isnan().any() and scratch.sum(-1).sub(1).abs().max() < 1e-4  # the masked softmax
    wrong = torch.full((6, vocab), float("nan"), dtype=torch.float64)
    assert torch.equal(SparsePlan(stats, 10.0, dense_dtype=emb.dtype, scratch=wrong).soft_embed(n, emb, 2.5), want)
    assert wrong.isnan().all()
    with pytest.raises(TensorError, match=r"out must be a contiguous \[6, 500\]"):
        rowstats.tempered_masked_probs(x, 0.7, stats.rowmax - 10, stats.lse, torch.float32, out=torch.empty(6, 499))


def test_survivor_mask_kernel_writes_into_a_lent_buffer():
    """tempered_survivors_triton(out=): the mask in the given int8 buffer (the sparse SC lends it the first C·V bytes
    of the engine's dead raw-logits buffer: SparsePlan._scratch_mask), the same mask and counts as a new one."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    x = _logits(4, 3000)
    thr = x.max(-1).values / 0.7 - 3.0
    mask, counts = rowstats.tempered_survivors_triton(x, 0.7, thr, block=512, segment=1024)
    scratch = torch.zeros(4, 3000, dtype=torch.bfloat16)
    buf = scratch.view(-1).view(torch.int8)[: 4 * 3000].view(4, 3000)
    got, got_counts = rowstats.tempered_survivors_triton(x, 0.7, thr, block=512, segment=1024, out=buf)
    assert torch.equal(got, mask) and torch.equal(got_counts, counts) and got.data_ptr() == scratch.data_ptr()
    plan = SparsePlan(StepStats(x, 0.7, fused=True), 3.0, scratch=scratch)
    assert plan._scratch_mask().data_ptr() == scratch.data_ptr()
    assert SparsePlan(StepStats(x, 0.7, fused=True), 3.0, scratch=scratch[:, :100].contiguous())._scratch_mask() is None


def test_each_block_drops_the_engines_staging(tiny_model, monkeypatch):
    """generate tells the engine to forget a forward staged (or launched ahead) at a block's last step, once per
    denoised canvas (a re-rolled attempt included): a staging left alive would keep a finished block's graph, and
    with it a dead cache's, alive into the next capture."""
    from diffgemma.model.engine import Engine

    eng = Engine.from_reference(tiny_model, dtype=torch.float32)
    drops = []
    monkeypatch.setattr(eng, "drop_staged", lambda: drops.append(1))
    s = _settings(tiny_model)
    prompt = torch.randint(4, tiny_model.config.vocab_size, (4,))
    result = [e for e in generate_stream(eng, prompt, settings=s)][-1].result
    assert len(drops) == len(result.steps_per_block) + result.retries > 0


def test_models_implement_the_protocol(tiny_model):
    """Both models generate() drives are DenoiseModels, and their denoisers Denoisers (model/protocol.py)."""
    from diffgemma.model.engine import Engine
    from diffgemma.model.protocol import DenoiseModel, Denoiser, KVCache

    for model in (tiny_model, Engine.from_reference(tiny_model, dtype=torch.float32)):
        assert isinstance(model, DenoiseModel)
        cache = model.new_cache(16)
        assert isinstance(cache, KVCache) and isinstance(model.denoiser([cache]), Denoiser)
    two = [tiny_model.new_cache(16), tiny_model.new_cache(16)]
    assert isinstance(tiny_model.denoiser(two), Denoiser)  # the reference batches (tests/test_batch.py)
    assert isinstance(model.denoiser([cache, model.new_cache(16)]), Denoiser)  # so does the engine
    with pytest.raises(Exception, match="a cache appears twice"):
        model.denoiser([cache, cache])


def test_engine_options_reach_the_engine_through_load():
    """load(options=) hands the fast engine its EngineOptions, keywords override single fields, an unknown field is a
    clear error, and the reference model takes none."""
    import diffgemma
    from diffgemma.errors import InputError
    from diffgemma.model.engine import Engine

    eng = diffgemma.load(None, engine="fast", dtype=torch.float32,
                         options=diffgemma.EngineOptions(prefill_chunk=5, launch_order=False))
    assert isinstance(eng, Engine) and eng.options.prefill_chunk == 5 and not eng.forward.options.launch_order
    assert eng.options.graphs is None and not eng.use_graphs  # graphs only on CUDA
    ref = diffgemma.load(None)
    assert Engine.from_reference(ref, dtype=torch.float32, prefill_chunk=7).forward.options.prefill_chunk == 7
    with pytest.raises(InputError, match="no_such_choice"):
        Engine.from_reference(ref, dtype=torch.float32, no_such_choice=1)
    with pytest.raises(InputError, match="options"):
        diffgemma.load(None, engine="reference", options=diffgemma.EngineOptions())
