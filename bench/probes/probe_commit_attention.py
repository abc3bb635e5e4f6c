"""Probe: a 256-token commit's causal attention per layer kind, flash kernel against tile-kernel configs (one GPU).

    PYTHONPATH=src:. python -m bench.probes.probe_commit_attention [--context 1024] [--slack 256] [--reps 50]

The full-size shapes: sliding layers (8 KV heads, head dim 256, a wrapped ring of 1023 + slack slots plus the chunk in
the canvas scratch rows, window 1024) and full layers (2 KV heads, head dim 512, a 2048-row bucket). Each variant is
checked against the f32 reference first, then timed as the median of CUDA-graph replays (10 calls a replay); each
line also says whether it gives the default flash call's bits (the flash variants split the output columns, BD, over
more programs: the same per-row key order; "full scan" visits every ring block, as the engine's call with its
ring_end hint does not; "8 warps" is the full layers' config before short calls took 4).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.bench_engine import time_graph
from diffgemma.ops import attention as attn
from diffgemma.ops import attention_flash as fl
from diffgemma.ops import attention_tiles as at

H, C, W = 16, 256, 1024


def time_ms(fn, reps: int) -> float:
    """Median ms a call from CUDA-graph replays of 10 calls (as the commit's graph runs them: no launch gaps)."""
    def ten():
        for _ in range(10):
            fn()
    return statistics.median(time_graph(ten, calls=10, reps=reps)) / 1e3


def cases(L: int, slack: int = 256):
    dev, RING = "cuda", W - 1 + slack
    sp = torch.full((RING,), -1, dtype=torch.int64, device=dev)
    p = torch.arange(max(0, L - RING), L, device=dev)
    sp[p % RING] = p
    q = torch.randn(H, C, 256, device=dev).half()
    k = (torch.randn(8, RING + C, 256, device=dev) * 0.25).half()
    v = torch.randn(8, RING + C, 256, device=dev).half()
    slide = dict(q=q, k=k, v=v, kpos=torch.cat([sp, torch.arange(L, L + C, device=dev)]), n_keys=RING + C,
                 qpos=torch.arange(L, L + C, device=dev), window=W,
                 flash=dict(n_ring=RING, base_pos=L, ring_end=torch.tensor(L, device=dev)))
    bucket = 2048
    q = torch.randn(H, C, 512, device=dev).half()
    k = (torch.randn(2, bucket + C, 512, device=dev) * 0.18).half()
    v = torch.randn(2, bucket + C, 512, device=dev).half()
    full = dict(q=q, k=k, v=v, kpos=torch.arange(bucket + C, device=dev), n_keys=bucket + C,
                qpos=torch.arange(L, L + C, device=dev), window=fl.NO_WINDOW, nlive=torch.tensor(L + C, device=dev),
                flash={})
    return {"sliding": slide, "full": full}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--slack", type=int, default=256, help="the ring's slots past the window (bench_e2e's: 1024)")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_commit_attention.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, context {a.context}, chunk {C}, ring slack {a.slack}")
    for kind, c in cases(a.context, a.slack).items():
        exp = attn.attention_ref(c["q"], c["k"], c["v"], c["kpos"], c["n_keys"], qpos=c["qpos"], window=c["window"],
                                 causal=True, out_dtype=torch.float32, q_block=64)
        variants = {"flash": lambda c=c: fl.attention_flash(c["q"], c["k"], c["v"], c["kpos"], c["n_keys"],
                                                            qpos=c["qpos"], window=c["window"], causal=True,
                                                            out_dtype=torch.bfloat16, **c["flash"])}
        d = c["q"].shape[-1]
        nohint = {k: x for k, x in c["flash"].items() if k != "ring_end"}
        if kind == "sliding":
            variants["flash full scan"] = lambda c=c: fl.attention_flash(
                c["q"], c["k"], c["v"], c["kpos"], c["n_keys"], qpos=c["qpos"], window=c["window"], causal=True,
                out_dtype=torch.bfloat16, **nohint)
        else:
            variants["flash 8 warps"] = lambda c=c: fl.attention_flash(
                c["q"], c["k"], c["v"], c["kpos"], c["n_keys"], qpos=c["qpos"], window=c["window"], causal=True,
                out_dtype=torch.bfloat16, BD=d // 2, num_warps=8, **c["flash"])
        for bd in (d // 2, d // 4):  # the flash kernel with its output columns split over more programs
            variants[f"flash BD{bd}"] = lambda c=c, bd=bd: fl.attention_flash(
                c["q"], c["k"], c["v"], c["kpos"], c["n_keys"], qpos=c["qpos"], window=c["window"], causal=True,
                out_dtype=torch.bfloat16, BD=bd, **c["flash"])
        for bm, bn in ((64, 256), (64, 128), (64, 64), (32, 128), (128, 128)):
            if bn > c["q"].shape[-1]:
                continue
            variants[f"tiles pv BM{bm} BN{bn}"] = lambda c=c, bm=bm, bn=bn: at.attention_tiles(
                c["q"], c["k"], c["v"], c["n_keys"], kpos=c["kpos"], qpos=c["qpos"], window=c["window"],
                nlive=c.get("nlive"), out_dtype=torch.bfloat16, pv_config=dict(BM=bm, BN=bn))
        flash = variants["flash"]().float()
        for name, fn in variants.items():
            out = fn().float()
            err = ((out - exp).norm() / exp.norm()).item()
            ms = time_ms(fn, a.reps)
            same = torch.equal(out, flash)
            print(f"  {kind:8s} {name:22s} {ms * 1e3:8.1f} us  rel err {err:.2e}  flash's bits: {same}", flush=True)


if __name__ == "__main__":
    main()
