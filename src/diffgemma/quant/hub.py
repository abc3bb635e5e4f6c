"""Which published quantized format a checkpoint directory holds, read from its config (docs/FORMATS.md).

A checkpoint says how it was quantized in config.json's `quantization_config` (compressed-tensors, AutoRound,
GPTQ) or in ModelOpt's `hf_quant_config.json`. `detect(directory)` reads them and returns a HubScheme naming one
of the supported formats, None for an unquantized checkpoint, or raises CheckpointError with one line that names
the scheme found and lists what is supported:

  fp8            compressed-tensors `float-quantized`: e4m3 weights, channel or tensor scales (activations
                 dynamic per token)
  nvfp4          compressed-tensors `nvfp4-pack-quantized` (weight-only or with FP4 activations declared)
  modelopt-nvfp4 ModelOpt's export with quant_algo NVFP4
  int4           compressed-tensors `pack-quantized` 4-bit integer groups, symmetric or asymmetric
  gptq-int4      AutoRound's / GPTQ's `qweight` / `qzeros` / `scales` export, 4 bits, grouped
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError

SUPPORTED = ("compressed-tensors fp8 (float-quantized, channel/tensor), compressed-tensors nvfp4-pack-quantized, "
             "compressed-tensors pack-quantized int4 (group, sym/asym), ModelOpt NVFP4, AutoRound/GPTQ int4 "
             "(qweight/qzeros/scales)")
FORMATS = ("fp8", "nvfp4", "modelopt-nvfp4", "int4", "gptq-int4")


@dataclass(frozen=True)
class HubScheme:
    format: str  # one of FORMATS
    group_size: int | None = None  # int4 / gptq-int4 / nvfp4 weight groups along K
    symmetric: bool = True
    strategy: str = ""  # fp8: "channel" or "tensor"
    zero_offset: int = 0  # gptq-int4: stored zero = zero - zero_offset (1 in the original GPTQ packing)
    activations: str = "none"  # what the checkpoint declares: "fp8-dynamic-token", "fp4", "none"
    ignore: tuple = field(default=())  # module names / "re:" patterns left unquantized (informational)

    def describe(self) -> str:
        extra = {"fp8": f"e4m3 weights, {self.strategy} scales", "int4": f"group {self.group_size}, "
                 f"{'symmetric' if self.symmetric else 'asymmetric'}", "gptq-int4": f"group {self.group_size}, "
                 f"{'symmetric' if self.symmetric else 'asymmetric'}"}.get(self.format, "e2m1, e4m3 scales per 16")
        return f"{self.format} ({extra})"


def _refuse(where, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: unsupported quantization {what}; diffgemma loads {SUPPORTED}")


def refuse_file(path: Path) -> None:
    """A GGUF file, or a directory holding GGUF files and no safetensors, where a checkpoint directory is expected:
    refused, naming it."""
    if path.is_file() and (path.suffix.lower() == ".gguf" or _magic(path) == b"GGUF"):
        raise _refuse(path, "GGUF (a llama.cpp file)")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not any(path.glob("*.safetensors")):
            raise _refuse(ggufs[0], "GGUF (a llama.cpp file)")


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def detect(directory: Path) -> HubScheme | None:
    """The published quantized format of `directory`, None when it declares none (docstring above)."""
    directory = Path(directory)
    refuse_file(directory)
    cfg = _read(directory / "config.json")
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    modelopt = _read(directory / "hf_quant_config.json")
    if modelopt and not qc:
        qc = {"quant_method": "modelopt", **modelopt}
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise _refuse(directory / "config.json", f"config {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    return scheme_of(qc, directory / ("hf_quant_config.json" if method == "modelopt" and modelopt else "config.json"))


def scheme_of(qc: dict, where) -> HubScheme:
    """The HubScheme of one `quantization_config` (ModelOpt's: {"quant_method": "modelopt", ...its file}); `where`
    names the file in the refusal."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "modelopt":
        return _modelopt(qc, where)
    if method in ("auto-round", "gptq", "autoround"):
        return _gptq(qc, where, method)
    raise _refuse(where, f"quant_method {method or qc.get('quant_method')!r}")


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _compressed_tensors(qc: dict, where) -> HubScheme:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, f"compressed-tensors without config_groups (format {fmt!r})")
    if len(groups) > 1:
        raise _refuse(where, f"compressed-tensors with {len(groups)} config groups (one scheme per checkpoint)")
    g = next(iter(groups.values()))
    fmt = g.get("format") or fmt
    w = g.get("weights") or {}
    a = g.get("input_activations") or {}
    bits, typ, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    ignore = tuple(qc.get("ignore") or ())
    name = f"compressed-tensors {fmt} ({typ} {bits}-bit, {strategy})"
    if fmt == "float-quantized" and typ == "float" and bits == 8 and strategy in ("channel", "tensor"):
        if a and not (a.get("dynamic") is True and a.get("strategy") == "token" and a.get("num_bits") == 8):
            raise _refuse(where, f"{name} with {'static' if not a.get('dynamic') else a.get('strategy')} "
                                 "activation scales (only dynamic per-token FP8 activations)")
        return HubScheme("fp8", strategy=strategy, activations="fp8-dynamic-token" if a else "none", ignore=ignore)
    if fmt == "nvfp4-pack-quantized" and typ == "float" and bits == 4 and w.get("group_size") == 16:
        if not w.get("symmetric", True):
            raise _refuse(where, f"{name}, asymmetric")
        return HubScheme("nvfp4", group_size=16, activations="fp4" if a else "none", ignore=ignore)
    if fmt == "pack-quantized" and typ == "int" and bits == 4 and strategy == "group":
        if a:
            raise _refuse(where, f"{name} with quantized activations (only weight-only int4, W4A16)")
        return HubScheme("int4", group_size=int(w.get("group_size") or 0), symmetric=bool(w.get("symmetric", True)),
                         ignore=ignore)
    raise _refuse(where, name)


def _modelopt(qc: dict, where) -> HubScheme:
    q = qc.get("quantization", qc)
    algo = str(q.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise _refuse(where, f"ModelOpt quant_algo {q.get('quant_algo')!r}")
    group = int(q.get("group_size", 16) or 16)
    if group != 16:
        raise _refuse(where, f"ModelOpt NVFP4 with group_size {group} (expected 16)")
    return HubScheme("modelopt-nvfp4", group_size=16, activations="fp4",
                     ignore=tuple(q.get("exclude_modules") or ()))


def _gptq(qc: dict, where, method: str) -> HubScheme:
    bits, group = qc.get("bits"), qc.get("group_size")
    packing = str(qc.get("packing_format") or ("auto_gptq" if method == "gptq" else "auto_round:auto_gptq"))
    if bits != 4 or not isinstance(group, int) or group <= 0:
        raise _refuse(where, f"{method} {bits}-bit, group_size {group!r} (only 4-bit with a positive group size)")
    if packing not in ("auto_gptq", "auto_round:auto_gptq", "auto_round", "auto_round:gptqmodel"):
        raise _refuse(where, f"{method} packing_format {packing!r} (only the GPTQ-style qweight/qzeros/scales)")
    # The original GPTQ packing stores zero - 1 (AutoRound's "auto_round:auto_gptq", GPTQ's v1 checkpoints);
    # AutoRound's own "auto_round" packing and GPTQ's v2 checkpoints store the zero itself.
    v1 = packing in ("auto_gptq", "auto_round:auto_gptq") and qc.get("checkpoint_format") != "gptq_v2"
    if qc.get("desc_act") or qc.get("act_order"):
        raise _refuse(where, f"{method} with act-order (desc_act) group indices")
    return HubScheme("gptq-int4", group_size=group, symmetric=bool(qc.get("sym", True)), zero_offset=int(v1))
