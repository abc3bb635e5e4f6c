"""The sampler pieces of the generation loop, one job per module (see diffgemma.generate for the loop)."""

from .accept import accept_mask
from .rng import Lcg, block_seed, categorical
from .schedule import temperature
from .self_condition import exact_soft_embed, sparse_error_bound, sparse_soft_embed
from .stats import entropy, max_prob
from .stops import FILLER_ID, StopRules
from .trim import trim_cut

__all__ = [
    "Lcg", "block_seed", "categorical", "temperature", "accept_mask", "entropy", "max_prob",
    "StopRules", "FILLER_ID", "exact_soft_embed", "sparse_soft_embed", "sparse_error_bound", "trim_cut",
]
