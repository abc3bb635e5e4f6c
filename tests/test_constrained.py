"""Constrained output: grammars made from schemas and tools (grammars.py), held over a canvas
(sampling/constraint.py), and the generation loop's reply valid by construction on the demo model."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

import diffgemma
from diffgemma import grammars
from diffgemma.errors import InputError
from diffgemma.sampling.constraint import GrammarState, ll_tokenizer
from diffgemma.tokenizer import load_tokenizer
from diffgemma.tool_calls import parse_tool_calls

llguidance = pytest.importorskip("llguidance")

DEMO = Path(diffgemma.__file__).parent / "assets" / "demo"
VOCAB, STOPS = 2048, (1, 106, 50)
TOOLS = json.loads((DEMO / "tools.json").read_text())
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO)


def matcher(tok, grammar):
    m = llguidance.LLMatcher(ll_tokenizer(tok, VOCAB, STOPS), grammar)
    assert not m.is_error(), m.get_error()
    return m


def fits(tok, grammar, text: str) -> bool:
    ids = tok.encode(text)
    return matcher(tok, grammar).validate_tokens(ids) == len(ids)


def test_json_grammar_takes_json_dumps_of_valid_instances_only(tok):
    g = grammars.json_grammar(PERSON, tok.token_to_id)
    assert fits(tok, g, json.dumps({"name": "Ada", "age": 36}))
    assert fits(tok, g, json.dumps({"name": "Ada", "age": 36, "tags": ["a", "b"]}))
    assert not fits(tok, g, json.dumps({"name": "Ada"}))  # a required key missing: the closing brace is refused
    assert not fits(tok, g, json.dumps({"name": "Ada", "age": 3.5}))
    assert not fits(tok, g, json.dumps({"name": "Ada", "age": 1, "tags": ["c"]}))
    assert not fits(tok, g, '{"name":  "Ada", "age": 1}')  # no free whitespace for a canvas to fill
    assert fits(tok, grammars.json_grammar(None, tok.token_to_id), json.dumps({"any": [1, {"x": None}]}))


def test_tool_call_grammar_names_and_arguments(tok):
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    add = '<|tool_call>call:add_numbers{a:4,b:9}<tool_call|>'
    any_tool = grammars.tool_call_grammar(TOOLS, tok.token_to_id)
    assert fits(tok, any_tool, call) and fits(tok, any_tool, add) and fits(tok, any_tool, call + add)
    assert not fits(tok, any_tool, '<|tool_call>call:get_weather{town:<|"|>Paris<|"|>}<tool_call|>')
    assert not fits(tok, any_tool, '<|tool_call>call:add_numbers{a:<|"|>4<|"|>,b:9}<tool_call|>')
    named = grammars.tool_call_grammar(TOOLS, tok.token_to_id, name="add_numbers")
    assert fits(tok, named, add) and not fits(tok, named, call) and not fits(tok, named, add + add)
    with pytest.raises(InputError, match="no offered function is named 'nope'"):
        grammars.tool_call_grammar(TOOLS, tok.token_to_id, name="nope")


def test_held_prefix_is_valid_and_grows(tok):
    """On random canvases and logits, every held prefix is a prefix the grammar allows, at least one longer than
    what the grammar allowed of the proposal as it stood, and every committed cut stays valid."""
    g = grammars.json_grammar(PERSON, tok.token_to_id)
    gen = torch.Generator().manual_seed(0)
    for fixes in (1, 3, 8):
        state = GrammarState(g, tok, VOCAB, STOPS, fixes=fixes)
        state.committed = []
        for _ in range(5):
            proposal = torch.randint(VOCAB, (64,), generator=gen)
            logits = torch.randn(64, VOCAB, generator=gen)
            held, ids = state.hold(proposal, logits)
            n = int(held.sum())
            assert held[:n].all() and not held[n:].any()
            fresh = matcher(tok, g)
            for tok_id in state_tokens(state):
                assert fresh.consume_token(tok_id)
            assert fresh.validate_tokens(ids[:n].tolist()) == n
            before = fresh.validate_tokens(proposal.tolist())
            assert n >= min(before + 1, 64)
            assert torch.equal(ids[n:], proposal[n:])  # only the held prefix is written
            assert state.cut(ids.tolist()) >= n
            keep = ids[: max(1, n // 2)].tolist()
            state.commit(keep)
            state.committed.extend(keep)


def state_tokens(state):
    return state.committed


def test_bad_grammar_and_missing_tokenizer_are_one_line_errors(tok):
    with pytest.raises(InputError, match="grammar: "):
        GrammarState("not a grammar", tok, VOCAB, STOPS)
    with pytest.raises(InputError, match="no tokenizer"):
        GrammarState(grammars.json_grammar(None, tok.token_to_id), None, VOCAB, STOPS)


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


@pytest.mark.parametrize("schema", [PERSON, {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                                              "n": {"type": "number"}},
                                             "required": ["ok", "n"]}])
def test_demo_reply_matches_the_schema_without_retry(demo, schema):
    tok = demo.tokenizer
    g = grammars.json_grammar(schema, tok.token_to_id)
    ids = tok.apply_chat_template([{"role": "user", "content": "Answer in JSON: what is 17 + 25?"}])
    out = diffgemma.generate(demo, ids, seed=0, max_new_tokens=96, grammar=g, max_denoising_steps=16)
    jsonschema.validate(json.loads(out.text), schema)
    assert out.stop_token is not None  # the grammar ended the reply


def test_demo_named_tool_choice_calls_that_tool(demo):
    tok = demo.tokenizer
    g = grammars.tool_call_grammar(TOOLS, tok.token_to_id, name="add_numbers")
    ids = tok.apply_chat_template([{"role": "user", "content": "What's the weather in Paris?"}], tools=TOOLS)
    out = diffgemma.generate(demo, ids, seed=0, max_new_tokens=64, grammar=g, max_denoising_steps=16)
    calls = parse_tool_calls(out.text)
    assert len(calls) == 1 and calls[0].ok and calls[0].name == "add_numbers", out.text
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == "add_numbers")
    jsonschema.validate(calls[0].arguments, schema)


def test_unconstrained_generation_is_untouched(demo):
    """grammar=None never reaches the constraint: the same tokens as before it existed (golden pins them too)."""
    tok = demo.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}])
    a = diffgemma.generate(demo, ids, seed=3, max_new_tokens=32, max_denoising_steps=8)
    b = diffgemma.generate(demo, ids, seed=3, max_new_tokens=32, max_denoising_steps=8, grammar="none")
    assert a.tokens == b.tokens


def test_sc_plan_before_the_hold_gives_the_same_tokens(demo, monkeypatch):
    """GrammarState.plan_first (the step's SC plan made before the hold, for the GPU to run during the walk) moves
    work in time only: the same constrained reply, token for token, as the plan made after the hold."""
    tok = demo.tokenizer
    g = grammars.json_grammar(PERSON, tok.token_to_id)
    ids = tok.apply_chat_template([{"role": "user", "content": "Describe a person in JSON."}])
    out = {}
    for first in (True, False):
        monkeypatch.setattr(GrammarState, "plan_first", first)
        out[first] = diffgemma.generate(demo, ids, seed=5, max_new_tokens=64, grammar=g, max_denoising_steps=12)
    assert out[True].tokens == out[False].tokens and out[True].forwards == out[False].forwards
