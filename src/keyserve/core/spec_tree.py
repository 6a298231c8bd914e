"""Tree speculative decoding: the tree's layout, its attention masks, the batched walk that
verifies it, and the KV moves that keep the accepted path. Pure torch, no engine imports.

**The tree.** After a sequence's last real token (the *root*, offset 0) the draft proposes its
w1 likeliest tokens as depth-1 nodes, under each of them its w2 likeliest next tokens, and so on:
a *shape* (w1, w2, ...). Nodes are numbered 1..N in preorder, children in the draft's rank order
(top-1 first), so the draft's top-1 chain sits at offsets 1..depth, exactly where a chain's
drafts would be. Node j's KV is written at slot ``root_slot + j`` and its RoPE position is
``root_position + depth(j)``; one target forward scores the root and every node, each node
attending to the prefix, its ancestors and itself (``tree_masks``). A tree is described by its
``parents`` (parents[0] = -1 for the root; parents[j] < j the parent's offset): the regular
kind comes from ``TreeShape``, but the engine may trim a tree for a sequence with less room,
so everything below takes an arbitrary preorder parents list.

**The walk** (``verify_tree``). Start at the root. At the current node emit one token x from
the target's row there: its argmax for a greedy row, else a draw from q, the target's processed
distribution at that row (temperature, top-k, top-p, min-p, as the sampler applies them). If a
child of the current node carries x, descend to it and repeat (that child's row is the target
conditioned on exactly the tokens emitted so far); otherwise stop. A node without children
emits its bonus token and the walk stops.

**Why it is lossless.** Every emitted token is drawn from the target's processed distribution
given all the tokens emitted before it (the row it comes from is the node whose path is exactly
those tokens), and whether the walk goes on depends only on tokens already emitted: the output
is a prefix of an ordinary autoregressive sample, and the next step continues it. Greedy rows
emit exactly what greedy decoding of the target would. Because the candidates are the draft's
top-w (deterministic given the prefix), a node is accepted exactly when the target's draw lands
on one of the children: probability q(children), and no exact method can accept more often,
since whatever it emits must be distributed as q. The draft's probabilities are never read.

Draws are by inverse CDF, one uniform per visited level, from ``sampler.uniforms`` (a
seeded sequence draws from its own generator, exactly its tree's depth + 1 values, so it emits
the same whatever shares its batch). A token of zero probability is never drawn
(``inverse_cdf``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from keyserve.core.sampler import GREEDY_BELOW, SamplingTensors, inverse_cdf, processed_probs, row_argmax, uniforms
from keyserve.core.spec_decode import PAD_TOKEN_ID

# The kernels' masks see 63 slots (bits 0..62 of an int64: the row's own slot and the 62
# before it); the root is one of them, so a tree has at most 62 nodes.
MAX_NODES = 62


# ---------------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------------


def full_parents(parents: Sequence[int]) -> list[int]:
    """``parents`` with the root's -1 in front: every function here takes either the full list
    (parents[0] = -1) or the nodes' alone (``StepItem.draft_parents``, parents[1:]); the two are
    told apart because a node's parent is never negative. Raises ValueError if it is not a
    preorder tree of at most ``MAX_NODES`` nodes."""
    full = [int(p) for p in parents]
    if not full or full[0] != -1:
        full = [-1] + full
    n = len(full) - 1
    if n > MAX_NODES:
        raise ValueError(f"a tree has at most {MAX_NODES} nodes (the kernels' masks see 63 slots), got {n}")
    path = [0]  # ancestors-or-self of node j - 1, root first
    for j in range(1, n + 1):
        p = full[j]
        if p not in path:  # preorder: a node's parent is node j - 1 or one of its ancestors
            raise ValueError(f"parents {full} are not a preorder tree: node {j}'s parent {p} is not "
                             f"node {j - 1} or one of its ancestors {path[:-1]}")
        del path[path.index(p) + 1 :]
        path.append(j)
    return full


def node_depths(parents: Sequence[int]) -> list[int]:
    """The depth of each entry of ``parents`` (one per entry given: with the full list,
    depths[0] = 0 is the root's; with the nodes' alone, depths[0] is node 1's)."""
    full = full_parents(parents)
    depths = [0] * len(full)
    for j in range(1, len(full)):
        depths[j] = depths[full[j]] + 1
    return depths if len(full) == len(parents) else depths[1:]


def trim(parents: Sequence[int], max_depth: int) -> list[int]:
    """The subtree of the nodes at depth <= ``max_depth``, renumbered (still preorder): for a
    sequence that may emit at most ``max_depth + 1`` tokens this step. Same convention as given
    (full list or nodes alone)."""
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    full = full_parents(parents)
    depths = node_depths(full)
    new_index: dict[int, int] = {}
    out: list[int] = []
    for j, p in enumerate(full):
        if depths[j] <= max_depth:
            new_index[j] = len(out)
            out.append(-1 if p < 0 else new_index[p])  # an ancestor is kept and numbered first
    return out if len(full) == len(parents) else out[1:]


class _TreeProperties:
    """What follows from a preorder parents list (``Tree`` and ``TreeShape``)."""

    parents: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents) - 1

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """[N + 1]: depths[0] = 0 (the root), depths[j] = node j's depth (its RoPE offset)."""
        return tuple(node_depths(self.parents))

    @property
    def depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """[N + 1]: each row's children's offsets in the draft's rank order (top-1 first)."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for j in range(1, len(self.parents)):
            kids[self.parents[j]].append(j)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """[N + 1]: each node's index among its siblings (0 = the draft's top-1); 0 for the root."""
        ranks = [0] * len(self.parents)
        for kids in self.children:
            for rank, j in enumerate(kids):
                ranks[j] = rank
        return tuple(ranks)

    @cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """[depth + 1]: the offsets of the nodes at each depth, in preorder (levels[0] = (0,))."""
        out: list[list[int]] = [[] for _ in range(self.depth + 1)]
        for j, d in enumerate(self.depths):
            out[d].append(j)
        return tuple(tuple(level) for level in out)

    def masks(self) -> list[int]:
        """``tree_masks(self.parents)``."""
        return tree_masks(self.parents)


@dataclass(frozen=True)
class Tree(_TreeProperties):
    """An arbitrary preorder tree (e.g. a trimmed one): ``Tree([-1, 0, 1, 0])``, or from the
    nodes' parents alone, ``Tree([0, 1, 0])``. Raises ValueError if it is not preorder."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(full_parents(self.parents)))

    def trim(self, max_depth: int) -> "Tree":
        return Tree(tuple(trim(self.parents, max_depth)))


@dataclass(frozen=True)
class TreeShape(_TreeProperties):
    """A regular tree: ``widths[d]`` children under every node at depth d. ``TreeShape((3, 2))``
    or ``TreeShape.parse("3x2")``: 3 depth-1 nodes, each with 2 children, 9 nodes."""

    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        widths = tuple(self.widths)
        if not widths:
            raise ValueError("a tree shape needs at least one level, e.g. '3x2'")
        for w in widths:
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"tree widths must be integers >= 1, got {widths}")
        count, level = 0, 1
        for w in widths:
            level *= w
            count += level
            if count > MAX_NODES:
                raise ValueError(f"tree shape {'x'.join(map(str, widths))} has more than {MAX_NODES} "
                                 f"nodes (the kernels' masks see 63 slots, the root is one of them)")
        object.__setattr__(self, "widths", widths)

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'3x2' -> TreeShape((3, 2)); a single width '4' is four depth-1 nodes."""
        parts = str(text).strip().lower().split("x")
        try:
            widths = tuple(int(part.strip()) for part in parts)
        except ValueError:
            raise ValueError(f"tree shape {text!r}: widths separated by 'x', e.g. '3x2'") from None
        return cls(widths)

    def __str__(self) -> str:
        return "x".join(map(str, self.widths))

    @cached_property
    def parents(self) -> tuple[int, ...]:  # type: ignore[override]
        """[N + 1] preorder parents: parents[0] = -1, a depth-1 node's is 0."""
        out = [-1]

        def grow(parent: int, level: int) -> None:
            if level == len(self.widths):
                return
            for _ in range(self.widths[level]):
                out.append(parent)
                grow(len(out) - 1, level + 1)

        grow(0, 0)
        return tuple(out)

    @property
    def num_nodes(self) -> int:
        count, level = 0, 1
        for w in self.widths:
            level *= w
            count += level
        return count

    @property
    def depth(self) -> int:
        return len(self.widths)

    def trim(self, max_depth: int) -> "TreeShape":
        """The levels at depth <= ``max_depth`` (>= 1): the same tree ``trim`` gives."""
        if max_depth < 1:
            raise ValueError(f"a trimmed tree shape keeps at least one level, got max_depth={max_depth}")
        return TreeShape(self.widths[:max_depth])


# ---------------------------------------------------------------------------------------------
# Attention masks.
# ---------------------------------------------------------------------------------------------


def tree_masks(parents: Sequence[int]) -> list[int]:
    """One int64 mask per row r = 0..N (the root, then node r), in the kernels' convention: bit
    i (0 <= i <= 62) is the slot i places before the row's own (bit 0 the row itself), and slots
    further back are always visible. Row r sees every slot before the root (bits > r), the root
    (bit r), its ancestors a (bit r - a) and itself (bit 0), nothing else: not its siblings' or
    cousins' KV, written between the root and it. Signed Python ints (``torch.tensor(masks,
    dtype=torch.int64)`` takes them); every row of a chain is -1."""
    full = full_parents(parents)
    masks = []
    for r in range(len(full)):
        mask = -1 << (r + 1)  # the prefix before the root, up to the sign bit and beyond
        a = r
        while a >= 0:  # itself, its ancestors, the root
            mask |= 1 << (r - a)
            a = full[a]
        masks.append(mask)
    return masks


def item_masks(n_new: int, parents: Sequence[int]) -> list[int]:
    """The masks of one sequence's rows in a step: ``n_new`` new real tokens (each sees every
    earlier slot: -1), the last of them the tree's root, then its N nodes: n_new + N masks."""
    if n_new < 1:
        raise ValueError(f"a tree needs its root among the new tokens: n_new >= 1, got {n_new}")
    return [-1] * (n_new - 1) + tree_masks(parents)


# ---------------------------------------------------------------------------------------------
# Verification.
# ---------------------------------------------------------------------------------------------


class TreeVerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [num_seqs, depth_max + 1] int64, PAD_TOKEN_ID after the end
    num_accepted: torch.Tensor  # [num_seqs] int64 accepted nodes (emitted = this + 1)
    accepted_nodes: torch.Tensor  # [num_seqs, depth_max] int64 the path's offsets, depth 1 first; -1 after
    logprobs: torch.Tensor | None  # [num_seqs, depth_max + 1] raw-model logprobs of emitted tokens (0 after)


def tree_depths(
    parents: torch.Tensor,  # [num_seqs, max_nodes + 1] int64, -1 for the root and padding
) -> torch.Tensor:  # [num_seqs, max_nodes + 1] int64 (0 for the root and padding)
    """Each node's depth by pointer doubling: log2(max_nodes) gathers, no host sync."""
    p = parents.long()
    d = (p >= 0).long()  # distance from each node to p, its current ancestor pointer
    for _ in range(max(1, p.shape[1].bit_length())):
        has = p >= 0
        at = p.clamp(min=0)
        d = d + torch.where(has, d.gather(1, at), 0)
        p = torch.where(has, p.gather(1, at), -1)
    return d


def verify_tree(
    target_logits: torch.Tensor,  # [num_seqs, max_nodes + 1, vocab] raw logits, row 0 the root
    node_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64: node j's token at column j - 1
    parents: torch.Tensor,  # [num_seqs, max_nodes + 1] int64 preorder, -1 for the root and padding
    num_nodes: torch.Tensor,  # [num_seqs] int64 nodes in each sequence's tree (the rest padding)
    st: SamplingTensors,  # one row per sequence
    generators: list[torch.Generator | None],  # per sequence (None: the global RNG)
    want_logprobs: bool = False,
) -> TreeVerifyOutput:
    """Walk every sequence's tree at once (see the module docstring), on the logits' device: a
    Python loop over depth levels only, one host sync (the deepest tree, for the output's
    width). Greedy rows (temperature 0) follow the target's argmax, sampled rows a draw from
    its processed distribution, in one call; per-sequence trees and sizes may differ. A child
    carrying the emitted token is descended into (the first such, should two carry it). An
    all-greedy batch computes no softmax and draws no uniforms."""
    num_seqs, rows_per_seq, vocab = target_logits.shape
    max_nodes = rows_per_seq - 1
    if node_tokens.shape != (num_seqs, max_nodes) or parents.shape != (num_seqs, rows_per_seq):
        raise ValueError(f"node_tokens {tuple(node_tokens.shape)} / parents {tuple(parents.shape)} do not "
                         f"match target_logits {tuple(target_logits.shape)}: want {(num_seqs, max_nodes)} "
                         f"and {(num_seqs, rows_per_seq)}")
    if len(generators) != num_seqs or st.temperature.shape[0] != num_seqs:
        raise ValueError(f"{len(generators)} generators and {st.temperature.shape[0]} sampling rows "
                         f"for {num_seqs} sequences")
    dev = target_logits.device
    offsets = torch.arange(rows_per_seq, device=dev)  # [max_nodes + 1]
    num_nodes = num_nodes.to(dev, torch.long)
    real = (offsets[None, :] >= 1) & (offsets[None, :] <= num_nodes[:, None])  # [num_seqs, max_nodes + 1]
    par = torch.where(real, parents.to(dev, torch.long), -1)  # padding never is anyone's child
    depths = tree_depths(par)  # [num_seqs, max_nodes + 1]
    row_depth = depths.max(dim=1).values  # [num_seqs]
    depth_max = int(row_depth.max()) if num_seqs else 0  # the one host sync
    node_par = par[:, 1:]  # [num_seqs, max_nodes]
    tokens = node_tokens.to(dev, torch.long)  # [num_seqs, max_nodes]

    greedy = st.temperature.to(dev) < GREEDY_BELOW  # [num_seqs]
    u = None
    if not st.all_greedy:  # a seeded row draws its own depth + 1 values, whatever its batch
        u = uniforms(num_seqs, depth_max + 1, generators, dev, widths=row_depth + 1,
                     dtype=torch.float64)  # [num_seqs, depth_max + 1]

    seqs = torch.arange(num_seqs, device=dev)
    cur = torch.zeros(num_seqs, dtype=torch.long, device=dev)  # [num_seqs] the node emitting now
    active = torch.ones(num_seqs, dtype=torch.bool, device=dev)  # [num_seqs] still walking
    # Every row's argmax in one pass: a greedy walk then reads [num_seqs] ids per level instead
    # of gathering and scanning a vocabulary-wide row (2.2 -> 0.4 ms for a 3x2 tree on 2 cores).
    argmax = row_argmax(target_logits.reshape(-1, vocab)).view(num_seqs, rows_per_seq)  # [num_seqs, max_nodes + 1]
    out_tokens, out_nodes, out_logprobs = [], [], []
    for level in range(depth_max + 1):
        token = argmax.gather(1, cur[:, None]).squeeze(1)  # [num_seqs]
        logits = target_logits[seqs, cur] if u is not None or want_logprobs else None  # [num_seqs, vocab]
        if u is not None:
            drawn = inverse_cdf(processed_probs(logits.float(), st), u[:, level])
            token = torch.where(greedy, token, drawn)
        out_tokens.append(torch.where(active, token, PAD_TOKEN_ID))
        if want_logprobs:
            lp = torch.log_softmax(logits.float(), dim=-1).gather(1, token[:, None]).squeeze(1)
            out_logprobs.append(torch.where(active, lp, 0.0))
        if level == depth_max:  # nothing is deeper: the token just emitted was every row's last
            break
        match = (node_par == cur[:, None]) & (tokens == token[:, None])  # [num_seqs, max_nodes]
        found = match.any(dim=1)  # [num_seqs]
        child = match.to(torch.uint8).argmax(dim=1) + 1  # [num_seqs] first matching child's offset
        active = active & found
        cur = torch.where(active, child, cur)
        out_nodes.append(torch.where(active, child, -1))

    output_token_ids = torch.stack(out_tokens, dim=1)  # [num_seqs, depth_max + 1]
    if out_nodes:
        accepted_nodes = torch.stack(out_nodes, dim=1)  # [num_seqs, depth_max]
    else:
        accepted_nodes = torch.empty(num_seqs, 0, dtype=torch.long, device=dev)
    num_accepted = (accepted_nodes >= 0).sum(dim=1)
    logprobs = torch.stack(out_logprobs, dim=1) if want_logprobs else None
    return TreeVerifyOutput(output_token_ids, num_accepted, accepted_nodes, logprobs)


# ---------------------------------------------------------------------------------------------
# KV of the accepted path.
# ---------------------------------------------------------------------------------------------


def kv_moves(accepted_nodes: Sequence[int]) -> list[tuple[int, int]]:
    """(source offset, destination offset) pairs, from the root's slot, that put the accepted
    path's KV where a chain's would be: the node at depth d at offset d, skipping those already
    there. The path may end in -1 padding (``TreeVerifyOutput.accepted_nodes``).

    Applying the pairs in order is safe: along a preorder path the offsets strictly increase
    and the node at depth d has offset n_d >= d (its d - 1 ancestors precede it), so a
    destination d is below every later source n_e > n_d >= d: no move overwrites KV that a
    later move still has to read."""
    moves = []
    previous = 0
    for depth, node in enumerate(accepted_nodes, start=1):
        node = int(node)
        if node < 0:
            break
        if node <= previous:
            raise ValueError(f"an accepted path's offsets increase (preorder), got {list(accepted_nodes)}")
        previous = node
        if node != depth:
            moves.append((node, depth))
    return moves
