"""EngineOptions: the fast engine's implementation choices, fixed when it is built.

None of them changes a token: each pair of forms computes the same bits (or, for `attn_impl`, the same math), and
the tests compare them. The defaults are the fast forms; the others stay because a test uses them as the
twin of a default (docs/ARCHITECTURE.md, 'Verification chain').
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


BATCH_PATHS = ("lane", "wide", "total")


@dataclass(frozen=True)
class EngineOptions:
    # Denoise through CUDA graphs (None: on CUDA). A capture that fails turns them off for the engine, with a warning.
    graphs: bool | None = None
    # Give each denoise graph a guarded twin (model/graph_guard.py: the graph as a CUDA graph IF node's body), so the
    # loop can launch the next forward before it knows there is one. Where the driver cannot, plain graphs are used.
    guarded_graphs: bool = True
    # Run the next step's forward ahead of the step's status read, under the device's own go answer (the staged step:
    # model/denoiser.py). Needs guarded graphs to launch; with plain graphs only the inputs are staged.
    run_ahead: bool = True
    # The loop steps on the raw bf16 logits and the sampler's kernels softcap them as they read (no f32 [C, V] pass);
    # False: on `denoise`'s softcapped f32 logits (the twin the tests compare).
    softcap_in_sampler: bool = True
    # Force one attention implementation everywhere ('triton' / 'sdpa' / 'ref'); None: the rule in Forward._attn_impl.
    attn_impl: str | None = None
    # The denoise canvas attention by layer kind ('full' / 'sliding'); a kind not named takes the dispatcher's flash
    # kernel. 'tiles' (ops/attention_tiles.py) is the default for full layers; 'gemm' (ops/attention_gemm.py) its twin.
    canvas_impls: Mapping[str, str] = field(default_factory=lambda: {"full": "tiles"})
    # The streaming expert GEMMs take the most-routed experts first (ops/moe_plan.moe_plan_with_order); False: in
    # expert order (the same results; the GPU tests compare them).
    launch_order: bool = True
    # The sliding layers' canvas attention visits only the ring's live window; False: every ring slot under a per-key
    # mask of the slot positions (the twin the CPU tests compare it with).
    sliding_live_window: bool = True
    # Prompt tokens per prefill chunk.
    prefill_chunk: int = 8192
    # Short prefills (a block's commit, a chat turn, a short prompt) run padded to a fixed length (the canvas, or the
    # smallest of `prefill_pads` that holds them) with the context read from device tensors, as one CUDA graph per
    # (cache, padded length, context bucket) (Forward.prefill_padded). None: on CUDA. True off CUDA (or with graphs
    # off): the same padded code, eagerly (the twin the tests compare). False: the unpadded eager prefill everywhere.
    padded_prefill: bool | None = None
    # The causal attention of a prefill chunk of up to this many rows (a block's commit, a short turn) runs on the tile
    # kernels (ops/attention_tiles.py, the canvas' form with a per-query causal and window mask) instead of the flash
    # kernel, whose Q-resident programs over so few rows leave most SMs idle. The same math, other roundings (as
    # attn_impl), so other tokens than the flash kernel's: 0 (the default) keeps the flash kernel's.
    causal_tiles_rows: int = 0
    # Padded lengths above the canvas for short prefills (each needs length <= the cache's sliding ring).
    prefill_pads: tuple[int, ...] = (512, 1024)
    # Canvases one batched denoise forward takes at most (Engine.max_batch; the batch scheduler's cap).
    max_batch: int = 8
    # What a batched denoise chooses its kernel paths by (the expert GEMM path, the router's side stream and the dense
    # MLP's SM carve-out): "lane" = one lane's rows, as that request alone would (batch invariance as far as the paths
    # go); "total" = all rows (the paths tuned for that size: a packed stack then dequantizes, other bits); "wide" =
    # all rows, except that a packed expert stack keeps its kernel (Forward._path_rows). "wide" is the default: its
    # lanes keep their solo bits and its kernels take the batch's rows in fewer passes than "lane".
    batch_paths: str = "wide"
    # A batched denoise runs each lane's attention (its qkv prep, cache writes and kernels) on a stream of its own,
    # forked from the layer and joined before the o projection, so the lanes' small kernels overlap on the GPU (one
    # lane's attention alone leaves most SMs idle). The same kernels on the same inputs: the same bits. False: the
    # lanes one after another on the layer's stream (the twin the GPU tests compare). CUDA only.
    lane_streams: bool = True
    # A batched padded prefill (a round's commits, a small wave of joining prompts) of at most engine_batch.graph_rows
    # rows replays a graph kept by its shape, as a batched denoise does, and the warm-up captures the batched commits;
    # False: eagerly (the twin). The same kernels on the same inputs. Off by default: docs/ARCHITECTURE.md, 'Batching'.
    batch_prefill_graphs: bool = False

    def __post_init__(self):
        if self.batch_paths not in BATCH_PATHS:
            raise ValueError(f"batch_paths: expected one of {', '.join(BATCH_PATHS)}, got {self.batch_paths!r}")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or self.max_batch < 1:
            raise ValueError(f"max_batch: expected a positive integer, got {self.max_batch!r}")
