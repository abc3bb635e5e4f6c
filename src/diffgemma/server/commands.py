"""argparse subcommands `serve` and `replay`, registered into the main CLI by add_subcommands."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from .. import options
from ..errors import InputError
from .limits import BODY_SLACK_BYTES, BUSY_PREFILL_CHUNK, MAX_QUEUE, MB, PREFILL_CHUNK, default_max_body_bytes


def add_subcommands(subparsers) -> None:
    s = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (chat completions, streaming, tools)")
    s.add_argument("--model", default=None, help="checkpoint or pack directory (default: the embedded demo model)")
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000; 0: any free port)")
    s.add_argument("--served-name", default=None, help="the model id clients name (default: the model directory's name)")
    s.add_argument("--slots", type=int, default=None,
                   help="conversations whose KV cache is kept for reuse; at most this many requests run at once "
                        "(default: --max-batch, at least 2)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="requests denoised together in one forward (continuous batching; default: what the model's "
                        "forward takes, 8 where it takes any number, and on CUDA no more than the free memory holds "
                        "slots for; 1: one request at a time)")
    s.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                   help="requests waiting for a place in the batch; more are refused with 503 and Retry-After "
                        f"(default {MAX_QUEUE})")
    s.add_argument("--prefill-chunk-tokens", type=int, default=PREFILL_CHUNK,
                   help="prompt tokens prefilled per scheduler round, between the running requests' denoise steps "
                        f"(default {PREFILL_CHUNK}: the longest prefill that runs as a CUDA graph)")
    s.add_argument("--busy-prefill-tokens", type=int, default=BUSY_PREFILL_CHUNK,
                   help="the same while other requests are generating, and the chunk of a long prompt joining "
                        f"them, so their steps wait for one short chunk at most (default {BUSY_PREFILL_CHUNK}; at "
                        "most --prefill-chunk-tokens)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="context of each slot: prompt + reply tokens (default 8192, or the model's "
                        "max_position_embeddings if smaller; more than that is refused)")
    s.add_argument("--log-dir", default=None, help="write an op-log of every generation here (for `diffgemma replay`)")
    s.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="a generation setting for every request (repeatable); requests may override it")
    s.add_argument("--limit", dest="limits", action="append", default=[], metavar="NAME=VALUE",
                   help="the most a request may ask through its `diffgemma` settings (repeatable): canvas_length "
                        "(default: the model's), max_denoising_steps (256), empty_reply_retry (8), stop_strings (16), "
                        "stop_string_chars (256); more is refused with 400")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every request but /health (default: $DIFFGEMMA_API_KEY, "
                        "else none)")
    s.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="before serving, compile the kernels and capture every slot's denoise graphs at each context "
                        "bucket, so the first requests do not wait for it (auto: on CUDA only; default auto)")
    s.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image_url parts (at most --max-image-mb, 10 s, no redirects); by default only "
                        "data: URLs are taken and a URL is refused with 400")
    s.add_argument("--max-images", type=int, default=8, help="images per request; more is refused with 400 (default 8)")
    s.add_argument("--max-image-mb", type=float, default=20.0,
                   help="bytes per image, in MB; more is refused with 400 (default 20)")
    s.add_argument("--max-body-mb", type=float, default=None,
                   help="the largest request body, in MB; a larger one is refused with 413 before it is read "
                        f"(default: room for one image of --max-image-mb as base64, plus "
                        f"{BODY_SLACK_BYTES // MB} MB)")
    options.add_tool_validate_flag(s)
    options.add_tool_repair_flag(s)
    options.add_gpus_flag(s)
    s.set_defaults(func=_run_serve)

    r = subparsers.add_parser("replay", help="run an op-log again and compare every event")
    r.add_argument("log", type=Path, nargs="+",
                   help="ops-*.jsonl files written by serve, ask or chat with --log-dir, or folders of them")
    r.add_argument("--model", default=None, help="model directory (default: the one the log names)")
    r.add_argument("--device", default=None, help="device (default: the one the log names)")
    r.set_defaults(func=_run_replay)


def served_name(model) -> str:
    from ..loader import is_embedded

    return "diffgemma-demo" if is_embedded(model) else (Path(model.path).name or "diffgemma")


def _run_serve(args) -> int:
    for flag in ("slots", "max_batch", "max_queue", "prefill_chunk_tokens", "busy_prefill_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise InputError(f"--{flag.replace('_', '-')} {value}: expected a positive number")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise InputError(f"--max-tokens {args.max_tokens}: expected a positive number")
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key: empty; give the key clients must send (or leave the flag out for none)")
    from .images import ImageLimits
    from .openai_fields import Limits

    try:
        limits = Limits().replace(args.limits)
    except ValueError as e:
        raise InputError(str(e)) from None
    if args.max_images < 0:
        raise InputError(f"--max-images {args.max_images}: expected a number >= 0")
    if not (args.max_image_mb > 0 and math.isfinite(args.max_image_mb)):
        raise InputError(f"--max-image-mb {args.max_image_mb}: expected a positive number")
    image_limits = ImageLimits(max_bytes=int(args.max_image_mb * MB), max_images=args.max_images,
                               allow_urls=args.allow_image_urls)
    if args.max_body_mb is not None and not (args.max_body_mb * MB >= 1 and math.isfinite(args.max_body_mb)):
        raise InputError(f"--max-body-mb {args.max_body_mb}: expected a positive number (at least one byte)")
    max_body = default_max_body_bytes(image_limits.max_bytes) \
        if args.max_body_mb is None else int(args.max_body_mb * MB)
    options.validate_early(args)
    try:
        import fastapi  # noqa: F401
        import jsonschema  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise InputError("serve needs fastapi, uvicorn, jsonschema and prometheus_client: "
                         "pip install 'diffgemma[serve]'") from None
    model = options.load_model(args)
    if getattr(model, "tokenizer", None) is None:
        raise InputError(f"{model.path}: has no tokenizer.json; serving chat needs a tokenizer")
    settings = options.generation_settings(model, args)
    from .worker import default_max_batch

    cap = getattr(model, "max_batch", 1)
    if args.max_batch is not None and cap is not None and args.max_batch > cap:
        raise InputError(f"--max-batch {args.max_batch}: this model's forward takes at most {cap} canvas(es)")
    max_tokens = options.context_tokens(model, args.max_tokens)
    max_batch = args.max_batch or default_max_batch(model, max_tokens)
    slots = args.slots or max(2, max_batch)
    api_key = args.api_key if args.api_key is not None else os.environ.get("DIFFGEMMA_API_KEY") or None
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"diffgemma serve: warning: listening on {args.host} with no --api-key: anyone who can reach this "
              f"port can use the model", file=sys.stderr)
    warmup = args.warmup == "on" or (args.warmup == "auto" and model.embedding.device.type == "cuda")
    # a request that names no seed gets a fresh one, unless the operator fixed the seed for every request
    seed_fixed = any(item.split("=", 1)[0].strip().replace("-", "_").lower() == "seed" for item in args.sets) \
        or "DIFFGEMMA_SEED" in os.environ
    return serve(model, settings, host=args.host, port=args.port, name=args.served_name or served_name(model),
                 slots=slots, max_tokens=max_tokens, log_dir=args.log_dir, tool_validate=args.tool_validate,
                 warmup=warmup, api_key=api_key, limits=limits, fresh_seed=not seed_fixed, image_limits=image_limits,
                 max_batch=max_batch, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk_tokens,
                 busy_prefill_chunk=args.busy_prefill_tokens, max_body_bytes=max_body)


def listen(host: str, port: int):
    """A socket bound to host:port, or an InputError naming them (a busy port fails before anything is announced)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"--host {host}: cannot resolve it ({e})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(model, settings, *, host: str, port: int, name: str, slots: int, max_tokens: int, log_dir=None,
          tool_validate: int = 0, warmup: bool = False, api_key: str | None = None, limits=None,
          fresh_seed: bool = False, image_limits=None, max_batch: int | None = None, max_queue: int = MAX_QUEUE,
          prefill_chunk: int = PREFILL_CHUNK, busy_prefill_chunk: int = BUSY_PREFILL_CHUNK,
          max_body_bytes: int | None = None) -> int:
    import uvicorn

    from ..oplog import OpLog, header
    from .app import create_app
    from .worker import Worker

    if not 0 <= port < 65536:
        raise InputError(f"--port {port}: expected 0-65535")
    sock = listen(host, port)
    port = sock.getsockname()[1]
    log = OpLog(log_dir, header(model, slots, max_tokens)) if log_dir else None
    worker = Worker(model, slots=slots, max_tokens=max_tokens, log=log, max_batch=max_batch, max_queue=max_queue,
                    prefill_chunk=prefill_chunk, busy_prefill_chunk=busy_prefill_chunk)
    try:
        if warmup:
            print(f"diffgemma serve: warming up {slots} slot(s) at every context bucket up to {max_tokens} tokens",
                  file=sys.stderr)
            seconds = worker.warm_up(settings, progress=lambda m: print(f"  warm-up {m}", file=sys.stderr))
            print(f"diffgemma serve: warm in {seconds:.1f} s", file=sys.stderr)
        app = create_app(worker, model.tokenizer, name, settings, tool_validate=tool_validate, api_key=api_key,
                         limits=limits, fresh_seed=fresh_seed, image_limits=image_limits, max_body_bytes=max_body_bytes)
        print(f"diffgemma serve: {name} on http://{host}:{port}/v1; batch {worker.max_batch}, {slots} slot(s)"
              + ("; API key required" if api_key else "")
              + (f"; op-log {log.path}" if log else ""), file=sys.stderr)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: for a server, a normal stop
            pass
    finally:
        sock.close()
        worker.close()
        if log is not None:
            log.close()
    return 0


def _run_replay(args) -> int:
    from ..replay import run_logs

    return run_logs(args.log, model_path=args.model, device=args.device)
