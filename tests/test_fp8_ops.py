"""The FP8 ops against their torch twins: per-row quantization (kernel under TRITON_INTERPRET=1), the linear, the
grouped expert GEMM kernel and the expert FFN, at tiny shapes; and the twins against plain float math."""

from __future__ import annotations

import os

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import fp8_linear, fp8_moe, fp8_quant, moe
from diffgemma.ops._backend import HAVE_TRITON
from diffgemma.ops.gelu_mul import gelu_mul_triton
from diffgemma.ops.fp8_weight import FP8_DTYPE, FP8_MAX, quantize_fp8, row_scale

# the kernels on CPU tensors: in the Triton interpreter (tests/gpu/test_fp8_gpu.py runs them natively)
needs_triton = pytest.mark.skipif(not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs the Triton interpreter")


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def test_quantize_fp8_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 40, generator=g) * torch.rand(3, 5, 1, generator=g)
    w[1, 2] = 0.0
    fw = quantize_fp8(w)
    assert fw.weight.dtype == FP8_DTYPE and fw.scale.shape == (3, 5)
    # the largest |value| of each (nonzero) row lands on ±448 exactly
    amax = fw.weight.float().abs().amax(-1)
    assert torch.all((amax == FP8_MAX) | (w.abs().amax(-1) == 0))
    assert torch.equal(fw.weight[1, 2].float(), torch.zeros(40)) and fw.scale[1, 2] > 0
    rel = (fw.dequantize() - w).abs() / w.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert rel.max() < 2 ** -4  # e4m3 has 3 mantissa bits: half an ulp at the top is 1/16 of amax
    with pytest.raises(TensorError, match="quantize_fp8"):
        quantize_fp8(torch.zeros(4))


def test_quantize_rows_ref_matches_weight_rule():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 48, generator=g).to(torch.bfloat16)
    q, s = fp8_quant.quantize_rows_ref(x)
    fw = quantize_fp8(x)
    assert torch.equal(_bits(q), _bits(fw.weight)) and torch.equal(s, fw.scale)
    assert torch.equal(s, row_scale(x.float().abs().amax(-1)))


@needs_triton
@pytest.mark.parametrize("K", [48, 100])
def test_quantize_rows_kernel_equals_twin(K):
    g = torch.Generator().manual_seed(K)
    x = (torch.randn(9, K, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(torch.bfloat16)
    x[4] = 0.0
    q, s = fp8_quant.quantize_rows_triton(x)
    qr, sr = fp8_quant.quantize_rows_ref(x)
    assert torch.equal(s, sr)
    assert torch.equal(_bits(q), _bits(qr))


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)])
def test_quantize_rows_into_row_slices_is_the_whole_quantization(kernel):
    """Lanes quantizing their rows into slices of one buffer pair give the bits of quantizing all rows at once."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(11, 40, generator=g) * torch.logspace(-2, 2, 11)[:, None]).to(torch.bfloat16)
    q, s = fp8_quant.fp8_row_buffers(11, 40, "cpu")
    fn = fp8_quant.quantize_rows_triton if kernel else fp8_quant.quantize_rows
    for a, b in ((0, 4), (4, 5), (5, 11)):
        got = fn(x[a:b], out=(q[a:b], s[a:b]))
        assert got[0].data_ptr() == q[a:b].data_ptr()
    whole = fp8_quant.quantize_rows_ref(x)
    rows = fp8_quant.fp8_rows_done(q, s)
    assert torch.equal(_bits(rows.q), _bits(whole[0])) and torch.equal(rows.s, whole[1])
    with pytest.raises(TensorError, match=r"quantize_rows: out expects q \[4, 40\]"):
        fn(x[:4], out=(q[:3], s[:3]))


def test_lanes_attend_hands_an_fp8_o_projection_the_whole_outputs_rows():
    """model/lane_attention: with an FP8 o projection each lane writes its own quantized rows; the result is the
    concatenated outputs' quantization, bit for bit; with a bf16 one, the concatenation."""
    from types import SimpleNamespace

    from diffgemma.model.lane_attention import lanes_attend

    g = torch.Generator().manual_seed(4)
    outs = [torch.randn(n, 32, generator=g).to(torch.bfloat16) for n in (5, 3, 8)]
    lanes, lo = [], 0
    for o in outs:
        lanes.append((lo, lo + len(o), lambda li, qkv, need, o=o: o + 0 * qkv[:, :1]))
        lo += len(o)
    qkv = torch.zeros(lo, 8, dtype=torch.bfloat16)
    fp8_layer = SimpleNamespace(o=quantize_fp8(torch.randn(16, 32, generator=g)))
    got = lanes_attend([fp8_layer], lanes, None, torch.device("cpu"))(0, qkv, True)
    want = fp8_quant.quantize_rows_ref(torch.cat(outs))
    assert isinstance(got, fp8_quant.Fp8Rows)
    assert torch.equal(_bits(got.q), _bits(want[0])) and torch.equal(got.s, want[1])
    plain = lanes_attend([SimpleNamespace(o=torch.randn(16, 32))], lanes, None, torch.device("cpu"))(0, qkv, True)
    assert torch.equal(plain, torch.cat(outs))


def test_fp8_linear_ref_is_the_fake_quant_product():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 64, generator=g), torch.randn(24, 64, generator=g) * 0.1
    fw = quantize_fp8(w)
    got = fp8_linear.fp8_linear_ref(x, fw)
    want = fp8_quant.fake_quant_rows(x) @ fw.dequantize().T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and near the unquantized product (two e4m3 roundings)
    assert ((got - x @ w.T).norm() / (x @ w.T).norm()) < 0.08
    assert torch.equal(fp8_linear.linear(x, fw), got)  # off CUDA the dispatcher runs the twin
    assert torch.equal(fp8_linear.linear(x, w), x @ w.T)  # a plain weight: the plain product
    with pytest.raises(TensorError, match="fp8_linear"):
        fp8_linear.fp8_linear_ref(torch.zeros(2, 32), fw)


def _routes(T, k, E, gen):
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    return experts, order // k, order, offs


@needs_triton
@pytest.mark.parametrize("with_src", [True, False])
def test_grouped_kernel_equals_twin(with_src):
    g = torch.Generator().manual_seed(3)
    E, N, K, T, k = 4, 48, 80, 11, 2
    w = quantize_fp8(torch.randn(E, N, K, generator=g) * 0.05)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    _, src, _, offs = _routes(T, k, E, g)
    q, s = fp8_quant.quantize_rows_ref(x)
    if not with_src:
        q, s, src = q[src], s[src], None
    want = fp8_moe.grouped_mm_fp8_ref(q, s, w, offs, src=src)
    for config in [(32, 16, 32, 4, 1), (16, 32, 64, 4, 1)]:
        got = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src, config=config)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    order = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    cfg = (32, 16, 32, 4, 1)
    assert torch.equal(fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src, order=order, config=cfg),
                       fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src, config=cfg))


@needs_triton
def test_grouped_kernel_rows_independent_of_tile():
    """A row's result does not depend on the other rows of its expert, and hardly on the row tile (BM: bit for bit
    on the GPU, tests/gpu/test_fp8_gpu.py; the interpreter's tile products follow the tile shape)."""
    g = torch.Generator().manual_seed(4)
    E, N, K = 2, 32, 64
    w = quantize_fp8(torch.randn(E, N, K, generator=g) * 0.05)
    q, s = fp8_quant.quantize_rows_ref(torch.randn(40, K, generator=g))
    offs = torch.tensor([25, 40], dtype=torch.int32)
    a = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, config=(16, 16, 32, 4, 1))
    b = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, config=(16, 32, 32, 4, 1))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    one = fp8_moe.grouped_mm_fp8_triton(q[:1], s[:1], w, torch.tensor([1, 1], dtype=torch.int32),
                                        config=(16, 16, 32, 4, 1))
    assert torch.equal(one[0], a[0])


def test_grouped_twin_is_the_dequantized_product():
    g = torch.Generator().manual_seed(5)
    E, N, K, T, k = 3, 16, 32, 7, 2
    w = quantize_fp8(torch.randn(E, N, K, generator=g) * 0.05)
    x = torch.randn(T, K, generator=g)
    experts, src, order, offs = _routes(T, k, E, g)
    q, s = fp8_quant.quantize_rows_ref(x)
    got = fp8_moe.grouped_mm_fp8_ref(q, s, w, offs, src=src, out_dtype=torch.float32)
    xf, wf = fp8_quant.fake_quant_rows(x), w.dequantize()
    want = torch.stack([xf[t] @ wf[e].T for t, e in zip(src.tolist(), experts.reshape(-1)[order].tolist())])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(TensorError, match="grouped_mm_fp8"):
        fp8_moe.grouped_mm_fp8_ref(q[:, :16], s, w, offs, src=src)


def test_expert_ffn_dispatches_fp8():
    """ops/moe.expert_ffn with FP8 stacks runs the FP8 FFN (the twin off CUDA), which is the fake-quant FFN."""
    g = torch.Generator().manual_seed(6)
    E, H, Fe, T, k = 4, 32, 16, 9, 2
    gu = quantize_fp8(torch.randn(E, 2 * Fe, H, generator=g) * 0.1)
    dn = quantize_fp8(torch.randn(E, H, Fe, generator=g) * 0.1)
    x = torch.randn(T, H, generator=g)
    experts, src, order, offs = _routes(T, k, E, g)
    got = moe.expert_ffn(x, gu, dn, offs, src=src)
    assert torch.equal(got, fp8_moe.expert_ffn_fp8_ref(x, gu, dn, offs, src=src))
    # the same as the plain FFN on fake-quantized operands, route by route
    gw, dw = gu.dequantize(), dn.dequantize()
    xf = fp8_quant.fake_quant_rows(x)
    want = []
    for t, e in zip(src.tolist(), experts.reshape(-1)[order].tolist()):
        h = moe.F.gelu((xf[t] @ gw[e, :Fe].T), approximate="tanh") * (xf[t] @ gw[e, Fe:].T)
        want.append(fp8_quant.fake_quant_rows(h[None])[0] @ dw[e].T)
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    # grouped_mm on an FP8 stack quantizes its input the same way
    g1 = moe.grouped_mm(x, gu, offs, src=src, glu=True)
    torch.testing.assert_close(g1, moe.gelu_mul(fp8_moe.grouped_mm_fp8_ref(
        *fp8_quant.quantize_rows_ref(x), gu, offs, src=src, out_dtype=torch.float32)), rtol=0, atol=0)


@needs_triton
def test_gelu_mul_quant_kernel_equals_the_two_steps():
    g = torch.Generator().manual_seed(7)
    gu = (torch.randn(6, 2 * 40, generator=g) * 3).to(torch.bfloat16)
    q, s = fp8_quant.gelu_mul_quant_triton(gu)
    _, s2 = fp8_quant.gelu_mul_quant_ref(gu)  # the twin: torch's gelu, within its rounding
    torch.testing.assert_close(s, s2, rtol=2 ** -7, atol=0)
    q3, s3 = fp8_quant.quantize_rows_triton(gelu_mul_triton(gu))
    assert torch.equal(s, s3) and torch.equal(_bits(q), _bits(q3))  # the fused kernel = gelu_mul then quantize


def test_gated_mlp_fp8_is_the_fake_quant_mlp():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 32, generator=g)
    gu, dn = quantize_fp8(torch.randn(48, 32, generator=g) * 0.2), quantize_fp8(torch.randn(32, 24, generator=g) * 0.2)
    got = fp8_linear.gated_mlp(x, gu, dn)
    h = fp8_quant.fake_quant_rows(x) @ gu.dequantize().T
    h = moe.F.gelu(h[:, :24], approximate="tanh") * h[:, 24:]
    torch.testing.assert_close(got, fp8_quant.fake_quant_rows(h) @ dn.dequantize().T, rtol=1e-5, atol=1e-5)
    w1, w2 = torch.randn(48, 32, generator=g), torch.randn(32, 24, generator=g)
    assert torch.equal(fp8_linear.gated_mlp(x, w1, w2), moe.gelu_mul(x @ w1.T) @ w2.T)  # plain weights: as before


@needs_triton
def test_linear_kernel_equals_twin_and_rows_are_independent():
    g = torch.Generator().manual_seed(9)
    w = quantize_fp8(torch.randn(40, 96, generator=g) * 0.1)
    q, s = fp8_quant.quantize_rows_ref(torch.randn(37, 96, generator=g))
    want = fp8_linear.scaled_product_ref(q, s, w.weight, w.scale, torch.float32)
    a = fp8_linear.fp8_linear_triton(q, s, w, torch.float32, config=(16, 16, 32, 4, 1))
    torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
    # other row / column tiles: the same values (bit for bit on the GPU's tensor cores, tests/gpu/test_fp8_gpu.py;
    # the interpreter's tile products go through a BLAS whose order follows the tile shape)
    b = fp8_linear.fp8_linear_triton(q, s, w, torch.float32, config=(32, 32, 32, 4, 1))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(fp8_linear.fp8_linear_triton(q[5:9], s[5:9], w, torch.float32, config=(16, 16, 32, 4, 1)),
                       a[5:9])
