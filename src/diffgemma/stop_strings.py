"""Stop strings (OpenAI's `stop`): texts that end a reply, matched in its decoded text.

A diffusion model commits a block of tokens at a time, so the reply is checked after each committed block: at the
first match, generation keeps that block's tokens up to the one that completes the match and stops. The reply's
text ends where the match begins (the stop text itself is not returned, as in OpenAI's API); its tokens and the
KV cache keep the tokens through the match, which is what the model wrote. Whoever shows the text (the library's
result, a Session's reply, the server's message and its stream) cuts it with `text_end`, so they all agree.
"""

from __future__ import annotations


def first_stop(text: str, stops) -> tuple[int, str] | None:
    """-> (where the earliest stop text in `text` begins, that text), or None. Of stops beginning at the same place
    the longest is reported."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def text_end(text: str, stops) -> int:
    """How much of `text` a reply shows: up to its first stop text, or all of it."""
    hit = first_stop(text, stops) if stops else None
    return len(text) if hit is None else hit[0]


def held_back(text: str, stops) -> int:
    """How much of `text`'s end a stream must hold back: the longest tail that is the start of some stop text (or
    of any marker), which the next block may complete."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


def settled(text: str, stops) -> str:
    """What of a reply's text so far a stream may show: up to its first stop text, or, while it holds none, all but a
    tail that the next block could complete into one."""
    end = text_end(text, stops)
    return text[:end] if end < len(text) else text[:len(text) - held_back(text, stops)]


def tokens_through_stop(decode, tokens: list[int], start: int, stops) -> tuple[int, str] | None:
    """The reply `tokens` (its first `start` already checked, with no stop text in them) -> (how many to keep: through
    the token that completes the first stop text to be completed, that stop text), or None when the reply holds
    none. `decode(ids) -> str`."""
    if not stops or first_stop(decode(tokens), stops) is None:
        return None
    lo, hi = start, len(tokens)  # decode(tokens[:hi]) holds a stop text; decode(tokens[:lo]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if first_stop(decode(tokens[:mid]), stops) is None:
            lo = mid
        else:
            hi = mid
    return hi, first_stop(decode(tokens[:hi]), stops)[1]
