"""The server's queueing and prefill defaults: one place for the worker (worker.py) and the `serve` flags
(commands.py), importable without the model's stack (docs/ARCHITECTURE.md, 'Limits and the queue')."""

# prompt tokens prefilled a round while no other request denoises: the longest padded prefill
# (EngineOptions.prefill_pads), which replays a graph; a longer chunk runs eagerly
PREFILL_CHUNK = 1024
# while other requests generate: the canvas-sized padded prefill, the shortest graphed one, so a running stream's
# step waits for at most one short chunk
BUSY_PREFILL_CHUNK = 256
# requests waiting beyond those that can start now; one more is refused with a 503
MAX_QUEUE = 64
