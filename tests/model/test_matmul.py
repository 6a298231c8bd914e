"""bf16 ``linear``: the float32-widened path equals an exact float32 product rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keyserve.model import matmul


@pytest.mark.parametrize("rows", [1, 3, 4, 37])
def test_bf16_linear_is_float32_product_rounded(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    monkeypatch.setattr(matmul, "cpu_has_native_bf16", lambda: False)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(80, 96, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16()
    out = matmul.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 80)
    exact = F.linear(x.double(), w.double(), b.double())
    # one bf16 rounding of a float32-accumulated sum: within 2 bf16 ulps of the exact value
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-2).all()
    if rows > matmul.NATIVE_MAX_ROWS:
        assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).bfloat16())


def test_float32_is_untouched() -> None:
    x, w = torch.randn(9, 16), torch.randn(8, 16)
    assert torch.equal(matmul.linear(x, w), F.linear(x, w))
