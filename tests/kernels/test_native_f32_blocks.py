"""float32 register-tile products (kernels/native/f32_blocks.py) against F.linear, and the LM
head of a float32 model taking them for 3-64 rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keyserve.kernels.native import f32_blocks

pytestmark = pytest.mark.skipif(not f32_blocks.available(), reason="no float32 register tiles in this build")


@pytest.mark.parametrize("rows", [*range(1, 14), 16, 25, 40, 64])  # every tile height, then balanced splits
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_f_linear(rows: int, threads: int) -> None:
    torch.manual_seed(rows)
    # 7 blocks of 32 outputs: split unevenly over the threads, several next-block prefetches
    w = torch.randn(224, 160)
    x = torch.randn(rows, 160)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = f32_blocks.f32_block_linear(x, w)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_strided_rows_and_weight_written_in_place() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 96)
    x = torch.randn(10, 200)[:, 7:103]  # rows 200 apart
    torch.testing.assert_close(f32_blocks.f32_block_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    w.mul_(2)  # the packed copy is made again
    torch.testing.assert_close(f32_blocks.f32_block_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@torch.no_grad()
def test_supports() -> None:
    w = torch.randn(64, 16)
    least = f32_blocks.min_rows()  # 3 on AVX-512 tiles, 4 on AVX2 ones
    assert least == {1: 3, 2: 4}[f32_blocks.kind()]
    assert f32_blocks.supports(torch.randn(least, 16), w)
    assert f32_blocks.supports(torch.randn(64, 16), w)
    assert not f32_blocks.supports(torch.randn(least - 1, 16), w)  # the row kernel's
    assert not f32_blocks.supports(torch.randn(65, 16), w)  # MKL's GEMM
    assert not f32_blocks.supports(torch.randn(8, 16), torch.randn(48, 16))  # not whole blocks
    assert not f32_blocks.supports(torch.randn(8, 16, dtype=torch.bfloat16), w.bfloat16())
    assert not f32_blocks.supports(torch.randn(8, 16), w.t().contiguous().t())  # column-major
    with torch.enable_grad():
        assert not f32_blocks.supports(torch.randn(8, 16), w)


def test_lm_head_of_a_float32_model(stories_path: str) -> None:
    """The model's logits for 3-64 rows come from the tiles and equal the dense product."""
    from keyserve.model.loader import load_model

    model = load_model(stories_path, progress=False).model
    w = model.lm_head_weight
    hidden = torch.randn(20, w.shape[1])
    with torch.no_grad():
        assert f32_blocks.supports(hidden, w), "stories260K's vocabulary should be whole blocks of 32"
        logits = model.compute_logits(hidden)
    assert id(w) in f32_blocks.packed_weight  # the tiles ran
    torch.testing.assert_close(logits, F.linear(hidden, w), rtol=1e-5, atol=1e-4)
