"""The importance-aware multi-tier prefix KV store (IMPRESS, docs/algorithms.md §5), apart from
the engine.

A radix tree indexes stored prefixes; each node's KV is kept per layer in chunks, repacked so
the node's important tokens fill its first chunks. Every chunk lives on disk (a full copy, so
evicting from a faster tier never writes back) and maybe in one of the bounded memory tiers
(device: slots in the engine's block pool; host: a chunk pool), which evict their
lowest-priority chunk first: priority = important tokens in the chunk × access count (or the
last access, for the LRU baseline). Every access counts and may promote the chunk upwards.

The engine hands in KV to store (``insert``) and asks for prefixes (``load``): all tokens, or
only the important ones for a request under a KV budget. Corrupt or missing disk chunks are
counted, their nodes dropped, and the lookup retried: they are a miss, never served.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import torch

from keyserve.core.prefix_store.disk import CorruptChunk, DiskTier
from keyserve.core.prefix_store.importance import select_important
from keyserve.core.prefix_store.radix import RadixNode, RadixTree, Split
from keyserve.core.prefix_store.repack import (
    chunk_counts,
    select_rows,
    storage_chunks,
    storage_order,
    to_logical,
)
from keyserve.core.prefix_store.tiers import ChunkKey, TierIndex

TIERS = ("device", "host", "disk")
# [num_tokens, 2, num_kv_heads, head_dim] per layer, stacked: [num_layers, num_tokens, 2, H, D]
ReadKV = Callable[[int, int], torch.Tensor]


@dataclass
class StoreSettings:
    chunk_size: int
    top_k_fraction: float = 0.3
    importance_heads: int = 3  # kv-heads per layer whose scores pick important tokens; 0 = all
    check_agreement: bool = True  # the Jaccard test; off: never fall back to loading all
    repack: bool = True
    eviction: Literal["importance", "lru"] = "importance"
    # Count accesses and move chunks between tiers at ``settle`` instead of inside ``load``: the
    # engine settles after the step that used the load has returned its tokens (off the TTFT).
    defer_promotions: bool = False


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass
class PrefixStoreStats:
    lookups: int = 0
    hits: int = 0  # lookups that loaded a prefix
    hit_tokens: int = 0  # prefix tokens those loads covered
    loaded_tokens: int = 0  # tokens whose KV they brought, per layer
    device_hits: int = 0  # chunks read from each tier
    host_hits: int = 0
    disk_hits: int = 0
    device_bytes_read: int = 0
    host_bytes_read: int = 0
    disk_bytes_read: int = 0
    device_evictions: int = 0  # chunks pushed out of a memory tier
    host_evictions: int = 0
    disk_evictions: int = 0  # nodes dropped to bound the directory
    promotions: int = 0  # chunks moved to a faster tier on access
    importance_layers: int = 0  # (stored prefix, layer) pairs judged
    importance_fallbacks: int = 0  # of them, marked "load all" (heads disagree)
    corrupt_chunks: int = 0  # damaged or missing on disk: treated as misses
    stored_tokens: int = 0
    disk_bytes_written: int = 0
    splits: int = 0
    relayout_bytes_read: int = 0  # read to re-layout split nodes (not a request's load)
    load_seconds: float = 0.0  # wall time spent in loads (reads, checks; promotions unless deferred)
    settle_seconds: float = 0.0  # wall time spent applying deferred accesses (promotions)
    disk_read_seconds: float = 0.0  # of load_seconds, reading (and checking) chunks from disk
    insert_seconds: float = 0.0  # and in inserts (gathers, repacking, disk writes, placement)
    dropped_inserts: int = 0  # deferred inserts whose copy no longer covered what they would read

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(eq=False)
class NodeData:
    order: torch.Tensor  # [L, n] int64: the mapping list, storage index -> logical index
    important: torch.Tensor | None  # [L, n] bool (logical), None = importance unknown
    load_all: torch.Tensor | None  # [L] bool
    scores: torch.Tensor | None  # [L, H, n] float32 accumulated attention (logical)
    weight: list[list[int]]  # [L][C] important tokens per stored chunk (the priority weight)
    freq: list[list[int]]  # [L][C] accesses
    tick: list[list[int]]  # [L][C] last access
    checksums: torch.Tensor | None = None  # [L, C] int64 CRC-32 (set once on disk)

    @property
    def num_chunks(self) -> int:
        return len(self.weight[0])


@dataclass
class LoadedPrefix:
    num_tokens: int  # tokens [0, num_tokens) are now covered
    start: int  # tokens before ``start`` were not loaded (the caller had them)
    positions: torch.Tensor  # [L, C] int64 positions loaded per layer, ascending; -1 pads a
    # layer that loaded fewer tokens than the longest (its tail)
    kv: torch.Tensor  # [L, C, 2, H, D] (zeros where positions pad)
    scores: torch.Tensor | None  # [L, H, C] float32 stored scores (loads that need them)
    exact: bool  # every token of [start, num_tokens) in every layer
    tiers: dict[str, int] = field(default_factory=dict)  # chunks read per tier


class PrefixStore:
    def __init__(
        self,
        settings: StoreSettings,
        layout: KVLayout,
        disk: DiskTier,
        device: Any | None = None,  # BlockPoolChunks (read/write/slots_per_layer) or None
        host: Any | None = None,  # HostChunks or None
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.chunk = settings.chunk_size
        self.tree = RadixTree(settings.chunk_size)
        self.disk = disk
        self.data = {"device": device, "host": host}
        L = layout.num_layers
        self.index = {
            "device": TierIndex("device", L, device.slots_per_layer if device is not None else 0),
            "host": TierIndex("host", L, host.slots_per_layer if host is not None else 0),
        }
        self.stats = PrefixStoreStats()
        self._ticks = itertools.count(1)
        self.chunk_bytes = disk.chunk_bytes
        # (node, its payload then, layer, chunk ids, their data) per read awaiting ``settle``
        self._unsettled: list[tuple[RadixNode, NodeData, int, list[int], torch.Tensor]] = []
        self.last_importance: Any = None  # the latest judgement (inspection, benchmarks)
        self.judgements: list[tuple[float, float]] = []  # (mean Jaccard over layers, threshold)

    # --------------------------------------------------------------- priority
    def _priority(self, nd: NodeData, layer: int, c: int) -> tuple:
        if self.settings.eviction == "lru":
            return (nd.tick[layer][c],)
        return (nd.weight[layer][c] * nd.freq[layer][c], nd.tick[layer][c])

    def _where(self, key: ChunkKey) -> str:
        for tier in ("device", "host"):
            if key in self.index[tier]:
                return tier
        return "disk"

    # ------------------------------------------------------------------ reads
    def _read_rows(
        self,
        node: RadixNode,
        storage: torch.Tensor,  # [L, c] storage indices to bring, per layer; -1 pads the tail
        access: bool,
        out: torch.Tensor | None = None,  # [L, >= at + c, 2, H, D] to write into
        at: list[int] | None = None,  # per layer: where its rows go in ``out``
    ) -> torch.Tensor:  # [L, c, 2, H, D], zeros where storage pads (or ``out``, filled at ``at``)
        """Read the chunks holding the wanted rows, each from the fastest tier that has it.
        With ``out`` each layer's rows are written at ``at[layer]`` and nothing else is touched
        (a load of several nodes packs them in place: no second copy)."""
        nd: NodeData = node.payload
        L, c = storage.shape
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        packed = out is not None
        if out is None:
            out = torch.empty(L, c, 2, H, D, dtype=self.layout.dtype)
        for layer in range(L):
            rows_wanted = storage[layer][storage[layer] >= 0]  # -1 pads a layer that loads fewer
            base = at[layer] if at is not None else 0
            if not packed:
                out[layer, rows_wanted.numel() :] = 0
            if rows_wanted.numel() == 0:
                continue
            ids, inv = torch.unique(rows_wanted // self.chunk, sorted=True, return_inverse=True)
            ids_list = ids.tolist()
            buf = torch.empty(len(ids_list), 2, self.chunk, H, D, dtype=self.layout.dtype)
            groups: dict[str, tuple[list[int], list[int]]] = {t: ([], []) for t in TIERS}
            for j, cid in enumerate(ids_list):
                tier = self._where((node.node_id, layer, cid))
                groups[tier][0].append(j)
                groups[tier][1].append(cid)
            for tier, (rows, cids) in groups.items():
                if not rows:
                    continue
                if tier == "disk":
                    assert nd.checksums is not None
                    t0 = time.perf_counter()
                    got, nbytes = self.disk.read_chunks(node.node_id, layer, nd.num_chunks, cids, nd.checksums)
                    self.stats.disk_read_seconds += time.perf_counter() - t0
                else:
                    slots = [self.index[tier].slot((node.node_id, layer, cid)) for cid in cids]
                    got = self.data[tier].read(layer, slots)
                    nbytes = len(rows) * self.chunk_bytes
                if len(rows) == len(ids_list):  # one tier holds every chunk: no copy
                    buf = got.to("cpu", buf.dtype).contiguous()
                else:
                    buf.index_copy_(0, torch.tensor(rows), got.to("cpu", buf.dtype))
                if access:
                    setattr(self.stats, f"{tier}_hits", getattr(self.stats, f"{tier}_hits") + len(rows))
                    setattr(self.stats, f"{tier}_bytes_read", getattr(self.stats, f"{tier}_bytes_read") + nbytes)
                else:
                    self.stats.relayout_bytes_read += nbytes
            if access and self.settings.defer_promotions:
                self._unsettled.append((node, nd, layer, ids_list, buf))
            elif access:
                self._access(node, layer, ids_list, buf)
            # buf as rows [chunks * (K, V) * chunk, H * D]: gather each wanted token's K and V
            # rows, interleaved, straight into out's [n, 2, H, D] (one index_select: no
            # permuted copy of the whole buffer first; advanced indexing was ~6x slower)
            flat = buf.view(-1, H * D)
            k_rows = inv * (2 * self.chunk) + rows_wanted % self.chunk
            n = rows_wanted.numel()
            kv_rows = torch.stack([k_rows, k_rows + self.chunk], dim=1).view(-1)
            torch.index_select(flat, 0, kv_rows, out=out[layer, base : base + n].view(2 * n, H * D))
        return out

    def _access(
        self,
        node: RadixNode,
        layer: int,
        chunk_ids: list[int],
        data: torch.Tensor,  # [len(chunk_ids), 2, chunk, H, D]
    ) -> None:
        """Count the access; promote chunks that now outrank a faster tier's minimum."""
        nd: NodeData = node.payload
        dev, host = self.index["device"], self.index["host"]
        pending = self._pending()
        for j, cid in enumerate(chunk_ids):
            key = (node.node_id, layer, cid)
            nd.freq[layer][cid] += 1
            nd.tick[layer][cid] = next(self._ticks)
            prio = self._priority(nd, layer, cid)
            src = self._where(key)
            if src == "device":
                dev.update(key, prio)
                continue
            if src == "host":
                host.update(key, prio)
            if dev.would_admit(layer, prio):
                if src == "host":
                    host.remove(key)
                self._place(key, prio, data[j : j + 1], "device", pending)
                self.stats.promotions += 1
            elif src == "disk" and host.would_admit(layer, prio):
                self._place(key, prio, data[j : j + 1], "host", pending)
                self.stats.promotions += 1
        self._flush(layer, pending)

    def settle(self) -> int:
        """Apply the accesses of the loads since the last call, in order: count them and promote
        what now outranks a faster tier (``defer_promotions``). A read whose node was dropped or
        laid out again since is skipped: its chunk ids no longer name the same data. Returns the
        reads applied. Until then every tier still holds what the loads read from it."""
        pending, self._unsettled = self._unsettled, []
        if not pending:
            return 0
        t0 = time.perf_counter()
        applied = 0
        for node, nd, layer, chunk_ids, data in pending:
            if node.payload is not nd or self.tree.nodes.get(node.node_id) is not node:
                continue
            self._access(node, layer, chunk_ids, data)
            applied += 1
        self.stats.settle_seconds += time.perf_counter() - t0
        return applied

    @staticmethod
    def _pending() -> dict[str, dict[int, tuple[ChunkKey, torch.Tensor]]]:
        return {"device": {}, "host": {}}

    def _place(
        self,
        key: ChunkKey,
        prio: tuple,
        data: torch.Tensor | int,  # [1, 2, chunk, H, D], or the device slot that holds it now
        tier: str,
        pending: dict[str, dict[int, tuple[ChunkKey, Any]]],
    ) -> bool:
        """Admit one chunk to ``tier``; a chunk it evicts from the device tier drops to host.
        Data moves are batched: ``pending[tier][slot]`` is what ``_flush`` writes there."""
        slot, evicted = self.index[tier].admit(key, prio)
        if slot is None:
            return False
        layer = key[1]
        if evicted is not None:
            victim, vslot = evicted
            vdata = pending[tier].pop(vslot, (None, None))[1]
            if tier == "device":
                if vdata is None:  # resident before this batch: read (batched) at the flush,
                    vdata = vslot  # before the device slots are overwritten
                vnd: NodeData = self.tree.nodes[victim[0]].payload
                vprio = self._priority(vnd, layer, victim[2])
                if self.index["host"].would_admit(layer, vprio):
                    self._place(victim, vprio, vdata, "host", pending)
        pending[tier][slot] = (key, data)
        return True

    def _flush(self, layer: int, pending: dict[str, dict[int, tuple[ChunkKey, Any]]]) -> None:
        """Write the batch: host first, its chunks that come from device slots read in one call
        while those slots still hold them, then the device tier."""
        host = pending["host"]
        from_device = [slot for slot, (_, d) in host.items() if isinstance(d, int)]
        if from_device:  # demoted chunks: on the host they are CPU tensors like the rest
            rows = self.data["device"].read(layer, [host[s][1] for s in from_device]).cpu()
            for j, slot in enumerate(from_device):
                host[slot] = (host[slot][0], rows[j : j + 1])
        for tier in ("host", "device"):
            moves = pending[tier]
            if moves:
                self.data[tier].write(layer, list(moves), torch.cat([d for _, d in moves.values()]))

    # ------------------------------------------------------------------ loads
    def _match(self, tokens: list[int], max_tokens: int | None, need_scores: bool, exact: bool = False) -> list:
        """The stored path of ``tokens``: with ``need_scores`` up to the first node stored without
        attention scores; with ``exact`` up to the first node with chunks the disk tier keeps
        rounded to its ``low_dtype`` (a full-policy request's KV must be the computed KV)."""
        path = self.tree.match(tokens, max_tokens)
        rounded = exact and self.disk.low_dtype is not None
        if need_scores or rounded:
            for i, step in enumerate(path):
                nd = step.node.payload
                if (need_scores and nd.scores is None) or (rounded and bool(self._low_chunks(nd).any())):
                    return path[:i]
        return path

    def match_length(
        self, tokens: list[int], max_tokens: int | None = None, need_scores: bool = False, exact: bool = False,
    ) -> int:
        return sum(s.num_tokens for s in self._match(tokens, max_tokens, need_scores, exact))

    def load(
        self,
        tokens: list[int],
        max_tokens: int,
        start: int = 0,
        important_only: bool = False,
        need_scores: bool = False,
        min_per_layer: int | None = 0,
        recent_from: int | None = None,
        exact: bool = False,
    ) -> LoadedPrefix | None:
        """KV of the longest stored prefix of ``tokens`` (at most ``max_tokens``) beyond
        ``start``: every token, or with ``important_only`` each node's important tokens per
        layer (every token in its "load all" layers only) and every token at a position from
        ``recent_from`` on (the request's recent window, which H2O keeps whatever the scores),
        topped up to ``min_per_layer`` tokens per layer with the next in storage order (None: to
        as many as the layer loading the most, so every layer holds the same count). With
        ``need_scores`` only nodes stored with attention scores count; with ``exact`` only nodes
        with no chunk rounded on disk (``_match``). None if nothing is stored."""
        t0 = time.perf_counter()
        try:
            return self._load(tokens, max_tokens, start, important_only, need_scores, min_per_layer,
                              recent_from, exact)
        finally:
            self.stats.load_seconds += time.perf_counter() - t0

    def first_unstored(self, tokens: list[int], with_scores: bool) -> int:
        """The first position whose KV ``insert(tokens, ...)`` would read (its aligned length if
        none): where the stored path ends or, when scores come with it, where the first stored
        node still without scores starts (it is repacked from the caller's exact KV)."""
        path = self.tree.match(tokens, self.tree.aligned(len(tokens)))
        if with_scores:
            for step in path:
                if step.node.payload is not None and step.node.payload.scores is None:
                    return step.node.start
        return sum(step.num_tokens for step in path)

    def insert(
        self,
        tokens: list[int],
        read_kv: ReadKV,
        scores: torch.Tensor | None = None,  # [L, H, >= aligned len] accumulated attention
    ) -> int:
        """Store the chunk-aligned part of ``tokens`` (exact KV, read through ``read_kv(start,
        end)`` for the part not stored yet). Returns the number of tokens newly stored."""
        self.settle()  # accesses first: an insert may split or repack the nodes they read
        t0 = time.perf_counter()
        try:
            return self._insert(tokens, read_kv, scores)
        finally:
            self.stats.insert_seconds += time.perf_counter() - t0

    def _load(
        self,
        tokens: list[int],
        max_tokens: int,
        start: int = 0,
        important_only: bool = False,
        need_scores: bool = False,
        min_per_layer: int | None = 0,
        recent_from: int | None = None,
        exact: bool = False,
    ) -> LoadedPrefix | None:
        """``load`` without the clock; a corrupt chunk drops its node and retries the lookup."""
        while True:
            path = self._match(tokens, max_tokens, need_scores, exact)
            m = sum(s.num_tokens for s in path)
            if m <= start:
                return None
            before = {t: getattr(self.stats, f"{t}_hits") for t in TIERS}
            try:
                positions, kv, scores = self._load_path(path, start, important_only, min_per_layer, recent_from)
            except CorruptChunk as e:
                self.stats.corrupt_chunks += 1
                bad = self.tree.nodes.get(e.node_id)
                if bad is not None:
                    self._drop(bad)
                continue
            break
        counts = (positions >= 0).sum(1)  # [L] tokens loaded per layer
        if not (important_only or need_scores):
            scores = None
        exact = bool((counts == m - start).all())
        self.stats.hits += 1
        self.stats.hit_tokens += m - start
        self.stats.loaded_tokens += int(counts.sum()) // len(counts)
        tiers = {t: getattr(self.stats, f"{t}_hits") - before[t] for t in TIERS}
        return LoadedPrefix(m, start, positions, kv, scores, exact, tiers)

    def _load_path(
        self, path: list, start: int, important_only: bool, min_per_layer: int | None,
        recent_from: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The path's selected tokens, packed (``_read_packed``): positions [L, W] (-1 pads),
        KV [L, W, 2, H, D], scores [L, H, W]. A layer short of ``min_per_layer`` tokens in all
        takes the next most important eligible tokens of the first nodes that have some; with
        None every layer of a node takes as many as its layer that needs the most."""
        L = self.layout.num_layers
        plan = []
        for step in path:
            node = step.node
            nd: NodeData = node.payload
            n = len(node.tokens)
            lo = max(start - node.start, 0)
            if lo >= step.num_tokens:
                continue
            ar = torch.arange(n)
            eligible = ((ar >= lo) & (ar < step.num_tokens)).expand(L, n)
            needed = eligible
            if important_only and nd.important is not None:
                assert nd.load_all is not None
                wanted = nd.important | nd.load_all[:, None]
                if recent_from is not None:
                    wanted = wanted | (ar + node.start >= recent_from)
                needed = eligible & wanted
            plan.append((node, needed, eligible))
        short = torch.full((L,), min_per_layer or 0, dtype=torch.int64)
        for _, needed, _ in plan:
            short -= needed.sum(1)
        selections = []
        for node, needed, eligible in plan:
            nd = node.payload
            have = needed.sum(1)
            if min_per_layer is None:
                counts = have.max().expand(L)
            else:
                extra = torch.minimum(short.clamp(min=0), eligible.sum(1) - have)
                short -= extra
                counts = have + extra
            selections.append((node, *select_rows(nd.order, needed, eligible, counts)))
        return self._read_packed(selections)

    def _read_packed(
        self,
        selections: list[tuple[RadixNode, torch.Tensor, torch.Tensor]],  # (node, logical [L, c], storage [L, c])
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read every node's selected rows into one buffer where each layer's tokens come first,
        ascending by position: positions [L, W] (-1 pads), KV [L, W, 2, H, D] (zeros where
        positions pad), scores [L, H, W]."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        counts = [(logical >= 0).sum(1) for _, logical, _ in selections]  # per node: [L]
        totals = torch.stack(counts).sum(0) if counts else torch.zeros(L, dtype=torch.int64)
        width = int(totals.max()) if counts else 0
        positions = torch.full((L, width), -1, dtype=torch.int64)
        kv = torch.empty(L, width, 2, H, D, dtype=self.layout.dtype)
        heads = next((node.payload.scores.shape[1] for node, _, _ in selections
                      if node.payload.scores is not None), H)
        scores = torch.zeros(L, heads, width)
        at = [0] * L
        for (node, logical, storage), n in zip(selections, counts):
            nd: NodeData = node.payload
            self._read_rows(node, storage, True, kv, at)
            for layer, k in enumerate(n.tolist()):  # each layer's valid rows come first
                rows = logical[layer, :k]
                positions[layer, at[layer] : at[layer] + k] = rows + node.start
                if nd.scores is not None:
                    scores[layer, :, at[layer] : at[layer] + k] = nd.scores[layer][:, rows]
                at[layer] += k
        for layer, total in enumerate(at):
            if total < width:
                kv[layer, total:] = 0
        return positions, kv, scores

    # ---------------------------------------------------------------- inserts
    def _insert(
        self,
        tokens: list[int],
        read_kv: ReadKV,
        scores: torch.Tensor | None = None,  # [L, H, >= aligned len] accumulated attention
    ) -> int:
        """Store the chunk-aligned part of ``tokens`` (exact KV, read through ``read_kv(start,
        end)`` for the part not stored yet). Returns the number of tokens newly stored."""
        m = self.tree.aligned(len(tokens))
        if m == 0:
            return 0
        while True:
            path = self.tree.match(tokens, m)
            old_logical = None
            if path and not path[-1].full:
                try:
                    old_logical = self._read_logical(path[-1].node)
                except CorruptChunk as e:
                    self.stats.corrupt_chunks += 1
                    self._drop(self.tree.nodes[e.node_id])
                    continue
            break
        nodes, new, splits = self.tree.insert_path(tokens[:m])
        for split in splits:
            assert old_logical is not None
            self._relayout(split, old_logical)
        imp = None
        if scores is not None and (new is not None or any(n.payload.scores is None for n in nodes)):
            s = self.settings
            imp = select_important(scores[..., :m], s.top_k_fraction, s.importance_heads, s.check_agreement)
            self.stats.importance_layers += self.layout.num_layers
            self.stats.importance_fallbacks += imp.num_fallbacks
            self.last_importance = imp
            self.judgements.append((float(imp.mean_jaccard.mean()), float(imp.threshold)))
            for node in nodes:  # stored without scores: now they are known, repack the node
                if node.payload.scores is None:
                    self._upgrade(node, imp, scores, read_kv)
        if new is None:
            return 0
        a, b = new.start, new.end
        kv = read_kv(a, b).to("cpu", self.layout.dtype)  # [L, T, 2, H, D]
        if imp is not None:
            assert scores is not None
            nd = self._node_data(imp.important[:, a:b], imp.load_all, scores[..., a:b].float().cpu().clone())
        else:
            nd = self._node_data(None, None, None, n=b - a)
        new.payload = nd
        protect = set(nodes) | {new} | {n for sp in splits for n in (sp.head, sp.tail)}
        if not self._make_disk_room(self.disk.node_bytes(self._low_chunks(nd)), protect):
            self.tree.remove_leaf(new)
            return 0
        self._write(new, kv)
        self.stats.stored_tokens += b - a
        return b - a

    def _node_data(
        self,
        important: torch.Tensor | None,  # [L, n] bool
        load_all: torch.Tensor | None,  # [L] bool
        scores: torch.Tensor | None,  # [L, H, n]
        freq: list[int] | None = None,  # per layer, for a re-laid-out node
        n: int | None = None,
    ) -> NodeData:
        L = self.layout.num_layers
        if important is None:
            n = n if n is not None else 0
            order = torch.arange(n).expand(L, n).clone()
            weight = torch.full((L, n // self.chunk), self.chunk, dtype=torch.int64)
        else:
            assert load_all is not None and scores is not None
            n = important.shape[1]
            h = scores.shape[1] if self.settings.importance_heads <= 0 else self.settings.importance_heads
            order = storage_order(important, scores[:, :h].sum(1), self.settings.repack)
            weight = chunk_counts(order, important | load_all[:, None], self.chunk)
        C = n // self.chunk
        tick = next(self._ticks)
        f = freq or [1] * L
        return NodeData(
            order, important, load_all, scores, weight.tolist(),
            [[f[l]] * C for l in range(L)], [[tick] * C for _ in range(L)],
        )

    @staticmethod
    def _low_chunks(nd: NodeData) -> torch.Tensor:  # [L, C] bool
        """The chunks without an important token (the disk tier may store them in its
        ``low_dtype``); none while a node's importance is unknown or its layer loads all."""
        if nd.important is None:
            return torch.zeros(len(nd.weight), nd.num_chunks, dtype=torch.bool)
        return torch.tensor(nd.weight) == 0

    def _write(
        self,
        node: RadixNode,
        logical: torch.Tensor,  # [L, n, 2, H, D] in logical order
    ) -> None:
        """Full copy to disk, in the node's storage order, then into the memory tiers where the
        chunks rank high enough."""
        nd: NodeData = node.payload
        L, n = logical.shape[:2]
        C = n // self.chunk
        chunks = storage_chunks(logical, nd.order, self.chunk)  # [L, C, 2, chunk, H, D]
        nd.checksums = self.disk.write_node(node.node_id, chunks, self._low_chunks(nd))
        self.stats.disk_bytes_written += self.disk.sizes[node.node_id]
        for layer in range(L):
            pending = self._pending()
            for c in range(C):
                key = (node.node_id, layer, c)
                prio = self._priority(nd, layer, c)
                for tier in ("device", "host"):
                    if self.index[tier].would_admit(layer, prio):
                        self._place(key, prio, chunks[layer, c : c + 1], tier, pending)
                        break
            self._flush(layer, pending)

    def _read_logical(self, node: RadixNode) -> torch.Tensor:  # [L, n, 2, H, D] logical order
        nd: NodeData = node.payload
        L, n = nd.order.shape
        stored = self._read_rows(node, torch.arange(n).expand(L, n), access=False)
        return to_logical(stored, nd.order)

    def _relayout(self, split: Split, logical: torch.Tensor) -> None:
        """A split node's halves are repacked on their own (repacking never crosses nodes)."""
        old: NodeData = split.old.payload
        self._forget(split.old)
        self.stats.splits += 1
        d = len(split.head.tokens)
        freq = [max(1, round(sum(f) / len(f))) for f in old.freq]
        for part, lo, hi in ((split.head, 0, d), (split.tail, d, d + len(split.tail.tokens))):
            if old.important is None:
                nd = self._node_data(None, None, None, freq, n=hi - lo)
            else:
                assert old.scores is not None
                nd = self._node_data(old.important[:, lo:hi], old.load_all, old.scores[..., lo:hi], freq)
            part.payload = nd
            self._write(part, logical[:, lo:hi])

    def _upgrade(self, node: RadixNode, imp: Any, scores: torch.Tensor, read_kv: ReadKV) -> None:
        """Give a node stored without scores the importance of a prefix through it, and
        repack it (its KV comes from the caller, exact, so nothing is read back)."""
        old: NodeData = node.payload
        freq = [max(1, round(sum(f) / len(f))) for f in old.freq]
        a, b = node.start, node.end
        kv = read_kv(a, b).to("cpu", self.layout.dtype)
        self._forget(node)
        nd = self._node_data(imp.important[:, a:b], imp.load_all, scores[..., a:b].float().cpu(), freq)
        node.payload = nd
        self._write(node, kv)

    # --------------------------------------------------------------- removal
    def _forget(self, node: RadixNode) -> None:
        """Drop a node's chunks from every tier (the node is already out of the tree)."""
        nd: NodeData | None = node.payload
        if nd is None:
            return
        for layer in range(self.layout.num_layers):
            for c in range(nd.num_chunks):
                key = (node.node_id, layer, c)
                for tier in ("device", "host"):
                    if key in self.index[tier]:
                        self.index[tier].remove(key)
        self.disk.delete(node.node_id)
        node.payload = None

    def _drop(self, node: RadixNode) -> None:
        """Remove ``node`` and its subtree (corrupt data, or disk space)."""
        for n in self.tree.remove_subtree(node):
            self._forget(n)

    def _node_priority(self, node: RadixNode) -> tuple:
        nd: NodeData = node.payload
        last = max(max(t) for t in nd.tick)
        if self.settings.eviction == "lru":
            return (last,)
        score = sum(w * f for wl, fl in zip(nd.weight, nd.freq) for w, f in zip(wl, fl))
        return (score, last)

    def _make_disk_room(self, nbytes: int, protect: set[RadixNode]) -> bool:
        """Evict whole leaf nodes, lowest priority first, until ``nbytes`` more fit."""
        if nbytes > self.disk.max_bytes:
            return False
        while self.disk.used_bytes + nbytes > self.disk.max_bytes:
            leaves = [n for n in self.tree.leaves() if n not in protect and n.payload is not None]
            if not leaves:
                return False
            victim = min(leaves, key=self._node_priority)
            self._drop(victim)
            self.stats.disk_evictions += 1
        return True

    def sync_stats(self) -> PrefixStoreStats:
        self.stats.device_evictions = self.index["device"].evictions
        self.stats.host_evictions = self.index["host"].evictions
        return self.stats

    def close(self) -> None:
        self._unsettled.clear()
        self.disk.close()
