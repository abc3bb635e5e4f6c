"""The sparse SC's survivors from the row pass's group maxima (ops/survivor_list.py) on the GPU at a batched round's
shape (skips without CUDA): 8 lanes x 256 rows x 262144 columns, raw bf16 (the engine's denoise_raw) and f32, each lane
at its own temperature. The row pass that stores the group maxima must keep every stat's bits (the form without them
is the one the engine ran before); the counts and the list must be the survivor mask's, bit for bit. Prints, with -s,
the plan's passes before (survivor mask + nonzero_static) and after (counts + list) on peaked and flat rows."""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.ops import rowstats, survivor_list, tempered_tables  # noqa: E402
from diffgemma.ops.lane_temps import LaneTemps  # noqa: E402
from diffgemma.sampling.stats import with_groups  # noqa: E402
from diffgemma.sampling.schedule import temperature_value  # noqa: E402
from test_generate_gpu import timed  # noqa: E402

DEV = "cuda"
B, C, V, CAP = 8, 256, 262144, 30.0


def _logits(dtype, peaked: bool) -> torch.Tensor:
    """[B·C, V]: Gaussian rows (flat), or with a few tokens a row far above the rest (peaked), some -inf columns."""
    x = torch.randn(B * C, V, device=DEV) * (1.0 if not peaked else 2.0)
    if peaked:
        hot = torch.randint(0, V, (B * C, 4), device=DEV)
        x.scatter_(1, hot, 20.0 + 4 * torch.rand(B * C, 4, device=DEV))
        x[:, -3:] = x[:, :3]  # ties
    x = x * (1.5 if dtype == torch.bfloat16 else 1.0)
    if dtype == torch.float32:
        x = torch.tanh(x / CAP) * CAP
        x[::7, ::5] = -float("inf")
    return x.to(dtype)


def _lanes() -> LaneTemps:
    temps = [temperature_value(random.randint(1, 16), 16, 0.4, 0.8) for _ in range(B)]
    return LaneTemps(temps, [k * C for k in range(B)], [C] * B, B * C, DEV)


@pytest.mark.parametrize("peaked", [False, True])
def test_group_maxima_keep_the_row_stats_bits(peaked):
    """For the logits the engine makes them for (raw bf16, softcapped as read: sampling/stats.with_groups); other
    logits take the plain pass, whose bits the group-maxima form is not held to."""
    dtype = torch.bfloat16
    x, lanes = _logits(dtype, peaked), _lanes()
    cap = CAP
    assert with_groups(x, cap) and not with_groups(x.float(), None) and not with_groups(x.float(), cap)
    got = rowstats.tempered_rowstats_triton(x, lanes, cap=cap, groups=True)
    plain = rowstats.tempered_rowstats_triton(x, lanes, cap=cap)
    for a, b in zip(got[:4], plain):
        assert torch.equal(a, b)
    capped = tempered_tables.softcap_lookup(x, cap) if cap is not None else x
    assert torch.equal(got[4], rowstats.group_maxima_ref(capped, lanes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("peaked", [False, True])
def test_counts_and_list_are_the_survivor_mask(dtype, peaked):
    x, lanes = _logits(dtype, peaked), _lanes()
    cap = CAP if dtype == torch.bfloat16 else None
    *stats, gmax = rowstats.tempered_rowstats_triton(x, lanes, cap=cap, groups=True)
    thr = stats[2] - 10.0
    thr[C: 2 * C] = float("inf")  # a lane that makes no plan
    mask, row_counts = rowstats.tempered_survivors_triton(x, lanes, thr, cap=cap)
    counts = survivor_list.survivor_counts(x, lanes, thr, gmax, cap=cap)
    assert torch.equal(counts.sum(-1, dtype=torch.int32), row_counts)
    left = counts.clone()
    left[3 * C: 4 * C] = 0  # a lane left out of the gather
    n = int(left.sum())
    if n > 8 * 2**20:
        pytest.skip(f"{n} survivors: the list would not fit the test's budget")
    rows, cols, z = survivor_list.survivor_list(x, lanes, thr, gmax, left, n, cap=cap)
    mask[3 * C: 4 * C] = False
    assert torch.equal(torch.stack([rows, cols], 1), torch.nonzero_static(mask, size=n))
    values = x[rows, cols] if cap is None else tempered_tables.softcap_lookup(x[rows, cols], cap)
    assert torch.equal(z, values / lanes.row_temps()[rows])  # the z the solo gather makes
    if dtype == torch.bfloat16:
        before = timed(lambda: torch.nonzero_static(rowstats.tempered_survivors_triton(x, lanes, thr, cap=cap)[0],
                                                    size=n))
        after = timed(lambda: survivor_list.survivor_list(
            x, lanes, thr, gmax, survivor_list.survivor_counts(x, lanes, thr, gmax, cap=cap), n, cap=cap))
        with_groups = timed(lambda: rowstats.tempered_rowstats_triton(x, lanes, cap=cap, groups=True))
        plain = timed(lambda: rowstats.tempered_rowstats_triton(x, lanes, cap=cap))
        print(f"\n[survivors {B}x{C}x{V} bf16 {'peaked' if peaked else 'flat'}, {n / (B * C):.1f} a row] mask + "
              f"nonzero_static {before:.3f} ms, counts + list {after:.3f} ms; row pass {plain:.3f} ms, with group "
              f"maxima {with_groups:.3f} ms")
