"""The sparse SC's segmented sum (ops/sc_gather.py): the kernels, interpreted on the CPU, against their chunked
twin bit for bit (same order, separately rounded multiplies and adds) and the index_add_ path, and through
SparsePlan."""

import random

import pytest
import torch

from diffgemma.ops import rowstats, sc_gather, softcap, tempered_tables
from diffgemma.sampling import stats as stats_mod
from diffgemma.sampling.schedule import temperature_value
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.sampling.stats import StepStats

pytestmark = pytest.mark.skipif(not sc_gather.HAVE_TRITON, reason="needs Triton (interpreter)")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_segment_kernels_are_the_chunked_twin_bit_for_bit(interpret, dtype, count_dtype):
    """Rows of 0, 1, a few and several chunks of survivors; H not a multiple of the column block; the row
    counts as the plan's kernels give them (int32) or as torch sums them (int64)."""
    R, V, H, chunk = 7, 400, random.choice([40, 70]), 4
    mask = torch.rand(R, V) < random.uniform(0.02, 0.1)
    mask[random.randrange(R)] = False  # a row with no survivor sums to 0
    one = random.randrange(R)
    mask[one] = False
    mask[one, random.randrange(V)] = True  # a row with one
    mask[random.randrange(R), :40] = True  # a row of many chunks
    rows, cols = mask.nonzero(as_tuple=True)
    w = torch.rand(rows.shape[0]) * 0.9 + 0.05
    emb = torch.randn(V, H).to(dtype)
    counts = mask.sum(-1).to(count_dtype)
    want = sc_gather.segment_embed_chunked_ref(counts, cols, w, emb, chunk)
    got = sc_gather.segment_embed_triton(counts, cols, w, emb, chunk=chunk, block_h=32)
    assert torch.equal(got, want)
    assert torch.equal(want[~mask.any(-1)], torch.zeros_like(want[~mask.any(-1)]))
    # the chunked sum is the index_add_ sum up to the association of the chunks (and equal where a row has
    # at most one chunk)
    plain = sc_gather.segment_embed_ref(rows, cols, w, emb, R, chunk=random.randint(1, 9))
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    small = counts <= chunk
    assert torch.equal(got[small], plain[small])


def test_survivor_lists_reach_the_kernels_aligned(interpret):
    """A survivor list that starts 8 bytes off a 16-byte boundary (a column of CUDA's nonzero_static, whose storage is
    [2, n], for odd n) is copied before the kernels see it, so they run as compiled for aligned lists; an aligned one
    goes as it is. The sum is the same either way."""
    R, V, H = 5, 300, 40
    mask = torch.rand(R, V) < 0.05
    mask[:, random.randrange(V)] = True
    rows, cols = mask.nonzero(as_tuple=True)
    n = len(cols)
    buf = torch.empty(2 * n + 2, dtype=torch.long)
    off = buf[1: n + 1] if buf.data_ptr() % 16 == 0 else buf[2: n + 2]  # a view that starts 8 bytes off
    off.copy_(cols)
    assert off.data_ptr() % 16 == 8
    fixed = sc_gather.aligned(off)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, cols)
    assert sc_gather.aligned(fixed) is fixed
    w, emb, counts = torch.rand(n) + 0.1, torch.randn(V, H), mask.sum(-1).to(torch.int32)
    want = sc_gather.segment_embed_chunked_ref(counts, cols, w, emb, 4)
    assert torch.equal(sc_gather.segment_embed_triton(counts, off, w, emb, chunk=4, block_h=32), want)


def test_segment_embed_refuses_mismatched_survivor_lists():
    with pytest.raises(Exception, match="rows / cols / weights"):
        sc_gather.segment_embed(torch.zeros(3, dtype=torch.long), torch.tensor([3]), torch.zeros(2, dtype=torch.long),
                                torch.zeros(3), torch.zeros(5, 4), cpu_chunk=4)


def test_sparse_plan_gather_through_the_kernel_is_the_torch_gather(interpret, monkeypatch):
    """SparsePlan's gather on the fused data flow with the kernels on (interpreted) equals the same plan with
    the torch twins: the same survivors per row, and sums within one bf16 rounding (the row statistics come from
    the interpreted kernel's exp / log, which numpy computes, not torch: an f32 weight may differ in its last bit,
    and about one seed in twenty then rounds a sum to the neighbouring bf16 value)."""
    vocab, hidden = 300, 24
    x = torch.randn(6, vocab) * 3
    x[:, :4] += 12.0  # peaked rows: a few survivors each
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    emb = torch.randn(vocab, hidden).to(torch.bfloat16)
    plain = SparsePlan(StepStats(x, temp, fused=True), 4.0)
    n = int(plain.count)
    want = plain.soft_embed(n, emb, 3.0)
    for mod in (stats_mod, rowstats, softcap, tempered_tables, sc_gather):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    kernels = SparsePlan(StepStats(x, temp, fused=True), 4.0)
    assert int(kernels.count) == n and 6 <= n < vocab
    assert int(kernels.row_counts.max()) <= sc_gather.CHUNK  # one chunk a row: the same adds as index_add_
    assert torch.equal(kernels.row_counts.long(), plain.row_counts.long())
    got = kernels.soft_embed(n, emb, 3.0).float()
    assert ((got - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()  # one bf16 ulp


def test_sparse_plan_gather_ahead_at_the_cap_is_the_gather_after_the_read(interpret, monkeypatch):
    """sparse_ahead: the gather queued before the status read, its nonzero sized for the most survivors the gather
    takes (padded past the count), gives soft_embed(n)'s sum bit for bit and is what soft_embed returns; when the
    count exceeds that cap the bet is lost (bet_holds false on the device) and soft_embed makes the dense product."""
    vocab, hidden = 300, 24
    x = torch.randn(6, vocab) * 3
    x[:, :4] += 12.0
    x[5] = torch.randn(vocab) * 0.3  # one flat row: many survivors
    temp = temperature_value(random.randint(1, 48), 48, 0.4, 0.8)
    emb = torch.randn(vocab, hidden).to(torch.bfloat16)
    for mod in (stats_mod, rowstats, softcap, tempered_tables, sc_gather):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    stats = StepStats(x, temp, fused=True)
    n = int(SparsePlan(stats, 4.0).count)
    for cap, gathers in ((n + random.randint(0, 50), True), (n - 1, False)):
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", cap * hidden * 4)
        want = SparsePlan(stats, 4.0).soft_embed(n, emb, 3.0)
        ahead = SparsePlan(stats, 4.0, sparse_ahead=True)
        assert ahead.speculative and not ahead.bets_dense
        ahead.start(emb, 3.0)
        product = ahead.product
        assert product is not None and bool(ahead.bet_holds(ahead.count, hidden)) == gathers
        got = ahead.soft_embed(n, emb, 3.0)
        assert torch.equal(got, want) and (got is product) == gathers and ahead.took_dense == (not gathers)
    # past the cap the kernels get counts cut to the listed survivors: no read past the list
    cut = SparsePlan(stats, 4.0)._counts_within(n - 3)
    assert int(cut.sum()) == n - 3 and bool((cut <= SparsePlan(stats, 4.0).row_counts).all())
    whole, counts = SparsePlan(stats, 4.0)._counts_within(n + 3), SparsePlan(stats, 4.0).row_counts
    # in the row counts' dtype: the kernels then run as compiled for the gather after the read (one variant)
    assert whole.dtype == counts.dtype and cut.dtype == counts.dtype and torch.equal(whole, counts)
    # off the kernels (the CPU twin would add the padding) the plan does not gather ahead
    monkeypatch.setattr(sc_gather, "use_triton", lambda t: False)
    assert not SparsePlan(stats, 4.0, sparse_ahead=True).speculative
