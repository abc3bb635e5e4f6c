"""MoE router: the f32 router logits, then ONE kernel for softmax, top-k (ties → lower expert), renorm, scale.

Routing is control flow, so its logits stay f32. Two ways to make them on the GPU:
- cuBLAS's f32 GEMM (`pieces=None`): bit-identical to the torch twin's logits. At the denoise shape it is a
  split-K SIMT GEMM on ~128 thread blocks plus a reduce, and its blocks fill every SM, so the dense MLP
  beside it on the other stream waits for them.
- the bf16x3 GEMM (`pieces`, the engine's default on CUDA): the f32 input is split in registers into three bf16
  parts, x = x1 + x2 + x3 exactly (8 + 8 + 8 mantissa bits), and the weight is bf16 already (a checkpoint's router
  is bf16; otherwise it is split too, `router_pieces`). A bf16 x bf16 product is exact in f32, so the tensor
  cores make the same products as an f32 GEMM and only the f32 sums differ, each BK-long chunk summed on the
  tensor core and the chunks added in f32. A program takes a row block and a K slice; its partial logits
  go to [S, T, E] and the routing kernel adds the S slices in order (deterministic, no atomics). Few small
  blocks, so the dense MLP's GEMMs run beside it.
The routing kernel does in one launch what the torch twin does in seven (softmax, sort, slice, sum, div, gather,
mul): per row, in registers, p = softmax(logits); k times: take the largest p, the LOWEST column holding it (the
twin's stable sort gives the same tie-break), mask it; w = picked / Σpicked · per_expert_scale[e].

  route               routing from f32 logits in torch (a stable sort gives the tie-break)
  route_ref           the torch twin: f32 matmul + `route`
  router_pieces       the router weight as bf16 parts [P, E, H] (P = 1 for a bf16 weight, else 3)
  router_gemm_triton  the bf16x3 GEMM's partial logits [S, T, E]
  route_triton        the logits (cuBLAS, or the bf16x3 GEMM given pieces) + the routing kernel
  route_fused         dispatch
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, interpreting, next_pow2, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

# the bf16x3 router GEMM: (BM rows, KS of K a program, BK a tensor-core chunk, warps, stages). At the denoise
# shape (256 x 2816 -> 128): 4 x 11 = 44 programs, few enough that the dense MLP beside it keeps most SMs and the
# two overlap (docs/ARCHITECTURE.md, 'Overlap').
ROUTER_GEMM_CONFIG = (64, 256, 64, 4, 3)


def route(router_logits: torch.Tensor, k: int, per_expert_scale: torch.Tensor):
    """router_logits f32 [T, E] -> (weights f32 [T, k], experts int64 [T, k]): softmax, top-k with ties broken
    towards the LOWER expert index, the k weights renormalised to sum 1, times per_expert_scale[expert]. A stable
    descending sort gives exactly that order (equal probabilities keep index order) on any device, which
    torch.topk does not promise."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :k], idx[:, :k]
    w = vals / vals.sum(-1, keepdim=True)
    return w * per_expert_scale.float()[idx], idx


def router_pieces(router_w: torch.Tensor) -> torch.Tensor:
    """f32 [E, H] -> bf16 [P, E, H] whose parts sum to it exactly: P = 1 when the weight is bf16 already (every
    checkpoint's router), else 3 (hi, mid, lo: 24 mantissa bits)."""
    w = router_w.float()
    w1 = w.to(torch.bfloat16)
    rest = w - w1.float()
    if not bool(rest.any()):
        return w1.unsqueeze(0).contiguous()
    w2 = rest.to(torch.bfloat16)
    return torch.stack([w1, w2, (rest - w2.float()).to(torch.bfloat16)]).contiguous()


def route_ref(router_in, router_w, k, per_expert_scale):
    """router_in f32 [T, H], router_w [E, H] (f32, or bf16 read as f32) -> (weights f32 [T, k], experts int64
    [T, k])."""
    return route(router_in.float() @ router_w.float().T, k, per_expert_scale)


if HAVE_TRITON:

    @triton.jit
    def _split3(x):
        """f32 -> three bf16 parts with x1 + x2 + x3 == x (each part rounds what the ones before left)."""
        x1 = x.to(tl.bfloat16)
        r = x - x1.to(tl.float32)
        x2 = r.to(tl.bfloat16)
        return x1, x2, (r - x2.to(tl.float32)).to(tl.bfloat16)

    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr):
        if F32:  # the CPU interpreter has no bf16 tensor-core product; the values are the same in f32
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    @triton.jit
    def _router_gemm_kernel(x_ptr, w_ptr, part_ptr, T, H, E: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr,
                            BM: tl.constexpr, KS: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        row_ok = rows < T
        e = tl.arange(0, EP)
        e_ok = e < E
        acc = tl.zeros((BM, EP), dtype=tl.float32)
        k_lo = tl.program_id(1) * KS
        for k0 in range(k_lo, k_lo + KS, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < H
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * H + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            x1, x2, x3 = _split3(x)
            w_off = e[None, :] * H + kk[:, None]
            w_ok = e_ok[None, :] & k_ok[:, None]
            w1 = tl.load(w_ptr + w_off, mask=w_ok, other=0.0)
            # the small parts first, so the big product is added to a sum that already holds them
            d = _dot(x3, w1, tl.zeros((BM, EP), dtype=tl.float32), DOT_F32)
            d = _dot(x2, w1, d, DOT_F32)
            if WP == 3:  # an f32 weight: its parts too, every product down to 2^-16 of the leading one
                w2 = tl.load(w_ptr + E * H + w_off, mask=w_ok, other=0.0)
                w3 = tl.load(w_ptr + 2 * E * H + w_off, mask=w_ok, other=0.0)
                d = _dot(x1, w3, d, DOT_F32)
                d = _dot(x2, w2, d, DOT_F32)
                d = _dot(x1, w2, d, DOT_F32)
            acc += _dot(x1, w1, d, DOT_F32)
        out = part_ptr + tl.program_id(1) * T * E + rows[:, None].to(tl.int64) * E + e[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & e_ok[None, :])

    @triton.jit
    def _route_kernel(lg_ptr, s_ptr, wout_ptr, eout_ptr, T, S,
                      E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        row_ok = rows < T
        ecols = tl.arange(0, EP)
        e_ok = ecols < E
        at = rows[:, None].to(tl.int64) * E + ecols[None, :]
        ok = row_ok[:, None] & e_ok[None, :]
        logits = tl.load(lg_ptr + at, mask=ok, other=-float("inf"))
        for s in range(1, S):  # the GEMM's K slices, added in order
            logits += tl.load(lg_ptr + s * T * E + at, mask=ok, other=0.0)
        m = tl.max(logits, axis=1)
        ex = tl.exp(logits - m[:, None])
        p = ex / tl.sum(ex, axis=1)[:, None]
        p = tl.where(e_ok[None, :], p, -1.0)  # padded experts are never picked
        kcols = tl.arange(0, KP)
        vals = tl.zeros((BT, KP), dtype=tl.float32)
        idxs = tl.zeros((BT, KP), dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(p, axis=1)
            bi = tl.min(tl.where(p == best[:, None], ecols[None, :], EP), axis=1)  # lowest index among ties
            vals = tl.where(kcols[None, :] == j, best[:, None], vals)
            idxs = tl.where(kcols[None, :] == j, bi[:, None], idxs)
            p = tl.where(ecols[None, :] == bi[:, None], -1.0, p)
        k_ok = kcols < K
        vals = tl.where(k_ok[None, :], vals, 0.0)
        w = vals / tl.sum(vals, axis=1)[:, None]
        w = w * tl.load(s_ptr + idxs, mask=k_ok[None, :], other=0.0)
        out_off = rows[:, None].to(tl.int64) * K + kcols[None, :]
        omask = row_ok[:, None] & k_ok[None, :]
        tl.store(wout_ptr + out_off, w, mask=omask)
        tl.store(eout_ptr + out_off, idxs, mask=omask)


def router_gemm_triton(router_in, pieces, config=None):
    """router_in f32 [T, H], pieces bf16 [P, E, H] (router_pieces) -> partial logits f32 [S, T, E], whose sum over
    S (in order) is router_in @ Wᵀ."""
    if (router_in.dim() != 2 or pieces.dim() != 3 or pieces.shape[2] != router_in.shape[1]
            or pieces.shape[0] not in (1, 3)):
        raise TensorError(f"router GEMM: router_in {list(router_in.shape)} and pieces {list(pieces.shape)} do not make "
                          "[T, H] x [1 or 3, E, H]")
    if pieces.dtype != torch.bfloat16:
        raise TensorError(f"router GEMM: pieces must be bf16 (router_pieces), got {pieces.dtype}")
    BM, KS, BK, warps, stages = config or ROUTER_GEMM_CONFIG
    x = router_in.float().contiguous()
    T, H = x.shape
    P, E = pieces.shape[:2]
    S = triton.cdiv(H, KS)
    part = torch.empty(S, T, E, dtype=torch.float32, device=x.device)
    if T:
        _router_gemm_kernel[(triton.cdiv(T, BM), S)](x, pieces.contiguous(), part, T, H, E=E,
                                                    EP=max(16, next_pow2(E)), WP=P, BM=BM, KS=KS, BK=BK,
                                                    DOT_F32=interpreting(),
                                                    num_warps=warps, num_stages=stages)
    return part


def route_triton(router_in, router_w, k, per_expert_scale, block_t: int = 8, pieces=None, gemm_config=None):
    """The routing kernel on f32 logits: cuBLAS's f32 GEMM (pieces None) or the bf16x3 GEMM's K slices."""
    if pieces is None:
        part = (router_in.float() @ router_w.float().T).contiguous().unsqueeze(0)
    else:
        part = router_gemm_triton(router_in, pieces, gemm_config)
    S, T, E = part.shape
    w = torch.empty(T, k, dtype=torch.float32, device=part.device)
    e = torch.empty(T, k, dtype=torch.int32, device=part.device)
    if T:
        _route_kernel[(triton.cdiv(T, block_t),)](part, per_expert_scale.float().contiguous(), w, e, T, S,
                                                  E=E, EP=max(16, next_pow2(E)), K=k, KP=next_pow2(k), BT=block_t,
                                                  num_warps=4)
    return w, e


def route_fused(router_in, router_w, k, per_expert_scale, pieces=None, gemm_config=None):
    """-> (weights f32 [T, k], experts int [T, k]; int32 from the kernel, int64 from the twin). pieces: the router
    weight's bf16 parts (router_pieces): the logits through the bf16x3 GEMM on CUDA (ignored by the twin)."""
    if use_triton(router_in):
        return route_triton(router_in, router_w, k, per_expert_scale, pieces=pieces, gemm_config=gemm_config)
    return route_ref(router_in, router_w, k, per_expert_scale)
