"""What the `diffgemma` commands share (cli.py's ask/chat/golden, server/commands.py's serve): flags, their
checks before the model loads, the model load itself, and the generation settings the flags ask for.

A setting travels once: `--set NAME=VALUE` (and --seed, --max-new-tokens) -> `generation_settings` -> one
GenerationSettings, which the Session or the server's worker hands to `generate_stream` unchanged.
"""

from __future__ import annotations

import argparse
import os

from .config import check_context
from .errors import InputError

SESSION_TOKENS = 8192  # the KV cache of `ask` and `chat`: prompt and replies of the whole conversation


def add_tool_validate_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-validate", type=int, default=0, metavar="N",
                   help="with tools: regenerate a tool call that does not parse, from its opener, with the seed "
                        "bumped, up to N times (default 0: off)")


def add_tool_repair_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-repair", action="store_true",
                   help="with tools: a reply whose tool call is invalid (does not parse, names a tool not offered, or "
                        "breaks its parameter schema) gets an error tool-response per bad call and is written again; "
                        "only the clean reply enters the conversation (the setting tool_repair, which a request's "
                        "`diffgemma` field can set too; tool_repair_attempts rounds at most)")


def add_gpus_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", default=None, metavar="G",
                   help="split the model's experts over G GPUs of this machine, rank r on cuda:r (on the CPU: G "
                        "processes); `torchrun --nproc-per-node G -m diffgemma ...` starts the same run")


def validate_early(args) -> None:
    """Check --set, the DIFFGEMMA_* environment and the numeric flags before the (slow) model load: the settings are
    resolved against an empty generation config, so a bad name or value fails here with its one-line error."""
    from .settings import GenerationSettings

    GenerationSettings.resolve({}, env=os.environ, overrides=list(args.sets))
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    if getattr(args, "tool_validate", 0) < 0:
        raise InputError(f"--tool-validate {args.tool_validate}: expected a number of retries >= 0")
    if getattr(args, "context", None) is not None and args.context < 1:
        raise InputError(f"--context {args.context}: expected a positive number of tokens")


def check_device(device: str) -> None:
    """--device: auto, cpu, cuda or cuda:N; anything else (meta, mps, a typo) is refused before the model load."""
    kind, _, index = str(device).partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise InputError(f"--device {device}: expected cpu, cuda, cuda:N or auto")


def load_model(args):
    """The model `--model` names (default: the embedded demo model) on `--device` (auto: cuda when available)."""
    import torch

    from .loader import load

    check_device(args.device)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return load(args.model, device=device, group=getattr(args, "parallel_group", None))  # set by launch.py


def generation_settings(model, args):
    """The GenerationSettings the command line asks for: the model's generation_config <- DIFFGEMMA_* environment
    <- each --set, then --seed and --max-new-tokens where the command has them and they were given. --tool-repair is
    `tool_repair=true` put before the --set items (so a --set of it wins)."""
    from .settings import GenerationSettings

    flags = {name: getattr(args, name, None) for name in ("seed", "max_new_tokens")}
    sets = (["tool_repair=true"] if getattr(args, "tool_repair", False) else []) + list(args.sets)
    settings = GenerationSettings.resolve(model.generation_config, env=os.environ, overrides=sets)
    given = {name: value for name, value in flags.items() if value is not None}
    return settings.replace(**given) if given else settings


def context_tokens(model, requested: int | None = None, flag: str = "--max-tokens") -> int:
    """The tokens a conversation's KV cache holds: `requested`, or SESSION_TOKENS, but never past the context the
    model was made for (config.check_context, the rule new_cache follows too): asked for more, an error naming
    both."""
    limit = model.config.max_positions
    if requested is None:
        return SESSION_TOKENS if limit is None else min(SESSION_TOKENS, limit)
    return check_context(model.config, requested, flag)
