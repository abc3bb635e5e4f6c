"""The sampler batched across lanes on the GPU at the real shapes (skips without CUDA): 8 lanes of [256, 262144]
logits, raw bf16 (the engine's denoise_raw, softcapped by the passes' table) and f32, each lane at its own
temperature. StepStats.batch and SparsePlan.batch / soft_embed_batch must give every lane the bits of its solo
StepStats / SparsePlan; and a solo StepStats (the row pass with a lane temperature) the bits of the pass with a
scalar temperature, the form the kernel had before lanes (ops/rowstats.py)."""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.ops import rowstats  # noqa: E402
from diffgemma.ops.survivor_list import survivor_list  # noqa: E402
from diffgemma.sampling.schedule import temperature_value  # noqa: E402
from diffgemma.sampling.self_condition import SparsePlan  # noqa: E402
from diffgemma.sampling.stats import StepStats  # noqa: E402

DEV = "cuda"
B, C, V, H, CAP = 8, 256, 262144, 2816, 30.0
FIELDS = ("entropy", "argmax", "rowmax", "lse")


def _logits(dtype, peaked: bool) -> torch.Tensor:
    """[B·C, V] logits: Gaussian (flat rows), or with a few tokens a row far above the rest (peaked rows)."""
    x = torch.randn(B * C, V, device=DEV) * (1.0 if not peaked else 2.0)
    if peaked:
        hot = torch.randint(0, V, (B * C, 4), device=DEV)
        x.scatter_(1, hot, 20.0 + 4 * torch.rand(B * C, 4, device=DEV))
    return (x * (1.5 if dtype == torch.bfloat16 else 1.0)).to(dtype)


def _temps():
    return [temperature_value(random.randint(1, 16), 16, 0.4, 0.8) for _ in range(B)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("peaked", [False, True])
def test_step_stats_batch_is_each_lane_alone(dtype, peaked):
    buf = _logits(dtype, peaked)
    cap = CAP if dtype == torch.bfloat16 else None
    lanes = list(buf.split(C))
    order = random.sample(range(B), B)  # lanes in another order than the buffer's, as in_caller_order returns them
    lanes, temps = [lanes[i] for i in order], _temps()
    batch = StepStats.batch(lanes, temps, cap=cap)
    assert batch[0].shared is not None and batch[0].shared.rows.data_ptr() == buf.data_ptr()  # read in place
    for s, x, t in zip(batch, lanes, temps):
        alone = StepStats(x, t, cap=cap)
        for f in FIELDS:
            assert torch.equal(getattr(s, f), getattr(alone, f)), f
    for z, s in zip(StepStats.processed_batch(StepStats.batch(lanes, temps, cap=cap)), batch):
        assert torch.equal(z, s.processed)
    stacked = StepStats.batch(buf.view(B, C, V), temps, cap=cap)
    for s, i in zip(stacked, range(B)):
        assert torch.equal(s.entropy, StepStats(buf[i * C:(i + 1) * C], temps[i], cap=cap).entropy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_solo_step_stats_are_the_scalar_temperature_pass(dtype):
    """A solo StepStats runs the row pass in its lane form; its bits are the scalar-temperature form's (the one the
    engine ran before lanes), so solo tokens stay as they were."""
    buf = _logits(dtype, True)
    cap = CAP if dtype == torch.bfloat16 else None
    for x, t in zip(buf.split(C), _temps()):
        alone = StepStats(x, t, cap=cap)
        for f, v in zip(FIELDS, rowstats.tempered_rowstats_triton(x, t, cap=cap)):
            assert torch.equal(getattr(alone, f), v), f


@pytest.mark.parametrize("peaked", [False, True])
def test_sparse_plan_batch_is_each_lane_alone(peaked):
    buf = _logits(torch.bfloat16, peaked)
    lanes, temps = list(buf.split(C)), _temps()
    emb = (torch.randn(V, H, device=DEV) * 0.02).to(torch.bfloat16)
    batch = StepStats.batch(lanes, temps, cap=CAP)
    plans = SparsePlan.batch(batch, [10.0] * B)
    solo = [SparsePlan(StepStats(x, t, cap=CAP), 10.0) for x, t in zip(lanes, temps)]
    counts = [int(q.count) for q in solo]
    assert SparsePlan.counts_batch(plans).tolist() == counts
    group = plans[0].shared
    for p, q in zip(plans, solo):  # the batch's plans hold no mask: their survivors are listed from the group maxima
        assert p.mask is None and torch.equal(p.row_counts, q.row_counts) and torch.equal(p.thr, q.thr)
    n = sum(counts)
    if n <= 4 * 2**20:  # the list of all lanes' survivors is the solo masks' nonzero, row after row
        rows, cols, _ = survivor_list(buf, group.shared.lanes, group.thr, group.shared.groups, group.seg_counts, n,
                                   cap=CAP)
        want = torch.cat([q.mask.nonzero() + torch.tensor([k * C, 0], device=DEV) for k, q in enumerate(solo)])
        assert torch.equal(torch.stack([rows, cols], 1), want)
    got = SparsePlan.soft_embed_batch(plans, counts, emb, 53.0)
    want = [q.soft_embed(n, emb, 53.0) for q, n in zip(solo, counts)]
    assert [p.took_dense for p in plans] == [q.took_dense for q in solo]
    if peaked:
        assert not any(q.took_dense for q in solo)  # the one gather served all lanes
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_dense_bets_batch_is_each_lane_alone():
    buf = _logits(torch.bfloat16, False)
    lanes, temps = list(buf.split(C)), _temps()
    plans = SparsePlan.batch(StepStats.batch(lanes, temps, cap=CAP), [10.0] * B, [torch.bfloat16] * B)
    solo = [SparsePlan(StepStats(x, t, cap=CAP), 10.0, dense_dtype=torch.bfloat16) for x, t in zip(lanes, temps)]
    for p, q in zip(plans, solo):
        assert torch.equal(p.probs, q.probs) and torch.equal(p.row_counts, q.row_counts)


def test_accept_masks_batch_is_each_lane_alone():
    from diffgemma.sampling.accept import accept_mask, accept_masks

    for _ in range(20):
        h = (torch.randint(0, 40, (B * C,), device=DEV).float() / 64)  # multiples of 1/64: exact sums, many ties
        lanes = list(h.split(C))
        bounds = [random.choice([0.0, 1 / 64, 0.1, 0.5, 3.0]) for _ in range(B)]
        finals = [random.random() < 0.2 for _ in range(B)]
        for g, x, b, f in zip(accept_masks(lanes, bounds, finals), lanes, bounds, finals):
            assert torch.equal(g, accept_mask(x, b, final_step=f))


def test_mixed_bets_batch_is_each_lane_alone():
    """Two lanes bet on the dense product (a fresh block's first step), the rest on the gather: one survivor pass
    and one gather serve the latter; every lane's soft embedding is its solo plan's bits."""
    buf = _logits(torch.bfloat16, True)
    lanes, temps = list(buf.split(C)), _temps()
    emb = (torch.randn(V, H, device=DEV) * 0.02).to(torch.bfloat16)
    dense = [torch.bfloat16 if k in (2, 5) else None for k in range(B)]
    plans = SparsePlan.batch(StepStats.batch(lanes, temps, cap=CAP), [10.0] * B, dense)
    solo = [SparsePlan(StepStats(x, t, cap=CAP), 10.0, dense_dtype=d) for x, t, d in zip(lanes, temps, dense)]
    counts = [int(q.count) for q in solo]
    for p in plans + solo:
        p.start(emb, 53.0)
    got = SparsePlan.soft_embed_batch(plans, counts, emb, 53.0)
    for g, q, n in zip(got, solo, counts):
        assert torch.equal(g, q.soft_embed(n, emb, 53.0))
