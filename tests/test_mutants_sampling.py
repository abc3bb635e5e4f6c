"""Edge cases of the sampling rules that the broader tests in test_sampling.py do not pin, each named after the
mutant of tools/mutate.py it kills (docs/MUTATION.md): exact ties in the inverse CDF, masked (-inf) logits in the
entropy, the final step's empty accept mask, the trim's row 0 and right neighbour, the confidence threshold's strict
comparison, and the sparse SC bound's worst row."""

import math

import pytest
import torch

from diffgemma.sampling.accept import accept_mask
from diffgemma.sampling.rng import categorical
from diffgemma.sampling.self_condition import exact_soft_embed, sparse_error_bound, sparse_soft_embed
from diffgemma.sampling.stats import entropy
from diffgemma.sampling.stops import CONFIDENT, StopRules
from diffgemma.sampling.trim import trim_cut


def test_categorical_picks_the_first_token_whose_cdf_exceeds_u_at_exact_ties():
    """u · total landing exactly on a cumulative sum goes past it (a zero-probability token is never drawn, u = 0
    included): [categorical-left]."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.25, 0.5]])  # cdf 0, .25, .25, .5, 1: every value exact in binary
    u = torch.tensor([0.0, 0.25, 0.5, 0.999])
    assert categorical(probs.expand(4, 5), u).tolist() == [1, 3, 4, 4]


def test_entropy_of_rows_with_masked_logits_is_that_of_the_rest():
    """-inf logits (masked tokens) weigh 0, not NaN: [entropy-no-clamp]."""
    logits = torch.randn(4, 30) * 3
    masked = logits.clone()
    masked[:, 20:] = float("-inf")
    h = entropy(masked)
    assert torch.isfinite(h).all()
    torch.testing.assert_close(h.double(), entropy(logits[:, :20].double()), atol=1e-5, rtol=1e-5)


def test_final_step_accepts_nothing_without_a_freeze():
    """[accept-final-step-all]: the final scheduled step leaves the commit to the argmax, accepting no position."""
    h = torch.rand(16)
    assert not accept_mask(h, 100.0, final_step=True).any()
    assert accept_mask(h, 100.0).all()  # the same bound accepts everything on any other step


def test_trim_never_cuts_row_zero_and_sees_the_right_neighbour():
    """[trim-row-zero] row 0 duplicates row 1 and is unsure, yet every block commits it;
    [trim-right-neighbour] an unsure row copying the row after it is a cut."""
    assert trim_cut(torch.tensor([4, 4, 7, 8]), torch.tensor([0.1, 0.99, 0.99, 0.99]), 0.9, 4) is None
    assert trim_cut(torch.tensor([5, 6, 7, 7]), torch.tensor([0.99, 0.99, 0.3, 0.99]), 0.9, 4) == 2


def test_confidence_threshold_is_strict():
    """transformers' StableAndConfidentStoppingCriteria stops on mean entropy < threshold: equal is not confident
    [confident-le]."""
    rules = StopRules(max_steps=48, stability_threshold=0, confidence_threshold=0.25)
    a = torch.arange(8)
    m = torch.ones(8, dtype=torch.bool)
    assert rules.update(1, a, 0.25, m) is None
    assert rules.update(2, a, 0.2499, m) == CONFIDENT


def test_sparse_bound_is_set_by_the_worst_row():
    """The bound is the worst row's tail mass · scale · max|E| [sc-bound-mean], and the one row with a heavy tail
    reaches a good part of it."""
    v, h = 64, 8
    emb = torch.zeros(v, h)
    emb[:, 0] = 1.0  # every embedding row the same: the dropped tail's mass moves output 0 by exactly its size
    emb[0, 0] = -1.0
    logits = torch.full((3, v), -30.0)
    logits[:, 0] = 10.0  # rows 0-1: one survivor, a negligible tail
    logits[2, 1:] = 10.0 - 12.0  # row 2: a tail dropped at log_ratio 10 that holds 4e-4 of the mass
    scale = math.sqrt(h)
    tail = torch.softmax(logits.double(), -1)[:, 1:].sum(-1)
    bound = sparse_error_bound(logits, emb, scale, 10.0)
    assert bound == pytest.approx(float(tail.max()) * scale, rel=1e-6)  # the mean over rows: a third of it
    err = (sparse_soft_embed(logits, emb, scale, 10.0).double() - exact_soft_embed(logits.double(), emb.double(),
                                                                                   scale)).abs().max().item()
    assert 0.5 * bound < err <= bound + 1e-6
