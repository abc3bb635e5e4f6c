"""Early-stop rules for one block's denoising loop (docs/ARCHITECTURE.md, 'Generation contract').

After every step the loop asks `StopRules.update(...)` whether to stop, and why:

- "confident": the argmax canvas equals each of the previous `stability_threshold` steps' AND the mean
  entropy is below `confidence_threshold` (transformers' StableAndConfidentStoppingCriteria).
- "plateau": the accept mask has been bit-identical for `plateau_steps` consecutive steps AND the mean
  entropy is below `plateau_entropy` (catches stuck-but-stable canvases; 0 disables).
- "entropy": from step `entropy_stop_min_steps` on, mean entropy below `entropy_stop`, without waiting
  for argmax stability (0 disables).
- "max_steps": the scheduled last step ran.

Pad gate: when on, an argmax canvas made only of pad / filler ids never triggers an early stop — it is a
degenerate forward, not a converged answer. It does not block "max_steps".
"""

from __future__ import annotations

from collections import deque

import torch

from ..ops._backend import use_triton
from ..ops.stop_code import StopState, stop_code_triton

FILLER_ID = 262143  # the reference engine's invalid-logits sentinel: the last id of the real vocabulary


def filler_id(vocab_size: int) -> int:
    """The filler sentinel is the last vocabulary id (262143 on the real model, vocab-1 on any other)."""
    return vocab_size - 1

CONFIDENT = "confident"
PLATEAU = "plateau"
ENTROPY = "entropy"
MAX_STEPS = "max_steps"


class StopRules:
    def __init__(
        self,
        *,
        max_steps: int,
        stability_threshold: int,
        confidence_threshold: float,
        plateau_steps: int = 0,
        plateau_entropy: float = 0.0,
        entropy_stop: float = 0.0,
        entropy_stop_min_steps: int = 1,
        pad_gate: bool = False,
        pad_ids: tuple[int, ...] = (0, FILLER_ID),
    ):
        self.max_steps = max_steps
        self.stability_threshold = stability_threshold
        self.confidence_threshold = confidence_threshold
        self.plateau_steps = plateau_steps
        self.plateau_entropy = plateau_entropy
        self.entropy_stop = entropy_stop
        self.entropy_stop_min_steps = entropy_stop_min_steps
        self.pad_gate = pad_gate
        self.pad_ids = tuple(pad_ids)
        self._history: deque[torch.Tensor] = deque(maxlen=max(stability_threshold, 1))
        self._last_mask: torch.Tensor | None = None
        self._mask_run = 0

    @classmethod
    def from_settings(cls, s, pad_token_id: int, vocab_size: int = FILLER_ID + 1) -> "StopRules":
        return cls(
            max_steps=s.max_denoising_steps,
            stability_threshold=s.stability_threshold,
            confidence_threshold=s.confidence_threshold,
            plateau_steps=s.plateau_steps,
            plateau_entropy=s.plateau_entropy,
            entropy_stop=s.entropy_stop,
            entropy_stop_min_steps=s.entropy_stop_min_steps,
            pad_gate=s.pad_gate,
            pad_ids=(pad_token_id, filler_id(vocab_size)),
        )

    def update(self, step: int, argmax: torch.Tensor, mean_entropy: float, accepted: torch.Tensor) -> str | None:
        """Record step `step` (1-based) and return the stop reason, or None to keep denoising."""
        # stability against the previous N argmax canvases (fewer than N seen = not stable)
        if self.stability_threshold == 0:
            stable = True
        else:
            stable = len(self._history) == self.stability_threshold and all(
                torch.equal(h, argmax) for h in self._history
            )
            self._history.append(argmax.clone())

        if self._last_mask is not None and torch.equal(self._last_mask, accepted):
            self._mask_run += 1
        else:
            self._mask_run = 1
        self._last_mask = accepted.clone()

        degenerate = self.pad_gate and bool(torch.isin(argmax, torch.tensor(self.pad_ids, device=argmax.device)).all())
        if not degenerate:
            if stable and mean_entropy < self.confidence_threshold:
                return CONFIDENT
            if self.plateau_steps > 0 and self._mask_run >= self.plateau_steps and mean_entropy < self.plateau_entropy:
                return PLATEAU
            if self.entropy_stop > 0 and step >= self.entropy_stop_min_steps and mean_entropy < self.entropy_stop:
                return ENTROPY
        if step >= self.max_steps:
            return MAX_STEPS
        return None


# Stop codes of DeviceStopRules: index into REASONS (0 = keep denoising).
REASONS: tuple[str | None, ...] = (None, CONFIDENT, PLATEAU, ENTROPY, MAX_STEPS)


class DeviceStopRules(StopRules):
    """The same rules with every data-dependent quantity kept on the device: `update` returns a 0-d int64
    stop code (an index into REASONS) without a host sync, so the loop reads it with its one per-step copy.

    Host-known facts (step number, thresholds, how many argmax canvases the history holds) stay Python;
    argmax equality, the mask-run counter and the pad gate are device tensors. Mean entropy arrives as a
    0-d float64 tensor and is compared in float64, exactly like the host rules compare a Python float.
    """

    def __init__(self, fused: bool | None = None, **kw):
        """fused: the one-kernel update (ops/stop_code.py); None = on CUDA with Triton."""
        super().__init__(**kw)
        self._run_t: torch.Tensor | None = None
        self._fused = fused
        self._state: StopState | None = None  # the fused update's device state (its ring, mask, counter)
        self._updates = 0

    def update(self, step: int, argmax: torch.Tensor, mean_entropy: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        if self._fused if self._fused is not None else use_triton(argmax):
            return self._update_fused(step, argmax, mean_entropy, accepted)
        dev = argmax.device
        if self.stability_threshold == 0:
            stable = None  # always stable
        else:
            if len(self._history) == self.stability_threshold:
                stable = torch.stack([(h == argmax).all() for h in self._history]).all()
            else:
                stable = False  # fewer than N previous canvases
            self._history.append(argmax.clone())

        if self._last_mask is None:
            self._run_t = torch.ones((), dtype=torch.int64, device=dev)
        else:
            same = (self._last_mask == accepted).all()
            self._run_t = torch.where(same, self._run_t + 1, torch.ones_like(self._run_t))
        self._last_mask = accepted.clone()

        h = mean_entropy.double()
        live = torch.ones((), dtype=torch.bool, device=dev)
        if self.pad_gate:
            pad = torch.zeros_like(argmax, dtype=torch.bool)
            for pid in self.pad_ids:
                pad |= argmax == pid
            live = ~pad.all()

        code = torch.full((), 4 if step >= self.max_steps else 0, dtype=torch.int64, device=dev)
        # lowest priority first, so a higher-priority rule overwrites it
        if self.entropy_stop > 0 and step >= self.entropy_stop_min_steps:
            code = torch.where(live & (h < self.entropy_stop), 3, code)
        if self.plateau_steps > 0:
            code = torch.where(live & (self._run_t >= self.plateau_steps) & (h < self.plateau_entropy), 2, code)
        if stable is not False:
            confident = live & (h < self.confidence_threshold)
            code = torch.where(confident if stable is None else confident & stable, 1, code)
        return code

    def _update_fused(self, step, argmax, mean_entropy, accepted) -> torch.Tensor:
        if self._state is None:
            self._state = StopState.allocate(self.stability_threshold, argmax.shape[0],
                                             (self.confidence_threshold, self.plateau_entropy, self.entropy_stop),
                                             self.pad_ids, argmax.device)
        code = stop_code_triton(self._state, argmax, accepted, mean_entropy, updates=self._updates,
                                pad_gate=self.pad_gate,
                                entropy_rule=self.entropy_stop > 0 and step >= self.entropy_stop_min_steps,
                                plateau_steps=self.plateau_steps, base_code=4 if step >= self.max_steps else 0)
        self._updates += 1
        return code
