"""A grammar over a canvas: the reply is valid by construction (docs/ARCHITECTURE.md, 'Constrained output').

A `GrammarState` follows one request's reply with an llguidance matcher that has consumed every committed token.
Within a block, each denoise step calls `hold(proposal, logits)` after the accept rule:

1. Walk the step's proposal left to right through a copy of the matcher; the longest prefix the grammar allows is
   valid as it stands.
2. At the first position the grammar refuses, write the tokens the grammar forces there (llguidance's fast-forward
   tokens: a key, punctuation, a function name), or, where it allows a choice, the grammar's masked argmax (the
   position's logits with every token the grammar refuses there removed; logits are argmax-equivalent to the
   tempered, softcapped probabilities), and walk on. At most `fixes` positions a step are chosen this way.
3. The walked prefix is *held*: accepted, with these tokens, whatever the entropy rule said. Every other position
   follows the usual accept / renoise rule.

Positions are held only when the grammar allows them given every token before them, so a held prefix is a valid
prefix of the grammar's language; each step holds at least one more position than the grammar's start (the first
refused one is corrected), so a block's valid prefix grows. At the block's end the committed tokens (held tokens
where held, the argmax elsewhere) are cut at the first token the grammar refuses (`cut`), and `commit` feeds the
kept tokens to the matcher. A stop token is allowed only where the grammar accepts, and a complete grammar allows
only stop tokens, so the reply ends exactly when the grammar is satisfied. The reply fails the grammar only when the
token budget ends first.

A reply whose token budget runs short is closed rather than cut off: from the position where the budget left is
`grammar_reserve` tokens, each position takes the allowed token that closes soonest (a stop token, else a thought's or
call's closing token, else one holding a quote, else a closing bracket, else a separator, else the best allowed by the
logits), so an open thought, string, list or object ends in a few tokens and the remaining required keys are written
by the grammar's forced tokens.

Each step adds one device->host read and one host->device write; unconstrained generations never reach this module.
The read holds the proposal and, for the `CANDIDATE_ROWS` positions from where the last walk ended (the frontier,
where this step's choices are likely), their `CANDIDATES` best tokens by the logits (ids and values), so a masked
argmax is chosen on the host from the grammar's bitmask: the best allowed candidate is the masked argmax whenever its
value is above the least candidate value (every token outside the candidates scores at most that; ties go to the
lowest id, as torch.argmax). Otherwise (no candidates at that position, none allowed, or a tie with the least) the
position's masked argmax runs on the device: the row gathered at the allowed ids and read back where few words allow
anything, else the packed bitmask written there. The write is the held tokens and their count, packed in one tensor
through a staging buffer kept for the state. Where a walk's candidates decide none of its choices (logits that
disagree with the grammar), the next holds read none, for 1, 2, 4 .. `MAX_SKIP` holds while that lasts: the top-k
would only cost; every choice is exact either way.

A walk resumes where the last one left off: its matcher is kept with the tokens it consumed, and where this step's
proposal begins with the same tokens (the model re-proposing the held prefix), it is rolled back to their common
prefix instead of the prefix being consumed again (the matcher's state after a token sequence is a function of the
sequence, so both give the same state). `timings` sums the host's wait for the read, its walk and the write, and
counts holds and choices.
"""

from __future__ import annotations

import functools
import time
import weakref

import numpy as np
import torch

from ..errors import InputError

_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
CANDIDATES = 32  # best tokens a position's read carries for the host's masked argmax; 0: every one on the device
CANDIDATE_ROWS = 16  # positions from the frontier on whose candidates the read carries (the rest choose on the device)
TOPK_SEGMENT = 0  # > 0: the read's top-k in two stages over segments of this many tokens (best_candidates)
MAX_SKIP = 16  # the most holds read without candidates after their walks' candidates decided nothing (_back_off)


def ll_tokenizer(tokenizer, vocab: int, stop_ids):
    """The llguidance tokenizer of a model's tokenizer (made once per tokenizer object: it scans the vocabulary)."""
    import llguidance

    key = (vocab, tuple(stop_ids))
    made = _LL_TOKENIZERS.setdefault(tokenizer, {})
    if key not in made:
        made[key] = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab, eos_token=list(stop_ids))
    return made[key]


def allowed_mask(matcher, vocab: int, device) -> torch.Tensor:
    """bool [vocab]: the tokens the matcher allows next (llguidance's bitmask, 32 tokens a little-endian word)."""
    return words_mask(bitmask_words(matcher), vocab, device)


def bitmask_words(matcher) -> np.ndarray:
    """The matcher's bitmask as uint32 words (token t allowed: bit t % 32 of word t // 32)."""
    return np.frombuffer(matcher.compute_bitmask(), dtype="<u4")


def mask_words(mask: np.ndarray) -> np.ndarray:
    """bool [vocab] -> uint32 words as llguidance's bitmask packs them (bitmask_words' layout, zero padded)."""
    padded = np.zeros(-(-len(mask) // 32) * 32, dtype=bool)
    padded[: len(mask)] = mask
    return np.packbits(padded, bitorder="little").view("<u4")


def words_mask(words: np.ndarray, vocab: int, device) -> torch.Tensor:
    """bool [vocab] of bitmask words (allowed_mask's bits), unpacked on the host and written to `device`."""
    return torch.from_numpy(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].view(bool)).to(device)


def device_words_mask(words: np.ndarray, vocab: int, device) -> torch.Tensor:
    """words_mask with the words (a bit a token) sent to `device` and unpacked there: bit b of word j is token
    32j + b, read as (word >> b) & 1 of the word as int32 (the arithmetic shift keeps bit b where it is)."""
    w = torch.from_numpy(np.ascontiguousarray(words, dtype=np.uint32).view(np.int32)).to(device)
    return ((w[:, None] >> _bit_shifts(torch.device(device))) & 1).view(-1)[:vocab].bool()


@functools.lru_cache(maxsize=None)
def _bit_shifts(device: torch.device) -> torch.Tensor:
    """0 .. 31 as int32 on `device`, made once per device (device_words_mask runs inside the constrained step)."""
    return torch.arange(32, dtype=torch.int32, device=device)


def host_masked_argmax(ids: np.ndarray, values: np.ndarray, words: np.ndarray, vocab: int) -> int | None:
    """masked_argmax from a row's best candidates (`ids`, `values`: the top k by value, any order among ties) and the
    bitmask words, or None where the candidates cannot decide it: the best allowed candidate is the row's masked
    argmax when its value is above the least candidate value, or the candidates are the whole row."""
    ok = ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)
    if not ok.any() or np.isnan(values).any():
        return None
    best = values[ok].max()
    if best <= values.min() and len(ids) < vocab:
        return None
    return int(ids[ok & (values == best)].min())


def device_masked_argmax(logits_row: torch.Tensor, words: np.ndarray, vocab: int, sparse_words: int = 256) -> int:
    """masked_argmax of a row against bitmask words: where at most `sparse_words` words allow anything, the allowed
    ids go to the device and the row's values at them come back (exact, as f32), the first best of the ascending ids
    being the lowest, a NaN the first NaN, as torch.argmax; else the refused tokens' words go, are unpacked there
    (device_words_mask) and the row's masked argmax is taken there. A best of -inf takes masked_argmax itself."""
    device = logits_row.device
    live = np.flatnonzero(words)
    if len(live) > sparse_words:  # masked_argmax's fill and first max, in the row's own dtype (the same order)
        return int(logits_row.masked_fill(device_words_mask(~words, vocab, device), float("-inf")).argmax())
    rows, bits = np.nonzero(np.unpackbits(words[live].view(np.uint8), bitorder="little").reshape(-1, 32))
    ids = live[rows] * 32 + bits
    ids = ids[ids < vocab]
    if len(ids) == 0:
        return masked_argmax(logits_row, torch.zeros(vocab, dtype=torch.bool, device=device))
    values = logits_row.index_select(0, torch.from_numpy(ids).to(device)).cpu().float().numpy()
    at = int(values.argmax())
    if values[at] == -np.inf:
        return masked_argmax(logits_row, device_words_mask(words, vocab, device))
    return int(ids[at])


def best_candidates(x: torch.Tensor, k: int, segment: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [R, k]: the k best tokens of each row of x [R, V], any order among ties. segment > 0 (dividing
    V, the segments' k best together fewer than V): each segment's k best, then the k best of those. Either way no
    token outside a row's k scores above their least (host_masked_argmax's premise): a token outside its segment's
    k best scores at most each of them, so were it above the least, those k would be too and the second stage
    would have taken k tokens above the least."""
    R, V = x.shape
    if segment <= 0 or V % segment or segment <= k or (V // segment) * k >= V:
        top = torch.topk(x, k, dim=-1, sorted=False)
        return top.values, top.indices
    part = x.reshape(R, V // segment, segment).topk(k, dim=-1, sorted=False)
    ids = (part.indices + torch.arange(0, V, segment, device=x.device).unsqueeze(1)).flatten(1)
    top = part.values.flatten(1).topk(k, dim=-1, sorted=False)
    return top.values, ids.gather(1, top.indices)


_CLOSING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CLOSERS = ("<channel|>", "<tool_call|>")  # special tokens that close a thought or a call
_QUOTES = ('"', "<|\"|>")
_BRACKETS = ("}", "]")


def closing_classes(tokenizer, vocab: int, stop_ids: tuple) -> tuple[torch.Tensor, ...]:
    """bool [vocab] masks, in the order a budget-short reply prefers them: the stop tokens; the special tokens closing
    a thought or a call (free text inside them takes any quote, so they come first); tokens whose text holds a quote
    or string delimiter (an open string ends first); a closing bracket; a separator (made once per tokenizer)."""
    made = _CLOSING.setdefault(tokenizer, {})
    key = (vocab, stop_ids)
    if key not in made:
        texts = [tokenizer.decode([i]) for i in range(vocab)]
        stops = torch.zeros(vocab, dtype=torch.bool)
        stops[[i for i in stop_ids if i < vocab]] = True
        closers = torch.tensor([t in _CLOSERS for t in texts])
        quotes = torch.tensor([any(q in t for q in _QUOTES) for t in texts])
        brackets = torch.tensor([any(b in t for b in _BRACKETS) for t in texts])
        seps = torch.tensor(["," in t or ":" in t for t in texts])
        made[key] = (stops, closers, quotes, brackets, seps)
    return made[key]


def masked_argmax(logits_row: torch.Tensor, allowed: torch.Tensor) -> int:
    """The highest-scoring allowed token (ties: the lowest id, as torch.argmax)."""
    row = logits_row.float().masked_fill(~allowed, float("-inf"))
    return int(row.argmax())


class GrammarState:
    """One request's grammar, fed the reply's committed tokens."""

    candidates = CANDIDATES  # the read's best tokens a position (module doc)
    candidate_rows = CANDIDATE_ROWS  # the positions, from the frontier on, whose candidates the read carries
    topk_segment = TOPK_SEGMENT  # the read's top-k in two stages over segments of this many tokens (0: one)
    reference = False  # every masked argmax by masked_argmax over allowed_mask, every walk from the committed matcher
    plan_first = True  # the step makes its SC plan before the hold, for the GPU to run while the host walks (core)

    def __init__(self, grammar: str, tokenizer, vocab: int, stop_ids, fixes: int = 8):
        import llguidance

        if tokenizer is None:
            raise InputError("grammar: this model has no tokenizer to match the grammar's text with")
        self.vocab = vocab
        self.fixes = fixes
        self._skip, self._backoff = 0, 1  # holds left to read no candidates; the next skip's length (_back_off)
        self._last = None  # (the last walk's matcher, the tokens it consumed) for the next walk to resume from
        self._frontier = 0  # where the last walk ended: the first row whose candidates the read carries
        self._staging = None  # (pinned int64 buffer, its copy's event) for the write, on CUDA
        self._positions = None  # arange(C) on the proposal's device, for the write's held mask
        self.timings = dict.fromkeys(("read_s", "walk_s", "write_s"), 0.0) | dict.fromkeys(
            ("holds", "choices", "device_choices", "resumed"), 0)
        self.stop_ids = tuple(stop_ids)
        self.closers = closing_classes(tokenizer, vocab, tuple(stop_ids))
        self._closer_words = tuple(mask_words(c.numpy()) for c in self.closers)
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab, stop_ids), grammar)
        if self.matcher.is_error():
            raise InputError(f"grammar: {self.matcher.get_error().strip().splitlines()[0]}")

    def hold(self, proposal: torch.Tensor, logits: torch.Tensor, close_from: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(held [C] bool, tokens [C] long) for this step, on the proposal's device (the algorithm: module doc).

        close_from: the canvas position from which the reply's token budget is short; from there every position is
        chosen to close the grammar (`closing_token`), whatever the proposal says."""
        t0 = time.perf_counter()
        ids, cand = self._read(proposal, logits)
        t1 = time.perf_counter()
        before = (self.timings["choices"], self.timings["device_choices"])
        pos = self._walk(ids, cand, logits, close_from)
        t2 = time.perf_counter()
        if cand is not None:
            self._back_off(self.timings["choices"] - before[0], self.timings["device_choices"] - before[1])
        held, tokens = self._write(ids, pos, proposal)
        t3 = time.perf_counter()
        for key, dt in (("read_s", t1 - t0), ("walk_s", t2 - t1), ("write_s", t3 - t2)):
            self.timings[key] += dt
        self.timings["holds"] += 1
        return held, tokens

    def _read(self, proposal: torch.Tensor, logits: torch.Tensor):
        """The step's one read -> (the proposal's ids, candidates or None). Candidates: (first row, ids [R, k], values
        [R, k]) as numpy, the best k tokens of rows first .. first + R - 1 (the frontier on: module doc)."""
        C = proposal.shape[0]
        k = min(self.candidates, logits.shape[-1]) if self._skip == 0 and not self.reference else 0
        first = min(self._frontier, max(C - self.candidate_rows, 0))
        rows = min(self.candidate_rows, C - first)
        self._skip = max(self._skip - 1, 0)
        if k == 0 or rows <= 0:
            return proposal.tolist(), None
        values, top = best_candidates(logits[first: first + rows], k, self.topk_segment)
        flat = torch.cat([proposal.double(), top.double().flatten(), values.double().flatten()])
        host = flat.cpu().numpy()
        n = rows * k
        return host[:C].astype(np.int64).tolist(), (first, host[C: C + n].astype(np.int64).reshape(rows, k),
                                                    host[C + n:].reshape(rows, k))

    def _back_off(self, choices: int, on_device: int) -> None:
        """After a walk with candidates: where they decided none of its choices, read none for the next 1, 2, 4 ..
        `MAX_SKIP` holds (doubling while they keep failing; any decision starts over)."""
        if choices and choices == on_device:
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, MAX_SKIP)
        elif choices:
            self._backoff = 1

    def _start(self, ids: list[int], n: int):
        """(a matcher for this walk, the position it has consumed up to): the last walk's matcher rolled back to the
        common prefix of its tokens and ids[:n] where they share one, else a copy of the committed matcher at 0."""
        if self._last is not None and not self.reference:
            m, done = self._last
            self._last = None
            same = min(n, len(done))
            if ids[:same] != done[:same]:
                same = int(np.flatnonzero(np.asarray(ids[:same]) != np.asarray(done[:same]))[0])
            if same > 0 and m.rollback(len(done) - same) and not m.is_error():
                self.timings["resumed"] += 1
                return m, same
        return self.matcher.deep_copy(), 0

    def _walk(self, ids: list[int], cand, logits: torch.Tensor, close_from: int | None) -> int:
        """Walk `ids` (rewritten in place) through a matcher -> the held count."""
        n = len(ids) if close_from is None else max(0, min(close_from, len(ids)))
        if self.complete:  # the grammar is satisfied and takes nothing more: the reply ends here
            ids[0] = masked_argmax(logits[0], self.closers[0].to(logits.device))
            self._frontier = 0
            return 1
        m, pos = self._start(ids, n)
        fixed, ok = 0, True
        while pos < len(ids) and not m.is_stopped():
            if pos < n:
                pos += m.try_consume_tokens(ids[pos:n])
            if pos >= len(ids) or m.is_stopped() or (pos < n and fixed >= self.fixes):
                break
            forced = m.compute_ff_tokens()[: len(ids) - pos]  # text the grammar fixes here: written as it is
            if forced:
                if not m.consume_tokens(forced):
                    ok = False
                    break
                ids[pos: pos + len(forced)] = forced
                pos += len(forced)
                continue
            t = self._choose(m, pos, logits, cand, closing=pos >= n)
            if not m.consume_token(t):
                ok = False
                break
            ids[pos] = t
            pos, fixed = pos + 1, fixed + (pos < n)
        self._last = (m, ids[:pos]) if ok and not self.reference else None
        self._frontier = pos
        return pos

    def _choose(self, m, pos: int, logits: torch.Tensor, cand, closing: bool = False) -> int:
        """The grammar's masked argmax at `pos` (closing: within the first closing class the grammar allows a token of,
        `closing_token`'s rule, on the packed words): from the read's candidates where they decide it, else on the
        device (`reference`: masked_argmax over allowed_mask, the twin the fast paths are tested against)."""
        if self.reference:
            allowed = allowed_mask(m, self.vocab, logits.device)
            return self.closing_token(logits[pos], allowed) if closing else masked_argmax(logits[pos], allowed)
        self.timings["choices"] += 1
        words = bitmask_words(m)
        if closing:  # the class words cover the model's vocabulary, the bitmask may run past it
            n = min(len(words), len(self._closer_words[0]))
            words = next((w for w in (words[:n] & c[:n] for c in self._closer_words) if w.any()), words)
        t = None
        if cand is not None and 0 <= pos - cand[0] < len(cand[1]):
            t = host_masked_argmax(cand[1][pos - cand[0]], cand[2][pos - cand[0]], words, self.vocab)
        if t is None:
            self.timings["device_choices"] += 1
            t = device_masked_argmax(logits[pos], words, self.vocab)
        return t

    def _write(self, ids: list[int], pos: int, proposal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(held, tokens) on the proposal's device: one write of the tokens and the held count, packed (on CUDA through
        a pinned staging buffer, reused once its last copy is done)."""
        C, device = len(ids), proposal.device
        if self._positions is None or self._positions.device != device or len(self._positions) != C:
            self._positions = torch.arange(C, device=device)
        if device.type == "cuda":
            if self._staging is None or len(self._staging[0]) != C + 1:
                self._staging = (torch.empty(C + 1, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
            host, done = self._staging
            done.synchronize()  # the last write's copy has read the buffer
            staged = host.numpy()
            staged[:C] = ids
            staged[C] = pos
            packed = host.to(device, non_blocking=True)
            done.record()
        else:
            packed = torch.tensor(ids + [pos], dtype=torch.int64)
        held = self._positions < packed[C]
        return held, packed[:C].to(proposal.dtype)

    def closing_token(self, logits_row: torch.Tensor, allowed: torch.Tensor) -> int:
        """The allowed token of the first closing class that has one (closing_classes' order, then anything), by the
        logits within that class."""
        for cls in self.closers:
            both = allowed & cls.to(allowed.device)
            if both.any():
                return masked_argmax(logits_row, both)
        return masked_argmax(logits_row, allowed)

    def cut(self, tokens: list[int]) -> int:
        """How many of a block's committed tokens the grammar allows, from the reply so far (a stop token first, once
        the grammar is complete)."""
        if self.complete:
            return int(bool(tokens) and tokens[0] in self.stop_ids)
        return self.matcher.deep_copy().try_consume_tokens(list(tokens))

    def commit(self, tokens: list[int]) -> None:
        """Feed kept tokens (a stop token included) to the matcher; the next block's walks start from it."""
        self._last, self._frontier = None, 0
        if self.complete:
            return
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise InputError("grammar: a committed token is not allowed by the grammar")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows no further token (the matcher stopped)."""
        return self.matcher.is_stopped()
