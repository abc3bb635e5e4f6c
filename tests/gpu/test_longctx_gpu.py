"""Long-context attention natively (issue 53): the top-k gather form against its f32 twin at the full layers' shapes,
the flash kernel's unmasked interior blocks against the masked scan (the same bits), and the demo model's CUDA engine
with a top-k cache against the CPU reference with the same rule, graphed and eager.

Skips without CUDA.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma  # noqa: E402
from diffgemma.ops import attention_flash as fl  # noqa: E402
from diffgemma.ops.attention_topk import TopKRule, attention_topk_gather, attention_topk_ref  # noqa: E402

DEV = "cuda"
H, KV, D = 16, 2, 512


def qkv(n, rows, d=D, kv=KV):
    s = d ** -0.25
    return ((torch.randn(H, n, d, device=DEV) * s).bfloat16(), (torch.randn(kv, rows, d, device=DEV) * s).half(),
            torch.randn(kv, rows, d, device=DEV).half())


@pytest.mark.parametrize("keys", [300, 5000, 40000])
def test_topk_gather_canvas_matches_twin(keys):
    n = 256
    q, k, v = qkv(n, keys + n + 64)
    k[:, keys + n:] = v[:, keys + n:] = float("nan")  # a graph bucket's unwritten rows
    nlive = torch.tensor(keys + n, device=DEV)
    rule = TopKRule()
    got = attention_topk_gather(q, k, v, None, keys + n + 64, rule, nlive=nlive)
    exp = attention_topk_ref(q, k, v, None, keys + n + 64, rule, nlive=nlive, q_block=64)
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), exp.float(), atol=2e-2, rtol=2e-2)


def test_topk_gather_causal_chunk_matches_twin():
    P, n = 20000, 512
    q, k, v = qkv(n, P + n)
    kpos, qpos = torch.arange(P + n, device=DEV), torch.arange(P, P + n, device=DEV)
    rule = TopKRule()
    got = attention_topk_gather(q, k, v, kpos, P + n, rule, qpos=qpos, causal=True, q_start=P)
    exp = attention_topk_ref(q, k, v, kpos, P + n, rule, qpos=qpos, causal=True, q_block=64)
    torch.testing.assert_close(got.float(), exp.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("d,kv,window", [(512, 2, fl.NO_WINDOW), (256, 8, 1024)])
def test_flash_interior_blocks_keep_the_bits(d, kv, window):
    P, n = 12288, 2048
    q, k, v = qkv(n, P + n, d, kv)
    kpos, qpos = torch.arange(P + n, device=DEV), torch.arange(P, P + n, device=DEV)
    kw = dict(qpos=qpos, window=window, causal=True)
    on = fl.attention_flash(q, k, v, kpos, P + n, **kw)
    off = fl.attention_flash(q, k, v, kpos, P + n, interior=False, **kw)
    assert torch.equal(on, off)


def test_demo_engine_topk_matches_reference():
    """The demo model: prefill and a denoise with a top-k cache, CUDA engine (graphed, then eager) against the CPU
    reference with the same rule; and the rule moves the logits (it bites)."""
    ref, eng = diffgemma.load(None, device="cpu"), diffgemma.load(None, device="cuda")
    rule = TopKRule(divisor=8, min_keys=16, max_keys=64)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ref.config.vocab_size, (700,), generator=g)
    canvas = torch.randint(0, ref.config.vocab_size, (ref.config.canvas_length,), generator=g)

    def logits(model, r, graphs=None):
        if graphs is not None:
            model.use_graphs = graphs
        cache = model.new_cache(1024)
        cache.attention_topk = r
        model.prefill(cache, prompt.to(model.device))
        return model.denoise(cache, canvas.to(model.device)).float().cpu()

    exp = logits(ref, rule)
    moved = (logits(ref, None) - exp).abs().mean().item()  # what the rule changes
    assert moved > 1e-3
    for graphs in (True, False):
        got = logits(eng, rule, graphs)
        assert (got.argmax(-1) == exp.argmax(-1)).float().mean() > 0.9
        assert (got - exp).abs().mean().item() < 0.5 * moved, graphs  # the engine is the sparse model, not dense
