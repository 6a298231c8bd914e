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


def test_cpu_gemv_layout_keeps_values_and_shapes_and_is_idempotent() -> None:
    from torch import nn

    from keyserve.model.matmul import use_cpu_gemv_layout

    net = nn.Sequential(nn.Linear(8, 5), nn.Embedding(7, 8))
    net[0].to(torch.bfloat16)  # bf16 stays row-major: its GEMV wants [out, in]
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    use_cpu_gemv_layout(net)
    use_cpu_gemv_layout(net)
    emb = net[1].weight
    assert emb.shape == (7, 8) and emb.stride() == (1, 7)  # column-major float32
    assert net[0].weight.stride() == (8, 1)
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n]), n
    x = torch.randn(3, 8)
    torch.testing.assert_close(torch.nn.functional.linear(x, emb.t().t()), x @ before["1.weight"].t())
