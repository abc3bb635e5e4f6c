"""Top-k sparse attention for the full-attention layers (a generation setting, off by default: it changes tokens).

Each query row attends only to its k highest-scoring visible keys, k from the number of keys that row may see:
    k = clamp(n_visible // divisor, min_keys, max_keys)                       (TopKRule.keys)
Selection is exact top-k by score (the f32 score q·k, scale 1), ties at the k-th score going to the lower key
index; the softmax runs over the selected set only. A row whose k covers all its visible keys is dense attention
(the same mask, so the twin gives attention_ref's bits). docs/ARCHITECTURE.md ('Generation contract', 'Attention').

Shapes are ops/attention.py's: q [H, n, d] head-major, k/v [KV, rows, d] (the first n_keys rows read), GQA folded.
Masks: causal (prefill) with kpos/qpos (full layers: no window), or the bidirectional canvas with kpos None and
`nlive` (a device scalar: keys below it are visible).

  topk_mask             the selection as a boolean mask over a score matrix (both twins, the reference model)
  attention_topk_ref    f32 twin: the dense scores per query block, masked to the selection (tests, CPU)
  attention_topk_gather the GPU form: scores by GEMM per block of query rows, torch.topk's candidates, the ties
                        at the threshold ordered by key index among the candidates, a softmax over the selected
                        candidates and their V rows gathered; the twin elsewhere. It equals the twin's selection
                        whenever every key tied at a row's k-th score is among its max_keys candidates (always,
                        unless more than max_keys - k + 1 keys share that exact score).
  attention_topk_fused  the fused form (ops/attention_topk_fused.py): f32 scores by a Triton GEMM, each row's exact
                        k-th score by a radix select on its f32 bits, the softmax and P·V over the selected keys
                        only; the twin's selection exactly, ties included
  attention_topk        dispatch: on CUDA the form FORM names (the gather form by default; the fused form, opt-in,
                        falls back to the gather form where it cannot compile or launch), the twin elsewhere
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from ._backend import use_triton
from .attention_topk_fused import fused_topk_blocks


@dataclass(frozen=True)
class TopKRule:
    """k = clamp(n_visible // divisor, min_keys, max_keys) keys per query row."""
    divisor: int = 128
    min_keys: int = 64
    max_keys: int = 512

    def __post_init__(self):
        for name in ("divisor", "min_keys", "max_keys"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"TopKRule.{name}: expected a positive integer, got {v!r}")
        if self.min_keys > self.max_keys:
            raise InputError(f"TopKRule: min_keys {self.min_keys} exceeds max_keys {self.max_keys}")

    def keys(self, n_visible: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.div(n_visible, self.divisor, rounding_mode="floor"), self.min_keys, self.max_keys)

    def candidates(self, n_keys: int) -> int:
        """How many top scores a row over at most n_keys keys needs: its k, or all of its keys where k exceeds them
        (k grows with the visible count, so this bounds every row's)."""
        return min(max(n_keys // self.divisor, self.min_keys), self.max_keys, n_keys)

    @classmethod
    def from_settings(cls, s) -> "TopKRule | None":
        """The rule a GenerationSettings asks for (its topk_* fields), or None (dense) when topk_attention is off."""
        if not getattr(s, "topk_attention", False):
            return None
        return cls(s.topk_divisor, s.topk_min, s.topk_max)


def cache_rule(cache) -> TopKRule | None:
    """The rule a KV cache's forwards use on the full layers: its `attention_topk` (None, the default: dense)."""
    return getattr(cache, "attention_topk", None)


def topk_mask(scores: torch.Tensor, visible: torch.Tensor, rule: TopKRule) -> torch.Tensor:
    """scores [..., rows, keys] (f32), visible (bool, broadcastable) -> bool mask of each row's selected keys:
    every visible key where k >= the row's visible count, else the k largest scores, ties by lower key index."""
    visible = visible.expand_as(scores)
    s = scores.masked_fill(~visible, float("-inf"))
    n_vis = visible.sum(-1, keepdim=True)
    kk = rule.keys(n_vis)
    kmax = rule.candidates(s.shape[-1])
    vals = s.topk(kmax, dim=-1, sorted=True).values
    thr = vals.gather(-1, (kk - 1).clamp(0, kmax - 1))
    above = s > thr
    need = kk - above.sum(-1, keepdim=True)
    tie = (s == thr) & visible
    take = above | (tie & (tie.cumsum(-1) <= need))
    return visible & (take | (kk >= n_vis))


def _visible(kpos, n_keys, qpos, causal, nlive, device, rows_pos=None):
    keys = torch.arange(n_keys, device=device)
    if causal:
        kp = kpos[:n_keys].long()[None, :]
        return (kp >= 0) & (kp <= rows_pos.long()[:, None])
    if kpos is not None:
        return (kpos[:n_keys] >= 0)[None, :]
    if nlive is None:
        return torch.ones(1, n_keys, dtype=torch.bool, device=device)
    return (keys < nlive)[None, :]


def _check(q, k, kpos, qpos, causal, rule):
    if not isinstance(rule, TopKRule):
        raise InputError(f"attention_topk: rule must be a TopKRule, got {type(rule).__name__}")
    if causal and (kpos is None or qpos is None):
        raise InputError("attention_topk: a causal call needs kpos and qpos")
    if q.shape[0] % k.shape[0]:
        raise InputError(f"attention_topk: {q.shape[0]} query heads are not a multiple of {k.shape[0]} KV heads")


def attention_topk_ref(q, k, v, kpos, n_keys, rule: TopKRule, qpos=None, causal=False, out_dtype=None, nlive=None,
                       q_block: int = 1024, **_):
    """-> [n, H·d]: attention_ref's math with each row's mask narrowed to its top-k selection (topk_mask)."""
    _check(q, k, kpos, qpos, causal, rule)
    H, n, d = q.shape
    KV = k.shape[0]
    kf = k[:, :n_keys].float().repeat_interleave(H // KV, 0)
    # never-visible rows (not a key, past nlive) are never read: 0·NaN would not be 0
    vf = v[:, :n_keys].float().masked_fill(~_visible(kpos, n_keys, None, False, nlive, q.device)[0][None, :, None], 0.0)
    vf = vf.repeat_interleave(H // KV, 0)
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    for s in range(0, n, q_block):
        qb = q[:, s: s + q_block].float()
        m = _visible(kpos, n_keys, qpos, causal, nlive, q.device, None if qpos is None else qpos[s: s + q_block])
        sc = qb @ kf.transpose(1, 2)
        m = topk_mask(sc, m[None], rule)
        sc = sc.masked_fill(~m, float("-inf"))
        o = torch.softmax(sc, -1) @ vf.masked_fill(~m.any(-2)[..., None], 0.0)  # keys no row here selects: unread
        out[s: s + q_block] = o.transpose(0, 1).reshape(-1, H * d).to(out.dtype)
    return out


_OUT_DTYPE: dict = {}  # (device type, dtype) -> whether bmm writes f32 from these operands (out_dtype)


def _scores(qb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
    """f32 scores [KV, rows, keys] from half-precision operands: f32 accumulation and f32 output (bmm's out_dtype
    where the backend has it, else on f32 copies). Asked once per device type and dtype, outside any capture."""
    key = (qb.device.type, qb.dtype)
    if qb.dtype != torch.float32 and _OUT_DTYPE.get(key, True):
        try:
            out = torch.bmm(qb, kb.transpose(1, 2), out_dtype=torch.float32)
            _OUT_DTYPE[key] = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE[key] = False
    return torch.bmm(qb.float(), kb.float().transpose(1, 2))


def _block_rows(n_keys: int, kmax: int, d: int, budget: int = 1 << 28) -> int:
    """Folded query rows per block: the [rows, keys] f32 scores and the [rows, kmax, d] gathered V in budget elements."""
    return max(1, min(budget // max(n_keys, 1), budget // (2 * kmax * d)))


# The gather form's candidate chunk on CUDA (_top_candidates; 0: one torch.topk over every key). The same selection
# either way.
CANDIDATE_CHUNK = 0
FORMS = ("fused", "gather")
FORM = "gather"  # the CUDA form (FORMS); "fused" is opt-in (docs/ARCHITECTURE.md, 'Kernel configurations')
_fused_failed: dict = {}  # head dim -> why the fused kernels could not compile or launch here


def attention_topk(q, k, v, kpos, n_keys, rule: TopKRule, qpos=None, causal=False, out_dtype=None, nlive=None,
                   q_start: int | None = None, **_):
    """-> [n, H·d]: on CUDA the form FORM names (the fused one needs Triton, no DIFFGEMMA_NO_TRITON=1, and falls back
    to the gather form where its kernels failed outside a graph capture, noted with a warning once); the twin
    elsewhere."""
    kw = dict(qpos=qpos, causal=causal, out_dtype=out_dtype, nlive=nlive)
    if not q.is_cuda:
        return attention_topk_ref(q, k, v, kpos, n_keys, rule, **kw)
    if FORM == "fused" and use_triton(q) and q.shape[-1] not in _fused_failed:
        try:
            return attention_topk_fused(q, k, v, kpos, n_keys, rule, q_start=q_start, **kw)
        except Exception as e:
            if torch.cuda.is_current_stream_capturing():
                raise
            import warnings

            _fused_failed[q.shape[-1]] = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"diffgemma attention_topk: the fused kernels are unavailable for head_dim {q.shape[-1]}, "
                          f"using the gather form ({_fused_failed[q.shape[-1]]})")
    return attention_topk_gather(q, k, v, kpos, n_keys, rule, q_start=q_start, chunk=CANDIDATE_CHUNK, **kw)


def attention_topk_fused(q, k, v, kpos, n_keys, rule: TopKRule, qpos=None, causal=False, out_dtype=None,
                         nlive=None, q_start: int | None = None, block_rows: int | None = None, **configs):
    """The fused form (module docstring), on CUDA or under TRITON_INTERPRET=1. Arguments as attention_topk_gather;
    block_rows: query positions per block (default: each KV head's f32 scores of a block in 2^28 floats, the blocks
    of even size); configs: the kernels' scores_config / select_config / pv_config and tma (ops/attention_topk_fused.py)."""
    _check(q, k, kpos, qpos, causal, rule)
    H, n, _ = q.shape
    if block_rows is None:
        per = max(1, (1 << 28) // max(n_keys, 1) // (H // k.shape[0]))
        blocks = -(-n // per)
        block_rows = -(-n // blocks)
    return fused_topk_blocks(q, k, v, kpos, n_keys, rule, block_rows, qpos=qpos, causal=causal, out_dtype=out_dtype,
                             nlive=nlive, q_start=q_start, **configs)


def _top_candidates(sc: torch.Tensor, kmax: int, chunk: int):
    """-> (values, key indices) of each row's kmax largest scores, descending. chunk > kmax: in two stages, each
    whole chunk of keys' kmax largest (and the keys past the last whole chunk), then the largest of those (a row's
    kmax largest scores are among its chunks' kmax largest), so the second stage reads about kmax / chunk of them."""
    n = sc.shape[-1]
    m = n // chunk if chunk > kmax else 0
    if m < 2:
        return sc.topk(kmax, dim=-1, sorted=True)
    v1, i1 = sc[..., :m * chunk].view(*sc.shape[:-1], m, chunk).topk(kmax, dim=-1, sorted=False)
    i1 = (i1 + torch.arange(0, m * chunk, chunk, device=sc.device)[:, None]).flatten(-2)
    tail = torch.arange(m * chunk, n, device=sc.device).expand(*sc.shape[:-1], n - m * chunk)
    vals, j = torch.cat([v1.flatten(-2), sc[..., m * chunk:]], -1).topk(kmax, dim=-1, sorted=True)
    return vals, torch.cat([i1, tail], -1).gather(-1, j)


def attention_topk_gather(q, k, v, kpos, n_keys, rule: TopKRule, qpos=None, causal=False, out_dtype=None,
                          nlive=None, q_start: int | None = None, chunk: int = 0, **_):
    """The gather form (module docstring), any device. q_start (causal): query row i is at position q_start + i and
    key row p holds position p (the full layers' prefill), so a block of queries reads only the keys up to its last
    position. chunk: the candidates' top-k in two stages (_top_candidates; 0: one torch.topk over every key)."""
    _check(q, k, kpos, qpos, causal, rule)
    H, n, d = q.shape
    KV = k.shape[0]
    G = H // KV
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    qg = q.view(KV, G, n, d).to(k.dtype)
    kmax_all = rule.candidates(n_keys)
    b = max(1, _block_rows(n_keys, kmax_all, d) // G)
    for s in range(0, n, b):
        e = min(n, s + b)
        nk = n_keys if not (causal and q_start is not None) else min(n_keys, q_start + e)
        kmax = rule.candidates(nk)
        qb = qg[:, :, s:e].reshape(KV, G * (e - s), d)
        sc = _scores(qb, k[:, :nk])  # [KV, G·b, nk]
        vis = _visible(kpos, nk, qpos, causal, nlive, q.device, None if qpos is None else qpos[s:e])
        if causal:  # [b, nk] per query position -> per folded row (head-major within the KV group)
            vis = vis.repeat(G, 1)
        sc.masked_fill_(~vis[None] if vis.dim() == 2 else ~vis, float("-inf"))
        n_vis = vis.sum(-1, keepdim=True).expand(G * (e - s) if causal else 1, 1)
        kk = rule.keys(n_vis)[None]  # [1, rows or 1, 1]
        vals, idx = _top_candidates(sc, kmax, chunk)
        del sc
        thr = vals.gather(-1, (kk - 1).clamp(0, kmax - 1).expand(KV, vals.shape[1], 1))
        order = idx.argsort(-1)  # candidates by key index: ties resolve to the lower index, and a fixed sum order
        idx, vals = idx.gather(-1, order), vals.gather(-1, order)
        above = vals > thr
        tie = vals == thr
        take = above | (tie & (tie.cumsum(-1) <= kk - above.sum(-1, keepdim=True)))
        take = (take | (kk >= n_vis[None])) & (vals > float("-inf"))
        p = torch.softmax(vals.masked_fill(~take, float("-inf")), -1)  # [KV, rows, kmax] f32
        # unselected candidates (p = 0) read a selected key's V row instead of theirs, which may never have been
        # written (0·NaN would not be 0)
        idx = torch.where(take, idx, idx.gather(-1, take.to(torch.int8).argmax(-1, keepdim=True)))
        vg = v[:, :nk][torch.arange(KV, device=q.device)[:, None, None], idx]  # [KV, rows, kmax, d]
        # P in V's dtype with f32 accumulation, as the flash kernel's P·V
        o = torch.matmul(p.unsqueeze(2).to(v.dtype), vg).squeeze(2)  # [KV, G·b, d]
        out.view(n, KV, G, d)[s:e] = o.view(KV, G, e - s, d).permute(2, 0, 1, 3).to(out.dtype)
    return out
