"""The early-stop rules' one-kernel update (ops/stop_code.py), interpreted on the CPU, against the torch
DeviceStopRules and the host StopRules: every rule, the pad gate, stability windows 0-3, step by step."""

import random

import pytest
import torch

from diffgemma.ops import stop_code
from diffgemma.sampling.stops import REASONS, DeviceStopRules, StopRules

pytestmark = pytest.mark.skipif(not stop_code.HAVE_TRITON, reason="needs Triton (interpreter)")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_fused_update_is_the_torch_update_step_by_step():
    stops_seen = set()
    for _ in range(150):
        kw = dict(max_steps=random.randint(1, 20), stability_threshold=random.randint(0, 3),
                  confidence_threshold=random.choice([0.005, 0.3, 1.0]), plateau_steps=random.choice([0, 2, 3]),
                  plateau_entropy=random.choice([0.05, 0.5]), entropy_stop=random.choice([0.0, 0.1, 0.4]),
                  entropy_stop_min_steps=random.randint(1, 6), pad_gate=random.random() < 0.5, pad_ids=(0, 9))
        C = random.choice([6, 7, 16])
        host = StopRules(**kw)
        torch_rules, fused = DeviceStopRules(fused=False, **kw), DeviceStopRules(fused=True, **kw)
        pool = [torch.randint(0, 10, (C,)) for _ in range(2)] + [torch.tensor([0, 9] * (C // 2) + [0] * (C % 2))]
        near = pool[0].clone()
        near[random.randrange(C)] += 1  # one position off: not stable
        pool.append(near)
        masks = [torch.rand(C) > 0.5 for _ in range(2)]
        masks.append(masks[0].clone())
        masks[2][random.randrange(C)] ^= True  # one position off: breaks the run
        for step in range(1, kw["max_steps"] + 1):
            argmax, mask = random.choice(pool), random.choice(masks)
            h = (torch.rand(C) * random.choice([0.001, 0.1, 1.0])).mean().double()
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
