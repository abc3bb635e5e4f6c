"""Benchmark: the fast engine on q4-packed experts at DiffusionGemma's full size, one GPU, one run.

    PYTHONPATH=src python -m bench.bench_pack [--reps 30] [--json out.json]

Builds the real shapes (bench_engine.py's TEXT) on the GPU with bench_engine's random non-expert
weights (RandomSource) and random q4 expert records + q8 SC records generated directly in the pack
layout on the device (bench.fixtures.RandomPackSource: quantizing 51 GB would not fit the run), then:
  engine  pack bytes (what a q4 pack of these tensors holds, the vision tower aside); GPU memory with an
          8k context (after an 8k prefill and a graphed denoise on it, with only what such a session holds:
          the weights, the 8k cache and its graph; the 1k case's cache and graph are gone by then);
          denoise ms/step at 1k context
          (CUDA-graph replays, median, CUDA events; SC from logits, and from SC embeddings: generate()'s call); prefill tok/s at 8k (one 8192-token
          chunk, median of 3) with both prefill strategies (dequant-to-bf16 + grouped GEMM / in-kernel);
          last, denoise at 1k alternating (same weights): the step as generate calls it with the q4 expert GEMMs,
          with a kernel that only reads their planes in their place, and with no expert GEMM (how far a faster
          expert GEMM could take the step: `floor`); the launch order on / off; the q4 GEMMs' planes through
          TMA or cp.async and their inputs as f16 operands or bf16; the expert stacks in the pack's own order
          against ops/moe_q4.py's tile layout.
  kernels the expert GEMMs alone (graph-timed: 20 calls a replay) at the denoise shape (256 tokens x top-8 = 2048 routes) and at the
          prefill shape (8192 x 8): q4 kernel configs (and at denoise the q4-tiles kernel) vs torch._grouped_mm
          on bf16 weights, and at the denoise shape the bf16 streaming kernel (ops/moe_stream.py) configs on the
          same bf16 weights.
  gather  the engine's gate_up call at the denoise shape (GEMM, then gelu_mul; graph-timed), bf16 and q4: the routes' rows
          gathered by index_select first, or by the kernel's own loads through the routes' token ids.
  bf16    the same engine with every expert stack dequantized to bf16 (same weights): denoise at 1k, prefill
          at 8k, and the logits agreement q4 vs bf16 on one step (each model prefills the same 1k prompt
          into its own cache).
Sections run in that order and the JSON is rewritten after each, so a time-out keeps what finished.
The engine sections run with balanced expert routing unless `--routing model` (see balanced_routing.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.balanced_routing import KINDS, routing
from bench.bench_engine import CANVAS, TEXT, generate_forward, profile_fn, time_cuda, time_graph, weight_bytes
from bench.fixtures import RandomPackSource, random_record
from diffgemma.checkpoint import expected_tensors
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine
from diffgemma.ops import moe
from diffgemma.ops import moe_packed as mp
from diffgemma.ops import moe_q4
from diffgemma.ops import moe_stream
from diffgemma.ops.grouped import grouped_mm_torch as _grouped_mm
from diffgemma.ops.moe_plan import moe_plan
from diffgemma.ops._backend import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

BW = 4.3e12  # device-to-device copy bandwidth measured on an H200 (bytes read + written per second)
GiB = 2**30


def log(*a):
    print(*a, flush=True)


def med(fn, reps=20, warmup=3, setup=None) -> float:
    return statistics.median(time_cuda(fn, reps=reps, warmup=warmup, setup=setup))


def gmed(fn, reps=7, calls=20) -> float:
    """ms a call, replayed from a CUDA graph of `calls` back-to-back calls. A kernel of ~0.1 ms timed one launch at
    a time measures the host's launch instead."""
    return statistics.median(time_graph(lambda: [fn() for _ in range(calls)], calls, reps)) / 1e3


def bench_engine_q4(res, eng, cfg, reps, skip=frozenset()):
    V = cfg.vocab_size
    r = res.setdefault("engine_q4", {})
    # warm-up: compile every kernel once (prefill of a small prompt, one denoise)
    c0 = eng.new_cache(2048)
    eng.prefill(c0, torch.randint(0, V, (1024,), device="cuda"))
    eng.denoise(c0, torch.randint(0, V, (CANVAS,), device="cuda"))
    del c0
    torch.cuda.synchronize()
    # denoise at 1k
    cache = eng.new_cache(1024)
    prompt_1k = torch.randint(0, V, (1024,), device="cuda")
    eng.prefill(cache, prompt_1k)
    ids = torch.randint(0, V, (CANVAS,), device="cuda")
    sc = torch.randn(CANVAS, V, device="cuda") * 3
    eng.denoise(cache, ids, sc_logits=sc)  # capture
    t = time_cuda(lambda: eng.denoise(cache, ids, sc_logits=sc), reps=reps, warmup=3)
    r["denoise_1k_ms"], r["denoise_1k_min_ms"] = statistics.median(t), min(t)
    r["graph_error"] = eng.graph_error
    log(f"[q4] denoise 1k: {r['denoise_1k_ms']:.3f} ms median (min {r['denoise_1k_min_ms']:.3f}) graph_error={eng.graph_error}")
    # generate()'s call with the default sparse SC: the soft embedding comes in, made outside the forward, and the
    # raw logits go out (denoise_raw: the sampler's kernels softcap them as they read); its inputs staged into the
    # graph beforehand, as generate does (bench_engine.py says why), and once unstaged for comparison
    emb = torch.randn(CANVAS, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    step = generate_forward(eng)
    step(cache, ids, sc_embeds=emb)  # capture
    t = time_cuda(lambda: step(cache, ids, sc_embeds=emb), reps=reps, warmup=3,
                  setup=lambda: eng.stage_denoise(cache, ids, sc_embeds=emb))
    r["denoise_1k_embeds_ms"], r["denoise_1k_embeds_min_ms"] = statistics.median(t), min(t)
    r["denoise_1k_embeds_unstaged_ms"] = med(lambda: step(cache, ids, sc_embeds=emb), reps=reps, warmup=1)
    log(f"[q4] denoise 1k from SC embeds: {r['denoise_1k_embeds_ms']:.3f} ms median (min {r['denoise_1k_embeds_min_ms']:.3f}),"
        f" unstaged {r['denoise_1k_embeds_unstaged_ms']:.3f}")
    del emb
    # the bf16 section compares its logits with these on the same prompt (each model prefills its own cache)
    res["_q4_logits"] = eng.denoise(cache, ids, sc_logits=sc).cpu()
    res["_q4_case"] = (prompt_1k.cpu(), ids.cpu(), sc.cpu())  # kept off the GPU: the memory measures below
    eng.use_graphs = False
    r["denoise_1k_eager_ms"] = med(lambda: eng.denoise(cache, ids, sc_logits=sc), reps=3, warmup=1)
    r["profile_denoise_1k"] = profile_fn(lambda: eng.denoise(cache, ids, sc_logits=sc))
    log(r["profile_denoise_1k"])
    eng.use_graphs = True
    # prefill 8k and memory with an 8k context: what a session at 8k holds (weights, its cache, its graph),
    # so the 1k cache and its graph go first
    del cache
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    c8 = eng.new_cache(8192)
    prompt = torch.randint(0, V, (8192,), device="cuda")

    def do_prefill():
        c8.truncate(0)
        eng.prefill(c8, prompt)

    for strategy, n in (("dequant", 3), ("kernel", 2)):
        os.environ["DIFFGEMMA_PACKED_PREFILL"] = strategy
        try:
            ms = med(do_prefill, reps=n, warmup=1)
            r[f"prefill_8k_{strategy}_tok_s"] = 8192 / (ms / 1e3)
            r[f"prefill_8k_{strategy}_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            log(f"[q4] prefill 8k ({strategy}): {r[f'prefill_8k_{strategy}_tok_s']:.0f} tok/s, "
                f"peak {r[f'prefill_8k_{strategy}_peak_gib']:.2f} GiB")
        except Exception as e:
            r[f"prefill_8k_{strategy}_tok_s"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"[q4] prefill 8k ({strategy}) failed: {r[f'prefill_8k_{strategy}_tok_s']}")
        torch.cuda.reset_peak_memory_stats()
    os.environ["DIFFGEMMA_PACKED_PREFILL"] = "dequant"
    do_prefill()
    ids8 = torch.randint(0, V, (CANVAS,), device="cuda")
    eng.denoise(c8, ids8, sc_logits=sc)  # capture at the 8k bucket
    r["denoise_8k_ms"] = med(lambda: eng.denoise(c8, ids8, sc_logits=sc), reps=reps)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    r["mem_8k_allocated_gib"] = torch.cuda.memory_allocated() / GiB
    r["mem_8k_reserved_gib"] = torch.cuda.memory_reserved() / GiB
    r["mem_8k_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB  # since the last prefill
    r["mem_8k_device_used_gib"] = (total - free) / GiB
    log(f"[q4] 8k context: denoise {r['denoise_8k_ms']:.3f} ms; allocated {r['mem_8k_allocated_gib']:.2f} GiB, "
        f"reserved {r['mem_8k_reserved_gib']:.2f}, peak {r['mem_8k_peak_allocated_gib']:.2f}, "
        f"device used {r['mem_8k_device_used_gib']:.2f} GiB")
    del c8, sc, ids, ids8
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    bench_session_8k(r, eng, V)
    if eng.w.layers[0].experts_gu.layout == moe_q4.LAYOUT:  # last, so re-laying never touches the memory measures
        for name, fn in (("floor", bench_floor), ("launch_order", bench_launch_order), ("q4_inputs", bench_q4_inputs),
                         ("glu", bench_glu), ("layouts", bench_layouts)):
            if name not in skip:
                fn(r, eng, V, reps)


def alternate_denoise_1k(eng, V, reps, variants: dict, as_generate: bool = False) -> dict:
    """Denoise at 1k under each of `variants` (name -> a function that sets the engine up), twice in turn, on
    the same weights and inputs, each captured afresh -> {name: [ms, ms]}. as_generate: the step as generate()
    calls it (SC embeddings in, raw logits out, inputs staged beforehand), else from SC logits."""
    cache = eng.new_cache(1024)
    eng.prefill(cache, torch.randint(0, V, (1024,), device="cuda"))
    ids = torch.randint(0, V, (CANVAS,), device="cuda")
    if as_generate:
        emb = torch.randn(CANVAS, eng.config.hidden_size, device="cuda").to(torch.bfloat16)
        step = generate_forward(eng)
        call, setup_call = (lambda: step(cache, ids, sc_embeds=emb)), (lambda: eng.stage_denoise(cache, ids, sc_embeds=emb))
    else:
        sc = torch.randn(CANVAS, V, device="cuda") * 3
        call, setup_call = (lambda: eng.denoise(cache, ids, sc_logits=sc)), None
    by = {}
    for _ in range(2):
        for name, setup in variants.items():
            setup()
            eng.clear_graphs()
            call()  # capture with this setup
            by.setdefault(name, []).append(med(call, reps=reps, setup=setup_call))
    del cache
    eng.clear_graphs()
    return by


if HAVE_TRITON:

    @triton.jit
    def _planes_read_kernel(codes, sides, sink, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                            GC: tl.constexpr):
        """One program per (tile, expert), as the q4 GEMM's grid: its planes read through TMA in the GEMM's K
        steps and folded into one word (so the loads stay); no x, no decode, no MMA."""
        G: tl.constexpr = K // 32
        tile = tl.program_id(1) * (N // BN) + tl.program_id(0)
        acc = tl.zeros((BN, 4 * GC), dtype=tl.int32)
        acc_side = tl.zeros((BN, GC), dtype=tl.int32)
        for g0 in range(0, G, GC):
            wd, sm = moe_q4._chunk_tma(codes, sides, tile, g0, G, BN, GC)
            acc ^= wd
            acc_side ^= sm
        tl.store(sink + tile, tl.sum(tl.sum(acc, 1), 0) + tl.sum(tl.sum(acc_side, 1), 0))


def planes_read_only(x, w, offs, src=None, glu=False, glu_f16=False, out_dtype=None, **_):
    """Stands in for moe_q4.grouped_mm_q4_tiles: reads w's planes as the GEMM's grid does and returns an unwritten
    result of the GEMM's shape and dtype (wrong on purpose: for timing only)."""
    E, N, K = w.shape
    gc_ = moe_q4.group_chunk(K // moe_q4.GROUP)
    sink = torch.empty(E * N // moe_q4.TILE_N, dtype=torch.int32, device=x.device)
    _planes_read_kernel[(N // moe_q4.TILE_N, E)](*moe_q4._descriptors(w, gc_), sink, N=N, K=K, BN=moe_q4.TILE_N,
                                                  GC=gc_, num_warps=4, num_stages=4)
    return no_expert_gemm(x, w, offs, src=src, glu=glu, glu_f16=glu_f16, out_dtype=out_dtype)


def no_expert_gemm(x, w, offs, src=None, glu=False, glu_f16=False, out_dtype=None, **_):
    """Stands in for moe_q4.grouped_mm_q4_tiles with no kernel at all: an unwritten result of its shape and dtype."""
    N = w.shape[1] // 2 if glu else w.shape[1]
    dtype = torch.float16 if glu and glu_f16 else (out_dtype or x.dtype)
    return torch.empty(mp.route_count(x, src), N, dtype=dtype, device=x.device)


def bench_floor(r, eng, V, reps):
    """How far the expert GEMMs alone can take the step: the step as generate calls it with the q4 GEMMs, with a
    kernel that only reads their planes in their place (the GEMM's bytes, grid and K steps, nothing else), and with
    no expert GEMM at all (the rest of the step). Results wrong on purpose in the last two; timing only."""
    real = moe_q4.grouped_mm_q4_tiles

    def use(fn):
        return lambda: setattr(moe_q4, "grouped_mm_q4_tiles", fn)

    try:
        by = alternate_denoise_1k(eng, V, reps, {"q4_gemm": use(real), "planes_read_only": use(planes_read_only),
                                                 "no_expert_gemm": use(no_expert_gemm)}, as_generate=True)
    finally:
        moe_q4.grouped_mm_q4_tiles = real
        eng.clear_graphs()
    r["denoise_1k_embeds_ms_by_expert_gemm"] = by
    log(f"[q4] denoise 1k as generate calls it, by what stands for the expert GEMMs (alternating, ms): {by}")


def bench_launch_order(r, eng, V, reps):
    """The q4 GEMMs launching the most-routed experts first (the engine's default) and in expert order."""
    try:
        by = alternate_denoise_1k(eng, V, reps, {"most_routed_first": lambda: setattr(eng, "launch_order", True),
                                                 "expert_order": lambda: setattr(eng, "launch_order", False)})
    finally:
        eng.launch_order = True
    r["denoise_1k_ms_by_launch_order"] = by
    log(f"[q4] denoise 1k by the q4 GEMMs' launch order (alternating, ms): {by}")


def bench_q4_inputs(r, eng, V, reps):
    """How the q4 GEMMs read their operands: planes through TMA and x as f16 operands from the producers (the
    defaults on Hopper), x as bf16 converted in the GEMM (ops/moe.expert_ffn(f16_operands=False)), planes through
    cp.async (the pre-Hopper path). The same bits in all three (GPU tests)."""
    import functools

    import diffgemma.model.forward as fm

    tma_available, ffn, finish = moe_q4.tma_available, fm.expert_ffn, fm.attn_finish

    def setup(f16, tma):
        def go():
            fm.expert_ffn = ffn if f16 else functools.partial(ffn, f16_operands=False)
            fm.attn_finish = finish if f16 else (lambda *a, moe_f16, **k: finish(*a, moe_f16=False, **k))
            moe_q4.tma_available = tma_available if tma else (lambda t: False)
        return go

    try:
        by = alternate_denoise_1k(eng, V, reps, {"tma_f16_inputs": setup(True, True),
                                                 "tma_bf16_inputs": setup(False, True),
                                                 "cp_async_f16_inputs": setup(True, False)})
    finally:
        fm.expert_ffn, fm.attn_finish, moe_q4.tma_available = ffn, finish, tma_available
    r["denoise_1k_ms_by_q4_inputs"] = by
    log(f"[q4] denoise 1k by how the q4 GEMMs read (alternating, ms): {by}")


def set_gate_up_glu(eng, glu: bool):
    """Every q4-tiles gate_up stack of `eng` re-laid with or without the glu tile order (ops/moe_q4.py); without it
    gelu·up runs as its own kernel after the GEMM. Graphs dropped."""
    for lw in eng.w.layers:
        w = lw.experts_gu
        if w.layout == moe_q4.LAYOUT and w.glu != glu:
            lw.experts_gu = moe_q4.to_tile_layout(moe_q4.to_natural_layout(w), glu=glu)
            del w
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()


def bench_glu(r, eng, V, reps):
    """gelu·up in the q4 gate_up GEMM's epilogue (the loader's layout) against gelu_mul after the plain GEMM."""
    try:
        by = alternate_denoise_1k(eng, V, reps, {"glu_epilogue": lambda: set_gate_up_glu(eng, True),
                                                 "gelu_after": lambda: set_gate_up_glu(eng, False)})
    finally:
        set_gate_up_glu(eng, True)
    r["denoise_1k_ms_by_glu"] = by
    log(f"[q4] denoise 1k by where gelu·up runs (alternating, ms): {by}")


def bench_layouts(r, eng, V, reps):
    """The q4 stacks in the pack's own order and in ops/moe_q4.py's tile layout."""
    by = alternate_denoise_1k(eng, V, reps, {layout: (lambda layout=layout: set_expert_layout(eng, layout))
                                             for layout in ("natural", moe_q4.LAYOUT)})
    r["denoise_1k_ms_by_layout"] = by
    log(f"[q4] denoise 1k by expert layout (alternating, ms): {by}")


def set_expert_layout(eng, layout):
    """Every q4 expert stack of `eng` re-laid to `layout` (ops/moe_q4.py), one tensor at a time; graphs dropped."""
    for lw in eng.w.layers:
        for name in ("experts_gu", "experts_down"):
            w = getattr(lw, name)
            if w.layout != layout:
                setattr(lw, name, moe_q4.to_tile_layout(w, glu=name == "experts_gu") if layout == moe_q4.LAYOUT
                        else moe_q4.to_natural_layout(w))
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()


def bench_session_8k(r, eng, V):
    """GPU memory of a real session at 8k context: a 7936-token prompt prefilled, then `generate` with the default
    settings (sparse SC) commits 256 tokens, so the cache ends at 8192. Peaks are taken over the generate only:
    the prefill before it is reported above (its dequant scratch goes back to the device when it ends)."""
    import diffgemma.generation as G

    cs = eng.new_cache(8192)
    eng.prefill(cs, torch.randint(0, V, (8192 - CANVAS,), device="cuda"))
    G.generate(eng, [], max_new_tokens=CANVAS, cache=cs, seed=0)  # warm: captures this bucket's graphs
    cs.truncate(8192 - CANVAS)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = G.generate(eng, [], max_new_tokens=CANVAS, cache=cs, seed=1)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used, reserved = (total - free) / GiB, torch.cuda.memory_reserved() / GiB
    r["session_8k"] = dict(tokens=len(out.tokens), forwards=out.forwards, cache_length=cs.length,
                           peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
                           peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB, reserved_gib=reserved,
                           device_used_gib=used, outside_torch_gib=used - reserved,
                           device_used_peak_gib=used - reserved + torch.cuda.max_memory_reserved() / GiB,
                           alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), graph_error=eng.graph_error)
    log(f"[q4] session at 8k context (generate, default settings): {r['session_8k']}")
    del cs
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()


def bench_kernels(res, reps):
    r = res.setdefault("kernels", {})
    E, H, Fe, k = 128, 2816, 704, 8
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)

    for T, label in ((256, "denoise"), (8192, "prefill")):
        experts = torch.randint(0, E, (T, k), device="cuda")
        if T == 256:
            experts = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        srcrows, _, offs = moe_plan(experts, E)
        M = T * k
        for fmt in (("q4", "q5", "q6", "nvfp4") if label == "denoise" else ("q4",)):
            for name, shape, K in (("gate_up", (E, 2 * Fe, H), H), ("down", (E, H, Fe), Fe)):
                if fmt != "q4" and name == "down":
                    continue
                pw = mp.PackedWeight.from_record(fmt, shape, random_record(fmt, shape, "cuda", gen, 0.02))
                xs = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                flops = 2 * M * shape[1] * K
                row = {"packed_bytes": pw.nbytes}
                if fmt == "q4":
                    if label == "denoise":  # the q4-tiles kernel (ops/moe_q4.py) on the same weights
                        tw = moe_q4.to_tile_layout(pw)
                        row["q4_tiles_ms"] = gmed(lambda: moe_q4.grouped_mm_q4_tiles(xs, tw, offs), reps=reps)
                        row["q4_tiles_GBps"] = pw.nbytes / row["q4_tiles_ms"] / 1e6
                        del tw
                    wb = mp.dequantize_triton(pw, torch.bfloat16)
                    row["bf16_grouped_mm_ms"] = gmed(lambda: _grouped_mm(xs, wb, offs), reps=reps)
                    if label == "denoise":  # the bf16 streaming kernel (ops/moe_stream.py) on the same weights
                        for cfg in (moe_stream.CONFIG, (64, 16, 128, 4, 4), (128, 16, 128, 8, 4), (64, 32, 256, 4, 3),
                                    (32, 16, 256, 4, 4), (128, 32, 64, 8, 5)):
                            key = "bf16_stream_" + "_".join(map(str, cfg)) + "_ms"
                            try:
                                row[key] = gmed(lambda: moe_stream.grouped_mm_triton(xs, wb, offs, config=cfg), reps=reps)
                            except Exception as e:
                                row[key] = f"{type(e).__name__}: {str(e)[:200]}"
                    if label == "prefill":
                        row["dequant_ms"] = gmed(lambda: mp.dequantize_triton(pw, torch.bfloat16, out=wb), reps=reps)
                    del wb
                # the last three: fewer registers (3 blocks an SM) or fewer instructions an element than the
                # default, read from Triton 3.6's sm_90 build offline; not yet timed
                configs = [mp.CONFIGS["stream"], (64, 32, 64, 4, 4), (64, 32, 128, 4, 3), (128, 32, 64, 4, 3),
                           (128, 32, 64, 8, 4), (128, 16, 64, 4, 4), (128, 32, 32, 4, 4), (64, 16, 128, 4, 3),
                           (256, 16, 64, 8, 3)] if (label == "denoise" and fmt == "q4") else \
                    [mp.CONFIGS["stream"]] if label == "denoise" else [mp.CONFIGS["compute"], (128, 128, 64, 8, 3)]
                for cfg in configs:
                    # kernel_*: the side planes prefetched one K-step ahead (the default); inloop_*: loaded in the
                    # step that uses them (the kernel's prefetch=False loop), timed beside it on the denoise shape
                    for prefix, prefetch in (("kernel_", True), ("inloop_", False)):
                        if not prefetch and label != "denoise":
                            continue
                        key = prefix + "_".join(map(str, cfg)) + "_ms"
                        try:
                            row[key] = gmed(lambda: mp.grouped_mm_packed_triton(xs, pw, offs, config=cfg, prefetch=prefetch),
                                           reps=reps)
                        except Exception as e:
                            row[key] = f"{type(e).__name__}: {str(e)[:200]}"
                best = min((v for kk, v in row.items() if kk.startswith("kernel_") and isinstance(v, float)), default=None)
                if best:
                    row["best_kernel_GBps"] = pw.nbytes / best / 1e6
                    row["best_kernel_TFLOPs"] = flops / best / 1e9
                if "bf16_grouped_mm_ms" in row:
                    row["bf16_TFLOPs"] = flops / row["bf16_grouped_mm_ms"] / 1e9
                    row["bf16_GBps"] = shape[0] * shape[1] * K * 2 / row["bf16_grouped_mm_ms"] / 1e6
                best_stream = min((v for kk, v in row.items() if kk.startswith("bf16_stream_") and isinstance(v, float)),
                                  default=None)
                if best_stream:
                    row["bf16_stream_best_GBps"] = shape[0] * shape[1] * K * 2 / best_stream / 1e6
                r[f"{label}_{fmt}_{name}"] = row
                log(f"[kernel] {label} {fmt} {name} M={M}: " + ", ".join(
                    f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items()))
                del pw, xs
                torch.cuda.empty_cache()


def bench_gather(res, reps):
    """The engine's gate_up call at the denoise shape (GEMM, then gelu_mul), bf16 (streaming kernel) and q4, with
    the routes' rows gathered first (index_select) or by the kernel's own x loads through the token ids (src)."""
    from diffgemma.ops.gelu_mul import gelu_mul

    r = res.setdefault("gather", {})
    E, H, Fe, T, k = 128, 2816, 704, 256, 8
    gen = torch.Generator(device="cuda")
    gen.manual_seed(2)
    experts = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    src, _, offs = moe_plan(experts, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    pw = mp.PackedWeight.from_record("q4", (E, 2 * Fe, H), random_record("q4", (E, 2 * Fe, H), "cuda", gen, 0.02))
    wb = mp.dequantize_triton(pw, torch.bfloat16)
    r["bf16_index_select_ms"] = gmed(lambda: gelu_mul(moe_stream.grouped_mm_triton(x.index_select(0, src), wb, offs)),
                                    reps=reps)
    r["bf16_src_ms"] = gmed(lambda: gelu_mul(moe_stream.grouped_mm_triton(x, wb, offs, src=src)), reps=reps)
    r["q4_index_select_ms"] = gmed(lambda: gelu_mul(mp.grouped_mm_packed_triton(x.index_select(0, src), pw, offs)),
                                  reps=reps)
    r["q4_src_ms"] = gmed(lambda: gelu_mul(mp.grouped_mm_packed_triton(x, pw, offs, src=src)), reps=reps)
    log("[gather] " + ", ".join(f"{a}={b:.4g}" for a, b in r.items()))


def bench_bf16(res, eng, cfg, reps):
    r = res.setdefault("engine_bf16_same_weights", {})
    V = cfg.vocab_size
    for lw in eng.w.layers:  # same weights, experts as bf16 stacks
        lw.experts_gu = moe.dequantize_stack(lw.experts_gu, torch.bfloat16)
        lw.experts_down = moe.dequantize_stack(lw.experts_down, torch.bfloat16)
    torch.cuda.synchronize()
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    prompt_1k, ids, sc = (t.cuda() for t in res.pop("_q4_case"))
    cache = eng.new_cache(1024)
    eng.prefill(cache, prompt_1k)
    eng.denoise(cache, ids, sc_logits=sc)
    t = time_cuda(lambda: eng.denoise(cache, ids, sc_logits=sc), reps=reps, warmup=3)
    r["denoise_1k_ms"], r["denoise_1k_min_ms"] = statistics.median(t), min(t)
    g = eng.denoise(cache, ids, sc_logits=sc)
    q = res.pop("_q4_logits").to(g.device)
    r["logits_cos_q4_vs_bf16"] = torch.nn.functional.cosine_similarity(g.flatten(), q.flatten(), dim=0).item()
    r["argmax_agree_q4_vs_bf16"] = (g.argmax(-1) == q.argmax(-1)).float().mean().item()
    log(f"[bf16] denoise 1k: {r['denoise_1k_ms']:.3f} ms; q4 vs bf16 logits cos {r['logits_cos_q4_vs_bf16']:.6f}, "
        f"argmax agree {r['argmax_agree_q4_vs_bf16']:.4f}")
    c8 = eng.new_cache(8192)
    prompt = torch.randint(0, V, (8192,), device="cuda")

    def do_prefill():
        c8.truncate(0)
        eng.prefill(c8, prompt)

    r["prefill_8k_tok_s"] = 8192 / (med(do_prefill, reps=2, warmup=1) / 1e3)
    log(f"[bf16] prefill 8k: {r['prefill_8k_tok_s']:.0f} tok/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: engine_q4,kernels,gather,bf16; "
                    "and of engine_q4's A/B parts: floor,launch_order,q4_inputs,glu,layouts")
    ap.add_argument("--routing", default="balanced", choices=KINDS, help="expert routing while timing the engine")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    def dump():
        if args.json:
            Path(args.json).write_text(json.dumps({k: v for k, v in res.items() if not k.startswith("_")}, indent=1))

    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    t0 = time.time()
    src = RandomPackSource(cfg, "cuda", torch.bfloat16, seed=0, experts="q4", sc="q8")
    eng = build_engine(cfg, src, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    names = expected_tensors(cfg)
    res["pack_bytes"] = sum(src.record_nbytes(n) for n in names)
    res["pack_expert_bytes"] = sum(src.record_nbytes(n) for n in names if ".experts." in n)
    res["engine_weight_bytes"] = weight_bytes(eng.w)
    res["byte_floor_ms"] = res["engine_weight_bytes"] / BW * 1e3
    log(f"[q4] built in {time.time() - t0:.1f}s: pack {res['pack_bytes'] / 1e9:.2f} GB (experts "
        f"{res['pack_expert_bytes'] / 1e9:.2f} GB), engine weights {res['engine_weight_bytes'] / 1e9:.2f} GB, "
        f"allocated {torch.cuda.memory_allocated() / GiB:.2f} GiB; weight-byte floor {res['byte_floor_ms']:.2f} ms/step")
    dump()
    sections = [("engine_q4", lambda: bench_engine_q4(res, eng, cfg, args.reps, skip)),
                ("kernels", lambda: bench_kernels(res, 20)),
                ("gather", lambda: bench_gather(res, 20)),
                ("bf16", lambda: bench_bf16(res, eng, cfg, args.reps))]
    res["routing"] = args.routing
    for name, fn in sections:
        if name in skip:
            continue
        t = time.time()
        try:
            with routing(args.routing):
                fn()
        except Exception as e:
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(f"[section {name}] {time.time() - t:.1f}s")
        dump()
    q = res.get("engine_q4", {})
    log("\n| metric | q4 | bar |\n|---|---|---|")
    log(f"| denoise ms/step at 1k (graphed, median) | {q.get('denoise_1k_ms')} | <= 6 |")
    log(f"| GPU memory at 8k context, GiB (allocated / device used) | {q.get('mem_8k_allocated_gib')} / "
        f"{q.get('mem_8k_device_used_gib')} | <= 20 |")
    ss = q.get("session_8k", {})
    log(f"| GPU memory, generate at 8k context, GiB (peak allocated / peak reserved / device used at peak) | "
        f"{ss.get('peak_allocated_gib')} / {ss.get('peak_reserved_gib')} / {ss.get('device_used_peak_gib')} | <= 20 |")
    log(f"| prefill tok/s at 8k (dequant / kernel) | {q.get('prefill_8k_dequant_tok_s')} / "
        f"{q.get('prefill_8k_kernel_tok_s')} | >= 40000 |")
    log(f"| bf16 (same weights) denoise 1k ms / prefill 8k tok/s | "
        f"{res.get('engine_bf16_same_weights', {}).get('denoise_1k_ms')} / "
        f"{res.get('engine_bf16_same_weights', {}).get('prefill_8k_tok_s')} | |")


if __name__ == "__main__":
    main()
