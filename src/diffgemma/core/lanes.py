"""A round's device work over its lanes (the running requests that step together), each lane exactly as it would
run alone (docs/ARCHITECTURE.md, 'Batching'):

    forward_lanes   the round's forward: one lane on its own denoiser, several in one batched forward per canvas
                    length
    lane_stats      every lane's StepStats of its logits, made in this one place
    read_asks       every lane's host read (step statuses, block reads) with one host wait
"""

from __future__ import annotations

from ..model.denoiser import queue_copy, read_statuses, wait_statuses
from ..sampling.stats import StepStats
from .steps import BlockRead, ForwardAsk


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
    device or vocabulary, go lane by lane.

    The rest of a step's sampler (accept rule, sparse-SC plan, soft embedding) runs inside each request's steps
    (core/steps._denoise_block), lane by lane; accept_masks and SparsePlan.batch would batch it from a round that
    holds every lane's stats at once."""
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
