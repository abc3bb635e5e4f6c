"""nvfp4e expert stacks on CUDA in the nvfp4-tiles layout (ops/packed_weight.py) and their kernels (ops/moe_nvfp4.py).

Skips without CUDA. At the model's expert shapes (hidden 2816, moe_intermediate 704, 128 experts, top-8; one canvas
of 256 rows and eight of 2048), gate_up stacks laid in the glu row order as the loader lays them: the GEMM against
the exact product of its operands (f16 x, exact f16 weights) and the twin (the plain product of a glu-laid stack in
logical column order), the PTX decode against the plain-op one bit for bit (plain and as the engine calls gate_up),
the planes through TMA against cp.async bit for bit (the GLU GEMM included), exact operands against their exact sum
bit for bit (the 2^-14-scaled f16 weights through the MMA), gelu·up in the epilogue against gelu_mul of the plain
product, the dequantize kernel against the twin bit for bit, and the expert FFN through the dispatcher against the
generic packed kernel on the pack's order. Then the engine bench/hub_fixtures.py builds for modelopt-nvfp4 holds its
experts in this layout (gate_up glu-laid) and runs this kernel.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.ops import moe, moe_nvfp4  # noqa: E402
from diffgemma.ops._backend import tma_available  # noqa: E402
from diffgemma.ops import moe_packed as mp  # noqa: E402
from diffgemma.ops import packed_weight as pwm  # noqa: E402
from diffgemma.ops.gelu_mul import gelu_mul  # noqa: E402
from diffgemma.ops.layouts import record_nbytes, record_planes  # noqa: E402
from test_moe_nvfp4 import exact_product  # noqa: E402
from test_moe_stream import routes_of  # noqa: E402

DEV = "cuda"
E, H, F, TOPK = 128, 2816, 704, 8
HAS_TMA = torch.cuda.is_available() and tma_available(torch.empty(1, device=DEV))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def natural_stack(shape, divides: bool) -> pwm.PackedWeight:
    """A random nvfp4e stack on the device in the pack's order: random nibbles, finite positive e4m3 block scales,
    per-expert pairs as ModelOpt (a multiplier) or compressed-tensors (a divisor) write them."""
    rec = torch.zeros(record_nbytes("nvfp4e", shape), dtype=torch.uint8, device=DEV)
    planes = record_planes("nvfp4e", shape, rec)
    planes["codes"].copy_(torch.randint(0, 256, planes["codes"].shape, dtype=torch.uint8, device=DEV))
    planes["scale"].copy_(torch.randint(0x20, 0x60, planes["scale"].shape, dtype=torch.uint8, device=DEV))
    t = torch.rand(shape[0], device=DEV) * 4 + 0.5
    one = torch.ones_like(t)
    pairs = torch.stack([one, t * 1000], 1) if divides else torch.stack([t * 1e-3, one], 1)
    planes["escale"].copy_(pairs.float().contiguous().view(torch.uint8))
    return pwm.PackedWeight.from_record("nvfp4e", shape, rec, layout="natural")


def loaded(nat: pwm.PackedWeight, which: str) -> pwm.PackedWeight:
    """The stack as the loader holds it on CUDA: re-laid in the nvfp4-tiles order, gate_up in the glu row order."""
    pw = pwm.PackedWeight.from_record("nvfp4e", nat.shape, nat.record, glu=which == "gate_up")
    assert pw.layout == pwm.NVFP4_TILES and pw.glu == (which == "gate_up") and pw.nbytes == nat.nbytes
    return pw


@pytest.mark.parametrize("divides", [False, True], ids=["modelopt", "ct"])
@pytest.mark.parametrize("tokens", [256, 2048], ids=["B1", "B8"])
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_gemm_at_model_shapes_matches_the_twin(which, tokens, divides):
    shape = (E, 2 * F, H) if which == "gate_up" else (E, H, F)
    nat = natural_stack(shape, divides)
    tiles = loaded(nat, which)
    assert tiles.divides == divides
    torch.manual_seed(tokens)
    x = torch.randn(tokens, shape[2], device=DEV).bfloat16()
    src, offs = (t.to(DEV) for t in routes_of(tokens, TOPK, E))
    got = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, out_dtype=torch.float32)
    w = mp.dequantize(nat)
    xs = x[src.long()].float()
    assert rel(got, exact_product(xs, w, offs)) < 1e-5  # only the f32 accumulation's roundings
    assert rel(got, mp.grouped_mm_packed_ref(xs, nat, offs)) < 2e-3  # the twin's f32 GEMM may run as TF32
    plain = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, out_dtype=torch.float32, asm=False)
    assert torch.equal(got, plain)  # the PTX decode makes the plain ops' f16 weights
    bf = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, BM=64)
    assert rel(bf.float(), got) < 4e-3  # another row tile, the result rounded to bf16
    if which == "gate_up":
        glu = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, glu=True)
        assert torch.equal(glu, gelu_mul(moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src)))
        plain_laid = pwm.PackedWeight.from_record("nvfp4e", shape, nat.record)  # glu after the plain GEMM
        assert not plain_laid.glu and torch.equal(
            moe_nvfp4.grouped_mm_nvfp4_tiles(x, plain_laid, offs, src=src, glu=True), glu)
        f16 = moe_nvfp4.grouped_mm_nvfp4_tiles(x.half(), tiles, offs, src=src, out_dtype=torch.bfloat16, glu=True,
                                               glu_f16=True)  # as the engine calls it
        plain = moe_nvfp4.grouped_mm_nvfp4_tiles(x.half(), tiles, offs, src=src, out_dtype=torch.bfloat16, glu=True,
                                                 glu_f16=True, asm=False)
        assert torch.equal(f16, plain)
    assert torch.equal(mp.dequantize_triton(tiles, torch.float32), w)
    del w


@pytest.mark.skipif(not HAS_TMA, reason="needs a device with TMA (compute capability 9.0+)")
@pytest.mark.parametrize("tokens", [256, 2048], ids=["B1", "B8"])
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_tma_path_equals_the_pointer_path(which, tokens, monkeypatch):
    """The planes through tensor descriptors (the default here) give the cp.async path's bits at the model's shapes,
    called as the engine calls the two GEMMs (the f16 operand in, the launch order given; gate_up with gelu·up as f16
    operands out, down to bf16; gate_up glu-laid, one box a plane and K step) and plain to f32 (gate_up: in logical
    column order), at the default stages and at 3 and 4; the default takes TMA below 128-row tiles (B1), cp.async
    at 128 (B8)."""
    shape = (E, 2 * F, H) if which == "gate_up" else (E, H, F)
    tiles = loaded(natural_stack(shape, which == "down"), which)
    torch.manual_seed(tokens)
    x = torch.randn(tokens, shape[2], device=DEV).bfloat16().half()
    src, offs = (t.to(DEV) for t in routes_of(tokens, TOPK, E))
    order = torch.randperm(E, device=DEV).to(torch.int32)
    engine = dict(glu=True, glu_f16=True) if which == "gate_up" else {}
    for kw in (dict(out_dtype=torch.bfloat16, order=order, **engine), dict(out_dtype=torch.float32)):
        want = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, tma=False, **kw)
        assert torch.equal(moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, **kw), want), kw
        for stages in (3, 4):
            got = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, tma=True, num_stages=stages, **kw)
            assert torch.equal(got, want), (kw, stages)
    seen, real = [], moe_nvfp4._descriptors
    monkeypatch.setattr(moe_nvfp4, "_descriptors", lambda *a: seen.append(1) or real(*a))
    moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src)
    assert seen == ([1] if tokens == 256 else [])  # the default's loads: default_tma


@pytest.mark.parametrize("tokens", [256, 2048], ids=["B1", "B8"])
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_exact_operands_give_the_exact_sum_bit_for_bit(which, tokens):
    """Block scales 1 .. 1.875, x in quarters, tensor scale pair (1, 1): every product and partial sum is exact in f32
    in any order, so the kernel (its MMA fed e2m1 · e4m3 · 2^-14, f16 subnormals below 2^-14, the 2^14 put back on the
    f32 accumulator) must give the exact product bit for bit, with the PTX decode and with the plain-op one."""
    shape = (E, 2 * F, H) if which == "gate_up" else (E, H, F)
    nat = natural_stack(shape, False)
    planes = record_planes("nvfp4e", shape, nat.record)
    planes["scale"].copy_(torch.randint(0x38, 0x40, planes["scale"].shape, dtype=torch.uint8, device=DEV))
    planes["escale"].copy_(torch.ones(E, 2, device=DEV).contiguous().view(torch.uint8))
    nat = pwm.PackedWeight.from_record("nvfp4e", shape, nat.record, layout="natural")
    tiles = loaded(nat, which)
    torch.manual_seed(tokens)
    x = (torch.randint(-4, 5, (tokens, shape[2]), device=DEV).float() / 4).half()
    src, offs = (t.to(DEV) for t in routes_of(tokens, TOPK, E))
    want = exact_product(x[src.long()].float(), mp.dequantize(nat), offs)
    for asm, tma in ((True, None), (False, None), (True, False), (True, HAS_TMA)):
        got = moe_nvfp4.grouped_mm_nvfp4_tiles(x, tiles, offs, src=src, out_dtype=torch.float32, asm=asm, tma=tma)
        assert torch.equal(got, want), (asm, tma)


@pytest.mark.parametrize("tokens", [256, 2048], ids=["B1", "B8"])
def test_expert_ffn_through_the_dispatcher_takes_the_fast_path(tokens, monkeypatch):
    gu_nat, dn_nat = natural_stack((E, 2 * F, H), False), natural_stack((E, H, F), True)
    gu, dn = loaded(gu_nat, "gate_up"), loaded(dn_nat, "down")
    calls = []
    fast = moe_nvfp4.grouped_mm_nvfp4_tiles
    monkeypatch.setattr(moe_nvfp4, "grouped_mm_nvfp4_tiles", lambda *a, **k: calls.append(1) or fast(*a, **k))
    torch.manual_seed(tokens)
    x = torch.randn(tokens, H, device=DEV).bfloat16() * 0.1
    src, offs = (t.to(DEV) for t in routes_of(tokens, TOPK, E))
    got = moe.expert_ffn(x, gu, dn, offs, src=src, path_routes=2048)
    assert len(calls) == 2  # gate_up with gelu·up, then down
    generic = moe.expert_ffn(x, gu_nat, dn_nat, offs, src=src, path_routes=2048)
    assert len(calls) == 2
    assert rel(got.float(), generic.float()) < 2e-2  # bf16 activations on both sides, other accumulation orders


def test_hub_fixture_engine_holds_and_runs_the_tiles(monkeypatch):
    from bench import hub_fixtures as hf
    from diffgemma.config import ModelConfig
    from test_hub_fixtures import TEXT

    text = dict(TEXT, hidden_size=H, moe_intermediate_size=F, intermediate_size=2112, vocab_size=256)
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": 8})
    calls = []
    fast = moe_nvfp4.grouped_mm_nvfp4_tiles
    monkeypatch.setattr(moe_nvfp4, "grouped_mm_nvfp4_tiles", lambda *a, **k: calls.append(1) or fast(*a, **k))
    eng, _ = hf.build(cfg, "modelopt-nvfp4", DEV)
    nat, _ = hf.build(cfg, "modelopt-nvfp4", DEV)
    for layer in eng.w.layers:
        assert layer.experts_gu.layout == layer.experts_down.layout == pwm.NVFP4_TILES
        assert layer.experts_gu.glu and not layer.experts_down.glu  # the loader's glu row order for gate_up
    for layer in nat.w.layers:  # the same records in the pack's order: the generic kernel
        for name in ("experts_gu", "experts_down"):
            w = getattr(layer, name)
            p = pwm.nvfp4_natural_planes(w)
            rec = w.record.clone()
            views = record_planes("nvfp4e", w.shape, rec)
            views["codes"].copy_(p["codes"])
            views["scale"].copy_(p["scale"])
            setattr(layer, name, pwm.PackedWeight.from_record("nvfp4e", w.shape, rec, layout="natural"))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (12,), generator=gen).cuda()
    canvas = torch.randint(0, cfg.vocab_size, (cfg.canvas_length,), generator=gen).cuda()
    out = []
    for e in (eng, nat):
        before = len(calls)
        cache = e.new_cache(64)
        e.prefill(cache, prompt)
        out.append(e.denoise(cache, canvas).float())
        out.append(len(calls) - before)
    assert out[1] > 0 and out[3] == 0, out[1::2]
    assert rel(out[0], out[2]) < 2e-2


def test_kernel_times_beside_q4():
    """Printed, not asserted (bench/bench_hub.py holds the issue's bars): ms of one denoise-shape GEMM (B=1: 2048
    routes) per stack for the q4-tiles kernel, this kernel, and the generic packed kernel on the pack's order."""
    from bench.fixtures import random_record
    from diffgemma.ops import q4_tiles

    gen = torch.Generator(device=DEV).manual_seed(0)
    src, offs = (t.to(DEV) for t in routes_of(256, TOPK, E))
    for shape in ((E, 2 * F, H), (E, H, F)):
        q4 = q4_tiles.to_tile_layout(pwm.PackedWeight.from_record("q4", shape, random_record("q4", shape, DEV, gen)))
        nat = natural_stack(shape, False)
        tiles = pwm.PackedWeight.from_record("nvfp4e", shape, nat.record)
        x = torch.randn(256, shape[2], device=DEV).bfloat16()
        ms = {}
        for name, w in (("q4-tiles", q4), ("nvfp4-tiles", tiles), ("nvfp4e generic", nat)):
            def run():
                return moe.grouped_mm(x, w, offs, src=src)
            for _ in range(3):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                run()
            end.record()
            torch.cuda.synchronize()
            ms[name] = round(start.elapsed_time(end) / 20, 4)
        print(f"\n[{list(shape)} B=1 denoise GEMM ms] {ms}")
        assert all(v > 0 for v in ms.values())
