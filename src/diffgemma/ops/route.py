"""MoE router: the f32 router GEMM, then ONE kernel for softmax, top-k (ties → lower expert), renorm, scale.

Routing is control flow, so its logits stay f32 (cuBLAS f32 GEMM, ~12 µs at T=256). A variant that
did the GEMM inside the kernel with `tf32x3` tensor-core products measured 47 µs per call on the
H200 (16 programs streaming the whole router weight each), so the GEMM stays on cuBLAS and the
logits are bit-identical to an f32 reference GEMM: routing cannot flip from the GEMM. The kernel
replaces round 1's softmax + radix sort + slice + sum + div + gather + mul: per row, in registers,
p = softmax(logits); k times: take the largest p, the LOWEST column holding it (the tie-break of
ARCHITECTURE §2.1), mask it; w = picked / Σpicked · per_expert_scale[e].

  route_ref      the torch twin: f32 matmul + `moe.route` (stable sort)
  route_triton   f32 matmul + the kernel (one program per BT rows, the whole expert axis in registers)
  route_fused    dispatch
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, next_pow2, use_triton
from .moe import route

if HAVE_TRITON:
    import triton
    import triton.language as tl


def route_ref(router_in, router_w, k, per_expert_scale):
    """router_in f32 [T, H], router_w f32 [E, H] -> (weights f32 [T, k], experts int64 [T, k])."""
    return route(router_in.float() @ router_w.float().T, k, per_expert_scale)


if HAVE_TRITON:

    @triton.jit
    def _route_kernel(lg_ptr, s_ptr, wout_ptr, eout_ptr, T,
                      E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        row_ok = rows < T
        ecols = tl.arange(0, EP)
        e_ok = ecols < E
        logits = tl.load(lg_ptr + rows[:, None].to(tl.int64) * E + ecols[None, :],
                         mask=row_ok[:, None] & e_ok[None, :], other=-float("inf"))
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


def route_triton(router_in, router_w, k, per_expert_scale, block_t: int = 8):
    logits = (router_in.float() @ router_w.float().T).contiguous()
    T, E = logits.shape
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    e = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    _route_kernel[(triton.cdiv(T, block_t),)](logits, per_expert_scale.float().contiguous(), w, e, T,
                                              E=E, EP=max(16, next_pow2(E)), K=k, KP=next_pow2(k), BT=block_t,
                                              num_warps=4)
    return w, e


def route_fused(router_in, router_w, k, per_expert_scale):
    """-> (weights f32 [T, k], experts int [T, k]; int32 from the kernel, int64 from the twin)."""
    if use_triton(router_in):
        return route_triton(router_in, router_w, k, per_expert_scale)
    return route_ref(router_in, router_w, k, per_expert_scale)
