"""Benchmark: image prefill on the fast engine at DiffusionGemma's full size, random bf16 weights, one GPU.

    PYTHONPATH=src:. python -m bench.bench_vision [--image 672x960] [--images 1] [--reps 10] [--json out.json]
    PYTHONPATH=src:. python -m bench.bench_vision --tiny          # a CPU dry run of the same code (< 1 minute)

Builds the full-size text engine (bench.bench_engine.TEXT, random weights on the device) and the vision tower at the
26B-A4B checkpoint's vision shapes (VISION below, or `--config` a checkpoint's config.json, whose vision_config and
token ids are then used), in bf16. One image prompt is text, then each image as <boi> + soft tokens + <eoi>, then
text. Per repeat, each stage on its own, synchronized: the tower (patches -> soft tokens in text space), the merge
(text embeddings with the soft tokens in place, the image groups) and the prompt's prefill into an emptied cache
(eager, the image rows in one chunk with the image attention rule). Image preprocessing (decode, resize, patches;
host side, PIL) is timed apart. For comparison, the same prompt's ids prefilled as plain text (the engine's normal
path: padded CUDA graphs for short prompts). Median of `--reps` after `--warmup` runs; JSON with every stage's
median, images/s of tower + merge + prefill, and with preprocessing.

The vision shapes: the 26B-A4B carries a ~550M-parameter tower (SigLIP-So400m's width and depth: hidden 1152, 27
layers, MLP 4304, 16 heads of 72; patch 16, 3x3 pooling, 280 soft tokens by default); transformers' Gemma4VisionConfig
defaults (768 wide, 16 layers: ~150M) are the small models'. `--config` takes the real numbers where a checkpoint is
at hand. The default image (672x960 pixels) is one the processor keeps as it is: 42x60 patches -> 280 soft tokens.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import torch

S, FULL = "sliding_attention", "full_attention"
VISION = dict(model_type="gemma4_vision", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
              num_attention_heads=16, num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
              position_embedding_size=10240, standardize=False, use_clipped_linears=False)
TOKENS = dict(boi_token_id=255_999, eoi_token_id=258_882, image_token_id=258_880)
# --tiny: a small text model and tower with the same code paths (sliding + full layers, GQA, pooling 3)
TINY_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                 sliding_window=64,
                 layer_types=[S, FULL, S, FULL], num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                 final_logit_softcapping=30.0, max_position_embeddings=4096)
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                   position_embedding_size=256, standardize=True, use_clipped_linears=True)
TINY_TOKENS = dict(boi_token_id=509, eoi_token_id=510, image_token_id=511)


class RandomVisionSource:
    """The tower's and projector's checkpoint-named tensors, random, generated on `device` on first `get` (the
    TensorSource interface VisionTower reads). Linears std 0.02 (patch embedding std 1/sqrt(3·p²), so the patch
    embedding is O(1)), norm weights near 1 (QK-norm near head_dim^-1/4, as bench.fixtures.RandomSource), clip
    bounds that rarely bite, a standardize scale near 1."""

    def __init__(self, cfg, device, seed: int = 1):
        from diffgemma.vision.tower import expected_vision_tensors

        self.shapes = expected_vision_tensors(cfg)
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)

    def keys(self):
        return set(self.shapes)

    def shape(self, name):
        return self.shapes[name]

    def get(self, name, dtype=None, device=None):
        shape, g, dev = self.shapes[name], self.gen, self.device
        if name.endswith(("input_min", "output_min")):
            t = torch.full(shape, -8.0, device=dev)
        elif name.endswith(("input_max", "output_max")):
            t = torch.full(shape, 8.0, device=dev)
        elif name.endswith("std_bias"):
            t = 0.1 * torch.randn(shape, generator=g, device=dev)
        elif len(shape) == 1 or name.endswith("std_scale"):  # norm weights
            t = 1.0 + 0.2 * torch.randn(shape, generator=g, device=dev)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                t = t * shape[0] ** -0.25
        elif name.endswith("input_proj.weight"):
            t = torch.randn(shape, generator=g, device=dev) * shape[1] ** -0.5
        else:
            t = torch.randn(shape, generator=g, device=dev) * 0.02
        return t.to(device=device or dev, dtype=dtype or torch.bfloat16)


def build(args):
    from bench.bench_engine import CANVAS, TEXT
    from bench.fixtures import RandomSource
    from diffgemma.config import ModelConfig
    from diffgemma.model.engine import build_engine
    from diffgemma.vision.config import VisionConfig
    from diffgemma.vision.tower import VisionTower

    text, vision, tokens = (TINY_TEXT, TINY_VISION, TINY_TOKENS) if args.tiny else (TEXT, VISION, TOKENS)
    if args.config:
        raw = json.loads(Path(args.config).read_text())
        vision = raw.get("vision_config", vision)
        tokens = {k: raw.get(k, v) for k, v in tokens.items()}
    canvas = 16 if args.tiny else CANVAS
    raw = {"model_type": "diffusion_gemma", "text_config": dict(text, use_bidirectional_attention="vision"),
           "vision_config": vision, "canvas_length": canvas, **tokens}
    processing = {"max_soft_tokens": args.soft_tokens, "patch_size": vision["patch_size"],
                  "pooling_kernel_size": vision["pooling_kernel_size"]}
    vcfg = VisionConfig.from_dict(raw, processor=processing, processor_source="bench")
    cfg = ModelConfig.from_dict(raw)
    dev, dtype = torch.device(args.device), torch.bfloat16
    eng = build_engine(cfg, RandomSource(cfg, dev, dtype, seed=0), dev, dtype)
    tower = VisionTower(vcfg, RandomVisionSource(vcfg, dev), device=dev, dtype=dtype)
    tower.load()
    return eng, tower, vcfg


def image_bytes(height: int, width: int, seed: int) -> bytes:
    """A random-noise PNG (the worst case for nothing: preprocessing does not look at content)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(data, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def run(args) -> dict:
    from diffgemma.vision.merge import image_groups, image_placeholder, merge_image_embeddings
    from diffgemma.vision.preprocess import prepare_image

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t_build = time.perf_counter()
    eng, tower, vcfg = build(args)
    sync()
    t_build = time.perf_counter() - t_build
    h, w = args.image
    files = [image_bytes(h, w, seed=i) for i in range(args.images)]
    prepared = [prepare_image(f, vcfg.processing) for f in files]
    g = torch.Generator().manual_seed(0)
    top = vcfg.boi_token_id if args.tiny else 200_000  # ordinary text ids, below the special ones
    text = lambda n: torch.randint(0, top, (n,), generator=g).tolist()  # noqa: E731
    ids = text(args.text)
    for im in prepared:
        ids += image_placeholder(im.num_soft_tokens, vcfg) + text(args.text)
    ids = torch.tensor(ids, device=dev)
    cache = eng.new_cache(max(1024, 2 * len(ids)))
    stages = {k: [] for k in ("preprocess", "tower", "merge", "prefill", "text_prefill")}
    for rep in range(args.warmup + args.reps):
        pre, t_pre = timed(lambda: [prepare_image(f, vcfg.processing) for f in files], lambda: None)
        feats, t_tower = timed(lambda: tower.encode(pre), sync)
        (embeds, groups), t_merge = timed(lambda: (merge_image_embeddings(eng.embed(ids), ids, feats, vcfg),
                                                   image_groups(ids, vcfg)), sync)
        cache.truncate(0)
        _, t_prefill = timed(lambda: eng.prefill(cache, ids, embeds=embeds, image_groups=groups), sync)
        cache.truncate(0)
        _, t_text = timed(lambda: eng.prefill(cache, ids), sync)
        if rep >= args.warmup:
            for k, t in zip(stages, (t_pre, t_tower, t_merge, t_prefill, t_text)):
                stages[k].append(t)
    med = {k: statistics.median(v) * 1e3 for k, v in stages.items()}
    gpu_ms = med["tower"] + med["merge"] + med["prefill"]
    n = args.images
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "tiny": args.tiny,
        "vision": {k: v for k, v in vars(vcfg).items() if k != "processing"},
        "tower_params": sum(t.numel() for t in tower._w.values()),
        "text": {"layers": eng.config.num_layers, "hidden": eng.config.hidden_size,
                 "experts": eng.config.num_experts, "vocab": eng.config.vocab_size},
        "image": {"height": h, "width": w, "grid": list(prepared[0].grid),
                  "soft_tokens": prepared[0].num_soft_tokens, "per_prompt": n},
        "prompt_tokens": len(ids),
        "reps": args.reps,
        "median_ms": med,
        "images_per_s": n / gpu_ms * 1e3,
        "images_per_s_with_preprocess": n / (gpu_ms + med["preprocess"]) * 1e3,
        "tower_images_per_s": n / med["tower"] * 1e3,
        "image_prefill_vs_text_prefill": med["prefill"] / med["text_prefill"],
        "build_s": t_build,
    }


def parse_size(s: str) -> tuple[int, int]:
    h, w = s.lower().split("x")
    return int(h), int(w)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small random models on the CPU: a dry run of the code")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--config", help="a checkpoint's config.json: its vision_config and image token ids")
    p.add_argument("--image", type=parse_size, default=None, help="HxW pixels (default 672x960; --tiny 36x48)")
    p.add_argument("--images", type=int, default=1, help="images per prompt")
    p.add_argument("--soft-tokens", type=int, default=280, help="the processor's max_soft_tokens")
    p.add_argument("--text", type=int, default=16, help="text tokens before, between and after the images")
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default 10; --tiny 3)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.image = args.image or ((36, 48) if args.tiny else (672, 960))
    args.reps = args.reps or (3 if args.tiny else 10)
    if args.tiny:
        args.soft_tokens = 70 if args.soft_tokens == 280 else args.soft_tokens
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_vision: CUDA is not available (use --tiny for a CPU dry run)")
    with torch.no_grad():
        result = run(args)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
