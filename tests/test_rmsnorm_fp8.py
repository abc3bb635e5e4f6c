"""The rms norms' FP8 epilogues (ops/rmsnorm.py dense_fp8 / moe_fp8 / next_fp8): the per-token FP8 operand they hand
the next GEMM is, bit for bit, ops/fp8_quant's quantization of the activation the unfused kernel stores; the twins
agree the same way, and the outputs not asked in FP8 are the plain kernel's bits. Kernels in the Triton interpreter.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from diffgemma.errors import TensorError  # noqa: E402
from diffgemma.ops import fp8_quant, rmsnorm  # noqa: E402
from diffgemma.ops.fp8_quant import Fp8Rows  # noqa: E402


def same_rows(got, want):
    """got an Fp8Rows, want the (q, s) of quantizing a tensor: the same bytes."""
    assert isinstance(got, Fp8Rows)
    assert torch.equal(got.q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got.s, want[1])


def case(dtype, T=6, H=80):  # H not a power of two: masked lanes in the row's max
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    res, a = rnd(T, H, scale=2), rnd(T, H)
    a[1] *= 1e3  # a row far above the others: its scale alone
    ws = [(torch.rand(H, generator=g) + 0.5).to(dtype) for _ in range(5)]
    return res, a, ws, torch.rand(H, generator=g) * 0.3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dense_fp8,moe_fp8", [(True, False), (False, True), (True, True)])
def test_attn_finish_fp8_operands_equal_quantizing_its_outputs(dtype, dense_fp8, moe_fp8):
    res, a, ws, wr = case(dtype)
    plain = rmsnorm.attn_finish_triton(res, a, ws[0], ws[1], ws[2], wr, 1e-6)
    got = rmsnorm.attn_finish_triton(res, a, ws[0], ws[1], ws[2], wr, 1e-6, dense_fp8=dense_fp8, moe_fp8=moe_fp8)
    ref = rmsnorm.attn_finish_ref(res, a, ws[0], ws[1], ws[2], wr, 1e-6, dense_fp8=dense_fp8, moe_fp8=moe_fp8)
    plain_ref = rmsnorm.attn_finish_ref(res, a, ws[0], ws[1], ws[2], wr, 1e-6)
    for i, flag in ((1, dense_fp8), (2, moe_fp8)):
        if flag:
            same_rows(got[i], fp8_quant.quantize_rows_triton(plain[i]))  # the fused kernel = unfused kernels
            same_rows(ref[i], fp8_quant.quantize_rows_ref(plain_ref[i]))  # the twin = the twins
        else:
            assert torch.equal(got[i], plain[i])
    assert torch.equal(got[0], plain[0]) and torch.equal(got[3], plain[3])
    if dtype == torch.bfloat16:  # one rounding of the same f32 norm: the twin's quantized rows where they agree
        for i in (1, 2):
            if isinstance(got[i], Fp8Rows) and torch.equal(plain[i], plain_ref[i]):
                same_rows(got[i], ref[i])


def test_attn_finish_refuses_both_moe_operands():
    res, a, ws, wr = case(torch.bfloat16)
    with pytest.raises(TensorError, match="not both"):
        rmsnorm.attn_finish(res, a, ws[0], ws[1], ws[2], wr, 1e-6, moe_f16=True, moe_fp8=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_finish_moe_next_fp8_equals_quantizing_its_norm(dtype):
    res, m, ws, _ = case(dtype)
    T, H, k, N = res.shape[0], res.shape[1], 3, 20
    y = torch.randn(N, H).to(dtype)
    inv, wts, s = torch.randperm(N)[: T * k], torch.rand(T, k), 0.75
    plain = rmsnorm.layer_finish_moe_triton(res, m, y, inv, wts, ws[1], ws[2], ws[3], s, 1e-6, ws[4])
    got = rmsnorm.layer_finish_moe_triton(res, m, y, inv, wts, ws[1], ws[2], ws[3], s, 1e-6, ws[4], next_fp8=True)
    assert torch.equal(got[0], plain[0])
    same_rows(got[1], fp8_quant.quantize_rows_triton(plain[1]))
    ref = rmsnorm.layer_finish_moe_ref(res, m, y, inv, wts, ws[1], ws[2], ws[3], s, 1e-6, ws[4], next_fp8=True)
    plain_ref = rmsnorm.layer_finish_moe_ref(res, m, y, inv, wts, ws[1], ws[2], ws[3], s, 1e-6, ws[4])
    same_rows(ref[1], fp8_quant.quantize_rows_ref(plain_ref[1]))
    # no next norm: nothing to quantize
    none = rmsnorm.layer_finish_moe_triton(res, m, y, inv, wts, ws[1], ws[2], ws[3], s, 1e-6, None, next_fp8=True)
    assert none[1] is None and torch.equal(none[0], plain[0])
