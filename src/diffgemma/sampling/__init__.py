"""The sampler pieces of the generation loop, one job per module (see diffgemma.generate for the loop).

Each host-side rule has a device-side twin the loop actually runs (no host sync per step): Lcg / DeviceLcg,
temperature / temperature_value, StopRules / DeviceStopRules, sparse_soft_embed / SparsePlan.

A batched round samples every lane at once, each lane's numbers the bits it has alone (ops/lane_temps.py):
    stats = StepStats.batch(logits, temps, cap=cap)          # one row-stats launch (the one full read of the logits)
    masks = accept_masks([s.entropy for s in stats], bounds, final_steps)   # one accept launch
    plans = SparsePlan.batch(stats, log_ratios, dense_dtypes)               # one survivor count (reads kept groups)
    counts = SparsePlan.counts_batch(plans)                                 # for the status read: int64 [B]
    embeds = SparsePlan.soft_embed_batch(plans, counts, embedding, scale)   # one survivor list, one gather
    StepStats.processed_batch(stats)                                        # lanes that sample, or run exact SC
"""

from .accept import accept_mask, accept_masks
from .rng import DeviceLcg, Lcg, block_seed, categorical
from .schedule import temperature, temperature_value
from .self_condition import SparsePlan, exact_soft_embed, sparse_error_bound, sparse_soft_embed
from .stats import StepStats, entropy, max_prob
from .stops import FILLER_ID, DeviceStopRules, StopRules
from .trim import trim_cut

__all__ = [
    "Lcg", "DeviceLcg", "block_seed", "categorical", "temperature", "temperature_value", "accept_mask", "accept_masks",
    "entropy", "max_prob", "StepStats", "StopRules", "DeviceStopRules", "FILLER_ID", "exact_soft_embed",
    "sparse_soft_embed", "SparsePlan", "sparse_error_bound", "trim_cut",
]
