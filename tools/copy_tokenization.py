"""Experiment: can the demo architecture copy an unseen one-token city name into a tool call, per tokenizer?

Behind MODEL_CARD.md's known gap: with the shipped byte-level BPE the request holds " Dublin" (one id) and the
call must write "Dublin" (another id), so an unseen name needs a per-word lookup; with spaces isolated
(build_tokenizer.py --isolate-spaces) both are the same id and the model only has to copy. This trains the
same small DemoModel from scratch, on CPU, once per tokenizer, on two families:
  call  "What's the weather in X?" -> <|tool_call>call:get_weather{city:<|"|>X<|"|>}<tool_call|><|tool_response>
  echo  "Say the word X."          -> X<turn|>
X: one-token words of that tokenizer (70%) and made-up multi-token names (30%). 12% of the names never appear
in a call target (split by hash, as demo_data does); echo has its own independent 12% held out. It reports
call exact match on held-out one-token names, split by whether echo wrote the word in training.

    python tools/copy_tokenization.py [--steps 1500] [--variant both|bytelevel|isolated] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import build_tokenizer  # noqa: E402
import demo_data  # noqa: E402
import train_demo as td  # noqa: E402

ARCH = dict(td.DEMO_TEXT_CONFIG, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            layer_types=[td.SLIDING, td.FULL], num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            global_head_dim=64, num_global_key_value_heads=1, moe_intermediate_size=64)
CANVAS = 32


def one_token_words(tok) -> list[str]:
    """Alphabetic strings that are one token where the call writes them (after <|"|>)."""
    words = set()
    for t in tok.get_vocab():
        w = t[1:] if t.startswith("\u0120") else t
        if w.isascii() and w.isalpha() and len(w) >= 3 and len(tok.encode(w).ids) == 1:
            words.add(w)
    return sorted(words)


def render(tok, template: str, user: str, target: str) -> tuple[list[int], list[int]]:
    from diffgemma.tokenizer import render_chat

    prompt = render_chat(template, [{"role": "user", "content": user}], tools=None, enable_thinking=False)
    return tok.encode(prompt).ids, tok.encode(target).ids


def call_text(city: str) -> str:
    return demo_data.tool_call_text("get_weather", {"city": city}) + demo_data.TOOL_RESPONSE_OPEN


def dataset(tok, template: str, words: list[str], n: int, seed: int):
    rng = random.Random(seed)
    names = words + demo_data.SYNTHETIC_CITIES[: int(len(words) * 0.43)]  # ~70% one-token words, 30% made up
    tool_train = [w for w in names if demo_data.split_of(f"city:{w}") == "train"]
    echo_train = [w for w in words if demo_data.split_of(f"echo:{w}") == "train"]
    rows = []
    for _ in range(n):
        if rng.random() < 0.6:
            c = rng.choice(tool_train)
            rows.append(render(tok, template, f"What's the weather in {c}?", call_text(c)))
        else:
            w = rng.choice(echo_train)
            rows.append(render(tok, template, f"Say the word {w}.", w + "<turn|>"))
    flat = [p + t for p, t in rows]
    lens = torch.tensor([len(s) for s in flat])
    return {"tokens": torch.tensor([i for s in flat for i in s]), "offset": torch.cumsum(lens, 0) - lens,
            "prompt_len": torch.tensor([len(p) for p, _ in rows]), "target_len": torch.tensor([len(t) for _, t in rows])}


def run(variant: str, steps: int, batch: int, seed: int = 0) -> dict:
    t0 = time.time()
    tok = build_tokenizer.build(2048, 20000, isolate_spaces=(variant == "isolated"))
    template = build_tokenizer.TEMPLATE_PATH.read_text()
    words = one_token_words(tok)
    data = dataset(tok, template, words, 60000, seed)
    torch.manual_seed(seed)
    model = td.DemoModel(td.Arch.from_dict(ARCH))
    batcher = td.Batcher(data, CANVAS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = 2e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * (1 - step / steps))
        ex, start = batcher.draw(batch, gen)
        prefix, n_pad, clean = batcher.block(ex, start)
        loss, _ = td.train_step(model, prefix, n_pad, clean, gen, 2048)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            losses.append((step, round(loss.item(), 4)))
            print(f"[{variant}] step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    held = [w for w in words if demo_data.split_of(f"city:{w}") == "heldout"]
    groups = {"echo-trained": [w for w in held if demo_data.split_of(f"echo:{w}") == "train"],
              "never written": [w for w in held if demo_data.split_of(f"echo:{w}") == "heldout"]}
    train_names = [w for w in words if demo_data.split_of(f"city:{w}") == "train"][:100]
    res = {"variant": variant, "one_token_words": len(words), "steps": steps, "batch": batch, "loss": losses}
    for label, names in list(groups.items()) + [("seen in calls (train)", train_names)]:
        prompts = [render(tok, template, f"What's the weather in {w}?", "")[0] for w in names]
        outs, _ = td.generate_batch(model, prompts, CANVAS, 2, torch.Generator().manual_seed(1))
        ok = sum(o == tok.encode(call_text(w)).ids for o, w in zip(outs, names))
        res[label] = f"{ok}/{len(names)}"
        print(f"[{variant}] {label}: {ok}/{len(names)}", flush=True)
    res["seconds"] = round(time.time() - t0)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--variant", default="both", choices=["both", "bytelevel", "isolated"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    variants = ["bytelevel", "isolated"] if a.variant == "both" else [a.variant]
    results = [run(v, a.steps, a.batch) for v in variants]
    print(json.dumps(results, indent=1))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
