"""The hub's 4-bit checkpoints at full size (docs/FORMATS.md, issue 52): each layout's engine beside diffgemma's own q4
pack (bench.fixtures.RandomPackSource: q4 experts, q8 SC MLP) in the same run, one engine at a time.

    PYTHONPATH=src:. timeout 600 python3 -m bench.bench_hub --json $OUT/hub.json

Per engine: the build time and the weights' GiB; the denoise step at 1k context as generate runs it (CUDA-graphed,
inputs staged before the replay, bench/bench_engine.generate_forward), median of --reps; the batched forward at
B=8 (denoise_batch_raw, 1k-token lanes); the peak allocated GiB of an 8k session (an 8k-token cache, the prompt
prefilled, one graphed step). Then each layout's step ratio and memory delta against q4 (the issue's bars: <= 1.1x,
<= 1 GiB).

Layouts (bench/hub_fixtures.py; --layouts): int4 (compressed-tensors W4A16, the engine's q4 records) and
modelopt-nvfp4 (ModelOpt NVFP4, the engine's nvfp4e records) by default; gptq-int4 and nvfp4 (compressed-tensors)
convert to the same records; fp8 (compressed-tensors FP8_DYNAMIC, the FP8 engine's) is there for comparison. By
default each is built in memory through the loader's own HubSource (no file; the conversion runs on the GPU);
--write DIR writes each as a checkpoint there and loads it with diffgemma.load instead (15-27 GB each).
Routing is balanced (bench/balanced_routing.py) unless --routing model. --tiny: a CPU dry run at the demo's shapes.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench import hub_fixtures
from bench.balanced_routing import KINDS, routing
from bench.bench_engine import generate_forward, time_cuda
from bench.runner import build as build_q4, call_times, dumper, log, shapes, sync
from diffgemma.quant.hub_source import describe_formats

GiB = 2**30
DEFAULT_LAYOUTS = ("int4", "modelopt-nvfp4")
STEP_CTX, BATCH, SESSION_CTX = 1024, 8, 8192
TINY_SIZES = (32, 2, 128)  # --tiny: the step's context, the batch, the session's context


def _canvas(eng, cfg, gen):
    dev, V, C = eng.device, cfg.vocab_size, cfg.canvas_length
    return torch.randint(0, V, (C,), generator=gen).to(dev), eng.embed(torch.randint(0, V, (C,), generator=gen).to(dev))


def _cache(eng, cfg, ctx, gen):
    cache = eng.new_cache(ctx + 2 * cfg.canvas_length)
    eng.prefill(cache, torch.randint(0, cfg.vocab_size, (ctx,), generator=gen).to(eng.device))
    return cache


def _ms(dev, fn, reps, setup=None) -> list[float]:
    if dev.type == "cuda":
        return time_cuda(fn, reps=reps, warmup=2, setup=setup)
    return call_times(dev, lambda: (setup and setup(), fn()), reps)


def step(eng, cfg, ctx, reps) -> dict:
    """The denoise step over a `ctx`-token cache, as generate calls it: the sparse-SC embedding in, staged."""
    gen = torch.Generator().manual_seed(1)
    cache = _cache(eng, cfg, ctx, gen)
    ids, emb = _canvas(eng, cfg, gen)
    fwd = generate_forward(eng)
    fwd(cache, ids, sc_embeds=emb)  # capture
    stage = getattr(eng, "stage_denoise", None)
    t = _ms(eng.device, lambda: fwd(cache, ids, sc_embeds=emb), reps,
            setup=(lambda: stage(cache, ids, sc_embeds=emb)) if stage is not None else None)
    out = {"ms": round(statistics.median(t), 4), "min_ms": round(min(t), 4), "graph_error": eng.graph_error}
    eng.clear_graphs()
    return out


def batched(eng, cfg, B, ctx, reps) -> dict:
    """The batched forward of B lanes over `ctx`-token caches (denoise_batch_raw), median ms and canvas rows/s."""
    gen = torch.Generator().manual_seed(2)
    caches = [_cache(eng, cfg, ctx, gen) for _ in range(B)]
    lanes = [_canvas(eng, cfg, gen) for _ in range(B)]
    ms = statistics.median(call_times(eng.device, lambda: eng.denoise_batch_raw(
        caches, [c for c, _ in lanes], sc_embeds=[e for _, e in lanes]), reps))
    eng.clear_graphs()
    return {"B": B, "ms": round(ms, 4), "rows_s": round(B * cfg.canvas_length / ms * 1e3, 1)}


def session_memory(eng, cfg, ctx) -> dict:
    """Peak allocated GiB over an 8k session: the cache made, the prompt (ctx - canvas) prefilled, a step captured
    and replayed; and what stays allocated after."""
    dev = eng.device
    if dev.type != "cuda":
        return {"skipped": "cpu"}
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    gen = torch.Generator().manual_seed(3)
    cache = _cache(eng, cfg, ctx - cfg.canvas_length, gen)
    ids, emb = _canvas(eng, cfg, gen)
    fwd = generate_forward(eng)
    fwd(cache, ids, sc_embeds=emb)
    fwd(cache, ids, sc_embeds=emb)
    sync(dev)
    out = {"ctx": ctx, "peak_gib": round(torch.cuda.max_memory_allocated(dev) / GiB, 3),
           "allocated_gib": round(torch.cuda.memory_allocated(dev) / GiB, 3)}
    del cache
    eng.clear_graphs()
    return out


def build(kind, cfg, dev, tiny, write_dir: Path | None):
    """(engine, its weights' formats) for "q4" (bench/runner.build) or a hub layout: in memory, or written under
    write_dir and loaded as a user would."""
    dtype = torch.float32 if tiny else torch.bfloat16
    kw = {"kv_dtype": torch.float32} if tiny else {}
    if kind == "q4":
        return build_q4("q4", cfg, dev, tiny), "experts=q4, sc=q8"
    if write_dir is None:
        eng, src = hub_fixtures.build(cfg, kind, dev, dtype, **kw)
        return eng, describe_formats(src, eng, dtype)
    import diffgemma

    directory = write_dir / kind
    shutil.rmtree(directory, ignore_errors=True)
    hub_fixtures.write(hub_fixtures.HubTensors(cfg, kind, dev), directory)
    eng = diffgemma.load(directory, device=dev, dtype=dtype, engine="fast")
    return eng, getattr(eng, "weight_formats", None)


def expert_layout(eng) -> str:
    """The byte order the engine's first expert stack is held in (the kernel it runs: ops/moe_paths.py)."""
    w = eng.w.layers[0].experts_gu
    return getattr(w, "layout", type(w).__name__)


def measure(kind, cfg, dev, a, res, dump) -> None:
    ctx, B, session = TINY_SIZES if a.tiny else (STEP_CTX, BATCH, SESSION_CTX)
    t = time.time()
    with routing(a.routing):
        eng, formats = build(kind, cfg, dev, a.tiny, a.write)
        sync(dev)
        r = res[kind] = {"build_s": round(time.time() - t, 1), "formats": formats,
                         "expert_layout": expert_layout(eng)}
        if dev.type == "cuda":
            r["weights_gib"] = round(torch.cuda.memory_allocated(dev) / GiB, 3)
        log(f"[{kind}] built in {r['build_s']}s: {formats} ({r['expert_layout']}), {r.get('weights_gib', '-')} GiB")
        for name, fn in (("step_1k", lambda: step(eng, cfg, ctx, a.reps)),
                         ("batch8_1k", lambda: batched(eng, cfg, B, ctx, max(3, a.reps // 4))),
                         ("session_8k", lambda: session_memory(eng, cfg, session))):
            if name == "batch8_1k" and a.no_batch:
                continue
            t = time.time()
            r[name] = fn()
            log(f"[{kind} {name}] {r[name]} ({time.time() - t:.1f}s)")
            dump()
    del eng
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def ratios(res: dict, layouts) -> dict:
    """Each layout against q4: step ratio (bar <= 1.1), 8k peak delta GiB (bar <= 1), batched ratio."""
    q = res["q4"]
    out = {}
    for kind in layouts:
        h = res.get(kind, {})
        row = {}
        if "step_1k" in h:
            row["step_ratio"] = round(h["step_1k"]["ms"] / q["step_1k"]["ms"], 4)
        if "batch8_1k" in h and "batch8_1k" in q:
            row["batch8_ratio"] = round(h["batch8_1k"]["ms"] / q["batch8_1k"]["ms"], 4)
        if "peak_gib" in h.get("session_8k", {}):
            row["mem_8k_delta_gib"] = round(h["session_8k"]["peak_gib"] - q["session_8k"]["peak_gib"], 3)
        if "step_ratio" in row and "mem_8k_delta_gib" in row:
            row["within_bars"] = row["step_ratio"] <= 1.1 and row["mem_8k_delta_gib"] <= 1.0
        out[kind] = row
    return out


def table(res: dict, layouts) -> str:
    lines = ["| engine | step at 1k ms (x q4) | B=8 forward ms (x q4) | 8k session peak GiB (vs q4) |",
             "|---|---|---|---|"]
    for kind in ("q4", *layouts):
        r, x = res.get(kind, {}), res["ratios"].get(kind, {})
        s, b, m = r.get("step_1k", {}), r.get("batch8_1k", {}), r.get("session_8k", {})
        lines.append(f"| {kind} | {s.get('ms', '-')} ({x.get('step_ratio', '-')}) | {b.get('ms', '-')} "
                     f"({x.get('batch8_ratio', '-')}) | {m.get('peak_gib', '-')} ({x.get('mem_8k_delta_gib', '-')}) |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                    help=f"comma list of {sorted(hub_fixtures.LAYOUTS)}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--routing", default="balanced", choices=KINDS)
    ap.add_argument("--no-batch", action="store_true", help="skip the B=8 batched forward")
    ap.add_argument("--write", type=Path, default=None, metavar="DIR",
                    help="write each layout as a checkpoint under DIR and load it (instead of building in memory)")
    ap.add_argument("--tiny", action="store_true", help="a CPU dry run at the demo model's shapes")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    layouts = [x for x in a.layouts.split(",") if x]
    bad = [x for x in layouts if x not in hub_fixtures.LAYOUTS]
    if bad or not layouts:
        ap.error(f"--layouts {a.layouts!r}: expected a comma list of {sorted(hub_fixtures.LAYOUTS)}")
    cfg, dev = shapes(a.tiny)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "routing": a.routing, "reps": a.reps, "tiny": a.tiny, "source": "written" if a.write else "in-memory",
           "layouts": layouts}
    dump = dumper(res, a.json)
    t0 = time.time()
    for kind in ("q4", *layouts):
        measure(kind, cfg, dev, a, res, dump)
    res["ratios"] = ratios(res, layouts)
    res["total_s"] = round(time.time() - t0, 1)
    dump()
    log("\n" + table(res, layouts) + f"\n(bars: step <= 1.1x q4, 8k peak within 1 GiB; {res['total_s']}s in all)")
    if a.write:
        shutil.rmtree(a.write, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
