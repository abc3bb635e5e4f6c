"""Self-conditioning soft embeddings (docs/ARCHITECTURE.md, 'Self-conditioning').

soft_embed = softmax(sc_logits) @ embedding * sqrt(hidden), where sc_logits are the previous step's
logits already divided by that step's temperature.

- exact: the dense [C, V] @ [V, H] product (the reference; what transformers computes).
- sparse: only "survivor" tokens with prob >= exp(-log_ratio) * row max (logit >= row max - log_ratio)
  are gathered; the tail is dropped without renormalising. Per row the error is bounded by
      |sparse - exact|_inf <= sqrt(hidden) * tail_mass * max|embedding|,
  tail_mass = the probability of the dropped tokens; `sparse_error_bound` computes it. The SC MLP's
  RMSNorm is scale-invariant, so the missing tail mass itself (a uniform shrink) does not matter.

Which to use: at the real vocabulary (262144 x 2816) the gather of a trained model's few survivors a row reads
a few embedding rows where the dense product reads the whole table; at tiny vocabularies, or with many survivors
a row, the dense product does less work.
So GenerationSettings.sc_mode defaults to "sparse", and rows with too many survivors fall back to the dense
product (docs/ARCHITECTURE.md, 'Self-conditioning').
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ..ops.rowstats import tempered_counted_probs, tempered_masked_probs, tempered_survivors
from ..ops import sc_gather
from ..ops.lane_temps import host_to_device
from ..ops.sc_gather import segment_embed
from ..ops.survivor_list import survivor_counts, survivor_list


def exact_soft_embed(sc_logits: torch.Tensor, embedding: torch.Tensor, scale: float) -> torch.Tensor:
    """[C, V] logits -> [C, H] soft embedding in the embedding's dtype (probs in float32, then cast)."""
    probs = torch.softmax(sc_logits, dim=-1, dtype=torch.float32).to(embedding.dtype)
    return (probs @ embedding) * torch.tensor(scale, dtype=torch.float32).to(embedding.dtype)


def survivors(sc_logits: torch.Tensor, log_ratio: float) -> torch.Tensor:
    """Bool [C, V]: tokens whose probability is within exp(-log_ratio) of their row's max."""
    logits = sc_logits.float()
    return logits >= logits.max(dim=-1, keepdim=True).values - log_ratio


def sparse_soft_embed(sc_logits: torch.Tensor, embedding: torch.Tensor, scale: float, log_ratio: float) -> torch.Tensor:
    """Survivor-gather soft embedding: sum over kept tokens of p * embedding row, f32 accumulate."""
    logits = sc_logits.float()
    log_z = logits.logsumexp(dim=-1)
    rows, cols = survivors(logits, log_ratio).nonzero(as_tuple=True)
    weights = torch.exp(logits[rows, cols] - log_z[rows])
    out = torch.zeros(logits.shape[0], embedding.shape[1], dtype=torch.float32, device=embedding.device)
    out.index_add_(0, rows, weights[:, None] * embedding[cols].float())
    return (out * scale).to(embedding.dtype)


def sparse_error_bound(sc_logits: torch.Tensor, embedding: torch.Tensor, scale: float, log_ratio: float) -> float:
    """Worst-case max |sparse - exact| over the canvas (see module docstring), float64."""
    logits = sc_logits.double()
    probs = torch.softmax(logits, dim=-1)
    tail = (probs * (~survivors(logits, log_ratio))).sum(dim=-1)
    return float(tail.max()) * scale * float(embedding.abs().max())


def counts_within(row_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The row counts cut to the first `size` survivors in row order (the counts themselves when they sum to at most
    `size`), so no kernel reads past a list of that size. In the counts' own dtype, as the gather after the read
    passes them: one compiled variant of the gather kernels for both paths, not two (each first compile would land
    mid-run)."""
    counts = row_counts.to(torch.int64)
    cut = (counts - (counts.cumsum(0) - size).clamp(min=0)).clamp(min=0)
    return cut.to(row_counts.dtype)


class _SharedPasses:
    """A SparsePlan.batch's passes over all lanes' rows: the stats' LaneRows, thresholds, survivor counts per (row,
    segment) (ops/survivor_list.py; None where the pass was the dense bet's), row counts; each plan's are views of
    them. With `ahead` (a size), the gather of every row's survivors is queued before the status read (`start`),
    sized for that many survivors; after the read it serves the plans only if the list held every row's (`take`)."""

    def __init__(self, shared, thr, seg_counts, counts, ahead: int = 0):
        self.shared, self.thr, self.seg_counts, self.counts = shared, thr, seg_counts, counts
        self.ahead, self.summed, self.plans = ahead, None, []

    def start(self, embedding: torch.Tensor, scale: float) -> None:
        """Queue the gather ahead (once): every row's survivors listed into `ahead` slots, the kernels summing each
        row's from its count cut to the list (no read past it; a cut row's sum is wrong and `take` drops it)."""
        if self.ahead and self.summed is None:
            cut = counts_within(self.counts, self.ahead)
            self.summed = _gather_rows(self, self.seg_counts, cut, self.ahead, embedding, scale, padded=True)

    def take(self) -> torch.Tensor | None:
        """The gather ahead's [R, H] sums, if it ran and every plan's count (as read, SparsePlan.read) fits the list:
        then each gather lane's rows are the sums soft_embed_batch would make after the read; else None."""
        summed, self.summed = self.summed, None
        if summed is None or any(p.read is None for p in self.plans):
            return None
        return summed if sum(p.read for p in self.plans) <= self.ahead else None


def _thresholds(rowmax: torch.Tensor, spans: list, log_ratios: list) -> torch.Tensor:
    """rowmax - log_ratio of each row's lane (a lane's rows: rowmax[sl] - its ratio, as its solo plan subtracts); a
    lane whose ratio is None makes no plan: its rows' threshold is +inf (no survivor, nothing counted)."""
    if len(set(log_ratios)) == 1 and log_ratios[0] is not None:
        return rowmax - log_ratios[0]
    thr = torch.full_like(rowmax, float("inf"))
    for sl, r in zip(spans, log_ratios):
        if r is not None:
            torch.sub(rowmax[sl], r, out=thr[sl])
    return thr


def _gather_rows(group, seg_counts: torch.Tensor, row_counts: torch.Tensor, n: int, embedding: torch.Tensor,
                 scale: float, padded: bool = False) -> torch.Tensor:
    """The survivors' soft embedding of every row of a batch's passes, [R, H] (SparsePlan._gather over all lanes'
    rows at once): the `n` survivors of the (row, segment)s whose `seg_counts` are not 0, listed in row-major order
    (ops/survivor_list.py: the mask's nonzero, from the group maxima's columns only), weighted with each row's lane
    temperature."""
    shared = group.shared
    # z as the passes compared it: the bits of softcap(value) / its lane's temperature, as the solo gather makes it
    rows, cols, z = survivor_list(shared.rows, shared.lanes, group.thr, shared.groups, seg_counts, n, cap=shared.cap,
                                  padded=padded)
    weights = torch.exp(z - shared.fields[3][rows])
    step = max(1, SparsePlan.gather_chunk_bytes // (embedding.shape[1] * 4))
    return (segment_embed(rows, row_counts, cols, weights, embedding, cpu_chunk=step) * scale).to(embedding.dtype)


def _use_summed(plans: list, gather: list, out: list, summed: torch.Tensor, spans: list) -> list:
    """Each gather lane's soft embedding: its rows of a batch gather's sums."""
    for k in gather:
        p = plans[k]
        p.took_dense, p.mask, p.probs = False, None, None
        out[k] = summed[spans[p.lane]]
    return out


class SparsePlan:
    """Sparse SC split in two around the generation loop's one host read per step.

    Before the read (`SparsePlan(stats, log_ratio)`): the survivor mask and its total count stay on the
    device; the count travels in the step's status. After the read (`soft_embed(n, ...)`): a fixed-size
    nonzero (no sync, since n is known) gathers the survivors. On the torch path every number is the one
    `sparse_soft_embed(stats.processed, ...)` computes (same mask, same order, same index_add_); on the
    fused path the mask comes from the Triton survivor kernel and log Z from the row-stats kernel.

    dense_dtype (fused path only; the embedding's dtype): the caller bets that the count will call for the
    dense product (flat rows; the loop bets on what the previous step took). Then one pass writes the
    survivors' probabilities and counts them (no mask), and `start` queues the product behind the status
    copy, so the GPU computes it while the host waits for the status and turns around. The bet only moves
    work in time: soft_embed still follows the count, and a lost bet drops the product and builds the mask
    after the read. The gather sums with ops/sc_gather.py: index_add_ on the CPU, fixed-order kernels on CUDA.

    sparse_ahead (fused path on CUDA, no dense bet): the bet that the count will call for the gather; `start` then
    queues the gather before the read too, sized for the most survivors the gather takes (`gather_cap`): the kernels
    sum each row's survivors from the row counts, so the padding past the real count adds nothing, and the sum is
    the one soft_embed(n) makes after the read.
    """

    def __init__(self, stats, log_ratio: float, dense_dtype: torch.dtype | None = None,
                 scratch: torch.Tensor | None = None, sparse_ahead: bool = False):
        """scratch: a dead [C, V] buffer (Engine.logits_scratch) that the dense fallback's probabilities (when its dtype
        is the embedding's) or the survivor mask may be written to, instead of new tensors; the same numbers either
        way. The probabilities and the mask are never alive at once (_take_mask / _dense_soft_embed)."""
        self.stats = stats
        self.log_ratio = log_ratio
        self.scratch = scratch
        self.probs = self.product = None
        self.product_is_dense = None  # which sum `product` is, once `start` made one
        self.took_dense = None  # set by soft_embed: which way the count sent it
        # the padding past the count is safe only where the gather runs the kernels (the CPU twin would add it)
        self.sparse_ahead = sparse_ahead and dense_dtype is None and stats.fused and sc_gather.use_triton(stats.logits)
        if stats.fused:
            self.thr = stats.rowmax - log_ratio
            self.log_z = stats.lse
            if dense_dtype is not None:
                self.mask = None  # built after the read if the bet is lost (_take_mask)
                self.probs, self.row_counts = tempered_counted_probs(stats.logits, stats.temp, self.thr, self.log_z,
                                                                     dense_dtype, out=self._scratch_for(dense_dtype),
                                                                     cap=stats.cap)
            else:
                self.mask, self.row_counts = tempered_survivors(stats.logits, stats.temp, self.thr,
                                                                out=self._scratch_mask(), cap=stats.cap)
        else:
            self._z = stats.processed.float()
            self.log_z = self._z.logsumexp(dim=-1)
            self.mask = survivors(self._z, log_ratio)
            self.row_counts = self.mask.sum(-1)
        self._count = self.read = None  # read: the count as the status read gave it (model/denoiser.py)
        self.shared = None  # set by `batch`: the plans of one batch share their passes' results

    @classmethod
    def batch(cls, stats: list, log_ratios, dense_dtypes=None) -> list["SparsePlan"]:
        """Every lane's plan of a batched round: lane i's is SparsePlan(stats[i], log_ratios[i],
        dense_dtype=dense_dtypes[i]) (no scratch). Where the stats are lanes of one StepStats.batch
        (fused; any of its lanes, in any order): when every lane bets on the dense product in one dtype, one
        counted-probability pass over all the batch's rows; else one survivor count over all rows serves the lanes that
        bet on the gather (ops/survivor_list.py: it reads only the columns of the groups whose maximum, from the row
        pass, reaches the threshold; the others' rows are counted too, unused; a row pass without group maxima,
        stats.with_groups, sends them lane by lane) and a lane that bets dense makes its own plan. The batch's lanes
        that ask no plan get none (their rows' threshold is +inf). Otherwise lane by lane. A plan of the shared count
        holds no mask: soft_embed_batch lists its survivors (or takes the group's gather ahead of the read, on the
        kernels: _SharedPasses.start), and a plan summing on its own makes its mask then (_take_mask).

        Exactness: each plan's survivors, row counts, count, bet probabilities and soft embedding have the bits of the
        solo plan's: the passes compare and exponentiate each value on its own (their only sums are integer counts),
        and z is read with the lane's temperature (ops/lane_temps.py)."""
        B = len(stats)
        log_ratios = [float(r) for r in log_ratios]
        dense_dtypes = list(dense_dtypes) if dense_dtypes is not None else [None] * B
        if not (len(log_ratios) == len(dense_dtypes) == B):
            raise TensorError(f"SparsePlan.batch: expected one log ratio and one dense dtype per lane, got "
                              f"{len(log_ratios)} / {len(dense_dtypes)} for {B} lanes")
        shared = stats[0].shared if B else None
        all_dense = len(set(dense_dtypes)) == 1 and dense_dtypes[0] is not None
        if (shared is None or any(s.shared is not shared or not s.fused for s in stats)
                or len({s.lane for s in stats}) != B or (not all_dense and shared.groups is None)
                or (not all_dense and sum(d is None for d in dense_dtypes) < 2)):
            return [cls(s, r, dense_dtype=d) for s, r, d in zip(stats, log_ratios, dense_dtypes)]
        spans = shared.lanes.spans()
        by_lane: list = [None] * len(spans)
        for s, r in zip(stats, log_ratios):
            by_lane[s.lane] = r
        thr = _thresholds(shared.fields[2], spans, by_lane)
        seg_counts = probs = None
        if all_dense:
            probs, counts = tempered_counted_probs(shared.rows, shared.lanes, thr, shared.fields[3], dense_dtypes[0],
                                                   cap=shared.cap)
        else:  # no mask: the gather lists the survivors from the group maxima after the read (soft_embed_batch)
            seg_counts = survivor_counts(shared.rows, shared.lanes, thr, shared.groups, cap=shared.cap)
            counts = seg_counts[:, 0] if seg_counts.shape[1] == 1 else seg_counts.sum(-1, dtype=torch.int32)
        # the gather ahead, on the kernels only (the CPU twin would add the padding past the count)
        ahead = shared.rows.shape[0] * cls.batch_ahead_rows if seg_counts is not None and sc_gather.use_triton(
            shared.rows) else 0
        group = _SharedPasses(shared, thr, seg_counts, counts, ahead=ahead)
        plans = []
        for s, r, d in zip(stats, log_ratios, dense_dtypes):
            if d is not None and not all_dense:
                plans.append(cls(s, r, dense_dtype=d))
                continue
            sl = spans[s.lane]
            p = cls.__new__(cls)
            p.lane = s.lane  # its lane in the stats' LaneTemps
            p.stats, p.log_ratio, p.scratch, p.sparse_ahead = s, r, None, bool(group.ahead) and probs is None
            p.product = p.product_is_dense = p.took_dense = p._count = p.read = None
            p.thr, p.log_z, p.row_counts = thr[sl], s.lse, counts[sl]
            p.mask = None  # made from the logits if the plan sums on its own (_take_mask)
            p.probs = None if probs is None else probs[sl]
            p.shared = group
            group.plans.append(p)
            plans.append(p)
        return plans

    @staticmethod
    def counts_batch(plans: list) -> torch.Tensor:
        """int64 [B] on the device: torch.stack([p.count for p in plans]), the same numbers (integer sums). For the
        plans of one SparsePlan.batch (any of its lanes) over lanes of one length and no gap rows, one sum over all
        rows (each plan's count is then its entry); otherwise lane by lane."""
        group = plans[0].shared if plans else None
        lanes = group.shared.lanes if group is not None else None
        if (group is None or any(p.shared is not group for p in plans) or len({p.lane for p in plans}) != len(plans)
                or not group.shared.whole or len(set(lanes.lengths)) != 1):
            return torch.stack([p.count for p in plans])
        C = lanes.lengths[0]
        sums = group.counts.view(len(lanes), C).sum(1, dtype=torch.int64)  # the lanes' blocks in row order
        blocks = [lanes.starts[p.lane] // C for p in plans]
        if blocks != list(range(len(plans))):
            sums = sums[host_to_device(torch.tensor(blocks), sums.device)]
        for p, n in zip(plans, sums.unbind()):
            p._count = n
        return sums

    @staticmethod
    def soft_embed_batch(plans: list, counts, embedding: torch.Tensor, scale: float) -> list[torch.Tensor]:
        """[p.soft_embed(n, embedding, scale) for p, n in zip(plans, counts)], the same bits. The plans of one
        SparsePlan.batch's survivor counts (over rows that are all some lane's) whose count takes the gather are summed
        by one gather (their survivors listed from the group maxima, ops/survivor_list.py; ops/sc_gather.py sums each
        row's survivors on their own, in index order; the other lanes' rows are left out of both); every other plan
        makes its own."""
        counts = [int(n) for n in counts]
        hidden = embedding.shape[1]
        group = next((p.shared for p in plans if p.shared is not None), None)
        gather = [] if group is None or not group.shared.whole or group.seg_counts is None else [
            k for k, (p, n) in enumerate(zip(plans, counts))
            if p.shared is group and p.product is None and not p.takes_dense(n, hidden)]
        out = [None if k in gather else p.soft_embed(n, embedding, scale)
               for k, (p, n) in enumerate(zip(plans, counts))]
        if not gather:
            return out
        lanes = group.shared.lanes
        spans = lanes.spans()
        summed = group.take()
        if summed is not None:  # the gather queued before the read held every row's survivors
            return _use_summed(plans, gather, out, summed, spans)
        seg_counts, row_counts = group.seg_counts, group.counts
        left_out = set(range(len(lanes))) - {plans[k].lane for k in gather}
        if left_out:  # their rows' survivors stay out of the list and the sums
            seg_counts, row_counts = seg_counts.clone(), row_counts.clone()
            for j in left_out:
                seg_counts[spans[j]] = 0
                row_counts[spans[j]] = 0
        summed = _gather_rows(group, seg_counts, row_counts, sum(counts[k] for k in gather), embedding, scale)
        return _use_summed(plans, gather, out, summed, spans)

    @property
    def count(self) -> torch.Tensor:
        """The survivors in all, an int64 device scalar, summed on the stream current at the first ask (the loop asks
        on its side stream, so the sum does not queue ahead of the dense product on the main one)."""
        if self._count is None:
            self._count = self.row_counts.sum(dtype=torch.int64)
        return self._count

    def _lent(self) -> torch.Tensor | None:
        """The scratch, when one is lent that the kernels can write: contiguous, beside the logits, and not the logits'
        own storage (raw logits are the engine's graph output, the very buffer it lends once they are dead)."""
        s, logits = self.scratch, self.stats.logits
        if s is None or not s.is_contiguous() or s.device != logits.device:
            return None
        return None if s.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() else s

    def _scratch_for(self, dtype) -> torch.Tensor | None:
        """The scratch itself as the probabilities' buffer, when it has their dtype and shape."""
        s = self._lent()
        return s if s is not None and s.dtype == dtype and s.shape == self.stats.logits.shape else None

    def _scratch_mask(self) -> torch.Tensor | None:
        """The survivor mask's int8 [C, V] buffer inside the scratch (its first C·V bytes)."""
        s = self._lent()
        rows, n = self.stats.logits.shape
        if s is None or s.numel() * s.element_size() < rows * n:
            return None
        return s.view(-1).view(torch.int8)[: rows * n].view(rows, n)

    @property
    def speculative(self) -> bool:
        """Whether `start` will queue a product: a dense bet's, or the gather ahead."""
        return self.probs is not None or self.sparse_ahead

    @property
    def bets_dense(self) -> bool:
        return self.probs is not None or self.product_is_dense is True

    def start(self, embedding: torch.Tensor, scale: float) -> None:
        """Queue the bet's sum (called while the status read is in flight): the dense product on the bet's
        probabilities, or the gather sized for `gather_cap` survivors."""
        if self.probs is not None:
            self.product = self._product(self.probs, embedding, scale)
            self.probs = None
            self.product_is_dense = True
        elif self.sparse_ahead and self.shared is not None:  # a batch's plan: its group's one gather, once
            self.shared.start(embedding, scale)
        elif self.sparse_ahead and self.product is None:
            self.product = self._gather(min(self.gather_cap(embedding.shape[1]), self.stats.logits.numel()), embedding,
                                        scale, bound=True)
            self.product_is_dense = False

    def bet_holds(self, n: torch.Tensor, hidden: int) -> torch.Tensor:
        """On the device: whether the count `n` (an int64 device scalar) sends soft_embed the way this plan bet."""
        dense = self.takes_dense(n, hidden)
        return dense if self.bets_dense else ~dense

    def gather_cap(self, hidden: int) -> int:
        """The most survivors the gather takes (one more goes to the dense product)."""
        return self.gather_bytes_limit // (hidden * 4)

    # Above this many bytes of gathered embedding rows (n survivors x hidden x f32) the survivors are summed
    # as one dense product of the masked probabilities instead: flat rows (random weights, an unconverged
    # canvas) can keep most of the vocabulary, and the gather would need n x hidden floats (tens of GiB on
    # the full-size random model). Converging canvases keep a few tokens per row and take the gather.
    gather_bytes_limit = 256 * 2**20
    # A batch's gather ahead of the read (SparsePlan.batch) lists this many survivors a row of the batch: converging
    # canvases keep a few tokens a row; a round whose rows keep more sums after the read instead. 0: never ahead.
    batch_ahead_rows = 32
    # Off CUDA the gathered rows are summed (index_add_) in chunks of this many bytes (f32): a whole 256 MiB gather
    # would hold its rows as bf16, f32 and weighted f32 at once, three copies at the sampler's peak.
    # Chunks keep the same adds in the same order. On CUDA the segment kernel
    # (ops/sc_gather.py) reads the embedding rows in place: no gathered copy, and the same sum on every run.
    gather_chunk_bytes = 32 * 2**20

    def _take_mask(self) -> torch.Tensor:
        """The survivor mask, which the plan then forgets: a [canvas, vocab] mask kept would sit beside the SC's
        peak allocation. A second soft_embed recomputes it (the same kernel or formula, the same bits)."""
        mask = self.mask
        if mask is None:
            if self.stats.fused:
                mask = tempered_survivors(self.stats.logits, self.stats.temp, self.thr, out=self._scratch_mask(),
                                          cap=self.stats.cap)[0]
            else:
                mask = survivors(self._z, self.log_ratio)
        self.mask = None
        return mask

    def takes_dense(self, n, hidden: int):
        """Whether n survivors (an int, or an int64 device tensor: then a bool tensor) go to the dense product."""
        return n * (hidden * 4) > self.gather_bytes_limit

    def soft_embed(self, n: int, embedding: torch.Tensor, scale: float) -> torch.Tensor:
        self.took_dense = self.takes_dense(n, embedding.shape[1])
        product, self.product = self.product, None
        if product is not None and self.product_is_dense == self.took_dense:
            return product  # the bet's sum, started before the read
        if self.took_dense:
            return self._dense_soft_embed(embedding, scale)
        self.probs = None  # a lost bet: its product (if started) is not the sum asked for
        return self._gather(n, embedding, scale)

    def _gather(self, size: int, embedding: torch.Tensor, scale: float, bound: bool = False) -> torch.Tensor:
        """The survivors' sum, their indices listed by a fixed-size nonzero: `size` = the count (after the read), or
        (bound) a cap the count may pass (ahead of the read, on the kernels, which sum each row's survivors from the
        row counts: the padding's weights are made at a valid index, -1, and never read). Past the cap the list is cut
        and so are the counts the kernels get: that sum is wrong, but then the count sends soft_embed to the dense
        product and the sum is dropped."""
        rows, cols = torch.nonzero_static(self._take_mask(), size=size).unbind(1)
        counts = self._counts_within(size) if bound else self.row_counts
        if self.stats.fused:  # z at the survivors only: the same softcap and correctly rounded division as the kernel's
            z = self.stats.softcapped(self.stats.logits[rows, cols]) / self.stats.temp_tensor()
        else:
            z = self._z[rows, cols]
        weights = torch.exp(z - self.log_z[rows])
        step = max(1, self.gather_chunk_bytes // (embedding.shape[1] * 4))
        out = segment_embed(rows, counts, cols, weights, embedding, cpu_chunk=step)
        return (out * scale).to(embedding.dtype)

    def _counts_within(self, size: int) -> torch.Tensor:
        return counts_within(self.row_counts, size)

    @staticmethod
    def _product(probs: torch.Tensor, embedding: torch.Tensor, scale: float) -> torch.Tensor:
        """(probs @ embedding) · scale in the embedding's dtype. The scale multiplies in place: torch forms a reduced
        float times a Python scalar in f32 and rounds once, the bits of `(product.float() * scale).to(dtype)` in one
        kernel instead of three (tests/test_generate_sync.py holds the two equal)."""
        return (probs.to(embedding.dtype) @ embedding).mul_(scale)

    def _dense_soft_embed(self, embedding: torch.Tensor, scale: float) -> torch.Tensor:
        """The same sum over survivors as one [C, V] @ [V, H] product (in the embedding's dtype, like exact SC)."""
        if self.probs is not None:  # the bet's probabilities, not yet multiplied
            probs, self.probs = self.probs, None
        elif self.stats.fused:  # one pass over the logits (the mask is z >= thr, recomputed in the kernel)
            self.mask = None  # not needed here: gone before the probabilities are allocated
            probs = tempered_masked_probs(self.stats.logits, self.stats.temp, self.thr, self.log_z, embedding.dtype,
                                          out=self._scratch_for(embedding.dtype), cap=self.stats.cap)
        else:
            probs = torch.where(self._take_mask(), torch.exp(self._z - self.log_z[:, None]), 0.0).to(embedding.dtype)
        return self._product(probs, embedding, scale)
