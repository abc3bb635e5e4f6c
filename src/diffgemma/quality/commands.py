"""argparse subcommands `census` and `smoketest`, registered into the main CLI by add_parsers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import InputError, SettingsError

EXIT_INTERRUPTED = 130


def add_parsers(subparsers) -> None:
    c = subparsers.add_parser("census", help="run settings arms x prompt batteries, with acceptance gates")
    c.add_argument("--arms", default=None, metavar="JSON",
                   help="arms file: {name: {setting: value}} or {\"arms\": ..., \"baseline\": ..., \"gates\": [...]}")
    c.add_argument("--battery", default=None, metavar="NAME[,NAME]",
                   help="shipped battery names (smoke, programmatic, longctx, ...) or .json files, comma-separated")
    c.add_argument("--out", default=None, metavar="DIR", help="campaign directory (results.jsonl, summary); rerun to "
                                                              "resume an interrupted campaign")
    c.add_argument("--analyze", default=None, metavar="DIR",
                   help="re-report an existing campaign directory without a model (gates from --arms if given)")
    c.add_argument("--seeds", default="0", metavar="N[,N]", help="generation seeds, each prompt runs once per seed")
    c.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N prompts of each battery")
    _model_flags(c)
    c.set_defaults(func=cmd_census)

    s = subparsers.add_parser("smoketest", help="the fixed quality gate (demo model: the smoke battery)")
    s.add_argument("--spec", default=None, metavar="JSON", help="gate spec (default: the shipped smoketest gate)")
    s.add_argument("--seeds", default=None, metavar="N[,N]", help="seeds (default: the spec's)")
    s.add_argument("--aggregate", action="store_true", help="judge the spec's multi-seed aggregate instead")
    s.add_argument("--out", default=None, metavar="DIR", help="keep the results here (default: a temp directory)")
    _model_flags(s)
    s.set_defaults(func=cmd_smoketest)


def _model_flags(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint or pack directory (default: the embedded demo model)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_seeds(text: str, flag: str = "--seeds") -> list[int]:
    try:
        seeds = [int(x, 10) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not seeds or any(not 0 <= s < 2**64 for s in seeds) or len(set(seeds)) != len(seeds):
        raise InputError(f"{flag} {text!r}: expected distinct integers in [0, 2**64)")
    return seeds


def load_model(args):
    import torch

    from ..loader import load

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return load(args.model, device=device)


def _batteries(spec: str, limit: int | None):
    from .batteries import load_battery

    names = [n for n in spec.split(",") if n.strip()]
    if not names:
        raise InputError(f"--battery {spec!r}: expected one or more battery names")
    if limit is not None and limit < 1:
        raise InputError(f"--limit {limit}: expected a positive number of prompts")
    out = [load_battery(n.strip()) for n in names]
    if len({b.name for b in out}) != len(out):
        raise InputError(f"--battery {spec}: a battery is named twice")
    for b in out:
        b.prompts = b.prompts[:limit] if limit else b.prompts
    return out


def cmd_census(args) -> int:
    from .arms import load_campaign

    if args.analyze:
        if args.battery or args.out:
            raise InputError("--analyze DIR re-reports a finished campaign; it takes no --battery or --out")
        return analyze_dir(args.analyze, load_campaign(args.arms) if args.arms else None)
    missing = [f for f, v in (("--arms", args.arms), ("--battery", args.battery), ("--out", args.out)) if not v]
    if missing:
        raise InputError(f"census: {', '.join(missing)} required (or --analyze DIR)")
    campaign = load_campaign(args.arms)  # every arm and gate is validated before the model loads
    batteries = _batteries(args.battery, args.limit)
    seeds = parse_seeds(args.seeds)
    return run(campaign, batteries, seeds, args.out, args)


def run(campaign, batteries, seeds, out, args, backend=None) -> int:
    from . import gates
    from .analyze import table
    from .runner import ModelBackend, run_campaign

    from ..settings import GenerationSettings

    for arm in campaign.arms:  # the environment's DIFFGEMMA_* too, before the model loads
        try:
            GenerationSettings.resolve({}, env=os.environ, overrides=arm.overrides)
        except SettingsError as e:
            raise SettingsError(f"arm {arm.name!r}: {e}") from None
    if backend is None:
        backend = ModelBackend(load_model(args))
    if hasattr(backend, "validate"):
        for arm in campaign.arms:
            backend.validate(arm)
    try:
        summary = run_campaign(campaign, batteries, backend, out, seeds, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"census: interrupted; {out} holds what finished (summary.md); run the same command again to resume",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    print(table(summary))
    results = gates.evaluate(campaign.gates, summary, campaign.baseline)
    if results:
        print(gates.report(results))
    return gates.exit_code(results)


def analyze_dir(out_dir: str, campaign=None) -> int:
    from . import analyze, gates

    header = analyze.read_campaign(out_dir)
    records = analyze.read_results(out_dir)
    arms = list(header.get("arms", {}))
    summary = analyze.summarize(records, arms)
    print(analyze.table(summary))
    gate_list = campaign.gates if campaign is not None else header.get("gates", [])
    baseline = campaign.baseline if campaign is not None else header.get("baseline", arms[0] if arms else "")
    results = gates.evaluate(gate_list, summary, baseline)
    if results:
        print(gates.report(results))
    analyze.plot(out_dir, summary)
    return gates.exit_code(results)


def cmd_smoketest(args) -> int:
    from . import smoketest

    spec = smoketest.load_spec(args.spec)
    seeds = parse_seeds(args.seeds) if args.seeds else (spec.aggregate_seeds if args.aggregate else spec.seeds)
    if args.out:
        return run(spec.campaign, spec.batteries, seeds, args.out, args)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="diffgemma-smoketest-") as tmp:
        return run(spec.campaign, spec.batteries, seeds, str(Path(tmp) / "smoketest"), args)
