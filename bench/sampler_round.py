"""bench_batch's "round" and "sampler" sections: a batched round against the batched forward alone, and the sampler
batched across lanes against B solo sampler calls, at B lanes of a `ctx`-token prompt each.

  round    the batched forward alone (p50 of single calls), and generate_batch's round: the period between consecutive
           batched forwards (p50, stamped on the device's stream as each forward is queued), one block of 16 fixed
           steps, warm caches; round_over_forward_ms = their difference (the sampler, SC, accept / renoise / stop
           rules and the host's turn-around of a round); after_read_round_over_forward_ms the same with the batch's
           SC gather made after the status read (SparsePlan.batch_ahead_rows = 0), in alternating calls of one run
  sampler  on one batched forward's raw logits, per lane its own temperature: StepStats + accept mask + SparsePlan +
           the status read of the survivor counts + the soft embedding, lane by lane (solo) against StepStats.batch +
           accept_masks + SparsePlan.batch + SparsePlan.soft_embed_batch (batched); p50 ms of each, whether every
           lane's fields, mask and soft embedding are bit-identical, the survivors per row and whether the count sent
           the SC to the dense product
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.runner import call_times
from diffgemma.sampling.accept import accept_mask, accept_masks
from diffgemma.sampling.schedule import temperature_value
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.sampling.stats import StepStats

FIELDS = ("entropy", "argmax", "rowmax", "lse")
BOUND = 0.1  # GenerationSettings.entropy_bound's default


def p50(xs) -> float:
    return round(statistics.median(xs), 3)


class ForwardStamps:
    """Stamps the start of every batched forward of `eng` (CUDA events on the current stream, else the host clock),
    by shadowing eng.denoise_batch_raw for the `with` block."""

    def __init__(self, eng):
        self.eng, self.stamps = eng, []

    def __enter__(self):
        inner = self.eng.denoise_batch_raw
        cuda = self.eng.device.type == "cuda"

        def stamped(*a, **kw):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.stamps.append(ev)
            else:
                self.stamps.append(time.perf_counter())
            return inner(*a, **kw)

        self.eng.denoise_batch_raw = stamped
        return self

    def __exit__(self, *exc):
        del self.eng.denoise_batch_raw  # the class's method again
        return False

    def periods_ms(self) -> list[float]:
        s = self.stamps
        if s and isinstance(s[0], torch.cuda.Event):
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(s, s[1:])]
        return [(b - a) * 1e3 for a, b in zip(s, s[1:])]


def section_round(eng, cfg, B: int, ctx: int, reps: int, lanes, generate_batch, settings) -> dict:
    """The round's p50 against the batched forward's p50, measured in one run (see the module docstring)."""
    dev, V = eng.device, cfg.vocab_size
    caches, canvases, scs = lanes(eng, cfg, B, ctx, seed=6)
    forward = p50(call_times(dev, lambda: eng.denoise_batch_raw(caches, canvases, sc_embeds=scs), reps))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (ctx,), generator=gen).tolist() for _ in range(B)]
    periods = {"ahead": [], "after_read": []}  # the batch's SC gather queued before the status read, or after it
    rows = SparsePlan.batch_ahead_rows
    try:
        for i in range(max(2, reps // 3) + 1):
            for form, ahead in (("ahead", rows), ("after_read", 0)):  # alternating: the same GPU state for both
                SparsePlan.batch_ahead_rows = ahead
                for c in caches:
                    c.truncate(0)
                with ForwardStamps(eng) as st:
                    generate_batch(eng, prompts, seeds=list(range(B)), settings=settings, max_batch=B, caches=caches)
                if i:  # the first call warms the round's graphs
                    periods[form] += st.periods_ms()
    finally:
        SparsePlan.batch_ahead_rows = rows
    ps = periods["ahead"]
    out = {"B": B, "ctx": ctx, "forward_ms": forward, "round_ms": p50(ps), "rounds": len(ps),
           "round_p90_ms": round(sorted(ps)[int(0.9 * (len(ps) - 1))], 3)}
    out["round_over_forward_ms"] = round(out["round_ms"] - forward, 3)
    out["after_read_round_over_forward_ms"] = round(p50(periods["after_read"]) - forward, 3)
    eng.clear_graphs()
    return out


def _same(x, y) -> bool:
    """Bit-identical tensors, or both None (a field the torch path does not make)."""
    return x is None and y is None or x is not None and y is not None and torch.equal(x, y)


def _solo(logits, temps, cap, ratio, emb, scale):
    stats = [StepStats(x, t, cap=cap) for x, t in zip(logits, temps)]
    masks = [accept_mask(s.entropy, BOUND) for s in stats]
    plans = [SparsePlan(s, ratio) for s in stats]
    counts = torch.stack([p.count for p in plans]).tolist()  # the step's one host read
    return stats, plans, [p.soft_embed(n, emb, scale) for p, n in zip(plans, counts)], counts, masks


def _batched(logits, temps, cap, ratio, emb, scale):
    stats = StepStats.batch(logits, temps, cap=cap)
    masks = accept_masks([s.entropy for s in stats], [BOUND] * len(stats), [False] * len(stats))
    plans = SparsePlan.batch(stats, [ratio] * len(stats))
    counts = SparsePlan.counts_batch(plans).tolist()
    return stats, plans, SparsePlan.soft_embed_batch(plans, counts, emb, scale), counts, masks


def section_sampler(eng, cfg, B: int, ctx: int, reps: int, lanes, steps: int = 16, ratio: float = 10.0) -> dict:
    """Batched sampler vs B solo sampler calls on one batched forward's logits (see the module docstring)."""
    dev, C = eng.device, cfg.canvas_length
    caches, canvases, scs = lanes(eng, cfg, B, ctx, seed=8)
    logits = [x.clone() for x in eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)]
    buf = torch.cat(logits)  # one buffer, as a batched forward returns them: the lanes are views of it
    logits = list(buf.split([x.shape[0] for x in logits]))
    temps = [temperature_value(steps - (i * 5) % steps, steps, 0.4, 0.8) for i in range(B)]  # lanes at other steps
    cap, emb, scale = eng.logit_softcap, eng.embedding, cfg.embed_scale
    args = (logits, temps, cap, ratio, emb, scale)
    solo_ms = call_times(dev, lambda: _solo(*args), reps)
    batched_ms = call_times(dev, lambda: _batched(*args), reps)
    a, b = _solo(*args), _batched(*args)
    same = all(_same(getattr(x, f), getattr(y, f)) for x, y in zip(a[0], b[0]) for f in FIELDS)
    same_embeds = all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
    rows = [n / C for n in a[3]]
    out = {"B": B, "ctx": ctx, "solo_ms": p50(solo_ms), "batched_ms": p50(batched_ms),
           "stats_bit_identical": same, "soft_embed_bit_identical": same_embeds and a[3] == b[3],
           "accept_bit_identical": all(torch.equal(x, y) for x, y in zip(a[4], b[4])),
           "survivors_per_row": {"min": round(min(rows), 2), "max": round(max(rows), 2)},
           "took_dense": [bool(p.took_dense) for p in a[1]], "temps": [round(t, 4) for t in temps]}
    out["saved_ms"] = round(out["solo_ms"] - out["batched_ms"], 3)
    del caches
    eng.clear_graphs()
    return out
