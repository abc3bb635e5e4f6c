"""argparse subcommands `quantize`, `repack` and `verify`, registered into the main CLI by add_subcommands.

Each subparser sets `func` (args -> exit status); errors are raised as DiffgemmaError for the CLI to
print on one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .policy import CLASS_FORMATS, LOCKED, PROFILES


def add_subcommands(subparsers) -> None:
    q = subparsers.add_parser(
        "quantize", help="quantize a checkpoint into a pack (manifest + blob)",
        description="Stream a DiffusionGemma HF checkpoint into a quantized pack. Profiles: q4/q5/q6 (experts "
                    "q4/q5/q6, SC MLP q8), nvfp4 (experts, attention, dense FFN nvfp4; SC MLP q8), nvfp4x "
                    "(= q4 with experts=nvfp4). Everything else stays raw, byte-for-byte.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--set classes and formats: " + "; ".join(f"{c}={'|'.join(f)}" for c, f in CLASS_FORMATS.items())
               + ". Locked (always raw): " + ", ".join(LOCKED) + ".")
    q.add_argument("model_dir", type=Path, help="HF checkpoint directory (config.json + safetensors)")
    q.add_argument("-o", "--output", type=Path, required=True, help="pack directory to create (must not exist)")
    q.add_argument("--profile", default="q4", help=f"one of {', '.join(PROFILES)} (default q4), or fp8: the "
                                                   "compressed-tensors FP8 checkpoint the hub publishes (docs/FORMATS.md)")
    q.add_argument("--set", dest="sets", action="append", default=[], metavar="CLASS=FORMAT",
                   help="per-class format override on top of the profile (repeatable)")
    q.add_argument("--overlay", action="store_true",
                   help="reference raw tensors inside the source shards instead of copying them (dev tooling)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=_run_quantize)

    r = subparsers.add_parser("repack", help="convert a pack between self-contained and overlay shapes")
    mode = r.add_mutually_exclusive_group(required=True)
    mode.add_argument("--monolithic", action="store_true", help="flatten a (layered) pack into a self-contained one")
    mode.add_argument("--overlay", action="store_true",
                      help="split a self-contained pack: raw tensors become references into the source shards")
    r.add_argument("-m", "--pack", type=Path, required=True, help="existing pack directory")
    r.add_argument("-o", "--output", type=Path, required=True, help="pack directory to create (must not exist)")
    r.add_argument("--model", type=Path, default=None,
                   help="source HF checkpoint for --overlay (default: the source_model recorded in the manifest)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_run_repack)

    v = subparsers.add_parser("verify", help="check a pack: its manifest, sizes, shards and every tensor's sha256",
                              description="Open a pack as the loader does (manifest, 64-byte alignment, blob size, an "
                                          "overlay's external shards), then read every tensor and check its sha256 "
                                          "against the manifest. Loading checks all but the hashes.")
    v.add_argument("pack", type=Path, help="pack directory, or a published quantized checkpoint (docs/FORMATS.md)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(func=_run_verify)


def _run_quantize(args) -> int:
    from .quantize import quantize

    if args.profile == "fp8":
        from ..errors import SettingsError
        from .hub_fp8 import quantize_fp8

        if args.sets or args.overlay:
            raise SettingsError("--profile fp8 writes the published compressed-tensors FP8 layout: no --set or --overlay")
        print(quantize_fp8(args.model_dir, args.output, progress=not args.no_progress))
        return 0

    out = quantize(args.model_dir, args.output, profile=args.profile, sets=args.sets, overlay=args.overlay,
                   progress=not args.no_progress)
    print(out)
    return 0


def _run_repack(args) -> int:
    from .overlay import repack_monolithic, repack_overlay
    from .pack import read_manifest

    if args.monolithic:
        out = repack_monolithic(args.pack, args.output, progress=not args.no_progress)
    else:
        model = args.model or Path(read_manifest(args.pack).source_model)
        out = repack_overlay(args.pack, model, args.output, progress=not args.no_progress)
    print(out)
    return 0


def _run_verify(args) -> int:
    from .hub import detect
    from .source import PackSource, is_pack

    scheme = None if is_pack(args.pack) else detect(args.pack)
    if scheme is not None:  # a published quantized checkpoint (docs/FORMATS.md); anything else is read as a pack
        from .hub_verify import verify_hub

        print(verify_hub(args.pack, scheme))
        return 0

    src = PackSource(args.pack)
    try:
        n, nbytes = src.verify(progress=not args.no_progress)
    finally:
        src.close()
    print(f"{args.pack}: {n} tensors, {nbytes} bytes: every sha256 matches the manifest")
    return 0
