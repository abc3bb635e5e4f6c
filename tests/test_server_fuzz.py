"""Random and mutated request bodies against the server (demo model, tiny budgets): never a 500, every error body
OpenAI-shaped, and a normal request answered after each."""

import json

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.openai_fields import CHAT, COMPLETION, Limits  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
SUM = [{"role": "user", "content": "What is 17 + 25?"}]
VALID = {
    "/v1/chat/completions": {"messages": SUM, "max_tokens": 4, "seed": 1, "tools": TOOLS, "tool_choice": "auto",
                             "stream": False, "stop": ["\n\n"], "response_format": {"type": "text"},
                             "reasoning_effort": "none", "diffgemma": {"max_denoising_steps": 4}},
    "/v1/completions": {"prompt": "The sky is", "max_tokens": 4, "seed": 1, "stream": False,
                        "diffgemma": {"max_denoising_steps": 4}},
}
FIELDS = {"/v1/chat/completions": sorted(CHAT), "/v1/completions": sorted(COMPLETION)}


@pytest.fixture(scope="module")
def client():
    model = diffgemma.load()
    # every request the fuzzer can make stays small: few steps, no re-rolls, a short reply
    base = GenerationSettings.resolve(model.generation_config, env={}).replace(
        max_new_tokens=4, max_denoising_steps=4, empty_reply_retry=0)
    worker = Worker(model, slots=1, max_tokens=512)
    app = create_app(worker, model.tokenizer, "diffgemma-demo", base, fresh_seed=True,
                     limits=Limits(canvas_length=64, max_denoising_steps=4, empty_reply_retry=0))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    worker.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


@st.composite
def mutated(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    body = dict(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "drop", "add", "deep"]))
        if action == "deep":  # inside a message, a tool or the settings
            key = draw(st.sampled_from(["messages", "tools", "diffgemma"] if "messages" in body else ["diffgemma"]))
            inner = body.get(key)
            if isinstance(inner, list) and inner and isinstance(inner[0], dict):
                body[key] = [dict(inner[0], **{draw(st.sampled_from(["role", "content", "tool_calls", "name",
                                                                      "tool_call_id", "function", "type"])):
                                               draw(json_values)})]
            elif isinstance(inner, dict):
                body[key] = dict(inner, **{draw(st.sampled_from(["seed", "canvas_length", "stop_strings",
                                                                 "entropy_bound", "semantics", "stop_ids"])):
                                           draw(json_values)})
        elif action == "set":
            body[draw(st.sampled_from(sorted(body) or ["model"]))] = draw(json_values)
        elif action == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(st.sampled_from(FIELDS[path]))] = draw(json_values)
    if isinstance(body.get("max_tokens"), int) or "max_tokens" not in body:
        body["max_tokens"] = 4  # keep any accepted request cheap
    body.pop("max_completion_tokens", None)
    return path, json.dumps(body)


@st.composite
def random_bodies(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    raw = draw(st.one_of(st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                         json_values.map(json.dumps)))
    return path, raw


def check_answer(r):
    assert r.status_code != 500 and r.status_code < 600, r.text[:300]
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            for e in events[:-1]:
                assert "error" not in json.loads(e), e
        else:
            assert json.loads(r.text)["object"] in ("chat.completion", "text_completion")
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]


def still_answers(client):
    r = client.post("/v1/chat/completions", json={"messages": SUM, "max_tokens": 4, "seed": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(case=st.one_of(mutated(), random_bodies()))
def test_no_body_breaks_the_server(client, case):
    path, raw = case
    check_answer(client.post(path, content=raw.encode("utf-8", "surrogatepass"),
                             headers={"content-type": "application/json"}))
    still_answers(client)


def test_pathological_bodies(client):
    for raw in ("[" * 100_000 + "]" * 100_000, '{"messages": ' + "{\"a\": " * 50_000 + "1" + "}" * 50_001,
                "\ufeff{}", "", "null", '{"messages": [{"role": "user", "content": "\\ud800"}]}'):
        check_answer(client.post("/v1/chat/completions", content=raw.encode("utf-8", "surrogatepass")))
    still_answers(client)
