"""The server's queueing, prefill and request-size defaults: one place for the worker (worker.py) and the `serve` flags
(commands.py), importable without the model's stack (docs/ARCHITECTURE.md, 'Limits and the queue')."""

# prompt tokens prefilled a round while no other request denoises: the longest padded prefill
# (EngineOptions.prefill_pads), which replays a graph; a longer chunk runs eagerly
PREFILL_CHUNK = 1024
# while other requests generate: the canvas-sized padded prefill, the shortest graphed one, so a running stream's
# step waits for at most one short chunk
BUSY_PREFILL_CHUNK = 256
# requests waiting beyond those that can start now; one more is refused with a 503
MAX_QUEUE = 64

MB = 1024 * 1024  # the unit of the size flags (--max-image-mb, --max-body-mb)

# a request body's bytes beyond its images (base64 in JSON): the text, tools and settings of any request that fits
# a context, many times over; what a body may hold in all is the images plus this (default_max_body_bytes)
BODY_SLACK_BYTES = 16 * MB


def default_max_body_bytes(max_image_bytes: int) -> int:
    """The largest request body `serve` takes unless told (--max-body-mb): one image of the largest size as base64 (4
    characters per 3 bytes), plus BODY_SLACK_BYTES. Several large images in one request need a larger --max-body-mb;
    the default keeps what any client may make the server read to tens of MB."""
    return 4 * -(-max_image_bytes // 3) + BODY_SLACK_BYTES
