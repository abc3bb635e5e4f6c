"""The linear temperature schedule (docs/ARCHITECTURE.md, 'Generation contract': `t_min`, `t_max`).

T = t_min + (t_max - t_min) * cur / max_steps, where `cur` counts DOWN from max_steps to 1: the first
step runs at t_max, the last at t_min + (t_max - t_min) / max_steps. The temperature divides the
logits before entropy, accept, stop and self-conditioning; it never changes an argmax commit.

It is computed as a float32 tensor the way transformers does (int32 step / max in float32), so the
"hf" semantics divides by the bit-identical temperature.
"""

from __future__ import annotations

import numpy as np
import torch


def temperature(cur: int, max_steps: int, t_min: float, t_max: float) -> torch.Tensor:
    """0-d float32 temperature for the step with `cur` steps remaining (cur = max_steps .. 1)."""
    if not 1 <= cur <= max_steps:
        raise ValueError(f"temperature: cur={cur} must be in [1, {max_steps}]")
    return t_min + (t_max - t_min) * (torch.tensor(cur, dtype=torch.int32) / max_steps)


def remaining(step: int, max_steps: int) -> int:
    """`cur` for the 1-based executed step number: step 1 -> max_steps, step max_steps -> 1."""
    return max_steps - step + 1


def temperature_value(cur: int, max_steps: int, t_min: float, t_max: float) -> float:
    """`temperature(...)` as a Python float, computed on the host without torch (no tensor, no sync).

    Mirrors torch's float32 arithmetic step by step: int32 / int -> float32 quotient; the Python-float
    operands are rounded to float32 before the float32 multiply and add (a wrapped Python scalar does not
    promote a float32 tensor). The tests pin it bit for bit against `temperature`.
    """
    if not 1 <= cur <= max_steps:
        raise ValueError(f"temperature: cur={cur} must be in [1, {max_steps}]")
    frac = np.float32(cur) / np.float32(max_steps)
    return float(np.float32(t_min) + np.float32(t_max - t_min) * frac)
