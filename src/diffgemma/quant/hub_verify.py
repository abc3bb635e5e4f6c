"""`diffgemma verify DIR` for a published quantized checkpoint (docs/FORMATS.md, 'diffgemma verify DIR').

safetensors shards carry no per-tensor hashes, so what can be checked is: every shard's header against its size
(a truncated copy fails), the index against the shards, every tensor the forward reads present with its shape,
and every byte of it read and dequantized to finite values. Where the directory is a Hugging Face cache snapshot,
each shard is a link to a blob named by the sha256 of its content (the hub's own hash of the file): those hashes
are checked too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..checkpoint import expected_tensors, validate
from ..config import ModelConfig
from ..errors import CheckpointError
from .hub import HubScheme
from .hub_source import HubSource


def _hub_sha256(path: Path) -> str | None:
    """The sha256 an HF cache snapshot names this file's blob by (None if it is not such a link)."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    name = target.name
    if target.parent.name == "blobs" and len(name) == 64 and all(c in "0123456789abcdef" for c in name):
        return name
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(64 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_hub(directory, scheme: HubScheme) -> str:
    """Check the checkpoint (module docstring) -> the one-line statement of what was checked; CheckpointError naming
    the file and the tensor on the first problem."""
    directory = Path(directory)
    cfg = ModelConfig.from_file(directory / "config.json")
    src = HubSource(directory, scheme, cfg)  # headers vs file sizes, the index vs the shards
    try:
        validate(src, cfg, str(directory))
        names = list(expected_tensors(cfg))
        for name in names:
            t = src.get(name, dtype=torch.float32)
            if not torch.isfinite(t).all():
                raise CheckpointError(f"{src.shard_of(name)}: tensor {name!r} dequantizes to non-finite values; the "
                                      "file is corrupted — re-download it")
        shards = sorted(src.raw.source.files())
        hashed = 0
        for p in shards:
            want = _hub_sha256(p)
            if want is not None:
                if _sha256(p) != want:
                    raise CheckpointError(f"{p}: sha256 differs from the hub's ({want[:12]}...); the file is corrupted "
                                          "— re-download it")
                hashed += 1
    finally:
        src.close()
    hashes = (f"{hashed} of {len(shards)} shards match the hub's sha256" if hashed else
              "no shard hashes to check (not a Hugging Face cache snapshot)")
    return (f"{directory}: {scheme.describe()}: {len(shards)} shards' headers and sizes, {len(names)} tensors read "
            f"and dequantized to finite values; {hashes}")
