"""bench/longctx_check.py's kernel sections for issue 53 (run through it: `--sections topk,tiles`):

  topk    the full layers' denoise canvas (256 queries, 16 heads, 2 KV heads, head dim 512) over 8k / 32k / 128k
          cache keys: dense attention (tiles and flash), the top-k gather form and the fused form (its default
          configs and one change each: FUSED), each timed (CUDA events, median); the sparse forms' max |error| against the f32 twin and
          the rows off by more than 1e-2 (beyond bf16 rounding); the fused form run twice (equal bits?); the
          fused form's time per kernel (profiler); then the arithmetic of issue 53's bar (top-k step <= 0.75x dense
          at 128k): the dense attention's share of the step, and the least an exact top-k can cost (the score pass
          at the dense kernel's rate, plus one read of the f32 scores at the measured copy bandwidth)
  tiles   the head-dim-512 causal chunk kernel (8192 queries ending at 32k / 64k / 128k keys): TILE_CANDIDATES
          (BM, BN, BD, warps, stages) timed against the default tiles, each checked first: bit-identical, within
          one bf16 ulp, or WRONG (not timed); the fastest that keeps the bits (else within an ulp) at each length,
          printed as the LONG_CAUSAL_TILES rows to write into ops/attention_flash.py
"""

from __future__ import annotations

import statistics
import traceback

import torch

from bench.bench_engine import CANVAS, time_cuda
from diffgemma.ops import attention_flash as fl
from diffgemma.ops.attention import attention
from diffgemma.ops.attention_topk import TopKRule, attention_topk_fused, attention_topk_gather, attention_topk_ref

DEV = "cuda"
H, KV, D, CHUNK = 16, 2, 512, 8192
TOPK_KEYS = (8192, 32768, 131072)
TILE_KEYS = (32768, 65536, 131072)
RULE = TopKRule()
# the fused form's default configs (ops/attention_topk_fused.py), then one change each
FUSED = {"fused": {}, "fused_bits8": dict(select_config=dict(BITS=8)),
         "fused_select_block4096": dict(select_config=dict(BLOCK=4096)),
         "fused_select_no_scratch": dict(select_config=dict(CAP=0)),
         "fused_scores_bk64": dict(scores_config=dict(BK=64)),
         "fused_scores_bn256_bk64": dict(scores_config=dict(BN=256, BK=64)),
         "fused_pv_bd512": dict(pv_config=dict(BD=512, num_warps=8)),
         "fused_pv_bk64_bd128": dict(pv_config=dict(BK=64, BD=128))}
DEFAULT_TILES = dict(BM=64, BN=32, BD=512, num_warps=8, num_stages=2)  # flash_config(512, causal=True)
TILE_CANDIDATES = {
    "bm64_bn32_s3": dict(BM=64, BN=32, BD=512, num_warps=8, num_stages=3),
    "bm64_bn64_s1": dict(BM=64, BN=64, BD=512, num_warps=8, num_stages=1),
    "bm64_bn32_bd256_w4": dict(BM=64, BN=32, BD=256, num_warps=4, num_stages=2),
    "bm64_bn64_bd256_w4": dict(BM=64, BN=64, BD=256, num_warps=4, num_stages=2),
    "bm128_bn32_bd256": dict(BM=128, BN=32, BD=256, num_warps=8, num_stages=2),
    "bm128_bn32_bd256_s3": dict(BM=128, BN=32, BD=256, num_warps=8, num_stages=3),
    "bm128_bn64_bd256": dict(BM=128, BN=64, BD=256, num_warps=8, num_stages=2),
    "bm128_bn16_bd256_s3": dict(BM=128, BN=16, BD=256, num_warps=8, num_stages=3),
    "bm128_bn32_bd128": dict(BM=128, BN=32, BD=128, num_warps=8, num_stages=2),
    "bm128_bn64_bd128_s3": dict(BM=128, BN=64, BD=128, num_warps=8, num_stages=3),
}


def med_ms(fn, reps: int, warmup: int = 1) -> float:
    return round(statistics.median(time_cuda(fn, reps=reps, warmup=warmup)), 3)


def err(o, ref) -> dict:
    """max |o - ref| and the rows (query, head) off by more than 1e-2 (beyond a bf16 output's rounding)."""
    e = (o.float() - ref.float()).abs().view(o.shape[0], H, D).amax(-1)
    return {"max_abs_err": round(e.max().item(), 5), "rows_over_1e-2": int((e > 1e-2).sum().item())}


def canvas_inputs(keys: int):
    """The full layers' canvas at `keys` cache keys: q [H, 256, D] bf16, K/V [KV, keys + 256, D] f16 (unit-variance
    scores), nlive = every row."""
    gen = torch.Generator(device=DEV).manual_seed(keys)
    n_keys = keys + CANVAS
    s = D ** -0.25
    q = (torch.randn(H, CANVAS, D, device=DEV, generator=gen) * s).bfloat16()
    k = (torch.randn(KV, n_keys, D, device=DEV, generator=gen) * s).half()
    v = torch.randn(KV, n_keys, D, device=DEV, generator=gen).half()
    return q, k, v, n_keys, torch.tensor(n_keys, device=DEV)


def kernel_parts(fn) -> dict:
    """GPU ms per kernel name of one call of fn (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    parts: dict = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if us:
            name = next((k for k in ("_scores_kernel", "_select_kernel", "_sparse_pv_kernel") if k in ev.key), "other")
            parts[name] = round(parts.get(name, 0.0) + us / 1e3, 3)
    return parts


def copy_gbps() -> float:
    """Measured device-to-device copy bandwidth (read + write bytes / time) over 1 GiB."""
    x = torch.empty(1 << 28, device=DEV)
    y = torch.empty_like(x)
    ms = med_ms(lambda: y.copy_(x), 5)
    return round(2 * x.numel() * 4 / ms / 1e6, 1)


def bar_arithmetic(dense_call_ms: float, keys: int, n_full: int, gbps: float, step_1k: float | None = None,
                   step_dense: float | None = None) -> dict:
    """Issue 53's bar at `keys`: the top-k step <= 0.75x the dense step. Per full layer, dense canvas attention is
    4·H·C·keys·D FLOPs; an exact top-k must at least compute every score (half of those FLOPs, taken at the dense
    kernel's rate) and read each f32 score once (4 bytes a score at the copy bandwidth)."""
    n_keys = keys + CANVAS
    score_flops = 2 * H * CANVAS * n_keys * D
    rate = 2 * score_flops / dense_call_ms / 1e9  # TFLOP/s of the dense call
    floor = n_full * (dense_call_ms / 2 + H * CANVAS * n_keys * 4 / (gbps * 1e6))
    r = {"dense_attention_call_ms": dense_call_ms, "dense_tflops": round(rate, 1), "full_layers": n_full,
         "score_pass_ms_all_layers": round(n_full * dense_call_ms / 2, 3),
         "exact_topk_floor_ms_all_layers": round(floor, 3), "copy_gbps": gbps}
    if step_1k is not None and step_dense is not None:
        allowed = 0.75 * step_dense - step_1k
        r.update(dense_step_ms=step_dense, step_1k_ms=step_1k, attention_share_ms=round(step_dense - step_1k, 3),
                 bar_step_ms=round(0.75 * step_dense, 3), topk_attention_allowed_ms=round(allowed, 3),
                 reachable=floor <= allowed)
    return r


def section_topk(left, log, n_full: int = 5) -> dict:
    out: dict = {}
    for keys in TOPK_KEYS:
        if left() < 40:
            out[keys] = "skipped: budget"
            continue
        try:
            q, k, v, n_keys, nlive = canvas_inputs(keys)
            r: dict = {}
            for impl in ("tiles", "triton"):
                r[f"dense_{impl}_ms"] = med_ms(lambda: attention(q, k, v, None, n_keys, impl=impl, nlive=nlive), 5)
            twin = attention_topk_ref(q, k, v, None, n_keys, RULE, nlive=nlive, out_dtype=torch.float32, q_block=32)
            forms = {"gather": lambda: attention_topk_gather(q, k, v, None, n_keys, RULE, nlive=nlive)}
            for name, cfg in FUSED.items():
                forms[name] = lambda cfg=cfg: attention_topk_fused(q, k, v, None, n_keys, RULE, nlive=nlive, **cfg)
            for name, fn in forms.items():
                try:
                    o = fn()
                    r[name] = err(o, twin)
                    if name.startswith("fused"):
                        r[name]["same_bits_twice"] = bool(torch.equal(o, fn()))
                    del o
                    r[name]["ms"] = med_ms(fn, 5)
                    r[name]["over_dense_tiles"] = round(r[name]["ms"] / r["dense_tiles_ms"], 3)
                except Exception as e:
                    traceback.print_exc()
                    r[name] = f"{type(e).__name__}: {str(e)[:300]}"
            del twin
            if isinstance(r.get("fused"), dict):
                try:
                    r["fused"]["kernels_ms"] = kernel_parts(forms["fused"])
                except Exception as e:
                    r["fused"]["kernels_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
            out[keys] = r
            log(f"[topk] canvas at {keys} keys: {r}")
        except Exception as e:
            traceback.print_exc()
            out[keys] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.empty_cache()
    last = out.get(TOPK_KEYS[-1])
    if isinstance(last, dict):
        out["bar"] = bar_arithmetic(last["dense_tiles_ms"], TOPK_KEYS[-1], n_full, copy_gbps())
        log(f"[topk] the 0.75x bar's arithmetic at {TOPK_KEYS[-1]} keys: {out['bar']}")
    return out


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in bf16 ulps of the larger magnitude (0: the same bits)."""
    a, b = a.float(), b.float()
    m = torch.maximum(a.abs(), b.abs()).clamp_min(2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(m)) - 7)
    return (a - b).abs().div(ulp).max().item()


def causal_chunk(end: int):
    gen = torch.Generator(device=DEV).manual_seed(end)
    s = D ** -0.25
    q = (torch.randn(H, CHUNK, D, device=DEV, generator=gen) * s).bfloat16()
    k = (torch.randn(KV, end, D, device=DEV, generator=gen) * s).half()
    v = torch.randn(KV, end, D, device=DEV, generator=gen).half()
    return q, k, v, torch.arange(end, device=DEV), torch.arange(end - CHUNK, end, device=DEV)


def section_tiles(left, log) -> dict:
    out: dict = {}
    for end in TILE_KEYS:
        if left() < 40:
            out[end] = "skipped: budget"
            continue
        q, k, v, kpos, qpos = causal_chunk(end)
        kw = dict(qpos=qpos, window=fl.NO_WINDOW, causal=True)
        flops = 4 * H * D * sum(min(end, end - CHUNK + i + 1) for i in range(0, CHUNK, 64)) * 64
        reps = 5 if end <= 65536 else 3
        base = fl.attention_flash(q, k, v, kpos, end, **kw, **DEFAULT_TILES)
        ms = med_ms(lambda: fl.attention_flash(q, k, v, kpos, end, **kw, **DEFAULT_TILES), reps)
        r = {"default": {"ms": ms, "tflops": round(flops / ms / 1e9, 1)}}
        for name, cfg in TILE_CANDIDATES.items():
            if left() < 20:
                r[name] = "skipped: budget"
                continue
            try:
                o = fl.attention_flash(q, k, v, kpos, end, **kw, **cfg)
                u = ulps_bf16(o, base)
                verdict = "bits" if u == 0 else ("ulp" if u <= 1 else "WRONG")
                r[name] = {"max_abs_diff": (o.float() - base.float()).abs().max().item(), "max_ulps": u, "check": verdict}
                del o
                if verdict != "WRONG":
                    r[name]["ms"] = t = med_ms(lambda: fl.attention_flash(q, k, v, kpos, end, **kw, **cfg), reps)
                    r[name]["tflops"] = round(flops / t / 1e9, 1)
            except Exception as e:
                r[name] = f"{type(e).__name__}: {str(e)[:200]}"
        timed = {n: x for n, x in r.items() if isinstance(x, dict) and "ms" in x and n != "default"}
        for kind in ("bits", "ulp"):
            pick = {n: x for n, x in timed.items() if x["check"] == kind}
            if pick:
                best = min(pick, key=lambda n: pick[n]["ms"])
                if pick[best]["ms"] < r["default"]["ms"]:
                    r[f"best_{kind}"] = best
        out[end] = r
        log(f"[tiles] hd512 causal chunk of {CHUNK} ending at {end}: " +
            ", ".join(f"{n} {x.get('ms', x.get('check')) if isinstance(x, dict) else x}" for n, x in r.items()))
        torch.cuda.empty_cache()
    rows = []
    for end, r in out.items():
        if isinstance(r, dict):
            best = r.get("best_bits") or r.get("best_ulp")
            cfg = TILE_CANDIDATES[best] if best else DEFAULT_TILES
            rows.append(f"    (2048, {end}, dict({', '.join(f'{k}={v}' for k, v in cfg.items())})),  # "
                        f"{r[best]['ms'] if best else r['default']['ms']} ms, {r[best]['check'] if best else 'default'}")
    out["table"] = rows
    log("[tiles] LONG_CAUSAL_TILES rows (ops/attention_flash.py):\n" + "\n".join(rows))
    return out
