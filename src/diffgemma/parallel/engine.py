"""The engines of an expert-parallel run: every rank's, and rank 0's model object that leads the others.

  ExpertParallelEngine  the fast engine (model/engine.Engine: graphs, buckets, padded prefills) over the
                        expert-parallel forward; the other ranks run it under the follower loop (parallel/follower.py)
  LeadEngine            rank 0's: the same public API (model/protocol.DenoiseModel), so generate, the sampler, the
                        session and the server use it as any engine. Every call that runs a forward or changes a
                        cache is first handed to the other ranks (a header on the control group, its tensors on the
                        data group), which then make the same call on their own engine and caches: every rank runs
                        the same forwards in the same order, so the forwards' all-reduces meet
  build_parallel_engine the loader's entry point

With one rank nothing is sent and every method is the Engine's own: the single-GPU path, bit for bit.

Calls handed over (op codes): a new cache, its truncation, a prefill (ids, and an image prompt's embeddings and image
groups), a denoise (canvas ids, the SC input as embeddings: SC logits [C, V] are turned into embeddings on rank 0
first, by the forward's own ops, so [C, H] travels instead), a batched denoise (its lanes' caches, canvases and SC
embeddings), new settings (EngineOptions, KV dtype, graphs on/off), the end of the run. A cache rank 0 drops is dropped
on the other ranks with the next call. Staging and the run-ahead launch (model/denoiser.StagedDenoiser) are off with
several ranks: a launch decided by a device flag on rank 0 could not be matched by the others.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..config import cache_tokens
from ..errors import InputError
from ..model.engine import Engine
from ..model.engine_batch import check_batch
from ..model.engine_inputs import check_denoise, check_ids, check_image_inputs
from ..model.engine_cache import EngineKVCache
from ..model.engine_weights import load_weights
from .expert import ExpertParallelForward, ExpertShard, expert_share
from .group import Group, ParallelError

NEW_CACHE, TRUNCATE, PREFILL, DENOISE, DENOISE_BATCH, SETTINGS, STOP = 1, 2, 3, 4, 5, 6, 7


def shard_source(source, config, group: Group):
    """The tensor source of `group`'s rank: its share of the experts (the source itself with one rank)."""
    check_split(config.num_experts, group.size)
    return source if group.size == 1 else ExpertShard(source, *expert_share(config.num_experts, group.rank,
                                                                              group.size))


def check_split(num_experts: int, size: int) -> None:
    if num_experts % size:
        raise InputError(f"expert parallel: the model's {num_experts} experts do not split evenly over {size} ranks")


def build_parallel_engine(config, source, group: Group, dtype, **kw) -> "ExpertParallelEngine":
    """This rank's engine over `source` (already this rank's share: shard_source). Rank 0 gets the LeadEngine. Every
    rank waits here until all have loaded, so no forward's collective waits on another rank's load."""
    weights = load_weights(config, source, group.device, dtype)
    cls = LeadEngine if group.lead else ExpertParallelEngine
    engine = cls(config, weights, group=group, device=group.device, dtype=dtype, **kw)
    group.barrier("start-up")
    group.live = group.size > 1
    return engine


class ExpertParallelEngine(Engine):
    """Engine over one rank's experts. Several ranks: no guarded graphs and no run-ahead (see the module docstring)."""

    def __init__(self, config, weights, *, group: Group, **kw):
        super().__init__(config, weights, **kw)
        self.group = group
        self.forward = ExpertParallelForward(config, weights, group=group, device=self.device, dtype=self.dtype,
                                             kv_dtype=self.forward.kv_dtype, options=self.options)
        if group.size > 1:
            self.options = replace(self.options, guarded_graphs=False, run_ahead=False)


class SharedCache(EngineKVCache):
    """Rank 0's KV cache: the other ranks hold its twin under the same id, truncated with it."""

    def bind(self, lead: "LeadEngine", cid: int) -> "SharedCache":
        self.lead, self.cid = lead, cid
        weakref.finalize(self, lead._freed.append, cid)
        return self

    def truncate(self, length: int) -> None:
        before = self.length
        super().truncate(length)
        if self.length != before:
            self.lead._send(TRUNCATE, self.cid, self.length)


class LeadEngine(ExpertParallelEngine):
    """Rank 0's model object (see the module docstring)."""

    def __init__(self, config, weights, *, group: Group, **kw):
        self._freed: list[int] = []
        self._next_cid = 0
        self._sent_settings = None
        self._failed: str | None = None
        super().__init__(config, weights, group=group, **kw)

    # ------------------------------------------------------------------ handing calls over

    def _send(self, op: int, *values: int) -> None:
        """The header of a call (and, first, the caches dropped and the settings changed since the last one)."""
        if self.group.size == 1:
            return
        if self._failed is not None:
            raise ParallelError(f"the run's ranks stopped earlier ({self._failed})")
        try:
            settings = (self.options, self.kv_dtype, self.use_graphs)
            if op != STOP and settings != self._sent_settings:
                self._header(SETTINGS)
                self.group.broadcast_object(settings)
                self._sent_settings = settings
            self._header(op, *values)
        except ParallelError as e:
            self._fail(e)

    def _header(self, op: int, *values: int) -> None:
        freed = []
        while self._freed:  # pop: a cache's finalizer may append while this runs
            freed.append(self._freed.pop())
        self.group.header([op, len(freed), *values])
        if freed:
            self.group.broadcast_object(freed)

    def _payload(self, t: torch.Tensor) -> None:
        try:
            self.group.broadcast(t.contiguous())
        except ParallelError as e:
            self._fail(e)

    def _fail(self, e: ParallelError):
        self._failed = str(e)
        self.group.live = False
        if self.group.on_failure is not None:
            self.group.on_failure(self._failed)
        raise e

    def close(self) -> None:
        """End the run: the other ranks leave their loop (a no-op once the run failed)."""
        if self.group.size > 1 and self._failed is None and self.group.live:
            self._send(STOP)
            self.group.live = False

    # ------------------------------------------------------------------ the model API

    def new_cache(self, max_tokens: int | None = None, rewind_slack: int | None = None) -> EngineKVCache:
        if self.group.size == 1:
            return super().new_cache(max_tokens, rewind_slack)
        tokens = cache_tokens(self.config, max_tokens)
        cache = SharedCache(self.config, tokens, self.device, self.kv_dtype, rewind_slack=rewind_slack)
        cid, self._next_cid = self._next_cid, self._next_cid + 1
        self._send(NEW_CACHE, cid, tokens, -1 if rewind_slack is None else rewind_slack)
        return cache.bind(self, cid)

    @torch.no_grad()
    def prefill(self, cache: EngineKVCache, ids: torch.Tensor, embeds: torch.Tensor | None = None,
                image_groups: torch.Tensor | None = None) -> None:
        if self.group.size > 1:
            ids = check_ids(self, ids, "prefill ids", check_range=True)
            if embeds is not None or image_groups is not None:
                embeds, image_groups = check_image_inputs(self, len(ids), embeds, image_groups)
            cache.check_room(len(ids))
            self._send(PREFILL, self._cid(cache), len(ids), int(embeds is not None), int(image_groups is not None))
            for t in (ids, embeds, image_groups):
                if t is not None:
                    self._payload(t)
        self._run(super().prefill, cache, ids, embeds, image_groups)

    def commit(self, cache: EngineKVCache, ids: torch.Tensor) -> None:
        if self.group.size > 1:  # the followers append it too, as a prefill
            return self.prefill(cache, ids)
        return super().commit(cache, ids)

    def prefill_batch(self, caches, ids) -> None:
        if self.group.size > 1:  # each chunk handed over as its own commit (a prefill for the followers)
            for cache, x in zip(caches, ids):
                self.commit(cache, x)
            return
        super().prefill_batch(caches, ids)

    def denoise_raw(self, cache: EngineKVCache, canvas_ids: torch.Tensor, sc_logits: torch.Tensor | None = None,
                    sc_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.group.size == 1:
            return super().denoise_raw(cache, canvas_ids, sc_logits, sc_embeds)
        with torch.no_grad():
            ids, sc = self._denoise_inputs(cache, canvas_ids, sc_logits, sc_embeds)
            self._send(DENOISE, self._cid(cache), len(ids), int(sc is not None))
            self._payload(ids)
            if sc is not None:
                self._payload(sc)
            return self._run(super().denoise_raw, cache, ids, None, sc)

    @torch.no_grad()
    def denoise_batch_raw(self, caches, canvases, sc_logits=None, sc_embeds=None) -> list[torch.Tensor]:
        if self.group.size == 1:
            return super().denoise_batch_raw(caches, canvases, sc_logits, sc_embeds)
        caches, ids, lens, rows, _ = check_batch(self, caches, canvases, sc_logits, sc_embeds)
        given = [(lg is not None or em is not None) for lg, em in zip(sc_logits or [None] * len(lens),
                                                                     sc_embeds or [None] * len(lens))]
        sc = [x if g else None for x, g in zip(rows.split(lens), given)]  # a lane's SC rows (logits: their embedding)
        cids = [self._cid(c) for c in caches]
        self._send(DENOISE_BATCH, len(caches))
        self._run(self.group.broadcast_object, (cids, lens, [s is not None for s in sc]))
        for t in [ids] + [s for s in sc if s is not None]:
            self._payload(t)
        return self._run(super().denoise_batch_raw, caches, list(ids.split(lens)), None, sc)

    def stage_denoise(self, cache, canvas_ids, sc_embeds=None, go=None) -> bool:
        if self.group.size == 1:
            return super().stage_denoise(cache, canvas_ids, sc_embeds, go)
        self._staged = self._ahead = None
        return False

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except ParallelError as e:
            self._fail(e)

    def _cid(self, cache) -> int:
        if getattr(cache, "lead", None) is not self:
            raise InputError("expert parallel: this cache was not made by this model's new_cache")
        return cache.cid

    def _denoise_inputs(self, cache, canvas_ids, sc_logits, sc_embeds):
        """Engine's checks of a denoise call, made before the call is handed over (so a bad call reaches no other
        rank), and its SC input as embeddings in the model's dtype (None without one)."""
        ids, mode, sc = check_denoise(self, cache, canvas_ids, sc_logits, sc_embeds)
        if mode == "logits":  # the forward's own first ops of an SC-logits call (Forward.sc_logits_embeds)
            return ids, self.forward.sc_logits_embeds(sc.to(self.device))
        return ids, None if sc is None else sc.to(self.device, self.dtype)
