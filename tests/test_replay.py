"""The op-log and `diffgemma replay` outside the server: `ask` / `chat` / Session with a log, and the reader's
refusals; logs cut by a crash (kill -9, a torn last line) or by Ctrl-C; several logs at once. (The server's logs,
cancellations and a tampered log: tests/test_server.py.)"""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import diffgemma
from diffgemma import cli, oplog
from diffgemma.errors import InputError
from diffgemma.events import BlockEvent
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


# Small generations: a few blocks of a few tokens, two denoise steps each, so that every replay below takes a
# handful of forwards.
SMALL = dict(max_new_tokens=8, canvas_length=4, max_denoising_steps=2)


def small_log(model, directory, turns=("Count from 1 to 200.", "And from 5 to 50?")) -> list[str]:
    """A real log of a short conversation -> its lines (with their newlines)."""
    log = oplog.OpLog(directory, oplog.header(model, 1, 512))
    session = Session(model, max_tokens=512, log=log)
    for turn in turns:
        session.ask(turn, **SMALL)
    log.close()
    return log.path.read_text().splitlines(keepends=True)


def test_a_log_cut_anywhere_replays_its_complete_part(model, tmp_path, capsys):
    lines = small_log(model, tmp_path / "whole")
    kinds = [json.loads(ln).get("op") or json.loads(ln)["event"] for ln in lines]
    assert kinds == ["start", "generate", "block", "block", "done", "generate", "block", "block", "done"]
    cut = tmp_path / "cut.jsonl"
    for n in range(1, len(lines) + 1):  # the first n lines whole, then (unless n is all) half of the next one
        for torn in ([""] if n == len(lines) else ["", lines[n][: len(lines[n]) // 2]]):
            cut.write_text("".join(lines[:n]) + torn)
            report = replay(cut, model)
            where = f"cut after line {n}" + (" and half a line" if torn else "")
            assert report.ok, (where, report.problems)
            assert (report.torn is not None) == bool(torn), where
            if torn:
                assert report.torn == f"{cut}:{n + 1}: the last line is cut mid-record ({len(torn)} bytes, no newline); left out"
            ends = kinds[:n].count("done")
            opened = kinds[:n].count("generate")
            assert report.generations == ends, where
            assert len(report.skipped) == opened - ends, where  # the generation the cut fell in, if any
            if opened > ends:
                blocks = kinds[max(i for i in range(n) if kinds[i] == "generate"):n].count("block")
                assert report.skipped == [f"generation {opened - 1}: unfinished in the log (no end record after "
                                          f"{blocks} block(s)): " + (f"its {blocks} logged block(s) replayed, the rest "
                                                                     f"skipped" if blocks else "skipped")], where
    # what the command says about a log cut mid-record in its second generation
    cut.write_text("".join(lines[:7]) + lines[7][:9])
    assert cli.main(["replay", str(cut)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{cut}:8: the last line is cut mid-record (9 bytes, no newline); left out",
        "generation 1: unfinished in the log (no end record after 1 block(s)): its 1 logged block(s) replayed, the "
        "rest skipped",
        "replay: 1 generations, 1 unfinished, 4 logged events: identical"]
    # the replayed part is compared: a changed block of the unfinished generation is a difference
    recs = [json.loads(ln) for ln in lines[:7]]
    recs[6]["tokens"][0] += 1
    cut.write_text("".join(json.dumps(r) + "\n" for r in recs))
    report = replay(cut, model)
    assert report.generations == 1 and len(report.skipped) == 1
    assert report.problems and report.problems[0].startswith("generation 1, event 1 (block): tokens logged")


def test_a_torn_first_line_or_a_bad_line_inside_is_one_line_error(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"op": "start", "vers')
    with pytest.raises(InputError, match="only a torn first line"):
        oplog.read(path)
    path.write_bytes(b'{"op": "start", "version": 1}\n\xff\xfe\n{"event": "done"}\n')
    with pytest.raises(InputError, match=":2: not a JSON line"):
        oplog.read(path)
    assert cli.main(["replay", str(path)]) == 2


def test_ctrl_c_is_journaled_and_replayed_as_an_interruption(model, tmp_path):
    log = oplog.OpLog(tmp_path, oplog.header(model, 1, 512))
    session = Session(model, max_tokens=512, log=log)

    def ctrl_c(event):
        if isinstance(event, BlockEvent):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.ask("Count from 1 to 200.", on_event=ctrl_c, **SMALL)
    assert session.messages == [] and session.cached_ids == [] and session.cache.length == 0
    after = session.ask("Count from 1 to 50.", **SMALL)  # the session goes on, from an empty cache
    assert after.reused_tokens == 0
    log.close()
    records = oplog.read(log.path)
    assert records[3] == {"event": "cancelled", "gen": 0, "blocks": 1, "kept": 0, "interrupted": True}
    assert [r.get("op") or r["event"] for r in records] == ["start", "generate", "block", "cancelled", "generate",
                                                            "block", "block", "done"]
    report = replay(log.path, model)
    assert report.ok and report.generations == 2 and not report.skipped, report.problems
    # replay interrupts it after the logged blocks: a block more, or a count that disagrees, is a difference
    lines = log.path.read_text().splitlines()
    for n, change in enumerate((lambda ls: ls.insert(2, ls[2]), lambda ls: ls.__setitem__(3, ls[3].replace(
            '"blocks":1', '"blocks":3')))):
        tampered = tmp_path / f"tampered{n}.jsonl"
        changed = list(lines)
        change(changed)
        tampered.write_text("\n".join(changed) + "\n")
        report = replay(tampered, model)
        assert len(report.problems) == 1 and report.problems[0].startswith("generation 0"), report.problems


def test_replay_takes_several_logs_and_folders(model, tmp_path, capsys):
    folder = tmp_path / "logs"
    small_log(model, folder, turns=("Count from 1 to 200.",))
    small_log(model, folder, turns=("Count from 1 to 50.",))
    paths = sorted(folder.glob("ops-*.jsonl"))
    assert len(paths) == 2
    for argv in ([str(folder)], [str(p) for p in paths]):
        assert cli.main(["replay", *argv]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [f"== {paths[0]}", "replay: 1 generations, 3 logged events: identical",
                       f"== {paths[1]}", "replay: 1 generations, 3 logged events: identical",
                       "replay: 2 logs: 2 identical"]
    # a log that differs -> 1; one that cannot be read -> 2 (the others are still replayed)
    lines = paths[1].read_text().splitlines()
    rec = json.loads(lines[2])
    rec["tokens"][0] += 1
    lines[2] = json.dumps(rec)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    assert cli.main(["replay", str(paths[0]), str(bad)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "replay: 2 logs: 1 identical, 1 differ"
    assert cli.main(["replay", str(bad), str(tmp_path / "missing.jsonl"), str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == "replay: 4 logs: 2 identical, 1 differ, 1 unreadable"
    assert captured.err.count("\n") == 1 and "missing.jsonl: cannot read the op-log" in captured.err
    assert cli.main(["replay", str(tmp_path)]) == 2  # no ops-*.jsonl directly in it
    assert "a folder with no op-log" in capsys.readouterr().err


def _sigint_default() -> None:
    """In the child before it execs: SIGINT back to its default, so Python installs its Ctrl-C handler. A test run
    started as a shell's background job (`cmd &`) inherits SIGINT ignored, and Python keeps an ignored SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ask_until_first_block(directory: Path, sig) -> tuple[subprocess.Popen, Path]:
    """`diffgemma ask --log-dir directory` in a subprocess, sent `sig` once its log holds a block."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(diffgemma.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffgemma.cli", "ask", "Count from 1 to 200.", "--device", "cpu",
         "--log-dir", str(directory), "--max-new-tokens", "2000", "--set", "canvas_length=4",
         "--set", "max_denoising_steps=2", "--set", "stop_ids=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=_sigint_default)
    deadline = time.monotonic() + 120
    try:
        while True:
            logs = list(directory.glob("ops-*.jsonl"))
            if logs and '"event":"block"' in logs[0].read_text():
                break
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no block logged within 120 s"
            time.sleep(0.02)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, logs[0]


def test_kill_9_mid_generation_leaves_a_log_that_replays(model, tmp_path, capsys):
    proc, path = _ask_until_first_block(tmp_path, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    report = replay(path, model)
    assert report.ok and report.generations == 0, report.problems
    assert len(report.skipped) == 1 and report.skipped[0].startswith("generation 0: unfinished in the log")
    assert cli.main(["replay", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("replay: 0 generations, 1 unfinished, ")


def test_ctrl_c_on_ask_journals_the_interruption(model, tmp_path):
    proc, path = _ask_until_first_block(tmp_path, signal.SIGINT)
    err = proc.stderr.read().decode()
    assert proc.returncode == 130 and "Traceback" not in err, err
    end = oplog.read(path)[-1]
    assert end["event"] == "cancelled" and end["interrupted"] is True and end["kept"] == 0 and end["blocks"] >= 1
    report = replay(path, model)
    assert report.ok and report.generations == 1 and not report.skipped, report.problems
