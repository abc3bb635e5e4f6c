"""Benchmark: the engine's batched denoise, full size, random weights, one process.

    PYTHONPATH=src:. python -m bench.bench_batch [--kinds q4,bf16] [--batches 1,2,4,8] [--reps 10] [--json out.json]
    PYTHONPATH=src:. python -m bench.bench_batch --tiny     # the demo model's shapes on the CPU: a dry run

Per engine kind (bf16: RandomSource; q4: RandomPackSource, q4 experts and a q8 SC MLP), balanced expert routing,
every lane its own cache holding a 1k prompt:
  forward  the batched denoise forward alone (graph replay; B=1 is the solo graphed denoise generate runs), median
           ms and canvas rows/s, and the ratio to B=1 measured in the same run, per batch_paths form (--forms;
           "wide-serial": "wide" with lane_streams off, the lanes' attention one after another)
  steps    generate_batch over B requests of one block at 16 fixed steps (the sampler, SC and stop rules per request
           included): aggregate canvas rows/s against B=1 through the same call; "cold" with fresh caches each call
           (every call captures its solo and prefill graphs again), "warm" with the same caches (caches=) rewound each call
  queue    a bulk job: 3·B requests of mixed prompt lengths through generate_batch at max_batch B (each joins as one
           leaves, on the caches generate_batch lends), against the first B alone: denoise rows/s and how the
           batched forwards ran (eager / captured / replayed) in the last call
  invariance  each lane's raw logits batched vs its solo denoise (share bit-identical, worst relative error), and
           generate_batch's tokens vs generate's per request (share identical), per batch_paths
  memory   q4 only: B=8 lanes with 8k-token caches, one batched step: the device's peak allocated GiB
  demo     the embedded demo model (real weights, its own engine): 8 chat prompts' tokens alone vs through
           generate_batch at max_batch 2 / 4 / 8: the share of requests token-identical
  profile  the fixture's rows (bench/fixtures.logit_profile): median row entropy and SC survivors per row
  round    at the largest B: generate_batch's round p50 against the batched forward alone (bench/sampler_round.py)
  sampler  at the largest B: the sampler batched across lanes against B solo sampler calls (bench/sampler_round.py)
  phases   at the largest B: the batched sampler's phases on one batched forward's logits (stats, accept, plans, the
           gather queued ahead of the status read, the soft embedding after it): each one's device ms (CUDA events)
           and the host's ms from the read to the last soft-embedding launch (in a round the device waits for it)
Each kind runs per fixture (--fixtures; bench/fixtures.py): "q4" is the flat fixture, "q4-peaked" the peaked one.
The issue-49 check, one run:  --sections profile,round,sampler,phases --batches 8 --json $OUT/round.json
Medians of --reps after warm-up; CUDA-synchronised wall clock. The JSON is rewritten after each section.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace

import torch

from bench.balanced_routing import KINDS
from bench.bench_e2e import fixed_steps
from bench.fixtures import logit_profile
from bench.runner import call_times, dumper, log, result_header, run_kinds, shapes, sync, with_fixtures
from bench.sampler_round import section_round, section_sampler
from diffgemma.batch import generate_batch
from diffgemma.generation import generate
from diffgemma.model.options import BATCH_PATHS, EngineOptions
from diffgemma.sampling.accept import accept_masks
from diffgemma.sampling.schedule import temperature_value
from diffgemma.sampling.self_condition import SparsePlan
from diffgemma.sampling.stats import StepStats

STEPS = 16
PATHS = BATCH_PATHS  # EngineOptions.batch_paths' forms


def median(xs):
    return round(statistics.median(xs), 3)


def timed(dev, fn, reps):
    return median(call_times(dev, fn, reps))


def lanes(eng, cfg, B, ctx, seed=0):
    dev, V, C = eng.device, cfg.vocab_size, cfg.canvas_length
    gen = torch.Generator().manual_seed(seed)
    caches, canvases, scs = [], [], []
    for _ in range(B):
        cache = eng.new_cache(ctx + 2 * C)
        eng.prefill(cache, torch.randint(0, V, (ctx,), generator=gen).to(dev))
        canvas = torch.randint(0, V, (C,), generator=gen).to(dev)
        caches.append(cache)
        canvases.append(canvas)
        scs.append(eng.embed(torch.randint(0, V, (C,), generator=gen).to(dev)))
    return caches, canvases, scs


def section_forward(eng, cfg, batches, ctx, reps, forms):
    dev, C = eng.device, cfg.canvas_length
    out = {}
    caches, canvases, scs = lanes(eng, cfg, max(batches), ctx)
    for form in forms:
        paths, _, serial = form.partition("-")
        eng.options = replace(eng.options, batch_paths=paths, lane_streams=not serial)
        eng.clear_graphs()
        r = out[form] = {}
        for B in batches:
            if B == 1:
                ms = timed(dev, lambda: eng.denoise_raw(caches[0], canvases[0], sc_embeds=scs[0]), reps)
            else:
                ms = timed(dev, lambda: eng.denoise_batch_raw(caches[:B], canvases[:B], sc_embeds=scs[:B]), reps)
            r[B] = {"ms": ms, "rows_s": round(B * C / ms * 1e3, 1)}
            r[B]["vs_b1"] = round(r[B]["rows_s"] / r[batches[0]]["rows_s"], 3)
            log(f"  forward [{form}] B={B}: {r[B]}")
            eng.clear_graphs()  # each B's graphs go before the next B's: their logits buffers add up
    eng.options = replace(eng.options, batch_paths=EngineOptions().batch_paths, lane_streams=True)
    return out


def section_steps(eng, cfg, batches, ctx, reps, paths):
    dev, V, C = eng.device, cfg.vocab_size, cfg.canvas_length
    eng.options = replace(eng.options, batch_paths=paths)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (ctx,), generator=gen).tolist() for _ in range(max(batches))]
    s = fixed_steps(C, 1)
    out = {}
    for B in batches:
        caches = [eng.new_cache(ctx + 2 * C) for _ in range(B)]
        for warm in (False, True):  # fresh caches each call (solo graphs captured again), then the same caches reused
            def run():
                if not warm:
                    return generate_batch(eng, prompts[:B], seeds=list(range(B)), settings=s, max_batch=B)
                for c in caches:
                    c.truncate(0)
                return generate_batch(eng, prompts[:B], seeds=list(range(B)), settings=s, max_batch=B, caches=caches)
            walls = []
            for i in range(max(2, reps // 3) + 1):
                sync(dev)
                t = time.perf_counter()
                res = run()
                sync(dev)
                if i:
                    walls.append(time.perf_counter() - t)
            assert all(r.forwards == STEPS for r in res), [r.forwards for r in res]
            # the wall includes each request's 1k prefill; the denoise time is what the requests report
            den = statistics.median(walls) - sum(r.timings["prefill_s"] for r in res)
            key = "warm" if warm else "cold"
            r = out.setdefault(B, {})[key] = {"wall_s": round(statistics.median(walls), 4),
                                              "rows_s": round(B * C * STEPS / den, 1)}
            r["vs_b1"] = round(r["rows_s"] / out[batches[0]][key]["rows_s"], 3)
            log(f"  steps [{paths}] B={B} {key}: {r}")
        caches = None  # this size's caches (and the graphs over them) go before the next
        eng.clear_graphs()
    eng.options = replace(eng.options, batch_paths=EngineOptions().batch_paths)
    return out


def section_queue(eng, cfg, B, ctx, reps):
    """A bulk job: 3·B requests of mixed prompt lengths at max_batch B (each joins as one leaves), one block of fixed
    steps each, against the first B of them alone in the same run: denoise rows/s, and how the batched forwards ran."""
    dev, V, C = eng.device, cfg.vocab_size, cfg.canvas_length
    gen = torch.Generator().manual_seed(5)
    lens = [max(1, n) for n in (ctx, ctx // 2, ctx // 3, ctx - ctx // 8, ctx // 11, ctx, 2 * ctx // 3, 5)]
    prompts = [torch.randint(0, V, (lens[i % len(lens)],), generator=gen).tolist() for i in range(3 * B)]
    s = fixed_steps(C, 1)
    out = {}
    for name, ps in (("alone", prompts[:B]), ("queue", prompts)):
        walls, counts = [], []
        for i in range(max(2, reps // 3) + 1):
            before = eng.batch_graph_counts
            sync(dev)
            t = time.perf_counter()
            res = generate_batch(eng, ps, seeds=list(range(len(ps))), settings=s, max_batch=B)
            sync(dev)
            if i:
                walls.append(time.perf_counter() - t - sum(r.timings["prefill_s"] for r in res))
                counts.append({k: v - before.get(k, 0) for k, v in eng.batch_graph_counts.items()})
        out[name] = {"requests": len(ps), "rows_s": round(len(ps) * C * STEPS / statistics.median(walls), 1),
                     "batch_graphs_last_call": counts[-1]}
        log(f"  queue [{name}] B={B}: {out[name]}")
    out["queue_vs_alone"] = round(out["queue"]["rows_s"] / out["alone"]["rows_s"], 3)
    eng.clear_graphs()
    return out


def section_invariance(eng, cfg, B, ctx):
    V, C = cfg.vocab_size, cfg.canvas_length
    out = {}
    caches, canvases, scs = lanes(eng, cfg, B, ctx, seed=2)
    solo = [eng.denoise_raw(c, x, sc_embeds=s).clone() for c, x, s in zip(caches, canvases, scs)]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (ctx, 37, ctx // 2, 300, ctx, 5, 700, 90)[:B]]
    s = fixed_steps(C, 2)
    alone = [generate(eng, p, settings=s, seed=i).tokens for i, p in enumerate(prompts)]
    for paths in PATHS:
        eng.options = replace(eng.options, batch_paths=paths)
        eng.clear_graphs()
        eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)  # a batch's first round runs eagerly; this one replays
        got = eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)
        same = sum(torch.equal(g, x) for g, x in zip(got, solo))
        worst = max(((g.float() - x.float()).norm() / x.float().norm()).item() for g, x in zip(got, solo))
        batched = generate_batch(eng, prompts, seeds=list(range(B)), settings=s, max_batch=B)
        tok_same = sum(b.tokens == a for b, a in zip(batched, alone))
        out[paths] = {"lanes_bit_identical": f"{same}/{B}", "worst_rel": float(f"{worst:.3g}"),
                      "requests_token_identical": f"{tok_same}/{B}"}
        log(f"  invariance [{paths}] B={B}: {out[paths]}")
    eng.options = replace(eng.options, batch_paths=EngineOptions().batch_paths)
    eng.clear_graphs()
    return out


def section_demo(dev, batches):
    import diffgemma
    from diffgemma.session import Session

    eng = diffgemma.load(None, device=dev)
    questions = ["Name a colour.", "What is 2+2?", "Say hi.", "Count to five.", "What is the capital of France?",
                 "Write a haiku about rain.", "List three fruits.", "Is ice cold?"]
    prompts = []
    for q in questions:
        s = Session(eng, max_tokens=64)
        s.messages.append({"role": "user", "content": q})
        prompts.append(s.render())
    kw = dict(max_new_tokens=64)
    alone = [generate(eng, p, seed=i, **kw).tokens for i, p in enumerate(prompts)]
    out = {}
    for B in batches:
        if B < 2:
            continue
        got = generate_batch(eng, prompts, seeds=list(range(len(prompts))), max_batch=B, **kw)
        out[B] = f"{sum(g.tokens == a for g, a in zip(got, alone))}/{len(prompts)}"
        log(f"  demo: max_batch {B}: requests token-identical {out[B]}")
    return out


def section_memory(eng, cfg, B, ctx):
    dev = eng.device
    if dev.type != "cuda":
        return {"skipped": "cpu"}
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    caches, canvases, scs = lanes(eng, cfg, B, ctx, seed=4)
    eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)
    sync(dev)
    out = {"B": B, "ctx": ctx, "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2),
           "reserved_gib": round(torch.cuda.memory_reserved(dev) / 2**30, 2)}
    log(f"  memory: {out}")
    del caches
    eng.clear_graphs()
    return out


def _stamp(dev):
    """A point on the device's stream (a recorded CUDA event), else the host clock."""
    if dev.type != "cuda":
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _between(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def section_phases(eng, cfg, B, ctx, reps, ratio=10.0):
    """The batched sampler's phases, p50 ms over reps (see the module docstring), on the batch's one buffer of raw
    logits, each lane at its own temperature."""
    dev, C = eng.device, cfg.canvas_length
    caches, canvases, scs = lanes(eng, cfg, B, ctx, seed=8)
    buf = torch.cat([x.clone() for x in eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)])
    logits = list(buf.split(C))
    temps = [temperature_value(STEPS - (i * 5) % STEPS, STEPS, 0.4, 0.8) for i in range(B)]
    names = ("stats", "accept", "plans", "ahead", "embed")
    times = {k: [] for k in (*names, "host_after_read", "total")}
    for i in range(reps + 2):
        sync(dev)
        marks = [_stamp(dev)]
        stats = StepStats.batch(logits, temps, cap=eng.logit_softcap)
        marks.append(_stamp(dev))
        accept_masks([s.entropy for s in stats], [0.1] * B, [False] * B)
        marks.append(_stamp(dev))
        plans = SparsePlan.batch(stats, [ratio] * B)
        counts = SparsePlan.counts_batch(plans)
        marks.append(_stamp(dev))
        for p in plans:  # the gather queued ahead of the read, as read_statuses starts it (SparsePlan.batch_ahead_rows)
            p.start(eng.embedding, cfg.embed_scale)
        marks.append(_stamp(dev))
        counts = counts.tolist()  # the round's status read
        for p, n in zip(plans, counts):
            p.read = n
        t = time.perf_counter()
        SparsePlan.soft_embed_batch(plans, counts, eng.embedding, cfg.embed_scale)
        host = (time.perf_counter() - t) * 1e3
        marks.append(_stamp(dev))
        sync(dev)
        if i >= 2:
            for k, a, b in zip(names, marks, marks[1:]):
                times[k].append(_between(a, b))
            times["host_after_read"].append(host)
            times["total"].append(_between(marks[0], marks[-1]))
    out = {"B": B, **{f"{k}_ms": median(v) for k, v in times.items()},
           "survivors_per_row": round(sum(counts) / (B * C), 2), "took_dense": sum(bool(p.took_dense) for p in plans)}
    log(f"  phases B={B}: {out}")
    del caches
    eng.clear_graphs()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="q4,bf16")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--sections", default="forward,steps,queue,invariance,memory,demo,profile,round,sampler,phases")
    ap.add_argument("--fixtures", default="flat,peaked", help="comma list of bench/fixtures.py's FIXTURES")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--paths", default=EngineOptions().batch_paths, choices=BATCH_PATHS,
                    help="batch_paths for the steps section (default: the engine's)")
    ap.add_argument("--forms", default=",".join([*BATCH_PATHS, "wide-serial"]),
                    help="the forward section's forms: a batch_paths, with '-serial' for lane_streams off")
    ap.add_argument("--json", default=None)
    ap.add_argument("--routing", default="balanced", choices=KINDS)
    ap.add_argument("--tiny", action="store_true", help="the demo model's shapes on the CPU (a dry run of the script)")
    a = ap.parse_args()
    kinds = with_fixtures([k for k in a.kinds.split(",") if k], a.fixtures)
    batches = [int(b) for b in a.batches.split(",")]
    forms = [f for f in a.forms.split(",") if f]
    bad = [f for f in forms if f.partition("-")[0] not in BATCH_PATHS or f.partition("-")[2] not in ("", "serial")]
    if bad:
        ap.error(f"--forms: {bad} are not a batch_paths ({', '.join(BATCH_PATHS)}) with an optional '-serial'")
    sections = set(a.sections.split(","))
    cfg, dev = shapes(a.tiny)
    ctx, mem_ctx = (32, 64) if a.tiny else (1024, 8192)
    if a.tiny:
        a.reps = min(a.reps, 2)
    res = result_header(dev, a, ctx=ctx)
    dump = dumper(res, a.json)
    if "demo" in sections:
        t = time.time()
        res["demo"] = section_demo(dev, batches)
        log(f"[demo] {time.time() - t:.1f}s")
        dump()
    run_kinds(kinds, cfg, dev, a.tiny, res, sections,
              lambda eng, kind: (("forward", lambda: section_forward(eng, cfg, batches, ctx, a.reps, forms)),
                                 ("steps", lambda: section_steps(eng, cfg, batches, ctx, a.reps, a.paths)),
                                 ("queue", lambda: section_queue(eng, cfg, max(batches), ctx, a.reps)),
                                 ("invariance", lambda: section_invariance(eng, cfg, max(batches), ctx)),
                                 ("memory", lambda: section_memory(eng, cfg, max(batches), mem_ctx)
                                  if kind == "q4" else None),
                                 ("profile", lambda: logit_profile(eng, cfg, ctx)),
                                 ("round", lambda: section_round(eng, cfg, max(batches), ctx, a.reps, lanes,
                                                                 generate_batch, fixed_steps(cfg.canvas_length, 1))),
                                 ("sampler", lambda: section_sampler(eng, cfg, max(batches), ctx, a.reps, lanes)),
                                 ("phases", lambda: section_phases(eng, cfg, max(batches), ctx, a.reps))),
              a.routing, dump)

    log("\n| kind | paths | " + " | ".join(f"B={b} fwd rows/s (x B=1)" for b in batches) + " | steps x B=1 cold / warm (B="
        + "/".join(map(str, batches)) + ") |")
    log("|---|---|" + "---|" * (len(batches) + 1))
    for kind in kinds:
        r = res.get(kind, {})
        for paths in forms:
            f = r.get("forward", {}).get(paths, {})
            cells = [f"{f[b]['rows_s']} ({f[b]['vs_b1']})" if b in f else "-" for b in batches]
            st = r.get("steps", {}) if paths == a.paths else {}
            steps = " / ".join("/".join(str(st[b][key]["vs_b1"]) if b in st else "-" for b in batches)
                               for key in ("cold", "warm"))
            log(f"| {kind} | {paths} | " + " | ".join(cells) + f" | {steps} |")


if __name__ == "__main__":
    main()
