"""GPU check of the bf16 streaming expert GEMM (ops/moe_stream.py) at the real denoise shapes.

Skips without CUDA. Held to torch._grouped_mm: bit for bit where the dispatcher streams (what keeps a token
from depending on which of the two runs), and by ‖Δ‖/‖ref‖ where a check only needs the product. Routing: balanced (16 rows per expert, what a
trained model's canvas does) and random top-8 (ragged, some experts with many rows, a few with none)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.ops import moe_stream  # noqa: E402
from diffgemma.ops.moe_plan import moe_plan  # noqa: E402

E, H, Fe, K_TOP, T = 128, 2816, 704, 8, 256


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def grouped_operands(routing: str, tokens: int, N: int, K: int):
    """(offs, w [E, N, K], x [tokens·top-k, K] grouped by expert) of `tokens` tokens routed "balanced" (the same rows
    every expert) or "random" (top-k drawn with repeats: ragged, some experts empty)."""
    if routing == "balanced":
        experts = (torch.arange(tokens * K_TOP, device="cuda") % E).view(tokens, K_TOP)
    else:
        experts = torch.randint(0, E, (tokens, K_TOP), device="cuda")
    _, _, offs = moe_plan(experts, E)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    return offs, w, torch.randn(tokens * K_TOP, K, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("routing", ["balanced", "random"])
@pytest.mark.parametrize("N,K", [(2 * Fe, H), (H, Fe)])  # gate_up, down
def test_stream_kernel_matches_grouped_mm_at_real_shapes(routing, N, K):
    offs, w, xs = grouped_operands(routing, T, N, K)
    got = moe_stream.grouped_mm_triton(xs, w, offs)
    want = moe_stream.grouped_mm_ref(xs, w, offs)
    r = rel(got, want)
    print(f"\n[stream gemm {routing} N={N} K={K}] rel {r:.2e}")
    assert r < 4e-3


@pytest.mark.parametrize("routing", ["balanced", "random"])
@pytest.mark.parametrize("T,N,K", [(256, 2 * Fe, H), (256, H, Fe), (1024, H, Fe)])
def test_streamed_gemm_gives_torchs_bits_where_the_dispatcher_streams(routing, T, N, K):
    """Where ops/moe_paths.py streams a bf16 expert GEMM (denoise's rows; a down projection at a 1k prefill's too)
    the kernel's result equals torch._grouped_mm's bit for bit, through the dispatcher as through the kernel: which
    of the two runs changes no token."""
    from diffgemma.ops import moe, moe_paths

    offs, w, xs = grouped_operands(routing, T, N, K)
    assert moe_paths.expert_gemm_path(w, T * K_TOP, xs) == "stream"
    want = moe_stream.grouped_mm_ref(xs, w, offs)
    assert torch.equal(moe_stream.grouped_mm_triton(xs, w, offs), want)
    assert torch.equal(moe.grouped_mm(xs, w, offs), want)


@pytest.mark.parametrize("routing", ["balanced", "random"])
def test_gate_up_reads_tokens_through_src_at_real_shape(routing):
    """The engine's gate_up call: token rows gathered in the kernel's loads (src), against index_select and the
    kernel on the gathered rows (bit for bit) and torch._grouped_mm."""
    experts = (torch.arange(T * K_TOP, device="cuda") % E).view(T, K_TOP) if routing == "balanced" else \
        torch.randint(0, E, (T, K_TOP), device="cuda")
    src, _, offs = moe_plan(experts, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * Fe, H, device="cuda", dtype=torch.bfloat16) * 0.02
    got = moe_stream.grouped_mm_triton(x, gu, offs, src=src)
    assert torch.equal(got, moe_stream.grouped_mm_triton(x.index_select(0, src), gu, offs))
    r = rel(got, moe_stream.grouped_mm_ref(x.index_select(0, src), gu, offs))
    print(f"\n[gate_up through src {routing}] rel {r:.2e}")
    assert r < 4e-3


def test_stream_kernel_launch_order_at_real_shape():
    """Popular experts at random ids, the engine's plan: the bf16 stream kernel launched most-routed first gives
    the same bits as in expert order."""
    from diffgemma.ops.moe_plan import moe_plan_with_order

    pr = (1.0 / (torch.arange(E, device="cuda", dtype=torch.float32) + 8))[torch.randperm(E, device="cuda")]
    experts = torch.multinomial(pr.expand(T, E), K_TOP, replacement=False)
    src, _, offs, order = moe_plan_with_order(experts, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * Fe, H, device="cuda", dtype=torch.bfloat16) * 0.02
    assert torch.equal(moe_stream.grouped_mm_triton(x, gu, offs, src=src, order=order),
                       moe_stream.grouped_mm_triton(x, gu, offs, src=src))


@pytest.mark.parametrize("routing", ["balanced", "random"])
def test_gate_up_with_gelu_in_the_epilogue_at_real_shape(routing):
    """The engine's gate_up call with gelu·up in the epilogue: the same bits as the gelu·up kernel after the plain
    GEMM (both round the products to bf16, then one formula in f32)."""
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    from diffgemma.ops.moe_plan import moe_plan_with_order

    experts = (torch.arange(T * K_TOP, device="cuda") % E).view(T, K_TOP) if routing == "balanced" else \
        torch.randint(0, E, (T, K_TOP), device="cuda")
    src, _, offs, order = moe_plan_with_order(experts, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * Fe, H, device="cuda", dtype=torch.bfloat16) * 0.02
    got = moe_stream.grouped_mm_triton(x, gu, offs, src=src, order=order, glu=True)
    want = gelu_mul_triton(moe_stream.grouped_mm_triton(x, gu, offs, src=src, order=order))
    assert got.shape == (T * K_TOP, Fe)
    diff = (got.float() != want.float()).sum().item()
    print(f"\n[gate_up + gelu epilogue {routing}] {diff} of {got.numel()} values differ; "
          f"max |d| {(got.float() - want.float()).abs().max().item():.2e}")
    assert torch.equal(got, want)
