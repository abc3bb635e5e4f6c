"""The server as OpenAI clients see it: the official `openai` client (and LangChain, when installed) over real HTTP
against `diffgemma serve`'s app on the demo model. Every response and chunk is parsed by the client's own models
and, from its raw JSON, validated again; every error path comes back as the client's exception with an
OpenAI-shaped body."""

import json
import logging
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.server import structured  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.commands import listen, served_name  # noqa: E402
from diffgemma.server.openai_fields import Limits  # noqa: E402
from diffgemma.server.protocol import parse_chat_request  # noqa: E402
from diffgemma.server.reply_text import final_message, reply_token_count  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]
SUM = [{"role": "user", "content": "What is 17 + 25?"}]
KEY = "sk-test"


class LiveServer:
    """create_app over a Worker, served by uvicorn on a free loopback port in a thread."""

    def __init__(self, model, **app_kw):
        base = GenerationSettings.resolve(model.generation_config, env={})
        self.worker = Worker(model, slots=2, max_tokens=1024)
        self.name = served_name(model)
        app = create_app(self.worker, model.tokenizer, self.name, base, api_key=KEY,
                         limits=Limits(max_denoising_steps=64), **app_kw)
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.02)
            assert self.thread.is_alive(), "the server did not start"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        self.worker.close()


@pytest.fixture(scope="module")
def live():
    s = LiveServer(diffgemma.load(), fresh_seed=True)
    yield s
    s.close()


def chat_raw(live, **kw) -> tuple[ChatCompletion, dict]:
    """A chat completion parsed by the client, and its raw JSON validated by the client's model on its own."""
    raw = live.client.chat.completions.with_raw_response.create(model=live.name, **kw)
    body = raw.http_response.json()
    ChatCompletion.model_validate(body)
    return raw.parse(), body


def stream(live, **kw) -> list[ChatCompletionChunk]:
    chunks = list(live.client.chat.completions.create(model=live.name, stream=True, **kw))
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump())
    return chunks


def joined(chunks) -> dict:
    text = {"content": "", "reasoning_content": ""}
    calls, finish = [], None
    for c in chunks:
        for choice in c.choices:
            d = choice.delta
            text["content"] += d.content or ""
            text["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
            calls += d.tool_calls or []
            finish = choice.finish_reason or finish
    return dict(text, tool_calls=calls, finish_reason=finish)


# ------------------------------------------------------------------------------------------- answers

def test_chat_with_a_seed_is_repeatable_and_without_one_is_fresh(live):
    a, body = chat_raw(live, messages=SUM, seed=7)
    b, _ = chat_raw(live, messages=SUM, seed=7)
    assert a.object == "chat.completion" and a.model == live.name and a.choices[0].finish_reason == "stop"
    assert a.choices[0].message.content == b.choices[0].message.content == "42"
    assert body["diffgemma"]["seed"] == 7
    u = a.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens < 64
    seeds = {chat_raw(live, messages=SUM, max_tokens=4)[1]["diffgemma"]["seed"] for _ in range(3)}
    assert len(seeds) == 3  # a retry without a seed is a new draw; the response says which


def test_stream_adds_up_to_the_reply(live):
    whole, _ = chat_raw(live, messages=SUM, seed=3)
    chunks = stream(live, messages=SUM, seed=3, stream_options={"include_usage": True})
    got = joined(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert got["content"] == whole.choices[0].message.content
    assert got["finish_reason"] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_tools_round_trip(live):
    first, _ = chat_raw(live, messages=WEATHER, tools=TOOLS, seed=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    history = WEATHER + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 17})}]
    second, _ = chat_raw(live, messages=history, tools=TOOLS, seed=0)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    assert "<|" not in (second.choices[0].message.content or "")
    streamed = joined(stream(live, messages=WEATHER, tools=TOOLS, seed=0))
    assert [c.function.name for c in streamed["tool_calls"]] == ["get_weather"]
    assert streamed["finish_reason"] == "tool_calls"


def _valid_call(call) -> dict:
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_calls_a_tool_or_says_it_could_not(live, choice):
    """A required (or named) call: the reply is a well-formed call to an offered tool, valid against its schema, or
    an explicit 422 after the regenerations; never text."""
    try:
        got, body = chat_raw(live, messages=SUM, tools=TOOLS, tool_choice=choice, seed=0)
    except openai.UnprocessableEntityError as e:
        assert e.body["code"] == "tool_choice_failed" and e.body["param"] == "tool_choice"
        return
    c = got.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        _valid_call(call)
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
    assert 1 <= body["diffgemma"]["attempts"] <= structured.FORMAT_ATTEMPTS


def test_named_tool_choice_on_the_weather_question(live):
    """The demo answers the weather question with get_weather; named get_weather, it is that call exactly."""
    got, _ = chat_raw(live, messages=WEATHER, tools=TOOLS, seed=0,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = got.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and _valid_call(call) == {"city": "Paris"}
    streamed = joined(stream(live, messages=WEATHER, tools=TOOLS, seed=0, tool_choice="required"))
    assert [c.function.name for c in streamed["tool_calls"]] == ["get_weather"]


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}])
@pytest.mark.parametrize("streamed", [False, True])
def test_structured_output_is_valid_json_or_an_explicit_error(live, fmt, streamed):
    try:
        if streamed:
            content = joined(stream(live, messages=SUM, response_format=fmt, seed=0, max_tokens=32))["content"]
        else:
            content = chat_raw(live, messages=SUM, response_format=fmt, seed=0, max_tokens=32)[0] \
                .choices[0].message.content
    except openai.UnprocessableEntityError as e:
        assert e.body["code"] == "response_format_failed" and e.body["param"] == "response_format"
        assert "attempt" in e.body["message"]
        return
    value = json.loads(content)
    if fmt["type"] == "json_schema":
        jsonschema.validate(value, SCHEMA)
    else:
        assert isinstance(value, dict)


def test_checked_reply_regenerates_with_a_bumped_seed():
    """The check-and-regenerate loop on its own: each attempt one seed further; the first passing reply stands, or
    the last problem is reported."""
    import asyncio

    replies = iter(['{"answer": "x"}', "not json", '{"answer": 42}'])
    seeds = []

    async def generate(settings):
        seeds.append(settings.seed)
        return 0, next(replies)

    fmt = structured.parse_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})

    def run(attempts):
        return asyncio.run(structured.checked(generate, GenerationSettings(seed=2**64 - 2),
                                              lambda r: ({"content": r}, []),
                                              lambda m, c: fmt.problem(m["content"]), attempts))

    *_, used, problem = run(2)
    assert (used, seeds) == (2, [2**64 - 2, 2**64 - 1]) and "not valid JSON" in problem
    *_, message, _, used, problem = run(1)
    assert (message, used, problem) == ({"content": '{"answer": 42}'}, 1, None)
    assert fmt.problem('{"answer": 42, "extra": 1}').startswith("the reply does not match the schema")
    assert structured.parse_response_format({"type": "json_object"}).problem("[1]").endswith("not an object (list)")


def test_reasoning_effort_turns_thinking_on_and_off(live):
    base = GenerationSettings()
    for effort, think in (("none", False), ("minimal", False), ("low", True), ("high", True)):
        assert parse_chat_request({"messages": SUM, "reasoning_effort": effort}, "m", base).think is think
    got, _ = chat_raw(live, messages=[{"role": "user", "content": "What is 12 + 30 + 7?"}], reasoning_effort="high",
                      seed=0)
    assert (got.choices[0].message.model_extra or {}).get("reasoning_content")
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        live.client.chat.completions.create(model=live.name, messages=SUM, reasoning_effort="high",
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})


def test_no_markup_in_content(live):
    """Thinking off, the demo opens its reply with a thought it never opened the channel for: the text before the
    channel's close is reasoning, not content, streamed or not; and no call or channel markup reaches content."""
    prompt = [{"role": "user", "content": "What is 12 + 30 + 7?"}]
    got, _ = chat_raw(live, messages=prompt, seed=0)
    msg = got.choices[0].message
    assert msg.content == "49" and "42" in msg.model_extra["reasoning_content"]
    s = joined(stream(live, messages=prompt, seed=0))
    assert (s["content"], s["reasoning_content"]) == (msg.content, msg.model_extra["reasoning_content"])
    none, _ = chat_raw(live, messages=WEATHER, tools=TOOLS, tool_choice="none", seed=0)
    assert none.choices[0].message.tool_calls is None and "<|" not in none.choices[0].message.content


def test_a_call_outside_the_offered_tools_is_not_a_tool_call(model_tokenizer):
    """Validated against the offered tools: an unknown function, or arguments against its schema, is no call."""
    tok = model_tokenizer
    ids = tok.encode('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>')
    ok, calls = final_message(tok, ids, True, tools=TOOLS)
    assert [c.name for c in calls] == ["get_weather"] and ok["content"] is None
    only_time = [t for t in TOOLS if t["function"]["name"] == "get_time"]
    msg, calls = final_message(tok, ids, True, tools=only_time)
    assert calls == [] and msg["content"] == "" and "tool_calls" not in msg
    bad = tok.encode('Sure.<|tool_call>call:get_weather{town:<|"|>Paris<|"|>}<tool_call|>')
    msg, calls = final_message(tok, bad, True, tools=TOOLS)
    assert calls == [] and msg["content"] == "Sure."
    two = ids + ids
    assert len(final_message(tok, two, True, tools=TOOLS)[1]) == 2
    assert len(final_message(tok, two, True, tools=TOOLS, parallel=False)[1]) == 1


def test_tool_validate_regenerates_a_call_against_the_schema():
    """With --tool-validate N, a call that parses but breaks the offered function's schema is written again (seed
    bumped) up to N times; one that still does not fit is left out: no tool_calls, no markup in content."""
    strict = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]+$"}}, "required": ["city"]}}}]
    s = LiveServer(diffgemma.load(), tool_validate=2)
    try:
        got, body = chat_raw(s, messages=WEATHER, tools=strict, seed=0)
        ok, ok_body = chat_raw(s, messages=WEATHER, tools=TOOLS, seed=0)
    finally:
        s.close()
    assert body["diffgemma"]["attempts"] == 3
    msg = got.choices[0].message
    assert msg.tool_calls is None and "<|" not in msg.content and got.choices[0].finish_reason == "stop"
    assert ok_body["diffgemma"]["attempts"] == 1 and ok.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_usage_leaves_padding_out(model_tokenizer):
    tok = model_tokenizer
    assert reply_token_count(tok, [tok.pad_id] * 60 + [5, 6]) == 2
    assert reply_token_count(tok, [tok.filler_id, tok.pad_id]) == 0


@pytest.fixture(scope="module")
def model_tokenizer():
    return diffgemma.load().tokenizer


def test_completions(live):
    fast = {"diffgemma": {"max_denoising_steps": 8, "empty_reply_retry": 0}}
    raw = live.client.completions.with_raw_response.create(model=live.name, prompt="The sky is", max_tokens=8,
                                                           seed=1, extra_body=fast)
    Completion.model_validate(raw.http_response.json())
    got = raw.parse()
    assert got.object == "text_completion" and got.choices[0].finish_reason in ("stop", "length")
    assert got.usage.completion_tokens <= 8
    pieces = list(live.client.completions.create(model=live.name, prompt="The sky is", max_tokens=8, seed=1,
                                                 stream=True, extra_body=fast))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == got.choices[0].text


def test_models(live):
    (card,) = live.client.models.list().data
    assert card.id == live.name
    got = live.client.models.retrieve(live.name)
    assert isinstance(got, Model) and got.id == live.name and got.owned_by == "diffgemma"
    with pytest.raises(openai.NotFoundError) as e:
        live.client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


IGNORED = dict(temperature=0.3, top_p=0.9, frequency_penalty=0.1, presence_penalty=0.1, logit_bias={"50256": -100},
               user="u1", metadata={"k": "v"}, store=False, service_tier="auto", prompt_cache_key="c1",
               safety_identifier="s1", verbosity="low", modalities=["text"], parallel_tool_calls=True,
               stream_options=None, max_completion_tokens=40,
               extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1})


def test_openai_fields_are_accepted_and_ignored_once(live, caplog, monkeypatch):
    from diffgemma.server import openai_fields

    monkeypatch.setattr(openai_fields, "_noted", set())  # as in a fresh process
    caplog.set_level(logging.INFO, logger="diffgemma.server")
    plain, _ = chat_raw(live, messages=SUM, seed=5, max_completion_tokens=40)
    got, _ = chat_raw(live, messages=SUM, seed=5, **IGNORED)
    assert got.choices[0].message.content == plain.choices[0].message.content
    chat_raw(live, messages=SUM, seed=5, **IGNORED)
    ignored = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert len(ignored) == len(set(ignored)) and any("'logit_bias'" in m for m in ignored)


# ------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kw,param,needle", [
    (dict(extra_body={"temperatur": 1}), "temperatur", "unknown field(s) ['temperatur']"),
    (dict(n=2), "n", "only 1"),
    (dict(logprobs=True), "logprobs", "not supported"),
    (dict(modalities=["text", "audio"]), "modalities", "only ['text']"),
    (dict(functions=[{"name": "f", "parameters": {}}]), "functions", "send `tools`"),
    (dict(reasoning_effort="maximum"), "reasoning_effort", "expected one of"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
     "response_format", "not a valid JSON schema"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch"}}), "tool_choice",
     "'launch' is not among the offered tools"),
    (dict(tool_choice="required"), "tool_choice", "offers no tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]), "tools",
     "tools[0].function.parameters: not a valid JSON schema"),
    (dict(extra_body={"diffgemma": {"canvas_length": 100000}}), "diffgemma", "canvas_length 100000: over"),
    (dict(extra_body={"diffgemma": {"max_denoising_steps": 5000}}), "diffgemma", "max_denoising_steps 5000: over"),
    (dict(extra_body={"diffgemma": {"entropy_bond": 1}}), "diffgemma", "unknown setting 'entropy_bond'"),
    (dict(stop=["x"] * 17), "stop", "17 stop texts"),
    (dict(max_tokens=10**6), "messages", "over this server's context"),
])
def test_bad_requests_are_400_naming_the_field(live, kw, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        live.client.chat.completions.create(model=live.name, messages=SUM, **kw)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param and needle in err["message"], err


def test_every_error_body_is_openai_shaped(live):
    h = {"Authorization": f"Bearer {KEY}"}
    deep = "[" * 100_000 + "]" * 100_000
    cases = [
        ("GET", "/v1/nowhere", None, h, 404),
        ("GET", "/v1/chat/completions", None, h, 405),
        ("POST", "/v1/chat/completions", "{not json", h, 400),
        ("POST", "/v1/chat/completions", deep, h, 400),
        ("POST", "/v1/chat/completions", '{"messages": ' + deep + "}", h, 400),
        ("POST", "/v1/completions", json.dumps({"prompt": [10**9]}), h, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": SUM, "model": "gpt-4o"}), h, 404),
        ("POST", "/v1/chat/completions", json.dumps({"messages": SUM}), {"Authorization": "Bearer nope"}, 401),
        ("GET", "/v1/models", None, {}, 401),
    ]
    with httpx.Client(base_url=live.url, timeout=60) as http:
        for method, path, body, headers, status in cases:
            r = http.request(method, path, content=body, headers=headers)
            assert r.status_code == status, (path, r.text[:200])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (path, err)
        for scheme in ("bearer", "BEARER", "Bearer"):
            assert http.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ------------------------------------------------------------------------------------------- LangChain

def test_langchain_tools_and_structured_output(live):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    # the step and re-roll budgets bound the failing structured attempts, which otherwise run every step
    llm = lc.ChatOpenAI(base_url=live.url + "/v1", api_key=KEY, model=live.name, max_retries=0, seed=0,
                        max_completion_tokens=32,
                        extra_body={"diffgemma": {"max_denoising_steps": 8, "empty_reply_retry": 0}})
    bound = llm.bind_tools(TOOLS)
    first = bound.invoke([HumanMessage(WEATHER[0]["content"])])
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    second = bound.invoke([HumanMessage(WEATHER[0]["content"]), first,
                           ToolMessage(json.dumps({"temperature": 17}), tool_call_id=call["id"])])
    assert isinstance(second.content, str) and "<|" not in second.content
    for method in ("json_schema", "function_calling"):
        structured_llm = llm.with_structured_output(SCHEMA | {"title": "Sum", "description": "the sum"},
                                                    method=method)
        try:
            value = structured_llm.invoke("What is 17 + 25? Answer as JSON.")
        except openai.UnprocessableEntityError as e:
            assert e.body["code"] in ("response_format_failed", "tool_choice_failed")
            continue
        jsonschema.validate(value, SCHEMA)


def test_a_drawn_seed_is_journaled_and_replays(tmp_path):
    """A request without a seed gets a fresh one: the response names it and the op-log records it, so the request
    can be replayed exactly (sending that seed gives the same reply)."""
    from fastapi.testclient import TestClient

    from diffgemma import oplog

    model = diffgemma.load()
    log = oplog.OpLog(tmp_path, oplog.header(model, 1, 512))
    worker = Worker(model, slots=1, max_tokens=512, log=log)
    app = create_app(worker, model.tokenizer, "m", GenerationSettings.resolve(model.generation_config, env={}),
                     fresh_seed=True)
    try:
        with TestClient(app) as http:
            first = http.post("/v1/chat/completions", json={"messages": SUM, "max_tokens": 8}).json()
            seed = first["diffgemma"]["seed"]
            again = http.post("/v1/chat/completions", json={"messages": SUM, "max_tokens": 8, "seed": seed}).json()
    finally:
        worker.close()
        log.close()
    ops = [r for r in oplog.read(log.path) if r.get("op") == "generate"]
    assert [op["settings"]["seed"] for op in ops] == [seed, seed]
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
