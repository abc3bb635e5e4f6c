"""The tile-softmax canvas attention (ops/attention_tiles.py): its three kernels through TRITON_INTERPRET=1
against the torch twin, and both against the f32 reference. Tiny shapes with the real layouts (GQA folded rows,
a graph's padded bucket: nlive < key rows, a short last tile). Fresh random data every run."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from attention_cases import qkv, ring_case  # noqa: E402
from diffgemma.ops import attention as attn  # noqa: E402
from diffgemma.ops import attention_tiles as at  # noqa: E402

SMALL = dict(qk_config=dict(BM=16, BK=16, num_warps=4, num_stages=1),
             pv_config=dict(BM=16, BN=16, num_warps=4, num_stages=1), tile=16)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("key_rows,live,C", [(96, 41, 8), (80, 80, 8), (50, 50, 8), (72, 9, 8), (40, 1, 8), (60, 33, 7)])
def test_tiles_kernels_match_the_twin_and_the_reference(key_rows, live, C, tma):
    """Rows [live, key_rows) are the bucket's padding: K rows there would dominate if they were weighted, and
    V rows there hold NaN (never read). Tiles past live count for nothing; the last tile may be short. C = 7: the
    last row block of a KV head is short (its TMA loads reach into the next head's rows, masked on store)."""
    H, KV, d = 8, 2, 32
    q, k, v = qkv(H, KV, C, key_rows + 3, d)
    k[:, live:] *= 50
    v[:, live:] = float("nan")
    nlive = torch.tensor(live)
    got = at.attention_tiles(q, k, v, key_rows, nlive=nlive, out_dtype=torch.bfloat16, kernels=True, tma=tma,
                             **SMALL)
    twin = at.attention_tiles(q, k, v, key_rows, nlive=nlive, out_dtype=torch.float32, kernels=False, tile=16)
    kpos = torch.where(torch.arange(key_rows) < live, 0, -1)
    v_clean = v.nan_to_num(0.0)
    exp = attn.attention_ref(q, k, v_clean, kpos, key_rows, out_dtype=torch.float32)
    assert got.shape == (C, H * d) and got.dtype == torch.bfloat16
    assert torch.isfinite(twin).all()
    torch.testing.assert_close(got.float(), twin, atol=8e-3, rtol=8e-3)  # bf16 output rounding
    got32 = at.attention_tiles(q, k, v, key_rows, nlive=nlive, out_dtype=torch.float32, kernels=True, tma=tma, **SMALL)
    # the same roundings, but an exp2 a last bit apart may move a P element by an f16 ulp (2^-11, twice rounded):
    # every output within 2^-10·max|v| of the twin, and on average within 2^-17·max|v| (a systematic error, such as
    # P rounded to bf16, lands near 2^-9). Observed over 100 seeds a case: mean ≤ 8.5e-7·max|v| ≈ 2^-20.
    diff = (got32 - twin).abs()
    vmax = v[:, :live].abs().max().float()
    assert diff.max() <= 2 ** -10 * vmax
    assert diff.mean() <= 2 ** -17 * vmax
    torch.testing.assert_close(twin, exp, atol=3e-3, rtol=3e-3)  # f16 P (twice rounded) against f32


@pytest.mark.parametrize("tma", [False, True])
def test_tiles_with_key_positions(tma):
    """A kpos mask (the sliding layers' ring form)."""
    q, k, v, kpos, n_keys = ring_case()
    got = at.attention_tiles(q, k, v, n_keys, kpos=kpos, out_dtype=torch.float32, kernels=True, tma=tma, **SMALL)
    exp = attn.attention_ref(q, k, v, kpos, n_keys, out_dtype=torch.float32)
    torch.testing.assert_close(got, exp, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("kernels", [False, True])
def test_tiles_weigh_each_tile_by_its_own_max(kernels):
    """Scores far apart from tile to tile: one tile ~40 units above the rest, one ~150 below (its weight underflows
    f32 and f16): the tile weights must carry the differences."""
    H, KV, C, d, n_keys = 4, 1, 4, 16, 80
    q = torch.randn(H, C, d)
    u = q.mean((0, 1)) / q.mean((0, 1)).norm()
    k = torch.randn(KV, n_keys, d) * 0.3
    k[:, 16:32] += u * 40 / (q @ u).mean()
    k[:, 48:64] -= u * 150 / (q @ u).mean()
    q, k, v = q.half(), k.half(), torch.randn(KV, n_keys, d).half()
    exp = attn.attention_ref(q, k, v, torch.zeros(n_keys, dtype=torch.long), n_keys, out_dtype=torch.float32)
    got = at.attention_tiles(q, k, v, n_keys, out_dtype=torch.float32, kernels=kernels, **SMALL)
    torch.testing.assert_close(got, exp, atol=3e-3, rtol=3e-3)


def test_dispatcher_calls_the_tiles_with_the_kernels_convention():
    """attention(impl='tiles') on CUDA calls _KERNELS['tiles'] with the flash kernel's keywords; here the same call
    on the CPU (through the twin), against the reference."""
    H, KV, C, d, key_rows, live = 8, 2, 8, 32, 60, 37
    q, k, v = qkv(H, KV, C, key_rows, d)
    nlive = torch.tensor(live)
    got = attn._KERNELS["tiles"](q, k, v, None, key_rows, n_ring=0, base_pos=0, nlive=nlive, qpos=None,
                                 window=attn.NO_WINDOW, causal=False, out_dtype=torch.float32)
    kpos = torch.where(torch.arange(key_rows) < live, 0, -1)
    exp = attn.attention_ref(q, k, v, kpos, key_rows, out_dtype=torch.float32)
    torch.testing.assert_close(got, exp, atol=3e-3, rtol=3e-3)
    # on the CPU the dispatcher sends impl='tiles' to the reference twin
    torch.testing.assert_close(attn.attention(q, k, v, None, key_rows, out_dtype=torch.float32, impl="tiles",
                                              nlive=nlive), exp, atol=1e-5, rtol=1e-5)


def test_tiles_refuses_bad_shapes():
    q, k, v = qkv(6, 4, 8, 40, 32)
    with pytest.raises(ValueError, match="H a multiple of KV"):
        at.attention_tiles(q, k, v, 40, kernels=False)
    q, k, v = qkv(8, 2, 8, 40, 32)
    with pytest.raises(ValueError, match="rows >= n_keys"):
        at.attention_tiles(q, k, v, 41, kernels=False)
    with pytest.raises(ValueError, match="expected q"):
        at.attention_tiles(q[0], k, v, 40, kernels=False)
    q, k, v = qkv(8, 2, 8, 40, 24)
    with pytest.raises(ValueError, match="head dim 24"):
        at.attention_tiles(q, k, v, 40, kernels=True, **SMALL)


def test_a_failing_canvas_kernel_falls_back_in_order(monkeypatch):
    """A kernel that cannot compile here (e.g. too little shared memory for the H200's tile configs) is noted once,
    with a warning, and the next of tiles -> gemm -> flash runs, then and on every later call."""
    calls = []

    def failing(name):
        def fn(*a, **kw):
            calls.append(name)
            raise RuntimeError(f"{name}: out of resource: shared memory")
        return fn

    def working(name):
        def fn(q, k, v, kpos, n_keys, **kw):
            calls.append(name)
            return torch.full((q.shape[1], q.shape[0] * q.shape[2]), float(len(name)))
        return fn

    monkeypatch.setattr(attn, "_triton_failed", {})
    monkeypatch.setattr(attn, "_canvas_only_ok", lambda q, causal, impl: not causal or impl == "tiles")
    monkeypatch.setattr(attn, "_KERNELS", {"tiles": failing("tiles"), "gemm": failing("gemm"),
                                           "triton": working("triton")})
    q, k, v = qkv(4, 2, 8, 40, 32)
    with pytest.warns(UserWarning, match="kernel 'tiles' unavailable.*using 'gemm'"):
        with pytest.warns(UserWarning, match="kernel 'gemm' unavailable.*using 'triton'"):
            out = attn.attention(q, k, v, None, 40, impl="tiles", nlive=torch.tensor(30))
    assert calls == ["tiles", "gemm", "triton"] and out.shape == (8, 128) and (out == len("triton")).all()
    calls.clear()
    attn.attention(q, k, v, None, 40, impl="tiles", nlive=torch.tensor(30))
    assert calls == ["triton"]  # the failures are remembered: no second attempt, no second warning
    assert set(attn._triton_failed) == {(32, False, "tiles"), (32, False, "gemm")}
    calls.clear()  # a causal call whose tiles fail goes to the flash kernel: the GEMM form is bidirectional only
    with pytest.warns(UserWarning, match="kernel 'tiles' unavailable.*causal=True"):
        attn.attention(q, k, v, torch.arange(40), 40, qpos=torch.arange(32, 40), causal=True, impl="tiles")
    assert calls == ["tiles", "triton"]


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("cached,n,pad,bucket,window", [(40, 8, 8, 64, 1 << 30), (21, 7, 8, 48, 1 << 30),
                                                         (0, 9, 12, 16, 1 << 30), (64, 16, 16, 96, 1 << 30),
                                                         (40, 8, 8, 64, 20), (64, 16, 16, 96, 5)])
def test_causal_tiles_match_the_twin_and_the_reference(cached, n, pad, bucket, window, tma):
    """A short prefill on full layers: `cached` rows, then a chunk of n real rows padded to `pad` (pad rows after
    the real ones, kpos = row = position), keys read over a padded bucket of key rows whose rows past the chunk
    hold large K and NaN V, and some keys are empty ring slots (kpos -1). With a window, a sliding layer's mask. The
    real rows equal the f32 causal reference; the kernels equal their twin."""
    H, KV, d = 8, 2, 32
    rows = bucket + pad
    q, k, v = qkv(H, KV, pad, rows, d)
    end = cached + pad
    k[:, end:] *= 50
    v[:, end:] = float("nan")
    kpos = torch.arange(rows)
    if cached > 3:
        kpos[torch.randperm(cached)[:3]] = -1  # empty slots among the cached keys
    qpos = cached + torch.arange(pad)
    nlive = torch.tensor(end)
    kw = dict(kpos=kpos, nlive=nlive, qpos=qpos, window=window, out_dtype=torch.float32)
    got = at.attention_tiles(q, k, v, rows, kernels=True, tma=tma, **kw, **SMALL)
    twin = at.attention_tiles(q, k, v, rows, kernels=False, tile=16, **kw)
    exp = attn.attention_ref(q, k, v.nan_to_num(0.0), torch.where(kpos < end, kpos, -1), rows, qpos=qpos,
                             window=window, causal=True, out_dtype=torch.float32)
    assert torch.isfinite(got).all() and torch.isfinite(twin).all()
    vmax = v[:, :end].abs().max().float()
    assert (got - twin).abs().max() <= 2 ** -10 * vmax
    torch.testing.assert_close(twin[:n], exp[:n], atol=3e-3, rtol=3e-3)
    # the mask is per query: a bidirectional call over the same keys differs (the last row sees every key anyway)
    full = at.attention_tiles(q, k, v, rows, kpos=kpos, nlive=nlive, out_dtype=torch.float32, kernels=False, tile=16)
    assert (full[: pad - 1] - twin[: pad - 1]).abs().max() > 1e-3


def test_causal_tiles_refuse_a_query_position_without_key_positions():
    q, k, v = qkv(8, 2, 4, 16, 32)
    with pytest.raises(ValueError, match="qpos"):
        at.attention_tiles(q, k, v, 16, qpos=torch.arange(4), kernels=False)
    with pytest.raises(ValueError, match="qpos"):
        at.attention_tiles(q, k, v, 16, kpos=torch.arange(16), qpos=torch.arange(5), kernels=False)


@pytest.mark.parametrize("kernels", [True, False])
def test_a_row_without_a_visible_key_gets_zeros(kernels):
    """A query whose keys are all masked (here the first three, whose own and earlier keys are empty slots) gets 0,
    never NaN, which would reach the router and its expert indices; the other rows are untouched."""
    q, k, v = qkv(8, 2, 6, 40, 32)
    kpos, qpos = torch.arange(40), torch.arange(6)
    kpos[:3] = -1
    kw = dict(kpos=kpos, qpos=qpos, out_dtype=torch.float32, kernels=kernels, **(SMALL if kernels else {"tile": 16}))
    got = at.attention_tiles(q, k, v, 40, nlive=torch.tensor(40), **kw)
    assert torch.isfinite(got).all()
    assert (got[:3] == 0).all() and (got[3:].abs().amax(-1) > 0).all()
    exp = attn.attention_ref(q[:, 3:].contiguous(), k, v, kpos, 40, qpos=qpos[3:], causal=True,
                             out_dtype=torch.float32)
    torch.testing.assert_close(got[3:], exp, atol=3e-3, rtol=3e-3)
