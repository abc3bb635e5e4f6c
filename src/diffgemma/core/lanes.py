"""A round's device work over its lanes (the running requests that step together), each lane exactly as it would
run alone (docs/ARCHITECTURE.md, 'Batching'):

    forward_lanes   the round's forward: one lane on its own denoiser, several in one batched forward per canvas
                    length
    lane_stats      every lane's StepStats of its logits, made in this one place
    lane_masks      every lane's accept mask (sampling/accept.accept_masks)
    lane_plans      every lane's sparse-SC plan, before the status read (SparsePlan.batch, counts_batch)
    read_asks       every lane's host read (step statuses, block reads) with one host wait
    lane_embeds     every lane's next SC embedding, after the read (SparsePlan.soft_embed_batch)
    commit_lanes    the commits of the lanes that ended a block, as one batched prefill (the model's prefill_batch)

Each makes one launch of each kernel for all lanes where the lanes' numbers allow it, and each lane gets the bits it
gets alone: a solo request is a batch of one. Lanes the batched kernels cannot serve together (other canvas lengths,
a frozen mask, another softcap) go lane by lane, inside the sampling functions.
"""

from __future__ import annotations

from ..model.denoiser import queue_copy, read_statuses, wait_statuses
from ..sampling.accept import accept_mask, accept_masks
from ..sampling.self_condition import SparsePlan
from ..sampling.stats import StepStats
from .steps import BlockRead, CommitAsk, EmbedAsk, ForwardAsk, Sampled, StatusAsk, own_plan


def forward_lanes(model, asks: list[ForwardAsk]) -> list:
    """The round's forward: one request on its own denoiser (exactly its solo step), several in one batched forward
    over their caches, one per canvas length (a re-rolled block's shorter canvas steps apart: a batch's kernels are
    chosen for one canvas length, the one every lane then has alone). Returns each lane's logits, in order. A
    batched forward's logits may be views of a buffer the engine's next batched forward overwrites
    (Engine.denoise_batch_raw), so a group's are copied when another batched group follows in the round."""
    if len(asks) == 1:
        return [asks[0].run()]
    groups: dict[int, list[int]] = {}
    for k, f in enumerate(asks):
        groups.setdefault(len(f.canvas), []).append(k)
    batched_left = sum(len(ks) > 1 for ks in groups.values())
    out: list = [None] * len(asks)
    for ks in groups.values():
        group = [asks[k] for k in ks]
        if len(group) == 1:
            logits = [group[0].run()]
        else:
            den = model.denoiser([f.cache for f in group])
            logits = den.forward([f.canvas for f in group], sc_logits=[f.sc_logits for f in group],
                                 sc_embeds=[f.sc_embeds for f in group])
            den.close()
            batched_left -= 1
            if batched_left:
                logits = [x.clone() for x in logits]
        for k, x in zip(ks, logits):
            out[k] = x
    return out


def lane_stats(asks: list[ForwardAsk], logits: list) -> list[StepStats]:
    """Each lane's row stats of its step's logits at its temperature, with its denoiser's softcap: the answers to
    the round's ForwardAsks. The one place a round makes its lanes' StepStats: StepStats.batch, so lanes that are
    views of one batched forward's buffer get their row stats in one launch, each lane the bits it has alone (a
    solo request is a batch of one). Lanes whose denoisers disagree on the softcap, or whose logits differ in dtype,
    device or vocabulary, go lane by lane."""
    caps = {ask.den.cap for ask in asks}
    if len(caps) != 1 or len({(x.dtype, x.device, x.shape[-1]) for x in logits}) != 1:
        return [StepStats(x, ask.temp, cap=ask.den.cap) for ask, x in zip(asks, logits)]
    return StepStats.batch(logits, [ask.temp for ask in asks], cap=caps.pop())


def read_asks(asks: list) -> list:
    """Several lanes' host reads in one wait: StatusAsks (model/denoiser.read_statuses) and BlockReads (a block's
    values), each answered as its own run() would. The blocks' copies are queued first, so a lane's block read never
    waits for what another lane queues after its own read (its block's commit)."""
    blocks = [k for k, a in enumerate(asks) if isinstance(a, BlockRead)]
    pending = [queue_copy(asks[k].packed) for k in blocks]
    rest = [a for a in asks if not isinstance(a, BlockRead)]
    statuses = iter(read_statuses(rest) if rest else [])
    values = dict(zip(blocks, wait_statuses(pending)))
    return [values[k] if k in values else next(statuses) for k in range(len(asks))]


def lane_masks(asks: list[ForwardAsk], stats: list[StepStats]) -> list[Sampled]:
    """Each lane's accept mask of its stats by its ask's rule: the answers to the round's ForwardAsks. Unfrozen lanes
    of a batch in one accept_masks call (one launch where their entropies are views of one StepStats.batch); a solo
    lane, and a frozen one, on its own denoiser's bookkeeping stream, where its freeze mask is born and replaced
    (model/denoiser.SideStream)."""
    masks: list = [None] * len(asks)
    together = [k for k, a in enumerate(asks) if a.frozen is None] if len(asks) > 1 else []
    if len(together) > 1:
        got = accept_masks([stats[k].entropy for k in together], [asks[k].bound for k in together],
                           [asks[k].final_step for k in together])
        for k, m in zip(together, got):
            masks[k] = m
    for k, (a, st) in enumerate(zip(asks, stats)):
        if masks[k] is None:
            with a.den.bookkeeping():
                masks[k] = accept_mask(st.entropy, a.bound, final_step=a.final_step, frozen=a.frozen)
    return [Sampled(st, m) for st, m in zip(stats, masks)]


def lane_plans(asks: list, lend: bool) -> None:
    """Make the sparse-SC plan of every StatusAsk that asks for one and has none yet (ask.plan). Several:
    SparsePlan.batch (one pass over the lanes' rows of one StepStats.batch) and their survivor counts by
    SparsePlan.counts_batch. One: its own plan (steps.own_plan), which with `lend` (a core stepping one request)
    writes into its denoiser's dead logits buffer and may queue its gather ahead of the read (den.run_ahead)."""
    want = [a for a in asks if isinstance(a, StatusAsk) and a.sc_ratio is not None and a.plan is None]
    if len(want) == 1:
        a = want[0]
        a.plan = own_plan(a.stats, a.sc_ratio, a.dense_dtype, a.den, lend)
    elif want:
        plans = SparsePlan.batch([a.stats for a in want], [a.sc_ratio for a in want], [a.dense_dtype for a in want])
        for a, plan in zip(want, plans):
            a.plan = plan
        shared = [p for p in plans if p.shared is not None]  # a lane betting dense among gathers has its own plan
        if len(shared) > 1 and all(p.shared is shared[0].shared for p in shared):
            SparsePlan.counts_batch(shared)


def lane_embeds(model, asks: list[EmbedAsk]) -> list:
    """Each lane's next SC embedding, plan.soft_embed(count): one gather for the plans of one SparsePlan.batch that
    take it (SparsePlan.soft_embed_batch), each lane the sum it makes alone."""
    return SparsePlan.soft_embed_batch([a.plan for a in asks], [a.count for a in asks], model.embedding,
                                       model.config.embed_scale)


def commit_lanes(model, asks: list[CommitAsk]) -> list:
    """Append each lane's block to its cache: several through the model's `prefill_batch` (one forward over their
    caches, each cache written with the bits of its own commit) where the model has one, else each lane's own
    commit (CommitAsk.run) -> one None per ask."""
    batch = getattr(model, "prefill_batch", None) if len(asks) > 1 else None
    if batch is None:
        for a in asks:
            a.run()
    else:
        batch([a.cache for a in asks], [a.ids for a in asks])
    return [None] * len(asks)
