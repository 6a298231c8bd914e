"""The one attention entry point the model calls: write K/V, then paged attention.

CUDA tensors go to the Triton kernels. On the CPU, decode attention runs the native C kernel
(``kernels/native``, built on first use) where a compiler is available, and everything else the
pure-torch reference (which the native kernel is tested against).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from keyserve.kernels import cpu_paths, noise, reference
from keyserve.kernels.metadata import AttentionMetadata, LayerScores
from keyserve.kernels.native import decode as native_decode
from keyserve.kernels.native import write_kv as native_write


_NO_KWARGS: Mapping[str, object] = MappingProxyType({})  # no extra keywords (shared, read-only)


def _use_triton(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    import keyserve.kernels.paged_attention  # noqa: F401  (imports triton lazily)

    return True


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] or [num_tokens, num_kv_heads]
) -> None:
    if _use_triton(key):
        from keyserve.kernels.paged_attention import write_kv as triton_write_kv

        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
    elif native_write.supports(key, k_cache, v_cache):
        native_write.write_kv_native(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.write_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    layer_idx: int,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    first_head: int = 0,  # global index of this rank's query head 0 (tensor parallelism)
) -> tuple[torch.Tensor, LayerScores | None]:  # [num_tokens, num_heads, head_dim], scores
    """Store this step's K/V, then attend decode tokens and prefill chunks to their caches.
    Returns the output and, when ``meta.score_mode`` is set, this layer's attention scores for
    KV budgets (None otherwise). Keyformer's noise is keyed by ``meta.noise_keys``, the layer
    and the global query head (``kernels/noise.py``)."""
    write_kv(key, value, k_cache, v_cache, meta.layer_slot_mapping(layer_idx))
    n_dec = meta.num_decode_seqs
    triton = _use_triton(query)
    if triton:
        from keyserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

        decode_fn, prefill_fn = paged_decode_attention, paged_prefill_attention
    else:
        decode_fn = reference.paged_decode_attention_reference
        if n_dec and native_decode.supports(query, k_cache):
            decode_fn = native_decode.paged_decode_attention_native
        prefill_fn = reference.paged_prefill_attention_reference
        if meta.num_prefill_seqs and meta.score_mode is not None:
            prefill_fn = _prefill_with_fast_scores
    tau = meta.tau
    layer_key = noise.layer_key(layer_idx, first_head)
    dec_lens, pre_lens = meta.layer_context_lens(layer_idx)
    outs = []
    dec_scores = pre_scores = None
    if n_dec:
        dec_args = (query[:n_dec], k_cache, v_cache, meta.decode_block_tables, dec_lens, scale)
        # tree speculation's rows see the prefix, their ancestors and themselves
        tree = _NO_KWARGS if meta.decode_tree_masks is None else {"tree_masks": meta.decode_tree_masks}
        out, dec_scores = _with_scores(
            decode_fn, dec_args, meta, None if tau is None else tau[:n_dec], slice(0, n_dec), layer_key, tree
        )
        outs.append(out)
    if meta.num_prefill_seqs:
        pre_args = (
            query[n_dec:], k_cache, v_cache, meta.prefill_block_tables,
            meta.prefill_query_start_loc, pre_lens, scale,
        )
        out, pre_scores = _with_scores(
            prefill_fn, pre_args, meta, None if tau is None else tau[n_dec:], slice(n_dec, None), layer_key
        )
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out, None if meta.score_mode is None else (dec_scores, pre_scores)


def _with_scores(fn, args: tuple, meta: AttentionMetadata, tau: torch.Tensor | None, rows: slice,
                 layer_key: int, extra: Mapping[str, object] = _NO_KWARGS):
    """Call one attention function (with ``extra`` keywords: decode's tree masks); a batch
    mixing H2O and Keyformer rows runs the score pass twice (rare: it only happens when both
    policies share a step) and picks per row."""
    window = meta.sliding_window
    if meta.score_mode is None or meta.score_mode == "softmax":
        return fn(*args, sliding_window=window, score_mode=meta.score_mode, tau=tau, **extra)
    keys = None if meta.noise_keys is None else meta.noise_keys[rows]
    noisy_kw = dict(sliding_window=window, score_mode="gumbel", tau=tau, noise_keys=keys,
                    noise_layer=layer_key, **extra)
    if meta.score_mode == "gumbel":
        return fn(*args, **noisy_kw)
    out, plain = fn(*args, sliding_window=window, score_mode="softmax", tau=tau, **extra)
    _, noisy = fn(*args, **noisy_kw)
    gumbel = meta.gumbel_rows[rows].to(plain.device)[:, None, None]
    return out, torch.where(gumbel, noisy, plain)


def _prefill_with_fast_scores(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    score_mode: str | None = None,
    tau: torch.Tensor | None = None,  # [num_seqs] float32
    *,
    noise_keys: torch.Tensor | None = None,  # [num_seqs, 2] int64 (gumbel only)
    noise_layer: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CPU prefill with score output: SDPA for the output, chunked matmuls for the scores
    (``cpu_paths.prefill_sdpa_scores``), with the reference's contract."""
    if score_mode is None:
        return reference.paged_prefill_attention_reference(
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window)
    if score_mode == "gumbel" and tau is None:
        raise ValueError("tau: score_mode='gumbel' needs the per-sequence temperature")
    return cpu_paths.prefill_sdpa_scores(
        query, k_cache, v_cache, block_tables, query_start_loc.tolist(), context_lens.tolist(),
        scale, sliding_window, score_mode, tau, noise_keys=noise_keys, noise_layer=noise_layer)
