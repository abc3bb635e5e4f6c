"""Probe: the expert GEMMs on torch's grouped kernels, bf16 against FP8, by rows per expert.

    PYTHONPATH=src:. python -m bench.probes.probe_fp8_grouped --json $OUT/grouped.json

At the model's expert shapes (128 experts; gate‖up N 1408 x K 2816, down N 2816 x K 704) with balanced routes
(every expert the same rows): 16 rows an expert (one canvas), 128 (eight canvases), 512 (eight 1k prompts in one
prefill). Variants:
  bf16          torch._grouped_mm on bf16 rows and weights
  fp8           torch._scaled_grouped_mm on e4m3 rows (per-row scales) and weights (per-channel scales), as
                ops/fp8_moe.grouped_mm_fp8_torch calls it
  fp8_chunks4   the same FP8 GEMM as four calls of 32 experts each (whether the kernel's choice depends on the
                call's total rows)
  triton_BN_BM_warps_stages   ops/fp8_moe.grouped_mm_fp8_triton at those tiles (K tile 128, as the engine's), and
                whether its output has torch's FP8 bits (bits_*)
Times: GPU µs a call, captured in a CUDA graph, the median of --reps replays (bench/bench_engine.time_graph), and
the TFLOP/s they make.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from diffgemma.ops import fp8_moe
from diffgemma.ops.fp8_quant import quantize_rows
from diffgemma.ops.fp8_weight import quantize_fp8

E, SHAPES, PER_EXPERT = 128, {"gate_up": (1408, 2816), "down": (2816, 704)}, (16, 128, 512)
TRITON = [(128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3), (64, 128, 4, 3), (256, 128, 8, 3)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_fp8_grouped: needs CUDA")
    from bench.bench_engine import time_graph
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res = {}
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(E, N, K, device=dev, generator=gen) * 0.02).bfloat16()
        w8 = quantize_fp8(w)
        wt, w8t = w.transpose(-2, -1), w8.weight.transpose(-2, -1)
        for per in PER_EXPERT:
            M = E * per
            x = torch.randn(M, K, device=dev, generator=gen).bfloat16()
            q, s = quantize_rows(x)
            offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * per
            c = E // 4
            offs_c = torch.arange(1, c + 1, device=dev, dtype=torch.int32) * per

            def chunks():
                for i in range(4):
                    r = slice(i * c * per, (i + 1) * c * per)
                    torch._scaled_grouped_mm(q[r], w8t[i * c:(i + 1) * c], scale_a=s[r],
                                             scale_b=w8.scale[i * c:(i + 1) * c], offs=offs_c,
                                             out_dtype=torch.bfloat16)

            runs = {"bf16": lambda: torch._grouped_mm(x, wt, offs=offs),
                    "fp8": lambda: torch._scaled_grouped_mm(q, w8t, scale_a=s, scale_b=w8.scale, offs=offs,
                                                            out_dtype=torch.bfloat16),
                    "fp8_chunks4": chunks}
            for bn, bm, warps, stages in TRITON:
                runs[f"triton_{bn}_{bm}_{warps}_{stages}"] = (
                    lambda c=(bn, bm, 128, warps, stages): fp8_moe.grouped_mm_fp8_triton(q, s, w8, offs, config=c))
            r = {}
            for v, fn in runs.items():
                try:
                    us = statistics.median(time_graph(fn, 1, a.reps))
                    r[f"{v}_us"] = round(us, 1)
                    r[f"{v}_tflops"] = round(2 * M * N * K / us / 1e6, 1)
                except Exception as e:  # a variant this torch cannot run, for the record
                    r[f"{v}_us"] = f"{type(e).__name__}: {str(e)[:200]}"
            want = runs["fp8"]()
            for v in runs:
                if v.startswith("triton") and isinstance(r.get(f"{v}_us"), float):
                    r[f"bits_{v}"] = bool(torch.equal(runs[v](), want))
            res[f"{name}_{per}"] = r
            print(name, per, json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
