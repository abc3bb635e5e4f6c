"""The op-log and `diffgemma replay` outside the server: `ask` / `chat` / Session with a log, and the reader's
refusals. (The server's logs, cancellations and a tampered log: tests/test_server.py.)"""

import io
import json

import pytest

import diffgemma
from diffgemma import cli, oplog
from diffgemma.errors import InputError
from diffgemma.replay import replay
from diffgemma.session import Session


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


def logs(directory) -> list:
    """The logs in `directory`, fewest generations first."""
    return sorted(directory.glob("ops-*.jsonl"), key=lambda p: sum('"op":"generate"' in ln for ln in p.open()))


def test_ask_and_chat_logs_replay_identically(tmp_path, monkeypatch, capsys):
    assert cli.main(["ask", "What is 17 + 25?", "--log-dir", str(tmp_path)]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2 + 3?\nAnd 4 + 4?\n"))
    assert cli.main(["chat", "--log-dir", str(tmp_path), "--seed", "5"]) == 0
    out = capsys.readouterr().out.split()
    assert out == ["42", "5", "8"]
    ask_log, chat_log = logs(tmp_path)
    records = oplog.read(chat_log)
    gens = [r for r in records if r.get("op") == "generate"]
    assert [r["slot"] for r in gens] == [0, 0] and all(r["settings"]["seed"] == 5 for r in gens)
    assert gens[1]["keep"] > 0  # the second turn was served from the first turn's cache
    for path, n in ((ask_log, 1), (chat_log, 2)):
        assert cli.main(["replay", str(path)]) == 0
        assert f"replay: {n} generations" in capsys.readouterr().out


def test_session_log_records_what_replay_needs(model, tmp_path):
    log = oplog.OpLog(tmp_path, oplog.header(model, 1, 512))
    session = Session(model, max_tokens=512, log=log)
    reply = session.ask("Sort these numbers: 31 12 87 45 6", max_new_tokens=40)
    log.close()
    start, op, *events = oplog.read(log.path)
    assert start["model"] is None and start["max_tokens"] == 512 and start["device"] == "cpu"
    assert op["keep"] == 0 and op["prompt"] == session.cached_ids[:len(op["prompt"])]
    assert op["settings"]["max_new_tokens"] == 40
    assert events[-1] == {"event": "done", "gen": 0, "tokens": reply.result.tokens,
                          "stop_token": reply.result.stop_token}
    assert sum(len(e["tokens"]) for e in events if e["event"] == "block") == len(reply.result.tokens)
    assert replay(log.path, model).ok
    # a second log of the same process in the same second gets its own file
    assert oplog.OpLog(tmp_path, oplog.header(model, 1, 512)).path != log.path


@pytest.mark.parametrize("lines,needle", [
    (['{"op": "start", "version": 1}', "{not json"], ":2: not a JSON line"),
    (['{"op": "start", "version": 99}'], "op-log version 99"),
    (['{"hello": 1}'], ":1: expected an object with an 'op' or an 'event'"),
    (['{"op": "generate"}'], "the first record must be the 'start' op"),
])
def test_reader_refuses_what_is_not_a_log(tmp_path, lines, needle):
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=needle.replace("(", r"\(").replace("'", "'")):
        oplog.read(path)


def test_replay_refuses_events_out_of_place(model, tmp_path):
    path = tmp_path / "x.jsonl"
    head = json.dumps({"op": "start", "version": 1, "model": None, "device": "cpu", "max_tokens": 64, "slots": 1})
    path.write_text(head + "\n" + json.dumps({"event": "done", "gen": 0, "tokens": []}) + "\n")
    with pytest.raises(InputError, match="outside its generate op"):
        replay(path, model)
    path.write_text(head + "\n" + json.dumps({"op": "generate", "gen": 0, "slot": 0}) + "\n")
    with pytest.raises(InputError, match="generation 0: malformed generate op"):
        replay(path, model)
    assert cli.main(["replay", str(tmp_path / "missing.jsonl")]) == 2
