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
from typing import Sequence

import torch
import torch.nn.functional as F

from ..checkpoint import DECODER, ENCODER_LAYERS
from ..config import LayerConfig, ModelConfig, cache_tokens
from ..errors import InputError
from ..ops.attention_topk import TopKRule, cache_rule, topk_mask
from .denoiser import Denoiser
from .kv_cache import ReferenceKVCache

# ----------------------------------------------------------------------------- building blocks

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma RMSNorm: x / sqrt(mean(x²) + eps) · w  (weight None = the no-scale variant)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T, the plain product (prefill: one request, its rows in one call)."""
    return x @ w.T


ROW_TILE = 64  # the batched denoise's tensors hold a whole number of these row tiles (docs/ARCHITECTURE.md, 'Batching')


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to a whole number of ROW_TILE rows."""
    pad = (-x.shape[0]) % ROW_TILE
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with a row's result independent of the other rows: the rows go through GEMM calls of exactly ROW_TILE
    rows (the last one zero-padded), so every row meets the same kernel whatever the batch holds. A BLAS picks its
    kernel (and so its reduction order) by the row count; a fixed count fixes it."""
    M = x.shape[0]
    wt = w.T
    return torch.cat([tile @ wt for tile in pad_rows(x).split(ROW_TILE)])[:M]


def gated_mlp(x, gate_w, up_w, down_w, mm=matmul):
    return mm(gelu_tanh(mm(x, gate_w)) * mm(x, up_w), down_w)


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


def attention(q, k, v, mask, topk: TopKRule | None = None) -> torch.Tensor:
    """q [Tq, H, d], k/v [Tk, KV, d], mask [Tq, Tk] bool (True = may attend). Scale 1 (no 1/sqrt(d)).
    topk: each row attends to its top-k visible keys by score only (ops/attention_topk.topk_mask)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k)
    mask = mask[None] if topk is None else topk_mask(scores.float(), mask[None], topk)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def route(x, proj_w, scale, per_expert_scale, top_k: int, eps: float, mm=matmul):
    """Router on the residual stream: no-scale norm → ·scale·H^-0.5 → linear → softmax → top-k →
    renormalise → ·per_expert_scale. Equal probabilities go to the lower expert index."""
    h = rms_norm(x, None, eps) * scale * (x.shape[-1] ** -0.5)
    probs = torch.softmax(mm(h, proj_w), dim=-1)
    # A stable descending sort keeps the lower index first among equal probabilities.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, order)
    weights = weights / weights.sum(-1, keepdim=True)
    return order, weights * per_expert_scale[order]


def moe(x, experts_idx, weights, gate_up, down, mm=matmul, pad=None):
    """Each token's output = Σ_k weight_k · expert_k(x), summed in ascending expert order.
    gate_up [E, 2F, H] = [gate‖up], down [E, H, F]. pad: applied to each expert's rows before its FFN (the batched
    denoise's pad_rows)."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts_idx).tolist():
        tok, slot = torch.nonzero(experts_idx == e, as_tuple=True)
        xe = x[tok] if pad is None else pad(x[tok])
        gate, up = mm(xe, gate_up[e]).chunk(2, dim=-1)
        y = mm(gelu_tanh(gate) * up, down[e])[:len(tok)]
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


# ----------------------------------------------------------------------------- the model

class ReferenceModel:
    """Plain-torch DiffusionGemma: ids are 1-D LongTensors; denoise_batch takes several canvases at once."""

    max_batch: int | None = None  # canvases one forward may take (denoise_batch): any number

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
        """A denoise step's device side for `caches` (model/protocol.py): `denoise` calls for one cache,
        `denoise_batch` for several."""
        return Denoiser(self, caches)

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
            # top-k on the full layers, as the cache asks (a prefill call with images stays dense)
            topk = cache_rule(cache) if not layer.is_sliding and image_groups is None else None
            attend = self._cached_attention(cache, layer, mask, denoise=False, topk=topk)
            x, k, v = self._layer(layer, x, pos, attend, denoise=False, with_ffn=layer.index != last)
            cache.append(layer.index, k, v)

    @torch.no_grad()
    def denoise(self, cache: ReferenceKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One canvas' denoise step: softcapped f32 logits [C, V]. The batch of one (denoise_batch), so a request's
        logits are the same bits alone and beside others."""
        return self.denoise_batch([cache], [canvas_ids], sc_logits=[sc_logits], sc_embeds=[sc_embeds])[0]

    @torch.no_grad()
    def denoise_batch(self, caches: Sequence[ReferenceKVCache], canvases, sc_logits=None,
                      sc_embeds=None) -> list[torch.Tensor]:
        """B canvases, each against its own cache (its own context length, window and positions), in one forward:
        the dense projections, router, SC-MLP, experts and lm_head run over all B·C rows together, attention per
        request.
        canvases: B 1-D id tensors (lengths may differ) or a [B, C] tensor; sc_logits / sc_embeds: None or B entries,
        each None or that request's [C, V] logits / [C, H] soft embedding. Returns B softcapped f32 logits [C, V].

        A request's logits do not depend on what else is in the batch, bit for bit: every tensor holds whole row tiles
        and every row-wise GEMM runs tile by tile (rows_matmul), norms, RoPE, routing and the softcap are per row, the
        experts add their outputs in ascending expert order, and attention reads only the request's own rows and
        cache (docs/ARCHITECTURE.md, 'Batching')."""
        B = len(caches)
        if B == 0 or len(canvases) != B:
            raise InputError(f"denoise_batch: expected one canvas per cache, got {len(canvases)} canvases for {B} "
                             "caches")
        canvases = [self._check_ids(c, "canvas ids") for c in canvases]
        sc_logits = self._per_request(sc_logits, B, "sc_logits")
        sc_embeds = self._per_request(sc_embeds, B, "sc_embeds")
        sc = [self._sc_embeds(len(c), lg, em) for c, lg, em in zip(canvases, sc_logits, sc_embeds)]
        spans, pos, lo = [], [], 0
        for cache, c in zip(caches, canvases):
            spans.append((cache, lo, lo + len(c)))
            pos.append(torch.arange(cache.length, cache.length + len(c), device=self.device))
            lo += len(c)
        # All rows in one tensor of whole row tiles: the pad rows (id 0, position 0, no SC) are computed and dropped.
        # Elementwise kernels treat a tensor's last partial vector apart (a scalar tail, other bits for tanh, exp,
        # sin...), so no real row may ever sit in a tail: each tensor below holds a whole number of tiles.
        pos = pad_rows(torch.cat(pos))
        x = self._denoise_input(pad_rows(torch.cat(canvases)), sc, spans)
        for layer in self.config.layers:
            x, _, _ = self._layer(layer, x, pos, self._batch_attention(layer, spans), denoise=True, mm=rows_matmul,
                                  pad=pad_rows)
        x = rms_norm(x, self.w[DECODER + "norm.weight"], self.config.rms_norm_eps)
        cap = self.config.final_logit_softcapping
        logits = cap * torch.tanh(rows_matmul(x, self.embedding).to(torch.float32) / cap)
        return [logits[lo:hi] for _, lo, hi in spans]

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

    @staticmethod
    def _per_request(values, B: int, what: str) -> list:
        if values is None:
            return [None] * B
        if len(values) != B:
            raise InputError(f"denoise_batch: {what} has {len(values)} entries, expected one per canvas ({B})")
        return list(values)

    def _sc_embeds(self, C: int, sc_logits, sc_embeds):
        """A request's SC signal as a soft embedding [C, H] (or None), from its logits or as given."""
        if sc_logits is not None and sc_embeds is not None:
            raise InputError("denoise: pass sc_logits or sc_embeds, not both")
        if sc_logits is not None:
            if tuple(sc_logits.shape) != (C, self.config.vocab_size):
                raise InputError(f"denoise: sc_logits has shape {list(sc_logits.shape)}, expected [{C}, {self.config.vocab_size}]")
            work = torch.float64 if self.dtype == torch.float64 else torch.float32
            probs = torch.softmax(sc_logits.to(self.device, work), dim=-1).to(self.dtype)
            return rows_matmul(probs, self.embedding.T) * self.config.embed_scale  # soft_embed, row-tiled
        if sc_embeds is not None and tuple(sc_embeds.shape) != (C, self.config.hidden_size):
            raise InputError(f"denoise: sc_embeds has shape {list(sc_embeds.shape)}, expected [{C}, {self.config.hidden_size}]")
        return sc_embeds

    def _denoise_input(self, ids, sc, spans):
        """Per row: rms_no_scale(embed(canvas) + SC-MLP(RMSNorm_w(soft signal))). ids: every row's canvas id; sc: each
        request's [C, H] signal or None. A zero signal contributes exactly zero, so the rows without one (and the pad
        rows) go through the SC-MLP with zeros when any request has a signal."""
        cfg, p = self.config, DECODER + "self_conditioning."
        x = self.embed(ids)
        if any(e is not None for e in sc):
            signal = torch.zeros_like(x)
            for e, (_, lo, hi) in zip(sc, spans):
                if e is not None:
                    signal[lo:hi] = e.to(self.device, self.dtype)
            s = rms_norm(signal, self.w[p + "pre_norm.weight"], cfg.rms_norm_eps)
            x = x + gated_mlp(s, self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"],
                              self.w[p + "down_proj.weight"], mm=rows_matmul)
        return rms_norm(x, None, cfg.rms_norm_eps)

    @staticmethod
    def _cached_attention(cache, layer: LayerConfig, mask, denoise: bool, topk: TopKRule | None = None):
        """Attention of new rows over `cache`'s visible positions and themselves, under `mask` (and `topk`)."""
        def attend(q, k, v):
            k_old, v_old = cache.visible(layer.index, for_denoise=denoise)  # [kv_heads, T_old, d]
            k_all = torch.cat([k_old.transpose(0, 1), k], dim=0)
            v_all = torch.cat([v_old.transpose(0, 1), v], dim=0)
            return attention(q, k_all, v_all, mask, topk)
        return attend

    def _batch_attention(self, layer: LayerConfig, spans):
        """Per-request attention for a batch of canvases: rows lo:hi attend bidirectionally to themselves and to
        their own cache (ragged contexts; nothing crosses requests)."""
        def attend(q, k, v):
            out = torch.zeros_like(q)  # the pad rows attend to nothing
            for cache, lo, hi in spans:
                visible = cache.visible(layer.index, for_denoise=True)[0].shape[1] + hi - lo
                mask = torch.ones(hi - lo, visible, dtype=torch.bool, device=self.device)  # bidirectional
                topk = None if layer.is_sliding else cache_rule(cache)
                out[lo:hi] = self._cached_attention(cache, layer, mask, True, topk)(q[lo:hi], k[lo:hi], v[lo:hi])
            return out
        return attend

    def _layer(self, layer: LayerConfig, x, pos, attend, denoise: bool, with_ffn: bool = True, mm=matmul,
               pad=None):
        """One transformer layer; attend(q, k, v) is its attention over the new rows' q/k/v and what they may read.
        Returns (new x, K and V of the new rows as [kv_heads, T, d])."""
        cfg, p, eps = self.config, f"{DECODER}layers.{layer.index}.", self.config.rms_norm_eps
        T, hd = len(pos), layer.head_dim
        h = rms_norm(x, self.w[p + "input_layernorm.weight"], eps)
        q = mm(h, self.w[p + "self_attn.q_proj.weight"]).view(T, cfg.num_heads, hd)
        q = apply_rope(rms_norm(q, self.w[p + "self_attn.q_norm.weight"], eps), pos, self.inv_freq[layer.index])
        k_raw = mm(h, self.w[p + "self_attn.k_proj.weight"]).view(T, layer.num_kv_heads, hd)
        # Full layers have no v_proj: V is the raw k_proj output (before k_norm and RoPE).
        v_raw = mm(h, self.w[p + "self_attn.v_proj.weight"]).view_as(k_raw) if layer.has_v_proj else k_raw
        k = apply_rope(rms_norm(k_raw, self.w[p + "self_attn.k_norm.weight"], eps), pos, self.inv_freq[layer.index])
        v = rms_norm(v_raw, None, eps)
        a = mm(attend(q, k, v).reshape(T, -1), self.w[p + "self_attn.o_proj.weight"])
        x = x + rms_norm(a, self.w[p + "post_attention_layernorm.weight"], eps)
        if with_ffn:
            x = self._ffn(layer, x, mm, pad)
        scalar = f"{DECODER}layers.{layer.index}.layer_scalar" if denoise else f"{ENCODER_LAYERS}{layer.index}.layer_scalar"
        return x * self.w[scalar], k.transpose(0, 1), v.transpose(0, 1)

    def _ffn(self, layer: LayerConfig, x, mm=matmul, pad=None):
        """Dense MLP and MoE side by side on the same residual, each inside its own norms (7-norm sandwich)."""
        cfg, p, eps = self.config, f"{DECODER}layers.{layer.index}.", self.config.rms_norm_eps
        dense = gated_mlp(rms_norm(x, self.w[p + "pre_feedforward_layernorm.weight"], eps),
                          self.w[p + "mlp.gate_proj.weight"], self.w[p + "mlp.up_proj.weight"], self.w[p + "mlp.down_proj.weight"], mm)
        dense = rms_norm(dense, self.w[p + "post_feedforward_layernorm_1.weight"], eps)
        idx, wts = route(x, self.w[p + "router.proj.weight"], self.w[p + "router.scale"],
                         self.w[p + "router.per_expert_scale"], cfg.top_k_experts, eps, mm)
        experts = moe(rms_norm(x, self.w[p + "pre_feedforward_layernorm_2.weight"], eps), idx, wts,
                      self.w[p + "experts.gate_up_proj"], self.w[p + "experts.down_proj"], mm, pad)
        experts = rms_norm(experts, self.w[p + "post_feedforward_layernorm_2.weight"], eps)
        return x + rms_norm(dense + experts, self.w[p + "post_feedforward_layernorm.weight"], eps)
