"""Keyformer's Gumbel noise as a pure function of who draws it (pure torch; the Triton kernels
and ``native/paged_decode.c`` implement the same function).

The uniform behind the noise of one logit is a counter-based hash of

- the attention row's 32-bit noise seed (per sequence: from the request's seed and sample index
  when it has one, else drawn by the engine each step),
- the layer and the global query head (``head_key = layer_key(layer, first_head) + local head``,
  so tensor-parallel ranks holding different heads draw what one rank would),
- the query token's position in its sequence (decode: the new token's; a prompt chunk or a
  verification: the first query's position + its row),
- the key's logical slot,

so a row's noise does not depend on which other sequences share the batch, on the kernel's
tiling or on the order programs run in. In uint32 arithmetic, with
``mix(x) = x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16``
(Wellons' "lowbias32"):

    row  = mix(mix(seed ^ mix(head_key)) ^ position)
    bits = mix(row + slot * 0x9E3779B9)
    U    = ((bits >> 9) + 0.5) / 2**23            (exact in float32: all three agree bit for bit)
    ζ    = -log(-log(clamp(U)))                    (``reference.gumbel_from_uniform``)

torch has no unsigned 32-bit multiply, so here the values live in int64 and every product is
split in 16-bit halves (no intermediate reaches 2**63).
"""

from __future__ import annotations

import torch

M1 = 0x7FEB352D
M2 = 0x846CA68B
WEYL = 0x9E3779B9
_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_HEAD_BITS = 16  # head_key = (layer << 16) + global query head


def layer_key(layer: int, first_head: int = 0) -> int:
    """The ``head_key`` of this rank's head 0 in ``layer`` (add the local head index)."""
    return ((int(layer) << _HEAD_BITS) + int(first_head)) & _MASK32


def request_seed(seed: int, sample_index: int = 0) -> int:
    """A request's 32-bit noise seed from its sampling seed and sample index (splitmix64's
    finaliser over the pair; Python ints, so exact)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + (int(sample_index) + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


def random_keys(num_rows: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[num_rows, 2]`` int64 noise keys (random seed, position 0): fresh noise for callers
    that name no keys (kernel tests, direct kernel calls)."""
    keys = torch.zeros(num_rows, 2, dtype=torch.int64)
    keys[:, 0] = torch.randint(0, 1 << 32, (num_rows,), dtype=torch.int64, generator=generator)
    return keys


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15)
    x = _mul32(x, M2)
    return x ^ (x >> 16)


def row_keys(
    seed: torch.Tensor,  # int64, any shape broadcastable with the others: the row's noise seed
    head_key: torch.Tensor | int,  # int64: layer_key(...) + local head
    position: torch.Tensor | int,  # int64: the query token's position
) -> torch.Tensor:
    """The per-(row, head) key ``mix(mix(seed ^ mix(head_key)) ^ position)``."""
    head = torch.as_tensor(head_key, dtype=torch.int64) & _MASK32
    pos = torch.as_tensor(position, dtype=torch.int64) & _MASK32
    return mix32(mix32((seed & _MASK32) ^ mix32(head)) ^ pos)


def uniforms(
    row_key: torch.Tensor,  # int64 [..., 1] from ``row_keys``
    slots: torch.Tensor,  # int64 [..., num_slots] logical slots (broadcast against row_key)
) -> torch.Tensor:  # float32 in (0, 1), the broadcast shape
    """The uniforms of the slots of rows with keys ``row_key``."""
    bits = mix32((row_key + _mul32(slots & _MASK32, WEYL)) & _MASK32)
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def decode_uniforms(
    keys: torch.Tensor,  # [num_seqs, 2] int64: (noise seed, query position)
    head_key0: int,  # layer_key(layer, first_head)
    num_heads: int,
    num_slots: int,
) -> torch.Tensor:  # [num_seqs, num_heads, num_slots] float32
    """Uniforms of one decode query per sequence, every head and slot ``0 .. num_slots - 1``."""
    keys = keys.to(torch.int64).cpu()
    heads = torch.arange(num_heads, dtype=torch.int64)[None, :, None] + head_key0
    rows = row_keys(keys[:, 0, None, None], heads, keys[:, 1, None, None])  # [S, H, 1]
    return uniforms(rows, torch.arange(num_slots, dtype=torch.int64)[None, None, :])


def chunk_uniforms(
    seed: int,
    first_position: int,  # position of the chunk's first query
    head_key0: int,
    num_heads: int,
    queries: range,  # query rows of the chunk (0 = its first query)
    slots: range,  # logical slots
) -> torch.Tensor:  # [num_heads, len(queries), len(slots)] float32
    """Uniforms of a chunk's queries (a prompt chunk, a verification) for one sequence."""
    heads = torch.arange(num_heads, dtype=torch.int64)[:, None, None] + head_key0
    pos = torch.arange(queries.start, queries.stop, dtype=torch.int64)[None, :, None] + first_position
    rows = row_keys(torch.tensor(seed, dtype=torch.int64), heads, pos)  # [H, Q, 1]
    return uniforms(rows, torch.arange(slots.start, slots.stop, dtype=torch.int64)[None, None, :])
