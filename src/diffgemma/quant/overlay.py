"""Layered (overlay) packs: raw tensors referenced inside the source HF shards, and `repack`.

An overlay pack stores only its quantized tensors (in a compact local blob); every raw tensor is an
external reference into the source checkpoint's safetensors shard, which is byte-identical because raw
tensors are never transformed. Each referenced shard is pinned in `external_files` by its byte size and
the sha256 of its header (length prefix + JSON header; not the multi-GiB payload): a shard that was
replaced, re-downloaded at another revision or deleted fails loudly, with the command that fixes it.

Finding and checking those shards is quant/externals.py's job.

Overlay packs are local dev tooling; `repack --monolithic` flattens one back into a self-contained pack
(the distribution shape), streaming every tensor's resolved bytes to canonical offsets, checking each
against its sha256 on the way. `repack --overlay` is the dual: it splits a self-contained pack against
its source checkpoint, keeping locally any raw tensor whose bytes turn out not to match the source.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from ..errors import CheckpointError
from . import codecs
from .externals import external_file_entry
from .pack import Manifest, PackWriter, version_for
from .shards import HFCheckpoint
from .source import PackSource

_COPY_CHUNK = 64 << 20


def _stream_copy(src: memoryview, writer: PackWriter, offset: int, bar) -> str:
    h = hashlib.sha256()
    for a in range(0, len(src), _COPY_CHUNK):
        chunk = src[a:a + _COPY_CHUNK]
        h.update(chunk)
        writer.write_at(offset + a, chunk)
        bar.update(len(chunk))
    return h.hexdigest()


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    if len(a) != len(b):
        return False
    return all(bytes(a[i:i + _COPY_CHUNK]) == bytes(b[i:i + _COPY_CHUNK]) for i in range(0, len(a), _COPY_CHUNK))


def repack_monolithic(pack_dir, out_dir, progress: bool = True) -> Path:
    """Flatten a (layered) pack into a self-contained one: same canonical offsets, no external refs."""
    src = PackSource(pack_dir)
    m = src.manifest
    entries = {}
    with PackWriter(out_dir, m.total_bytes) as w, tqdm(total=sum(e.nbytes for e in m.tensors.values()), unit="B",
                                                       unit_scale=True, desc="repack", disable=not progress) as bar:
        for name, e in m.tensors.items():
            sha = _stream_copy(src.record(name), w, e.offset, bar)
            if e.sha256 and sha != e.sha256:
                raise CheckpointError(f"{pack_dir}: tensor {name} does not match its sha256; the pack or its source "
                                      "shard is corrupted — nothing was written")
            entries[name] = replace(e, sha256=sha, source=None)
        out = replace(m, tensors=entries, blob_bytes=m.total_bytes, external_files={})
        src.close()
        return w.finish(out, side_files_from=src.path)


def repack_overlay(pack_dir, model_dir, out_dir, progress: bool = True) -> Path:
    """Split a self-contained pack: raw tensors byte-identical to `model_dir`'s shards become external refs."""
    src = PackSource(pack_dir)
    ckpt = HFCheckpoint(model_dir)
    m = src.manifest
    plan, local_off, externals = {}, 0, {}
    for name, e in m.tensors.items():
        st = ckpt.tensors.get(name)
        if e.kind == "raw" and st is not None and st.dtype == e.dtype and list(st.shape) == e.shape \
                and _same_bytes(ckpt.byte_view(name), src.record(name)):
            externals[st.file.name] = external_file_entry(ckpt, st.file.name)
            plan[name] = replace(e, source={"file": st.file.name, "offset": st.start})
        else:  # quantized, or a raw tensor that is not verbatim in the source: stays in our blob
            plan[name] = replace(e, source={"local_offset": local_off})
            local_off = codecs.align_up(local_off + e.nbytes)
    with PackWriter(out_dir, local_off) as w, tqdm(total=local_off, unit="B", unit_scale=True, desc="repack",
                                                   disable=not progress) as bar:
        for name, e in plan.items():
            if "local_offset" in e.source:
                _stream_copy(src.record(name), w, e.source["local_offset"], bar)
        out = replace(m, tensors=plan, blob_bytes=local_off, external_files=externals,
                      version=version_for(e.kind for e in plan.values()))
        src.close()
        return w.finish(out, side_files_from=src.path)


def describe(m: Manifest) -> str:
    n_ext = sum(1 for e in m.tensors.values() if e.source and "file" in e.source)
    return f"{len(m.tensors)} tensors, {n_ext} external, blob {m.blob_bytes} bytes, canonical {m.total_bytes} bytes"
