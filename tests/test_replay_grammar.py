"""The op-log journals a generation's grammar (oplog.py): a request constrained by response_format or tool_choice
(server/structured.constrain) is logged with its grammar in its settings and the grammar's sha256 beside them;
`diffgemma replay` rebuilds the same grammar from the log and runs it again, event for event. A grammar that does not
hash to its logged sha256 is a one-line error; a log from before the hash was kept replays as it is."""

import json

import pytest

import diffgemma
from diffgemma import oplog
from diffgemma.errors import InputError
from diffgemma.loader import embedded_model_path
from diffgemma.replay import replay, run_logs

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("llguidance")

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
FAST = {"max_denoising_steps": 16}


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


@pytest.fixture(scope="module")
def logged(demo, tmp_path_factory):
    """A server's op-log of a json_schema reply, a named tool_choice call and a free reply."""
    from test_server import Server

    from diffgemma.settings import GenerationSettings

    base = GenerationSettings.resolve(demo.generation_config, env={}).replace(max_new_tokens=64)
    s = Server(demo, base, log_dir=tmp_path_factory.mktemp("log"), max_tokens=1024)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
        a = s.chat([{"role": "user", "content": "What is 17 + 25?"}], response_format=fmt, diffgemma=FAST)
        assert a["diffgemma"]["structured"] == "grammar"
        b = s.chat([{"role": "user", "content": "What's the weather in Paris?"}], tools=TOOLS, diffgemma=FAST,
                   tool_choice={"type": "function", "function": {"name": "add_numbers"}})
        assert b["diffgemma"]["structured"] == "grammar"
        s.chat([{"role": "user", "content": "Hi"}], diffgemma=FAST)
    finally:
        s.close()
    return s.log.path


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_constrained_generations_journal_their_grammar_and_replay(demo, logged):
    gens = [r for r in oplog.read(logged) if r.get("op") == "generate"]
    assert len(gens) == 3
    for g in gens[:2]:
        assert g["settings"]["grammar"] and g["grammar_sha256"] == oplog.grammar_sha256(g["settings"]["grammar"])
    assert gens[2]["settings"]["grammar"] is None and "grammar_sha256" not in gens[2]
    report = replay(logged, demo)
    assert report.ok and report.generations == 3, report.problems


def test_a_grammar_replaced_in_the_log_is_a_one_line_error(demo, logged, tmp_path, capsys):
    records = oplog.read(logged)
    gen = next(r for r in records if r.get("op") == "generate")
    other = next(r for r in records if r.get("op") == "generate" and r is not gen)
    gen["settings"]["grammar"] = other["settings"]["grammar"]  # a grammar, but not the one that ran
    bad = write(tmp_path / "ops-bad.jsonl", records)
    with pytest.raises(InputError, match=r"^generation \d+: its grammar does not match its grammar_sha256 "):
        replay(bad, demo)
    assert run_logs([bad], device="cpu") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match its grammar_sha256" in err[0]


def test_a_log_without_grammar_hashes_still_replays(demo, logged, tmp_path):
    records = [{k: v for k, v in r.items() if k != "grammar_sha256"} for r in oplog.read(logged)]
    old = write(tmp_path / "ops-old.jsonl", records)
    report = replay(old, demo)
    assert report.ok and report.generations == 3, report.problems
    # and the grammar is what it replays: without it, the constrained replies differ
    for r in records:
        if r.get("op") == "generate":
            r["settings"]["grammar"] = None
    assert not replay(write(tmp_path / "ops-free.jsonl", records), demo).ok
