"""Checked replies (response_format, a forced tool call) with a scripted generation: every branch on purpose.

The demo model rarely fails a check, so its tests see one branch; here a stub worker answers each attempt with
a scripted reply and records the seed it was asked for. Attempts 2, 3 and 4 each get their own seed (the
request's plus 1, 2, 3); a reply passing at attempt k is returned with attempts=k; one still failing after the
last attempt is a 422 naming what failed, streamed or not; a named tool_choice answered with the named call
plus another is regenerated, never returned.
"""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jsonschema")

from fastapi.testclient import TestClient  # noqa: E402

from diffgemma.events import DoneEvent, StartEvent  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.structured import FORMAT_ATTEMPTS  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402
from diffgemma.tokenizer import Tokenizer  # noqa: E402

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
SUM = [{"role": "user", "content": "What is 17 + 25?"}]
SEED = 1000
WEATHER_CALL = 'city:<|"|>Paris<|"|>}<tool_call|>'  # what follows the forced `<|tool_call>call:get_weather{`
TIME_CALL = '<|tool_call>call:get_time{city:<|"|>Oslo<|"|>}<tool_call|>'  # well-formed, valid: another function


class _Job:
    def __init__(self, events):
        self.events = list(events)

    async def aget(self):
        return self.events.pop(0)

    def get(self, timeout=None):
        return self.events.pop(0)

    def cancel(self):
        pass


class ScriptedWorker:
    """A Worker stand-in: attempt k's reply is replies[k] (the last one repeats); the seeds asked for are kept."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.seeds = tokenizer, list(replies), []
        self.model, self.max_tokens = SimpleNamespace(), 4096

    def submit(self, ids, settings, *args, **kw):
        text = self.replies[min(len(self.seeds), len(self.replies) - 1)]
        self.seeds.append(settings.seed)
        result = SimpleNamespace(tokens=self.tokenizer.encode(text),
                                 stop_token=self.tokenizer.turn_end_id, stop_string=None)
        return _Job([StartEvent(cached_tokens=0, prefill_tokens=len(ids)), DoneEvent(result)])


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(embedded_model_path())


def post(tok, replies, **body):
    worker = ScriptedWorker(tok, replies)
    client = TestClient(create_app(worker, tok, "m", GenerationSettings()))
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": SUM, "seed": SEED, **body})
    return r, worker.seeds


def streamed_content(r) -> str:
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
    return "".join(json.loads(ln)["choices"][0]["delta"].get("content") or "" for ln in lines if
                   json.loads(ln)["choices"])


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
FORMATS = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}]


@pytest.mark.parametrize("fmt", FORMATS, ids=["json_object", "json_schema"])
@pytest.mark.parametrize("passes_at", [1, 3, 4])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_passing_at_attempt_k(tok, fmt, passes_at, stream):
    bad = ["42", '{"answer": "forty-two"}' if fmt["type"] == "json_schema" else "[1, 2]", "{not json"]
    replies = [bad[k % len(bad)] for k in range(passes_at - 1)] + ['{"answer": 42}']
    r, seeds = post(tok, replies, response_format=fmt, stream=stream)
    assert r.status_code == 200, r.text
    assert seeds == [SEED + k for k in range(passes_at)]  # retries 2, 3 and 4 each with their own seed
    content = streamed_content(r) if stream else r.json()["choices"][0]["message"]["content"]
    assert json.loads(content) == {"answer": 42}
    if not stream:
        assert r.json()["diffgemma"]["attempts"] == passes_at


@pytest.mark.parametrize("fmt", FORMATS, ids=["json_object", "json_schema"])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_failing_every_attempt_is_a_422(tok, fmt, stream):
    r, seeds = post(tok, ["42", "{not json", "[]", '"x"'], response_format=fmt, stream=stream)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "response_format_failed" and err["param"] == "response_format"
    assert f"{FORMAT_ATTEMPTS} attempt(s)" in err["message"]
    assert seeds == [SEED, SEED + 1, SEED + 2, SEED + 3] and len(set(seeds)) == FORMAT_ATTEMPTS


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_that_never_comes_is_a_422(tok, choice):
    r, seeds = post(tok, ["The answer is 42."], tools=TOOLS, tool_choice=choice)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "tool_choice_failed" and err["param"] == "tool_choice"
    assert f"{FORMAT_ATTEMPTS} attempt(s)" in err["message"]
    assert seeds == [SEED + k for k in range(FORMAT_ATTEMPTS)]


def test_a_forced_tool_call_coming_at_the_last_attempt_is_returned(tok):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    replies = ["no", "no", "still no", WEATHER_CALL]
    r, seeds = post(tok, replies, tools=TOOLS, tool_choice=choice)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert r.json()["diffgemma"]["attempts"] == 4 and seeds == [SEED, SEED + 1, SEED + 2, SEED + 3]


def test_a_named_tool_choice_answered_with_the_named_call_plus_another_is_regenerated(tok):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r, seeds = post(tok, [WEATHER_CALL + TIME_CALL, WEATHER_CALL], tools=TOOLS, tool_choice=choice)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert seeds == [SEED, SEED + 1] and r.json()["diffgemma"]["attempts"] == 2
    # every attempt adds the other call: no reply is returned, a 422 says why
    r, seeds = post(tok, [WEATHER_CALL + TIME_CALL], tools=TOOLS, tool_choice=choice)
    assert r.status_code == 422 and "another function than 'get_weather'" in r.json()["error"]["message"]
    assert len(seeds) == FORMAT_ATTEMPTS
    # tool_choice "required" takes both calls as they are
    r, seeds = post(tok, ["call:get_weather{" + WEATHER_CALL + TIME_CALL], tools=TOOLS, tool_choice="required")
    assert r.status_code == 200, r.text
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["get_weather",
                                                                                                 "get_time"]
    assert seeds == [SEED]


def test_a_call_to_a_function_not_offered_never_fits_whatever_its_arguments():
    from diffgemma.server.structured import tool_call_problem

    for args in ({}, {"city": "Paris"}):
        problem = tool_call_problem("get_stock_price", args, TOOLS)
        assert problem is not None and "which the request did not offer" in problem, args
    assert tool_call_problem("get_weather", {"city": "Paris"}, TOOLS) is None
    assert "arguments do not match" in tool_call_problem("get_weather", {}, TOOLS)
    assert tool_call_problem("anything", {}, None) is None  # no tools offered: nothing to check against
