"""`diffgemma replay` shows its progress on stderr at a terminal: a bar per log, advanced per generation, named
by the log's place among the logs; piped, stderr stays clean (tqdm's own rule)."""

import io
import sys

from diffgemma import cli
from diffgemma.replay import run_logs


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_replay_reports_progress_per_log_and_generation(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 3?\nAnd 4 + 4?\n"))
    assert cli.main(["chat", "--log-dir", str(tmp_path), "--seed", "5"]) == 0
    assert cli.main(["ask", "What is 17 + 25?", "--log-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    paths = sorted(tmp_path.glob("ops-*.jsonl"))
    assert len(paths) == 2
    err, out = Terminal(), io.StringIO()
    assert run_logs(paths, out=out, err=err) == 0
    shown = err.getvalue()
    for i, path in enumerate(paths):
        assert f"replay {i + 1}/2 {path.name}" in shown
    assert "0/2" in shown and "2/2" in shown  # the chat log's two generations, one at a time
    assert "1/1" in shown
    piped = io.StringIO()
    assert run_logs(paths, out=io.StringIO(), err=piped) == 0
    assert piped.getvalue() == ""
