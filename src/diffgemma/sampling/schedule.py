"""The linear temperature schedule (ARCHITECTURE.md §6.1).

T = t_min + (t_max - t_min) * cur / max_steps, where `cur` counts DOWN from max_steps to 1: the first
step runs at t_max, the last at t_min + (t_max - t_min) / max_steps. The temperature divides the
logits before entropy, accept, stop and self-conditioning; it never changes an argmax commit.

It is computed as a float32 tensor the way transformers does (int32 step / max in float32), so the
"hf" semantics divides by the bit-identical temperature.
"""

from __future__ import annotations

import torch


def temperature(cur: int, max_steps: int, t_min: float, t_max: float) -> torch.Tensor:
    """0-d float32 temperature for the step with `cur` steps remaining (cur = max_steps .. 1)."""
    if not 1 <= cur <= max_steps:
        raise ValueError(f"temperature: cur={cur} must be in [1, {max_steps}]")
    return t_min + (t_max - t_min) * (torch.tensor(cur, dtype=torch.int32) / max_steps)


def remaining(step: int, max_steps: int) -> int:
    """`cur` for the 1-based executed step number: step 1 -> max_steps, step max_steps -> 1."""
    return max_steps - step + 1
