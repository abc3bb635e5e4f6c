"""ModelConfig: the architecture of a DiffusionGemma checkpoint, parsed from its config.json.

Only what the forward pass needs is kept, resolved per layer (head_dim, KV heads, RoPE), so the
model code never has to re-interpret transformers' config conventions. Anything we cannot honour
exactly (an unknown rope_type, attention bias, bidirectional encoder) is refused with a ConfigError
rather than silently computed differently.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, InputError

SLIDING = "sliding_attention"
FULL = "full_attention"

# transformers' DiffusionGemmaTextConfig defaults, used when config.json leaves a field out.
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_DEFAULT_GLOBAL_HEAD_DIM = 512
_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default" or "proportional"
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class LayerConfig:
    index: int
    layer_type: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    rope: RopeConfig

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def has_v_proj(self) -> bool:
        # Full-attention layers have no v_proj: V is the raw k_proj output (attention_k_eq_v).
        return self.is_sliding


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layers: tuple[LayerConfig, ...]
    sliding_window: int
    rms_norm_eps: float
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    final_logit_softcapping: float
    canvas_length: int
    pad_token_id: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_activation: str = "gelu_pytorch_tanh"
    max_positions: int | None = None  # text_config.max_position_embeddings: the context the model was made for
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    @staticmethod
    def from_file(path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config.json not found (expected a DiffusionGemma checkpoint directory)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return ModelConfig.from_dict(raw, source=str(path))

    @staticmethod
    def from_dict(raw: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        model_type = raw.get("model_type")
        if model_type != "diffusion_gemma":
            raise ConfigError(f"{source}: model_type is {model_type!r}, expected 'diffusion_gemma'")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: missing 'text_config' object")

        def need(key: str, kind=int):
            if key not in text or text[key] is None:
                raise ConfigError(f"{source}: text_config.{key} is missing")
            value = text[key]
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{source}: text_config.{key} must be a positive integer, got {value!r}")
            return value

        vocab_size = need("vocab_size")
        hidden_size = need("hidden_size")
        intermediate_size = need("intermediate_size")
        num_layers = need("num_hidden_layers")
        num_heads = need("num_attention_heads")
        head_dim = need("head_dim")
        num_kv_heads = need("num_key_value_heads")
        num_experts = need("num_experts")
        top_k = need("top_k_experts")
        moe_intermediate = need("moe_intermediate_size")
        sliding_window = need("sliding_window")
        if top_k > num_experts:
            raise ConfigError(f"{source}: text_config.top_k_experts={top_k} exceeds num_experts={num_experts}")
        if text.get("attention_bias"):
            raise ConfigError(f"{source}: text_config.attention_bias=true is not supported (the model has none)")
        if text.get("use_bidirectional_attention") == "all":
            raise ConfigError(f"{source}: text_config.use_bidirectional_attention='all' is not supported")
        activation = text.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ConfigError(f"{source}: text_config.hidden_activation={activation!r}, expected 'gelu_pytorch_tanh'")

        layers = _layers(text, _layer_types(text, num_layers, source), num_heads, head_dim, num_kv_heads, source)

        max_positions = text.get("max_position_embeddings")
        if max_positions is not None and (not isinstance(max_positions, int) or isinstance(max_positions, bool)
                                          or max_positions <= 0):
            raise ConfigError(f"{source}: text_config.max_position_embeddings must be a positive integer, "
                              f"got {max_positions!r}")
        eos = text.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        canvas = raw.get("canvas_length", 256)
        if not isinstance(canvas, int) or canvas <= 0:
            raise ConfigError(f"{source}: canvas_length must be a positive integer, got {canvas!r}")
        if raw.get("tie_word_embeddings", True) is False or text.get("tie_word_embeddings", True) is False:
            raise ConfigError(f"{source}: tie_word_embeddings=false is not supported (lm_head is the embedding)")

        return ModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            layers=tuple(layers),
            sliding_window=sliding_window,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            num_experts=num_experts,
            top_k_experts=top_k,
            moe_intermediate_size=moe_intermediate,
            final_logit_softcapping=float(text.get("final_logit_softcapping", 30.0) or 30.0),
            canvas_length=canvas,
            pad_token_id=int(text.get("pad_token_id", 0) if text.get("pad_token_id") is not None else 0),
            bos_token_id=text.get("bos_token_id", 2),
            eos_token_ids=eos_ids,
            hidden_activation=activation,
            max_positions=max_positions,
            raw=raw,
        )


def _layer_types(text: dict, num_layers: int, source: str) -> list[str]:
    """text_config.layer_types checked (transformers' default where absent: 5 sliding, then 1 full), the last full."""
    layer_types = text.get("layer_types")
    if layer_types is None:  # transformers' default: 5 sliding : 1 full
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"{source}: text_config.layer_types has {len(layer_types)} entries, expected num_hidden_layers={num_layers}"
        )
    for t in layer_types:
        if t not in (SLIDING, FULL):
            raise ConfigError(f"{source}: text_config.layer_types entry {t!r}, expected {SLIDING!r} or {FULL!r}")
    layer_types[-1] = FULL  # transformers forces the last layer to full attention
    return layer_types


def _layers(text: dict, layer_types: list[str], num_heads: int, head_dim: int, num_kv_heads: int,
            source: str) -> list["LayerConfig"]:
    """Each layer's head dim, KV heads and RoPE: the defaults, per_layer_config's overrides (or transformers'
    fallback: full layers take global_head_dim and the global KV heads if given), each checked."""
    rope_params = text.get("rope_parameters") or _DEFAULT_ROPE
    ropes = {t: _parse_rope(rope_params.get(t), t, source) for t in set(layer_types)}
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        override = {"head_dim": text.get("global_head_dim", _DEFAULT_GLOBAL_HEAD_DIM)}
        if text.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = text["num_global_key_value_heads"]
        per_layer = {str(i): override for i, t in enumerate(layer_types) if t == FULL}
    if not isinstance(per_layer, dict):
        raise ConfigError(f"{source}: text_config.per_layer_config must be an object keyed by layer index")
    layers = []
    for i, t in enumerate(layer_types):
        over = per_layer.get(str(i), per_layer.get(i, {})) or {}
        unknown = set(over) - _PER_LAYER_KEYS
        if unknown:
            raise ConfigError(
                f"{source}: text_config.per_layer_config[{i}] overrides {sorted(unknown)}; "
                f"only {sorted(_PER_LAYER_KEYS)} are supported"
            )
        hd = over.get("head_dim", head_dim)
        kvh = over.get("num_key_value_heads", num_kv_heads)
        if num_heads % kvh:
            raise ConfigError(
                f"{source}: layer {i}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={kvh}"
            )
        rope = ropes[t]
        rotary = int(rope.partial_rotary_factor * hd // 2) if rope.rope_type == "proportional" else hd // 2
        if hd % 2 or rotary > hd // 2:
            raise ConfigError(f"{source}: layer {i}: head_dim={hd} cannot carry its RoPE ({rope})")
        layers.append(LayerConfig(index=i, layer_type=t, head_dim=hd, num_kv_heads=kvh, rope=rope))
    return layers


def _parse_rope(params, layer_type: str, source: str) -> RopeConfig:
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: text_config.rope_parameters.{layer_type} is missing")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ConfigError(
            f"{source}: rope_parameters.{layer_type}.rope_type={rope_type!r}; supported: 'default', 'proportional'"
        )
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: rope_parameters.{layer_type}.rope_theta must be a positive number, got {theta!r}")
    partial = float(params.get("partial_rotary_factor", 1.0))
    if rope_type == "default" and partial != 1.0:
        raise ConfigError(f"{source}: rope_parameters.{layer_type}: partial_rotary_factor needs rope_type 'proportional'")
    return RopeConfig(rope_type=rope_type, theta=float(theta), partial_rotary_factor=partial,
                      factor=float(params.get("factor", 1.0)))


DEFAULT_CONTEXT = 8192  # a KV cache's size when none is asked for, capped at the model's own context


def cache_tokens(config, tokens: int | None = None, name: str = "max_tokens") -> int:
    """The size of a new KV cache: `tokens` checked by `check_context`, or, when None, DEFAULT_CONTEXT capped at the
    model's context."""
    if tokens is None:
        limit = getattr(config, "max_positions", None)
        return DEFAULT_CONTEXT if limit is None else min(DEFAULT_CONTEXT, limit)
    return check_context(config, tokens, name)


def check_context(config, tokens: int, name: str = "max_tokens") -> int:
    """The one rule for how many tokens a KV cache may hold (the CLI's --context, serve's --max-tokens, the API's
    new_cache): a positive number, at most the context the model was made for (`max_positions`, when the config
    gives it). -> tokens; else an InputError naming `name`, the value and the limit."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise InputError(f"{name} {tokens!r}: expected a positive number of tokens")
    limit = getattr(config, "max_positions", None)
    if limit is not None and tokens > limit:
        raise InputError(f"{name} {tokens}: over this model's context of {limit} tokens "
                         f"(text_config.max_position_embeddings); use at most {limit}")
    return tokens
