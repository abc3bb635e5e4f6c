"""Full-size engines in the hub's published 4-bit layouts (docs/FORMATS.md), built in memory: no checkpoint file.

  HubTensors   a published checkpoint's tensors for a config, in one layout, each made on the device when read
               (random, seeded by its name, so any order of reads gives the same values)
  hub_source   the loader's own HubSource over such tensors (quant/hub_source.py): the same planning, dequantization
               and record conversion (quant/hub_codecs.py) as `diffgemma.load(DIR)`, on the device, the file read
               skipped
  build        build_engine(cfg, hub_source(...)): layer by layer, each expert stack made, converted and dropped
               before the next, so neither host nor device holds more than one stack's published tensors
  write        the same tensors as a checkpoint directory (config.json with the layout's quantization_config and
               safetensors shards): the path a user's download takes, for the tests and bench_hub --write

Layouts (LAYOUTS), each as its library writes it (tests/data/hub/ holds tiny ones those libraries made):
  int4            compressed-tensors pack-quantized W4A16 (llmcompressor): weight_packed int32 [N, K/8],
                  weight_scale bf16 [N, K/128], weight_shape; symmetric, group 128; every decoder linear
  gptq-int4       AutoRound's GPTQ-style export: qweight int32 [K/8, N], qzeros int32 [K/128, N/8], scales f16
                  [K/128, N]; symmetric (zero 8), group 128; every decoder linear
  nvfp4           compressed-tensors nvfp4-pack-quantized with FP4 activations declared: weight_packed u8 [N, K/2],
                  weight_scale e4m3 [N, K/16], weight_global_scale and input_global_scale f32 [1]; every decoder
                  linear
  modelopt-nvfp4  ModelOpt's NVFP4 export of the experts only: weight u8 [N, K/2], weight_scale e4m3 [N, K/16],
                  weight_scale_2 and input_scale f32 []
  fp8             compressed-tensors FP8_DYNAMIC (llmcompressor): weight e4m3 [N, K], weight_scale bf16 [N, 1];
                  every decoder linear (not a 4-bit layout: the FP8 engine's, for comparison)
Routers stay bf16 (both libraries leave them out). Experts are split per expert (`experts.E.{gate,up,down}_proj`);
an expert's gate and up share its tensor scale, experts differ, as the libraries write them. Codes are uniform
random; scales make weights of std ~`std` (a uniform random e2m1 code has rms 2.93, a uniform int4 code q - 8 has
rms 16 / sqrt(12)). Tensors outside the quantized linears are bench.fixtures.RandomSource's, reseeded per name.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from bench.fixtures import RandomSource
from diffgemma.checkpoint import expected_tensors
from diffgemma.config import ModelConfig
from diffgemma.model.engine import build_engine
from diffgemma.quant.hub import scheme_of
from diffgemma.quant.hub_source import HubSource

INT4_GROUP = 128
E2M1_RMS = 2.93  # rms of a uniform random e2m1 code (bench/fixtures.py)
_CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
    "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": INT4_GROUP, "symmetric": True}}},
    "ignore": ["re:.*router.*", "lm_head"]}
_CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "format": "nvfp4-pack-quantized",
    "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                          "dynamic": "local"},
    "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}}},
    "ignore": ["re:.*router.*", "lm_head"]}
_CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
    "ignore": ["re:.*router.*", "lm_head"]}
LAYOUTS = {  # layout: (quantization_config, which linears are quantized: "all" decoder linears or "experts")
    "int4": (_CT_INT4, "all"),
    "gptq-int4": ({"quant_method": "auto-round", "bits": 4, "group_size": INT4_GROUP, "sym": True,
                   "packing_format": "auto_round:auto_gptq"}, "all"),
    "nvfp4": (_CT_NVFP4, "all"),
    "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "experts"),
    "fp8": (_CT_FP8, "all"),
}
FP8_SPREAD = 64.0  # the e4m3 values' std before the row scale
_EXPERT_PARTS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}
_LINEAR_SUFFIXES = ("_proj.weight",)


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62


def _linears(cfg: ModelConfig, which: str) -> dict[str, tuple[int, int]]:
    """{module name: (N, K)} of the quantized linears (experts split per expert), and the names they replace."""
    out = {}
    for name, shape in expected_tensors(cfg).items():
        stack = next((s for s in _EXPERT_PARTS if name.endswith(s)), None)
        if stack is not None:
            e, rows, k = shape
            parts = _EXPERT_PARTS[stack]
            for i in range(e):
                for p in parts:
                    out[f"{name[:-len(stack)]}experts.{i}.{p}"] = (rows // len(parts), k)
        elif which == "all" and name.endswith(_LINEAR_SUFFIXES) and ".router." not in name:
            out[name[:-len(".weight")]] = shape
    return out


def _tensor_specs(layout: str, n: int, k: int) -> dict[str, tuple[tuple, torch.dtype]]:
    """{suffix: (shape, dtype)} of one linear module stored in `layout`."""
    g = -(-k // INT4_GROUP)
    return {
        "int4": {"weight_packed": ((n, k // 8), torch.int32), "weight_scale": ((n, g), torch.bfloat16),
                 "weight_shape": ((2,), torch.int64)},
        "gptq-int4": {"qweight": ((k // 8, n), torch.int32), "qzeros": ((g, n // 8), torch.int32),
                      "scales": ((g, n), torch.float16)},
        "nvfp4": {"weight_packed": ((n, k // 2), torch.uint8), "weight_scale": ((n, k // 16), torch.float8_e4m3fn),
                  "weight_global_scale": ((1,), torch.float32), "input_global_scale": ((1,), torch.float32)},
        "modelopt-nvfp4": {"weight": ((n, k // 2), torch.uint8), "weight_scale": ((n, k // 16), torch.float8_e4m3fn),
                           "weight_scale_2": ((), torch.float32), "input_scale": ((), torch.float32)},
        "fp8": {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale": ((n, 1), torch.bfloat16)},
    }[layout]


class HubTensors:
    """The tensors of a `layout` checkpoint for `cfg` (module docstring), made on `device` when read: a store with
    SafetensorsSource's reading methods, for HubSource(raw=...)."""

    def __init__(self, cfg: ModelConfig, layout: str, device="cpu", seed: int = 1, std: float = 0.02):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {sorted(LAYOUTS)}")
        self.cfg, self.layout, self.device, self.seed, self.std = cfg, layout, torch.device(device), seed, std
        self.where = Path(f"random-{layout}")
        self.plain = RandomSource(cfg, device, torch.bfloat16, seed=seed, std=std)
        self.meta: dict[str, tuple[tuple, torch.dtype]] = {}
        self.module: dict[str, tuple[str, int, int]] = {}  # tensor name -> (module, N, K)
        linears = _linears(cfg, LAYOUTS[layout][1])
        replaced = {m + ".weight" for m in linears}
        for name, shape in expected_tensors(cfg).items():
            if name not in replaced and not name.endswith(tuple(_EXPERT_PARTS)):
                self.meta[name] = (tuple(shape), torch.bfloat16)
        for mod, (n, k) in linears.items():
            for suffix, spec in _tensor_specs(layout, n, k).items():
                self.meta[f"{mod}.{suffix}"] = spec
                self.module[f"{mod}.{suffix}"] = (mod, n, k)

    def keys(self) -> set[str]:
        return set(self.meta)

    def shape(self, name: str) -> tuple:
        return self.meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name][1]

    def file_of(self, name: str) -> Path:
        return self.where

    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.meta.values())

    def close(self) -> None:
        pass

    def get(self, name: str, dtype=None, device=None) -> torch.Tensor:
        shape, dt = self.meta[name]
        if name in self.module:
            t = self._quantized(name, *self.module[name])
        else:
            self.plain.gen.manual_seed(_seed(self.seed, name))
            t = self.plain.get(name, dtype=dt)
        return t.to(device=device or self.device, dtype=dtype or t.dtype)

    def _quantized(self, name: str, mod: str, n: int, k: int) -> torch.Tensor:
        suffix = name[len(mod) + 1:]
        shape, dt = self.meta[name]
        gen = torch.Generator(device=self.device).manual_seed(_seed(self.seed, name))
        dev = self.device

        def ints(lo, hi):
            return torch.randint(lo, hi, shape, generator=gen, device=dev, dtype=torch.int64)

        def jitter():  # each group's or expert's own range, as trained weights have
            return 0.75 + 0.5 * torch.rand(shape, generator=gen, device=dev)

        if self.layout == "fp8":  # e4m3 values of spread FP8_SPREAD, one bf16 scale per row
            if suffix == "weight":
                return (torch.randn(shape, generator=gen, device=dev) * FP8_SPREAD).clamp(-448, 448).to(dt)
            return (self.std / FP8_SPREAD * jitter()).to(dt)
        if suffix in ("weight_packed", "qweight") and dt == torch.int32:
            return ints(-2**31, 2**31).to(torch.int32)
        if suffix in ("weight_packed", "weight"):  # nvfp4 nibbles
            return ints(0, 256).to(torch.uint8)
        if suffix == "weight_scale" and dt == torch.float8_e4m3fn:
            return ints(0x30, 0x41).to(torch.uint8).view(torch.float8_e4m3fn)  # block scales 0.5 .. 2.0
        if suffix in ("weight_scale", "scales"):
            return (self.std * math.sqrt(12) / 16 * jitter()).to(dt)
        if suffix == "weight_shape":  # metadata: made on the host, where the loader reads it
            return torch.tensor([n, k], dtype=torch.int64)
        if suffix == "qzeros":
            return torch.full(shape, 0x77777777, dtype=torch.int32, device=dev)  # zero 7 + 1 (v1 packing): 8
        if suffix in ("input_global_scale", "input_scale"):
            return torch.ones(shape, device=dev)
        # the tensor scale: one per expert (gate and up share it), a library's global scale divides
        one = torch.Generator(device=dev).manual_seed(_seed(self.seed, mod.replace("up_proj", "gate_proj")))
        t = self.std / E2M1_RMS * (0.9 + 0.2 * torch.rand((), generator=one, device=dev))
        return (1 / t if suffix == "weight_global_scale" else t).reshape(shape).float()


class InMemoryHub(HubSource):
    """HubSource over a store that makes its tensors on the device: the engine takes each record from convert()
    there (model/engine_weights.upload_record), never through the host."""

    def record_tensor(self, name: str, device=None) -> torch.Tensor:
        return self.convert(name, device)


def hub_source(cfg: ModelConfig, layout: str, device="cpu", seed: int = 1, std: float = 0.02) -> InMemoryHub:
    """The loader's HubSource over HubTensors, converting on `device`, its scheme read from the layout's
    quantization_config by the loader's own parser (quant/hub.scheme_of)."""
    tensors = HubTensors(cfg, layout, device, seed, std)
    scheme = scheme_of(LAYOUTS[layout][0], tensors.where / "config.json")
    return InMemoryHub(tensors.where, scheme, cfg, raw=tensors, convert_device=device)


def build(cfg: ModelConfig, layout: str, device="cuda", dtype=torch.bfloat16, seed: int = 1, **kw):
    """(engine, its InMemoryHub): a fast engine on `device` whose weights are a `layout` checkpoint's, as the loader
    converts them; kw: build_engine's."""
    src = hub_source(cfg, layout, device, seed)
    return build_engine(cfg, src, device, dtype, **kw), src


def write(tensors: HubTensors, directory: Path, shard_bytes: int = 4 * 2**30) -> None:
    """Every tensor of `tensors` into safetensors shards under `directory` (a fresh one), with an index and a
    config.json holding the config's text_config and the layout's quantization_config: a checkpoint the loader
    opens."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=False)
    shard, size, index = {}, 0, {}

    def flush():
        nonlocal shard, size
        if shard:
            fname = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, str(directory / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
            shard, size = {}, 0

    for name in sorted(tensors.keys()):
        t = tensors.get(name, device="cpu").contiguous()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size > shard_bytes:
            flush()
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "diffusion_gemma", "canvas_length": tensors.cfg.canvas_length,
        "text_config": tensors.cfg.raw["text_config"],
        "quantization_config": LAYOUTS[tensors.layout][0]}))
