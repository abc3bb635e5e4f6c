"""The early-stop rules' per-step update (sampling/stops.py, DeviceStopRules) in one kernel.

The torch twin spends dozens of small kernels a step on it (argmax against each remembered canvas, the accept-mask
run counter, the pad gate, a where per rule), whose launch latency sits on the critical path of every
step. One program here reads the step's argmax and accept mask once, updates the state in
place (the ring of the last N argmax canvases, the last mask, the run counter) and writes the stop code.
What the host knows stays a constexpr or an argument: whether the ring is full, whether there is a last mask,
which rules apply at this step. Mean entropy is compared in float64 against float64 thresholds, as the twin
does (the thresholds travel in a float64 tensor: a float argument would be float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import HAVE_TRITON, next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _stop_code_kernel(argmax_ptr, accepted_ptr, mean_ptr, thr_ptr, pad_ptr, ring_ptr, last_ptr, run_ptr, code_ptr,
                          C, slot, n_pad, plateau_steps, base_code,
                          N: tl.constexpr, CHECK_STABLE: tl.constexpr, ALWAYS_STABLE: tl.constexpr,
                          HAS_LAST: tl.constexpr, PAD_GATE: tl.constexpr, ENTROPY_RULE: tl.constexpr,
                          PLATEAU: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        ok = i < C
        a = tl.load(argmax_ptr + i, mask=ok, other=0).to(tl.int64)
        acc = tl.load(accepted_ptr + i, mask=ok, other=0) != 0
        h = tl.load(mean_ptr).to(tl.float64)
        # stability: the canvas against every remembered one (read them all before this step's goes in)
        stable = tl.full((), 1, tl.int1)
        if CHECK_STABLE:
            diff = 0
            for j in tl.static_range(N):
                old = tl.load(ring_ptr + j * C + i, mask=ok, other=0)
                diff += tl.sum((ok & (old != a)).to(tl.int32), axis=0)
            stable = diff == 0
        if N > 0:
            tl.store(ring_ptr + slot * C + i, a, mask=ok)
        # the accept mask's run of identical steps
        run = tl.full((), 1, tl.int64)
        if HAS_LAST:
            last = tl.load(last_ptr + i, mask=ok, other=0) != 0
            same = tl.sum((ok & (last != acc)).to(tl.int32), axis=0) == 0
            run = tl.where(same, tl.load(run_ptr) + 1, 1)
        tl.store(run_ptr, run)
        tl.store(last_ptr + i, acc.to(tl.int8), mask=ok)
        live = tl.full((), 1, tl.int1)
        if PAD_GATE:  # an all-pad / filler canvas never stops early
            is_pad = tl.zeros((BLOCK,), dtype=tl.int1)
            for p in range(n_pad):
                is_pad = is_pad | (a == tl.load(pad_ptr + p))
            live = tl.sum((ok & ~is_pad).to(tl.int32), axis=0) > 0
        code = tl.full((), 0, tl.int64) + base_code  # 4 once the scheduled last step ran
        if ENTROPY_RULE:
            code = tl.where(live & (h < tl.load(thr_ptr + 2)), 3, code)
        if PLATEAU:
            code = tl.where(live & (run >= plateau_steps) & (h < tl.load(thr_ptr + 1)), 2, code)
        if CHECK_STABLE or ALWAYS_STABLE:
            code = tl.where(live & stable & (h < tl.load(thr_ptr)), 1, code)
        tl.store(code_ptr, code)


@dataclass
class StopState:
    """The fused update's device state for one block: the ring of the last n_ring argmax canvases, the last
    accept mask, the run counter, and the constants (float64 thresholds, pad ids). Made by fills: a
    host->device copy of the constants would sync."""

    n_ring: int  # the stability window N (0: no ring is read)
    ring: torch.Tensor  # int64 [max(N, 1), C]
    last: torch.Tensor  # int8 [C]
    run: torch.Tensor  # int64 0-d
    thresholds: torch.Tensor  # float64 [3]: confidence, plateau entropy, entropy stop
    pads: torch.Tensor  # int64 [max(n_pad, 1)]
    n_pad: int

    @classmethod
    def allocate(cls, n_ring: int, canvas: int, thresholds, pad_ids, device) -> "StopState":
        thr = torch.empty(3, dtype=torch.float64, device=device)
        for k, v in enumerate(thresholds):
            thr[k].fill_(float(v))
        pads = torch.empty(max(len(pad_ids), 1), dtype=torch.int64, device=device)
        for k, v in enumerate(pad_ids):
            pads[k].fill_(int(v))
        return cls(n_ring, torch.empty(max(n_ring, 1), canvas, dtype=torch.int64, device=device),
                   torch.empty(canvas, dtype=torch.int8, device=device),
                   torch.empty((), dtype=torch.int64, device=device), thr, pads, len(pad_ids))


def stop_code_triton(state: StopState, argmax, accepted, mean_entropy, *, updates: int, pad_gate: bool,
                     entropy_rule: bool, plateau_steps: int, base_code: int) -> torch.Tensor:
    """One update: the stop code (int64 0-d); `state` moves on in place. updates: how many came before in
    this block (which ring slot is oldest, whether it is full, whether there is a last mask)."""
    N, C = state.n_ring, argmax.shape[0]
    code = torch.empty((), dtype=torch.int64, device=argmax.device)
    _stop_code_kernel[(1,)](argmax, accepted, mean_entropy, state.thresholds, state.pads, state.ring, state.last,
                            state.run, code, C, updates % max(N, 1), state.n_pad, int(plateau_steps), base_code,
                            N=N, CHECK_STABLE=N > 0 and updates >= N, ALWAYS_STABLE=N == 0, HAS_LAST=updates > 0,
                            PAD_GATE=bool(pad_gate), ENTROPY_RULE=bool(entropy_rule), PLATEAU=plateau_steps > 0,
                            BLOCK=next_pow2(C), num_warps=4)
    return code
