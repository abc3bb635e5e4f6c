"""The fast engine: the forward (model/forward.py) behind a runner that owns CUDA graphs, context buckets and staging.

`Engine` is the model object `diffgemma.load` returns on CUDA (model/protocol.DenoiseModel): the same public methods
as the reference model (new_cache / prefill / denoise / embed / soft_embed / embedding / config /
generation_config / tokenizer), plus what the fast step uses (`denoiser`, `denoise_raw`, `stage_denoise`,
`logits_scratch`, `drop_staged`, `commit`, `prefill_batch`) and what warm-up visits (`context_buckets`).

CUDA graphs. On CUDA, a denoise replays a graph per (cache, canvas length, context bucket, SC mode, attention impl):
every quantity that changes between steps (cache length, ring positions) is read from device tensors, so one capture
serves every step at contexts up to the bucket. The bucket's padded key rows are masked (and skipped block-wise by
the kernel). The graph ends at the raw logits: `denoise_raw` returns them, `denoise` softcaps them into a fresh f32
tensor. Each graph also gets a guarded twin (model/graph_guard.py: the same graph inside a CUDA graph IF node), which
`stage_denoise(go=)` launches under a device flag (docs/ARCHITECTURE.md, 'Overlap').

A short prefill (a block's commit, a chat turn) runs padded to a fixed length (`prefill_pad`: the canvas, or the
smallest of `options.prefill_pads` that holds it) through Forward.prefill_padded, which reads the context and the
number of real rows from device tensors: on CUDA one graph per (cache, padded length, context bucket) replays every
such prefill; the chunks of several caches padded to one length (a round's commits, its joining prompts) run as one
forward (`prefill_batch`), with `options.batch_prefill_graphs` replayed from a graph per batch shape where it is
short. A longer prefill runs eagerly in `prefill_chunk` chunks."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import replace

import torch

from ..config import ModelConfig, cache_tokens
from ..errors import InputError
from ..ops._backend import use_triton
from ..ops.attention_topk import cache_rule
from ..ops.rows_at import RowsAt, aligned
from ..ops.softcap import softcap
from .denoiser import BatchDenoiser, StagedDenoiser
from .engine_cache import EngineKVCache, swap_stores
from .engine_batch import BatchGraphs, check_batch, in_caller_order, in_lane_order, prefill_batch
from .engine_graph import DenoiseGraph, capture, capture_prefill, padded_ids
from .engine_inputs import check_denoise, check_ids, check_image_inputs
from .engine_weights import DictSource, EngineWeights, load_weights
from .forward import Forward
from .graph_guard import GuardedGraph, guard_support
from .options import EngineOptions

_BUCKET0 = 1024  # smallest context bucket for graphed denoise; buckets double from here


def build_engine(config: ModelConfig, tensor_source, device, dtype=torch.bfloat16, **kw) -> "Engine":
    """The loader's entry point: read every tensor from `tensor_source` onto `device`, fused and cast."""
    device = torch.device(device)
    return Engine(config, load_weights(config, tensor_source, device, dtype), device=device, dtype=dtype, **kw)


def _option(name: str):
    """An EngineOptions field read (and, for the twins' tests, replaced) through the engine."""
    return property(lambda self: getattr(self.options, name),
                    lambda self, value: setattr(self, "options", replace(self.options, **{name: value})))


class Engine:
    def __init__(self, config: ModelConfig, weights: EngineWeights, *, device, dtype=torch.bfloat16,
                 kv_dtype=torch.float16, generation_config=None, path=None, tokenizer=None,
                 options: EngineOptions | None = None, **option_kw):
        """options: the implementation choices (EngineOptions); keywords override its fields (prefill_chunk=,
        attn_impl=, ... and use_graphs= for `graphs`)."""
        if "use_graphs" in option_kw:
            option_kw["graphs"] = option_kw.pop("use_graphs")
        try:
            options = replace(options or EngineOptions(), **option_kw)
        except (TypeError, ValueError) as e:
            raise InputError(f"Engine: {e}") from None
        self.forward = Forward(config, weights, device=device, dtype=dtype, kv_dtype=kv_dtype, options=options)
        self.config, self.w, self.path, self.tokenizer = config, weights, path, tokenizer
        self.device, self.dtype = torch.device(device), dtype
        self.generation_config = generation_config or {}
        self.options = options
        # graphs on (live: a failed capture turns them off, and `graph_error` says why)
        self.use_graphs = (self.device.type == "cuda") if options.graphs is None else options.graphs
        self.graph_error: str | None = None
        self.guard_error: str | None = None  # why denoise graphs have no guarded twin, if they have none
        # cache -> {graph key: DenoiseGraph}. Weakly keyed: a graph reads its cache's buffers, so it must die with that
        # cache; keying by id(cache) would let a new cache at a recycled address replay a graph over freed memory.
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # cache -> {(padded length, key rows, attention impl): PrefillGraph}: the padded prefills' graphs, likewise
        self._prefill_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # One memory pool for every denoise graph: a private pool per graph would keep each graph's intermediates for
        # as long as it lives (one set per context bucket). Sharing is safe: graphs replay one at a time on one
        # stream, and each replay's output is read right after that replay, before another graph may overwrite it.
        self._graph_pool = None
        self._batch_graphs = BatchGraphs(self)  # the batched denoise's graphs (model/engine_batch.py)
        self._prefill_batch_graphs = BatchGraphs(self)  # the batched padded prefill's, likewise
        self._last_graph = (None, None)  # (weakref to the cache, graph key) of the last graphed denoise
        self._staged = None  # stage_denoise's (graph entry, key, ids, ids version, sc, sc version) until the next call
        self._ahead = None  # the same for a forward stage_denoise(go=) launched, until the call that takes it

    @property
    def options(self) -> EngineOptions:
        return self._options

    @options.setter
    def options(self, options: EngineOptions) -> None:
        """New choices apply to graphs captured from now on (a graph keeps the form it was captured with)."""
        self._options = self.forward.options = options

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the caches new_cache makes (the forward owns it; tests may switch it to f32)."""
        return self.forward.kv_dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: torch.dtype) -> None:
        self.forward.kv_dtype = dtype

    launch_order = _option("launch_order")
    sliding_live_window = _option("sliding_live_window")
    attn_impl = _option("attn_impl")
    canvas_impls = _option("canvas_impls")
    prefill_chunk = _option("prefill_chunk")
    padded_prefill = _option("padded_prefill")
    causal_tiles_rows = _option("causal_tiles_rows")
    guarded_graphs = _option("guarded_graphs")

    @classmethod
    def from_reference(cls, ref, dtype=torch.bfloat16, device=None, **kw) -> "Engine":
        """An engine over the reference model's weights (its `w` dict of checkpoint-named tensors)."""
        eng = build_engine(ref.config, DictSource(ref.w), device or ref.device, dtype, **kw)
        eng.generation_config, eng.path, eng.tokenizer = ref.generation_config, ref.path, ref.tokenizer
        return eng

    # ------------------------------------------------------------------ the model protocol

    @property
    def embedding(self) -> torch.Tensor:
        return self.w.embed

    @property
    def logit_softcap(self) -> float:
        return self.config.final_logit_softcapping

    def new_cache(self, max_tokens: int | None = None, rewind_slack: int | None = None) -> EngineKVCache:
        """A KV cache of max_tokens (default: 8192, or the model's context where smaller; more is refused)."""
        return self.forward.new_cache(cache_tokens(self.config, max_tokens), rewind_slack)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.forward.embed(ids)

    def soft_embed(self, probs: torch.Tensor) -> torch.Tensor:
        return self.forward.soft_embed(probs)

    @property
    def max_batch(self) -> int:
        """Canvases one denoise forward takes (options.max_batch): the batch scheduler's cap."""
        return self.options.max_batch

    def denoiser(self, caches):
        """The step's device side for one cache (a cache, or a sequence of one), or a batched forward over several
        (at most max_batch, each a different cache)."""
        if not isinstance(caches, (list, tuple)):
            return StagedDenoiser(self, caches)
        if len(caches) == 1:
            return StagedDenoiser(self, caches[0])
        return BatchDenoiser(self, caches)

    @torch.no_grad()
    def prefill(self, cache: EngineKVCache, ids: torch.Tensor, embeds: torch.Tensor | None = None,
                image_groups: torch.Tensor | None = None) -> None:
        """Append `ids` to the cache. Images (both optional, as ReferenceModel.prefill; diffgemma.vision.merge):
        `embeds` [T, hidden] replaces embed(ids) as the layer-0 input; `image_groups` [T] gives each row its image's
        index or -1, and one image's rows also attend to each other both ways. Runs eagerly, image rows in one chunk."""
        ids = check_ids(self, ids, "prefill ids", check_range=True)
        if embeds is not None or image_groups is not None:
            embeds, image_groups = check_image_inputs(self, len(ids), embeds, image_groups)
            cache.check_room(len(ids))
            self.forward.prefill(cache, ids, embeds, image_groups)
            return
        self._append(cache, ids)

    @torch.no_grad()
    def commit(self, cache: EngineKVCache, ids: torch.Tensor) -> None:
        """Append a block this engine sampled: prefill of its kept ids. On CUDA they are the sampler's, in range by
        construction, so not checked on the host: that read would wait for the GPU before every commit (in a batched
        round, before each request's commit in turn, holding back the others' block events)."""
        on_device = isinstance(ids, torch.Tensor) and ids.is_cuda
        self._append(cache, check_ids(self, ids, "commit ids", check_range=not on_device))

    prefill_batch = prefill_batch  # several caches' chunks in one forward (engine_batch.prefill_batch)

    def _append(self, cache: EngineKVCache, ids: torch.Tensor) -> None:
        cache.check_room(len(ids))
        pad = self.prefill_pad(cache, len(ids))
        if pad is None:
            self.forward.prefill(cache, ids)
            return
        if self._on_graphs(lambda: self._prefill_graphed(cache, ids, pad) or True):
            return
        n_real = torch.full((), len(ids), dtype=torch.long, device=self.device)
        key_rows = self.prefill_key_rows(cache, pad)
        self.forward.prefill_padded(cache, padded_ids(ids, pad, self.device), n_real, key_rows)
        cache.length += len(ids)

    def prefill_pad(self, cache: EngineKVCache, n: int) -> int | None:
        """The padded length a prefill of `n` tokens runs at now (options.padded_prefill), or None: unpadded. The
        smallest of the canvas and `prefill_pads` that holds n, fits the sliding ring, and whose rows past the
        cache's length still fit its full layers."""
        padded = self.options.padded_prefill
        if padded is None:
            padded = self.device.type == "cuda"
        if not padded:
            return None
        for pad in sorted({cache.canvas, *self.options.prefill_pads}):
            if n <= pad <= cache.ring and cache.length + pad <= cache.max_tokens + cache.canvas:
                return pad
        return None

    def prefill_key_rows(self, cache: EngineKVCache, pad: int) -> int:
        """Full-layer cache rows a padded prefill reads: the context's bucket and the chunk, within the buffer."""
        return min(self.context_bucket(cache) + pad, cache.max_tokens + cache.canvas)

    def _prefill_graphed(self, cache: EngineKVCache, ids: torch.Tensor, pad: int) -> None:
        key_rows = self.prefill_key_rows(cache, pad)
        key = (pad, key_rows, self.forward._causal_impl(pad), cache_rule(cache))
        graphs = self._prefill_graphs.setdefault(cache, {})
        entry = graphs.get(key)
        if entry is None:
            entry = graphs[key] = capture_prefill(self, cache, pad, key_rows)
        padded_ids(ids, pad, self.device, entry.ids)
        entry.n_real.fill_(len(ids))
        entry.replay()
        cache.length += len(ids)

    @torch.no_grad()
    def denoise(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return softcap(self.denoise_raw(cache, canvas_ids, sc_logits, sc_embeds), self.logit_softcap)

    def denoise_raw(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                    sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The denoise forward up to its last op, the final softcap: logits in the model's dtype, [C, V], whose
        softcap(., logit_softcap) is `denoise`'s result (the sampler's kernels softcap as they read:
        sampling/stats.StepStats(cap=)). With graphs the result is the graph's output buffer: valid until this
        engine's next denoise."""
        staged, self._staged = self._staged, None
        ahead, self._ahead = self._ahead, None
        if ahead is not None and sc_logits is None:
            entry = self._staged_entry(ahead, cache, canvas_ids, sc_embeds)
            if entry is not None:  # launched by stage_denoise(go=): by the caller's contract its condition was true
                return entry.out
        if staged is not None and sc_logits is None:
            entry = self._staged_entry(staged, cache, canvas_ids, sc_embeds)
            if entry is not None:  # checked and copied by stage_denoise: the replay alone
                entry.replay()
                self._last_graph = (weakref.ref(cache), staged[1])
                return entry.out
        with torch.no_grad():
            return self._denoise_checked(cache, canvas_ids, sc_logits, sc_embeds)

    def _denoise_checked(self, cache, canvas_ids, sc_logits, sc_embeds) -> torch.Tensor:
        ids, mode, sc = check_denoise(self, cache, canvas_ids, sc_logits, sc_embeds)
        out = self._on_graphs(lambda: self._denoise_graphed(cache, ids, mode, sc))
        return out if out is not None else self.forward.denoise(cache, ids, mode, sc, key_rows=self._key_rows(cache, len(ids)))

    def _on_graphs(self, run):
        """run() where graphs are on (CUDA), else None. A capture that fails is never wrong, only slower: graphs go off
        for this engine, with a warning saying why, and the caller runs eagerly (None)."""
        if not (self.use_graphs and self.device.type == "cuda"):
            return None
        try:
            return run()
        except Exception as e:
            self.use_graphs = False
            self.graph_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"diffgemma engine: CUDA graph capture failed, running eager ({self.graph_error})")
            return None

    # ------------------------------------------------------------------ batched denoise

    @torch.no_grad()
    def denoise_batch(self, caches, canvases, sc_logits=None, sc_embeds=None) -> list[torch.Tensor]:
        """B canvases, each against its own cache, in one forward -> B softcapped f32 logits [C_i, V] (the batched
        `denoise`; model/protocol). sc_logits / sc_embeds: None or B entries, each None or that request's."""
        return [softcap(x, self.logit_softcap) for x in self.denoise_batch_raw(caches, canvases, sc_logits, sc_embeds)]

    @torch.no_grad()
    def denoise_batch_raw(self, caches, canvases, sc_logits=None, sc_embeds=None) -> list[torch.Tensor]:
        """denoise_batch's logits before the softcap, in the model's dtype. With graphs they are views of the batch
        graphs' shared output buffer: valid until this engine's next batched denoise.

        The lanes run in engine_batch.in_lane_order, so one graph serves any order of a batch's requests."""
        self._staged = self._ahead = None  # a staged solo forward is not this one
        caches, ids, lens, sc_rows, has = check_batch(self, caches, canvases, sc_logits, sc_embeds)
        key_rows = [self._key_rows(c, C) for c, C in zip(caches, lens)]
        order, (caches, ids, lens, key_rows, sc_rows, has) = in_lane_order(caches, ids, lens, key_rows, sc_rows, has)
        ran = self._on_graphs(lambda: self._batch_graphs.run(caches, ids, lens, key_rows, sc_rows, has))
        out, perm = ran if ran is not None else (self.forward.denoise_batch(caches, ids, sc_rows, has, lens, key_rows),
                                                 list(range(len(caches))))
        return in_caller_order(out.split([lens[i] for i in perm]), [order[i] for i in perm])

    def swap_stores(self, a: EngineKVCache, b: EngineKVCache) -> None:
        """Exchange two caches' stores (engine_cache.swap_stores) with the solo and prefill graphs captured over
        them: a graph follows the buffers it reads."""
        swap_stores(a, b)
        for graphs in (self._graphs, self._prefill_graphs):
            ga, gb = graphs.pop(a, None), graphs.pop(b, None)
            if gb is not None:
                graphs[a] = gb
            if ga is not None:
                graphs[b] = ga
        self._last_graph = (None, None)
        self._staged = self._ahead = None

    @property
    def keeps_batch_graphs(self) -> bool:
        """Whether batched denoises replay graphs kept by their shape (CUDA, graphs on): warmup.warm_up_batches."""
        return self.use_graphs and self.device.type == "cuda"

    @property
    def batch_graphs_kept(self) -> int:
        """How many batched denoise graphs this engine keeps (the least recently used goes first)."""
        return self._batch_graphs.keep

    @property
    def batch_graph_counts(self) -> dict:
        """How this engine's batched denoises have run: "eager" (no graph yet), "captured", "replayed"."""
        return dict(self._batch_graphs.counts)

    @property
    def batch_prefill_counts(self) -> dict:
        """How its batched padded prefills of up to engine_batch.graph_rows rows have run, likewise."""
        return dict(self._prefill_batch_graphs.counts)

    # ------------------------------------------------------------------ context buckets

    def context_bucket(self, cache: EngineKVCache) -> int:
        b = _BUCKET0
        while b < cache.length:
            b *= 2
        return min(b, cache.max_tokens)

    def context_buckets(self, cache: EngineKVCache) -> list[int]:
        """Every context bucket a denoise on `cache` can use, ascending: bucket k serves cache lengths above bucket
        k-1 up to its own (a graph is captured per bucket; warmup.py visits each)."""
        out, b = [], _BUCKET0
        while b < cache.max_tokens:
            out.append(b)
            b *= 2
        return out + [cache.max_tokens]

    def _key_rows(self, cache: EngineKVCache, C: int) -> int:
        """Full-layer cache rows a denoise reads. On CUDA the context's bucket, graphed or eager: the canvas GEMMs'
        shapes (and the flash kernel's split count) follow it, so both compute the same bits."""
        return (self.context_bucket(cache) if self.device.type == "cuda" else cache.length) + C

    # ------------------------------------------------------------------ graphs

    def _graph_key(self, cache: EngineKVCache, C: int, mode: str) -> tuple:
        """(canvas, key rows, SC mode, attention impl, top-k rule): what a denoise graph of this cache is kept by."""
        return C, self._key_rows(cache, C), mode, self.options.attn_impl, cache_rule(cache)

    def _denoise_graphed(self, cache: EngineKVCache, ids, mode: str, sc) -> torch.Tensor:
        key = self._graph_key(cache, len(ids), mode)
        graphs = self._graphs.setdefault(cache, {})
        entry = graphs.get(key)
        if entry is None:
            entry = graphs[key] = self._capture(cache, len(ids), key[1], mode, sc)
        entry.ids.copy_(ids)
        sc = self._feed_sc(entry.sc, sc)  # held until the replay is queued: the graph may read it where it lies
        entry.replay()
        self._last_graph = (weakref.ref(cache), key)
        return entry.out  # static: the next replay overwrites it

    def _feed_sc(self, sc_buf, sc):
        """Give a graph its SC input: the logits' address (RowsAt: the graph reads them where they lie), or a copy
        into its static buffer. -> the tensor the graph will read, which must outlive the replay's queueing."""
        if isinstance(sc_buf, RowsAt):
            sc = aligned(sc.to(self.device, torch.float32))  # a view starting mid-vector is copied
            sc_buf.point_at(sc)
        elif sc_buf is not None:
            sc_buf.copy_(sc)
        return sc

    def _capture(self, cache, C, key_rows, mode, sc) -> DenoiseGraph:
        ids_buf = torch.zeros(C, dtype=torch.long, device=self.device)
        if mode == "logits" and use_triton(sc):  # read by the row-stats kernels alone (Forward._sc_probs): no copy
            sc_buf = RowsAt(*sc.shape, self.device)
        else:
            sc_buf = None if mode == "none" else torch.zeros(sc.shape, dtype=sc.dtype, device=self.device)
        self._feed_sc(sc_buf, sc)
        # Warm up on a side stream (Triton compile, cuBLAS workspaces), then capture. The warm-up writes only canvas
        # scratch rows of the cache, which no read outside a denoise sees.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward.denoise(cache, ids_buf, mode, sc_buf, key_rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._fresh_pool_if_dead()
        guarded = self.options.guarded_graphs and self._guard_ok()
        graph = torch.cuda.CUDAGraph(keep_graph=guarded)  # a guarded twin clones the kept cudaGraph_t
        with capture(graph, self._graph_pool):
            out = self.forward.denoise(cache, ids_buf, mode, sc_buf, key_rows)
        guard = None
        if guarded:
            graph.instantiate()
            try:
                guard = GuardedGraph(graph, torch.ones((), dtype=torch.bool, device=self.device))
            except Exception as e:  # never wrong without it, only without the launch ahead
                self.guard_error = f"{type(e).__name__}: {e}"
                warnings.warn(f"diffgemma engine: no guarded denoise graph ({self.guard_error})")
        return DenoiseGraph(graph, ids_buf, sc_buf, out, guard)

    def _fresh_pool_if_dead(self) -> None:
        """A fresh pool whenever no graph is alive: the allocator frees a pool once its last graph dies, and
        capturing into that dead handle again trips its internal assert (use_count > 0)."""
        if not (any(self._graphs.values()) or any(self._prefill_graphs.values()) or self._batch_graphs.graphs
                or self._prefill_batch_graphs.graphs):
            self._graph_pool = torch.cuda.graph_pool_handle()

    def clear_graphs(self) -> None:
        """Drop every captured graph (denoise and prefill), e.g. after patching what a graph captured."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._batch_graphs.clear()
        self._prefill_batch_graphs.clear()

    def _guard_ok(self) -> bool:
        if self.guard_error is None:
            self.guard_error = guard_support(self.device)
        return self.guard_error is None

    # ------------------------------------------------------------------ staging (the run-ahead step)

    @torch.no_grad()
    def stage_denoise(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_embeds: torch.Tensor | None = None,
                      go: torch.Tensor | None = None) -> bool:
        """Copy a coming `denoise_raw(cache, canvas_ids, sc_embeds=sc_embeds)`'s inputs into its graph's static
        buffers now, queued on the current stream; that call, on the same stream and with these very tensors
        unchanged, then launches the replay alone. -> whether anything was staged (a graph for that call exists).
        The loop knows the next step's inputs before its status read, and CUDA calls the host makes right after
        such a wait run slowly while the GPU waits; staged before the read, they are queued while the GPU is busy.
        Any other denoise call in between drops the staging; a call with other tensors, or with these modified in
        place since, copies as usual.

        go (a bool device scalar): also launch the forward now, conditioned on `go` as the GPU finds it when the
        replay starts (a guarded graph). Contract: the caller makes that very call only when go was true, and then
        gets the launched forward's output (no second launch); when go was false the replay ran nothing, and any
        other call (other inputs, another cache, or none) is safe. -> whether the forward was launched (False: at
        most staged, e.g. plain graphs)."""
        self._staged = self._ahead = None
        if not (self.use_graphs and self.device.type == "cuda" and isinstance(canvas_ids, torch.Tensor)
                and canvas_ids.is_cuda and canvas_ids.dim() == 1 and canvas_ids.dtype == torch.long):
            return False
        C, mode = len(canvas_ids), "embeds" if sc_embeds is not None else "none"
        if C > cache.canvas or (sc_embeds is not None and tuple(sc_embeds.shape) != (C, self.config.hidden_size)):
            return False
        key = self._graph_key(cache, C, mode)
        entry = self._graphs.get(cache, {}).get(key)
        if entry is None:
            return False
        entry.ids.copy_(canvas_ids)
        if entry.sc is not None:
            entry.sc.copy_(sc_embeds)
        staged = (entry, key, canvas_ids, canvas_ids._version, sc_embeds,
                  None if sc_embeds is None else sc_embeds._version)
        if go is None or entry.guard is None:
            self._staged = staged
            return go is None
        entry.launch_if(go)
        self._ahead = staged
        self._last_graph = (weakref.ref(cache), key)
        return True

    def drop_staged(self) -> None:
        """Forget what stage_denoise staged or launched (at a canvas' end): the staging holds its graph and input
        tensors, which should not outlive the block, let alone a cache."""
        self._staged = self._ahead = None

    def _staged_entry(self, staged, cache, ids, sc):
        """The graph entry stage_denoise filled with these very inputs, unchanged since and still this call's graph
        (the same cache and context bucket, graphs on), or None."""
        entry, key, s_ids, s_ids_v, s_sc, s_sc_v = staged
        if not (ids is s_ids and sc is s_sc and ids._version == s_ids_v and (sc is None or sc._version == s_sc_v)
                and self.use_graphs):
            return None
        if key != self._graph_key(cache, key[0], key[2]) or self._graphs.get(cache, {}).get(key) is not entry:
            return None
        return entry

    def logits_scratch(self) -> torch.Tensor | None:
        """The [canvas, vocab] buffer the last graphed denoise wrote its raw logits to, while that graph lives (else
        None). It is dead from the moment that denoise's logits were read until the next denoise writes it again: a
        loop on `denoise`'s softcapped logits lends it to the dense SC's probabilities. A loop on `denoise_raw` reads
        this very buffer as its logits (SparsePlan never writes the logits' own storage)."""
        cache_ref, key = self._last_graph
        cache = cache_ref() if cache_ref is not None else None
        entry = self._graphs.get(cache, {}).get(key) if cache is not None else None
        return entry.out if entry is not None else None

