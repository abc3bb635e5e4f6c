"""GPU checks for the graphed commit prefill (Engine.prefill through Forward.prefill_padded; skips without CUDA).

- The graphed padded prefill computes the eager padded prefill's bits (the same kernels at the same shapes).
- Against the unpadded eager prefill (the twin): the same cache bits for a full block (the same GEMM shapes; the
  attention only sees more masked keys), bf16-close for a shorter one; the same next denoise logits.
- One graph per (padded length, context bucket) serves every commit in that bucket.
- Seeded generate gives the unpadded eager commit's tokens when every commit is a full block.
"""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.generation import generate  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

from tiny_checkpoints import cache_state, mid_engine  # noqa: E402

DEV = "cuda"
CANVAS = 64


@pytest.fixture(scope="module")
def engine():
    return mid_engine(DEV, random.getrandbits(31), CANVAS)


def commit(engine, cache, ids, padded, graphs=True):
    old = engine.options, engine.use_graphs
    engine.padded_prefill, engine.use_graphs = padded, graphs
    try:
        engine.prefill(cache, ids)
    finally:
        engine.options, engine.use_graphs = old
    torch.cuda.synchronize()


def prefilled(engine, prompt, max_tokens=2048):
    cache = engine.new_cache(max_tokens)
    commit(engine, cache, prompt, padded=False)
    return cache


@pytest.mark.parametrize("k", [CANVAS, 17, 1])
def test_graphed_commit_is_the_eager_commit(engine, k):
    V = engine.config.vocab_size
    prompt = torch.randint(0, V, (300,), device=DEV)  # past the sliding window: the ring has wrapped
    caches = {m: prefilled(engine, prompt) for m in ("graphed", "padded_eager", "unpadded")}
    for b in range(4):  # several commits in one context bucket: one graph replayed
        ids = torch.randint(0, V, (k,), device=DEV)
        commit(engine, caches["graphed"], ids, padded=True)
        commit(engine, caches["padded_eager"], ids, padded=True, graphs=False)
        commit(engine, caches["unpadded"], ids, padded=False)
        g, e, u = (cache_state(caches[m]) for m in ("graphed", "padded_eager", "unpadded"))
        assert g[:2] == e[:2] == u[:2] == (300 + (b + 1) * k,) * 2
        assert torch.equal(g[2], e[2]) and torch.equal(g[2], u[2]), "ring slot positions differ"
        for i, (x, y, z) in enumerate(zip(g[3], e[3], u[3])):
            assert torch.equal(x, y), f"block {b}: graphed and eager padded commit differ in live K/V {i}"
            if k == CANVAS:
                assert torch.equal(x, z), f"block {b}: a full block's commit differs from the unpadded one ({i})"
            else:
                err = (x.float() - z.float()).abs().max().item()
                assert err <= 0.05 * max(1.0, z.float().abs().max().item()), f"block {b}: K/V {i} off by {err:.3g}"
    keys = list(engine._prefill_graphs[caches["graphed"]])
    assert keys == [(CANVAS, keys[0][1], engine.forward._causal_impl(CANVAS))], keys
    canvas = torch.randint(0, V, (CANVAS,), device=DEV)
    lg, lu = (engine.denoise(caches[m], canvas).float().clone() for m in ("graphed", "unpadded"))
    if k == CANVAS:
        assert torch.equal(lg, lu)
    else:
        assert (lg - lu).abs().max().item() <= 0.5  # softcapped logits (cap 30) after bf16-rounded K/V


def test_seeded_generate_tokens_match_the_eager_commit(engine):
    V = engine.config.vocab_size
    s = GenerationSettings.resolve({}, env={}, overrides=dict(max_denoising_steps=8, max_new_tokens=4 * CANVAS,
                                                               confidence_trim=0.0, stop_ids=[],
                                                               seed=random.getrandbits(32)))
    prompt = torch.randint(0, V, (CANVAS,), device=DEV)  # a prompt of the pad's length: full blocks throughout
    runs = {}
    for padded in (False, True):
        old = engine.options
        engine.padded_prefill = padded
        try:
            cache = engine.new_cache(1024)
            r = generate(engine, prompt, settings=s, cache=cache)
            runs[padded] = (r.tokens, cache.fingerprint())
        finally:
            engine.options = old
    assert len(runs[True][0]) == 4 * CANVAS
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]  # the caches too, bit for bit


def test_every_short_prefill_attention_call_matches_the_reference(engine, monkeypatch):
    """Each causal attention call this model's prefills make (a prompt in a 256-row and a 44-row chunk, then 17- and
    64-token commits, unpadded and padded) run through both the flash kernel and the tile kernels, each against the
    f32 reference on the same inputs. The caches the two kernels leave are not compared: a rounding-level difference
    in one call can flip a token's expert choice, after which that token's K/V differ by O(1)."""
    import diffgemma.model.forward as forward_mod
    from diffgemma.ops import attention as attn
    from diffgemma.ops import attention_flash as fl
    from diffgemma.ops import attention_tiles as at

    orig, errors = attn.attention, []

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    def checked(q, k, v, kpos, n_keys, qpos=None, window=fl.NO_WINDOW, causal=False, out_dtype=None, impl=None,
                n_ring=0, base_pos=0, nlive=None, **kw):
        out = orig(q, k, v, kpos, n_keys, qpos=qpos, window=window, causal=causal, out_dtype=out_dtype, impl=impl,
                   n_ring=n_ring, base_pos=base_pos, nlive=nlive, **kw)
        if causal and kw.get("groups") is None:
            live = kpos[:n_keys] if nlive is None else torch.where(
                torch.arange(n_keys, device=q.device) < nlive, kpos[:n_keys], -1)
            ref = attn.attention_ref(q, k, v, live, n_keys, qpos=qpos, window=window, causal=True,
                                     out_dtype=torch.float32, q_block=64)
            flash = fl.attention_flash(q, k, v, kpos, n_keys, qpos=qpos, window=window, causal=True,
                                       out_dtype=out_dtype, n_ring=n_ring, base_pos=base_pos)
            tiles = at.attention_tiles(q, k, v, n_keys, kpos=kpos, qpos=qpos, window=window, nlive=nlive,
                                       out_dtype=out_dtype)
            errors.append((tuple(q.shape), n_keys, min(window, 10 ** 6), rel(flash, ref), rel(tiles, ref)))
        return out

    monkeypatch.setattr(forward_mod, "attention", checked)
    V = engine.config.vocab_size
    cache = prefilled(engine, torch.randint(0, V, (300,), device=DEV))
    for k in (17, CANVAS):
        for padded in (False, True):
            commit(engine, cache, torch.randint(0, V, (k,), device=DEV), padded=padded, graphs=False)
    for e in errors:
        print(f"q {e[0]} keys {e[1]} window {e[2]}: flash {e[3]:.1e}, tiles {e[4]:.1e}")
    assert errors and all(e[3] < 1e-2 for e in errors), "the flash kernel is off the reference"
    assert all(e[4] < 1e-2 for e in errors), "the tile kernels are off the reference"


def test_a_commit_writes_the_prefills_cache_without_a_host_wait(engine):
    """Engine.commit (a block's kept ids, on the device) is the graphed prefill without the host range check: the
    same cache bits, and no synchronizing call (torch's sync debug mode raises on one), where prefill's check reads
    the ids' range from the device."""
    V = engine.config.vocab_size
    prompt = torch.randint(0, V, (300,), device=DEV)
    a, b = prefilled(engine, prompt), prefilled(engine, prompt)
    ids = torch.randint(0, V, (CANVAS,), device=DEV)
    commit(engine, a, ids, padded=True)  # captures the bucket's graph on a
    engine.prefill(b, ids)  # and on b
    more = torch.randint(0, V, (CANVAS,), device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.commit(a, more)
        with pytest.raises(RuntimeError, match="synchroniz"):
            engine.prefill(b, more)  # the check this test proves commit skips
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.prefill(b, more)
    torch.cuda.synchronize()
    for x, y in zip(cache_state(a)[3], cache_state(b)[3]):
        assert torch.equal(x, y)
    assert cache_state(a)[:2] == cache_state(b)[:2]
