"""Inputs shared by the canvas-attention tests (the GEMM and tile paths): fresh random data each call."""

import torch


def qkv(H, KV, n, rows, d):
    q = torch.randn(H, n, d).half()
    k = (torch.randn(KV, rows, d) * d ** -0.5 * 3).half()  # logits of a few units: a peaked softmax
    v = torch.randn(KV, rows, d).half()
    return q, k, v


def ring_case(H=4, KV=2, C=8, d=32, ring=37):
    """The sliding layers' call: a ring with empty / out-of-window slots (kpos -1) whose K would dominate if it
    were weighted, then the canvas. -> q, k, v, kpos, n_keys."""
    n_keys = ring + C
    q, k, v = qkv(H, KV, C, n_keys + 4, d)
    kpos = torch.where(torch.rand(n_keys) < 0.35, -1, 0)
    kpos[ring:] = 0
    k[:, :n_keys][:, kpos < 0] *= 50
    return q, k, v, kpos, n_keys


def assert_close_f32(got, exp, rel=1e-3):
    """A kernel's f32 output against the f32 twin, relative to the output's size: ‖Δ‖ ≤ rel·‖exp‖ and
    max|Δ| ≤ 2·rel·max|exp|. The f16 operands' roundings (P for P·V, the softmax in f32) leave ‖Δ‖/‖exp‖ ≈ 8e-5
    and max|Δ|/max|exp| ≈ 1.4e-4 at these shapes; an output off by a factor 1.004 lands at 4e-3 on both."""
    assert got.dtype == torch.float32 and got.shape == exp.shape, (got.dtype, got.shape, exp.shape)
    assert not torch.isnan(got).any()
    d = (got - exp).double()
    norm_rel = (d.norm() / exp.double().norm()).item()
    max_rel = (d.abs().max() / exp.double().abs().max()).item()
    assert norm_rel <= rel and max_rel <= 2 * rel, f"‖Δ‖/‖exp‖ = {norm_rel:.3g}, max|Δ|/max|exp| = {max_rel:.3g}"
