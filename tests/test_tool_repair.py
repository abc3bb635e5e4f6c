"""The tool repair stage (the setting `tool_repair`; core/repair.py): a reply with an invalid tool call gets an error
tool-response per bad call and is written again; only the clean reply enters the conversation and its KV cache.

The invalid call is made by the real path: the demo model asked for the weather in Paris writes
`get_weather{city:"Paris"}`; offered a get_weather whose `city` must be "Paris, France" (an enum), that call fails the
tool's schema. Written again after the error, the demo ends its turn with no call (a clean reply).

The gate: after the repair, the session's live KV is byte-identical (torch.equal, every live layer's K and V, and the
length) to a cache that never saw the bad exchange (a fresh session's cache given the same prompt and the same clean
reply), and a seeded next turn is identical on both."""

import copy
import json

import pytest
import torch

import diffgemma
from diffgemma import oplog
from diffgemma.events import BlockEvent, RetryEvent
from diffgemma.loader import embedded_model_path
from diffgemma.replay import replay
from diffgemma.session import Session
from diffgemma.tool_repair import Problem, ToolRepair

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
WEATHER = "What's the weather in Paris?"
BUDGET = 32
FAST = {"max_new_tokens": BUDGET, "max_denoising_steps": 12}


def strict_tools():
    """The demo's tools, with get_weather's city limited to one value the demo does not write."""
    tools = copy.deepcopy(TOOLS)
    for t in tools:
        if t["function"]["name"] == "get_weather":
            t["function"]["parameters"]["properties"]["city"]["enum"] = ["Paris, France"]
    return tools


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


def live_equal(a, b) -> bool:
    ka, kb = a.live_kv(), b.live_kv()
    return a.length == b.length and len(ka) == len(kb) and all(torch.equal(x, y) for x, y in zip(ka, kb))


def repaired_turn(demo, log=None):
    """A repaired turn -> (session, reply, the first generation's blocks' tokens, the retries seen)."""
    seen, retries = [], []

    def on_event(e):
        if isinstance(e, RetryEvent):
            retries.append(e)
        elif isinstance(e, BlockEvent) and not retries:
            seen.extend(e.tokens)

    s = Session(demo, tools=strict_tools(), tool_repair=True, max_tokens=1024, log=log)
    reply = s.ask(WEATHER, on_event=on_event, **FAST)
    return s, reply, seen, retries


def test_feedback_renders_one_error_response_per_call(demo):
    t = demo.tokenizer
    ids = ToolRepair(t, TOOLS).feedback([Problem("get_weather", "bad <|\"|> city"), Problem(None, "no closing")])
    text = t.decode(ids)
    assert text.count("<|tool_response>") == 2 and text.count("<tool_response|>") == 2
    assert text.startswith("<|tool_response>response:get_weather{error:") and "response:tool{error:" in text
    assert 'bad <"> city' in text  # a special-token lookalike in the message is defused
    repair = ToolRepair(t, strict_tools())
    call = t.encode('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>')
    assert [p.name for p in repair.problems(call)] == ["get_weather"]
    assert ToolRepair(t, TOOLS).problems(call) == []
    assert repair.trim(call + t.encode("<|tool_response>response:x{}")) == len(call)


def test_an_invalid_call_is_repaired_the_kv_never_saw_it_and_it_replays(demo, tmp_path):
    log = oplog.OpLog(tmp_path, oplog.header(demo, 1, 1024))
    s, reply, first, retries = repaired_turn(demo, log)
    check = ToolRepair(demo.tokenizer, strict_tools())
    assert [p.name for p in check.problems(first)] == ["get_weather"]  # the injected bad call was written
    assert len(retries) == 1 and retries[0].kept == 0
    r = reply.result
    assert r.tool_repairs == 1 and not r.tool_repair_failed
    assert check.problems(r.tokens) == [] and check.opener not in r.tokens  # the final reply is clean
    assert reply.tool_calls == [] and s.messages[-1] == {"role": "assistant", "content": reply.answer}
    # a fresh session given the same conversation and the same clean reply
    fresh = Session(demo, tools=strict_tools(), tool_repair=True, max_tokens=1024)
    fresh.messages = copy.deepcopy(s.messages[:-1])
    prompt = fresh.render()
    assert s.cached_ids == prompt + r.tokens
    demo.prefill(fresh.cache, torch.tensor(prompt))
    demo.prefill(fresh.cache, torch.tensor(r.tokens))
    fresh.slot.ids = prompt + list(r.tokens)
    fresh.messages = copy.deepcopy(s.messages)
    assert live_equal(s.cache, fresh.cache)
    # ... and one that kept the bad exchange differs (the check can fail)
    bad = demo.new_cache(1024)
    demo.prefill(bad, torch.tensor(prompt + first))
    demo.prefill(bad, torch.tensor(r.tokens))
    assert not live_equal(s.cache, bad)
    # a seeded next turn is the same on both, and so are the caches after it
    a = s.ask("And in Tokyo?", seed=5, **FAST)  # get_weather{city:"Tokyo"}: repaired too
    b = fresh.ask("And in Tokyo?", seed=5, **FAST)
    assert a.result.tokens == b.result.tokens and a.reused_tokens == b.reused_tokens
    assert a.result.tool_repairs == b.result.tool_repairs == 1
    assert live_equal(s.cache, fresh.cache)
    log.close()
    replayed(demo, log.path, [reply.result.tokens, a.result.tokens], tmp_path)


def replayed(demo, path, finals, tmp_path):
    """The log of two repaired turns: each round journaled, each rewind an extend op; it replays identically."""
    records = oplog.read(path)
    gens = [r for r in records if r.get("op") == "generate"]
    assert [g.get("tool_repair") for g in gens] == [None, 1, None, 1]
    assert all(g["settings"]["tool_repair"] for g in gens)
    extend = [r for r in records if r.get("op") == "extend"]
    assert [e["tokens"] for e in extend] == finals
    report = replay(path, demo)
    assert report.ok and report.generations == 4, report.problems
    # an extend op past what its slot holds is a difference, named (the log cut after it)
    end = records.index(extend[0]) + 1
    bad = [dict(r, keep=10**6) if r.get("op") == "extend" else r for r in records[:end]]
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in bad))
    problems = replay(tampered, demo).problems
    assert problems and problems[0].startswith("extend op of slot 0: the cache rewound to")


def test_off_by_default_and_without_tools(demo):
    bad = Session(demo, tools=strict_tools(), max_tokens=1024).ask(WEATHER, **FAST)
    assert bad.result.tool_repairs == 0 and [c.name for c in bad.tool_calls] == ["get_weather"]
    # a turn's own keyword turns it on; a session without tools has nothing to repair
    on = Session(demo, tools=strict_tools(), max_tokens=1024).ask(WEATHER, tool_repair=True, **FAST)
    assert on.result.tool_repairs == 1
    plain = Session(demo, tool_repair=True, max_tokens=1024).ask(WEATHER, **FAST)
    assert plain.result.tool_repairs == 0


def test_the_engine_cache_prefills_what_its_ring_cannot_rewind(demo, tmp_path):
    """The fast engine's cache (f16 KV, a sliding-window ring that rewinds at most its slack) cannot go back from the
    last rewrite to the mark: the repair's rewind falls back to an empty cache, and the prompt is prefilled again in a
    call of its own, then the final reply in one call. Its live KV is then byte-identical to a cache given the prompt
    and then the reply (in one call the two would give other bits: other shapes)."""
    from diffgemma.model.engine import Engine

    eng = Engine.from_reference(demo, dtype=torch.float32)
    log = oplog.OpLog(tmp_path, oplog.header(demo, 1, 1024))
    s = Session(eng, tools=strict_tools(), tool_repair=True, max_tokens=1024, log=log)
    r = s.ask(WEATHER, **FAST).result
    log.close()
    assert r.tool_repairs == 1
    fresh = Session(eng, tools=strict_tools(), max_tokens=1024)
    fresh.messages = copy.deepcopy(s.messages[:-1])
    prompt = fresh.render()
    assert s.cached_ids == prompt + r.tokens
    eng.prefill(fresh.cache, torch.tensor(prompt))
    eng.prefill(fresh.cache, torch.tensor(r.tokens))
    assert live_equal(s.cache, fresh.cache)
    extend = [(e["keep"], e["tokens"]) for e in oplog.read(log.path) if e.get("op") == "extend"]
    assert extend == [(0, prompt), (len(prompt), r.tokens)]  # the ring's fallback ran: two prefills, journaled


class AlwaysInvalid(ToolRepair):
    """Every reply judged invalid: the attempts run out."""

    def problems(self, tokens):
        return [Problem("get_weather", "judged invalid by the test")]


def test_exhausted_attempts_return_the_last_reply_flagged(demo):
    s = Session(demo, tools=TOOLS, tool_repair=True, max_tokens=1024)
    s.repair = AlwaysInvalid(demo.tokenizer, TOOLS)
    reply = s.ask(WEATHER, max_new_tokens=16, max_denoising_steps=12, tool_repair_attempts=2)
    r = reply.result
    assert r.tool_repairs == 2 and r.tool_repair_failed
    prompt = s.cached_ids[:len(s.cached_ids) - len(r.tokens)]
    assert s.cached_ids == prompt + r.tokens and s.cache.length == len(s.cached_ids)
    # a cache too small for another round ends the repair at once, flagged, with the first reply
    small = Session(demo, tools=TOOLS, tool_repair=True, max_tokens=300)
    small.repair = AlwaysInvalid(demo.tokenizer, TOOLS)
    r = small.ask(WEATHER, max_new_tokens=16, max_denoising_steps=12).result
    assert r.tool_repairs == 0 and not r.tool_repair_failed


# ------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def base(demo):
    from diffgemma.settings import GenerationSettings

    return GenerationSettings.resolve(demo.generation_config, env={}).replace(**FAST)


def test_server_repairs_per_request_and_journals_it(demo, base, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from test_server import Server

    s = Server(demo, base, log_dir=tmp_path, max_tokens=1024)
    try:
        msgs = [{"role": "user", "content": WEATHER}]
        off = s.chat(msgs, tools=strict_tools())
        assert "tool_repair" not in off["diffgemma"]
        assert "tool_calls" not in off["choices"][0]["message"]  # the invalid call is left out, not answered
        on = s.chat(msgs, tools=strict_tools(), diffgemma={"tool_repair": True})
        assert on["diffgemma"]["tool_repair"] == {"rounds": 1, "failed": False}
        assert "tool_calls" not in on["choices"][0]["message"]
        chunks = s.stream(msgs, tools=strict_tools(), diffgemma={"tool_repair": True})
        assert chunks[-1]["diffgemma"]["tool_repair"] == {"rounds": 1, "failed": False}
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == on["choices"][0]["finish_reason"]
        r = s.client.post("/v1/chat/completions", json={"messages": msgs, "tools": strict_tools(),
                                                        "diffgemma": {"tool_repair_attempts": 99}})
        assert r.status_code == 400 and "tool_repair_attempts 99: over this server's limit of 4" in r.text
    finally:
        s.close()
    records = oplog.read(s.log.path)
    gens = [r for r in records if r.get("op") == "generate"]
    assert [g["settings"]["tool_repair"] for g in gens] == [False, True, True, True, True]
    assert [g.get("tool_repair") for g in gens] == [None, None, 1, None, 1]
    assert sum(r.get("op") == "extend" for r in records) == 2
    report = replay(s.log.path, demo)
    assert report.ok and report.generations == 5, report.problems


def test_serve_flag_sets_the_servers_default(demo, base):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from test_server import Server

    from diffgemma import cli, options

    args = cli.build_parser().parse_args(["serve", "--tool-repair", "--set", "max_new_tokens=8"])
    assert options.generation_settings(demo, args).tool_repair
    args = cli.build_parser().parse_args(["chat", "--tool-repair", "--set", "tool_repair=false"])
    assert not options.generation_settings(demo, args).tool_repair  # a --set of it wins
    s = Server(demo, base.replace(tool_repair=True), max_tokens=1024)
    try:
        msgs = [{"role": "user", "content": WEATHER}]
        assert s.chat(msgs, tools=strict_tools())["diffgemma"]["tool_repair"]["rounds"] == 1
        assert "tool_repair" not in s.chat(msgs, tools=strict_tools(), diffgemma={"tool_repair": False})["diffgemma"]
    finally:
        s.close()
