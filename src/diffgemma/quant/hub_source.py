"""HubSource: the loader's TensorSource over a published quantized checkpoint (docs/FORMATS.md).

It presents the names and shapes of the bf16 checkpoint (checkpoint.expected_tensors), so the loader validates and
pulls tensors as from any other source:

  get(name)        the weight dequantized to float32 (hub_codecs: exactly; NVFP4 bit for bit as its library does), then
                   cast: what the reference path runs on and what the fast engine receives for any tensor it does not
                   keep quantized
  kind(name)       for expert stacks whose format the engine's 4-bit kernels hold: "nvfp4e" or "q4"; else "raw"
  record(name)     that stack's codecs record, converted at load from the published bytes (never through bf16)
  convert(name)    the same record as a uint8 tensor, made on `convert_device`
  fp8_weight(name) an FP8 tensor as ops.fp8_weight.Fp8Weight (e4m3 values + f32 per-row scales), for the FP8 engine

The published tensors come from the checkpoint's safetensors files, or from any store with the same names, shapes
and dtypes (`raw`: keys / shape / dtype / get / file_of / nbytes / close), e.g. one that makes them in memory;
`convert_device` is where they are read to, dequantized and converted (the host unless given).

Per-expert checkpoints (`layers.L.experts.E.{gate,up,down}_proj`, as llmcompressor writes them) are stacked to the
fused [E, 2F, H] / [E, H, F] tensors, gate rows before up rows; a fused FP8 form (`experts.gate_up_proj` in e4m3
with `experts.gate_up_proj_scale`) is read as it is. Only decoder names are read: the encoder's copies of the
shared weights, which some writers keep, are ignored.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from ..checkpoint import SafetensorsSource, expected_tensors
from ..errors import CheckpointError, TensorError
from ..ops.fp8_weight import Fp8Weight
from . import hub_codecs as hc
from .hub import HubScheme
from .policy import tensor_class

_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")
_VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
FP8 = "fp8"  # the kind of a tensor fp8_weight() hands out (the FP8 engine's, model/engine_weights.py)
_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class _Aliased:
    """The checkpoint's tensors, where a decoder name that is absent answers with the encoder's copy of the same
    shared weight (`model.encoder.language_model.X` for `model.decoder.X`): some writers store a tied weight once,
    under the encoder's name."""

    _ENC, _DEC = "model.encoder.language_model.", "model.decoder."

    def __init__(self, source: SafetensorsSource):
        self.source = source
        have = source.keys()
        self.alias = {self._DEC + k[len(self._ENC):]: k for k in have
                      if k.startswith(self._ENC) and self._DEC + k[len(self._ENC):] not in have}

    def keys(self) -> set[str]:
        return self.source.keys() | set(self.alias)

    def _k(self, name: str) -> str:
        return self.alias.get(name, name)

    def shape(self, name):
        return self.source.shape(self._k(name))

    def dtype(self, name):
        return self.source.dtype(self._k(name))

    def file_of(self, name):
        return self.source.file_of(self._k(name))

    def get(self, name, dtype=None, device="cpu"):
        return self.source.get(self._k(name), dtype=dtype, device=device)

    def nbytes(self):
        return self.source.nbytes()

    def close(self):
        self.source.close()


def fp8_weight(source, name: str, device="cpu") -> Fp8Weight | None:
    """The FP8 form of `name` when `source` holds it in FP8 (a HubSource of an fp8 checkpoint), else None: the
    one entry point the fast engine's FP8 path asks."""
    get = getattr(source, "fp8_weight", None)
    return get(name, device) if get is not None else None


class HubSource:
    def __init__(self, directory, scheme: HubScheme, cfg, raw=None, convert_device="cpu"):
        self.path = Path(directory)
        self.scheme = scheme
        self.raw = _Aliased(SafetensorsSource(self.path) if raw is None else raw)
        self.convert_device = torch.device(convert_device)
        self._raw_keys = self.raw.keys()
        self._expected = expected_tensors(cfg)
        self._plans: dict[str, tuple] = {}
        for name in self._expected:
            plan = self._plan(name)
            if plan is not None:
                self._plans[name] = plan
        self.notes: list[str] = []
        self._records: dict[str, memoryview] = {}

    # ------------------------------------------------------------------------------ planning
    def _plan(self, name: str):
        """('raw', name) | ('linear', module) | ('stack', [[module, ...] per expert]) | ('fp8-fused', name)."""
        m = _EXPERTS.match(name)
        if m:
            if name in self._raw_keys:
                return ("fp8-fused", name) if self.raw.dtype(name) == torch.float8_e4m3fn else ("raw", name)
            experts = self._expected[name][0]
            mods = [[f"{m.group(1)}.{e}.{p}" for p in _PARTS[m.group(2)]] for e in range(experts)]
            if all(self._module_kind(mod) for row in mods for mod in row):
                return ("stack", mods)
            return None
        if name in self._raw_keys and self.raw.dtype(name).is_floating_point and self.raw.dtype(name).itemsize > 1:
            return ("raw", name)
        if name.endswith(".weight") and self._module_kind(name[:-len(".weight")]):
            return ("linear", name[:-len(".weight")])
        return ("raw", name) if name in self._raw_keys else None

    def _module_kind(self, mod: str) -> str | None:
        """Which stored layout a linear module uses, from the tensor names present."""
        has = lambda suffix: f"{mod}.{suffix}" in self._raw_keys  # noqa: E731
        if has("qweight") and has("scales"):
            return "gptq"
        if has("weight_packed"):
            return "ct-int4" if self.raw.dtype(f"{mod}.weight_packed") == torch.int32 else "ct-nvfp4"
        if has("weight") and has("weight_scale_2"):
            return "mo-nvfp4"
        if has("weight") and self.raw.dtype(f"{mod}.weight") == torch.float8_e4m3fn and has("weight_scale"):
            return "fp8"
        if has("weight") and self.raw.dtype(f"{mod}.weight").is_floating_point:
            return "raw"
        return None

    # ------------------------------------------------------------------------------ TensorSource
    @property
    def directory(self) -> Path:
        return self.path

    def keys(self) -> set[str]:
        """The text forward's names this checkpoint can give, and its unquantized vision tensors as stored."""
        return set(self._plans) | {k for k in self._raw_keys if k.startswith(_VISION)}

    def nbytes(self) -> int:
        return self.raw.nbytes()

    def shard_of(self, name: str) -> Path:
        """The file holding (the first part of) `name`. Not `file_of`: the parallel loader reads a `file_of` source's
        expert stacks as slices of one stored tensor, which a split checkpoint does not have."""
        plan = self._plans[name]
        first = plan[1] if plan[0] in ("raw", "fp8-fused") else (plan[1] if plan[0] == "linear" else plan[1][0][0])
        key = first if first in self._raw_keys else next(k for k in self._raw_keys if k.startswith(first + "."))
        return self.raw.file_of(key)

    def shape(self, name: str) -> tuple[int, ...]:
        kind, what = self._plan_of(name)
        if kind in ("raw", "fp8-fused"):
            return tuple(self.raw.shape(what))
        if kind == "linear":
            return self._linear_shape(what)
        rows = [sum(self._linear_shape(m)[0] for m in row) for row in what]
        ks = {self._linear_shape(m)[1] for row in what for m in row}
        if len(set(rows)) != 1 or len(ks) != 1:
            raise TensorError(f"{self.path}: the experts of {name!r} differ in shape")
        return (len(what), rows[0], ks.pop())

    def dtype(self, name: str) -> torch.dtype:
        kind, what = self._plan_of(name)
        return self.raw.dtype(what) if kind == "raw" else torch.float32

    def kind(self, name: str) -> str:
        """'nvfp4e' / 'q4' for expert stacks the engine's 4-bit kernels hold (record() converts), 'fp8' for a tensor
        fp8_weight() hands out, else 'raw'."""
        kind, what = self._plan_of(name)
        if self._is_fp8(kind, what):
            return FP8
        if kind != "stack":
            return "raw"
        fmt = self._module_kind(what[0][0])
        if fmt in ("ct-nvfp4", "mo-nvfp4"):
            return "nvfp4e"
        if fmt in ("ct-int4", "gptq") and self.scheme.group_size % 32 == 0 and self.shape(name)[-1] % 32 == 0:
            return "q4"
        return "raw"

    def get(self, name: str, dtype: torch.dtype | None = None, device="cpu") -> torch.Tensor:
        kind, what = self._plan_of(name)
        if kind == "raw":
            return self.raw.get(what, dtype=dtype, device=device)
        if kind == "fp8-fused":
            t = self.fp8_weight(name).dequantize()
        elif kind == "linear":
            t = self._dequant(what)
        else:
            t = torch.stack([torch.cat([self._dequant(m) for m in row]) for row in what])
        return t.to(dtype or torch.float32).to(device)

    def record(self, name: str) -> memoryview:
        if name not in self._records:
            self._records[name] = memoryview(self.convert(name).cpu().numpy())
        return self._records.pop(name)

    def close(self) -> None:
        self.raw.close()

    def _plan_of(self, name):
        try:
            return self._plans[name]
        except KeyError:
            if name.startswith(_VISION) and name in self._raw_keys:
                return ("raw", name)
            raise TensorError(f"{self.path}: checkpoint has no tensor {name!r}") from None

    # ------------------------------------------------------------------------------ one linear
    def _t(self, mod: str, suffix: str) -> torch.Tensor:
        return self.raw.get(f"{mod}.{suffix}", device=self.convert_device)

    def _linear_shape(self, mod: str) -> tuple[int, int]:
        kind = self._module_kind(mod)
        if kind in ("raw", "fp8"):
            return tuple(self.raw.shape(f"{mod}.weight"))
        if kind == "ct-int4":
            return tuple(int(v) for v in self.raw.get(f"{mod}.weight_shape").tolist())
        if kind == "gptq":
            kw, n = self.raw.shape(f"{mod}.qweight")
            return (n, kw * 8)
        n, half = self.raw.shape(f"{mod}.{'weight_packed' if kind == 'ct-nvfp4' else 'weight'}")
        return (n, half * 2)

    def _int4(self, mod: str):
        """(codes, scale, zero) of an int4 linear, w = (code - zero) · scale (hub_codecs)."""
        g = self.scheme.group_size
        if self._module_kind(mod) == "ct-int4":
            zp = f"{mod}.weight_zero_point"
            return hc.ct_int4_codes(self._t(mod, "weight_packed"), self._t(mod, "weight_scale"),
                                    self._t(mod, "weight_zero_point") if zp in self._raw_keys else None,
                                    self._linear_shape(mod), g)
        return hc.gptq_int4_codes(self._t(mod, "qweight"), self._t(mod, "qzeros"), self._t(mod, "scales"), g,
                                  zero_offset=self.scheme.zero_offset)

    def _nvfp4(self, mod: str):
        """(packed nibbles, e4m3 block scales as uint8, mul, div) of an nvfp4 linear: w = e2m1 · fl(fl(s · mul) / div),
        compressed-tensors' global scale a divisor, ModelOpt's weight_scale_2 a multiplier (hub_codecs), as f32."""
        if self._module_kind(mod) == "ct-nvfp4":
            gs = float(self._t(mod, "weight_global_scale").float().reshape(-1)[0])
            return self._t(mod, "weight_packed"), hc.as_uint8(self._t(mod, "weight_scale")), 1.0, gs
        t = float(self._t(mod, "weight_scale_2").float().reshape(-1)[0])
        return self._t(mod, "weight"), hc.as_uint8(self._t(mod, "weight_scale")), t, 1.0

    def _dequant(self, mod: str) -> torch.Tensor:
        kind = self._module_kind(mod)
        try:
            if kind == "raw":
                return self._t(mod, "weight").float()
            if kind == "fp8":
                return hc.dequant_fp8(self._t(mod, "weight"), self._t(mod, "weight_scale"))
            if kind in ("ct-int4", "gptq"):
                return hc.dequant_int4(*self._int4(mod), self.scheme.group_size)
            return hc.dequant_nvfp4(*self._nvfp4(mod))
        except TensorError as e:
            raise TensorError(f"{self.raw.file_of(next(k for k in self._raw_keys if k.startswith(mod + '.')))}: "
                              f"{mod}: {e}") from None

    # ------------------------------------------------------------------------------ engine forms
    def _is_fp8(self, kind: str, what) -> bool:
        if kind == "fp8-fused":
            return True
        if kind == "linear":
            return self._module_kind(what) == "fp8"
        return kind == "stack" and all(self._module_kind(m) == "fp8" for row in what for m in row)

    def fp8_weight(self, name: str, device="cpu") -> Fp8Weight | None:
        """`name` as an Fp8Weight ([N, K] or a stacked [E, N, K]) when every part of it is FP8, else None."""
        kind, what = self._plan_of(name)
        if kind == "fp8-fused":
            w = self.raw.get(what)
            scale = self._fused_scale(what, w.shape)
            return Fp8Weight(w, scale).to(device)
        if kind == "linear" and self._module_kind(what) == "fp8":
            w = self._t(what, "weight")
            return Fp8Weight(w, hc.fp8_row_scales(self._t(what, "weight_scale"), w.shape[0])).to(device)
        if kind == "stack" and all(self._module_kind(m) == "fp8" for row in what for m in row):
            ws = [[self._t(m, "weight") for m in row] for row in what]
            ss = [[hc.fp8_row_scales(self._t(m, "weight_scale"), w.shape[0]) for m, w in zip(row, wr)]
                  for row, wr in zip(what, ws)]
            return Fp8Weight(torch.stack([torch.cat(r) for r in ws]), torch.stack([torch.cat(r) for r in ss])).to(device)
        return None

    def _fused_scale(self, name: str, shape) -> torch.Tensor:
        """The float32 [E, N] row scales of a fused FP8 expert stack: stored per row ([E, N] / [E, N, 1]), per expert,
        per tensor, or as llmcompressor's repacked gate ‖ up pair ([E, N/2, 2]: gate's scales then up's)."""
        e, n = shape[0], shape[1]
        for key in (name + "_scale", name + ".weight_scale", name + "_weight_scale"):
            if key not in self._raw_keys:
                continue
            s = self.raw.get(key).float()
            if s.dim() == 3 and tuple(s.shape) == (e, n // 2, 2) and name.endswith("gate_up_proj"):
                return torch.cat([s[..., 0], s[..., 1]], 1).contiguous()
            if s.numel() == e * n and (s.dim() < 3 or s.shape[-1] == 1):
                return s.reshape(e, n).contiguous()
            if s.numel() in (1, e):
                return s.reshape(-1, 1).expand(e, n).contiguous()
            raise TensorError(f"{self.raw.file_of(key)}: {key} has shape {list(s.shape)}; expected one scale per row "
                              f"([{e}, {n}]), per expert or per tensor")
        raise TensorError(f"{self.raw.file_of(name)}: fp8 tensor {name!r} has no {name}_scale beside it")

    def convert(self, name: str, device=None) -> torch.Tensor:
        """The codecs record of expert stack `name` (kind() "nvfp4e" / "q4"), converted on `convert_device` from the
        published tensors, as a uint8 tensor on `device` (default: where it was made)."""
        kind, what = self._plan_of(name)
        fmt = self.kind(name)
        note = hc.Inexact()
        mods = [m for row in what for m in row]
        if fmt == "nvfp4e":
            rec = hc.nvfp4e_record([[self._nvfp4(m) for m in row] for row in what], self.shape(name), note)
        elif fmt == "q4":
            rec = hc.q4_record([self._int4(m) for m in mods], self.shape(name), self.scheme.group_size, note)
        else:
            raise CheckpointError(f"{self.path}: {name!r} has no packed form for the engine")
        if not self.notes:
            self.notes.append(f"diffgemma: {self.path.name}: converting the expert stacks to the engine's {fmt} "
                              "records at load (docs/FORMATS.md)")
            print(self.notes[-1], file=sys.stderr)
        if note.count:
            msg = (f"diffgemma: {self.path.name}: {name}: {note.count} of {note.total} scale values rounded when "
                   f"converting to the engine's {fmt} record (largest change {note.worst:.3g}); docs/FORMATS.md")
            self.notes.append(msg)
            print(msg, file=sys.stderr)
        return rec if device is None else rec.to(device)

    # ------------------------------------------------------------------------------ describing
    def formats(self) -> dict[str, str]:
        """{tensor class: stored format} over the tensors the forward reads (for `ask --stats`)."""
        out: dict[str, set] = {}
        for name, (kind, what) in self._plans.items():
            cls = tensor_class(name)
            if cls is None:
                continue
            cls = "experts" if cls.startswith("experts") else cls
            if kind == "stack":
                fmt = self._module_kind(what[0][0])
            elif kind == "linear":
                fmt = self._module_kind(what)
            else:
                fmt = "fp8" if kind == "fp8-fused" else str(self.raw.dtype(what)).replace("torch.", "")
            out.setdefault(cls, set()).add(fmt)
        return {cls: "/".join(sorted(v)) for cls, v in out.items()}


def describe_formats(source, model, dtype: torch.dtype) -> str:
    """'class=stored->held, ...' for `ask --stats`: each weight class's stored format and what the loaded model holds
    (the fast engine's weights as built: an nvfp4 / q4 / q8 record, fp8, or a dtype; the reference: `dtype`)."""
    stored = source.formats() if hasattr(source, "formats") else {}
    kinds: dict[str, set] = {}
    for name in source.keys():
        cls = tensor_class(name)
        if cls is not None and not cls.startswith("vision"):
            kinds.setdefault("experts" if cls.startswith("experts") else cls, set()).add(
                source.kind(name) if hasattr(source, "kind") else "raw")
    w = getattr(model, "w", None)
    held = {}
    if w is not None and getattr(w, "layers", None):
        layer = w.layers[0]
        held = {"experts": layer.experts_gu, "attn": layer.o, "dense": layer.mlp_down, "sc": w.sc_down}
    out = []
    for cls in sorted(kinds):
        t = held.get(cls)
        if t is None:
            runs = str(dtype)
        elif getattr(t, "fmt", None):
            runs = t.fmt
        else:
            runs = str(getattr(t, "weight", t).dtype)
        runs = FP8 if "float8" in runs else runs.replace("torch.", "")
        out.append(f"{cls}={stored.get(cls) or '/'.join(sorted(kinds[cls]))}->{runs}")
    return ", ".join(out)


def open_hub(directory, scheme: HubScheme) -> HubSource:
    """The loader's entry point (diffgemma.loader.open_source): a HubSource, with one line on stderr saying what
    the checkpoint holds."""
    from ..config import ModelConfig

    src = HubSource(directory, scheme, ModelConfig.from_file(Path(directory) / "config.json"))
    print(f"diffgemma: {Path(directory).name}: {scheme.describe()} checkpoint; formats: "
          + ", ".join(f"{c}={f}" for c, f in sorted(src.formats().items())), file=sys.stderr)
    return src
