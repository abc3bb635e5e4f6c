"""Probe: where `generate`'s time outside the forwards goes, and whether seeded runs repeat (one GPU, ~1 min each).

    PYTHONPATH=src python -m bench.probes.probe_generate timeline      # CUDA events at the loop's seams, per step
    PYTHONPATH=src python -m bench.probes.probe_generate side          # overhead with the bookkeeping stream on / off
    PYTHONPATH=src python -m bench.probes.probe_generate repeat        # seeded full-size generates: the same tokens?
    PYTHONPATH=src python -m bench.probes.probe_generate gather        # the SC gather kernels against index_add_

All on the full-size architecture with random weights and balanced routing (as bench_engine.py). `timeline`
records CUDA events around the forward, the row stats, the SC plan, the status read and the SC product (no
profiler, whose host overhead would stretch every gap) and prints per-seam GPU and host medians. `side` runs
bench_engine's overhead measure alternately with the second stream on and off. `repeat` runs one seeded
generate several times on fresh caches, then again after filling the allocator's free memory with NaN (weak:
later allocations first reuse the blocks the previous run cached), and prints a hash of every step's draft
and of the tokens, comparable across processes: run it plain, under CUDA_LAUNCH_BLOCKING=1, with
`--fill-uninitialized` (torch's deterministic mode, every new tensor filled with NaN / max int), `--no-side`
or `--plain-generate` (generate() itself, no per-step clone).
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time

import torch

import bench.bench_engine as B
import diffgemma.generation as G
from bench.fixtures import RandomSource
from diffgemma.config import ModelConfig
from diffgemma.model import denoiser as D
from diffgemma.sampling import self_condition as SC
from diffgemma.sampling import stats as ST


def full_size_engine():
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": B.TEXT, "canvas_length": B.CANVAS})
    return cfg, B.build_engine(cfg, RandomSource(cfg, "cuda", torch.bfloat16, seed=0), "cuda", torch.bfloat16)


class _NoSide(D.SideStream):
    """The loop's bookkeeping on the main stream (the A/B twin of the side stream)."""

    def __init__(self, device):
        self.stream = None


def timeline():
    cfg, eng = full_size_engine()
    prompt = torch.randint(0, cfg.vocab_size, (1024,), device="cuda")
    cache = eng.new_cache(4096)
    marks = []

    def mark(label):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((label, e, time.perf_counter()))

    def wrap(obj, name, label):
        orig = getattr(obj, name)

        def f(*a, **k):
            mark(label + ">")
            r = orig(*a, **k)
            mark("<" + label)
            return r
        setattr(obj, name, f)

    with B.routing("balanced"):
        G.generate(eng, prompt, seed=0, max_new_tokens=256, cache=cache)  # warm: graphs, compiles
        wrap(eng, "denoise", "fwd")
        wrap(D, "read_status", "read")
        wrap(ST.StepStats, "__init__", "stats")
        wrap(SC.SparsePlan, "__init__", "plan")
        wrap(SC.SparsePlan, "start", "product")
        wrap(SC.SparsePlan, "soft_embed", "embed")
        for rep in range(2):
            marks.clear()
            cache.truncate(0)
            torch.cuda.synchronize()
            out = G.generate(eng, prompt, seed=1, max_new_tokens=256, cache=cache)
            torch.cuda.synchronize()
            seams = collections.defaultdict(list)
            for (l1, e1, h1), (l2, e2, h2) in zip(marks, marks[1:]):
                seams[f"{l1} -> {l2}"].append((e1.elapsed_time(e2) * 1e3, (h2 - h1) * 1e6))
            print(f"run {rep}: {out.forwards} forwards")
            for k, v in sorted(seams.items(), key=lambda kv: -sum(g for g, _ in kv[1])):
                print(f"  {k:28s} n={len(v):3d}  GPU median {statistics.median(g for g, _ in v):9.1f} us"
                      f"  host median {statistics.median(h for _, h in v):9.1f} us")


def side(reps: int):
    _, eng = full_size_engine()
    real = D.SideStream
    res = {"side": [], "no side": []}
    try:
        with B.routing("balanced"):
            for _ in range(reps):
                for name, cls in (("side", real), ("no side", _NoSide)):
                    D.SideStream = cls
                    r = B.bench_generate(eng)
                    res[name].append(r["outside_ms_per_step"])
                    print(f"{name}: {r['outside_ms_per_step']:.3f} ms/step outside ({r['outside_share'] * 100:.2f} %)",
                          flush=True)
    finally:
        D.SideStream = real
    for name, v in res.items():
        print(f"{name}: median {statistics.median(v):.3f} ms/step over {len(v)} runs")


def repeat(runs: int, fill_uninitialized: bool, no_side: bool, plain_generate: bool = False, prompt_len: int = 300,
           cache_len: int = 2048):
    """Seeded generates on fresh caches: per run, a hash of every step's draft and the first step that differs
    from the last plain run. The hashes are comparable across processes (the same seeds build the same model),
    so runs under CUDA_LAUNCH_BLOCKING=1 (no concurrency: a race cannot show) or --fill-uninitialized (a read
    of unwritten memory shows) can be set against a plain process's."""
    import hashlib

    if fill_uninitialized:  # every torch.empty filled with NaN (floats) / the max (ints): unwritten reads show
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    if no_side:
        D.SideStream = _NoSide
    cfg, eng = full_size_engine()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(11)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), device="cuda", generator=gen)
    print(f"prompt {hashlib.sha1(prompt.cpu().numpy().tobytes()).hexdigest()[:12]} ({prompt_len} tokens)", flush=True)

    def poison():
        free, _ = torch.cuda.mem_get_info()
        x = torch.empty(int(free * 0.8) // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))
        del x

    runs_out = []
    with B.routing("balanced"):
        for kind in ["plain"] * runs + ["after NaN fill"]:
            if kind != "plain":
                poison()
            cache = eng.new_cache(cache_len)
            drafts = []
            if plain_generate:  # the loop exactly as a user calls it: no per-step clone, final tokens only
                res = G.generate(eng, prompt, seed=3, max_new_tokens=256, cache=cache)
                toks, drafts = res.tokens, [torch.tensor(res.steps_per_block)]
            else:
                for ev in G.generate_stream(eng, prompt, seed=3, max_new_tokens=256, cache=cache):
                    if isinstance(ev, G.StepEvent):
                        drafts.append(ev.draft.clone())  # no host read inside the loop: it would change the timing
                    elif isinstance(ev, G.DoneEvent):
                        toks = ev.result.tokens
            drafts = [hashlib.sha1(d.cpu().numpy().tobytes()).hexdigest()[:8] for d in drafts]
            runs_out.append((kind, drafts, hashlib.sha1(str(toks).encode()).hexdigest()[:12]))
            del cache
            gc.collect()  # the cache's graphs go with it (a cycle would keep their pool alive into the next run)
    ref = runs_out[-2][1]
    for i, (kind, d, h) in enumerate(runs_out):
        first = next((j + 1 for j, (a, b) in enumerate(zip(d, ref)) if a != b), None)
        same = "same steps as the last plain run" if d == ref else f"first step differing from the last plain run: {first}"
        print(f"run {i} ({kind}): tokens {h}, {len(d)} steps, " + same
              + f"; step hashes {' '.join(d[:6])} ...", flush=True)


def gather():
    from bench.bench_engine import time_cuda
    from diffgemma.ops import sc_gather as g

    V, H, R = 262144, 2816, 256
    E = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    for label, per_row, flat in (("even 8/row", 8, 0), ("even 90/row", 90, 0), ("one row 20000 + 10/row", 10, 20000)):
        counts = torch.full((R,), per_row, device="cuda", dtype=torch.int64)
        counts[3] += flat
        rows = torch.repeat_interleave(torch.arange(R, device="cuda"), counts)
        cols = torch.randint(0, V, (rows.shape[0],), device="cuda")
        w = torch.rand(rows.shape[0], device="cuda")
        k = statistics.median(time_cuda(lambda: g.segment_embed_triton(counts, cols, w, E), reps=20, warmup=2)) * 1e3
        ia = statistics.median(time_cuda(lambda: g.segment_embed_ref(rows, cols, w, E, R, 2979), reps=20,
                                         warmup=2)) * 1e3
        same = torch.equal(g.segment_embed_triton(counts, cols, w, E), g.segment_embed_triton(counts, cols, w, E))
        print(f"{label}: n={rows.shape[0]} kernels {k:.1f} us, index_add_ {ia:.1f} us, two runs equal: {same}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["timeline", "side", "repeat", "gather"])
    ap.add_argument("--reps", type=int, default=3, help="side: alternations; repeat: plain runs")
    ap.add_argument("--fill-uninitialized", action="store_true",
                    help="repeat: torch's deterministic mode, new tensors filled")
    ap.add_argument("--no-side", action="store_true", help="repeat: the bookkeeping on the main stream")
    ap.add_argument("--plain-generate", action="store_true", help="repeat: generate() itself, final tokens only")
    ap.add_argument("--prompt-len", type=int, default=300, help="repeat: prompt tokens")
    ap.add_argument("--cache", type=int, default=2048, help="repeat: cache tokens")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_generate.py needs a CUDA GPU")
    {"timeline": timeline, "side": lambda: side(a.reps), "gather": gather,
     "repeat": lambda: repeat(a.reps, a.fill_uninitialized, a.no_side, a.plain_generate, a.prompt_len, a.cache)}[a.what]()


if __name__ == "__main__":
    main()
