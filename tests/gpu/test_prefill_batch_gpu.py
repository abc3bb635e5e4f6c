"""GPU checks for the batched commit (Engine.prefill_batch: the commits of lanes that end a block in one round as one
padded prefill forward; skips without CUDA).

- On a random mid engine, under each batch_paths rule, with the batched prefill graphs off and on: every cache's
  length and ring positions are its solo commit's, its K/V and next denoise within bf16 rounding of it; the share of
  lanes bit-identical to their solo (graphed) commit is printed (-s): the measurement, as tests/gpu/test_batch_gpu.py
  does for the batched denoise.
- On the demo model's CUDA engine: every cache gets its solo commit's bits, whether the batched commit ran eagerly, was
  captured or replayed its graph over other caches; and through the engine core a batch whose blocks end in the same
  round commits them in one forward with each request's solo tokens.
"""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from dataclasses import replace  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma import generate, generate_batch  # noqa: E402
from diffgemma.model import engine_batch  # noqa: E402

from tiny_checkpoints import cache_state as state, mid_engine  # noqa: E402

DEV = "cuda"
CANVAS = 64


@pytest.fixture(scope="module")
def engine():
    return mid_engine(DEV, random.getrandbits(31), CANVAS)


def caches(engine, contexts, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in contexts:
        cache = engine.new_cache(2048)
        engine.prefill(cache, torch.randint(0, engine.config.vocab_size, (n,), generator=g).to(DEV))
        out.append(cache)
    return out


class Runs:
    """Counts the lanes of each batched padded prefill (engine_batch.prefill_padded_batch) inside the `with`."""

    def __enter__(self):
        self.runs, self.inner = [], engine_batch.prefill_padded_batch
        engine_batch.prefill_padded_batch = lambda fwd, cs, *a: (self.runs.append(len(cs)), self.inner(fwd, cs, *a))[1]
        return self.runs

    def __exit__(self, *exc):
        engine_batch.prefill_padded_batch = self.inner
        return False


def solo_and_batched(engine, lens, contexts, seed=1):
    """Solo commits and one batched commit of the same blocks over twin caches -> (solo caches, batched caches, how
    the batched commit ran: "eager", "captured" or "replayed")."""
    V = engine.config.vocab_size
    blocks = [torch.randint(0, V, (k,), device=DEV) for k in lens]
    solo, batched = caches(engine, contexts, seed), caches(engine, contexts, seed)
    for cache, ids in zip(solo, blocks):
        engine.commit(cache, ids)
    before = engine.batch_prefill_counts
    with Runs() as runs:
        engine.prefill_batch(batched, blocks)
    torch.cuda.synchronize()
    ran = [k for k, v in engine.batch_prefill_counts.items() if v != before[k]]
    if engine_batch.graph_rows(engine):  # one forward for all lanes (one padded length: the canvas), counted
        assert len(ran) == 1 and engine.batch_prefill_counts[ran[0]] == before[ran[0]] + 1, ran
        how = ran[0]
    else:  # graphs off: an eager forward, which the counts leave out
        assert ran == [], ran
        how = "eager"
    # eagerly, or its graph captured (two warm-up runs and the capture), or replayed
    assert runs == {"eager": [len(lens)], "captured": [len(lens)] * 3, "replayed": []}[how], (how, runs)
    return solo, batched, how


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("paths", ["lane", "wide"])
@pytest.mark.parametrize("lens", [(CANVAS,) * 4, (CANVAS, 17, 1, 40, CANVAS, 3, 9, 64)])
def test_batched_commit_near_each_solo_commit(engine, paths, lens, graphs):
    old = engine.options
    engine.options = replace(old, batch_paths=paths, batch_prefill_graphs=graphs)
    try:
        contexts = [random.choice([30, 300, 700, 1500]) for _ in lens]  # 300+: the ring has wrapped
        solo, batched, _ = solo_and_batched(engine, lens, contexts)
        canvas = torch.randint(0, engine.config.vocab_size, (CANVAS,), device=DEV)
        identical = 0
        for k, (a, b) in enumerate(zip(solo, batched)):
            la, ta, sa, kva = state(a)
            lb, tb, sb, kvb = state(b)
            assert (la, ta) == (lb, tb) and torch.equal(sa, sb), k
            for x, y in zip(kva, kvb):
                err = (x.float() - y.float()).abs().max().item()
                assert err <= 0.05 * max(1.0, x.float().abs().max().item()), (k, err)
            la_, lb_ = engine.denoise(a, canvas).clone(), engine.denoise(b, canvas).clone()
            assert (la_ - lb_).abs().max().item() <= 0.5, k  # softcapped logits (cap 30) after bf16-rounded K/V
            identical += all(torch.equal(x, y) for x, y in zip(kva, kvb))
        print(f"\n[{paths}, graphs {graphs}] {len(lens)} lanes' caches bit-identical to their solo commit: "
              f"{identical}/{len(lens)}")
    finally:
        engine.options = old


def test_demo_batched_commit_is_each_solo_commit_bit_for_bit():
    """Eagerly, then captured, then replayed over other caches (each handed one of the graph's stores first, with its
    contents): every cache gets its solo commit's bits."""
    eng = diffgemma.load(None, device="cuda")
    eng.options = replace(eng.options, batch_prefill_graphs=True)
    lens = (eng.config.canvas_length, 17, 1, 40)
    ways = []
    for seed in (1, 2, 3):
        solo, batched, how = solo_and_batched(eng, lens, [30, 300, 700, 90], seed)
        ways.append(how)
        for k, (a, b) in enumerate(zip(solo, batched)):
            la, ta, sa, kva = state(a)
            lb, tb, sb, kvb = state(b)
            assert (la, ta) == (lb, tb) and torch.equal(sa, sb), (how, k)
            assert all(torch.equal(x, y) for x, y in zip(kva, kvb)), (how, k, lens[k])
    assert ways == ["eager", "captured", "replayed"] and eng.graph_error is None


def test_demo_rounds_commits_run_as_one_forward_and_keep_each_requests_tokens():
    eng = diffgemma.load(None, device="cuda")
    tok = eng.tokenizer
    prompts = [tok.encode(p) for p in ("Name a colour.", "What is 2+2?", "Say hi.", "Count to five.")]
    # three whole blocks each, no stop id: every lane commits its first two blocks (a one-shot generate skips the
    # last), in the same rounds
    kw = dict(max_new_tokens=3 * eng.config.canvas_length, max_denoising_steps=8, stability_threshold=0,
              entropy_stop=0.0, plateau_steps=0, confidence_trim=0.0, empty_reply_retry=0, stop_ids=[])
    with Runs() as runs:
        batched = generate_batch(eng, prompts, seeds=[5, 6, 7, 8], max_batch=4, **kw)
    assert runs and max(runs) >= 2, runs
    solo = [generate(eng, p, seed=s, **kw) for p, s in zip(prompts, [5, 6, 7, 8])]
    assert [b.tokens for b in batched] == [s.tokens for s in solo]
