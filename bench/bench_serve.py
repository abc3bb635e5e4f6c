"""Benchmark: the OpenAI server under concurrent streaming clients, with and without continuous batching.

    PYTHONPATH=src:. python -m bench.bench_serve [--kind q4|bf16|fp8] [--clients 8] [--json out.json]
    PYTHONPATH=src:. python -m bench.bench_serve --kinds q4,fp8 --sections throughput --fixtures peaked
    PYTHONPATH=src:. python -m bench.bench_serve --tiny      # the demo model on the CPU: a dry run (< 1 min)

The real HTTP server (server/app.py served by uvicorn in-process on a free port) over a model built from random
full-size weights (bench.runner.build: q4 experts + q8 SC MLP, bf16, or fp8; balanced expert routing), or with --tiny the
embedded demo model (the reference forward, which takes any batch). Every request does the same work: fixed
denoise steps a block, no early stop, no stop id (bench_e2e.fixed_steps), so a reply is exactly --reply tokens.

  throughput  --clients streaming clients (httpx, each in a process of its own, as a server's clients are, started
              once and all sent off at one moment: bench/clients.py; --client-threads: threads of this process),
              each a distinct --prompt-token prompt through /v1/completions, --reply tokens back; once with
              --max-batch 1 (one request at a time) and once with --batch: aggregate completion tokens/s (the
              clients' start to the last [DONE]) and the ratio. Unless --tiny, the server warms up as `serve` does on
              CUDA (Worker.warm_up: each slot's graphs and every batch size's), and a warm-up pass (one block each)
              runs, then --passes measured passes of the same load on one server; the median pass (by wall time; of
              an even count, the slower middle one) is the one reported, and every pass is in the JSON: when
              requests land decides the batch sizes a pass meets, and a size met for the first time runs eagerly.
              Each pass starts on an idle server (Served.settle: the last pass's final commits, which run after its
              replies are out, done first).
  prefill     one stream runs (a --prompt prompt, a long reply) while another client sends a --long-token prompt:
              the running stream's step times (between its consecutive forwards, from the scheduler's trace), before
              the long prompt arrives and while it prefills (--busy tokens a round, as the server prefills while
              others generate, at most --chunk): their p50 / p99 and both ratios. Unless --tiny, the same script
              runs first on other ids, so that no graph capture lands in the measured pass.
  --kinds A,B  the throughput section across two engines in one process: kind A serial (--max-batch 1), then its
              engine freed, kind B batched (--batch), and the ratio B batched / A serial (the FP8 engine serving 8
              clients against the q4 engine serving them one at a time: `--kinds q4,fp8`)
  --variants  the batched run once per variant, in order, on the same engine (an A/B of one process and card):
              `default,now,graphs` measures as it is, with each ended request's last block committed at its round's
              end, and with the batched prefill graphs on; the first variant is the headline
Per fixture (--fixtures; bench/fixtures.py; full size only, --tiny runs the demo's real weights): the flat fixture's
numbers at the top of the JSON as before, the peaked one's under "peaked", each with the fixture's logit profile
(median row entropy, SC survivors per row).
JSON (--json) holds every number; a short table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import random
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch

from bench.bench_e2e import STEPS, WrappedTokenizer, fixed_steps
from bench.clients import ClientProcesses, stream
from bench.runner import KINDS, fixture_list

TINY = dict(clients=8, prompt=128, reply=128, steps=8, long=1024, chunk=256, busy=64, batch=8, passes=1)
FULL = dict(clients=8, prompt=1024, reply=256, steps=STEPS, long=32768, chunk=1024, busy=256, batch=8, passes=3)


def log(*a):
    print(*a, flush=True)


class Served:
    """A Worker + the app, served by uvicorn on a free local port in a thread of this process."""

    def __init__(self, model, tokenizer, settings, warm: bool = False, **worker_kw):
        import uvicorn

        from diffgemma.server.app import create_app
        from diffgemma.server.worker import Worker

        self.trace: list = []
        self.worker = Worker(model, trace=self.trace, **worker_kw)
        self._gc_start: dict = {}
        gc.callbacks.append(self._gc)
        # what `serve` does before it listens on CUDA (--warmup auto): every slot's graphs, every batch size's
        self.warm_s = round(self.worker.warm_up(settings), 3) if warm else None
        app = create_app(self.worker, tokenizer, "bench", settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1/completions"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def _gc(self, phase: str, info: dict) -> None:
        """Each pause of the cyclic collector of 1 ms or more, in any thread, as (time, "gc", generation, ms)."""
        now = time.perf_counter()
        if phase == "start":
            self._gc_start[threading.get_ident()] = now
            return
        t = self._gc_start.pop(threading.get_ident(), None)
        if t is not None and now - t >= 1e-3:
            self.trace.append((now, "gc", info["generation"], round((now - t) * 1e3, 2)))

    def settle(self) -> None:
        """Return once the worker has ended every request and the GPU has done its queued work: a pass's last
        commits run after its replies are out, and the next pass's clock must start on an idle server."""
        self.worker.between_rounds(lambda: torch.cuda.synchronize() if torch.cuda.is_available() else None)

    def close(self):
        gc.callbacks.remove(self._gc)
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()
        self.worker.close()


def concurrently(calls: list) -> tuple[float, float]:
    """calls: functions of one httpx.Client each, run at once, a thread and a client each -> (wall seconds, the
    perf_counter time the first thread started). Each client (its SSL context alone is tens of ms of CPU) is made
    before the clock starts."""
    clients = [httpx.Client(timeout=None) for _ in calls]
    threads = [threading.Thread(target=f, args=(c,)) for f, c in zip(calls, clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    for c in clients:
        c.close()
    return wall, t


def run_clients(url: str, prompts: list[list[int]], max_tokens: int, procs: ClientProcesses | None = None
                ) -> tuple[float, int, float, list[dict]]:
    """All prompts at once, one client process each (procs), or one thread each in this process (None) -> (wall
    seconds, completion tokens, the perf_counter time the clients started, each client's record: see stream)."""
    if procs is not None:
        wall, t, outs = procs.run(url, prompts, max_tokens)
    else:
        outs = [{} for _ in prompts]
        wall, t = concurrently([functools.partial(stream, url, p, max_tokens, i, o) for i, (p, o) in
                                enumerate(zip(prompts, outs))])
    missing = [i for i, o in enumerate(outs) if "tokens" not in o]
    if missing:
        raise RuntimeError(f"clients {missing} got no usage chunk")
    # usage leaves padding out: the demo model pads a random prompt's reply
    return wall, sum(o["tokens"] for o in outs), t, outs


def timeline(t0: float, trace: list, outs: list[dict]) -> dict:
    """A pass's events in ms from its start: the scheduler's trace (prefill / forward / block) and each client's
    start, first text and end."""
    ms = lambda t: round((t - t0) * 1e3, 2)  # noqa: E731
    return {"scheduler": [[ms(e[0]), e[1], list(e[2]) if isinstance(e[2], tuple) else e[2], *e[3:]] for e in trace],
            "clients": [[ms(o["t_start"]), ms(o.get("t_text", o["t_end"])), ms(o["t_end"])] for o in outs]}


def throughput(model, tokenizer, settings, a, prompts, max_batch: int) -> dict:
    ctx = a.prompt + a.reply + 2 * model.config.canvas_length
    s = Served(model, tokenizer, settings, warm=not a.tiny, slots=a.clients, max_tokens=ctx, max_batch=max_batch,
               prefill_chunk=a.chunk, busy_prefill_chunk=a.busy, max_queue=a.clients)
    C = model.config.canvas_length
    work = len(prompts) * -(-a.reply // C) * a.steps
    passes = []
    try:
        if not a.tiny:  # graphs, kernels, caches: made before the clock starts
            run_clients(s.url, [p[::-1] for p in prompts], model.config.canvas_length, a.procs)
        for _ in range(a.passes):
            s.settle()
            s.trace.clear()
            counts0 = getattr(model, "batch_graph_counts", {})
            prefills0 = getattr(model, "batch_prefill_counts", {})
            wall, usage_tokens, t0, outs = run_clients(s.url, prompts, a.reply, a.procs)
            counts = {k: v - counts0.get(k, 0) for k, v in getattr(model, "batch_graph_counts", {}).items()}
            prefills = {k: v - prefills0.get(k, 0) for k, v in getattr(model, "batch_prefill_counts", {}).items()}
            batches = [len(e[2]) for e in s.trace if e[1] == "forward"]
            times = [e[0] for e in s.trace if e[1] == "forward"]
            if sum(batches) != work:  # fixed steps: every reply is exactly --reply tokens, at --steps a block
                raise RuntimeError(f"the server ran {sum(batches)} canvas steps; fixed steps make it {work}")
            tokens = len(prompts) * a.reply
            passes.append({"wall_s": round(wall, 3), "completion_tokens": tokens,
                           "usage_completion_tokens": usage_tokens, "tok_s": round(tokens / wall, 1),
                           "forwards": len(batches),
                           "mean_batch": round(statistics.mean(batches), 2) if batches else 0.0,
                           # how the batched forwards ran (a shape seen once runs eagerly, then is captured)
                           "batch_graphs": counts,
                           # how its batched prefills (commits, joining prompts) ran, and the collector's pauses
                           "batch_prefills": prefills,
                           "gc_ms": round(sum(e[3] for e in s.trace if e[1] == "gc"), 2),
                           "round_ms_p50_p90": [pct([b - a for a, b in zip(times, times[1:])], q) for q in (0.5, 0.9)],
                           "timeline": timeline(t0, s.trace, outs)})
    finally:
        s.close()
    median = sorted(passes, key=lambda p: p["wall_s"])[len(passes) // 2]  # of an even count, the slower middle one
    out = {"max_batch": max_batch, "warm_up_s": s.warm_s, **median, "passes": passes}
    log(f"  max_batch {max_batch}: { {k: v for k, v in out.items() if k not in ('passes', 'timeline')} }")
    return out


def step_times(trace, job: int, lo: float, hi: float) -> list[float]:
    """Seconds between the job's consecutive forwards, for the intervals inside [lo, hi]."""
    ts = [e[0] for e in trace if e[1] == "forward" and job in e[2]]
    return [b - a for a, b in zip(ts, ts[1:]) if a >= lo and b <= hi]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else float("nan")


def prefill_interference(model, tokenizer, settings, a, rng, max_batch: int) -> dict:
    C = model.config.canvas_length
    long_prompt = [rng.randrange(10, tokenizer.vocab_size) for _ in range(a.long)]
    warm_steps = 2 * a.steps + 2  # two blocks of the running stream before the long prompt comes
    chunks = -(-a.long // min(a.busy, a.chunk))
    reply = C * (3 + -(-2 * chunks // a.steps))  # enough blocks to outlast the long prompt's prefill (and its holds)
    ctx = max(a.prompt + reply, a.long + C) + 2 * C
    s = Served(model, tokenizer, settings, slots=2, max_tokens=ctx, max_batch=max_batch, prefill_chunk=a.chunk,
               busy_prefill_chunk=a.busy)

    def scenario(prompt, long_prompt):
        """The stream starts; after warm_steps of its forwards the long prompt comes. -> (the long prompt's arrival,
        the trace)."""
        s.trace.clear()
        out_a, out_b = {}, {}
        ta = threading.Thread(target=stream, args=(s.url, prompt, reply, 1, out_a))
        ta.start()
        while sum(e[1] == "forward" for e in s.trace) < warm_steps:
            time.sleep(0.001)
        t_long = time.perf_counter()
        tb = threading.Thread(target=stream, args=(s.url, long_prompt, C, 2, out_b))
        tb.start()
        tb.join()
        ta.join()
        return t_long, list(s.trace)

    try:
        prompt = [rng.randrange(10, tokenizer.vocab_size) for _ in range(a.prompt)]
        if not a.tiny:  # the same script on other ids first: every graph and context bucket it meets is made
            scenario(prompt[::-1], long_prompt[::-1])
            for slot in s.worker.slots:  # both slots look unused again: each request takes the slot it warmed
                if slot is not None:
                    slot.ids = []
        t_long, trace = scenario(prompt, long_prompt)
    finally:
        s.close()
    ids = sorted({j for e in trace if e[1] == "forward" for j in e[2]})
    job_a, job_b = ids[0], ids[-1]
    fills = [e[0] for e in trace if e[1] == "prefill" and e[2] == job_b]
    b_first_forward = next(e[0] for e in trace if e[1] == "forward" and job_b in e[2])
    before = step_times(trace, job_a, 0.0, t_long)[2:]  # past the first steps (the prompt's own prefill)
    during = step_times(trace, job_a, fills[0], b_first_forward)
    out = {"long_prompt": a.long, "chunk": a.chunk, "busy_chunk": a.busy, "chunks": len(fills),
           "steps_before": len(before),
           "steps_during": len(during), "p50_ms_without": pct(before, 0.5), "p99_ms_without": pct(before, 0.99),
           "p50_ms_during": pct(during, 0.5), "p99_ms_during": pct(during, 0.99),
           "prefill_s": round(b_first_forward - fills[0], 3)}
    out["p99_ratio"] = round(out["p99_ms_during"] / out["p99_ms_without"], 2) if before and during else None
    out["p50_ratio"] = round(out["p50_ms_during"] / out["p50_ms_without"], 2) if before and during else None
    log(f"  prefill: {out}")
    return out


def build(a, fixture: str = "flat", kind: str | None = None):
    from diffgemma.loader import embedded_model_path
    from diffgemma.tokenizer import load_tokenizer

    if a.tiny:
        import diffgemma

        model = diffgemma.load()
        return model, model.tokenizer
    from bench.runner import build as build_engine_kind
    from bench.bench_engine import CANVAS, TEXT
    from diffgemma.config import ModelConfig

    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    kind = kind or a.kind
    model = build_engine_kind(kind if fixture == "flat" else f"{kind}-{fixture}", cfg, torch.device("cuda"), False)
    return model, WrappedTokenizer(load_tokenizer(embedded_model_path()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="q4", choices=list(KINDS))
    ap.add_argument("--kinds", default=None, help="A,B: kind A serial vs kind B batched, one process (throughput)")
    ap.add_argument("--tiny", action="store_true", help="the demo model on the CPU (a dry run of the script)")
    for name, help_ in (("clients", "concurrent streaming clients"), ("prompt", "prompt tokens per client"),
                        ("reply", "reply tokens per client"), ("steps", "denoise steps per block"),
                        ("long", "the long prompt's tokens (prefill section)"),
                        ("chunk", "--prefill-chunk-tokens of the server"),
                        ("busy", "--busy-prefill-tokens of the server"), ("batch", "--max-batch of the batched run"),
                        ("passes", "measured passes of the throughput load (the median one is reported)")):
        ap.add_argument(f"--{name}", type=int, default=None, help=f"{help_} (default {FULL[name]}; --tiny {TINY[name]})")
    ap.add_argument("--sections", default="throughput,prefill")
    ap.add_argument("--routing", default="balanced", choices=["balanced", "model"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default="default",
                    help="comma list: the batched run once per variant, in order, on one engine (the first is the "
                         "headline): 'default', or '+'-joined changes: 'graphs' (EngineOptions.batch_prefill_graphs "
                         "on), 'nographs' (off), 'now' (an ended request's last block committed at its round's end)")
    ap.add_argument("--client-threads", action="store_true",
                    help="the throughput clients as threads of this process, not processes of their own")
    ap.add_argument("--fixtures", default="flat,peaked", help="comma list of bench/fixtures.py's FIXTURES (full size)")
    a = ap.parse_args()
    for k, v in (TINY if a.tiny else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    fixtures = ["flat"] if a.tiny else fixture_list(a.fixtures)
    kinds = cross_kinds(a)
    a.variants = a.variants.split(",")
    for v in a.variants:
        if v != "default" and not set(v.split("+")) <= {"graphs", "nographs", "now"}:
            raise SystemExit(f"--variants: {v!r} is not 'default' or a '+' list of graphs, nographs, now")
    res: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not a.tiny else "cpu",
                 "model": "demo" if a.tiny else (",".join(kinds) if kinds else a.kind), "routing": a.routing,
                 "variants": a.variants, "clients": a.clients, "prompt": a.prompt, "reply": a.reply,
                 "steps": a.steps, "clients_in": "threads" if a.client_threads else "processes"}

    def dump():
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))

    with contextlib.ExitStack() as stack:
        a.procs = None  # the throughput clients' processes, started once for every pass of every run
        if "throughput" in a.sections and not a.client_threads:
            a.procs = stack.enter_context(ClientProcesses(a.clients))
        for fixture in fixtures:
            r = res if fixture == "flat" else res.setdefault(fixture, {})
            if kinds:
                cross(a, fixture, kinds, r, dump)
            else:
                measure(a, fixture, r, dump)
            log(f"\n[{fixture}]")
            summary(r)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def cross_kinds(a) -> list[str] | None:
    """--kinds as [A, B] (each one of bench/runner.KINDS), or None."""
    if not a.kinds:
        return None
    kinds = a.kinds.split(",")
    if len(kinds) != 2 or any(k not in KINDS for k in kinds) or a.tiny:
        raise SystemExit(f"--kinds {a.kinds!r}: expected two of {KINDS} as A,B (full size, not with --tiny)")
    return kinds


def prepared(a, fixture: str, res: dict, kind: str | None = None):
    """One fixture's model of `kind` (default --kind) -> (model, tokenizer, settings, prompts, rng)."""
    t = time.time()
    model, tokenizer = build(a, fixture, kind)
    cap = getattr(model, "max_batch", 1)
    if cap is not None and a.batch > cap:
        log(f"note: this model's forward takes at most {cap} canvas(es); --batch {a.batch} -> {cap}")
        a.batch = cap
    log(f"model built in {time.time() - t:.1f}s ({type(model).__name__}, max_batch {cap}, fixture {fixture}, "
        f"kind {kind or a.kind})")
    C = model.config.canvas_length
    res["canvas"] = C
    settings = fixed_steps(C, -(-a.reply // C)).replace(max_denoising_steps=a.steps, max_new_tokens=a.reply)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, tokenizer.vocab_size) for _ in range(a.prompt)] for _ in range(a.clients)]
    return model, tokenizer, settings, prompts, rng


def cross(a, fixture: str, kinds: list[str], res: dict, dump) -> None:
    """--kinds A,B: kind A's engine serves the clients one at a time, then (A freed) kind B's serves them batched."""
    from bench.balanced_routing import routing
    from bench.fixtures import logit_profile

    res["kinds"] = {"serial": kinds[0], "batched": kinds[1]}
    for run, kind in (("serial", kinds[0]), ("batched", kinds[1])):
        model, tokenizer, settings, prompts, _ = prepared(a, fixture, res, kind)
        with routing(a.routing):
            if run == "serial":
                res[run] = throughput(model, tokenizer, settings, a, prompts, 1)
                res[run]["kind"] = kind
                dump()
            else:
                res["profile"] = logit_profile(model, model.config, a.prompt)
                batched_runs(model, tokenizer, settings, a, prompts, res, dump, kind)
        del model
        gc.collect()
        torch.cuda.empty_cache()


def batched_runs(model, tokenizer, settings, a, prompts, res: dict, dump, kind: str | None = None) -> None:
    """The batched throughput run once per --variants entry, in order, on this engine: res["by_variant"][name] each
    (with its ratio to res["serial"]), res["batched"] and res["ratio"] the first's."""
    for v in a.variants:
        with variant(model, v):
            r = throughput(model, tokenizer, settings, a, prompts, a.batch)
        r["variant"] = v
        if kind:
            r["kind"] = kind
        r["ratio"] = round(r["tok_s"] / res["serial"]["tok_s"], 2)
        res.setdefault("by_variant", {})[v] = r
        if v == a.variants[0]:
            res["batched"], res["ratio"] = r, r["ratio"]
        dump()


@contextlib.contextmanager
def variant(model, name: str):
    """The engine and core as --variants `name` makes them, for the `with` ('default': as they are)."""
    from diffgemma.core.engine import EngineCore

    changes = set(name.split("+")) - {"default"}
    options, may_wait = getattr(model, "options", None), EngineCore._last_may_wait
    if changes & {"graphs", "nographs"}:
        if options is None:
            raise SystemExit(f"--variants {name}: {type(model).__name__} has no EngineOptions (the CUDA engine has)")
        model.options = dataclasses.replace(options, batch_prefill_graphs="graphs" in changes)
    if "now" in changes:
        EngineCore._last_may_wait = lambda self: False
    try:
        yield
    finally:
        EngineCore._last_may_wait = may_wait
        if options is not None:
            model.options = options


def measure(a, fixture: str, res: dict, dump) -> None:
    """One fixture's model: its logit profile, then the sections, into `res`."""
    model, tokenizer, settings, prompts, rng = prepared(a, fixture, res)

    from contextlib import nullcontext

    from bench.balanced_routing import routing
    from bench.fixtures import logit_profile

    with nullcontext() if a.tiny else routing(a.routing):
        if not a.tiny:
            res["profile"] = logit_profile(model, model.config, a.prompt)
        if "throughput" in a.sections:
            res["serial"] = throughput(model, tokenizer, settings, a, prompts, 1)
            dump()
            batched_runs(model, tokenizer, settings, a, prompts, res, dump)
        if "prefill" in a.sections:
            res["prefill"] = prefill_interference(model, tokenizer, settings, a, rng, a.batch)
            dump()


def summary(res: dict) -> None:
    log("| run | kind | max batch | tok/s | wall s | mean batch |\n|---|---|---|---|---|---|")
    runs = [("serial", res.get("serial"))] + [(f"batched {v}", r) for v, r in res.get("by_variant", {}).items()]
    for run, r in runs:
        if r:
            log(f"| {run} | {r.get('kind', res.get('model'))} | {r['max_batch']} | {r['tok_s']} | {r['wall_s']} | "
                f"{r['mean_batch']} |")
    if "ratio" in res:
        kinds = res.get("kinds")
        what = f"{kinds['batched']} batched / {kinds['serial']} serial" if kinds else "batched / serial"
        log(f"aggregate tokens/s, {what}: {res['ratio']}x")
    for v, r in res.get("by_variant", {}).items():
        log(f"  variant {v}: {r['ratio']}x")
    p = res.get("prefill")
    if p:
        log(f"running stream's step ms while a {p['long_prompt']}-token prompt prefills ({p['chunks']} chunks of "
            f"at most {p['busy_chunk']}): p50 {p['p50_ms_during']} / p99 {p['p99_ms_during']}; without it: p50 "
            f"{p['p50_ms_without']} / p99 {p['p99_ms_without']}; p99 ratio {p['p99_ratio']}, p50 ratio {p['p50_ratio']}")


if __name__ == "__main__":
    main()
