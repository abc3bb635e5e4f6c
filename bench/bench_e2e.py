"""Benchmark: end-to-end generation on the fast engine, full size, random weights, one process.

    PYTHONPATH=src:. python -m bench.bench_e2e [--kinds q4,bf16] [--sections a,b,c] [--reps 3] [--json out.json]
    PYTHONPATH=src:. python -m bench.bench_e2e --tiny      # the demo model's shapes on the CPU: a dry run

Per engine kind (bf16: bench.fixtures.RandomSource; q4: RandomPackSource, q4 experts and a q8 SC MLP), with balanced
expert routing (balanced_routing.py) unless --routing model:
  a  generation at 16 fixed denoise steps a block (every early stop off), 4 blocks of one canvas, after a 1k prompt
     that is prefilled untimed: tokens/s, ms per forward, against the denoise step alone (graph replay) and the
     256-token commit alone, both timed in the same run; once with the eager (unpadded) commit and once with the
     graphed one (EngineOptions.padded_prefill False / True). generate() is given the cache, so all 4 blocks are
     committed (a one-shot generate skips the last block's commit).
  b  time to first block for 1k / 8k / 32k prompts: from the prompt's prefill to the end of the first block's last
     step (the block's commit excluded), on a cache reused across repeats (its graphs captured once); and the
     prompt's prefill alone, tokens/s.
  c  a 3-turn chat through Session (KV reuse: each turn prefills only what the cache lacks): seconds per turn,
     each turn 1 block at 16 steps, with the demo model's tokenizer and chat template.
  profile  the fixture's rows (bench/fixtures.logit_profile): median row entropy and SC survivors per row.
Each kind runs per fixture (--fixtures, bench/fixtures.py): "q4" the flat one (random weights, as always), "q4-peaked"
rows peaked as a trained model's.
Medians of --reps repeats after one warm-up; CUDA-synchronised wall clock. The JSON is rewritten after each
section, so a time-out keeps what finished; a short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from contextlib import contextmanager

import torch

from bench.balanced_routing import KINDS
from bench.fixtures import logit_profile
from bench.runner import dumper, log, result_header, run_kinds, shapes, sync, with_fixtures
from diffgemma.generation import StepEvent, generate, generate_stream
from diffgemma.loader import embedded_model_path
from diffgemma.session import Session
from diffgemma.settings import GenerationSettings
from diffgemma.tokenizer import load_tokenizer

VLLM_FP8_TOK_S = 1288  # vLLM's published DiffusionGemma FP8 figure at batch 1 (16 fixed steps, prompt excluded)
BLOCKS = 4
STEPS = 16


def fixed_steps(canvas: int, blocks: int, seed: int = 0, **kw) -> GenerationSettings:
    """Every block runs exactly STEPS steps and keeps its whole canvas: no early stop, no trim, no stop id, no
    re-roll (docs/ARCHITECTURE.md, 'Generation contract')."""
    return GenerationSettings.resolve({}, env={}, overrides=dict(
        max_denoising_steps=STEPS, confidence_threshold=0.0, plateau_steps=0, entropy_stop=0.0, confidence_trim=0.0,
        empty_reply_retry=0, stop_ids=[], max_new_tokens=blocks * canvas, seed=seed, **kw))


def median(xs):
    return round(statistics.median(xs), 3)


@contextmanager
def commit_mode(eng, padded: bool):
    old = eng.options
    eng.padded_prefill = padded
    try:
        yield
    finally:
        eng.options = old


def timed(dev, fn) -> float:
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    return (time.perf_counter() - t) * 1e3


def section_a(eng, cfg, prompt_len, reps):
    dev, C, V = eng.device, cfg.canvas_length, cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (prompt_len,), generator=gen).to(dev)
    block = torch.randint(0, V, (C,), generator=gen).to(dev)
    canvas = torch.randint(0, V, (C,), generator=gen).to(dev)
    s = fixed_steps(C, BLOCKS)
    # the slack lets each run rewind its 4 blocks back to the prompt (the ring keeps that many old window positions)
    cache = eng.new_cache(prompt_len + (BLOCKS + 1) * C, rewind_slack=BLOCKS * C)
    out = {"prompt": prompt_len, "blocks": BLOCKS, "steps": STEPS, "canvas": C}
    # the step alone: the denoise forward generate runs (SC embeddings; graphed on CUDA)
    with commit_mode(eng, False):
        eng.prefill(cache, prompt)
    sce = eng.embed(canvas)
    step = [timed(dev, lambda: eng.denoise_raw(cache, canvas, sc_embeds=sce)) for _ in range(reps + 2)][2:]
    out["step_ms"] = median(step)
    for name, padded in (("eager", False), ("graphed", True)):
        with commit_mode(eng, padded):
            def commit():
                eng.prefill(cache, block)
            commits = []
            for i in range(reps + 1):
                cache.truncate(prompt_len)
                ms = timed(dev, commit)
                if i:
                    commits.append(ms)
            runs = []
            for i in range(reps + 1):
                cache.truncate(prompt_len)
                sync(dev)
                t = time.perf_counter()
                r = generate(eng, [], settings=s, cache=cache)
                sync(dev)
                wall = time.perf_counter() - t
                assert r.forwards == BLOCKS * STEPS and len(r.tokens) == BLOCKS * C, (r.forwards, len(r.tokens))
                if i:
                    runs.append(wall)
                tokens = r.tokens
            w = statistics.median(runs)
            out[name] = {"commit_ms": median(commits), "wall_s": round(w, 4),
                         "tok_s": round(BLOCKS * C / w, 1), "ms_per_forward": round(w * 1e3 / (BLOCKS * STEPS), 3),
                         "tokens_hash": hash(tuple(tokens)) & 0xFFFFFFFF}
            out[name]["forward_over_step"] = round(out[name]["ms_per_forward"] / out["step_ms"], 3)
            out[name]["commit_over_step"] = round(out[name]["commit_ms"] / out["step_ms"], 3)
        log(f"  a/{name}: {out[name]}")
    out["same_tokens"] = out["eager"]["tokens_hash"] == out["graphed"]["tokens_hash"]
    log(f"  a: step {out['step_ms']} ms; same tokens eager/graphed commit: {out['same_tokens']}")
    return out


def section_b(eng, cfg, prompts, reps):
    dev, C, V = eng.device, cfg.canvas_length, cfg.vocab_size
    s = fixed_steps(C, 1)
    out = {}
    for T in prompts:
        prompt = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(T)).to(dev)
        cache = eng.new_cache(T + 2 * C)
        firsts, prefills = [], []
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for i in range((reps if T <= 32768 else 1) + 1):  # long prompts: one timed run after the warm one
            cache.truncate(0)
            pf = timed(dev, lambda: eng.prefill(cache, prompt))
            cache.truncate(0)
            sync(dev)
            t = time.perf_counter()
            first = None
            for ev in generate_stream(eng, prompt, settings=s, cache=cache):
                if first is None and isinstance(ev, StepEvent) and ev.stop_reason is not None:
                    first = (time.perf_counter() - t) * 1e3  # the step's status read has waited for the GPU
            if i:
                firsts.append(first)
                prefills.append(pf)
        out[str(T)] = {"first_block_ms": median(firsts), "prefill_ms": median(prefills),
                       "prefill_tok_s": round(T / statistics.median(prefills) * 1e3, 1),
                       "kv_gib": round(sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values]) / 2**30, 3),
                       "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None}
        log(f"  b/{T}: {out[str(T)]}")
        del cache
        gc.collect()
    return out


class WrappedTokenizer:
    """The demo tokenizer for a model with a larger vocabulary: ids past its own decode as id mod its size (random
    weights make any id)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, *a, **kw):
        return self._tok.decode([int(i) % self._tok.vocab_size for i in ids], *a, **kw)


def section_c(eng, cfg, reps, max_tokens):
    C = cfg.canvas_length
    s = fixed_steps(C, 1)
    eng.tokenizer = WrappedTokenizer(load_tokenizer(embedded_model_path()))
    turns = ["Hello! Tell me about block diffusion language models in a few sentences.",
             "Now compare them with autoregressive decoding: speed, quality and memory. " * 4,
             "Summarise our conversation as a list of three points, then suggest a follow-up question. " * 8]
    per = [[] for _ in turns]
    for i in range(reps + 1):
        sess = Session(eng, max_tokens=max_tokens, system="You are a concise assistant.")
        for j, text in enumerate(turns):
            sync(eng.device)
            t = time.perf_counter()
            sess.ask(text, settings=s)
            sync(eng.device)
            if i:
                per[j].append((time.perf_counter() - t) * 1e3)
        del sess
    eng.tokenizer = None
    out = {f"turn{j + 1}_ms": median(x) for j, x in enumerate(per)}
    log(f"  c: {out}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="q4,bf16")
    ap.add_argument("--sections", default="a,b,c,profile")
    ap.add_argument("--fixtures", default="flat,peaked", help="comma list of bench/fixtures.py's FIXTURES: each kind "
                    "runs per fixture, 'q4' the flat one (its results' old name), 'q4-peaked' the peaked one")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", default=None, help="comma list of prompt lengths for b (default 1024,8192,32768; "
                    "--prompts 131072,261632: the model's long range, 256k less the two canvases the cache also holds)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--routing", default="balanced", choices=KINDS)
    ap.add_argument("--tiny", action="store_true", help="the demo model's shapes on the CPU (a dry run of the script)")
    a = ap.parse_args()
    kinds = with_fixtures([k for k in a.kinds.split(",") if k], a.fixtures)
    cfg, dev = shapes(a.tiny)
    prompt_a, prompts = (32, [32, 64, 128]) if a.tiny else (1024, [1024, 8192, 32768])
    if a.prompts:
        prompts = [int(x) for x in a.prompts.split(",")]
    res = result_header(dev, a, vllm_fp8_tok_s=VLLM_FP8_TOK_S)
    run_kinds(kinds, cfg, dev, a.tiny, res, set(a.sections.split(",")),
              lambda eng, kind: (("a", lambda: section_a(eng, cfg, prompt_a, a.reps)),
                                 ("b", lambda: section_b(eng, cfg, prompts, a.reps)),
                                 ("c", lambda: section_c(eng, cfg, a.reps, 4096)),
                                 ("profile", lambda: logit_profile(eng, cfg, prompt_a))),
              a.routing, dumper(res, a.json))

    log("\n| kind | step ms | commit ms eager / graphed | tok/s eager / graphed | ms/forward eager / graphed "
        "| first block ms (prompts) | chat turn ms |\n|---|---|---|---|---|---|---|")
    for kind in kinds:
        r = res.get(kind, {})
        ra, rb, rc = r.get("a", {}), r.get("b", {}), r.get("c", {})
        e, g = ra.get("eager", {}), ra.get("graphed", {})
        fb = " / ".join(f"{k}: {v['first_block_ms']}" for k, v in rb.items())
        log(f"| {kind} | {ra.get('step_ms')} | {e.get('commit_ms')} / {g.get('commit_ms')} | {e.get('tok_s')} / "
            f"{g.get('tok_s')} | {e.get('ms_per_forward')} / {g.get('ms_per_forward')} | {fb} | "
            f"{' / '.join(str(v) for v in rc.values())} |")


if __name__ == "__main__":
    main()
