"""The published quantized layouts (docs/FORMATS.md): exact float32 dequantization, and conversion to the engine's
own records (codecs.py) where one holds the same values.

Every `dequant_*` takes one linear's stored tensors ([N, K] weights, "out" rows, "in" columns) and returns the
float32 weight. fp8 and int4: the real value rounded once to float32 (exact for the published scale dtypes, bfloat16
/ float16 scales: at most 4 + 11 significant bits; a float32 fp8 scale rounds once). nvfp4: in float32 the way the
formats' own libraries dequantize, bit for bit: the block scale times (ModelOpt) or divided by (compressed-tensors)
the tensor's scale, rounded, then times the e2m1 value, rounded.

  fp8        w = e4m3 · scale                      scale [N, 1] / [N] (channel) or one value (tensor)
  nvfp4 (ct) w = e2m1 · fl(e4m3(scale) / global_scale)  packed nibbles [N, K/2] (element 2j low), scale [N, K/16]
  nvfp4 (mo) w = e2m1 · fl(e4m3(scale) · weight_scale_2)
  int4 (ct)  w = (q - zp) · scale                   8 values per int32 along K, element i at bits 4i, stored
                                                    q + 8; zero points packed the same way along N
  gptq-int4  w = (q - z) · scale                    qweight [K/8, N] packed along K, qzeros [K/g, N/8] along N,
                                                    scales [K/g, N]; q and z unsigned 0..15

Conversions for the fast engine (one record per expert stack, a uint8 tensor made on the parts' device):
  nvfp4 -> codecs' nvfp4e: the nibbles and block scales are the same bytes, and each expert keeps its tensor scale
      as its (multiplier, divisor) pair (ops/layouts.py), so the engine decodes the library's values exactly. Only
      where one expert's parts (gate, up) have different tensor scales do they share the largest, the others'
      block scales re-rounded to e4m3 (counted and reported).
  int4 / gptq-int4 -> q4: code = q (+8 for signed storage), scale = s, min = -z·s, each group of g splitting into
      g/32 q4 groups with the same pair; exact when s and z·s are float16 values (counted otherwise).
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from . import codecs
from ..ops.packed_weight import nvfp4e_decode
from ..ops.layouts import pack_nibbles, record_planes


def _need(cond: bool, what: str):
    if not cond:
        raise TensorError(what)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] times a per-row ([N, 1] / [N]) or per-tensor scale -> float32 [N, K], one rounding (none for
    bfloat16 / float16 scales)."""
    _need(weight.dtype == torch.float8_e4m3fn, f"fp8 weight has dtype {weight.dtype}, expected float8_e4m3fn")
    return weight.float() * fp8_row_scales(scale, weight.shape[0]).unsqueeze(-1)


def fp8_row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A channel ([N, 1] / [N]) or tensor (one value) scale as float32 [N] (exact: bf16/f16/f32 -> f32)."""
    s = scale.float().reshape(-1)
    _need(s.numel() in (1, rows), f"fp8 weight_scale has {s.numel()} values, expected 1 or {rows}")
    return s.expand(rows).contiguous() if s.numel() == 1 else s.contiguous()


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, mul: float, div: float) -> torch.Tensor:
    """e2m1 · fl(fl(e4m3 block scale (group 16) · mul) / div) in float32 -> float32 [N, K]: ModelOpt's (mul =
    weight_scale_2, div = 1) and compressed-tensors' (mul = 1, div = global_scale) own arithmetic, and the engine's
    nvfp4e decode (ops/packed_weight.nvfp4e_decode, the rule itself)."""
    n, half = packed.shape
    _need(packed.dtype == torch.uint8 and scale.shape == (n, half * 2 // 16),
          f"nvfp4 weight {packed.dtype} {list(packed.shape)} / scale {list(scale.shape)}: expected uint8 [N, K/2] "
          "and e4m3 [N, K/16]")
    pair = torch.tensor([[mul, div]], dtype=torch.float32, device=packed.device).expand(n, 2)
    return nvfp4e_decode(packed, as_uint8(scale), pair)


def unpack_int4_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [R, W] with 8 nibbles a word (element i at bits 4i) -> uint8 [R, cols] unsigned nibbles."""
    w = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=w.device)
    q = ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(w.shape[0], -1)
    _need(q.shape[1] >= cols, f"int4 packed tensor holds {q.shape[1]} values a row, expected {cols}")
    return q[:, :cols].to(torch.uint8)


def groups(k: int, group: int) -> int:
    """Groups along K: the last one may be partial (K = 704 in groups of 128: 5 whole and one of 64)."""
    return -(-k // group)


def ct_int4_codes(packed, scale, zero_point, shape, group: int):
    """compressed-tensors pack-quantized -> (codes uint8 [N, K] 0..15, scale f32 [N, G], zero f32 [N, G]), G the
    groups along K, with w = (code - zero) · scale: stored nibbles are q + 8, so zero = 8 + zp (8 when symmetric)."""
    n, k = shape
    g = groups(k, group)
    _need(tuple(scale.shape) == (n, g), f"int4 scale {list(scale.shape)}: expected [{n}, {g}] for group {group}")
    codes = unpack_int4_rows(packed, k)
    if zero_point is None:
        zero = torch.full((n, g), 8.0, device=codes.device)
    else:
        zp = unpack_int4_rows(zero_point.t().contiguous(), n).t()  # packed along N
        zero = zp.float()  # stored zp + 8
    return codes, scale.float(), zero


def gptq_int4_codes(qweight, qzeros, scales, group: int, zero_offset: int):
    """GPTQ-style -> (codes uint8 [N, K], scale f32 [N, G], zero f32 [N, G]); w = (code - zero) · scale where
    zero = stored zero + zero_offset (1 for the original GPTQ export, 0 for the fixed one)."""
    kw, n = qweight.shape
    k = kw * 8
    _need(tuple(scales.shape) == (groups(k, group), n),
          f"gptq scales {list(scales.shape)}: expected [{groups(k, group)}, {n}] for group {group}")
    codes = unpack_int4_rows(qweight.t().contiguous(), k)  # qweight packs along K: transpose to rows = N
    zero = unpack_int4_rows(qzeros, n).t().float() + zero_offset
    return codes, scales.t().float().contiguous(), zero.contiguous()


def dequant_int4(codes, scale, zero, group: int) -> torch.Tensor:
    """(code - zero) · scale, each group's pair over its `group` columns (the last group may be partial)."""
    k = codes.shape[1]
    z = zero.repeat_interleave(group, 1)[:, :k]
    return (codes.float() - z) * scale.repeat_interleave(group, 1)[:, :k]


# ------------------------------------------------------------------------------------- engine records

class Inexact:
    """Counts values a conversion could not carry exactly, and the largest change it made (absolute)."""

    def __init__(self):
        self.count, self.total, self.worst = 0, 0, 0.0

    def add(self, exact: torch.Tensor, got: torch.Tensor):
        bad = exact != got
        self.total += exact.numel()
        if bool(bad.any()):
            self.count += int(bad.sum())
            self.worst = max(self.worst, float((exact - got).abs().max()))


def nvfp4e_record(experts, shape, note: Inexact) -> torch.Tensor:
    """codecs' nvfp4e record of an expert stack, a uint8 tensor on the parts' device: `experts` lists, per expert,
    its parts (gate, up or down) stacked row-wise, each (packed uint8 [n, K/2], e4m3 scale uint8-viewable [n, K/16],
    mul, div) as _nvfp4 gives them. Each expert keeps its (mul, div); see the module docstring for parts that
    differ."""
    codes, scales, pairs = [], [], []
    for parts in experts:
        mul, div = max(((float(m), float(d)) for _, _, m, d in parts), key=lambda md: md[0] / md[1])
        for packed, scale, m, d in parts:
            s = scale.contiguous().view(torch.float8_e4m3fn)
            if (float(m), float(d)) != (mul, div):  # the library's block scale · m / d, carried by (mul, div)
                exact = s.double() * (float(m) / float(d)) / (mul / div)
                s = exact.clamp(max=codecs.E4M3_MAX).to(torch.float8_e4m3fn)
                note.add(exact, s.double())
            else:
                note.add(torch.zeros(1), torch.zeros(1))
            codes.append(packed.contiguous())
            scales.append(s.view(torch.uint8))
        pairs.append((mul, div))
    escale = torch.tensor(pairs, dtype=torch.float32)
    note.add(torch.tensor(pairs, dtype=torch.float64), escale.double())  # f32 values given: exact
    return _assemble("nvfp4e", shape, {"codes": torch.cat(codes), "scale": torch.cat(scales),
                                       "escale": escale.to(codes[0].device).view(torch.uint8)})


def q4_record(parts, shape, group: int, note: Inexact) -> torch.Tensor:
    """codecs' q4 record, a uint8 tensor on the parts' device, from int4 parts (codes uint8 [n, K] 0..15, scale f32
    [n, K/g], zero f32 [n, K/g]) stacked row-wise; each group of g becomes g/32 q4 groups (scale, min = -zero ·
    scale) in float16."""
    _need(group % codecs.GROUP["q4"] == 0, f"int4 group size {group} does not split into q4's groups of 32")
    rep, q4_groups = group // codecs.GROUP["q4"], shape[-1] // codecs.GROUP["q4"]
    codes = torch.cat([c for c, _, _ in parts])
    scale = torch.cat([s for _, s, _ in parts]).double()
    mn = -torch.cat([z for _, _, z in parts]).double() * scale
    s16, m16 = scale.to(torch.float16), mn.to(torch.float16)
    note.add(scale, s16.double())
    note.add(mn, m16.double())
    return _assemble("q4", shape, {"codes": pack_nibbles(codes),
                                   "scale": s16.repeat_interleave(rep, 1)[:, :q4_groups].contiguous().view(torch.uint8),
                                   "min": m16.repeat_interleave(rep, 1)[:, :q4_groups].contiguous().view(torch.uint8)})


def _assemble(fmt: str, shape, parts: dict) -> torch.Tensor:
    """A whole record (padding zero) on the parts' device, each plane's rows copied in (ops/layouts.record_planes)."""
    first = next(iter(parts.values()))
    rec = torch.zeros(codecs.record_nbytes(fmt, shape), dtype=torch.uint8, device=first.device)
    for name, view in record_planes(fmt, shape, rec).items():
        view.copy_(parts[name].reshape(view.shape))
    return rec


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t

