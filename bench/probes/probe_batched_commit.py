"""Probe: a round's batched prefills (Engine.prefill_batch) eagerly against replayed from their graph.

    PYTHONPATH=src:. python -m bench.probes.probe_batched_commit --kinds fp8,q4 --json $OUT/commit.json
    PYTHONPATH=src:. python -m bench.probes.probe_batched_commit --tiny      # CPU dry run (no graphs: eager twice)

Full-size random weights (bench.runner.build), balanced routing. Two loads, each three ways:
  commit   B lanes over a --context-token prompt each end a block together: B canvases of new tokens committed
  prompts  B --context-token prompts into empty caches, one wave
  solo     each lane alone, one after another (Engine.commit: its own graphed padded prefill)
  eager    one batched padded forward, run eagerly (engine_batch.graph_rows made 0)
  graphed  the same forward replayed from its graph (engine_batch.BatchGraphs.run_prefill), at any row count
           (graph_rows lifted; "within_graph_rows": whether the engine graphs it, with batch_prefill_graphs on),
           and how much the memory torch reserves grew while it was captured and timed
ms: host clock around a synchronized call, median of --reps after two warm-up calls (the graph is seen, then
captured), each call from the same cache state (rewound). "bits": caches whose K/V after the eager and graphed
calls equal their solo call's, of B.
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import json
import statistics

import torch

from bench.balanced_routing import routing
from bench.runner import build, call_times, log, shapes
from diffgemma.model import engine_batch
from diffgemma.slots import rewind


@contextlib.contextmanager
def graph_rows(rows: int):
    """engine_batch.graph_rows is `rows` inside the `with` (0: every batched prefill runs eagerly)."""
    inner = engine_batch.graph_rows
    engine_batch.graph_rows = lambda engine: rows
    try:
        yield
    finally:
        engine_batch.graph_rows = inner


def ways(eng, caches, chunks, base: int, reps: int) -> dict:
    """solo / eager / graphed ms (median) of writing chunks[i] into caches[i] from length `base`, and the bits."""
    dev = eng.device
    runs = {"solo": lambda: [eng.commit(c, x) for c, x in zip(caches, chunks)],
            "eager": lambda: eng.prefill_batch(caches, chunks),
            "graphed": lambda: eng.prefill_batch(caches, chunks)}
    out, kv = {}, {}
    for name, fn in runs.items():
        reserved = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        with graph_rows(0 if name == "eager" else 2**31):
            times = call_times(dev, fn, reps, setup=lambda: [rewind(c, base) for c in caches])
        kv[name] = [[x.clone() for x in c.live_kv()] for c in caches]
        out[f"{name}_ms"] = round(statistics.median(times), 3)
        if name == "graphed" and dev.type == "cuda":  # what its capture added to the memory torch holds
            out["graphed_reserved_mib"] = round((torch.cuda.memory_reserved(dev) - reserved) / 2**20, 1)
    same = lambda a, b: sum(all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(kv[a], kv[b]))  # noqa: E731
    out["bits"] = f"eager {same('solo', 'eager')}/{len(caches)}, graphed {same('solo', 'graphed')}/{len(caches)}"
    return out


def probe(eng, cfg, ctx: int, sizes, reps: int) -> dict:
    dev, C, V = eng.device, cfg.canvas_length, cfg.vocab_size
    eng.options = dataclasses.replace(eng.options, batch_prefill_graphs=True)  # graph_rows' rule as the option makes it
    gen = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(0, V, (n,), generator=gen).to(dev)  # noqa: E731
    res = {}
    B = max(sizes)
    caches = [eng.new_cache(ctx + 2 * C) for _ in range(B)]
    for c in caches:
        eng.prefill(c, rand(ctx))
    blocks = [rand(C) for _ in range(B)]
    for b in sizes:
        res[f"commit_{b}x{C}"] = r = ways(eng, caches[:b], blocks[:b], ctx, reps)
        log(f"  commit {b} x {C} over {ctx}: {r}")
    prompts = [rand(ctx) for _ in range(B)]
    pad = eng.prefill_pad(caches[0], ctx) or ctx
    for b in sizes:
        res[f"prompts_{b}x{ctx}"] = r = ways(eng, caches[:b], prompts[:b], 0, reps)
        r["within_graph_rows"] = b * pad <= engine_batch.graph_rows(eng)
        log(f"  prompts {b} x {ctx}: {r}")
    eng.clear_graphs()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="fp8,q4")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--sizes", default="2,3,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    cfg, dev = shapes(a.tiny)
    ctx = 32 if a.tiny else a.context
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "context": ctx}
    for kind in a.kinds.split(","):
        eng = build(kind, cfg, dev, a.tiny)
        if a.tiny:
            eng.padded_prefill = True  # the CUDA engine's padded commits, on the CPU's torch path
        log(f"[{kind}]")
        with routing("balanced"):
            res[kind] = probe(eng, cfg, ctx, [int(x) for x in a.sizes.split(",")], a.reps)
        del eng
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
