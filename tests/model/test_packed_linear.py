"""bf16 linear on prepacked oneDNN weights: the same bits as F.linear, packed once per weight."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from keyserve.kernels.native import amx as native_amx
from keyserve.kernels.native import gemv as native_gemv
from keyserve.model import matmul, packed_linear

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch has no oneDNN bf16 packed linear here")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_equals_f_linear_bit_for_bit(rows: int, with_bias: bool) -> None:
    weight, x = _bf16(960, 576, seed=1), _bf16(rows, 576, seed=2)
    bias = _bf16(960, seed=3) if with_bias else None
    with torch.inference_mode():
        got = packed_linear.packed_linear(x, weight, bias)
        want = F.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)


def test_packed_once_then_repacked_after_an_in_place_write() -> None:
    weight, x = _bf16(64, 32, seed=4), _bf16(20, 32, seed=5)
    with torch.inference_mode():
        first = packed_linear.packed_weight(weight)
        assert packed_linear.packed_weight(weight) is first  # the cache answers
    weight.mul_(2)  # outside inference mode: the version counter moves
    with torch.inference_mode():
        assert packed_linear.packed_weight(weight) is not first
        assert torch.equal(packed_linear.packed_linear(x, weight), F.linear(x, weight))


def test_cache_entry_goes_with_its_weight() -> None:
    weight = _bf16(64, 32, seed=6)
    with torch.inference_mode():
        packed_linear.packed_weight(weight)
    key = id(weight)
    assert key in packed_linear._PACKED
    del weight
    gc.collect()
    assert key not in packed_linear._PACKED


@pytest.mark.skipif(not matmul.cpu_has_native_bf16(), reason="the CPU has no bf16 dot product: bf16 goes to float32 GEMM")
def test_engine_linear_packs_beyond_the_native_rows() -> None:
    """``matmul.linear`` sends bf16 products of more rows than the few-row kernels take (the
    vector kernel's 16, or AMX's 48 where the CPU has it) to the packed weights, and leaves the
    few-row ones to them."""
    weight = _bf16(96, 64, seed=7)
    limit = native_amx.LINEAR_MAX_ROWS if native_amx.available() else native_gemv.MAX_ROWS
    few, many = _bf16(limit, 64, seed=8), _bf16(limit + 1, 64, seed=9)
    with torch.inference_mode():
        matmul.linear(few, weight)
        if native_gemv.supports(few, weight) or native_amx.supports(few, weight):
            assert id(weight) not in packed_linear._PACKED
        got = matmul.linear(many, weight)
        assert id(weight) in packed_linear._PACKED
        assert torch.equal(got, F.linear(many, weight))


def test_float32_and_grad_are_not_packed() -> None:
    w32 = torch.randn(8, 8)
    assert not packed_linear.supports(torch.randn(20, 8), w32)
    w = _bf16(8, 8, seed=10).requires_grad_()
    assert not packed_linear.supports(_bf16(20, 8, seed=11), w)
