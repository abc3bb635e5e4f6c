"""Checkers: a battery prompt's "check" object and a reply -> an outcome (analyze.py's outcome names).

    {"exact": "42"} or {"exact": ["42", "forty-two"]}   the answer, stripped, is one of these
    {"contains": "Paris"} or {"contains": [...]}          the answer holds every one of these
    {"regex": "[0-9]+"}                                   the stripped answer matches it entirely
    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}   the first tool call, well-formed
    {"program": {"language": "python", "cases": [{"stdin": "1 2\\n", "stdout": "3\\n", "args": [], "exit_code": 0}],
                 "timeout_s": 10}}                        the answer is a program (sandbox.py); the prompt forbids
                                                          markdown fences, so a fenced one fails but is still run
Any checker takes "ignore_case": true. A prompt with no "check" is run for its trace metrics only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import InputError
from ..tool_calls import parse_tool_calls
from .analyze import COMPILE_FAIL, FAIL, PASS, WRONG_OUTPUT
from .sandbox import LANGUAGES, Limits, judge_program

KINDS = ("exact", "contains", "regex", "tool_call", "program")


@dataclass
class Verdict:
    outcome: str
    detail: str = ""
    extra: dict = field(default_factory=dict)  # recorded beside the outcome (fenced, cases passed, ...)


def validate_check(check, where: str) -> None:
    if not isinstance(check, dict):
        raise InputError(f"{where}: check: expected an object with one of {', '.join(KINDS)}")
    kinds = [k for k in KINDS if k in check]
    unknown = set(check) - set(KINDS) - {"ignore_case"}
    if len(kinds) != 1 or unknown:
        raise InputError(f"{where}: check: expected exactly one of {', '.join(KINDS)} (and optionally ignore_case), "
                         f"got {sorted(check)}")
    kind, spec = kinds[0], check[kinds[0]]
    if kind in ("exact", "contains"):
        if not (isinstance(spec, str) or (isinstance(spec, list) and spec and all(isinstance(s, str) for s in spec))):
            raise InputError(f"{where}: check {kind}: expected a string or a non-empty list of strings")
    elif kind == "regex":
        try:
            re.compile(spec)
        except (re.error, TypeError) as e:
            raise InputError(f"{where}: check regex {spec!r}: {e}") from None
    elif kind == "tool_call":
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InputError(f"{where}: check tool_call: expected {{\"name\": ..., \"arguments\": {{...}}}}")
    else:
        if not isinstance(spec, dict) or spec.get("language") not in LANGUAGES:
            raise InputError(f"{where}: check program: language must be one of {', '.join(LANGUAGES)}")
        cases = spec.get("cases")
        if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) for c in cases):
            raise InputError(f"{where}: check program: \"cases\" must be a non-empty list of objects")
        for c in cases:
            bad = set(c) - {"stdin", "stdout", "args", "exit_code"}
            if bad:
                raise InputError(f"{where}: check program: case keys {sorted(bad)}; expected stdin, stdout, args, "
                                 f"exit_code")
        t = spec.get("timeout_s", 10)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 600:
            raise InputError(f"{where}: check program: timeout_s {t!r}: expected seconds in (0, 600]")


def check(spec: dict, answer: str, budget_hit: bool = False) -> Verdict:
    """Judge one reply's answer text (thought removed). budget_hit: the reply ran out of max_new_tokens."""
    fold = (lambda s: s.lower()) if spec.get("ignore_case") else (lambda s: s)
    got = answer.strip()
    if "exact" in spec:
        options = [spec["exact"]] if isinstance(spec["exact"], str) else spec["exact"]
        ok = fold(got) in {fold(o.strip()) for o in options}
        return Verdict(PASS if ok else FAIL, "" if ok else f"got {got[:80]!r}, expected {options[0][:80]!r}")
    if "contains" in spec:
        wanted = [spec["contains"]] if isinstance(spec["contains"], str) else spec["contains"]
        missing = [w for w in wanted if fold(w) not in fold(got)]
        return Verdict(FAIL if missing else PASS, f"missing {missing[0][:60]!r}" if missing else "")
    if "regex" in spec:
        ok = re.fullmatch(spec["regex"], got, re.S | (re.I if spec.get("ignore_case") else 0)) is not None
        return Verdict(PASS if ok else FAIL, "" if ok else f"got {got[:80]!r}")
    if "tool_call" in spec:
        return _tool_call(spec["tool_call"], got)
    return _program(spec["program"], answer, budget_hit)


def _tool_call(want: dict, answer: str) -> Verdict:
    calls = parse_tool_calls(answer)
    if not calls:
        return Verdict(FAIL, f"no tool call in {answer[:80]!r}")
    call = calls[0]
    if not call.ok:
        return Verdict(FAIL, f"malformed tool call ({call.error}): {call.raw[:80]!r}")
    if call.name != want["name"]:
        return Verdict(FAIL, f"called {call.name}, expected {want['name']}")
    if "arguments" in want and call.arguments != want["arguments"]:
        return Verdict(FAIL, f"arguments {call.arguments}, expected {want['arguments']}")
    return Verdict(PASS)


def _program(spec: dict, answer: str, budget_hit: bool) -> Verdict:
    limits = Limits(timeout_s=float(spec.get("timeout_s", 10)))
    v = judge_program(answer, spec["language"], spec["cases"], limits)
    extra = {"fenced": v.fenced, "cases_passed": v.cases_passed, "cases_total": v.cases_total,
             "budget_hit": budget_hit, "language": spec["language"], "program_outcome": v.outcome}
    outcome, detail = v.outcome, v.detail
    if outcome == PASS and (v.fenced or budget_hit):
        # every case passes, but the reply disobeyed the prompt (fence) or was cut at the token budget
        outcome = FAIL
        detail = ("fenced reply (instruction violation); " if v.fenced else "") + \
                 ("token budget exhausted; " if budget_hit else "") + detail
    assert outcome in (PASS, FAIL, COMPILE_FAIL, WRONG_OUTPUT)
    return Verdict(outcome, detail, extra)
