"""Probe: what is alive at the peak of a q4 generate session at 8k context (one GPU, a minute).

    PYTHONPATH=src python -m bench.probes.probe_memory [--top 25]

Builds the full-size q4 model on random weights (as bench_pack.py), prefills 7936 tokens, runs one warm
`generate` (captures the graphs), then records the allocator's history over a second generate that ends with
8192 tokens in the cache. Replaying that trace finds the moment of peak allocated memory; the blocks alive
then are grouped by the first diffgemma / bench frame of their allocation stack and printed, largest first.
Graph-pool blocks that were allocated before recording began show as "before recording".
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

import diffgemma.generation as G
from bench.bench_engine import CANVAS, TEXT
from bench.fixtures import RandomPackSource
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine

GiB = 2**30


def where(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "diffgemma" in name or "/bench/" in name:
            return f"{Path(name).name}:{f.get('line')} {f.get('name')}"
    return "(torch internals)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    eng = build_engine(cfg, RandomPackSource(cfg, "cuda", torch.bfloat16, seed=0, experts="q4", sc="q8"), "cuda",
                       torch.bfloat16)
    V = cfg.vocab_size
    weights = torch.cuda.memory_allocated()
    cs = eng.new_cache(8192)
    eng.prefill(cs, torch.randint(0, V, (8192 - CANVAS,), device="cuda"))
    G.generate(eng, [], max_new_tokens=CANVAS, cache=cs, seed=0)
    cs.truncate(8192 - CANVAS)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    G.generate(eng, [], max_new_tokens=CANVAS, cache=cs, seed=1)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    print(f"weights {weights / GiB:.3f} GiB; allocated before the generate {base / GiB:.3f}; peak {peak / GiB:.3f}; "
          f"reserved {torch.cuda.memory_reserved() / GiB:.3f}")
    # replay the trace: live blocks at the peak of allocated bytes
    live, cur, best, best_live = {}, 0, -1, {}
    for trace in snap["device_traces"]:
        for ev in trace:
            act, addr, size = ev["action"], ev["addr"], ev["size"]
            if act == "alloc":
                live[addr] = (size, where(ev.get("frames", [])))
                cur += size
                if cur > best:
                    best, best_live = cur, dict(live)
            elif act == "free_completed" and addr in live:
                cur -= live.pop(addr)[0]
    by = collections.Counter()
    for size, w in best_live.values():
        by[w] += size
    print(f"bytes allocated during the generate and alive at its peak: {best / GiB:.3f} GiB "
          f"(on top of {base / GiB:.3f} GiB held before it)")
    for w, size in by.most_common(a.top):
        print(f"  {size / 2**20:9.1f} MiB  {w}")
    # what was held before: the cache, the graphs' pool, weights
    kv = sum(t.numel() * t.element_size() for t in cs.keys + cs.values)
    print(f"held before the generate: cache K/V {kv / GiB:.3f} GiB, the rest (graph pools, small tensors) "
          f"{(base - weights - kv) / GiB:.3f} GiB")


if __name__ == "__main__":
    main()
