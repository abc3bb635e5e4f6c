"""`diffgemma ask --batch-file prompts.jsonl`: many prompts answered together (batch.generate_batch).

Each non-blank line is a JSON object {"prompt": str, optional "seed": int, optional "id": any}. The whole file is
checked before the model loads (a bad line is a one-line error naming it); then every prompt is rendered with the chat
template (--system, --think, --tools apply to all), generated in batches of --max-batch, and answered with one JSON
line per prompt, in the file's order, on stdout or in --out (written whole or not at all). A progress bar counts the
finished prompts on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .errors import InputError

KEYS = ("prompt", "seed", "id")


def read_batch_file(path) -> list[dict]:
    """The requests of a batch file: [{"line", "prompt", "seed" (or None), "id"}], or an InputError naming the line."""
    where = f"--batch-file {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"{where}: cannot read ({e.strerror})") from None
    entries = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{where}: line {n}: not valid UTF-8 (byte 0x{raw[e.start:e.start + 1].hex()})") from None
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(item, dict):
            raise InputError(f"{where}: line {n}: expected a JSON object like {{\"prompt\": \"...\"}}, "
                             f"got {type(item).__name__}")
        unknown = sorted(set(item) - set(KEYS))
        if unknown:
            raise InputError(f"{where}: line {n}: unknown key {unknown[0]!r}; expected {', '.join(KEYS)}")
        if "prompt" not in item:
            raise InputError(f"{where}: line {n}: no \"prompt\"; expected {{\"prompt\": \"...\"}}")
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise InputError(f"{where}: line {n}: \"prompt\" must be a string of text, got {item['prompt']!r}")
        seed = item.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
            raise InputError(f"{where}: line {n}: \"seed\" must be an integer in [0, 2**64), got {seed!r}")
        entries.append({"line": n, "prompt": item["prompt"], "seed": seed, "id": item.get("id", n)})
    if not entries:
        raise InputError(f"{where}: no prompts (expected one JSON object per line)")
    return entries


def check_out(out) -> None:
    if out is not None and not Path(out).resolve().parent.is_dir():
        raise InputError(f"--out {out}: its directory does not exist")


def write_atomically(path, text: str) -> None:
    """`text` into `path` whole: a temporary file beside it, then a rename; nothing half-written on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def result_line(entry: dict, result, tokenizer) -> dict:
    """One request's JSON line: its id and seed, the reply split like `ask` prints it, and the generation's counts."""
    from .reply import reply_parts

    _, thought, answer, calls = reply_parts(tokenizer, result.tokens, result.settings.stop_strings)
    return {
        "id": entry["id"],
        "seed": result.settings.seed,
        "answer": answer,
        "thought": thought,
        "tool_calls": [{"name": c.name, "arguments": c.arguments} if c.ok else {"error": c.error, "raw": c.raw}
                       for c in calls],
        "tokens": len(result.tokens),
        "steps_per_block": result.steps_per_block,
        "stop_reasons": result.stop_reasons,
        "stop_token": result.stop_token,
    }


def run_batch_file(args, read_tools) -> int:
    """The `ask --batch-file` command (cli.cmd_ask): read_tools is the CLI's --tools reader."""
    from tqdm import tqdm

    from . import options
    from .batch import generate_batch
    from .events import DoneEvent

    for flag, given in (("--log-dir", args.log_dir), ("--show-canvas", args.show_canvas), ("--stats", args.stats),
                        ("--tool-validate", args.tool_validate)):
        if given:  # the JSON lines carry the counts; op-logs and tool retries are per conversation
            raise InputError(f"{flag}: not with --batch-file")
    entries = read_batch_file(args.batch_file)
    check_out(args.out)
    if args.max_batch < 1:
        raise InputError(f"--max-batch {args.max_batch}: expected a positive number of prompts")
    options.validate_early(args)
    tools = None if args.tools == "model" else read_tools(args.tools)  # a bad file fails before the load
    model = options.load_model(args)
    tools = tools or read_tools(args.tools, model)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError(f"{getattr(model, 'path', 'model')}: has no tokenizer.json; ask needs a tokenizer")
    settings = options.generation_settings(model, args)
    limit = options.context_tokens(model, args.context, "--context")
    system = [{"role": "system", "content": args.system}] if args.system else []
    prompts = []
    for e in entries:
        ids = tokenizer.apply_chat_template(system + [{"role": "user", "content": e["prompt"]}], tools=tools,
                                            add_generation_prompt=True, enable_thinking=args.think)
        if len(ids) + settings.max_new_tokens > limit:
            raise InputError(f"--batch-file {args.batch_file}: line {e['line']}: {len(ids)} prompt tokens + "
                             f"{settings.max_new_tokens} new ones do not fit the context of {limit} (--context)")
        prompts.append(ids)
    seeds = [settings.seed if e["seed"] is None else e["seed"] for e in entries]
    with tqdm(total=len(entries), desc="ask", unit="prompt", file=sys.stderr, disable=None) as bar:
        results = generate_batch(model, prompts, seeds=seeds, settings=settings, max_batch=args.max_batch,
                                 on_event=lambda i, ev: bar.update(1) if isinstance(ev, DoneEvent) else None)
    lines = [json.dumps(result_line(e, r, tokenizer), ensure_ascii=False) for e, r in zip(entries, results)]
    text = "".join(line + "\n" for line in lines)
    if args.out is not None:
        write_atomically(args.out, text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0
