"""PackSource: the loader's TensorSource over a pack directory (dequantizing on `get`).

Same protocol as the checkpoint source in diffgemma/checkpoint.py — keys(), shape(name), dtype(name),
get(name, dtype=None, device="cpu"), config_path, path — so the loader validates names and shapes
against the model config and pulls one tensor at a time. Quantized tensors come back dequantized
(in row chunks, so the peak extra memory is one chunk of float32), raw tensors byte-exact.

Opening a pack checks, before any tensor is materialised: the manifest (fields, byte lengths, overlaps),
the 64-byte alignment of every offset, the blob's exact size (a truncated copy is refused), and for
layered packs every external shard's size and header sha256. The blob is memory-mapped, never read
whole; `record(name)` hands out the zero-copy bytes a GPU loader would upload as they are.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import warnings
from pathlib import Path

import torch

from ..errors import CheckpointError, TensorError
from . import codecs
from .externals import resolve_external
from .pack import BLOB, MANIFEST, Manifest, TensorEntry, read_manifest
from .shards import torch_dtype

_DECODE_CHUNK_ELEMS = 1 << 24  # 16M elements = 64 MiB of float32 per dequant chunk


def is_pack(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def open_pack(path) -> "PackSource":
    """The loader's entry point (diffgemma.loader.open_source)."""
    return PackSource(path)


class PackSource:
    def __init__(self, path):
        self.path = Path(path)
        self.manifest: Manifest = read_manifest(self.path)  # alignment + consistency, nothing mapped yet
        blob = self.path / BLOB
        if not blob.is_file():
            raise CheckpointError(f"{blob}: blob file is missing; the pack is incomplete — re-create it with "
                                  "`diffgemma quantize`")
        size = blob.stat().st_size
        if size != self.manifest.blob_bytes:
            what = "truncated" if size < self.manifest.blob_bytes else "longer than the manifest says"
            raise CheckpointError(f"{blob}: blob is {what} ({size} bytes, the manifest expects "
                                  f"{self.manifest.blob_bytes}); the copy is damaged — re-copy or re-create the pack")
        self.config_path = self.path / "config.json"
        if not self.config_path.is_file():
            raise CheckpointError(f"{self.path}: pack has no config.json (it is copied from the source checkpoint "
                                  "by `diffgemma quantize`)")
        self.external_paths = {key: resolve_external(key, ent, self.path)
                               for key, ent in self.manifest.external_files.items()}
        self._maps: dict[Path, mmap.mmap] = {}

    @property
    def directory(self) -> Path:
        return self.path

    # ---------------------------------------------------------------- the TensorSource protocol
    def keys(self) -> set[str]:
        return set(self.manifest.tensors)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise TensorError(f"{self.path}: pack has no tensor {name!r}") from None

    def shape(self, name: str) -> tuple:
        return tuple(self.entry(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        """The source checkpoint's dtype (quantized tensors dequantize to it by default)."""
        return torch_dtype(self.entry(name).dtype)

    def nbytes(self) -> int:
        """Bytes of all tensor records (the canonical space, padding excluded)."""
        return sum(e.nbytes for e in self.manifest.tensors.values())

    def kind(self, name: str) -> str:
        return self.entry(name).kind

    def get(self, name: str, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        e = self.entry(name)
        dtype = dtype or torch_dtype(e.dtype)
        data = self.record(name)
        if e.kind == "raw":
            with warnings.catch_warnings():  # read-only mmap; cloned before anyone can write it
                warnings.simplefilter("ignore", UserWarning)
                t = (torch.frombuffer(data, dtype=torch_dtype(e.dtype)) if e.nbytes
                     else torch.empty(0, dtype=torch_dtype(e.dtype)))
            return t.reshape(e.shape).to(dtype=dtype, copy=True).to(device)
        views = codecs.plane_views(e.kind, data, e.shape)
        rows, k = codecs.rows_k(e.shape)
        out = torch.empty((rows, k), dtype=dtype)
        step = max(1, _DECODE_CHUNK_ELEMS // max(k, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            out[r0:r1] = codecs.decode_rows(e.kind, views, r0, r1)
        return out.reshape(e.shape).to(device)

    # ---------------------------------------------------------------- bytes
    def _map(self, path: Path) -> memoryview:
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
        return memoryview(self._maps[path])

    def record(self, name: str) -> memoryview:
        """The tensor's record bytes, zero-copy, wherever they live (own blob or an external shard)."""
        e = self.entry(name)
        if e.nbytes == 0:
            return memoryview(b"")
        if e.source is None:
            return self._map(self.path / BLOB)[e.offset:e.offset + e.nbytes]
        if "local_offset" in e.source:
            a = e.source["local_offset"]
            return self._map(self.path / BLOB)[a:a + e.nbytes]
        a = e.source["offset"]
        return self._map(self.external_paths[e.source["file"]])[a:a + e.nbytes]

    def verify(self, names=None, progress: bool = False, workers: int | None = None) -> tuple[int, int]:
        """Check each record's sha256 against the manifest (reads every byte; not done on open: a full pack is
        ~19 GB) -> (tensors checked, bytes read). Hashes run on `workers` threads (hashlib lets go of the GIL on
        large buffers). Every tensor is checked before a failure is raised, so the error says how many differ."""
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        names = list(names or self.manifest.tensors)
        entries = [self.entry(n) for n in names]
        unpinned = [e.name for e in entries if not e.sha256]
        if unpinned:
            raise CheckpointError(f"{self.path}: {len(unpinned)} tensor(s) have no sha256 in the manifest (first: "
                                  f"{unpinned[0]}); re-create the pack with `diffgemma quantize` to verify it")
        workers = workers or min(8, os.cpu_count() or 1)
        bad = []
        with ThreadPoolExecutor(workers) as pool, tqdm(total=sum(e.nbytes for e in entries), unit="B",
                                                       unit_scale=True, desc="verify", disable=not progress) as bar:
            records = [self.record(e.name) for e in entries]  # mapped here: the threads only hash
            for e, digest in zip(entries, pool.map(lambda r: hashlib.sha256(r).hexdigest(), records)):
                bar.update(e.nbytes)
                if digest != e.sha256:
                    bad.append(e.name)
        if bad:
            raise CheckpointError(f"{self.path}: {len(bad)} of {len(entries)} tensor(s) do not match their sha256 in the "
                                  f"manifest ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); the pack is "
                                  "corrupted — re-copy or re-create it")
        return len(entries), sum(e.nbytes for e in entries)

    def close(self) -> None:
        for m in self._maps.values():
            if isinstance(m, mmap.mmap):
                try:
                    m.close()
                except BufferError:  # a tensor view is still alive; the GC unmaps it later
                    pass
        self._maps.clear()
