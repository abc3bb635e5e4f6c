"""Every input the CLI can be given gets a one-line error or a clear answer, never a traceback: bytes that are not
UTF-8, tool files without names, devices the engine cannot run on, a busy port, --version, the settings list."""

import io
import json
import socket
import sys

import pytest

from diffgemma import cli


def run_cli(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", stdin)
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, needle):
    assert code == cli.EXIT_USAGE, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffgemma: error:") and needle in lines[0], err


def test_a_prompt_that_is_not_utf8(capsys):
    prompt = b"\xff\xfe".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    code, out, err = run_cli(["ask", prompt, "--device", "cpu"], capsys)
    one_line_error(code, err, "the prompt: not valid UTF-8 text (byte 0xff at character 0)")
    assert out == ""


def test_chat_input_that_is_not_utf8(capsys, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"hi \xff\xfe\n"), encoding="utf-8")
    code, out, err = run_cli(["chat", "--device", "cpu", "--max-new-tokens", "4"], capsys, stdin, monkeypatch)
    one_line_error(code, err, "the input: not valid UTF-8 text (byte 0xff)")
    stdin = io.TextIOWrapper(io.BytesIO(b"hi \xff\n"), encoding="utf-8", errors="surrogateescape")
    code, out, err = run_cli(["chat", "--device", "cpu", "--max-new-tokens", "4"], capsys, stdin, monkeypatch)
    one_line_error(code, err, "the input: not valid UTF-8 text (byte 0xff")


@pytest.mark.parametrize("entry", [{"type": "function", "function": {"description": "x"}},
                                   {"type": "function", "function": {"name": ""}}, {"description": "x"},
                                   {"type": "function", "function": "get_weather"}])
def test_a_tools_entry_without_a_name(tmp_path, capsys, entry):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([{"type": "function", "function": {"name": "ok"}}, entry]))
    code, out, err = run_cli(["ask", "hi", "--device", "cpu", "--tools", str(path)], capsys)
    one_line_error(code, err, f"--tools {path}: entry 1 has no name")


@pytest.mark.parametrize("command", [["ask", "hi"], ["golden"], ["serve"]])
@pytest.mark.parametrize("device", ["meta", "mps", "cuda:x", "cpu:0", "gpu"])
def test_a_device_the_engine_cannot_run_on(capsys, command, device):
    code, out, err = run_cli(command + ["--device", device], capsys)
    one_line_error(code, err, f"--device {device}: expected cpu, cuda, cuda:N or auto")


def test_version_and_help_texts(capsys):
    import diffgemma

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"diffgemma {diffgemma.__version__}"
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for command, flags in (("ask", ("--seed", "--max-new-tokens")), ("chat", ("--seed", "--max-new-tokens")),
                           ("serve", ("--host", "--port", "--limit"))):
        actions = {opt: a for a in subs[command]._actions for opt in a.option_strings}
        for flag in flags:
            assert actions[flag].help and len(actions[flag].help) > 20, (command, flag)
        for a in subs[command]._actions:  # every flag says what it does
            assert a.help, (command, a.option_strings)


def test_settings_lists_every_name_with_its_default(capsys):
    from diffgemma.settings import FIELD_NAMES, GenerationSettings

    code, out, err = run_cli(["settings"], capsys)
    rows = dict(line.split(None, 1) for line in out.strip().splitlines())
    assert code == 0 and err == "" and list(rows) == list(FIELD_NAMES)
    assert rows["entropy_bound"] == repr(GenerationSettings().entropy_bound)
    code, out, _ = run_cli(["settings", "--model", "demo"], capsys)
    assert code == 0 and "stop_ids" in out and "(1, 106, 50)" in out  # the demo's eos ids
    code, out, err = run_cli(["settings", "--model", "/nonexistent/dir"], capsys)
    one_line_error(code, err, "--model /nonexistent/dir: no such directory")
    code, out, err = run_cli(["ask", "hi", "--set", "entropy_bond=1"], capsys)
    one_line_error(code, err, "entropy_bond")


def test_serve_on_a_busy_port_fails_before_announcing(capsys):
    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run_cli(["serve", "--device", "cpu", "--port", str(port)], capsys)
    one_line_error(code, err, f"cannot listen on 127.0.0.1:{port}")
    assert "http://" not in err and out == ""
    code, out, err = run_cli(["serve", "--device", "cpu", "--limit", "canvas_length=0"], capsys)
    one_line_error(code, err, "--limit 'canvas_length=0': expected a positive integer")
    code, out, err = run_cli(["serve", "--device", "cpu", "--limit", "canvas=64"], capsys)
    one_line_error(code, err, "NAME one of canvas_length")
