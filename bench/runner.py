"""What the full-size benches share: the model's shapes (full size on CUDA, or the demo's shrunk for a CPU dry run),
an engine of random weights per kind, and the loop that runs each kind's sections.

A section is a name and a function of the engine; its result (or its error, with the traceback printed) goes into
the bench's result dict under the kind, the JSON is rewritten after each section, so a time-out keeps what finished,
and each kind's engine is freed before the next one is built.
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from pathlib import Path

import torch

from bench.balanced_routing import routing
from bench.bench_engine import CANVAS, TEXT
from bench.fixtures import FIXTURES, RandomPackSource, RandomSource
from diffgemma.config import ModelConfig
from diffgemma.loader import embedded_model_path
from diffgemma.model.engine import build_engine
from diffgemma.model.engine_weights import Fp8QuantizedSource


def log(*a):
    print(*a, flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def call_times(dev, fn, reps: int, setup=None) -> list[float]:
    """ms of each of `reps` synchronised calls after two warm-up calls; setup(), if given, before each, untimed."""
    out = []
    for i in range(reps + 2):
        if setup is not None:
            setup()
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        if i >= 2:
            out.append((time.perf_counter() - t) * 1e3)
    return out


def shapes(tiny: bool) -> tuple[ModelConfig, torch.device]:
    """The full-size architecture on CUDA, or (tiny) the demo model's shapes on the CPU with a 4096-token vocabulary,
    two layers and a canvas of 8: a dry run of a bench's code."""
    if tiny:
        tc = json.loads((embedded_model_path() / "config.json").read_text())["text_config"]
        text = dict(tc, vocab_size=4096, num_hidden_layers=2, layer_types=tc["layer_types"][-2:])
        canvas, dev = 8, torch.device("cpu")
    else:
        text, canvas, dev = TEXT, CANVAS, torch.device("cuda")
    return ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": canvas}), dev


def fixture_list(text: str) -> list[str]:
    """A --fixtures comma list, checked against bench/fixtures.py's FIXTURES."""
    fixtures = [f for f in text.split(",") if f]
    bad = [f for f in fixtures if f not in FIXTURES]
    if bad or not fixtures:
        raise ValueError(f"fixtures {fixtures}: expected a comma list of {FIXTURES}")
    return fixtures


def with_fixtures(kinds, fixtures: str) -> list[str]:
    """The kinds to run per fixture (bench/fixtures.py): "q4" for the flat fixture (the name the results always had),
    "q4-peaked" for the peaked one."""
    return [k if f == "flat" else f"{k}-{f}" for f in fixture_list(fixtures) for k in kinds]


KINDS = ("q4", "bf16", "fp8")


def build(kind, cfg, dev, tiny):
    """An engine of random weights: "q4" (q4 experts, q8 SC MLP), "bf16", or "fp8" (the bf16 weights with the
    attention projections, dense MLP and experts quantized to FP8 per output row, as an FP8-dynamic checkpoint
    holds them: model/engine_weights.Fp8QuantizedSource), with "-peaked" the peaked fixture (bench/fixtures.py); f32
    with an f32 KV cache when tiny."""
    dtype = torch.float32 if tiny else torch.bfloat16
    kind, _, fixture = kind.partition("-")
    fixture = fixture or "flat"
    if kind not in KINDS:
        raise ValueError(f"engine kind {kind!r}: expected one of {KINDS}")
    if kind == "q4":
        src = RandomPackSource(cfg, dev, dtype, seed=0, experts="q4", sc="q8", fixture=fixture)
    else:
        src = RandomSource(cfg, dev, dtype, seed=0, fixture=fixture)
    if kind == "fp8":  # each tensor quantized as it is drawn (cache=False: the source draws each name once)
        src = Fp8QuantizedSource(src, cache=False)
    return build_engine(cfg, src, dev, dtype, **({"kv_dtype": torch.float32} if tiny else {}))


def result_header(dev, a, **extra) -> dict:
    """The head of a bench's JSON: the device, torch, and the run's common arguments."""
    return {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "routing": a.routing, "tiny": a.tiny, "reps": a.reps, **extra}


def dumper(res: dict, path):
    """A function that rewrites `path` (if given) with `res` as JSON."""
    def dump():
        if path:
            Path(path).write_text(json.dumps(res, indent=1))
    return dump


def run_kinds(kinds, cfg, dev, tiny, res: dict, sections: set, jobs, routing_kind: str, dump) -> None:
    """For each kind: build its engine, run jobs(eng, kind) -> [(name, fn)] for the names in `sections` under
    `routing_kind`, store each result (None: nothing to store) or error in res[kind], dump after each."""
    for kind in kinds:
        t = time.time()
        eng = build(kind, cfg, dev, tiny)
        sync(dev)
        log(f"[{kind}] built in {time.time() - t:.1f}s")
        r = res[kind] = {}
        for name, fn in jobs(eng, kind):
            if name not in sections:
                continue
            t = time.time()
            try:
                with routing(routing_kind):
                    value = fn()
                if value is not None:
                    r[name] = value
            except Exception as e:
                traceback.print_exc()
                r[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(f"[{kind} {name}] {time.time() - t:.1f}s")
            dump()
        del eng, r
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
