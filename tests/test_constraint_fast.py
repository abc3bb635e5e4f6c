"""The constrained step's fast paths (sampling/constraint.py) against their twins: the host's masked argmax from a
read's candidates, the device's from bitmask words, and a whole hold / generation against the reference walk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import diffgemma
from diffgemma import grammars
from diffgemma.sampling.constraint import (GrammarState, best_candidates, device_masked_argmax, device_words_mask,
                                           host_masked_argmax, mask_words, masked_argmax, words_mask)
from diffgemma.tokenizer import load_tokenizer

pytest.importorskip("llguidance")

DEMO = Path(diffgemma.__file__).parent / "assets" / "demo"
VOCAB, STOPS = 2048, (1, 106, 50)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
                                      "age": {"type": "integer", "minimum": 0},
                                      "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"},
                                      "at": {"type": "object", "properties": {"zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}},
                                             "required": ["zip"]}}, "required": ["ok", "at"]},
]


def random_words(vocab: int, density: float, gen: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """(bitmask words as llguidance writes them, the same mask as bool [vocab])."""
    bits = gen.random(vocab) < density
    return mask_words(bits), torch.from_numpy(bits)


def tied_logits(rows: int, vocab: int, gen: torch.Generator, dtype) -> torch.Tensor:
    """Logits with many ties (few distinct values), some rows with -inf entries."""
    x = torch.randint(-6, 7, (rows, vocab), generator=gen).to(dtype)
    x[0, : vocab // 2] = float("-inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_masked_argmax_matches_the_device_one_where_it_decides(dtype):
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    vocab, decided = 1000, 0
    for density in (0.002, 0.05, 0.5, 1.0):
        logits = tied_logits(16, vocab, gen, dtype)
        logits[1:8] = torch.randn(7, vocab, generator=gen).to(dtype)
        logits[8, ::5] = float("nan")
        for k in (1, 8, 64, vocab):
            top = torch.topk(logits, k, dim=-1)
            ids, values = top.indices.numpy(), top.values.double().numpy()
            for r in range(logits.shape[0]):
                words, allowed = random_words(vocab, density, rng)
                t = host_masked_argmax(ids[r], values[r], words, vocab)
                if t is not None:
                    decided += 1
                    assert t == masked_argmax(logits[r], allowed), (density, k, r)
                elif k == vocab and allowed.any() and not logits[r].isnan().any():
                    pytest.fail("every candidate at hand: the host must decide")
    assert decided > 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_stage_candidates_are_a_top_k(dtype):
    """best_candidates over segments gives a top k: the values, sorted, are torch.topk's; the ids hold them; and the
    host's masked argmax from them is the reference's wherever it decides."""
    rng, gen = np.random.default_rng(4), torch.Generator().manual_seed(4)
    vocab, decided = 4096, 0
    logits = tied_logits(12, vocab, gen, dtype)
    logits[1:6] = torch.randn(5, vocab, generator=gen).to(dtype)
    logits[6, ::9] = float("nan")
    logits[7] = float("-inf")
    for k, segment in ((8, 256), (32, 512), (1, 64), (32, 4096)):
        values, ids = best_candidates(logits, k, segment)
        want = torch.topk(logits, k, dim=-1).values
        assert torch.equal(values.sort(dim=-1).values.nan_to_num(), want.sort(dim=-1).values.nan_to_num()), (k, segment)
        assert torch.equal(logits.gather(1, ids).nan_to_num(), values.nan_to_num())
        assert all(len(set(r)) == k for r in ids.tolist())
        for r in range(logits.shape[0]):
            words, allowed = random_words(vocab, 0.3, rng)
            t = host_masked_argmax(ids[r].numpy(), values[r].double().numpy(), words, vocab)
            decided += t is not None
            assert t is None or t == masked_argmax(logits[r], allowed), (k, segment, r)
    assert decided > 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_masked_argmax_and_words_mask_match_the_reference(dtype):
    rng, gen = np.random.default_rng(1), torch.Generator().manual_seed(1)
    vocab = 3000  # not a multiple of 32: the last word's padding bits are never tokens
    logits = tied_logits(6, vocab, gen, dtype)
    logits[3, :] = float("-inf")  # every allowed value -inf: the reference's own answer
    logits[4, ::7] = float("nan")  # NaN scores as the best, as torch.argmax takes it
    for density in (0.0, 0.001, 0.01, 0.3, 1.0):
        for r in range(logits.shape[0]):
            words, allowed = random_words(vocab, density, rng)
            assert torch.equal(words_mask(words, vocab, "cpu"), allowed)
            assert torch.equal(device_words_mask(words, vocab, "cpu"), allowed)
            want = masked_argmax(logits[r], allowed)
            for sparse_words in (0, 4, 256):
                assert device_masked_argmax(logits[r], words, vocab, sparse_words) == want, (density, r)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO)


@pytest.mark.parametrize("candidates", [0, 1, 16, VOCAB])
def test_hold_matches_the_reference_walk(tok, candidates, monkeypatch):
    """Random proposals and logits (the grammar corrects nearly every position): the fast hold holds the same prefix
    with the same tokens as the reference one, step after step, with commits between."""
    gen = torch.Generator().manual_seed(3)
    for schema in SCHEMAS:
        g = grammars.json_grammar(schema, tok.token_to_id)
        fast, ref = GrammarState(g, tok, VOCAB, STOPS, fixes=4), GrammarState(g, tok, VOCAB, STOPS, fixes=4)
        fast.candidates, ref.reference = candidates, True
        for step in range(6):
            proposal = torch.randint(VOCAB, (48,), generator=gen)
            logits = torch.randn(48, VOCAB, generator=gen).to(torch.bfloat16)
            close_from = 20 if step == 5 else None
            held_f, ids_f = fast.hold(proposal, logits, close_from)
            held_r, ids_r = ref.hold(proposal, logits, close_from)
            assert torch.equal(held_f, held_r) and torch.equal(ids_f, ids_r), (schema, step)
            n = int(held_f.sum())
            keep = ids_f[: max(1, n // 2)].tolist()
            fast.commit(keep)
            ref.commit(keep)
        assert fast.timings["holds"] == 6 and fast.timings["read_s"] > 0


def reproposed(held, ids, noise, gen, change: bool):
    """A step's proposal as a model that keeps what it sees gives it: the last held tokens again (one of them changed
    where `change`), noise elsewhere."""
    if held is None:
        return noise
    proposal = torch.where(held, ids, noise)
    n = int(held.sum())
    if change and n:
        proposal[int(torch.randint(n, (), generator=gen))] = int(torch.randint(VOCAB, (), generator=gen))
    return proposal


@pytest.mark.parametrize("candidates,rows,segment", [(0, 16, 0), (16, 4, 0), (VOCAB, 48, 0), (32, 48, 256)])
def test_resumed_walks_match_the_reference(tok, candidates, rows, segment):
    """Proposals that re-propose the last held prefix (now and then with a token changed): the fast walk resumes from
    its last matcher rolled back to the common prefix, and holds the reference walk's tokens, with commits between and
    a budget-short step."""
    gen = torch.Generator().manual_seed(7)
    resumed, stopped = 0, 0
    for schema in SCHEMAS + [{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]:
        g = grammars.json_grammar(schema, tok.token_to_id)
        fast, ref = GrammarState(g, tok, VOCAB, STOPS, fixes=3), GrammarState(g, tok, VOCAB, STOPS, fixes=3)
        fast.candidates, fast.candidate_rows, fast.topk_segment, ref.reference = candidates, rows, segment, True
        held = ids = None
        for step in range(14):
            proposal = reproposed(held, ids, torch.randint(VOCAB, (48,), generator=gen), gen, step % 3 == 2)
            logits = torch.randn(48, VOCAB, generator=gen).to(torch.bfloat16)
            close_from = 30 if step == 13 else None
            held, ids = fast.hold(proposal, logits, close_from)
            held_r, ids_r = ref.hold(proposal, logits, close_from)
            assert torch.equal(held, held_r) and torch.equal(ids, ids_r), (schema, step)
            stopped += fast._last is not None and fast._last[0].is_stopped()  # the next walk rolls a stop back
            if step % 5 == 4:
                keep = ids[: max(1, int(held.sum()) // 2)].tolist()
                fast.commit(keep)
                ref.commit(keep)
                held = None
        resumed += fast.timings["resumed"]
    assert resumed > 10 and stopped > 0


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


def test_demo_generation_is_the_reference_walks(demo, monkeypatch):
    """The demo model under a grammar gives the reference walk's tokens, a budget short enough to close included."""
    tok = demo.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Answer in JSON: what is 17 + 25?"}])
    runs = [(grammars.json_grammar(s, tok.token_to_id), 48) for s in SCHEMAS]
    tools = json.loads((DEMO / "tools.json").read_text())
    runs.append((grammars.tool_call_grammar(tools, tok.token_to_id, name="add_numbers"), 16))

    def tokens():
        return [diffgemma.generate(demo, ids, seed=1, max_new_tokens=n, grammar=g, max_denoising_steps=8).tokens
                for g, n in runs]

    fast = tokens()
    monkeypatch.setattr(GrammarState, "reference", True)
    assert fast == tokens()


def test_candidates_that_decide_nothing_back_off(tok, monkeypatch):
    """Where the read's candidates decide none of a walk's choices, the next 1, 2, 4 .. holds read none (no top-k),
    any decision starts over, and the tokens stay the reference walk's throughout."""
    from diffgemma.sampling import constraint

    tops = []
    real_topk = torch.topk
    monkeypatch.setattr(constraint.torch, "topk", lambda *a, **k: tops.append(1) or real_topk(*a, **k))
    monkeypatch.setattr(constraint, "host_masked_argmax", lambda *a: None)  # candidates never decide
    g = grammars.json_grammar(SCHEMAS[0], tok.token_to_id)
    fast, ref = GrammarState(g, tok, VOCAB, STOPS, fixes=4), GrammarState(g, tok, VOCAB, STOPS, fixes=4)
    ref.reference = True
    gen = torch.Generator().manual_seed(5)
    read = []
    for _ in range(10):
        proposal = torch.randint(VOCAB, (32,), generator=gen)
        logits = torch.randn(32, VOCAB, generator=gen)
        n = len(tops)
        a, b = fast.hold(proposal, logits), ref.hold(proposal, logits)
        read.append(len(tops) > n)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert read == [True, False, True, False, False, True, False, False, False, False]
    fast._back_off(2, 1)  # a decision: the next failure skips one hold again
    fast._skip = 0
    fast._back_off(2, 2)
    assert fast._skip == 1
