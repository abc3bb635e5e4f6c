"""The constrained step's fast paths on CUDA (sampling/constraint.py; skips without CUDA): the host's masked argmax
from a CUDA top-k's candidates (unsorted, ties in any order) and the device's from bitmask words give masked_argmax's
token at the real shape [256, 262144] in bf16; a hold over the full-size padded tokenizer and a demo-engine
generation under grammars give the reference walk's tokens."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("llguidance")

import diffgemma  # noqa: E402
from diffgemma import grammars  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.sampling.constraint import (GrammarState, best_candidates, device_masked_argmax,  # noqa: E402
                                           host_masked_argmax, masked_argmax)

from bench.bench_constrained import SCHEMA, padded_tokenizer  # noqa: E402

V, C = 262144, 256


def random_words(density, rng):
    bits = rng.random(V) < density
    return np.packbits(bits, bitorder="little").view("<u4"), torch.from_numpy(bits).cuda()


def test_choices_at_the_real_shape():
    rng, gen = np.random.default_rng(0), torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(C, V, device="cuda", generator=gen).to(torch.bfloat16)
    logits[: C // 2] = logits[: C // 2].mul(2).round()  # few distinct values: ties everywhere
    top = torch.topk(logits, 32, dim=-1, sorted=False)
    ids, values = top.indices.cpu().numpy(), top.values.double().cpu().numpy()
    decided = 0
    for r in range(0, C, 8):
        for density in (1e-4, 0.01, 0.5):
            words, allowed = random_words(density, rng)
            want = masked_argmax(logits[r], allowed)
            t = host_masked_argmax(ids[r], values[r], words, V)
            decided += t is not None
            assert t is None or t == want, (r, density)
            assert device_masked_argmax(logits[r], words, V) == want, (r, density)
    assert decided > 10


@pytest.mark.parametrize("segment", [4096, 16384])
def test_two_stage_candidates_at_the_real_shape(segment):
    """best_candidates in two stages on CUDA, [256, 262144] bf16 with ties: torch.topk's values, ids that hold them."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(C, V, device="cuda", generator=gen).to(torch.bfloat16)
    logits[: C // 2] = logits[: C // 2].mul(2).round()
    values, ids = best_candidates(logits, 32, segment)
    assert torch.equal(values.sort(dim=-1).values, torch.topk(logits, 32, dim=-1).values.sort(dim=-1).values)
    assert torch.equal(logits.gather(1, ids), values)


@pytest.mark.parametrize("reproposed", [False, True])
def test_hold_at_full_vocab_is_the_reference_walk(tmp_path, reproposed):
    """Random proposals, or (reproposed) the last held tokens again with noise after them and now and then one
    changed, so walks resume from the last one's matcher; every candidate setting against the reference walk."""
    tok = padded_tokenizer(V, Path(tmp_path))
    g = grammars.json_grammar(SCHEMA, tok.token_to_id)
    for candidates, rows, segment in ((32, 16, 0), (32, C, 0), (32, C, 4096), (0, 16, 0)):
        fast, ref = GrammarState(g, tok, V, (1, 106)), GrammarState(g, tok, V, (1, 106))
        fast.candidates, fast.candidate_rows, fast.topk_segment, ref.reference = candidates, rows, segment, True
        gen = torch.Generator(device="cuda").manual_seed(1)
        held = ids = None
        for step in range(10):
            proposal = torch.randint(V, (C,), device="cuda", generator=gen)
            if reproposed and held is not None:
                proposal = torch.where(held, ids, proposal)
                if step % 3 == 2 and int(held.sum()) > 1:
                    proposal[int(held.sum()) // 2] = 7
            logits = torch.randn(C, V, device="cuda", generator=gen).to(torch.bfloat16)
            close_from = 40 if step == 9 else None
            (held, ids), b = fast.hold(proposal, logits, close_from), ref.hold(proposal, logits, close_from)
            assert torch.equal(held, b[0]) and torch.equal(ids, b[1]), (candidates, rows, segment, step)
            if step % 4 == 3:
                keep = ids[: max(1, int(held.sum()) // 2)].tolist()
                fast.commit(keep)
                ref.commit(keep)
                held = None
        assert fast.timings["resumed"] > 0 or not reproposed


def test_demo_engine_generation_is_the_reference_walks(monkeypatch):
    model = diffgemma.load(None, device="cuda")
    tok = model.tokenizer
    tools = json.loads((embedded_model_path() / "tools.json").read_text())
    ids = tok.apply_chat_template([{"role": "user", "content": "Answer in JSON: what is 17 + 25?"}])
    runs = [(grammars.json_grammar(SCHEMA, tok.token_to_id), 96), (grammars.json_grammar(SCHEMA, tok.token_to_id), 24),
            (grammars.tool_call_grammar(tools, tok.token_to_id, name="add_numbers"), 48)]

    def tokens():
        return [diffgemma.generate(model, ids, seed=s, max_new_tokens=n, grammar=g, max_denoising_steps=16).tokens
                for g, n in runs for s in (0, 1)]

    fast = tokens()
    monkeypatch.setattr(GrammarState, "reference", True)
    assert fast == tokens()
