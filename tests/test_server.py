"""The OpenAI-compatible server (diffgemma.server) on the embedded demo model: the same tokens as the library's
Session, KV reuse across requests, streaming that adds up to the whole message, tool calls both ways, refusals
by name, cancellation, and the op-log that `diffgemma replay` runs again."""

import json
import sys
import threading
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma import cli, options  # noqa: E402
from diffgemma.errors import InputError  # noqa: E402
from diffgemma.events import CancelledEvent, DoneEvent, ErrorEvent, StartEvent  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma import oplog  # noqa: E402
from diffgemma.replay import replay  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.commands import served_name  # noqa: E402
from diffgemma.server.protocol import RequestError, convert_messages, parse_chat_request  # noqa: E402
from diffgemma.server.reply_text import ReplyDeltas  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.session import Session  # noqa: E402
from diffgemma.slots import Slot  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def base(model):
    return GenerationSettings.resolve(model.generation_config, env={})


class Server:
    """A worker + app + client over the demo model, optionally logging."""

    def __init__(self, model, base, log_dir=None, slots=2, max_tokens=2048, tool_validate=0):
        self.log = oplog.OpLog(log_dir, oplog.header(model, slots, max_tokens)) if log_dir else None
        self.worker = Worker(model, slots=slots, max_tokens=max_tokens, log=self.log)
        self.client = TestClient(create_app(self.worker, model.tokenizer, served_name(model), base,
                                            tool_validate=tool_validate))

    def chat(self, messages, **body):
        r = self.client.post("/v1/chat/completions", json={"messages": messages, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, messages, **body):
        chunks = []
        with self.client.stream("POST", "/v1/chat/completions",
                                json={"messages": messages, "stream": True, **body}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        for ln in lines[:-1]:
            assert ln.startswith("data: ")
            chunks.append(json.loads(ln[6:]))
        return chunks

    def close(self):
        self.worker.close()
        if self.log is not None:
            self.log.close()


@pytest.fixture
def server(model, base):
    s = Server(model, base)
    yield s
    s.close()


# ------------------------------------------------------------------------------------- the wire format

@pytest.mark.parametrize("body,status,needle", [
    ({"messages": WEATHER, "temperatur": 1}, 400, "unknown field(s) ['temperatur']"),
    ({"messages": WEATHER, "model": "gpt-4"}, 404, "'gpt-4' is not served here; this server serves 'diffgemma-demo'"),
    ({"messages": WEATHER, "n": 2}, 400, "n: only 1"),
    ({"messages": WEATHER, "stop": ["\n", 3]}, 400, "stop: expected a non-empty string or an array of them"),
    ({"messages": WEATHER, "stop": ""}, 400, "stop: expected a non-empty string"),
    ({"messages": WEATHER, "logprobs": True}, 400, "logprobs: not supported"),
    ({"messages": WEATHER, "tool_choice": "required"}, 400, "tool_choice: a tool call is required but the request offers no tools"),
    ({"messages": WEATHER, "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": WEATHER, "stream": "yes"}, 400, "stream: expected true or false"),
    ({"messages": WEATHER, "diffgemma": {"entropy_bond": 0.2}}, 400, "entropy_bond"),
    ({"messages": WEATHER, "diffgemma": {"entropy_bound": -1}}, 400, "entropy_bound"),
    ({"messages": WEATHER, "max_tokens": 0}, 400, "max_new_tokens"),
    ({"messages": WEATHER, "chat_template_kwargs": {"add_vision": True}}, 400, "chat_template_kwargs"),
    ({"messages": []}, 400, "messages: expected a non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]: URL scheme 'x'; expected a data: URL"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role: 'robot'"),
    ({"messages": WEATHER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments: not valid JSON"),
    ({"messages": WEATHER + [{"role": "tool", "tool_call_id": "nope", "content": "17"}]}, 400,
     "tool_call_id 'nope' names no earlier assistant tool call"),
    ({"messages": WEATHER, "tools": [{"type": "function"}]}, 400, "tools[0]"),
])
def test_refusals_name_the_field(server, body, status, needle):
    r = server.client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_refusals_before_anything_runs(server):
    r = server.client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    # the template's own refusal: a tool result with no tool call before it
    r = server.client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "name": "get_weather", "content": "17"}]})
    assert r.status_code == 400 and "tool message must follow" in r.json()["error"]["message"]
    r = server.client.post("/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 5000})
    assert r.status_code == 400 and "over this server's context of 2048" in r.json()["error"]["message"]
    assert all(s is None for s in server.worker.slots)  # nothing was generated or cached


def test_messages_become_the_templates_form():
    msgs = convert_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c7", "content": '{"temperature": -3}'},
        {"role": "tool", "tool_call_id": "c7", "content": "snowing"},
    ])
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "name": "get_weather", "content": {"temperature": -3}},
        {"role": "tool", "name": "get_weather", "content": "snowing"},
    ]


def test_request_fields_become_settings(base):
    req = parse_chat_request({"messages": WEATHER, "max_completion_tokens": 40, "seed": 9, "temperature": 0.3,
                              "diffgemma": {"entropy_bound": 0.2}, "chat_template_kwargs": {"enable_thinking": True},
                              "stream": True, "stream_options": {"include_usage": True}}, "m", base)
    assert (req.settings.max_new_tokens, req.settings.seed, req.settings.entropy_bound) == (40, 9, 0.2)
    assert req.think and req.stream and req.include_usage
    assert req.settings.t_max == base.t_max  # temperature is an autoregressive knob: accepted, not applied
    with pytest.raises(RequestError):
        parse_chat_request(["not", "an", "object"], "m", base)


# ------------------------------------------------------------------------------------- generation

def test_reply_is_the_sessions_reply(server, model, base):
    """The same rendering, prefill and generation as the library's Session: the same answer, token for token."""
    for prompt in ("What is 17 + 25?", "Sort these numbers: 31 12 87 45 6"):
        got = server.chat([{"role": "user", "content": prompt}])
        reply = Session(model).ask(prompt, settings=base)
        assert got["choices"][0]["message"] == {"role": "assistant", "content": reply.answer}
        assert got["choices"][0]["finish_reason"] == "stop"
        u = got["usage"]
        assert u["completion_tokens"] == len(reply.result.tokens)
        assert u["prompt_tokens"] == reply.prefilled_tokens and u["total_tokens"] == u["prompt_tokens"] + len(
            reply.result.tokens)
    assert got["model"] == "diffgemma-demo" and got["object"] == "chat.completion"


def test_tool_call_round_trip_reuses_the_kv_cache(server, model, base):
    """A tool call goes out as OpenAI tool_calls; its result comes back as a tool message. The second request
    is served from the cache the first left (its whole prompt and reply), and answers as the Session does."""
    first = server.chat(WEATHER, tools=TOOLS)
    msg = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    result = {"temperature": 17, "condition": "cloudy"}
    second = server.chat(WEATHER + [msg, {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}],
                         tools=TOOLS)
    u1, u2 = first["usage"], second["usage"]
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"] - 1
    session = Session(model, tools=TOOLS)
    session.ask(WEATHER[0]["content"], settings=base)
    reply = session.tool_result("get_weather", result, settings=base)
    assert second["choices"][0]["message"]["content"] == reply.answer
    assert u2["prompt_tokens_details"]["cached_tokens"] == reply.reused_tokens


def test_tool_choice_none_leaves_the_call_out(server):
    """tool_choice 'none': a call the model writes anyway is neither a tool call nor content (no markup leaks)."""
    got = server.chat(WEATHER, tools=TOOLS, tool_choice="none")["choices"][0]
    assert got["finish_reason"] == "stop" and "tool_calls" not in got["message"]
    assert got["message"]["content"] == ""


@pytest.mark.parametrize("case", ["plain", "tools", "thinking"])
def test_stream_adds_up_to_the_message(server, case):
    body = {"plain": {}, "tools": {"tools": TOOLS},
            "thinking": {"chat_template_kwargs": {"enable_thinking": True}}}[case]
    messages = WEATHER if case == "tools" else [{"role": "user", "content": "What is 12 + 30 + 7?"}]
    whole = server.chat(messages, **body)
    chunks = server.stream(messages, stream_options={"include_usage": True}, **body)
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *body_chunks, last, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    text = {"content": "", "reasoning_content": ""}
    calls = []
    for c in body_chunks:
        delta = c["choices"][0]["delta"]
        for k in text:
            text[k] += delta.get(k) or ""
        calls += delta.get("tool_calls", [])
    msg = whole["choices"][0]["message"]
    assert text["content"] == (msg["content"] or "")
    assert text["reasoning_content"] == msg.get("reasoning_content", "")
    assert [c["function"] for c in calls] == [c["function"] for c in msg.get("tool_calls", [])]
    if case == "thinking":
        assert msg.get("reasoning_content"), msg  # the demo model writes a thought when asked to
    if case == "tools":
        assert calls and calls[0]["index"] == 0


SORT = [{"role": "user", "content": "Sort these numbers: 31 12 87 45 6"}]


@pytest.mark.parametrize("stop", ["45", ["nope", " 45"]])
def test_stop_ends_the_reply_where_the_stop_text_begins(server, model, base, stop):
    """OpenAI's `stop`: the reply ends at the first stop text, which it leaves out; finish_reason "stop"; the stream
    adds up to the same message; usage counts the tokens the model wrote (through the stop text), and the next turn
    reuses the slot's cache."""
    whole = server.chat(SORT)["choices"][0]["message"]["content"]
    assert whole == "6 12 31 45 87"  # the demo model's answer, which the stops below cut
    got = server.chat(SORT, stop=stop)
    choice = got["choices"][0]
    assert choice["message"]["content"] == "6 12 31" and choice["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == len(model.tokenizer.encode("6 12 31 45"))  # through the stop text
    chunks = server.stream(SORT, stop=stop)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "6 12 31" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    follow = server.chat(SORT + [choice["message"], {"role": "user", "content": "What is 17 + 25?"}])
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] >= got["usage"]["prompt_tokens"]


def test_streamed_text_never_shows_what_a_stop_text_will_cut(model):
    """Fed a reply a token at a time, the deltas hold back a tail that may grow into a stop text, and never send
    text from a stop text on: what was sent is always a prefix of the final message."""
    tok = model.tokenizer
    ids = tok.encode("6 12 31 45 87")
    for stops in (("45",), ("31 4", "1 45 8"), ("87",), ("none",)):
        deltas = ReplyDeltas(tok, False, stops)
        sent = ""
        for t in ids:
            sent += deltas.feed([t]).get("content", "")
        last, message, _ = deltas.finish()
        sent += last.get("content", "")
        want = "6 12 31 45 87"
        for s in stops:
            want = want[:want.find(s)] if s in want else want
        assert sent == message["content"] == want.strip(), stops


def test_concurrent_requests_are_served_one_at_a_time(server):
    out = {}

    def ask(key, prompt):
        out[key] = server.chat([{"role": "user", "content": prompt}])["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(["What is 17 + 25?", "What is 2 + 3?"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {0: "42", 1: "5"}


# ------------------------------------------------------------------------------------- slots, cancel, replay

def test_slot_choice(model):
    worker = Worker(model, slots=3)
    try:
        a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9, 9, 9, 9, 9]
        assert worker.pick(a) == (0, 0)  # nothing held: the first unused slot
        worker.slots[0] = Slot(None, a + [70, 71], last_used=1)
        assert worker.pick(a + [70, 71, 72]) == (0, 10)  # continues slot 0's conversation
        assert worker.pick(b) == (1, 0)  # shares 2 of slot 0's 10 tokens: a new conversation takes an unused slot
        worker.slots[1] = Slot(None, b, last_used=2)
        worker.slots[2] = Slot(None, [5, 5], last_used=3)
        assert worker.pick([1, 2, 3, 0]) == (0, 3)  # all used, none continued: the least recently used
        with pytest.raises(InputError, match="slots"):
            Worker(model, slots=0)
    finally:
        worker.close()


def test_cancel_rewinds_the_slot_to_the_prompt(model, base, tmp_path):
    s = Server(model, base, log_dir=tmp_path)
    try:
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 200."}])
        job = s.worker.submit(ids, base.replace(max_new_tokens=1024))
        assert isinstance(job.get(timeout=60), StartEvent)
        job.cancel()
        events = []
        while not events or not isinstance(events[-1], (DoneEvent, CancelledEvent, ErrorEvent)):
            events.append(job.get(timeout=60))
        assert isinstance(events[-1], CancelledEvent) and events[-1].kept == len(ids), events
        slot = s.worker.slots[0]
        assert slot.ids == ids and slot.cache.length == len(ids)
        # the next turn of that conversation is served from the slot
        again = s.chat([{"role": "user", "content": "Count from 1 to 200."}], max_tokens=16)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
    finally:
        s.close()
    records = oplog.read(s.log.path)
    assert [r["event"] for r in records if r.get("event") in ("cancelled", "done")] == ["cancelled", "done"]
    assert replay(s.log.path, model).ok


def test_replay_repeats_a_logged_session_and_finds_a_difference(model, base, tmp_path, capsys):
    s = Server(model, base, log_dir=tmp_path / "logs")
    try:
        first = s.chat(WEATHER, tools=TOOLS)
        msg = first["choices"][0]["message"]
        s.chat(WEATHER + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "sunny"}],
               tools=TOOLS)
        s.stream([{"role": "user", "content": "Sort these numbers: 31 12 87 45 6"}], diffgemma={"seed": 3})
    finally:
        s.close()
    path = s.log.path
    records = oplog.read(path)
    assert records[0]["model"] is None and records[0]["slots"] == 2  # the embedded model
    assert [r["op"] for r in records if "op" in r] == ["start", "generate", "generate", "generate"]
    assert all(isinstance(t, int) for r in records if r.get("op") == "generate" for t in r["prompt"])
    report = replay(path, model)
    assert report.ok and report.generations == 3, report.problems
    assert cli.main(["replay", str(path)]) == 0
    assert "3 generations" in capsys.readouterr().out

    lines = path.read_text().splitlines()
    k = next(i for i, ln in enumerate(lines) if json.loads(ln).get("event") == "block")
    rec = json.loads(lines[k])
    rec["tokens"][0] += 1
    lines[k] = json.dumps(rec)
    bad = tmp_path / "tampered.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    report = replay(bad, model)
    assert not report.ok and f"generation {rec['gen']}, event 1 (block): tokens logged" in report.problems[0]
    assert cli.main(["replay", str(bad)]) == 1

    (tmp_path / "notalog.jsonl").write_text('{"op": "generate"}\n')
    with pytest.raises(InputError, match="first record must be the 'start' op"):
        replay(tmp_path / "notalog.jsonl", model)


def test_serve_flags_are_checked_before_the_model_loads(capsys):
    assert cli.main(["serve", "--slots", "0"]) == 2
    assert "--slots 0: expected a positive number" in capsys.readouterr().err
    assert cli.main(["serve", "--set", "entropy_bond=1"]) == 2
    assert "entropy_bond" in capsys.readouterr().err


def test_warmed_worker_serves_a_fresh_workers_replies(model, base, tmp_path):
    """Worker.warm_up (serve --warmup) makes every slot's cache, generates in each of its context buckets and empties
    it: the requests after it get the same replies and KV reuse as on a worker that never warmed, and the op-log
    holds the requests alone, so replay needs no warm-up."""
    cold, warm = Server(model, base, max_tokens=1500), Server(model, base, max_tokens=1500, log_dir=tmp_path)
    try:
        assert warm.worker.warm_up(base) > 0
        assert all(s is not None and s.ids == [] and s.cache.length == 0 for s in warm.worker.slots)
        for s in (cold, warm):
            s.replies = [s.chat(WEATHER, tools=TOOLS), s.chat([{"role": "user", "content": "What is 17 + 25?"}])]
        for r in warm.replies + cold.replies:  # a tool call's id is random; the rest must be equal
            for c in r["choices"][0]["message"].get("tool_calls") or []:
                c.pop("id")
        assert [r["choices"] for r in warm.replies] == [r["choices"] for r in cold.replies]
        assert [r["usage"] for r in warm.replies] == [r["usage"] for r in cold.replies]
        again = warm.worker.warm_up(base)  # slots holding a conversation keep it
        assert again == 0 and [s.cache.length for s in warm.worker.slots] == [len(s.ids) for s in warm.worker.slots]
    finally:
        cold.close()
        warm.close()
    assert [r["op"] for r in oplog.read(warm.log.path) if "op" in r] == ["start", "generate", "generate"]
    assert replay(warm.log.path, model).ok


def test_a_failed_warm_up_reaches_the_caller_and_the_worker_still_serves(model, base, monkeypatch):
    s = Server(model, base, max_tokens=1100)
    try:
        def broken(*a, **k):
            raise RuntimeError("warm-up boom")

        with monkeypatch.context() as m:
            m.setattr(model, "prefill", broken)
            with pytest.raises(RuntimeError, match="warm-up boom"):
                s.worker.warm_up(base)
        assert all(slot is None or slot.cache.length == 0 for slot in s.worker.slots)
        assert s.chat([{"role": "user", "content": "What is 17 + 25?"}])["choices"][0]["message"]["content"] == "42"
    finally:
        s.close()


def no_server(monkeypatch, commands, seen: dict) -> None:
    """`diffgemma serve` up to the server itself: serve() records its arguments in `seen` instead of starting
    uvicorn (which the test extras do not install: serve checks that it imports, so a stand-in module is given)."""
    monkeypatch.setitem(sys.modules, "uvicorn", types.ModuleType("uvicorn"))
    monkeypatch.setattr(commands, "serve", lambda model, settings, **kw: seen.update(kw) or 0)


@pytest.mark.parametrize("flag,device,warms", [("auto", "cpu", False), ("auto", "cuda", True), ("on", "cpu", True),
                                               ("off", "cuda", False)])
def test_serve_warms_up_on_cuda_unless_told(monkeypatch, flag, device, warms):
    from diffgemma.server import commands

    fake = SimpleNamespace(tokenizer=object(), generation_config={}, path=None, config=SimpleNamespace(max_positions=None),
                           embedding=SimpleNamespace(device=torch.device(device)))
    monkeypatch.setattr(options, "load_model", lambda args: fake)
    seen = {}
    no_server(monkeypatch, commands, seen)
    assert cli.main(["serve", "--warmup", flag, "--served-name", "m"]) == 0
    assert seen["warmup"] is warms


def test_serve_refuses_a_bad_warmup_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--warmup", "sometimes"])
    assert "--warmup" in capsys.readouterr().err


def test_serve_context_defaults_to_the_models_and_refuses_more(monkeypatch, capsys):
    """--max-tokens: 8192 by default, but never past the model's max_position_embeddings (the demo model's is 4096):
    the default shrinks to it, and asking for more is an error naming both."""
    from diffgemma.server import commands

    seen = {}
    no_server(monkeypatch, commands, seen)
    assert cli.main(["serve"]) == 0 and seen["max_tokens"] == 4096
    assert (seen["prefill_chunk"], seen["busy_prefill_chunk"]) == (1024, 256)  # the flags' defaults reach the worker
    assert cli.main(["serve", "--busy-prefill-tokens", "512"]) == 0 and seen["busy_prefill_chunk"] == 512
    assert cli.main(["serve", "--max-tokens", "3000"]) == 0 and seen["max_tokens"] == 3000
    assert cli.main(["serve", "--max-tokens", "5000"]) == 2
    assert "--max-tokens 5000: over this model's context of 4096 tokens" in capsys.readouterr().err
    big = SimpleNamespace(config=SimpleNamespace(max_positions=262144))
    assert options.context_tokens(big) == options.SESSION_TOKENS and options.context_tokens(big, 100000) == 100000
    assert options.context_tokens(SimpleNamespace(config=SimpleNamespace(max_positions=None)), 10**6) == 10**6


# ------------------------------------------------------------------------------------- /v1/completions

def complete(server, **body):
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_of_a_rendered_chat_is_the_chats_reply(server, model):
    """/v1/completions continues a raw prompt: given the chat template's own text (BOS spelt out) or its token ids,
    it writes the chat endpoint's reply, token for token (same settings and seed); the text is not stripped, and a
    text prompt without BOS gets it in front."""
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    chat = server.chat(messages)
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    by_text, by_ids = complete(server, prompt=text), complete(server, prompt=ids)
    for got in (by_text, by_ids):
        assert got["object"] == "text_completion" and got["model"] == "diffgemma-demo"
        c = got["choices"][0]
        assert c["text"].strip() == chat["choices"][0]["message"]["content"] == "42"
        assert c["finish_reason"] == chat["choices"][0]["finish_reason"] and c["logprobs"] is None
        assert got["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]
        assert got["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1  # the same conversation
    bos = model.tokenizer.id_to_token(model.tokenizer.bos_id)
    assert text.startswith(bos)
    without = complete(server, prompt=text[len(bos):], max_tokens=8)
    assert without["usage"]["prompt_tokens"] == len(ids)  # BOS put back in front


@pytest.mark.parametrize("stop", [None, "31"])
def test_completion_stream_adds_up_to_the_text(server, model, stop):
    ids = model.tokenizer.apply_chat_template(SORT, add_generation_prompt=True)
    extra = {} if stop is None else {"stop": stop}
    whole = complete(server, prompt=ids, **extra)
    r = server.client.post("/v1/completions", json={"prompt": ids, "stream": True,
                                                     "stream_options": {"include_usage": True}, **extra})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    *body, last, use = chunks
    assert "".join(c["choices"][0]["text"] for c in body) == whole["choices"][0]["text"]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "stop"
    assert use["choices"] == [] and use["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert whole["choices"][0]["text"].strip() == ("6 12 31 45 87" if stop is None else "6 12")


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "echo": True}, "echo: not supported"),
    ({"prompt": "x", "suffix": "y"}, "suffix: not supported"),
    ({"prompt": "x", "best_of": 2}, "best_of: only 1"),
    ({"prompt": ["a", "b"]}, "prompt: expected one non-empty prompt"),
    ({"prompt": ""}, "prompt: expected one non-empty prompt"),
    ({"prompt": [1, "2"]}, "prompt: expected one non-empty prompt"),
    ({"prompt": [2, 10**6]}, "prompt: token id 1000000 is outside the vocabulary [0, 2048)"),
    ({"prompt": "x", "messages": []}, "unknown field(s) ['messages']"),
    ({"prompt": "x", "n": 3}, "n: only 1"),
    ({"prompt": "x", "logprobs": 2}, "logprobs: not supported"),
    ({"prompt": "x", "max_tokens": 10**6}, "over this server's context"),
])
def test_completion_refusals_name_the_field(server, body, needle):
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_an_api_key_guards_the_v1_routes(model, base):
    """--api-key: every /v1 request needs `Authorization: Bearer <key>` (401 naming the header otherwise); /health
    stays open for load balancers."""
    worker = Worker(model, slots=1, max_tokens=1024)
    try:
        client = TestClient(create_app(worker, model.tokenizer, "m", base, api_key="s3cret"))
        body = {"messages": [{"role": "user", "content": "What is 17 + 25?"}]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path, kw in (("post", "/v1/chat/completions", {"json": body}), ("get", "/v1/models", {}),
                                     ("post", "/v1/completions", {"json": {"prompt": "x"}}),
                                     ("get", "/openapi.json", {})):
                r = getattr(client, method)(path, headers=headers, **kw)
                assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"], (path, r.text)
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "42"
    finally:
        worker.close()


def test_serve_takes_its_api_key_from_the_flag_or_the_environment(monkeypatch, capsys):
    from diffgemma.server import commands

    seen = {}
    no_server(monkeypatch, commands, seen)
    monkeypatch.delenv("DIFFGEMMA_API_KEY", raising=False)
    assert cli.main(["serve"]) == 0 and seen["api_key"] is None
    monkeypatch.setenv("DIFFGEMMA_API_KEY", "from-env")
    assert cli.main(["serve"]) == 0 and seen["api_key"] == "from-env"
    assert cli.main(["serve", "--api-key", "from-flag"]) == 0 and seen["api_key"] == "from-flag"
    assert cli.main(["serve", "--api-key", " "]) == 2 and "--api-key: empty" in capsys.readouterr().err
    monkeypatch.delenv("DIFFGEMMA_API_KEY")
    assert cli.main(["serve", "--host", "0.0.0.0"]) == 0 and "0.0.0.0 with no --api-key" in capsys.readouterr().err
    for quiet in (["--host", "0.0.0.0", "--api-key", "k"], []):
        assert cli.main(["serve", *quiet]) == 0 and "warning" not in capsys.readouterr().err


def test_models_names_the_served_model_and_its_context(server):
    r = server.client.get("/v1/models").json()
    assert r["object"] == "list" and len(r["data"]) == 1
    m = r["data"][0]
    assert m["id"] == "diffgemma-demo" and m["object"] == "model" and m["max_model_len"] == 2048  # Server's slots
    assert server.client.get("/health").json() == {"status": "ok"}


def test_a_slot_is_taken_over_only_where_its_cache_can_rewind(model):
    """On the fast engine a cache cannot rewind more than a canvas past the sliding window (its ring reused those
    slots), so a request sharing half of a slot's conversation but needing a deeper rewind goes to a free slot: taking
    the slot over would prefill everything again and lose that conversation for nothing. The reference cache keeps
    every position and can always rewind."""
    from diffgemma.model.engine import Engine

    engine = Engine.from_reference(model, dtype=torch.float32)
    C = engine.config.canvas_length
    for m, deep_ok in ((engine, False), (model, True)):
        worker = Worker(m, slots=2, max_tokens=1024)
        try:
            held = torch.randint(4, m.config.vocab_size, (600,)).tolist()
            slot = worker.slots[0] = Slot(m.new_cache(1024))
            m.prefill(slot.cache, torch.tensor(held))
            slot.ids = held
            assert worker.pick(held[:600 - C // 2] + [1, 2]) == (0, 600 - C // 2)  # a shallow rewind: slot 0
            deep = held[:400] + [1, 2]  # shares 2/3 of slot 0, 200 tokens back: past the engine's ring
            assert worker.pick(deep) == ((0, 400) if deep_ok else (1, 0))
            assert slot.cache.can_truncate(400) is deep_ok and slot.cache.can_truncate(600 - C // 2)
        finally:
            worker.close()
