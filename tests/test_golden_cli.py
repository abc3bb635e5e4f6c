"""`diffgemma golden` end to end on the embedded demo model, through the command's `main([...])` entry point: the
shipped fixture passes (exit 0), a fixture whose pinned tokens were tampered with fails (exit 1) naming the case and
the first differing token, and a missing fixture is a one-line error (exit 2). tests/test_golden.py checks the same
cases through the library; this is the command a user runs."""

import json

import pytest

from diffgemma import golden
from diffgemma.cli import main
from diffgemma.loader import embedded_model_path

FIXTURE = embedded_model_path() / golden.FIXTURE_NAME


def test_golden_command_passes_on_the_shipped_fixture(capsys):
    assert main(["golden"]) == 0
    out = capsys.readouterr().out
    n = len(golden.CASES)
    assert f"golden: {n} passed, 0 failed" in out


def test_golden_command_fails_on_a_tampered_fixture(tmp_path, capsys):
    fixture = json.loads(FIXTURE.read_text())
    case = fixture["cases"]["arith_default"]
    last = len(case["tokens"]) - 1
    case["tokens"][last] ^= 1  # one pinned token changed (to another valid id)
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(fixture))
    assert main(["golden", "--fixture", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"arith_default: tokens differ from index {last}" in out
    assert f"golden: {len(golden.CASES) - 1} passed, 1 failed" in out
    assert json.loads(path.read_text()) == fixture  # a check never rewrites the fixture


def test_golden_command_without_a_fixture_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    assert main(["golden", "--fixture", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "--bless" in err
    assert not missing.exists()


def test_golden_command_refuses_a_fixture_of_another_model(tmp_path, capsys):
    """A quantized pack carries the checkpoint's golden.json among its side files: checking it against the pack's
    (different) outputs must say the fixture belongs to another model, not fail every case."""
    pack = tmp_path / "pack"
    assert main(["quantize", str(embedded_model_path()), "-o", str(pack), "--profile", "q4"]) == 0
    assert (pack / golden.FIXTURE_NAME).is_file()  # copied with the config and tokenizer
    capsys.readouterr()
    assert main(["golden", "--model", str(pack)]) == 2
    err = capsys.readouterr().err
    assert "this fixture pins another model's outputs" in err and "--bless" in err and err.count("\n") == 1
    assert golden.load_fixture(FIXTURE, embedded_model_path())  # the shipped one is the demo's own
