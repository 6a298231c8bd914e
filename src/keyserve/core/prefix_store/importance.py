"""Which tokens of a stored prefix are important, per layer (IMPRESS, docs/algorithms.md §5).

The accumulated attention scores of only the first ``num_heads`` (3) kv-heads of each layer
pick the important tokens: their summed score's top-k. The layer trusts that choice only if
those heads agree: the mean pairwise Jaccard index of the heads' own top-k sets must reach
``t = j^0.6``, where ``j = (k/n) / (2 - k/n)`` is the expected Jaccard index of two random
k-of-n sets. A layer below the threshold is marked "load all".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

ALPHA = 0.6


def random_jaccard(k: int, n: int) -> float:
    """E|A∩B| / E|A∪B| for two independent uniformly random k-subsets of n."""
    if not 0 < k <= n:
        raise ValueError(f"need 0 < k <= n, got k={k}, n={n}")
    f = k / n
    return f / (2.0 - f)


def jaccard_threshold(k: int, n: int, alpha: float = ALPHA) -> float:
    return random_jaccard(k, n) ** alpha


def top_k_mask(
    scores: torch.Tensor,  # [..., n] float
    k: int,
) -> torch.Tensor:  # [..., n] bool: the k highest (ties: the lower index)
    # A stable descending sort breaks ties by position, so the choice is deterministic.
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, True)


def mean_pairwise_jaccard(
    masks: torch.Tensor,  # [num_layers, num_heads, n] bool
) -> torch.Tensor:  # [num_layers] float32 (1.0 with fewer than two heads)
    num_heads = masks.shape[1]
    pairs = list(itertools.combinations(range(num_heads), 2))
    if not pairs:
        return torch.ones(masks.shape[0])
    a = masks[:, [p[0] for p in pairs]]  # [L, P, n]
    b = masks[:, [p[1] for p in pairs]]
    inter = (a & b).sum(-1).float()
    union = (a | b).sum(-1).float().clamp(min=1.0)
    return (inter / union).mean(-1)


@dataclass
class Importance:
    important: torch.Tensor  # [num_layers, n] bool: k per layer
    load_all: torch.Tensor  # [num_layers] bool: heads disagree, load every token
    mean_jaccard: torch.Tensor  # [num_layers] float32
    threshold: float
    k: int

    @property
    def num_fallbacks(self) -> int:
        return int(self.load_all.sum())


def num_important(n: int, fraction: float) -> int:
    return max(1, min(n, int(round(fraction * n))))


def select_important(
    scores: torch.Tensor,  # [num_layers, num_kv_heads, n] accumulated attention per token
    fraction: float,
    num_heads: int = 3,  # heads sampled per layer; 0 = all
    check_agreement: bool = True,
) -> Importance:
    """Top-k (k = round(fraction·n)) by the sampled heads' summed score, per layer, and the
    layers whose sampled heads disagree (load all)."""
    num_layers, total_heads, n = scores.shape
    h = total_heads if num_heads <= 0 else min(num_heads, total_heads)
    k = num_important(n, fraction)
    sampled = scores[:, :h].float()
    important = top_k_mask(sampled.sum(1), k)
    jac = mean_pairwise_jaccard(top_k_mask(sampled, k))
    t = jaccard_threshold(k, n)
    if check_agreement and k < n:
        load_all = jac < t
    else:
        load_all = torch.zeros(num_layers, dtype=torch.bool)
    return Importance(important, load_all, jac, t, k)
