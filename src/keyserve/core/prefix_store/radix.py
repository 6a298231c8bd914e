"""A radix tree over token ids whose edges are whole chunks (IMPRESS's prefix index).

Stored KV is only reusable in whole chunks, so every edge label is a multiple of
``chunk_size`` tokens and nodes split only at chunk boundaries. A node's children are keyed by
their first chunk, so two children never share one. Each node carries an opaque ``payload``
(the store's per-node data); the tree only knows the structure.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

Chunk = tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    node_id: int
    tokens: tuple[int, ...]  # edge label: this node's tokens, a multiple of chunk_size
    start: int  # position of the node's first token in every prefix through it
    parent: "RadixNode | None" = None
    children: dict[Chunk, "RadixNode"] = field(default_factory=dict)
    payload: Any = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, start={self.start}, len={len(self.tokens)})"


@dataclass
class MatchStep:
    node: RadixNode
    num_tokens: int  # tokens of this node that match (a chunk multiple, > 0)

    @property
    def full(self) -> bool:
        return self.num_tokens == len(self.node.tokens)


@dataclass
class Split:
    """``old`` was replaced by ``head`` (its first tokens) and ``tail`` (the rest, head's child)."""

    old: RadixNode
    head: RadixNode
    tail: RadixNode


class RadixTree:
    def __init__(self, chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self._ids = itertools.count(1)
        self.root = RadixNode(0, (), 0)
        self.nodes: dict[int, RadixNode] = {}

    def _chunk(self, tokens: tuple[int, ...] | list[int], i: int) -> Chunk:
        c = self.chunk_size
        return tuple(tokens[i * c : (i + 1) * c])

    def aligned(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.chunk_size

    # ----------------------------------------------------------------- lookup
    def match(self, tokens: list[int] | tuple[int, ...], max_tokens: int | None = None) -> list[MatchStep]:
        """The path of the longest stored chunk-aligned prefix of ``tokens`` (at most
        ``max_tokens``); the last step may use only the first chunks of its node."""
        limit = self.aligned(min(len(tokens), len(tokens) if max_tokens is None else max_tokens))
        path: list[MatchStep] = []
        node, pos = self.root, 0
        c = self.chunk_size
        while pos < limit:
            child = node.children.get(tuple(tokens[pos : pos + c]))
            if child is None:
                break
            n = 0
            label = child.tokens
            while n < len(label) and pos + n < limit and label[n : n + c] == tuple(tokens[pos + n : pos + n + c]):
                n += c
            path.append(MatchStep(child, n))
            pos += n
            if n < len(label):
                break
            node = child
        return path

    # --------------------------------------------------------------- changes
    def split(self, node: RadixNode, num_tokens: int) -> Split:
        """Cut ``node`` after ``num_tokens`` (a chunk multiple strictly inside it) into a head
        and a tail; both are new nodes (new ids), the old one leaves the tree."""
        if num_tokens % self.chunk_size or not 0 < num_tokens < len(node.tokens):
            raise ValueError(f"cannot split {node} at {num_tokens}")
        parent = node.parent
        assert parent is not None
        head = RadixNode(next(self._ids), node.tokens[:num_tokens], node.start, parent)
        tail = RadixNode(next(self._ids), node.tokens[num_tokens:], node.start + num_tokens, head)
        tail.children = node.children
        for child in tail.children.values():
            child.parent = tail
        head.children = {self._chunk(tail.tokens, 0): tail}
        parent.children[self._chunk(head.tokens, 0)] = head
        del self.nodes[node.node_id]
        self.nodes[head.node_id] = head
        self.nodes[tail.node_id] = tail
        node.children = {}
        node.parent = None
        return Split(node, head, tail)

    def add_child(self, parent: RadixNode, tokens: tuple[int, ...]) -> RadixNode:
        """A new leaf under ``parent`` (whose first chunk no sibling has)."""
        if not tokens or len(tokens) % self.chunk_size:
            raise ValueError("a node holds a positive multiple of chunk_size tokens")
        key = self._chunk(tokens, 0)
        if key in parent.children:
            raise ValueError("a child with this first chunk exists")
        node = RadixNode(next(self._ids), tuple(tokens), parent.end, parent)
        parent.children[key] = node
        self.nodes[node.node_id] = node
        return node

    def remove_leaf(self, node: RadixNode) -> None:
        if node.children:
            raise ValueError(f"{node} has children")
        parent = node.parent
        assert parent is not None
        del parent.children[self._chunk(node.tokens, 0)]
        del self.nodes[node.node_id]
        node.parent = None

    def remove_subtree(self, node: RadixNode) -> list[RadixNode]:
        """Remove ``node`` and everything below it; returns the removed nodes, leaves first."""
        removed = list(self.iter_subtree(node))[::-1]
        for n in removed:
            self.remove_leaf(n)
        return removed

    def iter_subtree(self, node: RadixNode) -> Iterator[RadixNode]:
        """``node`` and its descendants, parents before children."""
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def leaves(self) -> list[RadixNode]:
        return [n for n in self.nodes.values() if n.is_leaf]

    def path_tokens(self, node: RadixNode) -> tuple[int, ...]:
        parts = []
        while node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def insert_path(self, tokens: list[int] | tuple[int, ...]) -> tuple[list[RadixNode], RadixNode | None, list[Split]]:
        """Make the chunk-aligned part of ``tokens`` stored: split where it diverges inside a
        node, add one leaf for the rest. Returns (the existing nodes it runs through, the new
        leaf or None, the splits made)."""
        n = self.aligned(len(tokens))
        path = self.match(tokens, n)
        splits: list[Split] = []
        nodes = [s.node for s in path]
        if path and not path[-1].full:
            split = self.split(path[-1].node, path[-1].num_tokens)
            splits.append(split)
            nodes[-1] = split.head
        matched = sum(s.num_tokens for s in path)
        new = None
        if matched < n:
            parent = nodes[-1] if nodes else self.root
            new = self.add_child(parent, tuple(tokens[matched:n]))
        return nodes, new, splits
