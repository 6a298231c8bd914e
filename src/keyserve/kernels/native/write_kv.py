"""torch-facing wrapper of the native KV write (``keyserve_write_kv`` in ``paged_decode.c``)."""

from __future__ import annotations

import torch

from keyserve.kernels.native import library, require_library


def supports(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
) -> bool:
    return (
        key.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.dtype == k_cache.dtype
        and library() is not None
    )


def write_kv_native(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] or [num_tokens, num_kv_heads] int; < 0 = skip
) -> None:
    """Same contract as ``reference.write_kv_reference``; slots must be < the cache's slots."""
    lib = require_library()
    num_tokens, num_kv_heads, head_dim = key.shape
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k = key.to(k_cache.dtype).contiguous()
    v = value.to(v_cache.dtype).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    per_head = slots.dim() == 2
    if num_tokens:
        bad = lib.keyserve_write_kv(
            k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            num_tokens, num_kv_heads, head_dim, k_cache.element_size(),
            num_kv_heads if per_head else 1, 1 if per_head else 0, num_slots,
        )
        if bad >= 0:
            raise IndexError(f"slot_mapping: slot {bad} out of range for {num_slots} slots")
