"""The `diffgemma` command: ask, chat, golden, quantize, repack, verify, serve, replay.

Every user mistake (bad flag, unknown --set name, missing model) prints ONE line on stderr and exits
with status 2; nothing else is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from . import options
from .errors import DiffgemmaError, InputError
from .options import SESSION_TOKENS, add_tool_validate_flag, context_tokens  # noqa: F401 (part of the CLI's API)

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; we want one line
        print(f"diffgemma: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint or pack directory (default: the embedded demo model)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--tools", default=None, metavar="JSON",
                   help="tool declarations: a JSON file (a list, OpenAI style), or 'model' for the checkpoint's own "
                        "tools.json (the demo model ships one)")
    p.add_argument("--think", action="store_true", help="let the model think first (thought channel on)")
    p.add_argument("--show-thought", action="store_true", help="print the thought channel too")
    p.add_argument("--seed", type=int, default=None,
                   help="the sampler's random seed: the same seed, prompt and settings give the same reply "
                        "(default: the generation settings' seed, 0)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="the most tokens a reply may have (default: the model's generation_config.json, 256 for "
                        "the demo)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens the conversation's KV cache holds, prompts and replies together (default 8192, or "
                        "the model's max_position_embeddings if smaller; more than that is refused)")
    p.add_argument("--show-canvas", action="store_true", help="redraw the denoising canvas live")
    p.add_argument("--stats", action="store_true", help="print steps per block, tokens per forward, timings")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                   help="override a generation setting (repeatable), e.g. --set entropy_bound=0.2; "
                        "`diffgemma settings` lists them")
    p.add_argument("--log-dir", default=None,
                   help="journal every turn (token ids and settings) in an op-log here, for `diffgemma replay`")
    add_tool_validate_flag(p)
    options.add_gpus_flag(p)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="diffgemma", description="DiffusionGemma inference engine")
    parser.add_argument("--version", action="version", version=f"diffgemma {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ask = sub.add_parser("ask", help="answer one prompt (or a file of them: --batch-file)")
    ask.add_argument("prompt", nargs="?", help="the user's message (UTF-8 text)")
    ask.add_argument("--image", dest="images", action="append", default=[], metavar="PATH",
                     help="an image file (PNG, JPEG, WebP, ...) put before the prompt (repeatable; needs a model "
                          "with a vision tower)")
    _add_generation_flags(ask)
    ask.add_argument("--batch-file", default=None, metavar="JSONL",
                     help='answer every line {"prompt": ..., "seed": ..., "id": ...} of this file, batched; one JSON '
                          'line per answer')
    ask.add_argument("--out", default=None, metavar="FILE", help="with --batch-file: write the answers here")
    ask.add_argument("--max-batch", type=int, default=8, metavar="N",
                     help="with --batch-file: prompts denoised together (default 8)")
    chat = sub.add_parser("chat", help="multi-turn chat that keeps the KV cache between turns")
    _add_generation_flags(chat)
    options.add_tool_repair_flag(chat)
    listing = sub.add_parser("settings", help="list the generation settings --set, DIFFGEMMA_<NAME> and the "
                                              "server's `diffgemma` request field take, with their defaults")
    listing.add_argument("--model", default=None,
                         help="show the defaults this checkpoint's generation_config.json gives (default: the "
                              "settings' own defaults)")
    golden = sub.add_parser("golden", help="check (or --bless) the golden byte-identity fixture")
    golden.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo model)")
    golden.add_argument("--fixture", default=None, help="fixture path (default: MODEL/golden.json)")
    how = golden.add_mutually_exclusive_group()
    how.add_argument("--bless", action="store_true", help="rewrite the fixture from this run")
    how.add_argument("--add-platform", action="store_true",
                        help="add this machine's KV hashes to the fixture (only when every token, step and stop matches)")
    golden.add_argument("--device", default="cpu")
    try:
        from .quant.commands import add_subcommands
    except ImportError:
        pass
    else:
        add_subcommands(sub)
    from .server.commands import add_subcommands as add_server_subcommands

    add_server_subcommands(sub)
    from .quality.commands import add_parsers as add_quality_parsers  # census, smoketest

    add_quality_parsers(sub)
    return parser


def _read_tools(path, model=None):
    if path is None:
        return None
    if path == "model":
        from .loader import model_tools

        tools = model_tools(model)
        if tools is None:
            raise InputError(f"--tools model: {model.path} has no tools.json")
        return tools
    try:
        tools = json.loads(open(path).read())
    except OSError as e:
        raise InputError(f"--tools {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"--tools {path}: not valid JSON ({e})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InputError(f"--tools {path}: expected a JSON list of tool declarations")
    for i, t in enumerate(tools):
        fn = t.get("function", t)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InputError(f"--tools {path}: entry {i} has no name; expected {{'type': 'function', 'function': "
                             f"{{'name': ..., 'parameters': {{...}}}}}}")
    return tools


def _print_reply(reply, args, out=None) -> None:
    out = out or sys.stdout
    if reply.thought is not None and args.show_thought:
        print(f"[thought]\n{reply.thought}\n[/thought]", file=out)
    print(reply.answer, file=out)
    for call in reply.tool_calls:
        if call.ok:
            print(f"[tool call] {call.name}({json.dumps(call.arguments)})", file=sys.stderr)
        else:
            print(f"[malformed tool call: {call.error}] {call.raw}", file=sys.stderr)
    if args.stats:
        r = reply.result
        print(f"[blocks={len(r.steps_per_block)} steps={r.steps_per_block} stops={r.stop_reasons} "
              f"tokens={len(r.tokens)} tokens/forward={r.tokens_per_forward:.2f} retries={r.retries} "
              f"tool_retries={r.tool_retries} "
              f"reused={reply.reused_tokens} prefilled={reply.prefilled_tokens} "
              f"total={r.timings.get('total_s', 0):.2f}s]", file=sys.stderr)


def _open_session(args):
    """Validate flags and environment, then load the model: (model, settings, session)."""
    from .session import Session

    options.validate_early(args)
    if args.system is not None:
        _utf8(args.system, "--system")
    tools = None if args.tools == "model" else _read_tools(args.tools)  # a bad file fails before the load
    model = options.load_model(args)
    tools = tools or _read_tools(args.tools, model)
    settings = options.generation_settings(model, args)
    tokens = context_tokens(model, args.context, "--context")
    log = None
    if args.log_dir:
        from .oplog import OpLog, header

        log = OpLog(args.log_dir, header(model, 1, tokens))
        print(f"diffgemma: op-log {log.path}", file=sys.stderr)
    return model, settings, Session(model, system=args.system, think=args.think, tools=tools,
                                    max_tokens=tokens, log=log, tool_validate=args.tool_validate)


def _utf8(text: str, what: str) -> str:
    """`text` as given on the command line or stdin, or an InputError when its bytes were not UTF-8 (Python keeps
    such bytes as lone surrogates, which no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise InputError(f"{what}: not valid UTF-8 text (byte 0x{bad.hex()} at character {e.start})") from None
    return text


def cmd_ask(args) -> int:
    if (args.prompt is None) == (args.batch_file is None):
        raise InputError("ask: expected a prompt or --batch-file FILE (one of the two)")
    if args.out is not None and args.batch_file is None:
        raise InputError("--out: only with --batch-file")
    if args.images and args.batch_file is not None:
        raise InputError("--image: not with --batch-file")
    if args.batch_file is not None:
        from .batch_file import run_batch_file

        return run_batch_file(args, _read_tools)
    _utf8(args.prompt, "the prompt")
    for path in args.images:  # a missing file fails before the load
        if not Path(path).expanduser().is_file():
            raise InputError(f"--image {path}: no such file")
    model, settings, session = _open_session(args)
    if args.stats and getattr(model, "weight_formats", None):  # class=stored->computed (docs/FORMATS.md)
        print(f"[weights: {model.weight_formats}]", file=sys.stderr)
    view = CanvasView(model.tokenizer) if args.show_canvas else None
    images = [Path(p).expanduser() for p in args.images] or None
    reply = session.ask(args.prompt, images=images, settings=settings, on_step=view)
    if view is not None:
        view.finish()
    _print_reply(reply, args)
    return 0


def cmd_chat(args) -> int:
    model, settings, session = _open_session(args)
    interactive = sys.stdin.isatty()
    if interactive:
        print("diffgemma chat: /exit to quit, /reset to start over; after a tool call, answer it with /tool RESULT "
              "(JSON or text)", file=sys.stderr)
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as e:
            line = "\n"  # a bad line is dropped (or, in a script, ends the chat) like any bad input
            bad = InputError(f"the input: not valid UTF-8 text (byte 0x{e.object[e.start:e.start + 1].hex()})")
            if not interactive:
                raise bad from None
            print(f"diffgemma: error: {bad}", file=sys.stderr)
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            continue
        view = CanvasView(model.tokenizer) if args.show_canvas else None
        try:
            _utf8(line, "the input")
            if line.startswith("/tool "):
                reply = session.tool_result(_last_call_name(session), _tool_content(line[6:]), settings=settings,
                                            on_step=view)
            else:
                reply = session.ask(line, settings=settings, on_step=view)
        except DiffgemmaError as e:
            if not interactive:  # a script's chat stops at its first error (exit 2)
                raise
            print(f"diffgemma: error: {e} (the turn was dropped; /reset starts over)", file=sys.stderr)
            continue
        finally:
            if view is not None:
                view.finish()
        if interactive:
            print("model> ", end="")
        _print_reply(reply, args)
        sys.stdout.flush()
    return 0


def _last_call_name(session) -> str:
    calls = (session.messages[-1].get("tool_calls") or []) if session.messages else []
    if not calls:
        raise InputError("/tool: the model made no tool call to answer")
    return calls[-1]["function"]["name"]


def _tool_content(text: str):
    from .reply import tool_result_value

    return tool_result_value(text.strip())


class CanvasView:
    """Redraws the canvas in place on each denoising step; accepted positions in bold green."""

    def __init__(self, tokenizer, out=None):
        self.tok = tokenizer
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.lines = 0

    def _cell(self, tid: int, accepted: bool) -> str:
        text = (self.tok.decode([tid]) or "·").replace("\n", "⏎")
        if not self.tty:
            return text
        return f"\x1b[1;32m{text}\x1b[0m" if accepted else f"\x1b[2m{text}\x1b[0m"

    def __call__(self, event) -> None:
        if not self.tty and event.stop_reason is None:
            return  # piped output: show only each block's final step
        draft, accepted = event.draft.tolist(), event.accepted.tolist()
        cells = [self._cell(t, a) for t, a in zip(draft, accepted)]
        header = (f"block {event.block} step {event.step:2d}  T={event.temperature:.2f}  "
                  f"accepted {sum(accepted)}/{len(accepted)}  mean H={event.mean_entropy:.3f}")
        if self.tty and self.lines:
            self.out.write(f"\x1b[{self.lines}F\x1b[J")  # back to the first line we drew, clear below
        self.out.write(f"{header}\n{''.join(cells)}\n")
        self.out.flush()
        # Rows the drawing took, wrapped lines included, so the next step can move back over them.
        cols = max(20, shutil.get_terminal_size().columns)
        plain = len("".join((self.tok.decode([t]) or "·") for t in draft))
        self.lines = 1 + max(1, -(-plain // cols))

    def finish(self) -> None:
        self.lines = 0


def cmd_golden(args) -> int:
    from . import golden

    model = options.load_model(args)
    path = args.fixture or golden.fixture_path(model)
    expected = None if args.bless else golden.load_fixture(path, model.path)
    results = golden.run_all(model)
    if args.bless:
        golden.bless(results, path, model.path)
        print(f"blessed {len(results)} cases -> {path}")
        return 0
    if args.add_platform:
        golden.bless(golden.add_platform(expected, results), path, model.path)
        print(f"added this platform's KV hashes to {len(results)} cases -> {path}")
        return 0
    problems = golden.diff(expected, results)
    for line in problems:
        print(line)
    failed = {p.split(':')[0] for p in problems}
    loose = [name for name in golden.unpinned(expected, results) if name not in failed]
    if loose:
        print(f"golden: this platform's KV bits are not pinned for {len(loose)} case(s) (tokens, steps and stops "
              f"identical, KV statistics within {golden.KV_RTOL:g}); `diffgemma golden --add-platform` pins them")
    print(f"golden: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if problems else 0


def cmd_settings(args) -> int:
    from .settings import FIELD_NAMES, GenerationSettings

    config = {}
    if args.model is not None:
        from .checkpoint import read_json
        from .loader import resolve_path

        if not resolve_path(args.model).is_dir():
            raise InputError(f"--model {args.model}: no such directory")
        path = resolve_path(args.model) / "generation_config.json"
        config = read_json(path, "generation_config.json") if path.is_file() else {}
    values = GenerationSettings.resolve(config, env={}).as_dict()
    width = max(map(len, FIELD_NAMES))
    for name in FIELD_NAMES:
        print(f"{name:<{width}}  {values[name]!r}")
    return 0


COMMANDS = {"ask": cmd_ask, "chat": cmd_chat, "golden": cmd_golden, "settings": cmd_settings}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        handler = COMMANDS.get(args.command) or args.func
        if hasattr(args, "gpus") and (args.gpus is not None or "WORLD_SIZE" in os.environ):
            from .launch import run

            code = run(args, handler)  # rank 0 runs the command, the other ranks follow its model's calls
        else:
            code = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except DiffgemmaError as e:
        print(f"diffgemma: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`diffgemma settings | head`): stop quietly, as a shell tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        return 141


if __name__ == "__main__":
    sys.exit(main())
