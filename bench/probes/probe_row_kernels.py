"""Probe: the fused norm kernels of a forward (ops/rmsnorm.py) by their warps.

    PYTHONPATH=src:. python -m bench.probes.probe_row_kernels --json $OUT/rowk.json
    PYTHONPATH=src:. TRITON_INTERPRET=1 python -m bench.probes.probe_row_kernels --tiny     # CPU dry run

At the model's widths (hidden 2816, top-8) for the rows of one canvas (256 tokens, 2048 routes) and of eight (2048
tokens, 16384 routes):
  attn_finish        bf16 (moe_in as the f16 operand, the q4 engine's) and FP8 (dense_in and moe_in quantized)
  layer_finish_moe   the MoE un-permute + finish + the next input norm, bf16 and FP8 (next_fp8)
                     both at 4, 8 and 16 warps (ops/rmsnorm.WIDE_ROW_WARPS set so; the FP8 variants take twice
                     it, so their rows are labelled by the warps they ran at; the default marked), each against its
                     torch twin (relative error) and against the 4-warp kernel (bits equal or not: the warps move a
                     norm's f32 summation order)
Times: GPU µs a call, 10 calls captured in one CUDA graph, the median of --reps replays (bench/bench_engine.time_graph).
The JSON is rewritten after every row. --tiny: small shapes in the Triton interpreter (a dry run of the code paths).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.probes.probe_nvfp4_kernel import Results, rel, timed_us
from diffgemma.ops import fp8_quant, rmsnorm

FULL = dict(H=2816, k=8, tokens={1: 256, 8: 2048})
TINY = dict(H=96, k=2, tokens={1: 4, 8: 9})
NORM_WARPS = (4, 8, 16)


def bits_equal(a, b) -> bool:
    a, b = (t.view(torch.uint8) if t.dtype == fp8_quant.FP8_DTYPE else t for t in (a, b))
    return a.shape == b.shape and bool(torch.equal(a, b))


def flat(out) -> list[torch.Tensor]:
    """A kernel's outputs as plain tensors (an Fp8Rows is its q and s)."""
    res = []
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if t is None:
            continue
        res.extend(flat(tuple(t)) if isinstance(t, tuple) else [t])
    return res


def norm_rows(res: Results, name, fn, ref, fp8, cuda, reps):
    """Time fn() at each of NORM_WARPS, its outputs against the twin's and the 4-warp kernel's."""
    default, base = rmsnorm.WIDE_ROW_WARPS, None
    engine_warps = rmsnorm.row_warps(4096, fp8)  # what the engine runs at the hidden width
    want = flat(ref())
    try:
        for w in NORM_WARPS:
            rmsnorm.WIDE_ROW_WARPS = w // 2 if fp8 else w
            got = flat(fn())
            base = got if base is None else base
            err = max(rel(g.float(), e.float()) for g, e in zip(got, want) if g.dtype != fp8_quant.FP8_DTYPE)
            res.add(kernel=name, warps=w, default=w == engine_warps,
                    us=round(timed_us(fn, cuda, reps), 2), rel_vs_twin=f"{err:.1e}",
                    bits_equal_4warps=all(bits_equal(a, b) for a, b in zip(got, base)))
    finally:
        rmsnorm.WIDE_ROW_WARPS = default


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the results here (rewritten as they come)")
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (TRITON_INTERPRET=1): a dry run")
    ap.add_argument("--reps", type=int, default=20, help="graph replays a timing (median)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    S = TINY if a.tiny else FULL
    H, k = S["H"], S["k"]
    res = Results(a.json, {"device": torch.cuda.get_device_name() if cuda else "cpu", "shapes": S})
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    ws = [torch.rand(H, generator=gen, device=dev).to(torch.bfloat16) + 0.5 for _ in range(5)]
    wr = torch.rand(H, generator=gen, device=dev)
    for B, T in S["tokens"].items():
        print(f"B={B}: {T} tokens, {T * k} routes", flush=True)
        r, at, m = rnd(T, H), rnd(T, H), rnd(T, H)
        y = rnd(T * k, H)
        inv = torch.randperm(T * k, generator=gen, device=dev).to(torch.int32)
        wts = torch.rand(T, k, generator=gen, device=dev)
        for fp8 in (False, True):
            kw = dict(dense_fp8=True, moe_fp8=True) if fp8 else dict(moe_f16=True)
            norm_rows(res, f"B{B} attn_finish {'fp8' if fp8 else 'bf16'}",
                      lambda: rmsnorm.attn_finish_triton(r, at, *ws[:3], wr, 1e-6, **kw),
                      lambda: rmsnorm.attn_finish_ref(r, at, *ws[:3], wr, 1e-6, **kw), fp8, cuda, a.reps)
            norm_rows(res, f"B{B} layer_finish_moe {'fp8' if fp8 else 'bf16'}",
                      lambda: rmsnorm.layer_finish_moe_triton(r, m, y, inv, wts, *ws[1:4], 0.8, 1e-6, ws[4],
                                                              next_fp8=fp8),
                      lambda: rmsnorm.layer_finish_moe_ref(r, m, y, inv, wts, *ws[1:4], 0.8, 1e-6, ws[4],
                                                           next_fp8=fp8), fp8, cuda, a.reps)
    print(f"{time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
