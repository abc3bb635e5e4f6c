"""The expert FFN and the one dispatcher of its grouped GEMMs.

Experts: gate_up [E, 2F, H] (gate ‖ up), down [E, H, F], act gelu_tanh(gate)·up. Routing (softmax, top-k with
ties towards the lower expert, renormalise, per-expert scale) is ops/route.py's.

  experts_ref      loop over experts, obviously correct (the twin)
  experts_grouped  flatten the T·k routes, stable-sort them by expert, gather the rows, two grouped
                   GEMMs (torch._grouped_mm: one launch streams every expert's weights once), then
                   un-permute and sum the k contributions per token in f32. No atomics, no host sync:
                   safe inside a CUDA graph and bit-deterministic.
  expert_ffn       the engine's expert FFN over routes already grouped by expert (ops/moe_plan.py makes them)
  grouped_mm       one grouped GEMM against a plain or packed expert stack: runs the path ops/moe_paths.py names
                   (torch._grouped_mm, the bf16 streaming kernel, the packed kernels, or dequantize then GEMM)
  dequantize_stack a packed stack decoded by the kernel of its layout (ops/moe_packed.py or ops/moe_q4.py)

FP8 stacks (ops/fp8_weight.Fp8Weight) go to ops/fp8_moe.py: its activations are quantized per token on the way in.

The implementation modules import none of each other's dispatch: this module chooses, they compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gelu_mul import gelu_mul
from .grouped import gelu_after, grouped_mm_torch, route_count, routed
from . import fp8_moe, moe_nvfp4, moe_packed, moe_q4, moe_stream
from .fp8_quant import quantize_rows
from .fp8_weight import Fp8Weight
from .moe_paths import F16_PATHS, expert_gemm_path, takes_f16_operand, tile_rows
from .q4_tiles import LAYOUT
from .route import route  # noqa: F401  (routing's torch twin, long imported from here)


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
    gu = grouped_mm_torch(xs, gate_up, offs)              # [T*k, 2F]
    h = (F.gelu(gu[:, :Fe].float(), approximate="tanh") * gu[:, Fe:].float()).to(x.dtype)
    y = grouped_mm_torch(h, down, offs)                   # [T*k, H]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=x.device)
    y = y.index_select(0, inv).view(T, k, H)
    return torch.einsum("tkh,tk->th", y.float(), weights.float())


def expert_ffn(x, gate_up, down, offs, src=None, order=None, out_dtype=None, f16_operands=True, fuse_glu=True,
               path_routes: int | None = None):
    """The engine's expert FFN over routes grouped by expert: x [M, H] (rows of expert g in offs[g-1]:offs[g]),
    or x [T, H] per token with src [M] naming each route's token (the kernels gather in their loads)
    -> [M, H] in out_dtype (default x.dtype). gate_up / down are bf16 stacks or packed ones
    (ops/packed_weight.PackedWeight: q4 / q5 / q6 / nvfp4, dequantized inside the GEMM), or FP8 ones
    (ops/fp8_weight.Fp8Weight: ops/fp8_moe.expert_ffn_fp8). order: the experts'
    launch order for the streaming GEMMs (ops/moe_plan.moe_plan_with_order); the result does not depend on it.
    x may be the f16 operand of bf16 activations (ops/moe_paths.takes_f16_operand); gelu·up hands the down GEMM
    its input the same way when that GEMM takes it, unless f16_operands is False (the ops-level twin switch the
    tests use; the engine always passes True). The results are the same bits either way. Otherwise gelu·up is asked
    of the gate_up GEMM (glu): the streaming kernels make it in their epilogue, the other paths with gelu_mul after
    them (fuse_glu False: always after, A/B).
    path_routes: the route count the kernel paths are chosen by (default: x's); a batched denoise passes one lane's,
    so a lane takes the kernels it takes alone (docs/ARCHITECTURE.md, 'Batching')."""
    if isinstance(gate_up, Fp8Weight):
        return fp8_moe.expert_ffn_fp8(x, gate_up, down, offs, src=src, order=order, out_dtype=out_dtype,
                                      path_routes=path_routes)
    out_dtype = out_dtype or x.dtype
    routes = route_count(x, src) if path_routes is None else path_routes
    as_f16 = f16_operands and takes_f16_operand(down, routes, x)
    if fuse_glu:
        h = grouped_mm(x, gate_up, offs, src=src, order=order, out_dtype=out_dtype, glu=True, glu_f16=as_f16,
                       path_routes=path_routes)
    else:
        h = gelu_mul(grouped_mm(x, gate_up, offs, src=src, order=order, out_dtype=out_dtype, path_routes=path_routes),
                     as_f16=as_f16)
    return grouped_mm(h, down, offs, order=order, out_dtype=out_dtype, path_routes=path_routes)


def grouped_mm(x, w, offs, src=None, order=None, out_dtype=None, glu: bool = False, glu_f16: bool = False,
               path_routes: int | None = None):
    """x @ W[g]^T per expert group: x grouped [M, K], or per token [T, K] with src [M] naming each route's row;
    W a plain [E, N, K] stack or a packed one; offs int32 [E] cumulative ends -> [M, N].
    order: the experts' launch order for the streaming kernels (moe_plan_with_order); results do not depend on it.
    out_dtype: the result's dtype (default x's); an f16 operand x (takes_f16_operand) comes with bfloat16 here,
    and a path other than the q4-tiles and nvfp4-tiles kernels first turns x back into it (exact: it is a copy of
    bf16 values).
    glu: W is a gate ‖ up stack; the result is gelu_tanh(gate)·up [M, N/2] (fused into the streaming kernels'
    epilogue where they can), as f16 operands with glu_f16 (for a down GEMM that takes them). path_routes: the route
    count the path is chosen by; default x's own (the q4 kernel's row tile always follows x's: moe_paths.tile_rows)."""
    if isinstance(w, Fp8Weight):
        q, s = quantize_rows(x if out_dtype is None else x.to(out_dtype))
        return gelu_after(fp8_moe.grouped_mm_fp8(q, s, w, offs, src=src, order=order, out_dtype=out_dtype or x.dtype,
                                                 path_routes=path_routes), glu, glu_f16)
    routes = route_count(x, src) if path_routes is None else path_routes
    path = expert_gemm_path(w, routes, x)
    if out_dtype is not None and x.dtype != out_dtype and path not in F16_PATHS:
        x = x.to(out_dtype)
    if path == "stream":  # its epilogue writes x's dtype; the f16-operand form is gelu_mul's
        if glu_f16:
            return gelu_after(moe_stream.grouped_mm_triton(x, w, offs, src=src, order=order), glu, True)
        return moe_stream.grouped_mm_triton(x, w, offs, src=src, order=order, glu=glu)
    if path == "torch":
        return gelu_after(grouped_mm_torch(routed(x, src), w, offs), glu, glu_f16)
    if path == "twin":
        return gelu_after(moe_packed.grouped_mm_packed_ref(routed(x, src), w, offs), glu, glu_f16)
    if path == "dequant":
        return gelu_after(grouped_mm_torch(routed(x, src), dequantize_stack(w, x.dtype), offs), glu, glu_f16)
    if path == "q4-tiles":  # the epilogue makes gelu·up where the stack was laid for it
        fused = glu and w.glu
        out = moe_q4.grouped_mm_q4_tiles(x, w, offs, src=src, BM=tile_rows(route_count(x, src), w.shape[0]),
                                         order=order, out_dtype=out_dtype, glu=fused, glu_f16=fused and glu_f16)
        return out if fused else gelu_after(out, glu, glu_f16)
    if path == "nvfp4-tiles":  # one layout serves the plain GEMM and the gelu·up epilogue
        return moe_nvfp4.grouped_mm_nvfp4_tiles(x, w, offs, src=src, order=order, out_dtype=out_dtype, glu=glu,
                                                glu_f16=glu_f16)
    return moe_packed.grouped_mm_packed_triton(x, w, offs, src=src, order=order, out_dtype=out_dtype, glu=glu,
                                               glu_f16=glu_f16)


def dequantize_stack(w, dtype=torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed tensor decoded on its device by the kernel that reads its layout, into `out` (or a new tensor)."""
    if w.layout == LAYOUT:
        return moe_q4.dequantize_q4_tiles(w, dtype, out)
    return moe_packed.dequantize_triton(w, dtype, out)
