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

from stop_cases import mean_entropy, random_rules, step_pools  # noqa: E402

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
        kw = random_rules()
        C = random.choice([7, 256])
        twin, fused = DeviceStopRules(fused=False, **kw), DeviceStopRules(fused=True, **kw)
        pool, masks = step_pools(C, DEV)
        for step in range(1, kw["max_steps"] + 1):
            argmax, mask = random.choice(pool), random.choice(masks)
            h = mean_entropy(C, DEV)
            want, got = twin.update(step, argmax, h, mask), fused.update(step, argmax, h, mask)
            assert int(got) == int(want), (kw, step)
            if int(got):
                break
