"""Commit-time confidence trim, dup tier (docs/ARCHITECTURE.md, 'Generation contract': `confidence_trim`).

A proposed block is cut at the first answer-region row that is BOTH unsure (p_max < tau) and a copy
of a neighbour's argmax: an unresolved row tends to copy its neighbour, so instead of committing the
stutter, the block ends before it and the tail re-denoises in the next block against committed
context. The answer region is rows [1, answer_len): everything that would otherwise be committed
(before a stop token, within the token budget). Row 0 is never cut so every block commits a token.
"""

from __future__ import annotations

import torch


def trim_cut(argmax, p_max, tau: float, answer_len: int) -> int | None:
    """Row index to cut at (keep rows [0, cut)), or None when nothing qualifies or tau == 0.

    argmax / p_max: tensors [C], or the host lists the generation loop already read (no second sync).
    """
    if tau <= 0 or answer_len <= 1:
        return None
    ids = argmax.tolist() if isinstance(argmax, torch.Tensor) else list(argmax)
    conf = p_max.tolist() if isinstance(p_max, torch.Tensor) else list(p_max)
    for i in range(1, min(answer_len, len(ids))):
        if conf[i] < tau and (ids[i] == ids[i - 1] or (i + 1 < len(ids) and ids[i] == ids[i + 1])):
            return i
    return None
