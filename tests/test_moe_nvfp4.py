"""The nvfp4-tiles layout (ops/packed_weight.py) and its kernels (ops/moe_nvfp4.py): the re-layout against the
pack's own order, the grouped GEMM (plain, gathered, gelu·up) and the dequantize kernel in the Triton interpreter
against the torch twin (dequantize, then the f32 GEMM).

Random nibbles, e4m3 block scales and per-expert (multiplier, divisor) pairs, fresh each run; N a multiple of the
64-row program tile, K with an even and an odd number of 32-code groups; ragged expert groups with empty experts
and experts longer than a row tile.
"""

import os

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import moe, moe_nvfp4, moe_paths
from diffgemma.ops import moe_packed as mp
from diffgemma.ops import packed_weight as pwm
from diffgemma.quant import codecs
from test_moe_packed import ragged_offs, rel
from test_nvfp4e import as_weight, random_planes

interpreted = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="needs CUDA or the Triton interpreter")


def stack(E, N, K, divides: bool, exact: bool = False):
    """(natural nvfp4e weight, the same stack in the nvfp4-tiles order), on the host. exact: block scales 1 .. 1.875
    only, so with x in quarters every product and partial sum is exact in f32 (any summation order, same bits)."""
    planes = random_planes(E, N, K, divides)
    if exact:
        planes["scale"] = torch.randint(0x38, 0x40, planes["scale"].shape, dtype=torch.uint8).numpy()
    pw = as_weight("nvfp4e", (E, N, K), codecs.assemble("nvfp4e", (E, N, K), planes))
    return pw, pwm.to_nvfp4_tiles(pw, experts_per_chunk=2)


def exact_product(xs, w, offs):
    """The grouped product of f16-rounded x with the weights in float64 (the kernel's operands, no other rounding)."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(xs[start:end].half().double() @ w[g].double().T)
        start = end
    return torch.cat(out).float()


@pytest.mark.parametrize("shape", [(3, 64, 96), (2, 128, 64)])
def test_tiles_round_trip_to_the_pack_order(shape):
    pw, tiled = stack(*shape, divides=True)
    assert tiled.layout == pwm.NVFP4_TILES and pw.layout == "natural" and tiled.divides
    assert tiled.nbytes == pw.nbytes and not torch.equal(tiled.record, pw.record)  # the bytes did move
    back = pwm.nvfp4_natural_planes(tiled)
    for name in ("codes", "scale", "escale"):
        assert torch.equal(back[name], pw.planes[name]), name
    assert torch.equal(mp.dequantize(tiled), mp.dequantize(pw))


def test_tiles_refusals():
    pw, tiled = stack(2, 64, 64, divides=False)
    with pytest.raises(TensorError, match="natural-order nvfp4e"):
        pwm.to_nvfp4_tiles(tiled)
    odd = as_weight("nvfp4e", (2, 40, 64), codecs.assemble("nvfp4e", (2, 40, 64), random_planes(2, 40, 64, False)))
    with pytest.raises(TensorError, match="multiple of 64"):
        pwm.to_nvfp4_tiles(odd)
    with pytest.raises(TensorError, match="nvfp4-tiles kernels need"):
        moe_nvfp4.grouped_mm_nvfp4_tiles(torch.randn(3, 64), pw, torch.tensor([1, 3], dtype=torch.int32))
    assert not pwm.nvfp4_tiles_wanted("nvfp4e", (2, 64, 64), "cpu")
    assert pwm.PackedWeight.from_record("nvfp4e", pw.shape, pw.record).layout == "natural"  # the host keeps it


@interpreted
@pytest.mark.parametrize("divides", [False, True])
@pytest.mark.parametrize("shape", [(3, 64, 96), (2, 128, 128)])
def test_dequant_kernel_equals_twin(shape, divides):
    pw, tiled = stack(*shape, divides)
    assert torch.equal(moe_nvfp4.dequantize_nvfp4_tiles(tiled, torch.float32), mp.dequantize(pw))
    assert torch.equal(mp.dequantize_triton(tiled, torch.float32), mp.dequantize(pw))  # the prefill entry point


@interpreted
@pytest.mark.parametrize("divides", [False, True])
@pytest.mark.parametrize("K", [96, 128])
def test_grouped_kernel_matches_twin(K, divides):
    E, N, M = 5, 128, 61
    pw, tiled = stack(E, N, K, divides)
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    want = mp.grouped_mm_packed_ref(xs, pw, offs)
    exact = exact_product(xs, mp.dequantize(pw).double(), offs)
    for bm, few in ((32, 16), (16, 0)):
        out = moe_nvfp4.grouped_mm_nvfp4_tiles(xs, tiled, offs, BM=bm, BM_FEW=few)
        assert rel(out, exact) < 1e-6  # f32 accumulation of exact f16 products
        assert rel(out, want) < 2e-3  # the twin's x is not rounded to f16
    src = torch.randint(0, 19, (M,))
    tokens = torch.randn(19, K)
    gathered = moe_nvfp4.grouped_mm_nvfp4_tiles(tokens, tiled, offs, src=src)
    assert torch.equal(gathered, moe_nvfp4.grouped_mm_nvfp4_tiles(tokens[src], tiled, offs))
    order = torch.randperm(E).to(torch.int32)
    assert torch.equal(moe_nvfp4.grouped_mm_nvfp4_tiles(xs, tiled, offs, order=order),
                       moe_nvfp4.grouped_mm_nvfp4_tiles(xs, tiled, offs))


@interpreted
@pytest.mark.parametrize("glu_f16", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_glu_epilogue_is_gelu_mul_after_the_plain_gemm(glu_f16, out_dtype):
    """gelu·up in the epilogue (gate and up rows of the same columns read from one order) is the gelu·up kernel
    after the plain GEMM, from the products rounded as the plain result holds them; the packed entry point
    (ops/moe.py's "packed" path) hands an nvfp4-tiles stack to this kernel."""
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    from test_moe_stream import routes_of

    T, k, E, N, K = 11, 4, 6, 128, 96
    pw, tiled = stack(E, N, K, divides=True, exact=True)
    x = torch.randint(-4, 5, (T, K)).float() / 4
    src, offs = routes_of(T, k, E)
    ref = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiled, offs, src=src, out_dtype=out_dtype)
    got = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiled, offs, src=src, out_dtype=out_dtype, glu=True, glu_f16=glu_f16)
    assert got.shape == (T * k, N // 2) and got.dtype == (torch.float16 if glu_f16 else ref.dtype)
    assert torch.equal(got, gelu_mul_triton(ref, as_f16=glu_f16))
    assert torch.equal(mp.grouped_mm_packed_triton(x, tiled, offs, src=src, out_dtype=out_dtype, glu=True,
                                                   glu_f16=glu_f16), got)


def test_host_dispatch_runs_the_twin_on_the_tiles():
    E, N, K, M = 5, 64, 64, 37
    pw, tiled = stack(E, N, K, divides=False)
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    assert moe_paths.expert_gemm_path(tiled, M, xs) == "twin"  # without CUDA
    assert torch.equal(moe.grouped_mm(xs, tiled, offs), moe.grouped_mm(xs, pw, offs))


@interpreted
def test_dispatch_runs_the_tiles_kernel_on_the_f16_operand(monkeypatch):
    """With Triton, an nvfp4-tiles stack takes the "nvfp4-tiles" path and its kernel gets the f16 operand as it is
    (ops/moe_paths.takes_f16_operand): the twin's product on the same rows, rounded once to bf16."""
    E, N, K, M = 5, 64, 64, 37
    pw, tiled = stack(E, N, K, divides=True, exact=True)
    x = (torch.randint(-4, 5, (M, K)).float() / 4).bfloat16()
    offs = ragged_offs(E, M)
    monkeypatch.setattr(moe_paths, "use_triton", lambda t: True)
    assert moe_paths.expert_gemm_path(tiled, M, x) == "nvfp4-tiles" and moe_paths.expert_gemm_path(pw, M, x) == "packed"
    assert moe_paths.takes_f16_operand(tiled, M, x) and not moe_paths.takes_f16_operand(pw, M, x)
    seen, real = [], moe_nvfp4.grouped_mm_nvfp4_tiles
    monkeypatch.setattr(moe_nvfp4, "grouped_mm_nvfp4_tiles", lambda xx, *a, **k: seen.append(xx.dtype) or real(xx, *a, **k))
    got = moe.grouped_mm(x.half(), tiled, offs, out_dtype=torch.bfloat16)
    assert seen == [torch.float16] and got.dtype == torch.bfloat16
    want = mp.grouped_mm_packed_ref(x.float(), pw, offs).to(torch.bfloat16).float()
    torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2**-7)  # one bf16 ulp; the scale pair rounds once
