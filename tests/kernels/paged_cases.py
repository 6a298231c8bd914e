"""Random paged KV caches with the true per-sequence tokens kept beside them (test helper).

The cache is filled by plain Python loops over blocks, independently of the code under test,
and unused slots hold large garbage so that reading past a context shows up in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keyserve.kernels.reference import dense_causal_attention


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]


def make_case(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)  # garbage outside contexts
    v_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need + [1]) + 1  # one extra padded column, as the engine's tables have
    tables = torch.full((len(lens), max_blocks), perm[-1], dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for j in range(need[i]):
            block = perm.pop(0)
            tables[i, j] = block
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            k_cache[block, : rows.stop - rows.start] = k[rows]
            v_cache[block, : rows.stop - rows.start] = v[rows]
        keys.append(k)
        values.append(v)
    return PagedCase(k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), keys, values)


def dense_decode(
    case: PagedCase,
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Dense attention of each sequence's one query over its true tokens."""
    rows = [
        dense_causal_attention(query[i : i + 1], case.keys[i], case.values[i], scale, sliding_window)
        for i in range(query.shape[0])
    ]
    return torch.cat(rows) if rows else torch.zeros_like(query)


def dense_prefill(
    case: PagedCase,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    query_start_loc: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Dense causal attention of each chunk over its sequence's true tokens."""
    out = torch.zeros_like(query)
    for i in range(len(query_start_loc) - 1):
        a, b = query_start_loc[i], query_start_loc[i + 1]
        if b > a:
            out[a:b] = dense_causal_attention(
                query[a:b], case.keys[i], case.values[i], scale, sliding_window
            )
    return out


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Output tolerances: float32 is exact up to summation order; bfloat16 has 8 mantissa
    bits, and the tensor-core path rounds the probabilities to bf16 before P @ V."""
    if dtype == torch.float32:
        return {"atol": 3e-5, "rtol": 1e-4}
    return {"atol": 3e-2, "rtol": 3e-2}
