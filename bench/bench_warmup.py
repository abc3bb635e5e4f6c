"""Benchmark: what the first requests of a fresh server process cost, with and without the warm-up (warmup.py,
`serve --warmup`), at DiffusionGemma's full size (random bf16 weights, one GPU).

    PYTHONPATH=src python -m bench.bench_warmup [--json out.json]

Each arm is a fresh Python process (a server's start): it builds the engine, makes one slot's cache (8192 tokens),
optionally warms it up (timed), then serves four requests on that slot, each a seeded generate of up to 256 tokens
from an empty cache: a 1000-token prompt twice (context bucket 1024), then a 3000-token prompt twice (bucket 4096).
A request's time is wall clock, prompt in to tokens out. The second request of a pair is the steady state: the first
minus the second is what that bucket's first use cost (graph captures; kernel compiles).

Arms, in this order: Triton's kernel cache empty (a fresh install) without and with the warm-up, each on a new
empty TRITON_CACHE_DIR; then the first arm's cache reused (a restart) without and with the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 8192
REQUESTS = [("1k", 1000), ("1k again", 1000), ("3k", 3000), ("3k again", 3000)]


def child(warm: bool) -> dict:
    import torch

    from bench.bench_engine import CANVAS, TEXT
    from bench.fixtures import RandomSource
    from diffgemma.config import ModelConfig
    from diffgemma.generation import generate
    from diffgemma.model.engine import build_engine
    from diffgemma.settings import GenerationSettings
    from diffgemma.warmup import warm_up

    t0 = time.perf_counter()
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    eng = build_engine(cfg, RandomSource(cfg, "cuda", torch.bfloat16, seed=0), "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    r = {"warmup": warm, "build_s": time.perf_counter() - t0}
    s = GenerationSettings.resolve({}, env={}, overrides={"max_new_tokens": 256, "seed": 1})
    cache = eng.new_cache(MAX_TOKENS)
    if warm:
        r["warmup_s"] = warm_up(eng, cache, s)
    g = torch.Generator().manual_seed(3)
    prompts = {n: torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in sorted({n for _, n in REQUESTS})}
    r["requests"] = []
    for name, n in REQUESTS:
        cache.truncate(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = generate(eng, prompts[n], settings=s, cache=cache)
        torch.cuda.synchronize()
        r["requests"].append({"name": name, "s": time.perf_counter() - t, "forwards": out.forwards,
                              "tokens": len(out.tokens), "hash": hash(tuple(out.tokens))})
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["warm", "cold"], help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child == "warm")), flush=True)
        return
    import torch

    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench_warmup_"))
    first = root / "triton_a"
    arms = [("empty Triton cache", first, False), ("empty Triton cache", root / "triton_b", True),
            ("reused Triton cache", first, False), ("reused Triton cache", first, True)]
    results = []
    for label, tdir, warm in arms:
        env = dict(os.environ, TRITON_CACHE_DIR=str(tdir))
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "bench.bench_warmup", "--child", "warm" if warm else "cold"],
                           env=env, cwd=HERE.parent, capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            print(f"{label}, warm-up {warm}: failed (rc {p.returncode})\n{p.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(line[len("RESULT "):])
        r.update(label=label, process_s=time.perf_counter() - t)
        results.append(r)
        req = " | ".join(f"{q['name']} {q['s'] * 1e3:.0f} ms ({q['forwards']} fw)" for q in r["requests"])
        warm_s = f"warm-up {r['warmup_s']:.1f} s, " if warm else ""
        print(f"{label}, warm-up {'on' if warm else 'off'}: build {r['build_s']:.1f} s, {warm_s}{req}", flush=True)
    hashes = {tuple(q["hash"] for q in r["requests"]) for r in results}
    print(f"same tokens in every arm: {len(hashes) == 1}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
