"""What a request is checked against while it is prepared (issue 55, part 3): the bound on characters that no
context can hold (the tokenizer's longest token, and where no bound exists), exactly at that bound, and the
piecewise base64 decoding of data URLs against the whole-text decoder."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.images import ImageLimits  # noqa: E402
from diffgemma.server.text_limit import longest_token_chars, max_prompt_chars  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def base(model):
    return GenerationSettings.resolve(model.generation_config, env={}).replace(
        max_new_tokens=4, max_denoising_steps=4, empty_reply_retry=0)


# ------------------------------------------------------------------------------------- the text bound

def tokenizer_spec(**parts) -> dict:
    spec = json.loads((embedded_model_path() / "tokenizer.json").read_text())
    spec.update(parts)
    return spec


def test_longest_token_is_the_vocabularys_and_none_where_characters_can_vanish():
    spec = tokenizer_spec()
    assert longest_token_chars(spec) == 16  # "<|tool_response>", an added token the text can spell out
    composing = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}
    assert longest_token_chars(tokenizer_spec(normalizer=composing)) == 64
    shrinking = {"type": "Replace", "pattern": {"String": "    "}, "content": "\t"}
    assert longest_token_chars(tokenizer_spec(normalizer=shrinking)) == 64
    for part in [{"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
                 {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}},
                 {"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}},
                 {"pre_tokenizer": {"type": "WhitespaceSplit"}},
                 {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                     {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}]}}]:
        assert longest_token_chars(tokenizer_spec(**part)) is None, part
    model = dict(tokenizer_spec()["model"])
    unknowns = dict(model, byte_fallback=False, unk_token="<unk>", fuse_unk=True)
    assert longest_token_chars(tokenizer_spec(model=unknowns, pre_tokenizer=None)) is None
    assert longest_token_chars(tokenizer_spec(model=dict(unknowns, fuse_unk=False), pre_tokenizer=None)) == 16


def test_no_text_needs_fewer_tokens_than_the_bound_says(model):
    """The bound's premise: every text of n characters takes at least n / longest tokens; random texts made of
    the vocabulary's own pieces (the densest there are), of special-token spellings and of any characters."""
    import random

    tok = model.tokenizer
    longest = longest_token_chars(tokenizer_spec())
    pieces = [tok.decode([i]) for i in range(tok.vocab_size)]
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 0x2FF)] + ["\n", "\t", "😀", "中", "ｶ", "ﾞ", "e\u0301"]
    for _ in range(200):
        kind = rng.randrange(3)
        if kind == 0:
            text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        elif kind == 1:
            text = "<|tool_response>" * rng.randrange(1, 5) + " " * rng.randrange(40)
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 200)))
        assert len(text) <= longest * len(tok.encode(text)), text


def test_text_exactly_at_the_bound_is_tokenized_and_one_more_character_is_not(model, base):
    """At max_prompt_chars characters the text reaches the tokenizer (and is then refused for the context it
    takes, naming the tokens); one character more is refused by its length without tokenizing."""
    worker = Worker(model, slots=1, max_tokens=64)
    try:
        client = TestClient(create_app(worker, model.tokenizer, "diffgemma-demo", base))
        limit = max_prompt_chars(model.tokenizer, 64)
        assert limit == 64 * 16
        for extra, needle in [(0, "over this server's context of 64"), (1, f"at most {limit} characters")]:
            text = "a" * (limit + extra)
            for path, body in [("/v1/completions", {"prompt": text}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": text[:limit // 2]},
                                                                      {"role": "user", "content": text[limit // 2:]}]})]:
                r = client.post(path, json=body)
                assert r.status_code == 400 and needle in r.json()["error"]["message"], (extra, path, r.text)
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}] * 65})
        assert r.status_code == 400 and "65 messages, more than this server's context of 64" in r.text
    finally:
        worker.close()


# ------------------------------------------------------------------------------------- data URLs in pieces

def test_data_urls_decode_piecewise_as_base64_does_whole(monkeypatch):
    """decode_data_url decodes base64 a piece at a time (the interpreter is free between pieces): on random data,
    wrapped or not, with a character corrupted anywhere (padding at a piece's end included), it accepts and refuses
    exactly what base64's strict decoder does on the whole text without its whitespace."""
    import base64
    import random

    from diffgemma.server import images
    from diffgemma.server.errors import RequestError

    monkeypatch.setattr(images, "_PIECE", 16)
    rng = random.Random(0)
    limits = ImageLimits(max_bytes=4000)

    def whole(text):
        try:
            return base64.b64decode("".join(text.split()), validate=True) or None
        except ValueError:
            return None

    for _ in range(400):
        data = rng.randbytes(rng.choice([0, 1, 2, 3, 11, 12, 13, rng.randrange(200)]))
        text = base64.encodebytes(data).decode() if rng.random() < 0.3 else base64.b64encode(data).decode()
        if text and rng.random() < 0.6:
            k = rng.choice([rng.randrange(len(text)), min(len(text) - 1, 15), min(len(text) - 1, 31)])
            text = text[:k] + rng.choice("=-*\n A/+") + text[k + 1:]
        try:
            got = images.decode_data_url("data:image/png;base64," + text, "x", limits)
        except RequestError:
            got = None
        assert got == whole(text), text
