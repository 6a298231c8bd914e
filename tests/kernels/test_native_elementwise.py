"""The fused elementwise kernels (kernels/native/elementwise.c) against the torch ops they
replace on the CPU path: residual add + RMSNorm, SiLU(gate) * up, rotary embedding.

In bfloat16 each kernel rounds where torch rounds; silu_mul and rotary then give torch's bits,
and RMSNorm all but a handful (torch sums the squares in another order: a 1-ulp difference in
the norm flips a bf16 rounding about once in 10^5 elements). Dropping any of the intermediate
roundings (SiLU's result, RoPE's products, the normalised value) changes thousands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keyserve.kernels.native import elementwise as native
from keyserve.kernels.native import library
from keyserve.model.norm import RMSNorm

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: native kernels not built")

DTYPES = [torch.float32, torch.bfloat16]


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # [n, hidden]
    """model/norm.py's torch path, whatever the native library."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, norm.shape, norm.weight, norm.eps)
    return norm.weight * torch.rms_norm(x.float(), norm.shape, None, norm.eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 2000])  # one thread, and the team (>= 65536 elements)
@torch.inference_mode()
def test_add_rms_norm(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden = 576
    h = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    y = torch.randn(rows, hidden, generator=g).to(dtype)
    norm = RMSNorm(hidden, 1e-5, dtype, "cpu")
    norm.weight.copy_(torch.randn(hidden, generator=g))
    h_sum, out = native.add_rms_norm(h, y, norm.weight, 1e-5)
    assert torch.equal(h_sum, h + y)
    want = _torch_norm(norm, h + y)
    _, alone = native.add_rms_norm(h + y, None, norm.weight, 1e-5)
    assert torch.equal(alone, out)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        assert (out != want).sum().item() <= max(2, out.numel() // 20000)
        torch.testing.assert_close(out.float(), want.float(), atol=1.6e-2, rtol=8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_norm_module_takes_the_native_pass_with_leading_dims(dtype: torch.dtype) -> None:
    """RMSNorm on [batch, seq, hidden] (the training model's shape) and its add_forward."""
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(64, 1e-6, dtype, "cpu")
    norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    torch.testing.assert_close(norm(x).float(), _torch_norm(norm, x.reshape(15, 64)).reshape(3, 5, 64).float(),
                               atol=1.6e-2, rtol=8e-3)
    y = torch.randn(3, 5, 64, generator=g).to(dtype)
    h, out = norm.add_forward(x, y)
    assert torch.equal(h, x + y) and torch.equal(out, norm(x + y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, 200])
@torch.inference_mode()
def test_silu_mul(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = native.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 300])
@torch.inference_mode()
def test_rotary_on_a_strided_qkv_view(dtype: torch.dtype, rows: int) -> None:
    """The rows of q and k inside the fused qkv output (row stride > heads * d), as
    model/rope.py's apply_rotary computes them (bit for bit: two products and a sum)."""
    g = torch.Generator().manual_seed(3)
    heads, kv, d = 9, 3, 64
    qkv = torch.randn(rows, heads + 2 * kv, d, generator=g).to(dtype)
    c = torch.randn(rows, d // 2, generator=g)
    s = torch.randn(rows, d // 2, generator=g)
    cos = torch.cat((c, c), -1).unsqueeze(1).to(dtype)
    sin = torch.cat((-s, s), -1).unsqueeze(1).to(dtype)
    x = qkv[:, : heads + kv]
    assert native.rotary_supports(x, cos, sin)
    swapped = x.reshape(rows, heads + kv, 2, d // 2).flip(2).reshape(rows, heads + kv, d)
    want = x * cos + swapped * sin
    got = native.rotary(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, want)


def test_supports_refuses_what_it_cannot_take() -> None:
    x = torch.zeros(4, 8)
    assert native.supports(x) is False or not torch.is_grad_enabled()  # autograd on: torch path
    with torch.inference_mode():
        assert native.supports(x)
        assert not native.supports(x.t())  # not contiguous
        assert not native.supports(x.half())
        assert not native.supports(x, x.bfloat16())  # mixed dtypes
        assert not native.rotary_supports(torch.zeros(2, 3, 8).transpose(0, 1), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8))
