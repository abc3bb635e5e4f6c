"""GET /metrics: the server's state in the Prometheus text format (prometheus_client), read from the worker at each
scrape (Worker.metrics). docs/SERVING.md, 'Metrics'.

    diffgemma_requests_running / _queued          gauges: requests in the batch; waiting for a place in it
    diffgemma_max_batch, _max_queue, _slots,      gauges: the limits the server runs with
    diffgemma_context_tokens
    diffgemma_requests_started_total              requests that joined the batch
    diffgemma_requests_left_total                 requests whose turn ended (done, cancelled, or failed in the turn)
    diffgemma_requests_failed_total               requests that ended with an error
    diffgemma_forwards_total                      the rounds' denoise forwards (one a round, over every asking request)
    diffgemma_canvas_steps_total                  canvases those forwards stepped (/ forwards = the mean batch)
    diffgemma_prefill_tokens_total                prompt tokens prefilled
    diffgemma_batch_forwards_total{how=...}       the engine's batched forwards: "replayed" (a CUDA graph),
                                                  "captured" (a graph made, then replayed), "eager"
    diffgemma_round_seconds                       histogram: a round that ran a forward (its prefill chunks, the
                                                  forward, the requests' steps and their status read)
    diffgemma_request_seconds                     histogram: a request's turn, from joining the batch to its end
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_GAUGES = (("requests_running", "running", "Requests in the running batch"),
           ("requests_queued", "queued", "Requests waiting for a place in the batch"),
           ("max_batch", "max_batch", "Requests stepped together at most (--max-batch)"),
           ("max_queue", "max_queue", "Requests that may wait beyond those that can start (--max-queue)"),
           ("slots", "slots", "KV cache slots (--slots)"),
           ("context_tokens", "max_tokens", "Tokens a slot's cache holds (--max-tokens)"))
_COUNTERS = (("requests_started", "started", "Requests that joined the batch"),
             ("requests_left", "left", "Requests whose turn ended (done, cancelled, or failed in the turn)"),
             ("requests_failed", "failed", "Requests that ended with an error"),
             ("forwards", "forwards", "Denoise forwards of the rounds (one a round, over every asking request)"),
             ("canvas_steps", "canvas_steps", "Canvases the forwards stepped (divided by forwards: the mean batch)"),
             ("prefill_tokens", "prefill_tokens", "Prompt tokens prefilled"))


class _WorkerCollector:
    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        m = self.worker.metrics()
        for name, key, doc in _GAUGES:
            yield GaugeMetricFamily(f"diffgemma_{name}", doc, value=m[key])
        for name, key, doc in _COUNTERS:
            yield CounterMetricFamily(f"diffgemma_{name}", doc, value=m["counts"].get(key, 0))
        how = CounterMetricFamily("diffgemma_batch_forwards", "The engine's batched forwards, by how they ran",
                                  labels=["how"])
        for k in ("replayed", "captured", "eager"):
            how.add_metric([k], m["batch_forwards"].get(k, 0))
        yield how


ROUND_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Timings:
    """The worker's listener (Worker.listeners): its round and turn times into histograms."""

    def __init__(self, registry: CollectorRegistry):
        self.rounds = Histogram("diffgemma_round_seconds", "Seconds of a round that ran a forward",
                                buckets=ROUND_BUCKETS, registry=registry)
        self.turns = Histogram("diffgemma_request_seconds", "Seconds of a request's turn, joining the batch to its end",
                               buckets=REQUEST_BUCKETS, registry=registry)

    def round(self, seconds: float) -> None:
        self.rounds.observe(seconds)

    def turn(self, seconds: float) -> None:
        self.turns.observe(seconds)


def registry_for(worker) -> CollectorRegistry:
    """A registry of its own (not the process-wide default) holding the worker's collector and its timings."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_WorkerCollector(worker))
    worker.listeners.append(_Timings(registry))
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """-> (the scrape's body, its media type)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
