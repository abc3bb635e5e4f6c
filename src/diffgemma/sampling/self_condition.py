"""Self-conditioning soft embeddings (ARCHITECTURE.md §5).

soft_embed = softmax(sc_logits) @ embedding * sqrt(hidden), where sc_logits are the previous step's
logits already divided by that step's temperature.

- exact: the dense [C, V] @ [V, H] product (the reference; what transformers computes).
- sparse: only "survivor" tokens with prob >= exp(-log_ratio) * row max (logit >= row max - log_ratio)
  are gathered; the tail is dropped without renormalising. Per row the error is bounded by
      |sparse - exact|_inf <= sqrt(hidden) * tail_mass * max|embedding|,
  tail_mass = the probability of the dropped tokens; `sparse_error_bound` computes it. The SC MLP's
  RMSNorm is scale-invariant, so the missing tail mass itself (a uniform shrink) does not matter.

Which is faster (CPU, 2 shared cores, 2026-11-30, best of 1-2 runs, C = canvas rows):
    V=128     H=32   C=8   f32, 16 survivors/row:   exact ~1-12 ms   sparse ~0.4-125 ms (noisy host)
    V=4096    H=256  C=64  f32, 16-256 survivors:   exact 20-26 ms   sparse 187-224 ms
    V=262144  H=2816 C=256 f32, 16 survivors/row:   exact 4632 ms    sparse 1234 ms
    V=262144  H=2816 C=256 f32, 256 survivors/row:  exact 4743 ms    sparse 2694 ms
    V=262144  H=2816 C=256 f32, 2048 survivors/row: exact 7331 ms    sparse 24965 ms
    V=262144  H=2816 C=256 bf16, 256 survivors/row: exact 2469 ms    sparse 4286 ms
so GenerationSettings.sc_mode defaults to "exact"; sparse only wins for f32 at the real vocabulary
with few survivors. Not yet measured on the GPU.
"""

from __future__ import annotations

import torch


def exact_soft_embed(sc_logits: torch.Tensor, embedding: torch.Tensor, scale: float) -> torch.Tensor:
    """[C, V] logits -> [C, H] soft embedding in the embedding's dtype (probs in float32, then cast)."""
    probs = torch.softmax(sc_logits, dim=-1, dtype=torch.float32).to(embedding.dtype)
    return (probs @ embedding) * torch.tensor(scale, dtype=torch.float32).to(embedding.dtype)


def survivors(sc_logits: torch.Tensor, log_ratio: float) -> torch.Tensor:
    """Bool [C, V]: tokens whose probability is within exp(-log_ratio) of their row's max."""
    logits = sc_logits.float()
    return logits >= logits.max(dim=-1, keepdim=True).values - log_ratio


def sparse_soft_embed(sc_logits: torch.Tensor, embedding: torch.Tensor, scale: float, log_ratio: float) -> torch.Tensor:
    """Survivor-gather soft embedding: sum over kept tokens of p * embedding row, f32 accumulate."""
    logits = sc_logits.float()
    log_z = logits.logsumexp(dim=-1)
    rows, cols = survivors(logits, log_ratio).nonzero(as_tuple=True)
    weights = torch.exp(logits[rows, cols] - log_z[rows])
    out = torch.zeros(logits.shape[0], embedding.shape[1], dtype=torch.float32, device=embedding.device)
    out.index_add_(0, rows, weights[:, None] * embedding[cols].float())
    return (out * scale).to(embedding.dtype)


def sparse_error_bound(sc_logits: torch.Tensor, embedding: torch.Tensor, scale: float, log_ratio: float) -> float:
    """Worst-case max |sparse - exact| over the canvas (see module docstring), float64."""
    logits = sc_logits.double()
    probs = torch.softmax(logits, dim=-1)
    tail = (probs * (~survivors(logits, log_ratio))).sum(dim=-1)
    return float(tail.max()) * scale * float(embedding.abs().max())
