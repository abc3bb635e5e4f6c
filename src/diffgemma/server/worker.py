"""The one thread that owns the model and its KV caches; HTTP handlers hand it jobs and read their events.

KV reuse across requests: the worker keeps a few conversation slots, each a KV cache and the token ids it
holds. An OpenAI client sends the whole conversation every turn; its rendering shares a long prefix with
what some slot already holds, so the worker picks that slot (`pick`), rewinds its cache to the common prefix
and prefills only the rest. A client that leaves mid-reply cancels its job between denoise steps; the cache is rewound to the
prompt, so the slot still serves the conversation.

Every generation goes through `run_generation`, which `replay` calls too: the op-log records exactly the
inputs it takes (slot, kept prefix, prompt ids, settings).
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, field

from ..errors import InputError
from ..generation import BlockEvent, DoneEvent, generate_stream
from ..session import _common_prefix, reuse_prefix, rewind


@dataclass
class Slot:
    cache: object
    ids: list[int] = field(default_factory=list)  # the token ids the cache holds, in order
    last_used: int = 0


class Job:
    """One request's generation. Events, read with `get()`: ("start", {"cached_tokens": K}), ("block",
    BlockEvent)..., then one of ("done", GenerationResult), ("cancelled", None), ("error", exception)."""

    def __init__(self, ids: list[int], settings):
        self.ids, self.settings = ids, settings
        self.events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def get(self, timeout: float | None = None):
        return self.events.get(timeout=timeout)


def run_generation(model, slot: Slot, keep: int, prompt: list[int], settings, log=None, gen: int = 0,
                   should_stop=lambda blocks: False, emit=lambda kind, payload: None):
    """Rewind `slot` to `keep` tokens, prefill `prompt`, generate; log and emit each event. `should_stop(blocks)`
    is asked after every event (a step or a block); True cancels: the cache is rewound to the prompt."""
    record = log.write if log is not None else (lambda r: None)
    full = slot.ids[:keep] + prompt
    slot.ids = []  # unknown until the generation ends
    blocks = 0
    stream = generate_stream(model, prompt, settings=settings, cache=slot.cache)
    try:
        for event in stream:
            if isinstance(event, BlockEvent):
                blocks += 1
                record({"event": "block", "gen": gen, "block": event.block, "tokens": event.tokens,
                        "steps": event.steps, "stop_reason": event.stop_reason, "end": event.end})
                emit("block", event)
            elif isinstance(event, DoneEvent):
                result = event.result
                slot.ids = full + list(result.tokens)
                record({"event": "done", "gen": gen, "tokens": result.tokens, "stop_token": result.stop_token})
                emit("done", result)
                return
            if should_stop(blocks):
                stream.close()
                kept = rewind(slot.cache, len(full))
                slot.ids = full[:kept]
                record({"event": "cancelled", "gen": gen, "blocks": blocks, "kept": kept})
                emit("cancelled", None)
                return
    except Exception as e:  # the cache may hold part of a prefill or a block: start it afresh
        stream.close()
        rewind(slot.cache, 0)
        record({"event": "error", "gen": gen, "error": f"{type(e).__name__}: {e}"})
        emit("error", e)


class Worker:
    def __init__(self, model, *, slots: int = 2, max_tokens: int = 8192, log=None):
        if not isinstance(slots, int) or slots < 1:
            raise InputError(f"slots: expected a positive integer, got {slots!r}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError(f"max_tokens: expected a positive integer, got {max_tokens!r}")
        self.model, self.max_tokens, self.log = model, max_tokens, log
        self.slots: list[Slot | None] = [None] * slots  # each cache is made on first use
        self._gens = itertools.count()
        self._clock = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="diffgemma-worker", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], settings) -> Job:
        """Queue a generation for the rendered conversation `ids`; refused at once if it cannot fit."""
        if not ids:
            raise InputError("the rendered prompt is empty")
        need = len(ids) + settings.max_new_tokens
        if need > self.max_tokens:
            raise InputError(f"the prompt ({len(ids)} tokens) plus max_tokens ({settings.max_new_tokens}) is {need} "
                             f"tokens, over this server's context of {self.max_tokens}; lower max_tokens or start "
                             f"the server with a larger --max-tokens")
        job = Job(list(ids), settings)
        self._queue.put(job)
        return job

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def pick(self, ids: list[int]) -> tuple[int, int]:
        """-> (slot index, common prefix length). The slot sharing the longest prefix, if that is at least half of
        what it holds (the request continues its conversation, or rewinds a little of it); otherwise an unused
        slot, so a new conversation does not evict one that merely shares a system prompt; otherwise the least
        recently used slot."""
        shared = {i: _common_prefix(s.ids, ids) for i, s in enumerate(self.slots) if s is not None and s.ids}
        if shared:
            i = max(shared, key=lambda j: (shared[j], self.slots[j].last_used))
            if 2 * shared[i] >= len(self.slots[i].ids):
                return i, shared[i]
        unused = [i for i, s in enumerate(self.slots) if s is None or not s.ids]
        if unused:
            return unused[0], 0
        i = min(shared, key=lambda j: self.slots[j].last_used)
        return i, shared[i]

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled:  # the client left while the job waited
                job.events.put(("cancelled", None))
                continue
            try:
                self._run(job)
            except Exception as e:  # a bug here must not kill the thread every request waits on
                job.events.put(("error", e))

    def _run(self, job: Job) -> None:
        i, _ = self.pick(job.ids)
        if self.slots[i] is None:
            self.slots[i] = Slot(self.model.new_cache(self.max_tokens))
        slot = self.slots[i]
        slot.last_used = next(self._clock)
        keep = reuse_prefix(slot.cache, slot.ids, job.ids)
        gen = next(self._gens)
        if self.log is not None:
            self.log.write({"op": "generate", "gen": gen, "slot": i, "keep": keep, "prompt": job.ids[keep:],
                            "settings": job.settings.as_dict()})
        job.events.put(("start", {"cached_tokens": keep}))
        run_generation(self.model, slot, keep, job.ids[keep:], job.settings, self.log, gen,
                       should_stop=lambda blocks: job.cancelled, emit=lambda kind, p: job.events.put((kind, p)))
