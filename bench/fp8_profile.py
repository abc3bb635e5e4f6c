"""fp8_check's profile section: where a batched denoise forward's GPU time goes, by op class, and a batched prompt
prefill's.

The eager forward (B lanes of 1k context, balanced routing; the same kernels its CUDA graph replays) runs once to
warm up and once under torch.profiler (CPU and CUDA activities); so does the batched prefill of B 1k prompts into
empty caches (Engine.prefill_batch, eager as the core runs a wave). Each GPU kernel is put in one class:

  expert_gemm   the expert GEMMs: torch._scaled_grouped_mm / torch._grouped_mm kernels, the FP8 / bf16 / packed
                streaming kernels
  linear        the other GEMMs: attention projections, dense MLP (FP8 via torch._scaled_mm or the Triton FP8
                GEMM; bf16 via cuBLAS), lm_head and the SC MLP
  attention     the canvas attention kernels (flash, tiles, chunk softmax, SDPA)
  quant_norm    per-token FP8 quantization, gelu·up, the rms-norm / layer-finish / qkv / RoPE epilogues
  routing       the router GEMM, top-k, the MoE plan
  glue          everything else (copies, gathers, index ops, fills)

A library GEMM kernel is classed by the aten op that launched it (the profiler's correlation), a Triton kernel by
its name. The result: ms per class (summed over the forward), the total, and the top kernels by GPU time.
"""

from __future__ import annotations

import re

import torch

from bench.balanced_routing import routing
from bench.bench_batch import lanes, timed
from bench.runner import log

GROUPED_OPS = ("aten::_scaled_grouped_mm", "aten::_grouped_mm")
LINEAR_OPS = ("aten::_scaled_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
CLASSES = [  # (class, kernel-name pattern), first match wins; for kernels no aten GEMM op launched
    ("expert_gemm", r"_fp8_gmm_kernel|_packed_gmm_kernel|_q4_tiles_gmm|_grouped_gemm|GroupProblemShape|grouped"),
    ("linear", r"_fp8_linear_kernel|_q8_linear_kernel"),
    ("attention", r"_flash_kernel|_combine_kernel|_qk_tile_softmax|_tile_weights|_pv_scaled|_chunk_softmax|fmha|"
                  r"flash|attention|sdpa"),
    ("routing", r"_route_kernel|_router_gemm|_moe_plan|topk|radix|sort|bitonic"),
    ("quant_norm", r"_quantize_rows|_gelu_mul|rms|norm|finish|ffn_inputs|embed_sc|qkv_prep|rope"),
    ("linear", r"gemm|cutlass|nvjet|xmma|wgmma|sm90_|matmul|cublas|splitK"),
]


def kernel_owners(events) -> dict:
    """kernel name -> the aten GEMM op that launched it (from each CPU op's correlated kernels), where one did."""
    owners = {}
    for ev in events:
        if ev.name in GROUPED_OPS + LINEAR_OPS:
            for k in getattr(ev, "kernels", []) or []:
                owners.setdefault(k.name, ev.name)
    return owners


def classify(name: str, owners: dict) -> str:
    op = owners.get(name)
    if op in GROUPED_OPS:
        return "expert_gemm"
    if op in LINEAR_OPS:
        return "linear"
    return next((cls for cls, pat in CLASSES if re.search(pat, name, re.I)), "glue")


def profiled_forward(eng, cfg, B: int, ctx: int, top: int = 25) -> dict:
    """The eager B-lane forward under torch.profiler -> {"gpu_ms", "classes_ms", "top_kernels"}."""
    caches, canvases, scs = lanes(eng, cfg, B, ctx, seed=6)
    graphs = eng.use_graphs
    eng.use_graphs = False
    try:
        return profiled(eng.device, lambda: eng.denoise_batch_raw(caches, canvases, sc_embeds=scs), top)
    finally:
        eng.use_graphs = graphs


def profiled_prefill(eng, cfg, B: int, ctx: int, top: int = 25) -> dict:
    """B prompts of ctx tokens prefilled in one batched forward into empty caches, under torch.profiler."""
    from diffgemma.slots import rewind

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (ctx,), generator=gen).to(eng.device) for _ in range(B)]
    caches = [eng.new_cache(ctx + 2 * cfg.canvas_length) for _ in range(B)]

    def fill():
        for c in caches:
            rewind(c, 0)
        eng.prefill_batch(caches, prompts)

    return profiled(eng.device, fill, top)


def profiled(dev, fn, top: int) -> dict:
    """fn() once to warm up, once under torch.profiler -> {"gpu_ms", "classes_ms", "top_kernels"}."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize(dev)
    events = p.events()
    owners = kernel_owners(events)
    per_kernel: dict = {}
    for e in events:
        if e.device_type.name == "CUDA":
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time_total / 1e3
    classes: dict = {}
    for name, ms in per_kernel.items():
        cls = classify(name, owners)
        classes[cls] = classes.get(cls, 0.0) + ms
    ordered = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {"gpu_ms": round(sum(per_kernel.values()), 3),
            "classes_ms": {k: round(v, 3) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
            "top_kernels": [[round(ms, 3), classify(name, owners), name[:120]] for name, ms in ordered]}


def graphed_ms(eng, cfg, B: int, ctx: int, reps: int) -> float:
    """Median ms of the graphed B-lane forward (its lanes freed on return)."""
    caches, canvases, scs = lanes(eng, cfg, B, ctx)
    return timed(eng.device, lambda: eng.denoise_batch_raw(caches, canvases, sc_embeds=scs), reps)


def section_profile(cfg, dev, kinds, build, B: int = 8, ctx: int = 1024, reps: int = 10) -> dict:
    """For each engine kind: the graphed B-lane forward's median ms and the eager forward's GPU time by class; the
    batched prefill of B prompts' GPU time by class (under "prefill")."""
    if dev.type != "cuda":
        return {"skipped": "no CUDA"}
    out = {}
    for kind in kinds:
        eng = build(kind, cfg, dev, False)
        try:
            with routing("balanced"):
                r = {f"B{B}_graphed_ms": graphed_ms(eng, cfg, B, ctx, reps)}
                eng.clear_graphs()
                r.update(profiled_forward(eng, cfg, B, ctx))
                r["prefill"] = profiled_prefill(eng, cfg, B, ctx)
            out[kind] = r
            log(f"  [profile {kind}] B={B}: graphed {r[f'B{B}_graphed_ms']} ms; eager kernels {r['gpu_ms']} ms: "
                f"{r['classes_ms']}")
            for ms, cls, name in r["top_kernels"]:
                log(f"     {ms:8.3f} ms  {cls:12} {name}")
            pre = r["prefill"]
            log(f"  [profile {kind}] prefill of {B} x {ctx}: eager kernels {pre['gpu_ms']} ms: {pre['classes_ms']}")
            for ms, cls, name in pre["top_kernels"]:
                log(f"     {ms:8.3f} ms  {cls:12} {name}")
        finally:
            eng = None
            torch.cuda.empty_cache()
    return out
