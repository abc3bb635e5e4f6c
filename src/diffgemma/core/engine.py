"""The engine core: the one loop that drives every generation (docs/ARCHITECTURE.md, 'Continuous batching').

generate, generate_batch, Session, replay and the server's worker all make Requests (core/request.py), add them
with `add_request` and call `step()` until they are done; `abort` (or Request.cancel) stops one. A step:

    plan      the scheduler's plan (core/scheduler.py): who is dropped, who joins, which prompt chunks are
              prefilled, who steps
    start     a joining request's generation opens: its op-log record, its images' prefill, a turn's StartEvent
    prefill   the planned prompt chunks, in waves of one chunk a request: a wave's chunks in one forward where the
              model has prefill_batch (turn.prefill_chunks); a request whose prompt is in starts its generation
              (core/steps.py) and runs to its first ForwardAsk
    forward   one forward over every stepping request's canvas (core/lanes.forward_lanes), every lane's StepStats
              and accept mask made in one place (lanes.lane_stats, lanes.lane_masks), each request running on with
              them to its StatusAsk
    read      every lane's sparse-SC plan (lanes.lane_plans), then one host wait for every lane's status
              (lanes.read_asks); each request runs on to its EmbedAsk, whose SC embeddings are summed together
              (lanes.lane_embeds), then to its next ForwardAsk or, at a block's end, to its BlockRead: those share one
              more wait before any lane commits, and the lanes' commits run together (lanes.commit_lanes)
    last      a generation's last block is committed after its end events, so a reply is out before its cache is
              written (a generation that may still be written again, turn.may_regenerate, commits first, as every
              other block does): with the next commit any lane runs (one forward), or at the round's end. In a batch
              whose other requests still denoise, with none waiting to join, it waits for their next commit instead
              of holding back their next forward; a request that joins has every such cache whole before it is
              admitted, and the core is idle only once none waits
    events    each request's events go to its sink as they come (and to its op-log); a request whose generation is
              over leaves at once (a turn may regenerate a malformed tool call first)

A failure in a round's forward or read is each of its lanes' own (an ErrorEvent; the slot's cache emptied); the
others go on. The forward is batch invariant, so a request gets the same tokens in any batch.
"""

from __future__ import annotations

import collections
import time

from ..errors import InputError
from ..events import BlockEvent, CancelledEvent, DoneEvent, ErrorEvent, StartEvent, StepEvent
from .lanes import commit_lanes, forward_lanes, lane_embeds, lane_masks, lane_plans, lane_stats, read_asks
from .request import DENOISE, DONE, PREFILL, Request, canvas_length
from .scheduler import Plan, Scheduler
from .steps import BlockRead, CommitAsk, EmbedAsk, ForwardAsk, StatusAsk
from .turn import Live, finish_generation, may_regenerate, open_generation, prefill_chunks, start_steps

READS = (StatusAsk, BlockRead, EmbedAsk, CommitAsk)  # the asks a round answers after its forward
COUNTED = ("started", "left", "failed", "forwards", "canvas_steps", "prefill_tokens")  # EngineCore.counts


def batch_size(model, max_batch: int | None) -> int | None:
    """The one check of a batch size: max_batch, a positive integer within what the model's forward takes (its
    `max_batch`: None for any number; a model without one takes a single canvas), or, when None, that."""
    if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
        raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
    cap = getattr(model, "max_batch", 1)
    if max_batch is None:
        return cap
    if cap is not None and max_batch > cap:
        raise InputError(f"max_batch {max_batch}: this model's forward takes at most {cap} canvas(es)")
    return max_batch


class EngineCore:
    """The requests of one model, stepped together. max_batch: requests stepped together (batch_size's rule; None:
    what the model takes). slots, prefill_chunk, busy_chunk, max_queue: the scheduler's (core/scheduler.py). trace:
    a list that gets (time, "prefill", request id, tokens) and (time, "forward", (request ids...)) for each
    operation, and (time, "block", request id, tokens) for each block a request ends, in order, or None."""

    def __init__(self, model, *, max_batch: int | None = 1, slots=None, prefill_chunk: int | None = None,
                 busy_chunk: int | None = None, max_queue: int | None = None, trace: list | None = None):
        self.model, self.trace = model, trace
        limit = batch_size(model, max_batch)
        self.scheduler = Scheduler(limit if limit is not None else 2**31, slots=slots, prefill_chunk=prefill_chunk,
                                   busy_chunk=busy_chunk, max_queue=max_queue)
        self.batched = limit is None or limit > 1  # lanes' asks answered together: no run-ahead, no lent scratch
        # what the rounds did (for /metrics): requests started / left / failed, forwards and the canvases they
        # stepped, prompt tokens prefilled. Every key is there from the start: /metrics copies this from another
        # thread, and a key added during the copy would break it.
        self.counts: collections.Counter = collections.Counter(dict.fromkeys(COUNTED, 0))
        self._last: list[tuple[Request, CommitAsk]] = []  # ended requests' last blocks, committed at the round's end

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and not self._last

    def add_request(self, request: Request) -> Request:
        """Queue `request`; its settings are resolved here, once: canvas_length None becomes the model's."""
        if request.settings.canvas_length is None:
            request.settings = request.settings.replace(canvas_length=canvas_length(self.model, request.settings))
        self.scheduler.add(request)
        return request

    def abort(self, request: Request) -> None:
        """Stop `request` at its next chance (Request.cancel)."""
        request.cancel()

    def run(self, requests: list[Request]) -> list:
        """Add `requests` and step until each is done -> their last events, in order."""
        for r in requests:
            self.add_request(r)
        while any(not r.done for r in requests):
            self.step()
        self._commit_last()
        return [r.end for r in requests]

    def step(self) -> Plan:
        """One round (see the module docstring) -> its plan. A KeyboardInterrupt (Ctrl-C) ends every running request
        with CancelledEvent(interrupted=True), its cache emptied, and is raised again."""
        try:
            if self.scheduler.waiting:  # a joining request may take an ended one's slot: every cache whole first
                self._commit_last()
            plan = self.scheduler.schedule()
            for r in plan.dropped:
                self._end(r, CancelledEvent())
            for r in plan.admitted:
                self._start(r)
            self._prefill(plan.prefill)
            for r in plan.withdrawn:
                self._cancel(r)
            lanes = [r for r in plan.denoise if r.phase == DENOISE and isinstance(r.run.ask, ForwardAsk)]
            if lanes:
                self._denoise(lanes)
            else:  # steps that ask a read before any forward (a step loop that runs its model itself) are read too
                self._read()
            if not self._last_may_wait():
                self._commit_last()
        except KeyboardInterrupt:
            for r in list(self.scheduler.running):
                self._interrupt(r)
            for r, _ in self._last:  # their caches may hold part of a write
                r.run.empty(r)
            self._last = []
            raise
        return plan

    def drop(self, request: Request) -> None:
        """Forget `request` at once, without an event (its consumer went away, e.g. a closed generate_stream)."""
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        if not request.done:
            self._end(request, None, log=False, emit=False)

    def fail_running(self, error: Exception) -> None:
        """End every running request with `error` (a bug in a round must not leave requests waiting forever)."""
        for r in list(self.scheduler.running):
            self._fail(r, error)

    # -- a round's parts ----------------------------------------------------------------------------------------

    def _start(self, r: Request) -> None:
        self.counts["started"] += 1
        r.run = Live(settings=r.settings, budget=r.settings.max_new_tokens)
        if r.turn:
            self._emit(r, StartEvent(cached_tokens=r.slot.cache.length, prefill_tokens=len(r.prompt)), log=False)
        if self._guard(r, open_generation, self.model, r, self._emit) and r.phase == DENOISE:
            self._begin(r)  # nothing to prefill: it steps in this round

    def _prefill(self, planned: list[tuple[Request, int]]) -> None:
        """The planned prompt chunks (request, how many), in waves: each takes the next chunk of every request with
        one left, and runs them together (_prefill_wave). Then each request whose prompt is in begins."""
        left = {id(r): n for r, n in planned}
        while True:
            wave = []
            for r, _ in planned:
                if not left[id(r)] or r.phase != PREFILL or not r.chunks:
                    continue
                self.counts["prefill_tokens"] += r.chunks[0]
                if self.trace is not None:
                    self.trace.append((time.perf_counter(), "prefill", r.id, r.chunks[0]))
                if r.run.chunks_done and r.cancelled:  # the client left while its prompt was prefilling
                    self._cancel(r)
                    continue
                left[id(r)] -= 1
                wave.append(r)
            if not wave:
                break
            self._prefill_wave(wave)
        for r, _ in planned:
            if r.phase == PREFILL and not r.chunks:
                self._begin(r)

    def _prefill_wave(self, wave: list[Request]) -> None:
        """One chunk of each request in `wave`: several in one call where the model has prefill_batch. That call
        checks every chunk before it writes anything, so an InputError there runs each chunk alone and fails only
        the request it names; any other failure is every one of theirs."""
        if len(wave) > 1 and hasattr(self.model, "prefill_batch"):
            try:
                prefill_chunks(self.model, wave)
                return
            except InputError:
                pass
            except Exception as e:
                for r in wave:
                    self._fail(r, e)
                return
        for r in wave:
            self._guard(r, prefill_chunks, self.model, [r])

    def _begin(self, r: Request) -> None:
        """The prompt is in: the generation's steps start and run to their first ask."""
        if self._guard(r, start_steps, self.model, r, self.batched):
            self._advance(r, None)

    def _denoise(self, lanes: list[Request]) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), "forward", tuple(r.id for r in lanes)))
        self.counts["forwards"] += 1
        self.counts["canvas_steps"] += len(lanes)
        asks = [r.run.ask for r in lanes]
        for r in lanes:
            r.run.ask = None
        try:
            sampled = lane_masks(asks, lane_stats(asks, forward_lanes(self.model, asks)))
        except Exception as e:  # a failed forward: each lane's own failure
            for r in lanes:
                self._fail(r, e)
            return
        del asks
        for r, s in zip(lanes, sampled):
            self._advance(r, s)
        del sampled  # each request holds its own stats until its status is read
        self._read()

    def _read(self) -> None:
        """Answer every request parked at an EmbedAsk (their SC embeddings summed together, queued first) or a
        CommitAsk (their blocks committed together), then every one parked at a StatusAsk (their sparse-SC plans made
        together) or a BlockRead with one host wait, and run each on; again while any asks anew (a request runs from
        its status to its EmbedAsk, or at a block's end to its BlockRead, then its CommitAsk)."""
        while parked := [r for r in self.scheduler.running if isinstance(r.run.ask, READS)]:
            embeds = [r for r in parked if isinstance(r.run.ask, EmbedAsk)]
            commits = [r for r in parked if isinstance(r.run.ask, CommitAsk)]
            if embeds or commits:
                if embeds:
                    self._answer(embeds, lambda asks: lane_embeds(self.model, asks))
                now = []
                for r in commits:
                    if r.run.ask.last and not may_regenerate(r):  # committed by _commit_last, after its end events
                        self._last.append((r, r.run.ask))
                        r.run.ask = None
                        self._advance(r, None)
                    else:
                        now.append(r)
                if now:
                    self._answer(now, self._commit_with_last)
                continue
            self._answer(parked, self._read_asks)

    def _last_may_wait(self) -> bool:
        """Whether the last blocks not yet committed may wait past this round: in a batch whose other requests still
        denoise, with no request waiting to join, they go with the next commit any lane runs, rather than hold back
        every other lane's next forward."""
        return self.batched and not self.scheduler.waiting and any(r.phase == DENOISE for r in self.scheduler.running)

    def _commit_last(self) -> None:
        """Commit the last blocks not yet committed, together (lanes.commit_lanes)."""
        if self._last:
            self._commit_with_last([])

    def _commit_with_last(self, asks: list[CommitAsk]) -> list:
        """The lanes' block commits `asks` and every last block not yet committed, in one commit_lanes -> asks'
        answers. The last blocks' requests have had their end events: a failure empties their caches (the next turn on
        a slot prefills it whole) and is raised."""
        last, self._last = self._last, []
        try:
            return commit_lanes(self.model, asks + [ask for _, ask in last])[:len(asks)]
        except Exception:
            for r, _ in last:
                r.run.empty(r)
            raise

    def _read_asks(self, asks: list) -> list:
        lane_plans(asks, lend=not self.batched)
        # a core of one request reads on its own denoiser, which may stage its next forward as it reads
        return read_asks(asks) if self.batched else [ask.run() for ask in asks]

    def _answer(self, parked: list[Request], answer) -> None:
        """Take the parked requests' asks, answer them together (answer(asks) -> one answer each) and run each request
        on with its answer; a failure is each of theirs."""
        asks = [r.run.ask for r in parked]
        for r in parked:
            r.run.ask = None
        try:
            answers = answer(asks)
        except Exception as e:
            for r in parked:
                self._fail(r, e)
            return
        del asks
        for r, a in zip(parked, answers):
            self._advance(r, a)

    # -- one request --------------------------------------------------------------------------------------------

    def _advance(self, r: Request, answer) -> None:
        """Run request r's steps on with `answer` to its next ask (parked in r.run.ask), handling the events on the
        way; its generation's end finishes it (or, in a turn, may open the next generation)."""
        try:
            while True:
                item = r.run.steps.send(answer)
                answer = None
                if isinstance(item, (ForwardAsk, *READS)):
                    r.run.ask = item
                    return
                if isinstance(item, DoneEvent):
                    self._generation_done(r, item)
                    return
                self._on_step_event(r, item)
                if r.cancelled:
                    return self._cancel(r)
        except Exception as e:
            self._fail(r, e)

    def _on_step_event(self, r: Request, event) -> None:
        if isinstance(event, StepEvent):
            r.step += 1
        elif isinstance(event, BlockEvent):
            r.block += 1
            r.run.tokens += list(event.tokens)
            r.tokens = r.run.kept_reply + r.run.tokens
            self.scheduler.block_ended = True
            if self.trace is not None:
                self.trace.append((time.perf_counter(), "block", r.id, len(event.tokens)))
        self._emit(r, event)

    def _generation_done(self, r: Request, event: DoneEvent) -> None:
        end = finish_generation(self.model, r, event, self._emit)
        if end is None:  # a turn regenerates a malformed tool call: the new generation's prompt is next
            if r.phase == DENOISE:
                self._begin(r)
            return
        self._end(r, end, log=False)

    def _cancel(self, r: Request) -> None:
        if r.interrupted:
            return self._interrupt(r)
        kept = r.run.rewind_to_prompt(r) if r.run is not None else None
        self._end(r, CancelledEvent(blocks=r.block, kept=kept))

    def _interrupt(self, r: Request) -> None:
        if r.run is not None:
            r.run.empty(r)
        self._end(r, CancelledEvent(blocks=r.block, kept=0, interrupted=True))

    def _fail(self, r: Request, error: Exception) -> None:
        if r.done:
            return
        self.counts["failed"] += 1
        if r.run is not None:
            r.run.empty(r)
        self._end(r, ErrorEvent(error))

    def _guard(self, r: Request, fn, *args) -> bool:
        """fn(*args); a failure is the request's own (_fail) -> whether it went through."""
        try:
            fn(*args)
            return True
        except Exception as e:
            self._fail(r, e)
            return False

    def _emit(self, r: Request, event, log: bool = True) -> None:
        """Hand `event` to r's sink; a generation's event is journaled first (op-log) where it is logged."""
        if log and r.log is not None and r.run is not None:
            from ..oplog import event_record

            if (record := event_record(r.run.gen, event)) is not None:
                r.log.write(record)
        r.sink(event)

    def _end(self, r: Request, event, log: bool = True, emit: bool = True) -> None:
        """The request is over with `event` (journaled with `log`, then to its sink)."""
        if r.done:
            return
        if r.run is not None and r.run.steps is not None:
            r.run.steps.close()
            r.run.steps = None
        r.phase, r.end = DONE, event
        if r in self.scheduler.running:
            self.counts["left"] += 1
        self.scheduler.leave(r)
        if emit:
            self._emit(r, event, log=log and r.run is not None)
