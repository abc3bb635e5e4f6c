"""Attention kernels alone at the real shapes: SDPA, the flash kernel over a config sweep, and for the
canvas the GEMM path (ops/attention_gemm.py; impl "gemm", chunk lengths swept on the full layers) and the tile
path (ops/attention_tiles.py; impl "tiles", the engine's full-layer canvas).

One H200 run: `PYTHONPATH=src python -m bench.bench_attention --json $OUT/attn.jsonl --budget 150`.
Every variant is first checked against the f32 twin (relative Frobenius error; a variant over 1e-2 is
reported as WRONG and not timed), then timed:
  canvas (denoise) calls: a CUDA graph of 2 × NSETS calls rotating over NSETS input sets (so K/V
      come from HBM, not L2, as in the real step where every layer has its own cache), replayed
      `--reps` times; the median replay time / calls = GPU µs per call, launch overhead excluded
      (the engine replays the whole denoise step as a graph);
  causal (prefill) chunks: eager calls between CUDA events after one warm-up, median of `--reps-causal`.
Shapes (16 query heads, f16 K/V and q, bf16 out, scale 1): the sliding canvas (hd 256, 8 KV heads,
ring 1279 + canvas 256 rows, the live window of 1023 ring slots visible; "flash_live" visits only those,
the engine's call), the full canvas (hd 512,
2 KV heads) over the 1k / 8k / 32k buckets + 256 canvas rows, and an 8192-query prefill chunk at
positions 0 and 24576 for both layer kinds (sliding: window 1024 over the ring then the chunk).
Results stream to --json as one JSON object per line (so a run cut short keeps what it measured);
the table prints last. The sweep stops starting new variants once --budget seconds have passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.bench_engine import time_graph
from diffgemma.ops import attention as A
from diffgemma.ops import attention_flash as F
from diffgemma.ops import attention_gemm as AG
from diffgemma.ops import attention_tiles as AT

H, W, RING, CANVAS = 16, 1024, 1279, 256
NSETS = 6


def canvas_case(name, d, KV, n_ctx, sliding, dev, live=None):
    """Inputs of one denoise attention call (NSETS independent sets), as the engine lays them out.
    live (full layers): the context rows in use, the rest of the n_ctx bucket padding (default: all)."""
    g = torch.Generator(device=dev).manual_seed(0)
    C = CANVAS
    rows = RING + C if sliding else n_ctx + C
    sets = []
    for _ in range(NSETS):
        q = torch.randn(H, C, d, device=dev, generator=g).half()
        k = (torch.randn(KV, rows, d, device=dev, generator=g) * d ** -0.5 * 4).half()  # QK-normed logits scale
        v = torch.randn(KV, rows, d, device=dev, generator=g).half()
        sets.append((q, k, v))
    if sliding:
        L = 30000  # a long context: the ring is full and wrapped
        slot_pos = torch.full((RING,), -1, device=dev, dtype=torch.int64)
        p = torch.arange(L - RING, L, device=dev)
        slot_pos[p % RING] = p
        live = (slot_pos >= 0) & (slot_pos > L - W)
        kpos = torch.cat([torch.where(live, 0, -1), torch.zeros(C, dtype=torch.int64, device=dev)])
        nlive = None
        length = torch.tensor(L, device=dev)  # the engine's call: the ring's live window only
    else:
        n_live = rows if live is None else live + C
        kpos = torch.where(torch.arange(rows, device=dev) < n_live, 0, -1)  # rows past n_live: the bucket's padding
        nlive = torch.tensor(n_live, device=dev)
        length = None
    return dict(name=name, d=d, KV=KV, causal=False, sets=sets, kpos=kpos, n_keys=rows, nlive=nlive,
                qpos=None, window=A.NO_WINDOW, n_ring=0, base_pos=0, queries=C, length=length)


def causal_case(name, d, KV, n, P, sliding, dev):
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(H, n, d, device=dev, generator=g).half()
    pos = torch.arange(P, P + n, device=dev)
    if sliding:  # the engine's layout: the ring as it was before the chunk, then the chunk's own K/V
        slot_pos = torch.full((RING,), -1, device=dev, dtype=torch.int64)
        if P > 0:
            p = torch.arange(max(0, P - RING), P, device=dev)
            slot_pos[p % RING] = p
        kpos = torch.cat([slot_pos, pos])
        rows, n_ring, window = RING + n, RING, W
    else:
        kpos = torch.arange(P + n, device=dev)
        rows, n_ring, window = P + n, 0, A.NO_WINDOW
    k = (torch.randn(KV, rows, d, device=dev, generator=g) * d ** -0.5 * 4).half()
    v = torch.randn(KV, rows, d, device=dev, generator=g).half()
    return dict(name=name, d=d, KV=KV, causal=True, sets=[(q, k, v)], kpos=kpos, n_keys=rows, nlive=None,
                qpos=pos, window=window, n_ring=n_ring, base_pos=P if sliding else 0, queries=n)


def call(case, impl, cfg, i):
    q, k, v = case["sets"][i]
    kw = dict(qpos=case["qpos"], window=case["window"], causal=case["causal"], out_dtype=torch.bfloat16)
    if impl == "sdpa":
        return A.attention_sdpa(q, k, v, case["kpos"], case["n_keys"], **kw)
    if impl == "gemm":  # the full canvas as two GEMMs around a chunked softmax (every row below nlive a key)
        kpos = case["kpos"] if case["nlive"] is None else None  # the engine's calls: positions on sliding layers only
        return AG.attention_gemm(q, k, v, case["n_keys"], kpos=kpos, nlive=case["nlive"], out_dtype=torch.bfloat16,
                                 **cfg)
    if impl == "tiles":  # Triton GEMMs, the softmax per key tile in the first's epilogue
        kpos = case["kpos"] if case["nlive"] is None else None
        return AT.attention_tiles(q, k, v, case["n_keys"], kpos=kpos, nlive=case["nlive"], out_dtype=torch.bfloat16,
                                  **cfg)
    if impl == "flash_live":  # the sliding canvas over the ring's live window (ring_length), no per-key positions
        return F.attention_flash(q, k, v, None, case["n_keys"], window=W, n_ring=RING, ring_length=case["length"],
                                 out_dtype=torch.bfloat16, **cfg)
    hints = dict(n_ring=case["n_ring"], base_pos=case["base_pos"], nlive=case["nlive"])
    kpos = None if impl == "flash_nokpos" else case["kpos"]  # the engine's full-layer canvas call (every row a key)
    return F.attention_flash(q, k, v, kpos, case["n_keys"], **kw, **hints, **cfg)


def reference(case):
    q, k, v = case["sets"][0]
    return A.attention_ref(q, k, v, case["kpos"], case["n_keys"], qpos=case["qpos"], window=case["window"],
                           causal=case["causal"], out_dtype=torch.float32, q_block=512)


def time_canvas(case, impl, cfg, reps):
    calls = [i % NSETS for i in range(2 * NSETS)]
    ts = time_graph(lambda: [call(case, impl, cfg, i) for i in calls], len(calls), reps)
    return statistics.median(ts), ts


def time_causal(case, impl, cfg, reps):
    call(case, impl, cfg, 0)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(case, impl, cfg, 0)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts), ts


def flops(case):
    """Useful matmul FLOPs (QK^T + PV over the visible keys only)."""
    d, n = case["d"], case["queries"]
    if not case["causal"]:
        vis = int((case["kpos"] >= 0).sum())
        return 4 * H * n * vis * d
    vis = float(torch.clamp(case["qpos"].double() + 1, max=case["window"]).sum())  # keys (q - window, q]
    return 4 * H * d * vis


def variants(case):
    """(impl, cfg) pairs to try, most informative first. Configs checked offline against Triton 3.6's
    sm_90 resource report (no spills, shared memory under 227 KB)."""
    d, causal = case["d"], case["causal"]
    out = [("sdpa", {}), ("flash", {})]
    if d >= 512 and not causal:  # the engine's full-canvas call: the flash kernel without positions vs the GEMMs
        out = [("flash_nokpos", {}), ("tiles", {}), ("gemm", {}), ("sdpa", {}), ("tiles", dict(tma=False)),
               ("tiles", dict(tile=64))]
    elif not causal:  # the sliding canvas: the engine's call (live window), the per-key mask over every ring slot
        out = [("flash_live", {}), ("flash", {}), ("tiles", {}), ("gemm", {}), ("sdpa", {})]
    if d >= 512 and causal:
        cfgs = [dict(BM=64, BN=16, BD=512, num_warps=8, num_stages=2),
                dict(BM=64, BN=32, BD=512, num_warps=8, num_stages=2),
                dict(BM=64, BN=32, BD=256, num_warps=8, num_stages=2),
                dict(BM=128, BN=16, BD=256, num_warps=8, num_stages=2)]
    elif d >= 512:
        cfgs = [dict(BM=64, BN=16, BD=512, num_warps=8, num_stages=2),
                dict(BM=64, BN=32, BD=256, num_warps=8, num_stages=2),
                dict(BM=128, BN=32, BD=256, num_warps=8, num_stages=2),
                dict(BM=64, BN=16, BD=256, num_warps=4, num_stages=2)]
    elif causal:
        cfgs = [dict(BM=64, BN=32, BD=256, num_warps=8, num_stages=2),
                dict(BM=64, BN=32, BD=256, num_warps=4, num_stages=2),
                dict(BM=64, BN=64, BD=256, num_warps=8, num_stages=2)]
    else:
        cfgs = [dict(BM=64, BN=32, BD=256, num_warps=4, num_stages=2),
                dict(BM=128, BN=32, BD=256, num_warps=8, num_stages=2),
                dict(BM=128, BN=64, BD=256, num_warps=8, num_stages=2)]
    if not causal:  # the default config at other split counts first, then the other configs at each
        waves = (1, 2, 4) if d >= 512 else (0, 1, 2)
        dflt = F.flash_config(d, causal, case["n_keys"])
        if d >= 512:  # the full canvas without per-key positions (the engine's call), every config
            out += [("flash", {})] + [("flash_nokpos", dict(dflt, waves=w)) for w in waves if w != dflt["waves"]]
            out += [("flash_nokpos", dict(c, waves=w)) for c in cfgs for w in (1, 2)]
        out += [("flash", dict(dflt, waves=w)) for w in waves if w != dflt["waves"]]
        if d < 512:
            out += [("flash_live", dict(c, waves=w)) for c in cfgs for w in waves]
        return out + [("flash", dict(c, waves=w)) for c in cfgs for w in waves]
    return out + [("flash", c) for c in cfgs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--reps-causal", type=int, default=3)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; no new variant starts after this")
    ap.add_argument("--only", default="", help="comma list of case names")
    a = ap.parse_args()
    dev = "cuda"
    t0 = time.time()
    sink = open(a.json, "a") if a.json else None
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}",
          flush=True)
    builders = [
        ("canvas_slide", lambda: canvas_case("canvas_slide", 256, 8, 0, True, dev)),
        ("canvas_full_1k", lambda: canvas_case("canvas_full_1k", 512, 2, 1024, False, dev)),
        ("canvas_full_8k", lambda: canvas_case("canvas_full_8k", 512, 2, 8192, False, dev)),
        ("canvas_full_32k", lambda: canvas_case("canvas_full_32k", 512, 2, 32768, False, dev)),
        # a 32k bucket half in use (a context of 16.4k): the flash kernel stops at nlive, the GEMMs do not
        ("canvas_full_32k_half", lambda: canvas_case("canvas_full_32k_half", 512, 2, 32768, False, dev, live=16640)),
        ("causal_full_8k@24k", lambda: causal_case("causal_full_8k@24k", 512, 2, 8192, 24576, False, dev)),
        ("causal_full_8k@0", lambda: causal_case("causal_full_8k@0", 512, 2, 8192, 0, False, dev)),
        ("causal_slide_8k@24k", lambda: causal_case("causal_slide_8k@24k", 256, 8, 8192, 24576, True, dev)),
        ("causal_slide_8k@0", lambda: causal_case("causal_slide_8k@0", 256, 8, 8192, 0, True, dev)),
    ]
    only = set(x for x in a.only.split(",") if x)
    rows = []
    # pass 1: the baselines and the default config on every shape; pass 2: the sweep, the largest levers first
    sweep_order = ["causal_full_8k@24k", "canvas_full_32k", "canvas_full_32k_half", "canvas_slide", "canvas_full_1k", "causal_slide_8k@24k",
                   "canvas_full_8k", "causal_full_8k@0", "causal_slide_8k@0"]
    for pass_ in (1, 2):
        order = builders if pass_ == 1 else sorted(builders, key=lambda b: sweep_order.index(b[0]))
        for name, build in order:
            if only and name not in only:
                continue
            if time.time() - t0 > a.budget:
                break
            case = build()
            ref = reference(case)
            vs = variants(case)
            vs = vs[:3] if pass_ == 1 else vs[3:]
            for impl, cfg in vs:
                if time.time() - t0 > a.budget:
                    print(f"# budget reached, skipping the rest of {name}", flush=True)
                    break
                rec = dict(case=name, impl=impl, cfg=cfg)
                try:
                    got = call(case, impl, cfg, 0)
                    torch.cuda.synchronize()
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    rec["rel_err"] = err
                    if not err < 1e-2:
                        rec["status"] = "WRONG"
                    else:
                        fn = time_causal if case["causal"] else time_canvas
                        med, ts = fn(case, impl, cfg, a.reps_causal if case["causal"] else a.reps)
                        rec.update(status="ok", us=med, spread=[min(ts), max(ts)],
                                   tflops=flops(case) / (med * 1e-6) / 1e12)
                except Exception as e:  # a config that does not fit (OutOfResources) is a result, not a crash
                    rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:200]}")
                    torch.cuda.synchronize()
                rows.append(rec)
                if sink:
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                print(json.dumps(rec), flush=True)
            del case, ref
            torch.cuda.empty_cache()
    print(f"\n# done in {time.time() - t0:.1f} s\n")
    print("| case | impl | config | µs (median) | TFLOP/s | rel err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cfg = " ".join(f"{k}={v}" for k, v in r["cfg"].items()) or "default"
        us = f"{r['us']:.1f}" if "us" in r else r["status"] + (": " + r.get("error", "")[:60] if "error" in r else "")
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        print(f"| {r['case']} | {r['impl']} | {cfg} | {us} | {tf} | {r.get('rel_err', float('nan')):.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
