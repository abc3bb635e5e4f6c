"""Benchmark: what a grammar costs a denoise step (docs/ARCHITECTURE.md, 'Constrained output'), full size, random
weights, one process.

    PYTHONPATH=src:. python -m bench.bench_constrained --json $OUT/constrained.json
    PYTHONPATH=src:. python -m bench.bench_constrained --tiny      # the demo model's shapes on the CPU: a dry run

After a prompt prefilled untimed, the same generation with and without a JSON-schema grammar; at batch size 1:
  fixed    every block runs exactly --steps steps (no early stop, no trim, no re-roll): ms per forward constrained
           against unconstrained, the ratio (the issue's bound: at most 1.10), and tokens per forward;
  default  the model's usual stop rules: tokens per forward and ms per forward of each;
  batch    generate_batch at --batches lanes, all constrained or none: ms per batched round, the ratio, and
           tokens per forward;
  hold     GrammarState.hold alone on a step's proposal and logits (the host walk, its masks, the device->host read),
           and the read's top-k alone (f32 and bf16 logits; every row or the frontier's; one or two stages).
Each constrained run also reports its holds' per-step split (hold_split): read_ms (the host's wait for the step's
one read: the forward and stats still running, then the copy), walk_ms (the host walk, its device masked argmaxes
included: the GPU idles through it), write_ms (the held tokens' write), choices_per_step (masked argmaxes) and
device_choices_per_step (those the read's candidates could not decide), resumed_per_step (walks resumed from the last
one's matcher). --candidates runs one constrained generation per entry: by default the frontier's rows (32@16, the
code's default and the bound's figure), every row (32), every row by a two-stage top-k (32/4096) and none (0);
--reference adds the reference walk (every masked argmax on the device over a bool mask): one run shows each part.
Random weights make the model's own JSON attempts meaningless (the grammar corrects nearly every position): this
measures cost, not quality. The tokenizer is the demo's with its vocabulary padded to the model's by synthetic
byte-level pieces (a 262144-token trie for llguidance's masks, as the real one is; no real tokenizer is needed).
Medians of --reps runs after one warm-up; CUDA-synchronised wall clock. The JSON is rewritten after each section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.balanced_routing import KINDS
from bench.runner import dumper, log, result_header, run_kinds, shapes, sync, with_fixtures
from diffgemma import grammars
from diffgemma.batch import generate_batch
from diffgemma.generation import generate
from diffgemma.loader import embedded_model_path
from diffgemma.sampling.constraint import GrammarState, best_candidates
from diffgemma.settings import GenerationSettings
from diffgemma.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                     "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "address"]}
TWO_STAGE = 4096  # the two-stage top-k's segment the default runs and the hold section time
_PIECES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + "Ġ" * 8 + ".,:;!?-_'\"(){}[]/"


def padded_tokenizer(vocab: int, directory: Path):
    """The demo tokenizer with its vocabulary padded to `vocab` ids by random byte-level pieces of 2..8 characters
    (written into `directory`, the demo's other tokenizer files beside it)."""
    src = embedded_model_path()
    for name in ("tokenizer_config.json", "chat_template.jinja", "config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, directory / name)
    spec = json.loads((src / "tokenizer.json").read_text())
    table = spec["model"]["vocab"]
    used = set(table.values()) | {t["id"] for t in spec["added_tokens"]}
    rng = random.Random(0)
    next_id = max(used) + 1
    while next_id < vocab:
        piece = "".join(rng.choice(_PIECES) for _ in range(rng.randint(2, 8)))
        if piece not in table:
            table[piece] = next_id
            next_id += 1
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return load_tokenizer(directory)


def settings(canvas: int, blocks: int, steps: int, fixed: bool, grammar: str | None) -> GenerationSettings:
    overrides = dict(max_denoising_steps=steps, max_new_tokens=blocks * canvas, seed=0, grammar=grammar)
    if fixed:
        overrides.update(confidence_threshold=0.0, plateau_steps=0, entropy_stop=0.0, confidence_trim=0.0,
                         empty_reply_retry=0)
    return GenerationSettings.resolve({}, env={}, overrides=overrides)


def run(eng, cache, prompt_len, s, reps):
    """-> (median wall s, the last result) of generate() from the prompt, over `reps` runs after a warm-up."""
    walls, result = [], None
    for i in range(reps + 1):
        cache.truncate(prompt_len)
        sync(eng.device)
        t = time.perf_counter()
        result = generate(eng, [], settings=s, cache=cache)
        sync(eng.device)
        if i:
            walls.append(time.perf_counter() - t)
    return statistics.median(walls), result


def walks(candidates: list[str], reference: bool) -> list[tuple[str, dict]]:
    """The constrained runs: (name, GrammarState attributes) per --candidates entry K[@R][/S] (the K best tokens of
    every row, or of the R rows from the frontier on; /S: a two-stage top-k over segments of S tokens), and the
    reference walk."""
    out = []
    for i, entry in enumerate(candidates):
        head, _, segment = entry.partition("/")
        k, _, rows = head.partition("@")
        attrs = {"candidates": int(k), "candidate_rows": int(rows) if rows else 1 << 30,
                 "topk_segment": int(segment or 0)}
        out.append(("constrained" if i == 0 else f"constrained_k{entry.replace('@', '_rows').replace('/', '_seg')}",
                    attrs))
    out.append(("constrained_plan_after", {**out[0][1], "plan_first": False}))  # the SC plan made after the hold
    return out + ([("constrained_reference", {"reference": True})] if reference else [])


@contextlib.contextmanager
def walk_as(attrs: dict):
    """GrammarState's class attributes set to `attrs` for the block (the generation makes its own GrammarState)."""
    old = {k: getattr(GrammarState, k) for k in attrs}
    for k, v in attrs.items():
        setattr(GrammarState, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(GrammarState, k, v)


def hold_split(timings: dict) -> dict:
    """The per-step split of a constrained generation's holds (GenerationResult.timings' grammar_* sums): the read's
    wait (the step's forward and stats still running, then the copy), the host walk and the write, in ms a step."""
    holds = max(timings.get("grammar_holds", 0), 1)
    return {"holds": int(timings.get("grammar_holds", 0)),
            **{f"{k}_ms": round(timings.get(f"grammar_{k}_s", 0.0) * 1e3 / holds, 4) for k in ("read", "walk",
                                                                                                 "write")},
            "choices_per_step": round(timings.get("grammar_choices", 0) / holds, 3),
            "device_choices_per_step": round(timings.get("grammar_device_choices", 0) / holds, 3),
            "resumed_per_step": round(timings.get("grammar_resumed", 0) / holds, 3)}


def section(eng, cfg, grammar, prompt_len, blocks, steps, reps, fixed, variants):
    dev, C, V = eng.device, cfg.canvas_length, cfg.vocab_size
    prompt = torch.randint(0, V, (prompt_len,), generator=torch.Generator().manual_seed(1)).to(dev)
    cache = eng.new_cache(prompt_len + (blocks + 1) * C, rewind_slack=blocks * C)
    eng.prefill(cache, prompt)
    out = {"prompt": prompt_len, "canvas": C, "blocks": blocks, "max_steps": steps}
    for name, g, attrs in [("unconstrained", None, {})] + [(n, grammar, a) for n, a in variants]:
        with walk_as(attrs):
            wall, r = run(eng, cache, prompt_len, settings(C, blocks, steps, fixed, g), reps)
        out[name] = {"wall_s": round(wall, 4), "forwards": r.forwards, "tokens": len(r.tokens),
                     "ms_per_forward": round(wall * 1e3 / max(r.forwards, 1), 3),
                     "tokens_per_forward": round(r.tokens_per_forward, 3), "block_ends": r.block_ends}
        if g is not None:
            out[name]["text"] = (r.text or "")[:400]
            out[name]["hold_split"] = hold_split(r.timings)  # the last rep's
            out[name]["step_ratio"] = round(out[name]["ms_per_forward"] / out["unconstrained"]["ms_per_forward"], 4)
        log(f"  {'fixed' if fixed else 'default'}/{name}: {out[name]}")
    out["step_ratio"] = out["constrained"]["step_ratio"]
    out["within_10_percent"] = out["step_ratio"] <= 1.10
    return out


def batch_section(eng, cfg, grammar, batches, prompt_len, steps, reps):
    """generate_batch at B lanes, one block at fixed steps, every lane constrained or none: ms per batched round
    (denoise time, prefill excluded, over the most forwards a lane ran) and tokens per forward, on reused caches."""
    dev, C, V = eng.device, cfg.canvas_length, cfg.vocab_size
    gen = torch.Generator().manual_seed(3)
    out = {}
    for B in batches:
        prompts = [torch.randint(0, V, (prompt_len,), generator=gen).tolist() for _ in range(B)]
        caches = [eng.new_cache(prompt_len + 2 * C) for _ in range(B)]
        row = out[str(B)] = {}
        for name, g in (("unconstrained", None), ("constrained", grammar)):
            s = settings(C, 1, steps, True, g)
            rounds, tokens, forwards = [], 0, 0
            for i in range(reps + 1):
                for c in caches:
                    c.truncate(0)
                res = generate_batch(eng, prompts, seeds=list(range(B)), settings=s, max_batch=B, caches=caches)
                sync(dev)
                if i:
                    den = max(r.timings["denoise_s"] for r in res)
                    rounds.append(den * 1e3 / max(r.forwards for r in res))
                    tokens, forwards = sum(len(r.tokens) for r in res), sum(r.forwards for r in res)
            row[name] = {"ms_per_round": round(statistics.median(rounds), 3),
                         "tokens_per_forward": round(tokens / max(forwards, 1), 3)}
        row["round_ratio"] = round(row["constrained"]["ms_per_round"] / row["unconstrained"]["ms_per_round"], 4)
        log(f"  batch B={B}: {row}")
        caches = None
        eng.clear_graphs()
    return out


def hold_section(eng, cfg, grammar, reps):
    """GrammarState.hold alone: a random proposal and random logits on the device (every position the grammar
    refuses from the first on: the most corrections a step makes), and with the proposal already valid."""
    dev, C, V = eng.device, cfg.canvas_length, cfg.vocab_size
    stop_ids = tuple(cfg.eos_token_ids)
    state = GrammarState(grammar, eng.tokenizer, V, stop_ids)
    gen = torch.Generator().manual_seed(2)
    proposal = torch.randint(0, V, (C,), generator=gen).to(dev)
    logits = torch.randn(C, V, generator=gen).to(dev)
    out = {}
    for name, prop in (("random_proposal", proposal), ("valid_proposal", None)):
        if prop is None:  # a proposal the grammar takes as it stands: the last hold's tokens
            _, prop = state.hold(proposal, logits)
        times = []
        for i in range(reps + 2):
            if i == 2:
                state.timings = dict.fromkeys(state.timings, 0)
            sync(dev)
            t = time.perf_counter()
            held, _ = state.hold(prop, logits)
            sync(dev)
            times.append((time.perf_counter() - t) * 1e3)
        out[name] = {"ms": round(statistics.median(times[2:]), 3), "held": int(held.sum()),
                     "split": hold_split({f"grammar_{k}": v for k, v in state.timings.items()})}
    for dtype in (torch.float32, torch.bfloat16):  # the read's top-k alone: every row or the frontier's, 1 or 2 stages
        for name, rows in (("", C), ("_frontier", min(GrammarState.candidate_rows, C))):
            for stages, segment in (("", 0), ("_two_stage", TWO_STAGE)):
                x, times = logits[:rows].to(dtype), []
                for _ in range(reps + 2):
                    sync(dev)
                    t = time.perf_counter()
                    best_candidates(x, max(GrammarState.candidates, 1), segment)
                    sync(dev)
                    times.append((time.perf_counter() - t) * 1e3)
                out[f"topk{name}{stages}_ms_{str(dtype)[6:]}"] = round(statistics.median(times[2:]), 3)
    log(f"  hold: {out}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="q4")
    ap.add_argument("--fixtures", default="flat")
    ap.add_argument("--sections", default="fixed,default,batch,hold")
    ap.add_argument("--batches", default="4,8", help="comma list of batch sizes for the batch section")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--json", default=None)
    k, rows = GrammarState.candidates, GrammarState.candidate_rows
    ap.add_argument("--candidates", default=f"{k}@{rows},{k},{k}/{TWO_STAGE},0",
                    help="comma list, one constrained run each (the first is 'constrained', the bound's figure): "
                         "K[@R][/S]: the hold read's K best tokens of every row, or @R of the R rows from the frontier "
                         "on; /S by a two-stage top-k over segments of S tokens")
    ap.add_argument("--reference", action="store_true",
                    help="also a constrained run with the reference walk (every masked argmax on the device)")
    ap.add_argument("--routing", default="balanced", choices=KINDS)
    ap.add_argument("--tiny", action="store_true", help="the demo model's shapes on the CPU (a dry run of the script)")
    a = ap.parse_args()
    kinds = with_fixtures([k for k in a.kinds.split(",") if k], a.fixtures)
    variants = walks([k for k in a.candidates.split(",") if k], a.reference)
    cfg, dev = shapes(a.tiny)
    prompt_len = 32 if a.tiny else 1024
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        tok = padded_tokenizer(cfg.vocab_size, Path(tmp))
        grammar = grammars.json_grammar(SCHEMA, tok.token_to_id)
        GrammarState(grammar, tok, cfg.vocab_size, tuple(cfg.eos_token_ids))  # the tokenizer's trie, made once
        log(f"tokenizer of {cfg.vocab_size} ids and its grammar tables: {time.time() - t:.1f}s")
        res = result_header(dev, a, schema=SCHEMA, steps=a.steps)
        dump = dumper(res, a.json)

        def jobs(eng, kind):
            eng.tokenizer = tok
            return (("fixed", lambda: section(eng, cfg, grammar, prompt_len, a.blocks, a.steps, a.reps, True,
                                              variants)),
                    ("default", lambda: section(eng, cfg, grammar, prompt_len, a.blocks, a.steps, a.reps, False,
                                                variants[:1])),
                    ("batch", lambda: batch_section(eng, cfg, grammar, [int(b) for b in a.batches.split(",")],
                                                    prompt_len, a.steps, a.reps)),
                    ("hold", lambda: hold_section(eng, cfg, grammar, a.reps)))

        run_kinds(kinds, cfg, dev, a.tiny, res, set(a.sections.split(",")), jobs, a.routing, dump)
    log("\n| kind | fixed: ms/forward unconstrained / constrained (ratio) | tokens/forward unconstrained / "
        "constrained | default: tokens/forward | hold ms random / valid |\n|---|---|---|---|---|")
    for kind in kinds:
        r = res.get(kind, {})
        f, d, h = r.get("fixed", {}), r.get("default", {}), r.get("hold", {})
        fu, fc = f.get("unconstrained", {}), f.get("constrained", {})
        log(f"| {kind} | {fu.get('ms_per_forward')} / {fc.get('ms_per_forward')} ({f.get('step_ratio')}) | "
            f"{fu.get('tokens_per_forward')} / {fc.get('tokens_per_forward')} | "
            f"{d.get('unconstrained', {}).get('tokens_per_forward')} / "
            f"{d.get('constrained', {}).get('tokens_per_forward')} | "
            f"{h.get('random_proposal', {}).get('ms')} / {h.get('valid_proposal', {}).get('ms')} |")
        for name, v in f.items():
            if isinstance(v, dict) and "hold_split" in v:
                log(f"| {kind} fixed/{name} | ratio {v['step_ratio']} | split {v['hold_split']} | | |")
        for B, row in r.get("batch", {}).items():
            log(f"| {kind} B={B} | round ms {row['unconstrained']['ms_per_round']} / "
                f"{row['constrained']['ms_per_round']} ({row['round_ratio']}) | "
                f"{row['unconstrained']['tokens_per_forward']} / {row['constrained']['tokens_per_forward']} | | |")


if __name__ == "__main__":
    main()
