"""The fused top-k attention (ops/attention_topk_fused.py) natively, at the full layers' shapes (head dim 512, 16 heads
over 2 KV heads, k up to 512): the radix select equals topk_mask on the same f32 scores, ties included; the whole
form equals the f32 twin within bf16 rounding on inputs whose scores are exact in any summation order (exact_qkv),
canvas (a graph bucket's unwritten NaN rows) and causal chunk; the same bits twice; a CUDA graph of it replays the
eager bits at another live length; the long causal tile table's rows stay within one bf16 ulp of the default tiles.
The dispatcher's CUDA form is the fused one.

Skips without CUDA.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.ops import attention_flash as fl  # noqa: E402
from diffgemma.ops import attention_topk as tk  # noqa: E402
from diffgemma.ops.attention_topk import TopKRule, attention_topk_fused, attention_topk_ref, topk_mask  # noqa: E402
from diffgemma.ops.attention_topk_fused import select_topk  # noqa: E402

DEV = "cuda"
H, KV, D = 16, 2, 512


def qkv(n, rows, d=D, kv=KV):
    s = d ** -0.25
    return ((torch.randn(H, n, d, device=DEV) * s).bfloat16(), (torch.randn(kv, rows, d, device=DEV) * s).half(),
            torch.randn(kv, rows, d, device=DEV).half())


def exact_qkv(n, rows, d=D, kv=KV):
    """q and k on a grid of eighths in [-1/4, 1/4]: every product a multiple of 1/64 and every partial sum too, of
    magnitude at most d/16 (11 significant bits), so the scores are exact in f32 whatever the summation order (the
    tensor cores' f16 products, the twin's f32 GEMM) and both forms select the same keys, ties included (many: the
    scores are coarse). On random normal inputs the two GEMMs' roundings differ in the last bits, which can swap the
    keys at a near-tie at a row's k-th score; one key swapped moves that row by about p·|v_a - v_b|, past the bf16
    tolerance where k is small."""
    grid = lambda *shape: torch.randint(-2, 3, shape, device=DEV).float() / 8  # noqa: E731
    return grid(H, n, d).bfloat16(), grid(kv, rows, d).half(), torch.randn(kv, rows, d, device=DEV).half()


@pytest.mark.parametrize("bits,cap", [(8, 4096), (11, 4096), (11, 0)])  # cap 0: every search over the row
def test_select_equals_topk_mask(bits, cap):
    sc = torch.randn(64, 70000, device=DEV)
    sc[::2] = (sc[::2] * 8).round() / 8  # many exact ties at every threshold
    sc[:, 65000:] = float("-inf")
    sc[5, 50:] = float("-inf")  # k (64 at least) covers the row
    rule = TopKRule()
    idx, cnt, big = select_topk(sc, rule, select_config=dict(BITS=bits, CAP=cap))
    want = topk_mask(sc, sc > float("-inf"), rule)
    got = torch.zeros_like(want)
    for r in range(sc.shape[0]):
        got[r, idx[r, : cnt[r]].long()] = True
    assert torch.equal(got, want)
    assert torch.equal(big, sc.amax(-1))


def test_select_of_a_short_canvas_row_equals_topk_mask():
    """The select at the short canvas' geometry (the [300] case below): 620 key rows, the last 64 past nlive and never
    read (NaN), a row block of 1024 under the 2048 bins of an 11-bit digit, k 64, the scratch as fused_topk_blocks
    bounds it (128)."""
    sc = torch.randn(512, 620, device=DEV)
    sc[::2] = (sc[::2] * 8).round() / 8  # exact ties
    sc[:, 556:] = float("nan")
    rule = TopKRule()
    idx, cnt, big = select_topk(sc, rule, 64, dict(CAP=128), nlive=torch.tensor(556, device=DEV))
    vis = torch.arange(620, device=DEV) < 556
    want = topk_mask(sc.masked_fill(~vis, float("-inf")), vis[None], rule)
    got = torch.zeros_like(want)
    for r in range(sc.shape[0]):
        got[r, idx[r, : cnt[r]].long()] = True
    assert torch.equal(got, want)
    assert torch.equal(big, sc[:, :556].amax(-1))


@pytest.mark.parametrize("keys", [300, 5000, 40000])
def test_fused_canvas_matches_twin_and_repeats(keys):
    n = 256
    q, k, v = exact_qkv(n, keys + n + 64)
    k[:, keys + n:] = v[:, keys + n:] = float("nan")  # a graph bucket's unwritten rows
    nlive = torch.tensor(keys + n, device=DEV)
    rule = TopKRule()
    got = attention_topk_fused(q, k, v, None, keys + n + 64, rule, nlive=nlive)
    exp = attention_topk_ref(q, k, v, None, keys + n + 64, rule, nlive=nlive, q_block=64)
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), exp.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got, attention_topk_fused(q, k, v, None, keys + n + 64, rule, nlive=nlive))
    assert torch.equal(got, attention_topk_fused(q, k, v, None, keys + n + 64, rule, nlive=nlive, tma=False))


@pytest.mark.parametrize("keys", [300, 5000])
def test_random_inputs_part_from_the_twin_only_at_near_ties(keys):
    """Random normal inputs (the canvas case above): a row off the twin by more than the bf16 tolerance must be one
    whose twin scores nearly tie at its k-th and k+1-th largest (within 1e-5 relative: the two GEMMs' rounding), where
    the forms may select different keys; a row off elsewhere is a wrong selection."""
    n = 256
    q, k, v = qkv(n, keys + n + 64)
    k[:, keys + n:] = v[:, keys + n:] = float("nan")
    live = keys + n
    rule = TopKRule()
    got = attention_topk_fused(q, k, v, None, live + 64, rule, nlive=torch.tensor(live, device=DEV)).float()
    exp = attention_topk_ref(q, k, v, None, live + 64, rule, nlive=torch.tensor(live, device=DEV), q_block=64).float()
    off = ((got - exp).abs() > 2e-2 + 2e-2 * exp.abs()).view(n, H, D).any(-1).T  # [H, n]
    sc = q.float() @ k[:, :live].float().repeat_interleave(H // KV, 0).transpose(1, 2)  # [H, n, live]
    kk = int(rule.keys(torch.tensor(live)))
    top = sc.topk(kk + 1, dim=-1).values
    gap = (top[..., kk - 1] - top[..., kk]) <= 1e-5 * top[..., kk - 1].abs().clamp_min(1.0)
    print(f"\n[topk random {keys}] rows off {int(off.sum())}, near ties {int(gap.sum())} of {H * n}")
    assert not (off & ~gap).any()


def test_fused_causal_chunk_matches_twin():
    P, n = 20000, 512
    q, k, v = exact_qkv(n, P + n)
    kpos, qpos = torch.arange(P + n, device=DEV), torch.arange(P, P + n, device=DEV)
    rule = TopKRule()
    got = attention_topk_fused(q, k, v, kpos, P + n, rule, qpos=qpos, causal=True, q_start=P)
    exp = attention_topk_ref(q, k, v, kpos, P + n, rule, qpos=qpos, causal=True, q_block=64)
    torch.testing.assert_close(got.float(), exp.float(), atol=2e-2, rtol=2e-2)


def test_fused_graph_replays_eager_bits():
    """One capture over a key-row bucket; nlive (a device scalar) moves between replays."""
    rows, n = 9000, 256
    q, k, v = qkv(n, rows)
    nlive = torch.tensor(6000, device=DEV)
    rule = TopKRule()
    attention_topk_fused(q, k, v, None, rows, rule, nlive=nlive)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attention_topk_fused(q, k, v, None, rows, rule, nlive=nlive)
    for live in (6000, 8500, 300):
        nlive.fill_(live)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attention_topk_fused(q, k, v, None, rows, rule, nlive=nlive)), live


def test_dispatcher_takes_the_fused_form(monkeypatch):
    q, k, v = qkv(64, 3000)
    rule = TopKRule()
    monkeypatch.setattr(tk, "FORM", "fused")
    got = tk.attention_topk(q, k, v, None, 3000, rule)
    assert torch.equal(got, attention_topk_fused(q, k, v, None, 3000, rule))
    assert not tk._fused_failed


def test_long_causal_tile_rows_within_one_ulp_of_default():
    P, n = 32768 - 2048, 2048
    q, k, v = qkv(n, P + n)
    kpos, qpos = torch.arange(P + n, device=DEV), torch.arange(P, P + n, device=DEV)
    kw = dict(qpos=qpos, window=fl.NO_WINDOW, causal=True)
    base = fl.attention_flash(q, k, v, kpos, P + n, BM=64, BN=32, BD=512, num_warps=8, num_stages=2, **kw)
    for _, _, tiles in fl.LONG_CAUSAL_TILES:
        got = fl.attention_flash(q, k, v, kpos, P + n, **tiles, **kw).float()
        m = torch.maximum(got.abs(), base.float().abs()).clamp_min(2.0 ** -126)
        ulp = torch.exp2(torch.floor(torch.log2(m)) - 7)
        assert ((got - base.float()).abs() <= ulp).all(), tiles
