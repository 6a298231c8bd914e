"""The AMX few-row bf16 product (kernels/native/amx_linear.c) against a float64 product of the
same bf16 values and against F.linear, and where ``matmul.linear`` sends products to it.

Its sums are float32 (tile dot products) rounded once to bf16, as F.linear's; only their order
differs from oneDNN's, so every value is within one bf16 rounding step of the exact product and
nearly all equal F.linear's bits."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from keyserve.kernels.native import amx
from keyserve.kernels.native import gemv as native_gemv
from keyserve.model import matmul

pytestmark = pytest.mark.skipif(not amx.available(), reason="no AMX here (CPU, compiler or kernel permission)")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# (rows, inputs, outputs): one tile of rows and a partial one, every tile count, inputs over
# several 256-input chunks with a short last one (576 = 2 x 256 + 64), the LM head's width
@pytest.mark.parametrize("m,k,n", [(2, 64, 16), (16, 576, 960), (17, 576, 3072), (40, 1536, 576),
                                   (64, 576, 576), (33, 576, 49152)])
def test_amx_linear_against_exact_and_f_linear(m: int, k: int, n: int) -> None:
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n)
    with torch.inference_mode():
        got = amx.amx_linear(x, w)
        want = F.linear(x, w)
    exact = x.double() @ w.double().t()
    # one bf16 rounding step (2^-8 relative) of the exact value, plus float32 summation noise
    assert torch.all((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3)
    assert (got == want).float().mean() > 0.999


def test_rows_outside_the_tiles_go_elsewhere() -> None:
    """matmul.linear: one row to the vector kernel, 2-48 to AMX (packing the weight once), more
    to oneDNN (faster there, bench/packed_linear_bench.py); a matrix the tiles do not divide
    never to AMX."""
    w = _bf16(96, 64, seed=1)
    with torch.inference_mode():
        matmul.linear(_bf16(1, 64, seed=2), w)
        assert id(w) not in amx._PACKED
        for m in (2, amx.LINEAR_MAX_ROWS):
            x = _bf16(m, 64, seed=m)
            torch.testing.assert_close(matmul.linear(x, w), F.linear(x, w), atol=0.05, rtol=2**-7)
        packed = amx._PACKED[id(w)]
        matmul.linear(_bf16(30, 64, seed=3), w)
        assert amx._PACKED[id(w)] is packed  # packed once
        assert not amx.supports(_bf16(amx.LINEAR_MAX_ROWS + 1, 64, seed=4), w)
        odd = _bf16(40, 48, seed=5)  # 48 inputs: not a multiple of 32
        assert not amx.supports(_bf16(8, 48, seed=6), odd)
        matmul.linear(_bf16(8, 48, seed=6), odd)
        assert id(odd) not in amx._PACKED
    key = id(w)
    del w, packed
    gc.collect()
    assert key not in amx._PACKED  # the packed copy goes with its weight


def test_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSERVE_AMX", "0")
    w = _bf16(32, 64, seed=7)
    assert not amx.supports(_bf16(8, 64, seed=8), w)
    with torch.inference_mode():
        matmul.linear(_bf16(8, 64, seed=8), w)
        assert native_gemv.supports(_bf16(8, 64, seed=8), w)  # where it went instead
    assert id(w) not in amx._PACKED
