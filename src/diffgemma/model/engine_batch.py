"""The engine's batched denoise, runner side: checking a batch's inputs, and the graphs of batched forwards.

A batched denoise (Forward.denoise_batch) reads B caches' buffers, so its CUDA graph belongs to that set of caches
(and the lanes' lengths and context buckets): one is captured when a batch's membership is new and replayed while
it stays, which in a scheduler is for as long as the same requests step together. A membership is captured on its
second round in a row: while requests join one by one each round's batch is new, and a capture costs a few eager
forwards, so a batch seen once runs eagerly. The kept graphs are bounded (the least recently used goes first: each
holds its [rows, V] logits), and a graph whose cache died is dropped.
"""

from __future__ import annotations

import collections

import torch

from ..errors import InputError
from .engine_graph import BatchGraph, CacheRefs, capture
from .engine_inputs import check_ids


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


KEPT_GRAPHS = 4  # batched graphs an engine keeps: each holds every lane's [canvas, vocab] logits


class BatchGraphs:
    """The engine's batched denoise graphs, by (the caches' ids, the lanes' lengths, key rows, attention impl, kernel
    path rule), most recently used last."""

    def __init__(self, engine, keep: int = KEPT_GRAPHS):
        self.engine, self.keep = engine, keep
        self.graphs: dict[tuple, BatchGraph] = {}
        self._last = None  # the key of the last batch run, and weak references to its caches
        # how the batched forwards ran: "eager" (no graph yet), "captured" (then replayed), "replayed"
        self.counts: collections.Counter = collections.Counter()

    def clear(self) -> None:
        self.graphs.clear()
        self._last = None

    def run(self, caches, ids, lens, key_rows, sc_rows, has) -> torch.Tensor | None:
        """Replay the graph of this batch with these inputs -> its raw logits buffer; captured first when the same
        batch also ran the round before. None: no graph for it yet (the caller runs the forward eagerly)."""
        opts = self.engine.options
        key = (tuple(id(c) for c in caches), tuple(lens), tuple(key_rows), opts.attn_impl, opts.batch_paths,
               opts.lane_streams)
        entry = self.graphs.pop(key, None)
        if entry is not None and not entry.serves(caches):  # a cache died and another took its address
            entry = None
        repeated = self._last is not None and self._last[0] == key and self._last[1].serves(caches)
        self._last = (key, CacheRefs(caches))
        if entry is None and not repeated:
            self.counts["eager"] += 1
            return None
        self.counts["replayed" if entry is not None else "captured"] += 1
        if entry is None:
            for k in [k for k, e in self.graphs.items() if not e.alive()]:
                del self.graphs[k]
            while len(self.graphs) >= self.keep:
                del self.graphs[next(iter(self.graphs))]
            entry = self._capture(caches, ids, lens, key_rows, sc_rows, has)
        self.graphs[key] = entry
        entry.ids.copy_(ids)
        entry.sc.copy_(sc_rows)
        entry.has.copy_(has)
        entry.replay()
        return entry.out

    def _capture(self, caches, ids, lens, key_rows, sc_rows, has) -> BatchGraph:
        """Warmed up once on a side stream (it writes only the caches' canvas scratch rows; the same batch ran eagerly
        the round before, so its kernels are compiled), then captured into the engine's shared graph pool."""
        eng = self.engine
        fwd, dev = eng.forward, eng.device
        ids_buf, sc_buf, has_buf = ids.clone(), sc_rows.clone(), has.clone()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            fwd.denoise_batch(caches, ids_buf, sc_buf, has_buf, lens, key_rows)
        torch.cuda.current_stream(dev).wait_stream(stream)
        eng._fresh_pool_if_dead()
        graph = torch.cuda.CUDAGraph()
        with capture(graph, eng._graph_pool):
            out = fwd.denoise_batch(caches, ids_buf, sc_buf, has_buf, lens, key_rows)
        return BatchGraph(graph, caches, ids_buf, sc_buf, has_buf, out)

