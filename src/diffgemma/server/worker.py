"""The one thread that owns the model and its KV caches; HTTP handlers hand it jobs and read their events.

The thread steps an engine core (core/engine.py): requests join the running batch at its next round and leave the
moment their turn ends, up to `max_batch` at a time; the rest wait in a bounded queue (`max_queue`; a request over it
is refused at once with QueueFull, which the HTTP layer sends as a 503 with Retry-After). A request whose client
leaves while it waits frees its place at once and is dropped at the next round.

KV reuse across requests: the core's slots (slots.SlotPool) are a few conversation slots, each a KV cache and the
token ids it holds. An OpenAI client sends the whole conversation every turn; its rendering shares a long prefix
with what some slot already holds, so that slot serves it (`pick`), rewound to the common prefix, and only the rest
is prefilled, a chunk per round. A client that leaves mid-reply cancels its job at its next denoise step; the cache
is rewound to the prompt, so the slot still serves the conversation.

Every generation is journaled in the op-log with exactly the inputs `diffgemma replay` needs (slot, kept prefix,
prompt ids, settings, prefill chunk). A job's events (events.py) are put on the job's queue as they come.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import queue
import threading
import time
from collections import deque

from ..config import cache_tokens
from ..core import EngineCore, Request
from ..core.request import QUEUED
from ..errors import DiffgemmaError, InputError
from ..events import CancelledEvent, DoneEvent, ErrorEvent, StepEvent
from ..model.engine_batch import KEPT_GRAPHS
from ..reply import malformed_call_cut
from ..slots import Slot, SlotPool
from .limits import BUSY_PREFILL_CHUNK, MAX_QUEUE, PREFILL_CHUNK

__all__ = ["Job", "QueueFull", "Worker", "default_max_batch"]


class Job:
    """One request as the HTTP layer sees it. Its events (events.py), read with `get()` (or `await aget()` on an
    event loop), are the turn's less the steps: a StartEvent, BlockEvents, a RetryEvent when a malformed tool call is
    regenerated (the blocks after it replace what followed the tokens it keeps), then one of DoneEvent,
    CancelledEvent, ErrorEvent. A job cancelled before it started gets only the CancelledEvent."""

    def __init__(self, request: Request, on_step=None):
        self.request = request
        self.id = request.id
        self.on_step = on_step  # StepEvent -> what to queue in its place (server/frames.py); None: steps are dropped
        request.sink = self.put
        self.events: queue.Queue = queue.Queue()
        try:  # made by a handler on the server's event loop: aget() waits on it without a thread
            self._loop = asyncio.get_running_loop()
            self._ready = asyncio.Event()
        except RuntimeError:
            self._loop = self._ready = None

    def cancel(self) -> None:
        self.request.cancel()

    @property
    def cancelled(self) -> bool:
        return self.request.cancelled

    def get(self, timeout: float | None = None):
        """The next event; queue.Empty after `timeout` seconds without one."""
        return self.events.get(timeout=timeout)

    async def aget(self):
        """The next event, awaited on the event loop that made the job (a thread waits for it on any other)."""
        if self._loop is None or asyncio.get_running_loop() is not self._loop:
            while True:  # polled: a cancelled wait must not leave a thread behind that takes the next event
                try:
                    return self.events.get_nowait()
                except queue.Empty:
                    await asyncio.sleep(0.01)
        while True:
            try:
                return self.events.get_nowait()
            except queue.Empty:
                self._ready.clear()
            try:  # an event put before the clear is seen here; one put after it sets the flag again
                return self.events.get_nowait()
            except queue.Empty:
                await self._ready.wait()

    def put(self, event) -> None:
        """Hand an event to the job's reader (on the worker thread); denoise steps stay there unless the reader asked
        for them (`on_step` turns each into what is queued)."""
        if isinstance(event, StepEvent):
            if self.on_step is None:
                return
            event = self.on_step(event)
        self.events.put(event)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop is closed: nobody awaits this job any more
                pass


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
        them (at most prefill_chunk). trace: see core.EngineCore."""
        _positive("slots", slots)
        self.max_queue = _positive("max_queue", max_queue)
        _positive("prefill_chunk", prefill_chunk)
        _positive("busy_prefill_chunk", busy_prefill_chunk)
        max_tokens = cache_tokens(model.config, max_tokens)  # the one rule for a cache's size
        self.model, self.max_tokens, self.log = model, max_tokens, log
        self.pool = SlotPool(model, slots, max_tokens)  # each cache is made on first use
        self.core = EngineCore(model, max_batch=default_max_batch(model) if max_batch is None else max_batch,
                               slots=self.pool, prefill_chunk=prefill_chunk, busy_chunk=busy_prefill_chunk,
                               max_queue=self.max_queue, trace=trace)
        self.max_batch = self.core.max_batch
        tokenizer = getattr(model, "tokenizer", None)
        self._call_cut = (lambda reply: malformed_call_cut(tokenizer, reply)) if tokenizer is not None else None
        self._gens = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued: list[Request] = []  # submitted, not started or dropped yet (the queue bound counts these)
        self._turn_s = 1.0  # a running average of a turn's seconds (for Retry-After)
        # told of each round that ran a forward, `round(seconds)`, and each turn's end, `turn(seconds)` (on the worker
        # thread; server/metrics.py's histograms listen)
        self.listeners: list = []
        self._thread = threading.Thread(target=self._serve, name="diffgemma-worker", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> list[Slot | None]:
        return self.pool.slots

    def slot(self, i: int) -> Slot:
        return self.pool.slot(i)

    def pick(self, ids: list[int], busy=()) -> tuple[int, int] | None:
        """slots.SlotPool.pick: the slot a request for `ids` would take now."""
        return self.pool.pick(ids, busy)

    @property
    def queued(self) -> int:
        """Requests waiting to start (a cancelled one stops counting at once)."""
        with self._lock:
            self._queued = [r for r in self._queued if r.phase == QUEUED and not r.cancelled]
            return len(self._queued)

    def submit(self, ids: list[int], settings, tool_retries: int = 0, images: dict | None = None,
               on_step=None, repair=None) -> Job:
        """Queue a generation for the rendered conversation `ids`; refused at once if it cannot fit (InputError) or
        the queue is full (QueueFull). tool_retries: regenerate a malformed tool call up to this many times
        (core/turn.py). images: with a prompt key (vision/prompt.py), its images. on_step: what each StepEvent becomes
        on the job's queue (server/frames.snapshot), or None: steps are dropped unread. repair: the chat's tool repair
        view (tool_repair.ToolRepair), run where the settings' tool_repair asks (core/repair.py)."""
        if not ids:
            raise InputError("the rendered prompt is empty")
        need = len(ids) + settings.max_new_tokens
        if need > self.max_tokens:
            raise InputError(f"the prompt ({len(ids)} tokens) plus max_tokens ({settings.max_new_tokens}) is {need} "
                             f"tokens, over this server's context of {self.max_tokens}; lower max_tokens or start "
                             f"the server with a larger --max-tokens")
        request = Request(settings, ids=list(ids), images=images, turn=True, tool_retries=tool_retries,
                          call_cut=self._call_cut, repair=repair, log=self.log, next_gen=self.next_gen)
        job = Job(request, on_step)
        request.sink = lambda event: self._on_event(job, event)
        waiting = self.queued
        with self._lock:
            if not self.core.scheduler.has_room(waiting):
                wait = max(1, min(60, math.ceil(self._turn_s * (waiting + 1) / self.max_batch)))
                raise QueueFull(f"the server is busy: {waiting} requests are queued (--max-queue "
                                f"{self.max_queue}); retry in {wait} s", wait)
            self._queued.append(request)
        self._inbox.put(job)
        return job

    def _on_event(self, job: Job, event) -> None:
        job.put(event)
        r = job.request
        if r.run is not None and isinstance(event, (DoneEvent, CancelledEvent, ErrorEvent)) and r.done:
            seconds = time.perf_counter() - r.t0
            self._turn_s = 0.8 * self._turn_s + 0.2 * seconds
            for listener in self.listeners:
                listener.turn(seconds)

    def metrics(self) -> dict:
        """A snapshot for /metrics (server/metrics.py): the requests running and queued, the limits, what the rounds
        did (EngineCore.counts) and how the model's batched forwards ran (graph replays, captures, eager runs)."""
        return {"running": len(self.core.scheduler.running), "queued": self.queued, "max_batch": self.max_batch,
                "max_queue": self.max_queue, "slots": len(self.slots), "max_tokens": self.max_tokens,
                "counts": dict(self.core.counts),
                "batch_forwards": dict(getattr(self.model, "batch_graph_counts", {}))}

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

        call = self.between_rounds(run, wait=False)
        try:
            return call.result()
        except BaseException:  # e.g. Ctrl-C while waiting: the worker thread stops warming at the next bucket
            stop.set()
            raise

    def between_rounds(self, fn, wait: bool = True):
        """fn() on the worker thread (the one that owns the model) once the core has no request left, ahead of any
        request queued later -> its result (wait), or the queued call, whose result() waits for it."""
        call = _Call(fn)
        self._inbox.put(call)
        return call.result() if wait else call

    def _serve(self) -> None:
        """The thread: hand submitted jobs to the core, run a between-rounds call (warm-up) once the core is idle
        (what came after it waits for it), and step the core while it has requests."""
        core, held, closing = self.core, deque(), False
        while not (closing and core.idle and not held):
            try:
                item = self._inbox.get(block=core.idle and not held)  # wait only when there is nothing to do
                while True:
                    if item is None:
                        closing = True
                    else:
                        held.append(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            while held and (isinstance(held[0], Job) or core.idle):
                item = held.popleft()
                if isinstance(item, Job):
                    core.add_request(item.request)
                else:
                    item.run()
            if core.idle:
                continue
            forwards, t = core.counts["forwards"], time.perf_counter()
            try:
                core.step()
            except Exception as e:  # a bug in a round must not kill the thread every request waits on
                core.fail_running(e)
            if core.counts["forwards"] != forwards:
                for listener in self.listeners:
                    listener.round(time.perf_counter() - t)
