"""`diffgemma replay OPS.jsonl`: run a logged session (`serve`, `ask` or `chat` with --log-dir) again and compare
every event with the log.

The same slots, rewinds, prompts and settings, in the logged order, through the same session.run_generation
that wrote it; a cancelled generation stops after the same number of blocks. On the device and build that
wrote the log every event must match: a difference is a bug (or a different device / build, which the start
record names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import oplog
from .errors import InputError
from .session import run_generation
from .settings import GenerationSettings
from .slots import Slot, rewind

COMPARED = {"block": ("block", "tokens", "steps", "stop_reason", "end"), "done": ("tokens", "stop_token"),
            "cancelled": ("blocks", "kept"), "error": ("error",)}


@dataclass
class ReplayReport:
    generations: int = 0
    events: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _group(records: list[dict]):
    """-> [(generate op, [its events])] in log order; events must follow their op."""
    out = []
    for n, rec in enumerate(records[1:], 2):
        if rec.get("op") == "generate":
            out.append((rec, []))
        elif "event" in rec:
            if not out or rec.get("gen") != out[-1][0].get("gen"):
                raise InputError(f"record {n}: event of generation {rec.get('gen')!r} outside its generate op")
            out[-1][1].append(rec)
        else:
            raise InputError(f"record {n}: unknown op {rec.get('op')!r}")
    return out


def replay(path, model) -> ReplayReport:
    records = oplog.read(path)
    start = records[0]
    slots: dict[int, Slot] = {}
    report = ReplayReport()
    for op, logged in _group(records):
        gen = op.get("gen")
        try:
            slot_i, keep, prompt = int(op["slot"]), int(op["keep"]), list(op["prompt"])
            settings = GenerationSettings(**op["settings"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"generation {gen}: malformed generate op ({type(e).__name__}: {e})") from None
        if slot_i not in slots:
            slots[slot_i] = Slot(model.new_cache(int(start["max_tokens"])))
        slot = slots[slot_i]
        got_keep = rewind(slot.cache, keep)
        if got_keep != keep:
            report.problems.append(f"generation {gen}: the cache rewound to {got_keep} tokens, the log says {keep}")
            continue
        ends = [r for r in logged if r["event"] == "cancelled"]
        stop_after = ends[0].get("blocks") if ends else None
        events: list = []
        images = None
        if op.get("images"):  # vision/journal.py: the images' bytes beside the log
            from .vision.journal import load_images

            images = load_images(path, op["images"], model, f"generation {gen}")
        run_generation(model, slot, keep, prompt, settings, gen=gen, slot_index=slot_i,
                       should_stop=lambda blocks: stop_after is not None and blocks >= stop_after,
                       on_event=events.append, images=images)
        got = [r for r in (oplog.event_record(gen, e) for e in events) if r is not None]  # as a log records them
        report.generations += 1
        report.events += len(logged)
        report.problems += _diff(gen, logged, got)
    return report


def _diff(gen, logged: list[dict], got: list[dict]) -> list[str]:
    problems = []
    for k in range(max(len(logged), len(got))):
        want = logged[k] if k < len(logged) else None
        have = got[k] if k < len(got) else None
        if want is None or have is None or want["event"] != have["event"]:
            problems.append(f"generation {gen}, event {k + 1}: logged {_brief(want)}, replayed {_brief(have)}")
            break  # the rest follows from the first divergence
        for key in COMPARED.get(want["event"], ()):
            if want.get(key) != have.get(key):
                problems.append(f"generation {gen}, event {k + 1} ({want['event']}): {key} logged "
                                f"{_short(want.get(key))}, replayed {_short(have.get(key))}")
                break
        if problems:
            break
    return problems


def _brief(rec) -> str:
    return "nothing" if rec is None else f"{rec['event']} {_short({k: v for k, v in rec.items() if k != 'gen'})}"


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
