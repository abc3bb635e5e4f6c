"""Structured output through the server on the demo model, by grammar (docs/ARCHITECTURE.md, 'Constrained
output'): 20 JSON schemas x 3 prompts parse and validate in one attempt; a named tool_choice calls that tool with
arguments fitting its schema; streamed replies too; LangChain's with_structured_output returns a model instance;
the op-log of a constrained request replays identically. (The path's choice and the grammars: the unit tests in
tests/test_structured_paths.py.)"""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from fastapi.testclient import TestClient  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma import oplog  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.replay import replay  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

from structured_cases import PROMPTS, SCHEMAS  # noqa: E402

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
FAST = {"max_denoising_steps": 8}  # the sampler's step budget: what these tests' time goes on


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


def serve(model, log=None, slots=1):
    worker = Worker(model, slots=slots, max_tokens=2048, log=log)
    app = create_app(worker, model.tokenizer, "m", GenerationSettings.resolve(model.generation_config, env={}))
    return worker, TestClient(app)


@pytest.fixture(scope="module")
def server(model):
    worker, client = serve(model)
    with client:
        yield client
    worker.close()


def chat(client, prompt, **body):
    body.setdefault("diffgemma", FAST)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "seed": 0,
                                                  **body})
    assert r.status_code == 200, r.text
    return r.json()


def schema_format(i):
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


def check_json(body, schema):
    assert body["diffgemma"]["structured"] == "grammar" and body["diffgemma"]["attempts"] == 1
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


FAST_CASES = [(i, i % len(PROMPTS)) for i in range(len(SCHEMAS))]  # every schema, one prompt each
CASES = [(i, p) for i in range(len(SCHEMAS)) for p in range(len(PROMPTS)) if (i, p) not in FAST_CASES]  # the rest


@pytest.mark.parametrize("i,p", FAST_CASES, ids=[f"s{i}-p{p}" for i, p in FAST_CASES])
def test_json_schema_reply_validates_without_retry(server, i, p):
    check_json(chat(server, PROMPTS[p], response_format=schema_format(i), max_tokens=96), SCHEMAS[i])


@pytest.mark.slow
@pytest.mark.parametrize("i,p", CASES, ids=[f"s{i}-p{p}" for i, p in CASES])
def test_json_schema_sweep_the_other_prompts(server, i, p):
    check_json(chat(server, PROMPTS[p], response_format=schema_format(i), max_tokens=96), SCHEMAS[i])


def test_json_object_reply_is_an_object(server):
    body = chat(server, PROMPTS[0], response_format={"type": "json_object"}, max_tokens=48)
    check_json(body, {"type": "object"})


@pytest.mark.parametrize("tool", [t["function"]["name"] for t in TOOLS])
@pytest.mark.parametrize("p", [0, 1])
def test_named_tool_choice_calls_that_tool(server, tool, p):
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == tool)
    body = chat(server, PROMPTS[p], tools=TOOLS, tool_choice={"type": "function", "function": {"name": tool}},
                max_tokens=48)
    assert body["diffgemma"]["structured"] == "grammar" and body["diffgemma"]["attempts"] == 1
    choice = body["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == tool
    jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])


def test_required_tool_choice_and_strict_tools_under_auto(server):
    body = chat(server, PROMPTS[0], tools=TOOLS, tool_choice="required", max_tokens=48)
    assert body["diffgemma"]["structured"] == "grammar" and body["choices"][0]["message"]["tool_calls"]
    strict = [dict(t, function=dict(t["function"], strict=True)) for t in TOOLS]
    body = chat(server, "What's the weather in Paris?", tools=strict, max_tokens=48)
    assert body["diffgemma"]["structured"] == "grammar"
    for call in body["choices"][0]["message"].get("tool_calls") or []:
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])
    plain = chat(server, "What's the weather in Paris?", tools=TOOLS, max_tokens=48)  # not strict: no grammar
    assert "structured" not in plain["diffgemma"]


def test_streamed_constrained_reply_streams_blocks_and_validates(server):
    r = server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPTS[2]}], "seed": 0, "stream": True, "max_tokens": 96,
        "response_format": schema_format(19), "diffgemma": FAST})
    assert r.status_code == 200, r.text
    chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert all(c["diffgemma"]["structured"] == "grammar" for c in chunks)
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(bool(x) for x in pieces) >= 2  # sent block by block, not held back until the end
    jsonschema.validate(json.loads("".join(x or "" for x in pieces)), SCHEMAS[19])
    # the same request whole: the same content
    whole = chat(server, PROMPTS[2], response_format=schema_format(19), max_tokens=96)
    assert whole["choices"][0]["message"]["content"] == "".join(x or "" for x in pieces)


def test_thinking_on_keeps_the_answer_valid(server):
    body = chat(server, PROMPTS[0], response_format=schema_format(0), max_tokens=96,
                chat_template_kwargs={"enable_thinking": True})
    check_json(body, SCHEMAS[0])


def test_a_schema_the_grammar_cannot_express_is_checked(server):
    """uniqueItems is not implemented by llguidance: the reply is checked (and regenerated) under a looser grammar,
    and the response says so; a 422 names the failure if no attempt fits."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True, "maxItems": 3}}, "required": ["xs"]}
    r = server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPTS[0]}], "seed": 0, "max_tokens": 48, "diffgemma": FAST,
        "response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": schema}}})
    if r.status_code == 422:
        assert r.json()["error"]["code"] == "response_format_failed"
        return
    body = r.json()
    assert body["diffgemma"]["structured"] == "checked"
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


def test_constrained_requests_replay_identically(model, tmp_path):
    log = oplog.OpLog(tmp_path, oplog.header(model, 1, 2048))
    worker, client = serve(model, log)
    try:
        with client:
            body = chat(client, PROMPTS[1], response_format=schema_format(3), max_tokens=64)
            chat(client, PROMPTS[0], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                 max_tokens=48)
    finally:
        worker.close()
        log.close()
    records = oplog.read(log.path)
    ops = [r for r in records if r.get("op") == "generate"]
    assert len(ops) == 2 and all(op["settings"]["grammar"] for op in ops)  # journaled with the settings
    done = [r for r in records if r.get("event") == "done"]
    assert model.tokenizer.decode(done[0]["tokens"]) == body["choices"][0]["message"]["content"]
    assert replay(log.path, model).ok


def test_langchain_with_structured_output_returns_a_model_instance(server):
    lc = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Weather(pydantic.BaseModel):
        """The weather in a city."""

        city: str
        temperature: int
        sky: Literal["sunny", "cloudy", "rainy"]

    llm = lc.ChatOpenAI(base_url="http://testserver/v1", api_key="none", model="m", max_retries=0, seed=0,
                        max_completion_tokens=64, http_client=server, extra_body={"diffgemma": FAST})
    for method in ("json_schema", "function_calling"):
        value = llm.with_structured_output(Weather, method=method).invoke("What's the weather in Paris?")
        assert isinstance(value, Weather), method


def test_constrained_lanes_batched_together_get_their_solo_replies(model, server):
    """Three constrained requests (two schemas and a named call) running in one continuous batch: each reply is
    the one it gets alone, and valid."""
    import threading

    bodies = [dict(response_format=schema_format(5), max_tokens=64), dict(response_format=schema_format(13),
                                                                          max_tokens=64),
              dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add_numbers"}}, max_tokens=48)]
    solo = [chat(server, PROMPTS[k], **b)["choices"][0]["message"] for k, b in enumerate(bodies)]
    worker, client = serve(model, slots=len(bodies))
    together = [None] * len(bodies)
    try:
        with client:
            start = threading.Barrier(len(bodies))

            def one(k):
                start.wait()
                together[k] = chat(client, PROMPTS[k], **bodies[k])["choices"][0]["message"]

            threads = [threading.Thread(target=one, args=(k,)) for k in range(len(bodies))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            counts = worker.metrics()["counts"]
    finally:
        worker.close()
    assert counts["canvas_steps"] > counts["forwards"]  # lanes stepped together in some rounds
    for k in range(len(bodies)):
        a, b = solo[k], together[k]
        for m in (a, b):
            for c in m.get("tool_calls") or ():
                c.pop("id")
        assert a == b, k
    jsonschema.validate(json.loads(together[0]["content"]), SCHEMAS[5])
    assert together[2]["tool_calls"][0]["function"]["name"] == "add_numbers"


def test_parallel_tool_calls_false_lets_the_grammar_write_one_call(server):
    body = chat(server, "Weather in Paris and the time in Oslo?", tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_tokens=64)
    assert body["diffgemma"]["structured"] == "grammar" and len(body["choices"][0]["message"]["tool_calls"]) == 1


def test_a_budget_too_small_for_the_grammar_is_a_422_at_once(server):
    r = server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPTS[2]}], "seed": 0, "max_tokens": 6, "diffgemma": FAST,
        "response_format": schema_format(19)})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "response_format_failed" and "1 attempt(s)" in err["message"]
    assert "max_tokens (6) ended the reply" in err["message"]
