"""How a denoise step meets the device: the forward call, the side stream, the one status read, the run-ahead.

core/steps.py says what a step computes; a Denoiser (model/protocol.py) says how it reaches the GPU:

  forward(canvas, sc)     the model's denoise -> logits (raw, with `cap` the softcap the sampler applies, or capped)
  bookkeeping()           a context for the step's small kernels (accept mask, renoise, stop rules): on CUDA a
                          second stream, so they run beside the sparse SC's pass over the logits (joined by the
                          status read)
  read_status(...)        THE per-step device->host read (stop code, mean entropy, survivor count), packed and copied
                          on the side stream while the main stream makes the SC product the step bet on; on an engine
                          with graphs the next forward's inputs are staged (and the forward launched, under the
                          device's own go flag) before the host waits
  close()                 the end of a canvas: forget what was staged

read_statuses(asks) reads several requests' statuses (each on its own one-cache denoiser, none running ahead) with one
host wait: every status queued first, then one wait for all (docs/ARCHITECTURE.md, 'Batching').

`Denoiser` serves any model (the reference on the CPU or CUDA); `StagedDenoiser` adds the engine's staging
(Engine.stage_denoise). Both make the same tokens; only when work is queued differs (docs/ARCHITECTURE.md, 'Overlap').
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass
class StepStatus:
    """What the host learns of a step: its stop code, the canvas' mean entropy, the sparse SC's survivor count (when
    a plan was made) and whether the device ran the next forward ahead (when it could)."""

    code: int
    mean_entropy: float
    count: int | None = None
    go: bool | None = None


class SideStream:
    """A second CUDA stream for the step's bookkeeping and its status read.

    `fork()` starts a side segment after everything queued so far on the main stream; `join()` makes the main
    stream wait for it. Every side segment opens after the main stream's latest work and the main stream joins
    it before using its results, so a tensor the side allocates is never reused while the main stream may
    still read it (the allocator's per-stream reuse is ordered by those waits). Off CUDA both are no-ops.

    The other way round needs care: a tensor the main stream allocated, read by a side segment and then dropped
    by the host, goes back to the main stream's pool while that read may still be queued, and the main stream's
    next allocation may overwrite it first. So what the side reads and replaces step by step is born on the side
    stream (the canvas, the freeze mask), the canvas RNG moves its state in place (sampling/rng.DeviceLcg), and
    the main stream's own tensors the side reads (entropy, argmax, row counts) live until after the join."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None

    def fork(self):
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


@dataclass
class PendingStatus:
    """A status read queued and not waited for yet (queue_status): the packed values, in pinned host memory with their
    copy queued on the side stream (`copied`: the CUDA event after it), or where make_status() made them (no side
    stream: the CPU)."""

    values: torch.Tensor
    copied: torch.cuda.Event | None = None


def queue_status(make_status, side: SideStream | None = None) -> PendingStatus:
    """The queue half of a status read: pack the status (make_status()) and, on CUDA, copy it to pinned memory on
    `side`, after the current stream's work so far; nothing waits."""
    if side is None or side.stream is None:
        return PendingStatus(make_status())
    with side.fork():
        return queue_copy(make_status())


def queue_copy(values: torch.Tensor) -> PendingStatus:
    """The queue half of a plain read (a status packed on the side stream, a block's values): on CUDA a copy to pinned
    memory queued on the current stream after its work so far, which wait_statuses completes; elsewhere the values
    themselves."""
    if not values.is_cuda:
        return PendingStatus(values)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return PendingStatus(host, copied)


def release_status(side: SideStream | None = None, overlap=None, then=None) -> None:
    """Between the queue half and the wait: queue `overlap` (the SC product) on the current stream, not behind the
    status copy, join `side` (the bookkeeping's results are the main stream's from here), then call `then`."""
    if overlap is not None:
        overlap()
    if side is not None:
        side.join()
    if then is not None:
        then()


def wait_statuses(pending: list[PendingStatus]) -> list[list[float]]:
    """The wait half: the host blocks once, until every queued status' copy has landed (the GPU goes on with what was
    queued after them) -> each status' values, in order."""
    for p in pending:
        if p.copied is not None:
            p.copied.synchronize()
    return [p.values.tolist() for p in pending]


def read_status(make_status, overlap=None, side: SideStream | None = None, then=None) -> list[float]:
    """The step's one device->host read of the few float64 numbers `make_status()` packs: queue_status,
    release_status, wait_statuses for one.

    overlap: queues more device work (the SC product) on the current stream. On CUDA the status is packed and copied
    on `side`, after the current stream's work so far but not behind the overlap: the product starts as soon as its
    inputs are ready, and the host waits for the copy alone while the GPU runs the product. then: called after the
    side stream is joined and before the wait (staging the next forward)."""
    pending = queue_status(make_status, side)
    release_status(side, overlap, then)
    return wait_statuses([pending])[0]


def read_statuses(asks) -> list[StepStatus]:
    """Several requests' status reads (each ask: a step's `den`, `code`, `mean_h`, `plan`, `canvas` and `run()`, e.g.
    core/steps.StatusAsk) with one host wait: every request's status is packed and copied first, then every speculative
    plan's SC product is started and each side stream joined, then the host waits once for all copies. Each request
    gets the StepStatus its own `den.read_status` would give. A request whose denoiser runs ahead (a request stepping
    alone on the engine) or is not a Denoiser reads through its own `run()` (docs/ARCHITECTURE.md, 'Batching')."""
    out: list = [None] * len(asks)
    lanes = []
    for k, ask in enumerate(asks):
        if isinstance(ask.den, Denoiser) and not ask.den.run_ahead:
            lanes.append(k)
        else:
            out[k] = ask.run()
    jobs = [asks[k].den._status_job(asks[k].code, asks[k].mean_h, asks[k].plan) for k in lanes]
    pending = [queue_status(make_status, asks[k].den.side) for k, (make_status, _) in zip(lanes, jobs)]
    for k, (_, overlap) in zip(lanes, jobs):
        release_status(asks[k].den.side, overlap)
    for k, values in zip(lanes, wait_statuses(pending)):
        out[k] = _step_status(values, asks[k].plan)
    return out


def _step_status(values: list[float], plan) -> StepStatus:
    """The status' numbers; the plan learns its count as read (a batch's gather ahead checks its size by them)."""
    if plan is not None:
        plan.read = int(values[2])
    return StepStatus(int(values[0]), values[1], int(values[2]) if plan is not None else None)


class Denoiser:
    """The step's device side for one cache, or for a batch of caches, on any model (model/protocol.DenoiseModel):
    `model.denoise` (one cache) or `model.denoise_batch` (several; the reference model), softcapped logits, the side
    stream on CUDA. With several caches only forward() is batched: each request's bookkeeping and status read go
    through its own one-cache denoiser (core/steps.generate_steps), the reads of a batch's requests together
    (read_statuses; docs/ARCHITECTURE.md, 'Batching')."""

    cap = None  # the logits forward() returns are softcapped already
    run_ahead = False  # whether read_status may stage the next forward (SparsePlan's sparse_ahead follows it)

    def __init__(self, model, caches):
        self.caches = list(caches) if isinstance(caches, (list, tuple)) else [caches]
        if not self.caches:
            raise InputError("denoiser: expected at least one cache")
        self.model = model
        self.cache = self.caches[0] if len(self.caches) == 1 else None
        self.side = SideStream(torch.device(model.embedding.device))

    def forward(self, canvas, sc_logits=None, sc_embeds=None):
        """One cache: canvas [C] ids -> logits [C, V]. B caches: canvas [B, C] (-> [B, C, V]) or B 1-D canvases of
        any lengths (-> a list of B [C_i, V]); sc_logits / sc_embeds None or B entries, each None or that request's."""
        if self.cache is not None:
            return self.model.denoise(self.cache, canvas, sc_logits=sc_logits, sc_embeds=sc_embeds)
        logits = self.model.denoise_batch(self.caches, canvas, sc_logits=sc_logits, sc_embeds=sc_embeds)
        return torch.stack(logits) if isinstance(canvas, torch.Tensor) else logits

    @contextlib.contextmanager
    def bookkeeping(self, join: bool = False):
        """The step's small kernels on the side stream (CUDA), beside what the main stream queues after the block:
        the main stream joins them in read_status, before anything reads their results. join=True: at once (a new
        canvas, which the first forward reads)."""
        with self.side.fork():
            yield
        if join:
            self.side.join()

    def scratch(self) -> torch.Tensor | None:
        """A dead [C, V] buffer the dense SC may write its probabilities into, or None."""
        return None

    def read_status(self, code: torch.Tensor, mean_h: torch.Tensor, plan, canvas: torch.Tensor) -> StepStatus:
        """The step's one host read. plan: the step's SparsePlan or None; a speculative plan's SC sum is started
        beside the read. canvas: the next step's canvas."""
        make_status, overlap = self._status_job(code, mean_h, plan)
        return _step_status(read_status(make_status, overlap, self.side), plan)

    def _status_job(self, code: torch.Tensor, mean_h: torch.Tensor, plan):
        """The read's device work: (make_status, which packs [code, mean entropy(, survivor count)] on the side
        stream, where the bookkeeping left code and mean_h; overlap, which starts a speculative plan's SC sum, or
        None)."""
        def make_status():
            return torch.stack([code.double(), mean_h] + ([plan.count.double()] if plan is not None else []))

        overlap = None
        if plan is not None and plan.speculative:
            embedding, scale = self.model.embedding, self.model.config.embed_scale
            overlap = lambda: plan.start(embedding, scale)  # noqa: E731
        return make_status, overlap

    def close(self) -> None:
        pass


class StagedDenoiser(Denoiser):
    """The engine's step (model/engine.Engine): raw logits (`cap` for the sampler to apply), the dead graph output as
    the dense SC's scratch, and the run-ahead: when the step bet on its SC sum (SparsePlan.speculative), the next
    forward's inputs go into its graph before the status read and, with guarded graphs, the forward itself is launched
    under the device's answer to "no stop, and the bet holds". The GPU then goes from the step's SC work straight into
    the next forward, however long the host takes to turn the step around."""

    def __init__(self, engine, cache):
        super().__init__(engine, cache)
        opts = engine.options
        self.raw = opts.softcap_in_sampler
        self.cap = engine.logit_softcap if self.raw else None
        self.run_ahead = opts.run_ahead
        self._launched = None  # (go as read, the SC input the launched forward took) after a launch ahead

    def forward(self, canvas, sc_logits=None, sc_embeds=None):
        if self._launched is not None:
            go, staged_sc = self._launched
            self._launched = None
            if go != (sc_logits is None and sc_embeds is staged_sc):
                self._disagree(go)
        call = self.model.denoise_raw if self.raw else self.model.denoise
        return call(self.cache, canvas, sc_logits=sc_logits, sc_embeds=sc_embeds)

    def scratch(self):
        return self.model.logits_scratch()

    def read_status(self, code, mean_h, plan, canvas):
        if plan is None or not plan.speculative:
            return super().read_status(code, mean_h, plan, canvas)
        engine, hidden = self.model, self.model.config.hidden_size
        go, launched = None, False

        def make_status():  # on the side stream, where the bookkeeping left code and mean_h
            nonlocal go
            parts = [code.double(), mean_h, plan.count.double()]
            if self.run_ahead:  # the device's own answer to "the next forward is the staged one": no stop, bet holds
                go = (code == 0) & plan.bet_holds(plan.count, hidden)
                parts.append(go.double())
            return torch.stack(parts)

        def stage_next():  # the next forward's inputs into its graph now, and with `go` the forward itself
            nonlocal launched
            if plan.product is not None:
                launched = engine.stage_denoise(self.cache, canvas, sc_embeds=plan.product, go=go) and go is not None

        status = read_status(make_status, lambda: plan.start(engine.embedding, engine.config.embed_scale), self.side,
                             stage_next)
        out = StepStatus(int(status[0]), status[1], int(status[2]), bool(status[3]) if go is not None else None)
        if launched:
            self._launched = (out.go, plan.product)
        return out

    def close(self):
        if self._launched is not None and self._launched[0]:
            self._disagree(True)
        self._launched = None
        self.model.drop_staged()  # a forward staged (or launched and skipped) at the last step is never called for

    @staticmethod
    def _disagree(go):
        # the next call would take (or drop) a forward the GPU skipped (or ran): never silently
        raise RuntimeError(f"generate: the device's run-ahead condition (go={go}) disagrees with the host's reading "
                           "of the same status")


class BatchDenoiser(Denoiser):
    """The engine's batched forward over several caches (Engine.denoise_batch): each lane's logits in the form its own
    request's StagedDenoiser hands the sampler (raw with options.softcap_in_sampler). Only forward() is batched; each
    request's bookkeeping and status read stay on its own one-cache denoiser, the status reads joined in one host wait
    (read_statuses; docs/ARCHITECTURE.md, 'Batching')."""

    def __init__(self, engine, caches):
        super().__init__(engine, caches)
        if len(self.caches) > engine.max_batch:
            raise InputError(f"denoiser: {len(self.caches)} caches exceed this engine's max_batch ({engine.max_batch})")
        if len({id(c) for c in self.caches}) != len(self.caches):
            raise InputError("denoiser: a cache appears twice; each lane needs its own cache")
        self.raw = engine.options.softcap_in_sampler
        self.cap = engine.logit_softcap if self.raw else None

    def forward(self, canvas, sc_logits=None, sc_embeds=None):
        call = self.model.denoise_batch_raw if self.raw else self.model.denoise_batch
        logits = call(self.caches, list(canvas), sc_logits=sc_logits, sc_embeds=sc_embeds)
        return torch.stack(logits) if isinstance(canvas, torch.Tensor) else logits
