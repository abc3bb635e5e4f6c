"""Canvas (bidirectional) attention as two cuBLAS GEMMs around a chunked softmax.

The engine ran the full layers' denoise canvas this way (head dim 512, every cache row below `nlive` a key)
until ops/attention_tiles.py, which keeps the scores out of memory, replaced it; it stays as the engine's A/B
alternative (`canvas_impls = {"full": "gemm"}`). The flash kernel
(ops/attention_flash.py) runs those well below the tensor cores' rate: a 512-wide head leaves it 32-key
blocks, and it recomputes QK^T for each output half. Here the products are plain GEMMs, which cuBLAS runs near the
compute roofline, and the scores make one round trip through memory:

  1. S = Q·K^T per KV head ([G·n, keys], f32; GQA folded into the rows as in the flash kernel);
  2. per chunk of `chunk` keys: m = the chunk's row max, P = exp(S - m) (f16, the V cache's dtype, written
     over S's own bytes), l = Σ P;
     keys at or past `nlive` (a device scalar, so one CUDA graph serves every step of a bucket) or with
     kpos < 0 get P = 0;
  3. per chunk: acc = P·V (f32), one GEMM batched over the KV heads;
  4. the flash kernel's merge of (acc, m, l) over the chunks (its partials' layout).

Keys masked by `kpos` (the sliding layers' ring) work too, but there the engine keeps the flash kernel, whose
256-wide heads fit its tiles whole.

The price is that the GEMMs always run over all `n_keys` rows (a graph's padded bucket), where the flash
kernel stops at `nlive`; masked rows hold zeros or earlier finite K/V (normed, so never inf), and
0 · V = 0 there. Numerics: as the flash kernel, f16 operands with f32 accumulation, f32 scores and
softmax, P rounded to f16 before the PV product.

  attention_gemm        the path above (CUDA; on the CPU the same steps with f32 matmuls, for tests)
  chunk_softmax_ref     torch twin of step 2
"""

from __future__ import annotations

import torch

from ._backend import HAVE_TRITON, next_pow2, use_triton
from .attention_flash import combine_partials

if HAVE_TRITON:
    import triton
    import triton.language as tl  # noqa: F401 (used inside the kernel)

LOG2E = 1.4426950408889634


if HAVE_TRITON:

    @triton.jit
    def _chunk_softmax_kernel(s_ptr, p_ptr, pml_ptr, nlive_ptr, kpos_ptr, n_keys, RT, n_chunks,
                              CHUNK: tl.constexpr, HAS_NLIVE: tl.constexpr, KPOS: tl.constexpr):
        """One program a row (g · (G·n) + r over every KV head = head · n + t), its chunks in order. P is
        written over the row's own scores (p_ptr: the same buffer as f16, row stride 2·n_keys): chunk c's P
        lands on the bytes of chunk c/2's scores, which this program has already read (the row max's
        reduction orders every thread's loads of a chunk before its stores)."""
        LOG2E_: tl.constexpr = 1.4426950408889634
        row = tl.program_id(0)
        hi = n_keys
        if HAS_NLIVE:
            hi = tl.minimum(n_keys, tl.load(nlive_ptr).to(tl.int32))
        s_row = s_ptr + row.to(tl.int64) * n_keys
        p_row = p_ptr + row.to(tl.int64) * 2 * n_keys
        for c in range(0, n_chunks):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            ok = cols < hi
            if KPOS:
                ok = ok & (tl.load(kpos_ptr + cols, mask=ok, other=-1) >= 0)
            s = tl.load(s_row + cols, mask=ok, other=-float("inf")).to(tl.float32) * LOG2E_
            m = tl.maximum(tl.max(s, axis=0), -1.0e30)  # finite: an all-masked chunk gets l = 0 and weight 0
            p = tl.exp2(s - m)
            tl.store(p_row + cols, p.to(p_ptr.dtype.element_ty), mask=cols < n_keys)
            ml = pml_ptr + c * 2 * RT + row  # the flash kernel's partials: [chunks, 2, RT]
            tl.store(ml, m)
            tl.store(ml + RT, tl.sum(p, axis=0))


def check_canvas_shapes(name: str, q, k, v, n_keys: int) -> None:
    """The canvas paths' shape contract (GEMM and tile forms), refused with a message naming the caller."""
    if (q.dim() != 3 or k.dim() != 3 or q.shape[0] % k.shape[0] or k.shape[2] != q.shape[2] or v.shape != k.shape
            or n_keys > k.shape[1] or n_keys <= 0):
        raise ValueError(f"{name}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, n_keys {n_keys}: "
                         f"expected q [H, n, d], H a multiple of KV, k and v [KV, rows >= n_keys > 0, d]")


def visible_keys(n_keys: int, nlive, kpos, device) -> torch.Tensor:
    """[n_keys] bool: key j is visible iff j < nlive (when given) and kpos[j] >= 0 (when given). No host reads."""
    ok = torch.ones(n_keys, dtype=torch.bool, device=device)
    if nlive is not None:
        ok &= torch.arange(n_keys, device=device) < nlive
    if kpos is not None:
        ok &= kpos[:n_keys] >= 0
    return ok


def chunk_size(n_keys: int) -> int:
    """Keys a chunk: n_keys / 8 rounded to a power of two, within [2048, 8192] (8192 keys: a row of the softmax
    in one program's registers). A function of the static key count only: larger chunks mean fewer partials to
    merge."""
    return max(2048, min(8192, next_pow2(n_keys // 8)))


def chunk_softmax_ref(s, nlive, chunk: int, p_dtype, kpos=None):
    """-> (P [KV, GR, n_keys] p_dtype, pml [chunks, 2, KV·GR] f32): m in log2 units, as the kernel writes them.
    No host reads (nlive stays on the device), so a CUDA graph may capture it (DIFFGEMMA_NO_TRITON=1)."""
    KV, GR, n_keys = s.shape
    n_chunks = -(-n_keys // chunk)
    x = (s.float() * LOG2E).masked_fill(~visible_keys(n_keys, nlive, kpos, s.device), -float("inf"))
    p = torch.empty(KV, GR, n_keys, dtype=p_dtype, device=s.device)
    pml = torch.empty(n_chunks, 2, KV * GR, dtype=torch.float32, device=s.device)
    for c in range(n_chunks):
        xc = x[..., c * chunk:(c + 1) * chunk]
        m = xc.amax(-1).clamp_min(-1.0e30)
        e = torch.exp2(xc - m[..., None])
        p[..., c * chunk:(c + 1) * chunk] = e.to(p_dtype)
        pml[c, 0], pml[c, 1] = m.flatten(), e.sum(-1).flatten()
    return p, pml


def _matmul_f32(a, b, out):
    """out (f32) <- a @ b for f16/bf16 a, b: f32 accumulation and output (cuBLAS on CUDA)."""
    if a.is_cuda:
        (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.matmul(a.float(), b.float(), out=out)


def attention_gemm(q, k, v, n_keys: int, kpos=None, nlive=None, out_dtype=None, chunk: int | None = None,
                   kernels: bool | None = None):
    """q [H, n, d] (contiguous), k/v [KV, rows, d] (the first n_keys rows read) -> [n, H·d]. Key j is visible
    iff j < nlive (when given) and kpos[j] >= 0 (when given); scale 1. kernels: the Triton softmax and merge
    (default: on CUDA), else their torch twins (tests run the kernels on the CPU through TRITON_INTERPRET=1)."""
    check_canvas_shapes("attention_gemm", q, k, v, n_keys)
    H, n, d = q.shape
    KV = k.shape[0]
    kernels = use_triton(q) if kernels is None else kernels
    GR = (H // KV) * n
    L = chunk or chunk_size(n_keys)
    n_chunks = -(-n_keys // L)
    qg = q.reshape(KV, GR, d).to(k.dtype)
    K, V = k[:, :n_keys], v[:, :n_keys]
    s = torch.empty(KV, GR, n_keys, dtype=torch.float32, device=q.device)
    _matmul_f32(qg, K.transpose(1, 2), s)
    if kernels:  # P in place of the scores: one [keys] buffer a row instead of two, at long contexts
        p = s.view(v.dtype)  # [KV, GR, 2·n_keys]; P is its first n_keys columns
        pml = torch.empty(n_chunks, 2, KV * GR, dtype=torch.float32, device=q.device)
        _chunk_softmax_kernel[(KV * GR,)](s, p, pml, nlive if nlive is not None else s, kpos if kpos is not None else s,
                                          n_keys, KV * GR, n_chunks, CHUNK=L, HAS_NLIVE=nlive is not None,
                                          KPOS=kpos is not None, num_warps=4)
        p = p[..., :n_keys]
    else:
        p, pml = chunk_softmax_ref(s, nlive, L, v.dtype, kpos)
    po = torch.empty(n_chunks, KV * GR, d, dtype=torch.float32, device=q.device)
    for c in range(n_chunks):  # one GEMM a chunk, batched over the KV heads (uniform strides for P and V)
        _matmul_f32(p[:, :, c * L:(c + 1) * L], V[:, c * L:(c + 1) * L], po[c].view(KV, GR, d))
    out = torch.empty(n, H * d, dtype=out_dtype or q.dtype, device=q.device)
    if kernels:
        combine_partials(po, pml, out, n)
    else:
        m, l = pml[:, 0], pml[:, 1]  # [chunks, H·n]
        w = torch.exp2(m - m.amax(0))
        o = (w[..., None] * po).sum(0) / (w * l).sum(0)[:, None]  # [H·n, d], rows head-major
        out.copy_(o.reshape(H, n, d).transpose(0, 1).reshape(n, H * d))
    return out
