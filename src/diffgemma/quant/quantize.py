"""The streaming quantizer: HF checkpoint directory -> pack directory.

Order of work, so that a mistake costs nothing:
  1. the profile and every --set are validated (policy.make_policy) before the source is opened;
  2. the source's config.json and safetensors headers are read; every tensor's format is resolved and
     its dimensions validated against that format — all before the output directory exists;
  3. records are written tensor by tensor, large tensors in row chunks (host memory stays around one
     chunk, not one model), into a temporary sibling directory that is renamed into place at the end.
     Any failure removes the temporary directory; nothing is left at the output path.

Raw tensors are copied byte-for-byte from the source (bf16 stays bf16, f32 stays f32). With
`overlay=True` they are not copied at all but referenced inside the source shards (see overlay.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tqdm import tqdm

from ..config import ModelConfig
from ..errors import TensorError
from . import codecs
from .externals import external_file_entry
from .pack import Manifest, PackWriter, TensorEntry, assign_offsets, version_for
from .policy import Policy, make_policy, tensor_class
from .shards import FLOAT_DTYPES, HFCheckpoint

CHUNK_ELEMS = 1 << 24  # elements per quantization chunk (64 MiB of float32 working memory)
_COPY_CHUNK = 64 << 20


def plan_pack(ckpt: HFCheckpoint, policy: Policy) -> tuple[list[TensorEntry], int, int]:
    """Every tensor's format, record size and canonical offset; refuses any invalid (tensor, format)."""
    entries = []
    for name in sorted(ckpt.keys()):
        st = ckpt.entry(name)
        fmt = policy.format_of(name)
        if fmt != "raw":
            where = f"{name} (class {tensor_class(name)}, shape {list(st.shape)}, {st.dtype}) -> {fmt}"
            problem = codecs.dims_problem(fmt, st.shape)
            if problem:
                raise TensorError(f"cannot quantize {where}: {problem}; nothing was written")
            if st.dtype not in FLOAT_DTYPES:
                raise TensorError(f"cannot quantize {where}: only float tensors can be quantized; nothing was written")
        nbytes = st.nbytes if fmt == "raw" else codecs.record_nbytes(fmt, st.shape)
        entries.append(TensorEntry(name=name, kind=fmt, dtype=st.dtype, shape=list(st.shape), offset=0, nbytes=nbytes))
    total, split = assign_offsets(entries)
    return entries, total, split


def quantize(model_dir, out_dir, profile: str = "q4", sets=(), overlay: bool = False, progress: bool = True,
             chunk_elems: int = CHUNK_ELEMS) -> Path:
    policy = make_policy(profile, sets)  # step 1: settings, before touching any file
    model_dir = Path(model_dir)
    ModelConfig.from_file(model_dir / "config.json")  # a DiffusionGemma checkpoint at all?
    ckpt = HFCheckpoint(model_dir)
    entries, total, split = plan_pack(ckpt, policy)  # step 2: every (tensor, format) checked

    externals: dict[str, dict] = {}
    local_off = 0
    for e in entries:
        if overlay and e.kind == "raw":
            st = ckpt.entry(e.name)
            externals.setdefault(st.file.name, external_file_entry(ckpt, st.file.name))
            e.source = {"file": st.file.name, "offset": st.start}
        elif overlay:
            e.source = {"local_offset": local_off}
            local_off = codecs.align_up(local_off + e.nbytes)
    blob_bytes = local_off if overlay else total

    manifest = Manifest(profile=policy.profile, requested_profile=policy.requested_profile,
                        custom_classes=dict(policy.overrides), tensors={e.name: e for e in entries},
                        total_bytes=total, blob_bytes=blob_bytes, expert_split=split, external_files=externals,
                        source_model=str(model_dir.absolute()), version=version_for(e.kind for e in entries))
    src_bytes = sum(ckpt.entry(e.name).nbytes for e in entries)
    try:
        with PackWriter(out_dir, blob_bytes) as w, tqdm(total=src_bytes, unit="B", unit_scale=True,
                                                        desc=f"quantize {policy.requested_profile}",
                                                        disable=not progress) as bar:
            for e in entries:  # step 3: stream
                where = e.offset if e.source is None else e.source.get("local_offset")
                if e.kind == "raw":
                    e.sha256 = _copy_raw(ckpt, e.name, w if where is not None else None, where, bar)
                else:
                    e.sha256 = _write_quantized(ckpt, e, w, where, chunk_elems, bar)
            return w.finish(manifest, side_files_from=model_dir)
    finally:
        ckpt.close()


def _copy_raw(ckpt: HFCheckpoint, name: str, w: PackWriter | None, offset, bar) -> str:
    """Copy (or, for an overlay ref, only hash) a raw tensor's source bytes, verbatim."""
    h = hashlib.sha256()
    view = ckpt.byte_view(name)
    for a in range(0, len(view), _COPY_CHUNK):
        chunk = view[a:a + _COPY_CHUNK]
        h.update(chunk)
        if w is not None:
            w.write_at(offset + a, chunk)
        bar.update(len(chunk))
    view.release()
    return h.hexdigest()


def _write_quantized(ckpt: HFCheckpoint, e: TensorEntry, w: PackWriter, offset: int, chunk_elems: int, bar) -> str:
    rows, k = codecs.rows_k(e.shape)
    step = max(1, chunk_elems // max(k, 1))
    row_bytes = ckpt.entry(e.name).itemsize * k
    tscale = None
    if e.kind == "nvfp4":  # one scale for the whole tensor: a |max| pre-pass over the same chunks
        amax = 0.0
        for r0 in range(0, rows, step):
            amax = max(amax, ckpt.rows(e.name, r0, min(rows, r0 + step)).float().abs().max().item())
        tscale = codecs.nvfp4_tensor_scale(amax)
    plane_list = codecs.planes(e.kind, e.shape)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        try:
            enc = codecs.encode(e.kind, ckpt.rows(e.name, r0, r1), tscale=tscale)
        except TensorError as err:
            raise TensorError(f"cannot quantize {e.name} to {e.kind}: {err}; nothing was written") from None
        for p in plane_list:
            if p.name == "tscale":
                if r0 == 0:
                    w.write_at(offset + p.offset, enc[p.name].tobytes())
            else:
                w.write_at(offset + p.offset + r0 * p.row_bytes, enc[p.name].tobytes())
        bar.update((r1 - r0) * row_bytes)
    # Hash what actually landed in the blob (doubles as a read-back check of the scattered plane writes).
    h = hashlib.sha256()
    for a in range(0, e.nbytes, _COPY_CHUNK):
        h.update(w.read_at(offset + a, min(_COPY_CHUNK, e.nbytes - a)))
    return h.hexdigest()
