"""Run a campaign: every arm x battery prompt x seed through a backend, one JSON line per reply in DIR.

The order interleaves arms (seed, then battery, then prompt, then arm), so a campaign stopped early still
compares every arm on the same prompts. Each record is written and flushed as soon as it exists; a rerun of the
same command skips what DIR already holds, so Ctrl-C leaves a readable, resumable directory. The backend is
anything with `run(prompt, overrides) -> Reply` and `describe() -> dict`: ModelBackend drives a loaded model
through the chat template and `diffgemma.generate`; tests inject scripted replies.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import DiffgemmaError, InputError
from ..generation import BUDGET
from . import analyze
from .analyze import CAMPAIGN, ERROR, RESULTS, SKIPPED, UNCHECKED
from .arms import Campaign
from .batteries import Battery, Prompt
from .checkers import check

CAMPAIGN_VERSION = 1


@dataclass
class Reply:
    answer: str  # the reply's answer text (thought channel removed), what checkers judge
    raw: str = ""  # the decoded reply with its special tokens
    thought: str | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    forwards: int = 0  # denoise forwards, re-rolled attempts included
    blocks: int = 0
    steps: int = 0  # denoise steps of the committed attempts
    retries: int = 0  # re-rolls of a degenerate first block
    stop_reasons: list[str] = field(default_factory=list)
    block_ends: list[str] = field(default_factory=list)
    flips: int = 0  # argmax changes between consecutive steps, summed over positions and steps
    contested: int = 0  # committed positions whose argmax changed at least twice within their block
    final_entropy: float | None = None  # mean canvas entropy at the last step, averaged over blocks
    seconds: float = 0.0

    @property
    def budget_hit(self) -> bool:
        return bool(self.block_ends) and self.block_ends[-1] == BUDGET


class Skip(Exception):
    """The backend cannot run this prompt (e.g. longer than the model's context); recorded as skipped."""


class Backend(Protocol):
    def run(self, prompt: Prompt, overrides: dict[str, Any]) -> Reply: ...

    def describe(self) -> dict: ...


def _tasks(campaign: Campaign, batteries: list[Battery], seeds: list[int]):
    for seed in seeds:
        for battery in batteries:
            for prompt in battery.prompts:
                for arm in campaign.arms:
                    yield arm, battery, prompt, seed


def campaign_header(campaign: Campaign, batteries: list[Battery], seeds: list[int], backend: Backend) -> dict:
    return {"version": CAMPAIGN_VERSION, **campaign.to_json(), "batteries": {b.name: b.digest for b in batteries},
            "seeds": list(seeds), "model": backend.describe()}


def _open_dir(out_dir: Path, header: dict) -> set[tuple]:
    """Create DIR (writing campaign.json) or check that it holds this same campaign; the keys already done."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CAMPAIGN
    if path.is_file():
        old = analyze.read_campaign(out_dir)
        for key in ("arms", "batteries", "seeds", "model"):
            if json.loads(json.dumps(old.get(key))) != json.loads(json.dumps(header[key])):
                raise InputError(f"--out {out_dir}: holds a different campaign ({key} differ); resume with the same "
                                 f"arms, batteries, seeds and model, or choose a new --out")
    else:
        path.write_text(json.dumps(header, indent=1) + "\n")
    results = out_dir / RESULTS
    if not results.is_file():
        results.touch()
        return set()
    records = analyze.read_results(out_dir)
    text = "".join(json.dumps(r) + "\n" for r in records)
    if text != results.read_text():  # drop a line cut short by a kill mid-write, so appends start clean
        results.write_text(text)
    return {analyze.record_key(r) for r in records}


def run_prompt(backend: Backend, arm, battery: Battery, prompt: Prompt, seed: int) -> dict:
    overrides: dict[str, Any] = {"seed": seed}
    if prompt.max_new_tokens is not None:
        overrides["max_new_tokens"] = prompt.max_new_tokens
    overrides.update(arm.overrides)  # the arm's own values win: they are the lever under test
    rec: dict[str, Any] = {"arm": arm.name, "battery": battery.name, "id": prompt.id, "seed": seed,
                           "family": prompt.family}
    if prompt.probe is not None:
        rec.update(probe=prompt.probe, rung=prompt.rung)
    t = time.perf_counter()
    try:
        reply = backend.run(prompt, overrides)
    except Skip as e:
        rec.update(outcome=SKIPPED, detail=str(e))
        return rec
    except DiffgemmaError as e:
        rec.update(outcome=ERROR, detail=f"{type(e).__name__}: {e}")
        return rec
    if not reply.seconds:
        reply.seconds = time.perf_counter() - t
    rec.update({k: v for k, v in asdict(reply).items()})
    if prompt.check is None:
        rec.update(outcome=UNCHECKED, detail="")
    else:
        verdict = check(prompt.check, reply.answer, reply.budget_hit)
        rec.update(outcome=verdict.outcome, detail=verdict.detail, **verdict.extra)
    return rec


def run_campaign(campaign: Campaign, batteries: list[Battery], backend: Backend, out_dir: str | Path,
                 seeds: list[int] | None = None, progress: bool = True) -> dict:
    """Run what DIR does not hold yet; returns the summary (analyze.summarize) of everything DIR holds."""
    out_dir = Path(out_dir)
    seeds = list(seeds or [0])
    done = _open_dir(out_dir, campaign_header(campaign, batteries, seeds, backend))
    tasks = list(_tasks(campaign, batteries, seeds))
    todo = [t for t in tasks if (t[0].name, t[1].name, t[2].id, t[3]) not in done]
    from tqdm import tqdm

    bar = tqdm(total=len(tasks), initial=len(tasks) - len(todo), disable=not progress, file=sys.stderr,
               unit="reply", dynamic_ncols=True)
    complete = False
    try:
        with open(out_dir / RESULTS, "a") as f:
            for arm, battery, prompt, seed in todo:
                bar.set_postfix_str(f"{arm.name} {battery.name}/{prompt.id}", refresh=False)
                rec = run_prompt(backend, arm, battery, prompt, seed)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                bar.update(1)
        complete = True
    finally:
        bar.close()
        summary = analyze.summarize(analyze.read_results(out_dir), [a.name for a in campaign.arms])
        analyze.write_summary(out_dir, summary, analyze.table(summary), complete)
    if complete:
        analyze.plot(out_dir, summary)
    return summary


# --------------------------------------------------------------------------------------------------------------
class _Trace:
    """on_step / on_block hooks: argmax flips between steps and contested positions, kept on the model's device
    (one small read per block, none per step)."""

    def __init__(self):
        self.prev = None
        self.counts = None
        self.flips = 0
        self.contested = 0
        self.entropies: list[float] = []
        self._key = None
        self._last_entropy = None

    def on_step(self, ev) -> None:
        key = (ev.block, ev.attempt)
        self._last_entropy = ev.mean_entropy
        if key != self._key or self.prev is None or self.prev.shape != ev.draft.shape:
            self._key, self.prev = key, ev.draft.clone()
            self.counts = ev.draft.new_zeros(ev.draft.shape)
            return
        changed = ev.draft != self.prev
        self.counts += changed
        self.prev.copy_(ev.draft)

    def on_block(self, ev) -> None:
        if self.counts is not None:
            n = len(ev.tokens)
            self.flips += int(self.counts.sum())
            self.contested += int((self.counts[:n] >= 2).sum())
        if self._last_entropy is not None:
            self.entropies.append(float(self._last_entropy))
        self.prev, self.counts, self._key, self._last_entropy = None, None, None, None


class ModelBackend:
    """A loaded diffgemma model: chat template -> diffgemma.generate with the arm's settings -> the reply."""

    def __init__(self, model, trace: bool = True):
        if getattr(model, "tokenizer", None) is None:
            raise InputError(f"{model.path}: has no tokenizer.json; a census renders chat prompts")
        self.model = model
        self.trace = trace

    def describe(self) -> dict:
        return {"path": str(getattr(self.model, "path", "")),
                "device": str(self.model.embedding.device), "dtype": str(self.model.embedding.dtype)}

    def validate(self, arm) -> None:
        """The arm on top of this model's generation_config and the environment, or SettingsError naming it."""
        from ..settings import GenerationSettings

        try:
            GenerationSettings.resolve(self.model.generation_config, env=os.environ, overrides=arm.overrides)
        except DiffgemmaError as e:
            raise type(e)(f"arm {arm.name!r}: {e}") from None

    def run(self, prompt: Prompt, overrides: dict[str, Any]) -> Reply:
        from ..generation import generate
        from ..session import reply_parts
        from ..settings import GenerationSettings

        tok = self.model.tokenizer
        ids = tok.apply_chat_template(prompt.messages, tools=prompt.tools, enable_thinking=prompt.think)
        settings = GenerationSettings.resolve(self.model.generation_config, env=os.environ, overrides=overrides)
        limit = self.model.config.max_positions
        if limit is not None and len(ids) + settings.max_new_tokens > limit:
            raise Skip(f"{len(ids)} prompt + {settings.max_new_tokens} new tokens exceed the model's context of "
                       f"{limit}")
        trace = _Trace() if self.trace else None
        t = time.perf_counter()
        r = generate(self.model, ids, settings=settings, on_step=trace and trace.on_step,
                     on_block=trace and trace.on_block)
        seconds = time.perf_counter() - t
        raw, thought, answer, _ = reply_parts(tok, r.tokens, settings.stop_strings)
        return Reply(answer=answer, raw=raw, thought=thought, tokens=len(r.tokens), prompt_tokens=len(ids),
                     forwards=r.forwards, blocks=len(r.steps_per_block), steps=sum(r.steps_per_block),
                     retries=r.retries, stop_reasons=list(r.stop_reasons), block_ends=list(r.block_ends),
                     flips=trace.flips if trace else 0, contested=trace.contested if trace else 0,
                     final_entropy=(sum(trace.entropies) / len(trace.entropies)) if trace and trace.entropies
                     else None, seconds=seconds)
