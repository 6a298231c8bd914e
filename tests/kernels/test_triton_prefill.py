"""Triton paged prefill / chunked-prefill attention against the reference and dense."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be run")

from paged_cases import dense_prefill, make_case, tolerance  # noqa: E402

from keyserve.kernels.reference import paged_prefill_attention_reference  # noqa: E402


def _starts(q_lens: list[int]) -> list[int]:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return starts


# (block_size, head_dim, num_kv_heads, group, dtype, context lengths, query lengths, window)
# Each batch mixes a whole prompt (query len == context), a single-token chunk after a prefix,
# a chunk after a partial-block prefix, and (first case) a sequence with no query this step.
CASES = [
    (16, 64, 3, 3, torch.float32, [21, 40, 7, 5], [21, 1, 4, 0], None),
    (8, 128, 2, 4, torch.bfloat16, [9, 30, 1], [9, 13, 1], None),
    (32, 64, 1, 8, torch.float32, [45, 12], [6, 12], 10),
    (16, 8, 4, 2, torch.float32, [17, 33], [17, 5], None),
    (8, 64, 4, 1, torch.bfloat16, [26, 3], [11, 3], 4),
]


@pytest.mark.parametrize("case_args", CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-g{c[3]}-w{c[7]}")
def test_prefill_matches_reference_and_dense(triton_kernels, case_args):
    block_size, head_dim, num_kv_heads, group, dtype, lens, q_lens, window = case_args
    case = make_case(lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(lens))
    starts = _starts(q_lens)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (q, case.k_cache, case.v_cache, case.block_tables,
            torch.tensor(starts, dtype=torch.int32), case.context_lens, scale, window)
    out, scores = triton_kernels.paged_prefill_attention(*args)
    assert scores is None and out.dtype == dtype and out.shape == q.shape
    want, _ = paged_prefill_attention_reference(*args)
    torch.testing.assert_close(out, want, **tolerance(dtype))
    torch.testing.assert_close(out, dense_prefill(case, q, starts, scale, window), **tolerance(dtype))


def test_prefill_int64_metadata_and_strided_query(triton_kernels):
    """int64 tables/lengths and a query that is a view into a fused QKV projection."""
    case = make_case([19, 6], 16, 2, 64, seed=11)
    qkv = torch.randn(10, 6 + 2 + 2, 64)
    q = qkv[:, :6]  # [num_tokens, num_heads, head_dim], row stride 10 * 64
    starts = torch.tensor([0, 4, 10])
    args = (q, case.k_cache, case.v_cache, case.block_tables.long(), starts,
            case.context_lens.long(), 0.125)
    out, _ = triton_kernels.paged_prefill_attention(*args)
    torch.testing.assert_close(out, dense_prefill(case, q, starts.tolist(), 0.125),
                               **tolerance(torch.float32))
