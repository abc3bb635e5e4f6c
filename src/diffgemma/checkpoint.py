"""Reading a Hugging Face DiffusionGemma checkpoint directory, one tensor at a time.

A TensorSource maps tensor names to lazily-read tensors. The safetensors implementation opens each
shard with `safe_open` (memory-mapped), so loading a 52 GB checkpoint never holds it whole in host
RAM: the loader asks for one tensor, converts it, moves it to the device, and drops the host copy.

`expected_tensors(config)` is the checkpoint's contract: every name the forward pass needs and its
shape. The loader validates a source against it before reading any tensor data, so a missing tensor
or a wrong shape fails fast with a message that names the tensor and the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, Protocol

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import CheckpointError, TensorError

DECODER = "model.decoder."
ENCODER_LAYERS = "model.encoder.language_model.layers."
# Prefixes of tensors that exist in the checkpoint but that a text-only forward never reads.
SKIPPED_PREFIXES = (
    "model.encoder.vision_tower.",
    "model.encoder.embed_vision.",
    # The encoder's own copies of the shared weights (tied to the decoder's; save_pretrained drops them,
    # other writers may not). Only encoder layer_scalar is distinct and is requested explicitly.
    "model.encoder.language_model.",
    "lm_head.",
)


class TensorSource(Protocol):
    """Where tensor bytes come from: an HF checkpoint, a quantized pack, ..."""

    def keys(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def get(self, name: str, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor: ...

    def nbytes(self) -> int: ...


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the text forward needs, with its shape, keyed by checkpoint name."""
    H, F, E, Fe = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {
        DECODER + "embed_tokens.weight": (cfg.vocab_size, H),
        DECODER + "norm.weight": (H,),
        DECODER + "self_conditioning.pre_norm.weight": (H,),
        DECODER + "self_conditioning.gate_proj.weight": (F, H),
        DECODER + "self_conditioning.up_proj.weight": (F, H),
        DECODER + "self_conditioning.down_proj.weight": (H, F),
    }
    for layer in cfg.layers:
        p = f"{DECODER}layers.{layer.index}."
        hd, kvh, nh = layer.head_dim, layer.num_kv_heads, cfg.num_heads
        out[p + "self_attn.q_proj.weight"] = (nh * hd, H)
        out[p + "self_attn.k_proj.weight"] = (kvh * hd, H)
        if layer.has_v_proj:
            out[p + "self_attn.v_proj.weight"] = (kvh * hd, H)
        out[p + "self_attn.o_proj.weight"] = (H, nh * hd)
        out[p + "self_attn.q_norm.weight"] = (hd,)
        out[p + "self_attn.k_norm.weight"] = (hd,)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            out[p + norm + ".weight"] = (H,)
        out[p + "mlp.gate_proj.weight"] = (F, H)
        out[p + "mlp.up_proj.weight"] = (F, H)
        out[p + "mlp.down_proj.weight"] = (H, F)
        out[p + "router.proj.weight"] = (E, H)
        out[p + "router.scale"] = (H,)
        out[p + "router.per_expert_scale"] = (E,)
        out[p + "experts.gate_up_proj"] = (E, 2 * Fe, H)
        out[p + "experts.down_proj"] = (E, H, Fe)
        out[p + "layer_scalar"] = (1,)  # decoder (denoise) layer scalar
        out[f"{ENCODER_LAYERS}{layer.index}.layer_scalar"] = (1,)  # encoder (prefill) layer scalar
    return out


def validate(source: TensorSource, cfg: ModelConfig, where: str) -> None:
    """Raise TensorError for the first missing or mis-shaped tensor, naming it and the expectation."""
    have = source.keys()
    expected = expected_tensors(cfg)
    missing = [n for n in expected if n not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TensorError(f"{where}: tensor {missing[0]!r} is missing{more}; expected shape {list(expected[missing[0]])}")
    for name, shape in expected.items():
        got = tuple(source.shape(name))
        if got != shape:
            raise TensorError(f"{where}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")


class SafetensorsSource:
    """One or many safetensors shards of an HF checkpoint, opened lazily (mmap)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index (expected a 'weight_map' object): {e}") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = ["model.safetensors"]
            weight_map = None
        else:
            raise CheckpointError(
                f"{self.directory}: no model.safetensors or model.safetensors.index.json (expected safetensors weights)"
            )
        self._files: dict[str, Path] = {}
        self._handles = {}
        self._where: dict[str, str] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for fname in files:
            path = self.directory / fname
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in model.safetensors.index.json does not exist")
            header = _read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(name) not in (None, fname):
                    continue  # the index says this tensor lives in another shard
                self._where[name] = fname
                self._meta[name] = (tuple(info["shape"]), info["dtype"])
            self._files[fname] = path
        if weight_map is not None:
            lost = [n for n, f in weight_map.items() if n not in self._where]
            if lost:
                raise CheckpointError(
                    f"{self.directory / weight_map[lost[0]]}: tensor {lost[0]!r} is listed in the index but not in that shard"
                )

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return _ST_DTYPES.get(self._meta[name][1], torch.float32)

    def file_of(self, name: str) -> Path:
        return self._files[self._where[name]]

    def files(self) -> list[Path]:
        """The shard files this checkpoint's tensors are read from."""
        return list(self._files.values())

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self._files.values())

    def get(self, name: str, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        fname = self._where.get(name)
        if fname is None:
            raise TensorError(f"{self.directory}: tensor {name!r} is not in the checkpoint")
        handle = self._handles.get(fname)
        if handle is None:
            try:
                handle = safe_open(str(self._files[fname]), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error type for corrupt files
                raise CheckpointError(f"{self._files[fname]}: cannot open safetensors file: {e}") from None
            self._handles[fname] = handle
        try:
            t = handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self._files[fname]}: cannot read tensor {name!r}: {e}") from None
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device)

    def close(self) -> None:
        self._handles.clear()


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


def _read_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header without touching the tensor data.

    Checking offsets against the file size up front turns a truncated download into a clear error
    at load time instead of a crash (or garbage) deep inside the first forward.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw_len)
            if n > size - 8 or n > 100_000_000:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e}); re-download or re-save it") from None
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            count = 1
            for d in info["shape"]:
                count *= d
            itemsize = _ST_ITEMSIZE[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
        if end > data_len or end - start != count * itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} needs bytes {start}..{end} but the file holds {data_len} data bytes "
                f"(truncated or corrupt file; re-download or re-save it)"
            )
    return header


def unknown_tensors(source: TensorSource, cfg: ModelConfig) -> list[str]:
    """Names that are neither needed nor known-skippable (reported as a warning, not an error)."""
    expected = expected_tensors(cfg)
    return sorted(n for n in source.keys() if n not in expected and not n.startswith(SKIPPED_PREFIXES))


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None


def iter_with_progress(items: Iterable, total: int, enabled: bool, desc: str):
    if not enabled:
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit="tensor", leave=False)
