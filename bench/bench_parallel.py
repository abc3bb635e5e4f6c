"""Benchmark: expert parallel over G GPUs against the 1-GPU engine, in one run, q4 and bf16 experts, full size.

    PYTHONPATH=src:. python -m bench.bench_parallel --gpus 2 [--formats q4,bf16] [--reps 20] [--json out.json]
    PYTHONPATH=src:. python -m bench.bench_parallel --gpus 2 --tiny      # CPU, gloo, a tiny model: the code path

For each expert format (q4 records with a q8 SC MLP, or bf16): the 1-GPU engine (model/engine.py) over random
full-size weights (bench/fixtures.py, seed 0) is built on GPU 0 and measured, then freed; then G ranks are started
(launch.py, NCCL), each builds its share of the same weights (every rank generates every tensor from the
same seed and keeps its slice) and rank 0's LeadEngine is measured the same way:
  step     a denoise at a 1k context as generate calls it (raw logits, SC embeddings; CUDA graph), wall time per call
           with a device sync after each (the same for both: rank 0's call includes handing it to the other ranks),
           median of --reps
  prefill  one 8k prompt into an empty cache (eager chunk), tokens/s, median of 3
  memory   rank 0's allocator peak after the 8k prefill and a graphed denoise over it (every rank holds the same
           share and the same caches), and GPU 0's used memory (cudaMemGetInfo: with NCCL's buffers) at that point
  check    the G-rank step's logits against the 1-GPU engine's on the same inputs (max |Δ| over max |logit|, argmax
           agreement): the ranks' f32 expert sums are added in another order, so a few bf16 roundings move
Routing is balanced on every rank (bench/balanced_routing.py): every expert gets the same rows.
The bars (issue 37): q4 and bf16 step on 2 GPUs <= 0.6x the 1-GPU step, prefill at 8k >= 1.6x, q4 memory per GPU
at 8k <= 12 GiB.

--tiny runs the same sequence on the CPU (gloo, G processes) on a tiny config at short contexts, in well under a
minute: it checks the path, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from bench import balanced_routing
from bench.bench_engine import CANVAS, TEXT
from bench.fixtures import RandomPackSource, RandomSource
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine
from diffgemma import launch
from diffgemma.parallel.engine import build_parallel_engine, shard_source

S, FULL = "sliding_attention", "full_attention"
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=6,
            layer_types=[S, FULL], num_experts=8, top_k_experts=2, moe_intermediate_size=32,
            final_logit_softcapping=30.0, max_position_embeddings=4096)
TINY_CANVAS = 16
SIZES = {False: dict(step_ctx=1024, prefill_ctx=8192), True: dict(step_ctx=64, prefill_ctx=256)}


def log(*a):
    print(*a, flush=True)


def config(tiny: bool) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TINY if tiny else TEXT,
                                  "canvas_length": TINY_CANVAS if tiny else CANVAS})


def source(cfg, fmt: str, device):
    if fmt == "bf16":
        return RandomSource(cfg, device, torch.bfloat16, seed=0)
    return RandomPackSource(cfg, device, torch.bfloat16, seed=0, experts=fmt, sc="q8")


def build_rank(group, fmt: str, tiny: bool):
    """One rank's engine over its share of the random weights, routing balanced (a follower's build: pickled)."""
    balanced_routing.forward_module.route_fused = balanced_routing.balanced_route
    cfg = config(tiny)
    return build_parallel_engine(cfg, shard_source(source(cfg, fmt, group.device), cfg, group), group, torch.bfloat16)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, cfg, tiny: bool, reps: int) -> dict:
    """step ms, prefill tok/s, peak memory and the step's logits (host) of one model; see the module docstring."""
    dev, V, sizes = model.device, cfg.vocab_size, SIZES[tiny]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (sizes["prefill_ctx"],), generator=g).to(dev)
    canvas = torch.randint(0, V, (cfg.canvas_length,), generator=g).to(dev)
    sc = model.embed(torch.randint(0, V, (cfg.canvas_length,), generator=g).to(dev))
    cache = model.new_cache(sizes["prefill_ctx"])
    model.prefill(cache, prompt[: sizes["step_ctx"]])
    logits = model.denoise_raw(cache, canvas, sc_embeds=sc).float().cpu()  # also the capture
    steps = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        model.denoise_raw(cache, canvas, sc_embeds=sc)
        _sync(dev)
        steps.append((time.perf_counter() - t) * 1e3)
    prefills = []
    for _ in range(3):
        cache.truncate(0)
        _sync(dev)
        t = time.perf_counter()
        model.prefill(cache, prompt)
        _sync(dev)
        prefills.append(len(prompt) / (time.perf_counter() - t))
    model.denoise_raw(cache, canvas, sc_embeds=sc)  # a graphed step over the full context: the session's peak
    _sync(dev)
    out = dict(step_ms=statistics.median(steps), prefill_tok_s=statistics.median(prefills), logits=logits)
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        free, total = torch.cuda.mem_get_info(dev)
        out["used_gib"] = (total - free) / 2**30  # the whole device as the driver sees it (contexts, NCCL buffers)
    del cache
    return out


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_format(fmt: str, gpus: int, tiny: bool, reps: int) -> dict:
    cfg = config(tiny)
    device_type = "cpu" if tiny else "cuda"
    dev = launch.rank_device(device_type, 0)
    with balanced_routing.routing("balanced"):
        one = build_engine(cfg, source(cfg, fmt, dev), dev, torch.bfloat16)
        base = measure(one, cfg, tiny, reps)
        del one
        _free(dev)
        log(f"{fmt}: 1 GPU  step {base['step_ms']:.2f} ms, prefill {base['prefill_tok_s']:.0f} tok/s")
        ranks = launch.start(gpus, device_type, build_rank, (fmt, tiny))
        try:
            lead = build_rank(ranks.group, fmt, tiny)
            par = measure(lead, cfg, tiny, reps)
            del lead
        finally:
            ranks.stop()
        _free(dev)
    a, b = base.pop("logits"), par.pop("logits")
    par["max_rel_diff"] = ((a - b).abs().max() / a.abs().max()).item()
    par["argmax_agree"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    par["step_ratio"] = par["step_ms"] / base["step_ms"]
    par["prefill_speedup"] = par["prefill_tok_s"] / base["prefill_tok_s"]
    log(f"{fmt}: {gpus} GPUs step {par['step_ms']:.2f} ms ({par['step_ratio']:.2f}x), prefill "
        f"{par['prefill_tok_s']:.0f} tok/s ({par['prefill_speedup']:.2f}x), logits max rel diff "
        f"{par['max_rel_diff']:.2g}, argmax agreement {par['argmax_agree']:.3f}"
        + (f", peak {par['peak_gib']:.1f} GiB on GPU 0" if "peak_gib" in par else ""))
    return {"one": base, "parallel": par}


def table(results: dict, gpus: int) -> str:
    rows = [f"| experts | 1 GPU step ms | {gpus} GPUs step ms | ratio (bar <= 0.6) | 1 GPU prefill tok/s | "
            f"{gpus} GPUs prefill tok/s | speedup (bar >= 1.6) | GiB per GPU at 8k (rank 0 peak) | logits check |",
            "|---|---|---|---|---|---|---|---|---|"]
    for fmt, r in results.items():
        o, p = r["one"], r["parallel"]
        mem = f"{p['peak_gib']:.1f}" if "peak_gib" in p else "—"
        rows.append(f"| {fmt} | {o['step_ms']:.2f} | {p['step_ms']:.2f} | {p['step_ratio']:.2f} | "
                    f"{o['prefill_tok_s']:.0f} | {p['prefill_tok_s']:.0f} | {p['prefill_speedup']:.2f} | {mem} | "
                    f"max rel {p['max_rel_diff']:.2g}, argmax {p['argmax_agree']:.3f} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, required=True, help="ranks of the parallel engine (GPUs; --tiny: processes)")
    ap.add_argument("--formats", default="q4,bf16", help="expert formats, comma-separated: q4, q5, q6, nvfp4, bf16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU over gloo (the code path, < 1 min)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.gpus < 1:
        ap.error("--gpus: expected a whole number >= 1")
    if not args.tiny and torch.cuda.device_count() < args.gpus:
        ap.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} visible GPU(s)")
    reps = min(args.reps, 3) if args.tiny else args.reps
    results = {}
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        results[fmt] = bench_format(fmt, args.gpus, args.tiny, reps)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpus": args.gpus, "tiny": args.tiny, "results": results}, f, indent=1)
    log(table(results, args.gpus))


if __name__ == "__main__":
    main()
