"""The `diffgemma` command end to end: ask, chat, and one-line exit-2 errors (`golden`: tests/test_golden_cli.py)."""

import io
import json
import shutil
import subprocess
import sys

import pytest

from diffgemma.cli import main
from diffgemma.loader import embedded_model_path
from tiny_checkpoints import CONFIGS, build_model, save

DEMO = embedded_model_path()


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A random tiny checkpoint that carries the demo tokenizer and chat template (vocab matched)."""
    vocab = json.loads((DEMO / "config.json").read_text())["text_config"]["vocab_size"]
    cfg = dict(CONFIGS["gqa2_mixed"], vocab_size=vocab)
    path = save(build_model(cfg, canvas_length=16), tmp_path_factory.mktemp("tiny_tok"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(DEMO / name, path)
    return path


def run(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_ask_on_a_tiny_random_checkpoint(tiny_with_tokenizer, capsys):
    code, out, err = run(["ask", "Hello there", "--model", tiny_with_tokenizer, "--max-new-tokens", "20",
                          "--set", "max_denoising_steps=4", "--stats", "--device", "cpu"], capsys)
    assert code == 0
    stats = err.strip().splitlines()[-1]
    assert stats.startswith("[blocks=") and "prefilled=" in stats
    # A random model: the answer is noise, but ask must print exactly one answer block and end.
    assert out.endswith("\n")


def test_ask_demo_model_is_deterministic(capsys):
    args = ["ask", "What is 6 * 7?", "--seed", "3", "--device", "cpu"]
    first = run(args, capsys)
    second = run(args, capsys)
    assert first[0] == 0 and first == second
    assert first[1].strip()  # the trained model says something


def test_show_canvas_draws_each_block(tiny_with_tokenizer, capsys):
    code, out, err = run(["ask", "Hi", "--model", tiny_with_tokenizer, "--show-canvas", "--max-new-tokens", "16",
                          "--set", "max_denoising_steps=3", "--device", "cpu"], capsys)
    assert code == 0
    assert "block 0 step" in err and "accepted" in err


def test_chat_reuses_the_kv_cache_between_turns(tiny_with_tokenizer, capsys, monkeypatch):
    code, out, err = run(["chat", "--model", tiny_with_tokenizer, "--stats", "--max-new-tokens", "8",
                          "--set", "max_denoising_steps=2", "--device", "cpu"], capsys,
                         stdin="first question\nsecond question\n", monkeypatch=monkeypatch)
    assert code == 0
    stats = [l for l in err.splitlines() if l.startswith("[blocks=")]
    assert len(stats) == 2
    reused = int(stats[1].split("reused=")[1].split()[0])
    prefilled = int(stats[1].split("prefilled=")[1].split()[0])
    assert reused > 10  # the first turn's prompt (and answer) are served from the cache
    assert prefilled > 0


@pytest.mark.parametrize("argv,needle", [
    (["ask", "hi", "--set", "no_such_setting=1"], "no_such_setting"),
    (["ask", "hi", "--set", "entropy_bound=abc"], "entropy_bound"),
    (["ask", "hi", "--set", "entropy_bound"], "name=value"),
    (["ask", "hi", "--model", "/no/such/model"], "/no/such/model"),
    (["ask", "hi", "--frobnicate"], "--frobnicate"),
    (["ask"], "prompt"),
    (["summon"], "summon"),
    (["ask", "hi", "--context", "0"], "--context 0: expected a positive number"),
    (["ask", "hi", "--context", "5000"], "--context 5000: over this model's context of 4096 tokens"),
    (["ask", "What is 17 + 25?", "--context", "16"], "max_tokens=16"),  # the flag sizes the session's cache
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors leave through SystemExit
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffgemma: error:") and needle in lines[0], err


def test_unknown_environment_variable_is_an_error(monkeypatch, capsys):
    monkeypatch.setenv("DIFFGEMMA_ENTROPY_BOUNDD", "0.2")
    code = main(["ask", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "DIFFGEMMA_ENTROPY_BOUNDD" in err and len(err.strip().splitlines()) == 1


def test_console_script_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diffgemma.cli", "ask", "hi", "--set", "bogus=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_ask_with_the_models_own_tools_prints_a_parsed_call(capsys):
    code, out, err = run(["ask", "What's the weather in Oslo?", "--tools", "model", "--device", "cpu"], capsys)
    assert code == 0
    assert out.strip() == '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
    assert '[tool call] get_weather({"city": "Oslo"})' in err


def test_bad_tools_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "tools.json"
    bad.write_text("{not json")
    code, out, err = run(["ask", "hi", "--tools", str(bad)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not valid JSON" in err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_interactive_chat_reports_a_failed_turn_and_goes_on(capsys, monkeypatch):
    """At a terminal a turn that fails (here /tool with no call to answer, then a turn too long for --context) is
    reported and dropped, and the chat goes on; /reset starts a new conversation. Piped, the first error ends it."""
    too_long = "Sort these numbers: " + " ".join(str(i) for i in range(200))
    lines = f"/tool 17\nWhat is 17 + 25?\n{too_long}\n/reset\nWhat is 17 + 25?\n"
    monkeypatch.setattr(sys, "stdin", Terminal(lines))
    code, out, err = run(["chat", "--context", "300", "--stats"], capsys)
    assert code == 0, err
    stats = [line for line in err.splitlines() if line.startswith("[blocks=")]
    reuse = [(int(x.split("reused=")[1].split()[0]), int(x.split("prefilled=")[1].split()[0])) for x in stats]
    assert len(reuse) == 2 and reuse[1] == reuse[0] and reuse[0][0] == 0  # after /reset: a fresh conversation
    assert "/tool: the model made no tool call to answer (the turn was dropped" in err
    assert "KV cache overflow" in err and "(ask / chat: --context)" in err and "(the turn was dropped" in err
    assert out.count("42") == 2  # the question is answered on the first conversation, then after /reset
    code, out, err = run(["chat", "--context", "300"], capsys, stdin=lines, monkeypatch=monkeypatch)
    assert code == 2 and "/tool: the model made no tool call" in err and out == ""


def test_output_into_a_closed_pipe_ends_quietly():
    """`diffgemma settings | head`, the reader gone before the output: the command stops without a traceback (exit
    141, as a shell tool killed by SIGPIPE reports)."""
    import os

    r, w = os.pipe()
    os.close(r)  # every write into w now fails (EPIPE)
    try:
        proc = subprocess.run([sys.executable, "-m", "diffgemma", "settings"], stdout=w, stderr=subprocess.PIPE,
                              timeout=120)
    finally:
        os.close(w)
    err = proc.stderr.decode()
    assert proc.returncode == 141 and "Traceback" not in err and "Exception ignored" not in err, err
