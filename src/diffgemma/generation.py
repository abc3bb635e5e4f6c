"""diffgemma.generate: the entropy-bound denoising loop and block chaining (docs/ARCHITECTURE.md, 'Generation contract').

One call = prefill the prompt, then propose / commit blocks until a stop token, the token budget, or
the block budget ends the turn:

    for each block:                                     (canvas at positions cache.length ..)
        canvas = uniform random ids                     (seeded LCG)
        for step 1..max_denoising_steps:
            logits = forward(canvas, SC)                (SC: first-step seed, then the previous step's logits)
            T = schedule(step);  H, argmax = stats(logits / T)
            accept the lowest-entropy prefix (bound in nats); renoise every other position
            stop? confident / plateau / entropy-only / max steps (pad gate: never on all-pad)
        committed = argmax of the last executed step
        first block opening with a stop/control id -> re-roll with a halved canvas (<= 3 times)
        cut at a stop id (end of turn), at the token budget, or at the confidence trim
        prefill the kept tokens into the cache

The loop calls the model only through model/protocol.DenoiseModel, and a step's forward, side stream and status read
through the model's Denoiser (model/denoiser.py): how the step meets the GPU lives there, what it computes here.
It is written once, as one request's coroutine (`generate_steps`) that yields a `Forward` where a step needs the
model and a `Status` where it reads its status: generate_stream answers both on the request's own denoiser,
batch.generate_batch each in one forward, and one status wait, with other requests (docs/ARCHITECTURE.md, 'Batching').

Cache contract (multi-turn reuse): on return a caller's cache holds the prompt plus exactly the returned
`tokens` (without a caller's cache the last block is not committed: no one reads it). The stop token that ended
the turn is NOT in `tokens` and NOT in the cache (it is reported as `stop_token`); the chat layer appends the
template's own end-of-turn text as part of the next turn's new tokens. When a cache is passed in, `input_ids` are only the tokens it does not hold yet.

Stop strings (settings.stop_strings, stop_strings.py): after each block the decoded reply is searched; at a match
the block keeps its tokens through the one completing it and the turn ends (`stop_string`). Those tokens stay in
`tokens` and in the cache (the model wrote them); `text` ends where the match begins.

RNG layout: with semantics="contract" every (block, re-roll attempt) gets its own LCG seeded with
block_seed(seed, block, attempt); with semantics="hf" one LCG(seed) stream serves the whole call in transformers'
order (canvas init, then per step: categorical draw (commit="sample" only) and renoise of the full canvas). Both
are deterministic across processes.

Host syncs: a denoise step does all its sampler work on the model's device (row stats, accept mask, LCG renoise,
stop rules, the sparse-SC survivor count) and the host reads ONE small status per step (Denoiser.read_status: stop
code, mean entropy, survivor count). Block-level work (the degenerate-opening check, the stop scan, the trim, the
prefill of the kept tokens) reads the block's result once per attempt: a `BlockRead` asked of the driver, which reads
the blocks of a batch's requests with one host wait.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

import torch

from .errors import InputError
from .model.protocol import DenoiseModel
from .ops.attention_topk import TopKRule
from .sampling.accept import accept_mask
from .sampling.constraint import GrammarState
from .sampling.rng import DeviceLcg, block_seed, categorical
from .sampling.schedule import remaining, temperature_value
from .sampling.self_condition import SparsePlan
from .sampling.stats import StepStats
from .sampling.stops import REASONS, DeviceStopRules, filler_id
from .sampling.trim import trim_cut
from .settings import GenerationSettings
from .stop_strings import text_end, tokens_through_stop

STOP_TOKEN = "stop_token"  # BlockEvent.end: the block held a stop id; the turn is over
BUDGET = "max_new_tokens"  # the token budget is spent
TRIMMED = "trimmed"  # the confidence trim cut the block; the tail re-denoises next block
STOP_STRING = "stop_string"  # the reply holds a stop text; the block was cut after it and the turn is over
GRAMMAR_CUT = "grammar_cut"  # the grammar refused a token of the block: it was cut there; the tail re-denoises next
CONTINUE = "continue"  # a full block was committed; the next block follows


# The events this loop yields live in events.py (one vocabulary for every layer); importable from here too.
from .events import BlockEvent, DoneEvent, GenerationResult, StepEvent  # noqa: E402


@dataclass
class _Proposal:
    committed: torch.Tensor  # [C] ids (device)
    argmax: torch.Tensor  # [C] last step's argmax (device)
    p_max: torch.Tensor | None  # [C] last step's max prob (tempered); None when the trim is off
    steps: int
    stop_reason: str


def resolve_settings(model: DenoiseModel, settings: GenerationSettings | None,
                     overrides: dict[str, Any]) -> GenerationSettings:
    """Explicit settings (+ per-call overrides), or the model's generation_config <- env <- overrides."""
    if settings is None:
        return GenerationSettings.resolve(model.generation_config or {}, env=os.environ,
                                          overrides=overrides)
    return settings.replace(**overrides) if overrides else settings


def generate(
    model: DenoiseModel,
    input_ids,
    *,
    settings: GenerationSettings | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
    on_block: Callable[[BlockEvent], None] | None = None,
    cache=None,
    **overrides: Any,
) -> GenerationResult:
    """Generate an answer for `input_ids` (LongTensor [T] or list of ids); see the module docstring."""
    for event in generate_stream(model, input_ids, settings=settings, cache=cache, **overrides):
        if isinstance(event, StepEvent):
            if on_step is not None:
                on_step(event)
        elif isinstance(event, BlockEvent):
            if on_block is not None:
                on_block(event)
        else:
            return event.result
    raise AssertionError("generate_stream ended without a DoneEvent")  # pragma: no cover


def generate_stream(
    model: DenoiseModel,
    input_ids,
    *,
    settings: GenerationSettings | None = None,
    cache=None,
    **overrides: Any,
) -> Iterator[StepEvent | BlockEvent | DoneEvent]:
    """The same loop as generate(), as an iterator of StepEvent, BlockEvent and a final DoneEvent: the request's
    steps (generate_steps) with each forward it asks for run on its own denoiser."""
    steps = generate_steps(model, input_ids, settings=settings, cache=cache, **overrides)
    try:
        answer = None
        while True:
            try:
                item = steps.send(answer)
            except StopIteration:
                return
            answer = None  # one [C, V] f32 alive at a time: the request dropped its last step's before asking
            if isinstance(item, (Forward, Status, BlockRead)):
                answer = item.run()
            else:
                yield item
    finally:
        steps.close()


@dataclass
class Forward:
    """A request's ask for one denoise forward, yielded by generate_steps and answered with send(logits): by
    generate_stream on the request's own denoiser (run()), or by the batch scheduler (batch.py) in one forward with
    other requests' canvases (model.denoiser([cache, ...]))."""

    den: Any  # the request's Denoiser (model/protocol.Denoiser): its bookkeeping and status read follow the answer
    cache: Any
    canvas: torch.Tensor  # [C] ids
    sc_logits: torch.Tensor | None
    sc_embeds: torch.Tensor | None

    def run(self) -> torch.Tensor:
        return self.den.forward(self.canvas, sc_logits=self.sc_logits, sc_embeds=self.sc_embeds)


@dataclass
class Status:
    """A request's ask for its step's one host read, yielded by generate_steps after the step's device work and answered
    with send(StepStatus): by generate_stream on the request's own denoiser (run()), or by a batch driver together
    with other requests' in one host wait (batch.read_asks, through model/denoiser.read_statuses)."""

    den: Any  # the request's Denoiser
    code: torch.Tensor  # the stop rules' device code
    mean_h: torch.Tensor  # the canvas' mean entropy (f64 device scalar)
    plan: Any  # the step's SparsePlan, or None
    canvas: torch.Tensor  # the next step's canvas

    def run(self):
        return self.den.read_status(self.code, self.mean_h, self.plan, self.canvas)


@dataclass
class BlockRead:
    """A request's ask for its block's one host read, yielded by generate_steps when an attempt's steps are done and
    answered with send(the values): the proposal packed as float64, [committed ids | argmax ids | max probs]. By
    generate_stream at once (run()), or by a batch driver with the other requests' reads of the round in one host
    wait (batch.read_asks), so that no request's read waits for the commit another request queued before it."""

    packed: torch.Tensor

    def run(self) -> list[float]:
        return self.packed.tolist()


def cache_need(model: DenoiseModel, prompt_tokens: int, s: GenerationSettings) -> int:
    """The tokens a cache made for one generation holds: the prompt, the reply's budget and a canvas, never past the
    model's context (config.check_context; an overflow is an error)."""
    need = prompt_tokens + s.max_new_tokens + (s.canvas_length or model.config.canvas_length)
    limit = getattr(model.config, "max_positions", None)
    return need if limit is None else min(need, limit)


def generate_steps(
    model: DenoiseModel,
    input_ids,
    *,
    settings: GenerationSettings | None = None,
    cache=None,
    batched: bool = False,
    scratch_cache: bool = False,
    **overrides: Any,
) -> Generator[StepEvent | BlockEvent | DoneEvent | Forward | Status | BlockRead, Any, None]:
    """One request's generation as a coroutine: it yields StepEvent, BlockEvent, a final DoneEvent and, where a step
    needs the model, a Forward, which the driver answers by send()ing that forward's logits ([C, V], as the request's
    denoiser returns them), then a Status, answered with the step's StepStatus (Status.run(), or several requests'
    with one host wait: batch.read_asks); after a block attempt's last step a BlockRead, answered with the block's
    values (BlockRead.run(), or with the round's other reads). Everything else of the algorithm (sampler, SC, stop
    rules, re-rolls, commits, the cache) is the request's own, so one request gives the same tokens alone
    (generate_stream) or batched (batch.py).
    batched: a scheduler may answer its forwards and status reads together with other requests' (batch.py, the
    server): the step then neither runs its next forward ahead nor lends the model's logits scratch, which are one
    request's devices. scratch_cache: `cache` (empty, with room for cache_need's tokens) stands in for the one this call
    would make, so, like that one, it does not get the last block's commit (batch.py lends pooled caches so)."""
    s = resolve_settings(model, settings, overrides)
    cfg = model.config
    vocab = cfg.vocab_size
    device = model.embedding.device
    prompt = _as_ids(input_ids, vocab, device)
    canvas_len = s.canvas_length or cfg.canvas_length
    stop_ids = tuple(s.stop_ids) if s.stop_ids is not None else tuple(cfg.eos_token_ids)
    # a first block opening with one of these is the empty-reply attractor (the re-roll guard)
    control_ids = set(stop_ids) | {cfg.pad_token_id, filler_id(vocab)}
    if cfg.bos_token_id is not None:
        control_ids.add(cfg.bos_token_id)
    hf = s.semantics == "hf"
    tokenizer = model.tokenizer
    if s.stop_strings and tokenizer is None:
        raise InputError("stop_strings: this model has no tokenizer to decode the reply with")
    grammar = GrammarState(s.grammar, tokenizer, vocab, stop_ids, s.grammar_fixes) if s.grammar else None
    # the trim can shorten blocks, so it gets twice the block budget; a grammar's cut keeps one token at least
    max_blocks = math.ceil(s.max_new_tokens / canvas_len) * (2 if s.confidence_trim > 0 else 1)
    if grammar is not None:
        max_blocks = max(max_blocks, s.max_new_tokens)

    t_start = time.perf_counter()
    timings = {"prefill_s": 0.0, "denoise_s": 0.0}
    # a caller's cache gets every kept token; our own (or a scratch one) skips the last block's commit
    keep_cache = cache is not None and not scratch_cache
    if cache is None or scratch_cache:
        if prompt.numel() == 0:
            raise InputError("input_ids: empty prompt without a cache; expected at least one token")
    if cache is None:
        cache = model.new_cache(cache_need(model, prompt.numel(), s))
    cache.attention_topk = TopKRule.from_settings(s)  # the full layers' attention from here on (None: dense)
    if prompt.numel():
        t = time.perf_counter()
        model.prefill(cache, prompt)
        timings["prefill_s"] += time.perf_counter() - t

    hf_rng = DeviceLcg(s.seed, device) if hf else None
    tokens: list[int] = []
    steps_per_block: list[int] = []
    stop_reasons: list[str] = []
    block_ends: list[str] = []
    retries = 0
    forwards = 0
    final_stop: int | None = None
    final_string: str | None = None

    block = 0
    while len(tokens) < s.max_new_tokens and block < max_blocks:
        attempt = 0
        while True:
            length = canvas_len if attempt == 0 else max(canvas_len >> attempt, canvas_len >> 2, 1)
            rng = hf_rng if hf else DeviceLcg(block_seed(s.seed, block, attempt), device)
            t = time.perf_counter()
            close_from = s.max_new_tokens - s.grammar_reserve - len(tokens)  # a constrained reply closes from here
            proposal = yield from _denoise_block(model, cache, s, rng, length, block, attempt, batched, grammar,
                                                 close_from)
            timings["denoise_s"] += time.perf_counter() - t
            forwards += proposal.steps
            # one read per attempt: committed ids (+ argmax and max probs for the trim)
            parts = [proposal.committed] if proposal.p_max is None else [proposal.committed, proposal.argmax,
                                                                         proposal.p_max]
            flat = yield BlockRead(torch.cat([x.double() for x in parts]))
            committed = [int(x) for x in flat[:length]]
            degenerate = committed[0] in control_ids and grammar is None  # a grammar chose the first token
            if block == 0 and degenerate and attempt < s.empty_reply_retry:
                attempt += 1
                retries += 1
                continue
            break
        if attempt > 0:
            max_blocks += 1  # a shrunk re-rolled block commits less: it does not use up a block of budget

        limit = min(len(committed), s.max_new_tokens - len(tokens))
        valid = grammar.cut(committed[:limit]) if grammar is not None else limit
        stop_pos = next((i for i in range(limit) if committed[i] in stop_ids), None)
        answer_len = stop_pos if stop_pos is not None else limit
        cut = None
        if proposal.p_max is not None:
            n = len(committed)
            argmax_ids = [int(x) for x in flat[n: 2 * n]]
            cut = trim_cut(argmax_ids, flat[2 * n:], s.confidence_trim, answer_len)
        stop_token = None
        if valid < limit and (stop_pos is None or valid <= stop_pos) and (cut is None or valid < cut):
            keep, end, cut = committed[:valid], GRAMMAR_CUT, None
        elif cut is not None:
            keep, end = committed[:cut], TRIMMED
        elif stop_pos is not None:
            keep, end, stop_token = committed[:stop_pos], STOP_TOKEN, committed[stop_pos]
        else:
            keep = committed[:limit]
            end = BUDGET if len(tokens) + limit >= s.max_new_tokens else CONTINUE
        if s.stop_strings and keep:
            hit = tokens_through_stop(tokenizer.decode, tokens + keep, len(tokens), s.stop_strings)
            if hit is not None:
                k, final_string = hit
                keep, end, stop_token, cut = keep[:k - len(tokens)], STOP_STRING, None, None

        if grammar is not None:
            grammar.commit(keep + ([stop_token] if stop_token is not None else []))
        last = (stop_token is not None or end == STOP_STRING or len(tokens) + len(keep) >= s.max_new_tokens
                or block + 1 >= max_blocks)
        if keep and (keep_cache or not last):
            t = time.perf_counter()
            _commit(model, cache, proposal.committed[: len(keep)])  # a prefix of the device ids: no copy back
            timings["prefill_s"] += time.perf_counter() - t
        tokens.extend(keep)
        steps_per_block.append(proposal.steps)
        stop_reasons.append(proposal.stop_reason)
        block_ends.append(end)
        yield BlockEvent(block=block, tokens=keep, steps=proposal.steps, stop_reason=proposal.stop_reason,
                         end=end, attempts=attempt + 1, stop_token=stop_token, trimmed_at=cut)
        block += 1
        if stop_token is not None:
            final_stop = stop_token
            break
        if end == STOP_STRING:
            break

    timings["total_s"] = time.perf_counter() - t_start
    text = tokenizer.decode(tokens) if tokenizer is not None else None
    if text is not None and final_string is not None:
        text = text[:text_end(text, s.stop_strings)]
    result = GenerationResult(
        tokens=tokens,
        text=text,
        steps_per_block=steps_per_block,
        tokens_per_forward=len(tokens) / forwards if forwards else 0.0,
        stop_reasons=stop_reasons,
        timings=timings,
        retries=retries,
        stop_token=final_stop,
        forwards=forwards,
        block_ends=block_ends,
        settings=s,
        stop_string=final_string,
    )
    yield DoneEvent(result)


def _denoise_block(model: DenoiseModel, cache, s: GenerationSettings, rng: DeviceLcg, length: int, block: int,
                   attempt: int, batched: bool = False, grammar: GrammarState | None = None, close_from: int = 0):
    """Denoise one canvas of `length` ids at positions cache.length.. ; yields StepEvents, returns _Proposal.

    Per step everything stays on the model's device; the Status it yields (the denoiser's read_status) is the only
    host read.
    """
    device, cfg = model.embedding.device, model.config
    vocab = cfg.vocab_size
    hf = s.semantics == "hf"
    sparse_sc = s.sc_mode != "exact"
    steps_total = s.max_denoising_steps
    stops = DeviceStopRules.from_settings(s, cfg.pad_token_id, vocab)
    den = model.denoiser([cache])
    if batched:
        den.run_ahead = False

    with den.bookkeeping(join=True):  # born where the bookkeeping reads and replaces them (model/denoiser.SideStream)
        canvas = rng.randint(length, vocab, device)
        frozen = torch.zeros(length, dtype=torch.bool, device=device) if s.freeze else None
    sc_logits = None
    sc_embeds = model.embed(canvas) if s.sc_seed else None  # the first step's SC seed
    reason, step, stats = None, 0, None
    bet_dense = True  # the sparse SC's bet (SparsePlan): a fresh canvas' rows are flat; then what the last step took
    while reason is None:
        step += 1
        cur = remaining(step, steps_total)
        temp = temperature_value(cur, steps_total, s.t_min, s.t_max)  # host float, bit-equal to the f32 schedule
        # the previous step's logits and plan go before this step's arrive: one [C, V] f32 alive at a time
        stats = plan = logits = None
        logits = yield Forward(den, cache, canvas, sc_logits, sc_embeds)
        stats = StepStats(logits, temp, cap=den.cap)
        h, argmax = stats.entropy, stats.argmax
        if s.commit == "sample":  # T's device scalar made here: an SC sum made ahead reads it
            stats.temp_tensor()

        with den.bookkeeping():  # sample, accept, renoise, stop rules: beside the SC pass below
            if s.commit == "sample":
                proposal = categorical(torch.softmax(stats.processed, dim=-1, dtype=torch.float32),
                                       rng.uniform(length, device))
            else:
                proposal = argmax
            # the final scheduled step accepts nothing under the contract; transformers decides it as usual
            mask = accept_mask(h, s.entropy_bound, final_step=(cur == 1 and not hf), frozen=frozen)
            if frozen is not None:
                proposal = torch.where(frozen, canvas, proposal)  # frozen positions keep their token
                frozen = mask
            if grammar is not None:  # the grammar's valid prefix is held (sampling/constraint.py)
                held, held_ids = grammar.hold(proposal, logits, close_from)
                proposal, mask = torch.where(held, held_ids, proposal), mask | held
            canvas = torch.where(mask, proposal, rng.randint(length, vocab, device))
            mean_h = h.mean().double()  # the f32 mean, compared in f64 like the host float it used to be
            code = stops.update(step, argmax, mean_h, mask)

        # the sparse SC's survivor count rides in the status; not needed when this step is the last one for sure
        plan = None
        if sparse_sc and step < steps_total:
            plan = SparsePlan(stats, s.sc_sparse_log_ratio,
                              dense_dtype=model.embedding.dtype if bet_dense and stats.fused else None,
                              scratch=None if batched else den.scratch(), sparse_ahead=den.run_ahead)
        status = yield Status(den, code, mean_h, plan, canvas)  # the step's one host read (den.read_status)
        reason = REASONS[status.code]
        yield StepEvent(block=block, attempt=attempt, step=step, temperature=temp, draft=argmax,
                        accepted=mask, mean_entropy=status.mean_entropy, stop_reason=reason, entropy=h)
        if reason is None:  # the next step self-conditions on these tempered logits
            if sparse_sc:
                sc_logits = None
                sc_embeds = plan.soft_embed(status.count, model.embedding, cfg.embed_scale)
                bet_dense = plan.took_dense
            else:
                sc_logits, sc_embeds = stats.processed, None

    den.close()
    committed = stats.argmax if frozen is None else torch.where(frozen, canvas, stats.argmax)
    if grammar is not None:
        committed = torch.where(held, canvas, committed)
    p_max = stats.max_prob() if s.confidence_trim > 0 else None
    return _Proposal(committed=committed, argmax=stats.argmax, p_max=p_max, steps=step, stop_reason=reason)


def _commit(model, cache, ids: torch.Tensor) -> None:
    """Append a block's kept ids (the sampler's, on the model's device) to the cache: the model's `commit` where it
    has one (the CUDA engine's skips the host range check, which would wait for the GPU), else its prefill."""
    (getattr(model, "commit", None) or model.prefill)(cache, ids)


def _as_ids(input_ids, vocab: int, device) -> torch.Tensor:
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise InputError(f"input_ids: expected shape [T] (or [1, T]), got {list(input_ids.shape)}")
        if ids.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
            raise InputError(f"input_ids: expected integer token ids, got dtype {ids.dtype}")
    else:
        try:
            ids = torch.tensor(list(input_ids), dtype=torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise InputError("input_ids: expected a LongTensor [T] or a list of token ids") from None
        if ids.dim() != 1:
            raise InputError("input_ids: expected a flat list of token ids")
    ids = ids.to(device=device, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InputError(f"input_ids: ids must be in [0, {vocab}), got range [{int(ids.min())}, {int(ids.max())}]")
    return ids
