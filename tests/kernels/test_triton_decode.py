"""Triton paged decode attention (under TRITON_INTERPRET=1) against the reference and dense."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be run")

from paged_cases import dense_decode, make_case, tolerance  # noqa: E402

from keyserve.kernels.reference import paged_decode_attention_reference  # noqa: E402

# (block_size, head_dim, num_kv_heads, group, dtype, context lengths). Lengths mix empty,
# single-token, partial-block and multi-tile sequences in one batch.
CASES = [
    (16, 64, 3, 3, torch.float32, [0, 1, 37, 100]),  # SmolLM2-135M: 9 q heads, 3 kv heads
    (8, 128, 2, 4, torch.bfloat16, [5, 17, 64]),
    (32, 64, 1, 8, torch.float32, [33, 1, 70]),
    (16, 8, 4, 2, torch.float32, [1, 29, 48]),  # stories260K: head_dim 8, 8 q / 4 kv heads
    (8, 64, 4, 1, torch.bfloat16, [0, 9, 40]),  # plain multi-head attention
]


@pytest.mark.parametrize("split_k", [False, True], ids=["single", "splitk"])
@pytest.mark.parametrize("case_args", CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-g{c[3]}-{str(c[4])[6:]}")
def test_decode_matches_reference_and_dense(triton_kernels, case_args, split_k):
    block_size, head_dim, num_kv_heads, group, dtype, lens = case_args
    case = make_case(lens, block_size, num_kv_heads, head_dim, dtype, seed=len(lens) + head_dim)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale)
    out, scores = triton_kernels.paged_decode_attention(*args, split_k=split_k, partition_size=32)
    assert scores is None and out.dtype == dtype and out.shape == q.shape
    want, _ = paged_decode_attention_reference(*args)
    torch.testing.assert_close(out, want, **tolerance(dtype))
    torch.testing.assert_close(out, dense_decode(case, q, scale), **tolerance(dtype))


@pytest.mark.parametrize("split_k", [False, True], ids=["single", "splitk"])
def test_decode_sliding_window(triton_kernels, split_k):
    case = make_case([0, 1, 37, 90], 16, 2, 64, seed=7)
    q = torch.randn(4, 6, 64)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    out, _ = triton_kernels.paged_decode_attention(*args, sliding_window=20, split_k=split_k,
                                                   partition_size=16)
    torch.testing.assert_close(out, dense_decode(case, q, 0.125, 20), **tolerance(torch.float32))
    want, _ = paged_decode_attention_reference(*args, sliding_window=20)
    torch.testing.assert_close(out, want, **tolerance(torch.float32))


def test_split_k_heuristic_and_empty_batch(triton_kernels):
    """Flash-decoding is chosen for few long sequences and not for short contexts."""
    cpu = torch.device("cpu")
    assert triton_kernels._want_split_k(1, 3, 8192, 512, cpu)
    assert not triton_kernels._want_split_k(1, 3, 512, 512, cpu)
    assert not triton_kernels._want_split_k(512, 8, 8192, 512, cpu)
    case = make_case([], 16, 1, 64)
    q = torch.zeros(0, 2, 64)
    out, scores = triton_kernels.paged_decode_attention(
        q, case.k_cache, case.v_cache, case.block_tables[:0], case.context_lens, 0.1,
        score_mode="softmax")
    assert out.shape == (0, 2, 64) and scores.shape == (0, 1, 0)
