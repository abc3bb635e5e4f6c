"""The sampler batched across lanes (ops/lane_temps.py, StepStats.batch, SparsePlan.batch): every lane's numbers are
the bits that lane gets alone. The Triton passes run interpreted at tiny shapes; each lane has its own temperature,
lanes may be ragged and lie in any order in one buffer, or in separate tensors."""

import random

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import rowstats, softcap, survivor_list, tempered_tables
from diffgemma.ops.lane_temps import LaneTemps, shared_rows
from diffgemma.sampling import stats as stats_mod
from diffgemma.sampling.schedule import temperature_value
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.sampling.stats import StepStats

FIELDS = ("entropy", "argmax", "rowmax", "lse")


def _temps(n):
    return [temperature_value(random.randint(1, 48), 48, 0.4, 0.8) if random.random() < 0.8 else 1.0
            for _ in range(n)]


def _rows(rows, vocab, raw):
    x = torch.tanh(torch.randn(rows, vocab) * 3) * 30
    x[0, random.randrange(vocab)] = 40.0  # a confident row
    if rows > 2:
        j, k = random.sample(range(vocab), 2)
        x[1, j] = x[1, k] = 35.0  # a tie: the lower index wins
        x[2] = random.uniform(-3, 3)  # a flat row
    return (x * 2).to(torch.bfloat16) if raw else x


@pytest.fixture
def kernels(monkeypatch):
    """The fused path with its kernels, interpreted."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod in (rowstats, softcap, tempered_tables, stats_mod, survivor_list):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    from diffgemma.ops import sc_gather
    monkeypatch.setattr(sc_gather, "use_triton", lambda t: True)


def _layout(lengths, gaps=True):
    """A buffer holding lanes of `lengths` rows in a random order, maybe with gap rows: (rows, starts)."""
    order = random.sample(range(len(lengths)), len(lengths))
    starts, at = [0] * len(lengths), 0
    for i in order:
        at += gaps and random.random() < 0.3  # a gap row no lane reads
        starts[i] = at
        at += lengths[i]
    return at, starts


@pytest.mark.parametrize("raw", [False, True])
def test_row_passes_with_lane_temperatures_are_each_lane_alone(raw):
    """Each pass over all lanes' rows (LaneTemps) gives, at each lane's rows, the bits of the pass over that lane
    alone with its temperature as a number (LANES off), across segment boundaries."""
    vocab, block, segment, cap = 700, 64, 256, (30.0 if raw else None)
    lengths = [random.randint(1, 4) for _ in range(random.randint(2, 4))]
    temps = _temps(len(lengths))
    rows, starts = _layout(lengths)
    x = _rows(rows, vocab, raw)
    lanes = LaneTemps(temps, starts, lengths, rows, x.device)
    got = rowstats.tempered_rowstats_triton(x, lanes, block=block, segment=segment, cap=cap)
    thr = got[2] - random.uniform(1.0, 8.0)
    mask, counts = rowstats.tempered_survivors_triton(x, lanes, thr, block=block, segment=segment, cap=cap)
    probs, n_kept = rowstats.tempered_masked_probs_triton(x, lanes, thr, got[3], torch.bfloat16, block=block,
                                                          segment=segment, count=True, cap=cap)
    for t, sl in zip(temps, lanes.spans()):
        alone = rowstats.tempered_rowstats_triton(x[sl], t, block=block, segment=segment, cap=cap)
        for a, b in zip(got, alone):
            assert torch.equal(a[sl], b)
        m, c = rowstats.tempered_survivors_triton(x[sl], t, thr[sl], block=block, segment=segment, cap=cap)
        assert torch.equal(mask[sl], m) and torch.equal(counts[sl], c) and torch.equal(n_kept[sl], c)
        p = rowstats.tempered_masked_probs_triton(x[sl], t, thr[sl], alone[3], torch.bfloat16, block=block,
                                                  segment=segment, cap=cap)
        assert torch.equal(probs[sl], p)
    # the twins (on raw logits: of the kernel's softcap, the table's): exact values and masks, entropy / lse within
    # float rounding
    capped = tempered_tables.softcap_lookup(x, cap) if raw else x
    ref = rowstats.tempered_rowstats_ref(capped, lanes)
    for sl in lanes.spans():
        assert torch.equal(got[1][sl], ref[1][sl]) and torch.equal(got[2][sl], ref[2][sl])
        assert torch.allclose(got[0][sl], ref[0][sl], atol=5e-5) and torch.allclose(got[3][sl], ref[3][sl], atol=1e-5)
    assert torch.equal(rowstats.tempered_survivors_ref(capped, lanes, thr)[0], mask)


def test_lane_tables_are_each_temperatures_tempered_table(kernels):
    raw = torch.zeros(3, 8, dtype=torch.bfloat16)
    temps = [0.5, 0.625, 0.75]
    lanes = LaneTemps(temps, [2, 0, 1], [1, 1, 1], 3, raw.device)  # the lanes listed out of row order
    assert lanes.row_order_temps == (0.625, 0.75, 0.5) and lanes.row_lane.tolist() == [0, 1, 2]
    assert torch.equal(lanes.row_temps(), torch.tensor([0.625, 0.75, 0.5]))
    tables = tempered_tables.lane_tables(30.0, lanes, raw)
    assert tables.shape == (3, 65536)
    for t, row in zip(lanes.row_order_temps, tables):
        want = tempered_tables.tempered_table(30.0, t, raw)
        assert torch.equal(row.isnan(), want.isnan()) and torch.equal(row.nan_to_num(), want.nan_to_num())


def _lane_views(kind, lengths, vocab, raw, gaps=True):
    """B lanes' logits: one [B, C, V] tensor, views of one buffer in any order, or separate tensors."""
    if kind == "stacked":
        return _rows(len(lengths) * lengths[0], vocab, raw).view(len(lengths), lengths[0], vocab)
    if kind == "views":
        rows, starts = _layout(lengths, gaps)
        buf = _rows(rows, vocab, raw)
        return [buf[a: a + n] for a, n in zip(starts, lengths)]
    return [_rows(n, vocab, raw) for n in lengths]


@pytest.mark.parametrize("kind", ["stacked", "views", "separate"])
@pytest.mark.parametrize("raw", [False, True])
def test_step_stats_batch_is_each_lane_alone(kernels, kind, raw):
    vocab, cap = 333, (30.0 if raw else None)
    B = random.randint(2, 4)
    lengths = [random.randint(3, 5)] * B if kind == "stacked" else [random.randint(1, 5) for _ in range(B)]
    logits = _lane_views(kind, lengths, vocab, raw)
    temps = _temps(B)
    batch = StepStats.batch(logits, temps, cap=cap)
    for i, s in enumerate(batch):
        alone = StepStats(logits[i], temps[i], cap=cap)
        assert s.fused and alone.fused and s.temp == temps[i] and s.cap == alone.cap
        for f in FIELDS:
            assert torch.equal(getattr(s, f), getattr(alone, f)), (i, f)
        assert torch.equal(s.processed, alone.processed) and torch.equal(s.max_prob(), alone.max_prob())
    again = StepStats.batch(logits, temps, cap=cap)
    for z, s in zip(StepStats.processed_batch(again), batch):  # one softcap and one division for all lanes
        assert torch.equal(z, s.processed)
    assert (batch[0].shared is None) == (kind == "separate")  # separate tensors: lane by lane, no copy
    if kind != "separate":  # the lanes' processed logits are views of one tensor
        assert len({z.untyped_storage().data_ptr() for z in StepStats.processed_batch(again)}) == 1


@pytest.mark.parametrize("raw", [False, True])
def test_step_stats_batch_on_the_torch_path_is_each_lane_alone(raw):
    B, vocab, cap = 3, 97, (30.0 if raw else None)
    logits = _lane_views("views", [random.randint(1, 4) for _ in range(B)], vocab, raw)
    temps = _temps(B)
    for i, s in enumerate(StepStats.batch(logits, temps, cap=cap)):
        alone = StepStats(logits[i], temps[i], cap=cap)
        assert not s.fused and torch.equal(s.entropy, alone.entropy) and torch.equal(s.argmax, alone.argmax)
        assert torch.equal(s.processed, alone.processed)


def test_shared_rows_reads_one_buffer_in_place_or_declines():
    buf = torch.randn(9, 5)
    rows, starts = shared_rows([buf[4:7], buf[1:3]])
    assert rows.data_ptr() == buf[1].data_ptr() and rows.shape == (6, 5) and starts == [3, 0]
    assert torch.equal(rows[3:6], buf[4:7])
    for lanes in ([buf[0:3], buf[2:4]], [buf[0:2], torch.randn(2, 5)], [buf[:, :4], buf[2:4, :4]]):
        assert shared_rows(lanes) is None  # overlapping, not one buffer, not contiguous
    with pytest.raises(TensorError, match="one V"):
        shared_rows([buf[0:2], torch.randn(2, 4)])


def test_batch_refuses_what_it_cannot_serve():
    x = torch.randn(2, 3, 11)
    with pytest.raises(TensorError, match="one temperature per lane"):
        StepStats.batch(x, [0.5])
    with pytest.raises(TensorError, match="lie within"):
        LaneTemps([0.5], [1], [3], 3, "cpu")
    with pytest.raises(TensorError, match="positive"):
        LaneTemps([0.0], [0], [3], 3, "cpu")
    with pytest.raises(TensorError, match="covers 4 rows"):
        rowstats.tempered_rowstats_triton(x[0], LaneTemps([0.5], [0], [2], 4, "cpu"))


def _plans_equal(a, b):
    """a: a batch's plan, b: the solo plan. A plan of a batch's shared survivor count holds no mask (its survivors are
    listed by the gather: the soft embeddings compare them); the solo plan's is the twin's."""
    for f in ("thr", "log_z", "row_counts", "count"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    if a.shared is not None and a.shared.seg_counts is not None:
        assert a.mask is None and b.mask is not None
        want = rowstats.tempered_survivors_ref(b.stats.logits, b.stats.temp, b.thr, b.stats.cap)[0]
        assert torch.equal(b.mask, want)
    else:
        assert (a.mask is None) == (b.mask is None) and (a.mask is None or torch.equal(a.mask, b.mask))
    assert (a.probs is None) == (b.probs is None) and (a.probs is None or torch.equal(a.probs, b.probs))


@pytest.mark.parametrize("bet", ["gather", "dense"])
@pytest.mark.parametrize("raw", [False, True])
def test_sparse_plan_batch_is_each_lane_alone(kernels, monkeypatch, bet, raw):
    """Plans of a batch (one survivor or counted-probability pass over all lanes) and their soft embeddings (one
    gather for all lanes, or each lane's dense product) against each lane's solo plan, bit for bit."""
    vocab, hidden, cap = 300, 8, (30.0 if raw else None)
    B = random.randint(2, 3)
    equal = random.random() < 0.5
    lengths = [random.randint(2, 4)] * B if equal else [random.randint(2, 4) for _ in range(B)]
    logits = _lane_views("views", lengths, vocab, raw, gaps=False)
    temps = _temps(B)
    ratios = [random.uniform(1.0, 6.0)] * B if random.random() < 0.5 else [random.uniform(1.0, 6.0) for _ in range(B)]
    emb = torch.randn(vocab, hidden)
    dense = [torch.float32 if bet == "dense" else None] * B
    batch = StepStats.batch(logits, temps, cap=cap)
    alone = [StepStats(x, t, cap=cap) for x, t in zip(logits, temps)]
    plans = SparsePlan.batch(batch, ratios, dense)
    solo = [SparsePlan(s, r, dense_dtype=d) for s, r, d in zip(alone, ratios, dense)]
    assert all(p.shared is plans[0].shared for p in plans)  # one pass served them
    for p, q in zip(plans, solo):
        _plans_equal(p, q)
    counts = [int(q.count) for q in solo]
    order = random.sample(range(B), B)
    assert SparsePlan.counts_batch([plans[i] for i in order]).tolist() == [counts[i] for i in order]
    assert [int(p.count) for p in plans] == counts
    if len(set(lengths)) == 1 and (raw or bet == "dense"):  # one sum over all rows gave every lane's count
        assert len({p.count.untyped_storage().data_ptr() for p in plans}) == 1
    if bet == "dense":
        monkeypatch.setattr(SparsePlan, "gather_bytes_limit", 0)
        for p in plans + solo:
            p.start(emb, 3.0)
    got = SparsePlan.soft_embed_batch(plans, counts, emb, 3.0)
    want = [q.soft_embed(n, emb, 3.0) for q, n in zip(solo, counts)]
    for g, w, p, q in zip(got, want, plans, solo):
        assert torch.equal(g, w) and p.took_dense == q.took_dense == (bet == "dense")
    if bet == "gather" and raw:  # one gather served all lanes
        assert plans[0].shared.shared.whole and plans[0].shared.seg_counts is not None
    elif bet == "gather":  # f32 logits: a row pass without group maxima (stats.with_groups), plans lane by lane
        assert all(p.shared is None for p in plans)


def test_sparse_plan_batch_falls_back_lane_by_lane_with_the_same_bits(kernels):
    """Mixed bets, or stats not from one batch: plans made one by one, still each lane's solo plan."""
    logits = _lane_views("views", [2, 3], 200, True)  # raw: the row pass makes group maxima
    temps, cap = _temps(2), 30.0
    batch = StepStats.batch(logits, temps, cap=cap)
    buf = torch.cat([logits[0], torch.randn(1, 200).bfloat16(), logits[1]])  # a gap row between the lanes
    gapped = StepStats.batch([buf[:2], buf[3:]], temps, cap=cap)
    plans = SparsePlan.batch(gapped, [4.0, 4.0])
    assert not gapped[0].shared.whole and plans[0].shared is not None
    counts = [int(p.count) for p in plans]
    emb = torch.randn(200, 8)
    want = [SparsePlan(StepStats(x, t, cap=cap), 4.0).soft_embed(n, emb, 2.0)
            for x, t, n in zip(logits, temps, counts)]
    assert all(torch.equal(a, b) for a, b in zip(SparsePlan.soft_embed_batch(plans, counts, emb, 2.0), want))
    mixed = SparsePlan.batch(batch, [4.0, 4.0], [torch.float32, None])
    assert all(p.shared is None for p in mixed)
    for p, s in zip(mixed, [SparsePlan(StepStats(x, t, cap=cap), 4.0, dense_dtype=d)
                            for x, t, d in zip(logits, temps, [torch.float32, None])]):
        _plans_equal(p, s)
    with pytest.raises(TensorError, match="one log ratio"):
        SparsePlan.batch(batch, [4.0])


def test_accept_masks_in_one_launch_are_each_lane_alone(monkeypatch):
    """The accept rule over all lanes' entropies (views of one [R], as StepStats.batch leaves them), each lane its own
    bound, some at their final step: one program per lane, each the solo kernel's mask bit for bit."""
    from diffgemma.sampling import accept
    from diffgemma.ops import sorted_prefix

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(accept, "use_triton", lambda t: True)
    launches = []
    inner = sorted_prefix.sorted_prefix_lanes_triton
    monkeypatch.setattr(accept, "sorted_prefix_lanes_triton", lambda *a: launches.append(1) or inner(*a))
    for lengths in ([40, 40, 40], [33, 64, 50, 41]):  # one next power of two: one launch
        h = (torch.randint(0, 40, (sum(lengths) + 3,)).float() / 64)  # multiples of 1/64: ties
        rows, starts = _layout(lengths, gaps=True)
        buf = torch.zeros(rows + 1)
        lanes = [buf[a: a + n] for a, n in zip(starts, lengths)]
        for x in lanes:
            x.copy_(h[: x.shape[0]][torch.randperm(x.shape[0])])
        bounds = [random.choice([0.0, 1 / 64, 0.5, 3.0]) for _ in lengths]
        finals = [random.random() < 0.3 for _ in lengths]
        before = len(launches)
        got = accept.accept_masks(lanes, bounds, finals)
        assert len(launches) == before + 1
        for g, x, b, f in zip(got, lanes, bounds, finals):
            assert torch.equal(g, accept.accept_mask(x, b, final_step=f))
            assert torch.equal(g, accept.accept_mask_frozen_reference(x, b, torch.zeros_like(g)) & (not f))
    # lengths of two powers of two, or a frozen lane: lane by lane, the same masks
    lanes = [torch.rand(40), torch.rand(70)]
    assert all(torch.equal(g, accept.accept_mask(x, 0.3)) for g, x in
               zip(accept.accept_masks(lanes, [0.3, 0.3], [False, False]), lanes))
    frozen = [torch.rand(40) < 0.3, None]
    got = accept.accept_masks([lanes[0], lanes[0]], [0.3, 0.3], [False, False], frozen)
    assert torch.equal(got[0], accept.accept_mask(lanes[0], 0.3, frozen=frozen[0]))
    with pytest.raises(TensorError, match="one bound"):
        accept.accept_masks(lanes, [0.3], [False, False])


@pytest.mark.parametrize("raw", [False, True])
def test_mixed_bets_and_counts_share_one_pass_and_one_gather(kernels, monkeypatch, raw):
    """Lanes betting dense beside lanes betting on the gather, and counts that send some of the latter to the dense
    product after all: the gather-bet lanes share one survivor pass, those whose count takes the gather share one
    gather, and every lane's soft embedding is its solo plan's bits."""
    vocab, hidden, cap, B = 300, 8, (30.0 if raw else None), 5
    logits = _lane_views("views", [3] * B, vocab, raw, gaps=False)
    temps = _temps(B)
    dense = [torch.float32 if k in (1, 3) else None for k in range(B)]
    emb = torch.randn(vocab, hidden)
    batch = StepStats.batch(logits, temps, cap=cap)
    plans = SparsePlan.batch(batch, [5.0] * B, dense)
    assert [p.shared is not None for p in plans] == [d is None and raw for d in dense]  # f32: lane by lane
    solo = [SparsePlan(StepStats(x, t, cap=cap), 5.0, dense_dtype=d) for x, t, d in zip(logits, temps, dense)]
    counts = [int(q.count) for q in solo]
    assert [int(p.count) for p in plans] == counts
    # the gather limit between the gather-bet lanes' counts: the largest of them goes dense
    top = max(counts[k] for k in range(B) if dense[k] is None)
    monkeypatch.setattr(SparsePlan, "gather_bytes_limit", (top - 1) * hidden * 4 if top > 1 else 10**9)
    got = SparsePlan.soft_embed_batch(plans, counts, emb, 2.0)
    want = [q.soft_embed(n, emb, 2.0) for q, n in zip(solo, counts)]
    for k, (g, w, p, q) in enumerate(zip(got, want, plans, solo)):
        assert torch.equal(g, w), k
        assert p.took_dense == q.took_dense
    gathered = [k for k in range(B) if dense[k] is None and not plans[k].took_dense]
    assert all(plans[k].mask is None for k in gathered)  # one list of the shared count served them: no mask made
