"""`diffgemma replay OPS.jsonl...`: run logged sessions (`serve`, `ask` or `chat` with --log-dir) again and compare
every event with the log.

The same slots, rewinds, prompts, settings and prefill chunks, in the logged order of the ops (generations that ran
batched together are replayed one after another: the forward is batch invariant), through the same
engine core (core/) that wrote it; an 'extend' op (the tool repair's rewind) rewinds its slot and prefills its ids in
one call; a generation's grammar is checked against its logged sha256 before it runs (a mismatch is an error); a
cancelled generation stops after the same number of blocks (or prompt chunks), an interrupted one (Ctrl-C) is
interrupted there again. On the device and build that wrote the log every event must match: a difference is a bug
(or a different device / build, which the start record names).

A log whose writer died (kill -9, a crash) is replayed as far as it goes: a torn last line is left out, and a
generation with no end record is unfinished: its logged blocks are replayed and compared, the rest is skipped and
said so, and its slot starts afresh (what the dead process's cache held is unknown). Neither is a difference.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import oplog
from .errors import DiffgemmaError, InputError
from .core import EngineCore, Request, as_ids
from .events import BlockEvent, StepEvent
from .settings import GenerationSettings
from .slots import Slot, rewind

COMPARED = {"block": ("block", "tokens", "steps", "stop_reason", "end"), "done": ("tokens", "stop_token"),
            "cancelled": ("blocks", "kept"), "error": ("error",)}


@dataclass
class ReplayReport:
    generations: int = 0  # replayed to their logged end
    events: int = 0  # logged events compared (the blocks of unfinished generations too)
    problems: list[str] = field(default_factory=list)  # one line per generation that differs
    skipped: list[str] = field(default_factory=list)  # one line per unfinished generation
    torn: str | None = None  # the torn last line, if the log has one

    @property
    def ok(self) -> bool:
        return not self.problems


def _group(records: list[dict]):
    """-> [(generate op, [its events])] in the ops' log order; each event follows its op and precedes its generation's
    end record (generations that ran in one batch interleave their events; an event names its generation)."""
    out, by_gen = [], {}
    for n, rec in enumerate(records[1:], 2):
        if rec.get("op") == "extend":
            out.append((rec, None))
        elif rec.get("op") == "generate":
            gen = rec.get("gen")
            if gen in by_gen and not _ended(by_gen[gen][1]):
                raise InputError(f"record {n}: generation {gen!r} starts again before its end record")
            by_gen[gen] = (rec, [])
            out.append(by_gen[gen])
        elif "event" in rec:
            gen = rec.get("gen")
            if gen not in by_gen:
                raise InputError(f"record {n}: event of generation {gen!r} outside its generate op")
            if _ended(by_gen[gen][1]):
                raise InputError(f"record {n}: event of generation {gen!r} after its end record")
            by_gen[gen][1].append(rec)
        else:
            raise InputError(f"record {n}: unknown op {rec.get('op')!r}")
    return out


def _ended(events: list[dict]) -> bool:
    return bool(events) and events[-1].get("event") in oplog.END_EVENTS


def replay(path, model, progress=None) -> ReplayReport:
    """progress(done, total): called before each generation and once at the end (reporting only)."""
    log = oplog.load(path)
    start = log.records[0]
    slots: dict[int, Slot] = {}
    report = ReplayReport(torn=log.torn)
    groups = _group(log.records)
    for done, (op, logged) in enumerate(groups):
        if progress is not None:
            progress(done, len(groups))
        if logged is None:
            _extend(model, op, slots, int(start["max_tokens"]), report)
            continue
        gen = op.get("gen")
        try:
            slot_i, keep, prompt = int(op["slot"]), int(op["keep"]), list(op["prompt"])
            settings = GenerationSettings(**op["settings"])
            chunk = None if op.get("prefill_chunk") is None else int(op["prefill_chunk"])
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"generation {gen}: malformed generate op ({type(e).__name__}: {e})") from None
        _check_grammar(gen, op, settings)
        if slot_i not in slots:
            slots[slot_i] = Slot(model.new_cache(int(start["max_tokens"])))
        slot = slots[slot_i]
        got_keep = rewind(slot.cache, keep)
        if got_keep != keep:
            report.problems.append(f"generation {gen}: the cache rewound to {got_keep} tokens, the log says {keep}")
            continue
        images = None
        if op.get("images"):  # vision/journal.py: the images' bytes beside the log
            from .vision.journal import load_images

            images = load_images(path, op["images"], model, f"generation {gen}")
        end = logged[-1] if logged and logged[-1]["event"] in oplog.END_EVENTS else None
        blocks = sum(r["event"] == "block" for r in logged)
        if end is None:  # the writer died during it
            report.skipped.append(f"generation {gen}: unfinished in the log (no end record after {blocks} "
                                  f"block(s)): " + (f"its {blocks} logged block(s) replayed, the rest skipped"
                                                    if blocks else "skipped"))
            if blocks:
                got = _run(model, slot, slot_i, keep, prompt, settings, gen, stop_after=blocks, images=images,
                           chunk=chunk)
                got = got[:-1] if got and got[-1]["event"] == "cancelled" else got  # the stop is replay's own
                report.events += len(logged)
                report.problems += _diff(gen, logged, got)
            rewind(slot.cache, 0)
            slot.ids = []
            continue
        if end["event"] == "cancelled":
            interrupt = bool(end.get("interrupted"))
            if interrupt and end.get("blocks") not in (blocks, blocks + 1):  # +1: Ctrl-C fell as a block was logged
                report.problems.append(f"generation {gen}: interrupted after {end.get('blocks')!r} blocks, the log "
                                       f"holds {blocks}")
                continue
            prefilling = not interrupt and end.get("blocks") == 0 and isinstance(end.get("kept"), int) \
                and end["kept"] < keep + len(prompt)  # the client left while its prompt was prefilling
            got = _run(model, slot, slot_i, keep, prompt, settings, gen,
                       stop_after=blocks if interrupt else end.get("blocks"), interrupt=interrupt,
                       images=images, chunk=chunk, prefilled=end["kept"] if prefilling else None)
        else:
            got = _run(model, slot, slot_i, keep, prompt, settings, gen, images=images, chunk=chunk)
        report.generations += 1
        report.events += len(logged)
        report.problems += _diff(gen, logged, got)
    if progress is not None:
        progress(len(groups), len(groups))
    return report


def _check_grammar(gen, op: dict, settings) -> None:
    """A generate op's grammar is the one it ran: its settings' grammar hashes to its grammar_sha256 (an op-log from
    before the hash was kept has none, and its grammar is taken as it is)."""
    want = op.get("grammar_sha256")
    if want is None:
        return
    have = None if settings.grammar is None else oplog.grammar_sha256(settings.grammar)
    if have != want:
        raise InputError(f"generation {gen}: its grammar does not match its grammar_sha256 ({str(want)[:12]}..., "
                         f"the grammar hashes to {str(have)[:12]}...); the op-log was edited or is damaged")


def _extend(model, op: dict, slots: dict, max_tokens: int, report: ReplayReport) -> None:
    """An 'extend' op: the slot's cache rewound to `keep`, then `tokens` prefilled in one call."""
    try:
        slot_i, keep, tokens = int(op["slot"]), int(op["keep"]), [int(t) for t in op["tokens"]]
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"malformed extend op ({type(e).__name__}: {e})") from None
    if slot_i not in slots:
        slots[slot_i] = Slot(model.new_cache(max_tokens))
    cache = slots[slot_i].cache
    got = rewind(cache, keep)
    if got != keep:
        report.problems.append(f"extend op of slot {slot_i}: the cache rewound to {got} tokens, the log says {keep}")
        return
    if tokens:
        model.prefill(cache, as_ids(tokens, model.config.vocab_size, model.embedding.device))


def _run(model, slot, slot_i, keep, prompt, settings, gen, stop_after=None, interrupt=False,
         images=None, chunk=None, prefilled=None) -> list[dict]:
    """Generation `gen` run again -> its events as a log records them. stop_after: cancel (or with `interrupt`,
    interrupt, as Ctrl-C did) it once that many blocks are committed, after its next event. images: the op's images
    (vision/journal.py). chunk: the prompt's prefill chunk size; prefilled: cancel it while it prefills, once its
    cache holds that many tokens (the core prefills one chunk a step and checks before each chunk after the first)."""
    events: list = []
    blocks = 0

    def sink(event):
        nonlocal blocks
        events.append(event)
        blocks += isinstance(event, BlockEvent)
        if stop_after is not None and isinstance(event, (StepEvent, BlockEvent)) and blocks >= stop_after:
            request.cancel(interrupted=interrupt)

    request = Request(settings, prompt=prompt, slot=slot, slot_index=slot_i, images=images, prefill_chunk=chunk,
                      next_gen=lambda: gen, sink=sink)
    core = EngineCore(model)
    core.add_request(request)
    while not request.done:
        core.step()
        if prefilled is not None and slot.cache.length >= prefilled:
            request.cancel()
    return [r for r in (oplog.event_record(gen, e) for e in events) if r is not None]


def _diff(gen, logged: list[dict], got: list[dict]) -> list[str]:
    problems = []
    for k in range(max(len(logged), len(got))):
        want = logged[k] if k < len(logged) else None
        have = got[k] if k < len(got) else None
        if want is None or have is None or want["event"] != have["event"]:
            problems.append(f"generation {gen}, event {k + 1}: logged {_brief(want)}, replayed {_brief(have)}")
            break  # the rest follows from the first divergence
        keys = COMPARED.get(want["event"], ())
        if want.get("interrupted"):  # its blocks were compared one by one (and their count checked by replay)
            keys = ("kept", "interrupted")
        for key in keys:
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


def log_paths(paths) -> list[Path]:
    """The logs that `paths` name: a file is itself, a folder its ops-*.jsonl in name (= time) order."""
    out = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("ops-*.jsonl"))
            if not found:
                raise InputError(f"{path}: a folder with no op-log (ops-*.jsonl) in it")
            out += found
        else:
            out.append(path)
    return out


def run_logs(paths, model_path=None, device=None, out=None, err=None) -> int:
    """`diffgemma replay`: each log in turn on the model and device it names (or these), its differences and skips,
    its verdict; with several logs a summary last. -> 0 all identical, 1 some differ, 2 some could not be replayed
    (a log or its model unreadable), as diff(1) does."""
    from .loader import load

    out, err = out or sys.stdout, err or sys.stderr
    logs = log_paths(paths)
    models: dict = {}
    counts = {"identical": 0, "differ": 0, "unreadable": 0}
    for i, path in enumerate(logs):
        if len(logs) > 1:
            print(f"== {path}", file=out)
        try:
            start = oplog.load(path).records[0]
            where = (model_path or start.get("model"), device or start.get("device") or "cpu")
            if where not in models:
                models[where] = load(where[0], device=where[1])
            with ReplayProgress(err, f"replay {i + 1}/{len(logs)} {Path(path).name}") as progress:
                report = replay(path, models[where], progress=progress)
        except DiffgemmaError as e:
            print(f"diffgemma: error: {e}", file=err)
            counts["unreadable"] += 1
            continue
        for line in [report.torn] * (report.torn is not None) + report.skipped + report.problems:
            print(line, file=out)
        unfinished = f", {len(report.skipped)} unfinished" if report.skipped else ""
        verdict = "identical" if report.ok else f"{len(report.problems)} generation(s) differ"
        print(f"replay: {report.generations} generations{unfinished}, {report.events} logged events: {verdict}",
              file=out)
        counts["identical" if report.ok else "differ"] += 1
    if len(logs) > 1:
        print(f"replay: {len(logs)} logs: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n), file=out)
    return 2 if counts["unreadable"] else 1 if counts["differ"] else 0


class ReplayProgress:
    """One log's progress on `err`: a tqdm bar of its generations (shown at a terminal only, as tqdm decides)."""

    def __init__(self, err, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(desc=desc, unit="generation", file=err, leave=False, disable=None)

    def __call__(self, done: int, total: int) -> None:
        self.bar.total = total
        self.bar.n = done
        self.bar.refresh()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
