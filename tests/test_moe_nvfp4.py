"""The nvfp4-tiles layout (ops/packed_weight.py) and its kernels (ops/moe_nvfp4.py): the re-layout against the
pack's own order (plain and in the glu row order of a gate ‖ up stack), the grouped GEMM (plain, gathered, gelu·up)
and the dequantize kernel in the Triton interpreter against the torch twin (dequantize, then the f32 GEMM), and the
loader laying gate_up stacks in the glu order where the kernels run.

Random nibbles, e4m3 block scales (subnormal ones included) and per-expert (multiplier, divisor) pairs, fresh each
run; N a multiple of the 64-row program tile, K with K steps of 2 and of 4 code groups; ragged expert groups with
empty experts and experts longer than a row tile.
"""

import os

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import moe, moe_nvfp4, moe_paths, q4_tiles
from diffgemma.ops import moe_packed as mp
from diffgemma.ops import packed_weight as pwm
from diffgemma.quant import codecs
from test_moe_packed import ragged_offs, rel
from test_nvfp4e import as_weight, random_planes

interpreted = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="needs CUDA or the Triton interpreter")


def stack(E, N, K, divides: bool, exact: bool = False, glu: bool = False):
    """(natural nvfp4e weight, the same stack in the nvfp4-tiles order; glu: in the glu row order), on the host.
    exact: block scales 1 .. 1.875 only, so with x in quarters every product and partial sum is exact in f32 (any
    summation order, same bits)."""
    planes = random_planes(E, N, K, divides)
    if exact:
        planes["scale"] = torch.randint(0x38, 0x40, planes["scale"].shape, dtype=torch.uint8).numpy()
    pw = as_weight("nvfp4e", (E, N, K), codecs.assemble("nvfp4e", (E, N, K), planes))
    return pw, pwm.to_nvfp4_tiles(pw, experts_per_chunk=2, glu=glu)


def rows_permuted(pw, order):
    """The natural nvfp4e stack `pw` with each expert's rows taken in `order` (position -> row)."""
    E, N, K = pw.shape
    planes = {n: pw.planes[n].view(E, N, -1)[:, order].reshape(E * N, -1).numpy() for n in ("codes", "scale")}
    planes["escale"] = pw.planes["escale"].numpy()
    return as_weight("nvfp4e", pw.shape, codecs.assemble("nvfp4e", pw.shape, planes))


def exact_product(xs, w, offs):
    """The grouped product of f16-rounded x with the weights in float64 (the kernel's operands, no other rounding)."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(xs[start:end].half().double() @ w[g].double().T)
        start = end
    return torch.cat(out).float()


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("shape", [(3, 64, 192), (2, 128, 64), (2, 192, 128)])
def test_tiles_round_trip_to_the_pack_order(shape, glu):
    """natural -> tiles (glu: in the glu row order) -> natural is the identity, and the twin's decode of the tiles
    is the natural stack's; a glu-laid stack holds the plain layout of its rows taken in glu_row_order's order."""
    pw, tiled = stack(*shape, divides=True, glu=glu)
    assert tiled.layout == pwm.NVFP4_TILES and pw.layout == "natural" and tiled.divides and tiled.glu == glu
    assert tiled.nbytes == pw.nbytes and not torch.equal(tiled.record, pw.record)  # the bytes did move
    back = pwm.nvfp4_natural_planes(tiled)
    for name in ("codes", "scale", "escale"):
        assert torch.equal(back[name], pw.planes[name]), name
    assert torch.equal(mp.dequantize(tiled), mp.dequantize(pw))
    if glu:
        order = q4_tiles.glu_row_order(shape[1])
        assert torch.equal(tiled.record, pwm.to_nvfp4_tiles(rows_permuted(pw, order)).record)
        if shape[1] > pwm.NVFP4_TILE_N:  # one tile: the glu order is the plain one
            assert not torch.equal(tiled.record, pwm.to_nvfp4_tiles(pw).record)


def test_tiles_refusals():
    pw, tiled = stack(2, 64, 64, divides=False)
    with pytest.raises(TensorError, match="natural-order nvfp4e"):
        pwm.to_nvfp4_tiles(tiled)
    odd = as_weight("nvfp4e", (2, 40, 64), codecs.assemble("nvfp4e", (2, 40, 64), random_planes(2, 40, 64, False)))
    with pytest.raises(TensorError, match="multiple of 64"):
        pwm.to_nvfp4_tiles(odd)
    odd_k = as_weight("nvfp4e", (2, 64, 96), codecs.assemble("nvfp4e", (2, 64, 96), random_planes(2, 64, 96, False)))
    with pytest.raises(TensorError, match="K of 64"):  # three code groups: no whole scale word
        pwm.to_nvfp4_tiles(odd_k)
    with pytest.raises(TensorError, match="nvfp4-tiles kernels need"):
        moe_nvfp4.grouped_mm_nvfp4_tiles(torch.randn(3, 64), pw, torch.tensor([1, 3], dtype=torch.int32))
    assert not pwm.nvfp4_tiles_wanted("nvfp4e", (2, 64, 64), "cpu")
    assert pwm.PackedWeight.from_record("nvfp4e", pw.shape, pw.record).layout == "natural"  # the host keeps it


@interpreted
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("divides", [False, True])
@pytest.mark.parametrize("shape", [(3, 64, 192), (2, 128, 128)])
def test_dequant_kernel_equals_twin(shape, divides, glu):
    pw, tiled = stack(*shape, divides, glu=glu)
    assert torch.equal(moe_nvfp4.dequantize_nvfp4_tiles(tiled, torch.float32), mp.dequantize(pw))
    assert torch.equal(mp.dequantize_triton(tiled, torch.float32), mp.dequantize(pw))  # the prefill entry point


@interpreted
@pytest.mark.parametrize("divides", [False, True])
@pytest.mark.parametrize("K", [192, 128])
def test_grouped_kernel_matches_twin(K, divides):
    """Plain and glu-laid stacks (the plain product of a glu-laid one in logical column order) against the exact
    product and the twin, through the BM_FEW pass and the BM loop; gathered through src; in a given launch order."""
    E, N, M = 5, 128, 61
    pw, tiled = stack(E, N, K, divides)
    glu_tiled = pwm.to_nvfp4_tiles(pw, glu=True)
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    want = mp.grouped_mm_packed_ref(xs, pw, offs)
    exact = exact_product(xs, mp.dequantize(pw).double(), offs)
    for bm, few in ((32, 16), (16, 0)):
        for w in (tiled, glu_tiled):
            out = moe_nvfp4.grouped_mm_nvfp4_tiles(xs, w, offs, BM=bm, BM_FEW=few)
            assert rel(out, exact) < 1e-6, w.glu  # f32 accumulation of exact f16 products
            assert rel(out, want) < 2e-3, w.glu  # the twin's x is not rounded to f16
    exact_pw, exact_tiled = stack(E, N, K, divides=False, exact=True)
    exact_glu = pwm.to_nvfp4_tiles(exact_pw, glu=True)
    for w in (exact_pw, exact_tiled, exact_glu):  # tensor scale pairs (1, 1): the result is the accumulator, exact
        w.escale.fill_(1.0)
    xq = torch.randint(-4, 5, (M, K)).float() / 4
    want_exact = exact_product(xq, mp.dequantize(exact_pw).double(), offs)
    assert torch.equal(moe_nvfp4.grouped_mm_nvfp4_tiles(xq, exact_tiled, offs), want_exact)  # 2^-14 weights, 2^14 back
    assert torch.equal(moe_nvfp4.grouped_mm_nvfp4_tiles(xq, exact_glu, offs), want_exact)  # logical column order
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
    """gelu·up in the epilogue of a glu-laid stack (a program's gate and up rows of the same columns, one run) is the
    gelu·up kernel after the plain GEMM, from the products rounded as the plain result holds them; glu asked of a
    stack not laid for it gives the same (the plain GEMM, then that kernel); the packed entry point (ops/moe.py's
    "packed" path) hands an nvfp4-tiles stack to this kernel."""
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    from test_moe_stream import routes_of

    T, k, E, N, K = 11, 4, 6, 128, 192
    pw, tiled = stack(E, N, K, divides=True, exact=True)
    glu_tiled = pwm.to_nvfp4_tiles(pw, glu=True)
    x = torch.randint(-4, 5, (T, K)).float() / 4
    src, offs = routes_of(T, k, E)
    ref = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiled, offs, src=src, out_dtype=out_dtype)
    got = moe_nvfp4.grouped_mm_nvfp4_tiles(x, glu_tiled, offs, src=src, out_dtype=out_dtype, glu=True,
                                           glu_f16=glu_f16)
    assert got.shape == (T * k, N // 2) and got.dtype == (torch.float16 if glu_f16 else ref.dtype)
    assert torch.equal(got, gelu_mul_triton(ref, as_f16=glu_f16))
    assert torch.equal(moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiled, offs, src=src, out_dtype=out_dtype, glu=True,
                                                        glu_f16=glu_f16), got)  # not glu-laid: gelu·up after
    assert torch.equal(mp.grouped_mm_packed_triton(x, glu_tiled, offs, src=src, out_dtype=out_dtype, glu=True,
                                                   glu_f16=glu_f16), got)


def test_host_dispatch_runs_the_twin_on_the_tiles():
    E, N, K, M = 5, 128, 64, 37
    pw, tiled = stack(E, N, K, divides=False)
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    assert moe_paths.expert_gemm_path(tiled, M, xs) == "twin"  # without CUDA
    want = moe.grouped_mm(xs, pw, offs)
    assert torch.equal(moe.grouped_mm(xs, tiled, offs), want)
    assert torch.equal(moe.grouped_mm(xs, pwm.to_nvfp4_tiles(pw, glu=True), offs), want)


class _RecordSource:
    """A tensor source of nvfp4e expert stacks (kind, shape, record_tensor), as model/engine_weights.py reads them."""

    def __init__(self, weights: dict):
        self.weights = weights

    def kind(self, name):
        return self.weights[name].fmt

    def shape(self, name):
        return self.weights[name].shape

    def record_tensor(self, name, device):
        return self.weights[name].record.clone().to(device)


@pytest.mark.parametrize("on_cuda", [False, True])
def test_loader_lays_gate_up_stacks_in_the_glu_order_where_the_kernels_run(on_cuda, monkeypatch):
    """model/engine_weights.py's packed-stack loader: where the nvfp4-tiles kernels run (CUDA; here made to say so
    on the host) a gate_up stack is re-laid in the glu row order and a down stack in the plain one; elsewhere both
    keep the pack's order. The logical weights do not change."""
    from diffgemma.model import engine_weights

    gu, _ = stack(2, 128, 64, divides=False)
    dn, _ = stack(2, 64, 128, divides=True)
    source = _RecordSource({"l.experts.gate_up_proj": gu, "l.experts.down_proj": dn})
    if on_cuda:
        monkeypatch.setattr(pwm, "nvfp4_tiles_wanted", lambda fmt, shape, device: pwm.nvfp4_tiles_ok(fmt, shape))
    got_gu = engine_weights._packed(source, "l.experts.gate_up_proj", "cpu")
    got_dn = engine_weights._packed(source, "l.experts.down_proj", "cpu")
    layout = pwm.NVFP4_TILES if on_cuda else "natural"
    assert (got_gu.layout, got_gu.glu) == (layout, on_cuda) and (got_dn.layout, got_dn.glu) == (layout, False)
    assert torch.equal(mp.dequantize(got_gu), mp.dequantize(gu))
    assert torch.equal(mp.dequantize(got_dn), mp.dequantize(dn))


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


def run_ptx(text: str, args: dict) -> dict:
    """A small interpreter of the PTX the decode inlines (mov, shl, shr, and, lop3, prmt, mul.rn.f16x2), elementwise
    over int64 arrays of 32-bit values; args: "$i" -> values. Returns every register it wrote."""
    reg = dict(args)
    u32 = 0xFFFFFFFF

    def val(tok):
        tok = tok.strip()
        return reg[tok] if tok in reg else torch.full_like(next(iter(args.values())), int(tok, 0))

    def f16x2_mul(a, b):
        def half(v, h):
            return ((v >> (16 * h)) & 0xFFFF).to(torch.int16).view(torch.float16)
        lo, hi = (half(a, h) * half(b, h) for h in (0, 1))  # one rounding of the exact product, as mul.rn
        return (lo.view(torch.int16).to(torch.int64) & 0xFFFF) | ((hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 16)

    for line in text.strip("{}\n").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {l, h}, r: unpack
            names, src = rest[1:].split("}, ")
            lo, hi = (n.strip() for n in names.split(","))
            reg[lo], reg[hi] = val(src) & 0xFFFF, (val(src) >> 16) & 0xFFFF
            continue
        d, tail = (t.strip() for t in rest.split(",", 1))
        if tail.startswith("{"):  # mov.b32 r, {l, h}: pack
            lo, hi = (n.strip() for n in tail.strip("{}").split(","))
            reg[d] = reg[lo] | (reg[hi] << 16)
            continue
        ops = [t.strip() for t in tail.split(",")]
        if op == "mov.b32":
            reg[d] = val(ops[0]) & u32
        elif op == "shl.b32":
            reg[d] = (val(ops[0]) << int(ops[1], 0)) & u32
        elif op == "shr.u32":
            reg[d] = (val(ops[0]) & u32) >> int(ops[1], 0)
        elif op == "and.b32":
            reg[d] = val(ops[0]) & val(ops[1]) & u32
        elif op == "lop3.b32":
            assert ops[3] == "0xea"  # (a & b) | c
            reg[d] = ((val(ops[0]) & val(ops[1])) | val(ops[2])) & u32
        elif op == "prmt.b32":  # default mode: result byte i = byte sel_i of {b, a} (a: bytes 0..3)
            a, b, sel = val(ops[0]) & u32, val(ops[1]) & u32, int(ops[2], 0)
            pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            reg[d] = sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))
        elif op == "mul.rn.f16x2":
            reg[d] = f16x2_mul(val(ops[0]), val(ops[1]))
        else:
            raise AssertionError(f"run_ptx: no rule for {op}")
    return reg


def test_decode_ptx_makes_the_plain_ops_weights():
    """The inline PTX of the CUDA decode (which the interpreter cannot run), interpreted on random words and every
    scale byte: (s_lo, s_hi) pairs equal to the e4m3 values, and each register's weights e2m1 · s · 2^-14 as f16,
    bit for bit, in NVFP4_BITS' placement (the torch layout's)."""
    n = 4096
    sw = torch.randint(0, 2 ** 32, (n,), dtype=torch.int64)
    sw[:256] = torch.arange(256) * 0x01010101  # every byte value, sign bit and NaN code too
    sc = run_ptx(moe_nvfp4.SCALE_PTX, {"$2": sw})
    e4m3 = lambda b: (b & 0x7F).to(torch.uint8).view(torch.float8_e4m3fn).float()  # noqa: E731 (sign dropped)
    for out, shift in (("$0", 0), ("$1", 16)):
        for h in (0, 1):
            got = ((sc[out] >> (16 * h)) & 0xFFFF).to(torch.int16).view(torch.float16).float()
            want = e4m3((sw >> (shift + 8 * h)) & 0xFF)
            nan = torch.isnan(want)  # 0x7F: e4m3_f32 reads 480, as the kernel's plain ops do
            assert torch.equal(got[~nan], want[~nan]) and bool((got[nan] == 480).all())
    words = torch.randint(0, 2 ** 32, (n,), dtype=torch.int64)
    regs = run_ptx(moe_nvfp4.DECODE_PTX, {"$4": words, "$5": sc["$0"]})
    codes = pwm.unpack_nvfp4_words(torch.stack([words, words, words, words], -1).to(torch.int32)
                                   .view(n, 4))[:, :8].long()  # word 0's slots
    e2m1 = torch.tensor(codecs.E2M1_VALUES + tuple(-v for v in codecs.E2M1_VALUES))
    for r in range(4):
        s = ((sc["$0"] >> (16 * (r // 2))) & 0xFFFF).to(torch.int16).view(torch.float16).float()
        for h in (0, 1):
            want = (e2m1[codes[:, r + 4 * h]] * s * 2.0 ** -14).half()
            got = ((regs[f"${r}"] >> (16 * h)) & 0xFFFF).to(torch.int16).view(torch.float16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (r, h)


def test_nvfp4_words_round_trip_and_fill_the_word():
    bits = sorted(b for m, s in pwm.NVFP4_BITS for b in (m, m + 1, m + 2, s))
    assert bits == list(range(16))  # four codes a half, no bit shared
    q = torch.randint(0, 16, (5, 3, 32), dtype=torch.uint8)
    assert torch.equal(pwm.unpack_nvfp4_words(pwm.pack_nvfp4_words(q)), q)


@interpreted
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("K", [128, 192])  # K steps of 4 code groups (two scale-word rows a box) and of 2 (one)
def test_tma_path_reads_the_pointer_paths_bits(K, glu):
    """The planes through tensor descriptors (ops/moe_nvfp4._descriptors: one code box of 8-row lines and one scale
    box a K step; glu: of a glu-laid stack, its gate and up rows one run) give the pointer path's bits: few routes an
    expert (one BM_FEW pass, as at denoise) gathered through src, and the BM loop over long experts beside short ones
    in a given launch order, gelu·up and (glu-laid) the plain product in logical column order; on exact operands,
    the twin's product (glu: gelu_mul of the plain one) bit for bit."""
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    from test_moe_stream import routes_of

    E, N = 6, 128
    _, tiled = stack(E, N, K, divides=True, glu=glu)
    T, k = 11, 4
    x = torch.randn(T, K)
    src, offs = routes_of(T, k, E)
    xs = torch.randn(61, K)
    long_offs = torch.tensor([0, 5, 32, 32, 40, 61], dtype=torch.int32)  # 0, 5, 27, 0, 8, 21 rows
    order = torch.randperm(E).to(torch.int32)
    outs = [dict(glu=True, glu_f16=True, out_dtype=torch.bfloat16), {}] if glu else [{}]
    for xx, oo, kw in ((x, offs, dict(src=src)), (xs, long_offs, dict(BM=16, BM_FEW=8, order=order))):
        for out_kw in outs:
            got = moe_nvfp4.grouped_mm_nvfp4_tiles(xx, tiled, oo, tma=True, **kw, **out_kw)
            assert torch.equal(got, moe_nvfp4.grouped_mm_nvfp4_tiles(xx, tiled, oo, tma=False, **kw, **out_kw)), kw
    exact_pw, exact_tiled = stack(E, N, K, divides=False, exact=True, glu=glu)
    for w in (exact_pw, exact_tiled):
        w.escale.fill_(1.0)
    xq = torch.randint(-4, 5, (61, K)).float() / 4
    plain = moe_nvfp4.grouped_mm_nvfp4_tiles(xq, exact_tiled, long_offs, BM=16, BM_FEW=8, tma=True)
    assert torch.equal(plain, exact_product(xq, mp.dequantize(exact_pw).double(), long_offs))
    if glu:
        got = moe_nvfp4.grouped_mm_nvfp4_tiles(xq, exact_tiled, long_offs, BM=16, BM_FEW=8, tma=True, glu=True)
        assert torch.equal(got, gelu_mul_triton(plain))
