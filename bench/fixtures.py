"""The benchmarks' (and GPU tests') random weights: checkpoint-named tensors and pack records generated directly on a
device, so the full-size model needs neither a file nor a host copy (quantizing 51 GB would take far longer than a run).

  RandomSource       random bf16 / f32 tensors under the checkpoint's names (a TensorSource)
  RandomPackSource   the same with expert stacks and the SC MLP as random pack records (q4 / q5 / q6 / nvfp4, q8)
  random_record      one random pack record
  FIXTURES           "flat" (plain random weights) and "peaked" (rows peaked the way a trained model's are)
  row_profile        median row entropy and SC survivors per row of a step's logits
  logit_profile      the same measured on an engine's first denoise steps over a prompt

The two fixtures. Random weights give flat rows: the tied embedding's rows are i.i.d. Gaussian, so every logit
h·e_v is Gaussian, and under the final softcap the top of a row stays crowded however the final norm is scaled
(262144 Gaussian logits, softcap 30, T = 0.4: at least ~100 tokens per row within the sparse SC's 10 nats of the
max; at T = 0.8 thousands). The sparse SC's gather then takes too many survivors and falls back to the dense
[rows x V] x [V x H] product, a cost a trained model does not pay. "peaked" scales PEAK_TOKENS rows of the embedding
(ids past PEAK_FIRST_ID: no special token) so that their logits have a spread of PEAK_LOGIT_STD (the others' is
std · sqrt(hidden), ~1 at full size; the final norm's weights are ~1): they stand out of the crowd and each row's top
is a few of them, as a trained model's row has a few likely tokens (simulated at full size: median entropy ~0.8 /
~0.3 nats and ~17 / ~5 survivors a row at T = 0.8 / 0.4). The benches measure the real rows with logit_profile.
"""

from __future__ import annotations

import math

import torch

from diffgemma.checkpoint import expected_tensors
from diffgemma.config import ModelConfig
from diffgemma.model.engine_weights import DictSource
from diffgemma.ops.moe_packed import PackedWeight
from diffgemma.quant import codecs


FIXTURES = ("flat", "peaked")
PEAK_TOKENS = 256
PEAK_LOGIT_STD = 8.5  # the peak tokens' logit spread: 8x the flat logits' at full size (0.02 · sqrt(2816) = 1.06)
PEAK_FIRST_ID = 1024
EMBEDDING = "model.decoder.embed_tokens.weight"


def peak_ids(vocab: int, seed: int) -> torch.Tensor:
    """The "peaked" fixture's PEAK_TOKENS ids: distinct, drawn from PEAK_FIRST_ID .. vocab - 1 (from a quarter of the
    vocabulary up when it is small), the same for a seed."""
    first = min(PEAK_FIRST_ID, vocab // 4)
    n = min(PEAK_TOKENS, (vocab - first) // 4)
    gen = torch.Generator().manual_seed(seed)
    return first + torch.randperm(vocab - first, generator=gen)[:n]


def peak_scale(hidden: int, std: float) -> float:
    """The factor that gives embedding rows of `std` entries logits of spread PEAK_LOGIT_STD against a final hidden
    state of rms ~1 (std · sqrt(hidden) before)."""
    return PEAK_LOGIT_STD / (std * math.sqrt(hidden))


def peak_embedding(table: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    """The embedding with its peak_ids rows scaled by `scale` (in place; returned)."""
    ids = peak_ids(table.shape[0], seed).to(table.device)
    table[ids] = (table[ids].float() * scale).to(table.dtype)
    return table


class RandomSource(DictSource):
    """Checkpoint-named random weights generated lazily on `device` (each tensor on first `get`), so the
    full-size model never needs a host copy. Scales keep activations O(1): std 0.02 linears, norm
    weights near 1 (QK-norm near head_dim^-1/4), layer scalars near 1. fixture: "flat" (those weights), or "peaked"
    (the embedding's peak_ids rows scaled up: see the module docstring)."""

    def __init__(self, cfg: ModelConfig, device, dtype=torch.bfloat16, seed=0, std=0.02, fixture="flat"):
        if fixture not in FIXTURES:
            raise ValueError(f"fixture {fixture!r}: expected one of {FIXTURES}")
        self.shapes = expected_tensors(cfg)
        self.device, self.dt, self.std, self.fixture, self.seed = device, dtype, std, fixture, seed
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        super().__init__({})

    def keys(self):
        return set(self.shapes)

    def shape(self, name):
        return self.shapes[name]

    def get(self, name, dtype=None, device=None):
        shape = self.shapes[name]
        dt = dtype or self.dt
        if name.endswith("layer_scalar") or name.endswith("per_expert_scale") or name.endswith("router.scale"):
            t = 1.0 + 0.1 * torch.rand(shape, generator=self.gen, device=self.device)
        elif len(shape) == 1:  # norm weights
            t = 1.0 + 0.2 * torch.randn(shape, generator=self.gen, device=self.device)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # Trained QK-norm weights carry the attention temperature (there is no 1/sqrt(d));
                # weights near 1 would make q·k ~ head_dim and attention a chaotic hard max.
                t = t * shape[0] ** -0.25
        else:  # in the model's dtype, as a checkpoint stores them (the router's too, though it is read as f32)
            t = torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dt) * self.std
            if name == EMBEDDING and self.fixture == "peaked":
                t = peak_embedding(t, self.seed, peak_scale(shape[1], self.std))
        return t.to(device=device or self.device, dtype=dt)


def random_record(fmt: str, shape, device, gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """A random pack record generated directly on `device` (no encoder pass): uniform random codes and
    per-group scales / mins chosen so the decoded weights have mean ~0 and std ~`std`. For the benchmark
    at the real size (quantizing 51 GB would take far longer than the run) and the GPU tests."""
    shape = tuple(shape)
    rec = torch.zeros(codecs.record_nbytes(fmt, shape), dtype=torch.uint8, device=device)
    view = {p.name: rec[p.offset:p.offset + p.nbytes].view(p.rows, p.row_bytes) for p in codecs.planes(fmt, shape)}

    def rand_bytes(v, lo=0, hi=256):
        v.copy_(torch.randint(lo, hi, v.shape, generator=gen, device=device, dtype=torch.int32).to(torch.uint8))

    def jitter(v):  # per-group spread of the ranges, as trained weights have
        return v * (0.75 + 0.5 * torch.rand(v.shape, generator=gen, device=device))

    for name in ("codes", "lo", "hi"):
        if name in view and fmt != "q8":
            rand_bytes(view[name])
    if fmt in ("q4", "q5", "q6"):
        levels = {"q4": 16, "q5": 32, "q6": 64}[fmt]
        s = jitter(torch.full(view["scale"].view(torch.float16).shape, std * math.sqrt(12) / levels, device=device))
        view["scale"].view(torch.float16).copy_(s)
        view["min"].view(torch.float16).copy_(-s * (levels - 1) / 2)
    elif fmt == "q8":
        view["codes"].view(torch.int8).copy_(torch.randint(-127, 128, view["codes"].shape, generator=gen, device=device,
                                                           dtype=torch.int32).to(torch.int8))
        view["scale"].view(torch.float32).copy_(jitter(torch.full(view["scale"].view(torch.float32).shape, std / 73.3,
                                                                  device=device)))
    elif fmt == "nvfp4":
        rand_bytes(view["scale"], 0x30, 0x41)  # e4m3 block scales 0.5 .. 2.0
        view["tscale"].view(torch.float32).fill_(std / 2.93)  # rms of a uniform random e2m1 code: 2.93
    else:
        raise ValueError(f"no random records for format {fmt!r}")
    return rec


class RandomPackSource(RandomSource):
    """RandomSource whose expert stacks come as random `experts` records and the SC MLP as random `sc`
    records, generated on the device: the fast engine keeps them packed. `get` on a packed name returns
    its dequantized values (so a reference model can be built from the same source). cache=True keeps
    every tensor it hands out, so two consumers see the same weights."""

    def __init__(self, cfg: ModelConfig, device, dtype=torch.bfloat16, seed=0, std=0.02, experts="q4", sc="q8",
                 cache=False, fixture="flat"):
        super().__init__(cfg, device, dtype, seed=seed, std=std, fixture=fixture)
        self.experts_fmt, self.sc_fmt, self.cache = experts, sc, cache
        self._records: dict = {}
        self._raw: dict = {}

    def kind(self, name) -> str:
        if ".experts." in name:
            return self.experts_fmt
        if ".self_conditioning." in name and "norm" not in name:
            return self.sc_fmt
        return "raw"

    def record_tensor(self, name, device=None):
        rec = self._records.get(name)
        if rec is None:
            rec = random_record(self.kind(name), self.shapes[name], self.device, self.gen, self.std)
            if self.cache:
                self._records[name] = rec
        return rec if device is None else rec.to(device)

    def record_nbytes(self, name) -> int:
        kind = self.kind(name)  # raw tensors: bf16 in the checkpoint, stored verbatim
        return math.prod(self.shapes[name]) * 2 if kind == "raw" else codecs.record_nbytes(kind, self.shapes[name])

    def get(self, name, dtype=None, device=None):
        if self.kind(name) != "raw":
            pw = PackedWeight.from_record(self.kind(name), self.shapes[name], self.record_tensor(name))
            return pw.dequantize(dtype or self.dt).to(device or self.device)
        if not self.cache:
            return super().get(name, dtype, device)
        if name not in self._raw:
            self._raw[name] = super().get(name, torch.float32)
        return self._raw[name].to(device=device or self.device, dtype=dtype or self.dt)


def row_profile(logits: torch.Tensor, temp: float, log_ratio: float = 10.0, cap: float | None = None) -> dict:
    """Of [R, V] logits (raw ones with cap: softcapped first) at temperature `temp`: the median row entropy (nats)
    and the SC survivors per row (tokens within log_ratio nats of the row's max: sampling/self_condition.py), median
    and mean, through the sampler's own StepStats and survivor rule."""
    from diffgemma.sampling.self_condition import survivors
    from diffgemma.sampling.stats import StepStats

    stats = StepStats(logits, temp, fused=False, cap=cap)
    kept = survivors(stats.processed, log_ratio).sum(-1).double()
    return {"temp": round(float(temp), 4), "median_entropy": round(float(stats.entropy.double().median()), 4),
            "survivors_median": float(kept.median()), "survivors_mean": round(float(kept.mean()), 2)}


def logit_profile(eng, cfg, ctx: int = 1024, seed: int = 0, temps=(0.8, 0.4), log_ratio: float = 10.0) -> dict:
    """row_profile of an engine's denoise over a random `ctx`-token prompt: "first" on a random canvas, "second" on
    the first step's argmax canvas self-conditioned on its tempered logits (the rows a converging canvas has), at
    each of `temps` (the schedule's ends)."""
    dev, V, C = eng.device, cfg.vocab_size, cfg.canvas_length
    gen = torch.Generator().manual_seed(seed)
    cache = eng.new_cache(ctx + 2 * C)
    eng.prefill(cache, torch.randint(0, V, (ctx,), generator=gen).to(dev))
    canvas = torch.randint(0, V, (C,), generator=gen).to(dev)
    first = eng.denoise(cache, canvas).float()
    second = eng.denoise(cache, first.argmax(-1), sc_logits=first / temps[0]).float()
    return {name: [row_profile(x, t, log_ratio) for t in temps] for name, x in (("first", first), ("second", second))}
