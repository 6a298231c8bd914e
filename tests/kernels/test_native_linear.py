"""The native few-row float32 product (``skinny_linear.c``) against ``F.linear``: every row
count it takes, output widths that fill whole 16-column strips and ones that leave a tail,
several OpenMP thread counts, and the dispatch that decides when it runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keyserve.kernels.native import library
from keyserve.kernels.native.linear import MAX_ROWS, skinny_linear, supports
from keyserve.model.matmul import linear

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: native kernels not built")


def _column_major(out: int, n_in: int, gen: torch.Generator) -> torch.Tensor:  # [out, in]
    return torch.randn(out, n_in, generator=gen).t().contiguous().t()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, MAX_ROWS, 23, 32])
@pytest.mark.parametrize("out,n_in", [(576, 576), (192, 576), (1536, 576), (576, 1536), (37, 70), (3, 5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_f_linear(rows: int, out: int, n_in: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out)
    w = _column_major(out, n_in, gen)
    x = torch.randn(rows, n_in, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = skinny_linear(x, w)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_strided_rows_and_a_wide_head() -> None:
    gen = torch.Generator().manual_seed(1)
    w = _column_major(49152 // 8, 576, gen)
    x = torch.randn(4, 1152, generator=gen)[:, ::2]  # not contiguous
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_dispatch() -> None:
    gen = torch.Generator().manual_seed(2)
    w = _column_major(64, 32, gen)
    row_major = torch.randn(64, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    with torch.inference_mode():
        assert supports(x, w)
        assert not supports(x, row_major)  # the kernel reads W^T rows
        assert not supports(x.bfloat16(), w.bfloat16())
        assert not supports(torch.randn(MAX_ROWS + 1, 32), w)  # enough rows for the BLAS GEMM
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert not supports(x[:1], w)  # one row, one thread: the BLAS streams faster
            torch.set_num_threads(2)
            assert supports(x[:1], w)
        finally:
            torch.set_num_threads(before)
        torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert not supports(x, w)  # autograd on: F.linear keeps the graph
