"""The fused top-k attention kernels (ops/attention_topk_fused.py) under TRITON_INTERPRET=1 at tiny shapes: the radix
select equals topk_mask's selection exactly (ties by key index included), the whole form equals the twin
(attention_topk_ref) and dense attention where k covers every key, and a second run gives the same bits."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from diffgemma.ops._backend import interpreting  # noqa: E402
from diffgemma.ops.attention import attention_ref  # noqa: E402
from diffgemma.ops.attention_topk import TopKRule, attention_topk_fused, attention_topk_ref, topk_mask  # noqa: E402
from diffgemma.ops.attention_topk_fused import select_topk  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="the CPU runs these kernels only under TRITON_INTERPRET=1")

SMALL = dict(scores_config=dict(BM=16, BN=16, BK=16, num_warps=1, num_stages=1),
             select_config=dict(BLOCK=32, num_warps=1), pv_config=dict(BK=4, BD=16, num_warps=1))


def _qkv(H=4, KV=2, n=5, nk=40, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, n, d, generator=g).to(dtype), torch.randn(KV, nk, d, generator=g).to(dtype),
            torch.randn(KV, nk, d, generator=g).to(dtype))


def _selected(idx, cnt):
    return [sorted(idx[r, : cnt[r]].tolist()) for r in range(idx.shape[0])]


# 4 digits of 8 bits; 3 of 11 (a narrower last); a scratch too small for any bucket: the search over the row
@pytest.mark.parametrize("bits,cap", [(8, 4096), (11, 4096), (11, 1)])
def test_select_equals_topk_mask_with_ties(bits, cap):
    g = torch.Generator().manual_seed(2)
    sc = torch.randn(8, 75, generator=g)
    sc[:, 60:] = float("-inf")  # invisible
    sc[0, 5:20] = 1.25  # ties straddling the threshold
    sc[1] = sc[1].round()  # many equal scores
    sc[2, :] = float("-inf")
    sc[2, :3] = torch.tensor([0.0, -0.0, -3.5])  # fewer visible keys than k: all of them
    sc[3] = -sc[3].abs()  # negative scores only
    sc[4, 10:] = float("-inf")
    sc[5, :8] = torch.tensor([1.0, -0.0, 2.0, 0.0, -0.0, -1.0, 0.0, 3.0])  # the threshold at zero: -0 ties with +0
    sc[5, 8:30], sc[5, 30:] = -2.0, float("-inf")  # 30 visible: k = 5, two of the four zeros
    rule = TopKRule(divisor=6, min_keys=3, max_keys=9)
    idx, cnt, big = select_topk(sc, rule, select_config=dict(BLOCK=16, BITS=bits, CAP=cap))
    want = topk_mask(sc, sc > float("-inf"), rule)
    assert _selected(idx, cnt) == [want[r].nonzero().flatten().tolist() for r in range(8)]
    assert torch.equal(big, sc.amax(-1))


@pytest.mark.parametrize("case", ["canvas", "canvas_nlive", "canvas_kpos", "causal", "causal_q_start"])
def test_fused_equals_twin(case):
    q, k, v = _qkv(seed=3)
    nk, n = k.shape[1], q.shape[1]
    rule = TopKRule(divisor=8, min_keys=3, max_keys=6)
    kpos, kw, extra = None, {}, {}
    if case == "canvas_nlive":
        kw = dict(nlive=torch.tensor(29))
    elif case == "canvas_kpos":
        kpos = torch.arange(nk)
        kpos[[3, 17, 33]] = -1
    elif case.startswith("causal"):
        kpos = torch.arange(nk)
        kw = dict(qpos=torch.arange(nk - n, nk), causal=True)
        if case == "causal_q_start":
            extra = dict(q_start=nk - n, block_rows=2)
    want = attention_topk_ref(q, k, v, kpos, nk, rule, **kw)
    got = attention_topk_fused(q, k, v, kpos, nk, rule, **kw, **extra, **SMALL)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    again = attention_topk_fused(q, k, v, kpos, nk, rule, **kw, **extra, **SMALL)
    assert torch.equal(got, again)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_is_dense_when_k_covers_every_key(causal):
    q, k, v = _qkv(seed=4)
    nk, n = k.shape[1], q.shape[1]
    kpos = torch.arange(nk)
    qpos = torch.arange(nk - n, nk) if causal else None
    rule = TopKRule(divisor=1, min_keys=nk, max_keys=nk)
    got = attention_topk_fused(q, k, v, kpos, nk, rule, qpos=qpos, causal=causal, **SMALL)
    want = attention_ref(q, k, v, kpos, nk, qpos=qpos, causal=causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_half_precision_and_unwritten_rows():
    """bf16 queries, f16 keys and values (f32 scores), bf16 out: within bf16 rounding of the f32 twin on the same
    rounded inputs; rows past nlive hold NaN and are never read."""
    q, k, v = _qkv(n=4, nk=40, d=32, seed=5)
    q, k, v = q.bfloat16(), k.half(), v.half()
    k[:, 30:], v[:, 30:] = float("nan"), float("nan")
    rule = TopKRule(divisor=4, min_keys=4, max_keys=10)
    nl = torch.tensor(30)
    want = attention_topk_ref(q.float(), k.float(), v.float(), None, 40, rule, nlive=nl)
    for tma in (False, True):  # the score tiles read through pointers, or through tensor descriptors
        got = attention_topk_fused(q, k, v, None, 40, rule, nlive=nl, tma=tma, **SMALL)
        assert got.dtype == torch.bfloat16 and got.isfinite().all()
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    kpos, qpos = torch.arange(30), torch.arange(26, 30)  # causal, key row = position, the NaN rows past the last
    want = attention_topk_ref(q.float(), k.float(), v.float(), kpos, 30, rule, qpos=qpos, causal=True)
    for tma in (False, True):
        got = attention_topk_fused(q, k, v, kpos, 30, rule, qpos=qpos, causal=True, q_start=26, tma=tma, **SMALL)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_engine_with_the_fused_form_matches_the_twin(monkeypatch):
    """The fast engine's full layers call the fused form with their own layouts (head-major q, the cache's K/V
    buffers, a prefill chunk's q_start, the canvas' nlive): the logits match the engine on the twin."""
    pytest.importorskip("transformers")
    import tempfile

    import diffgemma
    import diffgemma.model.forward as fwd
    from diffgemma.model.engine import Engine
    from tiny_checkpoints import CONFIGS, build_model, save

    hf = build_model(CONFIGS["gqa2_mixed"], canvas_length=8)
    with tempfile.TemporaryDirectory() as tmp:
        ref = diffgemma.load(save(hf, tmp))
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32, prefill_chunk=7)
    rule = TopKRule(divisor=4, min_keys=2, max_keys=6)
    g = torch.Generator().manual_seed(0)
    V, C = ref.config.vocab_size, ref.config.canvas_length
    prompt, canvas = torch.randint(0, V, (20,), generator=g), torch.randint(0, V, (C,), generator=g)
    calls = []

    def fused(*a, **kw):
        calls.append(kw.get("causal", False))
        return attention_topk_fused(*a, **kw, **SMALL)

    def logits():
        cache = eng.new_cache(64)
        cache.attention_topk = rule
        eng.prefill(cache, prompt)
        return eng.denoise(cache, canvas).float()

    want = logits()
    monkeypatch.setattr(fwd, "attention_topk", fused)
    got = logits()
    assert True in calls and False in calls  # prefill (causal) and denoise (canvas) both ran the fused form
    assert (got - want).abs().max().item() <= 1e-3


def test_short_canvas_in_a_bucket_with_the_default_select():
    """A short canvas in a graph bucket: the rows past nlive unwritten (NaN) and counted in n_keys, k the rule's
    minimum (the live keys // divisor fall below it), the select at its default digits with a row block shorter than
    its 2^BITS bins and the scratch bounded as fused_topk_blocks bounds it; half-precision inputs on a grid whose
    scores are exact, so the selection is the twin's, ties included."""
    g = torch.Generator().manual_seed(7)
    grid = lambda *shape: (torch.randint(-2, 3, shape, generator=g).float() / 8)  # noqa: E731
    live, pad = 140, 36
    q, k = grid(4, 6, 32).bfloat16(), grid(2, live + pad, 32).half()
    v = torch.randn(2, live + pad, 32, generator=g).half()
    k[:, live:], v[:, live:] = float("nan"), float("nan")
    rule = TopKRule(divisor=32, min_keys=8, max_keys=16)  # 140 // 32 = 4 live keys a row: k = 8
    nl = torch.tensor(live)
    want = attention_topk_ref(q.float(), k.float(), v.float(), None, live + pad, rule, nlive=nl)
    got = attention_topk_fused(q, k, v, None, live + pad, rule, nlive=nl, scores_config=SMALL["scores_config"],
                               pv_config=SMALL["pv_config"])
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
