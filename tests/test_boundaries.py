"""Limits exactly at their boundary, and defaults nobody else exercises.

Each test takes a limit at its value (allowed) and one past it (refused), so an off-by-one in either direction
fails: serve's --limit values (a request asking exactly its limit; `--limit empty_reply_retry=0`), the number
and length of stop texts, `max_images` images in a message and in a request, two stop texts that begin at the
same place, and a vision checkpoint with no processor config file (transformers' defaults: rescale 1/255).
"""

from types import SimpleNamespace

import pytest

from diffgemma.errors import InputError
from diffgemma.loader import embedded_model_path
from diffgemma.settings import GenerationSettings
from diffgemma.stop_strings import first_stop, held_back, settled, text_end, tokens_through_stop
from diffgemma.tokenizer import Tokenizer


# -- serve --limit ------------------------------------------------------------------------------------

def test_a_request_asking_exactly_its_limit_is_served_one_more_is_refused():
    pytest.importorskip("fastapi")
    from diffgemma.server.openai_fields import Limits, over_limit

    base = GenerationSettings()
    limits = Limits(canvas_length=64, max_denoising_steps=20, empty_reply_retry=3, stop_strings=2,
                    stop_string_chars=5)
    at = dict(canvas_length=64, max_denoising_steps=20, empty_reply_retry=3)
    for name, value in at.items():
        assert over_limit(base.replace(**{name: value}), base, limits, 128) is None, name
        hit = over_limit(base.replace(**{name: value + 1}), base, limits, 128)
        assert hit is not None and hit[0] == name and f"limit of {value}" in hit[1], name
    # the server's own value is never limited, even past the limit
    assert over_limit(base.replace(max_denoising_steps=99), base.replace(max_denoising_steps=99), limits, 128) is None
    # canvas: with no --limit the model's own canvas is the cap, exactly
    assert over_limit(base.replace(canvas_length=32), base, Limits(), 32) is None
    assert over_limit(base.replace(canvas_length=33), base, Limits(), 32)[0] == "canvas_length"
    # stop texts: exactly as many and exactly as long as allowed
    assert over_limit(base.replace(stop_strings=("abcde", "x")), base, limits, 128) is None
    assert over_limit(base.replace(stop_strings=("a", "b", "c")), base, limits, 128)[0] == "stop"
    assert "6 characters" in over_limit(base.replace(stop_strings=("abcdef",)), base, limits, 128)[1]


def test_limit_empty_reply_retry_zero_allows_zero_and_refuses_one():
    pytest.importorskip("fastapi")
    from diffgemma.server.openai_fields import Limits, over_limit

    limits = Limits().replace(["empty_reply_retry=0"])
    assert limits.empty_reply_retry == 0
    base = GenerationSettings(empty_reply_retry=0)
    assert over_limit(base, base, limits, None) is None
    hit = over_limit(base.replace(empty_reply_retry=1), base, limits, None)
    assert hit == ("empty_reply_retry", "empty_reply_retry 1: over this server's limit of 0 "
                                        "(serve --limit empty_reply_retry=N)")
    for bad in ("max_denoising_steps=0", "stop_strings=0", "canvas_length=0", "empty_reply_retry=-1"):
        with pytest.raises(ValueError, match="expected a positive integer"):
            Limits().replace([bad])


# -- stop texts ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(embedded_model_path())


def test_two_stop_texts_beginning_at_the_same_place(tok):
    """The reply's text ends where both begin; its tokens stop where the shorter completes (it completes first),
    whichever order the stops are given in; a stream holds back the tail either could grow from."""
    text = "6 12 31 45 87"
    ids = tok.encode(text)
    decode = tok.decode
    for stops in (("31 45 8", "31 4"), ("31 4", "31 45 8")):
        assert first_stop(text, stops) == (5, "31 45 8")  # the longest of those beginning first is reported
        assert text_end(text, stops) == 5
        kept, hit = tokens_through_stop(decode, ids, 0, stops)
        assert hit == "31 4" and decode(ids[:kept]) == "6 12 31 4"
        assert settled("6 12 31", stops) == "6 12 " and held_back("6 12 31 4", stops) == 4
    assert first_stop("x ab", ("a", "ab")) == (2, "ab") == first_stop("x ab", ("ab", "a"))
    # a tail one character short of a whole stop text is held back whole
    assert held_back("6 12 31 45 ", ("31 45 8",)) == 6 and settled("6 12 31 45 ", ("31 45 8",)) == "6 12 "


def test_stop_positions_equal_a_brute_force_at_every_token(tok):
    """For stop texts taken from everywhere in a reply: the tokens kept are exactly those through the first token
    whose prefix holds a stop text, and a stream holds back exactly the longest tail that begins a stop text."""
    import random

    rng = random.Random(7)
    text = "Sort: 6 12 31 45 87, then 3 5 8 13 21 and done."
    ids = tok.encode(text)
    decode = tok.decode
    for _ in range(60):
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text) - 1)
            stops.append(text[a:a + rng.randint(1, 6)])
        want = next(k for k in range(1, len(ids) + 1) if first_stop(decode(ids[:k]), stops) is not None)
        start = rng.randrange(want)  # any prefix already checked and free of stops
        kept, hit = tokens_through_stop(decode, ids, start, stops)
        assert kept == want and hit in stops and hit in decode(ids[:kept]), (stops, start)
        cut = rng.randrange(1, len(text))
        part = text[:cut]
        brute = max([k for s in stops for k in range(1, len(s)) if part.endswith(s[:k])], default=0)
        assert held_back(part, stops) == brute, (part, stops)


# -- images: exactly max_images ----------------------------------------------------------------------

def _vision_stub(processor=None):
    from diffgemma.vision.config import VisionConfig
    from tiny_checkpoints import CONFIGS
    from tiny_vision import VISION_CONFIGS, token_ids

    spec = VISION_CONFIGS["p4_pool2"]
    text = dict(CONFIGS[spec["text"]], use_bidirectional_attention="vision")
    raw = dict(text_config=text, vision_config=spec["vision"], **token_ids(text["vocab_size"]))
    return SimpleNamespace(config=VisionConfig.from_dict(raw, processor=processor)), raw


def test_exactly_max_images_are_taken_one_more_is_refused():
    pytest.importorskip("PIL")
    from diffgemma.vision.prompt import prepare_parts
    from tiny_vision import random_image

    vision, _ = _vision_stub()
    for limit in (1, 3):
        content = [{"type": "image", "image": random_image(8, 8, seed=i)} for i in range(limit)]
        assert len(prepare_parts(content + [{"type": "text", "text": "x"}], vision, max_images=limit)) == limit + 1
        with pytest.raises(InputError, match=f"{limit + 1} images, at most {limit} allowed"):
            prepare_parts(content + [{"type": "image", "image": random_image(8, 8, seed=9)}], vision,
                          max_images=limit)
    assert prepare_parts([{"type": "text", "text": "x"}], vision, max_images=0)  # no image, limit 0: fine


def test_a_request_with_exactly_max_images_passes_the_server_count():
    pytest.importorskip("fastapi")
    from diffgemma.server.images import ImageLimits, count_images
    from diffgemma.server.errors import RequestError

    def messages(n_first, n_second):
        return [{"role": "user", "content": [{"type": "image"}] * n_first + [{"type": "text", "text": "a"}]},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": [{"type": "image"}] * n_second}]

    limits = ImageLimits(max_images=3)
    assert count_images(messages(2, 1), limits) == 3  # over all messages, exactly the limit
    with pytest.raises(RequestError, match="4 images, over this server's limit of 3"):
        count_images(messages(2, 2), limits)
    assert count_images(messages(0, 0), ImageLimits(max_images=0)) == 0
    with pytest.raises(RequestError):
        count_images(messages(1, 0), ImageLimits(max_images=0))


# -- vision defaults --------------------------------------------------------------------------------

def test_a_vision_checkpoint_without_processor_config_preprocesses_as_transformers_defaults(tmp_path):
    """No processor_config.json / preprocessor_config.json: the defaults are transformers' Gemma-4 image
    processor's (rescale 1/255, its max_soft_tokens), and the patches equal that processor's, bit for bit."""
    pytest.importorskip("PIL")
    pytest.importorskip("transformers")
    import json

    import torch
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from diffgemma.vision.config import VisionConfig
    from diffgemma.vision.preprocess import pad_batch, prepare_images
    from tiny_vision import random_image

    _, raw = _vision_stub()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = VisionConfig.from_checkpoint(tmp_path)
    hf = Gemma4ImageProcessorPil(patch_size=cfg.patch_size, pooling_kernel_size=cfg.pooling_kernel_size)
    assert cfg.processing.rescale_factor == hf.rescale_factor == 1 / 255
    assert cfg.processing.max_soft_tokens == hf.max_soft_tokens
    images = [random_image(50, 37, seed=1), random_image(8, 8, seed=2), random_image(61, 90, seed=3)]
    want = hf(images, return_tensors="pt")
    pixels, positions = pad_batch(prepare_images(images, cfg.processing), cfg.processing)
    assert torch.equal(pixels, want["pixel_values"]) and torch.equal(positions, want["image_position_ids"])
    assert float(pixels.max()) == 1.0  # a white-ish pixel of 255 lands exactly on 1.0


# -- settings: each range taken at its ends -------------------------------------------------------------

@pytest.mark.parametrize("name,ok,bad", [
    ("confidence_trim", [0.0, 1.0], [-1e-9, 1.0 + 1e-9]),
    ("seed", [0, 2**64 - 1], [-1, 2**64]),
    ("empty_reply_retry", [0], [-1]),
    ("max_denoising_steps", [1], [0]),
    ("max_new_tokens", [1], [0]),
    ("entropy_stop_min_steps", [1], [0]),
    ("plateau_steps", [0], [-1]),
    ("stability_threshold", [0], [-1]),
    ("entropy_bound", [0.0], [-1e-9]),
    ("canvas_length", [None, 1], [0]),
])
def test_settings_ranges_at_their_ends(name, ok, bad):
    from diffgemma.errors import SettingsError

    for value in ok:
        assert getattr(GenerationSettings().replace(**{name: value}), name) == value
    for value in bad:
        with pytest.raises(SettingsError, match=name):
            GenerationSettings().replace(**{name: value})
