"""The reference forward pass of DiffusionGemma, in plain torch, written to be read as the spec.

One set of weights, two passes:

* prefill (the encoder role): causal attention over new tokens; writes every layer's K/V into the
  cache. Input is embed(ids)·sqrt(hidden) straight into layer 0 (no input norm), and each layer's
  output is multiplied by the *encoder's* layer_scalar.
* denoise (the decoder role): a canvas attends bidirectionally to itself and read-only to the
  cache (sliding layers: only the last window-1 cached positions). Input is
  rms_no_scale(embed(canvas)·sqrt(hidden) + SC-MLP(soft embedding of the previous logits)); each
  layer's output is multiplied by the *decoder's* layer_scalar; output logits are
  30·tanh(h·Eᵀ/30) with the embedding E as the tied lm_head.

Checkpoint-specific details that look wrong but are right (docs/ARCHITECTURE.md, 'The model';
transformers is the authority): RMSNorm is x·w (not x·(1+w)); no 1/sqrt(d) attention scale (QK-norm folds it in);
full-attention layers have no v_proj and use the raw k_proj output as V (then a no-scale norm,
no RoPE); RoPE pairs dimension d with d+head_dim/2, and on full layers only the first
partial_rotary_factor·head_dim/2 frequencies rotate, with exponents over the whole head_dim;
each layer runs the dense MLP and the MoE in parallel inside a seven-norm sandwich.

Everything runs in the compute dtype given at load (float32 by default, float64 for oracles).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import DECODER, ENCODER_LAYERS
from ..config import LayerConfig, ModelConfig, cache_tokens
from ..errors import InputError
from .denoiser import Denoiser, one_cache
from .kv_cache import ReferenceKVCache

# ----------------------------------------------------------------------------- building blocks

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma RMSNorm: x / sqrt(mean(x²) + eps) · w  (weight None = the no-scale variant)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gated_mlp(x, gate_w, up_w, down_w):
    return (gelu_tanh(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def rope_inv_freq(layer: LayerConfig, dtype=torch.float64) -> torch.Tensor:
    """head_dim/2 inverse frequencies; the ones past the rotary fraction are 0 (identity rotation)."""
    hd, rope = layer.head_dim, layer.rope
    if rope.rope_type == "proportional":
        angles = int(rope.partial_rotary_factor * hd // 2)
        exps = torch.arange(0, 2 * angles, 2, dtype=dtype) / hd  # over the FULL head_dim
        inv = torch.cat([rope.theta ** -exps, torch.zeros(hd // 2 - angles, dtype=dtype)])
    else:
        inv = rope.theta ** -(torch.arange(0, hd, 2, dtype=dtype) / hd)
    return inv / rope.factor


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; rotates pairs (d, d + hd/2)."""
    # Angles are formed in float32 like transformers, so f32 runs agree to the last bit on position.
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos = ang.cos().to(x.dtype)[:, None, :]
    sin = ang.sin().to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(q, k, v, mask) -> torch.Tensor:
    """q [Tq, H, d], k/v [Tk, KV, d], mask [Tq, Tk] bool (True = may attend). Scale 1 (no 1/sqrt(d))."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def route(x, proj_w, scale, per_expert_scale, top_k: int, eps: float):
    """Router on the residual stream: no-scale norm → ·scale·H^-0.5 → linear → softmax → top-k →
    renormalise → ·per_expert_scale. Equal probabilities go to the lower expert index."""
    h = rms_norm(x, None, eps) * scale * (x.shape[-1] ** -0.5)
    probs = torch.softmax(h @ proj_w.T, dim=-1)
    # A stable descending sort keeps the lower index first among equal probabilities.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, order)
    weights = weights / weights.sum(-1, keepdim=True)
    return order, weights * per_expert_scale[order]


def moe(x, experts_idx, weights, gate_up, down):
    """Each token's output = Σ_k weight_k · expert_k(x). gate_up [E, 2F, H] = [gate‖up], down [E, H, F]."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts_idx).tolist():
        tok, slot = torch.nonzero(experts_idx == e, as_tuple=True)
        gate, up = (x[tok] @ gate_up[e].T).chunk(2, dim=-1)
        y = (gelu_tanh(gate) * up) @ down[e].T
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


# ----------------------------------------------------------------------------- the model

class ReferenceModel:
    """Plain-torch DiffusionGemma. Unbatched: ids are 1-D LongTensors."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, device, dtype,
                 generation_config: dict | None = None, path: Path | None = None, tokenizer=None):
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.generation_config = generation_config or {}
        self.path = path
        self.tokenizer = tokenizer
        self.w = weights
        self.embedding = weights[DECODER + "embed_tokens.weight"]
        self.inv_freq = [rope_inv_freq(l).to(self.device) for l in cfg.layers]

    # -- public API ------------------------------------------------------------------------

    def new_cache(self, max_tokens: int | None = None) -> ReferenceKVCache:
        """A KV cache of max_tokens (default: 8192, or the model's context where smaller; more is refused)."""
        return ReferenceKVCache(self.config, cache_tokens(self.config, max_tokens), self.dtype, self.device)

    def context_buckets(self, cache: ReferenceKVCache) -> list[int]:
        """One bucket: the reference captures nothing per context length."""
        return [cache.max_tokens]

    def denoiser(self, caches) -> Denoiser:
        """A denoise step's device side for `caches` (model/protocol.py): plain `denoise` calls."""
        return Denoiser(self, one_cache(caches))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding[ids] * self.config.embed_scale

    def soft_embed(self, probs: torch.Tensor) -> torch.Tensor:
        return (probs.to(self.dtype) @ self.embedding) * self.config.embed_scale

    @torch.no_grad()
    def prefill(self, cache: ReferenceKVCache, ids: torch.Tensor, embeds: torch.Tensor | None = None,
                image_groups: torch.Tensor | None = None) -> None:
        """Append `ids` to the cache.

        Images (both optional, see diffgemma.vision.merge): `embeds` [T, hidden] replaces embed(ids)
        as the layer-0 input (image soft tokens merged in); `image_groups` [T] gives each row its
        image's index or -1, and rows of the same image also attend to each other bidirectionally.
        """
        ids = self._check_ids(ids, "prefill ids")
        cache.check_room(len(ids))
        start = cache.length
        pos = torch.arange(start, start + len(ids), device=self.device)
        x = self.embed(ids) if embeds is None else self._check_prefill_embeds(embeds, len(ids))
        keys = torch.arange(0, start + len(ids), device=self.device)
        causal = keys[None, :] <= pos[:, None]
        in_window = keys[None, :] > pos[:, None] - self.config.sliding_window  # q sees [q-(W-1), q]
        same_image = None if image_groups is None else self._same_image(image_groups, start, len(ids))
        last = self.config.num_layers - 1
        for layer in self.config.layers:
            mask = causal & in_window if layer.is_sliding else causal
            if same_image is not None:
                mask = mask | same_image
            # The last layer's output is never read on prefill (only its K/V are), so skip its FFN.
            x, k, v = self._layer(layer, x, pos, cache, mask, denoise=False, with_ffn=layer.index != last)
            cache.append(layer.index, k, v)

    @torch.no_grad()
    def denoise(self, cache: ReferenceKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        canvas_ids = self._check_ids(canvas_ids, "canvas ids")
        C = len(canvas_ids)
        if sc_logits is not None and sc_embeds is not None:
            raise InputError("denoise: pass sc_logits or sc_embeds, not both")
        if sc_logits is not None:
            if tuple(sc_logits.shape) != (C, self.config.vocab_size):
                raise InputError(f"denoise: sc_logits has shape {list(sc_logits.shape)}, expected [{C}, {self.config.vocab_size}]")
            work = torch.float64 if self.dtype == torch.float64 else torch.float32
            sc_embeds = self.soft_embed(torch.softmax(sc_logits.to(self.device, work), dim=-1))
        if sc_embeds is not None and tuple(sc_embeds.shape) != (C, self.config.hidden_size):
            raise InputError(f"denoise: sc_embeds has shape {list(sc_embeds.shape)}, expected [{C}, {self.config.hidden_size}]")
        x = self._denoise_input(canvas_ids, sc_embeds)
        start = cache.length
        pos = torch.arange(start, start + C, device=self.device)
        for layer in self.config.layers:
            visible = cache.visible(layer.index, for_denoise=True)[0].shape[1] + C
            mask = torch.ones(C, visible, dtype=torch.bool, device=self.device)  # bidirectional
            x, _, _ = self._layer(layer, x, pos, cache, mask, denoise=True)
        x = rms_norm(x, self.w[DECODER + "norm.weight"], self.config.rms_norm_eps)
        cap = self.config.final_logit_softcapping
        logits = (x @ self.embedding.T).to(torch.float32)
        return cap * torch.tanh(logits / cap)

    # -- internals ---------------------------------------------------------------------------

    def _check_ids(self, ids, what: str) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or len(ids) == 0:
            raise InputError(f"{what}: expected a non-empty 1-D integer tensor, got shape {list(ids.shape)} dtype {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise InputError(f"{what}: ids must be in [0, {self.config.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
        return ids.to(self.device, torch.long)

    def _check_prefill_embeds(self, embeds, T: int) -> torch.Tensor:
        if not isinstance(embeds, torch.Tensor) or tuple(embeds.shape) != (T, self.config.hidden_size):
            got = list(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise InputError(f"prefill: embeds has shape {got}, expected [{T}, {self.config.hidden_size}]")
        return embeds.to(self.device, self.dtype)

    def _same_image(self, image_groups, start: int, T: int) -> torch.Tensor:
        """[T, start+T] bool: query and key rows belong to the same image (cached rows never do)."""
        if not isinstance(image_groups, torch.Tensor) or tuple(image_groups.shape) != (T,):
            got = list(image_groups.shape) if isinstance(image_groups, torch.Tensor) else type(image_groups).__name__
            raise InputError(f"prefill: image_groups has shape {got}, expected [{T}]")
        g = image_groups.to(self.device, torch.long)
        g_keys = torch.cat([torch.full((start,), -1, dtype=torch.long, device=self.device), g])
        return (g[:, None] == g_keys[None, :]) & (g[:, None] >= 0)

    def _denoise_input(self, canvas_ids, sc_embeds):
        """rms_no_scale(embed(canvas) + SC-MLP(RMSNorm_w(soft signal))); a zero signal contributes zero."""
        cfg, p = self.config, DECODER + "self_conditioning."
        x = self.embed(canvas_ids)
        if sc_embeds is not None:
            s = rms_norm(sc_embeds.to(self.dtype), self.w[p + "pre_norm.weight"], cfg.rms_norm_eps)
            x = x + gated_mlp(s, self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"], self.w[p + "down_proj.weight"])
        return rms_norm(x, None, cfg.rms_norm_eps)

    def _layer(self, layer: LayerConfig, x, pos, cache, mask, denoise: bool, with_ffn: bool = True):
        """One transformer layer. Returns (new x, K and V of the new rows as [kv_heads, T, d])."""
        cfg, p, eps = self.config, f"{DECODER}layers.{layer.index}.", self.config.rms_norm_eps
        T, hd = len(pos), layer.head_dim
        h = rms_norm(x, self.w[p + "input_layernorm.weight"], eps)
        q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(T, cfg.num_heads, hd)
        q = apply_rope(rms_norm(q, self.w[p + "self_attn.q_norm.weight"], eps), pos, self.inv_freq[layer.index])
        k_raw = (h @ self.w[p + "self_attn.k_proj.weight"].T).view(T, layer.num_kv_heads, hd)
        # Full layers have no v_proj: V is the raw k_proj output (before k_norm and RoPE).
        v_raw = (h @ self.w[p + "self_attn.v_proj.weight"].T).view_as(k_raw) if layer.has_v_proj else k_raw
        k = apply_rope(rms_norm(k_raw, self.w[p + "self_attn.k_norm.weight"], eps), pos, self.inv_freq[layer.index])
        v = rms_norm(v_raw, None, eps)

        k_old, v_old = cache.visible(layer.index, for_denoise=denoise)  # [kv_heads, T_old, d]
        k_all = torch.cat([k_old.transpose(0, 1), k], dim=0)
        v_all = torch.cat([v_old.transpose(0, 1), v], dim=0)
        a = attention(q, k_all, v_all, mask).reshape(T, -1) @ self.w[p + "self_attn.o_proj.weight"].T
        x = x + rms_norm(a, self.w[p + "post_attention_layernorm.weight"], eps)
        if with_ffn:
            x = self._ffn(layer, x)
        scalar = f"{DECODER}layers.{layer.index}.layer_scalar" if denoise else f"{ENCODER_LAYERS}{layer.index}.layer_scalar"
        return x * self.w[scalar], k.transpose(0, 1), v.transpose(0, 1)

    def _ffn(self, layer: LayerConfig, x):
        """Dense MLP and MoE side by side on the same residual, each inside its own norms (7-norm sandwich)."""
        cfg, p, eps = self.config, f"{DECODER}layers.{layer.index}.", self.config.rms_norm_eps
        dense = gated_mlp(rms_norm(x, self.w[p + "pre_feedforward_layernorm.weight"], eps),
                          self.w[p + "mlp.gate_proj.weight"], self.w[p + "mlp.up_proj.weight"], self.w[p + "mlp.down_proj.weight"])
        dense = rms_norm(dense, self.w[p + "post_feedforward_layernorm_1.weight"], eps)
        idx, wts = route(x, self.w[p + "router.proj.weight"], self.w[p + "router.scale"],
                         self.w[p + "router.per_expert_scale"], cfg.top_k_experts, eps)
        experts = moe(rms_norm(x, self.w[p + "pre_feedforward_layernorm_2.weight"], eps), idx, wts,
                      self.w[p + "experts.gate_up_proj"], self.w[p + "experts.down_proj"])
        experts = rms_norm(experts, self.w[p + "post_feedforward_layernorm_2.weight"], eps)
        return x + rms_norm(dense + experts, self.w[p + "post_feedforward_layernorm.weight"], eps)
