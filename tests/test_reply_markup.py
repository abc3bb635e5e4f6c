"""No channel markup reaches `ask` / `chat` with thinking off: a reply that closes a thought channel it never
opened (the demo does, for "What is 12 + 30 + 7?") has its thought split off in reply.reply_parts, the one place
every consumer (Session, the CLI, the server) takes a reply apart."""

import io
import sys

import pytest

from diffgemma.cli import main
from diffgemma.loader import embedded_model_path
from diffgemma.reply import CHANNEL_CLOSE, CHANNEL_OPEN, reply_parts
from diffgemma.tokenizer import Tokenizer

PROMPT = "What is 12 + 30 + 7?"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(embedded_model_path())


def test_a_close_never_opened_splits_off_the_thought(tok):
    ids = tok.encode("12 12+30=42, 42+7=49<channel|>49")
    raw, thought, answer, calls = reply_parts(tok, ids)
    assert (thought, answer, calls) == ("12 12+30=42, 42+7=49", "49", [])
    assert CHANNEL_CLOSE in raw
    # shown in blocks: a close after the first block only drops its markup (what came before was shown)
    first = len(tok.encode("12 12+30=42, 42+7=49"))
    late = reply_parts(tok, ids, first_block=first - 2)
    assert late[1:3] == (None, "12 12+30=42, 42+7=4949")
    # an opened channel is unchanged; a reply without any channel has no thought
    opened = reply_parts(tok, tok.encode("<|channel>thought\nx<channel|>y"))
    assert opened[1:3] == ("x", "y")
    assert reply_parts(tok, tok.encode("plain"))[1:3] == (None, "plain")


def test_ask_with_thinking_off_prints_no_channel_markup(capsys):
    code = main(["ask", PROMPT, "--device", "cpu", "--seed", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == "49\n"
    for mark in (CHANNEL_OPEN, CHANNEL_CLOSE, "<|", "|>"):
        assert mark not in out
    code = main(["ask", PROMPT, "--device", "cpu", "--seed", "0", "--show-thought"])
    out = capsys.readouterr().out
    assert out.startswith("[thought]\n") and "42" in out.split("[/thought]")[0] and out.endswith("[/thought]\n49\n")


def test_chat_history_keeps_the_answer_without_markup(capsys, monkeypatch):
    """Two turns: each printed answer is markup-free (the second turn's prompt holds the first answer only)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPT}\n{PROMPT}\n"))
    code = main(["chat", "--device", "cpu", "--seed", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "<|" not in out and "|>" not in out and out.count("49") >= 2


def test_a_malformed_call_after_an_unopened_thought_is_cut_at_its_own_opener(tok):
    """A call spelled out in a thought whose channel was never opened is not the answer's call: the regeneration
    cut lands on the answer's malformed call, not on the thought's."""
    from diffgemma.reply import malformed_call_cut

    thought = 'x<|tool_call>call:f{a:<|"|>b<|"|>}<tool_call|>'
    answer = 'ok<|tool_call>call:g{a:1,}<tool_call|>'
    ids = tok.encode(thought + CHANNEL_CLOSE + answer)
    calls = reply_parts(tok, ids)[3]
    assert [c.name for c in calls] == ["g"] and not calls[0].ok
    cut = malformed_call_cut(tok, ids)
    assert cut is not None and tok.decode(ids[:cut]) == thought + CHANNEL_CLOSE + "ok<|tool_call>"
    # with the channel opened, as before
    opened = tok.encode("<|channel>thought\n" + thought + CHANNEL_CLOSE + answer)
    cut = malformed_call_cut(tok, opened)
    assert tok.decode(opened[:cut]).endswith(CHANNEL_CLOSE + "ok<|tool_call>")
