"""Probe: the q4 batched forward's row tile, speed against invariance (one GPU, ~1 min).

    PYTHONPATH=src:. python -m bench.probes.probe_batch_paths [--batch 8] [--reps 10]
    PYTHONPATH=src:. python -m bench.probes.probe_batch_paths --profile     # GPU time by kernel, B=1 vs B=8

Full-size q4 random weights, balanced routing, B lanes of 1k context. The solo graphed denoise of each lane (its
q4 kernel at BM=32 rows a pass) against the batched forward with batch_paths "lane" and the q4 kernel's row tile
forced to BM = 32 / 64 / 128 for the batch: median ms, and how many lanes come out bit-identical to solo.
--profile: the eager forward at B=1 and at B, under torch.profiler: the GPU time per kernel name (top 25, summed
over the forward), to see what grows with B.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from bench.balanced_routing import routing
from bench.bench_batch import lanes, timed
from bench.runner import build, log
from bench.bench_engine import CANVAS, TEXT
from diffgemma.config import ModelConfig
from diffgemma.ops import moe


def profile(eng, cfg, B, kind):
    from torch.profiler import ProfilerActivity, profile as prof

    dev = eng.device
    caches, canvases, scs = lanes(eng, cfg, B, 1024, seed=6)
    eng.use_graphs = False
    for n in (1, B):
        def fwd():
            if n == 1:
                eng.denoise_raw(caches[0], canvases[0], sc_embeds=scs[0])
            else:
                eng.denoise_batch_raw(caches[:n], canvases[:n], sc_embeds=scs[:n])
        fwd()
        torch.cuda.synchronize(dev)
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            fwd()
            torch.cuda.synchronize(dev)
        rows = {}
        for e in p.events():
            if e.device_type.name == "CUDA":
                k = e.name[:60]
                rows[k] = rows.get(k, 0.0) + e.device_time_total / 1e3
        total = sum(rows.values())
        log(f"[{kind}] B={n}: kernels' GPU time {total:.2f} ms")
        for k, v in sorted(rows.items(), key=lambda kv: -kv[1])[:25]:
            log(f"   {v:8.3f} ms  {k}")
    eng.use_graphs = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    dev = torch.device("cuda")
    if a.profile:
        for kind in ("q4", "bf16"):
            with routing("balanced"):
                profile(build(kind, cfg, dev, False), cfg, a.batch, kind)
        return
    eng = build("q4", cfg, dev, False)
    real = moe.moe_q4.grouped_mm_q4_tiles
    with routing("balanced"):
        caches, canvases, scs = lanes(eng, cfg, a.batch, 1024, seed=5)
        solo = [eng.denoise_raw(c, x, sc_embeds=s).clone() for c, x, s in zip(caches, canvases, scs)]
        ms1 = timed(dev, lambda: eng.denoise_raw(caches[0], canvases[0], sc_embeds=scs[0]), a.reps)
        log(f"solo B=1: {ms1} ms")
        for bm in (32, 64, 128):
            moe.moe_q4.grouped_mm_q4_tiles = lambda *x, BM=32, **k: real(*x, BM=bm, **k)  # noqa: B023
            eng.options = replace(eng.options, batch_paths="lane")
            eng.clear_graphs()
            try:
                got = [g.clone() for g in eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)]
                ms = timed(dev, lambda: eng.denoise_batch_raw(caches, canvases, sc_embeds=scs), a.reps)
                same = sum(torch.equal(g, s) for g, s in zip(got, solo))
                log(f"batch B={a.batch} BM={bm}: {ms} ms, x{round(a.batch * ms1 / ms, 3)} rows/s vs B=1, "
                    f"lanes bit-identical {same}/{a.batch}")
            except Exception as e:
                log(f"batch BM={bm}: {type(e).__name__}: {str(e)[:300]}")
            finally:
                moe.moe_q4.grouped_mm_q4_tiles = real


if __name__ == "__main__":
    main()
