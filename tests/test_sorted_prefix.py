"""The accept rule's one-kernel sorted prefix (ops/sorted_prefix.py), interpreted on the CPU, against the torch
rule (sampling/accept.py) and its plain-Python twin: ties, frozen positions, a NaN entropy, canvases that are
not a power of two. Entropies are multiples of 1/64 (sums exact in f32, so no prefix lies within rounding of
the bound, where the kernel's tree sum and the twin's scan may differ), plus random floats away from it."""

import random

import pytest
import torch

from diffgemma.ops import sorted_prefix
from diffgemma.sampling import accept
from diffgemma.sampling.accept import accept_mask_frozen_reference, accept_mask_reference

pytestmark = pytest.mark.skipif(not sorted_prefix.HAVE_TRITON, reason="needs Triton (interpreter)")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _entropies(n):
    if random.random() < 0.5:
        return torch.randint(0, 40, (n,)).float() / 64  # many ties, exact sums
    return torch.rand(n) * random.choice([0.05, 0.5, 3.0])


def test_kernel_is_the_torch_rule_and_the_python_twin():
    for _ in range(60):
        n = random.choice([1, 5, 37, 64, 200, 256])
        h = _entropies(n)
        bound = random.choice([0.0, 1 / 64, 0.1, 0.5, 3.0])
        got = sorted_prefix.sorted_prefix_triton(h, bound)
        assert got.dtype == torch.bool and got.shape == (n,)
        assert torch.equal(got, accept._sorted_prefix(h, bound, stable=True))
        assert got.tolist() == accept_mask_reference(h.tolist(), bound)


def test_kernel_with_frozen_positions_is_the_subset_rule():
    for _ in range(60):
        n = random.choice([3, 37, 256])
        h = _entropies(n)
        frozen = torch.rand(n) < random.random()
        bound = random.choice([0.0, 1 / 64, 0.1, 1.0])
        got = sorted_prefix.sorted_prefix_triton(h, bound, frozen)
        assert torch.equal(got, accept_mask_frozen_reference(h, bound, frozen))


def test_nan_entropy_is_never_accepted():
    h = torch.tensor([0.25, float("nan"), 0.0, 0.5])
    got = sorted_prefix.sorted_prefix_triton(h, 10.0)
    assert got.tolist() == [True, False, True, True] == accept._sorted_prefix(h, 10.0).tolist()


def test_accept_mask_dispatches_to_the_kernel(monkeypatch):
    calls = []
    real = accept.sorted_prefix_triton
    monkeypatch.setattr(accept, "use_triton", lambda t: True)
    monkeypatch.setattr(accept, "sorted_prefix_triton", lambda *a: calls.append(1) or real(*a))
    h = _entropies(50)
    assert torch.equal(accept.accept_mask(h, 0.1), accept._sorted_prefix(h, 0.1, stable=True)) and calls
    assert not accept.accept_mask(h, 0.1, final_step=True).any()  # the final step accepts nothing, no kernel
