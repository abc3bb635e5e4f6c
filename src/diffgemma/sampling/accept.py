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

from ..errors import TensorError
from ..ops._backend import next_pow2, use_triton
from ..ops.lane_temps import host_to_device
from ..ops.sorted_prefix import lanes_table, sorted_prefix_lanes_triton, sorted_prefix_triton


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


_LANES: dict = {}  # (device, starts, lengths, bounds) -> the lanes' table on the device; kept, never dropped
_LANES_KEPT = 256


def accept_masks(entropies: list, bounds, final_steps, frozens=None) -> list[torch.Tensor]:
    """[accept_mask(h, bound, final_step=f, frozen=z) for each lane], the same bits. With the kernel (CUDA), one
    launch for all lanes when their entropies lie in one 1-D tensor (StepStats.batch's lanes: views of one [R]), no
    lane is frozen and every lane's length has one next power of two (so each lane's program is its solo kernel's);
    a final step is the bound -inf (nothing accepted: accept_mask's zeros). Otherwise lane by lane."""
    B = len(entropies)
    frozens = list(frozens) if frozens is not None else [None] * B
    if not (len(bounds) == len(final_steps) == len(frozens) == B):
        raise TensorError(f"accept_masks: expected one bound, final_step and frozen per lane, got {len(bounds)} / "
                          f"{len(final_steps)} / {len(frozens)} for {B} lanes")
    one = _one_tensor(entropies) if B > 1 and all(z is None for z in frozens) else None
    if one is None:
        return [accept_mask(h, b, final_step=f, frozen=z)
                for h, b, f, z in zip(entropies, bounds, final_steps, frozens)]
    buf, starts = one
    lengths = [h.shape[0] for h in entropies]
    bnds = tuple(-float("inf") if f else float(b) for b, f in zip(bounds, final_steps))
    key = (str(buf.device), tuple(starts), tuple(lengths), bnds)
    table = _LANES.get(key)
    if table is None:
        table = host_to_device(lanes_table(starts, lengths, bnds), buf.device)
        if len(_LANES) < _LANES_KEPT:
            _LANES[key] = table
    out = sorted_prefix_lanes_triton(buf, table, next_pow2(lengths[0]))
    return [out[a: a + n] for a, n in zip(starts, lengths)]


def _one_tensor(entropies: list):
    """(the 1-D tensor the lanes' entropies are disjoint parts of, each lane's first index there), or None (not one
    contiguous tensor, not f32 1-D, not on the kernel's device, or lengths of several powers of two)."""
    h0 = entropies[0]
    if not use_triton(h0) or any(h.dim() != 1 or h.dtype != torch.float32 or h.stride(0) != 1 or h.shape[0] == 0
                                 or h.untyped_storage().data_ptr() != h0.untyped_storage().data_ptr()
                                 for h in entropies):
        return None
    if len({next_pow2(h.shape[0]) for h in entropies}) != 1:
        return None
    offs = [h.storage_offset() for h in entropies]
    base = min(offs)
    spans = sorted((o - base, o - base + h.shape[0]) for o, h in zip(offs, entropies))
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    return h0.as_strided((spans[-1][1],), (1,), base), [o - base for o in offs]


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
