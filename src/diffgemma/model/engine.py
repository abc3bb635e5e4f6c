"""The fast forward: the reference model's math with fused weights, fused ops and CUDA graphs.

Same public methods as `model/reference.py` (new_cache / prefill / denoise / embed / soft_embed /
embedding / config / generation_config). Precision policy (ARCHITECTURE Part III): activations in
`dtype` (bf16 on the GPU), norms/softmax/router logits/MoE accumulation in f32, KV cache in f16
(`kv_dtype`; the CPU parity tests may ask for f32), logits returned as f32.

Data path of one layer (both passes; only attention differs):
  rms_norm → one qkv GEMM → norm_rope (Q; K and V straight into the cache) → SDPA → o GEMM
  → norm_add (post-attn norm + residual) → ffn_inputs (three norms of one row: dense in, MoE in,
  f32 router in) → dense gate‖up GEMM, down GEMM ∥ router GEMM (f32), route (stable sort:
  ties to the lower expert), sort-by-expert grouped GEMMs → layer_finish (post norms, residual,
  layer scalar).

Attention. The scale is 1 (QK-norm folds it). Prefill: causal, sliding layers restricted to
[q-(W-1), q]; queries run in chunks so the mask never exceeds [chunk, context]. Denoise: the
canvas writes its K/V into per-layer scratch rows of the cache, then attends bidirectionally to
cache+canvas through a per-key mask (it does not depend on the query), so the GQA group folds
into the query length instead of copying K/V once per head.

CUDA graphs. On CUDA, `denoise` replays a graph per (cache, canvas length, context bucket, SC
mode): every quantity that changes between steps (cache length, ring positions) is read from
device tensors, so one capture serves every step at contexts up to the bucket. Attention over the
bucket's padded key range is masked per key.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import InputError
from ..ops.moe import experts_grouped, route
from ..ops.rmsnorm import ffn_inputs, layer_finish, norm_add, rms_norm
from ..ops.rope_kv import norm_rope
from ..ops.rowstats import softcap
from .engine_cache import EngineKVCache
from .engine_weights import DictSource, EngineWeights, load_weights

_BUCKET0 = 1024  # smallest context bucket for graphed denoise; buckets double from here


def build_engine(config: ModelConfig, tensor_source, device, dtype=torch.bfloat16, **kw) -> "Engine":
    """The loader's entry point: read every tensor from `tensor_source` onto `device`, fused and cast."""
    device = torch.device(device)
    return Engine(config, load_weights(config, tensor_source, device, dtype), device=device, dtype=dtype, **kw)


class Engine:
    def __init__(self, config: ModelConfig, weights: EngineWeights, *, device, dtype=torch.bfloat16,
                 kv_dtype=torch.float16, generation_config=None, path=None, tokenizer=None,
                 prefill_chunk: int = 4096, use_graphs: bool | None = None):
        self.config = config
        self.w = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.generation_config = generation_config or {}
        self.path = path
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self._graphs: dict = {}
        self.graph_error: str | None = None  # why graphs were turned off, if they were

    @classmethod
    def from_reference(cls, ref, dtype=torch.bfloat16, device=None, **kw) -> "Engine":
        """An engine over the reference model's weights (its `w` dict of checkpoint-named tensors)."""
        eng = build_engine(ref.config, DictSource(ref.w), device or ref.device, dtype, **kw)
        eng.generation_config, eng.path, eng.tokenizer = ref.generation_config, ref.path, ref.tokenizer
        return eng

    # ------------------------------------------------------------------ public API

    @property
    def embedding(self) -> torch.Tensor:
        return self.w.embed

    def new_cache(self, max_tokens: int = 8192, rewind_slack: int | None = None) -> EngineKVCache:
        return EngineKVCache(self.config, max_tokens, self.device, self.kv_dtype, rewind_slack=rewind_slack)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.w.embed[ids].float() * self.config.embed_scale).to(self.dtype)

    def soft_embed(self, probs: torch.Tensor) -> torch.Tensor:
        return ((probs.to(self.dtype) @ self.w.embed).float() * self.config.embed_scale).to(self.dtype)

    @torch.no_grad()
    def prefill(self, cache: EngineKVCache, ids: torch.Tensor) -> None:
        ids = self._check_ids(ids, "prefill ids", check_range=True)
        cache.check_room(len(ids))
        for s in range(0, len(ids), self.prefill_chunk):
            self._prefill_chunk(cache, ids[s: s + self.prefill_chunk])

    @torch.no_grad()
    def denoise(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        ids = self._check_ids(canvas_ids, "canvas ids", check_range=not canvas_ids.is_cuda)
        C = len(ids)
        if C > cache.canvas:
            raise InputError(f"denoise: canvas of {C} tokens exceeds the cache's canvas scratch ({cache.canvas})")
        if sc_logits is not None and sc_embeds is not None:
            raise InputError("denoise: pass sc_logits or sc_embeds, not both")
        if sc_logits is not None and tuple(sc_logits.shape) != (C, self.config.vocab_size):
            raise InputError(f"denoise: sc_logits has shape {list(sc_logits.shape)}, expected [{C}, {self.config.vocab_size}]")
        if sc_embeds is not None and tuple(sc_embeds.shape) != (C, self.config.hidden_size):
            raise InputError(f"denoise: sc_embeds has shape {list(sc_embeds.shape)}, expected [{C}, {self.config.hidden_size}]")
        mode = "logits" if sc_logits is not None else "embeds" if sc_embeds is not None else "none"
        sc = sc_logits if sc_logits is not None else sc_embeds
        if self.use_graphs and self.device.type == "cuda":
            try:
                return self._denoise_graphed(cache, ids, mode, sc)
            except Exception as e:  # never wrong, only slower: fall back to eager and say why
                self.use_graphs = False
                self.graph_error = f"{type(e).__name__}: {e}"
                warnings.warn(f"diffgemma engine: CUDA graph capture failed, running eager ({self.graph_error})")
        return self._denoise_core(cache, ids, mode, sc, key_rows=cache.length + C)

    # ------------------------------------------------------------------ checks

    def _check_ids(self, ids, what: str, check_range: bool) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or len(ids) == 0:
            raise InputError(f"{what}: expected a non-empty 1-D integer tensor, got shape {list(ids.shape)} dtype {ids.dtype}")
        if check_range and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise InputError(f"{what}: ids must be in [0, {self.config.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
        return ids.to(self.device, torch.long)

    # ------------------------------------------------------------------ the layer

    def _layer(self, li: int, x: torch.Tensor, attend, scalar: float, with_ffn: bool = True) -> torch.Tensor:
        cfg, lw, eps = self.config, self.w.layers[li], self.config.rms_norm_eps
        layer = cfg.layers[li]
        nq, nk = cfg.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        h = rms_norm(x, lw.input_norm, eps)
        qkv = h @ lw.qkv.T
        q_raw, k_raw = qkv[:, :nq], qkv[:, nq: nq + nk]
        v_raw = qkv[:, nq + nk:] if layer.has_v_proj else k_raw  # full layers: V = raw k_proj output
        a = attend(li, q_raw, k_raw, v_raw) @ lw.o.T
        x = norm_add(x, a, lw.post_attn_norm, eps)
        if not with_ffn:
            return x * scalar
        dense_in, moe_in, router_in = ffn_inputs(x, lw.pre_ff_norm, lw.pre_ff2_norm, lw.router_in_scale, eps)
        gu = dense_in @ lw.mlp_gu.T
        half = gu.shape[1] // 2
        dense = (F.gelu(gu[:, :half].float(), approximate="tanh") * gu[:, half:].float()).to(x.dtype) @ lw.mlp_down.T
        weights, experts = route(router_in @ lw.router_w.T, cfg.top_k_experts, lw.per_expert_scale)
        moe = experts_grouped(moe_in, weights, experts, lw.experts_gu, lw.experts_down)
        return layer_finish(x, dense, moe, lw.post_ff1_norm, lw.post_ff2_norm, lw.post_ff_norm, scalar, eps)

    def _qkv_heads(self, li, q_raw, k_raw, v_raw):
        layer = self.config.layers[li]
        T, hd = q_raw.shape[0], layer.head_dim
        return (q_raw.view(T, self.config.num_heads, hd), k_raw.view(T, layer.num_kv_heads, hd),
                v_raw.view(T, layer.num_kv_heads, hd))

    # ------------------------------------------------------------------ prefill (causal, writes the cache)

    def _prefill_chunk(self, cache: EngineKVCache, ids: torch.Tensor) -> None:
        cfg, eps, W = self.config, self.config.rms_norm_eps, self.config.sliding_window
        P, n = cache.length, len(ids)
        pos = torch.arange(P, P + n, device=self.device)
        # masks (True = may attend): full = causal over [0, P+n); sliding = ring slots then the chunk itself
        full_mask = torch.arange(P + n, device=self.device)[None, :] <= pos[:, None]
        sp = cache.slot_pos
        ring_ok = (sp[None, :] >= 0) & (sp[None, :] > pos[:, None] - W)
        i = torch.arange(n, device=self.device)
        own_ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
        slide_mask = torch.cat([ring_ok, own_ok], dim=1)
        ring_slots = cache.ring_slots(pos, P + n)
        tail = max(0, n - cache.ring)  # the first `tail` chunk positions are overwritten within the chunk
        R = cache.ring

        def attend(li, q_raw, k_raw, v_raw):
            layer, lw = cfg.layers[li], self.w.layers[li]
            qh, kh, vh = self._qkv_heads(li, q_raw, k_raw, v_raw)
            q = norm_rope(qh, lw.q_norm, lw.inv_freq, pos, eps, out_dtype=self.kv_dtype)
            K, V = cache.keys[li], cache.values[li]
            if layer.is_sliding:
                # Attend over the ring as it was before this chunk, then store the chunk: a long chunk's
                # own writes would otherwise clobber window positions its earlier queries still need.
                k = norm_rope(kh, lw.k_norm, lw.inv_freq, pos, eps, out_dtype=self.kv_dtype)
                v = norm_rope(vh, None, None, pos, eps, out_dtype=self.kv_dtype)
                Kx = torch.cat([K[:, :R], k.transpose(0, 1)], dim=1)
                Vx = torch.cat([V[:, :R], v.transpose(0, 1)], dim=1)
                o = self._sdpa_causal(q, Kx, Vx, slide_mask)
                K.index_copy_(1, ring_slots[tail:], k[tail:].transpose(0, 1))
                V.index_copy_(1, ring_slots[tail:], v[tail:].transpose(0, 1))
            else:
                norm_rope(kh, lw.k_norm, lw.inv_freq, pos, eps, out_dtype=self.kv_dtype, cache=K, slots=pos)
                norm_rope(vh, None, None, pos, eps, out_dtype=self.kv_dtype, cache=V, slots=pos)
                o = self._sdpa_causal(q, K[:, : P + n], V[:, : P + n], full_mask)
            return o.reshape(n, -1).to(self.dtype)

        x = self.embed(ids)  # no input norm on the encoder pass
        last = cfg.num_layers - 1
        for li in range(cfg.num_layers):
            # the last layer's output is never read on prefill (only its K/V), so skip its FFN
            x = self._layer(li, x, attend, self.w.layers[li].prefill_scalar, with_ffn=li != last)
        cache.advance(pos, P + n)

    def _sdpa_causal(self, q, K, V, mask, q_block: int = 2048):
        """q [n, H, d]; K/V [KV, S, d]; mask [n, S] -> [n, H, d]. Query blocks bound the mask/score memory."""
        H, KV = q.shape[1], K.shape[0]
        Kx = K.repeat_interleave(H // KV, dim=0)[None]
        Vx = V.repeat_interleave(H // KV, dim=0)[None]
        qh = q.transpose(0, 1)[None]  # [1, H, n, d]
        out = torch.empty_like(qh)
        for s in range(0, q.shape[0], q_block):
            out[:, :, s: s + q_block] = F.scaled_dot_product_attention(
                qh[:, :, s: s + q_block], Kx, Vx, attn_mask=mask[None, None, s: s + q_block], scale=1.0)
        return out[0].transpose(0, 1)

    # ------------------------------------------------------------------ denoise (bidirectional canvas, read-only cache)

    def _denoise_core(self, cache: EngineKVCache, ids, mode: str, sc, key_rows: int) -> torch.Tensor:
        """One denoise forward. Only device tensors describe the context (graph-safe). key_rows = rows of
        each full-attention cache the canvas reads (>= cache.length + C; rows past that are masked)."""
        cfg, eps, W, dev = self.config, self.config.rms_norm_eps, self.config.sliding_window, self.device
        C = len(ids)
        L = cache.length_t
        ar = torch.arange(C, device=dev)
        pos = L + ar
        x = self.embed(ids)
        if mode != "none":
            s = self.soft_embed(torch.softmax(sc.float(), dim=-1)) if mode == "logits" else sc.to(self.dtype)
            s = rms_norm(s, self.w.sc_pre_norm, eps)
            gu = s @ self.w.sc_gu.T
            half = gu.shape[1] // 2
            s = (F.gelu(gu[:, :half].float(), approximate="tanh") * gu[:, half:].float()).to(self.dtype) @ self.w.sc_down.T
            x = rms_norm(x.float() + s.float(), None, eps, out_dtype=self.dtype)
        else:  # a zero SC signal goes through the SC MLP as exactly zero
            x = rms_norm(x, None, eps)

        R = cache.ring
        sp = cache.slot_pos
        slide_mask = torch.cat([(sp >= 0) & (sp > L - W), torch.ones(C, dtype=torch.bool, device=dev)])
        full_mask = torch.arange(key_rows, device=dev) < L + C
        full_slots = pos
        ring_canvas_slots = R + ar

        def attend(li, q_raw, k_raw, v_raw):
            layer, lw = cfg.layers[li], self.w.layers[li]
            qh, kh, vh = self._qkv_heads(li, q_raw, k_raw, v_raw)
            K, V = cache.keys[li], cache.values[li]
            slots = ring_canvas_slots if layer.is_sliding else full_slots
            q = norm_rope(qh, lw.q_norm, lw.inv_freq, pos, eps, out_dtype=self.kv_dtype)
            norm_rope(kh, lw.k_norm, lw.inv_freq, pos, eps, out_dtype=self.kv_dtype, cache=K, slots=slots)
            norm_rope(vh, None, None, pos, eps, out_dtype=self.kv_dtype, cache=V, slots=slots)
            if layer.is_sliding:
                Kx, Vx, mask = K, V, slide_mask
            else:
                Kx, Vx, mask = K[:, :key_rows], V[:, :key_rows], full_mask
            H, KV, d = cfg.num_heads, layer.num_kv_heads, layer.head_dim
            # the mask depends only on the key, so fold the GQA group into the query length
            qg = q.transpose(0, 1).reshape(KV, (H // KV) * C, d)
            o = F.scaled_dot_product_attention(qg[None], Kx[None], Vx[None], attn_mask=mask[None, None, None, :],
                                               scale=1.0)
            return o[0].reshape(H, C, d).transpose(0, 1).reshape(C, H * d).to(self.dtype)

        for li in range(cfg.num_layers):
            x = self._layer(li, x, attend, self.w.layers[li].denoise_scalar)
        x = rms_norm(x, self.w.final_norm, eps)
        return softcap(x @ self.w.embed.T, cfg.final_logit_softcapping)

    def context_bucket(self, cache: EngineKVCache) -> int:
        b = _BUCKET0
        while b < cache.length:
            b *= 2
        return min(b, cache.max_tokens)

    def _denoise_graphed(self, cache: EngineKVCache, ids, mode: str, sc) -> torch.Tensor:
        C = len(ids)
        key_rows = self.context_bucket(cache) + C
        key = (id(cache), C, key_rows, mode)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(cache, C, key_rows, mode, sc)
            self._graphs[key] = entry
        graph, ids_buf, sc_buf, out = entry
        ids_buf.copy_(ids)
        if sc_buf is not None:
            sc_buf.copy_(sc)
        graph.replay()
        return out.clone()  # the static buffer is overwritten by the next replay

    def _capture(self, cache, C, key_rows, mode, sc):
        ids_buf = torch.zeros(C, dtype=torch.long, device=self.device)
        sc_buf = None if mode == "none" else torch.zeros(sc.shape, dtype=sc.dtype, device=self.device)
        if sc_buf is not None:
            sc_buf.copy_(sc)
        # Warm up on a side stream (Triton compile, cuBLAS workspaces), then capture. The warm-up
        # writes only canvas scratch rows of the cache, which no read outside a denoise sees.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._denoise_core(cache, ids_buf, mode, sc_buf, key_rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._denoise_core(cache, ids_buf, mode, sc_buf, key_rows)
        return graph, ids_buf, sc_buf, out
