"""The prefix store with real tiers on a toy KV layout: exact round trips through device, host
and disk, splits, importance loads and their bytes, bounded tiers, disk pressure, corruption."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from keyserve.core.prefix_store import (
    BlockPoolChunks,
    DiskTier,
    HostChunks,
    KVLayout,
    PrefixStore,
    StoreSettings,
)

L, H, D, CHUNK, BLOCK = 2, 2, 2, 4, 2
SHAPE = (2, CHUNK, H, D)


def kv_of(tokens: list[int], a: int, b: int) -> torch.Tensor:  # [L, b - a, 2, H, D]
    """A position's KV depends on every token up to it (like a model's)."""
    rows = []
    for p in range(a, b):
        seed = int.from_bytes(hashlib.sha256(repr(tokens[: p + 1]).encode()).digest()[:4], "little")
        rows.append(torch.randn(L, 2, H, D, generator=torch.Generator().manual_seed(seed)))
    return torch.stack(rows, dim=1)


def make_store(tmp_path: Path, device_chunks: int = 0, host_chunks: int = 0, disk_bytes: int = 1 << 30,
               low_dtype: torch.dtype | None = None, **settings) -> PrefixStore:
    device = None
    if device_chunks:
        caches = [(torch.zeros(64, BLOCK, H, D), torch.zeros(64, BLOCK, H, D)) for _ in range(L)]
        device = BlockPoolChunks(caches, list(range(10, 10 + device_chunks * CHUNK // BLOCK)), CHUNK)
    host = HostChunks(L, host_chunks, SHAPE, torch.float32) if host_chunks else None
    disk = DiskTier(str(tmp_path), disk_bytes, SHAPE, torch.float32, low_dtype=low_dtype)
    return PrefixStore(StoreSettings(CHUNK, **settings), KVLayout(L, H, D, torch.float32), disk, device, host)


def insert(store: PrefixStore, tokens: list[int], scores: torch.Tensor | None = None) -> int:
    return store.insert(tokens, lambda a, b: kv_of(tokens, a, b), scores)


def check_exact(store: PrefixStore, tokens: list[int], want_len: int, start: int = 0) -> None:
    got = store.load(tokens, len(tokens) - 1, start)
    assert got is not None and got.num_tokens == want_len and got.exact
    assert got.positions.equal(torch.arange(start, want_len).expand(L, -1))
    assert torch.equal(got.kv, kv_of(tokens, start, want_len))


def test_round_trip_prefixes_and_splits(tmp_path: Path) -> None:
    store = make_store(tmp_path, device_chunks=2, host_chunks=3)
    a = list(range(1, 19))  # 18 tokens: 16 stored
    b = a[:9] + [50] * 10  # diverges inside a's node, in its third chunk (chunk 8..11)
    assert insert(store, a) == 16
    check_exact(store, a + [0], 16)
    check_exact(store, a[:13], 12)  # a prefix ending inside the node
    assert insert(store, b) == 8  # stores tokens 8..15 of b; a's node splits at 8
    assert store.stats.splits == 1
    check_exact(store, a + [0], 16)
    check_exact(store, b + [0], 16)
    check_exact(store, b + [0], 16, start=4)  # the first 4 were the caller's
    assert store.load([7, 7, 7, 7, 7], 4) is None
    assert store.disk.used_bytes == (8 + 8 + 8) * L * store.chunk_bytes // CHUNK


def test_importance_load_reads_only_important_chunks(tmp_path: Path) -> None:
    n = 16
    tokens = list(range(100, 100 + n + 1))
    scores = torch.zeros(L, H, n)
    hot = {0: [1, 6, 9, 14], 1: [0, 3, 5, 12]}  # per layer; all heads agree
    for layer, pos in hot.items():
        scores[layer, :, pos] = 1.0
    for repack, chunks_read in ((True, 2), (False, 7)):  # chunks over both layers
        store = make_store(tmp_path / str(repack), top_k_fraction=0.25, repack=repack)
        insert(store, tokens, scores)
        assert store.stats.importance_fallbacks == 0
        got = store.load(tokens, n, important_only=True)
        assert got is not None and not got.exact and got.num_tokens == n
        for layer, pos in hot.items():
            assert got.positions[layer].tolist() == pos
            assert torch.equal(got.kv[layer], kv_of(tokens, 0, n)[layer, pos])
            assert got.scores is not None and got.scores[layer, 0].tolist() == [1.0] * 4
        assert store.stats.disk_hits == chunks_read  # repacked: 4 important tokens = 1 chunk a layer
        assert store.stats.disk_bytes_read == chunks_read * store.chunk_bytes
        full = store.load(tokens, n)  # the full policy still gets everything
        assert full is not None and full.exact and torch.equal(full.kv, kv_of(tokens, 0, n))


def test_layer_fallback_loads_all_and_counts(tmp_path: Path) -> None:
    n = 16
    tokens = list(range(n + 1))
    scores = torch.zeros(L, 3, n)
    scores[0, :, :4] = 1.0  # layer 0 agrees
    for h in range(3):  # layer 1: three heads with disjoint tops
        scores[1, h, 4 * h : 4 * h + 4] = 1.0
    store = make_store(tmp_path, top_k_fraction=0.25)
    insert(store, tokens, scores)
    assert store.stats.importance_fallbacks == 1 and store.stats.importance_layers == L
    # only the layer whose heads disagree loads all: layer 0 reads its one important chunk
    got = store.load(tokens, n, important_only=True)
    assert got is not None and not got.exact and got.positions.shape == (L, n)
    assert got.positions[0].tolist() == [0, 1, 2, 3] + [-1] * (n - 4)
    assert got.positions[1].tolist() == list(range(n))
    want = kv_of(tokens, 0, n)
    assert torch.equal(got.kv[0, :4], want[0, :4]) and torch.equal(got.kv[1], want[1])
    assert got.scores is not None and got.scores[0, :, 4:].eq(0).all()
    assert store.stats.disk_hits == 1 + n // CHUNK
    # a floor per layer tops layer 0 up with its next most important tokens
    got = store.load(tokens, n, important_only=True, min_per_layer=6)
    assert got is not None and (got.positions[0] >= 0).sum() == 6 and got.positions[0, :4].tolist() == [0, 1, 2, 3]
    assert torch.equal(got.kv[0, :6], want[0, got.positions[0, :6]])
    # None: every layer loads as many as the layer that loads the most
    got = store.load(tokens, n, important_only=True, min_per_layer=None)
    assert got is not None and got.exact and got.positions.equal(torch.arange(n).expand(L, -1))


def test_memory_tiers_bounded_hits_and_promotion(tmp_path: Path) -> None:
    store = make_store(tmp_path, device_chunks=2, host_chunks=2)
    prefixes = [[p] * 9 for p in range(1, 5)]  # 4 prefixes of 2 chunks (8 tokens) each
    for p in prefixes:
        insert(store, p)
    dev, host = store.index["device"], store.index["host"]
    for layer in range(L):
        assert len(dev.heaps[layer]) <= 2 and len(host.heaps[layer]) <= 2
    assert len(store.disk.sizes) == 4  # disk keeps everything
    before = store.stats.disk_hits
    check_exact(store, prefixes[0], 8)  # the oldest is on disk only by now
    assert store.stats.disk_hits > before and store.stats.promotions > 0
    # accessed twice, it now outranks the chunks that were accessed once: served from memory
    check_exact(store, prefixes[0], 8)
    assert store.stats.device_hits + store.stats.host_hits >= 2 * L
    s = store.sync_stats()
    assert s.device_evictions > 0


def test_lru_mode_evicts_least_recent(tmp_path: Path) -> None:
    store = make_store(tmp_path, device_chunks=2, eviction="lru")
    for p in range(1, 4):
        insert(store, [p] * 9)
    dev = store.index["device"]
    nodes = {store.tree.match([p] * 9)[0].node.node_id: p for p in range(1, 4)}
    held = {nodes[k[0]] for k in dev.slots}
    assert held == {3}  # the newest prefix's two chunks
    check_exact(store, [1] * 9, 8)
    assert {nodes[k[0]] for k in dev.slots} == {1}


def test_disk_bound_evicts_leaves(tmp_path: Path) -> None:
    node_bytes = 2 * L * (CHUNK * H * D * 2 * 4)  # 8 tokens
    store = make_store(tmp_path, disk_bytes=2 * node_bytes)
    for p in range(1, 4):
        insert(store, [p] * 9)
    assert store.disk.used_bytes <= 2 * node_bytes and store.stats.disk_evictions == 1
    assert store.load([1] * 9, 8) is None  # the least valuable went
    check_exact(store, [3] * 9, 8)
    store.disk.drain()
    assert len(list(Path(store.disk.root).glob("*.kv"))) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_chunk_is_a_counted_miss(tmp_path: Path, damage: str) -> None:
    store = make_store(tmp_path)
    a = [1] * 8 + [2] * 9
    insert(store, a[:9])  # node 1: tokens 0..7
    insert(store, a)  # node 2: tokens 8..15 below it
    child = store.tree.match(a)[1].node
    store.disk.drain()  # the files are written (in the background)
    path = store.disk.path(child.node_id)
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[5] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:10])
    else:
        path.unlink()
    got = store.load(a, 16)
    assert store.stats.corrupt_chunks == 1
    assert got is not None and got.num_tokens == 8 and torch.equal(got.kv, kv_of(a, 0, 8))
    assert child.node_id not in store.tree.nodes
    insert(store, a)  # stored again, fine afterwards
    check_exact(store, a, 16)


@pytest.mark.parametrize("low_dtype, repack, hot", [
    (torch.float16, True, [2, 7, 9, 13]),  # repacked: one important chunk, then three low ones
    (torch.bfloat16, True, [2, 7, 9, 13]),
    (torch.float16, False, [1, 2, 3, 4]),  # in place: important chunks 0 and 1, low 2 and 3
    (torch.float16, False, [0, 1, 8, 9]),  # low chunks between important ones (runs alternate)
])
def test_unimportant_chunks_on_disk_in_low_precision(
    tmp_path: Path, low_dtype: torch.dtype, repack: bool, hot: list[int]
) -> None:
    """With ``low_dtype`` the chunks without an important token take its size on disk and come
    back rounded to it; important chunks, and a node stored before its importance is known,
    stay bit-exact. A load of every token under a budget brings the stored scores along."""
    n = 16
    tokens = list(range(200, 200 + n + 1))
    scores = torch.zeros(L, H, n)
    scores[:, :, hot] = 1.0
    store = make_store(tmp_path, top_k_fraction=0.25, low_dtype=low_dtype, repack=repack)
    insert(store, tokens)  # importance unknown: every chunk as cached
    node = store.tree.match(tokens)[0].node
    full, low = store.chunk_bytes, store.chunk_bytes // 2
    assert store.disk.sizes[node.node_id] == L * (n // CHUNK) * full
    check_exact(store, tokens, n)
    insert(store, tokens, scores)  # now with importance (and, if repack, relaid out)
    num_full = -(-len(hot) // CHUNK) if repack else len({p // CHUNK for p in hot})
    size = L * (num_full * full + (n // CHUNK - num_full) * low)
    assert store.disk.sizes[node.node_id] == size
    want = kv_of(tokens, 0, n)
    before = store.stats.disk_bytes_read
    got = store.load(tokens, n, need_scores=True)  # every token, with the stored scores
    assert got is not None and got.exact and got.positions.equal(torch.arange(n).expand(L, -1))
    assert store.stats.disk_bytes_read - before == size
    exact = [p for p in range(n) if p // CHUNK in {h // CHUNK for h in hot}] if not repack else hot
    cold = [p for p in range(n) if p not in exact]
    assert torch.equal(got.kv[:, exact], want[:, exact])  # in an important chunk: bit-exact
    assert torch.equal(got.kv[:, cold], want[:, cold].to(low_dtype).float())  # rounded once
    assert not torch.equal(got.kv[:, cold], want[:, cold])
    assert got.scores is not None and got.scores[:, 0, hot].eq(1).all()
    assert got.scores[:, 0, [p for p in range(n) if p not in hot]].eq(0).all()
    imp = store.load(tokens, n, important_only=True, need_scores=True)
    assert imp is not None and torch.equal(imp.kv[:, :4], want[:, hot])
    store.disk.drain()
    path = store.disk.path(node.node_id)  # a flipped byte in a low-precision chunk is caught
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.load(tokens, n, need_scores=True) is None and store.stats.corrupt_chunks == 1


def test_scores_arriving_later_repack_the_node(tmp_path: Path) -> None:
    n = 16
    tokens = list(range(n + 1))
    store = make_store(tmp_path, top_k_fraction=0.25)
    insert(store, tokens)
    assert store.match_length(tokens, n, need_scores=True) == 0
    scores = torch.zeros(L, H, n)
    scores[:, :, 8:12] = 1.0
    assert insert(store, tokens, scores) == 0  # nothing new, but the node learns its importance
    assert store.match_length(tokens, n, need_scores=True) == n
    got = store.load(tokens, n, important_only=True, need_scores=True)
    assert got is not None and got.positions.tolist() == [[8, 9, 10, 11]] * L
    assert torch.equal(got.kv, kv_of(tokens, 0, n)[:, 8:12])


def test_first_unstored_is_the_first_position_an_insert_reads(tmp_path: Path) -> None:
    """The engine copies KV out of blocks from ``first_unstored`` on and stores it later; an
    insert given only that part must read nothing before it."""
    store = make_store(tmp_path)
    a = list(range(1, 19))
    b = a[:9] + [50] * 10
    assert store.first_unstored(a, False) == 0
    insert(store, a)
    assert store.first_unstored(a, False) == 16  # all of a's aligned part is stored
    assert store.first_unstored(b, False) == 8  # b diverges inside a's node, in chunk 8..11
    assert store.first_unstored(b, True) == 0  # with scores, a's scoreless node is repacked
    reads: list[tuple[int, int]] = []

    def read_from(start: int):
        def read(x: int, y: int) -> torch.Tensor:
            assert x >= start
            reads.append((x, y))
            return kv_of(b, x, y)
        return read

    scores = torch.rand(L, H, len(b))
    assert store.insert(b, read_from(store.first_unstored(b, True)), scores) == 8
    assert reads and min(x for x, _ in reads) == 0
    assert store.first_unstored(b, True) == 16 and store.first_unstored(b + [3] * 4, True) == 16
    check_exact(store, b + [0], 16)


def test_cold_reads_drop_the_file_from_the_page_cache_before_each_read(tmp_path: Path, monkeypatch) -> None:
    """A benchmark of the disk tier measures the device, not the page cache: every read drops
    the node's file first (written files are synced so their pages can go), and the data and
    checksums still round-trip. Without the drop (or with ``cold_reads`` off) no call is seen."""
    import os

    calls: list[int] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:  # records, then really drops
        calls.append(advice)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    tokens = list(range(1, 18))
    for cold in (False, True):
        store = make_store(tmp_path / str(cold))
        store.disk.cold_reads = cold
        insert(store, tokens)
        calls.clear()
        check_exact(store, tokens, 16)
        check_exact(store, tokens, 16)
        reads = 2 * L  # one read per layer per load
        assert calls == ([os.POSIX_FADV_DONTNEED] * reads if cold else [])


@pytest.mark.parametrize("eviction", ["importance", "lru"])
def test_deferred_promotions_settle_to_the_tiers_of_immediate_ones(tmp_path: Path, eviction: str) -> None:
    """The engine defers a load's promotions to ``settle`` (after the first token's step). Until
    then the tiers are untouched, reads stay exact, and settling leaves every tier, heap and
    counter as applying them inside the loads would have -- also when an insert in between
    splits a node that a pending read touched (inserts settle first). Without the deferral the
    tiers move during the load; with reads applied out of order or skipped the states differ."""
    prefixes = [[p] * 9 for p in range(1, 5)] + [[1] * 5 + [7] * 4]  # the last splits prefix 1
    stores = {}
    for defer in (False, True):
        store = make_store(tmp_path / str(defer), device_chunks=2, host_chunks=2, eviction=eviction,
                           defer_promotions=defer)
        for p in prefixes[:4]:
            insert(store, p)
        before = {t: dict(store.index[t].slots) for t in ("device", "host")}
        check_exact(store, prefixes[0], 8)
        check_exact(store, prefixes[2], 8)
        check_exact(store, prefixes[0], 8)
        moved = {t: dict(store.index[t].slots) for t in ("device", "host")} != before
        assert moved != defer  # deferred: nothing moved yet
        insert(store, prefixes[4])  # settles first, then splits prefix 1's node
        check_exact(store, prefixes[1], 8)
        store.settle()
        check_exact(store, prefixes[0] + [0], 8)
        store.settle()
        stores[defer] = store
    now, later = stores[False], stores[True]
    assert later.stats.promotions == now.stats.promotions > 0
    for tier in ("device", "host"):
        assert later.index[tier].slots == now.index[tier].slots
        for layer in range(L):
            heap_now, heap_later = now.index[tier].heaps[layer], later.index[tier].heaps[layer]
            assert sorted(heap_later.keys()) == sorted(heap_now.keys())
            assert all(heap_later.priority(k) == heap_now.priority(k) for k in heap_now.keys())
    for key in now.tree.nodes:
        a, b = now.tree.nodes[key].payload, later.tree.nodes[key].payload
        assert a.freq == b.freq and a.tick == b.tick


def _gate(disk: DiskTier):
    """Hold the disk tier's writer thread until the returned event is set (a job ahead of
    every write: what a slow disk does)."""
    import threading

    gate = threading.Event()
    disk._writer.submit(gate.wait, 30)
    return gate


def test_writes_run_in_the_background_and_reads_wait_for_them(tmp_path: Path) -> None:
    """``DiskTier`` writes files on its own thread: ``write_node`` returns with the node
    accounted for but not on disk yet; a read waits for the write and gets the exact data;
    a node deleted before its write started never reaches the disk."""
    import threading

    disk = DiskTier(str(tmp_path), 1 << 30, SHAPE, torch.float32)
    gate = _gate(disk)
    data = torch.randn(L, 3, *SHAPE)
    crcs = disk.write_node(1, data)
    assert disk.used_bytes == data.numel() * 4 and not disk.path(1).exists()
    disk.write_node(2, torch.randn(L, 3, *SHAPE))
    queued = disk._pending[2]
    disk.delete(2)  # still queued behind the gate: cancelled, not waited for
    assert queued.cancelled() and 2 not in disk.sizes
    threading.Timer(0.2, gate.set).start()
    got, nbytes = disk.read_chunks(1, 1, 3, [0, 2], crcs)  # waits for the write
    assert torch.equal(got, data[1, [0, 2]]) and nbytes == 2 * disk.chunk_bytes
    disk.drain()
    assert sorted(p.name for p in Path(disk.root).iterdir()) == ["1.kv"] and disk.sizes == {1: data.numel() * 4}
    disk.close()
    assert not Path(disk.root).exists()


def test_a_failed_background_write_is_a_counted_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails on the writer thread (a full disk: faked, it cannot be caused here)
    is found by the first read of its node: ``CorruptChunk``, so the store drops the node,
    counts it and recomputes; the next insert stores it again."""
    import errno

    import keyserve.core.prefix_store.disk as disk_module

    store = make_store(tmp_path)
    real_replace = disk_module.os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "replace", full)
    tokens = list(range(1, 10))
    assert insert(store, tokens) == 8
    store.disk.drain()
    assert store.load(tokens, 8) is None and store.stats.corrupt_chunks == 1
    assert not list(Path(store.disk.root).iterdir())  # the temporary file went too
    monkeypatch.setattr(disk_module.os, "replace", real_replace)
    assert insert(store, tokens) == 8
    check_exact(store, tokens, 8)


def test_pending_writes_are_bounded(tmp_path: Path) -> None:
    """At most ``MAX_PENDING_WRITES`` nodes' bytes wait in memory for the writer: one more
    write waits for the oldest."""
    import threading

    from keyserve.core.prefix_store.disk import MAX_PENDING_WRITES

    disk = DiskTier(str(tmp_path), 1 << 30, SHAPE, torch.float32)
    gate = _gate(disk)
    for node_id in range(MAX_PENDING_WRITES):
        disk.write_node(node_id, torch.randn(L, 1, *SHAPE))
    assert len(disk._pending) == MAX_PENDING_WRITES
    threading.Timer(0.2, gate.set).start()
    disk.write_node(99, torch.randn(L, 1, *SHAPE))  # waits for node 0's write
    assert disk.path(0).exists() and len(disk._pending) <= MAX_PENDING_WRITES
    disk.close()
