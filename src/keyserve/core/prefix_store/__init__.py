"""IMPRESS: an importance-aware multi-tier prefix KV store (docs/algorithms.md §5). Pure logic
plus torch tensors and files: no ray, no triton. The engine wires it in
``keyserve.engine.prefix_store``."""

from keyserve.core.prefix_store.disk import CorruptChunk, DiskTier
from keyserve.core.prefix_store.heap import IndexedMinHeap
from keyserve.core.prefix_store.importance import (
    Importance,
    jaccard_threshold,
    mean_pairwise_jaccard,
    random_jaccard,
    select_important,
    top_k_mask,
)
from keyserve.core.prefix_store.memory import BlockPoolChunks, HostChunks
from keyserve.core.prefix_store.radix import MatchStep, RadixNode, RadixTree
from keyserve.core.prefix_store.repack import inverse_order, select_rows, storage_order, to_logical, to_storage
from keyserve.core.prefix_store.store import (
    KVLayout,
    LoadedPrefix,
    PrefixStore,
    PrefixStoreStats,
    StoreSettings,
)
from keyserve.core.prefix_store.tiers import TierIndex

__all__ = [
    "BlockPoolChunks", "CorruptChunk", "DiskTier", "HostChunks", "Importance", "IndexedMinHeap",
    "KVLayout", "LoadedPrefix", "MatchStep", "PrefixStore", "PrefixStoreStats", "RadixNode",
    "RadixTree", "StoreSettings", "TierIndex", "inverse_order", "jaccard_threshold",
    "mean_pairwise_jaccard", "random_jaccard", "select_important", "select_rows",
    "storage_order", "to_logical", "to_storage", "top_k_mask",
]
