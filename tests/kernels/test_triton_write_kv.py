"""Triton KV write against the reference: per-token and per-(token, kv-head) slots."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be run")

from keyserve.kernels.reference import write_kv_reference  # noqa: E402


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(6, 8, 3, 16).to(dtype)  # [num_blocks, block_size, num_kv_heads, head_dim]
    return k, torch.randn_like(k)


@pytest.mark.parametrize("per_head", [False, True], ids=["per-token", "per-head"])
@pytest.mark.parametrize(
    "src,dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
    ids=["f32", "bf16", "f32-to-bf16"],
)
def test_write_kv_matches_reference(triton_kernels, per_head, src, dtype):
    num_tokens = 7
    qkv = torch.randn(num_tokens, 9, 16).to(src)  # keys / values as views into a fused projection
    key, value = qkv[:, 3:6], qkv[:, 6:9]
    if per_head:  # each kv-head writes into its own (evicted) slot; -1 = this head skips
        slots = torch.randperm(48)[: num_tokens * 3].view(num_tokens, 3)
        slots[2, 1] = -1
        slots[5] = -1
    else:
        slots = torch.randperm(48)[:num_tokens]
        slots[3] = -1
    k1, v1 = _caches(dtype)
    k2, v2 = k1.clone(), v1.clone()
    triton_kernels.write_kv(key, value, k1, v1, slots.int())
    write_kv_reference(key, value, k2, v2, slots)
    if src == dtype:
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    else:  # Triton's interpreter truncates float32 -> bfloat16 where GPUs (and torch) round to
        # nearest even: allow one bf16 ulp.
        torch.testing.assert_close(k1, k2, atol=0, rtol=2**-7)
        torch.testing.assert_close(v1, v2, atol=0, rtol=2**-7)


def test_write_kv_no_tokens(triton_kernels):
    k, v = _caches(torch.float32)
    before = k.clone()
    empty = torch.zeros(0, 3, 16)
    triton_kernels.write_kv(empty, empty, k, v, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(k, before)
