"""The step's status read as a yield point: several requests' reads with one host wait (docs/ARCHITECTURE.md,
'Batching').

- read_statuses gives each request the StepStatus its own read_status gives (random codes, entropies and survivor
  counts, with and without a sparse-SC plan, a speculative one's product started as the solo read starts it), in
  order; a request whose denoiser runs ahead, or is no Denoiser, reads through its own run().
- generate_batch: every round's forward is followed by ONE status wait for all its requests (not one per request),
  the solo read_status is never called, and the tokens are the solo ones, on the torch path and on the fused path
  where every step bets on (and starts) the dense SC product.
"""

import random
from types import SimpleNamespace

import pytest
import torch

import diffgemma
from diffgemma.core import engine as engine_mod
from diffgemma.core import lanes as lanes_mod
from diffgemma.core import steps as steps_mod
from diffgemma import generate, generate_batch
from diffgemma.core.steps import StatusAsk
from diffgemma.model import denoiser as denoiser_mod
from diffgemma.model.denoiser import Denoiser, StepStatus, read_statuses
from diffgemma.ops import rowstats, softcap, tempered_tables
from diffgemma.sampling import stats as stats_mod
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.sampling.stats import StepStats
from diffgemma.settings import GenerationSettings

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device, vocab=300, hidden=24):
    """What a Denoiser reads of its model: the embedding (its device) and the embedding scale."""
    return SimpleNamespace(embedding=torch.randn(vocab, hidden, device=device), config=SimpleNamespace(embed_scale=4.0))


def _lane(model, kind, device):
    """One request's step inputs -> a function making a fresh ask over them (a plan is consumed by its read)."""
    vocab = model.embedding.shape[0]
    rows = random.randint(3, 8)
    logits = torch.tanh(torch.randn(rows, vocab, device=device) * 3) * 30
    logits[random.randrange(rows):] *= 0.02  # flat rows: many survivors
    temp = random.uniform(0.4, 0.8)
    code = torch.tensor(random.randint(0, 4), device=device)
    mean_h = torch.tensor(random.uniform(0.0, 5.0), dtype=torch.float64, device=device)
    canvas = torch.randint(0, vocab, (rows,), device=device)
    ratio = random.choice([2.0, 10.0])
    den = Denoiser(model, object())

    def ask():
        plan = None
        if kind == "dense bet":  # speculative: the read starts its dense product
            plan = SparsePlan(StepStats(logits, temp, fused=True), ratio, dense_dtype=model.embedding.dtype)
            assert plan.speculative
        elif kind == "plan":
            plan = SparsePlan(StepStats(logits, temp, fused=False), ratio)
            assert not plan.speculative
        return StatusAsk(den, code, mean_h, plan, canvas)

    return ask


@pytest.mark.parametrize("device", DEVICES)
def test_read_statuses_equals_each_requests_own_read(device):
    model = _model(device)
    for _ in range(4):
        kinds = random.choices(["none", "plan", "dense bet"], k=random.randint(1, 6))
        lanes = [_lane(model, kind, device) for kind in kinds]
        lanes += [_lane(model, kind, device) for kind in ("none", "plan", "dense bet")]
        random.shuffle(lanes)
        solo_asks = [lane() for lane in lanes]
        want = [a.run() for a in solo_asks]
        asks = [lane() for lane in lanes]
        got = read_statuses(asks)
        assert got == want
        assert len({(s.code, s.mean_entropy, s.count) for s in got}) > 1  # a swap would show
        for a, s in zip(asks, got):
            assert s == StepStatus(int(a.code), float(a.mean_h), None if a.plan is None else int(a.plan.count))
        for a, b in zip(asks, solo_asks):  # a speculative plan's product was started, and is the solo read's
            if a.plan is not None and a.plan.speculative:
                assert a.plan.product is not None and torch.equal(a.plan.product, b.plan.product)
            if a.plan is not None:
                n = int(a.plan.count)
                assert torch.equal(a.plan.soft_embed(n, model.embedding, 4.0),
                                   b.plan.soft_embed(n, model.embedding, 4.0))


def test_read_statuses_waits_once_and_lets_a_running_ahead_request_read_alone(monkeypatch):
    model = _model("cpu")
    lanes = [_lane(model, kind, "cpu") for kind in ("plan", "none", "dense bet", "plan")]
    asks = [lane() for lane in lanes]
    want = [lane().run() for lane in lanes]
    ahead = Denoiser(model, object())
    ahead.run_ahead = True  # a request stepping alone on the engine: its read may stage the next forward
    foreign = SimpleNamespace(read_status=lambda code, mean_h, plan, canvas: StepStatus(7, 0.5))  # no Denoiser
    own = []
    monkeypatch.setattr(ahead, "read_status", lambda *a: (own.append(a), StepStatus(9, 1.5))[1])
    asks.insert(1, StatusAsk(ahead, torch.tensor(0), torch.tensor(0.0, dtype=torch.float64), None, None))
    asks.append(StatusAsk(foreign, torch.tensor(0), torch.tensor(0.0, dtype=torch.float64), None, None))
    waits, reads = [], []
    wait = denoiser_mod.wait_statuses
    monkeypatch.setattr(denoiser_mod, "wait_statuses", lambda pending: (waits.append(len(pending)), wait(pending))[1])
    monkeypatch.setattr(denoiser_mod, "read_status", lambda *a, **k: reads.append(1))
    got = read_statuses(asks)
    assert got == want[:1] + [StepStatus(9, 1.5)] + want[1:] + [StepStatus(7, 0.5)]
    assert waits == [4] and not reads and len(own) == 1


# ------------------------------------------------------------------------------------------ the batched loop

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import CONFIGS, build_model, save

    return diffgemma.load(save(build_model(CONFIGS["gqa2_mixed"], canvas_length=8), tmp_path_factory.mktemp("status")))


PROMPTS = [[2, 5, 9], [2, 11, 12, 13, 14, 15], [2], [2, 7, 7, 30, 31]]


def _result(r):
    return r.tokens, r.steps_per_block, r.stop_reasons, r.block_ends, r.retries, r.stop_token, r.forwards


@pytest.mark.parametrize("fused", [False, True])
def test_one_status_wait_per_batched_round(tiny, monkeypatch, fused):
    """Each round: one forward over the k running requests, then one wait for their k statuses; no request reads
    alone. fused: the loop's fused path, where every step bets on the dense SC product and its read starts it."""
    if fused:
        monkeypatch.setattr(stats_mod, "use_triton", lambda t: True)
        for mod in (rowstats, softcap, tempered_tables):
            monkeypatch.setattr(mod, "use_triton", lambda t: True)
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 0)  # every count calls for the dense product
    base = GenerationSettings(max_new_tokens=8 if fused else 16, max_denoising_steps=5, confidence_trim=0.0)
    settings = [base, base.replace(sc_mode="exact"), base.replace(commit="sample", entropy_bound=2.0),
                base.replace(max_new_tokens=8)]
    seeds = [random.getrandbits(32) for _ in PROMPTS]
    solo = [generate(tiny, p, settings=s.replace(seed=seed)) for p, s, seed in zip(PROMPTS, settings, seeds)]

    log, plans = [], []
    forward, wait, read = engine_mod.forward_lanes, denoiser_mod.wait_statuses, denoiser_mod.read_status
    monkeypatch.setattr(engine_mod, "forward_lanes",
                        lambda m, fs: (log.append(("forward", len(fs))), forward(m, fs))[1])
    monkeypatch.setattr(denoiser_mod, "wait_statuses", lambda p: (log.append(("wait", len(p))), wait(p))[1])
    monkeypatch.setattr(denoiser_mod, "read_status", lambda *a, **k: (log.append(("solo read", 1)), read(*a, **k))[1])
    start = SparsePlan.start
    monkeypatch.setattr(SparsePlan, "start", lambda self, *a: (plans.append(self.probs is not None), start(self, *a)))
    batched = generate_batch(tiny, PROMPTS, seeds=seeds, settings=settings, max_batch=3)

    assert [_result(r) for r in batched] == [_result(r) for r in solo]
    kinds = [k for k, _ in log]
    assert kinds == ["forward", "wait"] * (len(log) // 2)  # one wait after each round's forward, never per request
    rounds = [(log[k][1], log[k + 1][1]) for k in range(0, len(log), 2)]
    assert all(f == w for f, w in rounds) and rounds[0] == (3, 3) and max(w for _, w in rounds) == 3
    assert sum(w for _, w in rounds) == sum(r.forwards for r in solo)
    assert (len(plans) > 0 and all(plans)) == fused  # the batched reads started the bets' products


def test_a_round_of_two_batched_groups_keeps_the_first_groups_logits():
    """A batched forward's logits may be views of one buffer that the next batched forward overwrites (the engine's
    batch graphs share their output buffer): a round with two canvas lengths runs two batched forwards, and each
    request must still get its own logits."""
    shared = torch.zeros(16, 3)

    class SharedOut:
        def __init__(self, caches):
            self.caches = caches

        def forward(self, canvases, sc_logits=None, sc_embeds=None):
            rows = [len(c) for c in canvases]
            out = shared[: sum(rows)]
            for i, part in enumerate(out.split(rows)):
                part.fill_(float(self.caches[i]))  # each lane's rows say whose they are
            return list(out.split(rows))

        def close(self):
            pass

    model = SimpleNamespace(denoiser=SharedOut)
    forwards = [SimpleNamespace(cache=k, canvas=torch.zeros(4 if k < 2 else 2), sc_logits=None, sc_embeds=None)
                for k in range(4)]
    got = lanes_mod.forward_lanes(model, forwards)
    for k, x in enumerate(got):
        assert x.shape == (len(forwards[k].canvas), 3)
        assert bool((x == k).all()), f"request {k} got another request's logits: {x[:, 0].tolist()}"


FIXED = dict(confidence_threshold=0.0, plateau_steps=0, entropy_stop=0.0, confidence_trim=0.0, empty_reply_retry=0,
             stop_ids=[])  # every block runs all its steps: requests that start together end blocks together


def spy_reads_and_commits(monkeypatch, owner) -> list:
    """A log of each read_asks call made through `owner` (the kinds of its asks) and each block's commit."""
    log = []
    read, commit = owner.read_asks, steps_mod.commit
    monkeypatch.setattr(owner, "read_asks", lambda asks: (log.append(sorted(type(a).__name__ for a in asks)),
                                                          read(asks))[1])
    monkeypatch.setattr(steps_mod, "commit", lambda *a: (log.append("commit"), commit(*a))[1])
    return log


def test_a_rounds_block_reads_wait_once_before_any_commit(tiny, monkeypatch):
    """Requests that end a block in the same round read their blocks in one host wait (core/lanes.read_asks) before any of
    them commits, so no request's block read waits for another's commit; the tokens are the solo ones."""
    s = GenerationSettings(max_new_tokens=16, max_denoising_steps=4, **FIXED)
    seeds = [random.getrandbits(32) for _ in range(3)]
    solo = [generate(tiny, p, settings=s.replace(seed=seed)) for p, seed in zip(PROMPTS, seeds)]
    log = spy_reads_and_commits(monkeypatch, engine_mod)
    batched = generate_batch(tiny, PROMPTS[:3], seeds=seeds, settings=s, max_batch=3)
    assert [_result(r) for r in batched] == [_result(r) for r in solo]
    blocks = [k for k, e in enumerate(log) if e != "commit" and "BlockRead" in e]
    assert [log[k] for k in blocks] == [["BlockRead"] * 3] * 2  # two blocks, each read by all three at once
    first = blocks[0]  # the first block is committed after the read, the last one (a lent cache) is not
    assert log[first + 1: first + 5] == ["commit"] * 3 + [["StatusAsk"] * 3]
    assert log.count("commit") == 3
