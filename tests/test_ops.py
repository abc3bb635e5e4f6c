"""Every Triton kernel against its torch twin, on the CPU through TRITON_INTERPRET=1, at tiny shapes.

Inputs are fresh random draws each run; outputs are poisoned (NaN) wherever a kernel must not
write, so a skipped or misplaced store fails. The same checks run natively at real shapes in
tests/gpu/test_engine_gpu.py.
"""

import functools
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")

from attention_cases import assert_close_f32  # noqa: E402
from diffgemma.ops import moe, rmsnorm, rope_kv, softcap  # noqa: E402
from diffgemma.sampling.stats import entropy  # noqa: E402


def rnd(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_kernels(dtype, tol):
    T, H = 5, 48  # H not a power of two: exercises the masked tail
    x, r, m, e = rnd(T, H, dtype=dtype, scale=3), rnd(T, H, dtype=dtype), rnd(T, H, dtype=dtype), rnd(T, H)
    w1, w2, w3 = (torch.rand(H).to(dtype) + 0.5 for _ in range(3))
    wr = torch.rand(H) * 0.3
    eps = 1e-6
    for w in (w1, None):
        torch.testing.assert_close(rmsnorm.rms_norm_triton(x, w, eps), rmsnorm.rms_norm_ref(x, w, eps), atol=tol, rtol=tol)
    torch.testing.assert_close(rmsnorm.rms_norm_triton(x, w1, eps, torch.float32),
                               rmsnorm.rms_norm_ref(x, w1, eps, torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rmsnorm.norm_add_triton(r, x, w1, eps), rmsnorm.norm_add_ref(r, x, w1, eps), atol=tol, rtol=tol)
    got, exp = rmsnorm.ffn_inputs_triton(x, w1, w2, wr, eps), rmsnorm.ffn_inputs_ref(x, w1, w2, wr, eps)
    assert got[2].dtype == torch.float32  # router input stays f32
    for g, ex in zip(got, exp):
        torch.testing.assert_close(g, ex, atol=tol, rtol=tol)
    s = float(torch.rand(()) + 0.5)
    torch.testing.assert_close(rmsnorm.layer_finish_triton(r, m, e, w1, w2, w3, s, eps),
                               rmsnorm.layer_finish_ref(r, m, e, w1, w2, w3, s, eps), atol=tol, rtol=tol)


def test_rms_norm_reference_is_gemma_norm():
    # pins the twin itself: x / sqrt(mean(x^2)+eps) * w, not (1 + w)
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.rand(16, dtype=torch.float64)
    exp = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rmsnorm.rms_norm_ref(x, w, 1e-6), exp, rtol=1e-6, atol=1e-6)  # the twin reduces in f32


@pytest.mark.parametrize("hd,rot", [(16, 8), (32, 4)])  # full rotary, and proportional (zeros past 4 angles)
def test_norm_rope_dense_and_cache_write(hd, rot):
    T, H, rows = 6, 3, 9
    x = rnd(T, H, hd, scale=2)
    w = torch.rand(hd) + 0.5
    inv = 1.0 / (10000.0 ** (torch.arange(0, 2 * rot, 2, dtype=torch.float32) / hd))
    inv = torch.cat([inv, torch.zeros(hd // 2 - rot)])
    pos = torch.randint(0, 5000, (T,))
    slots = torch.tensor([4, -1, 0, 8, -1, 2])  # -1: pad rows write nothing
    for wt, f in ((w, inv), (None, None)):
        cache_k = torch.full((H, rows, hd), float("nan"), dtype=torch.float16)
        cache_r = cache_k.clone()
        got = rope_kv.norm_rope_triton(x, wt, f, pos, 1e-6, out_dtype=torch.bfloat16, cache=cache_k, slots=slots)
        exp = rope_kv.norm_rope_ref(x, wt, f, pos, 1e-6, out_dtype=torch.bfloat16, cache=cache_r, slots=slots)
        torch.testing.assert_close(got.float(), exp.float(), atol=2e-2, rtol=2e-2)
        # written rows match, and only the named rows were written
        assert torch.equal(torch.isnan(cache_k), torch.isnan(cache_r))
        assert torch.isnan(cache_k[:, [1, 3, 5, 6, 7]]).all()
        torch.testing.assert_close(cache_k[:, slots[slots >= 0]].float(), exp[slots >= 0].transpose(0, 1).float(),
                                   atol=1e-2, rtol=1e-2)


def test_norm_rope_matches_rotate_half_convention():
    # the twin against transformers' formula: x*cos + rotate_half(x)*sin with cos/sin of cat(freqs, freqs)
    T, H, hd = 4, 2, 8
    x, pos = torch.randn(T, H, hd, dtype=torch.float64), torch.randint(0, 100, (T,))
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    emb = torch.cat([pos.float()[:, None] * inv] * 2, -1).double()
    n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    rot = torch.cat([-n[..., hd // 2:], n[..., : hd // 2]], -1)
    exp = n * emb.cos()[:, None] + rot * emb.sin()[:, None]
    # cos/sin are taken of the f32 angle in float32 (like transformers), hence f32-level agreement
    torch.testing.assert_close(rope_kv.norm_rope_ref(x, None, inv, pos, 1e-6), exp, atol=1e-6, rtol=1e-6)


def test_ring_wrap_slots_write_the_last_ring_positions():
    from types import SimpleNamespace
    from diffgemma.model.engine_cache import EngineKVCache

    layer = SimpleNamespace(is_sliding=True, num_kv_heads=1, head_dim=2)
    cfg = SimpleNamespace(canvas_length=2, sliding_window=4, layers=[layer])
    cache = EngineKVCache(cfg, 64, "cpu", rewind_slack=2)  # ring = 3 + 2 = 5
    pos = torch.arange(3, 15)
    slots = cache.ring_slots(pos, 15)
    assert slots.tolist() == [-1] * 7 + [10 % 5, 11 % 5, 12 % 5, 13 % 5, 14 % 5]
    cache.advance(pos, 15)
    assert sorted(cache.slot_pos.tolist()) == [10, 11, 12, 13, 14]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_rowstats(dtype):
    R, V = 4, 5000  # V not a multiple of the block: masked tail
    raw = rnd(R, V, dtype=dtype, scale=20)
    raw[1, 77] = raw[1, 4000] = 500.0  # an exact tie: argmax must be the lower index
    inv_t = 1.0 / (0.4 + 0.4 * float(torch.rand(())))
    got = softcap.softcap_rowstats_triton(raw, 30.0, inv_t, block=1024)
    exp = softcap.softcap_rowstats_ref(raw, 30.0, inv_t)
    torch.testing.assert_close(got[0], exp[0], atol=2e-5, rtol=1e-5)
    # entropy against the float64 entropy of the same logits, not the twin's: the twin's f32 formula (torch's) is
    # itself up to 2.9e-4 off over 5000 columns of |z| <= 75, and used up to 94 % of the old 1e-4 + 1e-4·|h| band
    # (4000 fresh draws). The kernel is observed within 2.0e-5 of float64 (2000 draws); a real fault moves it far more
    # (temperature not applied: >= 0.3; the short last block of the row dropped: >= 0.12 over 2000 draws).
    truth = entropy(got[0].double() * inv_t)
    assert (got[1].double() - truth).abs().max() < 1e-4
    assert (exp[1].double() - entropy(exp[0].double() * inv_t)).abs().max() < 1e-3  # the twin: within its 2.9e-4
    for g, e in zip(got[2:], exp[2:]):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    assert got[2][1].item() == 77


def test_route_tie_break_and_weights():
    T, E, k = 6, 8, 3
    logits = torch.randn(T, E)
    logits[0] = 0.0  # all tied: experts 0,1,2
    logits[1, [5, 2, 7]] = 9.0  # three-way tie at the top: 2,5,7 in index order
    scale = torch.rand(E) + 0.5
    w, idx = moe.route(logits, k, scale)
    assert idx[0].tolist() == [0, 1, 2] and idx[1].tolist() == [2, 5, 7]
    p = torch.softmax(logits, -1)
    top = p.gather(1, idx)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True) * scale[idx])
    assert (top[:, :-1] >= top[:, 1:]).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_experts_match_loop(dtype, tol):
    T, H, E, Fe, k = 9, 16, 5, 6, 2
    x = rnd(T, H, dtype=dtype)
    gate_up, down = rnd(E, 2 * Fe, H, dtype=dtype, scale=0.3), rnd(E, H, Fe, dtype=dtype, scale=0.3)
    w, idx = moe.route(torch.randn(T, E), k, torch.rand(E) + 0.5)
    idx[:, 0] = 3  # a crowded expert, and (likely) an empty one
    got = moe.experts_grouped(x, w, idx, gate_up, down)
    exp = moe.experts_ref(x, w, idx, gate_up, down)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, exp, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------- fused ops

from diffgemma.ops import attention as attn  # noqa: E402
from diffgemma.ops import gelu_mul, moe_plan, qkv, route  # noqa: E402
from diffgemma.ops.f16_operand import f16_operand_ref  # noqa: E402
from diffgemma.errors import TensorError  # noqa: E402


def test_route_kernel_matches_sorted_twin_with_ties():
    T, H, E, k = 20, 40, 12, 3  # T not a multiple of the row block, E not a power of two
    x, w = torch.randn(T, H), torch.randn(E, H) * 0.3
    w[7] = w[2]  # experts 2 and 7 always tie: 2 must come first
    x[0] = w[2] * 5  # make the tie the top choice of row 0
    scale = torch.rand(E) + 0.5
    gw, ge = route.route_triton(x, w, k, scale, block_t=8)
    ew, ee = route.route_ref(x, w, k, scale)
    assert torch.equal(ge.long(), ee)
    assert ge[0, :2].tolist() == [2, 7]
    torch.testing.assert_close(gw, ew, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bf16_weight", [True, False])
def test_router_pieces_sum_to_the_weight_exactly(bf16_weight):
    w = torch.randn(12, 200) * 0.3
    if bf16_weight:
        w = w.bfloat16().float()
    p = route.router_pieces(w)
    assert p.dtype == torch.bfloat16 and p.shape == ((1 if bf16_weight else 3), 12, 200)
    assert torch.equal(p.double().sum(0), w.double())


@pytest.mark.parametrize("bf16_weight", [True, False])
def test_router_gemm_bf16x3_matches_f64(bf16_weight):
    # T, H, E off every block size: row, K-slice and expert masks all in play; 4 K slices of 64
    T, H, E = 20, 200, 12
    x = torch.randn(T, H) * 2.0
    w = torch.randn(E, H) * 0.3
    if bf16_weight:
        w = w.bfloat16().float()
    part = route.router_gemm_triton(x, route.router_pieces(w), config=(16, 64, 32, 4, 1))
    assert part.shape == (4, T, E)
    truth = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    assert (part.double().sum(0) - truth).abs().max().item() <= 1e-6 * scale


def test_route_kernel_from_the_bf16x3_gemm_matches_twin_with_ties():
    T, H, E, k = 20, 40, 12, 3
    x, w = torch.randn(T, H), (torch.randn(E, H) * 0.3).bfloat16().float()
    w[7] = w[2]  # an exact tie stays exact: the same products summed in the same order
    x[0] = w[2] * 5
    scale = torch.rand(E) + 0.5
    gw, ge = route.route_triton(x, w, k, scale, pieces=route.router_pieces(w), gemm_config=(16, 32, 16, 4, 1))
    ew, ee = route.route_ref(x, w, k, scale)
    assert torch.equal(ge.long(), ee)
    assert ge[0, :2].tolist() == [2, 7]
    torch.testing.assert_close(gw, ew, atol=1e-6, rtol=1e-5)


def test_router_gemm_refuses_bad_pieces():
    x = torch.randn(4, 32)
    with pytest.raises(TensorError, match="pieces"):
        route.router_gemm_triton(x, torch.zeros(2, 8, 32, dtype=torch.bfloat16))
    with pytest.raises(TensorError, match="bf16"):
        route.router_gemm_triton(x, torch.zeros(1, 8, 32))


def test_moe_plan_kernel_matches_argsort():
    T, k, E = 23, 3, 9
    ex = torch.randint(0, E, (T, k))
    ex[:, 0] = 4  # crowded expert; others may be empty
    got = moe_plan.moe_plan_triton(ex, E, block=16)  # N = 69 > block: carries across blocks
    exp = moe_plan.moe_plan_ref(ex, E)
    for g, e in zip(got, exp):
        assert torch.equal(g.long(), e.long())


@pytest.mark.parametrize("case", ["random", "crowded", "balanced"])
def test_moe_plan_order_is_experts_by_row_count_ties_by_index(case):
    T, k, E = 37, 3, 12  # E not a power of two: the histogram's spare bins must not rank
    ex = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    if case == "crowded":
        ex[:, 0], ex[:5, 1] = 7, 2  # expert 7 in every token, 2 in five more
    elif case == "balanced":
        T = 4 * E // k
        ex = (torch.arange(T * k) % E).view(T, k)  # every count equal: the order is the identity
    src, inv, offs, order = moe_plan.moe_plan_triton(ex, E, block=16, with_order=True)
    want = moe_plan.expert_order_ref(offs)
    assert order.dtype == torch.int32 and torch.equal(order, want)
    assert sorted(order.tolist()) == list(range(E))
    counts = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.long))
    assert (counts[order.long()][:-1] >= counts[order.long()][1:]).all()
    if case == "crowded":
        assert order[0] == 7
    if case == "balanced":
        assert order.tolist() == list(range(E))
    for g, e in zip((src, inv, offs), moe_plan.moe_plan_ref(ex, E)):  # the plan itself is unchanged
        assert torch.equal(g.long(), e.long())


def test_moe_plan_with_order_off_cuda():
    ex = torch.randint(0, 8, (10, 2))
    assert moe_plan.moe_plan_with_order(ex, 8)[3] is None  # CPU tensors: the twin, nothing reads an order


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_gelu_mul_kernel(dtype, tol):
    gu = rnd(7, 2 * 40, dtype=dtype, scale=4)
    got = gelu_mul.gelu_mul_triton(gu, block=16)
    torch.testing.assert_close(got, gelu_mul.gelu_mul_ref(gu), atol=tol, rtol=tol)
    # as the q4 GEMM's f16 operand: the f16 copy of the bf16 rounding, bit for bit (and the twin's likewise).
    # With bf16 input the kernel's own bf16 rounding is the reference (the interpreter rounds f32 -> bf16 its
    # own way; on the GPU both paths are the same conversion), with f32 input it is within that rounding.
    gu[0, :2], gu[0, 40:42] = torch.tensor([3e3, 1e4]).to(dtype), torch.tensor([100.0, -100.0]).to(dtype)  # clamped
    got, f16 = gelu_mul.gelu_mul_triton(gu, block=16), gelu_mul.gelu_mul_triton(gu, block=16, as_f16=True)
    assert f16.dtype == torch.float16 and f16[0, 0] == 65504 and f16[0, 1] == -65504
    if dtype == torch.bfloat16:
        assert torch.equal(f16, f16_operand_ref(got))
    else:
        torch.testing.assert_close(f16.float(), got.clamp(-65504, 65504), atol=2**-24, rtol=2**-7)  # f16 subnormals
    assert torch.equal(gelu_mul.gelu_mul_ref(gu, as_f16=True),
                       f16_operand_ref(F.gelu(gu[:, :40].float(), approximate="tanh") * gu[:, 40:].float()))


def test_f16_operand_is_the_bf16_value_in_f16():
    x = rnd(1000, scale=30)
    x[:4] = torch.tensor([1e6, -1e6, 65504.0, 1e-3])
    got = f16_operand_ref(x)
    b = x.bfloat16()
    inside = b.float().abs() <= 65504
    assert torch.equal(got[inside].float(), b[inside].float())  # exact: 8 mantissa bits fit in 10
    assert torch.equal(got[:2].float(), torch.tensor([65504.0, -65504.0]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_norm_chains(dtype, tol):
    T, H, k, N = 5, 48, 3, 15
    res, a, m = rnd(T, H, dtype=dtype, scale=2), rnd(T, H, dtype=dtype), rnd(T, H, dtype=dtype)
    ws = [(torch.rand(H) + 0.5).to(dtype) for _ in range(5)]
    wr = torch.rand(H) * 0.3
    got = rmsnorm.attn_finish_triton(res, a, ws[0], ws[1], ws[2], wr, 1e-6)
    for g, e in zip(got, rmsnorm.attn_finish_ref(res, a, ws[0], ws[1], ws[2], wr, 1e-6)):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)
    # moe_in as the q4 GEMM's f16 operand: the f16 copy of the bf16 rounding; the other outputs unchanged
    f16 = rmsnorm.attn_finish_triton(res, a, ws[0], ws[1], ws[2], wr, 1e-6, moe_f16=True)
    assert f16[2].dtype == torch.float16 and all(torch.equal(f, g) for i, (f, g) in enumerate(zip(f16, got)) if i != 2)
    if dtype == torch.bfloat16:  # see test_gelu_mul_kernel
        assert torch.equal(f16[2], f16_operand_ref(got[2]))
    else:
        torch.testing.assert_close(f16[2].float(), got[2], atol=2**-24, rtol=2**-7)
    ref16 = rmsnorm.attn_finish_ref(res, a, ws[0], ws[1], ws[2], wr, 1e-6, moe_f16=True)
    assert torch.equal(ref16[2], f16_operand_ref(rmsnorm.attn_finish_ref(res, a, ws[0], ws[1], ws[2], wr, 1e-6)[2]))
    y = rnd(N, H, dtype=dtype)
    inv = torch.randperm(N)[: T * k]
    wts = torch.rand(T, k)
    s = float(torch.rand(()) + 0.5)
    for w_next in (ws[4], None):
        got = rmsnorm.layer_finish_moe_triton(res, m, y, inv, wts, ws[1], ws[2], ws[3], s, 1e-6, w_next)
        exp = rmsnorm.layer_finish_moe_ref(res, m, y, inv, wts, ws[1], ws[2], ws[3], s, 1e-6, w_next)
        torch.testing.assert_close(got[0], exp[0], atol=tol, rtol=tol)
        if w_next is None:
            assert got[1] is None and exp[1] is None
        else:
            torch.testing.assert_close(got[1], exp[1], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_embed_sc_norms_kernel(dtype, tol):
    """The denoise prelude in one kernel (gather, scale and round the embedding, add the SC output, norm, then the
    first layer's input norm) against its twin, which is what the engine did in eight ops; an id outside the table
    makes only its own row NaN, with no read outside the table."""
    V, H, T = 37, 48, 7
    table = rnd(V, H, dtype=dtype)
    ids = torch.randint(0, V, (T,))
    s = rnd(T, H, dtype=dtype, scale=2)
    w = torch.rand(H).to(dtype) + 0.5
    scale = float(H) ** 0.5
    got = rmsnorm.embed_sc_norms_triton(ids, table, scale, s, w, 1e-6, dtype)
    exp = rmsnorm.embed_sc_norms_ref(ids, table, scale, s, w, 1e-6, dtype)
    for g, e in zip(got, exp):
        assert g.dtype == dtype
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)
    x_old = rmsnorm.rms_norm_ref((table[ids].float() * scale).to(dtype).float() + s.float(), None, 1e-6, dtype)
    assert torch.equal(exp[0], x_old) and torch.equal(exp[1], rmsnorm.rms_norm_ref(x_old, w, 1e-6))
    bad = ids.clone()
    bad[2], bad[5] = V, -1
    x, h = rmsnorm.embed_sc_norms_triton(bad, table, scale, s, w, 1e-6, dtype)
    keep = torch.tensor([i not in (2, 5) for i in range(T)])
    assert x[~keep].isnan().all() and h[~keep].isnan().all()
    torch.testing.assert_close(x[keep], got[0][keep], atol=0, rtol=0)
    with pytest.raises(TensorError, match="embed_sc_norms"):
        rmsnorm.embed_sc_norms(ids, table, scale, s[:, :-1], w, 1e-6, dtype)


@pytest.mark.parametrize("M,N,K", [(7, 40, 96), (33, 130, 80)])  # tiles partly masked on every side
def test_q8_linear_kernel(M, N, K):
    """The q8 GEMM reading int8 codes against its twin (codes in x's dtype, row scales after) and the float64 product
    of the decoded weight, f16 activations (the interpreter has no bf16 dot; tests/gpu runs bf16 at the real shapes).
    Malformed operands are refused."""
    from diffgemma.ops import q8_linear as q8

    codes = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    scale = torch.rand(N) * 0.02 + 0.001
    w = codes.double() * scale.double()[:, None]
    x = rnd(M, K, dtype=torch.float16)
    got = q8.q8_linear_triton(x, codes, scale, config=(16, 32, 32, 4, 1))
    twin = q8.q8_linear_ref(x, codes, scale)
    exact = x.double() @ w.T
    assert got.dtype == torch.float16 and got.shape == (M, N)
    assert ((got.double() - exact).abs() <= 2 ** -10 * exact.abs() + 1e-4).all()  # one rounding of the output
    torch.testing.assert_close(got.float(), twin.float(), atol=1e-3, rtol=2e-3)
    with pytest.raises(TensorError, match="q8_linear"):
        q8.q8_linear_triton(x, codes[:, :-1], scale)
    with pytest.raises(TensorError, match="q8_linear"):
        q8.q8_linear_triton(x, codes.to(torch.int16), scale)


# heads a program: all 8 in one; 10 in three programs, the last partly masked; one at a time
@pytest.mark.parametrize("Hq,per_program", [(4, 8), (6, 4), (4, 1)])
@pytest.mark.parametrize("has_v", [True, False])
def test_qkv_prep_kernel(has_v, Hq, per_program):
    T, KV, hd, rows = 6, 2, 16, 9
    nq, nk = Hq * hd, KV * hd
    qkvx = rnd(T, nq + nk + (nk if has_v else 0) + 8, scale=2)[:, :-8]  # a strided (non-contiguous) view
    nw = torch.stack([torch.rand(hd) + 0.5, torch.rand(hd) + 0.5, torch.ones(hd)])
    inv = torch.cat([1.0 / (100.0 ** (torch.arange(0, 8, 2) / hd)), torch.zeros(4)])
    pos = torch.randint(0, 3000, (T,))
    slots = torch.tensor([3, -1, 0, 8, 5, -1])
    v_off = nq + nk if has_v else nq
    outs = []
    for fn in (functools.partial(qkv.qkv_prep_triton, heads_per_program=per_program), qkv.qkv_prep_ref):
        ck = torch.full((KV, rows, hd), float("nan"), dtype=torch.float16)
        cv = ck.clone()
        q, kv = fn(qkvx, Hq, KV, hd, v_off, nw, inv, pos, 1e-6, torch.float16, cache_k=ck, cache_v=cv, slots=slots,
                   dense_kv=True)
        outs.append((q, kv, ck, cv))
    (q, kv, ck, cv), (q2, kv2, ck2, cv2) = outs
    assert q.shape == (Hq, T, hd) and kv.shape == (2, KV, T, hd)
    for g, e in ((q, q2), (kv, kv2)):
        torch.testing.assert_close(g.float(), e.float(), atol=3e-3, rtol=3e-3)
    written = torch.zeros(rows, dtype=torch.bool)
    written[slots[slots >= 0]] = True  # slots 0, 3, 5, 8; the -1 rows write nothing
    for name, c in (("kernel K", ck), ("kernel V", cv), ("twin K", ck2), ("twin V", cv2)):
        assert not torch.isnan(c[:, written]).any(), f"{name}: a named slot was not written"
        assert torch.isnan(c[:, ~written]).all(), f"{name}: a slot outside the named ones was written"
    for g, e in ((ck, ck2), (cv, cv2)):
        torch.testing.assert_close(g[:, written].float(), e[:, written].float(), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("case", ["bidir", "bidir_nlive", "causal_ring", "causal_full"])
def test_attention_kernel(case):
    H, KV, d, n, rows = 4, 2, 32, 24, 70
    q = rnd(H, n, d, dtype=torch.float16)
    k, v = rnd(KV, rows, d, dtype=torch.float16), rnd(KV, rows, d, dtype=torch.float16)
    n_keys = 60  # rows past n_keys must not be read into the result
    k[:, n_keys:] = v[:, n_keys:] = float("nan")
    causal = case.startswith("causal")
    hints, qpos, window = {}, None, attn.NO_WINDOW
    if case == "causal_ring":  # the sliding prefill layout: old ring slots (some empty), then the chunk's own keys
        kpos = torch.cat([torch.randint(-1, 40, (n_keys - n,)), torch.arange(40, 40 + n)])
        qpos, window = torch.arange(40, 40 + n), 9
        hints = dict(n_ring=n_keys - n, base_pos=40)
        v[:, :n_keys][:, kpos < 0] = float("nan")  # empty slots hold garbage: never read
    elif case == "causal_full":  # the full-layer layout: key i holds position i
        kpos, qpos = torch.arange(n_keys), torch.arange(n_keys - n, n_keys)
    else:
        kpos = torch.where(torch.rand(n_keys) < 0.3, -1, 0)
        kpos[-n:] = 0
        if case == "bidir_nlive":  # a graph's padded bucket: keys past the live count are not visible
            live = 50
            kpos[live:] = -1
            kpos[live - n: live] = 0
            hints = dict(nlive=torch.tensor(live))
        v[:, :n_keys][:, kpos < 0] = float("nan")
    got = attn.attention_flash(q, k, v, kpos, n_keys, qpos=qpos, window=window, causal=causal,
                               out_dtype=torch.float32, BM=16, BN=16, BD=16, num_warps=4, num_stages=1, **hints)
    exp = attn.attention_ref(q, k, v, kpos, n_keys, qpos=qpos, window=window, causal=causal, out_dtype=torch.float32)
    assert got.shape == (n, H * d)
    assert_close_f32(got, exp)  # f32 output at 1e-3 relative: a bf16 output's rounding would hide a 0.4 % error
    if "ring" not in case and "nlive" not in case:
        sd = attn.attention_sdpa(q.float(), k.float(), v.float().nan_to_num(), kpos, n_keys, qpos=qpos, window=window, causal=causal)
        torch.testing.assert_close(sd, exp, atol=1e-4, rtol=1e-4)
