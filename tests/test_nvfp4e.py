"""nvfp4e records (ops/layouts.py): nvfp4 expert stacks with one tensor scale per expert, as published NVFP4
checkpoints hold them (a multiplier, ModelOpt's weight_scale_2, or a divisor, compressed-tensors' global scale).

The torch twin (ops/packed_weight.dequantize) and the codecs' decode against a numpy float32 oracle written from the
layout's rule, bit for bit; the kernels (ops/moe_packed.py) in the Triton interpreter against the twin; and an nvfp4
record (one tensor scale) re-expressed as nvfp4e with that scale for every expert runs bit-identically.
"""

import os

import numpy as np
import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import moe_packed as mp
from diffgemma.quant import codecs

interpreted = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="needs CUDA or the Triton interpreter")
E2M1 = np.array(codecs.E2M1_VALUES + tuple(-v for v in codecs.E2M1_VALUES), dtype=np.float32)


def random_planes(E, N, K, divides: bool) -> dict:
    """Random nibbles, random finite e4m3 block scales (NaN codes 0x7F / 0xFF avoided) and per-expert pairs: a
    divisor like compressed-tensors' global scale (multiplier 1), or a multiplier like ModelOpt's (divisor 1)."""
    codes = torch.randint(0, 256, (E * N, K // 2), dtype=torch.uint8)
    scale = torch.randint(0, 0x7F, (E * N, K // 16), dtype=torch.uint8)  # e4m3 0 .. 448, positive
    t = (torch.rand(E) * 4 + 0.5).float()
    pairs = torch.stack([torch.ones(E), t * 1000], 1) if divides else torch.stack([t * 1e-3, torch.ones(E)], 1)
    return {"codes": codes.numpy(), "scale": scale.numpy(), "escale": pairs.float().contiguous().view(torch.uint8).numpy()}


def as_weight(fmt, shape, rec: bytes, device="cpu") -> mp.PackedWeight:
    return mp.PackedWeight.from_record(fmt, shape, torch.frombuffer(bytearray(rec), dtype=torch.uint8).clone().to(device))


def oracle(planes: dict, E: int) -> np.ndarray:
    """e2m1 · fl32(fl32(e4m3 · mul) / div), numpy float32 arithmetic (each operation rounded once)."""
    codes = planes["codes"]
    nib = np.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1)
    s = torch.from_numpy(planes["scale"].copy()).view(torch.float8_e4m3fn).float().numpy()
    pairs = planes["escale"].copy().view(np.float32)
    rows = np.arange(codes.shape[0]) // (codes.shape[0] // E)
    sc = (s * pairs[rows, :1]).astype(np.float32) / pairs[rows, 1:]
    return (E2M1[nib].reshape(len(rows), -1, 16) * sc.astype(np.float32)[..., None]).reshape(len(rows), -1)


@pytest.mark.parametrize("divides", [False, True])
def test_twin_and_codecs_decode_equal_the_rule(divides):
    E, N, K = 4, 24, 64
    planes = random_planes(E, N, K, divides)
    rec = codecs.assemble("nvfp4e", (E, N, K), planes)
    want = torch.from_numpy(oracle(planes, E)).reshape(E, N, K)
    pw = as_weight("nvfp4e", (E, N, K), rec)
    assert pw.divides == divides and pw.nbytes == codecs.record_nbytes("nvfp4e", (E, N, K))
    assert torch.equal(mp.dequantize(pw), want)
    assert torch.equal(codecs.decode("nvfp4e", rec, (E, N, K)), want)
    views = codecs.plane_views("nvfp4e", rec, (E, N, K))
    assert torch.equal(codecs.decode_rows("nvfp4e", views, 17, 53), want.reshape(E * N, K)[17:53])  # across experts


def test_layout_refusals():
    with pytest.raises(TensorError, match="expert stack"):
        codecs.planes("nvfp4e", (24, 64))
    with pytest.raises(TensorError, match="not encoded"):
        codecs.encode("nvfp4e", torch.randn(2, 8, 32))


@interpreted
@pytest.mark.parametrize("divides", [False, True])
def test_dequant_kernel_equals_twin(divides):
    E, N, K = 3, 20, 96
    pw = as_weight("nvfp4e", (E, N, K), codecs.assemble("nvfp4e", (E, N, K), random_planes(E, N, K, divides)))
    assert torch.equal(mp.dequantize_triton(pw, torch.float32, BR=16, BK=64), mp.dequantize(pw))


@interpreted
@pytest.mark.parametrize("divides", [False, True])
@pytest.mark.parametrize("config", [(16, 16, 64, 4, 1), (32, 16, 32, 4, 1)])
def test_grouped_kernel_matches_twin(divides, config):
    from test_moe_packed import ragged_offs, rel

    E, N, K, M = 6, 40, 96, 53
    pw = as_weight("nvfp4e", (E, N, K), codecs.assemble("nvfp4e", (E, N, K), random_planes(E, N, K, divides)))
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    out = mp.grouped_mm_packed_triton(xs, pw, offs, config=config)
    assert rel(out, mp.grouped_mm_packed_ref(xs, pw, offs)) < 1e-5
    assert torch.equal(out, mp.grouped_mm_packed_triton(xs, pw, offs, config=config, prefetch=False))
    glu = mp.grouped_mm_packed_triton(xs, pw, offs, config=config, glu=True)
    assert rel(glu, mp.gelu_mul_ref(mp.grouped_mm_packed_ref(xs, pw, offs))) < 1e-5


@interpreted
def test_one_tensor_scale_as_nvfp4e_runs_bit_identically():
    """An nvfp4 record's one tensor scale is nvfp4e's pair (tscale, 1) for every expert: same decode, same GEMM."""
    from test_moe_packed import packed, ragged_offs

    E, N, K, M = 5, 40, 96, 47
    old, _ = packed("nvfp4", (E, N, K))
    planes = {"codes": old.planes["codes"].numpy(), "scale": old.planes["scale"].numpy(),
              "escale": torch.tensor([[old.tscale, 1.0]] * E, dtype=torch.float32).view(torch.uint8).numpy()}
    new = as_weight("nvfp4e", (E, N, K), codecs.assemble("nvfp4e", (E, N, K), planes))
    assert not new.divides
    assert torch.equal(mp.dequantize(new), mp.dequantize(old))
    assert torch.equal(mp.dequantize_triton(new, torch.float32, BR=16, BK=64), mp.dequantize(old))
    xs = torch.randn(M, K)
    offs = ragged_offs(E, M)
    for cfg in ((16, 16, 64, 4, 1), (32, 16, 32, 4, 1)):
        assert torch.equal(mp.grouped_mm_packed_triton(xs, new, offs, config=cfg),
                           mp.grouped_mm_packed_triton(xs, old, offs, config=cfg))
