"""Benchmark: the fast engine vs transformers at DiffusionGemma's full size, random bf16 weights, one GPU.

    PYTHONPATH=src python -m bench.bench_engine [--contexts 1024,8192,32768] [--skip-hf] [--json out.json]

Builds the real shapes (30 layers, hidden 2816, vocab 262144, 128 experts top-8 F=704, dense 2112,
16 heads; sliding hd 256 / 8 KV, full hd 512 / 2 KV; window 1024; canvas 256) directly on the GPU,
then times, for each context length: prefill (tokens/s, one prompt of that length into an empty
cache) and one denoise step over that cache (CUDA-graph replay, median of repeats, CUDA events),
with peak memory. The step is timed twice: from SC logits (the exact soft embedding, softmax and
[256 x 262144] @ [262144 x 2816] product, inside the graph: what transformers' step does), and from SC
embeddings (what generate() calls with the default sparse SC, which makes the soft embedding outside
the forward; issue 5 counts SC in generate's time outside the forwards, measured separately below). Then frees it and times transformers' DiffusionGemmaForBlockDiffusion (random
init on the GPU, bf16, sdpa) on the same shapes: its denoise over a DynamicCache filled with random
K/V of that length, and its encoder prefill. One table at the end, with ratios and the weight-byte
roofline (all weights read once per step at 4.3e12 B/s, the copy bandwidth measured on an H200).

Routing: random weights route the canvas to only ~3/4 of the experts (bench_routing.py), which would time a
step that reads fewer bytes than the real model's. So by default both engines run with balanced routing
(balanced_routing.py: every expert gets the same number of rows; the routers still run); `--routing model`
times the random model's own routing instead.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.balanced_routing import KINDS, balance_hf, routing
from bench.fixtures import RandomPackSource, RandomSource
from diffgemma.config import ModelConfig
from diffgemma.model import denoiser as denoiser_mod
from diffgemma.model.engine import build_engine
from diffgemma.ops.moe_packed import PackedWeight

S, FULL = "sliding_attention", "full_attention"
BW = 4.3e12
TEXT = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
            sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
            final_logit_softcapping=30.0, layer_types=[FULL if (i + 1) % 6 == 0 else S for i in range(30)],
            max_position_embeddings=262144)
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=16)
CANVAS = 256
# (EngineOptions field, value, name) for the A/B timings of bench_ours; --ab picks by name
AB_VARIANTS = [("attn_impl", "sdpa", "sdpa"), ("attn_impl", "triton", "triton"),
               ("launch_order", False, "expert_order"),  # the expert GEMMs' programs in expert order
               ("canvas_impls", {"full": "gemm"}, "gemm"), ("canvas_impls", {"full": "tiles"}, "tiles"),
               ("sliding_live_window", False, "slide_mask"),  # the sliding canvas over every ring slot, per-key mask
               ("guarded_graphs", False, "plain_graphs")]  # denoise graphs without the IF node around the forward


def log(*a):
    print(*a, flush=True)


def time_cuda(fn, reps: int, warmup: int = 1, setup=None) -> list[float]:
    """Milliseconds per call, CUDA events around each call (setup(), if given, runs before each call, untimed)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    out = []
    for _ in range(reps):
        if setup is not None:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def generate_forward(eng):
    """The engine method generate() calls for a denoise step (model/denoiser.StagedDenoiser.forward)."""
    return eng.denoise_raw if eng.options.softcap_in_sampler else eng.denoise


def time_graph(run, calls: int, reps: int = 7) -> list[float]:
    """GPU µs a call, host launch time excluded: run() (which makes `calls` calls) is warmed up on a side stream,
    captured once into a CUDA graph, and the graph replayed `reps` times. For kernels of a few microseconds,
    whose back-to-back Python launches are timed by the host rather than the GPU."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # Triton compiles and allocator pools happen off the capture stream
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return out


@contextlib.contextmanager
def knob(eng, field, value):
    """The engine with one EngineOptions field changed for the block; its graphs are dropped on the way out, so the
    default step is captured afresh after it."""
    old = eng.options
    eng.options = replace(old, **{field: value})
    try:
        yield
    finally:
        eng.options = old
        eng.clear_graphs()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def weight_bytes(w) -> int:
    """Bytes of every weight the engine holds (each storage once; packed records at their packed size)."""
    seen, total = set(), 0
    for t in [v for k, v in vars(w).items() if k != "layers"] + [v for lw in w.layers for v in vars(lw).values()]:
        if isinstance(t, PackedWeight):
            t = t.record
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def bench_ours(contexts, reps, extra_chunks=(), ab_names=("sdpa", "triton"), generate: bool = True,
               alternate: int = 0, kind: str = "bf16") -> dict:
    """kind: "bf16" experts, or "q4" (q4-packed experts and a q8 SC MLP, bench/fixtures.RandomPackSource)."""
    cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
    t0 = time.time()
    src = (RandomPackSource(cfg, "cuda", torch.bfloat16, seed=0, experts="q4", sc="q8") if kind == "q4"
           else RandomSource(cfg, "cuda", torch.bfloat16, seed=0))
    eng = build_engine(cfg, src, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    wb = weight_bytes(eng.w)
    log(f"[ours] built in {time.time() - t0:.1f}s, weights {wb / 1e9:.2f} GB, allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    res = {"weight_bytes": wb, "ctx": {}}
    V = cfg.vocab_size
    # warm-up: compile kernels, cuBLAS handles
    c0 = eng.new_cache(2048)
    eng.prefill(c0, torch.randint(0, V, (1024,), device="cuda"))
    eng.denoise(c0, torch.randint(0, V, (CANVAS,), device="cuda"))
    del c0
    for T in contexts:
        r = {}
        cache = eng.new_cache(T)
        prompt = torch.randint(0, V, (T,), device="cuda")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

        def do_prefill():
            cache.truncate(0)
            eng.prefill(cache, prompt)

        times = time_cuda(do_prefill, reps=2 if T > 8192 else 3, warmup=0 if T > 65536 else 1)
        r["prefill_ms"] = statistics.median(times)
        r["kv_cache_gib"] = sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values]) / 2**30
        r["prefill_tok_s"] = T / (r["prefill_ms"] / 1e3)
        r["prefill_peak_gib"] = peak_gib()
        # denoise over a cache of T tokens; the canvas ids and SC logits change every step like in generate
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, V, (CANVAS,), device="cuda")
        sc = torch.randn(CANVAS, V, device="cuda") * 3
        eng.use_graphs = True
        eng.denoise(cache, ids, sc_logits=sc)  # capture
        times = time_cuda(lambda: eng.denoise(cache, ids, sc_logits=sc), reps=reps, warmup=2)
        r["denoise_ms"] = statistics.median(times)
        r["denoise_min_ms"] = min(times)
        r["denoise_peak_gib"] = peak_gib()
        r["graph_error"] = eng.graph_error
        # the same step as generate() calls it by default: sparse SC computes the soft embedding from the last
        # step's logits outside the forward (the generate-overhead measurement below times that part), so the
        # graph starts from the [C, hidden] embedding instead of the [C, V] logits' softmax and dense product;
        # and the step ends at the raw logits (denoise_raw), which generate's row-stats and SC kernels softcap as
        # they read them (also timed below, outside the forward). generate stages each such call's inputs into the
        # graph before its status read (Engine.stage_denoise), so the call launches the replay alone: staged here
        # too, before the timing starts (the unstaged call, which copies its inputs first, is kept for comparison)
        emb = torch.randn(CANVAS, cfg.hidden_size, device="cuda").to(torch.bfloat16)
        step = generate_forward(eng)
        step(cache, ids, sc_embeds=emb)  # capture
        stage = getattr(eng, "stage_denoise", None)
        times = time_cuda(lambda: step(cache, ids, sc_embeds=emb), reps=reps, warmup=2,
                          setup=(lambda: stage(cache, ids, sc_embeds=emb)) if stage is not None else None)
        r["denoise_embeds_ms"] = statistics.median(times)
        r["denoise_embeds_min_ms"] = min(times)
        r["denoise_embeds_unstaged_ms"] = statistics.median(time_cuda(lambda: step(cache, ids, sc_embeds=emb),
                                                                      reps=reps, warmup=1))
        # A/B: the same graphed step (and prefill) with one engine option changed: every attention forced to
        # SDPA or to the Triton kernel, or the expert GEMMs' programs in expert order
        ab = {}
        chosen = [v for v in AB_VARIANTS if v[2] in ab_names]

        def step_ms():  # capture afresh (a knob outside the graph key, launch_order, needs it), then time
            eng.clear_graphs()
            eng.denoise(cache, ids, sc_logits=sc)
            return statistics.median(time_cuda(lambda: eng.denoise(cache, ids, sc_logits=sc),
                                               reps=max(3, reps // 2), warmup=2))

        if alternate and chosen:  # the default and each variant, captured afresh, in turn: drift hits all alike
            alt = {"default": []} | {name: [] for _, _, name in chosen}
            for _ in range(alternate):
                alt["default"].append(step_ms())
                for attr, value, name in chosen:
                    with knob(eng, attr, value):
                        alt[name].append(step_ms())
            ab["denoise_alternating_ms"] = {name: [round(x, 3) for x in xs] for name, xs in alt.items()}
        for attr, value, name in chosen:
            with knob(eng, attr, value):
                try:
                    ab[f"denoise_{name}_ms"] = step_ms()
                except Exception as e:
                    ab[f"denoise_{name}_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
                eng.clear_graphs()
                try:
                    times = time_cuda(do_prefill, reps=1, warmup=1)
                    ab[f"prefill_{name}_tok_s"] = T / (statistics.median(times) / 1e3)
                except Exception as e:
                    ab[f"prefill_{name}_tok_s"] = f"{type(e).__name__}: {str(e)[:200]}"
        r.update(ab)
        log(f"[ours] ctx {T} A/B: " + json.dumps(ab))
        eng.use_graphs = False
        r["denoise_eager_ms"] = statistics.median(time_cuda(lambda: eng.denoise(cache, ids, sc_logits=sc), reps=3))
        if T == contexts[0]:
            r["profile"] = profile_step(eng, cache, ids, sc)
            log(r["profile"])
        if T == 8192:  # where prefill time goes (issue 5's 50k tok/s bar is at 8k)
            r["prefill_profile"] = profile_fn(do_prefill)
            log(r["prefill_profile"])
        eng.use_graphs = True
        # K+V bytes one step reads: full layers T positions, sliding layers their ring
        kv_bytes = sum(2 * l.num_kv_heads * l.head_dim * 2 * (cache.ring if l.is_sliding else T) for l in cfg.layers)
        r["roofline_ms"] = (wb + kv_bytes) / BW * 1e3
        log(f"[ours] ctx {T}: prefill {r['prefill_ms']:.1f} ms ({r['prefill_tok_s']:.0f} tok/s, peak {r['prefill_peak_gib']:.1f} GiB, KV {r['kv_cache_gib']:.2f} GiB); "
            f"denoise {r['denoise_ms']:.2f} ms graphed ({r['denoise_embeds_ms']:.2f} from SC embeds, {r['denoise_embeds_unstaged_ms']:.2f} unstaged) / {r['denoise_eager_ms']:.2f} ms eager (peak {r['denoise_peak_gib']:.1f} GiB)"
            f"; roofline {r['roofline_ms']:.2f} ms")
        res["ctx"][T] = r
        if T == contexts[-1] and extra_chunks:
            for ch in extra_chunks:
                eng.options = replace(eng.options, prefill_chunk=ch)
                times = time_cuda(do_prefill, reps=2, warmup=0)
                r[f"prefill_tok_s_chunk{ch}"] = T / (statistics.median(times) / 1e3)
                log(f"[ours] ctx {T}: prefill chunk {ch}: {r[f'prefill_tok_s_chunk{ch}']:.0f} tok/s")
            eng.options = replace(eng.options, prefill_chunk=8192)
        del cache
        eng.clear_graphs()
    res["generate"] = bench_generate(eng) if generate else {}
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return res


def profile_step(eng, cache, ids, sc) -> str:
    """Top GPU kernels of one eager denoise step (where the time goes; graphs hide kernel names)."""
    return profile_fn(lambda: eng.denoise(cache, ids, sc_logits=sc))


def gpu_table(avg, rows: int) -> str:
    """The profiler's kernels by GPU time (the sort key's name differs between torch versions)."""
    for key in ("self_device_time_total", "self_cuda_time_total", "cuda_time_total"):
        try:
            return avg.table(sort_by=key, row_limit=rows, max_name_column_width=70)
        except Exception:
            continue
    return "profile: no sortable key"


def profile_fn(fn) -> str:
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return gpu_table(prof.key_averages(), rows=18)
    except Exception as e:
        return f"profile failed: {type(e).__name__}: {e}"


def profile_generate(eng, prompt, cache, trace: str | None) -> str:
    """Where `generate`'s time outside the forwards goes: one warm generate under the profiler (CPU + CUDA).

    Prints the CUDA kernels and the host ops by self time; `trace` also writes a Chrome trace (the idle gaps
    between a step's status read and the next graph replay are visible there)."""
    import diffgemma.generation as G
    from torch.profiler import ProfilerActivity, profile

    cache.truncate(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        G.generate(eng, prompt, seed=1, max_new_tokens=256, cache=cache)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    avg = prof.key_averages()
    return gpu_table(avg, rows=25) + "\n" + avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)


# bench_generate's seeds: the timed run's, and the warm-up's (--warm-seed; the same by default)
TIMED_SEED = 1
WARM_SEED = TIMED_SEED


def bench_generate(eng, profile_trace: str | None = None, profile: bool = False) -> dict:
    """generate() time outside the forwards: total − Σ prefill calls − Σ(CUDA-event time of each denoise call).

    A prefill call (the prompt's, and each block's commit) counts as the longer of its host time and its GPU span
    (CUDA events around it): its kernels are queued eagerly, so when the GPU is the slower side the call returns
    before they finish, and their tail would otherwise be counted outside the forwards. `outside_s_host_prefill`
    keeps the older count (prefill by host time alone). `gap_ms_*`: from one denoise call's end event to the next
    one's start event inside a block (the sampler, SC and bookkeeping between two steps, as the GPU saw them).

    The warm-up run captures the graphs on the same cache object (graphs are keyed by the cache), so the timed
    run replays them. It runs the timed run's seed (WARM_SEED), so it takes the same paths and every Triton kernel
    the timed run launches is compiled before the timing starts (with another seed, a path first taken in the timed
    run would compile there, inside one gap).
    Host syncs per step = the loop's status reads / forwards (the loop's one allowed read).
    """
    try:
        import diffgemma.generation as G
    except Exception as e:
        return {"error": f"import: {e}"}
    try:
        V = eng.config.vocab_size
        prompt = torch.randint(0, V, (1024,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
        cache = eng.new_cache(4096)
        G.generate(eng, prompt, seed=WARM_SEED, max_new_tokens=256, cache=cache)  # warm: captures graphs
        cache.truncate(0)
        events, prefills = [], []
        # host seconds: in the status read, from its return to the next denoise call, and in that call
        host = {"read": None, "wait": [], "turn": [], "call": []}
        name = generate_forward(eng).__name__  # the call each step makes: its CUDA-event time is the forward's
        inner = getattr(eng, name)
        inner_prefill = eng.prefill
        # made beforehand: an event created in the loop is one more CUDA call on the host's path to the next replay
        spare = [torch.cuda.Event(enable_timing=True) for _ in range(320)]

        def pair():
            return (spare.pop(), spare.pop()) if len(spare) >= 2 else tuple(
                torch.cuda.Event(enable_timing=True) for _ in range(2))

        def timed_prefill(*a, **k):
            s, e = pair()
            t0 = time.perf_counter()
            s.record()
            out = inner_prefill(*a, **k)
            e.record()
            prefills.append((s, e, time.perf_counter() - t0))
            events.append(None)  # a block boundary: no gap (nor host turn) is counted across it
            host["read"] = None
            return out

        def timed_denoise(*a, **k):
            t0 = time.perf_counter()
            if host["read"] is not None:
                host["turn"].append(t0 - host["read"])
                host["read"] = None
            ahead = getattr(eng, "_ahead", None)
            if ahead is not None and eng._staged_entry(ahead, a[0], a[1], k.get("sc_embeds")) is not None:
                out = inner(*a, **k)  # takes the forward stage_denoise(go=) launched (timed there): launches nothing
                host["call"].append(time.perf_counter() - t0)
                return out
            s, e = pair()
            s.record()
            out = inner(*a, **k)
            e.record()
            host["call"].append(time.perf_counter() - t0)
            events.append((s, e))
            return out

        inner_stage = getattr(eng, "stage_denoise", None)

        def timed_stage(*a, go=None, **k):  # a forward launched ahead (EngineOptions.run_ahead) is timed here
            if go is None:
                return inner_stage(*a, **k)
            s, e = pair()
            s.record()
            launched = inner_stage(*a, go=go, **k)
            e.record()
            if launched:  # its span is the forward's, or the IF node's few µs where the device said stop
                events.append((s, e))
            return launched

        reads = {"n": 0}
        read_status = denoiser_mod.read_status
        if read_status is not None:
            def counted(*a, **k):
                reads["n"] += 1
                t0 = time.perf_counter()
                out = read_status(*a, **k)
                host["read"] = time.perf_counter()
                host["wait"].append(host["read"] - t0)
                return out
            denoiser_mod.read_status = counted
        setattr(eng, name, timed_denoise)
        eng.prefill = timed_prefill
        if inner_stage is not None:
            eng.stage_denoise = timed_stage
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = G.generate(eng, prompt, seed=TIMED_SEED, max_new_tokens=256, cache=cache)
            torch.cuda.synchronize()
            total = time.perf_counter() - t
        finally:
            delattr(eng, name)  # the instance attributes go: the methods are back
            del eng.prefill
            if inner_stage is not None:
                del eng.stage_denoise
            if read_status is not None:
                denoiser_mod.read_status = read_status
        fwd_s = sum(s.elapsed_time(e) for s, e in filter(None, events)) / 1e3
        prefill_host_s = out.timings.get("prefill_s", 0.0)
        prefill_gpu_s = sum(s.elapsed_time(e) for s, e, _ in prefills) / 1e3
        prefill_s = sum(max(host, s.elapsed_time(e) / 1e3) for s, e, host in prefills)
        outside = total - prefill_s - fwd_s
        gaps = [a[1].elapsed_time(b[0]) for a, b in zip(events, events[1:]) if a is not None and b is not None]
        if profile or profile_trace:
            log(profile_generate(eng, prompt, cache, profile_trace))
        host_outside = total - prefill_host_s - fwd_s
        return {"total_s": total, "prefill_s": prefill_s, "prefill_host_s": prefill_host_s,
                "prefill_gpu_s": prefill_gpu_s, "forward_s": fwd_s, "forwards": out.forwards,
                "outside_s": outside, "outside_share": outside / max(total, 1e-9),
                "outside_ms_per_step": outside / max(out.forwards, 1) * 1e3,
                "outside_s_host_prefill": host_outside, "outside_share_host_prefill": host_outside / max(total, 1e-9),
                "gap_ms_median": statistics.median(gaps) if gaps else None, "gap_ms_sum": sum(gaps),
                "gap_ms_max": max(gaps) if gaps else None,
                "gaps": len(gaps),
                # host ms from a step's status read to the next denoise call (a block's end excluded), and in that call
                "host_read_ms_median": statistics.median(host["wait"]) * 1e3 if host["wait"] else None,
                "host_turn_ms_median": statistics.median(host["turn"]) * 1e3 if host["turn"] else None,
                "host_call_ms_median": statistics.median(host["call"]) * 1e3 if host["call"] else None,
                "step_ms": (total - prefill_s) / max(out.forwards, 1) * 1e3,  # forward + outside: what a user waits
                "status_reads_per_step": reads["n"] / max(out.forwards, 1) if read_status is not None else None,
                "tokens": len(out.tokens), "tokens_hash": hash(tuple(out.tokens)), "timings": out.timings}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def bench_hf(contexts, reps, routing_kind: str = "balanced") -> dict:
    res = {"ctx": {}}
    try:
        import transformers
        from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
        from transformers.cache_utils import DynamicCache
    except Exception as e:
        return {"error": f"import: {e}"}
    res["version"] = transformers.__version__
    hcfg = DiffusionGemmaConfig(text_config=dict(TEXT), vision_config=TINY_VISION, canvas_length=CANVAS)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            kw = dict(attn_implementation="sdpa")
            for extra in ({"experts_implementation": "grouped_mm", "dtype": torch.bfloat16},
                          {"dtype": torch.bfloat16}, {"torch_dtype": torch.bfloat16}):
                try:
                    model = DiffusionGemmaForBlockDiffusion._from_config(hcfg, **kw, **extra).eval()
                    res["from_config_kwargs"] = sorted(extra)
                    break
                except TypeError:
                    continue
    finally:
        torch.set_default_dtype(torch.float32)
    torch.cuda.synchronize()
    res["experts_impl"] = str(getattr(model.config.get_text_config(), "_experts_implementation", "?"))
    res["routing"] = routing_kind
    if routing_kind == "balanced":
        res["balanced_routers"] = len(balance_hf(model))
    log(f"[hf {transformers.__version__}] built in {time.time() - t0:.1f}s, allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
        f"experts={res['experts_impl']}")
    V = TEXT["vocab_size"]
    for T in contexts:
        r = {}
        cache = DynamicCache(config=model.config.get_text_config())
        with torch.no_grad():
            for li, lt in enumerate(TEXT["layer_types"]):
                hd, kvh = (512, 2) if lt == FULL else (256, 8)
                k = torch.randn(1, kvh, T, hd, device="cuda", dtype=torch.bfloat16)
                cache.update(k, torch.randn_like(k), li)
        ids = torch.randint(0, V, (1, CANVAS), device="cuda")
        sc = torch.randn(1, CANVAS, V, device="cuda") * 3
        torch.cuda.reset_peak_memory_stats()
        try:
            with torch.no_grad():
                times = time_cuda(lambda: model(past_key_values=cache, decoder_input_ids=ids, self_conditioning_logits=sc),
                                  reps=max(3, reps // 4), warmup=1)
            r["denoise_ms"] = statistics.median(times)
            r["denoise_peak_gib"] = peak_gib()
        except Exception as e:
            r["denoise_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        del cache
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            prompt = torch.randint(0, V, (1, T), device="cuda")

            def hf_prefill():
                c = DynamicCache(config=model.config.get_text_config())
                model.model.encoder(input_ids=prompt, past_key_values=c)

            with torch.no_grad():
                times = time_cuda(hf_prefill, reps=1 if T > 8192 else 2, warmup=1 if T <= 8192 else 0)
            r["prefill_ms"] = statistics.median(times)
            r["prefill_tok_s"] = T / (r["prefill_ms"] / 1e3)
            r["prefill_peak_gib"] = peak_gib()
        except Exception as e:
            r["prefill_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        gc.collect()
        torch.cuda.empty_cache()
        log(f"[hf] ctx {T}: {json.dumps(r)}")
        res["ctx"][T] = r
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _f(x, fmt, missing="—"):
    return format(x, fmt) if isinstance(x, (int, float)) else missing


def table(ours, hf, contexts) -> str:
    rows = ["| context | ours denoise ms (graph, exact SC inside) | ours denoise ms (graph, SC embeds in: generate's call) | all-SDPA attn | all-flash attn | ours eager ms | roofline ms | HF denoise ms | speed-up | "
            "ours prefill tok/s | HF prefill tok/s | speed-up | ours peak GiB (prefill / denoise) | HF peak GiB (prefill / denoise) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for T in contexts:
        o, h = ours["ctx"][T], hf.get("ctx", {}).get(T, {})
        hd, hp = h.get("denoise_ms"), h.get("prefill_tok_s")
        sd = _f(hd / o["denoise_ms"] if hd else None, ".1f") + ("x" if hd else "")
        sp = _f(o["prefill_tok_s"] / hp if hp else None, ".1f") + ("x" if hp else "")
        rows.append(
            f"| {T} | {o['denoise_ms']:.2f} | {_f(o.get('denoise_embeds_ms'), '.2f')} | {_f(o.get('denoise_sdpa_ms'), '.2f')} | {_f(o.get('denoise_triton_ms'), '.2f')} | {o['denoise_eager_ms']:.2f} | {o['roofline_ms']:.2f} | "
            f"{_f(hd, '.1f', h.get('denoise_error', '—'))} | {sd} | {o['prefill_tok_s']:.0f} | "
            f"{_f(hp, '.0f', h.get('prefill_error', '—'))} | {sp} | "
            f"{o['prefill_peak_gib']:.1f} / {o['denoise_peak_gib']:.1f} | "
            f"{_f(h.get('prefill_peak_gib'), '.1f')} / {_f(h.get('denoise_peak_gib'), '.1f')} |")
    return "\n".join(rows)


def run_ahead_ab(eng, rounds: int) -> dict:
    """bench_generate with EngineOptions.run_ahead on and off in turn: ms a step outside the forwards, its share, the
    forwards' ms a step and what a user waits a step, per round."""
    keep = eng.options
    out = {"ahead": [], "after_read": []}
    try:
        for _ in range(rounds):
            for name, flag in (("ahead", True), ("after_read", False)):
                eng.options = replace(keep, run_ahead=flag)
                r = bench_generate(eng)
                row = {k: r.get(k) for k in ("outside_ms_per_step", "outside_share", "step_ms", "gap_ms_median",
                                              "gap_ms_sum", "host_turn_ms_median", "host_call_ms_median", "forwards",
                                              "tokens_hash", "error")}
                row["forward_ms"] = r["forward_s"] / max(r["forwards"], 1) * 1e3 if "forward_s" in r else None
                out[name].append(row)
                log(f"[ours] run-ahead A/B {name}: {json.dumps(row, default=str)}")
    finally:
        eng.options = keep
    out["same_tokens"] = len({row["tokens_hash"] for rows in out.values() for row in rows}) == 1
    log(f"[ours] run-ahead A/B: the same tokens in every run: {out['same_tokens']}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192,32768",
                    help="context lengths; the model's range goes to 262144 (--contexts 131072,262144 --skip-hf "
                         "--ab '' --no-generate: the long cases, with the KV cache's size at each)")
    ap.add_argument("--kind", default="bf16", choices=("bf16", "q4"), help="the engine's experts (q4: a q4 pack)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--extra-chunks", default="", help="prefill chunk sizes to also time at the largest context")
    ap.add_argument("--json", default=None)
    ap.add_argument("--generate-only", action="store_true", help="only the generate-overhead measurement")
    ap.add_argument("--routing", default="balanced", choices=KINDS, help="expert routing while timing (see the docstring)")
    ap.add_argument("--profile-generate", action="store_true", help="with --generate-only: profile one more generate")
    ap.add_argument("--trace", default=None, help="with --profile-generate: also write a Chrome trace here")
    ap.add_argument("--run-ahead-ab", type=int, default=0,
                    help="with --generate-only: also time generate with and without the forward launched ahead "
                         "(EngineOptions.run_ahead) in turn, this many rounds")
    ap.add_argument("--ab", default="sdpa,triton",
                    help=f"A/B variants of the denoise step to also time (of {', '.join(v[2] for v in AB_VARIANTS)}; '' for none)")
    ap.add_argument("--no-generate", action="store_true", help="skip the generate-overhead measurement")
    ap.add_argument("--warm-seed", type=int, default=TIMED_SEED,
                    help="the generate warm-up's seed (default: the timed run's, so it compiles what the timed run runs)")
    ap.add_argument("--alternate", type=int, default=0,
                    help="also time the default step and the --ab variants in turn, this many rounds, in one process")
    a = ap.parse_args()
    global WARM_SEED
    WARM_SEED = a.warm_seed
    ab_names = [x for x in a.ab.split(",") if x]
    unknown = set(ab_names) - {v[2] for v in AB_VARIANTS}
    if unknown:
        ap.error(f"--ab: unknown variant(s) {sorted(unknown)}; expected names from {[v[2] for v in AB_VARIANTS]}")
    contexts = [int(x) for x in a.contexts.split(",")]
    log(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  routing: {a.routing}")
    if a.generate_only:
        cfg = ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS})
        eng = build_engine(cfg, RandomSource(cfg, "cuda", torch.bfloat16, seed=0), "cuda", torch.bfloat16)
        with routing(a.routing):
            res = {"generate": bench_generate(eng, a.trace, a.profile_generate), "routing": a.routing}
            log(f"[ours] generate: {json.dumps(res['generate'], default=str)}")
            if a.run_ahead_ab:
                res["run_ahead_ab"] = run_ahead_ab(eng, a.run_ahead_ab)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        return
    with routing(a.routing):
        ours = bench_ours(contexts, a.reps, [int(x) for x in a.extra_chunks.split(",") if x], ab_names,
                          generate=not a.no_generate, alternate=a.alternate, kind=a.kind)
    log(f"[ours] generate: {json.dumps(ours['generate'], default=str)}")
    if a.json:  # ours survives a failure or time-out on transformers' side
        Path(a.json).write_text(json.dumps({"ours": ours}, indent=1, default=str))
    try:
        hf = {} if a.skip_hf else bench_hf(contexts, a.reps, a.routing)
    except Exception as e:  # report ours even if transformers' side breaks
        hf = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"[hf] failed: {hf['error']}")
        gc.collect()
        torch.cuda.empty_cache()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "routing": a.routing, "ours": ours, "hf": hf}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    log("\n" + table(ours, hf, contexts))


if __name__ == "__main__":
    main()
