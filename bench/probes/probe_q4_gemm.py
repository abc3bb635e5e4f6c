"""Probe: where the q4 expert GEMM's time goes at the denoise shape (one GPU, a minute).

    PYTHONPATH=src python -m bench.probes.probe_q4_gemm [--modes full,no_affine,...] [--configs N] [--json out.json]

The packed kernel (ops/moe_packed.py) streams q4 codes at a fifth of the bandwidth the bf16 streaming
kernel reaches. Without hardware counters, this times variants of the same loop that leave one stage
out, and takes the differences. Their results are
wrong on purpose, except MODE full, which is checked against the twin.

Its loop loads the scales and mins in the K step that uses them; the
production kernel loads them one step ahead (Triton left those loads synchronous), so "full" here is the
kernel's `prefetch=False` path, not its default.

  full      the production decode (codes -> f32 by their bits, · scale + min, bf16) and dot
  no_affine codes -> f32 -> bf16, no scale / min (so no group broadcast)
  bytes     the code bytes themselves as bf16 values, one dot over K/2 (no nibble split, no interleave)
  no_dot    the full decode, then a row sum instead of the dot (no MMA, no operand layout change)
  loads     the loads only (codes, scales, mins), folded into the accumulator by a cheap sum
  group_dots  (a candidate, checked like full) one dot per group of 32 on the raw codes (exact in bf16),
            the group's scale applied to that dot's [BN, BM] result and its min times the group's x sums:
            Σ_k (q·s + m)·x = Σ_g s_g·(Σ_{k∈g} q·x) + m_g·(Σ_{k∈g} x), so no per-element affine at all
  ptr_affine  (a candidate, checked) scale and min loaded straight into the [BN, BK] tile's layout (each
            element's pointer names its group: repeated addresses, served by L1) instead of broadcast
            from [BN, BK/32] in registers
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.bench_engine import time_cuda
from bench.fixtures import random_record
from diffgemma.ops import moe_packed as mp
from diffgemma.ops.moe_plan import moe_plan

MODES = {"full": 0, "no_affine": 1, "bytes": 2, "no_dot": 3, "loads": 4, "group_dots": 5, "ptr_affine": 6}


@triton.jit
def _probe_kernel(x_ptr, out_ptr, offs_ptr, p0, p2, p3, N, K, stride_x, stride_o,
                  MODE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    start, end, n, n_ok, rows = mp._expert_tile(offs_ptr, offs_ptr, N, BN, False)
    for m0 in range(start, end, BM):
        m = m0 + tl.arange(0, BM)
        m_ok = m < end
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            kb = k0 // 2 + tl.arange(0, BK // 2)
            c = tl.load(p0 + rows[:, None] * (K // 2) + kb[None, :], mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0)
            kg = k0 // 32 + tl.arange(0, BK // 32)
            gmask = n_ok[:, None] & (kg < K // 32)[None, :]
            s = tl.load(p2 + rows[:, None] * (K // 32) + kg[None, :], mask=gmask, other=0.0).to(tl.float32)
            mn = tl.load(p3 + rows[:, None] * (K // 32) + kg[None, :], mask=gmask, other=0.0).to(tl.float32)
            if MODE == 5:
                for j in tl.static_range(BK // 32):
                    kbj = k0 // 2 + j * 16 + tl.arange(0, 16)
                    cj = tl.load(p0 + rows[:, None] * (K // 2) + kbj[None, :],
                                 mask=n_ok[:, None] & (kbj < K // 2)[None, :], other=0).to(tl.int32)
                    qj = tl.reshape(tl.join(cj & 0xF, cj >> 4), (BN, 32))
                    kj = k0 + j * 32 + tl.arange(0, 32)
                    xj = tl.load(x_ptr + m[None, :].to(tl.int64) * stride_x + kj[:, None],
                                 mask=(kj < K)[:, None] & m_ok[None, :], other=0.0)
                    gj = k0 // 32 + j + 0 * n  # a [BN] vector: every row's group index
                    g_ok = n_ok & (gj < K // 32)
                    sj = tl.load(p2 + rows * (K // 32) + gj, mask=g_ok, other=0.0).to(tl.float32)
                    mj = tl.load(p3 + rows * (K // 32) + gj, mask=g_ok, other=0.0).to(tl.float32)
                    part = tl.dot(qj.to(xj.dtype), xj)
                    acc += sj[:, None] * part + mj[:, None] * tl.sum(xj.to(tl.float32), axis=0)[None, :]
            elif MODE == 4:
                acc += (tl.sum(c.to(tl.float32), axis=1) + tl.sum(s + mn, axis=1))[:, None]
            elif MODE == 2:
                xh = tl.load(x_ptr + m[None, :].to(tl.int64) * stride_x + kb[:, None],
                             mask=(kb < K)[:, None] & m_ok[None, :], other=0.0)
                acc = tl.dot(c.to(xh.dtype), xh, acc)
            else:
                ci = c.to(tl.int32)
                q = tl.reshape(tl.join(ci & 0xF, ci >> 4), (BN, BK // 32, 32))
                qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                if MODE == 1:
                    w = tl.reshape(qf, (BN, BK))
                elif MODE == 6:
                    kg2 = kk // 32
                    m2 = n_ok[:, None] & (kk < K)[None, :]
                    s2 = tl.load(p2 + rows[:, None] * (K // 32) + kg2[None, :], mask=m2, other=0.0).to(tl.float32)
                    mn2 = tl.load(p3 + rows[:, None] * (K // 32) + kg2[None, :], mask=m2, other=0.0).to(tl.float32)
                    w = tl.reshape(qf, (BN, BK)) * s2 + mn2
                else:
                    w = tl.reshape(qf * s[:, :, None] + mn[:, :, None], (BN, BK))
                if MODE == 3:
                    acc += tl.sum(w.to(tl.bfloat16).to(tl.float32), axis=1)[:, None]
                else:
                    xt = tl.load(x_ptr + m[None, :].to(tl.int64) * stride_x + kk[:, None],
                                 mask=(kk < K)[:, None] & m_ok[None, :], other=0.0)
                    acc = tl.dot(w.to(xt.dtype), xt, acc)
        tl.store(out_ptr + m[None, :].to(tl.int64) * stride_o + n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])


CONFIGS = ((64, 32, 128, 4, 3), (64, 32, 64, 4, 4), (64, 16, 64, 4, 4), (32, 32, 64, 4, 4), (64, 16, 128, 4, 4),
           (64, 16, 256, 4, 3), (128, 16, 128, 8, 3), (64, 32, 256, 8, 3))


def run(xs, pw, offs, mode, cfg):
    E, N, K = pw.shape
    out = torch.empty(xs.shape[0], N, dtype=xs.dtype, device=xs.device)
    BN, BM, BK, warps, stages = cfg
    p = pw.planes
    _probe_kernel[(triton.cdiv(N, BN), E)](xs, out, offs, p["codes"], p["scale"].view(torch.float16),
                                           p["min"].view(torch.float16), N, K, xs.stride(0), out.stride(0),
                                           MODE=MODES[mode], BN=BN, BM=BM, BK=BK, num_warps=warps, num_stages=stages)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="time the first N of CONFIGS")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; expected names from {list(MODES)}")
    E, H, Fe, T, k = 128, 2816, 704, 256, 8
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    experts = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    src, _, offs = moe_plan(experts, E)
    offs = offs.to(torch.int32)
    res = {}
    for name, shape in (("gate_up", (E, 2 * Fe, H)), ("down", (E, H, Fe))):
        pw = mp.PackedWeight.from_record("q4", shape, random_record("q4", shape, "cuda", gen, 0.02))
        xs = torch.randn(T * k, shape[2], device="cuda", dtype=torch.bfloat16)
        want = mp.grouped_mm_packed_ref(xs, pw, offs)
        for cfg in CONFIGS[:a.configs]:
            for mode in modes:
                key = f"{name}_{mode}_" + "_".join(map(str, cfg))
                try:
                    got = run(xs, pw, offs, mode, cfg)
                    if mode in ("full", "group_dots", "ptr_affine"):
                        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                        assert err < 5e-3, f"full decode is wrong: rel {err:.2e}"
                    ms = statistics.median(time_cuda(lambda: run(xs, pw, offs, mode, cfg), reps=20, warmup=3))
                    res[key] = {"ms": ms, "GBps": pw.nbytes / ms / 1e6}
                except Exception as e:
                    res[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(key, res[key], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
