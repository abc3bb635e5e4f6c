"""Published quantized checkpoints at full size (docs/FORMATS.md): write one with random weights in a hub layout,
load it as a user would (`diffgemma.load(DIR, device="cuda")`), and time the step at 1k context and the memory at 8k
context beside diffgemma's own q4 pack (bench.fixtures.RandomPackSource, experts q4, SC q8) in the same run.

    PYTHONPATH=src python3 -m bench.bench_hub --layout modelopt-nvfp4 --dir /tmp/hub --json $OUT/hub.json

Layouts: modelopt-nvfp4 (experts only, per-expert weight_scale_2 that differ, as published), autoround-int4 (GPTQ
qweight/qzeros/scales, group 128, symmetric; the experts, attention and dense MLP), ct-fp8 (compressed-tensors
FP8, per-channel bf16 scales: until the FP8 engine consumes Fp8Weight it runs dequantized to bf16). The expert
codes are uniform random; the scales are chosen so the weights have std ~0.02 (bench/fixtures.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.bench_engine import CANVAS, TEXT, time_cuda
from bench.fixtures import RandomPackSource, RandomSource
from diffgemma.checkpoint import expected_tensors
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine

GiB = 2**30
SHARD = 4 * GiB
LAYOUTS = ("modelopt-nvfp4", "autoround-int4", "ct-fp8")
DEV = "cuda"


def log(*a):
    print(*a, flush=True)


def _linear_tensors(layout: str, mod: str, n: int, k: int, gen, std=0.02) -> dict:
    dev = DEV

    def rbytes(shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=gen, device=dev, dtype=torch.int32).to(torch.uint8)

    if layout == "modelopt-nvfp4":
        t2 = std / 2.93 * (1 + 0.1 * torch.rand((), generator=gen, device=dev))
        return {f"{mod}.weight": rbytes((n, k // 2)), f"{mod}.weight_scale": rbytes((n, k // 16), 0x30, 0x41).view(
            torch.float8_e4m3fn), f"{mod}.weight_scale_2": t2.float(), f"{mod}.input_scale": torch.ones((), device=dev)}
    if layout == "autoround-int4":
        g = -(-k // 128)  # groups of 128 along K, the last one partial where K is not a multiple (704)
        return {f"{mod}.qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, device=dev,
                                                dtype=torch.int64).to(torch.int32),
                f"{mod}.qzeros": torch.full((g, n // 8), 0x77777777, dtype=torch.int32, device=dev),
                f"{mod}.scales": (std * math.sqrt(12) / 16 * (0.75 + 0.5 * torch.rand((g, n), generator=gen,
                                                                                        device=dev))).half()}
    w = torch.randn((n, k), generator=gen, device=dev) * std
    s = (w.abs().amax(-1, keepdim=True) / 448).to(torch.bfloat16)
    return {f"{mod}.weight": (w / s.float()).clamp(-448, 448).to(torch.float8_e4m3fn), f"{mod}.weight_scale": s}


def write_checkpoint(layout: str, directory: Path, cfg: ModelConfig, text: dict = TEXT) -> float:
    """A full-size random checkpoint in `layout` at `directory` -> seconds taken."""
    t0 = time.time()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    src = RandomSource(cfg, DEV, torch.bfloat16, seed=1)
    gen = torch.Generator(device=DEV)
    gen.manual_seed(2)
    shard, size, files, index = {}, 0, [], {}

    def put(name, t):
        nonlocal shard, size
        shard[name] = t.cpu().contiguous()
        size += t.numel() * t.element_size()
        if size > SHARD:
            flush()

    def flush():
        nonlocal shard, size
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(directory / fname), metadata={"format": "pt"})
            files.append(fname)
            index.update({k: fname for k in shard})
            shard, size = {}, 0

    quantized_linears = layout != "modelopt-nvfp4"  # ModelOpt's published recipe quantizes the experts only
    for name, shape in expected_tensors(cfg).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, rows, k = shape
            base = name.rsplit(".", 1)[0]
            parts = (("gate_proj", rows // 2), ("up_proj", rows // 2)) if "gate_up" in name else (("down_proj", rows),)
            for i in range(e):
                for proj, n in parts:
                    for key, t in _linear_tensors(layout, f"{base}.{i}.{proj}", n, k, gen).items():
                        put(key, t)
        elif quantized_linears and (".self_attn." in name or ".mlp." in name) and name.endswith("_proj.weight"):
            n, k = shape
            for key, t in _linear_tensors(layout, name[:-len(".weight")], n, k, gen).items():
                put(key, t)
        else:
            put(name, src.get(name))
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    qc = {"modelopt-nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
          "autoround-int4": {"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
                             "packing_format": "auto_round:auto_gptq"},
          "ct-fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
              "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}}[layout]
    (directory / "config.json").write_text(json.dumps({"model_type": "diffusion_gemma", "canvas_length": CANVAS,
                                                       "text_config": text, "quantization_config": qc}))
    return time.time() - t0


def step_and_memory(eng, cfg, reps: int) -> dict:
    """Median ms of the graphed denoise at 1k context; GPU memory allocated with an 8k context prefilled."""
    V = cfg.vocab_size
    cache = eng.new_cache(1024)
    eng.prefill(cache, torch.randint(0, V, (1024,), device="cuda"))
    ids = torch.randint(0, V, (CANVAS,), device="cuda")
    eng.denoise(cache, ids)  # capture
    t = time_cuda(lambda: eng.denoise(cache, ids), reps=reps, warmup=3)
    out = {"denoise_1k_ms": statistics.median(t), "denoise_1k_min_ms": min(t), "graph_error": eng.graph_error}
    del cache
    eng.clear_graphs()
    gc.collect()
    torch.cuda.empty_cache()
    c8 = eng.new_cache(8192)
    eng.prefill(c8, torch.randint(0, V, (8192 - CANVAS,), device="cuda"))
    eng.denoise(c8, ids)
    torch.cuda.synchronize()
    out["mem_8k_allocated_gib"] = torch.cuda.memory_allocated() / GiB
    out["mem_8k_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    del c8
    eng.clear_graphs()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=LAYOUTS, default="modelopt-nvfp4")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/diffgemma-hub-bench"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import diffgemma

    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layout": args.layout}
    res["write_s"] = write_checkpoint(args.layout, args.dir, cfg)
    res["checkpoint_gb"] = sum(p.stat().st_size for p in args.dir.glob("*.safetensors")) / 1e9
    log(f"[{args.layout}] wrote {res['checkpoint_gb']:.2f} GB in {res['write_s']:.0f}s")
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    eng = diffgemma.load(args.dir, device="cuda")
    torch.cuda.synchronize()
    res["load_s"] = time.time() - t0
    res["weights_gib"] = torch.cuda.memory_allocated() / GiB
    res["formats"] = getattr(eng, "weight_formats", None)
    log(f"[{args.layout}] loaded in {res['load_s']:.0f}s, {res['weights_gib']:.2f} GiB: {res['formats']}")
    res["hub"] = step_and_memory(eng, cfg, args.reps)
    log(f"[{args.layout}] {res['hub']}")
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    q4 = build_engine(cfg, RandomPackSource(cfg, "cuda", torch.bfloat16, seed=0, experts="q4", sc="q8"), "cuda",
                      torch.bfloat16)
    res["q4_pack"] = step_and_memory(q4, cfg, args.reps)
    log(f"[q4 pack] {res['q4_pack']}")
    h, q = res["hub"], res["q4_pack"]
    res["step_ratio"] = h["denoise_1k_ms"] / q["denoise_1k_ms"]
    res["mem_8k_delta_gib"] = h["mem_8k_allocated_gib"] - q["mem_8k_allocated_gib"]
    log(f"\n| {args.layout} vs q4 pack | step at 1k ms | memory at 8k GiB |\n|---|---|---|\n"
        f"| {args.layout} | {h['denoise_1k_ms']:.3f} | {h['mem_8k_allocated_gib']:.2f} |\n"
        f"| q4 pack | {q['denoise_1k_ms']:.3f} | {q['mem_8k_allocated_gib']:.2f} |\n"
        f"| ratio / delta (bars: <= 1.1x, <= 1 GiB) | {res['step_ratio']:.3f}x | {res['mem_8k_delta_gib']:+.2f} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
