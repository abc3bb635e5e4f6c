"""Does the random-weight benchmark route like a real model? (the validity of issue 5's and 6's step times)

A real model's canvas (256 positions x top-8 routes) reaches every one of the 128 experts, so a denoise step
streams all expert weights: issue 5's premise and our roofline. Random weights need not do that: if the
canvas rows' hidden states are alike, they pick the same few experts and the grouped GEMM reads a fraction
of the bytes, so a step looks faster than it would be on the real model.

    PYTHONPATH=src python -m bench.bench_routing [--contexts 1024,8192] [--reps 20] [--json out.json]

Builds the full-size random engine (bf16 experts, then q4 experts as in bench_pack.py) and, per context:
  - counts, per layer, the distinct experts the canvas routes to and the largest rows-per-expert (eager pass,
    the model's own routing);
  - times the graphed denoise step (CUDA events, median) under the model's routing and under balanced
    routing: route (t, j) -> expert (8t + j) mod 128, so every expert gets exactly 16 rows and every expert
    weight is read. The router still runs (its cost stays in); only its expert ids are replaced.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from bench.balanced_routing import MODEL_ROUTE, route_with, routing
from bench.bench_engine import BW, CANVAS, TEXT, time_cuda, weight_bytes
from bench.fixtures import RandomPackSource, RandomSource
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine

def log(*a):
    print(*a, flush=True)


def routing_stats(eng, cache, ids, sc) -> dict:
    """Distinct experts and max rows per expert, per layer, under the model's own routing (eager, syncs)."""
    seen = []

    def counting_route(router_in, router_w, k, per_expert_scale, **kw):
        weights, experts = MODEL_ROUTE(router_in, router_w, k, per_expert_scale, **kw)
        counts = torch.bincount(experts.flatten(), minlength=router_w.shape[0])
        seen.append((int((counts > 0).sum()), int(counts.max())))
        return weights, experts

    use_graphs, eng.use_graphs = eng.use_graphs, False
    try:
        with route_with(counting_route):
            eng.denoise(cache, ids, sc_logits=sc)
    finally:
        eng.use_graphs = use_graphs
    distinct = [d for d, _ in seen]
    return {"distinct_experts_per_layer": distinct, "max_rows_per_expert": [m for _, m in seen],
            "distinct_min": min(distinct), "distinct_mean": sum(distinct) / len(distinct)}


def timed_step(eng, cache, ids, sc, reps: int, kind: str) -> float:
    eng.clear_graphs()  # a captured graph holds the routing function it was captured with
    try:
        with routing(kind):
            eng.denoise(cache, ids, sc_logits=sc)  # capture
            return statistics.median(time_cuda(lambda: eng.denoise(cache, ids, sc_logits=sc), reps=reps, warmup=2))
    finally:
        eng.clear_graphs()


def bench(label: str, eng, cfg, contexts, reps) -> dict:
    V, out = cfg.vocab_size, {"weight_bytes": weight_bytes(eng.w)}
    c0 = eng.new_cache(2048)  # warm-up: compile kernels
    eng.prefill(c0, torch.randint(0, V, (1024,), device="cuda"))
    eng.denoise(c0, torch.randint(0, V, (CANVAS,), device="cuda"))
    del c0
    for T in contexts:
        cache = eng.new_cache(T)
        eng.prefill(cache, torch.randint(0, V, (T,), device="cuda"))
        ids = torch.randint(0, V, (CANVAS,), device="cuda")
        sc = torch.randn(CANVAS, V, device="cuda") * 3
        r = routing_stats(eng, cache, ids, sc)
        r["denoise_model_routing_ms"] = timed_step(eng, cache, ids, sc, reps, "model")
        r["denoise_balanced_routing_ms"] = timed_step(eng, cache, ids, sc, reps, "balanced")
        r["roofline_weights_ms"] = out["weight_bytes"] / BW * 1e3
        log(f"[{label}] ctx {T}: distinct experts per layer min {r['distinct_min']} mean {r['distinct_mean']:.1f} "
            f"(of {cfg.num_experts}); max rows/expert {max(r['max_rows_per_expert'])}; denoise graphed "
            f"{r['denoise_model_routing_ms']:.2f} ms (model routing) / {r['denoise_balanced_routing_ms']:.2f} ms "
            f"(balanced); weight-byte floor {r['roofline_weights_ms']:.2f} ms")
        log(f"[{label}] ctx {T}: distinct per layer {r['distinct_experts_per_layer']}")
        out[T] = r
        del cache
        gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-q4", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    sources = [("bf16", lambda: RandomSource(cfg, "cuda", torch.bfloat16, seed=0))]
    if not args.skip_q4:
        sources.append(("q4", lambda: RandomPackSource(cfg, "cuda", torch.bfloat16, seed=0, experts="q4", sc="q8")))
    for label, make in sources:
        t0 = time.time()
        eng = build_engine(cfg, make(), "cuda", torch.bfloat16)
        torch.cuda.synchronize()
        log(f"[{label}] built in {time.time() - t0:.1f}s")
        res[label] = bench(label, eng, cfg, contexts if label == "bf16" else contexts[:1], args.reps)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
