"""Paged attention and KV-write kernels (Triton on CUDA) with pure-torch references (CPU).

The model calls ``keyserve.kernels.attention.paged_attention`` (dispatch: CUDA → Triton, CPU →
reference). ``keyserve.kernels.paged_attention`` is the Triton module itself, so the package
does not re-export a function of that name (importing the submodule would shadow it).
"""

from keyserve.kernels.attention import write_kv
from keyserve.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "write_kv"]
