"""Benchmark: what canvas frames (server/frames.py, `"diffgemma": {"frames": true}`) cost the server's tokens/s.

    PYTHONPATH=src:. python -m bench.bench_frames [--kind q4|bf16]    # JSON to $OUT/bench_frames.json (or --json)
    PYTHONPATH=src:. python -m bench.bench_frames --tiny             # the demo model on the CPU: a dry run

The real HTTP server (bench_serve.Served: the app served by uvicorn in this process; unless --tiny warmed up as
`serve` does on CUDA) over random full-size weights (bench_serve.build: q4 experts + q8 SC MLP, or bf16; balanced
expert routing), or with --tiny the embedded demo model. Every request does the same work: streamed chat
completions of a distinct --prompt-token prompt, fixed denoise steps a block, no early stop, no stop id
(bench_e2e.fixed_steps), so each reply is exactly --reply tokens.

Three sections (--sections picks some): solo, 1 client on a server stepping one request at a time (--max-batch 1:
the engine runs each next forward ahead of the step's turnaround); one and batched, 1 client and --clients clients
at once on a server stepping up to --batch requests together. In each, passes alternate between frames off and
frames on (off, on, off, on, ...; --passes of each, after one unmeasured pass of each, which leaves the prompts in
the slots' caches for all), so that drift falls on both arms: per arm the median aggregate tokens/s (reply tokens /
first request sent to last [DONE]), and on / off. The clients read every line but parse only the reply's chunks,
not the frames (a front end's parsing happens elsewhere). Also timed: the worker's side of frames (frames.snapshot,
the step's one device-to-host read), per step. The goal: frames on keep at least 0.95 of the tokens/s without
them, in every section.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx
import torch

from bench.bench_e2e import STEPS, fixed_steps
from bench.bench_serve import Served, build, concurrently

TINY = dict(clients=4, prompt=64, reply=128, steps=8, batch=4, passes=2)
FULL = dict(clients=8, prompt=1024, reply=1024, steps=STEPS, batch=8, passes=5)
GOAL = 0.95
SECTIONS = ("solo", "one", "batched")  # (the server's max batch, clients): (1, 1), (--batch, 1), (--batch, --clients)
FRAME = '"frame":{'  # in a frame chunk's diffgemma object; never in a reply's text, where JSON escapes the quotes


def log(*a):
    print(*a, flush=True)


def chat(url: str, content: str, max_tokens: int, seed: int, frames: bool, client: httpx.Client, out: dict) -> None:
    """One streamed chat completion; out gets its completion tokens (usage) and how many frame chunks came."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    if frames:
        body["diffgemma"] = {"frames": True}
    n_frames = 0
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if FRAME in line:  # counted, not parsed
                n_frames += 1
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    out["frames"] = n_frames


def one_pass(url: str, prompts: list[str], reply: int, frames: bool) -> dict:
    """Every prompt at once, a client thread each -> aggregate tokens/s and frames per request."""
    outs = [{} for _ in prompts]
    wall, _ = concurrently([lambda c, i=i, p=p, o=o: chat(url, p, reply, i, frames, c, o)
                            for i, (p, o) in enumerate(zip(prompts, outs))])
    if any("tokens" not in o for o in outs):
        raise RuntimeError("a client got no usage chunk (see the server's log)")
    if frames and not all(o["frames"] for o in outs):
        raise RuntimeError("a client asked for frames and got none")
    return {"wall_s": round(wall, 3), "tok_s": round(len(prompts) * reply / wall, 1),
            "frames_per_request": statistics.mean(o["frames"] for o in outs)}


def prompt_texts(tokenizer, rng, n: int, tokens: int) -> list[str]:
    """n distinct texts of about `tokens` tokens each, made of words the tokenizer reads back as one token each."""
    words = []
    for i in range(10, min(tokenizer.vocab_size, 4096)):
        w = tokenizer.decode([i]).strip()
        if w.isalpha() and tokenizer.encode(w) == [i]:
            words.append(w)
    if not words:
        raise RuntimeError("the tokenizer has no plain words to make prompts of")
    out = []
    for _ in range(n):
        text = ""
        while len(tokenizer.encode(text)) < tokens:
            text += "".join(" " + rng.choice(words) for _ in range(16))
        out.append(text)
    return out


def section(url: str, prompts: list[str], a) -> dict:
    arms = {False: [], True: []}
    # unmeasured: the first pass of each arm meets whatever is made on first use, and leaves each prompt in a slot's
    # cache, so that every measured pass of either arm reuses it alike (the measure is of the denoising)
    for frames in (False, True):
        one_pass(url, prompts, a.reply, frames)
    for _ in range(a.passes):
        for frames in (False, True):
            arms[frames].append(one_pass(url, prompts, a.reply, frames))
    off = round(statistics.median(p["tok_s"] for p in arms[False]), 1)
    on = round(statistics.median(p["tok_s"] for p in arms[True]), 1)
    out = {"clients": len(prompts), "off_tok_s": off, "on_tok_s": on, "ratio": round(on / off, 4),
           "frames_per_request": arms[True][-1]["frames_per_request"], "off": arms[False], "on": arms[True]}
    log(f"  {len(prompts)} client(s): off {off} tok/s, on {on} tok/s, on/off {out['ratio']}")
    return out


def timed_snapshots():
    """Wrap frames.snapshot (the worker's read of a step, looked up at each request) -> its timings list."""
    from diffgemma.server import frames

    plain, times = frames.snapshot, []

    def snapshot(event):
        t = time.perf_counter()
        frame = plain(event)
        times.append(time.perf_counter() - t)
        return frame

    frames.snapshot = snapshot
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="q4", choices=["q4", "bf16"])
    ap.add_argument("--tiny", action="store_true", help="the demo model on the CPU (a dry run of the script)")
    for name, help_ in (("clients", "concurrent clients of the batched section"), ("prompt", "prompt tokens"),
                        ("reply", "reply tokens per request"), ("steps", "denoise steps per block"),
                        ("batch", "the server's --max-batch"), ("passes", "measured passes per arm")):
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"{help_} (default {FULL[name]}; --tiny {TINY[name]})")
    ap.add_argument("--routing", default="balanced", choices=["balanced", "model"])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--json", default=None, help="default: $OUT/bench_frames.json where OUT is set")
    a = ap.parse_args()
    for k, v in (TINY if a.tiny else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    out_path = a.json or (str(Path(os.environ["OUT"]) / "bench_frames.json") if os.environ.get("OUT") else None)
    t = time.time()
    model, tokenizer = build(a)
    cap = getattr(model, "max_batch", 1)
    a.batch = a.batch if cap is None else min(a.batch, cap)
    log(f"model built in {time.time() - t:.1f}s ({type(model).__name__}, max_batch {cap})")
    C = model.config.canvas_length
    settings = fixed_steps(C, -(-a.reply // C)).replace(max_denoising_steps=a.steps, max_new_tokens=a.reply)
    rng = random.Random(0)
    prompts = prompt_texts(tokenizer, rng, a.clients, a.prompt)
    res: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not a.tiny else "cpu",
                 "model": "demo" if a.tiny else a.kind, "routing": a.routing, "prompt": a.prompt, "reply": a.reply,
                 "steps": a.steps, "canvas": C, "max_batch": a.batch, "passes": a.passes, "goal": GOAL}
    times = timed_snapshots()

    from contextlib import nullcontext

    from bench.balanced_routing import routing

    ctx = a.prompt + a.reply + 4 * C  # the prompt, the chat template's turn markers, the reply
    sections = [x for x in SECTIONS if x in a.sections.split(",")]
    with nullcontext() if a.tiny else routing(a.routing):
        for max_batch, names in ((1, ["solo"]), (a.batch, ["one", "batched"])):
            names = [n for n in names if n in sections]
            if not names:
                continue
            s = Served(model, tokenizer, settings, warm=not a.tiny, slots=1 if max_batch == 1 else a.clients,
                       max_tokens=ctx, max_batch=max_batch, max_queue=a.clients)
            url = s.url.replace("/v1/completions", "/v1/chat/completions")
            try:
                res[f"warm_up_s_max_batch_{max_batch}"] = s.warm_s
                for name in names:
                    res[name] = section(url, prompts if name == "batched" else prompts[:1], a)
                    res[name]["max_batch"] = max_batch
                    if out_path:
                        Path(out_path).write_text(json.dumps(res, indent=1))
            finally:
                s.close()
    res["snapshot_us"] = {"steps": len(times), "mean": round(statistics.mean(times) * 1e6, 1) if times else None,
                          "p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1) if times else None}
    res["ok"] = all(res[k]["ratio"] >= GOAL for k in sections)
    if out_path:
        Path(out_path).write_text(json.dumps(res, indent=1))
    log("\n| section | max batch | clients | frames off tok/s | frames on tok/s | on / off |")
    log("|---|---|---|---|---|---|")
    for k in sections:
        r = res[k]
        log(f"| {k} | {r['max_batch']} | {r['clients']} | {r['off_tok_s']} | {r['on_tok_s']} | {r['ratio']} |")
    log(f"frames.snapshot on the worker: {res['snapshot_us']} (microseconds a step)")
    verdict = "met" if res["ok"] else "NOT met"
    log(f"goal on/off >= {GOAL} in every section: {verdict}" + (f"; JSON: {out_path}" if out_path else ""))


if __name__ == "__main__":
    main()
