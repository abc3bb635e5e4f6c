"""How much text a prompt can hold: a bound on characters, so text no context could hold is refused before it is
tokenized.

A token stands for at most L characters of the input, where L is the tokenizer's longest token: the longest
vocabulary piece or added token, in characters (a byte-level piece has one character per byte, and a byte covers
at most one input character), times what the normalizer may fold into one character (canonical composition joins
at most 4 code points into one). So a text of more than `context x L` characters needs more tokens than the
context holds. The bound holds only for a tokenizer that keeps every input character in some token; one whose
normalizer, pre-tokenizer or model can drop characters or fold a run of them into one token (whitespace
splitting, stripping, a fused unknown token) gets no bound (None), and its prompts are only checked once
tokenized.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("diffgemma.server")

# normalizers that never shrink the text, and how many input characters a composing one folds into one at most
_KEEPING_NORMALIZERS = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 4, "NFKC": 4}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "Punctuation", "Split", "UnicodeScripts"}


def _normalizer_factor(spec) -> int | None:
    """At most how many input characters one normalized character stands for; None when unbounded or unknown."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if not isinstance(pattern, str) or not content:  # a regex, or a deletion: unbounded
            return None
        return max(1, math.ceil(len(pattern) / len(content)))
    return _KEEPING_NORMALIZERS.get(kind)


def _pre_tokenizers(spec) -> list[dict] | None:
    """The pre-tokenizer's parts, or None when one of them can drop characters (or is unknown)."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        parts = []
        for part in spec.get("pretokenizers", []):
            got = _pre_tokenizers(part)
            if got is None:
                return None
            parts += got
        return parts
    if spec.get("type") not in _KEEPING_PRE_TOKENIZERS or spec.get("behavior") == "Removed":
        return None
    return [spec]


def _pieces(model: dict) -> list[str]:
    vocab = model.get("vocab") or {}
    return list(vocab) if isinstance(vocab, dict) else [v[0] for v in vocab if v and isinstance(v[0], str)]


def longest_token_chars(spec: dict) -> int | None:
    """The most input characters one token of the tokenizer described by `spec` (tokenizer.json's content) can
    stand for, or None where the tokenizer may drop characters or fold a run of them into one token."""
    factor = _normalizer_factor(spec.get("normalizer"))
    pre = _pre_tokenizers(spec.get("pre_tokenizer"))
    model = spec.get("model") or {}
    if factor is None or pre is None:
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    if model.get("type") == "BPE":
        keeps = model.get("byte_fallback") or byte_level or (model.get("unk_token") and not model.get("fuse_unk"))
    elif model.get("type") == "Unigram":
        keeps = bool(model.get("byte_fallback"))
    else:  # WordPiece, WordLevel: a whole unknown word becomes one token
        keeps = False
    if not keeps:
        return None
    texts = _pieces(model) + [t.get("content", "") for t in spec.get("added_tokens") or []]
    longest = max((len(t) for t in texts), default=0)
    return longest * factor if longest else None


def max_prompt_chars(tokenizer, context_tokens: int) -> int | None:
    """The most characters of text a prompt of `context_tokens` tokens can hold for `tokenizer` (one that reads a
    tokenizer.json, its `path`), or None when no such bound is known; computed from the whole vocabulary, so
    callers keep it."""
    path = getattr(tokenizer, "path", None)
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        spec = None
    per_token = longest_token_chars(spec) if isinstance(spec, dict) else None
    if per_token is None:
        log.info("the tokenizer gives no bound on characters per token; long texts are checked once tokenized")
        return None
    return context_tokens * per_token
