"""Per-row statistics of tempered logits: entropy (nats), argmax, max probability.

Entropy is computed from the normalised log-probabilities as -sum(p * log p), with log p clamped at
the dtype's most negative finite value so a zero-probability token contributes 0 rather than NaN
(the same arithmetic as torch.distributions.Categorical, which the hf semantics must match bit for
bit because the accept mask sorts on it).
"""

from __future__ import annotations

import torch

from ..ops.rowstats import softcap, softcap_lookup, tempered_rowstats, use_triton


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


class StepStats:
    """Row stats of one step's tempered logits z = logits / T, computed once and shared by the accept mask,
    the stop rules, the trim and self-conditioning.

    Two ways to get them, same fields:
    - torch (CPU, and anywhere Triton is off): z is materialised and entropy / argmax use the functions
      above, so the CPU path is bit-identical to the loop before fusion (the golden fixture pins it).
    - fused (CUDA + Triton, f32 logits): one kernel read of the logits gives entropy, argmax, row max and
      logsumexp (ops/rowstats.py); z exists only if someone asks for `processed` (exact SC, sampling).
      z, its max and argmax are bit-identical to the torch path; entropy and lse differ by float rounding.

    cap: `logits` are the raw ones before the final softcap (the engine's `denoise_raw`). The fused kernels then
    softcap them as they read (ops/rowstats.py; the bits of softcap(logits, cap)), and the step never holds the
    f32 [C, V] logits; the torch path softcaps them here first. `cap` stays set only while `logits` are raw.
    """

    def __init__(self, logits: torch.Tensor, temp: float, fused: bool | None = None, cap: float | None = None):
        self.temp = temp
        self._temp = None
        self._processed: torch.Tensor | None = None
        if fused is None:
            fused = use_triton(logits) and (logits.dtype == torch.float32 or cap is not None)
        if cap is not None and not (fused and logits.dtype in (torch.bfloat16, torch.float16)):
            logits, cap = softcap(logits, cap), None  # the torch path, or raw logits wider than the passes' table
        self.logits, self.cap = logits, cap
        self.fused = fused
        if fused:
            self.entropy, self.argmax, self.rowmax, self.lse = tempered_rowstats(logits, temp, cap=cap)
        else:
            z = self.processed
            self.entropy = entropy(z)
            self.argmax = z.argmax(dim=-1)
            self.rowmax = self.lse = None

    def temp_tensor(self) -> torch.Tensor:
        """T as an f32 device scalar (a fill, not a copy), made when a division by it is first asked for (on the
        stream current then): the fused passes take T as a number, so a fused step launches nothing for it."""
        if self._temp is None:
            self._temp = torch.full((), self.temp, dtype=torch.float32, device=self.logits.device)
        return self._temp

    @property
    def processed(self) -> torch.Tensor:
        """logits / T (materialised on first use)."""
        if self._processed is None:  # raw logits: softcapped by the kernel that made the fused passes' table
            logits = self.logits if self.cap is None else softcap(self.logits, self.cap)
            self._processed = logits / self.temp_tensor()
        return self._processed

    def softcapped(self, values: torch.Tensor) -> torch.Tensor:
        """f32 logits from a few values gathered out of `self.logits`: those values, or with raw logits their softcap
        through the fused passes' table (the bits those passes read)."""
        return values if self.cap is None else softcap_lookup(values, self.cap)

    def max_prob(self) -> torch.Tensor:
        if self.fused:
            return torch.exp(self.rowmax - self.lse)
        return max_prob(self.processed)
