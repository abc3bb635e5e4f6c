"""tools/remap_vocab.py: a trained checkpoint's embedding rows carried over to another tokenizer."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import build_tokenizer  # noqa: E402
import remap_vocab  # noqa: E402

VOCAB = 600


@pytest.fixture(scope="module")
def tokenizers():
    """Two tokenizers over the same text that split it differently (spaces attached vs isolated)."""
    return (build_tokenizer.build(VOCAB, 1500), build_tokenizer.build(VOCAB, 1500, isolate_spaces=True))


def test_rows_follow_their_token_string_or_the_mean_of_its_old_pieces(tokenizers):
    old_tok, new_tok = tokenizers
    hidden = 16
    old = torch.randn(VOCAB + 3, hidden)  # rows past the vocabularies stand for ids no token maps to
    new, counts = remap_vocab.remap_rows(old, old_tok, new_tok)
    old_vocab = old_tok.get_vocab()
    new_vocab = new_tok.get_vocab()
    assert counts["same_string"] + counts["from_pieces"] == len(new_vocab)
    assert counts["same_string"] > 0 and counts["from_pieces"] > 0  # the fixture exercises both rules
    for token, i in new_vocab.items():
        if token in old_vocab:
            assert torch.equal(new[i], old[old_vocab[token]]), token
        else:
            pieces = old_tok.encode(new_tok.decode([i], skip_special_tokens=False), add_special_tokens=False).ids
            assert len(pieces) >= 1
            assert torch.allclose(new[i], old[pieces].mean(0)), token
    for special in ("<|tool_call>", '<|"|>', "<turn|>"):  # special tokens keep their learned rows
        assert torch.equal(new[new_vocab[special]], old[old_vocab[special]])
    assert torch.equal(new[VOCAB:], old[VOCAB:])


def test_a_table_smaller_than_the_new_vocabulary_is_refused(tokenizers):
    with pytest.raises(ValueError, match="embedding has only 10 rows"):
        remap_vocab.remap_rows(torch.randn(10, 4), *tokenizers)


def test_checkpoint_remap_changes_only_the_embedding_and_writes_atomically(tmp_path, tokenizers):
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    for d, tok in zip((old_dir, new_dir), tokenizers):
        d.mkdir()
        tok.save(str(d / "tokenizer.json"))
    sd = {remap_vocab.EMBEDDING: torch.randn(VOCAB, 8).to(torch.bfloat16),
          "model.decoder.norm.weight": torch.rand(8).to(torch.bfloat16)}
    save_file(sd, str(tmp_path / "model.safetensors"))
    out = tmp_path / "out" / "model.safetensors"
    counts = remap_vocab.remap_checkpoint(tmp_path / "model.safetensors", old_dir, new_dir, out)
    got = load_file(str(out))
    assert set(got) == set(sd) and got[remap_vocab.EMBEDDING].dtype == torch.bfloat16
    assert torch.equal(got["model.decoder.norm.weight"], sd["model.decoder.norm.weight"])
    assert counts["from_pieces"] > 0 and not torch.equal(got[remap_vocab.EMBEDDING], sd[remap_vocab.EMBEDDING])
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]  # no partial file left

    with pytest.raises(FileNotFoundError, match="nowhere"):
        remap_vocab.remap_checkpoint(tmp_path / "model.safetensors", tmp_path / "nowhere", new_dir, tmp_path / "x.st")
    save_file({"other": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(KeyError, match="embed_tokens"):
        remap_vocab.remap_checkpoint(tmp_path / "bad.safetensors", old_dir, new_dir, tmp_path / "y.st")
    assert not (tmp_path / "x.st").exists() and not (tmp_path / "y.st").exists()
