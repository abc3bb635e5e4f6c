"""Carry a trained demo checkpoint over to a new tokenizer by remapping its (tied) embedding rows.

Changing the tokenizer changes every id, so the old embedding table is meaningless under the new one,
but the layers above it are not: a warm start with remapped rows needs far fewer steps than training
from scratch (MODEL_CARD.md, run 6). Each new token's row is
  - the old row of the same token string, where the old vocabulary has it (special tokens included);
  - otherwise the mean of the old rows of the pieces the old tokenizer splits its text into.
Ids no token string maps to keep their rows. Every other tensor is copied.

    python tools/remap_vocab.py --model OLD/model.safetensors --from-tokenizer OLD_TOK_DIR \\
        --to-tokenizer NEW_TOK_DIR --out NEW_INIT.safetensors
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

EMBEDDING = "model.decoder.embed_tokens.weight"


def remap_rows(old: torch.Tensor, old_tok, new_tok) -> tuple[torch.Tensor, dict]:
    """old: [V, H] rows under old_tok (a `tokenizers.Tokenizer`); returns rows under new_tok and counts."""
    old_vocab, new_vocab = old_tok.get_vocab(), new_tok.get_vocab()
    if max(new_vocab.values()) >= old.shape[0]:
        raise ValueError(f"the new tokenizer has ids up to {max(new_vocab.values())}; the embedding has only "
                         f"{old.shape[0]} rows")
    table = old.float()
    new = table.clone()  # ids no token string maps to keep their rows
    counts = {"same_string": 0, "from_pieces": 0}
    for token, i in new_vocab.items():
        if token in old_vocab:
            new[i] = table[old_vocab[token]]
            counts["same_string"] += 1
            continue
        pieces = old_tok.encode(new_tok.decode([i], skip_special_tokens=False), add_special_tokens=False).ids
        if not pieces:
            raise ValueError(f"token {token!r} (id {i}) encodes to nothing under the old tokenizer")
        new[i] = table[pieces].mean(0)
        counts["from_pieces"] += 1
    return new.to(old.dtype), counts


def remap_checkpoint(model: Path, from_tokenizer: Path, to_tokenizer: Path, out: Path) -> dict:
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    for p in (model, from_tokenizer / "tokenizer.json", to_tokenizer / "tokenizer.json"):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: not found")
    sd = load_file(str(model))
    if EMBEDDING not in sd:
        raise KeyError(f"{model}: no {EMBEDDING} (not a demo checkpoint?)")
    sd[EMBEDDING], counts = remap_rows(sd[EMBEDDING], Tokenizer.from_file(str(from_tokenizer / "tokenizer.json")),
                                       Tokenizer.from_file(str(to_tokenizer / "tokenizer.json")))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    save_file(sd, str(tmp))
    os.replace(tmp, out)  # never a half-written checkpoint under the final name
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the trained model.safetensors")
    ap.add_argument("--from-tokenizer", type=Path, required=True, help="directory of the tokenizer it was trained on")
    ap.add_argument("--to-tokenizer", type=Path, required=True, help="directory of the new tokenizer")
    ap.add_argument("--out", type=Path, required=True, help="where to write the remapped model.safetensors")
    args = ap.parse_args(argv)
    counts = remap_checkpoint(args.model, args.from_tokenizer, args.to_tokenizer, args.out)
    print(f"wrote {args.out}: {counts['same_string']} rows by token string, {counts['from_pieces']} from old pieces")


if __name__ == "__main__":
    main()
