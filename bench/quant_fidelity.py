"""Fidelity of each pack profile on the embedded demo model (CPU): logits vs bf16, held-out accuracy.

For each profile: quantize the demo checkpoint, load the pack through diffgemma.load (dequantizing CPU
path), and measure (1) cosine and top-1 agreement of denoise logits against the unquantized model on
held-out prompts with random canvases, and (2) exact match of diffgemma.generate on held-out prompts.

    python bench/quant_fidelity.py [--per-family 12] [--profiles q4,q5,q6,nvfp4,nvfp4x]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-family", type=int, default=12)
    ap.add_argument("--profiles", default="q4,q5,q6,nvfp4,nvfp4x")
    args = ap.parse_args()
    src = embedded_model_path()
    base = diffgemma.load(src)
    items = prompts(base.tokenizer, args.per_family)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"demo model, {len(items)} held-out prompts ({', '.join(FAMILIES)}), CPU, torch {torch.__version__}, "
          f"commit {commit}")
    rows = [("bf16 (source)", src.joinpath("model.safetensors").stat().st_size, 1.0, 1.0, exact_match(base, items))]
    with tempfile.TemporaryDirectory() as tmp:
        for profile in args.profiles.split(","):
            t = time.time()
            out = Path(tmp) / profile
            quantize(src, out, profile=profile, progress=False)
            size = sum(p.stat().st_size for p in out.iterdir() if p.name.startswith("model.pack"))
            model = diffgemma.load(out)
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
