"""The sparse SC's survivors counted and listed from the row pass's group maxima (ops/survivor_list.py) against their
torch twins, interpreted at tiny shapes: ties at the threshold, -inf and NaN columns, a row of -inf only, rows with no
plan (+inf threshold), a partial last segment, (row, segment)s left out; and through SparsePlan.batch, lanes whose
survivors overflow the gather's cap go to the dense product with their solo bits."""

import random

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import rowstats, sc_gather, softcap, survivor_list, tempered_tables
from diffgemma.ops.lane_temps import LaneTemps
from diffgemma.sampling import stats as stats_mod
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.sampling.stats import StepStats

BLOCK, SEGMENT = 64, 256  # 2 groups of 32 columns a block, 4 blocks a segment


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod in (rowstats, softcap, tempered_tables, stats_mod, survivor_list, sc_gather):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)


def _logits(x: torch.Tensor, raw: bool) -> torch.Tensor:
    """Raw bf16 logits, or f32 ones softcapped but for -inf."""
    return x.to(torch.bfloat16) if raw else torch.where(x.isinf(), x, torch.tanh(x / 30) * 30)


def _peaked(rows: int, vocab: int) -> torch.Tensor:
    """A few tokens a row far above a Gaussian crowd."""
    x = torch.randn(rows, vocab) * 2
    for r in range(rows):
        x[r, random.sample(range(vocab), 3)] = 20 + 4 * torch.rand(3)
    return x


def _rows(rows: int, vocab: int, raw: bool) -> torch.Tensor:
    """Peaked rows, a flat row, a tie, -inf and NaN columns, a row of -inf."""
    x = _peaked(rows, vocab)
    x[1, :] = torch.randn(vocab) * 0.1  # flat: most columns survive
    j, k = random.sample(range(vocab), 2)
    x[2, j] = x[2, k] = 30.0  # a tie at the top
    x[3, random.sample(range(vocab), vocab // 3)] = -float("inf")
    x[4, random.randrange(vocab)] = float("nan")
    x[5, :] = -float("inf")
    return _logits(x, raw)


def _lanes(rows: int) -> LaneTemps:
    cut = random.randint(1, rows - 1)
    return LaneTemps([0.4, 0.75], [cut, 0], [rows - cut, cut], rows, "cpu")


@pytest.mark.parametrize("raw", [False, True])
def test_group_maxima_are_their_twins_and_leave_the_row_stats_alone(raw):
    rows, vocab, cap = 7, 700, (30.0 if raw else None)  # 700 columns: a partial last segment and block
    x, lanes = _rows(rows, vocab, raw), _lanes(rows)
    with_groups = rowstats.tempered_rowstats_triton(x, lanes, block=BLOCK, segment=SEGMENT, cap=cap, groups=True)
    plain = rowstats.tempered_rowstats_triton(x, lanes, block=BLOCK, segment=SEGMENT, cap=cap)
    for a, b in zip(with_groups[:4], plain):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    capped = tempered_tables.softcap_lookup(x, cap) if raw else x
    want = rowstats.group_maxima_ref(capped, lanes, block=BLOCK, segment=SEGMENT)
    assert with_groups[4].shape == (rows, 3, BLOCK // rowstats.GROUP) and torch.equal(with_groups[4], want)
    if not raw:  # a row of -inf only (raw ones are softcapped to -cap)
        assert want[5].eq(-float("inf")).all()


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("vocab", [700, 768])  # a partial last segment, or whole segments only (unmasked loads)
def test_survivor_counts_and_list_are_the_masks(raw, vocab):
    rows, cap = 7, (30.0 if raw else None)
    x, lanes = _rows(rows, vocab, raw), _lanes(rows)
    *stats, gmax = rowstats.tempered_rowstats_triton(x, lanes, block=BLOCK, segment=SEGMENT, cap=cap, groups=True)
    thr = stats[2] - random.uniform(2.0, 8.0)
    thr[6] = float("inf")  # a row that makes no plan
    capped = tempered_tables.softcap_lookup(x, cap) if raw else x
    z = capped / lanes.row_temps()[:, None]
    tie = random.randrange(vocab)  # a value exactly at its row's threshold survives
    thr[0] = z[0, tie]
    kw = dict(block=BLOCK, segment=SEGMENT, cap=cap)
    counts = survivor_list.survivor_counts_triton(x, lanes, thr, gmax, **kw)
    twin = dict(block=BLOCK, segment=SEGMENT)  # on raw logits: of the kernel's softcap, the table's
    assert torch.equal(counts, survivor_list.survivor_counts_ref(capped, lanes, thr, **twin))
    mask, row_counts = rowstats.tempered_survivors_triton(x, lanes, thr, block=BLOCK, segment=SEGMENT, cap=cap)
    assert torch.equal(counts.sum(-1, dtype=torch.int32), row_counts) and bool(mask[0, tie])
    assert counts[6].sum() == 0 and counts[5].sum() == vocab  # +inf: none; a row of -inf: thr -inf, all survive
    assert counts[1].sum() > vocab // 2  # the flat row
    left = counts.clone()
    left[random.randrange(rows)] = 0  # a lane's rows left out of the list
    left[random.randrange(rows), random.randrange(left.shape[1])] = 0
    n = int(left.sum())
    got = survivor_list.survivor_list_triton(x, lanes, thr, gmax, left, n, **kw)
    want = survivor_list.survivor_list_ref(capped, lanes, thr, left, n, **twin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    keep = mask.clone()
    for r, s in (left == 0).nonzero().tolist():
        keep[r, s * SEGMENT:(s + 1) * SEGMENT] = False
    rows_, cols = got[:2]
    assert torch.equal(torch.stack([rows_, cols], 1), keep.nonzero())  # the mask's nonzero, in row-major order
    assert torch.equal(got[2], z[rows_, cols])  # z as the solo gather makes it: softcap(value) / T


def test_survivor_passes_refuse_maxima_of_another_pass():
    x, thr = torch.randn(2, 300), torch.zeros(2)
    with pytest.raises(TensorError, match="group maxima must be"):
        survivor_list.survivor_counts(x, 0.5, thr, torch.zeros(2, 1, 3))
    with pytest.raises(TensorError, match="counts must be"):
        survivor_list.survivor_list(x, 0.5, thr, torch.zeros(2, 1, 64), torch.zeros(2, 3, dtype=torch.int32), 0)


@pytest.mark.parametrize("raw", [False, True])
def test_plans_past_the_gather_cap_go_dense_with_their_solo_bits(monkeypatch, raw):
    """A batch whose lanes' counts straddle the gather's cap: those past it take the dense product, the others share
    one survivor list; every lane's count and soft embedding are its solo plan's bits."""
    B, C, vocab, hidden, cap = 4, 3, 700, 8, (30.0 if raw else None)
    x = _peaked(B * C, vocab)
    x[C: 2 * C] = torch.randn(C, vocab) * 0.1  # lane 1: flat rows, its count far past the cap
    j, k = random.sample(range(vocab), 2)
    x[2 * C, j] = x[2 * C, k] = 30.0  # a tie at the top
    x[3 * C, random.sample(range(vocab), vocab // 3)] = -float("inf")
    buf = _logits(x, raw)
    lanes = list(buf.split(C))
    temps = [0.4, 0.8, 0.55, 0.7]
    emb = torch.randn(vocab, hidden)
    batch = StepStats.batch(lanes, temps, cap=cap)
    plans = SparsePlan.batch(batch, [6.0] * B)
    solo = [SparsePlan(StepStats(x, t, cap=cap), 6.0) for x, t in zip(lanes, temps)]
    counts = [int(q.count) for q in solo]
    assert SparsePlan.counts_batch(plans).tolist() == counts
    monkeypatch.setattr(SparsePlan, "gather_bytes_limit", (sorted(counts)[-2] + 1) * hidden * 4)
    got = SparsePlan.soft_embed_batch(plans, counts, emb, 2.0)
    want = [q.soft_embed(n, emb, 2.0) for q, n in zip(solo, counts)]
    assert [p.took_dense for p in plans] == [q.took_dense for q in solo] and plans[1].took_dense
    assert sum(p.took_dense for p in plans) == 1
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("case", ["fits", "small", "dense", "unread"])
def test_batch_gather_ahead_of_the_read_is_the_gather_after_it(monkeypatch, case):
    """A batch's gather queued before the status read (SparsePlan.batch_ahead_rows slots a row, padded past the count):
    when every plan's count as read fits the list, soft_embed_batch returns its rows, each lane's solo bits; when the
    list is too small ("small"), a lane's count sends it to the dense product ("dense") or a plan's count was never
    read ("unread"), the sums after the read, the same bits."""
    B, C, vocab, hidden, cap = 3, 4, 700, 8, 30.0
    x = _peaked(B * C, vocab)
    if case == "dense":
        x[C: 2 * C] = torch.randn(C, vocab) * 0.1  # lane 1: flat rows, its count far past the cap
    lanes = list(_logits(x, True).split(C))
    temps = [0.4, 0.8, 0.55]
    emb = torch.randn(vocab, hidden)
    if case == "small":
        monkeypatch.setattr(SparsePlan, "batch_ahead_rows", 1)  # 3 survivors a row: more than one slot a row
    plans = SparsePlan.batch(StepStats.batch(lanes, temps, cap=cap), [6.0] * B)
    group = plans[0].shared
    assert all(p.shared is group and p.speculative for p in plans)
    assert group.ahead == B * C * SparsePlan.batch_ahead_rows
    counts = SparsePlan.counts_batch(plans).tolist()
    if case == "dense":
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", (sorted(counts)[-2] + 1) * hidden * 4)
    for p in plans:
        p.start(emb, 2.0)  # the first queues the group's one gather; the others find it queued
    summed = group.summed
    assert summed is not None and summed.shape == (B * C, hidden)
    for p, n in zip(plans, counts):
        p.read = None if case == "unread" and p is plans[-1] else n
    got = SparsePlan.soft_embed_batch(plans, counts, emb, 2.0)
    want = [SparsePlan(StepStats(v, t, cap=cap), 6.0).soft_embed(n, emb, 2.0) for v, t, n in zip(lanes, temps, counts)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    from_ahead = [g.untyped_storage().data_ptr() == summed.untyped_storage().data_ptr() for g in got]
    assert from_ahead == [case == "fits"] * B if case != "dense" else from_ahead == [False] * B
    assert group.summed is None  # taken: a second round's plans make their own
