"""Image input against transformers, on tiny random multimodal checkpoints (two vision configs).

Covers: preprocessing identical to transformers' Gemma-4 image processor (bit for bit, several sizes and
modes, path / bytes / PIL input); vision features (tower + projector) within 1e-4 in float32; the
denoise logits after a prefill with one and two images within the text parity bound (1e-3) in
float32, which checks the merge and the bidirectional image rule, and within 1e-4 of a float64
forward; bad images, bad configs and a checkpoint missing a tower tensor failing with one clear error
and nothing loaded; the tower read from a quantized pack.
"""

import io
import struct
import zlib

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

import diffgemma  # noqa: E402
from diffgemma.errors import ConfigError, InputError, TensorError  # noqa: E402
from diffgemma.vision.config import VisionConfig  # noqa: E402
from diffgemma.vision.merge import image_groups, image_placeholder, image_runs, merge_image_embeddings  # noqa: E402
from diffgemma.vision.preprocess import num_soft_tokens, pad_batch, prepare_image, prepare_images  # noqa: E402
from diffgemma.vision.tower import VisionTower  # noqa: E402
from tiny_vision import VISION_CONFIGS, build_model, image_processor, random_image, save  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

# Features are O(1-5); f32 reassociation (rsqrt vs pow, pooled mean vs one-hot matmul, no padding rows)
# puts both transformers and this tower ~1e-5 from a float64 forward, stage by stage (patch embedding
# 6e-7, each encoder layer 1-3e-5, pooled 3e-5 ours / 5e-5 transformers). The text model amplifies
# that ~10x in the logits: against this model's own float64 forward (tower and text model in f64)
# our f32 logits are within 1e-5 to 6e-5 (TOL_LOGITS_F64), transformers' f32 logits within 1.5e-5 to
# 1.3e-4, so the two f32 results differ by up to 1.4e-4 and keep the text parity tests' f32 bound
# (TOL_LOGITS). A forgotten norm, scale, position or mask rule costs O(0.1-1). (transformers is no
# float64 oracle: it pools, standardizes and routes in float32 even in float64 mode.)
TOL_FEATURES = 1e-4
TOL_LOGITS = 1e-3
TOL_LOGITS_F64 = 1e-4

# (height, width): downscaled, thin (one tile high), upscaled, odd aspect.
SIZES = [(50, 37), (200, 30), (8, 8), (61, 90)]


@pytest.fixture(scope="module", params=sorted(VISION_CONFIGS))
def ckpt(request, tmp_path_factory):
    name = request.param
    hf = build_model(name)
    path = save(hf, name, tmp_path_factory.mktemp(name))
    return name, hf, path, VisionTower.from_checkpoint(path)


def hf_pixels(name, images):
    out = image_processor(name)(images, return_tensors="pt")
    return out["pixel_values"], out["image_position_ids"], [int(n) for n in out["num_soft_tokens_per_image"]]


# ----------------------------------------------------------------------------- preprocessing

@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_preprocessing_identical_to_transformers(ckpt, mode):
    name, _, _, tower = ckpt
    settings = tower.config.processing
    images = [random_image(h, w, seed=i, mode=mode) for i, (h, w) in enumerate(SIZES)]
    pixels, positions, counts = hf_pixels(name, images)
    ours = prepare_images(images, settings)
    got_pixels, got_positions = pad_batch(ours, settings)
    assert got_pixels.dtype == pixels.dtype == torch.float32
    assert torch.equal(got_pixels, pixels) and torch.equal(got_positions, positions)
    assert [im.num_soft_tokens for im in ours] == counts
    assert [num_soft_tokens(h, w, settings) for h, w in SIZES] == counts
    assert len(set(counts)) > 1 or len(set(im.grid for im in ours)) > 1  # the sizes really differ


def test_path_bytes_and_pil_give_the_same_image(ckpt, tmp_path):
    settings = ckpt[3].config.processing
    pil = random_image(33, 47, seed=5)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    a, b, c = (prepare_image(x, settings) for x in (pil, buf.getvalue(), tmp_path / "a.png"))
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.pixel_values, c.pixel_values)
    assert a.digest == b.digest == c.digest
    assert prepare_image(random_image(33, 47, seed=6), settings).digest != a.digest


# ----------------------------------------------------------------------------- the tower

@pytest.mark.parametrize("n_images", [1, 2])
def test_vision_features_match_transformers(ckpt, n_images):
    name, hf, _, tower = ckpt
    images = [random_image(h, w, seed=10 + i) for i, (h, w) in enumerate(SIZES[:n_images])]
    pixels, positions, counts = hf_pixels(name, images)
    with torch.no_grad():
        expected = hf.model.encoder.get_image_features(pixels, positions).pooler_output
    got = tower.encode(prepare_images(images, tower.config.processing))
    assert [g.shape for g in got] == [(n, tower.config.text_hidden_size) for n in counts]
    got = torch.cat(got)
    assert got.dtype == torch.float32 and expected.std() > 0.1
    err = (got - expected).abs().max().item()
    assert err <= TOL_FEATURES, f"max |Δfeatures| = {err:.3g}"


def test_tower_reads_weights_only_when_an_image_arrives(ckpt):
    _, _, path, _ = ckpt
    tower = VisionTower.from_checkpoint(path)
    assert not tower.loaded
    tower.encode([prepare_image(random_image(9, 9, seed=1), tower.config.processing)])
    assert tower.loaded


def test_tower_reads_a_quantized_pack(tmp_path):
    from diffgemma.quant.quantize import quantize
    from tiny_checkpoints import PACKABLE

    name = "p4_pool2"
    path = save(build_model(name, text_config=PACKABLE), name, tmp_path / "model")
    pack = quantize(path, tmp_path / "pack", profile="q4", progress=False)  # the vision class stays raw
    ours, packed = VisionTower.from_checkpoint(path), VisionTower.from_checkpoint(pack)
    image = [prepare_image(random_image(30, 41, seed=2), ours.config.processing)]
    assert torch.equal(ours.encode(image)[0], packed.encode(image)[0])


class _Without:
    """A TensorSource missing one tensor."""

    def __init__(self, source, name):
        self._source, self._name = source, name

    def keys(self):
        return self._source.keys() - {self._name}

    def __getattr__(self, attr):
        return getattr(self._source, attr)


def test_missing_tower_tensor_is_one_error_and_nothing_loaded(ckpt):
    from diffgemma.checkpoint import SafetensorsSource

    _, _, path, good = ckpt
    name = "model.encoder.vision_tower.encoder.layers.0.self_attn.k_norm.weight"
    tower = VisionTower(good.config, _Without(SafetensorsSource(path), name))
    image = prepare_image(random_image(9, 9, seed=1), tower.config.processing)
    with pytest.raises(TensorError, match="k_norm.weight.*missing"):
        tower.encode([image])
    assert not tower.loaded


# ----------------------------------------------------------------------------- prefill with images

def prompt_with_images(prepared, cfg, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, vocab - 3, (n,), generator=gen)  # noqa: E731 (below the image ids)
    parts = [text(4)]
    for i, im in enumerate(prepared):
        parts += [torch.tensor(image_placeholder(im.num_soft_tokens, cfg)), text(3 + i)]
    return torch.cat(parts)


def hf_logits(hf, ids, pixels, positions, canvas):
    T = len(ids)
    cache = DynamicCache(config=hf.config.text_config)
    pos = torch.arange(T)[None]
    mm_types = (ids == hf.config.image_token_id).long()[None]
    masks = hf.model.encoder.create_masks_for_generate(
        config=hf.config, inputs_embeds=torch.empty(1, T, 0, dtype=hf.dtype), attention_mask=None, cache=cache,
        position_ids=pos, mm_token_type_ids=mm_types)
    with torch.no_grad():
        hf.model.encoder(input_ids=ids[None], attention_mask=masks, cache=cache, position_ids=pos,
                         pixel_values=pixels.to(hf.dtype), image_position_ids=positions)
        return hf(cache=cache, decoder_input_ids=canvas[None]).logits[0], cache


def our_logits(model, tower, ids, prepared, canvas, bidirectional=True):
    cfg = tower.config
    embeds = merge_image_embeddings(model.embed(ids), ids, tower.encode(prepared), cfg)
    cache = model.new_cache(1024)
    model.prefill(cache, ids, embeds=embeds, image_groups=image_groups(ids, cfg) if bidirectional else None)
    return model.denoise(cache, canvas), cache


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_after_image_prefill_match_transformers(ckpt, n_images):
    name, hf, path, tower = ckpt
    model = diffgemma.load(path)
    V, C = model.config.vocab_size, model.config.canvas_length
    images = [random_image(h, w, seed=20 + i) for i, (h, w) in enumerate(SIZES[:n_images])]
    prepared = prepare_images(images, tower.config.processing)
    ids = prompt_with_images(prepared, tower.config, V, seed=n_images)
    # Image runs are longer than the sliding window: the image rule must override the window.
    assert min(e - s for s, e in image_runs(ids, tower.config.image_token_id)) > model.config.sliding_window
    canvas = torch.randint(0, V, (C,), generator=torch.Generator().manual_seed(3))
    pixels, positions, _ = hf_pixels(name, images)
    expected, hf_cache = hf_logits(hf, ids, pixels, positions, canvas)
    got, cache = our_logits(model, tower, ids, prepared, canvas)
    err = (got - expected).abs().max().item()
    assert err <= TOL_LOGITS, f"max |Δlogits| = {err:.3g}"
    # The comparison can tell the rule apart: image tokens kept causal give other logits.
    causal, _ = our_logits(model, tower, ids, prepared, canvas, bidirectional=False)
    assert (causal - expected).abs().max().item() > 100 * TOL_LOGITS
    # The next block: the committed canvas is prefilled as text after the images, then denoised.
    canvas2 = torch.randint(0, V, (C,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected2 = hf(input_ids=canvas[None], cache=hf_cache, decoder_input_ids=canvas2[None]).logits[0]
    model.prefill(cache, canvas)
    err2 = (model.denoise(cache, canvas2) - expected2).abs().max().item()
    assert err2 <= TOL_LOGITS, f"block 2: max |Δlogits| = {err2:.3g}"


@pytest.mark.parametrize("n_images", [1, 2])
def test_f32_logits_after_image_prefill_within_1e4_of_float64(ckpt, n_images):
    """The issue's 1e-4 logits bar, against the exact answer: this model's float64 forward (tower and text model in
    float64; test above: the same math as transformers') is within 1e-4 of the float32 one."""
    _, _, path, tower = ckpt
    m32, m64 = diffgemma.load(path), diffgemma.load(path, dtype=torch.float64)
    t64 = VisionTower.from_checkpoint(path, dtype=torch.float64)
    V, C = m32.config.vocab_size, m32.config.canvas_length
    prepared = prepare_images([random_image(h, w, seed=20 + i) for i, (h, w) in enumerate(SIZES[:n_images])],
                              tower.config.processing)
    ids = prompt_with_images(prepared, tower.config, V, seed=n_images)
    canvas = torch.randint(0, V, (C,), generator=torch.Generator().manual_seed(3))
    got, _ = our_logits(m32, tower, ids, prepared, canvas)
    exact, _ = our_logits(m64, t64, ids, prepared, canvas)
    assert exact.dtype == torch.float32  # softcapped logits come back in f32; the forward ran in f64
    err = (got - exact).abs().max().item()
    assert err <= TOL_LOGITS_F64, f"max |Δlogits| vs float64 = {err:.3g}"


def test_prefill_without_image_arguments_is_unchanged(ckpt):
    _, _, path, tower = ckpt
    model = diffgemma.load(path)
    ids = torch.randint(0, model.config.vocab_size - 3, (11,))
    canvas = torch.randint(0, model.config.vocab_size, (model.config.canvas_length,))
    plain, merged = model.new_cache(64), model.new_cache(64)
    model.prefill(plain, ids)
    model.prefill(merged, ids, embeds=model.embed(ids), image_groups=image_groups(ids, tower.config))
    assert torch.equal(model.denoise(plain, canvas), model.denoise(merged, canvas))


# ----------------------------------------------------------------------------- bad input

def _png(width, height, seed=0) -> bytes:
    buf = io.BytesIO()
    random_image(height, width, seed).save(buf, format="PNG")
    return buf.getvalue()


def _png_header_only(width, height) -> bytes:
    """A PNG that declares width x height but carries no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data  # noqa: E731
                                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_bad_images_raise_one_clear_error(ckpt, tmp_path):
    from PIL import Image

    settings = ckpt[3].config.processing
    truncated = _png(64, 64)
    cases = [
        (truncated[: len(truncated) // 2], "corrupt or truncated"),
        (b"just some text, not a picture", "not an image"),
        (b"", "empty"),
        (Image.new("RGB", (0, 0)), "0x0"),
        (_png_header_only(100_000, 100_000), "too many pixels|pixels, more than"),
        (tmp_path / "nope.png", "no such file"),
        (tmp_path, "not a file"),
        (12345, "expected a file path, bytes or a PIL image"),
    ]
    for image, message in cases:
        with pytest.raises(InputError, match=message):
            prepare_image(image, settings)
    with pytest.raises(InputError, match="more than the 5000 allowed"):
        prepare_image(_png(100, 100), settings, max_pixels=5000)


def test_one_bad_image_fails_the_whole_list(ckpt):
    settings = ckpt[3].config.processing
    with pytest.raises(InputError, match="image 2: not an image"):
        prepare_images([_png(10, 10), b"nope", _png(12, 12)], settings)
    with pytest.raises(InputError, match="3 images given, at most 2"):
        prepare_images([_png(10, 10)] * 3, settings, max_images=2)


def test_merge_refuses_mismatched_images(ckpt):
    _, _, _, tower = ckpt
    cfg = tower.config
    prepared = prepare_image(random_image(20, 20, seed=1), cfg.processing)
    ids = torch.tensor([1, 2] + image_placeholder(prepared.num_soft_tokens, cfg) + [3])
    embeds = torch.zeros(len(ids), cfg.text_hidden_size)
    feats = tower.encode([prepared])
    with pytest.raises(InputError, match="1 image placeholder.*2 image"):
        merge_image_embeddings(embeds, ids, feats * 2, cfg)
    with pytest.raises(InputError, match="image 1: .* placeholder tokens"):
        merge_image_embeddings(embeds, ids, [feats[0][:-1]], cfg)
    merged = merge_image_embeddings(embeds, ids, feats, cfg)
    s, e = image_runs(ids, cfg.image_token_id)[0]
    assert torch.equal(merged[s:e], feats[0]) and not merged[:s].any() and not merged[e:].any()


def test_config_errors_are_clear(ckpt):
    import json

    _, _, path, _ = ckpt
    raw = json.loads(open(f"{path}/config.json").read())
    with pytest.raises(ConfigError, match="no 'vision_config'"):
        VisionConfig.from_dict({k: v for k, v in raw.items() if k != "vision_config"})
    bad = dict(raw, vision_config=dict(raw["vision_config"], hidden_activation="relu"))
    with pytest.raises(ConfigError, match="hidden_activation"):
        VisionConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="image_token_id=.* outside the vocabulary"):
        VisionConfig.from_dict(dict(raw, image_token_id=raw["text_config"]["vocab_size"]))
    with pytest.raises(ConfigError, match="max_soft_tokens=100"):
        VisionConfig.from_dict(raw, processor={"max_soft_tokens": 100})
    with pytest.raises(ConfigError, match="patch_size=99 disagrees"):
        VisionConfig.from_dict(raw, processor={"image_processor": {"patch_size": 99}})
    nested = {"processor_class": "Gemma4Processor", "image_processor": {"max_soft_tokens": 140, "resample": 3}}
    assert VisionConfig.from_dict(raw, processor=nested).processing.max_soft_tokens == 140
    with pytest.raises(ConfigError, match="do_normalize"):
        VisionConfig.from_dict(raw, processor={"do_normalize": True})
    causal = dict(raw, text_config={k: v for k, v in raw["text_config"].items() if k != "use_bidirectional_attention"})
    assert VisionConfig.from_dict(causal).bidirectional_images is False
    assert image_groups(torch.tensor([1, 2]), VisionConfig.from_dict(causal)) is None
