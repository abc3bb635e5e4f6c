"""The generation algorithm, written once as one request's coroutine (docs/ARCHITECTURE.md, 'Generation contract').

After the prompt is in the cache (the engine core prefills it), one generation proposes and commits blocks until a
stop token, the token budget, or the block budget ends it:

    for each block:                                     (canvas at positions cache.length ..)
        canvas = uniform random ids                     (seeded LCG)
        for step 1..max_denoising_steps:
            logits = forward(canvas, SC)                (SC: first-step seed, then the previous step's logits)
            T = schedule(step);  H, argmax = stats(logits / T)
            accept the lowest-entropy prefix (bound in nats); renoise every other position
            (a grammar holds its valid prefix too: sampling/constraint.py)
            stop? confident / plateau / entropy-only / max steps (pad gate: never on all-pad)
        committed = argmax of the last executed step
        first block opening with a stop/control id -> re-roll with a halved canvas (<= 3 times)
        cut at a stop id (end of turn), at the token budget, at the confidence trim, or where a grammar refuses
        prefill the kept tokens into the cache

`generate_steps` yields a `ForwardAsk` where a step needs the model and its sampler's row pass, a `StatusAsk` where it
reads its step's status, an `EmbedAsk` where it needs its next step's sparse SC embedding, a `BlockRead` where it
reads its block and a `CommitAsk` where the block's kept ids go into the cache: the engine core (core/engine.py),
its only driver, answers them for every running request of a round together (one batched forward; the lanes' row
stats, accept masks, sparse-SC plans and soft embeddings each made once for all lanes, core/lanes.py; one host wait;
the commits of a round in one batched prefill), each lane getting the bits it gets alone. Everything else
(sampling, renoise, grammar hold, stop rules, re-rolls, commits) is the request's own, so a request gets the same
tokens alone or batched. The loop reaches the model only through model/protocol.DenoiseModel and its Denoiser
(model/denoiser.py: how a step meets the device).

Cache contract: with keep_cache the cache gets every kept token; otherwise the last block is not committed (no one
reads it). The stop token that ended the turn is NOT in `tokens` and NOT in the cache (it is `stop_token`). Stop
strings (stop_strings.py): the block keeps its tokens through the one completing the match, and the turn ends.

RNG layout: with semantics="contract" every (block, re-roll attempt) gets its own LCG seeded with
block_seed(seed, block, attempt); with semantics="hf" one LCG(seed) stream serves the whole call in transformers'
order. Host syncs: one StatusAsk per step (stop code, mean entropy, survivor count), one BlockRead per attempt.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Generator

import torch

from ..errors import InputError
from ..events import BlockEvent, DoneEvent, GenerationResult, StepEvent
from ..model.protocol import DenoiseModel
from ..sampling.constraint import GrammarState
from ..sampling.rng import DeviceLcg, block_seed, categorical
from ..sampling.schedule import remaining, temperature_value
from ..sampling.self_condition import SparsePlan
from ..sampling.stats import StepStats
from ..sampling.stops import REASONS, DeviceStopRules, filler_id
from ..sampling.trim import trim_cut
from ..settings import GenerationSettings
from ..stop_strings import text_end, tokens_through_stop

STOP_TOKEN = "stop_token"  # BlockEvent.end: the block held a stop id; the turn is over
BUDGET = "max_new_tokens"  # the token budget is spent
TRIMMED = "trimmed"  # the confidence trim cut the block; the tail re-denoises next block
STOP_STRING = "stop_string"  # the reply holds a stop text; the block was cut after it and the turn is over
GRAMMAR_CUT = "grammar_cut"  # the grammar refused a token of the block: it was cut there; the tail re-denoises next
CONTINUE = "continue"  # a full block was committed; the next block follows


@dataclass
class ForwardAsk:
    """A request's ask for one denoise forward, answered with the step's `Sampled`: the engine core runs the round's
    forward over every lane's canvas, makes each lane's StepStats of its logits at `temp` (with its denoiser's cap),
    then each lane's accept mask (sampling/accept.py) by its rule: `bound`, `final_step` (accept nothing), `frozen`."""

    den: Any  # the request's Denoiser (model/protocol.Denoiser)
    cache: Any
    canvas: torch.Tensor  # [C] ids
    sc_logits: torch.Tensor | None
    sc_embeds: torch.Tensor | None
    temp: float  # the step's temperature
    bound: float = 0.0  # the accept rule's entropy bound (nats)
    final_step: bool = False
    frozen: torch.Tensor | None = None  # the legacy freeze's mask

    def run(self) -> torch.Tensor:
        """This forward alone, on the request's own denoiser -> logits [C, V]."""
        return self.den.forward(self.canvas, sc_logits=self.sc_logits, sc_embeds=self.sc_embeds)


@dataclass
class Sampled:
    """A ForwardAsk's answer: the step's row stats and its accept mask [C] (bool)."""

    stats: Any  # sampling/stats.StepStats
    mask: torch.Tensor


@dataclass
class StatusAsk:
    """A request's ask for its step's one host read, answered with a StepStatus (model/denoiser.read_statuses reads
    a round's lanes with one host wait). Where `sc_ratio` is set the engine core first makes the step's sparse-SC plan
    of `stats` into `plan` (core/lanes.lane_plans: SparsePlan(stats, sc_ratio, dense_dtype) for every lane at once);
    its survivor count rides in the status. A plan made before the ask (`own_plan`, under a grammar) is kept."""

    den: Any
    code: torch.Tensor  # the stop rules' device code
    mean_h: torch.Tensor  # the canvas' mean entropy (f64 device scalar)
    plan: Any  # the step's SparsePlan, or None
    canvas: torch.Tensor  # the next step's canvas
    stats: Any = None  # the step's StepStats, which the plan is made of
    sc_ratio: float | None = None  # the sparse SC's log ratio, or None: no plan this step
    dense_dtype: torch.dtype | None = None  # the plan's bet on the dense product (SparsePlan's dense_dtype)

    def run(self):
        return self.den.read_status(self.code, self.mean_h, self.plan, self.canvas)


def own_plan(stats, sc_ratio: float, dense_dtype, den, lend: bool) -> SparsePlan:
    """A request's sparse-SC plan made on its own: the one it gets stepping alone (`lend`: in its denoiser's dead
    logits buffer, and betting ahead where its denoiser runs ahead), or one lane's outside a batch's shared pass."""
    return SparsePlan(stats, sc_ratio, dense_dtype=dense_dtype, scratch=den.scratch() if lend else None,
                      sparse_ahead=den.run_ahead)


def _plan_before_hold(model, den, grammar, stats, sc_ratio, dense_dtype, batched: bool):
    """Under a grammar (with GrammarState.plan_first): the step's SC plan (own_plan), made and started on the main
    stream before the hold, which runs on the bookkeeping stream, so the GPU runs the SC's passes while the host walks
    the grammar. None otherwise: the core makes the plan at the StatusAsk."""
    if grammar is None or not grammar.plan_first or sc_ratio is None:
        return None
    plan = own_plan(stats, sc_ratio, dense_dtype, den, lend=not batched)
    if plan.speculative:
        plan.start(model.embedding, model.config.embed_scale)
    return plan


@dataclass
class EmbedAsk:
    """A request's ask for its next step's SC embedding, answered with plan.soft_embed(count, ...) [C, H] (the engine
    core sums every lane's at once: SparsePlan.soft_embed_batch)."""

    plan: Any  # the step's SparsePlan
    count: int  # its survivors in all, as the status read them

@dataclass
class BlockRead:
    """A request's ask for its block's one host read, answered with the values: the proposal packed as float64,
    [committed ids | argmax ids | max probs]. A round's block reads share one host wait, queued before any commit."""

    packed: torch.Tensor

    def run(self) -> list[float]:
        return self.packed.tolist()


@dataclass
class CommitAsk:
    """A request's ask to append its block's kept ids to its cache, answered with None once they are in (the engine
    core commits a round's blocks together: core/lanes.commit_lanes). `last`: the generation's last block, whose
    commit the core may run after the generation's end events, before the round ends (core/engine.py)."""

    model: Any
    cache: Any
    ids: torch.Tensor  # the kept ids, on the model's device
    last: bool = False

    def run(self) -> None:
        commit(self.model, self.cache, self.ids)


@dataclass
class _Proposal:
    committed: torch.Tensor  # [C] ids (device)
    argmax: torch.Tensor  # [C] last step's argmax (device)
    p_max: torch.Tensor | None  # [C] last step's max prob (tempered); None when the trim is off
    steps: int
    stop_reason: str


@dataclass
class _Tally:
    """What a generation has done so far (its result's fields)."""

    tokens: list[int] = field(default_factory=list)
    steps_per_block: list[int] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)
    block_ends: list[str] = field(default_factory=list)
    retries: int = 0
    forwards: int = 0
    stop_token: int | None = None
    stop_string: str | None = None
    timings: dict = field(default_factory=lambda: {"prefill_s": 0.0, "denoise_s": 0.0})


def control_ids(model: DenoiseModel, s: GenerationSettings) -> tuple[tuple[int, ...], set[int]]:
    """(the stop ids, the ids a first block may not open with: the empty-reply attractor the re-roll guards)."""
    cfg = model.config
    stop_ids = tuple(s.stop_ids) if s.stop_ids is not None else tuple(cfg.eos_token_ids)
    control = set(stop_ids) | {cfg.pad_token_id, filler_id(cfg.vocab_size)}
    if cfg.bos_token_id is not None:
        control.add(cfg.bos_token_id)
    return stop_ids, control


def generate_steps(model: DenoiseModel, cache, s: GenerationSettings, *, keep_cache: bool = True,
                   batched: bool = False) -> Generator[Any, Any, None]:
    """One generation as a coroutine over `cache` (which holds the prompt): it yields StepEvent, BlockEvent, a final
    DoneEvent and the asks above. `s` is resolved (core/request.resolve: canvas_length filled in). keep_cache: commit
    the last block too. batched: the driver answers this request's asks together with other requests' (its denoiser
    then neither runs the next forward ahead nor lends the model's logits scratch, which are one request's)."""
    canvas_len = s.canvas_length
    stop_ids, control = control_ids(model, s)
    if s.stop_strings and model.tokenizer is None:
        raise InputError("stop_strings: this model has no tokenizer to decode the reply with")
    grammar = GrammarState(s.grammar, model.tokenizer, model.config.vocab_size, stop_ids, s.grammar_fixes) \
        if s.grammar else None
    # the trim can shorten blocks, so it gets twice the block budget; a grammar's cut keeps one token at least
    max_blocks = math.ceil(s.max_new_tokens / canvas_len) * (2 if s.confidence_trim > 0 else 1)
    if grammar is not None:
        max_blocks = max(max_blocks, s.max_new_tokens)
    t_start = time.perf_counter()
    hf_rng = DeviceLcg(s.seed, model.embedding.device) if s.semantics == "hf" else None
    tally = _Tally()
    block = 0
    while len(tally.tokens) < s.max_new_tokens and block < max_blocks:
        proposal, flat, attempt = yield from _propose(model, cache, s, hf_rng, block, control, batched, tally,
                                                      grammar)
        if attempt > 0:
            max_blocks += 1  # a shrunk re-rolled block commits less: it does not use up a block of budget
        keep, end, stop_token, cut = _cut(model, s, flat, proposal, stop_ids, tally, grammar)
        if grammar is not None:
            grammar.commit(keep + ([stop_token] if stop_token is not None else []))
        last = (stop_token is not None or end == STOP_STRING or len(tally.tokens) + len(keep) >= s.max_new_tokens
                or block + 1 >= max_blocks)
        if keep and (keep_cache or not last):
            t = time.perf_counter()
            yield CommitAsk(model, cache, proposal.committed[: len(keep)], last=last)  # a prefix of the device ids
            tally.timings["prefill_s"] += time.perf_counter() - t
        tally.tokens.extend(keep)
        tally.steps_per_block.append(proposal.steps)
        tally.stop_reasons.append(proposal.stop_reason)
        tally.block_ends.append(end)
        yield BlockEvent(block=block, tokens=keep, steps=proposal.steps, stop_reason=proposal.stop_reason,
                         end=end, attempts=attempt + 1, stop_token=stop_token, trimmed_at=cut)
        block += 1
        if stop_token is not None:
            tally.stop_token = stop_token
            break
        if end == STOP_STRING:
            break
    tally.timings["total_s"] = time.perf_counter() - t_start
    if grammar is not None:  # the hold's split: its read's wait, its walk, its write (sampling/constraint.py)
        tally.timings.update({f"grammar_{k}": v for k, v in grammar.timings.items()})
    yield DoneEvent(_result(model, s, tally))


def _propose(model, cache, s, hf_rng, block: int, control: set[int], batched: bool, tally: _Tally,
             grammar: GrammarState | None = None):
    """Denoise block `block`, re-rolling a first block that opens with a control id (each attempt a halved canvas;
    not under a grammar, which chose that first token) -> (its proposal, the block's values as read, the attempt
    kept)."""
    canvas_len, device = s.canvas_length, model.embedding.device
    attempt = 0
    while True:
        length = canvas_len if attempt == 0 else max(canvas_len >> attempt, canvas_len >> 2, 1)
        rng = hf_rng if hf_rng is not None else DeviceLcg(block_seed(s.seed, block, attempt), device)
        t = time.perf_counter()
        close_from = s.max_new_tokens - s.grammar_reserve - len(tally.tokens)  # a constrained reply closes from here
        proposal = yield from _denoise_block(model, cache, s, rng, length, block, attempt, batched, grammar,
                                             close_from)
        tally.timings["denoise_s"] += time.perf_counter() - t
        tally.forwards += proposal.steps
        # one read per attempt: committed ids (+ argmax and max probs for the trim)
        parts = [proposal.committed] if proposal.p_max is None else [proposal.committed, proposal.argmax,
                                                                     proposal.p_max]
        flat = yield BlockRead(torch.cat([x.double() for x in parts]))
        degenerate = int(flat[0]) in control and grammar is None
        if block == 0 and degenerate and attempt < s.empty_reply_retry:
            attempt += 1
            tally.retries += 1
            continue
        return proposal, flat, attempt


def _cut(model, s, flat: list[float], proposal: _Proposal, stop_ids, tally: _Tally,
         grammar: GrammarState | None = None):
    """Where a block's kept tokens end: at the first token a grammar refuses, a stop id, the token budget, the
    confidence trim or a stop string -> (kept ids, the block's end, the stop id or None, the trim's cut or None)."""
    n = len(proposal.committed)
    committed = [int(x) for x in flat[:n]]
    tokens = tally.tokens
    limit = min(n, s.max_new_tokens - len(tokens))
    valid = grammar.cut(committed[:limit]) if grammar is not None else limit
    stop_pos = next((i for i in range(limit) if committed[i] in stop_ids), None)
    answer_len = stop_pos if stop_pos is not None else limit
    cut = None
    if proposal.p_max is not None:
        cut = trim_cut([int(x) for x in flat[n: 2 * n]], flat[2 * n:], s.confidence_trim, answer_len)
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
        hit = tokens_through_stop(model.tokenizer.decode, tokens + keep, len(tokens), s.stop_strings)
        if hit is not None:
            k, tally.stop_string = hit
            keep, end, stop_token, cut = keep[:k - len(tokens)], STOP_STRING, None, None
    return keep, end, stop_token, cut


def _result(model, s, tally: _Tally) -> GenerationResult:
    tokenizer = model.tokenizer
    text = tokenizer.decode(tally.tokens) if tokenizer is not None else None
    if text is not None and tally.stop_string is not None:
        text = text[:text_end(text, s.stop_strings)]
    return GenerationResult(
        tokens=tally.tokens, text=text, steps_per_block=tally.steps_per_block,
        tokens_per_forward=len(tally.tokens) / tally.forwards if tally.forwards else 0.0,
        stop_reasons=tally.stop_reasons, timings=tally.timings, retries=tally.retries, stop_token=tally.stop_token,
        forwards=tally.forwards, block_ends=tally.block_ends, settings=s, stop_string=tally.stop_string)


def _denoise_block(model: DenoiseModel, cache, s: GenerationSettings, rng: DeviceLcg, length: int, block: int,
                   attempt: int, batched: bool = False, grammar: GrammarState | None = None, close_from: int = 0):
    """Denoise one canvas of `length` ids at positions cache.length.. ; yields StepEvents and the step's asks,
    returns _Proposal. Per step everything stays on the model's device; the StatusAsk is the only host read (and,
    under a grammar, its hold's read of the proposal: sampling/constraint.py). close_from: the canvas position from
    which a constrained reply closes its grammar."""
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
        # the previous step's stats and plan go before this step's arrive: one [C, V] f32 alive at a time
        stats = plan = sampled = None
        # the final scheduled step accepts nothing under the contract; transformers decides it as usual
        sampled = yield ForwardAsk(den, cache, canvas, sc_logits, sc_embeds, temp, s.entropy_bound,
                                   final_step=(cur == 1 and not hf), frozen=frozen)
        stats, mask = sampled.stats, sampled.mask
        h, argmax = stats.entropy, stats.argmax
        if s.commit == "sample":  # T's device scalar made here: an SC sum made ahead reads it
            stats.temp_tensor()
        # the sparse SC's plan (the core's, or made before a grammar's hold) and its survivor count in the status; not
        # needed when this step is the last one for sure
        sc_ratio = s.sc_sparse_log_ratio if sparse_sc and step < steps_total else None
        dense_dtype = model.embedding.dtype if bet_dense and stats.fused else None
        plan = _plan_before_hold(model, den, grammar, stats, sc_ratio, dense_dtype, batched)
        with den.bookkeeping():  # sample, renoise, stop rules: beside the SC pass the status read follows
            proposal = argmax
            if s.commit == "sample":
                proposal = categorical(torch.softmax(stats.processed, dim=-1, dtype=torch.float32),
                                       rng.uniform(length, device))
            if frozen is not None:
                proposal = torch.where(frozen, canvas, proposal)  # frozen positions keep their token
                frozen = mask
            # what no hold changes is queued before the hold's read waits, so its launches hide behind the forward
            noise = rng.randint(length, vocab, device)
            mean_h = h.mean().double()  # the f32 mean, compared in f64 like the host float it used to be
            if grammar is not None:  # the grammar's valid prefix is held (sampling/constraint.py)
                held, held_ids = grammar.hold(proposal, stats.logits, close_from)  # logits: argmax-equivalent
                proposal, mask = torch.where(held, held_ids, proposal), mask | held
            canvas = torch.where(mask, proposal, noise)
            code = stops.update(step, argmax, mean_h, mask)
        ask = StatusAsk(den, code, mean_h, plan, canvas, stats, sc_ratio, dense_dtype=dense_dtype)
        status = yield ask
        plan, ask = ask.plan, None
        reason = REASONS[status.code]
        yield StepEvent(block=block, attempt=attempt, step=step, temperature=temp, draft=argmax,
                        accepted=mask, mean_entropy=status.mean_entropy, stop_reason=reason, entropy=h)
        if reason is None:  # the next step self-conditions on these tempered logits
            if sparse_sc:
                sc_logits = None
                sc_embeds = yield EmbedAsk(plan, status.count)
                bet_dense = plan.took_dense
            else:
                sc_logits, sc_embeds = stats.processed, None
    den.close()
    committed = stats.argmax if frozen is None else torch.where(frozen, canvas, stats.argmax)
    if grammar is not None:
        committed = torch.where(held, canvas, committed)
    p_max = stats.max_prob() if s.confidence_trim > 0 else None
    return _Proposal(committed=committed, argmax=stats.argmax, p_max=p_max, steps=step, stop_reason=reason)


def commit(model, cache, ids: torch.Tensor) -> None:
    """Append a block's kept ids (the sampler's, on the model's device) to the cache: the model's `commit` where it
    has one (the CUDA engine's skips the host range check, which would wait for the GPU), else its prefill."""
    (getattr(model, "commit", None) or model.prefill)(cache, ids)
