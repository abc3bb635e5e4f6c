"""Run a generated program against fixture cases, each in a fresh temp dir under jail.py's limits.

Three outcomes stay apart: the program does not parse (compile_fail), it runs but a case's stdout or exit status is
wrong (wrong_output), or every case matches (pass). A program that hangs, forks or writes outside its temp dir
fails its case (timeout, fork refused, write refused) and leaves nothing behind: jail.py kills every process it
started. The census process never forks a program itself: jail.py is a fresh interpreter that applies the limits
before exec, which a threaded parent (torch) cannot safely do in a preexec hook.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

JAIL = Path(__file__).with_name("jail.py")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
LANGUAGES = {
    # name: (file name, syntax-check argv, run argv, processes the program may start); "python" is resolved
    # by python_interpreter()
    "python": ("prog.py", None, ["python", "-I", "prog.py"], 0),
    "bash": ("prog.sh", ["bash", "-n", "prog.sh"], ["bash", "prog.sh"], 16),
}
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:\n```|\Z)", re.S)


@dataclass
class Limits:
    timeout_s: float = 10.0  # wall clock per case
    memory_bytes: int = 1 << 30  # address space
    file_bytes: int = 16 << 20  # largest file it may write (stdout included)
    output_bytes: int = 1 << 20  # stdout / stderr kept for the check


@dataclass
class RunResult:
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    signal: int | None = None
    leftover_processes: int = 0
    confined: bool = False  # Landlock held writes to the temp dir


@dataclass
class ProgramVerdict:
    outcome: str  # "pass", "wrong_output" or "compile_fail"
    fenced: bool
    cases_passed: int
    cases_total: int
    detail: str
    runs: list[RunResult] = field(default_factory=list)


def strip_fence(reply: str) -> tuple[str, bool]:
    """The program in a reply, and whether it came inside a markdown fence (the first fenced block wins)."""
    m = _FENCE.search(reply)
    if m:
        return m.group(1).strip("\n") + "\n", True
    return reply.strip("\n") + "\n", False


def _unprivileged_uid() -> int | None:
    """The uid programs run as when we are root (root ignores RLIMIT_NPROC and file permissions)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def python_interpreter() -> str:
    """The interpreter programs run under: ours, unless programs run as another uid (we are root), which may not
    be able to reach ours (a home-directory install): then the system's python3."""
    if _unprivileged_uid() is None:
        return sys.executable
    return shutil.which("python3", path=SANDBOX_PATH) or sys.executable


def run_jailed(argv: list[str], files: dict[str, str], stdin: str = "", limits: Limits | None = None,
               forks: int = 0) -> RunResult:
    """Run argv in a fresh temp dir holding `files` (name -> text) under the jail; the dir is removed after."""
    limits = limits or Limits()
    uid = _unprivileged_uid()
    with tempfile.TemporaryDirectory(prefix="dg-sandbox-") as private:
        work = Path(private) / "work"  # the program's cwd; the rest of `private` (spec, pipes) is ours
        work.mkdir()
        for name, text in files.items():
            (work / name).write_text(text)
        if uid is not None:  # the dropped uid may pass through `private` (ours, root's) and write in `work` only
            os.chmod(private, 0o711)
            os.chown(work, uid, uid)
            for name in files:
                os.chown(work / name, uid, uid)
        spec = {"argv": argv, "cwd": str(work), "timeout_s": limits.timeout_s,
                "cpu_s": max(1, int(limits.timeout_s) + 1), "as_bytes": limits.memory_bytes,
                "fsize_bytes": limits.file_bytes, "forks": forks, "uid": uid, "status": f"{private}/status.json",
                "env": {"PATH": SANDBOX_PATH, "HOME": str(work), "TMPDIR": str(work),
                        "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}}
        Path(private, "spec.json").write_text(json.dumps(spec))
        Path(private, "stdin").write_text(stdin)
        with open(f"{private}/stdin", "rb") as fin, open(f"{private}/stdout", "wb") as fout, \
                open(f"{private}/stderr", "wb") as ferr:
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(JAIL), f"{private}/spec.json"], stdin=fin,
                                    stdout=fout, stderr=ferr, cwd=private, env={"PATH": spec["env"]["PATH"]},
                                    start_new_session=True, close_fds=True)
            try:
                proc.wait(timeout=limits.timeout_s + 30)  # the jail enforces the timeout; this is the backstop
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        try:
            status = json.loads(Path(private, "status.json").read_text())
        except (OSError, json.JSONDecodeError):
            status = {"exit_code": None, "timed_out": True, "signal": None, "leftover_processes": 0,
                      "landlock_abi": 0}
        out = _read(Path(private, "stdout"), limits.output_bytes)
        err = _read(Path(private, "stderr"), limits.output_bytes)
        shutil.rmtree(work, ignore_errors=True)
    return RunResult(exit_code=status["exit_code"], stdout=out, stderr=err, timed_out=status["timed_out"],
                     signal=status.get("signal"), leftover_processes=status.get("leftover_processes", 0),
                     confined=bool(status.get("landlock_abi")))


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def _same_output(got: str, want: str) -> bool:
    """stdout equality up to trailing whitespace on each line and trailing blank lines."""
    norm = lambda s: "\n".join(line.rstrip() for line in s.rstrip().splitlines())  # noqa: E731
    return norm(got) == norm(want)


def syntax_error(language: str, code: str, limits: Limits | None = None) -> str | None:
    """None when the program parses, else the first line of the complaint."""
    name, check, _, _ = LANGUAGES[language]
    if check is None:  # python: compile() parses without running anything
        try:
            compile(code, name, "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
            return f"{type(e).__name__}: {e}"
        return None
    r = run_jailed(check, {name: code}, limits=limits)
    if r.exit_code == 0:
        return None
    return (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[0]


def judge_program(reply: str, language: str, cases: list[dict], limits: Limits | None = None) -> ProgramVerdict:
    code, fenced = strip_fence(reply)
    err = syntax_error(language, code, limits)
    if err is not None:
        return ProgramVerdict("compile_fail", fenced, 0, len(cases), err)
    name, _, argv, forks = LANGUAGES[language]
    if argv[0] == "python":
        argv = [python_interpreter()] + argv[1:]
    runs, failures = [], []
    for i, case in enumerate(cases):
        r = run_jailed(argv + [str(a) for a in case.get("args", [])], {name: code}, stdin=case.get("stdin", ""),
                       limits=limits, forks=forks)
        runs.append(r)
        want_code = case.get("exit_code", 0)
        if r.timed_out:
            failures.append(f"case {i}: timed out")
        elif r.exit_code != want_code:
            why = f"signal {r.signal}" if r.signal else f"exit {r.exit_code}"
            failures.append(f"case {i}: {why}, expected exit {want_code}")
        elif "stdout" in case and not _same_output(r.stdout, case["stdout"]):
            failures.append(f"case {i}: stdout {r.stdout[:60]!r}, expected {case['stdout'][:60]!r}")
    passed = len(cases) - len(failures)
    if failures:
        return ProgramVerdict("wrong_output", fenced, passed, len(cases), "; ".join(failures[:3]), runs)
    return ProgramVerdict("pass", fenced, passed, len(cases), f"{passed}/{len(cases)} cases", runs)
