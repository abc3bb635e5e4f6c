"""GPU checks for the packed-weight GEMMs at the real shapes, and the engine on packed weights.

Skips without CUDA. Random packed records are generated on the device (bench.fixtures.random_record).
Kernels are held to their torch twins (dequantize to bf16 + torch._grouped_mm) by ‖Δ‖/‖ref‖: both
accumulate in f32 from the same bf16 weights and round the output to bf16, so only the summation order
differs.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.checkpoint import expected_tensors  # noqa: E402
from diffgemma.config import ModelConfig  # noqa: E402
from diffgemma.model.engine import build_engine  # noqa: E402
from diffgemma.model.reference import ReferenceModel  # noqa: E402
from diffgemma.ops import grouped, moe, moe_packed as mp, moe_q4  # noqa: E402
from diffgemma.ops.moe_plan import moe_plan  # noqa: E402

from bench.fixtures import RandomPackSource, random_record  # noqa: E402

DEV = "cuda"
S, FULL = "sliding_attention", "full_attention"
E, H, Fe, K_TOP = 128, 2816, 704, 8


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def packed(fmt, shape, std=0.02):
    gen = torch.Generator(device=DEV)
    gen.manual_seed(int(torch.randint(0, 2**31, (1,))))
    return mp.PackedWeight.from_record(fmt, shape, random_record(fmt, shape, DEV, gen, std))


def routed_rows(T):
    """xs [T·k, H] grouped by expert and offs, from a random top-k routing (ragged, like the engine's)."""
    experts = torch.stack([torch.randperm(E, device=DEV)[:K_TOP] for _ in range(T)]) if T <= 256 else \
        torch.randint(0, E, (T, K_TOP), device=DEV)
    src, _, offs = moe_plan(experts, E)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    return x.index_select(0, src.long()), offs


@pytest.mark.parametrize("fmt", ["q4", "q5", "q6", "nvfp4"])
def test_packed_gemm_denoise_shape(fmt):
    xs, offs = routed_rows(256)
    gu, dn = packed(fmt, (E, 2 * Fe, H)), packed(fmt, (E, H, Fe))
    for w, x in ((gu, xs), (dn, torch.randn(xs.shape[0], Fe, device=DEV, dtype=torch.bfloat16))):
        ref = mp.grouped_mm_packed_ref(x, w, offs)
        got = mp.grouped_mm_packed_triton(x, w, offs)
        assert torch.isfinite(got).all()
        r = rel(got, ref)
        print(f"\n[packed {fmt} {list(w.shape)} denoise] rel {r:.2e}")
        assert r < 5e-3


@pytest.mark.parametrize("fmt", ["q4", "q5", "q6", "nvfp4"])
def test_packed_gemm_prefetched_scales_equal_in_step_scales(fmt):
    xs, offs = routed_rows(256)
    for w, x in ((packed(fmt, (E, 2 * Fe, H)), xs), (packed(fmt, (E, H, Fe)), torch.randn(xs.shape[0], Fe, device=DEV, dtype=torch.bfloat16))):
        assert torch.equal(mp.grouped_mm_packed_triton(x, w, offs), mp.grouped_mm_packed_triton(x, w, offs, prefetch=False))


@pytest.mark.parametrize("fmt", ["q4", "nvfp4"])
def test_packed_gate_up_through_src_denoise_shape(fmt):
    experts = torch.stack([torch.randperm(E, device=DEV)[:K_TOP] for _ in range(256)])
    src, _, offs = moe_plan(experts, E)
    x = torch.randn(256, H, device=DEV, dtype=torch.bfloat16)
    gu = packed(fmt, (E, 2 * Fe, H))
    got = mp.grouped_mm_packed_triton(x, gu, offs, src=src)
    assert torch.equal(got, mp.grouped_mm_packed_triton(x.index_select(0, src), gu, offs))
    r = rel(got, mp.grouped_mm_packed_ref(x.index_select(0, src), gu, offs))
    print(f"\n[packed {fmt} gate_up through src] rel {r:.2e}")
    assert r < 5e-3


def test_packed_gemm_prefill_shape_both_paths(monkeypatch):
    xs, offs = routed_rows(8192)
    gu = packed("q4", (E, 2 * Fe, H))
    ref = mp.grouped_mm_packed_ref(xs, gu, offs)
    got = mp.grouped_mm_packed_triton(xs, gu, offs)  # the compute-bound config
    assert rel(got, ref) < 5e-3
    dq = mp.dequantize_triton(gu, torch.bfloat16)
    assert torch.equal(dq, mp.dequantize(gu, torch.bfloat16))
    monkeypatch.setenv("DIFFGEMMA_PACKED_PREFILL", "dequant")
    assert torch.equal(moe.grouped_mm(xs, gu, offs), grouped.grouped_mm_torch(xs, dq, offs))


def exact_product(xs, w: mp.PackedWeight, offs):
    """The grouped product in f32 from the exact decoded weights (no bf16 rounding of them)."""
    wf = mp.dequantize(w, torch.float32)
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(xs[start:end].float() @ wf[g].T)
        start = end
    return torch.cat(out)


def test_q4_tiles_kernel_denoise_shape():
    """The q4-tiles GEMM (PTX decode) at the real shapes, random (ragged) routing: closer to the exact product than
    the bf16-weight twin, bit-equal to its plain-op decode, the same through src as on gathered rows, and in
    every row-tile width."""
    experts = torch.stack([torch.randperm(E, device=DEV)[:K_TOP] for _ in range(256)])
    src, _, offs = moe_plan(experts, E)
    x = torch.randn(256, H, device=DEV, dtype=torch.bfloat16)
    xs = x.index_select(0, src.long())
    h = torch.randn(xs.shape[0], Fe, device=DEV, dtype=torch.bfloat16)
    for w, a, s in ((packed("q4", (E, 2 * Fe, H)), x, src), (packed("q4", (E, H, Fe)), h, None)):
        t = moe_q4.to_tile_layout(w)
        rows = a if s is None else xs
        got = moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s)
        exact = exact_product(rows, w, offs)
        r_kernel, r_twin = rel(got, exact), rel(mp.grouped_mm_packed_ref(rows, w, offs), exact)
        print(f"\n[q4-tiles {list(w.shape)}] rel to exact {r_kernel:.2e}, the twin's {r_twin:.2e}")
        assert torch.isfinite(got).all() and r_kernel < 3e-3 and r_kernel <= r_twin
        assert torch.equal(got, moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s, asm=False))
        assert torch.equal(got, moe.grouped_mm(a, t, offs, src=s))  # the dispatcher picks it
        if s is not None:
            assert torch.equal(got, moe_q4.grouped_mm_q4_tiles(xs, t, offs))
        for bm, few in ((16, 0), (64, 16), (32, 0)):  # one width, two widths, and the default's wide one alone
            assert rel(moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s, BM=bm, BM_FEW=few), exact) < 3e-3


@pytest.mark.parametrize("glu_f16", [False, True])
def test_q4_tiles_gelu_epilogue_at_real_shape(glu_f16):
    """The engine's q4 gate_up call: a glu-laid stack, gelu·up in the epilogue (as the down GEMM's f16 operand with
    glu_f16), x as attn_finish's f16 operand, the plan's order: the same bits as the gelu·up kernel after the plain
    GEMM on the plain layout, ragged routing; the dequantize kernel reads the glu order back to the twin's bits."""
    from diffgemma.ops.f16_operand import f16_operand_ref
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    from diffgemma.ops.moe_plan import moe_plan_with_order

    experts = torch.stack([torch.randperm(E, device=DEV)[:K_TOP] for _ in range(256)])
    src, _, offs, order = moe_plan_with_order(experts, E)
    x = f16_operand_ref(torch.randn(256, H, device=DEV, dtype=torch.bfloat16))
    w = packed("q4", (E, 2 * Fe, H))
    plain, glu = moe_q4.to_tile_layout(w), moe_q4.to_tile_layout(w, glu=True)
    kw = dict(src=src, order=order, out_dtype=torch.bfloat16)
    want = gelu_mul_triton(moe_q4.grouped_mm_q4_tiles(x, plain, offs, **kw), as_f16=glu_f16)
    got = moe_q4.grouped_mm_q4_tiles(x, glu, offs, glu=True, glu_f16=glu_f16, **kw)
    diff = (got.float() != want.float()).sum().item()
    print(f"\n[q4 gate_up + gelu epilogue, f16 out {glu_f16}] {diff} of {got.numel()} values differ")
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(moe_q4.dequantize_q4_tiles(glu), mp.dequantize(w, torch.bfloat16))


def test_q4_tiles_launch_order_at_real_shapes():
    """Popular experts at random ids: the plan kernel's order (most routes first) is the twin's, the q4 GEMM gives
    the same bits in that order, and no order is made for prefill's route counts."""
    from diffgemma.ops.moe_plan import ORDER_MAX_ROUTES, expert_order_ref, moe_plan_with_order

    pr = (1.0 / (torch.arange(E, device=DEV, dtype=torch.float32) + 8))[torch.randperm(E, device=DEV)]
    experts = torch.multinomial(pr.expand(256, E), K_TOP, replacement=False)
    src, _, offs, order = moe_plan_with_order(experts, E)
    assert torch.equal(order, expert_order_ref(offs))
    assert not torch.equal(order, torch.arange(E, device=DEV, dtype=torch.int32))  # the popular ids are scattered
    assert moe_plan_with_order(torch.randint(0, E, (ORDER_MAX_ROUTES // K_TOP + 1, K_TOP), device=DEV), E)[3] is None
    x = torch.randn(256, H, device=DEV, dtype=torch.bfloat16)
    h = torch.randn(256 * K_TOP, Fe, device=DEV, dtype=torch.bfloat16)
    for w, a, s in ((packed("q4", (E, 2 * Fe, H)), x, src), (packed("q4", (E, H, Fe)), h, None)):
        t = moe_q4.to_tile_layout(w)
        assert torch.equal(moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s, order=order),
                           moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s))


def test_q4_tiles_tma_and_pointer_loads_agree_at_real_shapes():
    """On Hopper the GEMM reads its planes through tensor descriptors (TMA); the cp.async path that other GPUs
    take gives the same bits, with empty, light and crowded experts."""
    from diffgemma.ops.moe_plan import moe_plan_with_order

    if not moe_q4.tma_available(torch.empty(1, device=DEV)):
        pytest.skip("TMA needs compute capability 9.0")
    pr = (1.0 / (torch.arange(E, device=DEV, dtype=torch.float32) + 2) ** 2)[torch.randperm(E, device=DEV)]
    experts = torch.multinomial(pr.expand(256, E), K_TOP, replacement=False)
    src, _, offs, order = moe_plan_with_order(experts, E)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (counts == 0).any() and (counts > 32).any()
    x = torch.randn(256, H, device=DEV, dtype=torch.bfloat16)
    h = torch.randn(256 * K_TOP, Fe, device=DEV, dtype=torch.bfloat16)
    for w, a, s in ((packed("q4", (E, 2 * Fe, H)), x, src), (packed("q4", (E, H, Fe)), h, None)):
        t = moe_q4.to_tile_layout(w)
        got = moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s, order=order, tma=True)
        assert torch.equal(got, moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s, order=order, tma=False))
        assert torch.equal(got, moe_q4.grouped_mm_q4_tiles(a, t, offs, src=s, order=order))  # the default


def test_q4_tiles_dequantize_kernel_is_bit_equal_to_the_twin():
    w = packed("q4", (E, 2 * Fe, H))
    t = moe_q4.to_tile_layout(w)
    want = mp.dequantize(w, torch.bfloat16)
    assert torch.equal(moe_q4.dequantize_q4_tiles(t), want)
    assert torch.equal(moe_q4.dequantize_q4_tiles(t, torch.float32), mp.dequantize(w, torch.float32))
    assert torch.equal(mp.dequantize(t, torch.bfloat16), want)


def test_linear_q8_sc_shape():
    w = packed("q8", (2 * 2112, H))
    x = torch.randn(256, H, device=DEV, dtype=torch.bfloat16)
    assert rel(mp.linear(x, w), mp.linear_ref(x, w)) < 1e-2


@pytest.mark.parametrize("N,K", [(2 * 2112, H), (H, 2112)])
def test_q8_linear_kernel_sc_shapes(N, K):
    """The q8 GEMM (int8 codes read in the kernel) at the SC MLP's shapes, bf16: within one output rounding of the
    float64 product of the decoded weight, and close to its torch twin (which rounds twice)."""
    from diffgemma.ops import q8_linear as q8

    codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=DEV)
    scale = torch.rand(N, device=DEV) * 0.01 + 1e-4
    x = torch.randn(256, K, device=DEV, dtype=torch.bfloat16)
    got = q8.q8_linear_triton(x, codes, scale)
    exact = x.double() @ (codes.double() * scale.double()[:, None]).T
    assert ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-3 * exact.abs().mean()).all()
    assert rel(got, q8.q8_linear_ref(x, codes, scale)) < 5e-3


MID = dict(vocab_size=8192, hidden_size=512, intermediate_size=384, num_hidden_layers=6, num_attention_heads=8,
           num_key_value_heads=4, head_dim=128, global_head_dim=256, num_global_key_value_heads=2, sliding_window=128,
           layer_types=[S, S, FULL, S, S, FULL], num_experts=32, top_k_experts=4, moe_intermediate_size=128,
           model_type="diffusion_gemma_text",
           rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})


@pytest.mark.parametrize("experts", ["q4", "nvfp4"])
def test_engine_on_packed_weights_matches_reference(experts, monkeypatch):
    """bf16 engine (packed experts + q8 SC, graphs, f16 KV) vs the f32 reference on the same dequantized weights."""
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": MID, "canvas_length": 64})
    src = RandomPackSource(cfg, DEV, torch.float32, seed=int(torch.randint(0, 2**31, (1,))), std=0.05,
                           experts=experts, cache=True)
    eng = build_engine(cfg, src, DEV, torch.bfloat16, prefill_chunk=256)
    assert isinstance(eng.w.layers[0].experts_gu, mp.PackedWeight)
    assert eng.w.layers[0].experts_gu.layout == (moe_q4.LAYOUT if experts == "q4" else "natural")
    ref = ReferenceModel(cfg, {n: src.get(n, torch.float32) for n in expected_tensors(cfg)}, device=DEV,
                         dtype=torch.float32)
    V = cfg.vocab_size
    prompt, canvas = torch.randint(0, V, (700,), device=DEV), torch.randint(0, V, (64,), device=DEV)
    sc = torch.randn(64, V, device=DEV) * 3
    rc, ec = ref.new_cache(800), eng.new_cache(800)
    ref.prefill(rc, prompt)
    eng.prefill(ec, prompt)
    e = ref.denoise(rc, canvas, sc_logits=sc)
    eng.denoise(ec, canvas, sc_logits=sc)
    g = eng.denoise(ec, canvas, sc_logits=sc)  # graph replay
    assert eng.graph_error is None, eng.graph_error
    cos = torch.nn.functional.cosine_similarity(g.flatten(), e.flatten(), dim=0).item()
    top2 = e.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 0.25
    agree = (g.argmax(-1) == e.argmax(-1))[decisive].float().mean().item() if decisive.any() else 1.0
    print(f"\n[packed engine {experts}] cos {cos:.6f}, argmax agree on {int(decisive.sum())} decisive rows {agree:.4f}")
    assert cos > 0.97 and agree >= 0.95
    # q4: the expert inputs come as f16 operands from attn_finish and gelu·up; as bf16 they give the same bits
    assert mp.takes_f16_operand(eng.w.layers[0].experts_gu, 64 * cfg.top_k_experts, g) == (experts == "q4")
    import functools

    import diffgemma.model.forward as forward_module

    with monkeypatch.context() as m:  # bf16 operands: attn_finish writes bf16, the GEMM converts in its loop
        m.setattr(forward_module, "expert_ffn", functools.partial(moe.expert_ffn, f16_operands=False))
        finish = forward_module.attn_finish
        m.setattr(forward_module, "attn_finish", lambda *a, moe_f16, **k: finish(*a, moe_f16=False, **k))
        eng.clear_graphs()
        assert torch.equal(eng.denoise(ec, canvas, sc_logits=sc), g)
        eng.use_graphs = False
        eager = eng.denoise(ec, canvas, sc_logits=sc)
    assert torch.equal(eng.denoise(ec, canvas, sc_logits=sc), eager)


def as_nvfp4e(w: mp.PackedWeight, divides: bool) -> mp.PackedWeight:
    """w's nibbles and block scales with a tensor scale per expert (ops/layouts.py nvfp4e): around w's one scale,
    as a multiplier (ModelOpt) or a divisor (compressed-tensors); divides=None: w's own scale for every expert."""
    from diffgemma.quant import codecs

    e = w.shape[0]
    rec = torch.zeros(codecs.record_nbytes("nvfp4e", w.shape), dtype=torch.uint8, device=DEV)
    view = {p.name: rec[p.offset:p.offset + p.nbytes].view(p.rows, p.row_bytes) for p in codecs.planes("nvfp4e", w.shape)}
    view["codes"].copy_(w.planes["codes"])
    view["scale"].copy_(w.planes["scale"])
    t = w.tscale * (0.5 + torch.rand(e, device=DEV))
    one = torch.ones(e, device=DEV)
    pairs = {None: torch.stack([one * w.tscale, one], 1), False: torch.stack([t, one], 1),
             True: torch.stack([one, 1.0 / t], 1)}[divides]
    view["escale"].view(torch.float32).copy_(pairs)
    return mp.PackedWeight.from_record("nvfp4e", w.shape, rec, layout="natural")  # the generic kernel


@pytest.mark.parametrize("divides", [False, True])
def test_nvfp4e_gemm_denoise_shape(divides):
    """Per-expert tensor scales at the real shapes: the grouped GEMM (gate_up through src with gelu·up, and down)
    against the twin, prefetch on and off bit-equal, the dequantize kernel bit-equal to the twin in f32 and bf16."""
    experts = torch.stack([torch.randperm(E, device=DEV)[:K_TOP] for _ in range(256)])
    src, _, offs = moe_plan(experts, E)
    x = torch.randn(256, H, device=DEV, dtype=torch.bfloat16)
    xs = x.index_select(0, src.long())
    gu, dn = as_nvfp4e(packed("nvfp4", (E, 2 * Fe, H)), divides), as_nvfp4e(packed("nvfp4", (E, H, Fe)), divides)
    assert gu.divides == divides
    h = torch.randn(xs.shape[0], Fe, device=DEV, dtype=torch.bfloat16)
    for w, a in ((gu, xs), (dn, h)):
        ref = mp.grouped_mm_packed_ref(a, w, offs)
        got = mp.grouped_mm_packed_triton(a, w, offs)
        r = rel(got, ref)
        print(f"\n[nvfp4e divides={divides} {list(w.shape)} denoise] rel {r:.2e}")
        assert torch.isfinite(got).all() and r < 5e-3
        assert torch.equal(got, mp.grouped_mm_packed_triton(a, w, offs, prefetch=False))
        for dt in (torch.float32, torch.bfloat16):
            assert torch.equal(mp.dequantize_triton(w, dt), mp.dequantize(w, dt))
    glu = mp.grouped_mm_packed_triton(x, gu, offs, src=src, glu=True)
    assert rel(glu, mp.gelu_mul_ref(mp.grouped_mm_packed_ref(xs, gu, offs))) < 5e-3


def test_nvfp4e_with_one_scale_is_nvfp4_bit_for_bit():
    """An nvfp4 stack's one tensor scale given to every expert of an nvfp4e stack: the same bits out of every kernel;
    and the time of each form's denoise-shape GEMM (printed: the per-expert load and the divide's cost)."""
    xs, offs = routed_rows(256)
    old = packed("nvfp4", (E, 2 * Fe, H))
    same, mul, div = as_nvfp4e(old, None), as_nvfp4e(old, False), as_nvfp4e(old, True)
    want = mp.grouped_mm_packed_triton(xs, old, offs)
    assert torch.equal(mp.grouped_mm_packed_triton(xs, same, offs), want)
    assert torch.equal(mp.dequantize_triton(same, torch.bfloat16), mp.dequantize_triton(old, torch.bfloat16))
    ms = {}
    for name, w in (("nvfp4", old), ("nvfp4e", same), ("nvfp4e-mul", mul), ("nvfp4e-div", div)):
        for _ in range(3):
            mp.grouped_mm_packed_triton(xs, w, offs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            mp.grouped_mm_packed_triton(xs, w, offs)
        end.record()
        torch.cuda.synchronize()
        ms[name] = start.elapsed_time(end) / 20
    print("\n[nvfp4 vs nvfp4e gate_up GEMM, 256 tokens] " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
