"""Which path a structured request takes (server/structured.constrain), no model run: a grammar where one expresses
the request exactly, the checked loop (with a looser grammar every valid reply fits) where none does, and the
prompt left as the chat template renders it when a grammar writes the call; the grammar helpers behind it
(grammars.unenforced, grammars.loosened)."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings as hsettings, strategies as st  # noqa: E402

from diffgemma import grammars  # noqa: E402
from diffgemma.errors import InputError  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.sampling.constraint import ll_tokenizer  # noqa: E402
from diffgemma.server import structured  # noqa: E402
from diffgemma.server.errors import RequestError  # noqa: E402
from diffgemma.server.prepare import Served, prepare_chat  # noqa: E402
from diffgemma.server.protocol import Policy  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402
from diffgemma.tokenizer import load_tokenizer  # noqa: E402

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
SUM = [{"role": "user", "content": "What is 17 + 25?"}]
VOCAB, STOPS = 2048, (1, 106, 50)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_path())


def prepared(tok, model=None, **body):
    """prepare_chat over a served model stand-in that has (or, model=SimpleNamespace(), lacks) a tokenizer."""
    model = SimpleNamespace(tokenizer=tok) if model is None else model
    served = Served(SimpleNamespace(model=model), tok, "m", GenerationSettings(), Policy())
    return prepare_chat(served, json.dumps({"messages": SUM, **body}).encode())


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def fits(tok, grammar, text):
    ids = tok.encode(text)
    m = llguidance.LLMatcher(ll_tokenizer(tok, VOCAB, STOPS), grammar)
    return m.validate_tokens(ids) == len(ids)


@pytest.mark.parametrize("body,path", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, "grammar"),
    ({"response_format": fmt({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x+$"}}})},
     "grammar"),
    ({"response_format": fmt({"type": "array", "uniqueItems": True})}, "checked"),  # llguidance lacks uniqueItems
    ({"response_format": fmt({"oneOf": [{"type": "integer"}, {"type": "number"}]})}, "checked"),  # overlapping
    ({"tools": TOOLS, "tool_choice": "required"}, "grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "grammar"),
    ({"tools": TOOLS}, None),  # auto, no strict tool: free text as before
    ({"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}}, "grammar"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "checked"),  # JSON or a call: no grammar
])
def test_the_path_each_request_takes(tok, body, path):
    prep = prepared(tok, **body)
    c = prep.constraint
    assert (c.path if c else None) == path
    assert prep.req.settings.grammar == (c.grammar if c else None)
    if path == "checked" and "response_format" in body and "tools" not in body:
        assert c.grammar is not None and "cannot be turned into a grammar" in c.why  # a looser grammar steers it


def test_strict_tools_constrain_calls_under_auto(tok):
    strict = [dict(t, function=dict(t["function"], strict=True)) for t in TOOLS]
    c = prepared(tok, tools=strict).constraint
    assert c.path == "grammar"
    assert fits(tok, c.grammar, "Let me check. " + '<|tool_call>call:get_time{city:<|"|>Oslo<|"|>}<tool_call|>')
    assert fits(tok, c.grammar, "Plain text, no call.")
    assert not fits(tok, c.grammar, '<|tool_call>call:get_time{town:<|"|>Oslo<|"|>}<tool_call|>')
    assert prepared(tok, tools=strict).req.settings.grammar == c.grammar
    served = Served(SimpleNamespace(model=SimpleNamespace(tokenizer=tok)), tok, "m", GenerationSettings(), Policy(),
               strict_tools=False)
    assert prepare_chat(served, json.dumps({"messages": SUM, "tools": strict}).encode()).constraint is None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_grammar_leaves_the_prompt_as_the_template_renders_it(tok, choice):
    """With a grammar, the forced call's opener is the grammar's to write: the prompt ids are the chat template's,
    exactly; without one (a model that cannot run a grammar) the opener goes into the prompt as before."""
    rendered = tok.apply_chat_template(SUM, tools=TOOLS, add_generation_prompt=True)
    prep = prepared(tok, tools=TOOLS, tool_choice=choice)
    assert prep.constraint.path == "grammar" and prep.prefix == [] and prep.ids == rendered
    old = prepared(tok, model=SimpleNamespace(), tools=TOOLS, tool_choice=choice)
    assert old.constraint.path == "checked" and old.constraint.grammar is None
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    assert old.prefix == tok.encode(structured.forced_call_text(name)) and old.ids == rendered + old.prefix


def test_a_grammar_of_the_request_and_of_its_format_is_a_400(tok):
    with pytest.raises(RequestError, match="diffgemma.grammar"):
        prepared(tok, response_format={"type": "json_object"},
                 diffgemma={"grammar": grammars.json_grammar(None, tok.token_to_id)})


def test_unenforced_keywords_send_tools_to_the_checked_path(tok):
    bounded = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3}, "s": {"type": "string",
                                                                                       "pattern": "^a$"}},
        "required": ["n"]}}}]
    assert grammars.unenforced(bounded[0]["function"]["parameters"]) == {"minimum", "pattern"}
    with pytest.raises(InputError, match=r"does not enforce \['minimum', 'pattern'\]"):
        grammars.tool_call_grammar(bounded, tok.token_to_id, exact=True)
    c = prepared(tok, tools=bounded, tool_choice="required").constraint
    assert c.path == "checked" and c.grammar is not None  # calls of f, their values free where unenforced
    assert fits(tok, c.grammar, "<|tool_call>call:f{n:1}<tool_call|>")  # minimum is left to the check
    for schema in TOOLS:
        assert grammars.unenforced(schema["function"]["parameters"]) == set()
    assert grammars.unenforced({"type": "object", "required": ["x"]}) == {"required"}  # undeclared: never written
    assert grammars.unenforced({"enum": [[1], [2]]}) == {"enum"}
    assert grammars.unenforced({"anyOf": [{"type": "string"}], "minLength": 2}) == {"anyOf", "minLength"}


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-50, 50), st.text("abc", max_size=3))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.sampled_from("xyz"), inner, max_size=3)),
                       max_leaves=8)
_LOOSENED = [
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 1}]},
    {"type": "object", "properties": {"x": {"not": {"type": "null"}}}, "dependentRequired": {"x": ["y"]}},
    {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    {"type": "array", "contains": {"type": "boolean"}, "minContains": 2},
]


@hsettings(max_examples=150, deadline=None)
@given(value=_VALUES, k=st.integers(0, len(_LOOSENED) - 1))
def test_a_loosened_schema_allows_everything_the_schema_does(value, k):
    schema = _LOOSENED[k]
    if jsonschema.Draft202012Validator(schema).is_valid(value):
        assert jsonschema.Draft202012Validator(grammars.loosened(schema)).is_valid(value)


def test_loosened_schemas_compile_where_the_originals_do_not(tok):
    for schema in _LOOSENED:
        with pytest.raises(InputError):
            grammars.json_grammar(schema, tok.token_to_id)
        grammars.json_grammar(grammars.loosened(schema), tok.token_to_id)
