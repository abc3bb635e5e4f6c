"""Which requests run, and what each does in the next round: admission, the prefill budget, the batch cap, cancel
(docs/ARCHITECTURE.md, 'Continuous batching'). The scheduler only decides; the engine core (core/engine.py) runs
its plan. A round:

    drop     waiting requests cancelled before they started
    admit    waiting requests join, in arrival order, while fewer than max_batch run and the slots give one a slot
             (slots.SlotPool: the slot sharing the longest prefix; a request that brings its own slot needs none)
    prefill  a prompt that fits in one chunk takes it in the round it joins, so a burst of them starts denoising
             together; longer prompts take chunks in join order, up to prefill_chunk tokens a round (at least one
             chunk): a long prompt is spread over rounds, so the running streams keep stepping. While some request
             denoises, that budget is busy_chunk tokens (and a prompt of over two chunks that joins then prefills in
             chunks of that size), and a round right after one in which a request ended a block (its commit ran
             then) prefills nothing, so no step waits for a commit and a chunk; never two such rounds in a row.
             Without a prefill budget (one request at a time: generate, Session, replay) each prompt takes one chunk
             a round.
    denoise  every running request past its prompt steps, in one batched forward; a cancelled one is withdrawn

The plan is plain data (`Plan`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .request import DENOISE, PREFILL, Request


@dataclass
class Plan:
    dropped: list[Request] = field(default_factory=list)  # waiting requests cancelled before they started
    admitted: list[Request] = field(default_factory=list)  # join now, in this order (their slots taken)
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt chunks it prefills now)
    withdrawn: list[Request] = field(default_factory=list)  # cancelled past their prompt: stop before the step
    denoise: list[Request] = field(default_factory=list)  # step in this round's forward (their prompt in by then)

    @property
    def empty(self) -> bool:
        return not (self.dropped or self.admitted or self.prefill or self.withdrawn or self.denoise)


def prompt_chunks(prompt, chunk: int | None) -> list[int]:
    """The sizes of a prompt's prefill chunks: the text after its last image (an image's part is prefilled in one
    call when the request starts: vision/prompt.prefill_images), split into chunks of `chunk` tokens (None: one)."""
    if isinstance(prompt, torch.Tensor):  # plain ids (core/request.as_ids checks them)
        n = prompt.numel()
    else:
        last = max((i for i, t in enumerate(prompt) if t < 0), default=-1)
        n = len(prompt) - last - 1
    if n == 0:
        return []
    if chunk is None or n <= chunk:
        return [n]
    return [min(chunk, n - i) for i in range(0, n, chunk)]


class Scheduler:
    """The waiting and running requests and the round's plan. max_batch: requests stepped together. slots: where a
    request without a slot gets one (slots.SlotPool or slots.CachePool: take(request) -> bool, give(request)), or
    None. prefill_chunk / busy_chunk: the prefill budget idle / while some request denoises (tokens a round; None:
    one chunk per prompt a round); prefill_chunk is also the chunk of a prompt that joins (busy_chunk for a long one
    joining while others denoise). max_queue: requests that may wait beyond those that could start now (None: no
    bound)."""

    def __init__(self, max_batch: int, *, slots=None, prefill_chunk: int | None = None,
                 busy_chunk: int | None = None, max_queue: int | None = None):
        self.max_batch, self.slots, self.max_queue = max_batch, slots, max_queue
        self.prefill_chunk = prefill_chunk
        self.busy_chunk = prefill_chunk if busy_chunk is None or prefill_chunk is None else min(busy_chunk,
                                                                                             prefill_chunk)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.block_ended = False  # a request ended a block in the last round (the core says so)
        self._held = False  # the last round's prefill was held back for that

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def busy(self) -> bool:
        """Whether some running request is past its prompt (it denoises each round)."""
        return any(r.phase == DENOISE for r in self.running)

    def capacity(self) -> int:
        """How many requests may run at once: max_batch, within the slots' count where they are fixed."""
        count = len(getattr(self.slots, "slots", ())) or self.max_batch
        return min(self.max_batch, count)

    def has_room(self, queued: int) -> bool:
        """Whether one more request may queue behind `queued` live waiting ones (the queue bound)."""
        if self.max_queue is None:
            return True
        return queued < self.max_queue + max(0, self.capacity() - len(self.running))

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def leave(self, request: Request) -> None:
        """A running request is done: its slot goes back."""
        if request in self.running:
            self.running.remove(request)
            if request.pooled:
                self.slots.give(request)

    def schedule(self) -> Plan:
        plan = Plan()
        for r in [r for r in self.waiting if r.cancelled]:  # left while it waited
            self.waiting.remove(r)
            plan.dropped.append(r)
        self._admit(plan)
        self._plan_prefill(plan)
        for r in self.running:
            if r.phase == DENOISE and r.cancelled:
                plan.withdrawn.append(r)
        joining = {id(r) for r, n in plan.prefill if n == len(r.chunks)}
        plan.denoise = [r for r in self.running if r not in plan.withdrawn
                        and (r.phase == DENOISE or id(r) in joining or (r in plan.admitted and not r.chunks))]
        return plan

    def _admit(self, plan: Plan) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            pooled = r.slot is None
            if pooled and (self.slots is None or not self.slots.take(r)):
                return  # every slot serves a running request
            self.waiting.popleft()
            if self.prefill_chunk is not None:
                # a long prompt (over two whole chunks) joining running streams prefills in busy chunks: its late
                # chunks read a long context, and each stalls every stream. The chunk is fixed for the turn.
                long = len(r.prompt) > 2 * self.prefill_chunk
                r.prefill_chunk = self.busy_chunk if self.busy and long else self.prefill_chunk
            r.chunks = prompt_chunks(r.prompt, r.prefill_chunk)
            r.one_chunk = len(r.prompt) <= (r.prefill_chunk or len(r.prompt))
            r.pooled = pooled
            r.phase = PREFILL
            self.running.append(r)
            plan.admitted.append(r)

    def _plan_prefill(self, plan: Plan) -> None:
        prefilling = [r for r in self.running if r.phase == PREFILL and r.chunks]
        busy, ended = self.busy, self.block_ended
        self.block_ended = False
        if busy and ended and not self._held and prefilling:
            self._held = True  # the block's commit already lengthens this round's step
            return
        self._held = False
        if self.prefill_chunk is None:  # one request at a time: a chunk a round
            plan.prefill = [(r, 1) for r in prefilling]
            return
        budget = self.busy_chunk if busy else self.prefill_chunk
        for r in prefilling:  # in join order
            n = 0
            while n < len(r.chunks) and (budget > 0 or r.one_chunk):
                if not r.one_chunk:  # a one-chunk prompt is outside the budget: its stall is bounded by max_batch
                    budget -= r.chunks[n]
                n += 1
            if n:
                plan.prefill.append((r, n))
