"""Per-row statistics of tempered logits: entropy (nats), argmax, max probability.

Entropy is computed from the normalised log-probabilities as -sum(p * log p), with log p clamped at
the dtype's most negative finite value so a zero-probability token contributes 0 rather than NaN
(the same arithmetic as torch.distributions.Categorical, which the hf semantics must match bit for
bit because the accept mask sorts on it).
"""

from __future__ import annotations

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits - logits.logsumexp(dim=-1, keepdim=True)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) per row: [..., V] -> [...]."""
    logp = log_probs(logits)
    probs = torch.softmax(logp, dim=-1)
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp * probs).sum(dim=-1)


def max_prob(logits: torch.Tensor) -> torch.Tensor:
    """p_max per row of softmax(logits): [..., V] -> [...]."""
    return torch.exp(logits.max(dim=-1).values - logits.logsumexp(dim=-1))
