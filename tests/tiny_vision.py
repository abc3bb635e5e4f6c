"""Tiny random multimodal DiffusionGemma checkpoints (text + vision tower) written by transformers.

Like tiny_checkpoints, every weight is random with non-trivial norms and scales, including the
vision tower's (its position table, standardize bias/scale and clipped-linear bounds), so that a
forward that forgets one of them fails. The image token ids sit at the top of the tiny vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from tiny_checkpoints import CONFIGS

# Two towers: different patch / pooling / soft-token budgets (so different image sizes), GQA and
# MHA, with and without standardize and clipped linears. (pooling_kernel_size 1 is left out:
# transformers' pooler then keeps the padding rows instead of the real ones.)
VISION_CONFIGS = {
    "p4_pool2": dict(
        vision=dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, patch_size=4, pooling_kernel_size=2,
                    position_embedding_size=160, standardize=True, use_clipped_linears=True),
        max_soft_tokens=70, text="gqa2_mixed"),
    "p3_pool3": dict(
        vision=dict(model_type="gemma4_vision", hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=3, num_key_value_heads=3, head_dim=8, patch_size=3, pooling_kernel_size=3,
                    position_embedding_size=256, standardize=False, use_clipped_linears=False),
        max_soft_tokens=70, text="mha_realsplit"),
}


def token_ids(vocab_size: int) -> dict:
    return dict(boi_token_id=vocab_size - 3, eoi_token_id=vocab_size - 2, image_token_id=vocab_size - 1)


def build_model(name: str, canvas_length: int = 8, seed: int = 0, bidirectional: bool = True,
                text_config: dict | None = None):
    """A random model with vision tower `name` and its text config (or `text_config` instead)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    spec = VISION_CONFIGS[name]
    text = dict(text_config or CONFIGS[spec["text"]], max_position_embeddings=4096)
    if bidirectional:
        text["use_bidirectional_attention"] = "vision"
    gen = torch.Generator().manual_seed(seed)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=spec["vision"], canvas_length=canvas_length,
                               **token_ids(text["vocab_size"]))
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("scale"):
                p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.25)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif bname.endswith("std_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
            elif bname.endswith("std_scale"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif bname.endswith(("input_min", "output_min")):  # bounds that bite on some activations
                b.fill_(-0.6 - float(torch.rand((), generator=gen)))
            elif bname.endswith(("input_max", "output_max")):
                b.fill_(0.6 + float(torch.rand((), generator=gen)))
    return model


def image_processor(name: str):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    spec = VISION_CONFIGS[name]
    return Gemma4ImageProcessorPil(patch_size=spec["vision"]["patch_size"],
                                   pooling_kernel_size=spec["vision"]["pooling_kernel_size"],
                                   max_soft_tokens=spec["max_soft_tokens"])


def save(model, name: str, directory) -> str:
    """The model's weights and config plus the image processor's settings, as a checkpoint ships them."""
    model.save_pretrained(str(directory))
    image_processor(name).save_pretrained(str(directory))
    return str(directory)


def random_image(height: int, width: int, seed: int, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode=mode)
