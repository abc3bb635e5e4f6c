"""GET /metrics: the server's state in the Prometheus text format (prometheus_client), read from the worker at each
scrape (Worker.metrics). docs/ARCHITECTURE.md, 'Serving'.

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
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_GAUGES = (("requests_running", "running", "Requests in the running batch"),
           ("requests_queued", "queued", "Requests waiting for a place in the batch"),
           ("max_batch", "max_batch", "Requests stepped together at most (--max-batch)"),
           ("max_queue", "max_queue", "Requests that may wait beyond those that can start (--max-queue)"),
           ("slots", "slots", "KV cache slots (--slots)"),
           ("context_tokens", "max_tokens", "Tokens a slot's cache holds (--max-tokens)"))
_COUNTERS = (("requests_started", "started", "Requests that joined the batch"),
             ("requests_left", "finished", "Requests whose turn ended (done, cancelled, or failed in the turn)"),
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


def registry_for(worker) -> CollectorRegistry:
    """A registry of its own (not the process-wide default) holding the worker's collector."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_WorkerCollector(worker))
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """-> (the scrape's body, its media type)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
