"""The padded prefill (Forward.prefill_padded: a block's commit and short prefills, graph-captured on CUDA) against the
unpadded eager prefill, run eagerly on the CPU through the same padded code.

A padded call must leave the cache as the unpadded one does: the same length (host and device), the same ring slot
positions, the same live K/V (f32 rounding: the padded call's GEMMs see more rows), the ring's older slots (what a
rewind needs) untouched by pad rows, and the same next denoise logits.
"""

import random

import pytest
import torch

from bench.fixtures import RandomSource
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine
from tiny_checkpoints import CONFIGS

CANVAS = 8
TOL = 1e-4  # f32: rounding moves these values by ~1e-6; a wrong mask, position or slot moves them by O(0.1)


def make_engine(name, **kw):
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": CANVAS,
                                 "text_config": dict(CONFIGS[name], model_type="diffusion_gemma_text")})
    return build_engine(cfg, RandomSource(cfg, "cpu", torch.float32, seed=7, std=0.3), "cpu", torch.float32,
                        kv_dtype=torch.float32, **kw)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine(request):
    return make_engine(request.param)


def ring_contents(cache):
    """Every ring slot holding a position: (positions, K and V rows of every sliding layer there)."""
    held = (cache.slot_pos >= 0).nonzero().flatten()
    rows = [t[:, held] for li, layer in enumerate(cache.cfg.layers) if layer.is_sliding
            for t in (cache.keys[li], cache.values[li])]
    return cache.slot_pos[held], rows


def assert_same_cache(a, b, what):
    assert a.length == b.length and int(a.length_t) == int(b.length_t) == a.length, what
    assert torch.equal(a.slot_pos, b.slot_pos), f"{what}: ring slot positions differ"
    for i, (x, y) in enumerate(zip(a.live_kv(), b.live_kv())):
        err = (x - y).abs().max().item() if x.numel() else 0.0
        assert err <= TOL, f"{what}: live K/V {i} differs by {err:.3g}"
    (pa, ra), (pb, rb) = ring_contents(a), ring_contents(b)
    assert torch.equal(pa, pb)
    for x, y in zip(ra, rb):  # older slots too: a rewind reads them
        assert (x - y).abs().max().item() <= TOL, f"{what}: a held ring slot differs"


@pytest.mark.parametrize("trial", range(3))
def test_padded_prefill_gives_the_unpadded_cache(engine, trial):
    rng = random.Random(trial)
    V, ring = engine.config.vocab_size, CANVAS + engine.config.sliding_window - 1
    prompt = torch.randint(0, V, (rng.randint(1, 3 * ring),))  # a prompt longer than the ring runs unpadded
    blocks = [torch.randint(0, V, (rng.randint(1, CANVAS),)) for _ in range(6)]
    canvas = torch.randint(0, V, (CANVAS,))
    try:
        engine.padded_prefill = False
        ref = engine.new_cache(256)
        got = engine.new_cache(256)
        engine.prefill(ref, prompt)
        engine.padded_prefill = True
        engine.prefill(got, prompt)
        assert_same_cache(got, ref, "prompt")
        for b, ids in enumerate(blocks):
            engine.padded_prefill = False
            engine.prefill(ref, ids)
            engine.padded_prefill = True
            assert engine.prefill_pad(got, len(ids)) == CANVAS  # this call does run padded
            engine.prefill(got, ids)
            assert_same_cache(got, ref, f"block {b} ({len(ids)} tokens)")
        err = (engine.denoise(got, canvas) - engine.denoise(ref, canvas)).abs().max().item()
        assert err <= 1e-3, f"next denoise logits differ by {err:.3g}"
        # a rewind within the slack reads the older ring slots: the padded rows must not have touched them
        back = got.length - rng.randint(1, CANVAS)
        got.truncate(back)
        ref.truncate(back)
        assert_same_cache(got, ref, "after a rewind")
    finally:
        engine.padded_prefill = None


def test_padded_prefill_fills_a_cache_to_the_brim():
    eng = make_engine("gqa2_mixed", padded_prefill=True)
    ref = make_engine("gqa2_mixed", padded_prefill=False)
    V = eng.config.vocab_size
    a, b = eng.new_cache(20), ref.new_cache(20)
    for n in (7, 8, 5):  # 20 tokens: the last call's pad rows run past max_tokens into the canvas scratch rows
        ids = torch.randint(0, V, (n,))
        eng.prefill(a, ids)
        ref.prefill(b, ids)
        assert_same_cache(a, b, f"{n} tokens")
    assert a.length == 20


def test_prefill_pad_choice():
    eng = make_engine("mha_realsplit", padded_prefill=True, prefill_pads=(11, 13))
    cache = eng.new_cache(64)  # ring = 8 + 7 - 1 = 14
    assert [eng.prefill_pad(cache, n) for n in (1, 8, 9, 11, 12, 13, 14)] == [8, 8, 11, 11, 13, 13, None]
    eng.padded_prefill = False
    assert eng.prefill_pad(cache, 3) is None
    eng.padded_prefill = None  # off CUDA: unpadded
    assert eng.prefill_pad(cache, 3) is None
    eng.padded_prefill = True
    eng.prefill(cache, torch.zeros(60, dtype=torch.long))
    # 4 tokens left: pad rows may run into the full layers' canvas scratch rows (64 + 8), no further
    assert eng.prefill_pad(cache, 4) == 8 and eng.prefill_pad(cache, 9) == 11 and eng.prefill_pad(cache, 12) is None


@pytest.mark.parametrize("padded", [False, True])
def test_short_prefills_on_the_tile_form_give_the_reference_cache(engine, padded, monkeypatch):
    """options.causal_tiles_rows: short prefills' attention (both layer kinds) on the tile kernels' torch twin (what
    CUDA runs; forced here on the CPU) against the reference attention: the prompt (a long one in unpadded chunks,
    its short tail on the tiles), then commits, padded and not. The twin rounds P to f16 twice, so the caches agree
    to f16 rounding, not f32; a wrong mask, window, position or key set moves them by O(0.1)."""
    from diffgemma.ops import attention as attn

    rng = random.Random(5)
    V, ring = engine.config.vocab_size, CANVAS + engine.config.sliding_window - 1
    prompt = torch.randint(0, V, (2 * ring + 3,))
    blocks = [torch.randint(0, V, (rng.randint(1, CANVAS),)) for _ in range(5)]
    old = engine.options
    caches = {}
    try:
        for rows in (0, CANVAS):
            engine.options = old
            engine.padded_prefill, engine.prefill_chunk, engine.causal_tiles_rows = padded, ring, rows
            with monkeypatch.context() as m:
                m.setattr(attn, "_canvas_only_ok", lambda q, causal, impl: not causal or impl == "tiles")
                cache = caches[rows] = engine.new_cache(256)
                engine.prefill(cache, prompt)
                for ids in blocks:
                    engine.prefill(cache, ids)
    finally:
        engine.options = old
    a, b = caches[0], caches[CANVAS]
    assert a.length == b.length and torch.equal(a.slot_pos, b.slot_pos)
    for i, (x, y) in enumerate(zip(a.live_kv(), b.live_kv())):
        err = (x - y).abs().max().item()
        print(i, err, x.abs().max().item())
        assert err <= 2e-2 * max(1.0, x.abs().max().item()), f"live K/V {i} differs by {err:.3g}"
