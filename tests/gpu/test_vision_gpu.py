"""Image input on the fast engine on CUDA: bf16 engine + bf16 tower against the f32 reference, and Session end to end.

Skips without CUDA. Prints the parity numbers with -s. On the tiny random multimodal checkpoints of
tests/tiny_vision.py: the reference (f32, with its f32 tower) and the engine (bf16, f16 KV cache, its own tower in bf16
with SDPA, the image chunk's attention on SDPA with the image overlay) each prefill the same prompt with one or two
images; the next denoise logits must agree as bf16 allows. Then `Session(engine).ask(image)` runs the whole path (the
image prefill eagerly, the text after it and the denoise steps through CUDA graphs).
"""

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

DEV = os.environ.get("DGTEST_VISION_DEVICE", "cuda")  # "cpu": the same checks on the CPU's bf16 twins (slow-ish)
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma  # noqa: E402
from diffgemma.model.engine import Engine  # noqa: E402
from diffgemma.vision.merge import image_groups, image_placeholder, merge_image_embeddings  # noqa: E402
from diffgemma.vision.preprocess import prepare_images  # noqa: E402
from diffgemma.vision.prompt import vision_for  # noqa: E402
from tiny_vision import VISION_CONFIGS, build_model, random_image, save  # noqa: E402

SIZES = [(50, 37), (61, 90)]


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.fixture(scope="module", params=sorted(VISION_CONFIGS))
def models(request, tmp_path_factory):
    from test_vision_chat import write_tokenizer

    from tiny_checkpoints import CONFIGS

    name = request.param
    # every expert routed: bf16 rounding cannot flip a top-k choice (on these tiny random models a flip moves a row's
    # logits by O(1), which would hide what this test looks at)
    text = dict(CONFIGS[VISION_CONFIGS[name]["text"]])
    text["top_k_experts"] = text["num_experts"]
    hf = build_model(name, text_config=text)
    directory = tmp_path_factory.mktemp(name)
    save(hf, name, directory)
    write_tokenizer(directory, hf.config.text_config.vocab_size)  # for Session: a character tokenizer and template
    ref = diffgemma.load(directory, device=DEV, engine="reference")  # f32
    eng = Engine.from_reference(ref, dtype=torch.bfloat16)  # f16 KV cache, graphs on CUDA
    return ref, eng


def prompt(cfg, vocab, prepared, seed):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, vocab - 3, (5,), generator=gen)]
    for i, im in enumerate(prepared):
        parts += [torch.tensor(image_placeholder(im.num_soft_tokens, cfg)), torch.randint(0, vocab - 3, (4 + i,),
                                                                                          generator=gen)]
    return torch.cat(parts).to(DEV)


def image_logits(model, ids, prepared, canvas):
    vision = vision_for(model)
    feats = vision.tower.encode(prepared)
    embeds = merge_image_embeddings(model.embed(ids), ids, feats, vision.config)
    cache = model.new_cache(1024)
    model.prefill(cache, ids, embeds=embeds, image_groups=image_groups(ids, vision.config))
    return torch.cat(feats), model.denoise(cache, canvas)


@pytest.mark.parametrize("n_images", [1, 2])
def test_bf16_engine_with_images_close_to_f32_reference(models, n_images):
    ref, eng = models
    vision = vision_for(eng)
    assert vision.tower.dtype == torch.bfloat16 and vision.tower.device.type == torch.device(DEV).type
    assert vision_for(ref).tower.dtype == torch.float32
    cfg, V, C = vision.config, ref.config.vocab_size, ref.config.canvas_length
    prepared = prepare_images([random_image(h, w, seed=30 + i) for i, (h, w) in enumerate(SIZES[:n_images])],
                              cfg.processing)
    ids = prompt(cfg, V, prepared, seed=n_images)
    canvas = torch.randint(0, V, (C,), generator=torch.Generator().manual_seed(5)).to(DEV)
    f_ref, want = image_logits(ref, ids, prepared, canvas)
    f_eng, got = image_logits(eng, ids, prepared, canvas)
    f_cos, cos = cosine(f_eng, f_ref), cosine(got, want)
    f_rel = ((f_eng.float() - f_ref).norm() / f_ref.norm()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"\n[vision bf16 {n_images} image(s)] features rel={f_rel:.2e} cos={f_cos:.6f}; logits cos={cos:.5f} "
          f"max|Δ|={(got - want).abs().max().item():.3f} argmax agree={agree:.3f}")
    # The tower in bf16 on these random towers (sharp attention: scale 1 with QK-norm weights up to 1.75), measured on
    # the CPU's bf16 twins: ||Δ||/||f|| 1.8-5.3e-2, cosine >= 0.9985. A wrong position, norm or pooling order is O(1).
    assert f_rel < 0.1 and f_cos > 0.997, (f_rel, f_cos)
    # The text model in bf16 with an f16 cache, every expert routed: logits cosine 0.965-0.999 (CPU bf16 twins).
    assert cos > 0.95, cos
    # ... and the image rule is visible through that noise: the same engine with the image rows left causal is at
    # least twice as far from the reference (measured 3-7x).
    cache = eng.new_cache(1024)
    eng.prefill(cache, ids, embeds=merge_image_embeddings(eng.embed(ids), ids, vision.tower.encode(prepared), cfg))
    causal = eng.denoise(cache, canvas)
    assert (got - want).norm() < 0.5 * (causal - want).norm()


def test_session_with_an_image_on_the_engine(models):
    """The whole path on the engine: render, tower, image prefill (eager), text tail and denoise steps (graphs on
    CUDA), seeded; the same request twice gives the same tokens, and another picture steers the answer."""
    from diffgemma.session import Session

    _, eng = models
    content = lambda seed: [{"type": "image", "image": random_image(30, 41, seed=seed)},  # noqa: E731
                            {"type": "text", "text": "Say"}]
    a = Session(eng).ask(content(3), max_new_tokens=24, seed=1)
    b = Session(eng).ask(content(3), max_new_tokens=24, seed=1)
    c = Session(eng).ask(content(4), max_new_tokens=24, seed=1)
    assert a.result.tokens == b.result.tokens and len(a.result.tokens) > 0
    assert a.result.tokens != c.result.tokens
    if DEV == "cuda":
        assert eng.graph_error is None, eng.graph_error
