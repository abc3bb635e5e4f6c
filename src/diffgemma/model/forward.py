"""The fast forward: the reference model's math (model/reference.py) with fused weights and fused ops.

Precision (docs/ARCHITECTURE.md, 'Precision'): activations in `dtype` (bf16 on the GPU), norms / softmax / router
logits / MoE accumulation in f32, KV cache in `kv_dtype` (f16; the CPU parity tests may ask for f32). `denoise`
returns the logits before the final softcap, in `dtype`.

Data path of one layer (both passes; only the attention mask and the cache slots differ), with the number of
launches on CUDA:
  qkv GEMM (1; its input norm came fused with the previous layer's finish)
  -> qkv_prep (1: Q/K norm + RoPE, V no-scale norm, K/V into the cache, Q head-major)
  -> attention (1: flash-style Triton, GQA folded, masked key blocks skipped; the full layers' denoise canvas
     instead (3): a Triton Q.K^T with the softmax per key tile in its epilogue, the tiles' weights, a Triton P.V)
  -> o GEMM (1) -> attn_finish (1: post-attn norm + residual + the dense / MoE / router input norms)
  -> dense gate||up GEMM, gelu.up, down GEMM (3; at up to OVERLAP_ROWS rows on all SMs but DENSE_SM_CARVEOUT)
     beside it on a side stream (CUDA), joined before the expert GEMMs:
  -> route_fused (2: f32 router logits from a bf16x3 GEMM; softmax, top-k ties -> lower expert, renorm, scale)
  -> moe_plan (1: stable expert grouping, and the experts by row count: the GEMMs' launch order)
  -> grouped expert GEMMs (2-4) -> layer_finish_moe (1: un-permute + weighted sum in f32, post norms, residual,
     layer scalar, and the next layer's input norm).
Every op dispatches to its torch twin off CUDA, so the CPU parity tests run this same structure. Weights held in FP8
(ops/fp8_weight.Fp8Weight) run on the FP8 GEMMs, their input quantized per token (ops/fp8_linear.py, fp8_moe.py):
by the norm that makes it (attn_finish, layer_finish_moe) where there is one.

Attention. The scale is 1 (QK-norm folds it). Prefill: causal, sliding layers restricted to (q-W, q], over the ring as
it was before the chunk followed by the chunk's own K/V (the ring is updated after). Denoise: the canvas writes its
K/V into per-layer scratch rows of the cache and attends bidirectionally to the visible cache rows and itself. Only
device tensors describe the context (cache.length_t, cache.slot_pos), so a denoise can be captured once as a CUDA
graph and replayed at every step (model/engine.py).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..ops import moe_paths
from ..ops.fp8_linear import gated_mlp, linear
from ..ops.fp8_weight import Fp8Weight
from ..ops.packed_weight import PackedWeight
from ..ops._backend import use_triton
from ..ops.attention import NO_WINDOW, attention
from ..ops.attention_topk import attention_topk, cache_rule
from ..ops.moe import expert_ffn
from ..ops.moe_plan import moe_plan, moe_plan_with_order
from ..ops.qkv import qkv_prep
from ..ops.rmsnorm import attn_finish, embed_sc_norms, layer_finish_moe, rms_norm
from ..ops.route import route_fused
from ..ops.rowstats import tempered_masked_probs, tempered_rowstats
from ..ops.sm_carveout import cublas_sm_carveout
from .engine_cache import EngineKVCache
from .engine_inputs import prefill_chunks
from .engine_weights import EngineWeights
from .lane_attention import lanes_attend
from .options import EngineOptions

# Up to this many rows (the denoise canvas, a committed block's prefill) the router chain runs on a side stream
# beside the dense MLP, whose GEMMs leave it DENSE_SM_CARVEOUT SMs (docs/ARCHITECTURE.md, 'Overlap'). A prefill
# chunk's kernels fill the GPU by themselves.
OVERLAP_ROWS = 512
DENSE_SM_CARVEOUT = 16


class Forward:
    """Weights, the prefill pass (writes the cache) and the denoise pass (reads it, returns raw logits)."""

    def __init__(self, config: ModelConfig, weights: EngineWeights, *, device, dtype=torch.bfloat16,
                 kv_dtype=torch.float16, options: EngineOptions | None = None):
        self.config = config
        self.w = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.options = options or EngineOptions()
        self._side_stream = None  # the router chain's (CUDA)
        self._lane_stream_pool: list = []  # a batched denoise's lane streams (CUDA)
        self._canvas_rows_cache: dict = {}
        self._lane_rows: int | None = None  # during a batched denoise: one lane's rows (options.batch_paths)

    @property
    def embedding(self) -> torch.Tensor:
        return self.w.embed

    def new_cache(self, max_tokens: int = 8192, rewind_slack: int | None = None) -> EngineKVCache:
        return EngineKVCache(self.config, max_tokens, self.device, self.kv_dtype, rewind_slack=rewind_slack)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.w.embed[ids].float() * self.config.embed_scale).to(self.dtype)

    def soft_embed(self, probs: torch.Tensor) -> torch.Tensor:
        return ((probs.to(self.dtype) @ self.w.embed).float() * self.config.embed_scale).to(self.dtype)

    # ------------------------------------------------------------------ prefill (causal, writes the cache)

    @torch.no_grad()
    def prefill(self, cache: EngineKVCache, ids: torch.Tensor, embeds: torch.Tensor | None = None,
                groups: torch.Tensor | None = None) -> None:
        """ids: checked, on the device. Writes their K/V into the cache, a chunk at a time. embeds [n, hidden] (the
        layer-0 input in place of embed(ids)) and groups [n] (each row's image or -1: rows of one image also attend
        to each other both ways): checked, on the device, or None. A chunk never splits an image."""
        chunk = self.options.prefill_chunk
        for s, e in prefill_chunks(len(ids), chunk, groups):
            self._prefill_chunk(cache, ids[s: e], None if embeds is None else embeds[s: e],
                                None if groups is None else groups[s: e])
        if self._dequantizes_in_prefill(min(len(ids), chunk)):
            # A packed model's prefill dequantizes each layer's expert stack into a bf16 scratch (1 GB at full
            # size; ops/moe_paths.PREFILL_ROWS); it goes back to the device, not to the allocator's cache.
            torch.cuda.empty_cache()

    def _prefill_chunk(self, cache: EngineKVCache, ids: torch.Tensor, embeds=None, groups=None) -> None:
        cfg, W, dev = self.config, self.config.sliding_window, self.device
        P, n, R = cache.length, len(ids), cache.ring
        pos = torch.arange(P, P + n, device=dev)
        full_kpos = torch.arange(P + n, device=dev)  # full layers: row p holds position p
        slide_kpos = torch.cat([cache.slot_pos, pos])  # the ring before this chunk, then the chunk itself
        ring_slots = cache.ring_slots(pos, P + n)
        tail = max(0, n - R)  # the first `tail` chunk positions are overwritten within the chunk
        # The image overlay (torch attention): each query's image, and each key's (cached rows are never in one)
        slide_groups = full_groups = None
        if groups is not None and bool((groups >= 0).any()):
            slide_groups = (groups, torch.cat([groups.new_full((R,), -1), groups]))
            full_groups = (groups, torch.cat([groups.new_full((P,), -1), groups]))

        def attend(li, qkv, need_out, topk=cache_rule(cache)):  # topk: the full layers' rule, None = dense
            K, V = cache.keys[li], cache.values[li]
            if cfg.layers[li].is_sliding:  # (the last layer is always full: need_out is True here)
                # Attend over the ring as it was before this chunk, then store the chunk: a long chunk's own writes
                # would otherwise clobber window positions its earlier queries still need.
                q, kv, Kx, Vx = self._ring_and_chunk(li, qkv, pos, K, V, R, cache.canvas)
                o = attention(q, Kx, Vx, slide_kpos, R + n, qpos=pos, window=W, causal=True, out_dtype=self.dtype,
                              impl=self._causal_impl(n), n_ring=R, base_pos=P, groups=slide_groups,
                              ring_end=cache.length_t)
                K.index_copy_(1, ring_slots[tail:], kv[0][:, tail:])
                V.index_copy_(1, ring_slots[tail:], kv[1][:, tail:])
                return o
            q, _ = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=pos)
            if not need_out:
                return None
            if topk is not None and groups is None:  # a prefill call with images stays dense (docs/ARCHITECTURE.md)
                return attention_topk(q, K, V, full_kpos, P + n, topk, qpos=pos, causal=True, out_dtype=self.dtype,
                                      q_start=P)
            return attention(q, K, V, full_kpos, P + n, qpos=pos, window=NO_WINDOW, causal=True, out_dtype=self.dtype,
                             impl=self._causal_impl(n), groups=full_groups)

        x = self.embed(ids) if embeds is None else embeds  # no SC norm on the encoder pass
        self._run_layers(x, [lw.prefill_scalar for lw in self.w.layers], attend, False, None)
        cache.advance(pos, P + n)

    def prefill_padded(self, cache: EngineKVCache, ids: torch.Tensor, n_real: torch.Tensor, key_rows: int) -> None:
        """The prefill of the first `n_real` (an int64 device scalar) of `ids` (N rows, the rest padding), described
        by device tensors alone (cache.length_t, cache.slot_pos, n_real), so one CUDA graph per (N, key_rows) serves
        every call. Needs N <= cache.ring and cache.length + N <= the full layers' rows (Engine.prefill_pad checks).

        Pad rows come after every real row, so causal attention keeps them out of the real rows' results. Their K/V
        land in full-layer rows past the cache's length (the denoise scratch, overwritten by the next write) and, on
        sliding layers, over their ring slot's own contents (written back unchanged); slot_pos and length_t advance
        by n_real. The host's `cache.length` is the caller's to advance. key_rows: the full-layer cache rows the
        attention may read (>= cache.length + N; rows past a query's position are masked).

        Sliding attention takes positions shifted by ring - length (the ring's positions stay >= 0; the kernel's
        base position is then the host constant `ring`): masks depend on position differences only."""
        attend, finish = self.padded_lane(cache, len(ids), n_real, key_rows)
        self._run_layers(self.embed(ids), [lw.prefill_scalar for lw in self.w.layers], attend, False, None)
        finish()

    def padded_lane(self, cache: EngineKVCache, N: int, n_real: torch.Tensor, key_rows: int):
        """One lane of a padded prefill of N rows: (attend(li, qkv, need_out) over its cache, finish() which advances
        the cache's device positions once the layers ran)."""
        cfg, W = self.config, self.config.sliding_window
        R = cache.ring
        P, sp = cache.length_t, cache.slot_pos
        ar = self._canvas_rows(N, R)[0]
        pos = P + ar
        real = ar < n_real
        end = P + n_real
        slots = torch.remainder(pos, R)  # distinct (N <= R)
        rel_ring = torch.where(sp >= 0, sp - P + R, torch.full_like(sp, -1))
        slide_kpos = torch.cat([rel_ring, R + ar])
        slide_qpos = R + ar
        full_kpos = self._rows_arange(key_rows)

        chunk_end = P + N  # the keys a kernel may skip past (pad rows too: each sees at least itself)
        in_scratch = N <= cache.canvas
        if in_scratch:  # pad rows store into their own canvas scratch row, where their K/V already are
            ring_w = torch.where(real, slots, R + ar)

        def keep_pad(new, old):  # real rows' K/V, and the pad rows' slots as they were
            return torch.where(real[None, :, None], new, old)

        def attend(li, qkv, need_out, topk=cache_rule(cache)):  # topk: the full layers' rule, None = dense
            K, V = cache.keys[li], cache.values[li]
            if cfg.layers[li].is_sliding:
                q, kv, Kx, Vx = self._ring_and_chunk(li, qkv, pos, K, V, R, cache.canvas)
                o = attention(q, Kx, Vx, slide_kpos, R + N, qpos=slide_qpos, window=W, causal=True,
                              out_dtype=self.dtype, impl=self._causal_impl(N), n_ring=R, base_pos=R, ring_end=P)
                if in_scratch:
                    K.index_copy_(1, ring_w, kv[0])
                    V.index_copy_(1, ring_w, kv[1])
                else:
                    K.index_copy_(1, slots, keep_pad(kv[0], K[:, slots]))
                    V.index_copy_(1, slots, keep_pad(kv[1], V[:, slots]))
                return o
            q, _ = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=pos)
            if not need_out:
                return None
            if topk is not None:
                return attention_topk(q, K, V, full_kpos, key_rows, topk, qpos=pos, causal=True, out_dtype=self.dtype)
            return attention(q, K, V, full_kpos, key_rows, qpos=pos, window=NO_WINDOW, causal=True,
                             out_dtype=self.dtype, impl=self._causal_impl(N), nlive=chunk_end)

        def finish():
            sp.index_copy_(0, slots, torch.where(real, pos, sp[slots]))
            cache.length_t.copy_(end)

        return attend, finish

    def _rows_arange(self, n: int) -> torch.Tensor:
        """arange(n) on the device, made once per n: a constant a graph reads."""
        key = ("rows", n)
        rows = self._canvas_rows_cache.get(key)
        if rows is None:
            rows = self._canvas_rows_cache[key] = torch.arange(n, device=self.device)
        return rows

    def _ring_and_chunk(self, li, qkv, pos, K, V, R: int, canvas: int):
        """A sliding layer's prefill chunk: -> (q, the chunk's dense K/V, keys, values), the keys and values being the
        ring as it was before the chunk followed by the chunk's own rows. A chunk of up to a canvas of rows writes
        its K/V into the cache's canvas scratch rows, right after the ring, so the cache buffers are those keys as
        they lie; a longer one is concatenated after a copy of the ring."""
        n = len(pos)
        if n <= canvas:
            q, kv = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=self._canvas_rows(n, R)[1], dense_kv=True)
            return q, kv, K, V
        q, kv = self._qkv(li, qkv, pos, dense_kv=True)
        return q, kv, torch.cat([K[:, :R], kv[0]], 1), torch.cat([V[:, :R], kv[1]], 1)

    def _causal_impl(self, n: int) -> str | None:
        """The causal attention of an n-row prefill chunk: a forced `attn_impl`, else the tile kernels up to
        options.causal_tiles_rows rows (a commit, a short turn), else the dispatcher's default (the flash kernel)."""
        if self.attn_impl is None and n <= self.options.causal_tiles_rows:
            return "tiles"
        return self.attn_impl

    def _dequantizes_in_prefill(self, chunk: int) -> bool:
        cfg = self.config
        return (self.device.type == "cuda" and isinstance(self.w.layers[0].experts_gu, PackedWeight)
                and moe_paths.dequantizes_for(chunk * cfg.top_k_experts / cfg.num_experts))

    # ------------------------------------------------------------------ denoise (bidirectional canvas, read-only cache)

    def denoise(self, cache: EngineKVCache, ids, mode: str, sc, key_rows: int) -> torch.Tensor:
        """One denoise forward -> the logits before the softcap, [C, V] in the model's dtype. mode: 'none' / 'logits'
        / 'embeds' (what `sc` is). key_rows: rows of each full-attention cache the canvas reads (>= cache.length + C;
        rows past that are masked)."""
        x, h = self._canvas_input(ids, mode, sc)
        attend = self._canvas_attention(cache, len(ids), key_rows)
        h = self._run_layers(x, [lw.denoise_scalar for lw in self.w.layers], attend, True, self.w.final_norm, h=h)
        return h @ self.w.embed.T if self.w.lm_head is None else linear(h, self.w.lm_head)

    def denoise_batch(self, caches, ids, sc, has_sc, lens, key_rows, out=None) -> torch.Tensor:
        """B canvases, each against its own cache, in one forward -> raw logits [sum(lens), V] (lane b's rows follow
        lane a's), written into `out` when given. ids: the canvases' ids, concatenated; lens: each lane's canvas
        length; key_rows: each lane's, as in denoise. sc: [rows, H] SC embeddings in the model's dtype (any finite
        value on a lane without one); has_sc: [rows] bool, whether a row's lane self-conditions (a lane that had SC
        logits passes their soft embedding, `sc_logits_embeds`).

        The projections, router, experts and lm_head run over all lanes' rows at once (one weight read); each row's
        input is what denoise computes for it alone (both input paths run, a select per row keeps its own), and each
        lane attends to its own cache only (docs/ARCHITECTURE.md, 'Batching')."""
        x_sc, h_sc = self._canvas_input(ids, "embeds", sc)
        x0, _ = self._canvas_input(ids, "none", None)
        h0 = rms_norm(x0, self.w.layers[0].input_norm, self.config.rms_norm_eps)  # as _run_layers makes it alone
        pick = has_sc[:, None]
        x, h = torch.where(pick, x_sc, x0), torch.where(pick, h_sc, h0)
        lanes, lo = [], 0
        for cache, C, rows in zip(caches, lens, key_rows):
            lanes.append((lo, lo + C, self._canvas_attention(cache, C, rows)))
            lo += C

        attend = lanes_attend(self.w.layers, lanes, self._lane_streams(len(lanes)), self.device)
        self._lane_rows = max(lens)  # lanes of one length (batch.py groups them): each lane's own
        try:
            h = self._run_layers(x, [lw.denoise_scalar for lw in self.w.layers], attend, True, self.w.final_norm, h=h)
        finally:
            self._lane_rows = None
        if self.w.lm_head is not None:  # a checkpoint's FP8 lm_head
            y = linear(h, self.w.lm_head)
            return y if out is None else out.copy_(y)
        return torch.matmul(h, self.w.embed.T, out=out)

    def _lane_streams(self, n: int):
        """n streams for a batched denoise's lanes (options.lane_streams, CUDA, n > 1), else None. Safe for the caching
        allocator without record_stream, as the router's stream is: a lane's tensors are last read by the join's
        concatenation on the layer's stream, and the next fork orders the lane's stream after it."""
        if self.device.type != "cuda" or n < 2 or not self.options.lane_streams:
            return None
        while len(self._lane_stream_pool) < n:
            self._lane_stream_pool.append(torch.cuda.Stream(self.device))
        return self._lane_stream_pool[:n]

    def sc_logits_embeds(self, sc_logits: torch.Tensor) -> torch.Tensor:
        """SC logits -> their soft embedding, by the same ops denoise's 'logits' mode runs (so a batched lane fed
        this gets the bits that mode gives)."""
        return self.soft_embed(self._sc_probs(sc_logits))

    def _canvas_input(self, ids, mode: str, sc):
        """The canvas' embedding with its SC signal -> (x, the first layer's input norm of x, or None: not made)."""
        cfg, eps = self.config, self.config.rms_norm_eps
        if mode == "none":  # a zero SC signal goes through the SC MLP as exactly zero
            return rms_norm(self.embed(ids), None, eps), None
        s = self.sc_logits_embeds(sc) if mode == "logits" else sc.to(self.dtype)
        s = self._sc_mlp(rms_norm(s, self.w.sc_pre_norm, eps))
        return embed_sc_norms(ids, self.w.embed, cfg.embed_scale, s, self.w.layers[0].input_norm, eps, self.dtype)

    def _canvas_attention(self, cache: EngineKVCache, C: int, key_rows: int):
        """attend(li, qkv, need_out) for a canvas of C rows over `cache`: its K/V go to the cache's canvas scratch
        rows, and it attends bidirectionally to the visible cache rows and itself."""
        cfg, W = self.config, self.config.sliding_window
        L, R = cache.length_t, cache.ring
        ar, ring_canvas_slots = self._canvas_rows(C, R)
        pos = L + ar
        live = self.options.sliding_live_window
        slide_kpos = None if live else self._slide_kpos(cache, C)
        slide_kw = dict(window=W, n_ring=R, ring_length=L) if live else {}
        nlive = L + C  # device scalar: the kernel's loop bound over a graph's padded bucket

        def attend(li, qkv, need_out, topk=cache_rule(cache)):  # topk: the full layers' rule, None = dense
            K, V = cache.keys[li], cache.values[li]
            if cfg.layers[li].is_sliding:
                q, _ = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=ring_canvas_slots)
                return attention(q, K, V, slide_kpos, R + C, out_dtype=self.dtype, impl=self._attn_impl(True, False),
                                 **slide_kw)
            q, _ = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=pos)
            # full layers: every cache row below nlive is a key (kpos None: the kernel reads no positions)
            if topk is not None:
                return attention_topk(q, K, V, None, key_rows, topk, out_dtype=self.dtype, nlive=nlive)
            return attention(q, K, V, None, key_rows, out_dtype=self.dtype, impl=self._attn_impl(False, False),
                             nlive=nlive)

        return attend

    def _sc_probs(self, sc: torch.Tensor) -> torch.Tensor:
        """softmax(sc_logits) for the SC soft embedding. On CUDA with f32 logits: the row-stats kernel's logsumexp,
        then exp(z - lse) written straight in bf16 (ops/rowstats.py): no [C, V] f32 softmax in the graph."""
        if use_triton(sc) and sc.dtype == torch.float32:  # sc may be a RowsAt (a graph's SC input, no copy)
            lse = tempered_rowstats(sc, 1.0)[3]
            return tempered_masked_probs(sc, 1.0, torch.full_like(lse, -float("inf")), lse, self.dtype)
        return torch.softmax(sc.float(), dim=-1)

    def _sc_mlp(self, s):
        """The self-conditioning MLP (gate||up, gelu.up, down); plain or packed q8 weights."""
        return gated_mlp(s, self.w.sc_gu, self.w.sc_down)

    def _canvas_rows(self, C: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(arange(C), R + arange(C)) on the device, made once per shape: constants a graph reads."""
        rows = self._canvas_rows_cache.get((C, R))
        if rows is None:
            ar = torch.arange(C, device=self.device)
            rows = self._canvas_rows_cache[(C, R)] = (ar, R + ar)
        return rows

    def _slide_kpos(self, cache: EngineKVCache, C: int) -> torch.Tensor:
        """Per-key visibility of a sliding canvas call from the cache's slot positions (0 = visible, -1 = not): the
        ring's live window, then the canvas itself (the twin of sliding_live_window)."""
        sp, L, dev = cache.slot_pos, cache.length_t, self.device
        neg = torch.full((), -1, dtype=torch.int64, device=dev)  # a fill, not a host copy: graph-capturable
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        ring = torch.where((sp >= 0) & (sp > L - self.config.sliding_window), zero, neg)
        return torch.cat([ring, torch.zeros(C, dtype=torch.int64, device=dev)])

    # ------------------------------------------------------------------ the layers

    def _attn_impl(self, sliding: bool, causal: bool):
        """Which attention runs where: a forced `attn_impl` everywhere; else the denoise canvas by layer kind as
        `canvas_impls` says, and the dispatcher's default (the flash kernel on CUDA) for the rest. A fixed rule, not
        a run-time race: the same inputs always take the same kernels (docs/ARCHITECTURE.md, 'Attention')."""
        if self.attn_impl is None and not causal:
            return self.canvas_impls.get("sliding" if sliding else "full")
        return self.attn_impl

    @property
    def attn_impl(self) -> str | None:
        return self.options.attn_impl

    @property
    def canvas_impls(self):
        return self.options.canvas_impls

    def _run_layers(self, x, scalars, attend, last_with_ffn: bool, final_w, h=None):
        """h: the first layer's input norm of x, when the op that made x made it too. -> the last layer's output
        norm (by final_w)."""
        layers = self.w.layers
        if h is None:
            h = rms_norm(x, layers[0].input_norm, self.config.rms_norm_eps)
        n = len(layers)
        for li in range(n):
            w_next = layers[li + 1].input_norm if li + 1 < n else final_w
            x, h = self._layer(li, x, h, attend, scalars[li], w_next, with_ffn=last_with_ffn or li + 1 < n)
        return h

    def _layer(self, li: int, x, h, attend, scalar: float, w_next, with_ffn: bool = True):
        """x: the residual stream, h: its input norm (fused into the previous op). -> (x, norm(x).w_next)."""
        cfg, lw, eps = self.config, self.w.layers[li], self.config.rms_norm_eps
        o = attend(li, linear(h, lw.qkv, self.dtype), with_ffn)  # h: an Fp8Rows where qkv is FP8 (_moe)
        if not with_ffn:  # prefill's last layer: only its K/V are ever read
            return None, None
        a = linear(o, lw.o, self.dtype)  # o may be an Fp8Rows (model/lane_attention.py)
        rows, path_routes = self._path_rows(lw, len(x))
        # a q4 expert GEMM multiplies f16: attn_finish then writes its input as such (same bits, ops/f16_operand.py);
        # FP8 dense / expert GEMMs take their inputs quantized per token by attn_finish (ops/rmsnorm.py)
        moe_f16 = moe_paths.takes_f16_operand(lw.experts_gu, path_routes or len(x) * cfg.top_k_experts, x)
        x, dense_in, moe_in, router_in = attn_finish(x, a, lw.post_attn_norm, lw.pre_ff_norm, lw.pre_ff2_norm,
                                                     lw.router_in_scale, eps, moe_f16=moe_f16,
                                                     dense_fp8=isinstance(lw.mlp_gu, Fp8Weight),
                                                     moe_fp8=isinstance(lw.experts_gu, Fp8Weight))
        side = self._router_stream() if rows <= OVERLAP_ROWS else None
        if side is None:
            dense = self._dense_mlp(lw, dense_in, rows)
            weights, src, inv, offs, order = self._route(lw, router_in)
        else:  # fork: the router chain beside the dense MLP; join before the expert GEMMs read the plan
            main = torch.cuda.current_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                weights, src, inv, offs, order = self._route(lw, router_in)
            dense = self._dense_mlp(lw, dense_in, rows)
            main.wait_stream(side)
        return self._moe(lw, x, dense, moe_in, weights, src, inv, offs, order, scalar, w_next, path_routes)

    def _moe(self, lw, x, dense, moe_in, weights, src, inv, offs, order, scalar, w_next, path_routes):
        """The experts on their routes, then the layer's finish: the f32 weighted sum of the expert outputs, post
        norms, residual, layer scalar, next input norm. The expert-parallel forward (parallel/expert.py) overrides it."""
        y = expert_ffn(moe_in, lw.experts_gu, lw.experts_down, offs, src=src, order=order, out_dtype=x.dtype,
                       path_routes=path_routes)
        # an FP8 qkv GEMM takes the next layer's input norm quantized per token (not the final norm: lm_head's)
        next_fp8 = isinstance(self.w.layers[0].qkv, Fp8Weight) and w_next is not self.w.final_norm
        return layer_finish_moe(x, dense, y, inv, weights, lw.post_ff1_norm, lw.post_ff2_norm, lw.post_ff_norm,
                                scalar, self.config.rms_norm_eps, w_next, next_fp8=next_fp8)

    def _path_rows(self, lw, n: int) -> tuple[int, int | None]:
        """-> (the rows the side stream and the dense MLP's carve-out are decided by, the route count the expert
        GEMMs' path is chosen by or None: their own). Outside a batched denoise, and with batch_paths "total": n and
        None. "lane": one lane's, as that request alone (docs/ARCHITECTURE.md, 'Batching'). "wide": n, except that a
        packed expert stack keeps its kernel where n's routes would dequantize it (other bits, and slower there)."""
        lane, mode, k = self._lane_rows, self.options.batch_paths, self.config.top_k_experts
        if lane is None or mode == "total":
            return n, None
        if mode == "lane":
            return lane, lane * k
        dequant = isinstance(lw.experts_gu, PackedWeight) and moe_paths.dequantizes_for(n * k / self.config.num_experts)
        return n, lane * k if dequant else n * k  # an FP8 stack's two paths give the same bits

    def _dense_mlp(self, lw, dense_in, rows: int | None = None):
        rows = len(dense_in) if rows is None else rows  # dense_in may be an Fp8Rows (q, s): rows given
        carve = DENSE_SM_CARVEOUT if self.device.type == "cuda" and rows <= OVERLAP_ROWS else None
        with cublas_sm_carveout(carve):
            return gated_mlp(dense_in, lw.mlp_gu, lw.mlp_down, self.dtype)

    def _route(self, lw, router_in):
        """The router chain: the mixing weights and the plan the expert GEMMs read (src, inv, offs, order)."""
        cfg = self.config
        weights, experts = route_fused(router_in, lw.router_w, cfg.top_k_experts, lw.per_expert_scale,
                                       pieces=lw.router_pieces)
        # order: the experts by row count, most first (None where no GEMM reads it, or with launch_order off)
        if self.options.launch_order:
            src, inv, offs, order = moe_plan_with_order(experts, cfg.num_experts)
        else:
            (src, inv, offs), order = moe_plan(experts, cfg.num_experts), None
        return weights, src, inv, offs, order

    def _router_stream(self):
        """The router chain's side stream (CUDA), else None. Safe for the caching allocator without record_stream:
        the side stream's tensors are last read by this layer's finish on the main stream, and the next fork (which
        orders the side stream after that finish) comes before any side allocation could reuse their blocks."""
        if self.device.type != "cuda":
            return None
        if self._side_stream is None:  # high priority: its blocks are scheduled first when SMs free up
            self._side_stream = torch.cuda.Stream(self.device, priority=-1)
        return self._side_stream

    def _qkv(self, li, qkv, positions, **kw):
        layer, lw = self.config.layers[li], self.w.layers[li]
        H, KV, hd = self.config.num_heads, layer.num_kv_heads, layer.head_dim
        v_off = (H + KV) * hd if layer.has_v_proj else H * hd  # full layers: V = raw k_proj output
        return qkv_prep(qkv, H, KV, hd, v_off, lw.qkv_norm, lw.inv_freq, positions, self.config.rms_norm_eps,
                        self.kv_dtype, **kw)
