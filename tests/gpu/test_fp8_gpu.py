"""GPU checks of the FP8 engine (ops/fp8_quant.py, fp8_linear.py, fp8_moe.py; model/forward.py with Fp8Weights).

Skips without CUDA (and the FP8 parts without FP8 tensor cores, compute capability < 8.9). Prints the numbers with -s.
- kernels vs twins at the real shapes (hidden 2816, 128 experts of F 704, top-8; the projections' N and K): the
  per-row quantization bit for bit; torch._scaled_mm, torch._scaled_grouped_mm and the FP8 grouped kernel by
  ‖Δ‖/‖ref‖ (bf16 output rounding and another summation order);
- batch invariance: a lane's 256 rows through the FP8 grouped kernel alone and inside 2048 (and at both row tiles),
  bit for bit; the same for torch._scaled_mm's rows (printed, asserted: a batched lane of the engine gets these
  rows' bits only if it holds);
- the engine on a random mid-size model with FP8 weights (bf16 activations, f16 KV, graphs) against the f32 reference
  on the dequantized weights with every FP8 GEMM's input fake-quantized per token (tests/test_fp8_engine.py's
  FakeQuantReference), printed beside the bf16 engine's distance to the f32 reference of the same weights. End to
  end this is a loose check (a wiring fault is O(1)): with bf16 activations an activation's bf16 rounding moves it
  across an e4m3 rounding boundary about once in sixteen values, a step of one e4m3 ulp, so the engine's distance to
  the f32 fake-quant forward is of the order of the quantization error itself (measured on the CPU twin path:
  0.07-0.09 relative on a model whose every token takes every expert, where the bf16 engine is 0.012-0.015 from
  f32). The f16-rounding-level check is per op, where the twin gets the kernel's own bf16 input;
- every lane of a batched FP8 denoise bit-identical to its solo denoise.
"""

import random
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.checkpoint import expected_tensors  # noqa: E402
from diffgemma.config import ModelConfig  # noqa: E402
from diffgemma.model.engine import build_engine  # noqa: E402
from diffgemma.model.engine_weights import DictSource, Fp8QuantizedSource  # noqa: E402
from diffgemma.model.reference import ReferenceModel  # noqa: E402
from diffgemma.ops import fp8_linear, fp8_moe, fp8_quant, moe  # noqa: E402
from diffgemma.ops.fp8_weight import has_fp8_mma, has_scaled_grouped_mm, quantize_fp8  # noqa: E402

from bench.fixtures import RandomSource  # noqa: E402
from fp8_reference import FakeQuantReference  # noqa: E402
from tiny_checkpoints import MID  # noqa: E402

DEV = torch.device("cuda")
E, H, Fe, TOP = 128, 2816, 704, 8
LINEARS = {"qkv_sliding": (8192, H), "qkv_full": (9216, H), "o_sliding": (H, 4096), "o_full": (H, 8192),
           "dense_gate_up": (4224, H), "dense_down": (H, 2112)}
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or not has_fp8_mma(DEV), reason="needs FP8 tensor cores")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def plan(experts):
    k = experts.shape[1]
    order = torch.argsort(experts.reshape(-1), stable=True)
    offs = torch.cumsum(torch.bincount(experts.reshape(-1), minlength=E), 0).to(torch.int32)
    return order // k, offs, order


def routes(kind, T):
    if kind == "balanced":
        return (torch.arange(T * TOP, device=DEV) % E).view(T, TOP)
    return torch.rand(T, E, device=DEV).topk(TOP, dim=-1).indices


@pytest.mark.parametrize("M,K", [(2048, H), (256, 8192), (16384, 704)])
def test_quantize_rows_kernel_bits(M, K):
    x = (torch.randn(M, K, device=DEV) * torch.logspace(-4, 4, M, device=DEV)[:, None]).to(torch.bfloat16)
    x[M // 2] = 0
    q, s = fp8_quant.quantize_rows_triton(x)
    qr, sr = fp8_quant.quantize_rows_ref(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("M,F", [(2048, Fe), (16384, Fe), (256, 2112)])
def test_gelu_mul_quant_kernel_bits(M, F):
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    gu = (torch.randn(M, 2 * F, device=DEV) * 2).to(torch.bfloat16)
    q, s = fp8_quant.gelu_mul_quant_triton(gu)
    q2, s2 = fp8_quant.quantize_rows_triton(gelu_mul_triton(gu))
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert rel(q.float() * s[:, None], fp8_quant.fake_quant_rows(fp8_quant.gelu_mul_ref(gu))) < 2e-2


@needs_fp8
@pytest.mark.parametrize("name", sorted(LINEARS))
def test_scaled_mm_linear_vs_twin_and_rows(name):
    N, K = LINEARS[name]
    w = quantize_fp8(torch.randn(N, K, device=DEV) * 0.02)
    x = torch.randn(2048, K, device=DEV).to(torch.bfloat16)
    got = fp8_linear.fp8_linear_scaled_mm(x, w)
    r = rel(got, fp8_linear.fp8_linear_ref(x, w))
    same = [torch.equal(fp8_linear.fp8_linear_scaled_mm(x[a:a + 256], w), got[a:a + 256]) for a in (0, 768, 1792)]
    print(f"\n[fp8 linear {name}] rel vs twin {r:.2e}; 256-row lanes alone == inside 2048: {same}")
    assert r < 4e-3
    assert all(same)


@needs_fp8
@pytest.mark.parametrize("name", sorted(LINEARS))
def test_triton_linear_vs_twin_and_rows(name):
    N, K = LINEARS[name]
    w = quantize_fp8(torch.randn(N, K, device=DEV) * 0.02)
    x = torch.randn(2048, K, device=DEV).to(torch.bfloat16)
    q, s = fp8_quant.quantize_rows(x)
    got = fp8_linear.fp8_linear_triton(q, s, w)
    assert rel(got, fp8_linear.fp8_linear_ref(x, w)) < 4e-3
    assert torch.equal(fp8_linear.fp8_linear_triton(q, s, w, config=(128, 128, 128, 8, 3)), got)
    for a in (0, 768, 1792):
        assert torch.equal(fp8_linear.fp8_linear_triton(q[a:a + 256], s[a:a + 256], w), got[a:a + 256]), a


@needs_fp8
@pytest.mark.parametrize("kind", ["balanced", "random"])
@pytest.mark.parametrize("N,K", [(2 * Fe, H), (H, Fe)])
def test_grouped_fp8_vs_twin(kind, N, K):
    w = quantize_fp8(torch.randn(E, N, K, device=DEV) * 0.02)
    src, offs, _ = plan(routes(kind, 256))
    q, s = fp8_quant.quantize_rows(torch.randn(256, K, device=DEV).to(torch.bfloat16))
    ref = fp8_moe.grouped_mm_fp8_ref(q, s, w, offs, src=src)
    r_tri = rel(fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src), ref)
    msg = f"\n[fp8 grouped {kind} N={N} K={K}] kernel rel {r_tri:.2e}"
    if has_scaled_grouped_mm(DEV):
        r_torch = rel(fp8_moe.grouped_mm_fp8_torch(q, s, w, offs, src=src), ref)
        msg += f", torch._scaled_grouped_mm rel {r_torch:.2e}"
        assert r_torch < 4e-3
    print(msg)
    assert r_tri < 4e-3


@needs_fp8
@pytest.mark.parametrize("N,K", [(2 * Fe, H), (H, Fe)])
def test_grouped_kernel_lane_bits_do_not_depend_on_the_batch(N, K):
    w = quantize_fp8(torch.randn(E, N, K, device=DEV) * 0.02)
    experts = routes("random", 2048)
    q, s = fp8_quant.quantize_rows(torch.randn(2048, K, device=DEV).to(torch.bfloat16))
    src, offs, order = plan(experts)
    full = torch.empty(2048 * TOP, N, dtype=torch.bfloat16, device=DEV)
    full[order] = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src)
    BN, _, BK, warps, stages = fp8_moe.pick_config(2048 * TOP, E, K)
    narrow = torch.empty_like(full)
    narrow[order] = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src, config=(BN, 32, BK, warps, stages))
    assert torch.equal(full, narrow), "the row tile changed bits"
    for lane in (0, 5):
        rows = slice(lane * 256, (lane + 1) * 256)
        src1, offs1, order1 = plan(experts[rows])
        alone = torch.empty(256 * TOP, N, dtype=torch.bfloat16, device=DEV)
        alone[order1] = fp8_moe.grouped_mm_fp8_triton(q[rows], s[rows], w, offs1, src=src1)
        assert torch.equal(alone, full[lane * 256 * TOP:(lane + 1) * 256 * TOP]), f"lane {lane}"


@needs_fp8
@pytest.mark.skipif(not torch.cuda.is_available() or not has_scaled_grouped_mm(DEV), reason="needs torch's FP8 grouped")
@pytest.mark.parametrize("tokens", [256, 2048, 8192])
@pytest.mark.parametrize("N,K", [(2 * Fe, H), (H, Fe)])
def test_grouped_kernel_has_torch_bits_at_every_size(tokens, N, K):
    """The engine's FP8 expert GEMM (the Triton kernel at every size, its tiles by rows) against
    torch._scaled_grouped_mm, at one canvas's, eight canvases' and eight 1k prompts' rows: the same bits."""
    w = quantize_fp8(torch.randn(E, N, K, device=DEV) * 0.02)
    src, offs, _ = plan(routes("balanced", tokens))
    q, s = fp8_quant.quantize_rows(torch.randn(tokens, K, device=DEV).to(torch.bfloat16))
    got = fp8_moe.grouped_mm_fp8(q, s, w, offs, src=src)
    assert torch.equal(got, fp8_moe.grouped_mm_fp8_torch(q, s, w, offs, src=src))


@needs_fp8
def test_expert_ffn_fp8_vs_twin_real_shape():
    gu = quantize_fp8(torch.randn(E, 2 * Fe, H, device=DEV) * 0.02)
    dn = quantize_fp8(torch.randn(E, H, Fe, device=DEV) * 0.02)
    x = torch.randn(256, H, device=DEV).to(torch.bfloat16)
    src, offs, _ = plan(routes("random", 256))
    got = moe.expert_ffn(x, gu, dn, offs, src=src)
    assert rel(got, fp8_moe.expert_ffn_fp8_ref(x, gu, dn, offs, src=src)) < 1e-2


# MID with every token routed to every expert: no routing flips, so the logits move smoothly with rounding
SMOOTH = dict(MID, num_experts=8, top_k_experts=8)


def _mid_models(seed, tc=MID):
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "canvas_length": 64,
                                 "text_config": dict(tc, model_type="diffusion_gemma_text")})
    src = RandomSource(cfg, DEV, torch.float32, seed=seed, std=0.05)
    weights = {n: src.get(n) for n in expected_tensors(cfg)}
    fsrc = Fp8QuantizedSource(DictSource(weights))
    fp8 = build_engine(cfg, fsrc, DEV, torch.bfloat16, prefill_chunk=256)
    deq = {n: fsrc.get(n, dtype=torch.float32, device=DEV) for n in weights}
    bf16 = build_engine(cfg, DictSource(deq), DEV, torch.bfloat16, prefill_chunk=256)
    plain = ReferenceModel(cfg, deq, device=DEV, dtype=torch.float32)
    return cfg, fp8, bf16, FakeQuantReference(cfg, weights, fsrc, device=DEV), plain


@needs_fp8
def test_fp8_engine_vs_fake_quant_reference():
    cfg, fp8, bf16, fq, plain = _mid_models(random.getrandbits(31), SMOOTH)
    gen = torch.Generator().manual_seed(random.getrandbits(31))
    prompt = torch.randint(0, cfg.vocab_size, (300,), generator=gen).to(DEV)
    canvas = torch.randint(0, cfg.vocab_size, (cfg.canvas_length,), generator=gen).to(DEV)
    out = {}
    for name, m in (("fp8", fp8), ("bf16", bf16), ("fq", fq), ("plain", plain)):
        cache = m.new_cache(1024)
        m.prefill(cache, prompt)
        out[name] = m.denoise(cache, canvas).float()
    e_fp8, e_bf16, far = rel(out["fp8"], out["fq"]), rel(out["bf16"], out["plain"]), rel(out["fp8"], out["plain"])
    agree = (out["fp8"].argmax(-1) == out["fq"].argmax(-1)).float().mean().item()
    print(f"\n[fp8 engine] vs fake-quant ref {e_fp8:.3g} (argmax {agree:.3f}); bf16 engine vs f32 ref {e_bf16:.3g}; "
          f"fp8 engine vs unquantized-activation ref {far:.3g}")
    assert fp8.graph_error is None, fp8.graph_error
    assert e_fp8 < 0.2 and agree > 0.75


@pytest.fixture
def linear_kernel(request):
    old = fp8_linear.KERNEL
    fp8_linear.KERNEL = request.param
    yield request.param
    fp8_linear.KERNEL = old


@needs_fp8
@pytest.mark.parametrize("linear_kernel", ["scaled_mm", "triton"], indirect=True)
@pytest.mark.parametrize("paths", ["wide", "lane"])
def test_fp8_batched_lanes_bit_identical_to_solo(paths, linear_kernel):
    """Holds with torch._scaled_mm only where its rows' bits do not depend on M (test_scaled_mm_linear_vs_twin_and_rows);
    with the Triton linear by construction."""
    cfg, fp8, *_ = _mid_models(random.getrandbits(31))
    fp8.options = replace(fp8.options, batch_paths=paths)
    gen = torch.Generator().manual_seed(random.getrandbits(31))
    V, C, W = cfg.vocab_size, cfg.canvas_length, cfg.sliding_window
    caches, canvases = [], []
    for T in (5, 3 * W + 1, W + 2, 2 * W):
        cache = fp8.new_cache(T + 4 * C)
        fp8.prefill(cache, torch.randint(0, V, (T,), generator=gen).to(DEV))
        caches.append(cache)
        canvases.append(torch.randint(0, V, (C,), generator=gen).to(DEV))
    solo = [fp8.denoise_raw(c, x).clone() for c, x in zip(caches, canvases)]
    fp8.denoise_batch_raw(caches, canvases)  # eager round; the next is captured
    got = fp8.denoise_batch_raw(caches, canvases)
    same = [torch.equal(g, s) for g, s in zip(got, solo)]
    print(f"\n[fp8 lanes {paths} {linear_kernel}] bit-identical to solo: {same}")
    assert all(same)
