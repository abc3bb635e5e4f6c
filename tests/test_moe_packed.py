"""Packed-weight GEMMs (ops/moe_packed.py): kernels in the Triton interpreter vs their torch twins, the
twins vs the codecs, and the fast engine on a quantized pack vs the reference model on the same pack.

Random weights and inputs are fresh each run; ragged expert groups include empty ones at the start, in
the middle and at the end, and shapes that are not multiples of the tiles (masked edges).
"""

import os

import pytest
import torch

import diffgemma
from diffgemma.errors import TensorError
from diffgemma.model.engine import build_engine
from diffgemma.ops import moe, moe_paths, moe_packed as mp
from diffgemma.quant import PackSource, codecs, quantize
from tiny_checkpoints import PACKABLE, build_model, save

FORMATS = ("q4", "q5", "q6", "nvfp4")
interpreted = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="needs CUDA or the Triton interpreter")


def packed(fmt, shape, scale=0.1, device="cpu"):
    """(PackedWeight of a random tensor, that tensor's float32 decode by the codecs)."""
    x = torch.randn(shape) * scale * (1 + torch.rand(shape[:-1] + (1,)))  # row ranges vary
    rec = codecs.assemble(fmt, shape, codecs.encode(fmt, x))
    want = codecs.decode(fmt, rec, shape)
    t = torch.frombuffer(bytearray(rec), dtype=torch.uint8).clone().to(device)  # clone: an aligned allocation
    return mp.PackedWeight.from_record(fmt, shape, t), want


def ragged_offs(E, M):
    """Cumulative ends with experts 0, E//2 and E-1 empty, the rest random (sums to M)."""
    cuts = torch.sort(torch.randint(0, M + 1, (E - 4,))).values
    ends = torch.cat([torch.zeros(1, dtype=torch.long), cuts[: E // 2 - 1], cuts[E // 2 - 2: E // 2 - 1], cuts[E // 2 - 1:],
                      torch.tensor([M, M])])
    assert len(ends) == E and ends[0] == 0 and ends[E // 2] == ends[E // 2 - 1] and ends[-1] == ends[-2] == M
    return ends.to(torch.int32)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------------------ torch twins

@pytest.mark.parametrize("fmt", FORMATS + ("q8",))
def test_dequantize_equals_codecs_decode(fmt):
    shape = (24, 64) if fmt == "q8" else (3, 24, 96)
    pw, want = packed(fmt, shape)
    got = mp.dequantize(pw)
    assert got.shape == shape and torch.equal(got, want)
    assert pw.nbytes == codecs.record_nbytes(fmt, shape)


def test_from_record_refuses_wrong_size_and_dtype():
    shape = (2, 8, 32)
    n = codecs.record_nbytes("q4", shape)
    with pytest.raises(TensorError, match="must be"):
        mp.PackedWeight.from_record("q4", shape, torch.zeros(n - 1, dtype=torch.uint8))
    with pytest.raises(TensorError, match="must be"):
        mp.PackedWeight.from_record("q4", shape, torch.zeros(n // 2, dtype=torch.int16))
    with pytest.raises(TensorError):
        mp.PackedWeight.from_record("q4", (2, 8, 20), torch.zeros(n, dtype=torch.uint8))  # K not a multiple of 32


def test_linear_q8_matches_dequantized_linear():
    pw, w = packed("q8", (40, 96))
    x = torch.randn(7, 96)
    got = mp.linear(x, pw)
    assert rel(got, x @ w.T) < 1e-5 and rel(mp.linear_ref(x, pw), x @ w.T) < 1e-6
    plain = torch.randn(40, 96)
    assert torch.equal(mp.linear(x, plain), x @ plain.T)


# ------------------------------------------------------------------------------------ kernels (interpreter)

@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [(16, 16, 64, 4, 1), (32, 16, 32, 4, 1)])
def test_grouped_kernel_matches_twin(fmt, config):
    E, N, K, M = 6, 40, 96, 53  # N, K, M not multiples of the tiles
    pw, w = packed(fmt, (E, N, K))
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    out = mp.grouped_mm_packed_triton(xs, pw, offs, config=config)
    want = mp.grouped_mm_packed_ref(xs, pw, offs)
    assert out.shape == (M, N) and torch.isfinite(out).all()
    assert rel(out, want) < 1e-5
    # and the twin is the plain per-expert product with the codecs' decode
    loop = torch.cat([xs[int(a):int(b)] @ w[g].T for g, (a, b) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))])
    assert rel(want, loop) < 1e-5


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_kernel_prefetched_scales_equal_in_step_scales(fmt):
    """The side planes loaded one K-step ahead give the very numbers of loading them in the step (K = 96 with
    BK 64 and 32: a partial last step, so the prefetch past K must load zeros and never be used)."""
    E, N, K, M = 5, 40, 96, 47
    pw, _ = packed(fmt, (E, N, K))
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    for cfg in ((16, 16, 64, 4, 1), (32, 16, 32, 4, 1)):
        new = mp.grouped_mm_packed_triton(xs, pw, offs, config=cfg)
        old = mp.grouped_mm_packed_triton(xs, pw, offs, config=cfg, prefetch=False)
        assert torch.equal(new, old), (fmt, cfg)


@interpreted
def test_grouped_kernel_all_rows_in_one_expert_and_no_rows():
    pw, w = packed("q4", (4, 32, 64))
    xs = torch.randn(37, 64)
    offs = torch.tensor([0, 0, 37, 37], dtype=torch.int32)  # 3 row tiles of 16 in one expert
    assert rel(mp.grouped_mm_packed_triton(xs, pw, offs, config=(16, 16, 32, 4, 1)), xs @ w[2].T) < 1e-5
    assert mp.grouped_mm_packed_triton(xs[:0], pw, torch.zeros(4, dtype=torch.int32)).shape == (0, 32)


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_kernel_gathers_rows_through_src(fmt):
    from test_moe_stream import routes_of

    T, k, E, N, K = 11, 4, 6, 40, 96
    pw, _ = packed(fmt, (E, N, K))
    x = torch.randn(T, K)
    src, offs = routes_of(T, k, E)
    cfg = (16, 16, 32, 4, 1)
    got = mp.grouped_mm_packed_triton(x, pw, offs, config=cfg, src=src)
    assert torch.equal(got, mp.grouped_mm_packed_triton(x.index_select(0, src), pw, offs, config=cfg))


@interpreted
@pytest.mark.parametrize("packed_stacks", [False, True])
def test_expert_ffn_with_src_equals_expert_ffn_on_gathered_rows(monkeypatch, packed_stacks):
    """The engine's call (tokens + src) against the old one (gathered rows), on the kernels and on the torch twins."""
    from test_moe_stream import routes_of

    from diffgemma.ops import moe_stream

    T, k, E, H, Fe = 9, 3, 5, 64, 32
    if packed_stacks:
        gu, _ = packed("q4", (E, 2 * Fe, H))
        dn, _ = packed("q6", (E, H, Fe))
    else:
        gu, dn = torch.randn(E, 2 * Fe, H) * 0.1, torch.randn(E, H, Fe) * 0.1
    x = torch.randn(T, H)
    src, offs = routes_of(T, k, E)
    want = moe.expert_ffn(x.index_select(0, src), gu, dn, offs)
    assert torch.equal(moe.expert_ffn(x, gu, dn, offs, src=src), want)  # CPU: the twin gathers first
    monkeypatch.setattr(moe_paths, "use_triton", lambda t: True)
    monkeypatch.setattr(mp, "pick_config", lambda m, e: (16, 16, 32, 4, 1))
    monkeypatch.setattr(moe_stream, "CONFIG", (16, 16, 32, 4, 1))
    monkeypatch.setattr(moe_stream, "CONFIG_SHORT_K", (16, 16, 32, 4, 1))
    monkeypatch.setattr(moe_stream, "CONFIG_SHORT_K_WIDE", (16, 16, 32, 4, 1))
    kernels = moe.expert_ffn(x, gu, dn, offs, src=src)
    assert torch.equal(kernels, moe.expert_ffn(x.index_select(0, src), gu, dn, offs))
    assert rel(kernels, want) < 1e-5


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_kernel_equals_codecs(fmt):
    shape = (3, 20, 96)
    pw, want = packed(fmt, shape)
    assert torch.equal(mp.dequantize_triton(pw, torch.float32, BR=16, BK=64), want)


@interpreted
@pytest.mark.parametrize("rows_per_expert_threshold", [1, 10**9])  # prefill (dequant + grouped GEMM) / kernel path
def test_expert_ffn_dispatch_on_packed_weights(monkeypatch, rows_per_expert_threshold):
    E, H, Fe, M = 5, 64, 32, 41
    gu, gu_w = packed("q4", (E, 2 * Fe, H))
    dn, dn_w = packed("q6", (E, H, Fe))
    xs = torch.randn(M, H)
    offs = ragged_offs(E, M)
    want = moe.expert_ffn(xs, gu_w, dn_w, offs)  # the bf16 path on the decoded stacks
    assert rel(moe.expert_ffn(xs, gu, dn, offs), want) < 1e-5  # CPU: the torch twin
    monkeypatch.setattr(moe_paths, "use_triton", lambda t: True)
    monkeypatch.setattr(moe_paths, "PREFILL_ROWS", rows_per_expert_threshold)
    monkeypatch.setattr(mp, "pick_config", lambda m, e: (16, 16, 32, 4, 1))
    assert rel(moe.expert_ffn(xs, gu, dn, offs), want) < 1e-5


# ------------------------------------------------------------------------------------ the engine on a pack

TEXT = PACKABLE
CANVAS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    return save(build_model(TEXT, canvas_length=CANVAS).to(torch.bfloat16), tmp_path_factory.mktemp("ckpt") / "m")


@pytest.mark.parametrize("profile", ["q4", "q6", "nvfp4x"])
def test_engine_on_pack_matches_reference_on_pack(ckpt, tmp_path, profile):
    """Same dequantized weights on both sides (the reference dequantizes at load, the engine inside its GEMMs),
    f32 activations and KV: the logits agree to f32 rounding."""
    pack = quantize(ckpt, tmp_path / profile, profile=profile, progress=False)
    ref = diffgemma.load(pack)  # CPU: the reference model, dequantized f32 weights
    eng = build_engine(ref.config, PackSource(pack), "cpu", torch.float32, kv_dtype=torch.float32)
    fast = diffgemma.load(pack, engine="fast", dtype=torch.float32)  # the loader's pack branch
    for e in (eng, fast):
        lw = e.w.layers[0]
        assert isinstance(lw.experts_gu, mp.PackedWeight) and isinstance(lw.experts_down, mp.PackedWeight)
        assert lw.experts_gu.fmt == {"nvfp4x": "nvfp4"}.get(profile, profile)
        assert isinstance(e.w.sc_gu, mp.PackedWeight) and e.w.sc_gu.fmt == "q8" and e.w.sc_gu.shape == (128, 64)
    V = ref.config.vocab_size
    prompt, canvas, sc = torch.randint(0, V, (11,)), torch.randint(0, V, (CANVAS,)), torch.randn(CANVAS, V) * 4
    outs = []
    for m in (ref, eng):
        cache = m.new_cache(64)
        m.prefill(cache, prompt)
        outs.append((m.denoise(cache, canvas), m.denoise(cache, canvas, sc_logits=sc)))
    for (a, b) in zip(*outs):
        err = (a - b).abs().max().item()
        assert err < 1e-4 * max(1.0, a.abs().max().item()), err
    # the pack's quantization is really in play: the unquantized checkpoint gives other logits
    base = diffgemma.load(ckpt)
    cache = base.new_cache(64)
    base.prefill(cache, prompt)
    assert (base.denoise(cache, canvas) - outs[0][0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("experts", ["q5", "nvfp4"])
def test_random_pack_source_engine_matches_reference(experts):
    """The benchmark's source (random records made on the device): the engine keeps them packed and
    agrees with a reference model built from the same source's dequantized tensors."""
    from diffgemma.checkpoint import expected_tensors
    from diffgemma.config import ModelConfig
    from bench.fixtures import RandomPackSource
    from diffgemma.model.reference import ReferenceModel

    tc = dict(TEXT, model_type="diffusion_gemma_text")
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": tc, "canvas_length": 8})
    src = RandomPackSource(cfg, "cpu", torch.float32, seed=int(torch.randint(0, 2**31, (1,))), std=0.05,
                           experts=experts, cache=True)
    eng = build_engine(cfg, src, "cpu", torch.float32, kv_dtype=torch.float32)
    assert eng.w.layers[1].experts_down.fmt == experts and eng.w.sc_down.fmt == "q8"
    ref = ReferenceModel(cfg, {n: src.get(n, torch.float32) for n in expected_tensors(cfg)}, device="cpu",
                         dtype=torch.float32)
    prompt, canvas, sc = torch.randint(0, 128, (9,)), torch.randint(0, 128, (8,)), torch.randn(8, 128) * 3
    outs = []
    for m in (ref, eng):
        cache = m.new_cache(64)
        m.prefill(cache, prompt)
        outs.append(m.denoise(cache, canvas, sc_logits=sc))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4 * max(1.0, outs[0].abs().max().item())


def test_expert_ffn_hands_the_down_gemm_f16_only_when_asked(monkeypatch):
    """gelu·up writes the down GEMM's input as an f16 operand where that GEMM takes one, unless the engine's
    f16_operands knob is off (then the GEMM converts bf16 itself)."""
    from diffgemma.ops import grouped

    asked = []
    plain = grouped.gelu_mul
    monkeypatch.setattr(moe, "takes_f16_operand", lambda w, routes, x: True)
    monkeypatch.setattr(grouped, "gelu_mul", lambda gu, as_f16=False: (asked.append(as_f16), plain(gu))[1])
    E, H, Fe, M = 3, 32, 16, 7
    gu, dn = torch.randn(E, 2 * Fe, H), torch.randn(E, H, Fe)
    x, offs = torch.randn(M, H), torch.tensor([2, 5, 7], dtype=torch.int32)
    on = moe.expert_ffn(x, gu, dn, offs)
    off = moe.expert_ffn(x, gu, dn, offs, f16_operands=False)
    assert asked == [True, False] and torch.equal(on, off)


def test_expert_gemm_path_names_one_implementation_per_case(monkeypatch):
    """The dispatcher's rule (ops/moe_paths.py): plain stacks stream at few rows per expert (a down projection up to
    a 1k prefill's) and go to torch._grouped_mm otherwise; packed ones run their kernel at denoise and dequantize at prefill; no Triton: twins."""
    from diffgemma.ops import moe_q4

    E, N, K = 4, 64, 64
    pw, _ = packed("q4", (E, N, K))
    tiled = moe_q4.to_tile_layout(pw)
    long_k = moe_paths.STREAM_SHORT_K + 32
    plain, plain_x = torch.randn(E, N, long_k), torch.randn(1, long_k)  # a gate_up projection's K
    down = torch.randn(E, N, K)  # K <= STREAM_SHORT_K: a down projection's
    x = torch.randn(1, K)
    few, many = moe_paths.STREAM_MAX_ROWS * E, moe_paths.PREFILL_ROWS * E
    wide = moe_paths.STREAM_SHORT_K_MAX_ROWS * E  # a 1k prefill's rows
    assert moe_paths.expert_gemm_path(plain, few, plain_x) == "torch"
    assert moe_paths.expert_gemm_path(pw, few, x) == "twin"
    monkeypatch.setattr(moe_paths, "use_triton", lambda t: True)
    assert moe_paths.expert_gemm_path(plain, few, plain_x) == "stream"
    assert moe_paths.expert_gemm_path(plain, few + 1, plain_x) == "torch"
    # a down projection streams up to a 1k prefill's rows too
    assert moe_paths.expert_gemm_path(down, wide, x) == "stream"
    assert moe_paths.expert_gemm_path(down, wide + 1, x) == "torch"
    assert moe_paths.expert_gemm_path(pw, many - 1, x) == "packed"
    assert moe_paths.expert_gemm_path(tiled, many - 1, x) == "q4-tiles"
    assert moe_paths.takes_f16_operand(tiled, many - 1, x) and not moe_paths.takes_f16_operand(pw, many - 1, x)
    assert moe_paths.expert_gemm_path(pw, many, x) == moe_paths.expert_gemm_path(tiled, many, x) == "dequant"
    monkeypatch.setenv(moe_paths.PACKED_PREFILL_ENV, "kernel")
    assert moe_paths.expert_gemm_path(tiled, many, x) == "q4-tiles"
    monkeypatch.setenv(moe_paths.EXPERT_GEMM_ENV, "cutlass")
    assert moe_paths.expert_gemm_path(plain, few, plain_x) == "torch"
    assert moe_paths.expert_gemm_path(down, few, x) == "torch"
