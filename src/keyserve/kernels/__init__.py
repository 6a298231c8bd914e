"""Paged attention and KV-write kernels (Triton on CUDA) with pure-torch references (CPU)."""

from keyserve.kernels.attention import paged_attention, write_kv
from keyserve.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]
