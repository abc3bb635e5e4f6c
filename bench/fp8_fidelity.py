"""FP8 and q4 against bf16, layer by layer, on the fixtures' random weights: where the logits part and why.

    PYTHONPATH=src:. python -m bench.fp8_fidelity [--out DIR]                 # GPU: full size, 30 layers
    PYTHONPATH=src:. python -m bench.fp8_fidelity --cpu [--layers 2]          # CPU: real widths, few layers
    ... [--sections layers,engines] [--fixtures flat,peaked]

One set of random weights (bench/fixtures.RandomSource, per fixture) is run through the reference forward
(model/reference.py, float32) in several variants at once, layer by layer: each layer's weights are made, every
variant runs that layer's prefill rows and then its denoise canvas, and the layer's weights are dropped, so the full
model never has to be held (one layer of experts at a time; each variant's expert weights are made per expert as the
reference asks for them). The variants:

  bf16              the random weights as drawn (bf16 values, float32 math): the baseline
  fp8_w             attention projections, dense MLP and experts quantized to FP8 per output row
                    (ops/fp8_weight.quantize_fp8), activations float32: the reference path's FP8 model
  fp8_wa            the same with every input of those GEMMs quantized per token (ops/fp8_quant.fake_quant_rows): the
                    CUDA FP8 engine's math
  fp8_wa_pinned     fp8_wa with each layer's expert choice (ids and mixing weights) taken from the bf16 run
  fp8_experts_wa    FP8 (weights and activations) on the experts alone, the tensors a q4 pack quantizes
  q4                the experts as q4 records represent them (group-32 affine, quant/codecs.py's rule, dequantized),
                    the SC MLP as q8: the q4 pack's weights
  q4_pinned         q4 with the bf16 run's expert choice

Per variant: after each layer, the denoise rows' hidden-state cosine to bf16's (mean, min), their relative error and
the share of (token, expert) choices bf16 also made; at the end the final hidden state's cosine, the softcapped
logits' cosine (mean, min) and argmax agreement; for bf16, each layer's median router margin (log-probability of the
k-th expert minus the (k+1)-th: how close the choice is to a tie). A variant that only moves logits by the weights'
own rounding keeps its layers' cosine near 1 once its routing is pinned; the unpinned one shows what a flipped
expert choice costs.

engines (CUDA only): the engines themselves at full size over each fixture's weights (bench/runner.build: bf16, and
fp8 on the FP8 GEMMs; and "q4_values", the bf16 engine with its expert stacks replaced by their q4 values and the
SC MLP by its q8 values), model routing, two lanes of --ctx context: each one's softcapped denoise logits against the
bf16 engine's (cosine mean / min, argmax agreement), the figure issue 50's bar names, beside the layers' reference.

Results: DIR/fp8_fidelity.json (rewritten after each part) and a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("src", "")]

import diffgemma.model.reference as reference  # noqa: E402
from bench.bench_engine import CANVAS, TEXT  # noqa: E402
from bench.fixtures import RandomSource  # noqa: E402
from bench.runner import fixture_list  # noqa: E402
from diffgemma.checkpoint import DECODER, ENCODER_LAYERS  # noqa: E402
from diffgemma.config import ModelConfig  # noqa: E402
from diffgemma.model.engine_weights import fp8_by_default  # noqa: E402
from diffgemma.model.reference import ReferenceModel, pad_rows, rms_norm, rows_matmul  # noqa: E402
from diffgemma.ops.fp8_quant import fake_quant_rows  # noqa: E402
from diffgemma.ops.fp8_weight import Fp8Weight, quantize_fp8  # noqa: E402
from diffgemma.quant import codecs  # noqa: E402

SC = DECODER + "self_conditioning."
Q4_LEVELS = 15  # quant/codecs.py: q4 is 16-level affine over groups of Q4_GROUP along K
Q4_GROUP = codecs.GROUP["q4"]
CHUNK = 16  # experts quantized at once (bounds the temporaries)


def q4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [.., K] -> (codes [.., K/32, 32], scale, min [.., K/32, 1] float32 of float16 values), on w's device, by
    quant/codecs.py's affine q4 rule: per group of 32 along K the min and (max - min) / 15, both rounded to float16,
    codes round((w - min) / scale) in 0..15. The codec computes the same on the CPU only; tests/test_fp8_fidelity.py
    compares the two."""
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // Q4_GROUP, Q4_GROUP)
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((mx.double() - mn.double()) / Q4_LEVELS).to(torch.float16).float()
    mn = mn.to(torch.float16).float()
    codes = ((g - mn) / torch.where(scale > 0, scale, 1.0)).round_().clamp_(0, Q4_LEVELS).to(torch.uint8)
    return codes, scale, mn


def q4_decode(codes, scale, mn) -> torch.Tensor:
    """The float32 weights [.., K] of q4_encode's parts: code · scale + min."""
    return (codes.float() * scale + mn).flatten(-2)


def q4_dequantized(w: torch.Tensor) -> torch.Tensor:
    """w as its q4 record represents it, float32."""
    return q4_decode(*q4_encode(w))


def q8_dequantized(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] as a q8 record represents it (quant/codecs.py, on the CPU), float32 on w's device."""
    enc = codecs.encode("q8", w.cpu())
    return codecs.decode("q8", codecs.assemble("q8", tuple(w.shape), enc), tuple(w.shape)).to(w.device)


def fp8_dequantized(w: torch.Tensor) -> torch.Tensor:
    return quantize_fp8(w).dequantize()


def is_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


@dataclass(frozen=True)
class Variant:
    """How one variant makes a weight from the drawn one: fp8 (which names in FP8), q4 (experts in q4, SC in q8),
    acts (the FP8 GEMMs' inputs quantized per token), pinned (expert choice from the bf16 run)."""

    name: str
    fp8: str = ""  # "" | "all" (fp8_by_default's tensors) | "experts"
    q4: bool = False
    acts: bool = False
    pinned: bool = False

    def quantized(self, name: str) -> bool:
        return (self.fp8 == "all" and fp8_by_default(name)) or (self.fp8 == "experts" and is_expert(name))

    def make(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The f32 weight [N, K] this variant multiplies, tagged `fp8_input` where its GEMM quantizes its input per
        token (expert stacks: LazyStack)."""
        if self.quantized(name):
            return self.tagged(fp8_dequantized(w))
        if self.q4 and name.startswith(SC) and w.dim() == 2:
            return q8_dequantized(w)
        return w.float()

    def tagged(self, w: torch.Tensor) -> torch.Tensor:
        w.fp8_input = self.acts
        return w


VARIANTS = [Variant("bf16"), Variant("fp8_w", fp8="all"), Variant("fp8_wa", fp8="all", acts=True),
            Variant("fp8_wa_pinned", fp8="all", acts=True, pinned=True),
            Variant("fp8_experts_wa", fp8="experts", acts=True), Variant("q4", q4=True),
            Variant("q4_pinned", q4=True, pinned=True)]


class LayerStacks:
    """One layer's drawn expert stacks and their FP8 and q4 forms, each made once (CHUNK experts at a time) when a
    variant first needs it and kept compact (e4m3 values and row scales; q4 codes, scales and mins) for the layer."""

    def __init__(self, drawn: dict):
        self.drawn, self.forms = drawn, {}

    def form(self, kind: str, name: str):
        key = (kind, name)
        if key not in self.forms:
            w = self.drawn[name]
            if kind == "fp8":
                parts = [quantize_fp8(w[i:i + CHUNK]) for i in range(0, len(w), CHUNK)]
                self.forms[key] = Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))
            else:
                parts = [q4_encode(w[i:i + CHUNK]) for i in range(0, len(w), CHUNK)]
                self.forms[key] = tuple(torch.cat(t) for t in zip(*parts))
        return self.forms[key]

    def expert(self, variant: Variant, name: str, e: int) -> torch.Tensor:
        if variant.quantized(name):
            fw = self.form("fp8", name)
            return variant.tagged(Fp8Weight(fw.weight[e], fw.scale[e]).dequantize())
        if variant.q4:
            return q4_decode(*(t[e] for t in self.form("q4", name)))
        return self.drawn[name][e].float()


class LazyStack:
    """An expert stack [E, N, K] as one variant multiplies it: expert e made when the reference indexes it."""

    def __init__(self, variant: Variant, name: str, stacks: LayerStacks):
        self.variant, self.name, self.stacks = variant, name, stacks

    def __getitem__(self, e):
        return self.stacks.expert(self.variant, self.name, e)


def variant_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference's row-tiled product, the input quantized per token where the weight says so."""
    return rows_matmul(fake_quant_rows(a) if getattr(w, "fp8_input", False) else a, w)


class RouteBook:
    """The reference's router, patched: records each (layer, phase)'s expert choice per variant and hands a pinned
    variant the bf16 run's."""

    def __init__(self):
        self.key, self.variant, self.book, self.margins = None, None, {}, {}
        self.inner = reference.route

    def route(self, x, proj_w, scale, per_expert_scale, top_k, eps, mm=reference.matmul):
        if self.variant.pinned:
            idx, wts = self.book[("bf16",) + self.key]
        else:
            idx, wts = self.inner(x, proj_w, scale, per_expert_scale, top_k, eps, mm)
        if self.variant.name == "bf16":
            h = rms_norm(x, None, eps) * scale * (x.shape[-1] ** -0.5)
            top = torch.log_softmax(mm(h, proj_w).float(), -1).topk(top_k + 1, -1).values
            self.margins[self.key] = (top[:, top_k - 1] - top[:, top_k]).median().item()
        self.book[(self.variant.name,) + self.key] = (idx, wts)
        return idx, wts

    @contextlib.contextmanager
    def installed(self):
        reference.route = self.route
        try:
            yield self
        finally:
            reference.route = self.inner


def layer_names(cfg: ModelConfig, i: int, shapes) -> list[str]:
    p = f"{DECODER}layers.{i}."
    return sorted(n for n in shapes if n.startswith(p)) + [f"{ENCODER_LAYERS}{i}.layer_scalar"]


def cosines(a: torch.Tensor, b: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    return {"cos_mean": round(cos.mean().item(), 6), "cos_min": round(cos.min().item(), 6),
            "rel_err": round(((a.float() - b.float()).norm() / b.float().norm()).item(), 6)}


class Lane:
    """One variant's model, cache and rows while the layers go by."""

    def __init__(self, variant, cfg, glob, dev, ctx, canvas, sc):
        w = {n: variant.make(n, t) for n, t in glob.items()}
        self.variant = variant
        self.model = ReferenceModel(cfg, w, device=dev, dtype=torch.float32)
        self.cache = self.model.new_cache(ctx + len(canvas))
        self.spans = [(self.cache, 0, len(canvas))]
        self.x_pre = None
        self.x_den = self.model._denoise_input(pad_rows(canvas), [sc], self.spans)


def run_fixture(cfg: ModelConfig, dev, fixture: str, ctx: int, seed: int, log) -> dict:
    """Every variant through every layer of cfg (module docstring); returns the per-layer and final figures."""
    C, V = cfg.canvas_length, cfg.vocab_size
    src = RandomSource(cfg, dev, torch.bfloat16, seed=seed, fixture=fixture)
    shapes = src.shapes
    glob = {n: src.get(n, dtype=torch.float32) for n in sorted(shapes) if not n.startswith(DECODER + "layers.")
            and not n.startswith(ENCODER_LAYERS) and n.startswith(DECODER)}
    gen = torch.Generator().manual_seed(seed + 5)
    prompt = torch.randint(0, V, (ctx,), generator=gen).to(dev)
    canvas = torch.randint(0, V, (C,), generator=gen).to(dev)
    sc = reference.ReferenceModel(cfg, glob, device=dev, dtype=torch.float32).embed(
        torch.randint(0, V, (C,), generator=gen).to(dev))
    lanes = [Lane(v, cfg, glob, dev, ctx, canvas, sc) for v in VARIANTS]
    for lane in lanes:
        lane.x_pre = lane.model.embed(prompt)
    pos_pre = torch.arange(ctx, device=dev)
    keys = pos_pre
    causal = keys[None, :] <= pos_pre[:, None]
    pos_den = pad_rows(torch.arange(ctx, ctx + C, device=dev))
    book, out = RouteBook(), {"layers": []}
    with book.installed(), torch.no_grad():
        for layer in cfg.layers:
            t0 = time.time()
            drawn = {n: src.get(n) if is_expert(n) else src.get(n, dtype=torch.float32)
                     for n in layer_names(cfg, layer.index, shapes)}
            mask = causal & (keys[None, :] > pos_pre[:, None] - cfg.sliding_window) if layer.is_sliding else causal
            row = {"layer": layer.index, "sliding": layer.is_sliding}
            stacks = LayerStacks({n: t for n, t in drawn.items() if is_expert(n)})
            for lane in lanes:
                v, m = lane.variant, lane.model
                m.w.update({n: LazyStack(v, n, stacks) if is_expert(n) else v.make(n, t) for n, t in drawn.items()})
                book.variant = v
                book.key = (layer.index, "prefill")
                attend = m._cached_attention(lane.cache, layer, mask, denoise=False)
                lane.x_pre, k, kv = m._layer(layer, lane.x_pre, pos_pre, attend, denoise=False,
                                             with_ffn=layer.index != cfg.num_layers - 1, mm=variant_mm)
                lane.cache.append(layer.index, k, kv)
                book.key = (layer.index, "denoise")
                lane.x_den, _, _ = m._layer(layer, lane.x_den, pos_den, m._batch_attention(layer, lane.spans),
                                            denoise=True, mm=variant_mm, pad=pad_rows)
                for n in drawn:
                    m.w.pop(n)
            base = lanes[0]
            row["router_margin_median"] = round(book.margins[(layer.index, "denoise")], 5)
            bidx = book.book[("bf16", layer.index, "denoise")][0]
            for lane in lanes[1:]:
                idx = book.book[(lane.variant.name, layer.index, "denoise")][0]
                row[lane.variant.name] = dict(cosines(lane.x_den[:C], base.x_den[:C]), route_agreement=round(
                    (idx[:C, :, None] == bidx[:C, None, :]).any(-1).float().mean().item(), 4))
            out["layers"].append(row)
            del drawn, stacks
            log(f"  [{fixture}] layer {layer.index} ({time.time() - t0:.1f}s) margin {row['router_margin_median']}: "
                + "  ".join(f"{n} {r['cos_mean']:.5f}/{r['route_agreement']:.3f}" for n, r in row.items()
                            if isinstance(r, dict)))
    out["final"] = final_figures(cfg, lanes, C)
    return out


def final_figures(cfg, lanes, C) -> dict:
    """After the final norm: the hidden state's cosine to bf16's and the softcapped logits' cosine and argmax."""
    cap = cfg.final_logit_softcapping
    heads = {}
    for lane in lanes:
        m = lane.model
        h = rms_norm(lane.x_den[:C], m.w[DECODER + "norm.weight"], cfg.rms_norm_eps)
        heads[lane.variant.name] = (h, cap * torch.tanh((h @ m.embedding.T).float() / cap))
    bh, bl = heads["bf16"]
    out = {"bf16": {"logit_std": round(bl.std().item(), 4), "top1_minus_top2_median": round(
        (lambda t: (t[:, 0] - t[:, 1]).median().item())(bl.topk(2, -1).values), 5)}}
    for name, (h, lg) in heads.items():
        if name == "bf16":
            continue
        out[name] = {"hidden": cosines(h, bh), "logits": cosines(lg, bl),
                     "argmax_agreement": round((lg.argmax(-1) == bl.argmax(-1)).float().mean().item(), 4)}
    return out


class Q4Values:
    """A TensorSource whose expert stacks come as their q4 values (CHUNK experts at a time) and SC MLP as its q8
    values, in the source's dtype; every other tensor as drawn (each name drawn once, in the caller's order)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def kind(self, name) -> str:
        return "raw"

    def get(self, name, dtype=None, device=None):
        t = self.inner.get(name, dtype=dtype, device=device)
        if is_expert(name):
            return torch.cat([q4_dequantized(t[i:i + CHUNK]).to(t.dtype) for i in range(0, len(t), CHUNK)])
        if name.startswith(SC) and t.dim() == 2:
            return q8_dequantized(t).to(t.dtype)
        return t


def engine_logits(kind: str, cfg, dev, fixture: str, ctx: int, lanes_n: int = 2) -> torch.Tensor:
    """The softcapped f32 denoise logits [lanes_n · C, V] (on the host) of a full-size engine of `kind` over the
    fixture's weights, model routing."""
    from bench.balanced_routing import routing
    from bench.bench_batch import lanes
    from bench.runner import build
    from diffgemma.model.engine import build_engine

    if kind == "q4_values":
        eng = build_engine(cfg, Q4Values(RandomSource(cfg, dev, torch.bfloat16, seed=0, fixture=fixture)), dev,
                           torch.bfloat16)
    else:
        eng = build(kind if fixture == "flat" else f"{kind}-{fixture}", cfg, dev, False)
    try:
        with routing("model"):
            caches, canvases, scs = lanes(eng, cfg, lanes_n, ctx, seed=5)
            cap = eng.logit_softcap
            return torch.cat([(cap * torch.tanh(eng.denoise_raw(c, x, sc_embeds=s).float() / cap)).cpu()
                              for c, x, s in zip(caches, canvases, scs)])
    finally:
        eng = None
        torch.cuda.empty_cache()


def section_engines(dev, fixture: str, ctx: int, log) -> dict:
    """engines (module docstring) at full size on one fixture."""
    cfg = config(TEXT["num_hidden_layers"], TEXT["vocab_size"], CANVAS)
    out, base = {}, None
    for kind in ("bf16", "fp8", "q4_values"):
        t = time.time()
        try:
            logits = engine_logits(kind, cfg, dev, fixture, ctx)
        except Exception as e:
            import traceback
            traceback.print_exc()
            out[kind] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        if base is None:
            base = logits
            out[kind] = {"seconds": round(time.time() - t, 1)}
        else:
            out[kind] = {"logits": cosines(logits, base), "argmax_agreement": round(
                (logits.argmax(-1) == base.argmax(-1)).float().mean().item(), 4), "seconds": round(time.time() - t, 1)}
        log(f"  [{fixture} engines] {kind}: {out[kind]}")
    return out


def config(layers: int, vocab: int, canvas: int) -> ModelConfig:
    """TEXT (the full-size model) with its last `layers` layers (a full layer and the sliding ones before it) and a
    `vocab`-token vocabulary."""
    types = TEXT["layer_types"][-layers:]
    text = dict(TEXT, num_hidden_layers=layers, layer_types=types, vocab_size=vocab)
    return ModelConfig.from_dict({"model_type": "diffusion_gemma", "text_config": text, "canvas_length": canvas})


def table(res: dict) -> str:
    lines = []
    for fixture, r in res.get("fixtures", {}).items():
        if "final" not in r:
            lines.append(f"{fixture}: {r}")
            continue
        lines.append(f"== {fixture}: bf16 logits {r['final']['bf16']}")
        lines.append(f"{'variant':16} {'logits cos mean':>16} {'min':>9} {'argmax':>7} {'hidden cos':>11} "
                     f"{'last-layer routes kept':>23}")
        last = r["layers"][-1]
        for name, f in r["final"].items():
            if name == "bf16":
                continue
            lines.append(f"{name:16} {f['logits']['cos_mean']:16.6f} {f['logits']['cos_min']:9.5f} "
                         f"{f['argmax_agreement']:7.4f} {f['hidden']['cos_mean']:11.6f} "
                         f"{last[name]['route_agreement']:23.4f}")
    for fixture, r in res.get("engines", {}).items():
        for name, f in r.items():
            if "logits" in f:
                lines.append(f"engine {fixture} {name:10} logits cos mean {f['logits']['cos_mean']:.6f} min "
                             f"{f['logits']['cos_min']:.5f} argmax {f['argmax_agreement']:.4f}")
            elif "error" in f:
                lines.append(f"engine {fixture} {name}: {f['error']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--cpu", action="store_true", help="on the CPU: defaults --layers 2 --vocab 32768 --ctx 16")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--canvas", type=int, default=CANVAS)
    p.add_argument("--ctx", type=int, default=None)
    p.add_argument("--fixtures", default="flat,peaked")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sections", default="layers,engines", help="comma list of layers, engines (CUDA only)")
    a = p.parse_args(argv)
    dev = torch.device("cpu" if a.cpu or not torch.cuda.is_available() else "cuda")
    small = dev.type == "cpu"
    layers = a.layers or (2 if small else TEXT["num_hidden_layers"])
    cfg = config(layers, a.vocab or (32768 if small else TEXT["vocab_size"]), a.canvas)
    ctx = a.ctx or (16 if small else 1024)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "layers": layers, "vocab": cfg.vocab_size, "canvas": a.canvas, "ctx": ctx}
    t0 = time.time()
    sections = set(a.sections.split(","))
    log = lambda *m: print(*m, flush=True)  # noqa: E731
    jobs = [("fixtures", f, lambda f=f: run_fixture(cfg, dev, f, ctx, a.seed, log)) for f in fixture_list(a.fixtures)
            if "layers" in sections]
    if "engines" in sections and dev.type == "cuda":
        jobs += [("engines", f, lambda f=f: section_engines(dev, f, ctx, log)) for f in fixture_list(a.fixtures)]
    for part, fixture, fn in jobs:
        try:
            res.setdefault(part, {})[fixture] = fn()
        except Exception as e:  # the other parts still run
            import traceback
            traceback.print_exc()
            res.setdefault(part, {})[fixture] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["seconds"] = round(time.time() - t0, 1)
        tmp = out_dir / "fp8_fidelity.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        tmp.rename(out_dir / "fp8_fidelity.json")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    text = table(res)
    (out_dir / "fp8_fidelity.txt").write_text(text + "\n")
    print(text, flush=True)
    return res


if __name__ == "__main__":
    main()
