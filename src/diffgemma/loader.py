"""`diffgemma.load`: a checkpoint directory (or the embedded demo model) → a ready model object."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from .checkpoint import SafetensorsSource, TensorSource, expected_tensors, iter_with_progress, read_json, unknown_tensors, validate
from .config import ModelConfig
from .errors import CheckpointError, InputError
from .quant.hub import refuse_file

# Show a progress bar when the weights are big enough for the load to take more than a moment.
PROGRESS_BYTES = 512 * 2**20

EMBEDDED_NAMES = ("demo", "default")


def embedded_model_path() -> Path:
    """The small trained model shipped inside the package (the default for `diffgemma ask`)."""
    return Path(__file__).parent / "assets" / "demo"


def is_embedded(model) -> bool:
    """Whether `model` was loaded from the embedded demo model."""
    return Path(getattr(model, "path", "") or "") == embedded_model_path()


def resolve_path(path) -> Path:
    if path is None or str(path) in EMBEDDED_NAMES:
        return embedded_model_path()
    return Path(path).expanduser()


def open_source(directory: Path) -> TensorSource:
    """Pick the TensorSource for a directory: a quantized pack, a published quantized checkpoint (quant/hub.py)
    or an HF safetensors checkpoint."""
    from .quant.hub import detect
    from .quant.source import is_pack, open_pack

    if is_pack(directory):
        return open_pack(directory)
    scheme = detect(directory)
    if scheme is None:
        return SafetensorsSource(directory)
    from .quant.hub_source import open_hub

    return open_hub(directory, scheme)


def load(path=None, device="cpu", dtype: torch.dtype | None = None, progress: bool | None = None,
         engine: str = "auto", options=None, group=None):
    """Load a DiffusionGemma checkpoint directory.

    device: "cpu" or "cuda[:N]". engine: "auto" (the fast engine on CUDA, the reference elsewhere),
    "fast" or "reference". dtype: compute dtype (default bfloat16 for the fast engine, float32 for the
    reference). options: the fast engine's implementation choices (model/options.EngineOptions; None: the
    defaults). group: this rank's place in an expert-parallel run (parallel/group.Group): the fast engine over the
    rank's share of the experts on the group's device (rank 0: the model object; docs/ARCHITECTURE.md, 'Several
    GPUs'). Tensors are read one at a time from memory-mapped files and converted on the way, so
    host RAM never holds the whole checkpoint.
    """
    if engine not in ("auto", "fast", "reference"):
        raise InputError(f"load: engine must be 'auto', 'fast' or 'reference', got {engine!r}")
    directory = resolve_path(path)
    refuse_file(directory)
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: expected a checkpoint directory, got a file")
    cfg = ModelConfig.from_file(directory / "config.json")
    generation_config = read_json(directory / "generation_config.json", "generation_config.json")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"load: bad device {device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("load: device='cuda' requested but CUDA is not available on this machine")
    if group is not None:
        if engine == "reference" or device.type != group.device.type:
            raise InputError(f"load: an expert-parallel rank runs the fast engine on {group.device.type}, got "
                             f"engine={engine!r} on {device.type}")
        device = group.device
    fast = engine == "fast" or (engine == "auto" and device.type == "cuda") or group is not None
    if options is not None and not fast:
        raise InputError("load: options are the fast engine's; the reference model takes none (engine='fast')")
    dtype = dtype or (torch.bfloat16 if fast else torch.float32)
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise InputError(f"load: dtype must be a floating torch dtype, got {dtype}")

    source = open_source(directory)
    validate(source, cfg, str(directory))
    extra = unknown_tensors(source, cfg)
    if extra:
        warnings.warn(f"{directory}: ignoring {len(extra)} unrecognised tensors, e.g. {extra[0]!r}")

    if progress is None:
        progress = source.nbytes() > PROGRESS_BYTES and sys.stderr.isatty()
    tokenizer = _load_tokenizer(directory)
    if fast and group is not None:
        from .parallel.engine import build_parallel_engine, shard_source

        share = _ProgressSource(shard_source(source, cfg, group), progress and group.lead, directory.name,
                                len(expected_tensors(cfg)))
        return build_parallel_engine(cfg, share, group, dtype, generation_config=generation_config, path=directory,
                                     tokenizer=tokenizer, options=options)
    from .quant.hub_source import describe_formats

    if fast:
        from .model.engine import build_engine

        model = build_engine(cfg, _ProgressSource(source, progress, directory.name, len(expected_tensors(cfg))), device,
                             dtype, generation_config=generation_config, path=directory, tokenizer=tokenizer,
                             options=options)
        model.weight_formats = describe_formats(source, model, dtype)  # `ask --stats`
        return model
    names = list(expected_tensors(cfg))
    weights = {}
    for name in iter_with_progress(names, len(names), progress, desc=f"loading {directory.name}"):
        weights[name] = source.get(name, dtype=dtype, device=device)

    from .model.reference import ReferenceModel

    model = ReferenceModel(cfg, weights, device=device, dtype=dtype, generation_config=generation_config,
                           path=directory, tokenizer=tokenizer)
    model.weight_formats = describe_formats(source, model, dtype)  # `ask --stats` (quant/hub_source.py)
    return model


class _ProgressSource:
    """Wraps a TensorSource to tick a progress bar as the engine pulls tensors one by one."""

    def __init__(self, source, enabled: bool, desc: str, total: int):
        self._source = source
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=f"loading {desc}", unit="tensor", leave=False)

    def __getattr__(self, name):
        return getattr(self._source, name)

    def get(self, name, dtype=None, device="cpu"):
        t = self._source.get(name, dtype=dtype, device=device)
        if self._bar is not None:
            self._bar.update(1)
        return t

    def record(self, name):
        """A pack's raw record bytes (the fast engine keeps expert / SC records packed on the device)."""
        r = self._source.record(name)
        if self._bar is not None:
            self._bar.update(1)
        return r


def model_tools(model) -> list | None:
    """The tool declarations a checkpoint ships beside its weights (tools.json), e.g. the demo model's."""
    path = Path(model.path) / "tools.json"
    return read_json(path, "tools.json") if path.is_file() else None


def _load_tokenizer(directory: Path):
    if not (directory / "tokenizer.json").is_file():
        return None
    try:
        from .tokenizer import load_tokenizer
    except ImportError:
        return None
    return load_tokenizer(directory)
