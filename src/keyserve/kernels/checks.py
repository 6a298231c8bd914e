"""Argument checks for the Triton launchers: shapes, dtypes, devices and strides.

A kernel given a wrong layout silently reads the wrong memory, so every launcher validates
first and raises ``ValueError`` naming the argument and what is wrong. Pure torch (no triton).
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
SCORE_MODES = (None, "softmax", "gumbel")


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels then run (slowly) on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require(cond: bool, name: str, problem: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {problem}")


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    last_contiguous: bool = True,
) -> torch.Tensor:
    """Type, rank, dtype, device and unit stride of the last dim."""
    require(isinstance(t, torch.Tensor), name, f"expected a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    require(t.dim() == ndim, name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, name, f"dtype {t.dtype} not in {[str(d) for d in dtypes]}")
    require(t.device == device, name, f"is on {t.device}, expected {device} like the query/key")
    if last_contiguous and t.numel() > 0 and t.shape[-1] > 1:
        require(t.stride(-1) == 1, name, f"last dim must be contiguous (stride 1), strides {t.stride()}")
    return t


def check_device(name: str, t: torch.Tensor) -> None:
    """Triton needs CUDA tensors, except under the interpreter (CPU)."""
    if interpreting():
        return
    require(t.is_cuda, name, f"is on {t.device}; the Triton kernels need CUDA tensors "
            "(CPU tensors go to keyserve.kernels.reference, or set TRITON_INTERPRET=1 to test)")


def check_cache_pair(
    k_cache: object, v_cache: object, device: torch.device, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, block_size, num_kv_heads, head_dim] twins; same dtype as the query if given."""
    dtypes = FLOAT_DTYPES if dtype is None else (dtype,)
    k = check_tensor("k_cache", k_cache, 4, dtypes, device)
    v = check_tensor("v_cache", v_cache, 4, dtypes, device)
    require(tuple(v.shape) == tuple(k.shape), "v_cache",
            f"shape {tuple(v.shape)} differs from k_cache {tuple(k.shape)}")
    return k, v


def check_write_kv(
    key: object,  # [num_tokens, num_kv_heads, head_dim]
    value: object,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: object,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: object,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: object,  # [num_tokens] or [num_tokens, num_kv_heads]
) -> None:
    require(isinstance(key, torch.Tensor), "key", "expected a torch.Tensor")
    assert isinstance(key, torch.Tensor)
    dev = key.device
    check_device("key", key)
    check_tensor("key", key, 3, FLOAT_DTYPES, dev)
    check_tensor("value", value, 3, FLOAT_DTYPES, dev)
    k_cache, v_cache = check_cache_pair(k_cache, v_cache, dev, None)
    assert isinstance(value, torch.Tensor)
    require(tuple(value.shape) == tuple(key.shape), "value",
            f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    require(key.shape[1:] == k_cache.shape[2:], "key",
            f"[num_tokens, num_kv_heads, head_dim] = {tuple(key.shape)} does not match "
            f"k_cache heads/dim {tuple(k_cache.shape[2:])}")
    require(isinstance(slot_mapping, torch.Tensor), "slot_mapping", "expected a torch.Tensor")
    assert isinstance(slot_mapping, torch.Tensor)
    require(slot_mapping.dim() in (1, 2), "slot_mapping",
            f"expected [num_tokens] or [num_tokens, num_kv_heads], got {tuple(slot_mapping.shape)}")
    check_tensor("slot_mapping", slot_mapping, slot_mapping.dim(), INDEX_DTYPES, dev, False)
    want = (key.shape[0],) if slot_mapping.dim() == 1 else tuple(key.shape[:2])
    require(tuple(slot_mapping.shape) == want, "slot_mapping",
            f"shape {tuple(slot_mapping.shape)}, expected {want}")


def check_attention(
    query: object,  # [num_tokens, num_heads, head_dim]
    k_cache: object,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: object,
    block_tables: object,  # [num_seqs, max_blocks] int32/int64
    context_lens: object,  # [num_seqs] int32/int64
    scale: object,
    sliding_window: object,
    score_mode: object,
    tau: object,  # [num_seqs] float (gumbel only)
) -> None:
    """Checks shared by decode and prefill (everything that needs no host sync)."""
    require(isinstance(query, torch.Tensor), "query", "expected a torch.Tensor")
    assert isinstance(query, torch.Tensor)
    dev = query.device
    check_device("query", query)
    check_tensor("query", query, 3, FLOAT_DTYPES, dev)
    k_cache, _ = check_cache_pair(k_cache, v_cache, dev, query.dtype)
    num_heads, head_dim = query.shape[1], query.shape[2]
    require(k_cache.shape[3] == head_dim, "k_cache",
            f"head_dim {k_cache.shape[3]} differs from the query's {head_dim}")
    num_kv_heads = k_cache.shape[2]
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0, "query",
            f"num_heads {num_heads} is not a multiple of the cache's num_kv_heads {num_kv_heads}")
    tables = check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, dev)
    lens = check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, dev)
    require(lens.shape[0] == tables.shape[0], "context_lens",
            f"has {lens.shape[0]} entries but block_tables has {tables.shape[0]} rows")
    require(isinstance(scale, (int, float)) and float(scale) > 0, "scale",
            f"expected a positive float, got {scale!r}")
    require(sliding_window is None or (isinstance(sliding_window, int) and sliding_window > 0),
            "sliding_window", f"expected None or a positive int, got {sliding_window!r}")
    require(score_mode in SCORE_MODES, "score_mode",
            f"expected one of {SCORE_MODES}, got {score_mode!r}")
    if score_mode == "gumbel":
        require(tau is not None, "tau", "score_mode='gumbel' needs the per-sequence temperature")
        t = check_tensor("tau", tau, 1, FLOAT_DTYPES, dev)
        require(t.shape[0] == tables.shape[0], "tau",
                f"has {t.shape[0]} entries, expected num_seqs = {tables.shape[0]}")


def check_tree_masks(tree_masks: object, num_seqs: int, device: torch.device) -> torch.Tensor | None:
    """Decode rows' tree masks (``AttentionMetadata.decode_tree_masks``): None, or a contiguous
    [num_seqs] int64 tensor beside the query (kernels read it by raw row index)."""
    if tree_masks is None:
        return None
    t = check_tensor("tree_masks", tree_masks, 1, (torch.int64,), device)
    require(t.shape[0] == num_seqs, "tree_masks", f"has {t.shape[0]} entries, expected num_seqs = {num_seqs}")
    return t


def check_table_covers(block_tables: torch.Tensor, block_size: int, max_ctx: int) -> None:
    covered = block_tables.shape[1] * block_size
    require(covered >= max_ctx, "block_tables",
            f"{block_tables.shape[1]} blocks of {block_size} slots cover {covered} slots, "
            f"but the longest context is {max_ctx}")


def check_uniforms(uniforms: object, rows: int, num_heads: int, max_ctx: int,
                   device: torch.device, rows_name: str) -> torch.Tensor:
    """Test-only Gumbel draws: [rows, num_heads, max_context] floats in [0, 1)."""
    u = check_tensor("uniforms", uniforms, 3, FLOAT_DTYPES, device)
    want = (rows, num_heads, max_ctx)
    require(tuple(u.shape) == want, "uniforms",
            f"shape {tuple(u.shape)}, expected [{rows_name}, num_heads, max_context] = {want}")
    return u
