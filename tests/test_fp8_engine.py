"""The engine with FP8 weights (ops/fp8_weight.Fp8Weight) on the CPU torch path, on tiny random checkpoints.

Its projections, dense MLP and experts are the checkpoint's quantized per output row (Fp8QuantizedSource); the
engine quantizes each FP8 GEMM's input per token. The oracle is the reference model on the dequantized weights
with every such GEMM's input fake-quantized per row by the same rule (FakeQuantReference). f32 activations and KV
cache: the two agree to f32 rounding, except where that rounding moves an activation across an e4m3 rounding
boundary, a rare one-ulp (1/16) step of one input value. The unquantized-activation reference is checked to lie
much further away, so the comparison can tell the two apart.
"""

import pytest
import torch

import diffgemma
from diffgemma.model.engine import build_engine
from diffgemma.model.engine_weights import LM_HEAD, DictSource, Fp8QuantizedSource, fp8_by_default, fused_linear
from diffgemma.model.reference import ReferenceModel
from diffgemma.ops import moe_paths
from diffgemma.ops.fp8_weight import Fp8Weight, quantize_fp8
from fp8_reference import FakeQuantReference
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    hf = build_model(CONFIGS[request.param], canvas_length=8)
    ref = diffgemma.load(save(hf, tmp_path_factory.mktemp(request.param)))
    src = Fp8QuantizedSource(DictSource(ref.w))
    eng = build_engine(ref.config, src, "cpu", torch.float32, kv_dtype=torch.float32)
    plain = ReferenceModel(ref.config, {n: src.get(n, dtype=torch.float32) for n in ref.w}, device="cpu",
                           dtype=torch.float32)
    return eng, FakeQuantReference(ref.config, ref.w, src), plain


def _case(cfg, gen, T):
    V, C = cfg.vocab_size, cfg.canvas_length
    return (torch.randint(0, V, (T,), generator=gen), torch.randint(0, V, (C,), generator=gen),
            torch.randn(C, V, generator=gen) * 4)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_engine_holds_fp8_weights(models):
    eng = models[0]
    lw = eng.w.layers[0]
    for name in ("qkv", "o", "mlp_gu", "mlp_down", "experts_gu", "experts_down"):
        assert isinstance(getattr(lw, name), Fp8Weight), name
    assert isinstance(eng.w.embed, torch.Tensor) and isinstance(eng.w.sc_gu, torch.Tensor)
    assert lw.router_w.dtype == torch.float32


@pytest.mark.parametrize("window_multiple", [0.5, 3])
def test_fp8_engine_matches_fake_quant_reference(models, window_multiple):
    """Three random cases. The per-token quantization is a step function: where an activation lands within f32
    rounding of an e4m3 boundary (or a row's max moves its scale), the engine's fused ops and the reference may round
    it to neighbouring values, and the tiny model carries that to every logit. So one case of three may miss the
    bound; a wiring fault (a GEMM without its activation quantization, a wrong scale) misses it in every case."""
    eng, fq, plain = models
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    errs = []
    for _ in range(3):
        prompt, canvas, sc = _case(eng.config, gen, max(1, int(eng.config.sliding_window * window_multiple)))
        outs = []
        for m in (eng, fq, plain):
            cache = m.new_cache(256)
            m.prefill(cache, prompt)
            outs.append((m.denoise(cache, canvas), m.denoise(cache, canvas, sc_logits=sc)))
        for (g, e, p), name in zip(zip(*outs), ("no SC", "SC logits")):
            err, far = _rel(g, e), _rel(p, e)
            errs.append(err)
            assert err < 0.6 * far, f"{name}: the engine is as near the unquantized reference ({err:.3g}, {far:.3g})"
            assert far > 5e-4, f"{name}: the unquantized-activation reference is as near ({far:.3g})"
    assert sorted(errs)[-3] < 5e-4, f"engine vs fake-quant reference, relative errors {errs}"


def test_fp8_batched_lanes_equal_solo(models):
    eng = models[0]
    cfg = eng.config
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    lanes = []
    for T in (3, 3 * cfg.sliding_window + 1, 2 * cfg.sliding_window):
        cache = eng.new_cache(T + 4 * cfg.canvas_length)
        prompt, canvas, sc = _case(cfg, gen, T)
        eng.prefill(cache, prompt)
        lanes.append((cache, canvas, sc))
    solo = [eng.denoise(c, x, sc_logits=s) for c, x, s in lanes]
    got = eng.denoise_batch([c for c, _, _ in lanes], [x for _, x, _ in lanes], sc_logits=[s for *_, s in lanes])
    for i, (g, s) in enumerate(zip(got, solo)):
        err = (g - s).abs().max().item()
        assert err <= 1e-4, f"lane {i}: max |Δlogits| {err:.3g}"


def test_a_checkpoints_fp8_lm_head_is_used(models):
    """A source with an FP8 `lm_head.weight` (here the embedding quantized) gives the engine an FP8 lm_head: the
    logits are those of the fake-quantized head, near the tied embedding's, and lanes stay their solo selves."""
    eng, fq, _ = models
    names = fq.w
    inner = DictSource({**names, LM_HEAD: names["model.decoder.embed_tokens.weight"]})
    src = Fp8QuantizedSource(inner, which=lambda n: fp8_by_default(n) or n == LM_HEAD)
    head_eng = build_engine(eng.config, src, "cpu", torch.float32, kv_dtype=torch.float32)
    assert isinstance(head_eng.w.lm_head, Fp8Weight) and eng.w.lm_head is None
    gen = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    prompt, canvas, _ = _case(eng.config, gen, 5)
    raw = []
    for m in (eng, head_eng):
        caches = [m.new_cache(64), m.new_cache(64)]
        for c in caches:
            m.prefill(c, prompt)
        raw.append(m.denoise_raw(caches[0], canvas))
        batched = m.denoise_batch_raw(caches, [canvas, canvas])
        assert (batched[1] - raw[-1]).abs().max() <= 1e-4
    assert 0 < _rel(raw[1], raw[0]) < 0.1


def test_fused_linear_stacks_fp8_parts_and_falls_back_when_mixed():
    g = torch.Generator().manual_seed(3)
    t = {n: torch.randn(4 + i, 8, generator=g) for i, n in enumerate(("a", "b", "c"))}
    src = Fp8QuantizedSource(DictSource(t), which=lambda n: n in ("a", "b"))
    both = fused_linear(src, ["a", "b"], "cpu", lambda n: src.get(n))
    assert isinstance(both, Fp8Weight) and both.shape == (9, 8)
    assert torch.equal(both.dequantize(), torch.cat([src.get("a"), src.get("b")]))
    mixed = fused_linear(src, ["a", "c"], "cpu", lambda n: src.get(n))  # one part plain: the dequantized values
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([src.get("a"), t["c"]]))
    assert fused_linear(src, ["c"], "cpu", lambda n: src.get(n)) is t["c"]
    assert src.kind("a") == "fp8" and src.kind("c") == "raw" and src.shape("c") == (6, 8)
    assert moe_paths.fp8_expert_path(quantize_fp8(torch.randn(2, 16, 16)), 4, torch.zeros(1), torch.float32) == "fp8-twin"


def test_fp8_expert_gemms_keep_one_kernel_and_widen_its_row_tiles(monkeypatch):
    """On a CUDA device with FP8 tensor cores the expert GEMMs take the Triton kernel at every size (torch's grouped
    kernel only when asked: DIFFGEMMA_EXPERT_GEMM=cutlass); its row tiles widen past STREAM_MAX_ROWS an expert."""
    from diffgemma.ops import fp8_moe

    class CudaRows:  # what fp8_expert_path reads of x, as a CUDA tensor has it
        is_cuda, device, dtype = True, torch.device("cuda"), torch.bfloat16

    monkeypatch.setattr(moe_paths, "has_fp8_mma", lambda dev: True)
    monkeypatch.setattr(moe_paths, "has_scaled_grouped_mm", lambda dev: True)
    monkeypatch.setattr(moe_paths, "use_triton", lambda x: True)
    w = quantize_fp8(torch.randn(128, 16, 32))
    monkeypatch.delenv(moe_paths.EXPERT_GEMM_ENV, raising=False)
    for routes in (128 * 16, 128 * 128, 128 * 512):
        assert moe_paths.fp8_expert_path(w, routes, CudaRows(), torch.bfloat16) == "fp8-triton"
    monkeypatch.setenv(moe_paths.EXPERT_GEMM_ENV, "cutlass")
    assert moe_paths.fp8_expert_path(w, 128 * 512, CudaRows(), torch.bfloat16) == "fp8-torch"
    wide = moe_paths.STREAM_MAX_ROWS * 128 + 1
    assert fp8_moe.pick_config(wide, 128, 2816) == fp8_moe.pick_config(wide, 128, 704) == fp8_moe.WIDE_CONFIG
    assert fp8_moe.pick_config(wide - 1, 128, 2816) == fp8_moe.CONFIG
    assert fp8_moe.pick_config(wide - 1, 128, 704) == fp8_moe.CONFIG_SHORT_K
    assert {c[2] for c in (fp8_moe.CONFIG, fp8_moe.CONFIG_SHORT_K, fp8_moe.WIDE_CONFIG)} == {128}  # one K tile


def test_fp8_demo_engine_generate_batch_equals_generate():
    """The whole loop (prefill, steps, commits, batched rounds) on the demo model with FP8 weights: each request's
    tokens through generate_batch are generate's alone."""
    demo = diffgemma.load()
    eng = build_engine(demo.config, Fp8QuantizedSource(DictSource(demo.w)), "cpu", torch.float32,
                       kv_dtype=torch.float32, generation_config=demo.generation_config, tokenizer=demo.tokenizer)
    assert isinstance(eng.w.layers[0].experts_gu, Fp8Weight)
    prompts = [demo.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Name a colour.", "What is 2+2?", "Say hi.")]
    kw = dict(max_new_tokens=16, max_denoising_steps=6)
    batched = diffgemma.generate_batch(eng, prompts, seeds=[5, 6, 7], **kw)
    solo = [diffgemma.generate(eng, p, seed=s, **kw) for p, s in zip(prompts, [5, 6, 7])]
    assert [r.tokens for r in batched] == [r.tokens for r in solo]
    assert all(len(r.tokens) > 0 for r in solo)
