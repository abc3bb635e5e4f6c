"""MoE routing (deterministic tie-break) and the expert FFN, as a sort-by-expert grouped GEMM.

Routing (ARCHITECTURE §2.1): softmax over the f32 router logits, top-k with ties broken towards the
LOWER expert index, renormalise the k weights to sum 1, multiply by per_expert_scale[expert].
A stable descending sort gives exactly that order (equal probabilities keep index order), on any
device, which torch.topk does not promise.

Experts: gate_up [E, 2F, H] (gate ‖ up), down [E, H, F], act gelu_tanh(gate)·up.
  experts_ref      loop over experts, obviously correct (the twin)
  experts_grouped  flatten the T·k routes, stable-sort them by expert, gather the rows, two grouped
                   GEMMs (torch._grouped_mm: one launch streams every expert's weights once), then
                   un-permute and sum the k contributions per token in f32. No atomics, no host sync:
                   safe inside a CUDA graph and bit-deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, k: int, per_expert_scale: torch.Tensor):
    """router_logits f32 [T, E] -> (weights f32 [T, k], experts int64 [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :k], idx[:, :k]
    w = vals / vals.sum(-1, keepdim=True)
    return w * per_expert_scale.float()[idx], idx


def experts_ref(x, weights, experts, gate_up, down):
    """x [T, H]; returns f32 [T, H] = Σ_j weights[t, j] · FFN_{experts[t, j]}(x[t])."""
    T, H = x.shape
    Fe = down.shape[-1]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in torch.unique(experts).tolist():
        tok, slot = torch.where(experts == e)
        gu = x[tok] @ gate_up[e].T
        h = (F.gelu(gu[:, :Fe].float(), approximate="tanh") * gu[:, Fe:].float()).to(x.dtype)
        y = h @ down[e].T
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out


def _grouped_mm(a, w, offs):
    """a [M, K] rows sorted by group, w [G, N, K] -> [M, N] with rows of group g multiplied by w[g]^T."""
    try:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError, AttributeError):
        # Older CPU builds have no grouped kernel: same result via a loop (host sync, CPU only).
        out = a.new_empty(a.shape[0], w.shape[1])
        start = 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ w[g].T
            start = end
        return out


def expert_ffn(x, gate_up, down, offs, src=None, order=None, out_dtype=None, f16_operands=True, fuse_glu=True):
    """The engine's expert FFN over routes grouped by expert: x [M, H] (rows of expert g in offs[g-1]:offs[g]),
    or x [T, H] per token with src [M] naming each route's token (the kernels gather in their loads)
    -> [M, H] in out_dtype (default x.dtype). gate_up / down are bf16 stacks or packed ones
    (ops.moe_packed.PackedWeight: q4 / q5 / q6 / nvfp4, dequantized inside the GEMM). order: the experts'
    launch order for the streaming GEMMs (ops/moe_plan.moe_plan_with_order); the result does not depend on it.
    x may be the f16 operand of bf16 activations (moe_packed.takes_f16_operand); gelu·up hands the down GEMM
    its input the same way when that GEMM takes it, unless f16_operands is False (the engine's A/B knob). The
    results are the same bits either way. Otherwise gelu·up is asked of the gate_up GEMM (glu): the streaming
    kernels make it in their epilogue, the other paths with gelu_mul after them (fuse_glu False: always after, A/B)."""
    from .gelu_mul import gelu_mul
    from .moe_packed import grouped_mm_packed as gmm  # packed or plain stacks; streams at denoise
    from .moe_packed import route_count, takes_f16_operand

    out_dtype = out_dtype or x.dtype
    as_f16 = f16_operands and takes_f16_operand(down, route_count(x, src), x)
    if fuse_glu:
        h = gmm(x, gate_up, offs, src=src, order=order, out_dtype=out_dtype, glu=True, glu_f16=as_f16)
    else:
        h = gelu_mul(gmm(x, gate_up, offs, src=src, order=order, out_dtype=out_dtype), as_f16=as_f16)
    return gmm(h, down, offs, order=order, out_dtype=out_dtype)


def experts_grouped(x, weights, experts, gate_up, down):
    T, H = x.shape
    k = experts.shape[1]
    E, Fe = gate_up.shape[0], down.shape[-1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)              # routes grouped by expert
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x.index_select(0, order // k)                    # [T*k, H]
    gu = _grouped_mm(xs, gate_up, offs)                   # [T*k, 2F]
    h = (F.gelu(gu[:, :Fe].float(), approximate="tanh") * gu[:, Fe:].float()).to(x.dtype)
    y = _grouped_mm(h, down, offs)                        # [T*k, H]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=x.device)
    y = y.index_select(0, inv).view(T, k, H)
    return torch.einsum("tkh,tk->th", y.float(), weights.float())
