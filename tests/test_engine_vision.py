"""Image prefill on the fast engine (its torch twins on the CPU) against the reference model.

On the tiny random multimodal checkpoints of tests/tiny_vision.py (two towers, two text configs): the engine in f32
with an f32 KV cache, given the same merged embeddings and image groups, must leave the reference's K/V in its cache
and give the reference's next denoise logits, with one and two images in the prompt and with prefill chunks that
end inside an image (the engine moves such a chunk end to the image's edge). hf-preset generation with an image
through Session is token-identical; malformed embeds / image_groups are one-line InputErrors.
"""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

import diffgemma  # noqa: E402
from diffgemma.errors import InputError  # noqa: E402
from diffgemma.model.engine import Engine  # noqa: E402
from diffgemma.model.engine_inputs import prefill_chunks  # noqa: E402
from diffgemma.model.forward import Forward  # noqa: E402
from diffgemma.vision.merge import image_groups, image_placeholder, image_runs, merge_image_embeddings  # noqa: E402
from diffgemma.vision.preprocess import prepare_images  # noqa: E402
from diffgemma.vision.tower import VisionTower  # noqa: E402
from tiny_vision import VISION_CONFIGS, build_model, random_image, save  # noqa: E402

# f32 on both sides, the same math re-associated (fused norms, flash-style vs plain softmax): K/V agree to ~1e-6
# and the logits to ~1e-5 (measured worst 1.4e-5 over these cases); a forgotten image rule, a chunk that splits an
# image or a misplaced embedding row costs O(0.1-10) (the causal check below shows the rule's size).
TOL_KV = 1e-4
TOL_LOGITS = 1e-4
SIZES = [(50, 37), (61, 90)]


@pytest.fixture(scope="module", params=sorted(VISION_CONFIGS))
def ckpt(request, tmp_path_factory):
    name = request.param
    path = save(build_model(name), name, tmp_path_factory.mktemp(name))
    ref = diffgemma.load(path)
    return ref, VisionTower.from_checkpoint(path)


def image_prompt(ref, tower, n_images, seed=0):
    """(ids, embeds, groups): text, then n images each followed by text; embeds merged from the tower."""
    cfg, V = tower.config, ref.config.vocab_size
    prepared = prepare_images([random_image(h, w, seed=20 + i) for i, (h, w) in enumerate(SIZES[:n_images])],
                              cfg.processing)
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, V - 3, (5,), generator=gen)]
    for i, im in enumerate(prepared):
        parts += [torch.tensor(image_placeholder(im.num_soft_tokens, cfg)),
                  torch.randint(0, V - 3, (4 + i,), generator=gen)]
    ids = torch.cat(parts)
    embeds = merge_image_embeddings(ref.embed(ids), ids, tower.encode(prepared), cfg)
    return ids, embeds, image_groups(ids, cfg)


def run(model, ids, embeds, groups, canvas, prefix=None, cache_tokens=512):
    cache = model.new_cache(cache_tokens)
    if prefix is not None:  # text already cached: the image rows' keys past the cache start
        model.prefill(cache, prefix)
    model.prefill(cache, ids, embeds=embeds, image_groups=groups)
    return cache, model.denoise(cache, canvas)


def kv_error(ref_cache, eng_cache) -> float:
    """Worst |ΔK|, |ΔV| over every layer: full layers row by row, sliding layers slot by slot (the ring)."""
    T, worst = ref_cache.length, 0.0
    slots = eng_cache.slot_pos
    live = torch.nonzero(slots >= 0).flatten()
    for li, layer in enumerate(ref_cache.cfg.layers):
        for e, r in ((eng_cache.keys[li], ref_cache.keys[li]), (eng_cache.values[li], ref_cache.values[li])):
            if layer.is_sliding:
                got, want = e[:, live].float(), r[:, slots[live]].float()
            else:
                got, want = e[:, :T].float(), r.float()
            worst = max(worst, (got - want).abs().max().item())
    return worst


@pytest.mark.parametrize("n_images,chunk,prefix", [(1, 8192, 0), (2, 8192, 0), (1, 13, 0), (2, 31, 6), (2, 8192, 9)])
def test_engine_image_prefill_matches_reference(ckpt, n_images, chunk, prefix):
    ref, tower = ckpt
    ids, embeds, groups = image_prompt(ref, tower, n_images, seed=n_images)
    runs = image_runs(ids, tower.config.image_token_id)
    assert min(e - s for s, e in runs) > ref.config.sliding_window  # the image rule must beat the window
    if chunk < 8192:  # some chunk boundary of the plain split falls inside an image
        assert any(s < b < e for s, e in runs for b in range(chunk, len(ids), chunk))
    V, C = ref.config.vocab_size, ref.config.canvas_length
    gen = torch.Generator().manual_seed(7)
    canvas = torch.randint(0, V, (C,), generator=gen)
    pre = torch.randint(0, V - 3, (prefix,), generator=gen) if prefix else None
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32, prefill_chunk=chunk)
    ref_cache, want = run(ref, ids, embeds, groups, canvas, pre)
    eng_cache, got = run(eng, ids, embeds, groups, canvas, pre)
    assert eng_cache.length == ref_cache.length == len(ids) + prefix
    err_kv = kv_error(ref_cache, eng_cache)
    assert err_kv <= TOL_KV, f"max |ΔKV| = {err_kv:.3g}"
    err = (got - want).abs().max().item()
    assert err <= TOL_LOGITS, f"max |Δlogits| = {err:.3g}"
    # The next block's text prefill on top (the padded / ordinary path) still agrees.
    block = torch.randint(0, V - 3, (C,), generator=gen)
    ref.prefill(ref_cache, block)
    eng.prefill(eng_cache, block)
    err2 = (eng.denoise(eng_cache, canvas) - ref.denoise(ref_cache, canvas)).abs().max().item()
    assert err2 <= TOL_LOGITS, f"block 2: max |Δlogits| = {err2:.3g}"
    # The test can tell the image rule apart: the engine with image tokens left causal is far off.
    _, causal = run(eng, ids, embeds, None, canvas, pre)
    assert (causal - want).abs().max().item() > 100 * TOL_LOGITS


def test_chunks_never_end_inside_an_image():
    groups = torch.tensor([-1] * 3 + [0] * 10 + [-1] * 2 + [1] * 4 + [-1] * 6)  # images at [3, 13) and [15, 19)
    for chunk in range(1, 30):
        bounds = prefill_chunks(len(groups), chunk, groups)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(groups)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
        for s, e in bounds:
            assert e not in (4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 17, 18), (chunk, bounds)
            assert e - s <= chunk or (groups[s] >= 0 and (s == 0 or groups[s - 1] != groups[s])), (chunk, bounds)
    assert prefill_chunks(7, 3, None) == [(0, 3), (3, 6), (6, 7)]
    assert prefill_chunks(25, 5, groups) == [(0, 3), (3, 13), (13, 15), (15, 20), (20, 25)]


def test_engine_embeds_without_groups_is_the_plain_prefill(ckpt):
    ref, tower = ckpt
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size - 3, (11,))
    canvas = torch.randint(0, ref.config.vocab_size, (ref.config.canvas_length,))
    plain, merged = eng.new_cache(64), eng.new_cache(64)
    eng.prefill(plain, ids)
    eng.prefill(merged, ids, embeds=eng.embed(ids), image_groups=torch.full((11,), -1))
    assert torch.equal(eng.denoise(plain, canvas), eng.denoise(merged, canvas))


def test_bad_image_inputs_are_one_line_errors(ckpt):
    ref, _ = ckpt
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32)
    H, T = ref.config.hidden_size, 6
    ids = torch.randint(0, ref.config.vocab_size - 3, (T,))
    cases = [
        (dict(embeds=torch.zeros(T, H + 1)), r"embeds is \[6, %d\].*expected a floating \[6, %d\]" % (H + 1, H)),
        (dict(embeds=torch.zeros(T - 1, H)), r"embeds is \[5, %d\]" % H),
        (dict(embeds=torch.zeros(T, H, dtype=torch.long)), "expected a floating"),
        (dict(embeds=[[0.0] * H] * T), "embeds is list"),
        (dict(image_groups=torch.zeros(T + 1, dtype=torch.long)), r"image_groups is \[7\].*expected a \[6\] integer"),
        (dict(image_groups=torch.zeros(T)), "image_groups is .*float32"),
        (dict(image_groups=torch.full((T,), -2)), "holds -2"),
    ]
    for kw, message in cases:
        cache = eng.new_cache(64)
        with pytest.raises(InputError, match=message) as e:
            eng.prefill(cache, ids, **kw)
        assert "\n" not in str(e.value)
        assert cache.length == 0 and int(cache.length_t) == 0  # nothing written


def test_hf_preset_generate_with_an_image_engine_equals_reference(tmp_path):
    """A Session with images, hf semantics, seeded: the engine (f32, f32 KV) gives the reference's tokens, turn by
    turn (a second image after the first turn, whose KV is reused). Every expert routed and the SC MLP damped, so f32
    re-association cannot flip a routing choice."""
    from diffgemma.session import Session
    from diffgemma.settings import GenerationSettings
    from test_hf_generate_parity import KNOBS, STOP_IDS
    from test_vision_chat import hf_preset_checkpoint

    hf_preset_checkpoint(tmp_path)
    ref = diffgemma.load(tmp_path, engine="reference")
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32)
    content = [{"type": "image", "image": random_image(30, 41, seed=3)}, {"type": "text", "text": "Say"}]
    other = [{"type": "image", "image": random_image(41, 30, seed=4)}, {"type": "text", "text": "And"}]
    replies = []
    for seed in (3, 7):
        settings = GenerationSettings.resolve({}, env={}, overrides=dict(
            semantics="hf", seed=seed, max_new_tokens=16, stop_ids=STOP_IDS, **KNOBS["max_steps"]))
        # a conversation: an image, then another image on top of the first turn (its KV reused)
        sessions = Session(ref), Session(eng)
        for turn in (content, other):
            want, got = (s.ask(turn, settings=settings).result.tokens for s in sessions)
            assert got == want, f"seed {seed}, turn {turn!r}"
            replies.append(want)
        assert sessions[1].cached_ids == sessions[0].cached_ids and min(sessions[0].cached_ids) < 0  # same keys
    assert sum(map(len, replies)) >= 24 and replies[0] != replies[1]
