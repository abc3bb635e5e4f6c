"""The early-stop rules' one-kernel update (ops/stop_code.py), interpreted on the CPU, against the torch
DeviceStopRules and the host StopRules: every rule, the pad gate, stability windows 0-3, step by step."""

import random

import pytest
import torch

from diffgemma.ops import stop_code
from diffgemma.sampling.stops import REASONS, DeviceStopRules, StopRules
from stop_cases import mean_entropy, random_rules, step_pools

pytestmark = pytest.mark.skipif(not stop_code.HAVE_TRITON, reason="needs Triton (interpreter)")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_fused_update_is_the_torch_update_step_by_step():
    stops_seen = set()
    for _ in range(150):
        kw = random_rules()
        C = random.choice([6, 7, 16])
        host = StopRules(**kw)
        torch_rules, fused = DeviceStopRules(fused=False, **kw), DeviceStopRules(fused=True, **kw)
        pool, masks = step_pools(C)
        for step in range(1, kw["max_steps"] + 1):
            argmax, mask = random.choice(pool), random.choice(masks)
            h = mean_entropy(C)
            want = torch_rules.update(step, argmax, h, mask)
            got = fused.update(step, argmax, h, mask)
            assert got.shape == () and got.dtype == torch.int64
            assert int(got) == int(want), (kw, step)
            assert REASONS[int(got)] == host.update(step, argmax, float(h), mask)
            stops_seen.add(REASONS[int(got)])
            if int(got):
                break
    assert stops_seen == set(REASONS)  # every rule fired somewhere, and "keep going"


def test_fused_update_compares_mean_entropy_in_float64():
    f32 = torch.tensor(0.005, dtype=torch.float32)  # rounds below 0.005: below in float64, not in float32
    kw = dict(max_steps=10, stability_threshold=0, confidence_threshold=0.005)
    code = DeviceStopRules(fused=True, **kw).update(1, torch.zeros(3, dtype=torch.long), f32.double(),
                                                    torch.ones(3, dtype=torch.bool))
    assert REASONS[int(code)] == "confident"
