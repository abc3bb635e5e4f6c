"""GPU checks for the one-sync generate loop on the fast engine (skips without CUDA).

- Syncs per step: with torch.cuda.set_sync_debug_mode("warn") every synchronizing CUDA call warns; between two
  denoise steps of one block exactly one may happen (the loop's packed status read), forward included.
- Fused vs torch step: the Triton row-stats step and the torch step (the CPU semantics) give the same tokens
  on a tiny and a mid-size random engine (exact SC, where both paths see bit-identical tempered logits), or part
  only on a shown near-tie of entropies.
- The sparse SC gather kernel: the CPU twin's bits, the same on every run; seeded generate repeats its tokens.
- The tempered row-stats / survivor kernels at the real shape [256, 262144] against their torch twins;
  with -s, their time next to the torch step's.
"""

import random
import warnings
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma import generation  # noqa: E402
from diffgemma.config import ModelConfig  # noqa: E402
from diffgemma.core import engine as engine_mod, lanes as lanes_mod  # noqa: E402
from diffgemma.generation import StepEvent, generate_stream  # noqa: E402
from diffgemma.model import denoiser as denoiser_mod  # noqa: E402
from diffgemma.model.engine import build_engine  # noqa: E402
from diffgemma.ops import rowstats, softcap, tempered_tables  # noqa: E402
from diffgemma.sampling.accept import accept_mask  # noqa: E402
from diffgemma.sampling import stats as stats_mod  # noqa: E402
from diffgemma.sampling.stats import StepStats  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

from bench.fixtures import RandomSource  # noqa: E402
from tiny_checkpoints import CONFIGS, MID  # noqa: E402

DEV = "cuda"

TINY = CONFIGS["gqa2_mixed"]


def make_engine(tc, canvas):
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": dict(tc, model_type="diffusion_gemma_text"),
                                 "canvas_length": canvas})
    return build_engine(cfg, RandomSource(cfg, DEV, torch.bfloat16, seed=random.getrandbits(31), std=0.05), DEV,
                        torch.bfloat16, prefill_chunk=256)


def settings(**kw):
    base = dict(max_denoising_steps=8, max_new_tokens=3 * 64, seed=random.getrandbits(32))
    base.update(kw)
    return GenerationSettings.resolve({}, env={}, overrides=base)


@pytest.fixture(scope="module", params=["tiny", "mid"])
def engine(request):
    return make_engine(TINY, 8) if request.param == "tiny" else make_engine(MID, 64)


ARMS = [{}, {"sc_mode": "exact"}, {"semantics": "hf"}, {"freeze": True}, {"confidence_trim": 0.0}]


@pytest.mark.parametrize("arm", range(len(ARMS)))
def test_at_most_one_sync_per_denoise_step(engine, arm, monkeypatch):
    s = settings(**ARMS[arm])
    V = engine.config.vocab_size
    prompt = torch.randint(4, V, (37,), device=DEV)
    cache = engine.new_cache(1024, rewind_slack=512)  # the timed run rewinds past the warm-up's answer
    # warm-up with the same seed on the same cache: graph captures and Triton compiles happen here
    list(generate_stream(engine, prompt, settings=s, cache=cache))
    cache.truncate(len(prompt))
    torch.cuda.synchronize()
    reads = []
    original = denoiser_mod.read_status
    monkeypatch.setattr(denoiser_mod, "read_status",
                        lambda *a, **k: (reads.append(1), original(*a, **k))[1])
    per_step = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            prev = None
            mark = 0
            for event in generate_stream(engine, [], settings=s, cache=cache):
                if isinstance(event, StepEvent):
                    syncs = [w for w in caught[mark:] if "synchroniz" in str(w.message).lower()]
                    if prev is not None and (event.block, event.attempt) == (prev.block, prev.attempt):
                        per_step.append((len(syncs), [str(w.message)[:120] + f" @{w.filename}:{w.lineno}" for w in syncs]))
                    prev, mark = event, len(caught)
                else:
                    mark = len(caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert per_step, "no two consecutive steps in one block"
    counts = [n for n, _ in per_step]
    print(f"\n[generate syncs {ARMS[arm]}] steps checked {len(per_step)}: syncs per step {sorted(set(counts))}")
    worst = max(per_step, key=lambda x: x[0])
    assert max(counts) <= 1, worst[1]
    assert len(reads) >= len(per_step)


def recording(log: list):
    """The engine core's lane_stats, also keeping each lane's logits, temperature and softcap in `log` (one entry a
    denoise step of a solo request)."""

    def lane_stats(asks, logits):
        log.extend((x.clone(), ask.temp, ask.den.cap) for ask, x in zip(asks, logits))
        return lanes_mod.lane_stats(asks, logits)

    return lane_stats


def near_tie(h: torch.Tensor, bound: float, accepted: int, tol: float) -> bool:
    """Whether the accept mask of entropies h sat on a near-tie: the last accepted and the first refused entropy
    within tol of each other (their order decides which is accepted), or a prefix sum within tol of the bound."""
    s = h.double().sort().values
    before = s.cumsum(0) - s
    gaps = [abs(before[accepted - 1].item() - bound)]
    if accepted < len(s):
        gaps += [(s[accepted] - s[accepted - 1]).item(), abs(before[accepted].item() - bound)]
    return min(gaps) < tol


@pytest.mark.parametrize("sc_mode", ["exact"])
def test_fused_step_gives_the_torch_step_tokens(engine, sc_mode, monkeypatch):
    """The fused row-stats step and the torch step give the same drafts, masks and tokens. Their entropies differ
    by float rounding (~1e-6), so where two positions' entropies nearly tie, the two paths may accept different
    ones and the runs part. That is allowed only when it is shown: up to the parting step both runs saw the same
    logits, the drafts there are equal, each mask is what the accept rule makes of its own path's entropies on
    those logits, the entropies agree within 1e-4, and the decision sat on a near-tie (within 1e-4)."""
    s = settings(sc_mode=sc_mode)
    prompt = torch.randint(4, engine.config.vocab_size, (29,), device=DEV)
    log: list = []
    monkeypatch.setattr(engine_mod, "lane_stats", recording(log))
    fused = [e for e in generate_stream(engine, prompt, settings=s)]
    monkeypatch.setattr(engine_mod, "lane_stats", lanes_mod.lane_stats)
    monkeypatch.setattr(stats_mod, "use_triton", lambda t: False)  # the CPU semantics' step, same forward
    plain = [e for e in generate_stream(engine, prompt, settings=s)]
    a = [e for e in fused if isinstance(e, StepEvent)]
    b = [e for e in plain if isinstance(e, StepEvent)]
    assert len(log) == len(a)
    parted = next((i for i, (x, y) in enumerate(zip(a, b))
                   if not (torch.equal(x.draft, y.draft) and torch.equal(x.accepted, y.accepted))), None)
    for x, y in zip(a[:parted], b[:parted]):
        assert abs(x.mean_entropy - y.mean_entropy) < 1e-4
    if parted is None:
        assert len(a) == len(b)
        assert fused[-1].result.tokens == plain[-1].result.tokens
        print(f"\n[fused vs torch step] {len(a)} steps, {len(fused[-1].result.tokens)} tokens identical")
        return
    x, y = a[parted], b[parted]
    assert torch.equal(x.draft, y.draft), f"step {parted}: the drafts differ (z and its argmax are the same bits)"
    logits, temp, cap = log[parted]
    h_fused = StepStats(logits, temp, fused=True, cap=cap).entropy
    h_torch = StepStats(logits, temp, fused=False, cap=cap).entropy
    bound = s.entropy_bound
    assert torch.equal(accept_mask(h_fused, bound), x.accepted) and torch.equal(accept_mask(h_torch, bound), y.accepted)
    assert (h_fused.double() - h_torch.double()).abs().max().item() < 1e-4
    assert near_tie(h_torch, bound, int(y.accepted.sum()), 1e-4), (h_torch.tolist(), y.accepted.tolist())
    print(f"\n[fused vs torch step] identical for {parted} steps, then parted on a near-tie of entropies")


def timed(fn, n=20) -> float:
    """ms a call of fn, CUDA events around n back-to-back calls after one warm-up (printed with -s, not asserted)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def test_tempered_rowstats_real_shape():
    logits = torch.tanh(torch.randn(256, 262144, device=DEV) * 0.5) * 30
    temp = 0.6083333492279053
    got = rowstats.tempered_rowstats_triton(logits, temp)
    exp = rowstats.tempered_rowstats_ref(logits, temp)
    assert torch.equal(got[1], exp[1]) and torch.equal(got[2], exp[2])
    assert (got[0] - exp[0]).abs().max().item() < 1e-3 and (got[3] - exp[3]).abs().max().item() < 1e-4
    thr = exp[2] - 10.0
    m, c = rowstats.tempered_survivors_triton(logits, temp, thr)
    me, ce = rowstats.tempered_survivors_ref(logits, temp, thr)
    assert torch.equal(m, me) and torch.equal(c, ce)
    probs = rowstats.tempered_masked_probs_triton(logits, temp, thr, exp[3], torch.bfloat16)
    want = rowstats.tempered_masked_probs_ref(logits, temp, thr, exp[3], torch.bfloat16)
    assert torch.equal(probs == 0, want == 0)
    assert ((probs.float() - want.float()).abs() <= 8e-3 * want.float().abs() + 1e-30).all()

    fused_ms = timed(lambda: StepStats(logits, temp, fused=True))
    torch_ms = timed(lambda: StepStats(logits, temp, fused=False))
    surv_ms = timed(lambda: rowstats.tempered_survivors_triton(logits, temp, thr))
    one_ms = timed(lambda: rowstats.tempered_rowstats_triton(logits, temp, segment=logits.shape[1]))
    probs_ms = timed(lambda: rowstats.tempered_masked_probs_triton(logits, temp, thr, exp[3], torch.bfloat16))
    probs_torch_ms = timed(lambda: rowstats.tempered_masked_probs_ref(logits, temp, thr, exp[3], torch.bfloat16))
    print(f"\n[step stats 256x262144 f32] fused {fused_ms:.3f} ms (one program per row: {one_ms:.3f}), "
          f"torch {torch_ms:.3f} ms, survivors {surv_ms:.3f} ms, masked probs {probs_ms:.3f} ms "
          f"(torch {probs_torch_ms:.3f})")


def test_row_passes_on_raw_logits_real_shape():
    """The passes generate now runs on the raw bf16 logits (cap=) against the same passes over the softcap kernel's f32
    logits, at the real shape: the same values (the table is the kernel's), so the same z, row max, argmax, survivors
    and (given the same lse) probabilities; entropy and lse to float rounding (a 16-bit load is laid out otherwise,
    and the sums ordered otherwise). With -s, the time of softcap + stats against stats from the raw logits."""
    raw = (torch.randn(256, 262144, device=DEV) * 12).to(torch.bfloat16)
    cap, temp = 30.0, 0.6083333492279053
    # the table: each bf16 pattern's softcap, as the kernel gives it at any place of a row (patterns shuffled)
    pats = torch.randperm(1 << 16, device=DEV)
    vals = torch.where(pats >= 1 << 15, pats - (1 << 16), pats).to(torch.int16).view(torch.bfloat16)
    torch.testing.assert_close(softcap.softcap(vals.reshape(1, -1), cap).reshape(-1),
                               tempered_tables.softcap_table(cap, raw)[pats], rtol=0, atol=0, equal_nan=True)
    capped = softcap.softcap(raw, cap)
    want = rowstats.tempered_rowstats_triton(capped, temp)
    got = rowstats.tempered_rowstats_triton(raw, temp, cap=cap)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-6)
    thr = want[2] - 6.0
    m, c = rowstats.tempered_survivors_triton(raw, temp, thr, cap=cap)
    me, ce = rowstats.tempered_survivors_triton(capped, temp, thr)
    assert torch.equal(m, me) and torch.equal(c, ce)
    p, pc = rowstats.tempered_masked_probs_triton(raw, temp, thr, want[3], torch.bfloat16, count=True, cap=cap)
    pe, pce = rowstats.tempered_masked_probs_triton(capped, temp, thr, want[3], torch.bfloat16, count=True)
    assert torch.equal(p, pe) and torch.equal(pc, pce)
    stats = StepStats(raw, temp, cap=cap)
    assert stats.fused and torch.equal(stats.processed, capped / torch.tensor(temp, device=DEV))
    rows, cols = torch.randint(0, 256, (1000,), device=DEV), torch.randint(0, 262144, (1000,), device=DEV)
    assert torch.equal(stats.softcapped(raw[rows, cols]), capped[rows, cols])

    before = timed(lambda: StepStats(softcap.softcap(raw, cap), temp))
    after = timed(lambda: StepStats(raw, temp, cap=cap))
    surv_before = timed(lambda: rowstats.tempered_survivors_triton(capped, temp, thr))
    surv_after = timed(lambda: rowstats.tempered_survivors_triton(raw, temp, thr, cap=cap))
    print(f"\n[step stats 256x262144] softcap + stats {before:.3f} ms, stats from raw bf16 {after:.3f} ms; "
          f"survivors from f32 {surv_before:.3f} ms, from raw {surv_after:.3f} ms")


@pytest.mark.parametrize("arm", [{"sc_mode": "exact"}, {}])
def test_generate_on_raw_logits_gives_the_softcapped_loop(engine, arm, monkeypatch):
    """generate on the engine's denoise_raw (the sampler softcaps as it reads) against the loop on denoise's f32
    logits. The first step sees the same logits on both paths: the same draft, entropies to float rounding (the row
    sums are ordered otherwise, see test_row_passes_on_raw_logits_real_shape). From there a random model's runs may
    part: an accept mask on a near-tie of entropies, or (sparse SC) survivors weighed with a differently rounded
    lse, moves the next step's input; the CPU test (interpreted, where the sums agree) compares whole runs."""
    s = settings(**arm)
    prompt = torch.randint(4, engine.config.vocab_size, (23,), device=DEV)
    a = next(e for e in generate_stream(engine, prompt, settings=s) if isinstance(e, StepEvent))
    monkeypatch.setattr(engine, "options", replace(engine.options, softcap_in_sampler=False))
    b = next(e for e in generate_stream(engine, prompt, settings=s) if isinstance(e, StepEvent))
    assert (a.block, a.step, b.block, b.step) == (0, 1, 0, 1)
    assert torch.equal(a.draft, b.draft) and abs(a.mean_entropy - b.mean_entropy) < 1e-5


def test_segment_kernel_is_the_cpu_twin_and_repeats():
    """The sparse SC's segmented sum on the GPU: bit-identical to its chunked twin run on the CPU, and the same on
    every run (index_add_ on CUDA is not: its atomics add in a different order each time)."""
    from diffgemma.ops import sc_gather

    R, V, H = 256, 20000, 2816
    mask = torch.rand(R, V, device=DEV) < 0.004  # ~80 survivors a row
    emb = (torch.randn(V, H, device=DEV) * 0.02).to(torch.bfloat16)
    mask[7, :5000] = True  # a flat row: 157 chunks
    rows, cols = mask.nonzero(as_tuple=True)
    w = torch.rand(rows.shape[0], device=DEV)
    got = sc_gather.segment_embed_triton(mask.sum(-1), cols, w, emb)
    want = sc_gather.segment_embed_chunked_ref(mask.sum(-1).cpu(), cols.cpu(), w.cpu(), emb.cpu(), sc_gather.CHUNK)
    assert torch.equal(got.cpu(), want)
    assert all(torch.equal(sc_gather.segment_embed_triton(mask.sum(-1), cols, w, emb), got) for _ in range(5))


def test_seeded_generate_repeats_its_tokens(engine):
    """Replayable sessions: the same seed and prompt give the same tokens on the GPU, on fresh caches, with the
    default (sparse) self-conditioning, whose gather on small vocabularies runs every step."""
    s = settings()
    prompt = torch.randint(4, engine.config.vocab_size, (29,), device=DEV)
    runs = [generate_stream(engine, prompt, settings=s) for _ in range(3)]
    tokens = [[e for e in r][-1].result.tokens for r in runs]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) > 0


@pytest.mark.parametrize("dense", [True, False])
def test_sparse_sc_in_the_engines_dead_logits_buffer_changes_no_token(engine, monkeypatch, dense):
    """The sparse SC writes its dense fallback's probabilities (forced here) or its survivor mask (the gather, which
    small vocabularies take) into the graph's raw-logits buffer, dead between a denoise's softcap and the next
    replay (Engine.logits_scratch): every step is lent the buffer, and the tokens are those of a run that
    allocates fresh ones. That is the loop on denoise's softcapped logits (softcap_in_sampler off): on the raw
    logits the buffer is the step's logits themselves, and nothing is lent."""
    from diffgemma.sampling.self_condition import SparsePlan

    monkeypatch.setattr(engine, "options", replace(engine.options, softcap_in_sampler=False))

    if dense:
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 0)
    s = settings()
    prompt = torch.randint(4, engine.config.vocab_size, (29,), device=DEV)
    lent, real = [], SparsePlan.__init__

    def spy(self, stats, log_ratio, dense_dtype=None, scratch=None, **kw):
        lent.append(scratch is not None and self_uses(scratch, stats))
        real(self, stats, log_ratio, dense_dtype, scratch, **kw)

    def self_uses(scratch, stats):
        return scratch.dtype == engine.embedding.dtype and tuple(scratch.shape) == tuple(stats.logits.shape)

    monkeypatch.setattr(SparsePlan, "__init__", spy)
    with_scratch = [e for e in generate_stream(engine, prompt, settings=s)][-1].result.tokens
    assert lent and all(lent), lent
    monkeypatch.setattr(type(engine), "logits_scratch", lambda self: None)
    without = [e for e in generate_stream(engine, prompt, settings=s)][-1].result.tokens
    assert with_scratch == without and len(with_scratch) > 0


def test_status_read_waits_for_the_main_stream_but_not_for_the_overlap():
    """The status is packed on the side stream after the main stream's work so far (here a long chain whose last
    value it reads), and the overlap queued after it (the dense SC product) still lands in order on the main stream."""
    side = denoiser_mod.SideStream(torch.device(DEV))
    a = torch.randn(2048, 2048, device=DEV)
    x = a
    for _ in range(20):  # long enough that a read racing it would see the zeros below
        x = torch.tanh(x @ a * 1e-3)
    value = torch.zeros((), dtype=torch.float64, device=DEV)
    value.copy_(x.double().sum())
    want = float(value)
    torch.cuda.synchronize()
    value.zero_()
    x = a
    for _ in range(20):
        x = torch.tanh(x @ a * 1e-3)
    value.copy_(x.double().sum())
    later = []

    def overlap():
        later.append(torch.tanh(x @ a * 1e-3).double().sum())

    got = denoiser_mod.read_status(lambda: torch.stack([value, value * 2]), overlap, side)
    assert got == [want, 2 * want]
    assert len(later) == 1 and torch.isfinite(later[0])


def test_dense_sc_product_scales_as_the_float_formula_on_the_gpu():
    from diffgemma.sampling.self_condition import SparsePlan

    probs = torch.rand(256, 16384, device=DEV).softmax(-1)
    emb = (torch.randn(16384, 2816, device=DEV) * 0.05).to(torch.bfloat16)
    scale = 2816 ** 0.5
    want = ((probs.to(torch.bfloat16) @ emb).float() * scale).to(torch.bfloat16)
    assert torch.equal(SparsePlan._product(probs, emb, scale), want)


def test_staged_forward_inputs_change_no_token(engine, monkeypatch):
    """generate stages each next forward's inputs (Engine.stage_denoise) before its status read when the dense SC
    product is what that forward takes (forced here: the small vocabularies otherwise take the gather): the same
    tokens as a run that stages nothing, and the staging did happen."""
    from diffgemma.sampling.self_condition import SparsePlan

    monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 0)
    s = settings()
    prompt = torch.randint(4, engine.config.vocab_size, (29,), device=DEV)
    staged, real = [], type(engine).stage_denoise

    def spy(self, *a, **k):
        staged.append(real(self, *a, **k))
        return staged[-1]

    monkeypatch.setattr(type(engine), "stage_denoise", spy)
    with_staging = [e for e in generate_stream(engine, prompt, settings=s)][-1].result.tokens
    assert any(staged), staged
    monkeypatch.setattr(type(engine), "stage_denoise", lambda self, *a, **k: False)
    without = [e for e in generate_stream(engine, prompt, settings=s)][-1].result.tokens
    assert with_staging == without and len(with_staging) > 0


@pytest.mark.parametrize("sc_way", ["dense", "gather", "both"])
def test_forwards_launched_ahead_change_no_token(engine, monkeypatch, sc_way):
    """generate launches each next forward before its status read, under the device's go/stop answer (EngineOptions.run_ahead),
    with the dense SC product (forced) or the gather (the small vocabularies' way) made ahead of the read, or a
    cap of ~2 survivors a row so that steps go both ways and bets are lost (a gather made ahead past its cap, then
    dropped): the same tokens as a run that launches after the read, some forwards were launched ahead, and some
    were launched with a false condition (the block's last step, where the run must not take a skipped forward's
    stale logits)."""
    from diffgemma.model.graph_guard import guard_support
    from diffgemma.sampling.self_condition import SparsePlan

    why = guard_support(torch.device(DEV))
    if why is not None:
        pytest.skip(f"no guarded graphs here: {why}")
    if sc_way != "gather":
        C, H = engine.config.canvas_length, engine.config.hidden_size
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 0 if sc_way == "dense" else 2 * C * H * 4)
    s = settings(max_denoising_steps=16)
    prompt = torch.randint(4, engine.config.vocab_size, (29,), device=DEV)
    gos, real = [], type(engine).stage_denoise

    def spy(self, *a, go=None, **k):
        launched = real(self, *a, go=go, **k)
        if launched and go is not None:
            gos.append(bool(go))  # a sync: fine in a test
        return launched

    monkeypatch.setattr(type(engine), "stage_denoise", spy)
    ahead = [e for e in generate_stream(engine, prompt, settings=s)][-1].result
    assert True in gos, gos
    if any(r != "max_steps" for r in ahead.stop_reasons):  # a block stopped on a step that had a plan: launched false
        assert False in gos, (gos, ahead.stop_reasons)
    monkeypatch.setattr(engine, "options", replace(engine.options, run_ahead=False))
    gos.clear()
    after = [e for e in generate_stream(engine, prompt, settings=s)][-1].result
    assert gos == []
    assert ahead.tokens == after.tokens and len(ahead.tokens) > 0
    assert ahead.steps_per_block == after.steps_per_block


# ~10 ms on an H200 (torch.cuda._sleep spins this many cycles): long enough that the host, running ahead, queues the
# main stream's next allocations and writes before the delayed side stream reads what it was given
SIDE_DELAY_CYCLES = 20_000_000


def test_device_lcg_draws_on_a_delayed_stream_match_the_host_lcg():
    """The canvas RNG drawn on the main stream, then on a side stream held back by a spin, while the main stream
    allocates and fills small tensors right away: the side's draws are still the host LCG's. A state replaced on
    each draw would go back to the main stream's pool here and be overwritten before the side read it."""
    from diffgemma.sampling.rng import DeviceLcg, Lcg

    seed = random.getrandbits(64)
    dev, host = DeviceLcg(seed, DEV), Lcg(seed)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    assert torch.equal(dev.randint(256, 262144).cpu(), host.randint(256, 262144))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SIDE_DELAY_CYCLES)
        drawn = dev.randint(256, 262144)
    junk = [torch.full((), -7, dtype=torch.int64, device=DEV) for _ in range(64)]
    main.wait_stream(side)
    assert torch.equal(drawn.cpu(), host.randint(256, 262144))
    assert dev.state == host.state
    del junk


ARMS_DELAYED = [{}, {"freeze": True}, {"commit": "sample"}, {"commit": "sample", "freeze": True}]


@pytest.mark.parametrize("arm", range(len(ARMS_DELAYED)))
def test_a_delayed_side_stream_changes_no_token(engine, monkeypatch, arm):
    """generate's bookkeeping stream held back by a spin at every fork (so the main stream's work and allocations run
    well ahead of it) gives the tokens of a run with no side stream at all, with the freeze mask and with sampling
    (whose temperature scalar the gather made ahead reads on the main stream). An RNG state the main stream
    reused before the side read it would change the first step's noise."""
    from diffgemma.sampling.self_condition import SparsePlan

    s = settings(max_denoising_steps=12, **ARMS_DELAYED[arm])
    monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 1 << 40)  # every step takes the gather (ahead, with graphs)
    prompt = torch.randint(4, engine.config.vocab_size, (29,), device=DEV)
    real_fork = denoiser_mod.SideStream.fork

    def delayed_fork(self):
        ctx = real_fork(self)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(SIDE_DELAY_CYCLES)
        return ctx

    monkeypatch.setattr(denoiser_mod.SideStream, "fork", delayed_fork)
    delayed = [[e for e in generate_stream(engine, prompt, settings=s)][-1].result for _ in range(2)]
    monkeypatch.setattr(denoiser_mod.SideStream, "__init__", lambda self, device: setattr(self, "stream", None))
    one_stream = [e for e in generate_stream(engine, prompt, settings=s)][-1].result
    for run in delayed:
        assert run.tokens == one_stream.tokens and len(one_stream.tokens) > 0
        assert run.steps_per_block == one_stream.steps_per_block


FIRST_RUNS = r"""
import json, os, sys
import torch
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # tests/ and the repo root (bench.fixtures)
from tiny_checkpoints import MID
from diffgemma.config import ModelConfig
from diffgemma.generation import generate_stream
from diffgemma.model.engine import build_engine
from bench.fixtures import RandomSource
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.settings import GenerationSettings

seed = int(sys.argv[2])
SparsePlan.gather_bytes_limit = 1 << 40  # every step takes the gather, made ahead with graphs
cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": 64,
                             "text_config": dict(MID, model_type="diffusion_gemma_text")})
eng = build_engine(cfg, RandomSource(cfg, "cuda", torch.bfloat16, seed=seed, std=0.05), "cuda", torch.bfloat16,
                   prefill_chunk=256)
s = GenerationSettings.resolve({}, env={}, overrides=dict(max_denoising_steps=12, max_new_tokens=3 * 64, seed=seed))
prompt = torch.randint(4, cfg.vocab_size, (29,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
print(json.dumps([[e for e in generate_stream(eng, prompt, settings=s)][-1].result.tokens for _ in range(3)]))
"""


def test_a_fresh_process_first_seeded_generate_gives_the_later_runs_tokens():
    """Every other test here generates after earlier tests warmed the process up: this one starts a fresh process
    and compares its first three seeded runs (a race on the first run's state would show here)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    seed = random.getrandbits(31)
    tests_dir = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", FIRST_RUNS, tests_dir, str(seed)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) > 0, f"seed {seed}"


def test_a_warmed_cache_replays_its_graphs_and_gives_a_fresh_caches_tokens(engine, monkeypatch):
    """serve --warmup: warm_up captures the denoise graphs of every context bucket on the cache itself, so the
    requests after it capture none; and a warmed cache, emptied, gives a fresh cache's tokens in each bucket."""
    from diffgemma.warmup import warm_up

    s = settings()
    C = engine.config.canvas_length
    cache = engine.new_cache(2600)
    warm_up(engine, cache, s)
    assert cache.length == 0
    # full canvases only: a re-rolled first block (empty_reply_retry) denoises a shrunk canvas, which the warm-up
    # captures only when its own generation happens to re-roll
    assert {key[1] - key[0] for key in engine._graphs[cache] if key[0] == C} == {1024, 2048, 2600}
    captures = []
    inner = engine._capture
    monkeypatch.setattr(engine, "_capture",
                        lambda *a, **k: (a[1] == C and captures.append(a[1])) or inner(*a, **k))
    for n in (29, 1500, 2300):  # one prompt in each bucket
        prompt = torch.randint(4, engine.config.vocab_size, (n,), device=DEV)
        cache.truncate(0)
        warmed = generation.generate(engine, prompt, settings=s, cache=cache).tokens
        assert not captures, f"a {n}-token prompt captured a graph on the warmed cache"
        fresh = generation.generate(engine, prompt, settings=s, cache=engine.new_cache(2600)).tokens
        assert warmed == fresh and warmed, n
        captures.clear()
