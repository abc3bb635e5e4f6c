"""The fast forward: the reference model's math with fused weights, fused ops and CUDA graphs.

Same public methods as `model/reference.py` (new_cache / prefill / denoise / embed / soft_embed /
embedding / config / generation_config). Precision policy (ARCHITECTURE Part III): activations in
`dtype` (bf16 on the GPU), norms/softmax/router logits/MoE accumulation in f32, KV cache in f16
(`kv_dtype`; the CPU parity tests may ask for f32), logits returned as f32.

Data path of one layer (both passes; only the attention mask and the cache slots differ), with the
number of launches on CUDA:
  qkv GEMM (1; its input norm came fused with the previous layer's finish)
  → qkv_prep (1: Q/K norm + RoPE, V no-scale norm, K/V into the cache, Q head-major)
  → attention (1: flash-style Triton, GQA folded, masked key blocks skipped; the full layers' denoise
    canvas instead (3): a Triton Q·K^T with the softmax per key tile in its epilogue, the tiles' weights,
    a Triton P·V that weighs each tile) → o GEMM (1)
  → attn_finish (1: post-attn norm + residual + the dense/MoE/router input norms)
  → dense gate‖up GEMM, gelu·up, down GEMM (3; at the denoise shape on all SMs but 16, via cuBLASLt)
    beside it on a side stream (CUDA), joined before the expert GEMMs:
  → route_fused (2: the f32 router logits from a bf16x3 GEMM (exact products); softmax, top-k ties→lower expert,
    renorm, scale in one kernel)
  → moe_plan (1: sort-free stable expert grouping, and the experts by row count: the GEMMs' launch order)
  → grouped GEMM (rows gathered in its loads at denoise, gelu·up in its epilogue; a row gather first and gelu·up
    after in prefill), grouped GEMM (2-4; a q4 GEMM gets its input from attn_finish and gelu·up as f16 operands,
    ops/f16_operand.py)
  → layer_finish_moe (1: un-permute + weighted sum in f32, post norms, residual, layer scalar,
    and the next layer's input norm).
Every op dispatches to its torch twin off CUDA, so the CPU parity tests run this same structure.

Attention. The scale is 1 (QK-norm folds it). Keys are described by a per-key position vector
(-1 = not a key). Prefill: causal, sliding layers restricted to (q-W, q], over the ring as it was
before the chunk followed by the chunk's own K/V (the ring is updated after). Denoise: the canvas
writes its K/V into per-layer scratch rows of the cache and attends bidirectionally to the visible
cache rows and itself (a per-key mask, so the GQA group folds into the query rows).

CUDA graphs. On CUDA, `denoise` replays a graph per (cache, canvas length, context bucket, SC
mode, attention impl): every quantity that changes between steps (cache length, ring positions)
is read from device tensors, so one capture serves every step at contexts up to the bucket. The
bucket's padded key rows are masked (and skipped block-wise by the kernel). The graph ends at the
raw bf16 logits: `denoise_raw` returns them, and `denoise` softcaps them into a fresh f32 tensor (no clone).
generate calls `denoise_raw`: its row-stats and SC kernels softcap as they read (sampling/stats.StepStats).
Each graph also gets a guarded twin (model/graph_guard.py: the same graph inside a CUDA graph IF node), which
`stage_denoise(go=)` launches under a device flag: generate queues the next forward before its status read and the
GPU runs it only if the device's own stop and SC-bet answer says so.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..config import ModelConfig
from ..errors import InputError
from ..ops import moe_packed
from ..ops._backend import use_triton
from ..ops.attention import NO_WINDOW, attention
from ..ops.gelu_mul import gelu_mul
from ..ops.moe import expert_ffn
from ..ops.moe_plan import moe_plan, moe_plan_with_order
from ..ops.qkv import qkv_prep
from ..ops.rmsnorm import attn_finish, embed_sc_norms, layer_finish_moe, rms_norm
from ..ops.route import route_fused
from ..ops.rows_at import RowsAt, aligned
from ..ops.rowstats import softcap, tempered_masked_probs, tempered_rowstats
from ..ops.sm_carveout import cublas_sm_carveout
from .engine_cache import EngineKVCache
from .engine_graph import DenoiseGraph
from .engine_weights import DictSource, EngineWeights, load_weights
from .graph_guard import GuardedGraph, guard_support

_BUCKET0 = 1024  # smallest context bucket for graphed denoise; buckets double from here
# Up to this many rows (the denoise canvas, a committed block's prefill) the router chain runs on a side stream beside
# the dense MLP, whose GEMMs leave it SMs. A prefill chunk's kernels fill the GPU by themselves: measured no faster
# side by side (bench/RESULTS.md round 16), and the side stream's own allocator pool cost a q4 session 50 MB.
OVERLAP_ROWS = 512


def build_engine(config: ModelConfig, tensor_source, device, dtype=torch.bfloat16, **kw) -> "Engine":
    """The loader's entry point: read every tensor from `tensor_source` onto `device`, fused and cast."""
    device = torch.device(device)
    return Engine(config, load_weights(config, tensor_source, device, dtype), device=device, dtype=dtype, **kw)


class Engine:
    def __init__(self, config: ModelConfig, weights: EngineWeights, *, device, dtype=torch.bfloat16,
                 kv_dtype=torch.float16, generation_config=None, path=None, tokenizer=None,
                 prefill_chunk: int = 8192, use_graphs: bool | None = None, attn_impl: str | None = None):
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
        # cache -> {(canvas, key rows, SC mode, attention impl): captured graph}. Weakly keyed: a graph reads
        # its cache's buffers, so it must die with that cache; keying by id(cache) would let a new cache at a
        # recycled address replay a graph over freed memory.
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # One memory pool for every denoise graph. A private pool per graph keeps that graph's intermediates
        # (with SC from logits a [canvas, vocab] softmax among them: 134-268 MB at full size) for as long as
        # it lives, so a conversation growing through the context buckets would hold one set per bucket.
        # Sharing is safe here: graphs replay one at a time on one stream, and each replay's output is read
        # (softcap) right after that replay. A later graph's output may sit in an earlier graph's scratch,
        # so another graph's replay may overwrite it, but only after it was read; its own next replay
        # writes it again.
        self._graph_pool = None
        self._last_graph = (None, None)  # (weakref to the cache, graph key) of the last graphed denoise
        # stage_denoise's (graph entry, its key, ids, ids version, sc, sc version), until the next denoise call
        self._staged = None
        # the same for a forward stage_denoise(go=) launched, until the call that takes its output (or any other)
        self._ahead = None
        # Give each denoise graph a guarded twin (model/graph_guard.py: the graph as an IF node's body), so
        # stage_denoise(go=) can launch the next forward before the host knows whether there is one. False: plain
        # graphs only (A/B). Where the driver cannot (graph_guard.guard_support), plain graphs, and `guard_error` says
        # why.
        self.guarded_graphs = True
        self.guard_error: str | None = None
        self.graph_error: str | None = None  # why graphs were turned off, if they were
        self.attn_impl = attn_impl  # None: the rule in _attn_impl; or force 'triton' / 'sdpa' / 'ref' everywhere
        # The denoise canvas attention's implementation by layer kind ('full' / 'sliding'); a kind not named takes
        # the dispatcher's default, the flash kernel. 'tiles': Triton GEMMs with the softmax in the first's epilogue
        # (ops/attention_tiles.py); 'gemm': cuBLAS GEMMs around a chunked softmax (ops/attention_gemm.py), for A/B.
        # A graph keeps the choice it was captured with.
        self.canvas_impls = {"full": "tiles"}
        # The streaming expert GEMMs take the most-routed experts first (ops/moe_plan.moe_plan_with_order); False:
        # in expert order, for A/B (same results; a graph captured before a change keeps the order it was made with).
        self.launch_order = True
        # A q4 expert GEMM gets its inputs as f16 operands from their producers (ops/f16_operand.py); False: as
        # bf16, converted in the GEMM's loop (A/B; the same bits; a graph keeps the form it was captured with).
        self.f16_operands = True
        # The streaming expert gate_up GEMM makes gelu·up in its epilogue (ops/moe_packed.py, GLU); False: gelu_mul
        # after it (A/B; the same bits; a graph keeps the form it was captured with).
        self.fuse_glu = True
        # On CUDA, at up to OVERLAP_ROWS rows, the router chain (router GEMM, routing, plan: ~20 µs a layer at the
        # denoise shape, nearly all latency) runs on a high-priority side stream beside the
        # dense MLP, and joins before the expert GEMMs (nothing runs beside the weight stream). False: one stream
        # (A/B; the same bits; a graph keeps the form it was captured with).
        self.overlap_router = True
        self._side_stream = None
        self._canvas_rows_cache: dict = {}
        # The router logits on CUDA: "bf16x3" (ops/route.py: exact products on the tensor cores, few small blocks, so
        # the dense MLP's GEMMs run beside it) or "cublas" (the f32 SIMT GEMM, whose blocks fill every SM: A/B).
        self.router_gemm = "bf16x3"
        self.router_gemm_config = None  # the bf16x3 GEMM's tiles: None = ops/route.ROUTER_GEMM_CONFIG (A/B)
        # The dense MLP's GEMMs at up to OVERLAP_ROWS rows target all SMs but this many (ops/sm_carveout.py), so the
        # router chain finds SMs free beside them; None: plain cuBLAS on every SM (A/B).
        self.dense_sm_carveout = 16
        # A denoise graph reads its SC logits where the caller's tensor lies, through their address (ops/rows_at.py);
        # False: copied into the graph's own buffer before each replay (A/B; the same bits).
        self.sc_by_address = True
        # The sliding layers' canvas attention visits only the ring's live window (its last window-1 positions, in
        # position order: ops/attention_flash.py ring_length), so the ring's rewind slack (256 slots) is neither
        # read nor split over; False: every ring slot under the per-key mask of slot_pos (A/B; a graph keeps the form
        # it was captured with).
        self.sliding_live_window = True

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
        if self._dequantizes_in_prefill(min(len(ids), self.prefill_chunk)):
            # A packed model's prefill dequantizes each layer's expert stack into a bf16 scratch (1 GB at
            # full size; ops/moe_packed.PREFILL_ROWS). Left in the allocator's cache it would count against
            # the memory a q4 model is for (a 24 GB card), so it goes back to the device after the prefill.
            torch.cuda.empty_cache()

    @torch.no_grad()
    def denoise(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return softcap(self.denoise_raw(cache, canvas_ids, sc_logits, sc_embeds), self.logit_softcap)

    @property
    def logit_softcap(self) -> float:
        return self.config.final_logit_softcapping

    def denoise_raw(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                    sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The denoise forward up to its last op, the final softcap: logits in the model's dtype, [C, V], whose
        softcap(·, logit_softcap) is `denoise`'s result. The sampler's kernels softcap them as they read them
        (sampling/stats.StepStats(cap=)), so generate's step never writes nor reads the f32 [C, V] logits. On CUDA
        with graphs the result is the graph's output buffer: valid until this engine's next denoise."""
        staged, self._staged = self._staged, None
        ahead, self._ahead = self._ahead, None
        if ahead is not None and sc_logits is None:
            entry = self._staged_entry(ahead, cache, canvas_ids, sc_embeds)
            if entry is not None:  # launched by stage_denoise(go=): by the caller's contract its condition was true
                return entry.out
        if staged is not None and sc_logits is None:
            entry = self._staged_entry(staged, cache, canvas_ids, sc_embeds)
            if entry is not None:  # checked and copied by stage_denoise: the replay alone (a graph needs no no_grad)
                entry.replay()
                self._last_graph = (weakref.ref(cache), staged[1])
                return entry.out
        with torch.no_grad():
            return self._denoise_checked(cache, canvas_ids, sc_logits, sc_embeds)

    def _denoise_checked(self, cache, canvas_ids, sc_logits, sc_embeds) -> torch.Tensor:
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
        return self._denoise_core(cache, ids, mode, sc, key_rows=self._key_rows(cache, C))

    def _dequantizes_in_prefill(self, chunk: int) -> bool:
        cfg = self.config
        return (self.device.type == "cuda" and isinstance(self.w.layers[0].experts_gu, moe_packed.PackedWeight)
                and moe_packed.dequantizes_for(chunk * cfg.top_k_experts / cfg.num_experts))

    # ------------------------------------------------------------------ checks

    def _check_ids(self, ids, what: str, check_range: bool) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or len(ids) == 0:
            raise InputError(f"{what}: expected a non-empty 1-D integer tensor, got shape {list(ids.shape)} dtype {ids.dtype}")
        if check_range and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise InputError(f"{what}: ids must be in [0, {self.config.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
        return ids.to(self.device, torch.long)

    # ------------------------------------------------------------------ attention implementation

    # Which attention runs where (None = this rule; attn_impl forces one implementation everywhere):
    # * the denoise canvas, by layer kind, as `canvas_impls` says: the full layers on two Triton GEMMs with the
    #   softmax per key tile between them (ops/attention_tiles.py). On the H200 (bench/bench_attention.py, GPU µs a
    #   call, graphed; bench/RESULTS.md round 15) 33.7 / 146 / 626 at 1k / 8k / 32k keys, against round 14's cuBLAS
    #   GEMMs (ops/attention_gemm.py, 'gemm') 40.1 / 215 / 708 and the flash kernel's 58.2 / 308 / 1116; a 32k
    #   bucket half in use 309 against 643 / 602.
    # * everything else: the round-3 flash kernel (ops/attention_flash.py), the dispatcher's default on CUDA
    #   (unless DIFFGEMMA_NO_TRITON=1). Sliding canvas 34.0 against 46.8 for the tiles, 127 for the cuBLAS GEMMs and
    #   103 for SDPA; 8k prefill chunks, full layers 45.6 ms vs SDPA 75.5 (at 24k) and 6.5 vs 17.7 (at 0), sliding
    #   0.82 vs the round-2 kernel 1.12 and SDPA 9.5 (commit 8f24671).
    # A fixed rule, not a run-time race: the same inputs always take the same kernels.
    def _attn_impl(self, sliding: bool, causal: bool):
        if self.attn_impl is None and not causal:
            return self.canvas_impls.get("sliding" if sliding else "full")
        return self.attn_impl

    # ------------------------------------------------------------------ the layer

    def _layer(self, li: int, x, h, attend, scalar: float, w_next, with_ffn: bool = True):
        """x: the residual stream, h: its input norm (fused into the previous op). -> (x, norm(x)·w_next)."""
        cfg, lw, eps = self.config, self.w.layers[li], self.config.rms_norm_eps
        qkv = h @ lw.qkv.T
        o = attend(li, qkv, with_ffn)
        if not with_ffn:  # prefill's last layer: only its K/V are ever read
            return None, None
        a = o @ lw.o.T
        # a q4 expert GEMM multiplies f16: attn_finish then writes its input as such (same bits, ops/f16_operand.py)
        moe_f16 = self.f16_operands and moe_packed.takes_f16_operand(lw.experts_gu, len(h) * cfg.top_k_experts, h)
        x, dense_in, moe_in, router_in = attn_finish(x, a, lw.post_attn_norm, lw.pre_ff_norm, lw.pre_ff2_norm,
                                                     lw.router_in_scale, eps, moe_f16=moe_f16)
        side = self._router_stream() if len(h) <= OVERLAP_ROWS else None
        if side is None:
            dense = self._dense_mlp(lw, dense_in)
            weights, experts, src, inv, offs, order = self._route(lw, router_in)
        else:  # fork: the router chain beside the dense MLP; join before the expert GEMMs read the plan
            main = torch.cuda.current_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                weights, experts, src, inv, offs, order = self._route(lw, router_in)
            dense = self._dense_mlp(lw, dense_in)
            main.wait_stream(side)
        y = expert_ffn(moe_in, lw.experts_gu, lw.experts_down, offs, src=src, order=order, out_dtype=x.dtype,
                       f16_operands=self.f16_operands, fuse_glu=self.fuse_glu)
        return layer_finish_moe(x, dense, y, inv, weights, lw.post_ff1_norm, lw.post_ff2_norm, lw.post_ff_norm,
                                scalar, eps, w_next)

    def _dense_mlp(self, lw, dense_in):
        carve = self.dense_sm_carveout if dense_in.is_cuda and len(dense_in) <= OVERLAP_ROWS else None
        with cublas_sm_carveout(carve):
            return gelu_mul(dense_in @ lw.mlp_gu.T) @ lw.mlp_down.T

    def _route(self, lw, router_in):
        """The router chain: weights, experts, and the plan the expert GEMMs read (src, inv, offs, order)."""
        cfg = self.config
        pieces = lw.router_pieces if self.router_gemm == "bf16x3" else None
        weights, experts = route_fused(router_in, lw.router_w, cfg.top_k_experts, lw.per_expert_scale, pieces=pieces,
                                       gemm_config=self.router_gemm_config)
        # order: the experts by row count, most first (None where no GEMM reads it, or with launch_order off)
        src, inv, offs, order = (moe_plan_with_order(experts, cfg.num_experts) if self.launch_order
                                 else (*moe_plan(experts, cfg.num_experts), None))
        return weights, experts, src, inv, offs, order

    def _router_stream(self):
        """The side stream of the router chain, or None (off CUDA, or overlap_router off). Safe for the caching
        allocator without record_stream: the side stream's tensors are last read by this layer's finish on the
        main stream, and the next fork (which orders the side stream after that finish) comes before any side
        allocation could reuse their blocks."""
        if not self.overlap_router or self.device.type != "cuda":
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

    def _run_layers(self, x, scalars, attend, last_with_ffn: bool, final_w, h=None):
        """h: the first layer's input norm of x, when the op that made x made it too."""
        layers = self.w.layers
        if h is None:
            h = rms_norm(x, layers[0].input_norm, self.config.rms_norm_eps)
        n = len(layers)
        for li in range(n):
            w_next = layers[li + 1].input_norm if li + 1 < n else final_w
            x, h = self._layer(li, x, h, attend, scalars[li], w_next, with_ffn=last_with_ffn or li + 1 < n)
        return h

    # ------------------------------------------------------------------ prefill (causal, writes the cache)

    def _prefill_chunk(self, cache: EngineKVCache, ids: torch.Tensor) -> None:
        cfg, W, dev = self.config, self.config.sliding_window, self.device
        P, n, R = cache.length, len(ids), cache.ring
        pos = torch.arange(P, P + n, device=dev)
        full_kpos = torch.arange(P + n, device=dev)  # full layers: row p holds position p
        slide_kpos = torch.cat([cache.slot_pos, pos])  # the ring before this chunk, then the chunk itself
        ring_slots = cache.ring_slots(pos, P + n)
        tail = max(0, n - R)  # the first `tail` chunk positions are overwritten within the chunk

        def attend(li, qkv, need_out):
            K, V = cache.keys[li], cache.values[li]
            if cfg.layers[li].is_sliding:  # (transformers forces the last layer to be full: need_out is True here)
                # Attend over the ring as it was before this chunk, then store the chunk: a long chunk's
                # own writes would otherwise clobber window positions its earlier queries still need.
                q, kv = self._qkv(li, qkv, pos, dense_kv=True)
                Kx, Vx = torch.cat([K[:, :R], kv[0]], 1), torch.cat([V[:, :R], kv[1]], 1)
                o = attention(q, Kx, Vx, slide_kpos, R + n, qpos=pos, window=W, causal=True, out_dtype=self.dtype,
                              impl=self._attn_impl(True, True), n_ring=R, base_pos=P)
                K.index_copy_(1, ring_slots[tail:], kv[0][:, tail:])
                V.index_copy_(1, ring_slots[tail:], kv[1][:, tail:])
                return o
            q, _ = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=pos)
            if not need_out:
                return None
            return attention(q, K, V, full_kpos, P + n, qpos=pos, window=NO_WINDOW, causal=True, out_dtype=self.dtype,
                             impl=self._attn_impl(False, True))

        x = self.embed(ids)  # no SC norm on the encoder pass
        self._run_layers(x, [lw.prefill_scalar for lw in self.w.layers], attend, False, None)
        cache.advance(pos, P + n)

    # ------------------------------------------------------------------ denoise (bidirectional canvas, read-only cache)

    def _denoise_core(self, cache: EngineKVCache, ids, mode: str, sc, key_rows: int):
        """One denoise forward -> the logits before the softcap, in the model's dtype. Only device tensors describe
        the context (graph-safe). key_rows = rows of each full-attention cache the canvas reads (>= cache.length + C;
        rows past that are masked)."""
        cfg, eps, W = self.config, self.config.rms_norm_eps, self.config.sliding_window
        C = len(ids)
        L = cache.length_t
        R = cache.ring
        ar, ring_canvas_slots = self._canvas_rows(C, R)
        pos = L + ar
        h = None
        if mode != "none":
            s = self.soft_embed(self._sc_probs(sc)) if mode == "logits" else sc.to(self.dtype)
            s = rms_norm(s, self.w.sc_pre_norm, eps)
            s = self._sc_mlp(s)
            x, h = embed_sc_norms(ids, self.w.embed, cfg.embed_scale, s, self.w.layers[0].input_norm, eps, self.dtype)
        else:  # a zero SC signal goes through the SC MLP as exactly zero
            x = rms_norm(self.embed(ids), None, eps)

        # sliding canvas calls: the ring's live window from the cache length, or (A/B) the slot positions' mask
        slide_kpos = None if self.sliding_live_window else self._slide_kpos(cache, C)
        slide_kw = dict(window=W, n_ring=R, ring_length=L) if self.sliding_live_window else {}
        nlive = L + C  # device scalar: the kernel's loop bound over a graph's padded bucket

        def attend(li, qkv, need_out):
            K, V = cache.keys[li], cache.values[li]
            if cfg.layers[li].is_sliding:
                q, _ = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=ring_canvas_slots)
                return attention(q, K, V, slide_kpos, R + C, out_dtype=self.dtype, impl=self._attn_impl(True, False),
                                 **slide_kw)
            q, _ = self._qkv(li, qkv, pos, cache_k=K, cache_v=V, slots=pos)
            # full layers: every cache row below nlive is a key (kpos None: the kernel reads no positions)
            return attention(q, K, V, None, key_rows, out_dtype=self.dtype,
                             impl=self._attn_impl(False, False), nlive=nlive)

        h = self._run_layers(x, [lw.denoise_scalar for lw in self.w.layers], attend, True, self.w.final_norm, h=h)
        return h @ self.w.embed.T

    def _canvas_rows(self, C: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(arange(C), R + arange(C)) on the device, made once per shape: constants a graph reads instead of two
        kernels it would replay every step. (A graph's first capture comes after eager warm-ups, which make them.)"""
        key = (C, R)
        rows = self._canvas_rows_cache.get(key)
        if rows is None:
            ar = torch.arange(C, device=self.device)
            rows = self._canvas_rows_cache[key] = (ar, R + ar)
        return rows

    def _slide_kpos(self, cache: EngineKVCache, C: int) -> torch.Tensor:
        """Per-key visibility of a sliding canvas call from the cache's slot positions (0 = visible, -1 = not): the
        ring's live window, then the canvas itself (the form before sliding_live_window, kept for A/B)."""
        sp, L, dev = cache.slot_pos, cache.length_t, self.device
        neg = torch.full((), -1, dtype=torch.int64, device=dev)  # a fill, not a host copy: graph-capturable
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        ring = torch.where((sp >= 0) & (sp > L - self.config.sliding_window), zero, neg)
        return torch.cat([ring, torch.zeros(C, dtype=torch.int64, device=dev)])

    def _sc_probs(self, sc: torch.Tensor) -> torch.Tensor:
        """softmax(sc_logits) for the SC soft embedding. On CUDA with f32 logits: the row-stats kernel's
        logsumexp, then exp(z - lse) written straight in bf16 (ops/rowstats.py), so the graph never holds
        the [canvas, vocab] f32 softmax (268 MB at full size) nor its bf16 copy as two tensors."""
        if use_triton(sc) and sc.dtype == torch.float32:  # sc may be a RowsAt (a graph's SC input, no copy)
            lse = tempered_rowstats(sc, 1.0)[3]
            return tempered_masked_probs(sc, 1.0, torch.full_like(lse, -float("inf")), lse, self.dtype)
        return torch.softmax(sc.float(), dim=-1)

    def _sc_mlp(self, s):
        """The self-conditioning MLP (gate‖up, gelu·up, down) on its normed input; the weights are
        plain tensors or packed q8 (ops.moe_packed.linear dequantizes on the fly)."""
        return moe_packed.linear(gelu_mul(moe_packed.linear(s, self.w.sc_gu)), self.w.sc_down)

    def context_bucket(self, cache: EngineKVCache) -> int:
        b = _BUCKET0
        while b < cache.length:
            b *= 2
        return min(b, cache.max_tokens)

    def context_buckets(self, cache: EngineKVCache) -> list[int]:
        """Every context bucket a denoise on `cache` can use, ascending: bucket k serves cache lengths above bucket
        k-1 up to its own (a graph is captured per bucket; warmup.py visits each)."""
        out, b = [], _BUCKET0
        while b < cache.max_tokens:
            out.append(b)
            b *= 2
        return out + [cache.max_tokens]

    def _key_rows(self, cache: EngineKVCache, C: int) -> int:
        """Full-layer cache rows a denoise reads. On CUDA the context's bucket, graphed or eager: the canvas
        GEMMs' shapes (and the flash kernel's split count) follow it, so both compute the same bits."""
        return (self.context_bucket(cache) if self.device.type == "cuda" else cache.length) + C

    def _graph_key(self, cache: EngineKVCache, C: int, mode: str) -> tuple:
        """(canvas, key rows, SC mode, attention impl): what a denoise graph of this cache is kept by."""
        return C, self._key_rows(cache, C), mode, self.attn_impl

    def _denoise_graphed(self, cache: EngineKVCache, ids, mode: str, sc) -> torch.Tensor:
        C = len(ids)
        key = self._graph_key(cache, C, mode)
        graphs = self._graphs.setdefault(cache, {})
        entry = graphs.get(key)
        if entry is None:
            entry = self._capture(cache, C, key[1], mode, sc)
            graphs[key] = entry
        entry.ids.copy_(ids)
        sc = self._feed_sc(entry.sc, sc)  # held until the replay is queued: the graph may read it where it lies
        entry.replay()
        self._last_graph = (weakref.ref(cache), key)
        return entry.out  # static: the next replay overwrites it (denoise's softcap writes a fresh f32 tensor from it)

    @torch.no_grad()
    def stage_denoise(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_embeds: torch.Tensor | None = None,
                      go: torch.Tensor | None = None) -> bool:
        """Copy a coming `denoise_raw(cache, canvas_ids, sc_embeds=sc_embeds)`'s inputs into its graph's static
        buffers now, queued on the current stream; that call, on the same stream and with these very tensors
        unchanged, then launches the replay alone. -> whether anything was staged (a graph for that call exists).

        Why: generate's loop knows the next step's inputs before its status read, and CUDA calls the host makes just
        after such a wait run slowly (~0.1 ms a copy on the H200 machines, bench/RESULTS.md round 23) while the GPU,
        done with the queued SC product, waits for the replay. Staged before the read, the copies are queued while
        the GPU is busy. Any other denoise call in between drops the staging; a call with other tensors, or with
        these modified in place since, copies as usual.

        go (a bool device scalar): also launch the forward now, conditioned on `go` as the GPU finds it when the
        replay starts (a guarded graph: engine_graph.DenoiseGraph). The GPU then runs the next forward right after
        the work queued before it, while the host is still reading the status. Contract: the caller makes that very
        call only when go was true, and then gets the launched forward's output (no second launch); when go was false
        the replay ran nothing, and any other call (other inputs, another cache, or none) is safe. -> whether the
        forward was launched (False: at most staged, e.g. plain graphs)."""
        self._staged = self._ahead = None
        if not (self.use_graphs and self.device.type == "cuda" and isinstance(canvas_ids, torch.Tensor)
                and canvas_ids.is_cuda and canvas_ids.dim() == 1 and canvas_ids.dtype == torch.long):
            return False
        C, mode = len(canvas_ids), "embeds" if sc_embeds is not None else "none"
        if C > cache.canvas or (sc_embeds is not None and tuple(sc_embeds.shape) != (C, self.config.hidden_size)):
            return False
        key = self._graph_key(cache, C, mode)
        entry = self._graphs.get(cache, {}).get(key)
        if entry is None:
            return False
        entry.ids.copy_(canvas_ids)
        if entry.sc is not None:
            entry.sc.copy_(sc_embeds)
        staged = (entry, key, canvas_ids, canvas_ids._version, sc_embeds,
                  None if sc_embeds is None else sc_embeds._version)
        if go is None or entry.guard is None:
            self._staged = staged
            return go is None
        entry.launch_if(go)
        self._ahead = staged
        self._last_graph = (weakref.ref(cache), key)
        return True

    def drop_staged(self) -> None:
        """Forget what stage_denoise staged or launched (generate calls it when a block's loop ends): the staging holds
        its graph and input tensors, which should not outlive the block, let alone a cache."""
        self._staged = self._ahead = None

    def _staged_entry(self, staged, cache, ids, sc):
        """The graph entry stage_denoise filled with these very inputs, unchanged since and still this call's graph
        (the same cache and context bucket, graphs on), or None."""
        entry, key, s_ids, s_ids_v, s_sc, s_sc_v = staged
        if not (ids is s_ids and sc is s_sc and ids._version == s_ids_v and (sc is None or sc._version == s_sc_v)
                and self.use_graphs):
            return None
        if key != self._graph_key(cache, key[0], key[2]) or self._graphs.get(cache, {}).get(key) is not entry:
            return None
        return entry

    def logits_scratch(self) -> torch.Tensor | None:
        """The bf16 [canvas, vocab] buffer the last graphed denoise wrote its raw logits to, while that graph lives
        (else None). It is dead from the moment that denoise returned (its softcap read it) until the next denoise
        writes it again, and every graph writes its scratch before reading it: a generate on `denoise`'s softcapped
        logits lends it to the sparse SC's dense fallback, whose probabilities (128 MiB at full size) would otherwise
        sit on top of the step's peak. A generate on `denoise_raw` reads this very buffer as its logits: it lends
        nothing, and holds no f32 [C, V] logits either (256 MiB at full size)."""
        cache_ref, key = self._last_graph
        cache = cache_ref() if cache_ref is not None else None
        entry = self._graphs.get(cache, {}).get(key) if cache is not None else None
        return entry.out if entry is not None else None

    def _feed_sc(self, sc_buf, sc):
        """Give a graph its SC input: the logits' address (RowsAt: the graph reads them where they lie), or a copy
        into its static buffer. -> the tensor the graph will read, which must outlive the replay's queueing."""
        if isinstance(sc_buf, RowsAt):
            sc = aligned(sc.to(self.device, torch.float32))  # a view starting mid-vector is copied
            sc_buf.point_at(sc)
        elif sc_buf is not None:
            sc_buf.copy_(sc)
        return sc

    def _capture(self, cache, C, key_rows, mode, sc):
        ids_buf = torch.zeros(C, dtype=torch.long, device=self.device)
        if mode == "logits" and use_triton(sc) and self.sc_by_address:
            # SC logits are read by the row-stats kernels alone (_sc_probs), which take an address: no copy
            sc_buf = RowsAt(*sc.shape, self.device)
        else:
            sc_buf = None if mode == "none" else torch.zeros(sc.shape, dtype=sc.dtype, device=self.device)
        sc = self._feed_sc(sc_buf, sc)
        # Warm up on a side stream (Triton compile, cuBLAS workspaces), then capture. The warm-up
        # writes only canvas scratch rows of the cache, which no read outside a denoise sees.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._denoise_core(cache, ids_buf, mode, sc_buf, key_rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if not any(self._graphs.values()):
            # A fresh pool whenever no graph is alive: the allocator frees a pool once its last graph dies,
            # and capturing into that dead handle again trips its internal assert (use_count > 0).
            self._graph_pool = torch.cuda.graph_pool_handle()
        guarded = self.guarded_graphs and self._guard_ok()
        graph = torch.cuda.CUDAGraph(keep_graph=guarded)  # a guarded twin clones the kept cudaGraph_t
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._denoise_core(cache, ids_buf, mode, sc_buf, key_rows)
        guard = None
        if guarded:
            graph.instantiate()
            try:
                guard = GuardedGraph(graph, torch.ones((), dtype=torch.bool, device=self.device))
            except Exception as e:  # never wrong without it, only without the launch ahead
                self.guard_error = f"{type(e).__name__}: {e}"
                warnings.warn(f"diffgemma engine: no guarded denoise graph ({self.guard_error})")
        return DenoiseGraph(graph, ids_buf, sc_buf, out, guard)

    def _guard_ok(self) -> bool:
        if self.guard_error is None:
            self.guard_error = guard_support(self.device)
        return self.guard_error is None
