"""The op-log: every generation of a session (`serve`, `ask`, `chat` with --log-dir), as JSON lines that
`diffgemma replay` can execute again.

A log holds token ids and settings only, never text: what the model was asked and what it answered is
fully determined by them, so a session seen in the field becomes a repro that re-runs bit for bit on the
same device (seeded generation is deterministic there). Records, one JSON object a line:

  {"op": "start", "version": 1, "model": PATH|null, "device": ..., "dtype": ..., "slots": N, "max_tokens": M}
  {"op": "generate", "gen": G, "slot": S, "keep": K, "prompt": [ids...], "settings": {...}}
      slot S's KV cache rewound to its first K tokens, then `prompt` (the rest of the rendered
      conversation) prefilled and a reply generated with `settings` (every GenerationSettings field); with
      images the prompt is a prompt key (vision/prompt.py) and the op has "images": {key: sha256}, the
      bytes in <log>.images/<sha256> (vision/journal.py); "prefill_chunk": N where the prompt was prefilled N tokens
      at a time (the server's scheduler); "tool_repair": n where the generation is the n-th round of a turn's tool
      repair (core/repair.py); "grammar_sha256": the sha256 of settings.grammar (its UTF-8 bytes) where the
      generation ran under a grammar (replay rebuilds that grammar from the settings and checks the hash first)
  {"op": "extend", "slot": S, "keep": K, "tokens": [ids...]}
      slot S's KV cache rewound to its first K tokens, then `tokens` prefilled in one call (the tool repair's
      rewind to a turn's prompt end with the final reply after it: core/repair.py)
  {"event": "block", "gen": G, "block": B, "tokens": [...], "steps": n, "stop_reason": ..., "end": ...}
  {"event": "done", "gen": G, "tokens": [...], "stop_token": id|null}
  {"event": "cancelled", "gen": G, "blocks": n, "kept": K}   the client left after n blocks; the cache
      was rewound to K tokens (the prompt, or 0 where the rewind was deeper than the sliding ring; with blocks 0
      and K short of the prompt: the client left while its prompt was prefilling, after K tokens of it)
  {"event": "cancelled", "gen": G, "blocks": n, "kept": 0, "interrupted": true}   Ctrl-C (KeyboardInterrupt)
      after n blocks; the cache was emptied
  {"event": "error", "gen": G, "error": "Type: message"}         the cache was emptied

Generations that run together in the server's batch interleave their records: an event names its generation
(`gen`), and a slot's generations never overlap (a slot serves one request at a time), so replaying the ops in log
order, each to its end, reproduces every slot's history.

Each line is written and flushed as it happens, so a crash leaves a readable prefix: every complete line is a
record, a generation with no done / cancelled / error record is unfinished (the process died during it), and a
last line with no newline that does not parse is a torn record (`load` reports it and reads the rest).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError
from .events import BlockEvent, CancelledEvent, DoneEvent, ErrorEvent

VERSION = 1


def header(model, slots: int, max_tokens: int) -> dict:
    """The start record's fields: what replay needs to rebuild the slots (the model: None for the embedded one)."""
    from .loader import is_embedded

    return {"model": None if is_embedded(model) else str(Path(model.path).resolve()),
            "device": str(model.embedding.device), "dtype": str(model.embedding.dtype), "slots": slots,
            "max_tokens": max_tokens}


def generate_record(gen: int, slot: int, keep: int, prompt: list[int], settings,
                    prefill_chunk: int | None = None) -> dict:
    """The 'generate' op: slot `slot` rewound to `keep` tokens, then `prompt` generated from with `settings` (its
    prefill in chunks of `prefill_chunk` tokens, where the server's scheduler chunked it)."""
    record = {"op": "generate", "gen": gen, "slot": slot, "keep": keep, "prompt": list(prompt),
              "settings": settings.as_dict()}
    if settings.grammar is not None:
        record["grammar_sha256"] = grammar_sha256(settings.grammar)
    return record if prefill_chunk is None else {**record, "prefill_chunk": prefill_chunk}


def grammar_sha256(grammar: str) -> str:
    """The hash a generate op keeps of its grammar (the `grammar` setting's text)."""
    return hashlib.sha256(grammar.encode("utf-8")).hexdigest()


def extend_record(slot: int, keep: int, tokens: list[int]) -> dict:
    """The 'extend' op: slot `slot` rewound to `keep` tokens, then `tokens` prefilled in one call."""
    return {"op": "extend", "slot": slot, "keep": keep, "tokens": [int(t) for t in tokens]}


def event_record(gen: int, event) -> dict | None:
    """The record of one of generation `gen`'s events (events.py), or None for those the log does not keep (steps,
    which follow from the blocks; a turn's start and retries, which follow from the ops)."""
    if isinstance(event, BlockEvent):
        return {"event": "block", "gen": gen, "block": event.block, "tokens": event.tokens, "steps": event.steps,
                "stop_reason": event.stop_reason, "end": event.end}
    if isinstance(event, DoneEvent):
        return {"event": "done", "gen": gen, "tokens": event.result.tokens, "stop_token": event.result.stop_token}
    if isinstance(event, CancelledEvent):
        record = {"event": "cancelled", "gen": gen, "blocks": event.blocks, "kept": event.kept}
        return {**record, "interrupted": True} if event.interrupted else record
    if isinstance(event, ErrorEvent):
        return {"event": "error", "gen": gen, "error": event.message}
    return None


class OpLog:
    """Appends records to one JSONL file (a new file per process, in `directory`)."""

    def __init__(self, directory, header: dict):
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"--log-dir {directory}: cannot create it ({e.strerror})") from None
        stem = f"ops-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for n in range(1000):  # a second log of this process in the same second gets a suffix
            self.path = directory / (f"{stem}.jsonl" if n == 0 else f"{stem}-{n}.jsonl")
            try:
                self._file = open(self.path, "x", encoding="utf-8")
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise InputError(f"--log-dir {directory}: cannot write {self.path.name} ({e.strerror})") from None
        else:
            raise InputError(f"--log-dir {directory}: 1000 logs named {stem}*.jsonl already")
        self.write({"op": "start", "version": VERSION, **header})

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


END_EVENTS = ("done", "cancelled", "error")  # the records that end a generation


@dataclass
class LogFile:
    path: Path
    records: list[dict]  # every complete record, the start record first
    torn: str | None = None  # the torn last line, described in one line (None: the file ends with a whole record)


def load(path) -> LogFile:
    """The complete records of a log, checked for the shape replay needs; errors name the line. A last line cut
    mid-record (the writer died while writing it) is left out and described in `torn`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read the op-log ({e.strerror})") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" when the file ends with one
    records, torn = [], None
    for n, line in enumerate(lines + [tail], 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if n == len(lines) + 1:  # the unterminated last line: written only in part
                torn = f"{path}:{n}: the last line is cut mid-record ({len(line)} bytes, no newline); left out"
                break
            raise InputError(f"{path}:{n}: not a JSON line ({getattr(e, 'msg', None) or e.reason})") from None
        if not isinstance(rec, dict) or not ("op" in rec or "event" in rec):
            raise InputError(f"{path}:{n}: expected an object with an 'op' or an 'event'")
        records.append(rec)
    if not records:
        what = "only a torn first line" if torn else "no records"
        raise InputError(f"{path}: {what}; an op-log starts with its 'start' op (is this a diffgemma op-log?)")
    if records[0].get("op") != "start":
        raise InputError(f"{path}: the first record must be the 'start' op (is this a diffgemma op-log?)")
    if records[0].get("version") != VERSION:
        raise InputError(f"{path}: op-log version {records[0].get('version')!r}; this diffgemma reads {VERSION}")
    return LogFile(path, records, torn)


def read(path) -> list[dict]:
    """The complete records of a log (load(path).records)."""
    return load(path).records
