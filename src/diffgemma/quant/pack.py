"""The pack format: a versioned JSON manifest + one blob file, and a writer that leaves nothing half-written.

A pack directory holds
    manifest.json      this module's Manifest (format "diffgemma-pack", version 1, or 2 when any nvfp4 tensor is
                       present so an older reader refuses instead of misreading)
    model.pack.bin     the blob
    config.json, generation_config.json, tokenizer files   copied from the source checkpoint

Addressing: every tensor has a canonical `offset` and `nbytes` in one unified address space, in which
every offset is a multiple of 64 (ALIGN). GPU kernels reinterpret blob + offset as typed pointers,
which is only defined for aligned offsets, and a misaligned read is silently wrong while every
byte-level check stays green — so alignment is checked when a pack is opened, before any tensor is
materialised. Non-expert tensors come first, the expert stacks last; `expert_split` is the canonical
offset where the experts begin (a loader may map the expert tail separately).

A self-contained pack stores every tensor in its blob AT its canonical offset (`source` is null). A
layered pack (overlay.py) gives some entries a `source`:
    {"local_offset": N}              in this pack's own compact blob at N (also a multiple of 64)
    {"file": KEY, "offset": N}       in external_files[KEY] (role "hf_safetensors": a source shard) at byte N
`source` says only where to copy the bytes FROM; consumers always address the canonical space.

Each entry records the sha256 of its record bytes, checked by `PackSource.verify` and by repack.
Record byte layouts are documented in codecs.py.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import CheckpointError
from . import codecs
from .shards import DTYPES

FORMAT = "diffgemma-pack"
VERSION = 1
VERSION_NVFP4 = 2
SUPPORTED_VERSIONS = (VERSION, VERSION_NVFP4)
MANIFEST = "manifest.json"
BLOB = "model.pack.bin"
ALIGN = codecs.ALIGN

# Files copied from the source checkpoint so a pack directory is loadable on its own.
SIDE_FILE_SUFFIXES = (".json", ".jinja", ".model", ".txt")
_NOT_SIDE_FILES = {"model.safetensors.index.json", MANIFEST}


@dataclass
class TensorEntry:
    name: str
    kind: str  # "raw" or a codec name
    dtype: str  # safetensors dtype of the SOURCE tensor (raw: of the stored bytes; quantized: dequant target)
    shape: list
    offset: int  # canonical offset, multiple of ALIGN
    nbytes: int
    sha256: str = ""
    source: dict | None = None  # None = in this blob at `offset`; see the module docstring


@dataclass
class Manifest:
    profile: str
    requested_profile: str
    custom_classes: dict
    tensors: dict  # name -> TensorEntry, in canonical order
    total_bytes: int  # size of the canonical address space
    blob_bytes: int  # size of this pack's own blob file
    expert_split: int
    external_files: dict = field(default_factory=dict)
    source_model: str = ""
    version: int = VERSION
    format: str = FORMAT

    def is_layered(self) -> bool:
        return any(e.source is not None for e in self.tensors.values())

    def to_json(self) -> str:
        d = asdict(self)
        d["tensors"] = [asdict(e) for e in self.tensors.values()]
        return json.dumps(d, indent=1)


def version_for(kinds) -> int:
    return VERSION_NVFP4 if "nvfp4" in set(kinds) else VERSION


def assign_offsets(entries: list[TensorEntry]) -> tuple[int, int]:
    """Give entries canonical offsets in place (non-experts first, experts last, each 64-aligned).

    Returns (total_bytes, expert_split). Reorders `entries`.
    """
    entries.sort(key=lambda e: (".experts." in e.name, e.name))
    off, split = 0, None
    for e in entries:
        if split is None and ".experts." in e.name:
            split = off
        e.offset = off
        off = codecs.align_up(off + e.nbytes)
    return off, (off if split is None else split)


# --------------------------------------------------------------------------------------------- reading

def _need(d, key, kind, where):
    if key not in d:
        raise CheckpointError(f"{where}: field {key!r} is missing")
    v = d[key]
    if kind is int and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise CheckpointError(f"{where}: field {key!r} must be a non-negative integer, got {v!r}")
    if kind is not int and not isinstance(v, kind):
        raise CheckpointError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def read_manifest(pack_dir: Path) -> Manifest:
    """Parse and validate manifest.json: every field, shape/kind/byte-length consistency, alignment, overlaps.

    Raises CheckpointError naming the pack, the tensor and the problem; nothing else is opened.
    """
    path = Path(pack_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{pack_dir}: no {MANIFEST} (not a diffgemma pack)")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted manifest, not valid JSON ({e}); re-create the pack with "
                              "`diffgemma quantize`") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest (format={d.get('format') if isinstance(d, dict) else None!r})")
    version = _need(d, "version", int, path)
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(f"{path}: pack version {version} is not supported by this diffgemma "
                              f"(supports {list(SUPPORTED_VERSIONS)}); upgrade diffgemma or re-quantize")
    tensors = {}
    for i, t in enumerate(_need(d, "tensors", list, path)):
        where = f"{path}: tensors[{i}]"
        if not isinstance(t, dict):
            raise CheckpointError(f"{where}: expected an object")
        name = _need(t, "name", str, where)
        where = f"{path}: tensor {name}"
        e = TensorEntry(name=name, kind=_need(t, "kind", str, where), dtype=_need(t, "dtype", str, where),
                        shape=_need(t, "shape", list, where), offset=_need(t, "offset", int, where),
                        nbytes=_need(t, "nbytes", int, where), sha256=t.get("sha256", ""), source=t.get("source"))
        _check_entry(e, where)
        if name in tensors:
            raise CheckpointError(f"{where}: listed twice")
        tensors[name] = e
    m = Manifest(
        profile=_need(d, "profile", str, path), requested_profile=d.get("requested_profile", d.get("profile")),
        custom_classes=d.get("custom_classes") or {}, tensors=tensors,
        total_bytes=_need(d, "total_bytes", int, path), blob_bytes=_need(d, "blob_bytes", int, path),
        expert_split=_need(d, "expert_split", int, path), external_files=d.get("external_files") or {},
        source_model=d.get("source_model", ""), version=version,
    )
    if version < version_for(e.kind for e in tensors.values()):
        raise CheckpointError(f"{path}: version {version} pack holds nvfp4 tensors (needs version {VERSION_NVFP4})")
    check_alignment(m, path)
    _check_ranges(m, path)
    return m


def _check_entry(e: TensorEntry, where: str):
    if e.kind not in codecs.ALL_FORMATS:
        raise CheckpointError(f"{where}: unknown kind {e.kind!r} (this diffgemma knows {', '.join(codecs.ALL_FORMATS)})")
    if e.dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {e.dtype!r}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in e.shape):
        raise CheckpointError(f"{where}: shape {e.shape!r} is not a list of non-negative integers")
    if e.kind == "raw":
        n = DTYPES[e.dtype][1]
        for s in e.shape:
            n *= s
    else:
        problem = codecs.dims_problem(e.kind, e.shape)
        if problem:
            raise CheckpointError(f"{where}: {problem}")
        n = codecs.record_nbytes(e.kind, e.shape)
    if e.nbytes != n:
        raise CheckpointError(f"{where}: nbytes={e.nbytes} but a {e.kind} {e.dtype} tensor of shape {e.shape} "
                              f"takes {n} bytes")
    if e.source is not None:
        ok = isinstance(e.source, dict) and (
            set(e.source) == {"local_offset"} and isinstance(e.source["local_offset"], int)
            or set(e.source) == {"file", "offset"} and isinstance(e.source["offset"], int))
        if not ok:
            raise CheckpointError(f"{where}: malformed source {e.source!r}")


def check_alignment(m: Manifest, where) -> None:
    """Refuse a pack any of whose canonical or local offsets is not a multiple of ALIGN (64).

    Plane offsets inside a record are multiples of ALIGN by construction (codecs.planes), so aligned
    records mean every plane a kernel reads is aligned.
    """
    for e in m.tensors.values():
        if e.offset % ALIGN:
            raise CheckpointError(f"{where}: tensor {e.name} sits at canonical offset {e.offset}, not a multiple of "
                                  f"{ALIGN}; GPU kernels would read it misaligned (silently wrong). Refusing the pack; "
                                  "re-create it with `diffgemma quantize` or `diffgemma repack --monolithic`")
        if e.source and "local_offset" in e.source and e.source["local_offset"] % ALIGN:
            raise CheckpointError(f"{where}: tensor {e.name} sits at local blob offset {e.source['local_offset']}, not a "
                                  f"multiple of {ALIGN}. Refusing the pack; re-create it")


def _check_ranges(m: Manifest, where) -> None:
    spans, local = [], []
    for e in m.tensors.values():
        if e.offset + e.nbytes > m.total_bytes:
            raise CheckpointError(f"{where}: tensor {e.name} [{e.offset}, {e.offset + e.nbytes}) runs past "
                                  f"total_bytes={m.total_bytes}")
        spans.append((e.offset, e.offset + e.nbytes, e.name))
        if e.source is None or "local_offset" in e.source:
            a = e.offset if e.source is None else e.source["local_offset"]
            if a + e.nbytes > m.blob_bytes:
                raise CheckpointError(f"{where}: tensor {e.name} [{a}, {a + e.nbytes}) runs past blob_bytes={m.blob_bytes}")
            local.append((a, a + e.nbytes, e.name))
        elif e.source["file"] not in m.external_files:
            raise CheckpointError(f"{where}: tensor {e.name} refers to unknown external file {e.source['file']!r}")
    for group in (spans, local):
        group.sort()
        for (a0, a1, n0), (b0, b1, n1) in zip(group, group[1:]):
            if b0 < a1:
                raise CheckpointError(f"{where}: tensors {n0} and {n1} overlap")


# --------------------------------------------------------------------------------------------- writing

class PackWriter:
    """Writes a pack into a temporary sibling directory and renames it into place only on success.

    Use as a context manager: any exception removes the temporary directory, so a failed run leaves
    nothing at the output path. Refuses an output path that exists and is not an empty directory.
    """

    def __init__(self, out_dir, blob_bytes: int):
        self.out = Path(out_dir).absolute()
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise CheckpointError(f"{self.out}: output path exists and is not an empty directory; choose a new path "
                                  "or remove it first")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        self.blob = open(self.tmp / BLOB, "w+b")
        self.blob.truncate(blob_bytes)  # sparse: the padding between records reads as zeros
        self.blob_bytes = blob_bytes

    def write_at(self, offset: int, data) -> None:
        self.blob.seek(offset)
        self.blob.write(data)

    def read_at(self, offset: int, n: int) -> bytes:
        self.blob.flush()
        self.blob.seek(offset)
        return self.blob.read(n)

    def finish(self, manifest: Manifest, side_files_from=None) -> Path:
        self.blob.flush()
        os.fsync(self.blob.fileno())
        self.blob.close()
        if (self.tmp / BLOB).stat().st_size != self.blob_bytes:
            raise CheckpointError(f"{self.tmp / BLOB}: wrote {(self.tmp / BLOB).stat().st_size} bytes, "
                                  f"expected {self.blob_bytes}")
        if side_files_from is not None:
            copy_side_files(Path(side_files_from), self.tmp)
        (self.tmp / MANIFEST).write_text(manifest.to_json())
        if self.out.exists():
            self.out.rmdir()  # verified empty in __init__
        os.rename(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        try:
            self.blob.close()
        except OSError:
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy config / generation config / tokenizer files (never weights or the index)."""
    copied = []
    for p in sorted(src.iterdir()):
        if p.is_file() and p.suffix in SIDE_FILE_SUFFIXES and p.name not in _NOT_SIDE_FILES:
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied
