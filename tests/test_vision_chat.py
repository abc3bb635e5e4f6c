"""Images in chat: the template's image parts, Session / chat with images, KV reuse keyed by image content,
hf-preset generation with an image against transformers, the server's image_url parts, `ask --image`, and the
op-log with images. On a tiny random multimodal checkpoint (tests/tiny_vision.py) with a character-level
tokenizer and a Gemma-style chat template whose image part is the `<|image|>` placeholder.
"""

import base64
import io
import json
import string

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

import diffgemma  # noqa: E402
from PIL import Image  # noqa: E402
from diffgemma.errors import InputError  # noqa: E402
from diffgemma.session import Session, chat  # noqa: E402
from diffgemma.vision.prompt import prepare_parts, render_prompt, vision_for  # noqa: E402
from tiny_vision import build_model, image_processor, random_image, save  # noqa: E402

NAME = "p4_pool2"  # text gqa2_mixed: vocab 96, image ids 93 (boi), 94 (eoi), 95 (image)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<|image|>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
BOI, EOI, IMAGE = 93, 94, 95


def write_tokenizer(directory, vocab_size: int):
    """A character-level tokenizer.json with Gemma's special tokens and the image tokens at the top ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    special = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]
    chars = list(string.ascii_letters + string.digits + " \n?.,:!'-")
    image = ["<|image>", "<image|>", "<|image|>"]
    names = special + chars + [f"<unused{i}>" for i in range(vocab_size - len(special) - len(chars) - 3)] + image
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special + image])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                                 "pad_token": "<pad>"}))
    return tok


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vision_chat")
    hf = build_model(NAME, seed=3)
    save(hf, NAME, directory)
    tok = write_tokenizer(directory, hf.config.text_config.vocab_size)
    return directory, hf, tok


@pytest.fixture(scope="module")
def model(ckpt):
    return diffgemma.load(ckpt[0], engine="reference")


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def hf_processor(tok):
    """transformers' Gemma4Processor over our tokenizer (its audio / video parts are not used here)."""
    from transformers import PreTrainedTokenizerFast, processing_utils
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    ht = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                 extra_special_tokens={"image_token": "<|image|>", "boi_token": "<|image>",
                                                       "eoi_token": "<image|>"})
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    processing_utils.ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None  # no torchvision
    try:
        proc = Gemma4Processor(image_processor=image_processor(NAME), tokenizer=ht, chat_template=TEMPLATE,
                               feature_extractor=Gemma4AudioFeatureExtractor(), video_processor=None)
    finally:
        processing_utils.ProcessorMixin.check_argument_for_proper_class = check
    proc.audio_token, proc.boa_token, proc.eoa_token = "<unused0>", "<unused1>", "<unused2>"
    return proc


def key_to_ids(key):
    return [IMAGE if t < 0 else t for t in key]


# -- the chat template ------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[(30, 41)], [(50, 37), (8, 8)]])
def test_image_parts_render_as_transformers_processor_expands_them(ckpt, model, sizes):
    _, _, tok = ckpt
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    content = [{"type": "text", "text": "Look: "}]
    for img in images:
        content += [{"type": "image", "image": img}, {"type": "text", "text": "and?"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    want = hf_processor(tok).apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 add_generation_prompt=True)["input_ids"][0]
    vision = vision_for(model)
    ours = [messages[0], {"role": "user", "content": prepare_parts(content, vision)}]
    key, table = render_prompt(model.tokenizer, vision, ours, add_generation_prompt=True)
    assert key_to_ids(key) == list(want)
    assert want.count(IMAGE) > 0 and want.count(BOI) == len(images) == len(table)
    # each image's run carries its own key; text positions are the ids
    runs = [t for i, t in enumerate(key) if t < 0 and (i == 0 or key[i - 1] != t)]
    assert runs == [img.key for img in table.values()] and len(set(runs)) == len(images)


def test_a_template_without_image_parts_gets_the_placeholder_in_text(model):
    from diffgemma.tokenizer import Tokenizer

    plain = Tokenizer(model.tokenizer.path, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                      model.tokenizer.config)
    vision = vision_for(model)
    content = prepare_parts([{"type": "text", "text": "a"}, {"type": "image", "image": random_image(8, 8, 1)}], vision)
    key, _ = render_prompt(plain, vision, [{"role": "user", "content": content}])
    n = content[1]["image"].prepared.num_soft_tokens
    assert key_to_ids(key) == [2, model.tokenizer.encode("a")[0], BOI] + [IMAGE] * n + [EOI]


def test_image_text_typed_in_a_text_part_is_refused(model):
    vision = vision_for(model)
    content = prepare_parts([{"type": "text", "text": "<|image|>"}, {"type": "image", "image": random_image(8, 8, 1)}],
                            vision)
    with pytest.raises(InputError, match="2 image placeholder"):
        render_prompt(model.tokenizer, vision, [{"role": "user", "content": content}])


def test_bad_image_parts_name_the_part(model):
    vision = vision_for(model)
    with pytest.raises(InputError, match=r"content\[1\].*not an image"):
        prepare_parts([{"type": "text", "text": "a"}, {"type": "image", "image": b"not a png"}], vision)
    with pytest.raises(InputError, match=r"content\[0\]: expected a text or an image part"):
        prepare_parts([{"type": "audio"}], vision)
    with pytest.raises(InputError, match="3 images, at most 2"):
        prepare_parts([{"type": "image", "image": random_image(8, 8, i)} for i in range(3)], vision, max_images=2)


# -- generation -------------------------------------------------------------------------------------

def test_session_with_an_image_equals_a_direct_prefill(model, monkeypatch):
    """Session's image turn = one prefill call up to the image's last soft token (features merged, image rule on),
    then the loop on the text after it. (Where the prompt is cut matters to the last bit in float32, and a random
    tiny model amplifies that, so the direct run cuts where the Session does.)"""
    import time

    from diffgemma.core import turn as turn_mod
    from diffgemma.generation import generate
    from diffgemma.vision.merge import image_groups, merge_image_embeddings

    image_prefill_s = []
    real_prefill_images = turn_mod.prefill_images

    def timed_prefill_images(*a, **kw):  # the image prefill's own time, measured inside the Session's timer
        t = time.perf_counter()
        out = real_prefill_images(*a, **kw)
        image_prefill_s.append(time.perf_counter() - t)
        return out

    monkeypatch.setattr(turn_mod, "prefill_images", timed_prefill_images)
    img = random_image(30, 41, seed=7)
    s = Session(model)
    reply = s.ask([{"type": "image", "image": img}, {"type": "text", "text": "What is it?"}],
                  max_new_tokens=10, seed=5)
    key = s.cached_ids[:reply.prefilled_tokens]
    vision = vision_for(model)
    ids = torch.tensor(key_to_ids(key))
    feats = vision.tower.encode([prepare_parts([{"type": "image", "image": img}], vision)[0]["image"].prepared])
    n = max(i for i, t in enumerate(key) if t < 0) + 1
    assert ids.tolist().count(IMAGE) == feats[0].shape[0] == n - key.index(BOI) - 1

    def prefill(cache, upto):
        h = ids[:upto]
        model.prefill(cache, h, embeds=merge_image_embeddings(model.embed(h), h, feats, vision.config),
                      image_groups=image_groups(h, vision.config))

    cache = model.new_cache(512)
    prefill(cache, n)
    want = generate(model, ids[n:], cache=cache, max_new_tokens=10, seed=5)
    assert reply.result.tokens == want.tokens and reply.reused_tokens == 0
    assert len(image_prefill_s) == 1
    assert reply.result.timings["prefill_s"] >= image_prefill_s[0] > 0  # the image's prefill is counted
    # the image is really in the KV: the same text after another picture gives other logits, while cutting
    # the prompt elsewhere changes them only by float32 rounding
    canvas = torch.arange(5, 13)
    whole, cut = model.new_cache(512), model.new_cache(512)
    prefill(whole, len(ids))
    prefill(cut, n)
    model.prefill(cut, ids[n:])
    assert (model.denoise(whole, canvas) - model.denoise(cut, canvas)).abs().max() < 1e-5
    other = model.new_cache(512)
    feats_other = vision.tower.encode([prepare_parts([{"type": "image", "image": random_image(30, 41, seed=8)}],
                                                     vision)[0]["image"].prepared])
    model.prefill(other, ids, embeds=merge_image_embeddings(model.embed(ids), ids, feats_other, vision.config),
                  image_groups=image_groups(ids, vision.config))
    assert (model.denoise(whole, canvas) - model.denoise(other, canvas)).abs().max() > 1e-2


def test_same_image_reuses_the_kv_and_another_image_does_not(model):
    img, other = random_image(30, 41, seed=1), random_image(30, 41, seed=2)
    s = Session(model)
    first = s.ask([{"type": "image", "image": png(img)}, {"type": "text", "text": "hi"}], max_new_tokens=4, seed=1)
    assert first.reused_tokens == 0
    n_image = first.prefilled_tokens
    # the same picture again (as a path-less PIL image this time): the whole history is served from the cache
    second = s.ask([{"type": "image", "image": img}, {"type": "text", "text": "again"}], max_new_tokens=4, seed=1)
    assert second.reused_tokens >= n_image
    # a fresh conversation with a different picture on the same slot: reuse stops at that image's run
    s2 = Session(model)
    s2.slot = s.slot
    third = s2.ask([{"type": "image", "image": other}, {"type": "text", "text": "hi"}], max_new_tokens=4, seed=1)
    prefix = s.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert third.reused_tokens == len(model.tokenizer.encode(prefix.split("x")[0])) + 1  # ... up to and with <boi>
    # and its KV equals a fresh session's (to float32 rounding: the prompt was cut elsewhere), while the first
    # picture's KV differs by far more: nothing of the first picture leaked in
    s3 = Session(model)
    fresh = s3.ask([{"type": "image", "image": other}, {"type": "text", "text": "hi"}], max_new_tokens=4, seed=1)
    p = third.reused_tokens + third.prefilled_tokens
    assert p == fresh.prefilled_tokens and s2.cached_ids[:p] == s3.cached_ids[:p]
    s1 = Session(model)
    s1.ask([{"type": "image", "image": img}, {"type": "text", "text": "hi"}], max_new_tokens=4, seed=1)
    for layer in (layer.index for layer in model.config.layers if not layer.is_sliding):
        k1, k2, k3 = (x.cache.visible(layer, for_denoise=False)[0][:, :p] for x in (s1, s2, s3))
        assert (k2 - k3).abs().max() < 1e-4
        assert (k1 - k3).abs().max() > 1e-2


def test_reuse_never_ends_inside_an_image_run():
    from diffgemma.slots import run_start

    key = [2, 3, BOI, -9, -9, -9, EOI, 5]
    assert [run_start(key, n) for n in range(len(key) + 1)] == [0, 1, 2, 3, 3, 3, 6, 7, 8]


def test_chat_takes_images_in_any_message(model):
    img = random_image(20, 20, seed=4)
    messages = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "a"}]},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    answer = chat(model, messages, max_new_tokens=4, seed=2)
    s = Session(model)
    s.messages = [s._with_images(m) for m in messages[:2]]
    assert s.ask("c", max_new_tokens=4, seed=2).answer == answer


def test_images_on_a_model_without_a_tower_or_without_embeds_are_refused(model):
    demo = diffgemma.load()
    with pytest.raises(InputError, match="cannot take images"):
        Session(demo).ask([{"type": "image", "image": random_image(8, 8, 1)}, {"type": "text", "text": "a"}])

    class NoEmbeds:  # a model whose prefill takes no embeds
        path, embedding = model.path, model.embedding

        def prefill(self, cache, ids):
            pass

    from diffgemma.vision.prompt import Vision

    with pytest.raises(InputError, match="takes no image embeddings"):
        Vision(NoEmbeds())


# -- hf-preset generate against transformers' generate with an image ---------------------------------

def hf_preset_checkpoint(directory):
    """The vision checkpoint the hf-preset comparisons use, saved with its tokenizer in `directory`: every expert
    routed and the SC MLP damped, so rounding cannot flip a routing choice -> the transformers model."""
    from tiny_checkpoints import CONFIGS
    from tiny_vision import VISION_CONFIGS

    text = dict(CONFIGS[VISION_CONFIGS[NAME]["text"]])
    text["top_k_experts"] = text["num_experts"]
    hf = build_model(NAME, seed=11, text_config=text)
    with torch.no_grad():
        hf.model.decoder.self_conditioning.down_proj.weight.mul_(0.01)
    save(hf, NAME, directory)
    write_tokenizer(directory, text["vocab_size"])
    return hf


def test_hf_preset_generate_with_an_image_matches_transformers(ckpt, tmp_path):
    """As tests/test_hf_generate_parity.py: float64 on both sides, SC damped and every expert routed, the same
    noise; transformers gets pixel_values / image_position_ids / mm_token_type_ids from its own processor."""
    import test_hf_generate_parity as parity
    from diffgemma.settings import GenerationSettings

    _, _, tok = ckpt
    hf = hf_preset_checkpoint(tmp_path)
    hf = hf.to(torch.float64)
    hf.set_experts_implementation("eager")
    ours = diffgemma.load(tmp_path, engine="reference", dtype=torch.float64)
    img = random_image(30, 41, seed=3)
    messages = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Say"}]}]
    inputs = hf_processor(tok).apply_chat_template(messages, tokenize=True, return_dict=True,
                                                   add_generation_prompt=True, return_tensors="pt")
    knobs = parity.KNOBS["max_steps"]
    replies, others = [], []
    for seed in (3, 4, 5):
        rng = parity.Lcg(seed)
        cls = parity.hfgen.EntropyBoundSampler
        init, multinomial = cls.initialize_canvas, torch.multinomial
        cls.initialize_canvas = lambda self, batch_size, device: rng.randint(
            batch_size * self.canvas_length, self.vocab_size, device).view(batch_size, -1)
        torch.multinomial = lambda probs, num_samples: parity.categorical(
            probs, rng.uniform(probs.shape[0], probs.device))[:, None]
        try:
            k = dict(knobs)
            sampler = parity.hfgen.EntropyBoundSamplerConfig(entropy_bound=k.pop("entropy_bound"))
            out = hf.generate(inputs["input_ids"], pixel_values=inputs["pixel_values"].to(torch.float64),
                              image_position_ids=inputs["image_position_ids"],
                              mm_token_type_ids=inputs["mm_token_type_ids"], max_new_tokens=20,
                              sampler_config=sampler,
                              eos_token_id=parity.STOP_IDS, pad_token_id=0, **k)
        finally:
            cls.initialize_canvas, torch.multinomial = init, multinomial
        new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        cut = next((i for i, t in enumerate(new) if t in parity.STOP_IDS), len(new))
        settings = GenerationSettings.resolve({}, env={}, overrides=dict(
            semantics="hf", seed=seed, max_new_tokens=20, stop_ids=parity.STOP_IDS, **knobs))
        got = Session(ours).ask(messages[0]["content"], settings=settings)
        assert got.result.tokens == new[:min(cut, 20)], f"seed {seed}"
        replies.append(got.result.tokens)
        other = [{"type": "image", "image": random_image(30, 41, seed=4)}, {"type": "text", "text": "Say"}]
        others.append(Session(ours).ask(other, settings=settings).result.tokens)
    assert sum(map(len, replies)) >= 8 and replies != others  # replies of substance, steered by the picture


# -- the server --------------------------------------------------------------------------------------

def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def image_message(url, text="What is it?"):
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                          {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture
def server(model, tmp_path):
    from fastapi.testclient import TestClient

    from diffgemma import oplog
    from diffgemma.server.app import create_app
    from diffgemma.server.images import ImageLimits
    from diffgemma.server.worker import Worker
    from diffgemma.settings import GenerationSettings

    log = oplog.OpLog(tmp_path / "logs", oplog.header(model, 2, 1024))
    worker = Worker(model, slots=2, max_tokens=1024, log=log)
    base = GenerationSettings.resolve(model.generation_config or {}, env={}, overrides={"max_new_tokens": 6})
    client = TestClient(create_app(worker, model.tokenizer, "tiny", base,
                                   image_limits=ImageLimits(max_bytes=4000, max_images=2, max_pixels=2000)))
    yield client, log
    worker.close()
    log.close()


def post(client, messages, **body):
    return client.post("/v1/chat/completions", json={"messages": messages, "diffgemma": {"seed": 1}, **body})


def test_server_takes_a_data_url_and_reuses_the_kv_of_the_same_picture(server, model):
    client, _ = server
    img = png(random_image(30, 41, seed=1))
    r = post(client, image_message(data_url(img)))
    assert r.status_code == 200, r.text
    want = Session(model).ask([{"type": "text", "text": "What is it?"}, {"type": "image", "image": img}],
                              max_new_tokens=6, seed=1)
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want.answer
    assert body["usage"]["prompt_tokens"] == want.prefilled_tokens
    # the same picture again continues the conversation from the cache; another one does not reuse its run
    again = post(client, image_message(data_url(img)) + [body["choices"][0]["message"],
                                                         {"role": "user", "content": "And?"}])
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= want.prefilled_tokens
    other = post(client, image_message(data_url(png(random_image(30, 41, seed=2)))))
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < 20


@pytest.mark.parametrize("part, needle", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "does not fetch image URLs"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "base64 does not decode"),
    ({"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0lGOD=="}}, "media type 'image/gif'"),
    ({"type": "image_url", "image_url": {"url": data_url(png(random_image(30, 41, 1))[:200])}}, "truncated"),
    ({"type": "image_url", "image_url": {"url": data_url(b"hello, not an image")}}, "not an image"),
    ({"type": "image_url", "image_url": {"url": data_url(bytes(5000))}}, "over this server's limit of 4000"),
    ({"type": "image_url", "image_url": {}}, "needs {'image_url': {'url'"),
    ({"type": "image_url", "image_url": {"url": data_url(png(Image.new("RGB", (60, 50))))}},
     "more than the 2000 allowed"),
    ({"type": "input_audio"}, "got 'input_audio'"),
])
def test_bad_image_parts_are_400s_naming_the_part(server, part, needle):
    client, _ = server
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    r = post(client, messages)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "messages[0].content[1]" in msg and needle in msg, msg


def test_too_many_images_and_a_model_without_a_tower_are_400s(server):
    client, _ = server
    url = data_url(png(random_image(8, 8, 1)))
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 3
    r = post(client, [{"role": "user", "content": parts}])
    assert r.status_code == 400 and "3 images, over this server's limit of 2" in r.json()["error"]["message"]

    from fastapi.testclient import TestClient

    from diffgemma.server.app import create_app
    from diffgemma.server.worker import Worker
    from diffgemma.settings import GenerationSettings

    demo = diffgemma.load()
    worker = Worker(demo, slots=1, max_tokens=512)
    try:
        client = TestClient(create_app(worker, demo.tokenizer, "demo", GenerationSettings.resolve({}, env={})))
        r = post(client, image_message(url))
        assert r.status_code == 400 and "cannot take images" in r.json()["error"]["message"], r.text
    finally:
        worker.close()


def test_server_op_log_with_an_image_replays(server, model):
    from diffgemma import oplog
    from diffgemma.replay import replay

    client, log = server
    img = png(random_image(30, 41, seed=5))
    assert post(client, image_message(data_url(img))).status_code == 200
    assert post(client, image_message(data_url(img), text="Again?")).status_code == 200
    ops = [r for r in oplog.read(log.path) if r.get("op") == "generate"]
    assert all(isinstance(t, int) for op in ops for t in op["prompt"]) and "images" in ops[0]
    (sha,) = ops[0]["images"].values()
    assert (log.path.parent / (log.path.name + ".images") / sha).read_bytes() == img
    report = replay(log.path, model)
    assert report.ok and report.generations == 2, report.problems
    # a missing side file is one clear error
    (log.path.parent / (log.path.name + ".images") / sha).unlink()
    with pytest.raises(InputError, match=f"image {sha} is missing"):
        replay(log.path, model)


# -- the command line --------------------------------------------------------------------------------

def test_ask_with_images(ckpt, model, tmp_path, capsys):
    from diffgemma import cli

    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(png(random_image(30, 41, seed=1)))
    b.write_bytes(png(random_image(20, 20, seed=2)))
    argv = ["ask", "What is it?", "--image", str(a), "--image", str(b), "--model", str(ckpt[0]), "--device", "cpu",
            "--seed", "3", "--max-new-tokens", "6"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    want = Session(model).ask("What is it?", images=[a, b], max_new_tokens=6, seed=3).answer
    assert out.strip() == want.strip()
    assert cli.main(["ask", "hi", "--image", str(tmp_path / "nope.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.png: no such file" in err[0]
    (tmp_path / "bad.png").write_bytes(b"garbage")
    assert cli.main(["ask", "hi", "--image", str(tmp_path / "bad.png"), "--model", str(ckpt[0]),
                     "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.png" in err[0] and "not an image" in err[0]


def test_allowed_image_urls_are_fetched_with_the_caps(model, tmp_path):
    import http.server
    import threading

    from fastapi.testclient import TestClient

    from diffgemma.server.app import create_app
    from diffgemma.server.images import ImageLimits
    from diffgemma.server.worker import Worker
    from diffgemma.settings import GenerationSettings

    small, big = png(random_image(20, 20, seed=1)), png(random_image(64, 64, seed=2))
    (tmp_path / "small.png").write_bytes(small)
    (tmp_path / "big.png").write_bytes(big)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(tmp_path), **k)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{httpd.server_address[1]}"
    worker = Worker(model, slots=1, max_tokens=1024)
    try:
        base = GenerationSettings.resolve({}, env={}, overrides={"max_new_tokens": 4})
        client = TestClient(create_app(worker, model.tokenizer, "tiny", base, image_limits=ImageLimits(
            max_bytes=len(small) + 10, allow_urls=True, url_timeout_s=5)))
        r = post(client, image_message(f"{root}/small.png"))
        assert r.status_code == 200, r.text
        want = Session(model).ask([{"type": "text", "text": "What is it?"}, {"type": "image", "image": small}],
                                  max_new_tokens=4, seed=1)
        assert r.json()["choices"][0]["message"]["content"] == want.answer
        for path, needle in [("big.png", "over this server's limit"), ("nope.png", "HTTP 404"),
                             ("", "not an image")]:  # a directory listing
            r = post(client, image_message(f"{root}/{path}"))
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (path, r.text)
    finally:
        worker.close()
        httpd.shutdown()
