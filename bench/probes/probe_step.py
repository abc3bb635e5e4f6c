"""Probe: where one graphed denoise step's GPU time goes, kernel by kernel (full size, random weights, one GPU).

    PYTHONPATH=src python -m bench.probes.probe_step [--contexts 1024,8192] [--q4] [--sc logits|embeds] [--idle] [--sequence N]
                                              [--json out.json]

Builds the full-size engine (bf16, or with --q4 the q4 pack's experts and q8 SC MLP), prefills a context,
captures the denoise step (SC from logits, or with --sc embeds from SC embeddings as generate calls it) and profiles a few graph replays with
the CUDA activity profiler, which records the kernels inside a replay one by one. Prints, per step: each
kernel family's GPU time and launches, the sum of kernel times against the step's wall time (the rest is
the gaps between kernels), and the step's median time from CUDA events outside the profiler. --idle adds where
the GPU sits idle (no kernel on any stream), charged to the pair of kernel families around each idle interval.
Balanced routing, as bench_engine.py (every expert's bytes are read).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path

import torch

import bench.bench_engine as B
from bench.fixtures import RandomPackSource, RandomSource
from diffgemma.config import ModelConfig

# kernel name -> family; the first pattern that matches wins
FAMILIES = [
    ("expert GEMM (Triton)", r"_packed_gmm_kernel|_grouped_gemm|grouped_mm"),
    ("attention (Triton flash)", r"_flash_kernel"),
    ("attention merge", r"_combine_kernel"),
    ("attention tiles (Triton, full layers)", r"_qk_tile_softmax_kernel|_tile_weights_kernel|_pv_scaled_kernel"),
    ("cuBLAS / CUTLASS GEMM", r"gemm|nvjet|cutlass|sm90_xmma|Kernel2|splitK|gemv"),
    ("qkv norm + rope + cache write", r"qkv|rope"),
    ("norm / residual chains", r"norm|finish|residual"),
    ("gelu * up", r"gelu"),
    ("routing + plan", r"route|plan|sort|scan|cumsum|histogram"),
    ("row stats / softcap / SC probs", r"rowstats|softcap|tempered|masked_probs"),
    ("copies / fills", r"copy|fill|Memcpy|Memset|elementwise|vectorized|index"),
]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.IGNORECASE):
            return fam
    return "other"


def profile_replays(fn, n: int, trace: str | None = None):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
    wall_ms = a.elapsed_time(b) / n
    if trace:
        prof.export_chrome_trace(trace)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        per_name[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        per_name[e.name][1] += 1
    return wall_ms, {k: (v[0] / n, v[1] / n) for k, v in per_name.items()}


def report(label: str, wall_ms: float, events_ms: float, per_name: dict) -> dict:
    fams = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (us, calls) in per_name.items():
        f = fams[family(name)]
        f[0] += us
        f[1] += calls
    total_us = sum(us for us, _ in per_name.values())
    print(f"\n== {label}: step {events_ms:.3f} ms (CUDA events, median), {wall_ms:.3f} ms a step under the profiler; "
          f"kernels {total_us / 1e3:.3f} ms, {sum(c for _, c in per_name.values()):.0f} launches; "
          f"gaps {wall_ms - total_us / 1e3:.3f} ms", flush=True)
    for fam, (us, calls) in sorted(fams.items(), key=lambda kv: -kv[1][0]):
        print(f"  {fam:34s} {us / 1e3:8.3f} ms  {calls:6.0f} launches  {us / max(calls, 1):8.1f} us each")
    print("  top kernels:")
    for name, (us, calls) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"    {us / 1e3:8.3f} ms {calls:5.0f}x  {name[:110]}")
    return {"step_ms": events_ms, "replay_ms_profiled": wall_ms, "kernel_ms": total_us / 1e3,
            "families": {k: {"ms": v[0] / 1e3, "launches": v[1]} for k, v in fams.items()},
            "kernels": {k: {"us": v[0], "launches": v[1]} for k, v in per_name.items()}}


def idle_report(trace: str, n: int, top: int = 14, max_gap: float = 200) -> dict:
    """Where the GPU sits idle inside the profiled replays: every interval in which no kernel runs on any stream,
    charged to the pair (family of the kernel that ended last before it -> family of the kernel that starts
    after it). The step's wall time is the busy union plus these intervals; a kernel boundary costs its gap."""
    ev = [e for e in json.loads(Path(trace).read_text())["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ev.sort(key=lambda e: e["ts"])
    pairs = collections.defaultdict(lambda: [0.0, 0])
    busy_end, last_name, idle_us = None, None, 0.0
    for e in ev:
        if busy_end is not None and e["ts"] > busy_end:
            gap = e["ts"] - busy_end
            if gap < max_gap:  # longer: between replays the host relaunches, not the step's
                key = f"{family(last_name)} -> {family(e['name'])}"
                pairs[key][0] += gap
                pairs[key][1] += 1
                idle_us += gap
        end = e["ts"] + e["dur"]
        if busy_end is None or end >= busy_end:
            busy_end, last_name = end, e["name"]
    streams = collections.Counter(e.get("args", {}).get("stream") for e in ev)
    print(f"  idle (no kernel on any stream): {idle_us / n / 1e3:.3f} ms a step, kernels on streams "
          f"{len(streams)} streams, the busiest {dict(streams.most_common(3))}", flush=True)
    for key, (us, cnt) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {us / n:8.1f} us {cnt / n:5.0f}x  {us / max(cnt, 1):5.2f} us each  {key}")
    return {"idle_ms": idle_us / n / 1e3, "pairs": {k: {"us": v[0] / n, "count": v[1] / n} for k, v in pairs.items()}}


def sequence_report(trace: str, first: int) -> list:
    """The first kernels of the last profiled replay in launch order (start offset, duration, name): what the step
    does before its first layer's GEMM, where a few microseconds each add up."""
    ev = sorted((e for e in json.loads(Path(trace).read_text())["traceEvents"]
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    starts = [0] + [i for i in range(1, len(ev)) if ev[i]["ts"] - max(e["ts"] + e["dur"] for e in ev[max(0, i - 8):i]) > 200]
    last = ev[starts[-1]:][:first]
    t0 = last[0]["ts"] if last else 0
    print(f"  the first {len(last)} kernels of the last replay (start µs, duration µs, family, name):")
    rows = []
    for e in last:
        rows.append({"start_us": e["ts"] - t0, "us": e["dur"], "name": e["name"]})
        print(f"    {e['ts'] - t0:8.1f} {e['dur']:7.2f}  {family(e['name'])[:22]:22s} {e['name'][:90]}")
    return rows


def read_bandwidth() -> dict:
    """What this GPU's memory gives a plain streaming read and a copy (the roofline's B/s, measured here)."""
    x = torch.empty(2 * 2**30, dtype=torch.bfloat16, device="cuda").normal_()  # 4 GiB
    y = torch.empty_like(x)
    sum_ms = statistics.median(B.time_cuda(lambda: x.sum(dtype=torch.float32), reps=10, warmup=2))
    copy_ms = statistics.median(B.time_cuda(lambda: y.copy_(x), reps=10, warmup=2))
    out = {"read_GBps": x.numel() * 2 / sum_ms / 1e6, "copy_GBps": 2 * x.numel() * 2 / copy_ms / 1e6}
    print(f"memory: sum over 4 GiB reads {out['read_GBps']:.0f} GB/s; copy moves {out['copy_GBps']:.0f} GB/s "
          "(read + write)", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--q4", action="store_true", help="q4 experts and a q8 SC MLP (the pack bench_pack.py builds)")
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sc", choices=("logits", "embeds"), default="logits",
                    help="the step from SC logits (the exact product in the graph) or from SC embeddings (generate's call)")
    ap.add_argument("--idle", action="store_true", help="also report the GPU's idle intervals between kernels")
    ap.add_argument("--sequence", type=int, default=0, help="also list this many of a replay's first kernels in order")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_step.py needs a CUDA GPU")
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": B.TEXT, "canvas_length": B.CANVAS})
    if a.q4:

        src = RandomPackSource(cfg, "cuda", torch.bfloat16, seed=0, experts="q4", sc="q8")
    else:
        src = RandomSource(cfg, "cuda", torch.bfloat16, seed=0)
    eng = B.build_engine(cfg, src, "cuda", torch.bfloat16)
    V = cfg.vocab_size
    out = {"gpu": torch.cuda.get_device_name(), "q4": a.q4, "ctx": {}, "memory": read_bandwidth()}
    with B.routing("balanced"):
        for T in [int(t) for t in a.contexts.split(",")]:
            cache = eng.new_cache(T)
            eng.prefill(cache, torch.randint(0, V, (T,), device="cuda"))
            ids = torch.randint(0, V, (B.CANVAS,), device="cuda")
            if a.sc == "logits":
                sc = {"sc_logits": torch.randn(B.CANVAS, V, device="cuda") * 3}
            else:
                sc = {"sc_embeds": torch.randn(B.CANVAS, cfg.hidden_size, device="cuda").to(torch.bfloat16)}

            def step(cache=cache, ids=ids, sc=sc):
                return eng.denoise(cache, ids, **sc)

            step()  # capture
            ms = statistics.median(B.time_cuda(step, reps=10, warmup=2))
            trace = f"/tmp/probe_step_{T}.json" if a.idle or a.sequence else None
            wall, per_name = profile_replays(step, a.replays, trace)
            out["ctx"][T] = report(f"{'q4' if a.q4 else 'bf16'} context {T}, SC {a.sc}", wall, ms, per_name)
            if a.idle:
                out["ctx"][T]["idle"] = idle_report(trace, a.replays)
            if a.sequence:
                out["ctx"][T]["sequence"] = sequence_report(trace, a.sequence)
            del cache
            eng.clear_graphs()
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
