"""Probe: where bench_e2e's section (a) spends a generation's time outside its denoise steps (one GPU, ~2 min a kind).

    PYTHONPATH=src:. python -m bench.probes.probe_e2e [--kinds q4,bf16] [--json out.json] [--traces DIR]

Per kind, full size, random weights, balanced routing, a 1k prompt and bench_e2e's fixed-step settings (16 steps,
4 blocks of one canvas): the GPU time by kernel family of (1) the graphed denoise step alone, (2) the graphed
256-token commit alone (its attention on the flash kernel and on the tile kernels), (3) one whole
generate under the CUDA activity profiler, per forward; and where the GPU sits idle during that generate (no kernel
on any stream), charged to the pair of kernel families around each interval; and each step's run-ahead answer.
So the loop's extra time per forward splits into kernels the step does not have (sampler, SC, commit) and idle GPU
(the host's turn-around).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
from dataclasses import replace
import sys
from pathlib import Path

import torch

from bench.bench_e2e import BLOCKS, STEPS, fixed_steps, timed
from bench.probes.probe_step import family, idle_report, profile_replays, report
from bench.runner import dumper, log, run_kinds, shapes
from diffgemma.generation import generate
from diffgemma.model.denoiser import StagedDenoiser


def kernel_families(trace: str, per: float) -> dict:
    ev = [e for e in json.loads(Path(trace).read_text())["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    fams = collections.defaultdict(lambda: [0.0, 0])
    for e in ev:
        f = fams[family(e["name"])]
        f[0] += e["dur"]
        f[1] += 1
    log(f"  kernels per forward: {sum(v[0] for v in fams.values()) / per / 1e3:.3f} ms")
    for k, (us, n) in sorted(fams.items(), key=lambda kv: -kv[1][0]):
        log(f"    {k:38s} {us / per / 1e3:8.3f} ms {n / per:7.1f} launches")
    return {k: {"ms": v[0] / per / 1e3, "launches": v[1] / per} for k, v in fams.items()}


def go_flags(eng, cache, prompt_len, s) -> list:
    """Each step's run-ahead answer (StepStatus.go: True = the next forward was launched before the host read; None =
    no speculative plan, so nothing was staged) over one more generate."""
    seen = []
    orig = StagedDenoiser.read_status

    def read_status(self, *a, **k):
        st = orig(self, *a, **k)
        seen.append(st.go)
        return st
    StagedDenoiser.read_status = read_status
    try:
        cache.truncate(prompt_len)
        generate(eng, [], settings=s, cache=cache)
    finally:
        StagedDenoiser.read_status = orig
    log(f"  go per step: {collections.Counter(seen)}")
    return seen


def step_intervals(eng, cache, prompt_len, s) -> list:
    """Host time between consecutive steps' status reads (each waits for its step on the GPU), per block: ms."""
    import time
    from diffgemma.generation import StepEvent, generate_stream

    cache.truncate(prompt_len)
    blocks, last = {}, None
    for ev in generate_stream(eng, [], settings=s, cache=cache):
        if isinstance(ev, StepEvent):
            t = time.perf_counter()
            if last is not None and ev.step > 1:
                blocks.setdefault(ev.block, []).append((t - last) * 1e3)
            last = t
    return [round(sum(v) / len(v), 3) for _, v in sorted(blocks.items())]


def variants(eng, cache, prompt_len, s) -> dict:
    """Mean step interval per block with the run-ahead as built, with plain graphs (inputs staged, nothing launched
    ahead) and without any run-ahead."""
    out = {}
    for name, kw in (("default", {}), ("plain_graphs", {"guarded_graphs": False}), ("no_run_ahead", {"run_ahead": False})):
        old = eng.options
        eng.options = replace(old, **kw)
        eng.clear_graphs()  # a graph keeps the form it was captured with
        try:
            step_intervals(eng, cache, prompt_len, s)  # warm (captures)
            out[name] = step_intervals(eng, cache, prompt_len, s)
        finally:
            eng.options = old
        log(f"  step interval per block, {name}: {out[name]} ms")
    return out


def probe(eng, kind: str, cfg, dev, trace_dir: str, prompt_len: int = 1024) -> dict:
    from torch.profiler import ProfilerActivity, profile

    C, V = cfg.canvas_length, cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (prompt_len,), generator=gen).to(dev)
    block = torch.randint(0, V, (C,), generator=gen).to(dev)
    canvas = torch.randint(0, V, (C,), generator=gen).to(dev)
    out = {}
    cache = eng.new_cache(prompt_len + (BLOCKS + 1) * C, rewind_slack=BLOCKS * C)
    eng.prefill(cache, prompt)
    sce = eng.embed(canvas)
    step = lambda: eng.denoise_raw(cache, canvas, sc_embeds=sce)  # noqa: E731
    step()
    wall, per = profile_replays(step, 5)
    out["step"] = report(f"{kind} denoise step", wall, wall, per)

    def commit():
        cache.truncate(prompt_len)
        eng.prefill(cache, block)
    for rows in (0, C):  # the commit's attention on the flash kernel, then on the tile kernels
        old = eng.options
        eng.causal_tiles_rows = rows
        try:
            commit()
            wall, per = profile_replays(commit, 5)
            out[f"commit_tiles_{rows}"] = report(f"{kind} graphed commit (truncate + prefill), causal_tiles_rows "
                                                 f"{rows}", wall, wall, per)
        finally:
            eng.options = old

    s = fixed_steps(C, BLOCKS)
    for _ in range(2):
        cache.truncate(prompt_len)
        ms = timed(dev, lambda: generate(eng, [], settings=s, cache=cache))
    forwards = BLOCKS * STEPS
    log(f"\n== {kind} generate: {ms:.1f} ms unprofiled, {ms / forwards:.3f} ms per forward")
    cache.truncate(prompt_len)
    trace = f"{trace_dir}/probe_e2e_{kind}.json"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gms = timed(dev, lambda: generate(eng, [], settings=s, cache=cache))
    prof.export_chrome_trace(trace)
    log(f"  profiled: {gms:.1f} ms, {gms / forwards:.3f} ms per forward")
    out["generate"] = {"ms": ms, "ms_profiled": gms, "families": kernel_families(trace, forwards)}
    out["generate"]["idle"] = idle_report(trace, forwards, top=20, max_gap=1e9)
    out["generate"]["go"] = go_flags(eng, cache, prompt_len, s)
    out["variants"] = variants(eng, cache, prompt_len, s)
    subprocess.run(["gzip", "-f", trace], check=False)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="q4,bf16")
    ap.add_argument("--json", default=None)
    ap.add_argument("--traces", default="/tmp", help="where the generate traces go (gzipped chrome traces)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_e2e.py needs a CUDA GPU")
    cfg, dev = shapes(False)
    res = {"gpu": torch.cuda.get_device_name()}
    run_kinds(a.kinds.split(","), cfg, dev, False, res, {"probe"},
              lambda eng, kind: [("probe", lambda: probe(eng, kind, cfg, dev, a.traces))], "balanced",
              dumper(res, a.json))


if __name__ == "__main__":
    main()
