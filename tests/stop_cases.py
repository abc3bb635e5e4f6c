"""Random early-stop cases shared by the stop-rule tests (host vs device rules, the fused kernel interpreted
and on the GPU): settings that make every rule reachable, and per-step inputs that hit their edges."""

import random

import torch


def random_rules() -> dict:
    """StopRules keyword arguments: stability windows 0-3, each rule on or off, the pad gate on half the time."""
    return dict(max_steps=random.randint(1, 20), stability_threshold=random.randint(0, 3),
                confidence_threshold=random.choice([0.005, 0.3, 1.0]), plateau_steps=random.choice([0, 2, 3]),
                plateau_entropy=random.choice([0.05, 0.5]), entropy_stop=random.choice([0.0, 0.1, 0.4]),
                entropy_stop_min_steps=random.randint(1, 6), pad_gate=random.random() < 0.5, pad_ids=(0, 9))


def step_pools(C: int, device="cpu"):
    """(argmax canvases, accept masks) to draw steps from: two random canvases, an all-pad one (ids 0 and 9) and
    one a single position off the first (not stable); two random masks and one a position off the first
    (breaks the run)."""
    canvases = [torch.randint(0, 10, (C,), device=device) for _ in range(2)]
    canvases.append(torch.tensor(([0, 9] * C)[:C], device=device))
    near = canvases[0].clone()
    near[random.randrange(C)] += 1
    canvases.append(near)
    masks = [torch.rand(C, device=device) > 0.5 for _ in range(2)]
    masks.append(masks[0].clone())
    masks[2][random.randrange(C)] ^= True
    return canvases, masks


def mean_entropy(C: int, device="cpu") -> torch.Tensor:
    """A step's mean entropy as the loop passes it: the f32 mean of C entropies, as a 0-d float64 tensor."""
    return (torch.rand(C, device=device) * random.choice([0.001, 0.1, 1.0])).mean().double()
