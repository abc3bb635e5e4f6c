"""Byte-level access to a Hugging Face safetensors checkpoint (single file or sharded with an index).

The quantizer needs more than tensors: raw tensors are copied byte-for-byte, overlay packs point at
byte ranges inside the shards, and a shard is pinned by its size and the sha256 of its header. So this
reads the safetensors header itself and hands out memory-mapped byte ranges; nothing is loaded whole.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError

# safetensors dtype string -> (torch dtype, bytes per element)
DTYPES = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 * 1024 * 1024


def torch_dtype(st_dtype: str) -> torch.dtype:
    if st_dtype not in DTYPES:
        raise CheckpointError(f"unsupported safetensors dtype {st_dtype!r}")
    return DTYPES[st_dtype][0]


def read_header(path: Path) -> tuple[dict, int, str]:
    """(header dict, data start offset, sha256 of the 8-byte length + JSON header) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise CheckpointError(f"{path}: header length {n} is implausible (not a safetensors file?)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) != n:
        raise CheckpointError(f"{path}: header truncated")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    return header, 8 + n, hashlib.sha256(head + raw).hexdigest()


@dataclass(frozen=True)
class ShardTensor:
    name: str
    file: Path
    dtype: str  # safetensors dtype string
    shape: tuple
    start: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]


class HFCheckpoint:
    """The tensors of an HF checkpoint directory, by name, as byte ranges in their shard files."""

    def __init__(self, directory):
        self.path = Path(directory)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory (expected an HF checkpoint directory)")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.path / "model.safetensors").is_file():
            weight_map, files = None, ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self.tensors: dict[str, ShardTensor] = {}
        self.files: dict[str, dict] = {}  # filename -> {"size", "header_sha256"}
        for fn in files:
            fp = self.path / fn
            if not fp.is_file():
                raise CheckpointError(f"{fp}: shard listed in the index is missing")
            header, data_start, sha = read_header(fp)
            size = fp.stat().st_size
            self.files[fn] = {"size": size, "header_sha256": sha}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(name) != fn:
                    continue
                self.tensors[name] = _parse_entry(fp, name, info, data_start, size)
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.tensors))
            if missing:
                raise CheckpointError(f"{index}: {missing[0]} is mapped to {weight_map[missing[0]]} but not stored there")
        self._maps: dict[Path, mmap.mmap] = {}

    def keys(self):
        return self.tensors.keys()

    def entry(self, name: str) -> ShardTensor:
        return self.tensors[name]

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[path]

    def byte_view(self, name: str, start: int = 0, stop: int | None = None) -> memoryview:
        """A zero-copy view of the tensor's bytes [start, stop) (relative to the tensor)."""
        t = self.tensors[name]
        stop = t.nbytes if stop is None else stop
        return memoryview(self._map(t.file))[t.start + start:t.start + stop]

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the tensor viewed as [R, K] (K = last dim), in its stored dtype (a copy)."""
        t = self.tensors[name]
        k = t.shape[-1] if t.shape else 1
        row = k * t.itemsize
        mv = self.byte_view(name, r0 * row, r1 * row)
        with warnings.catch_warnings():  # read-only mmap; the tensor is cloned before anyone can write it
            warnings.simplefilter("ignore", UserWarning)
            x = torch.frombuffer(mv, dtype=torch_dtype(t.dtype)) if len(mv) else torch.empty(0, dtype=torch_dtype(t.dtype))
        return x.reshape(r1 - r0, k).clone()

    def close(self):
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap it
                pass
        self._maps.clear()


def _parse_entry(fp: Path, name: str, info, data_start: int, size: int) -> ShardTensor:
    try:
        dtype, shape, (a, b) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{fp}: header entry for {name} is malformed") from None
    if dtype not in DTYPES:
        raise CheckpointError(f"{fp}: {name} has unsupported dtype {dtype!r}")
    n = 1
    for s in shape:
        n *= s
    if b - a != n * DTYPES[dtype][1] or a < 0 or data_start + b > size:
        raise CheckpointError(f"{fp}: {name} byte range [{a}, {b}) does not fit shape {list(shape)} {dtype} "
                              f"or the file ({size} bytes)")
    return ShardTensor(name, fp, dtype, shape, data_start + a, b - a)
