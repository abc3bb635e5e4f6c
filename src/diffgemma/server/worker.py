"""The one thread that owns the model and its KV caches; HTTP handlers hand it jobs and read their events.

KV reuse across requests: the worker keeps a few conversation slots, each a KV cache and the token ids it
holds. An OpenAI client sends the whole conversation every turn; its rendering shares a long prefix with
what some slot already holds, so the worker picks that slot (`pick`), rewinds its cache to the common prefix
and prefills only the rest. A client that leaves mid-reply cancels its job between denoise steps; the cache is rewound to the
prompt, so the slot still serves the conversation.

Every generation goes through session.run_generation (via run_turn, which may regenerate a malformed tool
call), which `replay` calls too: the op-log records exactly the inputs it takes (slot, kept prefix, prompt ids,
settings). A job's events are those of run_turn (events.py), put on the job's queue as they come.
"""

from __future__ import annotations

import itertools
import queue
import threading

from ..config import cache_tokens
from ..errors import InputError
from ..events import CancelledEvent, ErrorEvent, StepEvent
from ..session import run_turn
from ..slots import Slot, reuse_prefix, usable_prefix


class Job:
    """One request's generation. Its events (events.py), read with `get()`, are run_turn's less the steps: a
    StartEvent, BlockEvents, a RetryEvent when a malformed tool call is regenerated (the blocks after it replace what
    followed the tokens it keeps), then one of DoneEvent, CancelledEvent, ErrorEvent. A job cancelled before it
    started, or failing outside the generation, gets only the CancelledEvent or ErrorEvent."""

    def __init__(self, ids: list[int], settings, tool_retries: int = 0, images: dict | None = None):
        self.ids, self.settings, self.tool_retries = ids, settings, tool_retries
        self.images = images  # a prompt key's images (vision/prompt.py), or None
        self.events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def get(self, timeout: float | None = None):
        """The next event; queue.Empty after `timeout` seconds without one."""
        return self.events.get(timeout=timeout)

    def put(self, event) -> None:
        """Hand an event to the job's reader; denoise steps stay on the worker (nobody downstream shows them)."""
        if not isinstance(event, StepEvent):
            self.events.put(event)


class _Call:
    """A function the worker thread runs between jobs (the thread that owns the model); result() waits for it."""

    def __init__(self, fn):
        self.fn, self._done = fn, queue.Queue(maxsize=1)

    def run(self) -> None:
        try:
            self._done.put((True, self.fn()))
        except Exception as e:  # handed to the caller, not left to kill the thread
            self._done.put((False, e))

    def result(self):
        ok, value = self._done.get()
        if not ok:
            raise value
        return value


class Worker:
    def __init__(self, model, *, slots: int = 2, max_tokens: int | None = None, log=None):
        if not isinstance(slots, int) or slots < 1:
            raise InputError(f"slots: expected a positive integer, got {slots!r}")
        max_tokens = cache_tokens(model.config, max_tokens)  # the one rule for a cache's size
        self.model, self.max_tokens, self.log = model, max_tokens, log
        self.slots: list[Slot | None] = [None] * slots  # each cache is made on first use
        self._gens = itertools.count()
        self._clock = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="diffgemma-worker", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], settings, tool_retries: int = 0, images: dict | None = None) -> Job:
        """Queue a generation for the rendered conversation `ids`; refused at once if it cannot fit. tool_retries:
        regenerate a malformed tool call up to this many times (session.run_turn). images: with a prompt key
        (vision/prompt.py), its images."""
        if not ids:
            raise InputError("the rendered prompt is empty")
        need = len(ids) + settings.max_new_tokens
        if need > self.max_tokens:
            raise InputError(f"the prompt ({len(ids)} tokens) plus max_tokens ({settings.max_new_tokens}) is {need} "
                             f"tokens, over this server's context of {self.max_tokens}; lower max_tokens or start "
                             f"the server with a larger --max-tokens")
        job = Job(list(ids), settings, tool_retries, images)
        self._queue.put(job)
        return job

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def warm_up(self, settings, progress=None) -> float:
        """Make every slot's cache now and warm it up (warmup.py: kernels compiled, a denoise graph per context
        bucket) with the settings requests will use, on the worker thread, ahead of any request queued later.
        -> seconds taken."""
        from ..warmup import warm_up

        stop = threading.Event()

        def run():
            t = 0.0
            for i in range(len(self.slots)):
                if self.slots[i] is None:
                    self.slots[i] = Slot(self.model.new_cache(self.max_tokens))
                if not self.slots[i].ids:  # a slot holding a conversation keeps it
                    t += warm_up(self.model, self.slots[i].cache, settings, should_stop=stop.is_set,
                                 progress=None if progress is None else (lambda m, i=i: progress(f"slot {i}: {m}")))
            return t

        call = _Call(run)
        self._queue.put(call)
        try:
            return call.result()
        except BaseException:  # e.g. Ctrl-C while waiting: the worker thread stops warming at the next bucket
            stop.set()
            raise

    def pick(self, ids: list[int]) -> tuple[int, int]:
        """-> (slot index, common prefix length). The slot sharing the longest prefix, if that is at least half of
        what it holds (the request continues its conversation, or rewinds a little of it); otherwise an unused
        slot, so a new conversation does not evict one that merely shares a system prompt; otherwise the least
        recently used slot. A prefix counts only where the slot's cache can rewind to it (slots.usable_prefix)."""
        shared = {i: usable_prefix(s, ids) for i, s in enumerate(self.slots) if s is not None and s.ids}
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
            if isinstance(job, _Call):
                job.run()
                continue
            if job.cancelled:  # the client left while the job waited
                job.put(CancelledEvent())
                continue
            try:
                self._run(job)
            except Exception as e:  # a bug here must not kill the thread every request waits on
                job.put(ErrorEvent(e))

    def _run(self, job: Job) -> None:
        i, _ = self.pick(job.ids)
        if self.slots[i] is None:
            self.slots[i] = Slot(self.model.new_cache(self.max_tokens))
        slot = self.slots[i]
        slot.last_used = next(self._clock)
        keep = reuse_prefix(slot.cache, slot.ids, job.ids)
        run_turn(self.model, slot, keep, job.ids[keep:], job.settings, tool_retries=job.tool_retries, log=self.log,
                 next_gen=lambda: next(self._gens), slot_index=i, should_stop=lambda blocks: job.cancelled,
                 on_event=job.put, images=job.images)
