"""Session: thought-channel split, tool-call grammar, tool round trips, and KV reuse across turns."""

import json

import pytest
import torch

import diffgemma
from diffgemma.events import BlockEvent, DoneEvent, StartEvent, StepEvent
from diffgemma.reply import split_thought
from diffgemma.session import Session
from diffgemma.tool_calls import parse_tool_calls

from diffgemma.loader import embedded_model_path

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


def test_split_thought():
    assert split_thought("<|channel>thought\nsix times seven<channel|>42") == ("six times seven", "42")
    assert split_thought("plain answer") == (None, "plain answer")
    assert split_thought("<|channel>thought\nstill thinking") == ("still thinking", "")


def test_tool_call_grammar():
    (call,) = parse_tool_calls('x <|tool_call>call:f{a:<|"|>b, c<|"|>,n:-3,x:2.5,ok:true,l:[1,<|"|>z<|"|>],o:{k:null}}<tool_call|>')
    assert call.ok and call.name == "f"
    assert call.arguments == {"a": "b, c", "n": -3, "x": 2.5, "ok": True, "l": [1, "z"], "o": {"k": None}}
    two = parse_tool_calls("<|tool_call>call:a{}<tool_call|><|tool_call>call:b{x:1}<tool_call|>")
    assert [(c.name, c.arguments) for c in two] == [("a", {}), ("b", {"x": 1})]
    for bad, why in [
        ("<|tool_call>call:f{a:1", "no closing"),
        ("<|tool_call>f{a:1}<tool_call|>", "call:NAME"),
        ('<|tool_call>call:f{a:<|"|>x}<tool_call|>', "unterminated string"),
        ("<|tool_call>call:f{a 1}<tool_call|>", "key:"),
        ("<|tool_call>call:f[1]<tool_call|>", "object"),
        ("<|tool_call>call:f{a:1}junk<tool_call|>", "after the arguments"),
    ]:
        (c,) = parse_tool_calls(bad)
        assert not c.ok and why in c.error, (bad, c.error)


def test_demo_model_makes_a_well_formed_tool_call_and_uses_the_result(demo):
    session = Session(demo, tools=TOOLS)
    reply = session.ask("What's the weather in Paris?")
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert reply.result.stop_token == demo.tokenizer.tool_response_id  # the turn pauses for the host
    follow = session.tool_result("get_weather", {"temperature": 17, "condition": "cloudy"})
    assert "17" in follow.answer and "cloudy" in follow.answer and "Paris" in follow.answer
    assert follow.reused_tokens > 150  # the tool turn continued on the cached prefix


def test_second_turn_reuses_cache_and_equals_a_fresh_prefill(demo):
    session = Session(demo)
    first = session.ask("What is 21 + 14?")
    second = session.ask("What is 3 + 4?")
    assert first.answer == "35"  # (the demo model was trained on single turns only; turn 2 is not scored)
    assert second.reused_tokens > 10 and second.prefilled_tokens < len(session.cached_ids)
    fresh = demo.new_cache(4096)
    demo.prefill(fresh, torch.tensor(session.cached_ids))
    assert session.cache.length == len(session.cached_ids)
    # Same K/V up to f32 rounding (chunked and one-shot prefill accumulate in different orders).
    for mine, ref in zip(session.cache.keys + session.cache.values, fresh.keys + fresh.values):
        assert (mine - ref).abs().max() < 1e-3


def test_a_turn_passes_on_the_loops_events(demo):
    """Session.ask's callbacks get generate_stream's own event objects, framed by the turn's StartEvent and DoneEvent:
    the blocks add up to the reply, the steps and blocks are the ones on_step and on_block see."""
    session = Session(demo)
    session.ask("What is 21 + 14?")
    events, steps, blocks = [], [], []
    reply = session.ask("What is 3 + 4?", on_event=events.append, on_step=steps.append, on_block=blocks.append)
    start, *middle, done = events
    assert isinstance(start, StartEvent) and isinstance(done, DoneEvent) and done.result is reply.result
    assert (start.cached_tokens, start.prefill_tokens) == (reply.reused_tokens, reply.prefilled_tokens)
    assert start.cached_tokens > 10
    assert list(map(id, (e for e in middle if isinstance(e, StepEvent)))) == list(map(id, steps))  # the same objects
    assert list(map(id, (e for e in middle if isinstance(e, BlockEvent)))) == list(map(id, blocks))
    assert len(steps) >= len(blocks) >= 1 and len(middle) == len(steps) + len(blocks)
    assert [t for b in blocks for t in b.tokens] == reply.result.tokens
    assert steps[-1].stop_reason is not None  # a block's last step says why it stopped


def test_thinking_drops_the_thought_from_history(demo):
    session = Session(demo, think=True)
    reply = session.ask("What is 12 + 30?")
    assert reply.thought is not None and "<|channel>" not in reply.answer
    assert session.messages[-1] == {"role": "assistant", "content": reply.answer}


def test_a_stop_string_cuts_the_reply_and_its_turn_replays(demo, tmp_path):
    """stop_strings on a Session turn: the answer (and the history) ends where the stop text begins, the next turn
    reuses the cache, and the op-log (which records the setting) replays to the same events."""
    from diffgemma import oplog
    from diffgemma.replay import replay

    log = oplog.OpLog(tmp_path, oplog.header(demo, 1, 512))
    session = Session(demo, max_tokens=512, log=log)
    reply = session.ask("Sort these numbers: 31 12 87 45 6", stop_strings=["45"])
    assert reply.answer == "6 12 31" and reply.result.stop_string == "45"
    assert reply.result.text.endswith("31 ") and session.messages[-1] == {"role": "assistant", "content": "6 12 31"}
    nxt = session.ask("What is 17 + 25?")
    assert nxt.answer == "42" and nxt.reused_tokens > 0
    log.close()
    records = oplog.read(log.path)
    assert [r["settings"]["stop_strings"] for r in records if r.get("op") == "generate"] == [["45"], []]
    report = replay(log.path, demo)
    assert report.ok and report.generations == 2, report.problems


def test_a_failed_turn_leaves_the_conversation_as_it_was(demo):
    session = Session(demo, max_tokens=300)
    first = session.ask("What is 17 + 25?")
    before = [dict(m) for m in session.messages]
    with pytest.raises(diffgemma.errors.InputError, match="KV cache overflow"):
        session.ask("Sort these numbers: " + " ".join(str(i) for i in range(200)))
    assert session.messages == before and session.cache.length == len(session.cached_ids)
    assert session.ask("What is 17 + 25?").answer == first.answer == "42"


def test_reset_starts_a_new_conversation_and_keeps_the_system_prompt(demo):
    session = Session(demo, system="Answer briefly.")
    first = session.ask("What is 17 + 25?")
    session.ask("And 6 * 7?")
    session.reset()
    assert session.messages == [{"role": "system", "content": "Answer briefly."}]
    assert session.cache.length == 0 and session.cached_ids == []
    again = session.ask("What is 17 + 25?")
    assert again.answer == first.answer and again.reused_tokens == 0
