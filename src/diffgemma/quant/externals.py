"""External shard references of layered (overlay) packs: pin a source shard, find it again, check it.

A raw tensor of an overlay pack lives inside the source checkpoint's safetensors shard; the manifest pins
that shard by its byte size and the sha256 of its header (length prefix + JSON header; not the multi-GiB
payload). `resolve_external` finds the shard at its recorded absolute path or, when the source was a
Hugging Face cache snapshot (.../models--ORG--NAME/snapshots/REV/), in the HF cache (DIFFGEMMA_HF_HOME,
HF_HOME, ~/.cache/huggingface), and fails loudly with the command that fixes it when the shard was
replaced, re-downloaded at another revision or deleted.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError
from .shards import HFCheckpoint, read_header


def hf_snapshot_of(path: Path) -> tuple[str, str] | None:
    """(repo, revision) if `path` is inside an HF cache snapshot directory, else None."""
    parts = Path(path).absolute().parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i][len("models--"):].replace("--", "/"), parts[i + 2]
    return None


def external_file_entry(ckpt: HFCheckpoint, filename: str) -> dict:
    info = ckpt.files[filename]
    ent = {"role": "hf_safetensors", "path": str((ckpt.path / filename).absolute()), "filename": filename,
           "size": info["size"], "header_sha256": info["header_sha256"]}
    snap = hf_snapshot_of(ckpt.path)
    if snap:
        ent["repo"], ent["revision"] = snap
    return ent


def _hf_roots() -> list[Path]:
    roots = [os.environ.get("DIFFGEMMA_HF_HOME"), os.environ.get("HF_HOME"), str(Path.home() / ".cache/huggingface")]
    return [Path(r) for r in roots if r]


def _fix_hint(ent: dict) -> str:
    if ent.get("repo"):
        return (f"fix: `hf download {ent['repo']} --revision {ent['revision']}` (restores the pinned snapshot), "
                "or rebuild the overlay from the shards you have with `diffgemma quantize --overlay`")
    return ("fix: restore that exact file, rebuild the overlay from the current checkpoint with "
            "`diffgemma quantize --overlay`, or (while the file is still intact) flatten it with "
            "`diffgemma repack --monolithic`")


def resolve_external(key: str, ent: dict, pack_dir: Path) -> Path:
    """The path of an external shard, checked against its pinned size and header sha256."""
    if not isinstance(ent, dict) or ent.get("role") != "hf_safetensors":
        raise CheckpointError(f"{pack_dir}: external file {key!r} has an unknown role; this diffgemma reads "
                              "'hf_safetensors' references only")
    candidates = [Path(ent.get("path", ""))]
    if ent.get("repo"):
        rel = Path("hub") / ("models--" + ent["repo"].replace("/", "--")) / "snapshots" / ent["revision"] / ent["filename"]
        candidates += [root / rel for root in _hf_roots()]
    found = [c for c in candidates if str(c) and c.is_file()]
    if not found:
        raise CheckpointError(f"{pack_dir}: overlay pack needs source shard {ent.get('filename')} (looked at "
                              f"{', '.join(str(c) for c in candidates)}) and it is missing; {_fix_hint(ent)}")
    path = found[0]
    size = path.stat().st_size
    try:
        _, _, sha = read_header(path)
    except CheckpointError as e:
        raise CheckpointError(f"{pack_dir}: source shard {path} is unreadable ({e}); {_fix_hint(ent)}") from None
    if size != ent.get("size") or sha != ent.get("header_sha256"):
        raise CheckpointError(f"{pack_dir}: source shard {path} is stale — it is not the file this overlay was built "
                              f"against (size {size} vs pinned {ent.get('size')}, header sha256 "
                              f"{'matches' if sha == ent.get('header_sha256') else 'differs'}); {_fix_hint(ent)}")
    return path
