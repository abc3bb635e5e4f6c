"""The fast engine's weights: read from a TensorSource, fused and cast once at load.

Layout choices (all lossless reshuffles of the checkpoint tensors):
  qkv        [ (heads + kv + kv) · hd, H ]  q ‖ k ‖ v rows stacked, one GEMM per layer. Full-attention
             layers have no v_proj (V is the raw k_proj output), so their block is q ‖ k only.
  mlp_gu     [2·F, H]  dense gate ‖ up, one GEMM.
  router_w   [E, H] and router_in_scale = router.scale · H^-0.5 (f32): routing is control flow, so its
             logits are computed in f32 (docs/ARCHITECTURE.md, 'Precision'). On CUDA also router_pieces, the same
             weight as exact bf16 parts for the bf16x3 router GEMM (ops/route.py); a bf16 router (every
             checkpoint's) is then one part, and router_w is that part (its users read it as f32), else f32.
  layer scalars are plain floats (read once; they are baked into the CUDA graph).
Norm weights stay in the activation dtype; experts stay [E, 2F, H] / [E, H, F] as stored.

Packs (quant/): a source that says a tensor's `kind` is quantized hands out its record bytes. Expert
stacks in q4 / q5 / q6 / nvfp4 and the SC MLP in q8 then stay packed on the device
(ops.packed_weight.PackedWeight): each record is copied from the memory-mapped blob straight to the
device, no bf16 copy is made, and the GEMMs dequantize on the fly. The SC gate and up records are
concatenated row-wise (q8 is per-row, so that is lossless). Any other quantized tensor is
dequantized once at load to `dtype`, as before.

FP8 (ops/fp8_weight.Fp8Weight): a source whose `kind(name)` is "fp8" hands that tensor out as an Fp8Weight through
`fp8_weight(name, device)` (e4m3 values and float32 per-row scales, expert stacks fused [E, N, K] under the bf16
checkpoint's names), and its dequantized values through `get`. The attention projections, the dense MLP and the
expert stacks then stay FP8 on the device and run on the FP8 GEMMs (model/forward.py); q ‖ k ‖ v and gate ‖ up are
stacked values with values and scales with scales (per-row scales, so that is lossless) where every part is FP8,
else made of the dequantized parts. Fp8QuantizedSource makes such a source of any other one (tests, benchmarks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..checkpoint import DECODER, ENCODER_LAYERS
from ..config import ModelConfig
from ..ops import q4_tiles
from ..ops.fp8_weight import Fp8Weight, has_fp8_mma, has_scaled_grouped_mm, quantize_fp8
from ..ops.packed_weight import EXPERT_FORMATS, PackedWeight
from ..ops.route import router_pieces

_NORMS = {
    "input_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "pre_ff_norm": "pre_feedforward_layernorm",
    "post_ff_norm": "post_feedforward_layernorm",
    "post_ff1_norm": "post_feedforward_layernorm_1",
    "pre_ff2_norm": "pre_feedforward_layernorm_2",
    "post_ff2_norm": "post_feedforward_layernorm_2",
}


@dataclass
class LayerWeights:
    qkv: torch.Tensor | Fp8Weight
    o: torch.Tensor | Fp8Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    inv_freq: torch.Tensor  # f32 [hd/2]; zeros past the rotated prefix (proportional RoPE)
    qkv_norm: torch.Tensor  # f32 [3, hd]: q_norm ‖ k_norm ‖ ones (V's no-scale norm), for ops.qkv
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    pre_ff_norm: torch.Tensor
    post_ff_norm: torch.Tensor
    post_ff1_norm: torch.Tensor
    pre_ff2_norm: torch.Tensor
    post_ff2_norm: torch.Tensor
    mlp_gu: torch.Tensor | Fp8Weight
    mlp_down: torch.Tensor | Fp8Weight
    router_w: torch.Tensor
    router_in_scale: torch.Tensor
    per_expert_scale: torch.Tensor
    experts_gu: torch.Tensor | PackedWeight | Fp8Weight
    experts_down: torch.Tensor | PackedWeight | Fp8Weight
    denoise_scalar: float
    prefill_scalar: float
    router_pieces: torch.Tensor | None = None  # bf16 [1 or 3, E, H] summing to router_w exactly (CUDA only)


@dataclass
class EngineWeights:
    embed: torch.Tensor  # [V, H], also the tied lm_head
    final_norm: torch.Tensor
    sc_pre_norm: torch.Tensor
    sc_gu: torch.Tensor | PackedWeight
    sc_down: torch.Tensor | PackedWeight
    layers: list
    lm_head: Fp8Weight | None = None  # a checkpoint's own FP8 lm_head; None: the tied embedding


def inv_freq_for(layer) -> torch.Tensor:
    """RoPE inverse frequencies, [head_dim/2] f32, transformers' default / proportional conventions."""
    hd, rope = layer.head_dim, layer.rope
    if rope.rope_type == "proportional":
        angles = int(rope.partial_rotary_factor * hd // 2)
        f = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / hd))
        f = torch.cat([f, torch.zeros(hd // 2 - angles)])
        return f / rope.factor
    return 1.0 / (rope.theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))


def tensor_kind(source, name) -> str:
    """'raw' for plain tensors, else the pack codec of `name` (sources without `kind` are all raw)."""
    kind = getattr(source, "kind", None)
    return kind(name) if kind is not None else "raw"


def upload_record(source, name, device) -> torch.Tensor:
    """A quantized tensor's record bytes as a uint8 tensor on `device`, copied from the source's mapping
    (a source may generate them on the device itself: `record_tensor`, e.g. the benchmark's)."""
    device = torch.device(device)
    make = getattr(source, "record_tensor", None)
    if make is not None:
        return make(name, device)
    mv = source.record(name)
    with warnings.catch_warnings():  # a read-only mmap view; the copy below is what we keep
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)
    return host.clone() if device.type == "cpu" else host.to(device)


def _packed(source, name, device) -> PackedWeight:
    fmt, shape = tensor_kind(source, name), source.shape(name)
    # gate ‖ up: a tile layout takes the glu row order, so the GEMM makes gelu·up in its epilogue; nvfp4e stacks are
    # re-laid by from_record (ops/packed_weight.py's nvfp4-tiles)
    glu = name.endswith("gate_up_proj")
    pw = PackedWeight.from_record(fmt, shape, upload_record(source, name, device), glu=glu)
    if q4_tiles.wanted(fmt, shape, device):  # q4 expert stacks in the streaming kernel's byte order (ops/q4_tiles.py)
        pw = q4_tiles.to_tile_layout(pw, glu=glu)
    return pw


FP8 = "fp8"  # the `kind` of a tensor a source hands out as an Fp8Weight
LM_HEAD = "lm_head.weight"  # held (as an Fp8Weight) only where a checkpoint has it in FP8; else tied to the embedding


def fused_linear(source, names, device, get):
    """The named [N_i, K] weights stacked row-wise: an Fp8Weight where the source has every part in FP8, else the
    plain parts (`get`) concatenated (a single name: that tensor itself)."""
    if all(tensor_kind(source, n) == FP8 for n in names):
        parts = [source.fp8_weight(n, device) for n in names]
        if len(parts) == 1:
            return parts[0]
        return Fp8Weight(torch.cat([p.weight for p in parts], 0), torch.cat([p.scale for p in parts], 0))
    return torch.cat([get(n) for n in names], 0) if len(names) > 1 else get(names[0])


def load_weights(cfg: ModelConfig, source, device, dtype) -> EngineWeights:
    def get(name, dt=dtype):
        return source.get(name, dtype=dt, device=device)

    def expert(name):
        kind = tensor_kind(source, name)
        if kind == FP8:
            return source.fp8_weight(name, device)
        return _packed(source, name, device) if kind in EXPERT_FORMATS else get(name)

    d = DECODER
    sc = [d + f"self_conditioning.{n}_proj.weight" for n in ("gate", "up", "down")]
    if all(tensor_kind(source, n) == "q8" for n in sc):
        g, u = (_packed(source, n, device) for n in sc[:2])
        sc_gu = PackedWeight.from_record("q8", (g.shape[0] + u.shape[0], g.shape[1]), _cat_q8(g, u))
        sc_down = _packed(source, sc[2], device)
        del g, u
    else:
        sc_gu, sc_down = torch.cat([get(sc[0]), get(sc[1])], 0), get(sc[2])

    layers = []
    for layer in cfg.layers:
        p = f"{d}layers.{layer.index}."
        qkv_names = ("q", "k", "v") if layer.has_v_proj else ("q", "k")
        qkv = fused_linear(source, [p + f"self_attn.{n}_proj.weight" for n in qkv_names], device, get)
        mlp_gu = fused_linear(source, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], device, get)
        norms = {k: get(p + v + ".weight") for k, v in _NORMS.items()}
        q_norm, k_norm = get(p + "self_attn.q_norm.weight"), get(p + "self_attn.k_norm.weight")
        router_w = get(p + "router.proj.weight", torch.float32)
        pieces = router_pieces(router_w) if router_w.is_cuda else None
        if pieces is not None and len(pieces) == 1:  # bf16 values: keep them once (43 MB at full size)
            router_w = pieces[0]
        layers.append(LayerWeights(
            qkv=qkv,
            o=fused_linear(source, [p + "self_attn.o_proj.weight"], device, get),
            q_norm=q_norm,
            k_norm=k_norm,
            qkv_norm=torch.stack([q_norm.float(), k_norm.float(), torch.ones_like(q_norm, dtype=torch.float32)]),
            inv_freq=inv_freq_for(layer).to(device),
            mlp_gu=mlp_gu,
            mlp_down=fused_linear(source, [p + "mlp.down_proj.weight"], device, get),
            router_w=router_w,
            router_pieces=pieces,
            router_in_scale=get(p + "router.scale", torch.float32) * cfg.hidden_size ** -0.5,
            per_expert_scale=get(p + "router.per_expert_scale", torch.float32),
            experts_gu=expert(p + "experts.gate_up_proj"),
            experts_down=expert(p + "experts.down_proj"),
            denoise_scalar=float(source.get(p + "layer_scalar", dtype=torch.float32)),
            prefill_scalar=float(source.get(f"{ENCODER_LAYERS}{layer.index}.layer_scalar", dtype=torch.float32)),
            **norms,
        ))
    head = LM_HEAD if LM_HEAD in source.keys() and tensor_kind(source, LM_HEAD) == FP8 else None
    if torch.device(device).type == "cuda" and any(isinstance(lw.qkv, Fp8Weight) or isinstance(lw.experts_gu, Fp8Weight)
                                                   for lw in layers):
        has_fp8_mma(torch.device(device))  # probed here, never first inside a graph capture
        has_scaled_grouped_mm(torch.device(device))
    return EngineWeights(
        embed=get(d + "embed_tokens.weight"),
        final_norm=get(d + "norm.weight"),
        sc_pre_norm=get(d + "self_conditioning.pre_norm.weight"),
        sc_gu=sc_gu,
        sc_down=sc_down,
        layers=layers,
        lm_head=None if head is None else source.fp8_weight(head, device),
    )


def _cat_q8(a: PackedWeight, b: PackedWeight) -> torch.Tensor:
    """The q8 record of rows(a) ‖ rows(b): codes and per-row scales concatenated plane by plane."""
    from ..quant import codecs

    shape = (a.shape[0] + b.shape[0], a.shape[1])
    rec = torch.zeros(codecs.record_nbytes("q8", shape), dtype=torch.uint8, device=a.device)
    for p in codecs.planes("q8", shape):
        rec[p.offset:p.offset + p.nbytes].view(p.rows, p.row_bytes).copy_(torch.cat([a.planes[p.name], b.planes[p.name]], 0))
    return rec


class DictSource:
    """A TensorSource over an in-memory {name: tensor} dict (random weights, converted state dicts)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def keys(self):
        return set(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def get(self, name, dtype=None, device="cpu"):
        t = self.tensors[name]
        return t.to(device=device, dtype=dtype or t.dtype)


def fp8_by_default(name: str) -> bool:
    """The tensors an FP8-dynamic checkpoint quantizes: the decoder's attention projections, dense MLP and experts
    (not the embedding / lm_head, routers, norms or the self-conditioning MLP)."""
    return name.startswith(DECODER + "layers.") and name.endswith(
        ("_proj.weight", "experts.gate_up_proj", "experts.down_proj")) and ".router." not in name


class Fp8QuantizedSource:
    """Another TensorSource with the tensors `which(name)` names quantized to FP8 per output row
    (ops/fp8_weight.quantize_fp8): `kind` says "fp8" for them, `fp8_weight` hands out the Fp8Weight and `get` its
    dequantized values (what a reference model built from this source multiplies). cache=True keeps each
    Fp8Weight made, so every consumer sees the same values even when the inner source draws afresh each read."""

    def __init__(self, inner, which=fp8_by_default, cache: bool = True):
        self.inner, self.which, self.cache = inner, which, cache
        self._made: dict = {}

    def __getattr__(self, attr):  # keys, shape, dtype, nbytes, ...: the inner source's
        return getattr(self.inner, attr)

    def kind(self, name) -> str:
        return FP8 if self.which(name) else tensor_kind(self.inner, name)

    def fp8_weight(self, name, device=None) -> Fp8Weight:
        fw = self._made.get(name)
        if fw is None:
            fw = quantize_fp8(self.inner.get(name, dtype=torch.float32, device=device))
            if self.cache:
                self._made[name] = fw
        return fw if device is None else fw.to(device)

    def get(self, name, dtype=None, device=None):
        if not self.which(name):
            return self.inner.get(name, dtype=dtype, device=device)
        return self.fp8_weight(name, device).dequantize(dtype or torch.float32)
