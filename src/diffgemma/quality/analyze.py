"""Per-arm statistics from a campaign directory's results.jsonl, and the summary table; needs no model.

`census` writes the same table when it finishes, and `census --analyze DIR` recomputes it from DIR alone, so the
two agree by construction: both call summarize() on the records in the file.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..errors import InputError

RESULTS = "results.jsonl"
CAMPAIGN = "campaign.json"
SUMMARY_JSON = "summary.json"
SUMMARY_TABLE = "summary.md"
PLOT = "quality_vs_forwards.png"

ALL = "all"  # the battery key of an arm's statistics over every battery

# outcomes of a checked prompt; a "pass" is the only success
PASS = "pass"
FAIL = "fail"  # a checked reply that is wrong (text batteries)
COMPILE_FAIL = "compile_fail"  # programmatic: the reply does not parse / compile
WRONG_OUTPUT = "wrong_output"  # programmatic: it runs, but a case's stdout or exit status is wrong
ERROR = "error"  # the generation itself raised (recorded so the campaign goes on)
SKIPPED = "skipped"  # not run: e.g. the prompt is longer than the model's context
UNCHECKED = "unchecked"  # no reference answer: trace metrics only
OUTCOMES = (PASS, FAIL, COMPILE_FAIL, WRONG_OUTPUT, ERROR, SKIPPED, UNCHECKED)

# metrics a gate may name (gates.py), each a number per (arm, battery)
METRICS = ("n", "checked", "passed", "exact_match", "forwards", "tokens_per_forward", "steps_per_block",
           "retries_per_prompt", "contested_per_1k", "flips_per_token", "seconds_per_prompt", "fenced_rate",
           "compile_fail_rate", "wrong_output_rate", "error_rate", "needle_only")


def read_results(out_dir: str | Path) -> list[dict]:
    """Every complete record of DIR/results.jsonl (a line cut short by an interrupted write is left out)."""
    path = Path(out_dir) / RESULTS
    if not path.is_file():
        raise InputError(f"{out_dir}: no {RESULTS}; expected a directory written by `diffgemma census`")
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial last line from a kill mid-write: that prompt simply runs again on resume
        if isinstance(rec, dict) and "arm" in rec:
            records.append(rec)
    return records


def read_campaign(out_dir: str | Path) -> dict:
    path = Path(out_dir) / CAMPAIGN
    try:
        return json.loads(path.read_text())
    except OSError:
        raise InputError(f"{out_dir}: no {CAMPAIGN}; expected a directory written by `diffgemma census`") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None


def record_key(rec: dict) -> tuple:
    return (rec["arm"], rec["battery"], rec["id"], rec["seed"])


def _stats(recs: list[dict]) -> dict:
    ran = [r for r in recs if r["outcome"] != SKIPPED]
    checked = [r for r in ran if r["outcome"] != UNCHECKED]
    passed = sum(r["outcome"] == PASS for r in checked)
    forwards = sum(r.get("forwards", 0) for r in ran)
    tokens = sum(r.get("tokens", 0) for r in ran)
    blocks = sum(r.get("blocks", 0) for r in ran)
    steps = sum(r.get("steps", 0) for r in ran)
    programs = [r for r in checked if "fenced" in r]

    def rate(num, den):
        return num / den if den else None

    return {
        "n": len(recs),
        "checked": len(checked),
        "passed": passed,
        "exact_match": rate(passed, len(checked)),
        "forwards": rate(forwards, len(ran)),
        "tokens_per_forward": rate(tokens, forwards),
        "steps_per_block": rate(steps, blocks),
        "retries_per_prompt": rate(sum(r.get("retries", 0) for r in ran), len(ran)),
        "contested_per_1k": rate(1000 * sum(r.get("contested", 0) for r in ran), tokens),
        "flips_per_token": rate(sum(r.get("flips", 0) for r in ran), tokens),
        "seconds_per_prompt": rate(sum(r.get("seconds", 0.0) for r in ran), len(ran)),
        "fenced_rate": rate(sum(bool(r.get("fenced")) for r in programs), len(programs)),
        "compile_fail_rate": rate(sum(r["outcome"] == COMPILE_FAIL for r in programs), len(programs)),
        "wrong_output_rate": rate(sum(r["outcome"] == WRONG_OUTPUT for r in programs), len(programs)),
        "error_rate": rate(sum(r["outcome"] == ERROR for r in ran), len(ran)),
        "needle_only": _needle_only(recs),
        "skipped": len(recs) - len(ran),
    }


def _needle_only(recs: list[dict]) -> int:
    """Long-context rungs whose needle control was answered while the document question was not: the signature of
    a context that is read only in part, counted as the failure it is (the document record is already a fail)."""
    probes: dict[tuple, dict] = defaultdict(dict)
    for r in recs:
        if r.get("probe") in ("doc", "needle"):
            probes[(r["battery"], r.get("rung"), r["seed"])][r["probe"]] = r["outcome"]
    return sum(p.get("needle") == PASS and p.get("doc") not in (PASS, None, SKIPPED) for p in probes.values())


def summarize(records: list[dict], arm_order: list[str] | None = None) -> dict:
    """{arm: {battery: stats, ..., "all": stats}}, arms in campaign order."""
    by_arm: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_arm[r["arm"]][r["battery"]].append(r)
        by_arm[r["arm"]][ALL].append(r)
    order = [a for a in (arm_order or []) if a in by_arm] + sorted(a for a in by_arm if a not in (arm_order or []))
    out = {}
    for arm in order:
        batteries = by_arm[arm]
        out[arm] = {b: _stats(batteries[b]) for b in sorted(k for k in batteries if k != ALL)}
        out[arm][ALL] = _stats(batteries[ALL])
    return out


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "int":
        return str(int(value))
    return f"{value:.2f}"


_COLUMNS = [("n", "n", "int"), ("pass", "passed", "int"), ("exact %", "exact_match", "pct"),
            ("fwd/prompt", "forwards", "num"), ("tok/fwd", "tokens_per_forward", "num"),
            ("steps/blk", "steps_per_block", "num"), ("re-rolls", "retries_per_prompt", "num"),
            ("contested/1k", "contested_per_1k", "num"), ("s/prompt", "seconds_per_prompt", "num")]


def _notes(st: dict) -> str:
    notes = []
    if st["fenced_rate"] is not None:
        notes.append(f"fenced {100 * st['fenced_rate']:.0f}%, compile_fail {100 * st['compile_fail_rate']:.0f}%, "
                     f"wrong_output {100 * st['wrong_output_rate']:.0f}%")
    if st["needle_only"]:
        notes.append(f"NEEDLE-RIGHT-DOC-WRONG x{st['needle_only']}")
    if st["error_rate"]:
        notes.append(f"errors {100 * st['error_rate']:.0f}%")
    if st["skipped"]:
        notes.append(f"skipped {st['skipped']}")
    return "; ".join(notes)


def table(summary: dict) -> str:
    """The summary as a Markdown table: one row per arm and battery (and an "all" row where an arm ran several)."""
    head = ["arm", "battery"] + [c[0] for c in _COLUMNS] + ["notes"]
    rows = []
    for arm, batteries in summary.items():
        names = [b for b in batteries if b != ALL]
        for b in names + ([ALL] if len(names) > 1 else []):
            st = batteries[b]
            rows.append([arm, b] + [_fmt(st[key], kind) for _, key, kind in _COLUMNS] + [_notes(st)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def write_summary(out_dir: str | Path, summary: dict, text: str, complete: bool) -> None:
    out_dir = Path(out_dir)
    payload = {"complete": complete, "arms": summary}
    _atomic_write(out_dir / SUMMARY_JSON, json.dumps(payload, indent=1) + "\n")
    _atomic_write(out_dir / SUMMARY_TABLE, text + "\n" + ("" if complete else "\n(incomplete: the run was interrupted; "
                                                           "run the same command again to resume)\n"))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def plot(out_dir: str | Path, summary: dict) -> Path | None:
    """Exact match against forwards per prompt, one point per arm (all batteries); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    points = [(arm, st[ALL]["forwards"], st[ALL]["exact_match"]) for arm, st in summary.items()
              if st[ALL]["forwards"] is not None and st[ALL]["exact_match"] is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(5, 4))
    for arm, x, y in points:
        ax.scatter([x], [100 * y])
        ax.annotate(arm, (x, 100 * y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("denoise forwards per prompt")
    ax.set_ylabel("exact match (%)")
    ax.set_title("quality vs forwards per arm")
    ax.grid(alpha=0.3)
    path = Path(out_dir) / PLOT
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError:
        return None
    finally:
        plt.close(fig)
    return path
