"""diffgemma.generate: every contract divergence shown with controlled logits, plus block chaining,
the cache contract and determinism on a real (tiny) checkpoint.

The fake model implements the model API with scripted logits. A script receives the denoise call
(step within the block, canvas, cache length, ...) and returns logits; `tempered()` multiplies a base
by the step's temperature so the loop sees exactly `base` after dividing by T, whatever the step.
"""

import json
import math
import random
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from diffgemma.errors import InputError
from diffgemma.generation import BlockEvent, DoneEvent, StepEvent, generate, generate_stream
from diffgemma.model.denoiser import Denoiser
from diffgemma.sampling.rng import Lcg, block_seed, categorical
from diffgemma.sampling.schedule import temperature
from diffgemma.sampling.self_condition import sparse_soft_embed
from diffgemma.sampling.stats import entropy
from diffgemma.settings import GenerationSettings



V, H, PAD, BOS, EOS = 32, 8, 0, 2, 1
CONTROL = {PAD, BOS, EOS, V - 1}  # V - 1: the filler sentinel (last vocabulary id)


@dataclass
class Call:
    step: int  # 1-based step within the current block attempt
    cache_len: int
    canvas: torch.Tensor
    sc_logits: torch.Tensor | None
    sc_embeds: torch.Tensor | None
    temperature: float


class FakeCache:
    def __init__(self, max_tokens):
        self.tokens: list[int] = []

    @property
    def length(self):
        return len(self.tokens)

    def truncate(self, n):
        del self.tokens[n:]

    def fingerprint(self):
        return str(hash(tuple(self.tokens)))


class FakeModel:
    def __init__(self, script, *, canvas=8, steps=16, t_min=0.4, t_max=0.8):
        self.config = SimpleNamespace(vocab_size=V, hidden_size=H, canvas_length=canvas, pad_token_id=PAD,
                                      bos_token_id=BOS, eos_token_ids=(EOS,), embed_scale=math.sqrt(H))
        # exact SC by default: a block's first step is then recognisable (no sc_logits); see denoise()
        self.generation_config = {"max_denoising_steps": steps, "t_min": t_min, "t_max": t_max, "sc_mode": "exact"}
        self.tokenizer = None
        self.embedding = torch.randn(V, H)
        self.script = script
        self.calls: list[Call] = []
        self.prefills: list[list[int]] = []
        self._steps, self._t = steps, (t_min, t_max)

    def denoiser(self, caches):
        return Denoiser(self, caches[0])

    def new_cache(self, max_tokens):
        return FakeCache(max_tokens)

    def prefill(self, cache, ids):
        self.prefills.append(ids.tolist())
        cache.tokens += ids.tolist()

    def embed(self, ids):
        return self.embedding[ids] * self.config.embed_scale

    def denoise(self, cache, canvas, sc_logits=None, sc_embeds=None):
        assert sc_logits is None or sc_embeds is None
        # a block's first step is the only one without a previous step's SC signal (at most the seed);
        # later steps carry sc_logits (exact SC) or, in the sparse test, a soft embedding of random logits
        first = sc_logits is None and (sc_embeds is None or torch.allclose(sc_embeds, self.embed(canvas)))
        step = 1 if first or not self.calls else self.calls[-1].step + 1
        temp = float(temperature(self._steps - step + 1, self._steps, *self._t))
        call = Call(step, cache.length, canvas.clone(), sc_logits, sc_embeds, temp)
        self.calls.append(call)
        return self.script(call).float()


def tempered(base: torch.Tensor, call: Call) -> torch.Tensor:
    return base * call.temperature


def peaked(ids, margin) -> torch.Tensor:
    """Logits [len(ids), V]: each row `margin` above a flat floor at its id."""
    ids = torch.as_tensor(ids)
    out = torch.zeros(len(ids), V)
    out[torch.arange(len(ids)), ids] = torch.as_tensor(margin, dtype=torch.float32)
    return out


def margin_for_entropy(h: float) -> float:
    """The margin whose peaked row has entropy h nats (bisection)."""
    lo, hi = 0.0, 60.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if entropy(peaked([5], mid))[0] > h:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def answer_ids(n):
    return torch.tensor(random.choices([t for t in range(V) if t not in CONTROL], k=n))


def run(model, prompt=None, **overrides):
    prompt = answer_ids(random.randint(1, 6)) if prompt is None else prompt
    settings = GenerationSettings.resolve(model.generation_config, env={}, overrides=overrides)
    return generate(model, prompt, settings=settings)


# ------------------------------------------------------------------------------ stop divergences

def test_plateau_then_entropy_then_max_steps_on_a_stuck_canvas():
    # every row settled at 0.02 nats (above the confident 0.005, below 0.05), the argmax changing every
    # step: the confident stop never fires, the accept mask (all, bound 1.0) is stuck
    m = margin_for_entropy(0.02)
    script = lambda call: tempered(peaked(answer_ids(8), m), call)
    common = dict(entropy_bound=1.0, confidence_trim=0, max_new_tokens=8, seed=random.getrandbits(32))
    cases = [({}, "plateau", 8), ({"plateau_steps": 0}, "entropy", 12),
             ({"plateau_steps": 0, "entropy_stop_min_steps": 5}, "entropy", 5),
             ({"plateau_steps": 0, "entropy_stop": 0}, "max_steps", 20), ({"plateau_steps": 3}, "plateau", 3)]
    for extra, reason, steps in cases:
        result = run(FakeModel(script, steps=20), **common, **extra)
        assert (result.stop_reasons, result.steps_per_block) == ([reason], [steps]), extra


def test_entropy_stop_needs_low_mean_entropy():
    m = margin_for_entropy(0.08)  # above entropy_stop 0.05 and plateau_entropy 0.05
    script = lambda call: tempered(peaked(answer_ids(8), m), call)
    result = run(FakeModel(script, steps=20), entropy_bound=1.0, confidence_trim=0, max_new_tokens=8)
    assert result.stop_reasons == ["max_steps"] and result.steps_per_block == [20]


def test_pad_gate_refuses_to_stop_on_an_all_pad_canvas():
    script = lambda call: tempered(peaked([PAD] * 8, 40.0), call)  # confident, stable, and all pad
    for gate, reason, steps in ((True, "max_steps", 10), (False, "confident", 2)):
        result = run(FakeModel(script, steps=10), pad_gate=gate, empty_reply_retry=0, max_new_tokens=8)
        assert (result.stop_reasons, result.steps_per_block) == ([reason], [steps])
        assert result.tokens == [PAD] * 8


def test_confident_stop_on_a_stable_sure_canvas():
    ids = answer_ids(8)
    result = run(FakeModel(lambda call: tempered(peaked(ids, 40.0), call)), max_new_tokens=8)
    assert (result.tokens, result.stop_reasons, result.steps_per_block) == (ids.tolist(), ["confident"], [2])


# ---------------------------------------------------------------------- degenerate first block

def test_empty_reply_retry_shrinks_the_canvas_and_is_deterministic():
    good = answer_ids(16)

    def script(call):  # canvases of 16 and 8 open with eos; the 4-canvas answers
        ids = good[: len(call.canvas)].clone()
        if len(call.canvas) >= 8 and call.cache_len < 20:
            ids[0] = EOS
        return tempered(peaked(ids, 40.0), call)

    seed = random.getrandbits(32)
    results, first_canvases = [], []
    for _ in range(2):
        model = FakeModel(script, canvas=16, steps=4)
        results.append(run(model, prompt=torch.tensor([7, 8, 9]), seed=seed, max_new_tokens=6, confidence_trim=0))
        first_canvases.append([c.canvas.tolist() for c in model.calls if c.step == 1])
    a, b = results
    assert a.retries == 2 and [len(c) for c in first_canvases[0][:3]] == [16, 8, 4]
    assert a.tokens == b.tokens and first_canvases[0] == first_canvases[1]
    for attempt, canvas in enumerate(first_canvases[0][:3]):  # re-rolls re-seed per attempt
        assert canvas == Lcg(block_seed(seed, 0, attempt)).randint(len(canvas), V).tolist()
    # block 0 commits the 4-canvas; block 1 is a full canvas again (opening with eos: the turn ends, no re-roll)
    assert a.tokens == good[:4].tolist() and a.steps_per_block == [2, 2] and a.stop_token == EOS
    assert [len(c) for c in first_canvases[0][3:]] == [16]


def test_empty_reply_retry_gives_up_after_three_and_can_be_disabled():
    always_eos = lambda call: tempered(peaked([EOS] + [5] * (len(call.canvas) - 1), 40.0), call)
    model = FakeModel(always_eos, canvas=16, steps=3)
    result = run(model, max_new_tokens=16)
    assert result.retries == 3 and [len(c.canvas) for c in model.calls if c.step == 1] == [16, 8, 4, 4]
    assert result.tokens == [] and result.stop_token == EOS
    model = FakeModel(always_eos, canvas=16, steps=3)
    assert run(model, max_new_tokens=16, empty_reply_retry=0).retries == 0


# ------------------------------------------------------------------------------- confidence trim

def test_trim_cuts_at_a_duplicated_low_confidence_row_and_keeps_the_budget():
    seed = random.getrandbits(32)
    p = 3  # prompt length

    def script(call):
        ids = answer_ids(8)
        ids[2] = ids[3] = 20  # rows 2, 3 share an argmax ...
        ids[5] = 21
        logits = peaked(ids, 40.0)
        if call.cache_len == p:
            logits[3] = peaked([20], 1.0)[0] + peaked([21], 1.0)[0] * 0.9  # ... and row 3 is unsure
        return tempered(logits, call)

    model = FakeModel(script, steps=4)
    result = run(model, prompt=answer_ids(p), seed=seed, max_new_tokens=16)
    assert result.block_ends[0] == "trimmed"
    # cut block, full block; the budget-capped last block is not committed (no caller's cache to keep it)
    assert [len(x) for x in model.prefills] == [p, 3, 8]
    assert sorted({c.cache_len for c in model.calls}) == [p, p + 3, p + 11]  # the next canvas starts after the cut
    assert len(result.tokens) == 16 and result.block_ends[1:] == ["continue", "max_new_tokens"]
    # trim off: two full blocks; the unsure duplicate is committed
    model = FakeModel(script, steps=4)
    result = run(model, prompt=answer_ids(p), seed=seed, max_new_tokens=16, confidence_trim=0)
    assert [len(x) for x in model.prefills] == [p, 8] and result.tokens[2:4] == [20, 20]
    # with a caller's cache every kept token is committed, the last block too
    model = FakeModel(script, steps=4)
    settings = GenerationSettings.resolve(model.generation_config, env={}, overrides=dict(seed=seed, max_new_tokens=16))
    result = generate(model, answer_ids(p), settings=settings, cache=model.new_cache(64))
    assert [len(x) for x in model.prefills] == [p, 3, 8, 5] and len(result.tokens) == 16


# ----------------------------------------------------------------------------- block chaining

def test_blocks_chain_until_a_stop_token_and_the_cache_holds_prompt_plus_answer():
    prompt = answer_ids(5)
    blocks = [answer_ids(8), answer_ids(8)]
    blocks[1][5] = EOS

    def script(call):
        return tempered(peaked(blocks[(call.cache_len - 5) // 8], 40.0), call)

    model = FakeModel(script)
    cache = model.new_cache(100)
    result = generate(model, prompt, cache=cache, settings=GenerationSettings.resolve(
        model.generation_config, env={}, overrides={"max_new_tokens": 40}))
    assert result.tokens == blocks[0].tolist() + blocks[1][:5].tolist()
    assert result.stop_token == EOS and result.block_ends == ["continue", "stop_token"]
    assert cache.tokens == prompt.tolist() + result.tokens  # the stop token is not in the cache
    assert model.prefills == [prompt.tolist(), blocks[0].tolist(), blocks[1][:5].tolist()]
    assert sorted({c.cache_len for c in model.calls}) == [5, 13]
    assert result.tokens_per_forward == pytest.approx(13 / result.forwards)

    # next turn on the same cache: only the new tokens are prefilled, the canvas follows them
    new = answer_ids(3)
    blocks[:] = [answer_ids(8)] * 10
    model.prefills.clear()
    before = cache.length
    result2 = generate(model, new, cache=cache, max_new_tokens=4)
    assert model.prefills[0] == new.tolist() and model.calls[-1].cache_len == before + 3
    assert cache.tokens[before:] == new.tolist() + result2.tokens and len(result2.tokens) == 4


def test_max_new_tokens_is_honoured_exactly():
    n = random.randint(9, 23)
    model = FakeModel(lambda call: tempered(peaked(answer_ids(8), 40.0), call), steps=3)
    result = run(model, max_new_tokens=n, confidence_trim=0)
    assert len(result.tokens) == n and len(result.steps_per_block) == math.ceil(n / 8)
    assert result.block_ends[-1] == "max_new_tokens"


# ------------------------------------------------------------------------------ stop strings

# Each token decodes to one letter, but token 9 to two ("Jj"), so a stop text can begin inside a token.
LETTERS = [chr(65 + t) if t < 26 else chr(97 + t - 26) for t in range(V)]
LETTERS[9] = "Jj"


class LetterTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(LETTERS[int(t)] for t in ids)


def two_blocks(first: list[int] | None = None):
    """A prompt and two 8-token blocks of distinct single-letter tokens (a stop text made of them occurs once),
    and a model that commits block k when the cache holds the prompt and k blocks."""
    plain = [t for t in range(V) if t not in CONTROL and t != 9]
    ids = random.sample(plain, 16)
    blocks = [torch.tensor(first or ids[:8]), torch.tensor(ids[8:])]
    model = FakeModel(lambda call: tempered(peaked(blocks[min((call.cache_len - 5) // 8, 1)], 40.0), call))
    model.tokenizer = LetterTokenizer()
    return answer_ids(5), blocks, model


def test_a_stop_string_across_two_blocks_ends_the_turn_after_its_last_token():
    prompt, blocks, model = two_blocks()
    stop = model.tokenizer.decode(blocks[0][-2:]) + model.tokenizer.decode(blocks[1][:2])
    cache = model.new_cache(100)
    result = generate(model, prompt, cache=cache, settings=GenerationSettings.resolve(
        model.generation_config, env={}, overrides={"max_new_tokens": 40, "stop_strings": ["zzz", stop]}))
    want = blocks[0].tolist() + blocks[1][:2].tolist()
    assert result.tokens == want and result.stop_string == stop and result.stop_token is None
    assert result.text == model.tokenizer.decode(want)[:-4]  # ends where the stop text begins
    assert result.block_ends == ["continue", "stop_string"]
    assert cache.tokens == prompt.tolist() + want  # the stop text's tokens are cached: the model wrote them
    assert model.prefills == [prompt.tolist(), blocks[0].tolist(), blocks[1][:2].tolist()]
    assert sorted({c.cache_len for c in model.calls}) == [5, 13]  # no third block


def test_a_stop_string_beginning_inside_a_token_cuts_the_text_there():
    prompt, blocks, model = two_blocks()
    blocks[0][3] = 9  # decodes to "Jj"
    stop = "j" + LETTERS[int(blocks[0][4])]
    result = generate(model, prompt, settings=GenerationSettings.resolve(
        model.generation_config, env={}, overrides={"max_new_tokens": 40, "stop_strings": stop}))
    assert result.tokens == blocks[0][:5].tolist() and result.block_ends == ["stop_string"]
    assert result.text == model.tokenizer.decode(blocks[0][:3]) + "J"


def test_stop_strings_that_never_occur_change_nothing():
    prompt, blocks, model = two_blocks()
    settings = GenerationSettings.resolve(model.generation_config, env={}, overrides={"max_new_tokens": 16})
    plain = generate(model, prompt, settings=settings)
    again = generate(model, prompt, settings=settings.replace(stop_strings=["@", "AAAA"]))
    assert again.tokens == plain.tokens and again.text == plain.text and again.stop_string is None
    assert again.block_ends == plain.block_ends == ["continue", "max_new_tokens"]


@pytest.mark.parametrize("stop_first", [True, False])
def test_a_stop_string_and_a_stop_token_in_one_block_the_earlier_wins(stop_first):
    prompt, blocks, model = two_blocks()
    blocks[0][5] = EOS
    stop = model.tokenizer.decode(blocks[0][1:3] if stop_first else blocks[0][6:8])
    result = generate(model, prompt, settings=GenerationSettings.resolve(
        model.generation_config, env={}, overrides={"max_new_tokens": 40, "stop_strings": stop}))
    if stop_first:
        assert result.tokens == blocks[0][:3].tolist() and result.stop_string == stop and result.stop_token is None
    else:  # the text after the stop token is not the reply's: its stop text never counts
        assert result.tokens == blocks[0][:5].tolist() and result.stop_token == EOS and result.stop_string is None
    assert result.text == model.tokenizer.decode(result.tokens)[:1 if stop_first else None]


def test_stop_strings_need_a_tokenizer():
    model = FakeModel(lambda call: tempered(peaked(answer_ids(8), 40.0), call))
    with pytest.raises(InputError, match="stop_strings: this model has no tokenizer"):
        run(model, stop_strings="x")


# ------------------------------------------------------- SC, renoise, commit, freeze: one step at a time

def _events(model, **overrides):
    settings = GenerationSettings.resolve(model.generation_config, env={}, overrides=overrides)
    return list(generate_stream(model, answer_ids(4), settings=settings))


def test_first_step_sc_seed_then_previous_logits_and_lcg_renoise():
    base = [torch.randn(8, V) * 3 for _ in range(3)]
    seed = random.getrandbits(32)
    model = FakeModel(lambda call: base[call.step - 1] * call.temperature, steps=3)
    steps = [e for e in _events(model, seed=seed, max_new_tokens=8, plateau_steps=0, entropy_stop=0,
                                confidence_threshold=0.0, empty_reply_retry=0, entropy_bound=3.0, sc_mode="exact")
             if isinstance(e, StepEvent)]
    rng = Lcg(seed)
    canvas0 = rng.randint(8, V)
    c1, c2 = model.calls[0], model.calls[1]
    assert torch.equal(c1.canvas, canvas0)
    assert c1.sc_logits is None and torch.allclose(c1.sc_embeds, model.embed(canvas0))  # the SC seed
    assert torch.allclose(c2.sc_logits, base[0], atol=1e-5) and c2.sc_embeds is None  # tempered logits
    noise = rng.randint(8, V)
    mask = steps[0].accepted
    assert 0 < int(mask.sum()) < 8
    assert torch.equal(c2.canvas, torch.where(mask, base[0].argmax(-1), noise))  # argmax kept, rest renoised
    assert not steps[-1].accepted.any()  # the final scheduled step accepts nothing

    model = FakeModel(lambda call: base[call.step - 1] * call.temperature, steps=3)
    _events(model, seed=seed, max_new_tokens=8, sc_seed=False, sc_mode="sparse", empty_reply_retry=0)
    assert model.calls[0].sc_embeds is None and model.calls[0].sc_logits is None
    want = sparse_soft_embed(base[0], model.embedding, model.config.embed_scale, 10.0)
    assert torch.allclose(model.calls[1].sc_embeds, want, atol=1e-4)


def test_sample_commit_draws_the_tempered_categorical_from_the_lcg():
    base = torch.randn(8, V) * 2
    seed = random.getrandbits(32)
    model = FakeModel(lambda call: base * call.temperature, steps=2)
    events = _events(model, seed=seed, max_new_tokens=8, commit="sample", entropy_bound=50.0, empty_reply_retry=0)
    rng = Lcg(seed)
    rng.randint(8, V)
    draw = categorical(torch.softmax(base, -1), rng.uniform(8))
    assert events[0].accepted.all()
    assert torch.equal(model.calls[1].canvas, draw)


def _no_control(logits):
    logits[:, sorted(CONTROL)] -= 100.0  # no stop/pad/filler argmax: the block is committed whole
    return logits


def test_freeze_keeps_accepted_tokens_and_commits_them():
    model = FakeModel(lambda call: _no_control(torch.randn(8, V) * 4) * call.temperature, steps=6)
    events = _events(model, max_new_tokens=8, freeze=True, entropy_bound=0.0, empty_reply_retry=0,
                     confidence_trim=0, plateau_steps=0, entropy_stop=0)
    steps = [e for e in events if isinstance(e, StepEvent)]
    for k in range(1, 5):
        newly = steps[k - 1].accepted
        assert newly.sum() == k  # one more position frozen per step (bound 0)
        assert torch.equal(model.calls[k].canvas[newly], model.calls[k + 1].canvas[newly])
    frozen = steps[4].accepted
    block = next(e for e in events if isinstance(e, BlockEvent))
    assert torch.equal(torch.tensor(block.tokens)[frozen], model.calls[5].canvas[frozen])


# ------------------------------------------------------------------------------ stream, errors

def test_stream_yields_steps_blocks_then_done_and_callbacks_see_the_same():
    model = FakeModel(lambda call: tempered(peaked(answer_ids(8), 40.0), call), steps=5)
    events = _events(model, max_new_tokens=20, seed=3)
    assert isinstance(events[-1], DoneEvent)
    result = events[-1].result
    blocks = [e for e in events if isinstance(e, BlockEvent)]
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert len(blocks) == len(result.steps_per_block) and len(steps) == result.forwards == sum(result.steps_per_block)
    assert sum((b.tokens for b in blocks), []) == result.tokens
    seen = {"step": 0, "block": 0}
    model = FakeModel(lambda call: tempered(peaked(answer_ids(8), 40.0), call), steps=5)
    generate(model, answer_ids(4), max_new_tokens=20, seed=3,
             on_step=lambda e: seen.__setitem__("step", seen["step"] + 1),
             on_block=lambda e: seen.__setitem__("block", seen["block"] + 1))
    assert seen == {"step": len(steps), "block": len(blocks)}


def test_bad_input_ids_are_input_errors():
    model = FakeModel(lambda call: tempered(peaked(answer_ids(8), 40.0), call))
    with pytest.raises(InputError, match="shape"):
        generate(model, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InputError, match=r"\[0, 32\)"):
        generate(model, [3, 99])
    with pytest.raises(InputError, match="empty prompt"):
        generate(model, [])


# ------------------------------------------------------------------------- real tiny checkpoint

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import CONFIGS, build_model, save

    return save(build_model(CONFIGS["gqa2_mixed"], canvas_length=8), tmp_path_factory.mktemp("gen"))


SMALL = dict(max_denoising_steps=8, max_new_tokens=20)


def test_contract_defaults_on_the_reference_model_are_deterministic_and_keep_the_cache(tiny_path):
    import diffgemma

    model = diffgemma.load(tiny_path)
    prompt = torch.randint(4, model.config.vocab_size, (6,))
    seed = random.getrandbits(32)
    cache = model.new_cache(128)
    chunks = []
    a = generate(model, prompt, cache=cache, seed=seed, on_block=lambda e: chunks.append(e.tokens), **SMALL)
    b = generate(model, prompt, seed=seed, **SMALL)
    assert a.tokens == b.tokens and a.steps_per_block == b.steps_per_block
    assert len(a.tokens) <= 20 and cache.length == 6 + len(a.tokens) and sum(chunks, []) == a.tokens
    # the cache holds exactly prompt + answer: the same prefills on a fresh cache give the same KV bytes
    fresh = model.new_cache(128)
    for ids in [prompt.tolist()] + [c for c in chunks if c]:
        model.prefill(fresh, torch.tensor(ids, dtype=torch.long))
    assert fresh.fingerprint() == cache.fingerprint()
    # and a next turn on the reused cache == the same turn on that rebuilt cache
    new = torch.randint(4, model.config.vocab_size, (3,))
    t2 = generate(model, new, cache=cache, seed=seed + 1, **SMALL)
    t2_fresh = generate(model, new, cache=fresh, seed=seed + 1, **SMALL)
    assert t2.tokens == t2_fresh.tokens and fresh.fingerprint() == cache.fingerprint()


_CHILD = """
import json, sys, torch, diffgemma
from diffgemma.generation import generate
torch.set_num_threads(1)  # same configuration as the parent (float reductions depend on the thread split)
model = diffgemma.load(sys.argv[1])
out = generate(model, json.loads(sys.argv[2]), seed=int(sys.argv[3]), sc_mode=sys.argv[4],
               max_denoising_steps=8, max_new_tokens=20)
print(json.dumps([out.tokens, out.steps_per_block, out.stop_reasons]))
"""


@pytest.mark.parametrize("sc_mode", ["exact", "sparse"])
def test_same_seed_gives_identical_tokens_across_processes(tiny_path, sc_mode):
    import diffgemma

    prompt = [random.randint(4, 90) for _ in range(5)]
    seed = random.getrandbits(32)
    here = generate(diffgemma.load(tiny_path), prompt, seed=seed, sc_mode=sc_mode, **SMALL)
    child = subprocess.run([sys.executable, "-c", _CHILD, tiny_path, json.dumps(prompt), str(seed), sc_mode],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    tokens, steps, reasons = json.loads(child.stdout.strip().splitlines()[-1])
    assert (tokens, steps, reasons) == (here.tokens, here.steps_per_block, here.stop_reasons)
    other = generate(diffgemma.load(tiny_path), prompt, seed=seed + 1, sc_mode=sc_mode, **SMALL)
    assert other.tokens != here.tokens  # the seed matters
