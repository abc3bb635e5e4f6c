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

Each step adds one device->host read (the proposal) and one mask a corrected position; unconstrained generations
never reach this module.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ..errors import InputError

_LL_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(bool)).to(device)


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

    def __init__(self, grammar: str, tokenizer, vocab: int, stop_ids, fixes: int = 8):
        import llguidance

        if tokenizer is None:
            raise InputError("grammar: this model has no tokenizer to match the grammar's text with")
        self.vocab = vocab
        self.fixes = fixes
        self.stop_ids = tuple(stop_ids)
        self.closers = closing_classes(tokenizer, vocab, tuple(stop_ids))
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab, stop_ids), grammar)
        if self.matcher.is_error():
            raise InputError(f"grammar: {self.matcher.get_error().strip().splitlines()[0]}")

    def hold(self, proposal: torch.Tensor, logits: torch.Tensor, close_from: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(held [C] bool, tokens [C] long) for this step, on the proposal's device (the algorithm: module doc).

        close_from: the canvas position from which the reply's token budget is short; from there every position is
        chosen to close the grammar (`closing_token`), whatever the proposal says."""
        ids = proposal.tolist()
        n = len(ids) if close_from is None else max(0, min(close_from, len(ids)))
        m = self.matcher.deep_copy()
        pos, fixed = 0, 0
        if self.complete:  # the grammar is satisfied and takes nothing more: the reply ends here
            ids[0] = masked_argmax(logits[0], self.closers[0].to(logits.device))
            pos = 1
        while pos < len(ids) and not m.is_stopped():
            if pos < n:
                pos += m.try_consume_tokens(ids[pos:n])
            if pos >= len(ids) or m.is_stopped() or (pos < n and fixed >= self.fixes):
                break
            forced = m.compute_ff_tokens()[: len(ids) - pos]  # text the grammar fixes here: written as it is
            if forced:
                if not m.consume_tokens(forced):
                    break
                ids[pos: pos + len(forced)] = forced
                pos += len(forced)
                continue
            allowed = allowed_mask(m, self.vocab, logits.device)
            t = masked_argmax(logits[pos], allowed) if pos < n else self.closing_token(logits[pos], allowed)
            if not m.consume_token(t):
                break
            ids[pos] = t
            pos, fixed = pos + 1, fixed + (pos < n)
        device = proposal.device
        held = torch.arange(len(ids), device=device) < pos
        return held, torch.tensor(ids, dtype=proposal.dtype, device=device)

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
        """Feed kept tokens (a stop token included) to the matcher."""
        if self.complete:
            return
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise InputError("grammar: a committed token is not allowed by the grammar")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows no further token (the matcher stopped)."""
        return self.matcher.is_stopped()
