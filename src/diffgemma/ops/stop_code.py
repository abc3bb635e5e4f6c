"""The early-stop rules' per-step update (sampling/stops.py, DeviceStopRules) in one kernel.

The torch twin spends ~30 small kernels a step on it (argmax against each remembered canvas, the accept-mask
run counter, the pad gate, a where per rule); on the H200 that is ~70 µs of launch latency on the critical
path of every step. One program here reads the step's argmax and accept mask once, updates the state in
place (the ring of the last N argmax canvases, the last mask, the run counter) and writes the stop code.
What the host knows stays a constexpr or an argument: whether the ring is full, whether there is a last mask,
which rules apply at this step. Mean entropy is compared in float64 against float64 thresholds, as the twin
does (the thresholds travel in a float64 tensor: a float argument would be float32).
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON

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


def stop_code_triton(rules, step: int, argmax, mean_entropy, accepted):
    """One DeviceStopRules update on the device (its ring, last mask and run counter live on the rules)."""
    dev, C, N = argmax.device, argmax.shape[0], rules.stability_threshold
    if rules._ring is None:  # once a block: state and constants by fills (a host->device copy would sync)
        rules._ring = torch.empty(max(N, 1), C, dtype=torch.int64, device=dev)
        rules._last8 = torch.empty(C, dtype=torch.int8, device=dev)
        rules._run_t = torch.empty((), dtype=torch.int64, device=dev)
        rules._thr = torch.empty(3, dtype=torch.float64, device=dev)
        for k, v in enumerate((rules.confidence_threshold, rules.plateau_entropy, rules.entropy_stop)):
            rules._thr[k].fill_(float(v))
        rules._pads = torch.empty(max(len(rules.pad_ids), 1), dtype=torch.int64, device=dev)
        for k, v in enumerate(rules.pad_ids):
            rules._pads[k].fill_(int(v))
    code = torch.empty((), dtype=torch.int64, device=dev)
    done = rules._updates
    _stop_code_kernel[(1,)](argmax, accepted, mean_entropy, rules._thr, rules._pads, rules._ring, rules._last8,
                            rules._run_t, code, C, done % max(N, 1), len(rules.pad_ids), int(rules.plateau_steps),
                            4 if step >= rules.max_steps else 0,
                            N=N, CHECK_STABLE=N > 0 and done >= N, ALWAYS_STABLE=N == 0, HAS_LAST=done > 0,
                            PAD_GATE=bool(rules.pad_gate),
                            ENTROPY_RULE=rules.entropy_stop > 0 and step >= rules.entropy_stop_min_steps,
                            PLATEAU=rules.plateau_steps > 0, BLOCK=triton.next_power_of_2(C), num_warps=4)
    rules._updates = done + 1
    return code
