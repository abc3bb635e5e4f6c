"""Fidelity of each pack profile on the embedded demo model: logits vs bf16, held-out accuracy.

For each profile: quantize the demo checkpoint (fp8: the hub's compressed-tensors FP8 layout, `quantize_fp8`; on the
CPU its weights dequantized, on CUDA the FP8 engine with per-token activations), load the pack through diffgemma.load (on the CPU: the
dequantizing reference path; with --device cuda: the fast engine and its packed kernels, q4 in
ops/moe_q4.py's tile order), and measure (1) cosine and top-1 agreement of denoise logits against the unquantized model on
held-out prompts with random canvases, and (2) exact match of diffgemma.generate on held-out prompts.

    python bench/quant_fidelity.py [--per-family 12] [--profiles q4,q5,q6,nvfp4,nvfp4x,fp8] [--device cuda]
    python bench/quant_fidelity.py --mid      # a mid-size random transformers checkpoint: logits agreement only
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import diffgemma
from diffgemma.loader import embedded_model_path
from diffgemma.quant.hub_fp8 import quantize_fp8
from diffgemma.quant.quantize import quantize

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
import demo_data  # noqa: E402

FAMILIES = ("arith", "facts", "sort", "brackets", "think")


def prompts(tok, per_family):
    out = []
    for ex in demo_data.heldout_set(per_family):
        if ex.family in FAMILIES:
            ids = tok.apply_chat_template(ex.messages, tools=ex.tools, enable_thinking=ex.enable_thinking)
            out.append((ex.family, ids, tok.encode(ex.target)))
    return out


def logits_agreement(base, model, items, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cos, top1, n = 0.0, 0, 0
    for _, ids, _ in items:
        canvas = torch.randint(0, base.config.vocab_size, (base.config.canvas_length,), generator=gen)
        outs = []
        for m in (base, model):
            c = m.new_cache(1024)
            m.prefill(c, torch.tensor(ids))
            outs.append(m.denoise(c, canvas))
        cos += torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1).mean().item()
        top1 += (outs[0].argmax(-1) == outs[1].argmax(-1)).sum().item()
        n += outs[0].shape[0]
    return cos / len(items), top1 / n


def exact_match(model, items):
    per = {}
    for fam, ids, target in items:
        r = diffgemma.generate(model, torch.tensor(ids), seed=0, max_new_tokens=200)
        per.setdefault(fam, []).append(r.tokens == target[:-1] and r.stop_token == target[-1])
    return {f: sum(v) / len(v) for f, v in per.items()}


S, FULL = "sliding_attention", "full_attention"
MID = dict(vocab_size=8192, hidden_size=512, intermediate_size=384, num_hidden_layers=6, num_attention_heads=8,
           num_key_value_heads=4, head_dim=128, global_head_dim=256, num_global_key_value_heads=2, sliding_window=128,
           layer_types=[S, S, FULL, S, S, FULL], num_experts=32, top_k_experts=4, moe_intermediate_size=128,
           max_position_embeddings=4096)
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=8, position_embedding_size=16)


def mid_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A mid-size DiffusionGemma with transformers' random init, saved in bf16 like a real checkpoint."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    cfg = DiffusionGemmaConfig(text_config=MID, vision_config=TINY_VISION, canvas_length=64)
    DiffusionGemmaForBlockDiffusion(cfg).to(torch.bfloat16).save_pretrained(str(directory))
    return directory


def expert_cosine(src: Path, pack: Path, layer: int = 0, rows: int = 256, seed: int = 2) -> float:
    """Cosine of one layer's expert FFN output, packed vs bf16 weights, on the same random inputs and routes:
    the quantization error itself, before a random model's near-tied routing amplifies it."""
    from safetensors.torch import load_file

    from diffgemma.ops.moe import experts_ref
    from diffgemma.quant.source import open_pack

    name = f"model.decoder.layers.{layer}.experts."
    ref = load_file(str(src / "model.safetensors"))
    packed = open_pack(pack)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, MID["hidden_size"], generator=gen)
    experts = torch.stack([torch.randperm(MID["num_experts"], generator=gen)[: MID["top_k_experts"]] for _ in range(rows)])
    w = torch.rand(rows, MID["top_k_experts"], generator=gen)
    a = experts_ref(x, w, experts, ref[name + "gate_up_proj"].float(), ref[name + "down_proj"].float())
    b = experts_ref(x, w, experts, packed.get(name + "gate_up_proj", torch.float32), packed.get(name + "down_proj", torch.float32))
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()


def main_mid(profiles, n_prompts: int = 8):
    with tempfile.TemporaryDirectory() as tmp:
        src = mid_checkpoint(Path(tmp) / "mid")
        base = diffgemma.load(src)
        gen = torch.Generator().manual_seed(1)
        items = [(None, torch.randint(3, MID["vocab_size"], (int(torch.randint(40, 300, (1,), generator=gen)),),
                                      generator=gen).tolist(), None) for _ in range(n_prompts)]
        print(f"mid-size random checkpoint ({sum(p.stat().st_size for p in src.glob('*.safetensors')):,} bytes bf16), "
              f"{n_prompts} random prompts x canvas 64, CPU, torch {torch.__version__}")
        print("| weights | expert FFN output cosine (layer 0, 256 random rows, top-4) | logits cosine vs bf16 | top-1 agreement |")
        print("|---|---|---|---|")
        for profile in profiles:
            out = Path(tmp) / profile
            quantize(src, out, profile=profile, progress=False)
            cos, top1 = logits_agreement(base, diffgemma.load(out), items)
            print(f"| {profile} | {expert_cosine(src, out):.5f} | {cos:.5f} | {top1:.4f} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-family", type=int, default=12)
    ap.add_argument("--profiles", default="q4,q5,q6,nvfp4,nvfp4x")
    ap.add_argument("--mid", action="store_true", help="the mid-size random checkpoint instead of the demo model")
    ap.add_argument("--device", default="cpu", help="cpu (the reference path) or cuda (the fast engine, bf16)")
    args = ap.parse_args()
    if args.mid:
        return main_mid(args.profiles.split(","))
    src = embedded_model_path()
    base = diffgemma.load(src, device=args.device)
    items = prompts(base.tokenizer, args.per_family)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"demo model, {len(items)} held-out prompts ({', '.join(FAMILIES)}), {args.device}, torch {torch.__version__}, "
          f"commit {commit}")
    rows = [("bf16 (source)", src.joinpath("model.safetensors").stat().st_size, 1.0, 1.0, exact_match(base, items))]
    with tempfile.TemporaryDirectory() as tmp:
        for profile in args.profiles.split(","):
            t = time.time()
            out = Path(tmp) / profile
            if profile == "fp8":
                quantize_fp8(src, out, progress=False)
            else:
                quantize(src, out, profile=profile, progress=False)
            size = sum(p.stat().st_size for p in out.iterdir() if p.name.startswith("model"))  # model.pack* or model*.safetensors
            model = diffgemma.load(out, device=args.device)
            cos, top1 = logits_agreement(base, model, items)
            rows.append((profile, size, cos, top1, exact_match(model, items)))
            print(f"  {profile}: {time.time() - t:.0f}s", file=sys.stderr)
    print("| weights | bytes | logits cosine vs bf16 | top-1 agreement | " + " | ".join(FAMILIES) + " | mean |")
    print("|---|---|---|---|" + "---|" * (len(FAMILIES) + 1))
    for name, size, cos, top1, em in rows:
        mean = sum(em.values()) / len(em)
        print(f"| {name} | {size:,} | {cos:.4f} | {top1:.4f} | " + " | ".join(f"{em[f]:.2f}" for f in FAMILIES)
              + f" | {mean:.3f} |")


if __name__ == "__main__":
    main()
