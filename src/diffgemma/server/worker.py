"""The one thread that owns the model and its KV caches; HTTP handlers hand it jobs and read their events.

The thread runs the continuous-batching scheduler (scheduler.py): requests join the running batch at its next round
and leave the moment their turn ends, up to `max_batch` at a time; the rest wait in a bounded queue (`max_queue`;
a request over it is refused at once with QueueFull, which the HTTP layer sends as a 503 with Retry-After).

KV reuse across requests: the worker keeps a few conversation slots, each a KV cache and the token ids it
holds. An OpenAI client sends the whole conversation every turn; its rendering shares a long prefix with
what some slot already holds, so the worker picks that slot (`pick`, among the slots no running request holds),
rewinds its cache to the common prefix and prefills only the rest, a chunk per round. A client that leaves
mid-reply cancels its job at its next denoise step; the cache is rewound to the prompt, so the slot still serves
the conversation.

Every generation goes through session.generation_steps (via run_turn_steps, which may regenerate a malformed tool
call), which `replay` runs too: the op-log records exactly the inputs it takes (slot, kept prefix, prompt ids,
settings, prefill chunk). A job's events are those of run_turn (events.py), put on the job's queue as they come.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time

from ..config import cache_tokens
from ..errors import DiffgemmaError, InputError
from ..model.engine_batch import KEPT_GRAPHS
from ..slots import Slot, usable_prefix
from .limits import BUSY_PREFILL_CHUNK, MAX_QUEUE, PREFILL_CHUNK
from .scheduler import Job, Scheduler

__all__ = ["Job", "QueueFull", "Worker", "default_max_batch"]


class QueueFull(DiffgemmaError):
    """The server's queue is full: the request is refused now; `retry_after` seconds is a fair wait."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def default_max_batch(model, max_tokens: int | None = None) -> int:
    """How many requests step together unless told: what the model's forward takes (its `max_batch`; a model
    without one takes a single canvas), or 8 where it takes any number; on CUDA, given each request's context
    (`max_tokens`), no more than fit in the device's free memory (fitting_batch)."""
    cap = getattr(model, "max_batch", 1)
    cap = 8 if cap is None else cap
    device = model.embedding.device
    if max_tokens is None or device.type != "cuda" or cap <= 1:
        return cap
    import torch

    before = torch.cuda.memory_allocated(device)
    cache = model.new_cache(max_tokens)  # one slot's cache, measured as made
    cache_bytes = torch.cuda.memory_allocated(device) - before
    buckets = len(model.context_buckets(cache))  # a solo denoise graph each
    del cache
    cfg, elem = model.config, model.embedding.element_size()
    logits_bytes = cfg.canvas_length * cfg.vocab_size * elem
    free = torch.cuda.mem_get_info(device)[0]
    sc_bytes = cfg.canvas_length * cfg.hidden_size * elem
    return fitting_batch(free, cache_bytes, logits_bytes, buckets, cap, sc_bytes=sc_bytes)


# Device bytes kept free beside the slots: a packed model's prefill dequantizes a layer's experts into a ~1 GB bf16
# scratch, and a step's transient tensors (the sampler's [canvas, vocab] passes, a capture's warm-up) come and go.
SERVE_RESERVE_BYTES = 3 * 2**30


def fitting_batch(free: int, cache_bytes: int, logits_bytes: int, buckets: int, cap: int, sc_bytes: int = 0) -> int:
    """The most requests (at least 1, at most cap) whose slots fit in `free` device bytes beside the reserve: each
    needs its KV cache, a solo denoise graph's [canvas, vocab] logits per context bucket, its lane of the batch
    graphs' shared logits buffer, and its lane's SC input rows (`sc_bytes`, [canvas, hidden]) in every kept batch
    graph."""
    per_request = cache_bytes + logits_bytes * (buckets + 1) + sc_bytes * KEPT_GRAPHS
    return max(1, min(cap, (free - SERVE_RESERVE_BYTES) // max(1, per_request)))


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name}: expected a positive integer, got {value!r}")
    return value


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
    def __init__(self, model, *, slots: int = 2, max_tokens: int | None = None, log=None, max_batch: int | None = None,
                 max_queue: int = MAX_QUEUE, prefill_chunk: int = PREFILL_CHUNK, trace: list | None = None,
                 busy_prefill_chunk: int = BUSY_PREFILL_CHUNK):
        """slots: KV caches kept for reuse (at most this many requests run at once). max_batch: requests stepped
        together (default: default_max_batch; at most what the model's forward takes). max_queue: requests waiting
        beyond those that can start now; more are refused (QueueFull). prefill_chunk: prompt tokens prefilled a
        round; busy_prefill_chunk: the same while other requests generate, and the chunk of a long prompt joining
        them (at most prefill_chunk). trace: see scheduler.Scheduler."""
        _positive("slots", slots)
        cap = getattr(model, "max_batch", 1)
        max_batch = default_max_batch(model) if max_batch is None else _positive("max_batch", max_batch)
        if cap is not None and max_batch > cap:
            raise InputError(f"max_batch {max_batch}: this model's forward takes at most {cap} canvas(es)")
        self.max_queue = _positive("max_queue", max_queue)
        _positive("prefill_chunk", prefill_chunk)
        _positive("busy_prefill_chunk", busy_prefill_chunk)
        max_tokens = cache_tokens(model.config, max_tokens)  # the one rule for a cache's size
        self.model, self.max_tokens, self.log = model, max_tokens, log
        self.slots: list[Slot | None] = [None] * slots  # each cache is made on first use
        self.max_batch = max_batch
        self._gens = itertools.count()
        self._clock = itertools.count(1)
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0  # jobs submitted, not yet started or dropped
        self._turn_s = 1.0  # a running average of a turn's seconds (for Retry-After)
        # told of each round that ran a forward, `round(seconds)`, and each turn's end, `turn(seconds)` (on the worker
        # thread; server/metrics.py's histograms listen)
        self.listeners: list = []
        self.scheduler = Scheduler(self, max_batch=max_batch, prefill_chunk=prefill_chunk, trace=trace,
                                   busy_chunk=busy_prefill_chunk)
        self._thread = threading.Thread(target=self._serve, name="diffgemma-worker", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], settings, tool_retries: int = 0, images: dict | None = None, on_step=None) -> Job:
        """Queue a generation for the rendered conversation `ids`; refused at once if it cannot fit (InputError) or
        the queue is full (QueueFull). tool_retries: regenerate a malformed tool call up to this many times
        (session.run_turn). images: with a prompt key (vision/prompt.py), its images."""
        if not ids:
            raise InputError("the rendered prompt is empty")
        need = len(ids) + settings.max_new_tokens
        if need > self.max_tokens:
            raise InputError(f"the prompt ({len(ids)} tokens) plus max_tokens ({settings.max_new_tokens}) is {need} "
                             f"tokens, over this server's context of {self.max_tokens}; lower max_tokens or start "
                             f"the server with a larger --max-tokens")
        job = Job(list(ids), settings, tool_retries, images)
        job.on_step = on_step  # the job's StepEvents, for a reader that asked for them (Job.put)
        with self._lock:
            free = max(0, min(self.max_batch, len(self.slots)) - len(self.scheduler.running))
            if self._waiting >= self.max_queue + free:
                wait = max(1, min(60, math.ceil(self._turn_s * (self._waiting + 1) / self.max_batch)))
                raise QueueFull(f"the server is busy: {self._waiting} requests are queued (--max-queue "
                                f"{self.max_queue}); retry in {wait} s", wait)
            self._waiting += 1
        self._inbox.put(job)
        return job

    def metrics(self) -> dict:
        """A snapshot for /metrics (server/metrics.py): the requests running and queued, the limits, what the rounds
        did (Scheduler.counts) and how the model's batched forwards ran (graph replays, captures, eager runs)."""
        sched = self.scheduler
        return {"running": len(sched.running), "queued": self._waiting, "max_batch": self.max_batch,
                "max_queue": self.max_queue, "slots": len(self.slots), "max_tokens": self.max_tokens,
                "counts": dict(sched.counts), "batch_forwards": dict(getattr(self.model, "batch_graph_counts", {}))}

    def left_queue(self, job: Job) -> None:
        """The scheduler took `job` off the queue (started, or dropped as cancelled)."""
        with self._lock:
            self._waiting -= 1

    def finished(self, slot: int, seconds: float) -> None:
        """A turn on `slot` ended after `seconds`."""
        self.slots[slot].last_used = self.tick()
        self._turn_s = 0.8 * self._turn_s + 0.2 * seconds
        for listener in self.listeners:
            listener.turn(seconds)

    def slot(self, i: int) -> Slot:
        """Slot i, its cache made on first use."""
        if self.slots[i] is None:
            self.slots[i] = Slot(self.model.new_cache(self.max_tokens))
        return self.slots[i]

    def tick(self) -> int:
        return next(self._clock)

    def next_gen(self) -> int:
        return next(self._gens)

    def close(self) -> None:
        """Serve what was submitted before, then stop the thread."""
        self._inbox.put(None)
        self._thread.join()

    def warm_up(self, settings, progress=None) -> float:
        """Make every slot's cache now and warm it up (warmup.py: kernels compiled, a denoise graph per context
        bucket) with the settings requests will use, on the worker thread, ahead of any request queued later.
        -> seconds taken."""
        from ..warmup import warm_up, warm_up_batches

        stop = threading.Event()

        def run():
            t = 0.0
            for i in range(len(self.slots)):
                slot = self.slot(i)
                if not slot.ids:  # a slot holding a conversation keeps it
                    t += warm_up(self.model, slot.cache, settings, should_stop=stop.is_set,
                                 progress=None if progress is None else (lambda m, i=i: progress(f"slot {i}: {m}")))
            empty = [s.cache for s in self.slots if not s.ids][:self.max_batch]
            if len(empty) >= 2:  # the batch sizes its empty slots can make (a kept conversation is left alone)
                t += warm_up_batches(self.model, empty, settings, should_stop=stop.is_set, progress=progress)
            return t

        call = _Call(run)
        self._inbox.put(call)
        try:
            return call.result()
        except BaseException:  # e.g. Ctrl-C while waiting: the worker thread stops warming at the next bucket
            stop.set()
            raise

    def pick(self, ids: list[int], busy=()) -> tuple[int, int] | None:
        """-> (slot index, common prefix length) among the slots not in `busy` (those running requests hold), or
        None when every slot is busy. The slot sharing the longest prefix, if that is at least half of what it holds
        (the request continues its conversation, or rewinds a little of it); otherwise an unused slot, so a new
        conversation does not evict one that merely shares a system prompt; otherwise the least recently used slot.
        A prefix counts only where the slot's cache can rewind to it (slots.usable_prefix)."""
        free = [i for i in range(len(self.slots)) if i not in busy]
        shared = {i: usable_prefix(self.slots[i], ids) for i in free if self.slots[i] is not None and self.slots[i].ids}
        if shared:
            i = max(shared, key=lambda j: (shared[j], self.slots[j].last_used))
            if 2 * shared[i] >= len(self.slots[i].ids):
                return i, shared[i]
        unused = [i for i in free if self.slots[i] is None or not self.slots[i].ids]
        if unused:
            return unused[0], 0
        if not shared:
            return None
        i = min(shared, key=lambda j: self.slots[j].last_used)
        return i, shared[i]

    def _serve(self) -> None:
        closing = False
        sched = self.scheduler
        while not (closing and sched.idle):
            try:
                item = self._inbox.get(block=sched.idle)  # wait only when there is nothing to step
                while True:
                    if item is None:
                        closing = True
                    else:
                        sched.pending.append(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            forwards, t = sched.counts["forwards"], time.perf_counter()
            sched.round()
            if sched.counts["forwards"] != forwards:
                for listener in self.listeners:
                    listener.round(time.perf_counter() - t)
