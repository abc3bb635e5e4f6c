"""The bf16 streaming expert GEMM (ops/moe_stream.py): the kernel in the Triton interpreter vs its twin
(torch._grouped_mm), on fresh random inputs with ragged groups (empty experts at the start, middle and end),
shapes off the tile grid, an expert with more rows than one row tile, and the dispatcher's switch."""

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import moe, moe_paths, moe_stream
from test_moe_packed import interpreted, ragged_offs, rel


@interpreted
@pytest.mark.parametrize("config", [(16, 16, 32, 4, 1), (32, 16, 64, 4, 1)])
def test_stream_kernel_matches_twin(config):
    E, N, K, M = 6, 40, 96, 53
    w = torch.randn(E, N, K) * 0.1
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    out = moe_stream.grouped_mm_triton(xs, w, offs, config=config)
    want = moe_stream.grouped_mm_ref(xs, w, offs)
    assert out.shape == (M, N) and torch.isfinite(out).all()
    assert rel(out, want) < 1e-5


@interpreted
def test_stream_kernel_one_expert_holding_every_row_and_no_rows():
    w = torch.randn(4, 32, 64)
    xs = torch.randn(37, 64)
    offs = torch.tensor([0, 0, 37, 37], dtype=torch.int32)  # 3 row tiles of 16 in expert 2
    assert rel(moe_stream.grouped_mm_triton(xs, w, offs, config=(16, 16, 32, 4, 1)), xs @ w[2].T) < 1e-5
    assert moe_stream.grouped_mm_triton(xs[:0], w, torch.zeros(4, dtype=torch.int32)).shape == (0, 32)


def routes_of(T, k, E):
    """(src [T·k] int32: each route's token, offs [E]) for a random top-k routing grouped by expert, stable."""
    experts = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    order = torch.argsort(experts.reshape(-1), stable=True)
    counts = torch.bincount(experts.reshape(-1), minlength=E)
    return (order // k).to(torch.int32), torch.cumsum(counts, 0).to(torch.int32)


@interpreted
def test_stream_kernel_gathers_rows_through_src():
    """Reading route m's row as x[src[m]] inside the kernel gives the kernel's result on the gathered rows, bit
    for bit (same loads, same order), and the dispatcher's torch path gathers first."""
    T, k, E, N, K = 13, 3, 6, 40, 96
    x = torch.randn(T, K)
    w = torch.randn(E, N, K) * 0.1
    src, offs = routes_of(T, k, E)
    cfg = (16, 16, 32, 4, 1)
    got = moe_stream.grouped_mm_triton(x, w, offs, config=cfg, src=src)
    assert torch.equal(got, moe_stream.grouped_mm_triton(x.index_select(0, src), w, offs, config=cfg))
    assert rel(moe.grouped_mm(x, w, offs, src=src), moe_stream.grouped_mm_ref(x[src.long()], w, offs)) < 1e-6


@interpreted
def test_a_short_k_gemm_with_more_rows_than_denoise_takes_the_wide_row_tile(monkeypatch):
    """A down projection (K <= moe_paths.STREAM_SHORT_K) over more than STREAM_MAX_ROWS rows an expert (a 1k prefill's 64) runs the
    kernel's CONFIG_SHORT_K_WIDE, at denoise's rows CONFIG_SHORT_K; through src too; the product is the twin's."""
    E, N, K = 6, 32, 64
    used = []
    launch = moe_stream.launch_grouped

    def spy(*a, **kw):
        used.append(a[7:12])  # (BN, BM, BK, warps, stages)
        return launch(*a, **kw)
    monkeypatch.setattr(moe_stream, "launch_grouped", spy)
    monkeypatch.setattr(moe_stream, "CONFIG_SHORT_K", (16, 16, 32, 4, 1))  # small tiles: the interpreter's speed
    monkeypatch.setattr(moe_stream, "CONFIG_SHORT_K_WIDE", (16, 32, 32, 4, 1))
    w = torch.randn(E, N, K) * 0.1
    for rows, config in ((moe_paths.STREAM_MAX_ROWS, (16, 16, 32, 4, 1)),
                         (moe_paths.STREAM_MAX_ROWS + 1, (16, 32, 32, 4, 1))):
        M = rows * E
        xs, offs = torch.randn(M, K), ragged_offs(E, M)
        used.clear()
        out = moe_stream.grouped_mm_triton(xs, w, offs)
        assert used == [config] and rel(out, moe_stream.grouped_mm_ref(xs, w, offs)) < 1e-5
        T, k = M // 3, 3
        src, offs = routes_of(T, k, E)
        x = torch.randn(T, K)
        used.clear()
        assert torch.equal(moe_stream.grouped_mm_triton(x, w, offs, src=src),
                           moe_stream.grouped_mm_triton(x.index_select(0, src), w, offs))
        assert used == [config, config]


def test_stream_and_packed_kernels_launch_order_does_not_change_the_result():
    """Experts launched most-routed first (the plan kernel's order): the same bits from the bf16 stream kernel and
    the packed one (q5 here: q4 on CUDA goes to ops/moe_q4.py, tested there); a wrong order is refused."""
    from diffgemma.ops import moe_packed as mp
    from diffgemma.ops.moe_plan import moe_plan_triton
    from test_moe_packed import packed

    T, k, E, N, K = 13, 3, 6, 32, 64
    ex = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ex[:, 0] = 4  # a crowded expert: first in the order
    src, _, offs, order = moe_plan_triton(ex, E, with_order=True)
    assert order[0] == 4
    x = torch.randn(T, K)
    w = torch.randn(E, N, K) * 0.1
    got = moe_stream.grouped_mm_triton(x, w, offs, src=src, order=order)
    assert torch.equal(got, moe_stream.grouped_mm_triton(x, w, offs, src=src))
    pw, _ = packed("q5", (E, N, K))
    got = mp.grouped_mm_packed_triton(x, pw, offs, src=src, order=order)
    assert torch.equal(got, mp.grouped_mm_packed_triton(x, pw, offs, src=src))
    with pytest.raises(TensorError, match="order must be int32"):
        moe_stream.grouped_mm_triton(x, w, offs, src=src, order=order[:3])


def test_stream_kernel_refuses_mismatched_operands():
    with pytest.raises(TensorError, match="grouped_mm"):
        moe_stream.grouped_mm_triton(torch.randn(5, 8), torch.randn(2, 4, 6), torch.tensor([2, 5]))
    with pytest.raises(TensorError, match="dtype"):
        moe_stream.grouped_mm_triton(torch.randn(5, 8), torch.randn(2, 4, 8, dtype=torch.float64), torch.tensor([2, 5]))
    with pytest.raises(TensorError, match="src must be a 1-D int32/int64"):
        moe_stream.grouped_mm_triton(torch.randn(5, 8), torch.randn(2, 4, 8), torch.tensor([2, 5]),
                                     src=torch.zeros(5, 1, dtype=torch.int32))
    with pytest.raises(TensorError, match="src must be a 1-D int32/int64"):
        moe_stream.grouped_mm_triton(torch.randn(5, 8), torch.randn(2, 4, 8), torch.tensor([2, 5]), src=torch.zeros(5))


@interpreted
@pytest.mark.parametrize("switch,rows_per_expert", [(None, 8), ("triton", 8), ("triton", 100), ("cutlass", 8)])
def test_expert_ffn_takes_the_kernel_by_default_at_the_denoise_shape_only(monkeypatch, switch, rows_per_expert):
    E, H, Fe = 5, 64, 32
    M = E * rows_per_expert
    gate_up, down = torch.randn(E, 2 * Fe, H) * 0.1, torch.randn(E, H, Fe) * 0.1
    xs = torch.randn(M, H)
    offs = ragged_offs(E, M)
    want = moe.expert_ffn(xs, gate_up, down, offs)  # CPU: the twin
    calls = []
    kernel = moe_stream.grouped_mm_triton
    monkeypatch.setattr(moe_stream, "grouped_mm_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k, config=(16, 16, 32, 4, 1)))
    monkeypatch.setattr(moe_paths, "use_triton", lambda t: True)
    if switch is None:
        monkeypatch.delenv(moe_paths.EXPERT_GEMM_ENV, raising=False)
    else:
        monkeypatch.setenv(moe_paths.EXPERT_GEMM_ENV, switch)
    got = moe.expert_ffn(xs, gate_up, down, offs)
    assert len(calls) == (2 if switch != "cutlass" and rows_per_expert <= moe_paths.STREAM_MAX_ROWS else 0)
    assert rel(got, want) < 1e-5


def test_expert_gemm_switch_refuses_unknown_values_and_is_a_known_setting(monkeypatch):
    from diffgemma.settings import GenerationSettings

    monkeypatch.setenv(moe_paths.EXPERT_GEMM_ENV, "cutlas")
    with pytest.raises(ValueError, match="DIFFGEMMA_EXPERT_GEMM='cutlas'"):
        moe_paths.expert_gemm_choice()
    monkeypatch.setenv(moe_paths.EXPERT_GEMM_ENV, "cutlass")
    GenerationSettings.resolve({})  # generation settings do not reject the kernel switch


def exact_operands(x_shape, w_shape):
    """Random x and w of a few bits each (quarters, sixteenths), whose products and partial sums are exact in f32:
    a GEMM on them has the same bits in any summation order. The interpreter's dot is the host's BLAS, whose
    rounding can follow a row's place in the tile (an AVX2 machine's does, in the last bits), so comparing a GLU
    tile's products with a plain tile's bit for bit needs such inputs."""
    return torch.randint(-8, 9, x_shape).float() / 4, torch.randint(-8, 9, w_shape).float() / 16


@interpreted
@pytest.mark.parametrize("config", [(16, 16, 32, 4, 1), (32, 16, 64, 4, 1)])
def test_gate_up_with_gelu_in_the_epilogue_is_gelu_mul_after_the_plain_gemm(config):
    """glu: each program loads BN/2 gate rows and the BN/2 up rows of the same columns, and stores gelu·up of its
    products: the same bits as the gelu·up kernel on the plain GEMM's output. F = 40 is off the BN/2 grid, routes
    come through src in the plan's launch order, and some experts have no rows."""
    from diffgemma.ops.gelu_mul import gelu_mul_ref, gelu_mul_triton
    from diffgemma.ops.moe_plan import moe_plan_triton

    T, k, E, F, K = 13, 3, 6, 40, 96
    ex = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])  # expert 5 gets nothing
    ex[:, 0] = 2
    src, _, offs, order = moe_plan_triton(ex, E, with_order=True)
    x, w = exact_operands((T, K), (E, 2 * F, K))
    got = moe_stream.grouped_mm_triton(x, w, offs, config=config, src=src, order=order, glu=True)
    plain = moe_stream.grouped_mm_triton(x, w, offs, config=config, src=src, order=order)
    assert got.shape == (T * k, F)
    assert torch.equal(got, gelu_mul_triton(plain))
    assert rel(got, gelu_mul_ref(moe_stream.grouped_mm_ref(x[src.long()], w, offs))) < 1e-5


@interpreted
@pytest.mark.parametrize("fmt", ["q6", "nvfp4"])
def test_packed_gate_up_with_gelu_in_the_epilogue(fmt):
    from diffgemma.ops import moe_packed as mp
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    from test_moe_packed import packed

    E, F, K, M = 5, 24, 64, 29
    pw, _ = packed(fmt, (E, 2 * F, K))
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    cfg = (16, 16, 32, 4, 1)
    got = mp.grouped_mm_packed_triton(xs, pw, offs, config=cfg, glu=True)
    # decoded weights of many bits: the interpreter's dot may round a row differently at another place in the tile
    # (see exact_operands); the bf16 test above and the GPU tests hold the same bits
    torch.testing.assert_close(got, gelu_mul_triton(mp.grouped_mm_packed_triton(xs, pw, offs, config=cfg)),
                               rtol=1e-5, atol=1e-6)


@interpreted
def test_expert_ffn_fused_gelu_matches_gelu_after(monkeypatch):
    E, H, Fe, M = 5, 64, 32, 40
    xs, gate_up = exact_operands((M, H), (E, 2 * Fe, H))  # the down GEMM then reads the same bits either way
    down = torch.randn(E, H, Fe) * 0.1
    offs = ragged_offs(E, M)
    kernel = moe_stream.grouped_mm_triton
    monkeypatch.setattr(moe_stream, "grouped_mm_triton", lambda *a, **k: kernel(*a, **k, config=(16, 16, 32, 4, 1)))
    monkeypatch.setattr(moe_paths, "use_triton", lambda t: True)
    from diffgemma.ops import gelu_mul as gm

    monkeypatch.setattr(gm, "use_triton", lambda t: True)  # gelu·up after: the kernel, as on CUDA
    fused = moe.expert_ffn(xs, gate_up, down, offs)
    after = moe.expert_ffn(xs, gate_up, down, offs, fuse_glu=False)
    assert torch.equal(fused, after)
    assert rel(fused, moe.grouped_mm_torch(gm.gelu_mul_ref(moe_stream.grouped_mm_ref(xs, gate_up, offs)), down, offs)) < 1e-5


def test_gate_up_with_gelu_refuses_an_odd_stack():
    with pytest.raises(TensorError, match="even N"):
        moe_stream.grouped_mm_triton(torch.randn(5, 8), torch.randn(2, 5, 8), torch.tensor([2, 5]), glu=True)
