"""The engine's batched denoise, runner side: checking a batch's inputs, and the graphs of batched forwards; and
the batched prefill of several caches' chunks (prefill_batch: a round's commits, or its joining prompts), graphed the
same way up to graph_rows.

A batched denoise (Forward.denoise_batch) reads B caches' buffers, so its CUDA graph is captured over those caches'
stores (engine_cache.KVStore). It is kept by the batch's shape alone (the lanes' canvas lengths and context buckets,
in the engine's lane order, and the options that choose kernels), not by its members: to replay it for another set
of caches of that shape, the engine first hands those caches the graph's stores (engine_cache.swap_stores: each
cache keeps its contents, at the addresses the graph reads; the caches that held those stores take the others).
So requests joining and leaving a running batch replay the graphs of its sizes instead of running eagerly. A shape
is captured the second time it is seen (a capture costs a few eager forwards; a shape seen once runs eagerly).
Every graph writes its logits into one buffer of max_batch canvases (BatchGraphs.logits), and its intermediates live
in the engine's shared graph pool, so a kept graph costs little memory: enough are kept for a server whose batch
size wanders over every size at a few context buckets (the least recently used goes first), and a graph whose store
died with its cache is dropped.
"""

from __future__ import annotations

import collections
import weakref

import torch

from ..errors import InputError
from ..ops.attention_topk import cache_rule
from .engine_graph import BatchGraph, BatchPrefillGraph, capture, padded_ids
from .engine_inputs import check_ids
from .lane_attention import lanes_attend


def check_batch(engine, caches, canvases, sc_logits, sc_embeds):
    """-> (caches, the ids concatenated, each lane's length, the SC rows [rows, H], whether a row has an SC signal
    [rows]), checked. A lane with SC logits gets their soft embedding (Forward.sc_logits_embeds: the ops its solo
    'logits' mode runs); a lane without an SC signal zero rows."""
    caches = list(caches)
    B, V, H = len(caches), engine.config.vocab_size, engine.config.hidden_size
    if not 1 <= B <= engine.max_batch:
        raise InputError(f"denoise_batch: expected 1 to {engine.max_batch} caches (max_batch), got {B}")
    if len({id(c) for c in caches}) != B:
        raise InputError("denoise_batch: a cache appears twice; each lane needs its own cache")
    if len(canvases) != B:
        raise InputError(f"denoise_batch: expected one canvas per cache, got {len(canvases)} for {B} caches")
    sc_logits = [None] * B if sc_logits is None else list(sc_logits)
    sc_embeds = [None] * B if sc_embeds is None else list(sc_embeds)
    if len(sc_logits) != B or len(sc_embeds) != B:
        raise InputError(f"denoise_batch: sc_logits / sc_embeds need one entry per cache ({B})")
    ids, lens, sc = [], [], []
    for b, (cache, c, lg, em) in enumerate(zip(caches, canvases, sc_logits, sc_embeds)):
        c = check_ids(engine, c, f"canvas {b} ids", check_range=not (isinstance(c, torch.Tensor) and c.is_cuda))
        C = len(c)
        if C > cache.canvas:
            raise InputError(f"denoise_batch: canvas {b} of {C} tokens exceeds its cache's canvas scratch "
                             f"({cache.canvas})")
        if lg is not None and em is not None:
            raise InputError(f"denoise_batch: lane {b} passes sc_logits and sc_embeds; expected at most one")
        if lg is not None and tuple(lg.shape) != (C, V):
            raise InputError(f"denoise_batch: sc_logits {b} has shape {list(lg.shape)}, expected [{C}, {V}]")
        if em is not None and tuple(em.shape) != (C, H):
            raise InputError(f"denoise_batch: sc_embeds {b} has shape {list(em.shape)}, expected [{C}, {H}]")
        ids.append(c)
        lens.append(C)
        sc.append(engine.forward.sc_logits_embeds(lg.to(engine.device)) if lg is not None else em)
    dev, dtype = engine.device, engine.dtype
    has = torch.cat([torch.full((C,), s is not None, dtype=torch.bool, device=dev) for C, s in zip(lens, sc)])
    rows = torch.cat([torch.zeros(C, H, dtype=dtype, device=dev) if s is None else s.to(dev, dtype)
                      for C, s in zip(lens, sc)])
    return caches, torch.cat(ids), lens, rows, has


def in_lane_order(caches, ids, lens, key_rows, sc_rows, has):
    """-> (order, the batch with its lanes in that order): by (canvas length, context bucket), so a batch's graph
    serves its requests in any order. A lane's rows are its own wherever it runs (the forward is batch invariant)."""
    order = sorted(range(len(caches)), key=lambda i: (lens[i], key_rows[i]))
    if order == list(range(len(order))):
        return order, (caches, ids, lens, key_rows, sc_rows, has)
    rows = lane_rows(lens, order, ids.device)
    pick = lambda xs: [xs[i] for i in order]  # noqa: E731
    return order, (pick(caches), ids[rows], pick(lens), pick(key_rows), sc_rows[rows], has[rows])


def lane_rows(lens, order, device) -> torch.Tensor:
    """The row indices that put lanes (of lens[i] rows each, concatenated) in `order`."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return torch.cat([torch.arange(starts[i], starts[i] + lens[i], device=device) for i in order])


def in_caller_order(parts, order) -> list:
    """The lanes' results, run in `order`, back in the caller's order."""
    back = [None] * len(parts)
    for place, i in enumerate(order):
        back[i] = parts[place]
    return back


KEPT_GRAPHS = 32  # batched graphs an engine keeps (their logits share one buffer)
SEEN_SHAPES = 64  # shapes remembered as seen once (a second sighting captures)


class BatchGraphs:
    """The engine's graphs of one kind of batched forward, most recently used last: batched denoises (`run`) by (the
    lanes' lengths, key rows, attention impl, kernel path rule, lane streams), or batched padded prefills
    (`run_prefill`) by (padded length, key rows, causal attention impl, kernel path rule); each also by its lanes'
    top-k rule. The engine keeps one of each kind."""

    def __init__(self, engine, keep: int = KEPT_GRAPHS):
        # weakly: the engine owns this, and a cycle would leave a dropped engine's graphs to the cyclic collector,
        # which may run during another engine's capture (engine_graph.capture)
        self._engine, self.keep = weakref.ref(engine), keep
        self.graphs: dict[tuple, BatchGraph] = {}
        self.seen: collections.OrderedDict = collections.OrderedDict()  # shapes run eagerly once
        # how the batched forwards ran: "eager" (no graph yet), "captured" (then replayed), "replayed" (every key
        # present from the start: a server's /metrics copies this from another thread)
        self.counts: collections.Counter = collections.Counter(eager=0, captured=0, replayed=0)
        # every graph's logits, as views of its first rows: valid until the next batched denoise of any shape
        self.logits: torch.Tensor | None = None

    @property
    def engine(self):
        return self._engine()

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()
        self.logits = None

    def _logits_rows(self, rows: int) -> torch.Tensor | None:
        """The shared logits buffer's first `rows` rows (made at the first capture: max_batch canvases of the model's
        length), or None for a batch of longer canvases (its graph then keeps logits of its own)."""
        eng = self.engine
        if self.logits is None:
            cfg = eng.config
            self.logits = torch.empty(eng.max_batch * cfg.canvas_length, cfg.vocab_size, dtype=eng.dtype,
                                      device=eng.device)
        return self.logits[:rows] if rows <= len(self.logits) else None

    def run(self, caches, ids, lens, key_rows, sc_rows, has):
        """Replay the graph of this batch's shape with these inputs, its stores handed to these caches first ->
        (its raw logits buffer, perm: graph lane j ran caches[perm[j]]); captured first when the shape was seen
        before. The lanes come in in_lane_order; perm only reorders lanes of one shape. None: no graph for it yet
        (the caller runs the forward eagerly)."""
        opts = self.engine.options
        key = (tuple(lens), tuple(key_rows), opts.attn_impl, opts.batch_paths, opts.lane_streams)
        got = self._graph(key, caches, lens, key_rows,
                          lambda: self._capture(caches, ids, lens, key_rows, sc_rows, has))
        if got is None:
            return None
        entry, perm = got
        if perm != sorted(perm):
            rows = lane_rows(lens, perm, ids.device)
            ids, sc_rows, has = ids[rows], sc_rows[rows], has[rows]
        entry.ids.copy_(ids)
        entry.sc.copy_(sc_rows)
        entry.has.copy_(has)
        entry.replay()
        return entry.out, perm

    def run_prefill(self, caches, ids: torch.Tensor, N: int, n_real: list[int], key_rows) -> bool:
        """prefill_padded_batch of these caches (ids [B·N], n_real: each lane's real rows, key_rows: each lane's, the
        lanes in ascending key_rows) from the graph of its shape, its stores handed to these caches first; captured
        first when the shape was seen before. -> whether it ran (False: the caller runs it eagerly). The inputs go in
        by device gathers, copies and fills alone: a host-to-device copy would wait for the GPU's queued work."""
        opts, B = self.engine.options, len(caches)
        key = ("prefill", N, tuple(key_rows), self.engine.forward._causal_impl(N), opts.batch_paths)
        got = self._graph(key, caches, [N] * B, key_rows, lambda: self._capture_prefill(caches, N, key_rows))
        if got is None:
            return False
        entry, perm = got
        entry.ids.copy_(ids if perm == sorted(perm) else ids[lane_rows([N] * B, perm, ids.device)])
        for j, i in enumerate(perm):
            entry.n_real[j].fill_(n_real[i])
        entry.replay()
        return True

    def _graph(self, key, caches, lens, key_rows, capture):
        """-> (the graph kept for `key` plus the caches' top-k rule, its stores handed to these caches, perm: graph
        lane j runs caches[perm[j]]), made by capture() when the shape was seen before; or None: a shape seen for the
        first time (the caller runs eagerly), or lanes of mixed top-k rules (a graph runs one)."""
        rules = {cache_rule(c) for c in caches}
        if len(rules) > 1:
            return None
        key = (*key, rules.pop())
        entry = self.graphs.pop(key, None)
        perm = self._place(entry, caches, lens, key_rows) if entry is not None else None
        if perm is None:  # no graph, or a store died, or a store would go to a cache of another geometry
            entry = None
            if key not in self.seen:
                self.seen[key] = True
                while len(self.seen) > SEEN_SHAPES:
                    self.seen.popitem(last=False)
                self.counts["eager"] += 1
                return None
        self.counts["replayed" if entry is not None else "captured"] += 1
        if entry is None:
            for k in [k for k, e in self.graphs.items() if not e.alive()]:
                del self.graphs[k]
            while len(self.graphs) >= self.keep:
                del self.graphs[next(iter(self.graphs))]
            entry, perm = capture(), list(range(len(caches)))
        self.graphs[key] = entry
        return entry, perm

    def _place(self, entry: BatchGraph, caches, lens, key_rows) -> list | None:
        """Hand the batch's caches the graph's stores -> perm (graph lane j runs caches[perm[j]]), or None (nothing
        exchanged) when a store died or a cache would take a store of another geometry. Lanes of one shape are
        interchangeable: a cache already holding one of its shape's stores keeps it, the others take the rest from
        whoever holds them (Engine.swap_stores, which moves each cache's contents along)."""
        stores = entry.stores()
        if any(s is None or s.owner() is None for s in stores):
            return None
        shape = list(zip(lens, key_rows))
        perm: list = [None] * len(caches)
        free = []
        for i, cache in enumerate(caches):  # the lane order is by shape, the same in the graph as here
            j = next((j for j, s in enumerate(stores) if s is cache.store and shape[j] == shape[i]), None)
            if j is None:
                free.append(i)
            else:
                perm[j] = i
        for j in range(len(stores)):
            if perm[j] is None:
                perm[j] = next(i for i in free if shape[i] == shape[j])
                free.remove(perm[j])
        moves = [(caches[i], stores[j]) for j, i in enumerate(perm) if caches[i].store is not stores[j]]
        if any(c.geometry != s.owner().geometry for c, s in moves):
            return None
        for cache, store in moves:
            self.engine.swap_stores(cache, store.owner())
        return perm

    def _capture(self, caches, ids, lens, key_rows, sc_rows, has) -> BatchGraph:
        """Warmed up once on a side stream (it writes only the caches' canvas scratch rows; the same shape ran
        eagerly before, so its kernels are compiled), then captured into the engine's shared graph pool."""
        eng = self.engine
        fwd, dev = eng.forward, eng.device
        ids_buf, sc_buf, has_buf = ids.clone(), sc_rows.clone(), has.clone()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            fwd.denoise_batch(caches, ids_buf, sc_buf, has_buf, lens, key_rows)
        torch.cuda.current_stream(dev).wait_stream(stream)
        eng._fresh_pool_if_dead()
        shared = self._logits_rows(len(ids))
        graph = torch.cuda.CUDAGraph()
        with capture(graph, eng._graph_pool):
            out = fwd.denoise_batch(caches, ids_buf, sc_buf, has_buf, lens, key_rows, out=shared)
        return BatchGraph(graph, [c.store for c in caches], ids_buf, sc_buf, has_buf, out)

    def _capture_prefill(self, caches, N: int, key_rows) -> BatchPrefillGraph:
        """prefill_padded_batch's graph over these caches, static ids [B·N] and real-row counts [B]: warmed up twice
        on a side stream and captured with no real row, so nothing a read can see is written (as
        engine_graph.capture_prefill does for one cache)."""
        eng = self.engine
        fwd, dev = eng.forward, eng.device
        ids_buf = torch.zeros(len(caches) * N, dtype=torch.long, device=dev)
        n_buf = torch.zeros(len(caches), dtype=torch.long, device=dev)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                prefill_padded_batch(fwd, caches, ids_buf, N, n_buf.unbind(), key_rows)
        torch.cuda.current_stream(dev).wait_stream(stream)
        eng._fresh_pool_if_dead()
        graph = torch.cuda.CUDAGraph()
        with capture(graph, eng._graph_pool):
            prefill_padded_batch(fwd, caches, ids_buf, N, n_buf.unbind(), key_rows)
        return BatchPrefillGraph(graph, [c.store for c in caches], ids_buf, n_buf)


def prefill_batch(engine, caches, ids) -> None:
    """Engine.prefill of a text chunk into each cache (a block's commit, or a prompt's chunk): the lanes whose chunks
    run padded to one length (Engine.prefill_pad) in one forward (prefill_padded_batch), each cache written with the
    bits its own prefill writes; a lane alone at its padded length, or unpadded, through Engine.commit. Every lane's
    ids and room are checked before anything is written. A padded forward of at most graph_rows(engine) rows replays
    the graph of its shape where graphs are on (BatchGraphs.run_prefill: lanes in ascending key rows)."""
    caches = list(caches)
    if len(ids) != len(caches) or len({id(c) for c in caches}) != len(caches):
        raise InputError(f"prefill_batch: expected one chunk of ids for each of {len(caches)} different caches, got "
                         f"{len(ids)} chunks")
    groups: dict = {}
    for cache, x in zip(caches, ids):
        x = check_ids(engine, x, "prefill ids", check_range=not (isinstance(x, torch.Tensor) and x.is_cuda))
        cache.check_room(len(x))
        groups.setdefault(engine.prefill_pad(cache, len(x)), []).append((cache, x))
    for pad, lanes in groups.items():
        if pad is None or len(lanes) == 1:
            for cache, x in lanes:
                engine.commit(cache, x)
            continue
        dev = engine.device
        lanes = sorted(((engine.prefill_key_rows(c, pad), c, x) for c, x in lanes), key=lambda lane: lane[0])
        key_rows, group = [k for k, _, _ in lanes], [c for _, c, _ in lanes]
        n_real = [len(x) for _, _, x in lanes]
        rows = torch.cat([padded_ids(x, pad, dev) for _, _, x in lanes])
        graphs = engine._prefill_batch_graphs
        if not (len(rows) <= graph_rows(engine)
                and engine._on_graphs(lambda: graphs.run_prefill(group, rows, pad, n_real, key_rows))):
            counts = [torch.full((), n, dtype=torch.long, device=dev) for n in n_real]  # fills: no host-to-device copy
            prefill_padded_batch(engine.forward, group, rows, pad, counts, key_rows)
        for cache, n in zip(group, n_real):
            cache.length += n


def graph_rows(engine) -> int:
    """The most rows a batched prefill replays from a graph (0 with options.batch_prefill_graphs off): as many as the
    largest graphs the engine keeps anyway (a batched denoise of max_batch canvases, a padded prefill of its largest
    pad), so the shared graph pool needs no more than those; a longer one runs eagerly, where its GPU time dwarfs the
    launches a graph saves."""
    opts = engine.options
    return max(opts.max_batch * engine.config.canvas_length, *opts.prefill_pads) if opts.batch_prefill_graphs else 0


@torch.no_grad()
def prefill_padded_batch(fwd, caches, ids: torch.Tensor, N: int, n_reals, key_rows) -> None:
    """Forward.prefill_padded of B caches in one forward: ids [B·N], lane b's N rows (its first n_reals[b] real) after
    lane a's; key_rows: each lane's. The projections, router and experts run over all rows at once with the kernel
    paths of one lane's N rows (options.batch_paths, as in a batched denoise); each lane attends to and writes its own
    cache as prefill_padded does alone (Forward.padded_lane; docs/ARCHITECTURE.md, 'Batching')."""
    lanes = [fwd.padded_lane(c, N, n, k) for c, n, k in zip(caches, n_reals, key_rows)]
    attend = lanes_attend(fwd.w.layers, [(b * N, (b + 1) * N, lane) for b, (lane, _) in enumerate(lanes)], None,
                          fwd.device)
    fwd._lane_rows = N
    try:
        fwd._run_layers(fwd.embed(ids), [lw.prefill_scalar for lw in fwd.w.layers], attend, False, None)
    finally:
        fwd._lane_rows = None
    for _, finish in lanes:
        finish()
