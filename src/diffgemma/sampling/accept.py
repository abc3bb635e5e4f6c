"""The entropy-bound accept mask (docs/ARCHITECTURE.md, 'Generation contract': `entropy_bound`).

Sort positions by ascending entropy and accept the k lowest while
    sum(H_1..H_k) - max(H_1..H_k) <= bound        (= the prefix sum BEFORE position k, since sorted)
so the lowest-entropy position is always accepted. The mask is re-decided from scratch every step:
a position accepted last step gets no special treatment (there is no freeze), and the final
scheduled step accepts nothing (the loop ends on the argmax anyway).

The legacy freeze (A/B only) keeps already-frozen positions accepted and spends the bound on the
remaining positions only.
"""

from __future__ import annotations

import torch

from ..ops._backend import use_triton
from ..ops.sorted_prefix import sorted_prefix_triton


def accept_mask(
    entropy: torch.Tensor,
    bound: float,
    *,
    final_step: bool = False,
    frozen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool mask [C] of accepted positions for per-position entropies [C] (nats)."""
    if final_step:
        return frozen.clone() if frozen is not None else torch.zeros_like(entropy, dtype=torch.bool)
    if use_triton(entropy) and entropy.dim() == 1:  # one kernel for the sort, scan and scatter below
        return sorted_prefix_triton(entropy, bound, frozen)
    if frozen is not None:
        # Frozen positions sort last as +inf, so the free ones form the same sorted prefix (and prefix sums)
        # as sorting the free subset alone; a frozen row's `before` is inf - inf = nan, never <= bound.
        # No data-dependent branch: this stays on the device (no host sync).
        # Stable sort, so equal entropies keep index order in both the full and the subset view.
        return frozen | _sorted_prefix(entropy.masked_fill(frozen, float("inf")), bound, stable=True)
    return _sorted_prefix(entropy, bound)


def _sorted_prefix(entropy: torch.Tensor, bound: float, stable: bool = False) -> torch.Tensor:
    sorted_h, order = torch.sort(entropy, dim=-1, descending=False, stable=stable)
    before = torch.cumsum(sorted_h, dim=-1) - sorted_h
    sorted_ok = before <= bound
    return torch.zeros_like(sorted_ok).scatter(-1, order, sorted_ok)


def accept_mask_frozen_reference(entropy: torch.Tensor, bound: float, frozen: torch.Tensor) -> torch.Tensor:
    """The freeze rule spelled out on the free subset (syncs; the twin the tests compare accept_mask to)."""
    mask = frozen.clone()
    free = ~frozen
    if bool(free.any()):
        mask[free] = _sorted_prefix(entropy[free], bound, stable=True)
    return mask


def accept_mask_reference(entropy: list[float], bound: float) -> list[bool]:
    """Plain-Python twin: walk positions by ascending entropy, accepting while the running sum allows."""
    order = sorted(range(len(entropy)), key=lambda i: entropy[i])
    accepted = [False] * len(entropy)
    running = 0.0
    for i in order:
        if running <= bound:
            accepted[i] = True
        running += entropy[i]
    return accepted
