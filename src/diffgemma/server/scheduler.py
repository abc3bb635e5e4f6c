"""The server's continuous-batching scheduler: the requests that run together, one round at a time, on the thread
that owns the model (worker.py). docs/ARCHITECTURE.md, 'Continuous batching'.

Each running request is session.run_turn_steps on its own KV slot: a coroutine that asks for prompt chunks to be
prefilled (`Prefill`), for denoise forwards (`Forward`), for each step's status read (`Status`) and each block's read
(`BlockRead`), and runs everything else of its turn itself (sampler, stop rules, commits, tool-call regeneration,
the op-log). A round:

    admit   queued requests join, in arrival order, while fewer than max_batch run and a slot is free (a slot
            serves one request at a time: the one sharing the longest prefix, worker.pick)
    prefill a prompt that fits in one chunk takes it in the round it joins, so a burst of them starts denoising
            together; longer prompts take chunks in join order, up to prefill_chunk tokens a round (at least one
            chunk): a long prompt is spread over rounds, so the running streams keep stepping. While some request
            denoises, that budget is busy_chunk tokens (and a prompt of over two chunks that joins then prefills in
            chunks of that size), and a round right after one in which a request ended a block (its commit ran
            then) prefills nothing, so no step waits for a commit and a chunk; never two such rounds in a row
    denoise one batched forward over every canvas asked for (batch.py's forward); each request takes its logits
            and queues its step's device work up to its status read; one host wait reads every request's status
            (batch.read_asks); each takes its status and runs on to its next forward, or, at a block's end, to its
            block read, which the requests ending a block then make in one more wait before any commits; a
            request whose turn is over leaves at once, freeing its slot

A request cancelled by its client stops before its next step (its forward withdrawn) or prompt chunk; the others
are not touched. The forward is batch invariant, so a request gets the same tokens in any batch (and `diffgemma
replay` runs the logged generations one after another).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import time
from collections import deque

from ..batch import _forward as batched_forward, read_asks
from ..events import BlockEvent, CancelledEvent, ErrorEvent, StepEvent
from ..generation import BlockRead, Forward, Status
from ..session import Prefill, run_turn_steps
from ..slots import rewind, reuse_prefix

_job_ids = itertools.count(1)
COUNTED = ("started", "left", "failed", "forwards", "canvas_steps", "prefill_tokens")  # Scheduler.counts


class Job:
    """One request's generation. Its events (events.py), read with `get()` (or `await aget()` on an event loop), are
    run_turn's less the steps: a StartEvent, BlockEvents, a RetryEvent when a malformed tool call is regenerated (the
    blocks after it replace what followed the tokens it keeps), then one of DoneEvent, CancelledEvent, ErrorEvent. A
    job cancelled before it started, or failing outside the generation, gets only the CancelledEvent or
    ErrorEvent."""

    def __init__(self, ids: list[int], settings, tool_retries: int = 0, images: dict | None = None):
        self.id = next(_job_ids)
        self.ids, self.settings, self.tool_retries = ids, settings, tool_retries
        self.images = images  # a prompt key's images (vision/prompt.py), or None
        self.on_step = None  # StepEvent -> what to queue in its place (server/frames.py); None: steps are dropped
        self.events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        try:  # made by a handler on the server's event loop: aget() waits on it without a thread
            self._loop = asyncio.get_running_loop()
            self._ready = asyncio.Event()
        except RuntimeError:
            self._loop = self._ready = None

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

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
        """Hand an event to the job's reader; denoise steps stay on the worker unless the reader asked for them
        (`on_step` turns each into what is queued)."""
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


class _Running:
    """A request in the batch: its job, its slot, its turn's coroutine and what that asks for now."""

    def __init__(self, job: Job, slot: int, steps, one_chunk: bool = False):
        self.job, self.slot, self.steps = job, slot, steps
        self.one_chunk = one_chunk  # its whole prompt is one chunk: prefilled in the round it joins
        self.ask = None  # a Prefill, a Forward, a Status or a BlockRead
        self.t0 = time.perf_counter()


class Scheduler:
    """The rounds of `worker` (its model, slots, op-log and queue accounting). `pending` holds the jobs not yet
    running, in arrival order, and the worker's between-rounds calls (anything with run(), taken when no request
    runs). trace: a list that gets (time, "prefill", job id, tokens) and (time, "forward", (job ids...)) for each
    operation, and (time, "block", job id, tokens) for each block a request ends (committed then), in order (tests
    and bench/bench_serve.py read it), or None. busy_chunk: the prefill budget while some request denoises (capped at
    prefill_chunk)."""

    def __init__(self, worker, *, max_batch: int, prefill_chunk: int, busy_chunk: int, trace: list | None = None):
        self.worker, self.max_batch, self.prefill_chunk, self.trace = worker, max_batch, prefill_chunk, trace
        self.busy_chunk = min(busy_chunk, prefill_chunk)
        self._block_ended = False  # a request ended a block in the last round's denoise
        self._held = False  # the last round's prefill was held back for that
        self.pending: deque = deque()
        self.running: list[_Running] = []
        # what the rounds did, for /metrics: requests started / left / failed, forwards and the canvases they stepped,
        # prompt tokens prefilled. Every key is there from the start: /metrics copies this from another thread, and a
        # key added during the copy would break it.
        self.counts: collections.Counter = collections.Counter(dict.fromkeys(COUNTED, 0))

    @property
    def idle(self) -> bool:
        return not self.pending and not self.running

    @property
    def busy(self) -> bool:
        """Whether some running request is past its prompt (it denoises each round)."""
        return any(not isinstance(r.ask, Prefill) for r in self.running)

    def round(self) -> None:
        try:
            self._admit()
            self._prefill()
            self._denoise()
        except Exception as e:  # a bug here must not kill the thread every request waits on
            for r in self.running:
                r.steps.close()
                self._fail(r, e)
            self.running = []

    # -- the round's parts ---------------------------------------------------------------------------------------

    def _admit(self) -> None:
        w = self.worker
        for job in [j for j in self.pending if isinstance(j, Job) and j.cancelled]:  # left while it waited
            self.pending.remove(job)
            w.left_queue(job)
            job.put(CancelledEvent())
        while self.pending and len(self.running) < self.max_batch:
            head = self.pending[0]
            if not isinstance(head, Job):  # a call between rounds (warm-up): when nothing runs
                if self.running:
                    return
                self.pending.popleft().run()
                continue
            picked = w.pick(head.ids, busy={r.slot for r in self.running})
            if picked is None:  # every slot serves a running request
                return
            self.pending.popleft()
            w.left_queue(head)
            self._start(head, picked[0])

    def _start(self, job: Job, i: int) -> None:
        w = self.worker
        slot = w.slot(i)
        slot.last_used = w.tick()
        steps = None
        try:
            keep = reuse_prefix(slot.cache, slot.ids, job.ids)
            # a long prompt (over two whole chunks) joining running streams prefills in busy chunks: its late chunks
            # read a long context, and each stalls every stream. The chunk is fixed for the turn (the op-log's).
            rest = len(job.ids) - keep
            chunk = self.busy_chunk if self.busy and rest > 2 * self.prefill_chunk else self.prefill_chunk
            steps = run_turn_steps(w.model, slot, keep, job.ids[keep:], job.settings, tool_retries=job.tool_retries,
                                   log=w.log, next_gen=w.next_gen, slot_index=i,
                                   should_stop=lambda blocks: job.cancelled, stop_prefill=lambda: job.cancelled,
                                   on_event=lambda event, job=job: self._on_event(job, event), images=job.images,
                                   prefill_chunk=chunk, batched=self.max_batch > 1)
        except Exception as e:
            job.put(ErrorEvent(e))
            return
        r = _Running(job, i, steps, one_chunk=rest <= chunk)
        self.running.append(r)
        self.counts["started"] += 1
        self._advance(r, None)

    def _on_event(self, job: Job, event) -> None:
        if isinstance(event, BlockEvent):
            self._block_ended = True
            if self.trace is not None:
                self.trace.append((time.perf_counter(), "block", job.id, len(event.tokens)))
        job.put(event)

    def _prefill(self) -> None:
        busy, ended = self.busy, self._block_ended
        self._block_ended = False
        if busy and ended and not self._held and any(isinstance(r.ask, Prefill) for r in self.running):
            self._held = True  # the block's commit already lengthens this round's step
            return
        self._held = False
        budget = self.busy_chunk if busy else self.prefill_chunk
        for r in list(self.running):  # in join order
            while isinstance(r.ask, Prefill) and (budget > 0 or r.one_chunk):
                if not r.one_chunk:  # a one-chunk prompt is outside the budget: its stall is bounded by max_batch
                    budget -= r.ask.tokens
                self.counts["prefill_tokens"] += r.ask.tokens
                if self.trace is not None:
                    self.trace.append((time.perf_counter(), "prefill", r.job.id, r.ask.tokens))
                self._advance(r, None)

    def _denoise(self) -> None:
        for r in [r for r in self.running if r.job.cancelled and isinstance(r.ask, Forward)]:
            self._advance(r, None)  # a forward withdrawn: the request stops before its step, nothing computed
        asking = [r for r in self.running if isinstance(r.ask, Forward)]
        if not asking:
            return
        if self.trace is not None:
            self.trace.append((time.perf_counter(), "forward", tuple(r.job.id for r in asking)))
        self.counts["forwards"] += 1
        self.counts["canvas_steps"] += len(asking)
        # a failed forward: each request journals the failure as its own and empties its cache
        self._answer(asking, lambda forwards: batched_forward(self.worker.model, forwards))
        self._read_statuses()  # each request holds its own logits until its status is read

    def _read_statuses(self) -> None:
        """Answer every request parked at its step's Status or its block's BlockRead with one host wait (read_asks),
        and run each on; again while any asks anew (a request whose block ended reads the block after its status).
        A failed read is each parked request's own failure, as a failed forward is."""
        while parked := [r for r in self.running if isinstance(r.ask, (Status, BlockRead))]:
            self._answer(parked, read_asks)

    def _answer(self, rs: list, call) -> None:
        """Take the asks of requests `rs`, answer them with call(asks) (one answer per ask, in order) and run each
        request on with its answer; if the call fails, each request gets the exception as its own."""
        asks = [r.ask for r in rs]
        for r in rs:
            r.ask = None
        try:
            answers = call(asks)
        except Exception as e:
            for r in rs:
                self._advance(r, None, thrown=e)
            return
        del asks
        for r, answer in zip(rs, answers):
            self._advance(r, answer)

    # -- one request ---------------------------------------------------------------------------------------------

    def _advance(self, r: _Running, answer, thrown: BaseException | None = None) -> None:
        """Run request r on to its next ask, or to the end of its turn (it leaves the batch)."""
        try:
            r.ask = r.steps.send(answer) if thrown is None else r.steps.throw(thrown)
        except StopIteration:  # the turn is over: its last event is already on the job's queue
            self._leave(r)
        except Exception as e:
            self._fail(r, e)
            self._leave(r)

    def _leave(self, r: _Running) -> None:
        if r in self.running:
            self.running.remove(r)
            self.counts["left"] += 1
        self.worker.finished(r.slot, time.perf_counter() - r.t0)

    def _fail(self, r: _Running, e: Exception) -> None:
        """A failure outside the turn's own handling: the slot starts afresh, the job gets the error."""
        slot = self.worker.slots[r.slot]
        rewind(slot.cache, 0)
        slot.ids = []
        self.counts["failed"] += 1
        r.job.put(ErrorEvent(e))
