"""`diffgemma quantize MODEL -o OUT --profile fp8`: a bf16 checkpoint -> the compressed-tensors FP8 checkpoint
the hub publishes (docs/FORMATS.md), streamed tensor by tensor.

The output is what llmcompressor's FP8_DYNAMIC recipe writes for this model: every decoder linear (attention
projections, dense MLP, each expert's gate / up / down as its own 2-D weight) becomes e4m3 values with one scale
per output channel, w ≈ e4m3 · scale, scale = max|row| / 448 (bfloat16, rounded up); activations are declared dynamic per
token. Left as they are (the recipe's `ignore`): lm_head, embeddings, routers, the self-conditioning MLP, the
vision tower. The fused expert stacks are split into `layers.L.experts.E.{gate,up,down}_proj.weight` (gate the
first half of gate_up's rows).

Tensors are read one at a time (memory-mapped) and written in shards of at most SHARD_BYTES, into a temporary
sibling directory renamed into place at the end; a failure leaves nothing at the output path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import CheckpointError, TensorError
from .codecs import E4M3_MAX
from .pack import copy_side_files
from .shards import FLOAT_DTYPES, HFCheckpoint

SHARD_BYTES = 4 << 30
IGNORE = ["lm_head", "re:.*embed.*", "re:.*router.*", "re:.*vision.*", "re:.*self_conditioning.*"]
_LINEAR = re.compile(r"model\.decoder\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_EXPERTS = re.compile(r"(model\.decoder\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)$")


def quantization_config() -> dict:
    """config.json's `quantization_config` of the written checkpoint (compressed-tensors, FP8 dynamic)."""
    args = dict(num_bits=8, type="float", symmetric=True, group_size=None, block_structure=None, actorder=None)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "weights": dict(args, strategy="channel", dynamic=False),
                                          "input_activations": dict(args, strategy="token", dynamic=True),
                                          "output_activations": None}},
            "ignore": IGNORE, "kv_cache_scheme": None, "sparsity_config": {}}


def fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], bfloat16 scale [N, 1]): scale = max|row| / 448 rounded UP to bfloat16 (the
    published checkpoints' scale dtype; rounding up keeps every |w| / scale <= 448, and e4m3 · bf16 is exact in
    float32), values rounded to nearest (ties to even) by the e4m3 cast of w / scale; an all-zero row gets scale 1."""
    w = w.float()
    if not torch.isfinite(w).all():
        raise TensorError("tensor has non-finite values (NaN or inf) and cannot be quantized")
    amax = w.abs().amax(-1, keepdim=True)
    exact = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scale = exact.to(torch.bfloat16)
    low = scale.float() < exact
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    q = (w / scale.float()).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _outputs(ckpt: HFCheckpoint, name: str):
    """(output name, tensor) pairs for one source tensor, read now."""
    st = ckpt.entry(name)
    m = _EXPERTS.match(name)
    if m and st.dtype in FLOAT_DTYPES and len(st.shape) == 3:
        e, n, k = st.shape
        full = ckpt.rows(name, 0, e * n).reshape(e, n, k)
        parts = (("gate_proj", 0, n // 2), ("up_proj", n // 2, n)) if m.group(2) == "gate_up_proj" else (("down_proj", 0, n),)
        for i in range(e):
            for proj, a, b in parts:
                q, s = fp8_channel(full[i, a:b])
                yield f"{m.group(1)}.{i}.{proj}.weight", q
                yield f"{m.group(1)}.{i}.{proj}.weight_scale", s
        return
    if _LINEAR.match(name) and st.dtype in FLOAT_DTYPES and len(st.shape) == 2:
        q, s = fp8_channel(ckpt.rows(name, 0, st.shape[0]))
        yield name, q
        yield name + "_scale", s
        return
    rows = 1
    for d in st.shape[:-1]:
        rows *= d
    yield name, ckpt.rows(name, 0, rows).reshape(st.shape).contiguous()


def quantize_fp8(model_dir, out_dir, progress: bool = True) -> Path:
    """Write the compressed-tensors FP8 checkpoint of `model_dir` at `out_dir` (module docstring)."""
    model_dir, out = Path(model_dir), Path(out_dir).absolute()
    ModelConfig.from_file(model_dir / "config.json")  # a DiffusionGemma checkpoint at all?
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise CheckpointError(f"{model_dir}: already quantized ({cfg['quantization_config'].get('quant_method')}); "
                              "--profile fp8 takes a bf16 checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: output path exists and is not an empty directory; choose a new path or "
                              "remove it first")
    ckpt = HFCheckpoint(model_dir)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shards = _write_shards(ckpt, tmp, progress)
        copy_side_files(model_dir, tmp)
        cfg["quantization_config"] = quantization_config()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    return out


def _write_shards(ckpt: HFCheckpoint, tmp: Path, progress: bool) -> int:
    names = sorted(n for n in ckpt.keys() if not n.startswith("model.encoder.language_model.layers.")
                   or n.endswith("layer_scalar"))
    total = sum(ckpt.entry(n).nbytes for n in names)
    pending, size, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal pending, size
        if pending:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(pending, str(tmp / fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update({k: fname for k in pending})
            pending, size = {}, 0

    with tqdm(total=total, unit="B", unit_scale=True, desc="quantize fp8", disable=not progress) as bar:
        for name in names:
            for out_name, t in _outputs(ckpt, name):
                nbytes = t.numel() * t.element_size()
                if size and size + nbytes > SHARD_BYTES:
                    flush()
                pending[out_name] = t
                size += nbytes
            bar.update(ckpt.entry(name).nbytes)
        flush()
    if len(files) == 1:
        os.rename(tmp / files[0], tmp / "model.safetensors")
    else:
        index = {"metadata": {"total_size": sum((tmp / f).stat().st_size for f in files)}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return len(files)
