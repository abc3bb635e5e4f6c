"""Probe: the nvfp4-tiles expert GEMM beside q4's at the model's shapes (one GPU, about a minute).

    PYTHONPATH=src:. python -m bench.probes.probe_nvfp4_kernel --json $OUT/nvfp4k.json
    PYTHONPATH=src:. TRITON_INTERPRET=1 python -m bench.probes.probe_nvfp4_kernel --tiny     # CPU dry run

Random full-size stacks (128 experts, hidden 2816, expert intermediate 704) in the q4-tiles layout (gate_up laid for
the gelu·up epilogue) and in the nvfp4-tiles layout (a random nvfp4e record, ModelOpt-style multiplier, re-laid as the
loader does: gate_up in the glu row order, so the GLU GEMM reads one box a plane and K step), balanced top-8 routing (bench/balanced_routing.py) of 256 tokens (B=1: 2048 routes, 16 an expert) and
2048 tokens (B=8: 16384 routes), each GEMM called as the engine's expert FFN calls it (the f16 operand in, gate_up with
gelu·up as f16 operands out, down to bf16, the launch order of moe_plan_with_order). Times: GPU µs a call, 10 calls
captured in one CUDA graph, the median of 20 replays (bench/bench_engine.time_graph). Each nvfp4 variant (launch
configs of ops/moe_nvfp4.grouped_mm_nvfp4_tiles: the planes through TMA or cp.async, pipeline stages; each row says
which it ran) is checked bit for bit against the twin, the same kernel with its plain-op decode and pointer loads
(asm=False, tma=False: the interpreter's decode, which the CPU tests hold to the exact product), and the default
against the dequantize-then-GEMM reference (packed_weight.dequantize, ops/moe_packed.grouped_mm_packed_ref; relative
error). The JSON is rewritten after every measurement; variants past --budget seconds are skipped (marked so).
--tiny: small shapes in the Triton interpreter (which runs the descriptor loads too), wall-clock µs of one call (a
dry run of the code paths, not timings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.balanced_routing import balanced_ids
from bench.fixtures import random_record
from diffgemma.ops import moe_nvfp4, moe_paths, moe_q4, q4_tiles
from diffgemma.ops import packed_weight as pwm
from diffgemma.ops.gelu_mul import gelu_mul_ref
from diffgemma.ops.layouts import record_nbytes, record_planes
from diffgemma.ops.moe_packed import grouped_mm_packed_ref
from diffgemma.ops.moe_plan import moe_plan_with_order

FULL = dict(E=128, H=2816, F=704, k=8, tokens={1: 256, 8: 2048})
TINY = dict(E=4, H=128, F=64, k=2, tokens={1: 8, 8: 32})
# name -> grouped_mm_nvfp4_tiles keywords; "default" is what the engine runs (moe_nvfp4.default_tma: TMA below 128-row
# tiles). "tma" / "no_tma": the planes through tensor descriptors / cp.async at the default stages; B=1 only: TMA at
# 3, 4, 2 stages.
# (5 stages, 8 groups a step, 8 warps and BM 64 lost to the cp.async default: bench/RESULTS.md, bench_hub.)
VARIANTS = {"default": {}, "no_tma": {"tma": False}, "tma": {"tma": True},
            "tma_stages3": {"tma": True, "num_stages": 3}, "tma_stages4": {"tma": True, "num_stages": 4},
            "tma_stages2": {"tma": True, "num_stages": 2}}
ONLY = {"tma_stages3": 1, "tma_stages4": 1, "tma_stages2": 1}


def nvfp4_stack(shape, dev, gen, glu: bool) -> tuple:
    """(natural, nvfp4-tiles) of a random nvfp4e stack: random nibbles, e4m3 block scales 2^-3 .. 2^3 with some
    subnormal ones, per-expert multipliers ~1e-3 (ModelOpt's weight_scale_2); glu: re-laid in the glu row order, as
    the loader lays a gate_up stack."""
    rec = torch.zeros(record_nbytes("nvfp4e", shape), dtype=torch.uint8, device=dev)
    p = record_planes("nvfp4e", shape, rec)
    p["codes"].copy_(torch.randint(0, 256, p["codes"].shape, generator=gen, device=dev, dtype=torch.int32))
    p["scale"].copy_(torch.randint(0x20, 0x50, p["scale"].shape, generator=gen, device=dev, dtype=torch.int32))
    p["scale"][:, ::7] = 5  # a subnormal e4m3 (5 · 2^-9) in every seventh block
    mul = torch.rand(shape[0], generator=gen, device=dev) * 4e-3 + 5e-4
    pairs = torch.stack([mul, torch.ones_like(mul)], 1)
    p["escale"].copy_(pairs.float().contiguous().view(torch.uint8))
    nat = pwm.PackedWeight.from_record("nvfp4e", shape, rec, layout="natural")
    return nat, pwm.to_nvfp4_tiles(nat, glu=glu)


def q4_stack(shape, dev, gen, glu: bool):
    return q4_tiles.to_tile_layout(pwm.PackedWeight.from_record("q4", shape, random_record("q4", shape, dev, gen)),
                                   glu=glu)


def timed_us(fn, cuda: bool, reps: int) -> float:
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    from bench.bench_engine import time_graph
    inner = 10
    return statistics.median(time_graph(lambda: [fn() for _ in range(inner)], inner, reps))


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


class Results:
    """The probe's results, rewritten to `path` (temp file, then rename) after every entry."""

    def __init__(self, path, meta):
        self.path, self.data = path, {"meta": meta, "rows": []}

    def add(self, **row):
        self.data["rows"].append(row)
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        self.save()

    def save(self):
        if self.path:
            tmp = Path(str(self.path) + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            os.replace(tmp, self.path)


def probe_batch(B, T, s, st, cuda, reps, res, start, budget):
    E, H, F, k, dev = s["E"], s["H"], s["F"], s["k"], st["dev"]
    src, _, offs, order = moe_plan_with_order(balanced_ids(T, k, E, dev), E)
    M = T * k
    gen = torch.Generator(device=dev).manual_seed(B)
    x = torch.randn(T, H, generator=gen, device=dev).bfloat16().half()  # the f16 operand of bf16 activations
    h = (torch.randn(M, F, generator=gen, device=dev) * 0.1).bfloat16().half()
    asm = None if cuda else False
    tma = None if cuda else False
    bm = moe_paths.tile_rows(M, E)
    q4 = {"gate_up": lambda: moe_q4.grouped_mm_q4_tiles(x, st["q4_gu"], offs, src=src, BM=bm, order=order, asm=asm,
                                                        tma=tma, out_dtype=torch.bfloat16, glu=True, glu_f16=True),
          "down": lambda: moe_q4.grouped_mm_q4_tiles(h, st["q4_dn"], offs, BM=bm, order=order, asm=asm, tma=tma,
                                                     out_dtype=torch.bfloat16)}

    def nv(which, **kw):
        if which == "gate_up":
            return moe_nvfp4.grouped_mm_nvfp4_tiles(x, st["nv_gu"], offs, src=src, order=order,
                                                    out_dtype=torch.bfloat16, glu=True, glu_f16=True, **kw)
        return moe_nvfp4.grouped_mm_nvfp4_tiles(h, st["nv_dn"], offs, order=order, out_dtype=torch.bfloat16, **kw)

    q4_us = {}
    for which in ("gate_up", "down"):
        q4_us[which] = timed_us(q4[which], cuda, reps)
        res.add(B=B, gemm=which, kernel="q4", us=round(q4_us[which], 2))
    twins = {w: nv(w, asm=False, tma=False) for w in ("gate_up", "down")}
    xs = x[src.long()].float()
    want = {"gate_up": gelu_mul_ref(grouped_mm_packed_ref(xs, st["nv_gu_nat"], offs).bfloat16()).float(),
            "down": grouped_mm_packed_ref(h.float(), st["nv_dn_nat"], offs)}
    for name, kw in VARIANTS.items():
        if ONLY.get(name, B) != B:
            continue
        for which in ("gate_up", "down"):
            bm_nv = moe_paths.tile_rows(M, E)
            tma = kw.get("tma", moe_nvfp4.default_tma(x, bm_nv))
            row = dict(B=B, gemm=which, kernel=f"nvfp4 {name}", tma=tma,
                       stages=kw.get("num_stages") or moe_nvfp4.default_stages(tma, bm_nv))
            if name != "default" and time.perf_counter() - start > budget:
                res.add(**row, skipped="past --budget")
                continue
            try:
                out = nv(which, asm=asm, **kw)
                row["bits_equal_twin"] = bool(torch.equal(out, twins[which]))
                if name == "default":
                    row["rel_vs_dequant_gemm"] = f"{rel(out.float(), want[which]):.2e}"
                us = timed_us(lambda: nv(which, asm=asm, **kw), cuda, reps)
                row.update(us=round(us, 2), vs_q4=round(us / q4_us[which], 3))
            except Exception as e:  # a config the device cannot run is a finding, not the end of the probe
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            res.add(**row)


def table(rows) -> str:
    lines = [f"{'B':>2} {'gemm':8} {'kernel':18} {'tma':>5} {'stages':>6} {'us':>9} {'vs q4':>7}  bits=twin"]
    for r in rows:
        lines.append(f"{r['B']:>2} {r['gemm']:8} {r['kernel']:18} {str(r.get('tma', '')):>5} {r.get('stages', ''):>6} "
                     f"{r.get('us', '-'):>9} {r.get('vs_q4', ''):>7}  "
                     f"{r.get('bits_equal_twin', '')} {r.get('skipped', r.get('error', ''))}")
    steps = {}
    for r in rows:
        if r["kernel"] in ("q4", "nvfp4 default") and "us" in r:
            steps.setdefault((r["B"], r["kernel"]), 0.0)
            steps[(r["B"], r["kernel"])] += 30 * r["us"] / 1e3
    for (B, kern), ms in sorted(steps.items()):
        lines.append(f"B={B} {kern}: 30 layers x (gate_up + down) = {ms:.3f} ms a step")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here (rewritten as they come)")
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (TRITON_INTERPRET=1): a dry run")
    ap.add_argument("--reps", type=int, default=20, help="graph replays a timing (median)")
    ap.add_argument("--budget", type=float, default=50.0, help="seconds after which further variants are skipped")
    a = ap.parse_args(argv)
    cuda = not a.tiny
    if cuda and not torch.cuda.is_available():
        ap.error("needs CUDA (or --tiny with TRITON_INTERPRET=1 for the CPU dry run)")
    if a.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--tiny runs the kernels in the Triton interpreter: set TRITON_INTERPRET=1")
    start = time.perf_counter()
    s = FULL if cuda else TINY
    dev = "cuda" if cuda else "cpu"
    E, H, F = s["E"], s["H"], s["F"]
    gen = torch.Generator(device=dev).manual_seed(0)
    st = {"dev": dev, "q4_gu": q4_stack((E, 2 * F, H), dev, gen, glu=True),
          "q4_dn": q4_stack((E, H, F), dev, gen, glu=False)}
    st["nv_gu_nat"], st["nv_gu"] = nvfp4_stack((E, 2 * F, H), dev, gen, glu=True)
    st["nv_dn_nat"], st["nv_dn"] = nvfp4_stack((E, H, F), dev, gen, glu=False)
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "shapes": s,
            "variants": VARIANTS, "reps": a.reps}
    res = Results(a.json, meta)
    for B, T in s["tokens"].items():
        print(f"B={B}: {T} tokens, {T * s['k']} routes", flush=True)
        probe_batch(B, T, s, st, cuda, a.reps, res, start, a.budget)
    res.data["meta"]["seconds"] = round(time.perf_counter() - start, 1)
    res.save()
    print(table(res.data["rows"]))
    print(f"{res.data['meta']['seconds']} s")


if __name__ == "__main__":
    main()
