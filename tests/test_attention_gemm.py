"""The GEMM canvas attention (ops/attention_gemm.py) against the f32 twin; its softmax and merge kernels
through TRITON_INTERPRET=1. Tiny shapes with the real layouts (GQA folded rows, a graph's padded bucket:
nlive < key rows, chunks of keys with a short last one). Fresh random data every run. Outputs in f32, compared
with the twin at 1e-3 relative (a bf16 output's rounding would hide a 0.4 % error); the bf16 store on its own."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from attention_cases import assert_close_f32, qkv, ring_case  # noqa: E402
from diffgemma.ops import attention as attn  # noqa: E402
from diffgemma.ops import attention_gemm as ag  # noqa: E402


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("key_rows,live,chunk", [(96, 41, 16), (80, 80, 32), (50, 50, 64), (72, 9, 16)])
def test_gemm_attention_matches_the_twin(kernels, key_rows, live, chunk):
    """Rows [0, live) visible, [live, key_rows) the bucket's padding: finite garbage (as in the cache),
    never weighted. Chunks past live count for nothing in the merge; a short last chunk is its own GEMM."""
    H, KV, C, d = 8, 2, 8, 32
    q, k, v = qkv(H, KV, C, key_rows + 3, d)
    k[:, live:] *= 50  # padding rows whose scores would dominate if they were not masked
    nlive = torch.tensor(live)
    got = ag.attention_gemm(q, k, v, key_rows, nlive=nlive, out_dtype=torch.float32, chunk=chunk, kernels=kernels)
    kpos = torch.where(torch.arange(key_rows) < live, 0, -1)
    exp = attn.attention_ref(q, k, v, kpos, key_rows, out_dtype=torch.float32)
    assert got.shape == (C, H * d)
    assert_close_f32(got, exp)


@pytest.mark.parametrize("kernels", [True, False])
def test_gemm_attention_with_key_positions(kernels):
    """The sliding layers' call: a ring with empty / out-of-window slots (kpos -1), then the canvas; no nlive."""
    q, k, v, kpos, n_keys = ring_case()
    got = ag.attention_gemm(q, k, v, n_keys, kpos=kpos, out_dtype=torch.float32, chunk=16, kernels=kernels)
    exp = attn.attention_ref(q, k, v, kpos, n_keys, out_dtype=torch.float32)
    assert_close_f32(got, exp)


@pytest.mark.parametrize("kernels", [True, False])
def test_gemm_bf16_output_is_the_f32_output_rounded(kernels):
    """out_dtype=bf16 (the engine's) rounds the f32 numbers once: within one bf16 ulp of the f32 output."""
    q, k, v, kpos, n_keys = ring_case()
    got = ag.attention_gemm(q, k, v, n_keys, kpos=kpos, out_dtype=torch.bfloat16, chunk=16, kernels=kernels)
    f32 = ag.attention_gemm(q, k, v, n_keys, kpos=kpos, out_dtype=torch.float32, chunk=16, kernels=kernels)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), f32.to(torch.bfloat16).float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("with_kpos", [False, True])
def test_chunk_softmax_kernel_matches_its_twin(with_kpos):
    KV, GR, n_keys, chunk, live = 2, 6, 75, 16, 58
    s = torch.randn(KV, GR, n_keys) * 4
    kpos = torch.where(torch.rand(n_keys) < 0.3, -1, 0) if with_kpos else None
    ep, epml = ag.chunk_softmax_ref(s, live, chunk, torch.float16, kpos)
    n_chunks = -(-n_keys // chunk)
    pml = torch.empty(n_chunks, 2, KV * GR)
    buf = s.clone()  # the kernel writes P over the scores it reads
    ag._chunk_softmax_kernel[(KV * GR,)](buf, buf.view(torch.float16), pml, torch.tensor(live),
                                         kpos if with_kpos else s, n_keys, KV * GR, n_chunks, CHUNK=chunk,
                                         HAS_NLIVE=True, KPOS=with_kpos, num_warps=4)
    p = buf.view(torch.float16)[..., :n_keys]
    assert torch.equal(p[..., live:], torch.zeros_like(p[..., live:]))  # masked keys weigh exactly 0 in P·V
    if with_kpos:
        assert torch.equal(p[..., :live][..., kpos[:live] < 0], torch.zeros_like(p[..., :live][..., kpos[:live] < 0]))
    torch.testing.assert_close(p.float(), ep.float(), atol=1e-3, rtol=1e-3)
    used = -(-live // chunk)
    torch.testing.assert_close(pml[:used], epml[:used], atol=1e-5, rtol=1e-5)
    assert torch.equal(pml[used:, 1], torch.zeros_like(pml[used:, 1]))  # chunks wholly past live: l = 0


def test_gemm_attention_refuses_bad_shapes():
    q, k, v = qkv(6, 4, 4, 16, 32)
    with pytest.raises(ValueError, match="attention_gemm"):
        ag.attention_gemm(q, k, v, 16)
    q, k, v = qkv(8, 2, 4, 16, 32)
    with pytest.raises(ValueError, match="n_keys"):
        ag.attention_gemm(q, k, v, 17)


@pytest.mark.parametrize("n_keys,expect", [(1280, 2048), (8448, 2048), (33024, 8192), (200000, 8192), (64, 2048)])
def test_chunk_size(n_keys, expect):
    assert ag.chunk_size(n_keys) == expect


def test_engine_rule_takes_the_gemms_for_the_full_canvas_only():
    from types import SimpleNamespace

    from diffgemma.model.forward import Forward

    eng = SimpleNamespace(attn_impl=None, canvas_impls={"full": "gemm"})
    rule = Forward._attn_impl
    assert rule(eng, sliding=False, causal=False) == "gemm"
    assert rule(eng, sliding=True, causal=False) is None  # the flash kernel (dispatcher default)
    assert rule(eng, sliding=False, causal=True) is None  # prefill
    eng.attn_impl = "triton"  # a forced implementation wins everywhere
    assert rule(eng, sliding=False, causal=False) == "triton"
    eng.attn_impl, eng.canvas_impls = None, {"full": "tiles", "sliding": "gemm"}
    assert rule(eng, sliding=True, causal=False) == "gemm"
    assert rule(eng, sliding=False, causal=False) == "tiles"


def test_dispatcher_calls_the_gemms_with_the_kernels_convention():
    """attention(impl='gemm') on CUDA calls _KERNELS['gemm'] with the flash kernel's keywords; here on the CPU
    (the dispatcher itself sends CPU tensors to the twin) the same call, through the torch softmax and merge."""
    H, KV, C, d, key_rows, live = 8, 2, 8, 32, 60, 37
    q, k, v = qkv(H, KV, C, key_rows, d)
    nlive = torch.tensor(live)
    got = attn._KERNELS["gemm"](q, k, v, None, key_rows, n_ring=0, base_pos=0, nlive=nlive, qpos=None,
                                window=attn.NO_WINDOW, causal=False, out_dtype=torch.float32)
    exp = attn.attention(q, k, v, None, key_rows, out_dtype=torch.float32, impl="gemm", nlive=nlive)  # -> the twin
    assert_close_f32(got, exp)
