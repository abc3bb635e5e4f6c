"""bench/fixtures.py's peaked fixture at tiny size: which embedding rows it scales, and row_profile's entropy and
survivor counts on rows of known shape."""

import math

import pytest
import torch

from bench.fixtures import (EMBEDDING, FIXTURES, PEAK_LOGIT_STD, PEAK_TOKENS, RandomSource, peak_ids, peak_scale,
                            row_profile)
from bench.runner import shapes, with_fixtures


def test_peak_ids_are_distinct_ordinary_tokens_fixed_by_the_seed():
    for vocab in (4096, 262144):
        ids = peak_ids(vocab, 0)
        assert ids.unique().numel() == ids.numel() == min(PEAK_TOKENS, (vocab - min(1024, vocab // 4)) // 4)
        assert int(ids.min()) >= min(1024, vocab // 4) and int(ids.max()) < vocab
        assert torch.equal(ids, peak_ids(vocab, 0)) and not torch.equal(ids, peak_ids(vocab, 1))


def test_peaked_source_scales_only_the_peak_rows_of_the_embedding():
    cfg, _ = shapes(tiny=True)
    flat, peaked = (RandomSource(cfg, "cpu", torch.float32, seed=3, fixture=f) for f in FIXTURES)
    a, b = flat.get(EMBEDDING), peaked.get(EMBEDDING)
    ids = peak_ids(cfg.vocab_size, 3)
    rest = torch.ones(cfg.vocab_size, dtype=torch.bool)
    rest[ids] = False
    scale = peak_scale(cfg.hidden_size, 0.02)
    assert abs(scale * 0.02 * math.sqrt(cfg.hidden_size) - PEAK_LOGIT_STD) < 1e-9 and 7 < peak_scale(2816, 0.02) < 9
    assert torch.equal(a[rest], b[rest]) and torch.allclose(b[ids], a[ids] * scale, rtol=1e-6, atol=0)
    name = "model.decoder.norm.weight"
    assert torch.equal(flat.get(name), peaked.get(name))
    with pytest.raises(ValueError, match="fixture"):
        RandomSource(cfg, "cpu", fixture="spiky")


def test_row_profile_reads_flat_and_one_hot_rows():
    V = 500
    flat = row_profile(torch.zeros(4, V), 0.8)
    assert abs(flat["median_entropy"] - math.log(V)) < 1e-3 and flat["survivors_median"] == V
    hot = torch.zeros(4, V)
    hot[:, 7] = 30.0
    one = row_profile(hot, 0.5)
    assert one["median_entropy"] < 1e-6 and one["survivors_median"] == one["survivors_mean"] == 1
    two = hot.clone()
    two[:, 9] = 27.0  # 6 nats below the top at T = 0.5: a survivor at log ratio 10, not at 5
    assert row_profile(two, 0.5)["survivors_median"] == 2
    assert row_profile(two, 0.5, log_ratio=5.0)["survivors_median"] == 1
    raw = torch.randn(3, V) * 40
    assert row_profile(raw, 0.6, cap=30.0) == row_profile(30.0 * torch.tanh(raw / 30.0), 0.6)


def test_peaked_rows_are_peaked_where_random_rows_are_flat():
    """The fixture's premise at a small vocabulary: Gaussian logits h·e_v of random unit-scale vectors under the
    softcap keep a crowded top; the same with the peak rows scaled have low entropy and few survivors."""
    V, H, std = 8192, 64, 0.02
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(V, H, generator=gen) * std
    h = torch.randn(32, H, generator=gen)  # a final hidden state of rms ~1
    flat = row_profile(h @ emb.T, 0.4, cap=30.0)
    ids = peak_ids(V, 0)
    emb[ids] *= peak_scale(H, std)
    peaked = row_profile(h @ emb.T, 0.4, cap=30.0)
    assert peaked["median_entropy"] < 1.0 < flat["median_entropy"]
    assert peaked["survivors_median"] < 20 < flat["survivors_median"]


def test_with_fixtures_names_flat_kinds_as_before():
    assert with_fixtures(["q4", "bf16"], "flat,peaked") == ["q4", "bf16", "q4-peaked", "bf16-peaked"]
    with pytest.raises(ValueError, match="fixtures"):
        with_fixtures(["q4"], "flat,bumpy")
