"""Replay's comparison catches a log changed anywhere, not only in its tokens: a block's step count, its stop
reason or its end flag, the done record's stop token, and a stray event after a generation's end."""

import json

import pytest

import diffgemma
from diffgemma import oplog
from diffgemma.errors import InputError
from diffgemma.replay import replay
from diffgemma.session import Session

SMALL = dict(max_new_tokens=8, canvas_length=4, max_denoising_steps=2)


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def lines(model, tmp_path_factory):
    """A real log of a two-turn conversation of a few small blocks each -> its records."""
    log = oplog.OpLog(tmp_path_factory.mktemp("tamper"), oplog.header(model, 1, 512))
    session = Session(model, max_tokens=512, log=log)
    for turn in ("Count from 1 to 200.", "And from 5 to 50?"):
        session.ask(turn, **SMALL)
    log.close()
    records = [json.loads(ln) for ln in log.path.read_text().splitlines()]
    assert replay(log.path, model).ok
    return records


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tampered(records, pick, change):
    out = [dict(r) for r in records]
    k = next(i for i, r in enumerate(out) if pick(r))
    change(out[k])
    return out, k


def _first_block(r):
    return r.get("event") == "block"


@pytest.mark.parametrize("what,pick,change", [
    ("steps", _first_block, lambda r: r.update(steps=r["steps"] + 1)),
    ("stop_reason", _first_block, lambda r: r.update(stop_reason="max_steps" if r["stop_reason"] != "max_steps"
                                                     else "confident")),
    ("end", lambda r: r.get("event") == "block" and r.get("end"), lambda r: r.update(end=False)),
    ("end", _first_block, lambda r: r.update(end=True)),
    ("stop_token", lambda r: r.get("event") == "done", lambda r: r.update(stop_token=(r.get("stop_token") or 0) + 1)),
    ("block", _first_block, lambda r: r.update(block=r["block"] + 1)),
])
def test_a_changed_block_field_is_a_difference(model, lines, tmp_path, what, pick, change):
    records, k = _tampered(lines, pick, change)
    report = replay(_write(tmp_path / "t.jsonl", records), model)
    assert not report.ok, what
    gen = records[k]["gen"]
    assert any(p.startswith(f"generation {gen}") and what in p for p in report.problems), report.problems


def _stray(lines, at_end: bool):
    """The log with a block event of an ended generation logged again after its end record."""
    ends = [i for i, r in enumerate(lines) if r.get("event") in oplog.END_EVENTS]
    end = ends[-1] if at_end else ends[0]
    gen = lines[end]["gen"]
    stray = dict(next(r for r in lines if r.get("event") == "block" and r["gen"] == gen))
    return lines[:end + 1] + [stray] + lines[end + 1:], gen


@pytest.mark.parametrize("at_end", [False, True])
def test_a_stray_event_after_a_generations_end_is_never_identical(model, lines, tmp_path, at_end):
    records, gen = _stray(lines, at_end)
    try:
        report = replay(_write(tmp_path / "stray.jsonl", records), model)
    except InputError as e:
        assert f"generation {gen}" in str(e)
        return
    assert not report.ok and any(p.startswith(f"generation {gen}") for p in report.problems), report


def test_a_stray_event_after_a_generations_end_is_not_an_unfinished_generation(model, lines, tmp_path):
    """An event logged after its generation's end record is refused by name (not taken as part of that generation,
    which would report it unfinished as well as different)."""
    records, gen = _stray(lines, at_end=False)
    with pytest.raises(InputError, match=f"event of generation {gen!r} after its end record"):
        replay(_write(tmp_path / "stray.jsonl", records), model)
