"""Weight codecs: the fast torch path against the float64 reference twins, error bounds, byte layout.

Data is fresh random every run: gaussian rows with per-row scales spread over 4 decades, an offset (so
affine mins matter) and a few outliers (so group ranges vary).
"""

import numpy as np
import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.quant import codecs as C

AFFINE = {"q4": 15, "q5": 31, "q6": 63}
F16_EPS = 2.0 ** -11  # half a float16 ulp, relative


def weights(rows=24, k=128):
    scale = 10.0 ** torch.empty(rows, 1).uniform_(-3, 1)
    x = torch.randn(rows, k) * scale + torch.randn(rows, 1) * scale * 0.3
    idx = torch.randint(0, rows * k, (rows,))
    x.view(-1)[idx] *= 6  # outliers
    return x


def encoded(fmt, x):
    return C.assemble(fmt, x.shape, C.encode(fmt, x))


@pytest.mark.parametrize("fmt", sorted(AFFINE))
def test_affine_fast_matches_float64_reference(fmt):
    x = weights()
    rec = encoded(fmt, x)
    codes, scales, mins = C.ref_unpack_affine(fmt, rec, x.shape)  # bytes read back with plain bit arithmetic
    rcodes, rscales, rmins = C.ref_encode_affine(x.double().numpy(), AFFINE[fmt])
    assert np.array_equal(scales, rscales)  # per-group scalars are computed in float64 on both sides
    assert np.array_equal(mins, rmins)
    same = codes == rcodes
    assert same.mean() > 0.995, f"{fmt}: only {same.mean():.4f} of codes match the reference"
    assert np.abs(codes - rcodes).max() <= 1
    # decode: fast path == reference formula on the same bytes
    fast = C.decode(fmt, rec, x.shape).double().numpy()
    ref = C.ref_decode_affine(codes, scales, mins)
    np.testing.assert_allclose(fast, ref, rtol=1e-6, atol=1e-7 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", sorted(AFFINE))
def test_affine_error_bound_against_float64(fmt):
    x = weights()
    xd = x.double().numpy()
    codes, scales, mins = C.ref_unpack_affine(fmt, encoded(fmt, x), x.shape)
    err = np.abs(C.decode(fmt, encoded(fmt, x), x.shape).double().numpy() - xd)
    g = xd.reshape(xd.shape[0], -1, 32)
    lo, hi = g.min(-1), g.max(-1)
    step = (hi - lo) / AFFINE[fmt]
    # half a step, plus what float16 rounding of min and scale can add at the clamped ends (relative, or
    # absolute 2**-25 where the value is float16-subnormal), plus float32 arithmetic
    f16_err = lambda v: np.maximum(F16_EPS * np.abs(v), 2.0 ** -25)  # noqa: E731
    bound = 0.5 * scales + f16_err(lo) + AFFINE[fmt] * f16_err(step) + 1e-6 * np.abs(g).max(-1)
    assert np.all(err.reshape(g.shape) <= bound[..., None]), f"{fmt}: worst err/bound {(err.reshape(g.shape) / bound[..., None]).max():.3f}"
    # not vacuous: uniform rounding noise has rms = step / sqrt(12)
    ratio = np.sqrt(np.mean((err.reshape(g.shape) / step[..., None]) ** 2))
    assert 0.22 < ratio < 0.36, f"{fmt}: rms error = {ratio:.3f} steps"


def test_q8_fast_matches_reference_and_bound():
    x = weights(k=96)
    rec = encoded("q8", x)
    codes, scale = C.ref_unpack_q8(rec, x.shape)
    rcodes, rscale = C.ref_encode_q8(x.double().numpy())
    assert np.array_equal(scale, rscale)
    assert (codes == rcodes).mean() > 0.995 and np.abs(codes - rcodes).max() <= 1
    fast = C.decode("q8", rec, x.shape).double().numpy()
    np.testing.assert_allclose(fast, C.ref_decode_q8(codes, scale), rtol=1e-6, atol=0)
    err = np.abs(fast - x.double().numpy())
    assert np.all(err <= 0.5 * scale[:, None] * (1 + 1e-5) + 1e-12)
    ratio = np.sqrt(np.mean((err / scale[:, None]) ** 2))
    assert 0.22 < ratio < 0.36


def test_nvfp4_fast_matches_reference_and_bound():
    x = weights(k=128)
    rec = encoded("nvfp4", x)
    codes, bscale, tscale = C.ref_unpack_nvfp4(rec, x.shape)
    rcodes, rbscale, rtscale = C.ref_encode_nvfp4(x.double().numpy())
    assert tscale == rtscale
    assert np.array_equal(bscale, rbscale), "e4m3 block scales differ from the float64 reference rounding"
    assert (codes == rcodes).mean() > 0.995 and np.abs(np.abs(codes) - np.abs(rcodes)).max() <= 1
    fast = C.decode("nvfp4", rec, x.shape).double().numpy()
    ref = C.ref_decode_nvfp4(codes, bscale, tscale)
    np.testing.assert_allclose(fast, ref, rtol=1e-6, atol=0)
    # bound: half the e2m1 gap at the value's magnitude (0.25 / 0.5 / 1 in scaled units). Values past 6
    # saturate; with a normal e4m3 block scale (relative rounding <= 2**-4) that is at most 6.375 -> error
    # < 1 unit. Rows ~4 decades below the tensor max get subnormal e4m3 scales and may clip further.
    s = np.repeat(bscale * tscale, 16, axis=1)
    y = np.abs(x.double().numpy()) / s
    half_gap = np.where(y <= 2, 0.25, np.where(y <= 4, 0.5, 1.0))
    err = np.abs(fast - x.double().numpy())
    normal = np.repeat(bscale >= 2.0 ** -6, 16, axis=1)
    assert np.all(y[normal] <= 6.375 * (1 + 1e-6))
    ok = (err <= half_gap * s * (1 + 1e-5) + 1e-12) | ((y > 6) & (np.abs(codes) == 7))
    assert np.all(ok)
    assert 0.05 < np.sqrt(np.mean((err[normal] / s[normal]) ** 2)) < 0.5


def test_e2m1_and_e4m3_rounding_rules():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, -0.75, -5.0, 0.0])
    expect = [0, 2, 2, 4, 4, 6, 6, 7, 7, 2, 6, 0]  # ties go to the even code (even mantissa); >6 saturates
    assert C._e2m1_code(ties).tolist() == expect
    assert np.abs(C.ref_e2m1_round(ties.double().numpy())).tolist() == expect
    v = (2.0 ** torch.empty(4000).uniform_(-12, 9)).float()
    fast = v.clamp(max=448).to(torch.float8_e4m3fn).float().double().numpy()
    assert np.array_equal(fast, C.ref_e4m3_round(v.double().numpy()))
    b = np.arange(256)
    dec = torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).float().double().numpy()
    np.testing.assert_array_equal(np.nan_to_num(dec, nan=-1), np.nan_to_num(C.ref_e4m3_decode(b), nan=-1))


@pytest.mark.parametrize("fmt", C.QUANT_FORMATS)
def test_chunked_encode_equals_whole_tensor(fmt):
    x = weights(rows=12, k=64).reshape(3, 4, 64) if fmt != "q8" else weights(rows=12, k=64)
    whole = C.encode(fmt, x)
    rows = x.reshape(-1, 64)
    tscale = C.nvfp4_tensor_scale(rows.abs().max().item())
    parts = [C.encode(fmt, rows[a:a + 5], tscale=tscale) for a in range(0, 12, 5)]
    for name, plane in whole.items():
        if name == "tscale":
            continue
        assert np.array_equal(plane, np.concatenate([p[name] for p in parts])), name


@pytest.mark.parametrize("fmt", C.QUANT_FORMATS)
def test_layout_alignment_and_size(fmt):
    shape = (3, 40, 96) if fmt != "q8" else (40, 96)
    ps = C.planes(fmt, shape)
    assert all(p.offset % 64 == 0 for p in ps)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(ps, ps[1:]))
    n = 3 * 40 * 96 if fmt != "q8" else 40 * 96
    bits = 8 * sum(p.nbytes for p in ps) / n
    expect = {"q4": 5.0, "q5": 6.0, "q6": 7.0, "q8": 8 + 32 / 96, "nvfp4": 4.5 + 32 / n}[fmt]
    assert bits == pytest.approx(expect)
    assert C.record_nbytes(fmt, shape) == ps[-1].offset + ps[-1].nbytes


def test_dimension_rules():
    assert C.dims_problem("q4", (8, 48)) and "multiple of 32" in C.dims_problem("q4", (8, 48))
    assert C.dims_problem("q6", (2, 8, 16))
    assert C.dims_problem("nvfp4", (8, 48)) is None and C.dims_problem("nvfp4", (8, 40))
    assert "rank-2" in C.dims_problem("q8", (2, 8, 16)) and C.dims_problem("q8", (8, 7)) is None
    assert C.dims_problem("q4", (64,))
    with pytest.raises(TensorError, match="multiple of 32"):
        C.encode("q4", torch.randn(4, 48))


@pytest.mark.parametrize("fmt", C.QUANT_FORMATS)
def test_non_finite_refused_and_degenerate_groups_exact(fmt):
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    with pytest.raises(TensorError, match="non-finite"):
        C.encode(fmt, x)
    const = torch.full((4, 64), float(torch.randn(())))
    const[2] = 0
    out = C.decode(fmt, encoded(fmt, const), const.shape)
    tol = {"nvfp4": 0.07, "q8": 0.004}.get(fmt, 1e-3) * const.abs().max()  # constant groups: (near) exact
    assert (out - const).abs().max() <= tol and torch.all(out[2] == 0)
