"""The captured graphs (denoise, padded prefill, batched denoise and prefill), what the engine keeps with each, and the
capture."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch

from .graph_guard import GuardedGraph


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool):
    """torch.cuda.graph(graph, pool=pool) with Python's cyclic garbage collector paused. A collection that runs
    during the capture may free a dead graph left in a reference cycle and so destroy a graph executable
    mid-capture, which CUDA refuses and which invalidates the capture. Cycles are collected as usual after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


class DenoiseGraph:
    """A captured denoise: the torch graph, its static inputs (canvas ids; the SC buffer or None), its output (raw
    logits), and `guard`: the same graph as the body of an IF node on a device flag (graph_guard.GuardedGraph), or
    None where graphs are plain. `replay()` runs the forward; `launch_if(go)` runs it only if the bool device scalar
    `go` is true when the GPU gets there (Engine.stage_denoise(go=))."""

    __slots__ = ("graph", "ids", "sc", "out", "guard")

    def __init__(self, graph, ids, sc, out, guard: GuardedGraph | None = None):
        self.graph, self.ids, self.sc, self.out, self.guard = graph, ids, sc, out, guard

    def replay(self) -> None:
        self.graph.replay()

    def launch_if(self, go: torch.Tensor) -> None:
        self.guard.flag.copy_(go)
        self.guard.launch()


class PrefillGraph:
    """A captured padded prefill (Forward.prefill_padded): the torch graph and its static inputs, the padded ids and
    the real-row count (an int64 device scalar). It has no output: it writes the cache."""

    __slots__ = ("graph", "ids", "n_real")

    def __init__(self, graph, ids, n_real):
        self.graph, self.ids, self.n_real = graph, ids, n_real

    def replay(self) -> None:
        self.graph.replay()


def padded_ids(ids: torch.Tensor, pad: int, device, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids in the first rows of `out` (or of new zeros) of `pad` rows."""
    out = torch.zeros(pad, dtype=torch.long, device=device) if out is None else out
    out[: len(ids)].copy_(ids)
    return out


def capture_prefill(engine, cache, pad: int, key_rows: int) -> PrefillGraph:
    """The graph of `engine`'s padded prefill (Forward.prefill_padded) of `pad` rows over `cache`, static ids [pad] and
    a real-row count. Warmed up and captured with no real row, so neither writes anything a read can see (pad rows
    leave the ring as it was and the length where it was; full-layer rows past the length are scratch)."""
    fwd, dev = engine.forward, engine.device
    ids_buf = torch.zeros(pad, dtype=torch.long, device=dev)
    n_buf = torch.zeros((), dtype=torch.long, device=dev)
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fwd.prefill_padded(cache, ids_buf, n_buf, key_rows)
    torch.cuda.current_stream(dev).wait_stream(stream)
    engine._fresh_pool_if_dead()
    graph = torch.cuda.CUDAGraph()
    with capture(graph, engine._graph_pool):
        fwd.prefill_padded(cache, ids_buf, n_buf, key_rows)
    return PrefillGraph(graph, ids_buf, n_buf)


class OverStores:
    """A graph captured over several caches' stores (engine_cache.KVStore): weak references to them; it is replayed
    only while every one is alive, by the caches holding them then (engine_batch.BatchGraphs)."""

    __slots__ = ("graph", "store_refs")

    def __init__(self, graph, stores):
        self.graph = graph
        self.store_refs = [weakref.ref(s) for s in stores]

    def stores(self) -> list:
        """The lanes' stores, None for one that died."""
        return [r() for r in self.store_refs]

    def alive(self) -> bool:
        return all(s is not None for s in self.stores())

    def replay(self) -> None:
        self.graph.replay()


class BatchGraph(OverStores):
    """A captured batched denoise (Forward.denoise_batch): its static inputs (ids, SC rows, SC row flags) and its
    output (raw logits of every lane's rows)."""

    __slots__ = ("ids", "sc", "has", "out")

    def __init__(self, graph, stores, ids, sc, has, out):
        super().__init__(graph, stores)
        self.ids, self.sc, self.has, self.out = ids, sc, has, out


class BatchPrefillGraph(OverStores):
    """A captured batched padded prefill (engine_batch.prefill_padded_batch): its static inputs, the lanes' padded
    ids [B·N] and real-row counts [B] (int64). It has no output: it writes the caches."""

    __slots__ = ("ids", "n_real")

    def __init__(self, graph, stores, ids, n_real):
        super().__init__(graph, stores)
        self.ids, self.n_real = ids, n_real
