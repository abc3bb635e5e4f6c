"""Long context at full size (random weights, one GPU), in one command (issue 53):

    PYTHONPATH=src:. python -m bench.longctx_check [--budget 450] [--json $OUT/longctx.json]

Sections, in this order (topk, tiles, prefill, profile, kernels, q4), each in its own try/except (a failure prints its traceback and the run goes on), the JSON
rewritten after each (a time-out keeps what finished), and a section that would start past `--budget` seconds is
skipped and says so:

  topk      the full layers' denoise canvas at 8k / 32k / 128k keys: dense against the top-k gather and fused forms,
            their error against the f32 twin, and the arithmetic of issue 53's 0.75x bar (bench/longctx_sections.py)
  tiles     the head-dim-512 causal chunk kernel's tile sweep at 32k / 64k / 128k keys, printed as the
            LONG_CAUSAL_TILES rows to write into ops/attention_flash.py (bench/longctx_sections.py)
  kernels   the full layers' causal attention at head dim 512 alone, for one 8192-row prefill chunk ending at
            8k / 32k / 64k / 128k / 256k keys: the flash kernel as the engine calls it, SDPA (efficient / cuDNN /
            flash backends, lower-right causal, GQA expanded), and the top-k gather and fused forms; the flash kernel
            checked against the f32 reference on the chunk's last rows; the sliding layers' chunk (hd 256, window
            1024); the full layers' denoise canvas (256 rows, dense tiles / flash against top-k) at 1k..256k keys
  prefill   the bf16 engine: dense prefill tokens/s at 8k, 32k, 64k, 128k, 256k with peak memory and KV-cache bytes;
            the denoise step (graphed, as generate calls it) at 1k / 8k / 32k / 128k, dense and top-k sparse (the
            gather and the fused form), and the 0.75x bar's arithmetic from these steps; sparse prefill at 64k /
            128k (256k with --sparse-256k), the fused form
  profile   one 8192-row prefill chunk after 56k cached tokens: per-part GPU time (full-layer attention, sliding
            attention, ring glue, GEMMs, MoE kernels, norms, other) from torch.profiler, the full / sliding split from
            CUDA events around each attention call, and the top kernels
  q4        the q4 engine's prefill at 64k / 128k against bf16's (built after bf16 is freed)
  sparse    (only when --sections names it) the bf16 engine's sparse prefill alone at --sparse-at lengths (default
            256k), after an 8k sparse warm-up: the 256k one without the ladder that precedes it in `prefill`

Output: $OUT/longctx.json and $OUT/longctx.txt (the printed summary).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import time
import traceback
from pathlib import Path

import torch

from bench.bench_engine import CANVAS, generate_forward, gpu_table, time_cuda
from bench.runner import build, shapes
from diffgemma.ops.attention import attention, attention_ref
from diffgemma.ops.attention_flash import NO_WINDOW, attention_flash
from bench.longctx_sections import bar_arithmetic, copy_gbps, section_tiles, section_topk
from diffgemma.ops import attention_topk as topk_mod
from diffgemma.ops.attention_topk import TopKRule, attention_topk_fused, attention_topk_gather

DEV = "cuda"
H, KV, D, SKV, SD, WIN, CHUNK = 16, 2, 512, 8, 256, 1024, 8192
ENDS = (8192, 32768, 65536, 131072, 262144)  # the prefill ladder, and where the kernel chunks end
STEP_AT, SPARSE_AT, SHORT = (1024, 8192, 32768, 131072), (65536, 131072), 1024  # the step; sparse prefill; a short prompt
PROFILE_CACHED = 57344  # tokens cached before the profiled chunk
RULE = TopKRule()
T0 = time.time()
LINES: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    LINES.append(s)
    print(s, flush=True)


def left(budget: float) -> float:
    return budget - (time.time() - T0)


def med_ms(fn, reps: int, warmup: int = 1) -> float:
    return round(statistics.median(time_cuda(fn, reps=reps, warmup=warmup)), 3)


def free():
    gc.collect()
    torch.cuda.empty_cache()


def causal_inputs(end: int, gen: torch.Generator):
    """One 8192-row chunk ending at `end` keys, full-layer shapes: q [H, n, D] bf16, K/V [KV, end, D] f16 (unit-variance
    scores), kpos = key row, qpos."""
    n = min(CHUNK, end)
    s = D ** -0.25
    q = (torch.randn(H, n, D, device=DEV, generator=gen) * s).bfloat16()
    k = (torch.randn(KV, end, D, device=DEV, generator=gen) * s).half()
    v = torch.randn(KV, end, D, device=DEV, generator=gen).half()
    return q, k, v, torch.arange(end, device=DEV), torch.arange(end - n, end, device=DEV)


def sdpa_lower_right(q, k, v, backend):
    """SDPA over the chunk with a lower-right causal bias (query i sees keys <= end - n + i), GQA expanded."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    Hq, n, d = q.shape
    kx = k.repeat_interleave(Hq // k.shape[0], 0)[None]
    vx = v.repeat_interleave(Hq // k.shape[0], 0)[None]
    qx = q[None].to(k.dtype)
    bias = causal_lower_right(n, kx.shape[2])
    with sdpa_kernel([backend]):
        o = torch.nn.functional.scaled_dot_product_attention(qx, kx, vx, attn_mask=bias, scale=1.0)
    return o[0].transpose(0, 1).reshape(n, Hq * d).to(q.dtype)


def check_and_time(fn, base, reps, tol=3e-2):
    """(max |Δ| against base, median ms) or the reason it was not timed."""
    out = fn()
    torch.cuda.synchronize()
    err = (out.float() - base.float()).abs().max().item()
    if not err <= tol:
        return {"max_abs_diff": err, "ms": "WRONG: not timed"}
    del out
    return {"max_abs_diff": round(err, 5), "ms": med_ms(fn, reps)}


def kernel_causal(end: int, budget: float) -> dict:
    from torch.nn.attention import SDPBackend

    gen = torch.Generator(device=DEV).manual_seed(end)
    q, k, v, kpos, qpos = causal_inputs(end, gen)
    n = q.shape[1]
    r = {"queries": n, "keys": end}
    reps = 3 if end <= 65536 else 2
    kw = dict(qpos=qpos, window=NO_WINDOW, causal=True)
    base = attention_flash(q, k, v, kpos, end, **kw)
    ms = med_ms(lambda: attention_flash(q, k, v, kpos, end, **kw), reps)
    flops = 4 * H * D * sum(min(end, end - n + i + 1) for i in range(0, n, 64)) * 64
    r["flash_default"] = {"ms": ms, "tflops": round(flops / ms / 1e9, 1)}
    tail = 256  # the f32 reference on the chunk's last rows (its f32 copies of K and V: up to 128k keys)
    ref = None if end > 131072 else attention_ref(q[:, -tail:].contiguous(), k, v, kpos, end, qpos=qpos[-tail:], causal=True)
    if ref is not None:
        r["flash_default"]["vs_f32_ref_last_rows"] = round((base[-tail:].float() - ref.float()).abs().max().item(), 5)
    del ref
    for bname in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "FLASH_ATTENTION"):
        if end > 131072 or left(budget) < 30:
            break
        try:
            r[f"sdpa_{bname.lower()}"] = check_and_time(lambda: sdpa_lower_right(q, k, v, getattr(SDPBackend, bname)),
                                                       base, reps)
        except Exception as e:
            r[f"sdpa_{bname.lower()}"] = f"{type(e).__name__}: {str(e)[:200]}"
        free()
    topk = {"topk_gather_ms": attention_topk_gather, "topk_fused_ms": attention_topk_fused}
    for name, fn in topk.items():  # the top-k forms (sparse: other results by design, timed only)
        try:
            r[name] = med_ms(lambda: fn(q, k, v, kpos, end, RULE, qpos=qpos, causal=True, q_start=end - n), 1)
        except Exception as e:
            r[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return r


def kernel_canvas(keys: int) -> dict:
    """The full layers' denoise canvas: 256 rows over `keys` cache rows + the canvas, every key visible."""
    gen = torch.Generator(device=DEV).manual_seed(keys)
    n_keys = keys + CANVAS
    s = D ** -0.25
    q = (torch.randn(H, CANVAS, D, device=DEV, generator=gen) * s).bfloat16()
    k = (torch.randn(KV, n_keys, D, device=DEV, generator=gen) * s).half()
    v = torch.randn(KV, n_keys, D, device=DEV, generator=gen).half()
    nlive = torch.tensor(n_keys, device=DEV)
    r = {}
    for impl in ("tiles", "triton"):
        try:
            r[f"dense_{impl}_ms"] = med_ms(lambda: attention(q, k, v, None, n_keys, impl=impl, nlive=nlive), 5)
        except Exception as e:
            r[f"dense_{impl}_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
    for name, fn in {"topk_gather_ms": attention_topk_gather, "topk_fused_ms": attention_topk_fused}.items():
        try:
            r[name] = med_ms(lambda: fn(q, k, v, None, n_keys, RULE, nlive=nlive), 5)
        except Exception as e:
            r[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return r


def section_kernels(a) -> dict:
    out = {"causal_full": {}, "canvas_full": {}}
    for end in ENDS:
        if left(a.budget) < 60:
            out["causal_full"][end] = "skipped: budget"
            continue
        try:
            out["causal_full"][end] = r = kernel_causal(end, a.budget)
            log(f"[kernels] causal hd512 chunk ending at {end}: " + json.dumps(r))
        except Exception as e:
            traceback.print_exc()
            out["causal_full"][end] = f"{type(e).__name__}: {str(e)[:300]}"
        free()
    try:  # the sliding layers' chunk: keys = the window before it + the chunk, position-ordered
        gen = torch.Generator(device=DEV).manual_seed(1)
        n, nk = CHUNK, CHUNK + WIN
        q = (torch.randn(H, n, SD, device=DEV, generator=gen) * SD ** -0.25).bfloat16()
        k = (torch.randn(SKV, nk, SD, device=DEV, generator=gen) * SD ** -0.25).half()
        v = torch.randn(SKV, nk, SD, device=DEV, generator=gen).half()
        P = 65536
        kpos, qpos = torch.arange(P - WIN, P + n, device=DEV), torch.arange(P, P + n, device=DEV)
        out["causal_sliding_ms"] = med_ms(lambda: attention_flash(q, k, v, kpos, nk, qpos=qpos, window=WIN,
                                                                  causal=True, base_pos=P - WIN), 5)
        log(f"[kernels] sliding hd256 chunk: {out['causal_sliding_ms']} ms")
    except Exception as e:
        traceback.print_exc()
        out["causal_sliding_ms"] = f"{type(e).__name__}: {str(e)[:300]}"
    for keys in (1024, 8192, 32768, 131072, 262144):
        try:
            out["canvas_full"][keys] = kernel_canvas(keys)
            log(f"[kernels] canvas hd512 at {keys} keys: {out['canvas_full'][keys]}")
        except Exception as e:
            traceback.print_exc()
            out["canvas_full"][keys] = f"{type(e).__name__}: {str(e)[:300]}"
        free()
    return out


def kv_gib(cache) -> float:
    return round(sum(t.numel() * t.element_size() for t in list(cache.keys) + list(cache.values)) / 2**30, 3)


def step_ms(eng, cache, rule, reps: int) -> float:
    """The graphed denoise step as generate calls it (SC embeddings in, raw logits out, inputs staged), with the
    cache's top-k rule (None: dense)."""
    cache.attention_topk = rule
    V = eng.config.vocab_size
    ids = torch.randint(0, V, (CANVAS,), device=DEV)
    emb = torch.randn(CANVAS, eng.config.hidden_size, device=DEV).bfloat16()
    eng.use_graphs = True
    step = generate_forward(eng)
    step(cache, ids, sc_embeds=emb)  # capture
    stage = getattr(eng, "stage_denoise", None)
    t = time_cuda(lambda: step(cache, ids, sc_embeds=emb), reps=reps, warmup=2,
                  setup=(lambda: stage(cache, ids, sc_embeds=emb)) if stage is not None else None)
    cache.attention_topk = None
    eng.clear_graphs()
    return round(statistics.median(t), 3)


def prefill_once(eng, cache, prompt, rule=None) -> dict:
    cache.truncate(0)
    cache.attention_topk = rule
    free()
    torch.cuda.reset_peak_memory_stats()
    ms = statistics.median(time_cuda(lambda: eng.prefill(cache, prompt), reps=1, warmup=0))
    cache.attention_topk = None
    T = len(prompt)
    return {"ms": round(ms, 1), "tok_s": round(T / ms * 1e3), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def section_engine(eng, a, kind: str) -> dict:
    """Dense prefill ladder (+ the step at 1k/8k/128k, sparse prefill) on one engine."""
    out = {"prefill": {}, "step": {}, "sparse_prefill": {}}
    V = eng.config.vocab_size
    c0 = eng.new_cache(ENDS[0])
    eng.prefill(c0, torch.randint(0, V, (ENDS[0],), device=DEV))  # compile and warm every prefill kernel
    del c0
    lengths = [SHORT] + [t for t in ENDS if t <= a.max_context]
    for T in lengths:
        if left(a.budget) < (60 if T >= 131072 else 20):
            out["prefill"][T] = "skipped: budget"
            continue
        try:
            cache = eng.new_cache(T)
            prompt = torch.randint(0, V, (T,), device=DEV)
            r = prefill_once(eng, cache, prompt)
            if T <= ENDS[1]:  # the warmed second run
                r = prefill_once(eng, cache, prompt)
            r["kv_cache_gib"] = kv_gib(cache)
            out["prefill"][T] = r
            log(f"[{kind}] prefill {T}: {r}")
            if T in STEP_AT and kind == "bf16" and left(a.budget) > 40:  # the cache holds the prompt
                st = {"dense_ms": step_ms(eng, cache, None, 10)}
                default_form = topk_mod.FORM
                for form in topk_mod.FORMS:
                    name = f"topk_{form}"
                    try:
                        topk_mod.FORM = form
                        st[f"{name}_ms"] = step_ms(eng, cache, RULE, 10)
                        st[f"{name}_over_dense"] = round(st[f"{name}_ms"] / st["dense_ms"], 3)
                    except Exception as e:
                        traceback.print_exc()
                        st[f"{name}_ms"] = f"{type(e).__name__}: {str(e)[:300]}"
                    finally:
                        topk_mod.FORM = default_form
                out["step"][T] = st
                log(f"[{kind}] step at {T}: {st}")
            sparse = SPARSE_AT + ((ENDS[-1],) if a.sparse_256k else ())
            if T in sparse and kind == "bf16" and left(a.budget) > (90 if T < ENDS[-1] else 200):
                try:
                    out["sparse_prefill"][T] = prefill_once(eng, cache, prompt, RULE)
                except Exception as e:
                    traceback.print_exc()
                    out["sparse_prefill"][T] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"[{kind}] sparse prefill {T}: {out['sparse_prefill'][T]}")
            del cache, prompt
        except Exception as e:
            traceback.print_exc()
            out["prefill"][T] = f"{type(e).__name__}: {str(e)[:300]}"
        eng.clear_graphs()
        free()
    return out


GROUPS = [  # (group, kernel-name pattern), first match wins
    ("attention_flash", r"_flash_kernel|_combine_kernel"),
    ("attention_tiles", r"_qk_tile_softmax|_tile_weights|_pv_scaled"),
    ("topk", r"topk|radix|sort|bitonic|gatherTopK"),
    ("moe_triton", r"moe|expert|route|router|q4_tiles|packed_gmm|dequant|stream"),
    ("norm_qkv_rope", r"rms|norm|qkv|rope|finish|gelu|ffn_inputs"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|wgmma|sm90_|_mm_|matmul|cublas|grouped|splitK"),
    ("ring_glue", r"index|copy|cat|elementwise|fill|arange|where|remainder|reduce|scatter|gather"),
]


def profile_chunk(eng, a) -> dict:
    """One 8192-row chunk after 56k cached tokens under torch.profiler, with CUDA events around each attention call
    (forward.py's `attention` and `attention_topk`, keyed by head dim: 512 full layers, else sliding)."""
    from torch.profiler import ProfilerActivity, profile

    import diffgemma.model.forward as fwd

    V, P = eng.config.vocab_size, PROFILE_CACHED
    cache = eng.new_cache(P + CHUNK)
    eng.prefill(cache, torch.randint(0, V, (P,), device=DEV))
    chunk = torch.randint(0, V, (CHUNK,), device=DEV)
    events: list = []

    def timed(fn):
        def call(q, *args, **kw):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            o = fn(q, *args, **kw)
            e1.record()
            events.append(("full" if q.shape[-1] >= 512 else "sliding", e0, e1))
            return o
        return call

    orig = fwd.attention, fwd.attention_topk
    fwd.attention, fwd.attention_topk = timed(orig[0]), timed(orig[1])
    try:
        torch.cuda.synchronize()
        t = time.time()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.prefill(cache, chunk)
            torch.cuda.synchronize()
        wall = time.time() - t
    finally:
        fwd.attention, fwd.attention_topk = orig
    groups: dict = {}
    total = 0.0
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if not us:
            continue
        total += us
        g = next((name for name, pat in GROUPS if re.search(pat, ev.key, re.I)), "other")
        groups[g] = groups.get(g, 0.0) + us
    attn = {}
    for kind, e0, e1 in events:
        attn[kind] = attn.get(kind, 0.0) + e0.elapsed_time(e1)
    r = {"cached": P, "chunk": CHUNK, "wall_ms": round(wall * 1e3, 1), "gpu_ms": round(total / 1e3, 1),
         "groups_ms": {k: round(v / 1e3, 1) for k, v in sorted(groups.items(), key=lambda x: -x[1])},
         "attention_calls_ms": {k: round(v, 1) for k, v in attn.items()},
         "top_kernels": gpu_table(prof.key_averages(), rows=30)}
    log(f"[profile] 8k chunk after {P}: groups {r['groups_ms']}; attention by layer kind {r['attention_calls_ms']}")
    log(r["top_kernels"])
    del cache
    return r


def section_sparse(eng, a) -> dict:
    """Only the sparse prefill (fused form) at --sparse-at lengths, without the dense ladder before it: the 256k
    sparse prefill in a call of its own. An 8k sparse prefill first compiles and warms its kernels."""
    V, out = eng.config.vocab_size, {}
    warm = eng.new_cache(ENDS[0])
    prefill_once(eng, warm, torch.randint(0, V, (ENDS[0],), device=DEV), RULE)
    del warm
    for T in (int(x) for x in a.sparse_at.split(",")):
        try:
            cache = eng.new_cache(T)
            out[T] = prefill_once(eng, cache, torch.randint(0, V, (T,), device=DEV), RULE)
            out[T]["kv_cache_gib"] = kv_gib(cache)
            del cache
        except Exception as e:
            traceback.print_exc()
            out[T] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"[bf16] sparse prefill {T}: {out[T]}")
        free()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=450.0, help="seconds; a section starting later is skipped")
    ap.add_argument("--sections", default="topk,tiles,kernels,prefill,profile,q4")
    ap.add_argument("--max-context", type=int, default=262144)
    ap.add_argument("--sparse-256k", action="store_true", help="also the sparse prefill at 256k (slow)")
    ap.add_argument("--sparse-at", default="262144", help="the `sparse` section's prompt lengths (comma list)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    path = Path(a.json) if a.json else out_dir / "longctx.json"
    sections = set(a.sections.split(","))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rule": vars(RULE) | {}}

    def dump():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1, default=str))
        (path.parent / "longctx.txt").write_text("\n".join(LINES) + "\n")

    def run(name, fn):
        if name not in sections:
            return
        if left(a.budget) < 30:
            res[name] = "skipped: budget"
            return
        t = time.time()
        try:
            res[name] = fn()
        except Exception as e:
            traceback.print_exc()
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(f"[{name}] {time.time() - t:.1f}s")
        dump()

    cfg, dev = shapes(False)
    n_full = sum(not layer.is_sliding for layer in cfg.layers)
    run("topk", lambda: section_topk(lambda: left(a.budget), log, n_full))
    free()
    run("tiles", lambda: section_tiles(lambda: left(a.budget), log))
    free()
    if sections & {"prefill", "profile", "sparse"}:
        t = time.time()
        eng = build("bf16", cfg, dev, False)
        log(f"[bf16] built in {time.time() - t:.1f}s")
        run("prefill", lambda: section_engine(eng, a, "bf16"))
        run("profile", lambda: profile_chunk(eng, a))
        run("sparse", lambda: section_sparse(eng, a))
        del eng
        free()
    run("kernels", lambda: section_kernels(a))
    free()
    if "q4" in sections and left(a.budget) > 120:
        t = time.time()
        eng = build("q4", cfg, dev, False)
        log(f"[q4] built in {time.time() - t:.1f}s")
        a.max_context = min(a.max_context, 131072)
        run("q4", lambda: section_engine(eng, a, "q4"))
        del eng
        free()
    summary(res, n_full)
    dump()


def summary(res, n_full: int):
    log("\n== summary ==")
    pf = res.get("prefill", {}) if isinstance(res.get("prefill"), dict) else {}
    q4 = res.get("q4", {}) if isinstance(res.get("q4"), dict) else {}
    for T, r in (pf.get("prefill") or {}).items():
        q = (q4.get("prefill") or {}).get(T)
        log(f"prefill {T}: bf16 {r}" + (f" | q4 {q}" if q else ""))
    steps = pf.get("step") or {}
    for T, r in steps.items():
        log(f"step {T}: {r}")
    tk = res.get("topk") if isinstance(res.get("topk"), dict) else {}
    big = tk.get(131072) if isinstance(tk.get(131072), dict) else None
    if isinstance(steps.get(131072), dict) and isinstance(steps.get(SHORT), dict):
        s1, s128 = steps[SHORT]["dense_ms"], steps[131072]["dense_ms"]
        # a full layer's dense canvas attention: the topk section's kernel time, else the step's growth per layer
        call = big["dense_tiles_ms"] if big else round((s128 - s1) / n_full, 3)
        res["bar"] = bar_arithmetic(call, 131072, n_full, copy_gbps(), s1, s128)
        log(f"the 0.75x bar at 128k from the steps: {res['bar']}")
    for T, r in (tk or {}).items():
        log(f"topk {T}: {r}")
    tl_ = res.get("tiles") if isinstance(res.get("tiles"), dict) else {}
    if tl_.get("table"):
        log("LONG_CAUSAL_TILES rows:\n" + "\n".join(tl_["table"]))
    for T, r in (pf.get("sparse_prefill") or {}).items():
        log(f"sparse prefill {T}: {r}")
    kern = res.get("kernels", {}) if isinstance(res.get("kernels"), dict) else {}
    for end, r in (kern.get("causal_full") or {}).items():
        if isinstance(r, dict):
            ms = {k: (v.get("ms") if isinstance(v, dict) else v) for k, v in r.items() if k not in ("queries", "keys")}
            log(f"causal hd512 chunk ending {end}: {ms}")
    pr = res.get("profile")
    if isinstance(pr, dict):
        log(f"profile: {pr.get('groups_ms')} attention {pr.get('attention_calls_ms')}")


if __name__ == "__main__":
    main()
