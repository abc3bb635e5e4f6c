"""GPU checks of the rms norms' FP8 epilogues (ops/rmsnorm.py dense_fp8 / moe_fp8 / next_fp8; model/forward.py).

Skips without CUDA (the engine part without FP8 tensor cores). At the real hidden size (2816) in bf16: each fused
kernel's (q, s) are quantize_rows' bits on the unfused kernel's output at the same warps (a wide norm with FP8
operands runs at twice the plain one's warps, ops/rmsnorm.row_warps, and the warps set a norm's summation order). The FP8 engine on a random mid-size model
(bf16, f16 KV, CUDA graphs): its logits with the fused operands equal, bit for bit, those with every FP8 GEMM
quantizing its own input (the epilogues switched off and the graphs recaptured), in prefill, denoise with and
without SC, and a batched denoise.
"""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma.model.forward as forward_module  # noqa: E402
from diffgemma.ops import fp8_quant, rmsnorm  # noqa: E402
from diffgemma.ops.fp8_quant import Fp8Rows  # noqa: E402
from diffgemma.ops.fp8_weight import has_fp8_mma  # noqa: E402

DEV = torch.device("cuda")
H = 2816


def same_rows(got, want):
    assert isinstance(got, Fp8Rows)
    assert torch.equal(got.q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got.s, want[1])


@pytest.mark.parametrize("T", [64, 2048])
def test_fused_kernels_bits_at_real_shape(T, monkeypatch):
    g = torch.Generator(device=DEV).manual_seed(random.getrandbits(31))
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=DEV) * scale).bfloat16()  # noqa: E731
    res, a, m = rnd(T, H, scale=4), rnd(T, H), rnd(T, H)
    ws = [(torch.rand(H, generator=g, device=DEV) + 0.5).bfloat16() for _ in range(5)]
    wr = torch.rand(H, generator=g, device=DEV) * 0.3
    got = rmsnorm.attn_finish_triton(res, a, ws[0], ws[1], ws[2], wr, 1e-6, dense_fp8=True, moe_fp8=True)
    k, N = 8, T * 8
    y, inv, wts = rnd(N, H), torch.randperm(N, device=DEV), torch.rand(T, k, device=DEV)
    fused = rmsnorm.layer_finish_moe_triton(res, m, y, inv, wts, ws[1], ws[2], ws[3], 0.7, 1e-6, ws[4], next_fp8=True)
    assert rmsnorm.row_warps(H, True) == 2 * rmsnorm.row_warps(H)
    monkeypatch.setattr(rmsnorm, "WIDE_ROW_WARPS", 2 * rmsnorm.WIDE_ROW_WARPS)  # the plain kernels at the FP8 warps
    plain = rmsnorm.attn_finish_triton(res, a, ws[0], ws[1], ws[2], wr, 1e-6)
    same_rows(got[1], fp8_quant.quantize_rows_triton(plain[1]))
    same_rows(got[2], fp8_quant.quantize_rows_triton(plain[2]))
    assert torch.equal(got[0], plain[0]) and torch.equal(got[3], plain[3])
    base = rmsnorm.layer_finish_moe_triton(res, m, y, inv, wts, ws[1], ws[2], ws[3], 0.7, 1e-6, ws[4])
    assert torch.equal(fused[0], base[0])
    same_rows(fused[1], fp8_quant.quantize_rows_triton(base[1]))


def _outputs(eng, cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    V, C = cfg.vocab_size, cfg.canvas_length
    caches, outs = [], []
    for T in (300, 45):
        cache = eng.new_cache(1024)
        eng.prefill(cache, torch.randint(0, V, (T,), generator=gen).to(DEV))
        caches.append(cache)
    canvases = [torch.randint(0, V, (C,), generator=gen).to(DEV) for _ in caches]
    sc = (torch.randn(C, V, generator=gen) * 3).to(DEV)
    for _ in range(2):  # eager, then captured
        outs = [eng.denoise(caches[0], canvases[0]).clone(), eng.denoise(caches[0], canvases[0], sc_logits=sc).clone()]
        outs += [o.clone() for o in eng.denoise_batch_raw(caches, canvases)]
    assert eng.graph_error is None, eng.graph_error
    return outs


@pytest.mark.skipif(not torch.cuda.is_available() or not has_fp8_mma(DEV), reason="needs FP8 tensor cores")
def test_fp8_engine_fused_operands_bit_identical_to_unfused(monkeypatch):
    from test_fp8_gpu import _mid_models

    seed = random.getrandbits(31)
    cfg, fp8, *_ = _mid_models(seed)
    fused = _outputs(fp8, cfg, seed)
    finish, finish_moe = forward_module.attn_finish, forward_module.layer_finish_moe
    monkeypatch.setattr(forward_module, "attn_finish", lambda *a, dense_fp8=False, moe_fp8=False, **k: finish(*a, **k))
    monkeypatch.setattr(forward_module, "layer_finish_moe", lambda *a, next_fp8=False, **k: finish_moe(*a, **k))
    fp8.clear_graphs()
    plain = _outputs(fp8, cfg, seed)
    same = [torch.equal(f, p) for f, p in zip(fused, plain)]
    print(f"\n[fp8 fused operands] bit-identical to unfused: {same}")
    assert all(same)
