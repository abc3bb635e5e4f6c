"""The generate loop's bookkeeping kernels natively on the GPU (skips without CUDA): the accept mask
(ops/sorted_prefix.py) and the early-stop update (ops/stop_code.py) against their torch twins on the same
device, at the real canvas of 256 and at odd sizes. The CPU tests check the same in the interpreter."""

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.ops import sorted_prefix  # noqa: E402
from diffgemma.sampling import accept  # noqa: E402
from diffgemma.sampling.accept import accept_mask_frozen_reference  # noqa: E402
from diffgemma.sampling.stops import DeviceStopRules  # noqa: E402

DEV = "cuda"


def test_accept_kernel_is_the_torch_rule():
    for _ in range(100):
        n = random.choice([1, 37, 256])
        h = (torch.randint(0, 40, (n,)).float() / 64).to(DEV)  # multiples of 1/64: exact sums, many ties
        bound = random.choice([0.0, 1 / 64, 0.5, 3.0])
        assert torch.equal(sorted_prefix.sorted_prefix_triton(h, bound), accept._sorted_prefix(h, bound, stable=True))
        frozen = torch.rand(n, device=DEV) < random.random()
        assert torch.equal(sorted_prefix.sorted_prefix_triton(h, bound, frozen),
                           accept_mask_frozen_reference(h, bound, frozen))


def test_stop_kernel_is_the_torch_update():
    for _ in range(60):
        kw = dict(max_steps=random.randint(1, 20), stability_threshold=random.randint(0, 3),
                  confidence_threshold=random.choice([0.005, 0.3, 1.0]), plateau_steps=random.choice([0, 2, 3]),
                  plateau_entropy=random.choice([0.05, 0.5]), entropy_stop=random.choice([0.0, 0.1, 0.4]),
                  entropy_stop_min_steps=random.randint(1, 6), pad_gate=random.random() < 0.5, pad_ids=(0, 9))
        C = random.choice([7, 256])
        twin, fused = DeviceStopRules(fused=False, **kw), DeviceStopRules(fused=True, **kw)
        pool = [torch.randint(0, 10, (C,), device=DEV) for _ in range(2)]
        pool.append(torch.tensor(([0, 9] * C)[:C], device=DEV))
        near = pool[0].clone()
        near[random.randrange(C)] += 1
        pool.append(near)
        masks = [torch.rand(C, device=DEV) > 0.5 for _ in range(2)]
        for step in range(1, kw["max_steps"] + 1):
            argmax, mask = random.choice(pool), random.choice(masks)
            h = (torch.rand(C, device=DEV) * random.choice([0.001, 0.1, 1.0])).mean().double()
            want, got = twin.update(step, argmax, h, mask), fused.update(step, argmax, h, mask)
            assert int(got) == int(want), (kw, step)
            if int(got):
                break
