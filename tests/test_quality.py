"""Quality harnesses (diffgemma.quality): arms, checkers, the program sandbox, the campaign runner with scripted
replies (outcomes, resume, gates, analyze), and the census CLI end to end on the demo model."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from diffgemma.cli import main
from diffgemma.errors import InputError, SettingsError
from diffgemma.quality import analyze, gates
from diffgemma.quality.arms import parse_campaign
from diffgemma.quality.batteries import load_battery, parse_battery, shipped_names
from diffgemma.quality.checkers import check
from diffgemma.quality.commands import analyze_dir, run
from diffgemma.quality.runner import Reply, run_campaign
from diffgemma.quality.sandbox import Limits, judge_program, strip_fence

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's guards are Linux's")


# ---------------------------------------------------------------------------------------------------------- arms
def test_arms_validate_like_set_and_name_the_arm():
    c = parse_campaign({"a": {}, "hf": {"semantics": "hf"}, "b": ["entropy_bound=0.3", "pad-gate=off"]})
    assert [a.name for a in c.arms] == ["a", "hf", "b"] and c.baseline == "a"
    assert c.arm("b").overrides == {"entropy_bound": 0.3, "pad_gate": False}
    assert c.arm("hf").overrides == {"semantics": "hf"}
    with pytest.raises(SettingsError, match="arm 'b'.*entropy_bund"):
        parse_campaign({"a": {}, "b": {"entropy_bund": 0.3}})
    with pytest.raises(SettingsError, match="arm 'b'.*t_max"):
        parse_campaign({"a": {}, "b": {"t_max": 0.1, "t_min": 0.5}})  # ranges too, across fields
    with pytest.raises(InputError, match="metric 'exact'"):
        parse_campaign({"arms": {"a": {}}, "gates": [{"arm": "a", "metric": "exact", "min": 1}]})
    with pytest.raises(InputError, match="arm 'c'"):
        parse_campaign({"arms": {"a": {}}, "gates": [{"arm": "c", "metric": "forwards", "max": 1}]})


def test_a_typo_in_an_arm_exits_2_before_the_model_loads(tmp_path, capsys, monkeypatch):
    arms = tmp_path / "arms.json"
    arms.write_text(json.dumps({"a": {}, "b": {"entropy_bund": 0.3}}))
    import diffgemma.quality.commands as commands

    monkeypatch.setattr(commands, "load_model", lambda args: pytest.fail("the model was loaded"))
    assert main(["census", "--arms", str(arms), "--battery", "smoke", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "entropy_bund" in err and "arm 'b'" in err
    assert main(["census", "--arms", str(tmp_path / "none.json"), "--battery", "smoke", "--out", "x"]) == 2
    arms.write_text(json.dumps({"a": {}}))
    assert main(["census", "--arms", str(arms), "--battery", "smokey", "--out", "x"]) == 2
    assert "smokey" in capsys.readouterr().err
    monkeypatch.setenv("DIFFGEMMA_ENTROPY_BOUND", "lots")  # the environment applies to every arm
    assert main(["census", "--arms", str(arms), "--battery", "smoke", "--out", str(tmp_path / "o")]) == 2
    assert "DIFFGEMMA_ENTROPY_BOUND" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ batteries
def test_shipped_batteries_load_and_are_well_formed():
    assert {"smoke", "programmatic", "longctx"} <= set(shipped_names())
    smoke = load_battery("smoke")
    assert len(smoke.prompts) >= 20 and smoke.digest
    assert {p.family for p in smoke.prompts} >= {"arith", "facts", "sort", "tool_call", "think"}
    assert all(p.tools for p in smoke.prompts if p.family.startswith("tool"))
    prog = load_battery("programmatic")
    assert all("program" in p.check and "fences" in p.messages[-1]["content"] for p in prog.prompts)
    longctx = load_battery("longctx")
    rungs = {p.rung for p in longctx.prompts}
    assert len(rungs) >= 3 and all({"doc", "needle"} == {p.probe for p in longctx.prompts if p.rung == r}
                                   for r in rungs)
    sizes = [len(p.messages[-1]["content"]) for p in longctx.prompts if p.probe == "doc"]
    assert sizes == sorted(sizes) and sizes[-1] > 8 * sizes[0]
    needle = next(p for p in longctx.prompts if p.probe == "needle")
    assert "access code" in needle.messages[-1]["content"]


def test_battery_errors_name_the_prompt():
    with pytest.raises(InputError, match="prompt 'x'.*exactly one of exact"):
        parse_battery({"prompts": [{"id": "x", "prompt": "hi", "check": {"exact": "a", "regex": "b"}}]})
    with pytest.raises(InputError, match="id 'x' appears twice"):
        parse_battery({"prompts": [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}]})
    with pytest.raises(InputError, match="tools 'nope'"):
        parse_battery({"prompts": [{"id": "x", "prompt": "a", "tools": "nope"}]})
    with pytest.raises(InputError, match="language must be one of"):
        parse_battery({"prompts": [{"id": "x", "prompt": "a", "check": {"program": {"language": "cobol"}}}]})


# ------------------------------------------------------------------------------------------------------- checkers
def test_text_checkers():
    assert check({"exact": "42"}, " 42\n").outcome == "pass"
    assert check({"exact": ["42", "forty-two"]}, "Forty-two", ).outcome == "fail"
    assert check({"exact": ["42", "forty-two"], "ignore_case": True}, "Forty-two").outcome == "pass"
    assert check({"contains": ["Paris", "sunny"]}, "It is sunny in Paris.").outcome == "pass"
    assert check({"contains": ["Paris", "rain"]}, "It is sunny in Paris.").detail == "missing 'rain'"
    assert check({"regex": r"\d+"}, "12a").outcome == "fail"
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    want = {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert check(want, call).outcome == "pass"
    assert "arguments" in check(want, call.replace("Paris", "Lyon")).detail
    assert "malformed" in check(want, call[:-12]).detail


# -------------------------------------------------------------------------------------------------------- sandbox
SUM = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
CASES = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5\n", "stdout": "5\n"}]
FAST = Limits(timeout_s=2.0)


def test_three_program_outcomes_stay_apart():
    ok = judge_program(SUM, "python", CASES, FAST)
    assert (ok.outcome, ok.cases_passed, ok.fenced) == ("pass", 2, False)
    wrong = judge_program(SUM.replace("sum(", "max(", 1), "python", CASES, FAST)
    assert (wrong.outcome, wrong.cases_passed) == ("wrong_output", 1)
    broken = judge_program("def f(:\n", "python", CASES, FAST)
    assert broken.outcome == "compile_fail" and not broken.runs  # never run
    assert judge_program("if then fi\n", "bash", [{"stdout": ""}], FAST).outcome == "compile_fail"
    assert judge_program("echo $(( $1 + $2 ))\n", "bash", [{"args": [2, 3], "stdout": "5\n"}], FAST).outcome == "pass"
    status = judge_program("import sys\nsys.exit(3)\n", "python", [{"exit_code": 3, "stdout": ""}], FAST)
    assert status.outcome == "pass"


def test_a_fenced_reply_is_run_but_fails_as_an_instruction_violation():
    code, fenced = strip_fence("Here:\n```python\n" + SUM + "```\n")
    assert fenced and code == SUM
    v = check({"program": {"language": "python", "cases": CASES, "timeout_s": 2}}, "```python\n" + SUM + "```")
    assert v.outcome == "fail" and v.extra["fenced"] and v.extra["cases_passed"] == 2
    assert "instruction violation" in v.detail


@linux_only
def test_a_hanging_program_times_out_and_leaves_nothing():
    t = time.monotonic()
    v = judge_program("import time\ntime.sleep(60)\n", "python", [{"stdout": ""}], Limits(timeout_s=1.0))
    assert v.outcome == "wrong_output" and "timed out" in v.detail
    assert time.monotonic() - t < 10
    busy = judge_program("while True:\n    pass\n", "python", [{"stdout": ""}], Limits(timeout_s=1.0))
    assert "timed out" in busy.detail


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd and "pytest" not in cmd:
            found.append(cmd)
    return found


@linux_only
def test_forks_are_refused_and_leftover_processes_are_killed():
    v = judge_program("import os\nos.fork()\nprint('forked')\n", "python", [{"stdout": "forked\n"}], FAST)
    assert v.outcome == "wrong_output"  # refused (an exception), or had it forked, "forked" twice
    if os.geteuid() == 0:  # as root, programs run as nobody, whose process count is exact; a user's may drift
        assert "BlockingIOError" in v.runs[0].stderr
    # a shell may start a few processes; whatever it leaves behind (a setsid'd sleeper) is killed at the end
    marker = "4242.5"
    sh = judge_program(f"(setsid sleep {marker} &)\necho hi\n", "bash", [{"stdout": "hi\n"}], FAST)
    assert sh.outcome == "pass" and sh.runs[0].leftover_processes >= 1
    time.sleep(0.2)
    assert _processes_with(f"sleep {marker}") == []
    bomb = judge_program("f(){ f | f & }; f\n", "bash", [{"stdout": ""}], Limits(timeout_s=3.0))
    assert bomb.runs[0].exit_code is not None or bomb.runs[0].timed_out  # it ended, bounded by RLIMIT_NPROC


@linux_only
def test_writes_outside_the_temp_dir_are_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    prog = f"open({str(target)!r}, 'w').write('x')\nprint('wrote')\n"
    v = judge_program(prog, "python", [{"stdout": "wrote\n"}], FAST)
    if not v.runs[0].confined:
        pytest.skip("this kernel has no Landlock: writes are only as confined as file permissions")
    assert v.outcome == "wrong_output" and not target.exists()
    inside = judge_program("open('mine.txt', 'w').write('x')\nprint(open('mine.txt').read())\n", "python",
                           [{"stdout": "x\n"}], FAST)
    assert inside.outcome == "pass"  # its own temp dir is writable


# --------------------------------------------------------------------------------------------- runner (scripted)
class Scripted:
    """A backend whose replies are a function of (arm overrides, prompt id); counts its calls; can be told to
    raise KeyboardInterrupt at a given call (a Ctrl-C mid-campaign)."""

    def __init__(self, answers, interrupt_at=None):
        self.answers = answers
        self.calls = []
        self.interrupt_at = interrupt_at

    def describe(self):
        return {"path": "scripted"}

    def run(self, prompt, overrides):
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls.append((prompt.id, dict(overrides)))
        loose = overrides.get("entropy_bound", 0.1) > 0.2
        answer = self.answers(prompt.id, loose)
        return Reply(answer=answer, tokens=4, forwards=2 if loose else 4, blocks=1, steps=2 if loose else 4,
                     block_ends=["stop_token"], seconds=0.01)


BATTERY = {"name": "toy", "prompts": [
    {"id": "a1", "prompt": "1+1?", "check": {"exact": "2"}},
    {"id": "a2", "prompt": "2+2?", "check": {"exact": "4"}},
    {"id": "a3", "prompt": "3+3?", "check": {"exact": "6"}},
    {"id": "a4", "prompt": "4+4?", "check": {"exact": "8"}},
    {"id": "free", "prompt": "say anything"},
]}
ANSWERS = {"a1": "2", "a2": "4", "a3": "6", "a4": "8", "free": "hello"}


def _campaign(gate_list=()):
    return parse_campaign({"arms": {"base": {}, "loose": {"entropy_bound": 0.3}}, "baseline": "base",
                           "gates": list(gate_list)})


def test_runner_records_outcomes_and_per_arm_stats(tmp_path):
    backend = Scripted(lambda pid, loose: "9" if (loose and pid == "a4") else ANSWERS[pid])
    summary = run_campaign(_campaign(), [parse_battery(BATTERY)], backend, tmp_path, progress=False)
    base, loose = summary["base"]["all"], summary["loose"]["all"]
    assert (base["checked"], base["passed"], base["exact_match"]) == (4, 4, 1.0)
    assert (loose["passed"], loose["exact_match"]) == (3, 0.75)
    assert (base["forwards"], loose["forwards"]) == (4.0, 2.0) and loose["tokens_per_forward"] == 2.0
    recs = analyze.read_results(tmp_path)
    assert len(recs) == 10 and {r["outcome"] for r in recs} == {"pass", "fail", "unchecked"}
    assert [r["arm"] for r in recs[:4]] == ["base", "loose", "base", "loose"]  # arms interleave
    assert all(o["seed"] == 0 for _, o in backend.calls)
    assert [o.get("entropy_bound") for _, o in backend.calls[:2]] == [None, 0.3]
    assert (tmp_path / "summary.md").read_text().startswith("| arm")


def test_gates_decide_the_exit_code(tmp_path):
    within = {"arm": "loose", "metric": "exact_match", "min_delta": -0.01}
    cheaper = {"arm": "loose", "metric": "forwards", "max_ratio": 0.8}
    summary = {"base": {"all": {"exact_match": 0.90, "forwards": 10.0}},
               "loose": {"all": {"exact_match": 0.89, "forwards": 8.0}}}
    res = gates.evaluate([within, cheaper], summary, "base")
    assert [r.ok for r in res] == [True, True] and gates.exit_code(res) == 0  # exactly 1 point, exactly 0.8x
    summary["loose"]["all"].update(exact_match=0.885, forwards=8.1)
    res = gates.evaluate([within, cheaper], summary, "base")
    assert [r.ok for r in res] == [False, False] and gates.exit_code(res) == 1
    assert "FAIL" in gates.report(res) and "loose.forwards / base.forwards <= 0.8" in gates.report(res)
    assert not gates.evaluate([{"arm": "gone", "metric": "forwards", "max": 1}], summary, "base")[0].ok

    class Args:
        no_progress = True

    backend = Scripted(lambda pid, loose: "9" if (loose and pid == "a4") else ANSWERS[pid])
    assert run(_campaign([within, cheaper]), [parse_battery(BATTERY)], [0], tmp_path / "x", Args, backend) == 1
    backend = Scripted(lambda pid, loose: ANSWERS[pid])
    assert run(_campaign([within, cheaper]), [parse_battery(BATTERY)], [0], tmp_path / "y", Args, backend) == 0


def test_interrupted_campaign_resumes_where_it_stopped(tmp_path, capsys):
    class Args:
        no_progress = True

    battery = parse_battery(BATTERY)
    first = Scripted(lambda pid, loose: ANSWERS[pid], interrupt_at=3)
    assert run(_campaign(), [battery], [0, 1], tmp_path, Args, first) == 130
    assert "resume" in capsys.readouterr().err
    assert len(analyze.read_results(tmp_path)) == 3
    assert "incomplete" in (tmp_path / "summary.md").read_text()
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"arm": "base", "battery": "toy", "id": "a3", "se')  # a kill mid-write
    second = Scripted(lambda pid, loose: ANSWERS[pid])
    assert run(_campaign(), [battery], [0, 1], tmp_path, Args, second) == 0
    assert len(second.calls) == 20 - 3  # only what was missing
    recs = analyze.read_results(tmp_path)
    assert len(recs) == 20 and len({analyze.record_key(r) for r in recs}) == 20
    assert all(json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines())
    other = parse_campaign({"base": {}, "loose": {"entropy_bound": 0.5}})
    with pytest.raises(InputError, match="different campaign"):
        run_campaign(other, [battery], Scripted(lambda p, l: ""), tmp_path, [0, 1], progress=False)


def test_analyze_reproduces_the_table_and_gates(tmp_path, capsys):
    class Args:
        no_progress = True

    gate = {"arm": "loose", "metric": "exact_match", "min_delta": -0.01}
    backend = Scripted(lambda pid, loose: "9" if (loose and pid == "a4") else ANSWERS[pid])
    assert run(_campaign([gate]), [parse_battery(BATTERY)], [0], tmp_path, Args, backend) == 1
    printed = capsys.readouterr().out
    assert analyze_dir(str(tmp_path)) == 1
    assert capsys.readouterr().out == printed
    assert main(["census", "--analyze", str(tmp_path)]) == 1
    assert capsys.readouterr().out == printed
    assert "| loose | toy     | 5 | 3    | 75.0" in printed
    assert main(["census", "--analyze", str(tmp_path / "nothing")]) == 2


def test_needle_right_document_wrong_is_reported_as_a_failure(tmp_path):
    battery = parse_battery({"name": "lc", "documents": {"d": "para one.\n\npara two."}, "prompts": [
        {"id": "r1-doc", "probe": "doc", "rung": "r1", "document": "d", "question": "q?", "check": {"exact": "one"}},
        {"id": "r1-needle", "probe": "needle", "rung": "r1", "document": "d", "question": "code?",
         "needle": {"text": "The code is 7.", "depth": 0.5}, "check": {"exact": "7"}}]})
    assert "para one.\n\nThe code is 7.\n\npara two." in battery.prompts[1].messages[-1]["content"]
    backend = Scripted(lambda pid, loose: "7" if pid.endswith("needle") else ("one" if loose else "two"))
    summary = run_campaign(_campaign(), [battery], backend, tmp_path, progress=False)
    assert summary["base"]["all"]["needle_only"] == 1 and summary["base"]["all"]["exact_match"] == 0.5
    assert summary["loose"]["all"]["needle_only"] == 0
    assert "NEEDLE-RIGHT-DOC-WRONG x1" in analyze.table(summary)


# ----------------------------------------------------------------------------------- CLI end to end, demo model
def test_census_cli_three_arms_on_the_demo_model(tmp_path, capsys):
    arms = tmp_path / "arms.json"
    arms.write_text(json.dumps({"arms": {"defaults": {}, "hf": {"semantics": "hf"}, "loose": {"entropy_bound": 0.3}},
                                "gates": [{"arm": "defaults", "metric": "exact_match", "min": 0.5}]}))
    out = tmp_path / "campaign"
    rc = main(["census", "--arms", str(arms), "--battery", "smoke", "--limit", "3", "--out", str(out),
               "--device", "cpu", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and list(summary["arms"]) == ["defaults", "hf", "loose"]
    for arm in ("defaults", "hf", "loose"):
        st = summary["arms"][arm]["smoke"]
        assert st["n"] == 3 and st["exact_match"] >= 2 / 3 and 1 <= st["forwards"] <= 48
        assert st["tokens_per_forward"] > 0 and st["steps_per_block"] >= 1
    recs = analyze.read_results(out)
    assert {r["id"] for r in recs} == {"arith-1", "facts-1", "sort-1"}
    assert all(r["forwards"] >= r["steps"] >= r["blocks"] >= 1 for r in recs)
    assert main(["census", "--analyze", str(out)]) == 0
    assert capsys.readouterr().out == printed  # --analyze reproduces the table (and the gate lines)


def test_smoketest_spec_is_a_valid_gate():
    from diffgemma.quality.smoketest import load_spec

    spec = load_spec()
    assert [b.name for b in spec.batteries] == ["smoke"] and spec.seeds == [7]
    assert spec.aggregate_seeds == [7, 42, 123] and len(spec.campaign.gates) >= 3
    assert {g["metric"] for g in spec.campaign.gates} >= {"exact_match", "tokens_per_forward"}


def test_plot_of_quality_against_forwards(tmp_path):
    pytest.importorskip("matplotlib")
    summary = {"a": {"all": {"forwards": 3.0, "exact_match": 0.9}}, "b": {"all": {"forwards": 2.0,
                                                                                  "exact_match": 0.8}}}
    path = analyze.plot(tmp_path, summary)
    assert path is not None and path.stat().st_size > 1000


def test_trace_counts_flips_and_contested_positions():
    import torch

    from diffgemma.generation import BlockEvent, StepEvent
    from diffgemma.quality.runner import _Trace

    def step(block, attempt, n, draft):
        d = torch.tensor(draft)
        return StepEvent(block=block, attempt=attempt, step=n, temperature=0.5, draft=d,
                         accepted=torch.ones_like(d, dtype=torch.bool), mean_entropy=0.1 * n, stop_reason=None)

    tr = _Trace()
    # block 0: position 0 flips twice (contested), position 1 once, position 3 twice but is not committed
    for n, draft in enumerate([[1, 2, 3, 4], [5, 6, 3, 7], [1, 6, 3, 4]], start=1):
        tr.on_step(step(0, 0, n, draft))
    tr.on_block(BlockEvent(block=0, tokens=[1, 6, 3], steps=3, stop_reason="confident", end="continue", attempts=1))
    # block 1: a re-roll starts afresh (no flip counted across attempts)
    tr.on_step(step(1, 0, 1, [9, 9, 9, 9]))
    tr.on_step(step(1, 1, 1, [1, 1, 1, 1]))
    tr.on_step(step(1, 1, 2, [1, 1, 1, 2]))
    tr.on_block(BlockEvent(block=1, tokens=[1], steps=2, stop_reason="confident", end="stop_token", attempts=2))
    assert (tr.flips, tr.contested) == (5 + 1, 1)
    assert tr.entropies == pytest.approx([0.3, 0.2])
