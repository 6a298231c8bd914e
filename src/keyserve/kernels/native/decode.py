"""torch-facing wrapper of the native paged decode kernel (``paged_decode.c``)."""

from __future__ import annotations

import torch

from keyserve.kernels import checks, noise
from keyserve.kernels.native import library, require_library

_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many (sequence, kv-head, slot) rows one thread is faster: waking the OpenMP team
# costs more than it saves (batch-1 decode of a short chat: ~170 vs ~70 µs per layer here).
PARALLEL_MIN_ROWS = 8192


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype``, without a copy when it already is one."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def supports(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
) -> bool:
    """True where the native kernel can take this call (CPU, float32/bf16 cache, contiguous)."""
    return (
        query.device.type == "cpu"
        and k_cache.dtype in _CACHE_DTYPES
        and k_cache.is_contiguous()
        and library() is not None
    )


def paged_decode_attention_native(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    context_lens: torch.Tensor,  # [num_seqs] int: filled slots per sequence
    scale: float,
    sliding_window: int | None = None,
    score_mode: str | None = None,
    tau: torch.Tensor | None = None,  # [num_seqs] float (gumbel only)
    uniforms: torch.Tensor | None = None,  # [num_seqs, num_heads, max_context] (tests)
    max_context: int | None = None,  # max(context_lens) when the caller knows it already
    *,
    noise_keys: torch.Tensor | None = None,  # [num_seqs, 2] int64: (noise seed, query position)
    noise_layer: int = 0,  # noise.layer_key(layer, first query head)
    tree_masks: torch.Tensor | None = None,  # [num_seqs] int64 (AttentionMetadata.decode_tree_masks)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``reference.paged_decode_attention_reference``: ``(out [num_seqs,
    num_heads, head_dim] in query's dtype, scores [num_seqs, num_kv_heads, max_context] float32
    or None)``. Gumbel noise is ``kernels/noise.py``'s hash of each row's ``noise_keys``, the
    layer and head (``noise_layer``) and the slot; without keys every row gets a seed drawn
    from torch's generator. ``tree_masks`` go to the kernel as a pointer (NULL when None),
    checked first: it reads one int64 per row."""
    lib = require_library()
    if score_mode not in (None, "softmax", "gumbel"):
        raise ValueError(f"score_mode: expected None, 'softmax' or 'gumbel', got {score_mode!r}")
    if score_mode == "gumbel" and tau is None:
        raise ValueError("tau: score_mode='gumbel' needs the per-sequence temperature")
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if v_cache.dtype != k_cache.dtype or not v_cache.is_contiguous():
        raise ValueError("v_cache must be contiguous with k_cache's dtype")
    # float32 and bf16 queries go in as they are (the kernel widens bf16 and rounds its output
    # back); anything else is computed in float32
    io_dtype = query.dtype if query.dtype in _CACHE_DTYPES else torch.float32
    q = _as(query, io_dtype)
    tables = _as(block_tables, torch.int32)
    lens = _as(context_lens, torch.int32)
    masks = checks.check_tree_masks(tree_masks, num_seqs, query.device)
    mode = {None: 0, "softmax": 1, "gumbel": 2}[score_mode]
    if mode and max_context is None:
        max_context = int(lens.max()) if num_seqs else 0
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=io_dtype)
    scores = None
    if mode:
        scores = torch.empty(num_seqs, num_kv_heads, max_context, dtype=torch.float32)
    tau_f = None if tau is None else _as(tau, torch.float32)
    u = None
    if uniforms is not None and mode == 2:  # only Gumbel scores draw noise
        u = _as(uniforms, torch.float32)
        if tuple(u.shape) != (num_seqs, num_heads, max_context):
            raise ValueError(f"uniforms: expected {(num_seqs, num_heads, max_context)}, got {tuple(u.shape)}")
    keys = None
    if mode == 2 and u is None:
        keys = _as(noise_keys if noise_keys is not None else noise.random_keys(num_seqs), torch.int64)
        if tuple(keys.shape) != (num_seqs, 2):
            raise ValueError(f"noise_keys: expected {(num_seqs, 2)}, got {tuple(keys.shape)}")
    if num_seqs:
        lib.keyserve_paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _CACHE_DTYPES[k_cache.dtype],
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), num_seqs, num_heads,
            num_kv_heads, head_dim, block_size, float(scale),
            sliding_window if sliding_window is not None else 0, out.data_ptr(), mode,
            None if tau_f is None else tau_f.data_ptr(), None if u is None else u.data_ptr(),
            None if keys is None else keys.data_ptr(), noise_layer & 0xFFFFFFFF,
            None if scores is None else scores.data_ptr(),
            -1 if max_context is None else max_context, torch.get_num_threads(), PARALLEL_MIN_ROWS,
            _CACHE_DTYPES[io_dtype], None if masks is None else masks.data_ptr(),
        )
    return out.to(query.dtype), scores


def gumbel_noise_native(
    seed: int,  # the row's 32-bit noise seed
    first_position: int,  # position of the chunk's first query
    head_key0: int,  # noise.layer_key(layer, first query head)
    num_heads: int,
    queries: range,  # query rows of the chunk (0 = its first query)
    slots: range,  # logical slots
) -> torch.Tensor:  # [num_heads, len(queries), len(slots)] float32
    """Keyformer's Gumbel noise ``-log(-log U)`` for a chunk, ``U`` being
    ``noise.chunk_uniforms`` of the same arguments (the same bits), in one native pass: the
    torch version takes some twenty int64 passes per element."""
    lib = require_library()
    out = torch.empty(num_heads, len(queries), len(slots), dtype=torch.float32)
    if out.numel():
        lib.keyserve_gumbel_noise(
            out.data_ptr(), int(seed) & 0xFFFFFFFF, int(head_key0) & 0xFFFFFFFF, num_heads,
            int(first_position) + queries.start, len(queries), slots.start, len(slots),
            torch.get_num_threads(),
        )
    return out
