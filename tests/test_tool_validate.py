"""Tool-call validation (opt-in `--tool-validate N`): a reply whose tool call does not parse is regenerated from that
call's opener with the seed bumped, in the library's Session and in the server (plain and streamed), journaled so
that `diffgemma replay` repeats it."""

import json

import pytest
import torch

import diffgemma
from diffgemma import cli, oplog, session as session_mod
from diffgemma.errors import InputError
from diffgemma.loader import embedded_model_path
from diffgemma.replay import replay
from diffgemma.reply import malformed_call_cut
from diffgemma.session import Session
from diffgemma.tool_calls import CALL_OPEN

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
WEATHER = "What's the weather in Paris?"


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


def test_malformed_call_cut_finds_the_first_bad_calls_opener(demo):
    t = demo.tokenizer
    op = t.token_to_id(CALL_OPEN)
    good = t.encode('<|tool_call>call:f{a:1}<tool_call|>')
    bad = t.encode('<|tool_call>call:g{a:<|"|>x}<tool_call|>')  # an unterminated string
    prose = t.encode("Let me check. ")
    assert malformed_call_cut(t, prose + good) is None
    assert malformed_call_cut(t, prose) is None
    assert malformed_call_cut(t, prose + bad) == len(prose) + 1
    assert malformed_call_cut(t, prose + good + bad) == len(prose) + len(good) + 1
    # an opener inside the thought is not one of the answer's calls
    thought = t.encode("<|channel>thought\nmaybe <|tool_call>call:f{}<tool_call|> then<channel|>")
    assert thought.count(op) == 1
    assert malformed_call_cut(t, thought + prose + bad) == len(thought) + len(prose) + 1
    assert malformed_call_cut(t, thought + prose + good) is None
    # the opener spelled out by ordinary tokens: no token to cut at, so no regeneration
    spelled = t.encode("<|") + t.encode("tool_call>") + bad[1:]
    assert op not in spelled and t.decode(spelled).startswith(CALL_OPEN)
    assert malformed_call_cut(t, prose + spelled) is None


def test_a_truncated_call_is_regenerated_until_the_retries_are_spent(demo):
    """max_new_tokens 4 cuts the demo's call short ('no closing'): every regeneration from the opener is cut short
    too, so N retries are spent and the last attempt stands. Without the flag nothing is retried."""
    op = demo.tokenizer.token_to_id(CALL_OPEN)
    for n in (0, 2):
        reply = Session(demo, tools=TOOLS, tool_validate=n).ask(WEATHER, max_new_tokens=4)
        assert reply.result.tool_retries == n
        assert len(reply.result.tokens) == 4 and reply.result.tokens[0] == op
        assert [c.error for c in reply.tool_calls] == ["no closing <tool_call|>"]
    # without tools a tool call is just text: nothing is validated
    assert Session(demo, tool_validate=2).ask(WEATHER, max_new_tokens=4).result.tool_retries == 0
    # the seed wraps at its range's end rather than failing the turn
    assert Session(demo, tools=TOOLS, tool_validate=1).ask(WEATHER, max_new_tokens=4,
                                                            seed=2**64 - 1).result.tool_retries == 1


def reject_first(monkeypatch):
    """malformed_call_cut that calls the first reply it sees malformed at its first opener (the demo model writes
    well-formed calls), then defers to the real one. -> the list of (tokens, cut) it answered."""
    real, seen = malformed_call_cut, []

    def fake(tokenizer, tokens):
        if not seen:
            cut = tokens.index(tokenizer.token_to_id(CALL_OPEN)) + 1
        else:
            cut = real(tokenizer, tokens)
        seen.append((list(tokens), cut))
        return cut

    monkeypatch.setattr(session_mod, "malformed_call_cut", fake)  # a Session's turns
    try:
        from diffgemma.server import worker as worker_mod
    except ImportError:  # no server extras
        return seen
    monkeypatch.setattr(worker_mod, "malformed_call_cut", fake)  # the server's
    return seen


def test_session_regenerates_from_the_opener_with_the_next_seed(demo, monkeypatch, tmp_path):
    """A rejected call: the reply keeps its text through the opener, the rest comes from a second generation with the
    seed + 1 and the remaining token budget, journaled as its own op; the cache ends holding exactly the prompt and
    the final reply (as a fresh prefill of those ids would), and the log replays identically."""
    log = oplog.OpLog(tmp_path, oplog.header(demo, 1, 4096))
    s = Session(demo, tools=TOOLS, tool_validate=1, max_tokens=4096, log=log)
    seen = reject_first(monkeypatch)
    reply = s.ask(WEATHER, seed=5)
    log.close()
    ((first, cut),) = seen  # the last allowed attempt stands as it is: nobody asks
    assert cut == 1
    assert reply.result.tool_retries == 1 and reply.tool_calls and all(c.ok for c in reply.tool_calls)
    assert reply.result.tokens[:cut] == first[:cut]
    assert reply.result.settings.seed == 5 and len(reply.result.steps_per_block) >= 2
    ops = [r for r in oplog.read(log.path) if r.get("op") == "generate"]
    assert [o["settings"]["seed"] for o in ops] == [5, 6]
    reply_start = ops[0]["keep"] + len(ops[0]["prompt"])
    assert reply_start == reply.reused_tokens + reply.prefilled_tokens
    assert ops[1]["keep"] + len(ops[1]["prompt"]) == reply_start + cut  # the retry starts where the kept reply ends
    assert ops[1]["settings"]["max_new_tokens"] == ops[0]["settings"]["max_new_tokens"] - cut
    # the cache holds the prompt and the final reply, and equals a fresh prefill of those ids
    assert s.cached_ids[reply_start:] == reply.result.tokens
    assert s.cache.length == len(s.cached_ids) == reply_start + len(reply.result.tokens)
    fresh = demo.new_cache(4096)
    demo.prefill(fresh, torch.tensor(s.cached_ids))
    for mine, ref in zip(s.cache.keys + s.cache.values, fresh.keys + fresh.values):
        assert (mine - ref).abs().max() < 1e-3
    monkeypatch.undo()  # replay needs no notion of retries: each attempt is its own logged generation
    report = replay(log.path, demo)
    assert report.ok and report.generations == 2, report.problems


def test_tool_validate_flag_is_checked_before_the_model_loads(demo, capsys):
    assert cli.main(["ask", "hi", "--tool-validate", "-1"]) == 2
    assert "--tool-validate -1: expected a number of retries >= 0" in capsys.readouterr().err
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError, match="tool_validate"):
            Session(demo, tool_validate=bad)


def test_server_streams_a_regenerated_call_without_taking_anything_back(demo, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from test_server import Server

    from diffgemma.settings import GenerationSettings

    base = GenerationSettings.resolve(demo.generation_config, env={})
    s = Server(demo, base, tool_validate=1)
    try:
        seen = reject_first(monkeypatch)
        chunks = s.stream([{"role": "user", "content": WEATHER}], tools=TOOLS)
        assert len(seen) == 1 and seen[0][1] == 1
        calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        seen.clear()
        whole = s.chat([{"role": "user", "content": WEATHER}], tools=TOOLS)
        assert len(seen) == 1
        assert [c["function"] for c in calls] == [c["function"] for c in whole["choices"][0]["message"]["tool_calls"]]
        seen.clear()
        s.chat([{"role": "user", "content": WEATHER}])  # no tools in the request: not validated
        assert seen == []
    finally:
        s.close()


def test_stream_deltas_drop_a_regenerated_call_and_keep_what_was_sent(demo):
    """ReplyDeltas.rewind: the prose sent before a malformed call stays; the call (held back) is replaced by the
    regenerated one, which goes out whole at the end. A rewind that would take back sent text is refused."""
    from diffgemma.server.reply_text import ReplyDeltas

    t = demo.tokenizer
    prose = t.encode("Let me check the weather. ")
    bad = t.encode('<|tool_call>call:get_weather{city:<|"|>Par')
    good = t.encode('call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>')
    d = ReplyDeltas(t, tools_on=True)
    assert d.feed(prose[:3]) == {"content": t.decode(prose[:3]).strip()}
    sent = d.feed(prose[3:] + bad)
    assert "tool_call" not in json.dumps(sent)
    d.rewind(len(prose) + 1)  # keep the opener
    assert d.feed(good) == {}  # the call is held back until it closes
    delta, message, calls = d.finish()
    assert message["content"] == "Let me check the weather." and [c.name for c in calls] == ["get_weather"]
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["get_weather"]
    with pytest.raises(AssertionError, match="is not a prefix"):
        d.rewind(2)
