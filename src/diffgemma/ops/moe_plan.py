"""The expert plan of one MoE call: which route goes to which row of the expert-sorted batch.

Given experts [T, k] (route t·k+j of token t uses expert experts[t, j]), the grouped GEMM wants
the T·k routes sorted by expert, stably (route order within an expert), with per-expert end
offsets. One kernel builds, for every expert e in its own program:
  offs[e]      = number of routes with expert <= e          (cumulative ends, torch._grouped_mm's offs)
  src[dest]    = token of the route placed at row dest       (the gather index for the input rows)
  inv[route]   = dest                                        (where that route's output row lands)
dest = (routes with a lower expert) + (earlier routes with the same expert). No sort, no atomics,
no host sync: deterministic and graph-safe.

`moe_plan_with_order` also gives the experts by row count, most first (ties: lower expert first), for the
streaming expert GEMMs to launch their longest programs first (ops/moe_q4.py, moe_packed.py, moe_stream.py):
each program of the same kernel counts every expert's routes (a histogram of the ids it reads anyway) and
writes its own expert at its rank.
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, next_pow2, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


def moe_plan_ref(experts, num_experts):
    """experts int [T, k] -> (src int64 [T·k], inv int64 [T·k], offs int32 [E])."""
    k = experts.shape[1]
    flat = experts.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=flat.device)
    return order // k, inv, offs


def expert_order_ref(offs) -> torch.Tensor:
    """offs int [E] (cumulative ends) -> int32 [E]: the experts by row count, most first, ties by index."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    return torch.argsort(-counts, stable=True).to(torch.int32)


# Above this many routes (prefill) no order is made: the GEMMs that read one stream weights at denoise (2048).
ORDER_MAX_ROUTES = 8192


def order_operand(order, offs: torch.Tensor, num_experts: int) -> torch.Tensor:
    """What a grouped GEMM kernel gets for its order pointer: the order (int32 [E], checked), or offs as a
    placeholder when there is none (HAS_ORDER = False: never read)."""
    if order is None:
        return offs
    if order.dtype != torch.int32 or tuple(order.shape) != (num_experts,):
        raise TensorError(f"grouped GEMM: order must be int32 [{num_experts}], got {order.dtype} {list(order.shape)}")
    return order.contiguous()


if HAVE_TRITON:

    @triton.jit
    def expert_rows(offs_ptr, order_ptr, HAS_ORDER: tl.constexpr):
        """A grouped GEMM program's expert (grid axis 1, through the launch order when given) and its routes
        start:end (offs = cumulative ends)."""
        e = tl.program_id(1)
        if HAS_ORDER:
            e = tl.load(order_ptr + e)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
        return e, start, tl.load(offs_ptr + e)

    @triton.jit
    def _moe_plan_kernel(exp_ptr, src_ptr, inv_ptr, offs_ptr, order_ptr, N, K, BLOCK: tl.constexpr,
                         WITH_ORDER: tl.constexpr, EP: tl.constexpr):
        e = tl.program_id(0)
        r = tl.arange(0, BLOCK)
        below = 0
        counts = tl.zeros([EP], dtype=tl.int32)
        for s in range(0, N, BLOCK):
            ok = (s + r) < N
            ids = tl.load(exp_ptr + s + r, mask=ok, other=2**30)
            below += tl.sum((ids < e).to(tl.int32), axis=0)
            if WITH_ORDER:
                counts += tl.histogram(ids, EP, mask=ok)
        seen = 0
        for s in range(0, N, BLOCK):
            ok = (s + r) < N
            ids = tl.load(exp_ptr + s + r, mask=ok, other=-1)
            hit = (ids == e) & ok
            hit_i = hit.to(tl.int32)
            dest = below + seen + tl.cumsum(hit_i, axis=0) - 1
            tl.store(src_ptr + dest, (s + r) // K, mask=hit)
            tl.store(inv_ptr + s + r, dest, mask=hit)
            seen += tl.sum(hit_i, axis=0)
        tl.store(offs_ptr + e, below + seen)
        if WITH_ORDER:  # rank = experts with more routes + experts as many with a lower index
            b = tl.arange(0, EP)
            ahead = (counts > seen) | ((counts == seen) & (b < e))
            tl.store(order_ptr + tl.sum(ahead.to(tl.int32), axis=0), e)


def moe_plan_triton(experts, num_experts, block: int = 1024, with_order: bool = False):
    """-> (src, inv, offs) int32, plus the order (int32 [E]) when with_order."""
    flat = experts.reshape(-1).to(torch.int32).contiguous()
    N, k = flat.numel(), experts.shape[1]
    src = torch.empty(N, dtype=torch.int32, device=flat.device)
    inv = torch.empty(N, dtype=torch.int32, device=flat.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    order = torch.empty(num_experts if with_order else 1, dtype=torch.int32, device=flat.device)
    _moe_plan_kernel[(num_experts,)](flat, src, inv, offs, order, N, k, BLOCK=block, WITH_ORDER=with_order,
                                     EP=next_pow2(num_experts), num_warps=4)
    return (src, inv, offs, order) if with_order else (src, inv, offs)


def moe_plan(experts, num_experts):
    return (moe_plan_triton if use_triton(experts) else moe_plan_ref)(experts, num_experts)


def moe_plan_with_order(experts, num_experts):
    """-> (src, inv, offs, order): moe_plan plus the experts by row count, most first (None above
    ORDER_MAX_ROUTES routes, and off CUDA, where nothing reads it)."""
    if not use_triton(experts):
        return (*moe_plan_ref(experts, num_experts), None)
    if experts.numel() > ORDER_MAX_ROUTES:
        return (*moe_plan_triton(experts, num_experts), None)
    return moe_plan_triton(experts, num_experts, with_order=True)
