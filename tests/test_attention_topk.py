"""Top-k sparse attention (ops/attention_topk.py): the selection rule, dense equality when k covers every key,
tie-breaking by key index, and the gather form against the f32 twin."""

import pytest
import torch

from diffgemma.errors import InputError
from diffgemma.ops.attention import attention_ref
from diffgemma.ops.attention_topk import TopKRule, attention_topk_gather, attention_topk_ref, topk_mask


def _qkv(H=4, KV=2, n=24, nk=96, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, n, d, generator=g).to(dtype)
    k = torch.randn(KV, nk, d, generator=g).to(dtype)
    v = torch.randn(KV, nk, d, generator=g).to(dtype)
    return q, k, v


def test_rule_keys_and_validation():
    r = TopKRule(128, 64, 512)
    assert r.keys(torch.tensor([10, 8192, 65536, 10 ** 6])).tolist() == [64, 64, 512, 512]
    assert r.keys(torch.tensor([16384])).item() == 128
    assert [r.candidates(n) for n in (10, 100, 8192, 20000, 131328)] == [10, 64, 64, 156, 512]
    for n in range(1, 2000, 7):  # bounds the k of every row with fewer visible keys, or covers them all
        m = torch.arange(1, n + 1)
        assert (torch.minimum(TopKRule(4, 3, 100).keys(m), m) <= TopKRule(4, 3, 100).candidates(n)).all()
    with pytest.raises(InputError, match="min_keys"):
        TopKRule(128, 600, 512)
    with pytest.raises(InputError, match="divisor"):
        TopKRule(0, 1, 2)


def test_from_settings():
    from diffgemma.settings import GenerationSettings
    assert TopKRule.from_settings(GenerationSettings()) is None
    s = GenerationSettings().replace(topk_attention=True, topk_divisor=4, topk_min=2, topk_max=8)
    assert TopKRule.from_settings(s) == TopKRule(4, 2, 8)


def test_mask_counts_and_is_the_largest():
    g = torch.Generator().manual_seed(1)
    sc = torch.randn(3, 7, 50, generator=g)
    vis = torch.rand(3, 7, 50, generator=g) > 0.2
    rule = TopKRule(divisor=5, min_keys=2, max_keys=6)
    m = topk_mask(sc, vis, rule)
    n_vis = vis.sum(-1)
    want = torch.minimum(rule.keys(n_vis), n_vis)
    assert torch.equal(m.sum(-1), want)
    assert not (m & ~vis).any()
    # every selected score >= every visible unselected score, row by row
    sel_min = sc.masked_fill(~m, float("inf")).amin(-1)
    rest_max = sc.masked_fill(~(vis & ~m), float("-inf")).amax(-1)
    assert (sel_min >= rest_max).all()


def test_ties_go_to_the_lower_key_index():
    sc = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.5]])
    vis = torch.ones_like(sc, dtype=torch.bool)
    m = topk_mask(sc, vis, TopKRule(divisor=1, min_keys=3, max_keys=3))
    assert m.tolist() == [[False, True, True, True, False, False]]


@pytest.mark.parametrize("causal", [False, True])
def test_dense_when_k_covers_every_key(causal):
    q, k, v = _qkv()
    nk = k.shape[1]
    kpos = torch.arange(nk)
    n = q.shape[1]
    qpos = torch.arange(nk - n, nk) if causal else None
    rule = TopKRule(divisor=1, min_keys=nk, max_keys=nk)
    got = attention_topk_ref(q, k, v, kpos, nk, rule, qpos=qpos, causal=causal)
    want = attention_ref(q, k, v, kpos, nk, qpos=qpos, causal=causal)
    assert torch.equal(got, want)
    fast = attention_topk_gather(q, k, v, kpos, nk, rule, qpos=qpos, causal=causal)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)


def test_sparse_differs_from_dense():
    q, k, v = _qkv()
    nk = k.shape[1]
    got = attention_topk_ref(q, k, v, None, nk, TopKRule(divisor=16, min_keys=4, max_keys=8))
    want = attention_ref(q, k, v, torch.zeros(nk, dtype=torch.long), nk)
    assert (got - want).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["causal", "canvas", "canvas_nlive"])
def test_gather_matches_twin(case):
    q, k, v = _qkv(n=20, nk=90, seed=3)
    nk = k.shape[1]
    rule = TopKRule(divisor=8, min_keys=3, max_keys=7)
    kw = {}
    kpos = None
    if case == "causal":
        kpos = torch.arange(nk)
        kw = dict(qpos=torch.arange(nk - 20, nk), causal=True)
    elif case == "canvas_nlive":
        kw = dict(nlive=torch.tensor(70))
    want = attention_topk_ref(q, k, v, kpos, nk, rule, **kw)
    got = attention_topk_gather(q, k, v, kpos, nk, rule, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if case == "causal":  # key rows = positions: blocks read keys up to their last query only
        got2 = attention_topk_gather(q, k, v, kpos, nk, rule, q_start=nk - 20, **kw)
        torch.testing.assert_close(got2, want, atol=1e-5, rtol=1e-5)


def test_gather_half_precision_close():
    q, k, v = _qkv(n=16, nk=80, d=32, seed=5)
    rule = TopKRule(divisor=8, min_keys=4, max_keys=10)
    want = attention_topk_ref(q, k, v, None, 80, rule)
    got = attention_topk_gather(q.half(), k.half(), v.half(), None, 80, rule)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_unwritten_rows_are_never_read():
    """Rows no query sees (past nlive, future keys of a causal call) may hold NaN: neither form reads their V."""
    q, k, v = _qkv(n=8, nk=40, seed=7)
    rule = TopKRule(divisor=2, min_keys=4, max_keys=64)  # more candidates than visible keys
    k[:, 30:], v[:, 30:] = float("nan"), float("nan")
    for fn in (attention_topk_ref, attention_topk_gather):
        assert fn(q, k, v, None, 40, rule, nlive=torch.tensor(30)).isfinite().all()
        got = fn(q, k, v, torch.arange(40), 40, rule, qpos=torch.arange(22, 30), causal=True)
        assert got.isfinite().all()


@pytest.mark.parametrize("causal", [False, True])
def test_two_stage_candidates_match(causal):
    """The candidates' top-k in chunks of keys, then over the chunks' winners: the same result."""
    q, k, v = _qkv(n=12, nk=96, seed=9)
    rule = TopKRule(divisor=8, min_keys=3, max_keys=7)
    kw = dict(kpos=torch.arange(96), qpos=torch.arange(84, 96), causal=True) if causal else dict(kpos=None)
    one = attention_topk_gather(q, k, v, n_keys=96, rule=rule, **kw)
    for chunk in (16, 20):  # 96 keys: whole chunks, and whole chunks plus a tail
        two = attention_topk_gather(q, k, v, n_keys=96, rule=rule, chunk=chunk, **kw)
        torch.testing.assert_close(two, one, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(two, attention_topk_ref(q, k, v, n_keys=96, rule=rule, **kw), atol=1e-5, rtol=1e-5)
