"""FP8 engine check: availability, kernels vs twins, GEMM timings FP8 vs bf16, and the full-size denoise step.

    PYTHONPATH=src:. python -m bench.fp8_check [--out DIR] [--reps 20] [--skip kernels,gemms,engine,demo,memory]
    PYTHONPATH=src:. python -m bench.fp8_check --sections profile [--profile-kinds fp8,bf16]
    python bench/fp8_check.py ...                             # the same
    PYTHONPATH=src:. python -m bench.fp8_check --tiny     # the demo model's shapes on the CPU: a dry run

One command, each section in try/except (a failing section prints its traceback, records its error and the next
one runs); DIR/fp8_check.json is rewritten after each section and DIR/fp8_check.txt summarises at the end
(DIR: --out, else $OUT, else the working directory). Shapes are the full-size model's (bench/bench_engine.TEXT:
hidden 2816, 128 experts top-8 of F 704, dense 2112, 16 heads, sliding hd 256 / 8 KV, full hd 512 / 2 KV,
vocab 262144, canvas 256).

  env      torch / device, FP8 tensor cores, torch._scaled_mm and torch._scaled_grouped_mm availability
  kernels  at the real shapes: per-row quantization kernel vs twin (bits); torch._scaled_mm and the Triton FP8
           linear vs the twin per linear, their rows alone vs inside 2048 (bits), the Triton one across tiles;
           the grouped FP8 kernel and torch._scaled_grouped_mm vs the twin (gate_up, down); batch invariance:
           a lane's 256 rows alone vs inside 2048 (_scaled_mm; the grouped kernel with its routes), the grouped
           kernel's row tile (BM 32 vs 64), the kernel vs torch._scaled_grouped_mm bit for bit
  gemms    µs per call (CUDA-graph replay) at 256 rows (B=1) and 2048 (B=8): bf16 cuBLAS vs FP8 _scaled_mm (with
           and without the activation quantization) and the Triton FP8 linear (a few tiles) per linear family; the
           expert GEMMs: bf16 torch._grouped_mm and
           the bf16 streaming kernel vs FP8 torch._scaled_grouped_mm and the FP8 kernel (a few tile configs),
           balanced routes
  engine   random full-size weights, balanced routing, 1k context: denoise step B=1 and batched B=8 forward for
           bf16, fp8 (the same weights quantized per row) and q4 (random q4 records: timing only); fp8 with the
           expert GEMMs forced to torch._scaled_grouped_mm (DIFFGEMMA_EXPERT_GEMM=cutlass) as an A/B, and with the
           linears on the Triton FP8 GEMM (ops/fp8_linear.KERNEL = "triton", its lanes' bits too); with the
           model's own routing: FP8 vs bf16 logits (softcapped) cosine and argmax agreement, and the FP8 lanes of a
           batched denoise vs their solo denoise (bit-identical count); B prompts of 1k tokens into empty caches,
           one after another (each its own graphed prefill) against one prefill_batch forward (ms, and how many
           caches the batch writes with their solo bits), every kind
  demo     the embedded demo model (real weights): bf16 vs its FP8 form (Fp8QuantizedSource), 8 chat prompts' tokens
  memory   fp8, 8 lanes of 8k context, one batched step: peak allocated GiB (skipped when the time budget is spent)
  profile  (only when --sections names it) per --profile-kinds engine: the graphed B=8 forward's median ms and the
           eager one's GPU kernel time by op class (expert GEMMs, linears, attention, quant / norm epilogues,
           routing, glue) from torch.profiler, and its top kernels; the same for a batched prefill of 8 1k
           prompts (bench/fp8_profile.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

# run as `python bench/fp8_check.py` too: this checkout's root (bench.*) and src/ (diffgemma) come first
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("src", "")]

from bench.bench_batch import lanes, timed
from bench.fp8_profile import section_profile
from bench.runner import build, log, shapes, sync
from diffgemma.model.engine import build_engine
from diffgemma.model.engine_weights import DictSource, Fp8QuantizedSource
from diffgemma.ops import fp8_linear, fp8_moe, fp8_quant, moe_stream
from diffgemma.ops.fp8_weight import has_fp8_mma, has_scaled_grouped_mm, probe_scaled_grouped_mm, quantize_fp8
from diffgemma.ops.grouped import grouped_mm_torch

BF16 = torch.bfloat16
DEFAULT_SECTIONS = ("env", "kernels", "gemms", "engine", "demo", "memory")
BUDGET_S = 400  # the demo and memory sections run only if this much time has not yet passed
ENGINE_BUDGET_S = 360  # the same for each engine kind after the first two (q4: timing only)
T0 = time.time()


def med(xs):
    return round(statistics.median(xs), 2)


def rel(a, b):
    return float(f"{((a.float() - b.float()).norm() / b.float().norm()).item():.3g}")


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                              b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


def linear_shapes(cfg) -> dict:
    """(N, K) of each linear family, from the config."""
    H, nh = cfg.hidden_size, cfg.num_heads
    slide = next(l for l in cfg.layers if l.is_sliding)
    full = next(l for l in cfg.layers if not l.is_sliding)
    return {"qkv_sliding": ((nh + 2 * slide.num_kv_heads) * slide.head_dim, H),
            "qkv_full": ((nh + full.num_kv_heads) * full.head_dim, H),
            "o_sliding": (H, nh * slide.head_dim), "o_full": (H, nh * full.head_dim),
            "dense_gate_up": (2 * cfg.intermediate_size, H), "dense_down": (H, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, H)}


def expert_shapes(cfg) -> dict:
    E, H, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {"experts_gate_up": (E, 2 * F, H), "experts_down": (E, H, F)}


def plan(experts: torch.Tensor, E: int):
    """(src, offs, order) of routes [T, k] grouped by expert, stable."""
    k = experts.shape[1]
    order = torch.argsort(experts.reshape(-1), stable=True)
    offs = torch.cumsum(torch.bincount(experts.reshape(-1), minlength=E), 0).to(torch.int32)
    return order // k, offs, order


def random_routes(T, k, E, dev, gen):
    return torch.rand(T, E, device=dev, generator=gen).topk(k, dim=-1).indices


def balanced_routes(T, k, E, dev):
    return (torch.arange(T * k, device=dev) % E).view(T, k)


def section_env(dev):
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "has_scaled_mm": hasattr(torch, "_scaled_mm"), "has_scaled_grouped_mm_attr": hasattr(torch, "_scaled_grouped_mm")}
    if dev.type == "cuda":
        out["capability"] = list(torch.cuda.get_device_capability(dev))
        out["fp8_mma"] = has_fp8_mma(dev)
        out["scaled_grouped_mm_runs"] = has_scaled_grouped_mm(dev)
        try:
            probe_scaled_grouped_mm(dev)
        except Exception as e:  # why it does not run, for the record
            out["scaled_grouped_mm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        import triton
        out["triton"] = triton.__version__
    return out


def check_linear(N, K, dev, gen):
    w = quantize_fp8(torch.randn(N, K, device=dev, generator=gen) * 0.02)
    x = torch.randn(2048, K, device=dev, generator=gen).to(BF16)
    fast = fp8_linear.fp8_linear_scaled_mm(x, w)
    r = {"rel_vs_twin": rel(fast, fp8_linear.fp8_linear_ref(x, w)),
         "rel_vs_bf16_weights": rel(fast, x @ w.dequantize(BF16).T)}
    for lo, n in ((0, 256), (768, 256), (1792, 256), (0, 512)):
        r[f"rows_{lo}+{n}_alone_bits_equal"] = bits_equal(fp8_linear.fp8_linear_scaled_mm(x[lo:lo + n], w),
                                                          fast[lo:lo + n])
    q, s = fp8_quant.quantize_rows(x)
    tri = fp8_linear.fp8_linear_triton(q, s, w)
    r["triton_rel_vs_twin"] = rel(tri, fp8_linear.fp8_linear_ref(x, w))
    r["triton_rows_768+256_alone_bits_equal"] = bits_equal(fp8_linear.fp8_linear_triton(q[768:1024], s[768:1024], w),
                                                           tri[768:1024])
    r["triton_config_128x128_bits_equal"] = bits_equal(fp8_linear.fp8_linear_triton(q, s, w,
                                                                                    config=(128, 128, 128, 8, 3)), tri)
    r["triton_vs_scaled_mm_share_bits_equal"] = round((tri == fast).float().mean().item(), 4)
    return r


def unpermute(y, order):
    out = torch.empty_like(y)
    out[order] = y
    return out


def check_grouped(shape, dev, gen, grouped_ok):
    E, N, K = shape
    w = quantize_fp8(torch.randn(shape, device=dev, generator=gen) * 0.02)
    out = {}
    for T in (256, 2048):
        experts = random_routes(T, 8, E, dev, gen)
        src, offs, order = plan(experts, E)
        q, s = fp8_quant.quantize_rows(torch.randn(T, K, device=dev, generator=gen).to(BF16))
        ref = fp8_moe.grouped_mm_fp8_ref(q, s, w, offs, src=src)
        tri = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src)
        r = out[T] = {"triton_rel_vs_twin": rel(tri, ref)}
        BN, _, BK, warps, stages = fp8_moe.pick_config(T * 8, E, K)
        a = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src, config=(BN, 32, BK, warps, stages))
        b = fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src, config=(BN, 64, BK, warps, stages))
        r["triton_bm32_bm64_bits_equal"] = bits_equal(a, b)
        for imp in (0, None):  # promote after every MMA / never (fast accumulation) vs the default (every K tile)
            r[f"triton_imprecise_{imp}_rel_vs_twin"] = rel(
                fp8_moe.grouped_mm_fp8_triton(q, s, w, offs, src=src, imprecise=imp), ref)
        if grouped_ok:
            tor = fp8_moe.grouped_mm_fp8_torch(q, s, w, offs, src=src)
            r["torch_rel_vs_twin"] = rel(tor, ref)
            r["triton_vs_torch_share_bits_equal"] = round((tri == tor).float().mean().item(), 4)
        if T == 2048:  # lane 0 (tokens 0..255) alone vs inside the 2048
            full = unpermute(tri, order)
            src1, offs1, order1 = plan(experts[:256], E)
            lane = unpermute(fp8_moe.grouped_mm_fp8_triton(q[:256], s[:256], w, offs1, src=src1), order1)
            r["triton_lane_alone_bits_equal"] = bits_equal(lane, full[:256 * 8])
    return out


def section_kernels(cfg, dev):
    if dev.type != "cuda":
        return {"skipped": "no CUDA"}
    gen = torch.Generator(device=dev).manual_seed(0)
    out = {"quantize": {}}
    for M, K in ((2048, cfg.hidden_size), (256, linear_shapes(cfg)["o_full"][1])):
        x = (torch.randn(M, K, device=dev, generator=gen) * 3).to(BF16)
        q, s = fp8_quant.quantize_rows_triton(x)
        qr, sr = fp8_quant.quantize_rows_ref(x)
        out["quantize"][f"{M}x{K}"] = {"values_bits_equal": bits_equal(q, qr), "scales_equal": torch.equal(s, sr)}
    from diffgemma.ops.gelu_mul import gelu_mul_triton
    gu = (torch.randn(16384, 2 * cfg.moe_intermediate_size, device=dev, generator=gen) * 2).to(BF16)
    q, s = fp8_quant.gelu_mul_quant_triton(gu)
    q2, s2 = fp8_quant.quantize_rows_triton(gelu_mul_triton(gu))
    out["gelu_mul_quant_bits_equal_two_steps"] = bits_equal(q, q2) and torch.equal(s, s2)
    for name, (N, K) in linear_shapes(cfg).items():
        try:
            out[name] = check_linear(N, K, dev, gen)
        except Exception as e:
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {name}: {out[name]}")
    grouped_ok = has_scaled_grouped_mm(dev)
    for name, shape in expert_shapes(cfg).items():
        try:
            out[name] = check_grouped(shape, dev, gen, grouped_ok)
        except Exception as e:
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {name}: {out[name]}")
    return out


def graph_us(fn, reps):
    from bench.bench_engine import time_graph
    try:
        return med(time_graph(fn, 1, reps))
    except Exception as e:
        traceback.print_exc()
        return f"{type(e).__name__}: {str(e)[:200]}"


def time_linear(N, K, dev, gen, reps):
    w = torch.randn(N, K, device=dev, generator=gen).to(BF16) * 0.02
    w8 = quantize_fp8(w)
    out = {}
    for M in (256, 2048):
        x = torch.randn(M, K, device=dev, generator=gen).to(BF16)
        q, s = fp8_quant.quantize_rows(x)
        r = out[M] = {"bf16_us": graph_us(lambda: x @ w.T, reps),
                      "fp8_us": graph_us(lambda: fp8_linear.fp8_linear_scaled_mm(x, w8), reps),
                      "fp8_gemm_only_us": graph_us(lambda: torch._scaled_mm(q, w8.weight.T, scale_a=s[:, None],
                                                                            scale_b=w8.scale[None, :], out_dtype=BF16),
                                                   reps),
                      "quantize_us": graph_us(lambda: fp8_quant.quantize_rows(x), reps)}
        for c in LINEAR_CONFIGS:
            r[f"fp8_triton_{'_'.join(map(str, c))}_us"] = graph_us(
                lambda: fp8_linear.fp8_linear_triton(q, s, w8, config=c), reps)
        if isinstance(r["bf16_us"], float) and isinstance(r["fp8_us"], float):
            r["fp8_speedup"] = round(r["bf16_us"] / r["fp8_us"], 3)
    return out


LINEAR_CONFIGS = [fp8_linear.CONFIG, (128, 128, 128, 8, 3), (64, 256, 128, 8, 3)]
TRITON_CONFIGS = [(64, 32, 128, 4, 4), (128, 32, 128, 8, 4), (64, 32, 256, 4, 3), (128, 64, 128, 8, 3)]


def time_grouped(shape, dev, gen, reps, grouped_ok):
    E, N, K = shape
    w = torch.randn(shape, device=dev, generator=gen).to(BF16) * 0.02
    w8 = quantize_fp8(w)
    out = {}
    for T in (256, 2048):
        src, offs, _ = plan(balanced_routes(T, 8, E, dev), E)
        x = torch.randn(T, K, device=dev, generator=gen).to(BF16)
        xs = x.index_select(0, src)
        q, s = fp8_quant.quantize_rows(x)
        r = out[T * 8] = {"bf16_torch_us": graph_us(lambda: grouped_mm_torch(xs, w, offs), reps),
                          "bf16_stream_us": graph_us(lambda: moe_stream.grouped_mm_triton(x, w, offs, src=src), reps),
                          "fp8_triton_default_us": graph_us(lambda: fp8_moe.grouped_mm_fp8_triton(q, s, w8, offs,
                                                                                                  src=src), reps)}
        if grouped_ok:
            r["fp8_torch_us"] = graph_us(lambda: fp8_moe.grouped_mm_fp8_torch(q, s, w8, offs, src=src), reps)
        r["fp8_triton_fast_accum_us"] = graph_us(lambda: fp8_moe.grouped_mm_fp8_triton(q, s, w8, offs, src=src,
                                                                                       imprecise=None), reps)
        for cfg_ in TRITON_CONFIGS:
            r[f"fp8_triton_{'_'.join(map(str, cfg_))}_us"] = graph_us(
                lambda: fp8_moe.grouped_mm_fp8_triton(q, s, w8, offs, src=src, config=cfg_), reps)
        log(f"    {shape} routes {T * 8}: {r}")
    return out


def section_gemms(cfg, dev, reps):
    if dev.type != "cuda":
        return {"skipped": "no CUDA"}
    gen = torch.Generator(device=dev).manual_seed(1)
    out = {}
    for name, (N, K) in linear_shapes(cfg).items():
        try:
            out[name] = time_linear(N, K, dev, gen, reps)
        except Exception as e:
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {name}: {out[name]}")
        torch.cuda.empty_cache()
    grouped_ok = has_scaled_grouped_mm(dev)
    for name, shape in expert_shapes(cfg).items():
        try:
            out[name] = time_grouped(shape, dev, gen, reps, grouped_ok)
        except Exception as e:
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        torch.cuda.empty_cache()
    return out


def softcapped(eng, raw):
    cap = eng.logit_softcap
    return (cap * torch.tanh(raw.float() / cap)).cpu()


def engine_timings(eng, cfg, dev, reps, ctx, B):
    from bench.balanced_routing import routing
    with routing("balanced"):
        caches, canvases, scs = lanes(eng, cfg, B, ctx)
        t1 = timed(dev, lambda: eng.denoise_raw(caches[0], canvases[0], sc_embeds=scs[0]), reps)
        tb = timed(dev, lambda: eng.denoise_batch_raw(caches, canvases, sc_embeds=scs), reps)
    eng.clear_graphs()
    C = cfg.canvas_length
    return {"B1_ms": t1, f"B{B}_ms": tb, "B1_rows_s": round(C / t1 * 1e3, 1), f"B{B}_rows_s": round(B * C / tb * 1e3, 1)}


def engine_logits(eng, cfg, ctx, B):
    """Model routing: each lane's solo softcapped logits, and how many lanes a batched forward gives the same bits."""
    from bench.balanced_routing import routing
    with routing("model"):
        caches, canvases, scs = lanes(eng, cfg, B, ctx, seed=5)
        solo = [eng.denoise_raw(c, x, sc_embeds=s).clone() for c, x, s in zip(caches, canvases, scs)]
        eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)  # the first batched round runs eagerly
        got = eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)
        same = sum(torch.equal(g, x) for g, x in zip(got, solo))
    eng.clear_graphs()
    return [softcapped(eng, x) for x in solo[:2]], f"{same}/{B}"


def engine_prefills(eng, cfg, ctx, B, reps):
    """B prompts of ctx tokens into B empty caches: one after another (each its own graphed prefill) against one
    prefill_batch forward, ms (median of reps, host clock around a synchronized call), under balanced routing as the
    step timings (the random routers would send most rows to a few experts); and how many caches the batch writes
    with the bits of their solo prefill."""
    from bench.balanced_routing import routing
    from diffgemma.slots import rewind
    dev = eng.device
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (ctx,), generator=gen).to(dev) for _ in range(B)]
    caches = [eng.new_cache(ctx + 2 * cfg.canvas_length) for _ in range(B)]
    runs = {"solo": lambda: [eng.prefill(c, p) for c, p in zip(caches, prompts)],
            "batch": lambda: eng.prefill_batch(caches, prompts)}
    times: dict = {name: [] for name in runs}
    kv = {}
    with routing("balanced"):
        for rep in range(reps + 2):  # the first round warms up (the solo graphs' capture), the last keeps the K/V
            for name, fn in runs.items():
                for c in caches:
                    rewind(c, 0)
                sync(dev)
                t = time.perf_counter()
                fn()
                sync(dev)
                if 0 < rep <= reps:
                    times[name].append((time.perf_counter() - t) * 1e3)
                kv[name] = [[t.clone() for t in c.live_kv()] for c in caches] if rep > reps else None
    same = sum(all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(kv["solo"], kv["batch"]))
    eng.clear_graphs()
    return {f"prefill_{B}x{ctx}_solo_ms": med(times["solo"]), f"prefill_{B}x{ctx}_batch_ms": med(times["batch"]),
            "prefill_lanes_bit_identical": f"{same}/{B}"}


def fidelity(logits, base) -> dict:
    a, b = torch.cat(logits), torch.cat(base)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {"cosine_mean": round(cos.mean().item(), 5), "cosine_min": round(cos.min().item(), 5),
            "argmax_agreement": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)}


def section_engine(cfg, dev, tiny, reps, res, dump):
    ctx, B = (64, 4) if tiny else (1024, 8)
    out = res["engine"] = {}
    base = None
    for kind in ("bf16", "fp8", "q4"):
        r = out[kind] = {}
        if kind == "q4" and time.time() - T0 > ENGINE_BUDGET_S:
            r["skipped"] = f"time budget ({ENGINE_BUDGET_S} s) spent"
            continue
        try:
            t = time.time()
            eng = build(kind, cfg, dev, tiny)
            sync(dev)
            r["build_s"] = round(time.time() - t, 1)
            r.update(engine_timings(eng, cfg, dev, reps, ctx, B))
            r.update(engine_prefills(eng, cfg, ctx, B, max(3, reps // 4)))
            r["graph_error"] = eng.graph_error
            log(f"  [{kind}] {r}")
            if kind == "fp8" and dev.type == "cuda":
                os.environ["DIFFGEMMA_EXPERT_GEMM"] = "cutlass"
                try:
                    r["experts_torch_grouped"] = engine_timings(eng, cfg, dev, reps, ctx, B)
                finally:
                    del os.environ["DIFFGEMMA_EXPERT_GEMM"]
                fp8_linear.KERNEL = "triton"
                try:
                    r["linears_triton"] = engine_timings(eng, cfg, dev, reps, ctx, B)
                    r["linears_triton"]["lanes_bit_identical"] = engine_logits(eng, cfg, ctx, B)[1]
                finally:
                    fp8_linear.KERNEL = "scaled_mm"
            if kind != "q4":
                logits, r["lanes_bit_identical"] = engine_logits(eng, cfg, ctx, B)
                if kind == "bf16":
                    base = logits
                elif base is not None:
                    r["vs_bf16"] = fidelity(logits, base)
            log(f"  [{kind}] {r}")
        except Exception as e:
            traceback.print_exc()
            r["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        finally:
            eng = None
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        dump()
    b, f, q = out.get("bf16", {}), out.get("fp8", {}), out.get("q4", {})
    ratios = {}
    for key, (num, den) in {"fp8_B1_over_bf16_B1": (f.get("B1_ms"), b.get("B1_ms")),
                            f"fp8_B{B}_over_bf16_B{B}": (f.get(f"B{B}_ms"), b.get(f"B{B}_ms")),
                            f"fp8_B{B}_rows_s_over_q4_B1_rows_s": (f.get(f"B{B}_rows_s"), q.get("B1_rows_s"))}.items():
        if num and den:
            ratios[key] = round(num / den, 3)
    out["ratios"] = ratios
    return None


DEMO_QUESTIONS = ("Name a colour.", "What is 2+2?", "Say hi.", "What is the capital of France?",
                  "Count to five.", "Give me a word that rhymes with cat.", "What day comes after Monday?",
                  "Is the sun a star?")


def section_demo(dev):
    """The embedded demo model (real weights), bf16 vs its FP8 form (weights quantized per row): each chat prompt's
    generated tokens, the share identical, and the replies."""
    import diffgemma
    if time.time() - T0 > BUDGET_S:
        return {"skipped": f"time budget ({BUDGET_S} s) spent"}
    demo = diffgemma.load(device="cpu")
    tok = demo.tokenizer
    kw = dict(generation_config=demo.generation_config, tokenizer=tok)
    dtype = BF16 if dev.type == "cuda" else torch.float32
    engines = {"bf16": build_engine(demo.config, DictSource(demo.w), dev, dtype, **kw),
               "fp8": build_engine(demo.config, Fp8QuantizedSource(DictSource(demo.w)), dev, dtype, **kw)}
    replies = {k: [] for k in engines}
    for q in DEMO_QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}])
        for k, eng in engines.items():
            replies[k].append(diffgemma.generate(eng, ids, seed=0, max_new_tokens=64).tokens)
    same = sum(a == b for a, b in zip(replies["bf16"], replies["fp8"]))
    return {"token_identical": f"{same}/{len(DEMO_QUESTIONS)}",
            "replies": {k: [tok.decode(t) for t in v] for k, v in replies.items()}}


def section_memory(cfg, dev, tiny):
    if dev.type != "cuda" or tiny:
        return {"skipped": "cpu"}
    if time.time() - T0 > BUDGET_S:
        return {"skipped": f"time budget ({BUDGET_S} s) spent"}
    eng = build("fp8", cfg, dev, False)
    try:
        torch.cuda.reset_peak_memory_stats(dev)
        caches, canvases, scs = lanes(eng, cfg, 8, 8192, seed=4)
        eng.denoise_batch_raw(caches, canvases, sc_embeds=scs)
        sync(dev)
        return {"B": 8, "ctx": 8192, "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)}
    finally:
        eng = None
        gc.collect()
        torch.cuda.empty_cache()


def summary(res) -> str:
    env = res.get("env", {})
    lines = [f"fp8_check  device={env.get('device')}  torch={env.get('torch')}", f"env: {json.dumps(env)}"]
    for name, by_rows in res.get("gemms", {}).items():
        if not isinstance(by_rows, dict) or "error" in by_rows:
            lines.append(f"gemm {name}: {by_rows}")
            continue
        for rows, r in by_rows.items():
            lines.append(f"gemm {name} rows={rows}: " + ", ".join(f"{k}={v}" for k, v in r.items()))
    for name, r in res.get("kernels", {}).items():
        lines.append(f"check {name}: {json.dumps(r)}")
    for kind, r in res.get("engine", {}).items():
        lines.append(f"engine {kind}: {json.dumps(r)}")
    lines.append(f"demo: {json.dumps(res.get('demo'))}")
    lines.append(f"memory: {json.dumps(res.get('memory'))}")
    def no_tops(r):
        return {k: no_tops(v) if isinstance(v, dict) else v for k, v in r.items() if k != "top_kernels"}

    for kind, r in (res.get("profile") or {}).items():
        lines.append(f"profile {kind}: " + (json.dumps(no_tops(r)) if isinstance(r, dict) else str(r)))
    lines += [f"{k}: {v}" for k, v in res.items() if k.endswith("_error")]
    lines.append(f"total {time.time() - T0:.0f} s")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip", default="")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma list of {DEFAULT_SECTIONS + ('profile',)}")
    p.add_argument("--profile-kinds", default="fp8,bf16")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    cfg, dev = shapes(a.tiny)
    skip = set(filter(None, a.skip.split(",")))
    wanted = set(filter(None, a.sections.split(",")))
    bad = wanted - set(DEFAULT_SECTIONS + ("profile",))
    if bad:
        raise SystemExit(f"--sections: unknown {sorted(bad)}; expected a comma list of {DEFAULT_SECTIONS + ('profile',)}")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {}

    def dump():
        (out_dir / "fp8_check.json").write_text(json.dumps(res, indent=1, default=str))

    sections = [("env", lambda: section_env(dev)), ("kernels", lambda: section_kernels(cfg, dev)),
                ("gemms", lambda: section_gemms(cfg, dev, a.reps)),
                ("engine", lambda: section_engine(cfg, dev, a.tiny, a.reps, res, dump)),
                ("demo", lambda: section_demo(dev)),
                ("memory", lambda: section_memory(cfg, dev, a.tiny)),
                ("profile", lambda: section_profile(cfg, dev, a.profile_kinds.split(","), build))]
    for name, fn in sections:
        if name in skip or name not in wanted:
            continue
        t = time.time()
        log(f"== {name}")
        try:
            value = fn()
            if value is not None:
                res[name] = value
        except Exception as e:
            traceback.print_exc()
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(f"== {name}: {time.time() - t:.1f}s")
        dump()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    text = summary(res)
    (out_dir / "fp8_check.txt").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
