"""Probe: one generate's GPU timeline, step by step (one GPU, ~1 min).

    PYTHONPATH=src:. python -m bench.probes.probe_loop_trace [--kind q4] [--out DIR]
    PYTHONPATH=src:. python -m bench.probes.probe_loop_trace --analyze DIR/loop_trace.json.gz   # no GPU

Full size, random weights, balanced routing, a 1k prompt and bench_e2e's fixed-step settings (4 blocks of 16
steps): three warm generates, then one under the profiler (CPU and CUDA activity), saved as a gzipped chrome trace.
The analysis cuts the timeline at each guarded launch's condition kernel (`set_if`: one a step launched ahead) and,
for the steps inside a block, gives per step: the span from one condition kernel to the next, the GPU's idle time
in it, the gap from the condition kernel to the body's first kernel, the idle gaps over 2 us by the kernels around
them, and the kernels on the loop's own stream (the sampler, SC and stop rules; the forward's body runs on the
graph's streams).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import sys
import time

SPAN_MAX_US = 12000  # a span longer than this holds a block's end (commit, decode): not a step


def kernels(trace: dict) -> list:
    return sorted([e for e in trace["traceEvents"] if e.get("ph") == "X"
                   and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])


def short(name: str) -> str:
    return name.split("(")[0].split("<")[0][:48]


def analyze(trace: dict) -> dict:
    K = kernels(trace)
    marks = [i for i, e in enumerate(K) if e["name"] == "set_if"]
    loop_stream = K[marks[0]]["args"].get("stream") if marks else None
    steps, span, idle, first_gap = 0, 0.0, 0.0, 0.0
    gaps, gap_n, loop = collections.Counter(), collections.Counter(), collections.Counter()
    for a, b in zip(marks, marks[1:]):
        if K[b]["ts"] - K[a]["ts"] > SPAN_MAX_US:
            continue
        steps += 1
        span += K[b]["ts"] - K[a]["ts"]
        end, prev = K[a]["ts"] + K[a]["dur"], "set_if"
        first_gap += K[a + 1]["ts"] - end
        for e in K[a + 1: b + 1]:
            if e["ts"] > end:
                idle += e["ts"] - end
                if e["ts"] > end + 2:
                    gaps[(prev, short(e["name"]))] += e["ts"] - end
                    gap_n[(prev, short(e["name"]))] += 1
            if e["ts"] + e["dur"] > end:
                end, prev = e["ts"] + e["dur"], short(e["name"])
        for e in K[a:b]:
            if e["args"].get("stream") == loop_stream:
                loop[short(e["name"])] += e["dur"]
    if not steps:
        raise SystemExit("no guarded launches in the trace (plain graphs, or no run-ahead)")
    out = {"steps": steps, "span_us": span / steps, "idle_us": idle / steps,
           "set_if_to_body_us": first_gap / steps,
           "gaps_us": {f"{p} -> {n}": round(v / steps, 1) for (p, n), v in gaps.most_common(8)},
           "loop_stream_us": {k: round(v / steps, 1) for k, v in loop.most_common(8)}}
    print(f"{steps} steps: span {out['span_us']:.1f} us, idle {out['idle_us']:.1f} us, condition kernel to body "
          f"{out['set_if_to_body_us']:.1f} us")
    print("idle gaps over 2 us, per step:")
    for k, v in out["gaps_us"].items():
        print(f"  {v:8.1f} us  {k}")
    print("the loop stream's kernels, per step:")
    for k, v in out["loop_stream_us"].items():
        print(f"  {v:8.1f} us  {k}")
    return out


def record(kind: str, out_dir: str) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.bench_e2e import BLOCKS, fixed_steps
    from bench.runner import build, routing, shapes, sync
    from diffgemma.generation import generate

    cfg, dev = shapes(False)
    eng = build(kind, cfg, dev, False)
    C, V = cfg.canvas_length, cfg.vocab_size
    prompt = torch.randint(0, V, (1024,), generator=torch.Generator().manual_seed(1)).to(dev)
    with routing("balanced"):
        cache = eng.new_cache(1024 + (BLOCKS + 1) * C, rewind_slack=BLOCKS * C)
        eng.prefill(cache, prompt)
        s = fixed_steps(C, BLOCKS)
        for _ in range(3):
            cache.truncate(1024)
            sync(dev)
            t = time.perf_counter()
            generate(eng, [], settings=s, cache=cache)
            sync(dev)
            print(f"generate {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)
        cache.truncate(1024)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(eng, [], settings=s, cache=cache)
            sync(dev)
    raw = os.path.join(out_dir, "loop_trace.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)
    return raw + ".gz"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="q4", choices=["q4", "bf16"])
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--analyze", default=None, help="a saved trace (.json.gz) to analyze instead of recording one")
    a = ap.parse_args()
    path = a.analyze
    if path is None:
        import torch

        if not torch.cuda.is_available():
            sys.exit("probe_loop_trace.py records on a CUDA GPU (--analyze reads a saved trace anywhere)")
        path = record(a.kind, a.out)
    with gzip.open(path) as f:
        analyze(json.load(f))


if __name__ == "__main__":
    main()
