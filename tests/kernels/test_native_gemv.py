"""The native few-row product over row-major weights (``gemv.c``) against a float64 product:
float32 and bfloat16 weights, 1..16 rows, widths that leave tails (in % 8, out % 4; for the
single-row bf16 pair kernel in % 64 == 32 and widths it leaves to ks_dot8), bias, one and two
threads, and the dispatch in ``model.matmul.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keyserve.kernels.native import library
from keyserve.kernels.native.gemv import MAX_ROWS, gemv, gemv_float, read_stream_gbps, supports
from keyserve.model.matmul import linear

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: native kernels not built")


def _threads(n: int):  # noqa: ANN202
    class _Ctx:
        def __enter__(self) -> None:
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc: object) -> None:
            torch.set_num_threads(self.before)

    return _Ctx()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, MAX_ROWS])
@pytest.mark.parametrize("out,n_in", [(576, 576), (832, 576), (576, 1536), (37, 70), (3, 5), (9, 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_equals_exact_product(rows: int, out: int, n_in: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out + n_in)
    w = torch.randn(out, n_in, generator=gen)
    b = torch.randn(out, generator=gen)
    x = torch.randn(rows, n_in, generator=gen)
    with _threads(threads), torch.inference_mode():
        got = gemv(x, w)
        got_b = gemv(x, w, b)
    exact = F.linear(x.double(), w.double())
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_b.double(), exact + b.double(), atol=1e-4, rtol=1e-5)


def _has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512f(), reason="the bit-identical few-row float32 path is AVX-512's")
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("out,n_in", [(576, 576), (37, 70), (9, 1536), (40, 100)])
def test_float32_rows_are_bit_identical_to_one_row_products(rows: int, out: int, n_in: int) -> None:
    """A verification step's K + 1 rows must give the logits K + 1 single-row decode steps
    would: same summation order, so greedy speculation cannot flip a near-tie."""
    gen = torch.Generator().manual_seed(rows * 7 + out)
    w = torch.randn(out, n_in, generator=gen)
    x = torch.randn(rows, n_in, generator=gen)
    with torch.inference_mode():
        together = gemv_float(x, w)
        one_by_one = torch.cat([gemv_float(x[r : r + 1], w) for r in range(rows)])
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, MAX_ROWS])
@pytest.mark.parametrize("out,n_in", [(576, 576), (37, 70), (4, 16), (40, 96), (9, 1536)])
def test_bfloat16_is_the_float32_product_rounded_once(rows: int, out: int, n_in: int) -> None:
    gen = torch.Generator().manual_seed(rows + out)
    w = torch.randn(out, n_in, generator=gen).bfloat16()
    b = torch.randn(out, generator=gen).bfloat16()
    x = torch.randn(rows, n_in, generator=gen).bfloat16()
    with torch.inference_mode():
        wide = gemv_float(x, w, b)  # float32 holding bf16 values
        narrow = gemv(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double())
    assert narrow.dtype == torch.bfloat16 and torch.equal(wide, narrow.float())
    assert torch.equal(wide, wide.bfloat16().float())  # already rounded
    # one bf16 rounding of a float32-accumulated sum: within one bf16 ulp (+ float32 noise)
    assert ((wide.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()


def test_dispatch_and_strides() -> None:
    w = torch.randn(64, 32)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        assert supports(x, w) and supports(x.bfloat16(), w.bfloat16())
        assert not supports(x, w.t().contiguous().t())  # column-major: skinny_linear's layout
        assert not supports(torch.randn(MAX_ROWS + 1, 32), w)
        assert not supports(x.bfloat16(), w)  # mixed dtypes go to torch
        torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
        xs = torch.randn(3, 64)[:, ::2]  # a strided x is copied, not misread
        torch.testing.assert_close(gemv(xs, w), F.linear(xs, w), atol=1e-5, rtol=1e-5)
    assert not supports(x, w)  # autograd on: F.linear keeps the graph


def test_read_stream_sums_the_buffer() -> None:
    buf = torch.arange(1 << 16, dtype=torch.float32) % 7
    _, gbps = read_stream_gbps(buf, 2)
    assert gbps > 0
    assert library().keyserve_read_stream(buf.data_ptr(), buf.numel(), 2) == float(buf.double().sum())
