"""Small kernels alone at the real shapes, each against the variant it replaced (one GPU, under a minute).

    PYTHONPATH=src python -m bench.bench_kernels [--reps 7] [--json out.json]

A kernel of a few microseconds launched from Python back to back is timed by the host's launch rate, not by
the GPU. So every call here is captured 20 times into one CUDA graph and the graph is replayed; GPU µs a
call = the median replay / inner. Inputs stay the same across the calls, so they sit in L2 as a producer's
output would in the engine. What is timed:

  qkv_prep           one program per (token, head) (heads_per_program=1), against the
                     default (2048 values a program); the sliding (hd 256, 16 + 8 + 8 heads) and full (hd 512,
                     16 + 2 heads, V read from K's columns) layers, 256 canvas rows and an 8192-row prefill chunk
  sampler passes     at [256, 262144]: the row stats and the counted probabilities from raw bf16 logits through
                     the tempered table (generate's step), the table's kernel, the row stats of f32 logits at a
                     step temperature and at T = 1 (against the per-block reductions they replaced)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from bench.bench_engine import time_graph
from diffgemma.ops import qkv, rowstats, tempered_tables


def timed(fn, reps: int, inner: int = 20) -> float:
    """GPU µs a call of fn: `inner` calls in one CUDA graph, the median of `reps` replays."""
    return statistics.median(time_graph(lambda: [fn() for _ in range(inner)], inner, reps))


def bench_qkv_prep(reps: int) -> dict:
    out = {}
    dev = "cuda"
    for name, (H, KV, hd, has_v) in {"sliding": (16, 8, 256, True), "full": (16, 2, 512, False)}.items():
        for T in (256, 8192):
            rows = 1279 + T
            x = torch.randn(T, (H + KV + (KV if has_v else 0)) * hd, device=dev, dtype=torch.bfloat16)
            nw = torch.rand(3, hd, device=dev) + 0.5
            inv = 1.0 / (1e4 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
            pos = torch.arange(5000, 5000 + T, device=dev)
            slots = pos % rows
            v_off = (H + KV) * hd if has_v else H * hd
            ck = torch.zeros(KV, rows, hd, device=dev, dtype=torch.float16)
            cv = torch.zeros_like(ck)
            row = {}
            for label, per_program in (("one_head_a_program", 1), ("default", None)):
                row[label] = timed(lambda p=per_program: qkv.qkv_prep_triton(
                    x, H, KV, hd, v_off, nw, inv, pos, 1e-6, torch.float16, cache_k=ck, cache_v=cv, slots=slots,
                    heads_per_program=p), reps)
            out[f"{name}_hd{hd}_rows{T}"] = row
            print(f"qkv_prep {name} hd {hd}, {T} rows: " + ", ".join(f"{k} {v:.1f} µs" for k, v in row.items()),
                  flush=True)
    return out


def bench_rowstats(reps: int) -> dict:
    """The sampler's passes as generate runs them (raw bf16 logits, softcap 30, z from the tempered table), the
    table itself, and the row stats over f32 logits at a step temperature and at T = 1 (the forward's SC softmax)."""
    dev = "cuda"
    raw = (torch.randn(256, 262144, device=dev) * 3).to(torch.bfloat16)
    logits = torch.tanh(torch.randn(256, 262144, device=dev) * 0.5) * 30
    temp, cap = 0.6083333492279053, 30.0
    stats = rowstats.tempered_rowstats_triton(raw, temp, cap=cap)
    thr = stats[2] - 10.0
    probs = torch.empty(256, 262144, device=dev, dtype=torch.bfloat16)
    row = {
        "rowstats_raw": timed(lambda: rowstats.tempered_rowstats_triton(raw, temp, cap=cap), reps),
        "counted_probs_raw": timed(lambda: rowstats.tempered_masked_probs_triton(
            raw, temp, thr, stats[3], torch.bfloat16, count=True, out=probs, cap=cap), reps),
        "tempered_table": timed(lambda: tempered_tables.divide_table(tempered_tables.softcap_table(cap, raw), temp, True),
                                reps),
        "rowstats_f32": timed(lambda: rowstats.tempered_rowstats_triton(logits, temp), reps),
        "rowstats_f32_t1": timed(lambda: rowstats.tempered_rowstats_triton(logits, 1.0), reps),
    }
    print("sampler passes at [256, 262144]: " + ", ".join(f"{k} {v:.1f} µs" for k, v in row.items()), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    res = {"gpu": torch.cuda.get_device_name(), "qkv_prep_us": bench_qkv_prep(a.reps),
           "tempered_rowstats_us": bench_rowstats(a.reps)}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
