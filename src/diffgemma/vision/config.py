"""VisionConfig: the image side of a DiffusionGemma checkpoint, parsed from its config.json.

The checkpoint carries Gemma-4's vision tower (`vision_config`, model_type "gemma4_vision"), the
projector into the text model (`embed_vision`), the special token ids that frame an image in the
prompt, and the text model's attention rule for image tokens (`use_bidirectional_attention`).
The image processor's settings (how many soft tokens an image may become) come from the
checkpoint's processor_config.json / preprocessor_config.json when there is one.

Like ModelConfig, only what the forward pass needs is kept, and anything we cannot honour exactly
(another activation, attention bias, a non-axial RoPE) is refused with a ConfigError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

# The soft-token budgets Gemma-4's image processor accepts (max_soft_tokens).
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
DEFAULT_MAX_SOFT_TOKENS = 280

# transformers' defaults for DiffusionGemmaConfig's token ids and Gemma4VisionConfig's fields.
_DEFAULT_TOKENS = {"boi_token_id": 255_999, "eoi_token_id": 258_882, "image_token_id": 258_880}
_DEFAULT_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                       num_key_value_heads=12, head_dim=64, rms_norm_eps=1e-6, pooling_kernel_size=3,
                       patch_size=16, position_embedding_size=10 * 1024)
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


@dataclass(frozen=True)
class ImageProcessing:
    """How an image becomes pixel patches: transformers' Gemma4ImageProcessor settings."""

    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int = DEFAULT_MAX_SOFT_TOKENS
    rescale_factor: float = 1 / 255

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    # The text model lets the tokens of one image attend to each other both ways during prefill
    # (text_config.use_bidirectional_attention == "vision"); otherwise image tokens are causal like text.
    bidirectional_images: bool
    processing: ImageProcessing

    @staticmethod
    def from_checkpoint(directory: str | Path) -> "VisionConfig":
        """Parse config.json (and the processor settings beside it, if any) of a checkpoint directory."""
        directory = Path(directory)
        path = directory / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: config.json not found (expected a DiffusionGemma checkpoint directory)")
        raw = _read_json(path, "config.json")
        processor = None
        for name in _PROCESSOR_FILES:
            if (directory / name).is_file():
                processor = _read_json(directory / name, name)
                source = str(directory / name)
                break
        else:
            source = None
        return VisionConfig.from_dict(raw, source=str(path), processor=processor, processor_source=source)

    @staticmethod
    def from_dict(raw: dict, source: str = "config.json", processor: dict | None = None,
                  processor_source: str | None = None) -> "VisionConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        vision = raw.get("vision_config")
        if vision is None:
            raise ConfigError(f"{source}: no 'vision_config' (this checkpoint has no vision tower; it cannot take images)")
        if not isinstance(vision, dict):
            raise ConfigError(f"{source}: vision_config must be an object, got {type(vision).__name__}")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: missing 'text_config' object")
        model_type = vision.get("model_type", "gemma4_vision")
        if model_type != "gemma4_vision":
            raise ConfigError(f"{source}: vision_config.model_type is {model_type!r}, expected 'gemma4_vision'")

        def pos_int(where: dict, key: str, prefix: str, default=None) -> int:
            value = where.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{source}: {prefix}.{key} must be a positive integer, got {value!r}")
            return value

        def v(key: str) -> int:
            return pos_int(vision, key, "vision_config", _DEFAULT_VISION.get(key))

        hidden, heads, kv_heads = v("hidden_size"), v("num_attention_heads"), v("num_key_value_heads")
        head_dim = vision.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"{source}: vision_config.head_dim must be a positive integer, got {head_dim!r}")
        if heads % kv_heads:
            raise ConfigError(f"{source}: vision_config.num_attention_heads={heads} is not a multiple of "
                              f"num_key_value_heads={kv_heads}")
        if head_dim % 4:
            # Axial 2-D RoPE rotates x on one half of each head and y on the other, in pairs.
            raise ConfigError(f"{source}: vision_config.head_dim={head_dim} must be a multiple of 4 (2-D RoPE)")
        if vision.get("attention_bias"):
            raise ConfigError(f"{source}: vision_config.attention_bias=true is not supported (the tower has none)")
        activation = vision.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ConfigError(f"{source}: vision_config.hidden_activation={activation!r}, expected 'gelu_pytorch_tanh'")
        rope = vision.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
        if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{source}: vision_config.rope_parameters must have rope_type 'axial', got {rope!r}")
        theta = rope.get("rope_theta", 100.0)
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ConfigError(f"{source}: vision_config.rope_parameters.rope_theta must be a positive number, got {theta!r}")

        tokens = {}
        for key, default in _DEFAULT_TOKENS.items():
            value = raw.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{source}: {key} must be a non-negative integer, got {value!r}")
            tokens[key] = value
        if len(set(tokens.values())) != 3:
            raise ConfigError(f"{source}: boi_token_id, eoi_token_id and image_token_id must differ, got {tokens}")
        text_hidden = pos_int(text, "hidden_size", "text_config")
        vocab = pos_int(text, "vocab_size", "text_config")
        for key, value in tokens.items():
            if value >= vocab:
                raise ConfigError(f"{source}: {key}={value} is outside the vocabulary (text_config.vocab_size={vocab})")
        bidi = text.get("use_bidirectional_attention")
        if bidi not in (None, "vision", "all"):
            raise ConfigError(f"{source}: text_config.use_bidirectional_attention={bidi!r}, expected null or 'vision'")

        patch, pool = v("patch_size"), v("pooling_kernel_size")
        processing = _parse_processing(processor, processor_source, patch, pool)
        return VisionConfig(
            hidden_size=hidden,
            intermediate_size=v("intermediate_size"),
            num_layers=v("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(vision.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            patch_size=patch,
            pooling_kernel_size=pool,
            position_embedding_size=v("position_embedding_size"),
            use_clipped_linears=bool(vision.get("use_clipped_linears", False)),
            standardize=bool(vision.get("standardize", False)),
            text_hidden_size=text_hidden,
            image_token_id=tokens["image_token_id"],
            boi_token_id=tokens["boi_token_id"],
            eoi_token_id=tokens["eoi_token_id"],
            bidirectional_images=bidi == "vision",
            processing=processing,
        )


def _parse_processing(processor: dict | None, source: str | None, patch: int, pool: int) -> ImageProcessing:
    """The image processor's settings; they must agree with the tower's own patch and pooling sizes."""
    if processor is None:
        return ImageProcessing(patch_size=patch, pooling_kernel_size=pool)
    # processor_config.json nests the image processor's settings; preprocessor_config.json is flat.
    settings = processor.get("image_processor", processor)
    if not isinstance(settings, dict):
        raise ConfigError(f"{source}: 'image_processor' must be an object")
    for key, expected in (("patch_size", patch), ("pooling_kernel_size", pool)):
        if key in settings and settings[key] != expected:
            raise ConfigError(f"{source}: image processor {key}={settings[key]!r} disagrees with "
                              f"vision_config.{key}={expected}")
    max_soft = settings.get("max_soft_tokens", DEFAULT_MAX_SOFT_TOKENS)
    if max_soft not in SUPPORTED_SOFT_TOKENS:
        raise ConfigError(f"{source}: max_soft_tokens={max_soft!r}, expected one of {list(SUPPORTED_SOFT_TOKENS)}")
    if settings.get("do_normalize"):
        raise ConfigError(f"{source}: do_normalize=true is not supported (Gemma-4 takes pixels in [0, 1])")
    if settings.get("do_rescale", True) is False:
        raise ConfigError(f"{source}: do_rescale=false is not supported (Gemma-4 takes pixels in [0, 1])")
    resample = settings.get("resample", 3)
    if resample != 3:
        raise ConfigError(f"{source}: resample={resample!r} is not supported, expected 3 (bicubic)")
    factor = settings.get("rescale_factor", 1 / 255)
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ConfigError(f"{source}: rescale_factor must be a positive number, got {factor!r}")
    return ImageProcessing(patch_size=patch, pooling_kernel_size=pool, max_soft_tokens=max_soft,
                           rescale_factor=float(factor))


def _read_json(path: Path, what: str) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw
