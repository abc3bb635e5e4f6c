"""The q4-tiles layout and its kernels (ops/moe_q4.py): the re-layout against the pack's own order, the grouped
GEMM and the dequantize kernel in the Triton interpreter against the torch twins.

Random weights and inputs are fresh each run. Shapes: N a multiple of the layout's 64-row tile; K with an even
and an odd number of 32-code groups (the GEMM takes two groups a step when it can); ragged expert groups with
empty experts and experts longer than a row tile.
"""

import os

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import moe, moe_paths, moe_q4, q4_tiles
from diffgemma.ops import moe_packed as mp
from diffgemma.ops.f16_operand import f16_operand_ref
from diffgemma.quant import codecs
from test_moe_packed import packed, ragged_offs, rel

interpreted = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="needs CUDA or the Triton interpreter")


def f32_product(xs, w, offs):
    """The grouped product in float64 (no rounding but the result's)."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(xs[start:end].double() @ w[g].double().T)
        start = end
    return torch.cat(out).float()


@pytest.mark.parametrize("shape", [(3, 64, 96), (2, 128, 64), (1, 192, 160)])
def test_tile_layout_round_trips_to_the_pack_order(shape):
    pw, want = packed("q4", shape)
    tiled = q4_tiles.to_tile_layout(pw, experts_per_chunk=2)
    assert tiled.layout == q4_tiles.LAYOUT and pw.layout == "natural"
    assert tiled.record.data_ptr() != pw.record.data_ptr() and tiled.nbytes == pw.nbytes
    side = q4_tiles.side_words(tiled)  # scale | min << 16, in the bytes of the pack's two side planes
    assert side.numel() * 4 == pw.planes["scale"].numel() + pw.planes["min"].numel()
    back = q4_tiles.natural_planes(tiled)
    assert torch.equal(back["codes"], pw.planes["codes"])
    for name in ("scale", "min"):
        assert torch.equal(back[name], pw.planes[name].view(torch.float16))
    assert not torch.equal(tiled.record, pw.record)  # the bytes did move
    assert torch.equal(q4_tiles.to_natural_layout(tiled).record, pw.record)
    assert torch.equal(mp.dequantize(tiled), want)
    assert torch.equal(mp.dequantize(tiled, torch.bfloat16), want.bfloat16())


def test_word_bits_round_trip_and_reach_bits_6_to_9_and_22_to_25():
    """Every slot's code lands where register r = slot % 4's shift (none, <<4, >>4, rotate 8) puts it at bits 6..9
    (slot r) and 22..25 (slot r + 4): the fields the kernel's LOP3 masks."""
    q = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    w = q4_tiles.pack_words(q)
    assert w.dtype == torch.int32 and w.shape == (5, 4)
    assert torch.equal(q4_tiles.unpack_words(w), q)
    u = w.to(torch.int64) & 0xFFFFFFFF
    regs = [u, (u << 4) & 0xFFFFFFFF, u >> 4, ((u << 8) | (u >> 24)) & 0xFFFFFFFF]
    slots = q.view(5, 4, 8).to(torch.int64)
    for r, v in enumerate(regs):
        assert torch.equal((v >> 6) & 0xF, slots[..., r]) and torch.equal((v >> 22) & 0xF, slots[..., r + 4])


def test_word_order_puts_a_quads_codes_in_one_word():
    """Slot 8t + p of a group holds k = 16(r//2) + 8(r%2) + 2t + h (r = p % 4, h = p // 4): lane t's registers."""
    src = q4_tiles.nibble_source("cpu").tolist()
    assert sorted(src) == list(range(32))
    for t in range(4):
        ks = src[8 * t: 8 * t + 8]
        assert sorted(ks) == sorted(2 * t + d for d in (0, 1, 8, 9, 16, 17, 24, 25))
        assert ks[0] + 1 == ks[4]  # nibbles r and r + 4 make one bf16 pair: k and k + 1


def test_tile_layout_refuses_what_it_cannot_hold():
    with pytest.raises(TensorError, match="multiple of 64"):
        q4_tiles.to_tile_layout(packed("q4", (2, 40, 64))[0])
    with pytest.raises(TensorError, match="q4"):
        q4_tiles.to_tile_layout(packed("q5", (2, 64, 64))[0])
    tiled = q4_tiles.to_tile_layout(packed("q4", (2, 64, 64))[0])
    with pytest.raises(TensorError, match="q4-tiles"):
        q4_tiles.to_tile_layout(tiled)
    with pytest.raises(TensorError, match="to_tile_layout"):
        moe_q4.grouped_mm_q4_tiles(torch.randn(4, 64), packed("q4", (2, 64, 64))[0],
                                   torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(TensorError, match="x must be"):
        moe_q4.grouped_mm_q4_tiles(torch.randn(4, 32), tiled, torch.tensor([2, 4], dtype=torch.int32))


def test_layout_wanted_only_for_cuda_q4_stacks(monkeypatch):
    assert not q4_tiles.wanted("q4", (4, 128, 64), "cpu")
    assert not q4_tiles.wanted("q4", (4, 100, 64), "cuda") and not q4_tiles.wanted("q5", (4, 128, 64), "cuda")
    assert q4_tiles.wanted("q4", (4, 128, 64), "cuda") == q4_tiles.HAVE_TRITON
    monkeypatch.setenv("DIFFGEMMA_Q4_LAYOUT", "natural")
    assert not q4_tiles.wanted("q4", (4, 128, 64), "cuda")
    monkeypatch.setenv("DIFFGEMMA_Q4_LAYOUT", "tiles")
    with pytest.raises(ValueError, match="DIFFGEMMA_Q4_LAYOUT='tiles': expected 'q4-tiles' or 'natural'"):
        q4_tiles.wanted("q4", (4, 128, 64), "cuda")


def test_decode_f16_is_the_weight_to_one_f16_rounding_of_the_offset():
    """w = f16((16 + q)·s + f16(min − 16·s)): within half an f16 ulp of |w| plus one of |min − 16·s| of the exact
    decode; and a product with these weights is closer to the exact one than with bf16 weights (the twin's)."""
    E, N, K = 3, 128, 256
    pw, want = packed("q4", (E, N, K))
    got = q4_tiles.decode_f16(q4_tiles.to_tile_layout(pw)).double()
    want = want.double()
    scale = pw.planes["scale"].view(torch.float16).double().view(E, N, K // 32, 1)
    mins = pw.planes["min"].view(torch.float16).double().view(E, N, K // 32, 1)
    bound = (want.abs().view(E, N, K // 32, 32) + (mins - 16 * scale).abs()) * 2.0**-11 * 1.0001
    assert ((got - want).abs().view(E, N, K // 32, 32) <= bound).all()
    # The product over all three experts' rows: the two errors are ~10 % apart, so one expert and 64 rows of x
    # (the earlier sample) put them in the wrong order about once in 40 runs; this sample, ratio 0.88-0.96 in 100.
    w, g = want.reshape(-1, K), got.reshape(-1, K)
    x = torch.randn(256, K, dtype=torch.float64)
    exact = x @ w.T
    assert rel(x @ g.T, exact) < rel(x @ w.bfloat16().double().T, exact)


@interpreted
@pytest.mark.parametrize("K", [64, 96, 256])  # 2 groups (2 a step), 3 (1 a step), 8 (4 a step)
@pytest.mark.parametrize("BM", [16, 64])
def test_tiles_kernel_matches_its_f16_operands_and_the_exact_product(K, BM):
    E, N, M = 6, 128, 150  # some experts hold more than one row tile of 16
    pw, w = packed("q4", (E, N, K))
    tiled = q4_tiles.to_tile_layout(pw)
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    got = moe_q4.grouped_mm_q4_tiles(xs, tiled, offs, BM=BM, asm=False)
    assert got.shape == (M, N)
    # the planes through tensor descriptors (TMA on Hopper): the same words, the same bits
    assert torch.equal(moe_q4.grouped_mm_q4_tiles(xs, tiled, offs, BM=BM, asm=False, tma=True), got)
    # what the kernel multiplies: f16 x and f16 weights, summed in f32 (only the summation order may differ)
    assert rel(got, f32_product(xs.half(), q4_tiles.decode_f16(tiled), offs)) < 1e-6
    exact = f32_product(xs, w, offs)
    assert rel(got, exact) < 2e-3
    assert rel(mp.grouped_mm_packed_ref(xs, pw, offs), exact) < 1e-5  # the twin in f32: same product, other order
    if BM == 16:  # the dispatcher runs this kernel on CUDA, with BM 32 at these rows per expert
        with pytest.MonkeyPatch.context() as mpatch:
            mpatch.setattr(moe_paths, "use_triton", lambda t: True)
            assert torch.equal(moe.grouped_mm(xs, tiled, offs), moe_q4.grouped_mm_q4_tiles(xs, tiled, offs, asm=False))


@interpreted
def test_tiles_kernel_launch_order_does_not_change_the_result():
    """The experts taken in a given order (most rows first, from the plan kernel) give the same bits."""
    from diffgemma.ops.moe_plan import moe_plan_triton

    T, k, E, N, K = 30, 3, 8, 64, 96
    pw, _ = packed("q4", (E, N, K))
    tiled = q4_tiles.to_tile_layout(pw)
    ex = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ex[:, 0] = 6  # a crowded expert: first in the order
    src, _, offs, order = moe_plan_triton(ex, E, with_order=True)
    x = torch.randn(T, K)
    got = moe_q4.grouped_mm_q4_tiles(x, tiled, offs, src=src, asm=False, order=order)
    assert order[0] == 6 and not torch.equal(order, torch.arange(E, dtype=torch.int32))
    assert torch.equal(got, moe_q4.grouped_mm_q4_tiles(x, tiled, offs, src=src, asm=False))
    with pytest.raises(TensorError, match="reads the pack's byte order"):  # the other kernel refuses this layout
        mp.grouped_mm_packed_triton(x, tiled, offs, src=src, order=order)
    with pytest.raises(TensorError, match="order must be int32"):
        moe_q4.grouped_mm_q4_tiles(x, tiled, offs, src=src, order=order.long())


@interpreted
def test_tiles_kernel_clamps_x_to_the_f16_range():
    """bf16 x beyond ±65504 is clamped to it in the kernel (f16 operands) instead of becoming inf."""
    E, N, K = 2, 64, 64
    pw, _ = packed("q4", (E, N, K))
    tiled = q4_tiles.to_tile_layout(pw)
    xs = torch.randn(4, K, dtype=torch.bfloat16)
    xs[1, 3] = 1e6
    offs = torch.tensor([2, 4], dtype=torch.int32)
    got = moe_q4.grouped_mm_q4_tiles(xs, tiled, offs, asm=False)
    want = f32_product(xs.float().clamp(-65504, 65504).half(), q4_tiles.decode_f16(tiled), offs)
    assert torch.isfinite(got).all() and rel(got.float(), want) < 1e-2
    # a producer's f16 operand (ops/f16_operand.py) is what the loop makes of bf16 x: the same bits out
    for tma in (False, True):
        f16 = moe_q4.grouped_mm_q4_tiles(f16_operand_ref(xs), tiled, offs, asm=False, out_dtype=torch.bfloat16, tma=tma)
        assert f16.dtype == torch.bfloat16 and torch.equal(f16, got)


@interpreted
def test_tiles_kernel_gathers_rows_through_src():
    from test_moe_stream import routes_of

    T, k, E, N, K = 11, 4, 6, 64, 96
    pw, w = packed("q4", (E, N, K))
    tiled = q4_tiles.to_tile_layout(pw)
    x = torch.randn(T, K)
    src, offs = routes_of(T, k, E)
    got = moe_q4.grouped_mm_q4_tiles(x, tiled, offs, src=src, asm=False)
    assert torch.equal(got, moe_q4.grouped_mm_q4_tiles(x.index_select(0, src), tiled, offs, asm=False))
    assert torch.equal(got, moe_q4.grouped_mm_q4_tiles(x, tiled, offs, src=src, asm=False, tma=True))
    assert rel(got, f32_product(x.index_select(0, src).half(), q4_tiles.decode_f16(tiled), offs)) < 1e-6
    assert moe_q4.grouped_mm_q4_tiles(x[:0], tiled, torch.zeros(E, dtype=torch.int32), src=src[:0]).shape == (0, N)


@interpreted
@pytest.mark.parametrize("K", [64, 96, 256])
def test_tiles_dequantize_kernel_equals_the_twin(K):
    """f32 here: the interpreter's cast to bf16 truncates (the GPU test checks bf16 bit for bit)."""
    pw, want = packed("q4", (3, 128, K))
    tiled = q4_tiles.to_tile_layout(pw)
    assert torch.equal(moe_q4.dequantize_q4_tiles(tiled, torch.float32), want)
    assert torch.equal(moe.dequantize_stack(tiled, torch.float32), want)


def test_packed_dispatch_on_cpu_reads_the_tile_layout():
    """Off CUDA a q4-tiles weight (made by hand here: the engine makes them only on CUDA) runs the twin."""
    E, N, K, M = 6, 64, 64, 30
    pw, w = packed("q4", (E, N, K))
    tiled = q4_tiles.to_tile_layout(pw)
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    assert torch.equal(moe.grouped_mm(xs, tiled, offs), moe.grouped_mm(xs, pw, offs))
    assert codecs.record_nbytes("q4", (E, N, K)) == tiled.nbytes


@pytest.mark.parametrize("shape", [(3, 128, 96), (2, 192, 64)])  # F = 64, 96: tiles within and across 64
def test_glu_tile_order_round_trips_to_the_pack_order(shape):
    """A gate ‖ up stack laid for the gelu·up epilogue: tile t holds gate rows 32t.. then up rows F + 32t..; the
    twins read it back in the pack's order."""
    pw, want = packed("q4", shape)
    tiled = q4_tiles.to_tile_layout(pw, glu=True)
    assert tiled.glu and not q4_tiles.to_tile_layout(pw).glu
    order = q4_tiles.glu_row_order(shape[1])
    F = shape[1] // 2
    assert order[:32].tolist() == list(range(32)) and order[32:64].tolist() == list(range(F, F + 32))
    back = q4_tiles.natural_planes(tiled)
    assert torch.equal(back["codes"], pw.planes["codes"])
    assert torch.equal(q4_tiles.to_natural_layout(tiled).record, pw.record)
    assert torch.equal(mp.dequantize(tiled), want)


def exact_q4(shape):
    """A q4 stack that decodes exactly to (code - 8) / 16: every group of 32 holds codes 0 and 15, so its scale is
    1/16 and its min -1/2. On inputs of a few bits its GEMMs then sum exactly in any order, so the interpreter's
    dot (the host's BLAS, whose blocking follows the tile's shape: an AVX2 machine's differs in the last bits
    between the GLU tile and the plain one) gives every tile shape the same bits."""
    q = torch.randint(0, 16, shape)
    q[..., 0::32], q[..., 1::32] = 0, 15
    w = (q.float() - 8) / 16
    rec = codecs.assemble("q4", shape, codecs.encode("q4", w))
    assert torch.equal(codecs.decode("q4", rec, shape), w)
    return mp.PackedWeight.from_record("q4", shape, torch.frombuffer(bytearray(rec), dtype=torch.uint8).clone())


@interpreted
@pytest.mark.parametrize("glu_f16", [False, True])
def test_tiles_kernel_gelu_epilogue_is_gelu_mul_after_the_plain_gemm(glu_f16):
    """gelu·up made in the q4 GEMM's epilogue from a glu-laid stack: the same bits as the gelu·up kernel (also
    its f16-operand form, what the q4 down GEMM reads) after the plain GEMM on the plain layout; TMA the same;
    a plain call on the glu-laid stack puts its columns back in order."""
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    from test_moe_stream import routes_of

    T, k, E, N, K = 11, 4, 6, 192, 96
    pw = exact_q4((E, N, K))
    plain, glu = q4_tiles.to_tile_layout(pw), q4_tiles.to_tile_layout(pw, glu=True)
    x = torch.randint(-4, 5, (T, K)).float() / 4  # with exact_q4: every product and partial sum exact in f32
    src, offs = routes_of(T, k, E)
    ref = moe_q4.grouped_mm_q4_tiles(x, plain, offs, src=src, asm=False)
    got = moe_q4.grouped_mm_q4_tiles(x, glu, offs, src=src, asm=False, glu=True, glu_f16=glu_f16)
    assert got.shape == (T * k, N // 2) and got.dtype == (torch.float16 if glu_f16 else torch.float32)
    assert torch.equal(got, gelu_mul_triton(ref, as_f16=glu_f16))
    assert torch.equal(moe_q4.grouped_mm_q4_tiles(x, glu, offs, src=src, asm=False, glu=True, glu_f16=glu_f16,
                                                  tma=True), got)
    assert torch.equal(moe_q4.grouped_mm_q4_tiles(x, glu, offs, src=src, asm=False), ref)
    with pytest.raises(TensorError, match="glu"):
        moe_q4.grouped_mm_q4_tiles(x, plain, offs, src=src, glu=True)


@interpreted
def test_tiles_dequantize_kernel_reads_the_glu_order_back():
    pw, want = packed("q4", (2, 192, 96))
    assert torch.equal(moe_q4.dequantize_q4_tiles(q4_tiles.to_tile_layout(pw, glu=True), torch.float32), want)


@interpreted
def test_tiles_kernel_gelu_epilogue_rounds_products_as_an_f16_result_would():
    """out_dtype f16 (GU_ROUND 2): gate and up rounded to f16 first, as the plain GEMM's f16 result holds them."""
    from diffgemma.ops.gelu_mul import gelu_mul_triton

    E, N, K, M = 6, 128, 64, 40
    pw = exact_q4((E, N, K))
    # sums exact in f32 (see exact_q4) yet of up to 19 significant bits, well past f16's 11: a missing rounding shows
    x = torch.randint(-1024, 1025, (M, K)).float() / 64
    offs = ragged_offs(E, M)
    ref = moe_q4.grouped_mm_q4_tiles(x, q4_tiles.to_tile_layout(pw), offs, asm=False, out_dtype=torch.float16)
    got = moe_q4.grouped_mm_q4_tiles(x, q4_tiles.to_tile_layout(pw, glu=True), offs, asm=False, glu=True,
                                     out_dtype=torch.float16)
    assert ref.dtype == got.dtype == torch.float16
    assert torch.equal(got, gelu_mul_triton(ref))
