"""Build the tiny hub-format DiffusionGemma checkpoints under tests/data/hub/ with the formats' own libraries.

Run in a separate environment (the libraries pin an older transformers than the project tests with):

    python3 -m venv /work/venv-ct && /work/venv-ct/bin/pip install torch==2.13.0 \
        "llmcompressor==0.14.*" auto-round nvidia-modelopt "transformers<=5.17"
    /work/venv-ct/bin/python tools/make_hub_checkpoints.py [--only NAME ...]

Each checkpoint is a tiny random DiffusionGemma (tests/tiny_checkpoints.py's build_model, the HUB config below)
quantized by its library and saved as that library saves it. Beside each, `library_dequant.safetensors` holds the
library's own dequantization (its decompressor, in float32) of a few quantized tensors, so the tests pin our
reading of the layout to the library's without importing it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import tiny_checkpoints  # noqa: E402
from tiny_checkpoints import FULL, S, build_model  # noqa: E402

OUT = ROOT / "tests" / "data" / "hub"
# Smallest shapes every format takes: every K a multiple of 32 (the int4 tests' group size).
HUB = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=6,
           layer_types=[S, FULL], num_experts=4, top_k_experts=2, moe_intermediate_size=32)
SEED = 1234
# The published FP8/NVFP4 recipes leave these unquantized (lm_head, embeddings, routers, vision, SC MLP).
IGNORE = ["lm_head", "re:.*embed.*", "re:.*router.*", "re:.*vision.*", "re:.*self_conditioning.*"]
PROBES = ("model.decoder.layers.0.experts.1.gate_proj", "model.decoder.layers.0.experts.2.down_proj",
          "model.decoder.layers.1.self_attn.q_proj")


def bf16_base(work: Path) -> Path:
    tiny_checkpoints.TINY_VISION = dict(tiny_checkpoints.TINY_VISION, patch_size=2)  # a 12-wide patch projection
    model = build_model(HUB, seed=SEED).to(torch.bfloat16)
    path = work / "bf16"
    model.save_pretrained(str(path))
    return path


def _ct_args(num_bits, typ, strategy, group_size=None, symmetric=True, dynamic=False):
    return dict(num_bits=num_bits, type=typ, strategy=strategy, group_size=group_size, symmetric=symmetric,
                dynamic=dynamic)


# compressed-tensors checkpoints made by llmcompressor: name -> (scheme preset name or config_groups, ignore)
CT_SCHEMES = {
    "ct_fp8_dynamic": ("FP8_DYNAMIC", IGNORE),
    "ct_nvfp4a16": ("NVFP4A16", IGNORE),
    "ct_nvfp4": ("NVFP4", IGNORE),
    # int4 weight-only, group 32 (the tiny model's K is 32; the hub uses 128, the loader reads it from the config)
    "ct_w4a16": ({"group_0": {"targets": ["Linear"], "weights": _ct_args(4, "int", "group", 32)}}, IGNORE),
    "ct_w4a16_asym": ({"group_0": {"targets": ["Linear"], "weights": _ct_args(4, "int", "group", 32, False)}},
                      IGNORE),
}
CALIBRATED = ("ct_nvfp4",)


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "src/diffgemma/assets/demo/tokenizer.json"))


def make_ct(base: Path, name: str, out: Path) -> None:
    """llmcompressor's oneshot, data-free, on the linearized experts; saved compressed."""
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import DiffusionGemmaForBlockDiffusion

    scheme, ignore = CT_SCHEMES[name]
    with load_quantizable_moe(DiffusionGemmaForBlockDiffusion):
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(base), dtype=torch.bfloat16)
    if isinstance(scheme, str):
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
    else:
        recipe = QuantizationModifier(config_groups=scheme, ignore=ignore)
    if name in CALIBRATED:  # static activation (global) scales: a few random token rows as calibration data
        from datasets import Dataset

        gen = torch.Generator().manual_seed(SEED)
        rows = torch.randint(0, HUB["vocab_size"], (4, 16), generator=gen).tolist()
        oneshot(model=model, recipe=recipe, dataset=Dataset.from_dict({"input_ids": rows, "attention_mask":
                                                                       [[1] * 16] * 4}),
                num_calibration_samples=4, max_seq_length=16, processor=_tokenizer())
    else:
        oneshot(model=model, recipe=recipe)
    model.save_pretrained(str(out), save_compressed=True)
    write_ct_probes(out)
    if name in FAKEQUANT:
        from safetensors.torch import save_file

        save_file(library_fakequant_logits(base, name, out), str(out / "library_fakequant.safetensors"))


# Checkpoints that also ship the library's own weights-and-activations fake-quant forward (the FP8 engine's GPU
# test compares its per-token FP8 activations with it).
FAKEQUANT = ("ct_fp8_dynamic",)


@torch.no_grad()
def library_fakequant_logits(base: Path, name: str, out: Path) -> dict:
    """llmcompressor's quantized forward on exactly the saved checkpoint's weights, in float32, on a fixed prompt and
    canvas (one prefill, one denoise): {prompt, canvas, logits_fakequant (weights QDQ + activations quantized per
    token on the fly), logits_weights_only (the same with activation quantization off)}.

    A fresh oneshot model (same recipe) gets each quantized linear's weight set to the checkpoint's e4m3 · scale in
    float32 (its compressor divides in bf16, so a float32 re-quantization of the original weights could pick other
    codes); the forward's weight QDQ then gives back those same values."""
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    with load_quantizable_moe(DiffusionGemmaForBlockDiffusion):
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(base), dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=CT_SCHEMES[name][0],
                                                     ignore=CT_SCHEMES[name][1]))
    saved = load_file(str(out / "model.safetensors"))
    model.float().eval()
    for mod_name, mod in model.named_modules():
        if mod_name + ".weight_scale" in saved:
            mod.weight.data = saved[mod_name + ".weight"].float() * saved[mod_name + ".weight_scale"].float()
    gen = torch.Generator().manual_seed(SEED + 1)
    prompt = torch.randint(0, HUB["vocab_size"], (12,), generator=gen)
    canvas = torch.randint(0, HUB["vocab_size"], (model.config.canvas_length,), generator=gen)

    def forward():
        cache = DynamicCache(config=model.config.text_config)
        return model(input_ids=prompt[None], cache=cache, decoder_input_ids=canvas[None]).logits[0].contiguous()

    full = forward()
    for mod in model.modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is not None:
            mod.quantization_scheme = scheme.model_copy(update={"input_activations": None})
    return {"prompt": prompt, "canvas": canvas, "logits_fakequant": full, "logits_weights_only": forward()}


def write_ct_probes(out: Path) -> None:
    """The library's own decompression (its compressor classes, scales in float32) of PROBES -> library_dequant."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open
    from safetensors.torch import save_file

    qcfg = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = next(iter(qcfg.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(qcfg.format)
    probes = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for mod in PROBES:
            sd = {k[len(mod) + 1:]: f.get_tensor(k) for k in f.keys() if k.startswith(mod + ".")}
            sd = {k: (v.float() if v.is_floating_point() and v.dtype.itemsize > 1 and "scale" in k else v)
                  for k, v in sd.items()}
            probes[mod + ".weight"] = _ct_decompress(compressor, qcfg.format, sd, scheme).float().contiguous()
    save_file(probes, str(out / "library_dequant.safetensors"))


def _ct_decompress(compressor, fmt: str, sd: dict, scheme) -> torch.Tensor:
    """The compressor's decompress; for nvfp4 its own unpack + dequantize called in float32 (its decompress unpacks
    to bfloat16, which would round the reference we compare with)."""
    if fmt != "nvfp4-pack-quantized":
        return compressor.decompress(sd, scheme)["weight"]
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = sd["weight_packed"]
    values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    return dequantize(x_q=values, scale=sd["weight_scale"].float(), args=scheme.weights,
                      global_scale=sd["weight_global_scale"].float(), dtype=torch.float32)


def make_modelopt(base: Path, name: str, out: Path) -> None:
    """ModelOpt's NVFP4 experts-only recipe (the published checkpoint's), calibrated on random tokens, exported."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(base), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(SEED)

    def calibrate(m):
        for _ in range(4):
            ids = torch.randint(0, HUB["vocab_size"], (1, 16), generator=gen)
            m(input_ids=ids, decoder_input_ids=ids[:, :8])

    model = mtq.quantize(model, mtq.NVFP4_EXPERTS_ONLY_CFG, calibrate)
    export_hf_checkpoint(model, export_dir=str(out))
    write_modelopt_probes(out)


def write_modelopt_probes(out: Path) -> None:
    """ModelOpt's own NVFP4QTensor.dequantize (float32) of the expert PROBES -> library_dequant.safetensors."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors import safe_open
    from safetensors.torch import save_file

    probes = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for mod in PROBES:
            if f"{mod}.weight_scale_2" not in f.keys():
                continue
            packed = f.get_tensor(f"{mod}.weight")
            shape = (packed.shape[0], packed.shape[1] * 2)
            q = NVFP4QTensor(torch.Size(shape), torch.float32, packed)
            probes[mod + ".weight"] = q.dequantize(dtype=torch.float32, scale=f.get_tensor(f"{mod}.weight_scale"),
                                                   double_scale=f.get_tensor(f"{mod}.weight_scale_2"),
                                                   block_sizes={-1: 16}).contiguous()
    save_file(probes, str(out / "library_dequant.safetensors"))


def make_autoround(base: Path, name: str, out: Path) -> None:
    """AutoRound in its round-to-nearest mode (iters=0), 4-bit symmetric groups, its default GPTQ-style export."""
    from auto_round import AutoRound
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(base), dtype=torch.bfloat16)
    ar = AutoRound(model, _tokenizer(), bits=4, group_size=32, sym=True, iters=0, disable_opt_rtn=True)
    with tempfile.TemporaryDirectory() as tmp:
        ar.quantize_and_save(tmp, format="auto_round")
        (saved,) = [p for p in Path(tmp).iterdir() if p.is_dir()]  # it saves into a named subfolder
        shutil.copytree(saved, out)
    for tok in ("tokenizer.json", "tokenizer_config.json"):  # the demo's, only needed to run AutoRound
        (out / tok).unlink(missing_ok=True)
    write_autoround_probes(out)


def write_autoround_probes(out: Path) -> None:
    """AutoRound's own torch kernel for its GPTQ packing (qlinear_torch_zp: stored zeros are zero - 1), run on the
    identity with float32 scales: its dequantized weight, exactly -> library_dequant.safetensors."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    from safetensors import safe_open
    from safetensors.torch import save_file

    probes = {}
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for mod in PROBES:
        if f"{mod}.qweight" not in index:
            continue
        with safe_open(str(out / index[f"{mod}.qweight"]), "pt") as f:
            qweight, qzeros, scales = (f.get_tensor(f"{mod}.{s}") for s in ("qweight", "qzeros", "scales"))
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        ql = QuantLinear(4, 32, k, n, bias=False)
        ql.qweight, ql.qzeros, ql.scales = qweight, qzeros, scales.float()
        ql.dequant_dtype = torch.int32
        with torch.no_grad():
            probes[mod + ".weight"] = ql(torch.eye(k)).t().contiguous()
    save_file(probes, str(out / "library_dequant.safetensors"))


# The encoder-named copies of the shared decoder weights that llmcompressor writes are kept in one checkpoint (the
# loader must ignore them) and dropped from the others to keep the test data small; the loader never reads them.
KEEP_ENCODER_COPIES = ("ct_fp8_dynamic",)


def drop_encoder_copies(directory: Path) -> None:
    """Rewrite the shards (and the index) without the encoder's copies of decoder weights that are also stored under
    their decoder names (layer scalars, and tensors a writer stored under the encoder name only, stay)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    names = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    enc = "model.encoder.language_model."

    def copy(k: str) -> bool:
        return k.startswith(enc + "layers.") and not k.endswith("layer_scalar") and \
            "model.decoder." + k[len(enc):] in names

    for path in directory.glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({k: v for k, v in tensors.items() if not copy(k)}, str(path), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        d = json.loads(index.read_text())
        d["weight_map"] = {k: v for k, v in d["weight_map"].items() if not copy(k)}
        index.write_text(json.dumps(d, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="names to (re)build (default: all)")
    args = ap.parse_args(argv)
    makers = {**{n: make_ct for n in CT_SCHEMES}, "modelopt_nvfp4": make_modelopt,
              "autoround_int4": make_autoround}
    names = args.only or list(makers)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        base = bf16_base(Path(work))
        for name in names:
            out = OUT / name
            tmp = Path(work) / name
            makers[name](base, name, tmp)
            for junk in ("recipe.yaml",):
                (tmp / junk).unlink(missing_ok=True)
            if name not in KEEP_ENCODER_COPIES:
                drop_encoder_copies(tmp)
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(tmp, out)
            size = sum(p.stat().st_size for p in out.iterdir())
            print(f"{out}: {size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
