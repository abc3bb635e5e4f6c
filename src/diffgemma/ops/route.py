"""MoE router in one kernel: f32 router GEMM, softmax, top-k (ties → lower expert), renorm, per-expert scale.

Routing is control flow, so its logits stay (near) f32: the kernel multiplies the f32 router input
by the f32 router weight on the tensor cores with `tf32x3` (three tf32 products, ~f32 accuracy,
f32 accumulate) instead of the f32 SIMT GEMM. Then, per row and without leaving registers:
p = softmax(logits); k times: take the largest p, the LOWEST column holding it (the tie-break of
ARCHITECTURE §2.1), mask it; w = picked / Σpicked · per_expert_scale[e].

  route_ref      the torch twin: f32 matmul + `moe.route` (stable sort)
  route_triton   the kernel (one program per BT rows, the whole expert axis in registers)
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
    def _route_kernel(x_ptr, w_ptr, s_ptr, wout_ptr, eout_ptr, T, H,
                      E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      BT: tl.constexpr, BH: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        row_ok = rows < T
        ecols = tl.arange(0, EP)
        e_ok = ecols < E
        hh = tl.arange(0, BH)
        acc = tl.zeros((BT, EP), dtype=tl.float32)
        for h0 in range(0, H, BH):
            h_ok = (h0 + hh) < H
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * H + h0 + hh[None, :],
                        mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            b = tl.load(w_ptr + ecols[:, None] * H + h0 + hh[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            acc += tl.dot(a, tl.trans(b), input_precision="tf32x3")
        logits = tl.where(e_ok[None, :], acc, -float("inf"))
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


def route_triton(router_in, router_w, k, per_expert_scale, block_t: int = 16, block_h: int = 64):
    x = router_in.contiguous().float()
    T, H = x.shape
    E = router_w.shape[0]
    w = torch.empty(T, k, dtype=torch.float32, device=x.device)
    e = torch.empty(T, k, dtype=torch.int32, device=x.device)
    _route_kernel[(triton.cdiv(T, block_t),)](
        x, router_w.contiguous(), per_expert_scale.float().contiguous(), w, e, T, H,
        E=E, EP=max(16, next_pow2(E)), K=k, KP=next_pow2(k), BT=block_t, BH=block_h, num_warps=4)
    return w, e


def route_fused(router_in, router_w, k, per_expert_scale):
    """-> (weights f32 [T, k], experts int [T, k]; int32 from the kernel, int64 from the twin)."""
    if use_triton(router_in):
        return route_triton(router_in, router_w, k, per_expert_scale)
    return route_ref(router_in, router_w, k, per_expert_scale)
