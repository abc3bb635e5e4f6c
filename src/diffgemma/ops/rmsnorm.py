"""RMSNorm and the fused norm/residual/layer_scalar chains of a DiffusionGemma layer.

Gemma RMSNorm: y = x / sqrt(mean(x^2) + eps) * w (w used as is, not 1 + w), computed in f32.
A layer runs seven of them; four fused ops cover the chain with one read of each input row:

  rms_norm(x, w)                 input_layernorm, final norm, SC norms (w=None: no-scale norm)
  norm_add(res, a, w)            res + norm(a)·w                      (post_attention_layernorm + residual)
  ffn_inputs(x, w_ff, w_ff2, w_r) norm(x)·w_ff, norm(x)·w_ff2 (bf16) and norm(x)·w_r (f32 router input)
  layer_finish(res, m, e, ...)   (res + norm(norm(m)·w1 + norm(e)·w2)·w3) · layer_scalar

Three more fuse across op boundaries (one launch instead of two, same roundings):
  attn_finish(res, a, w, ...)    norm_add, then ffn_inputs of its (rounded) output: x, dense_in, moe_in, router_in
  layer_finish_moe(res, m, y, inv, wts, ..., w_next)
                                 e = Σ_j wts[t,j]·y[inv[t·k+j]] (the MoE un-permute, f32), then layer_finish,
                                 then (optionally) the next norm of the rounded output: x, norm(x)·w_next
  embed_sc_norms(ids, table, scale, s, w_next)
                                 a denoise step's first residual: the token embedding (gathered, scaled and rounded
                                 as Engine.embed does it) plus the SC MLP's output s, normed; and its norm·w_next

Intermediates stay in f32 inside each op (one rounding at the end), which is at least as accurate
as rounding after every norm. Each `*_ref` is the torch twin the tests pin the kernel to.

FP8 operands: attn_finish (dense_fp8 / moe_fp8) and layer_finish_moe (next_fp8) can hand the next GEMM its input
quantized per token (ops/fp8_quant.Fp8Rows) instead of the rounded activation: the kernel rounds the value to the
activation dtype as it would store it, then quantizes that row by ops/fp8_quant.store_fp8_row, so the bits are those
of quantize_rows on the unfused output, and the separate quantization launch (and the activation's store and load)
goes away.
"""

from __future__ import annotations

import torch

from ..errors import TensorError
from ._backend import HAVE_TRITON, next_pow2, use_triton
from .f16_operand import f16_operand_ref
from .fp8_quant import Fp8Rows, fp8_row_buffers, fp8_rows_done, quantize_rows_ref
from .fp8_weight import FP8_MAX, SCALE_MIN

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .f16_operand import f16_operand
    from .fp8_quant import store_fp8_row

    _FMAX = tl.constexpr(FP8_MAX)  # the per-token FP8 rule's constants (ops/fp8_weight.row_scale)
    _SMIN = tl.constexpr(SCALE_MIN)


def _norm_f32(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------- references

def rms_norm_ref(x, w, eps, out_dtype=None):
    y = _norm_f32(x, eps)
    if w is not None:
        y = y * w.float()
    return y.to(out_dtype or x.dtype)


def norm_add_ref(res, a, w, eps):
    return (res.float() + _norm_f32(a, eps) * w.float()).to(res.dtype)


def ffn_inputs_ref(x, w_ff, w_ff2, w_r, eps):
    n = _norm_f32(x, eps)
    return (n * w_ff.float()).to(x.dtype), (n * w_ff2.float()).to(x.dtype), n * w_r.float()


def layer_finish_ref(res, m, e, w1, w2, w3, scalar, eps):
    s = _norm_f32(m, eps) * w1.float() + _norm_f32(e, eps) * w2.float()
    return ((res.float() + _norm_f32(s, eps) * w3.float()) * scalar).to(res.dtype)


def _fp8_rows_ref(t):
    return Fp8Rows(*quantize_rows_ref(t))


def attn_finish_ref(res, a, w, w_ff, w_ff2, w_r, eps, moe_f16=False, dense_fp8=False, moe_fp8=False):
    x = norm_add_ref(res, a, w, eps)
    dense_in, moe_in, router_in = ffn_inputs_ref(x, w_ff, w_ff2, w_r, eps)
    moe_in = f16_operand_ref(moe_in) if moe_f16 else _fp8_rows_ref(moe_in) if moe_fp8 else moe_in
    return x, _fp8_rows_ref(dense_in) if dense_fp8 else dense_in, moe_in, router_in


def unpermute_ref(y, inv, wts):
    """y [T·k, H] expert-sorted rows, inv [T·k] route -> row, wts [T, k] -> f32 [T, H]."""
    T, k = wts.shape
    return torch.einsum("tkh,tk->th", y.index_select(0, inv.long()).view(T, k, -1).float(), wts.float())


def layer_finish_moe_ref(res, m, y, inv, wts, w1, w2, w3, scalar, eps, w_next=None, next_fp8=False):
    x = layer_finish_ref(res, m, unpermute_ref(y, inv, wts), w1, w2, w3, scalar, eps)
    hn = rms_norm_ref(x, w_next, eps) if w_next is not None else None
    return x, (_fp8_rows_ref(hn) if next_fp8 and hn is not None else hn)


def embed_sc_norms_ref(ids, table, scale, s, w_next, eps, out_dtype):
    e = (table[ids].float() * scale).to(out_dtype)
    x = rms_norm_ref(e.float() + s.float(), None, eps, out_dtype=out_dtype)
    return x, rms_norm_ref(x, w_next, eps)


# ----------------------------------------------------------------------------------------- kernels

if HAVE_TRITON:

    @triton.jit
    def _row_norm(x, mask, n_cols, eps):
        # x: f32 row (masked lanes are 0, so they add nothing to the sum of squares)
        ms = tl.sum(x * x, axis=0) / n_cols
        return x * (1.0 / tl.sqrt(ms + eps))

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = _row_norm(x, mask, n_cols, eps)
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_add_kernel(res_ptr, a_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(a_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = r + _row_norm(a, mask, n_cols, eps) * w
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_ffn_inputs(n, row, cols, mask, n_cols, w1_ptr, w2_ptr, wr_ptr, o1_ptr, o2_ptr, or_ptr,
                          MOE_F16: tl.constexpr, q1_ptr, s1_ptr, q2_ptr, s2_ptr, DENSE_FP8: tl.constexpr,
                          MOE_FP8: tl.constexpr):
        """The three feed-forward inputs of one normed row: dense (·w1), experts (·w2), router (·wr, f32).
        MOE_F16: the experts' input as the f16 operand of its bf16 value (ops/f16_operand.py). DENSE_FP8 / MOE_FP8:
        that input, rounded to o1's / o2's dtype, as its per-token FP8 form in (q1, s1) / (q2, s2) instead."""
        w1 = tl.load(w1_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wr = tl.load(wr_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        d = (n * w1).to(o1_ptr.dtype.element_ty)
        if DENSE_FP8:
            store_fp8_row(d.to(tl.float32), mask, q1_ptr, s1_ptr, row, n_cols, cols, _FMAX, _SMIN)
        else:
            tl.store(o1_ptr + row * n_cols + cols, d, mask=mask)
        if MOE_F16:
            tl.store(o2_ptr + row * n_cols + cols, f16_operand(n * w2), mask=mask)
        elif MOE_FP8:
            store_fp8_row((n * w2).to(o2_ptr.dtype.element_ty).to(tl.float32), mask, q2_ptr, s2_ptr, row, n_cols,
                          cols, _FMAX, _SMIN)
        else:
            tl.store(o2_ptr + row * n_cols + cols, (n * w2).to(o2_ptr.dtype.element_ty), mask=mask)
        tl.store(or_ptr + row * n_cols + cols, n * wr, mask=mask)

    @triton.jit
    def _ffn_inputs_kernel(x_ptr, w1_ptr, w2_ptr, wr_ptr, o1_ptr, o2_ptr, or_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        n = _row_norm(x, mask, n_cols, eps)
        _store_ffn_inputs(n, row, cols, mask, n_cols, w1_ptr, w2_ptr, wr_ptr, o1_ptr, o2_ptr, or_ptr, False,
                          o1_ptr, or_ptr, o2_ptr, or_ptr, False, False)

    @triton.jit
    def _layer_finish_kernel(res_ptr, m_ptr, e_ptr, w1_ptr, w2_ptr, w3_ptr, out_ptr, n_cols, eps, scalar,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        m = tl.load(m_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        e = tl.load(e_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(w1_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w3 = tl.load(w3_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        s = _row_norm(m, mask, n_cols, eps) * w1 + _row_norm(e, mask, n_cols, eps) * w2
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = (r + _row_norm(s, mask, n_cols, eps) * w3) * scalar
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _attn_finish_kernel(res_ptr, a_ptr, w_ptr, w1_ptr, w2_ptr, wr_ptr, x_ptr, o1_ptr, o2_ptr, or_ptr,
                            q1_ptr, s1_ptr, q2_ptr, s2_ptr, n_cols, eps, BLOCK: tl.constexpr, MOE_F16: tl.constexpr,
                            DENSE_FP8: tl.constexpr, MOE_FP8: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(a_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        xo = (r + _row_norm(a, mask, n_cols, eps) * w).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n_cols + cols, xo, mask=mask)
        n = _row_norm(xo.to(tl.float32), mask, n_cols, eps)  # normed from the rounded residual, like the twin
        _store_ffn_inputs(n, row, cols, mask, n_cols, w1_ptr, w2_ptr, wr_ptr, o1_ptr, o2_ptr, or_ptr, MOE_F16,
                          q1_ptr, s1_ptr, q2_ptr, s2_ptr, DENSE_FP8, MOE_FP8)

    @triton.jit
    def _layer_finish_moe_kernel(res_ptr, m_ptr, y_ptr, inv_ptr, wts_ptr, w1_ptr, w2_ptr, w3_ptr, wn_ptr,
                                 out_ptr, hn_ptr, q_ptr, s_ptr, n_cols, eps, scalar, K: tl.constexpr,
                                 HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr, NEXT_FP8: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        e = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            src = tl.load(inv_ptr + row * K + j).to(tl.int64)
            wj = tl.load(wts_ptr + row * K + j)
            e += wj * tl.load(y_ptr + src * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(w1_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        w3 = tl.load(w3_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        s = _row_norm(m, mask, n_cols, eps) * w1 + _row_norm(e, mask, n_cols, eps) * w2
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        xo = ((r + _row_norm(s, mask, n_cols, eps) * w3) * scalar).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, xo, mask=mask)
        if HAS_NEXT:
            wn = tl.load(wn_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            hn = _row_norm(xo.to(tl.float32), mask, n_cols, eps) * wn
            if NEXT_FP8:  # the next GEMM's per-token FP8 operand of the rounded norm, instead of it
                store_fp8_row(hn.to(hn_ptr.dtype.element_ty).to(tl.float32), mask, q_ptr, s_ptr, row, n_cols, cols,
                              _FMAX, _SMIN)
            else:
                tl.store(hn_ptr + row * n_cols + cols, hn.to(hn_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _embed_sc_norms_kernel(ids_ptr, table_ptr, s_ptr, wn_ptr, x_ptr, hn_ptr, n_rows, n_cols, scale, eps,
                               BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tok = tl.load(ids_ptr + row).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        known = (tok >= 0) & (tok < n_rows)  # an id outside the table reads nothing and makes its row NaN
        e = tl.load(table_ptr + tok * n_cols + cols, mask=cols < tl.where(known, n_cols, 0), other=0.0)
        e = tl.where(known, e.to(tl.float32), float("nan"))
        e = (e * scale).to(x_ptr.dtype.element_ty).to(tl.float32)  # the embedding rounded, as Engine.embed gives it
        v = e + tl.load(s_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        xo = _row_norm(v, mask, n_cols, eps).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n_cols + cols, xo, mask=mask)
        wn = tl.load(wn_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        hn = _row_norm(xo.to(tl.float32), mask, n_cols, eps) * wn
        tl.store(hn_ptr + row * n_cols + cols, hn.to(hn_ptr.dtype.element_ty), mask=mask)


# The warps of a row program over a row of `width` values: a wide row keeps several row vectors live in each thread,
# and more warps spread them (fewer registers a thread, none spilled); the variants that also write FP8 operands keep
# more live (the quantized rows and their maxima) and take twice the warps. The choice moves a norm's f32 summation
# order only (docs/ARCHITECTURE.md, 'Kernel configurations').
WIDE_ROW_WARPS = 8


def row_warps(width: int, fp8: bool = False) -> int:
    return (2 * WIDE_ROW_WARPS if fp8 else WIDE_ROW_WARPS) if width > 2048 else 4


def _rows(x):
    x = x.contiguous()
    return x, x.numel() // x.shape[-1], x.shape[-1]


def rms_norm_triton(x, w, eps, out_dtype=None):
    x, rows, n = _rows(x)
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    _rms_norm_kernel[(rows,)](x, w if w is not None else x, out, n, eps, HAS_W=w is not None, BLOCK=next_pow2(n),
                              num_warps=row_warps(n))
    return out


def norm_add_triton(res, a, w, eps):
    res, rows, n = _rows(res)
    a = a.contiguous()
    out = torch.empty_like(res)
    _norm_add_kernel[(rows,)](res, a, w, out, n, eps, BLOCK=next_pow2(n), num_warps=row_warps(n))
    return out


def ffn_inputs_triton(x, w_ff, w_ff2, w_r, eps):
    x, rows, n = _rows(x)
    o1, o2 = torch.empty_like(x), torch.empty_like(x)
    orr = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _ffn_inputs_kernel[(rows,)](x, w_ff, w_ff2, w_r, o1, o2, orr, n, eps, BLOCK=next_pow2(n),
                                num_warps=row_warps(n))
    return o1, o2, orr


def layer_finish_triton(res, m, e, w1, w2, w3, scalar, eps):
    res, rows, n = _rows(res)
    out = torch.empty_like(res)
    _layer_finish_kernel[(rows,)](res, m.contiguous(), e.contiguous(), w1, w2, w3, out, n, eps, float(scalar),
                                  BLOCK=next_pow2(n), num_warps=row_warps(n))
    return out


def _fp8_or(flag, like, rows, n):
    """(q, s) buffers for an FP8 output, or `like` twice (an unused pointer of the right kind)."""
    return fp8_row_buffers(rows, n, like.device) if flag else (like, like)


def attn_finish_triton(res, a, w, w_ff, w_ff2, w_r, eps, moe_f16=False, dense_fp8=False, moe_fp8=False):
    res, rows, n = _rows(res)
    x = torch.empty_like(res)
    o1 = x if dense_fp8 else torch.empty_like(res)  # with dense_fp8: only its dtype is read
    o2 = torch.empty(res.shape, dtype=torch.float16, device=res.device) if moe_f16 else \
        x if moe_fp8 else torch.empty_like(res)
    orr = torch.empty(res.shape, dtype=torch.float32, device=res.device)
    (q1, s1), (q2, s2) = _fp8_or(dense_fp8, orr, rows, n), _fp8_or(moe_fp8, orr, rows, n)
    _attn_finish_kernel[(rows,)](res, a.contiguous(), w, w_ff, w_ff2, w_r, x, o1, o2, orr, q1, s1, q2, s2, n, eps,
                                 BLOCK=next_pow2(n), MOE_F16=moe_f16, DENSE_FP8=dense_fp8, MOE_FP8=moe_fp8,
                                 num_warps=row_warps(n, dense_fp8 or moe_fp8))
    return x, fp8_rows_done(q1, s1) if dense_fp8 else o1, fp8_rows_done(q2, s2) if moe_fp8 else o2, orr


def layer_finish_moe_triton(res, m, y, inv, wts, w1, w2, w3, scalar, eps, w_next=None, next_fp8=False):
    res, rows, n = _rows(res)
    out = torch.empty_like(res)
    next_fp8 = next_fp8 and w_next is not None
    hn = torch.empty_like(res) if w_next is not None and not next_fp8 else out  # next_fp8: only its dtype is read
    q, s = _fp8_or(next_fp8, out, rows, n)
    _layer_finish_moe_kernel[(rows,)](res, m.contiguous(), y.contiguous(), inv.contiguous(), wts.float().contiguous(),
                                      w1, w2, w3, w_next if w_next is not None else w1, out, hn, q, s, n, eps,
                                      float(scalar), K=wts.shape[1], HAS_NEXT=w_next is not None, BLOCK=next_pow2(n),
                                      NEXT_FP8=next_fp8, num_warps=row_warps(n, next_fp8))
    return out, (fp8_rows_done(q, s) if next_fp8 else hn if w_next is not None else None)


def embed_sc_norms_triton(ids, table, scale, s, w_next, eps, out_dtype):
    s = s.contiguous()
    n = table.shape[1]
    x = torch.empty(len(ids), n, dtype=out_dtype, device=s.device)
    hn = torch.empty_like(x)
    _embed_sc_norms_kernel[(len(ids),)](ids.contiguous(), table, s, w_next, x, hn, table.shape[0], n, float(scale),
                                        eps, BLOCK=next_pow2(n), num_warps=row_warps(n))
    return x, hn


# ----------------------------------------------------------------------------------------- dispatch

def rms_norm(x, w, eps, out_dtype=None):
    return (rms_norm_triton if use_triton(x) else rms_norm_ref)(x, w, eps, out_dtype)


def norm_add(res, a, w, eps):
    return (norm_add_triton if use_triton(res) else norm_add_ref)(res, a, w, eps)


def ffn_inputs(x, w_ff, w_ff2, w_r, eps):
    return (ffn_inputs_triton if use_triton(x) else ffn_inputs_ref)(x, w_ff, w_ff2, w_r, eps)


def layer_finish(res, m, e, w1, w2, w3, scalar, eps):
    return (layer_finish_triton if use_triton(res) else layer_finish_ref)(res, m, e, w1, w2, w3, scalar, eps)


def attn_finish(res, a, w, w_ff, w_ff2, w_r, eps, moe_f16=False, dense_fp8=False, moe_fp8=False):
    """-> (x, dense_in, moe_in, router_in f32): post-attention norm + residual, then the three FFN input norms.
    moe_f16: moe_in as the f16 operand of its bf16 value, for the q4 expert GEMM (ops/f16_operand.py).
    dense_fp8 / moe_fp8: dense_in / moe_in as its per-token FP8 form (ops/fp8_quant.Fp8Rows), for FP8 weights."""
    if moe_f16 and moe_fp8:
        raise TensorError("attn_finish: moe_in is either the f16 operand or the FP8 one, not both")
    fn = attn_finish_triton if use_triton(res) else attn_finish_ref
    return fn(res, a, w, w_ff, w_ff2, w_r, eps, moe_f16, dense_fp8, moe_fp8)


def layer_finish_moe(res, m, y, inv, wts, w1, w2, w3, scalar, eps, w_next=None, next_fp8=False):
    """-> (x, norm(x)·w_next or None): MoE un-permute + layer_finish (+ the next layer's input norm; next_fp8: as
    its per-token FP8 form, ops/fp8_quant.Fp8Rows, for an FP8 qkv GEMM)."""
    fn = layer_finish_moe_triton if use_triton(res) else layer_finish_moe_ref
    return fn(res, m, y, inv, wts, w1, w2, w3, scalar, eps, w_next, next_fp8)


def embed_sc_norms(ids, table, scale, s, w_next, eps, out_dtype):
    """-> (x, norm(x)·w_next), x = norm(embed(ids) + s) in out_dtype: a denoise step's residual stream from its canvas
    ids and the SC MLP's output, and the first layer's input. One launch for what took eight (gather, cast, scale,
    cast, two casts and an add, two norms). ids must lie in [0, len(table)); the kernel checks them without a host
    sync, so an id outside reads nothing and its row comes out NaN (torch's gather would stop the device instead)."""
    if s.shape != (len(ids), table.shape[1]):
        raise TensorError(f"embed_sc_norms: s has shape {list(s.shape)}, expected [{len(ids)}, {table.shape[1]}]")
    fn = embed_sc_norms_triton if use_triton(s) else embed_sc_norms_ref
    return fn(ids, table, scale, s, w_next, eps, out_dtype)
