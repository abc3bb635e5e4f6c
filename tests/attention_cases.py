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
