"""Quantized packs damaged in the ways a size check or a full-file rewrite would not notice: a blob longer than
its manifest says, an overlay's source shard stale in its size only (bytes appended, header intact) or in its
header only (same size, one header byte changed), and an overlay tensor at a misaligned local blob offset."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import diffgemma
from diffgemma.errors import CheckpointError
from diffgemma.quant import PackSource, quantize
from diffgemma.quant.pack import ALIGN, BLOB, MANIFEST
from tiny_checkpoints import PACKABLE, build_model, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = build_model(PACKABLE, canvas_length=16).to(torch.bfloat16)
    return Path(save(hf, tmp_path_factory.mktemp("ckpt") / "model", max_shard_size="150KB"))


@pytest.fixture(scope="module")
def overlay(ckpt, tmp_path_factory):
    """(a private copy of the source, an overlay pack built against it)."""
    root = tmp_path_factory.mktemp("ov")
    base = root / "base"
    shutil.copytree(ckpt, base)
    ov = quantize(base, root / "ov", profile="q4", overlay=True, progress=False)
    PackSource(ov).close()
    return base, Path(ov)


def _fresh(overlay, tmp_path):
    """A copy of the source and of the overlay, the overlay re-pinned to the copy."""
    base, ov = overlay
    b, o = tmp_path / "base", tmp_path / "ov"
    shutil.copytree(base, b)
    shutil.copytree(ov, o)
    m = json.loads((o / MANIFEST).read_text())
    text = json.dumps(m).replace(str(base), str(b))
    (o / MANIFEST).write_text(text)
    PackSource(o).close()  # the copy opens as the original does
    return b, o


def test_a_blob_longer_than_its_manifest_is_refused(ckpt, tmp_path):
    pack = quantize(ckpt, tmp_path / "q4", profile="q4", progress=False)
    with open(Path(pack) / BLOB, "ab") as f:
        f.write(b"\0" * ALIGN)
    with pytest.raises(CheckpointError, match="blob is longer than the manifest says"):
        PackSource(pack)
    with pytest.raises(CheckpointError, match="longer than the manifest says"):
        diffgemma.load(pack)


def test_a_source_shard_stale_in_size_only_is_refused(overlay, tmp_path):
    base, ov = _fresh(overlay, tmp_path)
    shard = sorted(base.glob("*.safetensors"))[0]
    with open(shard, "ab") as f:  # the header (and every tensor it lists) unchanged: only the size differs
        f.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is stale.*header sha256 matches"):
        PackSource(ov)


def test_a_source_shard_stale_in_header_only_is_refused(overlay, tmp_path):
    base, ov = _fresh(overlay, tmp_path)
    shard = sorted(base.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n]
    at = header.find(b'"pt"')
    assert at > 0, "the shard's header carries format metadata"
    header[at + 1:at + 3] = b"PT"  # same length, still valid JSON: the size is unchanged
    data[8:8 + n] = header
    size = shard.stat().st_size
    shard.write_bytes(bytes(data))
    assert shard.stat().st_size == size
    with pytest.raises(CheckpointError, match=rf"{shard.name} is stale.*header sha256 differs"):
        PackSource(ov)


def test_an_overlay_tensor_at_a_misaligned_local_offset_is_refused(overlay, tmp_path):
    _, ov = _fresh(overlay, tmp_path)
    m = json.loads((ov / MANIFEST).read_text())
    local = [t for t in m["tensors"] if t.get("source") and "local_offset" in t["source"]]
    assert local and any(t.get("source", {}).get("file") for t in m["tensors"])  # a real overlay: both kinds
    last = max(local, key=lambda t: t["source"]["local_offset"])
    last["source"]["local_offset"] += 16  # past every other local record: no overlap, only the alignment is wrong
    m["blob_bytes"] += 16
    (ov / MANIFEST).write_text(json.dumps(m))
    with open(ov / BLOB, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"{last['name']} sits at local blob offset \d+, not a multiple of 64"):
        PackSource(ov)
