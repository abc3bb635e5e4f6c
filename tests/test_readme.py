"""Every command and code block of README.md runs as written, on the demo model.

The fenced ```bash lines are parsed by bash itself (quotes, globs, comments) and run through the `diffgemma` CLI,
all in one subprocess (one torch import) in a scratch folder, in README order: `quantize` makes the pack that
`verify` checks, and `serve` (run as its own process, stopped after one request) writes the op-log that `replay`
runs again. The ```python blocks run in a subprocess of their own. Each line's output is checked for what it
promises (EXPECTED). A line that cannot run here is listed in SKIPPED with its reason; a README line neither
skipped nor checked fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import diffgemma
from diffgemma.loader import embedded_model_path

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)

# README lines (the command, its comment left out) that are not run here, and why.
SKIPPED = {
    "pip install -e '.[test]' && python -m pytest -q": "runs this test suite itself",
    'diffgemma ask "..." --model /path/to/diffusiongemma-26B-A4B-it --device cuda':
        "needs the 26B checkpoint and a GPU",
    "diffgemma serve --model /path/to/DiffusionGemma-FP8-Dynamic":
        "needs the published checkpoint (tests/test_hub_fp8.py serves and asks the test checkpoints)",
    'diffgemma ask "..." --model /path/to/DiffusionGemma-NVFP4': "needs the published checkpoint",
    'diffgemma ask "..." --model /path/to/DiffusionGemma-NVFP4-ModelOpt': "needs the published checkpoint",
    'diffgemma ask "..." --model /path/to/DiffusionGemma-W4A16': "needs the published checkpoint",
    'diffgemma ask "..." --model /path/to/DiffusionGemma-int4-AutoRound': "needs the published checkpoint",
    "diffgemma census --arms src/diffgemma/assets/batteries/longctx.arms.json --battery longctx --out DIR":
        "a campaign takes minutes on the CPU (tests/test_quality.py runs census on small batteries)",
    "diffgemma smoketest": "the whole smoke battery takes minutes on the CPU (tests/test_quality.py checks the gate logic)",
}
# Placeholders of the bash lines, and what stands for them here.
PLACEHOLDERS = {"MODEL_DIR": str(embedded_model_path()), "PACK_DIR": "pack"}
# What a line's run gets besides the line: stdin for `chat`; a smaller budget for the open-ended "..." prompt.
STDIN = {"diffgemma chat --context 4096": "What is 2 + 3?\n/exit\n"}
EXTRA = {'diffgemma ask "..." --set entropy_bound=0.2 --set confidence_trim=0 --stats': " --max-new-tokens 32"}
SERVE = "diffgemma serve --log-dir logs/"
SERVES = importlib.util.find_spec("uvicorn") is not None and importlib.util.find_spec("httpx") is not None

# Runs each command line it is given (JSON on stdin: [[line, stdin], ...]) through diffgemma.cli.main, in order:
# bash turns the line into words, exactly as a shell would; the words after `diffgemma` are main's argv.
DRIVER = r'''
import contextlib, io, json, subprocess, sys
from diffgemma import cli

results = []
for line, stdin in json.load(sys.stdin):
    words = subprocess.run(["bash", "-c", "printf '%s\\0' " + line], capture_output=True, text=True, check=True)
    argv = words.stdout.split("\0")[:-1]
    assert argv[0] == "diffgemma", argv
    out, err = io.StringIO(), io.StringIO()
    sys.stdin = io.StringIO(stdin)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv[1:])
        except SystemExit as e:
            rc = e.code
    results.append({"line": line, "argv": argv, "rc": rc, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
'''


def fenced(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README.read_text()) if kind == lang]


def command(line: str) -> str:
    """A README line without its comment (the commands' own text has no '#')."""
    return line.split("#", 1)[0].strip()


def bash_lines() -> list[str]:
    return [command(ln) for body in fenced("bash") for ln in body.splitlines() if command(ln)]


def env() -> dict:
    src = str(Path(diffgemma.__file__).resolve().parents[1])  # this checkout's diffgemma, installed or not
    out = {k: v for k, v in os.environ.items() if not k.startswith("DIFFGEMMA_")}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return out


def runnable(line: str) -> str:
    """The part of a line that is run: after `pip install ... &&` only the diffgemma command; placeholders
    replaced."""
    line = line.split("&&")[-1].strip()
    for name, value in PLACEHOLDERS.items():
        line = re.sub(rf"\b{name}\b", value, line)
    return line


def test_readme_has_only_blocks_this_test_runs():
    kinds = [kind for kind, _ in FENCE.findall(README.read_text())]
    assert set(kinds) <= {"bash", "python", ""}, kinds  # "": the layout tree, not code
    assert kinds.count("bash") >= 2 and kinds.count("python") == 1
    lines = bash_lines()
    assert set(SKIPPED) | set(STDIN) | set(EXTRA) <= set(lines)  # none stale
    assert lines[0] == 'pip install . && diffgemma ask "What is 17 + 25?"'  # the quickstart, exactly
    assert lines[1] == "pip install -e '.[test]' && python -m pytest -q"
    assert len(README.read_text().splitlines()) < 150  # a newcomer's two-minute read; the reference is in docs/
    assert all(runnable(ln).startswith("diffgemma ") for ln in lines if ln not in SKIPPED)


def test_readme_names_what_ships():
    """What a skipped line names is there: the census line's arms file ships, and the served model id that
    test_serve_line's client sends is the one the README gives."""
    root = README.parent
    for line in bash_lines():
        for arms in re.findall(r"--arms (\S+)", line):
            assert (root / arms).is_file(), line
    assert "`diffgemma-demo`" in README.read_text()


def test_layout_names_every_module():
    """The Layout tree names every top-level module and package of src/diffgemma (as `name.py` or `name/`)."""
    (tree,) = fenced("")
    pkg = Path(diffgemma.__file__).resolve().parent
    names = {p.name for p in pkg.glob("*.py") if not p.name.startswith("__")}
    names |= {p.name + "/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    missing = sorted(n for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", tree))
    assert not missing, f"README's Layout does not name {missing}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(cwd: Path) -> dict:
    """The README's serve line (on a free port) until it answers one chat request; then Ctrl-C."""
    import httpx

    port = free_port()
    argv = runnable(SERVE).split()[1:] + ["--port", str(port)]
    proc = subprocess.Popen([sys.executable, "-m", "diffgemma.cli", *argv], cwd=cwd, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "serve did not answer /health within 120 s"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "diffgemma-demo", "messages": [{"role": "user", "content": "What is 17 + 25?"}]}).json()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"reply": reply, "rc": proc.returncode, "err": proc.stderr.read()}


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    """Every runnable bash line of the README, run in a scratch folder -> {README line: its result}."""
    cwd = tmp_path_factory.mktemp("readme")
    lines = [ln for ln in bash_lines() if ln not in SKIPPED]
    assert SERVE in lines
    before, after = lines[:lines.index(SERVE)], lines[lines.index(SERVE) + 1:]
    if SERVES:
        results = {SERVE: run_serve(cwd)}
        logs = sorted((cwd / "logs").glob("ops-*.jsonl"))
        assert len(logs) == 1
        shutil.copy(logs[0], logs[0].with_name(logs[0].stem + "-copy.jsonl"))  # two logs: the glob names both
    else:  # serve, and the replay of what it logs, need the 'serve' extra
        results = {}
        after = [ln for ln in after if not ln.startswith("diffgemma replay ")]
    todo = [[runnable(ln) + EXTRA.get(ln, ""), STDIN.get(ln, "")] for ln in before + after]
    proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=cwd, env=env(), input=json.dumps(todo),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line, result in zip(before + after, json.loads(proc.stdout)):
        results[line] = result
    results["cwd"] = cwd
    return results


def line_of(start: str) -> str:
    found = [ln for ln in bash_lines() if ln.startswith(start) or ln.split("&& ")[-1].startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


# (the start of a README line, what its stdout is, and what its stderr holds)
EXPECTED = [
    ('diffgemma ask "What is 17 + 25?"', "42\n", ""),
    ('diffgemma ask "Sort these numbers', "6 12 31 45 87\n", "block 0 step"),
    ('diffgemma ask "What is 12 + 30 + 7?"', "[thought]", ""),
    ("diffgemma ask \"What's the weather in Paris?\" --tools model", "", '[tool call] get_weather({"city": "Paris"})'),
    ('diffgemma ask "..." --set', "", "[blocks="),
    ("diffgemma chat --context 4096", "5\n", ""),
    ("diffgemma golden", "golden: ", ""),
    ("diffgemma quantize", "pack\n", ""),
    ("diffgemma verify", "every sha256 matches the manifest\n", ""),
    ("diffgemma replay", "replay: 2 logs: 2 identical\n", ""),
    ("diffgemma settings", "entropy_bound ", ""),
    ("diffgemma --version", "diffgemma ", ""),
]


@pytest.mark.parametrize("start,out,err", EXPECTED, ids=[e[0].split('"')[0].split()[1] + str(i)
                                                        for i, e in enumerate(EXPECTED)])
def test_bash_line(ran, start, out, err):
    if line_of(start) not in ran:
        pytest.skip("replays what serve logs; serve needs uvicorn (pip install '.[serve]')")
    result = ran[line_of(start)]
    assert result["rc"] == 0, result
    if start == 'diffgemma ask "What is 12 + 30 + 7?"':
        assert result["out"].startswith("[thought]\n") and result["out"].endswith("[/thought]\n49\n"), result
    elif start == "diffgemma golden":
        assert re.search(r"^golden: \d+ passed, 0 failed$", result["out"], re.M), result
    elif start == "diffgemma replay":
        assert result["out"].endswith(out) and result["out"].count("logged events: identical") == 2, result
    elif start in ("diffgemma quantize", "diffgemma verify"):
        assert result["out"].endswith(out) and (ran["cwd"] / "pack" / "manifest.json").is_file(), result
    else:
        assert result["out"] == out if out.endswith("\n") else out in result["out"], result
    assert err in result["err"], result


def test_every_run_line_is_checked(ran):
    checked = {line_of(start) for start, _, _ in EXPECTED} | {SERVE}
    assert checked == set(bash_lines()) - set(SKIPPED)
    assert set(ran) - {"cwd"} == (checked if SERVES else checked - {SERVE, line_of("diffgemma replay")})


@pytest.mark.skipif(not SERVES, reason="serve needs uvicorn (pip install '.[serve]') and httpx")
def test_serve_line(ran):
    served = ran[SERVE]
    assert served["reply"]["choices"][0]["message"]["content"] == "42", served
    assert served["rc"] == 0 and "Traceback" not in served["err"], served


def test_python_block(tmp_path):
    (block,) = fenced("python")
    checks = """
assert logits.shape == (model.config.canvas_length, model.config.vocab_size) and logits.dtype == torch.float32
assert model.tokenizer.decode(out.tokens) == "42" and len(out.steps_per_block) >= 1
assert isinstance(text, str) and text
assert session.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
assert "17" in reply.answer, reply.answer
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", block + checks], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-3000:]
