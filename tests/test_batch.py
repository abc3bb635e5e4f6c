"""Batched denoising on the reference model and generate_batch (docs/ARCHITECTURE.md, 'Batching').

- The forward: denoise_batch's logits for each request are bit for bit its solo denoise's, whatever else is in the
  batch (other context lengths past the sliding window, other canvas lengths, other SC inputs, any order).
- rows_matmul: a row's result does not depend on the rows around it.
- The loop: generate_batch gives each request exactly what generate gives it alone (tokens, steps per block, stop
  reasons, block ends), with per-request seeds and settings, requests leaving when done and queued ones joining.
- The engine's batched forward: tests/test_engine_batch.py.
- `diffgemma ask --batch-file`: one JSON line per request; a bad line fails before the model loads.
"""

import json

import pytest
import torch

import diffgemma
from diffgemma import generate, generate_batch
from diffgemma.slots import CachePool
from diffgemma.errors import InputError
from diffgemma.events import BlockEvent, DoneEvent, StepEvent
from diffgemma.model.reference import ROW_TILE, rows_matmul
from diffgemma.settings import GenerationSettings
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    hf = build_model(CONFIGS[request.param], canvas_length=8)
    return diffgemma.load(save(hf, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


def _cache(model, n, room=64):
    cache = model.new_cache(n + room)
    model.prefill(cache, torch.randint(0, model.config.vocab_size, (n,)))
    return cache


def _result(r):
    return r.tokens, r.steps_per_block, r.stop_reasons, r.block_ends, r.retries, r.stop_token


# ----------------------------------------------------------------------------------- the forward

def test_rows_matmul_row_results_do_not_depend_on_the_other_rows():
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        for rows, k, n in [(1, 16, 8), (3, 64, 512), (8, 256, 96), (70, 32, 2048)]:
            w = torch.randn(n, k, generator=gen, dtype=dtype)
            x = torch.randn(rows, k, generator=gen, dtype=dtype)
            alone = rows_matmul(x, w)
            assert torch.allclose(alone, x @ w.T, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-5)
            for before, after in [(0, 5), (1, 0), (ROW_TILE - 1, 2), (37, 2 * ROW_TILE + 3)]:
                others = torch.randn(before + after, k, generator=gen, dtype=dtype) * 100
                mixed = torch.cat([others[:before], x, others[before:]])
                assert torch.equal(rows_matmul(mixed, w)[before:before + rows], alone)


@pytest.mark.parametrize("B", [2, 3, 4])
def test_batched_logits_are_bitwise_the_solo_logits(tiny, B):
    cfg = tiny.config
    V, H = cfg.vocab_size, cfg.hidden_size
    contexts = [1, 23, 4, 11][:B]  # past every tiny sliding window, and within it
    lengths = [8, 3, 8, 5]
    caches = [_cache(tiny, n) for n in contexts]
    canvases = [torch.randint(0, V, (c,)) for c in lengths[:B]]
    sc_logits = [None, torch.randn(lengths[1], V) * 4, None, torch.randn(lengths[3], V)][:B]
    sc_embeds = [None, None, torch.randn(lengths[2], H), None][:B] if B > 2 else None
    embeds = sc_embeds or [None] * B
    solo = [tiny.denoise(c, x, sc_logits=lg, sc_embeds=em) for c, x, lg, em in zip(caches, canvases, sc_logits, embeds)]
    batched = tiny.denoise_batch(caches, canvases, sc_logits=sc_logits, sc_embeds=sc_embeds)
    assert len(batched) == B
    for a, b in zip(solo, batched):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    order = list(reversed(range(B)))  # another order, through the batch denoiser
    den = tiny.denoiser([caches[i] for i in order])
    again = den.forward([canvases[i] for i in order], sc_logits=[sc_logits[i] for i in order],
                        sc_embeds=[embeds[i] for i in order])
    for i, b in zip(order, again):
        assert torch.equal(solo[i], b)
    # the protocol's [B, C] form: equal canvas lengths in, [B, C, V] out
    same = torch.stack([torch.randint(0, V, (lengths[0],)) for _ in range(B)])
    stacked = tiny.denoiser(caches).forward(same)
    assert stacked.shape == (B, lengths[0], V)
    for i in range(B):
        assert torch.equal(stacked[i], tiny.denoise(caches[i], same[i]))


def test_random_batches_are_bitwise_the_solo_logits(tiny):
    """Random batches: 1-5 requests, contexts 0-30 (empty caches, inside and past the window), canvases of 1-20
    ids, each with SC logits, SC embeddings or none."""
    V, H = tiny.config.vocab_size, tiny.config.hidden_size
    gen = torch.Generator().manual_seed(7)
    for _ in range(6):
        B = int(torch.randint(1, 6, (1,), generator=gen))
        caches, canvases, lg, em = [], [], [], []
        for _ in range(B):
            n, C, kind = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((0, 31), (1, 21), (0, 3)))
            cache = tiny.new_cache(n + 32)
            if n:
                tiny.prefill(cache, torch.randint(0, V, (n,), generator=gen))
            caches.append(cache)
            canvases.append(torch.randint(0, V, (C,), generator=gen))
            lg.append(torch.randn(C, V, generator=gen) * 3 if kind == 1 else None)
            em.append(torch.randn(C, H, generator=gen) if kind == 2 else None)
        batched = tiny.denoise_batch(caches, canvases, sc_logits=lg, sc_embeds=em)
        for i in range(B):
            assert torch.equal(batched[i], tiny.denoise(caches[i], canvases[i], sc_logits=lg[i], sc_embeds=em[i]))


def test_batched_demo_logits_are_bitwise_the_solo_logits(demo):
    V = demo.config.vocab_size
    caches = [_cache(demo, n, 80) for n in (3, 40, 17)]
    canvases = [torch.randint(0, V, (c,)) for c in (64, 16, 32)]
    sc = [torch.randn(64, V), None, torch.randn(32, V)]
    solo = [demo.denoise(c, x, sc_logits=s) for c, x, s in zip(caches, canvases, sc)]
    for a, b in zip(solo, demo.denoise_batch(caches, canvases, sc_logits=sc)):
        assert torch.equal(a, b)


def test_denoise_batch_rejects_mismatched_inputs(tiny):
    caches = [_cache(tiny, 3), _cache(tiny, 4)]
    canvas = torch.zeros(8, dtype=torch.long)
    with pytest.raises(InputError, match="one canvas per cache"):
        tiny.denoise_batch(caches, [canvas])
    with pytest.raises(InputError, match="sc_logits has 1 entries"):
        tiny.denoise_batch(caches, [canvas, canvas], sc_logits=[None])
    with pytest.raises(InputError, match="sc_logits has shape"):
        tiny.denoise_batch(caches, [canvas, canvas], sc_logits=[None, torch.zeros(3, 5)])
    with pytest.raises(InputError, match="canvas ids"):
        tiny.denoise_batch(caches, [canvas, torch.zeros(0, dtype=torch.long)])


# ----------------------------------------------------------------------------------- the loop

PROMPTS = [[2, 5, 9], [2, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [2], [2, 7, 7, 30, 31]]


@pytest.mark.parametrize("B", [2, 3, 4])
def test_generate_batch_equals_generate_per_request(tiny, B):
    prompts = PROMPTS[:B]
    base = GenerationSettings(max_new_tokens=20, max_denoising_steps=6, confidence_trim=0.0)
    settings = [base, base.replace(sc_mode="exact", confidence_trim=0.9), base.replace(commit="sample", freeze=True),
                base.replace(semantics="hf", max_new_tokens=11)][:B]
    seeds = [3, 3, 17, 5][:B]
    solo = [generate(tiny, p, settings=s.replace(seed=seed)) for p, s, seed in zip(prompts, settings, seeds)]
    batched = generate_batch(tiny, prompts, seeds=seeds, settings=settings)
    assert [_result(r) for r in batched] == [_result(r) for r in solo]
    assert [r.settings for r in batched] == [r.settings for r in solo]


def test_generate_batch_on_the_demo_model_equals_generate(demo):
    msgs = [[{"role": "user", "content": c}] for c in ("hi", "What is 2+2? Answer briefly.", "Name a colour.")]
    prompts = [demo.tokenizer.apply_chat_template(m) for m in msgs]
    kw = dict(max_new_tokens=24, max_denoising_steps=8)
    solo = [generate(demo, p, seed=i, **kw) for i, p in enumerate(prompts)]
    batched = generate_batch(demo, prompts, seeds=[0, 1, 2], **kw)
    assert [_result(r) for r in batched] == [_result(r) for r in solo]
    assert [r.text for r in batched] == [r.text for r in solo]


def test_generate_batch_lends_a_few_caches_of_one_size(tiny, monkeypatch):
    """Without caches=, a queue of requests is served from max_batch caches (needs of one size class: one size),
    each emptied and lent again when its request is done; every request still gets generate's result, and no
    request's last block is committed into a lent cache (it is not the caller's)."""
    made, prefills = [], []
    new_cache, prefill = tiny.new_cache, tiny.prefill

    def counting_new_cache(max_tokens=None, *a, **kw):
        made.append(max_tokens)
        return new_cache(max_tokens, *a, **kw)

    monkeypatch.setattr(tiny, "new_cache", counting_new_cache)
    def counting_prefill(cache, ids, *a, **kw):
        prefills.append(len(ids))
        return prefill(cache, ids, *a, **kw)

    monkeypatch.setattr(tiny, "prefill", counting_prefill)
    prompts = PROMPTS + PROMPTS[::-1]
    s = GenerationSettings(max_new_tokens=20, max_denoising_steps=4, confidence_trim=0.0)
    seeds = list(range(len(prompts)))
    batched = generate_batch(tiny, prompts, seeds=seeds, settings=s, max_batch=2)
    assert len(made) == 2 and len(set(made)) == 1, made
    assert made[0] == CachePool(tiny, 2).size_for(max(len(p) for p in prompts) + 20 + tiny.config.canvas_length)
    prefilled = sum(prefills)  # prompts and commits
    prefills.clear()
    solo = [generate(tiny, p, settings=s.replace(seed=seed)) for p, seed in zip(prompts, seeds)]
    assert [_result(r) for r in batched] == [_result(r) for r in solo]
    assert prefilled == sum(prefills), "a lent cache got a commit generate's own cache does not"


def test_the_cache_pool_sizes_by_class_and_keeps_at_most_limit_caches():
    """Sizes: a power of two of at least 1024 tokens at or above the need, within the model's context. A request
    takes a free cache of its class; a new cache first drops a free one of another class once `limit` are alive."""
    made = []

    class Cache:
        def __init__(self, n):
            self.n, self.length = n, 5
            made.append(n)

        def truncate(self, n):
            self.length = n

    model = type("M", (), {"config": type("C", (), {"max_positions": 6000})(), "new_cache": lambda self, n: Cache(n)})()
    pool = CachePool(model, limit=2)
    assert [pool.size_for(n) for n in (1, 1024, 1025, 3000, 5000, 6000)] == [1024, 1024, 2048, 4096, 6000, 6000]
    a, b = pool.take_cache(100), pool.take_cache(1500)
    assert (a.n, b.n) == (1024, 2048)
    pool.give_cache(a)
    assert a.length == 0 and pool.take_cache(900) is a  # the free cache of its class, emptied
    pool.give_cache(a)
    c = pool.take_cache(3000)  # two alive (a free, b lent): a goes, c comes
    assert c.n == 4096 and len(pool.size) == 2 and id(a) not in pool.size
    pool.give_cache(b)
    pool.give_cache(c)
    assert pool.take_cache(2000) is b and made == [1024, 2048, 4096]


def test_generate_batch_continues_each_requests_own_cache(tiny):
    """caches=: each request continues the cache it is given (a second turn: only the new tokens as input, one with
    none at all), as generate(..., cache=) does; the caches end holding the same K/V as generate's."""
    base = GenerationSettings(max_new_tokens=12, max_denoising_steps=5, confidence_trim=0.0)
    turns = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    follow = [[4, 8], [], [9]]

    def primed():
        caches = [tiny.new_cache(128) for _ in turns]
        for c, p in zip(caches, turns):
            tiny.prefill(c, torch.tensor(p))
        return caches

    solo_caches, batch_caches = primed(), primed()
    solo = [generate(tiny, f, settings=base.replace(seed=i), cache=c) for i, (f, c) in enumerate(zip(follow, solo_caches))]
    batched = generate_batch(tiny, follow, seeds=[0, 1, 2], settings=base, caches=batch_caches)
    assert [_result(r) for r in batched] == [_result(r) for r in solo]
    for a, b, p, f, r in zip(batch_caches, solo_caches, turns, follow, batched):
        assert a.length == b.length == len(p) + len(f) + len(r.tokens)
        assert all(torch.equal(x, y) for x, y in zip(a.live_kv(), b.live_kv()))
    with pytest.raises(InputError, match="2 caches for 3 requests"):
        generate_batch(tiny, follow, caches=batch_caches[:2])
    with pytest.raises(InputError, match="a cache appears twice"):
        generate_batch(tiny, follow[:2], caches=[batch_caches[0]] * 2)


def test_requests_leave_when_done_and_queued_ones_join_mid_block(tiny, monkeypatch):
    """Request 0 has one short block and leaves; request 2 (queued behind max_batch=2) joins while request 1 is
    still in its blocks; every forward holds exactly the requests that are running; results equal generate's."""
    canvas = tiny.config.canvas_length
    base = GenerationSettings(max_denoising_steps=6, confidence_trim=0.0, empty_reply_retry=0)
    never_early = dict(confidence_threshold=0.0, plateau_steps=0, entropy_stop=0.0)  # request 1: 6 steps a block
    settings = [base.replace(max_new_tokens=canvas, max_denoising_steps=2),
                base.replace(max_new_tokens=4 * canvas, **never_early), base.replace(max_new_tokens=2 * canvas, seed=9)]
    prompts = PROMPTS[:3]
    sizes, events = [], []
    real = tiny.denoise_batch

    def spy(caches, canvases, **kw):
        sizes.append(len(caches))
        events.append(("forward", len(caches)))
        return real(caches, canvases, **kw)

    steps = []  # (forward number, request, block, step)

    def on_event(i, e):
        events.append((type(e).__name__, i))
        if isinstance(e, StepEvent):
            steps.append((len(sizes), i, e.block, e.step))

    monkeypatch.setattr(tiny, "denoise_batch", spy)
    batched = generate_batch(tiny, prompts, settings=settings, max_batch=2, on_event=on_event)
    monkeypatch.undo()
    solo = [generate(tiny, p, settings=s) for p, s in zip(prompts, settings)]
    assert [_result(r) for r in batched] == [_result(r) for r in solo]

    done = {i: events.index(("DoneEvent", i)) for i in range(3)}
    first_step = {i: events.index(("StepEvent", i)) for i in range(3)}
    assert done[0] < first_step[2] < done[1]  # 2 joined after 0 left, while 1 was running
    assert max(sizes) == 2 and 1 not in sizes[:2]  # two at a time from the start
    # between two forwards, each running request took one step: the forward's size is the number of StepEvents
    steps_after = []
    for kind, value in events:
        if kind == "forward":
            steps_after.append(0)
        elif kind == "StepEvent":
            steps_after[-1] += 1
    assert steps_after == sizes
    # request 0 converged and left in the middle of request 1's first block; request 2 joined mid-block too
    assert {s for _, i, b, s in steps if i == 1} == set(range(1, 7))  # 1 never stops early: 6 steps a block
    last_of_0 = max(n for n, i, _, _ in steps if i == 0)
    assert [(b, s) for n, i, b, s in steps if i == 1 and n == last_of_0] == [(0, last_of_0)]
    first_of_2 = min(n for n, i, _, _ in steps if i == 2)
    assert [s for n, i, b, s in steps if i == 1 and n == first_of_2][0] > 1
    assert any(e == ("BlockEvent", 1) for e in events[done[0]:])  # 1 kept going after 0 left


def test_generate_batch_checks_every_request_before_running_any(tiny):
    with pytest.raises(InputError, match="2 seeds for 3 requests"):
        generate_batch(tiny, PROMPTS[:3], seeds=[1, 2])
    with pytest.raises(InputError, match="1 settings for 2 requests"):
        generate_batch(tiny, PROMPTS[:2], settings=[GenerationSettings()])
    with pytest.raises(InputError, match="request 1: input_ids"):
        generate_batch(tiny, [[2, 3], [tiny.config.vocab_size + 5]])
    with pytest.raises(InputError, match="request 0: input_ids: empty prompt"):
        generate_batch(tiny, [[], [2]])
    with pytest.raises(InputError, match="max_batch must be a positive integer"):
        generate_batch(tiny, PROMPTS[:2], max_batch=0)
    assert generate_batch(tiny, []) == []


# ----------------------------------------------------------------------------------- the CLI

def test_ask_batch_file_writes_one_json_line_per_request(tmp_path, capsys):
    from diffgemma.cli import main

    batch = tmp_path / "prompts.jsonl"
    batch.write_text(json.dumps({"prompt": "hi", "id": "a"}) + "\n\n"
                     + json.dumps({"prompt": "Name a colour.", "seed": 7}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["ask", "--batch-file", str(batch), "--out", str(out), "--max-new-tokens", "8",
                 "--set", "max_denoising_steps=4"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["a", 3]  # the id given, else the line number (line 2 is blank)
    assert [line["seed"] for line in lines] == [0, 7]
    assert all(isinstance(line["answer"], str) and line["tokens"] <= 8 for line in lines)
    assert capsys.readouterr().out == ""  # --out: nothing on stdout

    single = diffgemma.Session(diffgemma.load()).ask("Name a colour.", seed=7, max_new_tokens=8, max_denoising_steps=4)
    assert lines[1]["answer"] == single.answer

    assert main(["ask", "--batch-file", str(batch), "--max-new-tokens", "4", "--set", "max_denoising_steps=2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.parametrize("text,message", [
    ('{"prompt": "hi"}\n{"prompt": 3}\n', "line 2: \"prompt\" must be a string"),
    ('{"prompt": "hi"}\nnot json\n', "line 2: not valid JSON"),
    ('{"seed": 1}\n', "line 1: no \"prompt\""),
    ('{"prompt": "x", "seed": "one"}\n', "line 1: \"seed\" must be an integer"),
    ('["hi"]\n', "line 1: expected a JSON object"),
    ('\n\n', "no prompts"),
    ('{"prompt": "x", "temperature": 1}\n', "line 1: unknown key 'temperature'"),
])
def test_ask_batch_file_bad_lines_fail_before_the_model_loads(tmp_path, capsys, monkeypatch, text, message):
    from diffgemma import cli, options

    monkeypatch.setattr(options, "load_model", lambda args: pytest.fail("the model loaded before the file was checked"))
    batch = tmp_path / "prompts.jsonl"
    batch.write_text(text)
    assert cli.main(["ask", "--batch-file", str(batch)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(batch) in err[0]


def test_ask_takes_a_prompt_or_a_batch_file(tmp_path, capsys):
    from diffgemma.cli import main

    batch = tmp_path / "p.jsonl"
    batch.write_text('{"prompt": "hi"}\n')
    for argv, message in [(["ask"], "a prompt or --batch-file"), (["ask", "hi", "--batch-file", str(batch)],
                                                                  "a prompt or --batch-file"),
                          (["ask", "hi", "--out", str(tmp_path / "o")], "--out: only with --batch-file"),
                          (["ask", "--batch-file", str(batch), "--out", str(tmp_path / "no" / "o")],
                           "its directory does not exist"),
                          (["ask", "--batch-file", str(batch), "--max-batch", "0"], "--max-batch 0"),
                          (["ask", "--batch-file", str(batch), "--log-dir", str(tmp_path)], "--log-dir: not with"),
                          (["ask", "--batch-file", str(batch), "--show-canvas"], "--show-canvas: not with")]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]
