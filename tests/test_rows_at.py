"""Kernel inputs read through their address (ops/rows_at.py): the SC logits a denoise graph reads where they lie.

The row-stats and masked-probabilities kernels (Triton interpreter on the CPU) fed a RowsAt give the same bits as
fed the tensor itself; pointing the same RowsAt at another tensor makes the same kernels read that one; a tensor
of the wrong shape, dtype or layout is refused by name.
"""

import pytest
import torch

from diffgemma.errors import TensorError
from diffgemma.ops import rowstats
from diffgemma.ops.rows_at import RowsAt


def _rows(n, vocab):
    x = torch.randn(n, vocab) * 4
    x[:, torch.randint(0, vocab, (n,))] += 20  # peaked rows, like real logits
    return x


def test_kernels_read_the_tensor_a_rows_at_names():
    vocab, block, segment = 1500, 256, 512
    a, b = _rows(4, vocab), _rows(4, vocab)
    at = RowsAt(4, vocab, "cpu")
    temp = float(torch.empty(()).uniform_(0.4, 1.0))
    for x in (a, b):  # one RowsAt, re-pointed: the kernels follow it
        at.point_at(x)
        direct = rowstats.tempered_rowstats_triton(x, temp, block=block, segment=segment)
        through = rowstats.tempered_rowstats_triton(at, temp, block=block, segment=segment)
        assert all(torch.equal(u, v) for u, v in zip(direct, through))
        lse = direct[3]
        thr = torch.full_like(lse, -float("inf"))
        for dtype in (torch.float32, torch.bfloat16):
            want = rowstats.tempered_masked_probs_triton(x, temp, thr, lse, dtype, block=block, segment=segment)
            got = rowstats.tempered_masked_probs_triton(at, temp, thr, lse, dtype, block=block, segment=segment)
            assert torch.equal(got, want)
    assert not torch.equal(rowstats.tempered_rowstats_triton(a, temp)[3], rowstats.tempered_rowstats_triton(b, temp)[3])


@pytest.mark.parametrize("bad", [lambda: torch.randn(4, 99), lambda: torch.randn(4, 100).double(),
                                 lambda: torch.randn(100, 4).t()], ids=["shape", "dtype", "not contiguous"])
def test_point_at_refuses_what_the_kernels_cannot_read(bad):
    at = RowsAt(4, 100, "cpu")
    before = at.offset.clone()
    with pytest.raises(TensorError, match="RowsAt: expected a contiguous torch.float32 tensor of shape \\[4, 100\\]"):
        at.point_at(bad())
    assert torch.equal(at.offset, before)  # nothing written


def test_point_at_refuses_data_off_the_vector_boundary():
    at = RowsAt(4, 100, "cpu")
    base = torch.randn(4 * 100 + 1)
    with pytest.raises(TensorError, match="16-byte boundary"):
        at.point_at(base[1:].view(4, 100))  # 4 bytes past an aligned start
    at.point_at(base[1:].view(4, 100).clone())
