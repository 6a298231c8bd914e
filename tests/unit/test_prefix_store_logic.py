"""IMPRESS pure logic against brute-force reference models: the radix tree (a set of stored
chunk prefixes), the indexed heap and tier eviction order (a sorted list), importance
selection (Python sets) and repacking (the mapping list round trip)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyserve.core.prefix_store import (
    IndexedMinHeap,
    RadixTree,
    TierIndex,
    inverse_order,
    jaccard_threshold,
    mean_pairwise_jaccard,
    random_jaccard,
    select_important,
    select_rows,
    storage_order,
    to_logical,
    to_storage,
    top_k_mask,
)
from keyserve.core.prefix_store.repack import chunk_counts, storage_chunks

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHUNK = 2

# --------------------------------------------------------------------------- radix tree

seqs = st.lists(st.integers(0, 2), min_size=0, max_size=12)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), seqs),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
        st.tuples(st.just("match"), seqs),
    ),
    max_size=30,
)


def _ref_match(stored: set[tuple[int, ...]], q: list[int]) -> int:
    best = 0
    for n in range(CHUNK, len(q) - len(q) % CHUNK + 1, CHUNK):
        if tuple(q[:n]) in stored:
            best = n
    return best


def _check_structure(tree: RadixTree) -> None:
    for node in tree.nodes.values():
        assert len(node.tokens) % CHUNK == 0 and node.tokens
        assert node.parent is not None
        assert node.start == node.parent.end
        assert node.parent.children[node.tokens[:CHUNK]] is node


@FAST
@given(ops)
def test_radix_tree_matches_set_of_stored_prefixes(script) -> None:
    tree = RadixTree(CHUNK)
    stored: set[tuple[int, ...]] = set()
    for op, arg in script:
        if op == "insert":
            nodes, new, splits = tree.insert_path(arg)
            aligned = len(arg) - len(arg) % CHUNK
            stored |= {tuple(arg[:n]) for n in range(CHUNK, aligned + 1, CHUNK)}
            for sp in splits:
                assert sp.head.tokens + sp.tail.tokens == sp.old.tokens
        elif op == "remove":
            leaves = sorted(tree.leaves(), key=lambda n: n.node_id)
            if not leaves:
                continue
            leaf = leaves[arg % len(leaves)]
            full = tree.path_tokens(leaf)
            tree.remove_leaf(leaf)
            stored -= {full[:n] for n in range(leaf.start + CHUNK, leaf.end + 1, CHUNK)}
        else:
            path = tree.match(arg)
            got = sum(s.num_tokens for s in path)
            assert got == _ref_match(stored, arg)
            # the path spells the query's prefix
            spelled = tuple(t for s in path for t in s.node.tokens[: s.num_tokens])
            assert spelled == tuple(arg[:got])
        _check_structure(tree)
    # every stored prefix is found whole
    for p in stored:
        assert sum(s.num_tokens for s in tree.match(list(p))) == len(p)


def test_radix_split_and_max_tokens() -> None:
    tree = RadixTree(2)
    _, a, _ = tree.insert_path([1, 2, 3, 4, 5, 6, 7])  # 7 -> 6 aligned
    assert a is not None and a.tokens == (1, 2, 3, 4, 5, 6)
    nodes, b, splits = tree.insert_path([1, 2, 3, 4, 9, 9])
    assert len(splits) == 1 and splits[0].old is a
    assert splits[0].head.tokens == (1, 2, 3, 4) and b is not None and b.start == 4
    assert [s.num_tokens for s in tree.match([1, 2, 3, 4, 5, 6], max_tokens=5)] == [4]
    assert tree.match([1, 3]) == []
    removed = tree.remove_subtree(splits[0].head)
    assert len(removed) == 3 and not tree.nodes


# --------------------------------------------------------------------------- heap and tiers

heap_ops = st.lists(
    st.tuples(st.sampled_from(["push", "remove", "pop"]), st.integers(0, 9), st.integers(0, 5)),
    max_size=60,
)


@FAST
@given(heap_ops)
def test_indexed_heap_against_dict(script) -> None:
    heap: IndexedMinHeap[int] = IndexedMinHeap()
    ref: dict[int, tuple[int, int]] = {}
    for op, key, prio in script:
        if op == "push":
            heap.push(key, (prio, key))
            ref[key] = (prio, key)
        elif op == "remove" and key in ref:
            assert heap.remove(key) == ref.pop(key)
        elif op == "pop" and ref:
            want = min((p, k) for k, p in ref.items())
            assert heap.pop() == (want[0], want[1])
            del ref[want[1]]
        assert len(heap) == len(ref)
        if ref:
            assert heap.peek()[0] == min(ref.values())


tier_ops = st.lists(
    st.tuples(st.sampled_from(["admit", "touch", "remove"]), st.integers(0, 11), st.integers(0, 1),
              st.integers(0, 4)),
    max_size=60,
)


@FAST
@given(tier_ops, st.integers(0, 3))
def test_tier_admission_and_eviction_order_against_sorting(script, cap) -> None:
    """A bounded tier keeps, per layer, what a brute-force 'sort by priority, keep the best'
    model keeps when fed the same online admissions."""
    tier = TierIndex("t", num_layers=2, slots_per_layer=cap)
    ref: dict[tuple, tuple] = {}  # key -> priority
    tick = itertools.count()
    for op, node, layer, weight in script:
        key = (node, layer, 0)
        prio = (weight, next(tick))
        if op == "admit":
            in_layer = {k: p for k, p in ref.items() if k[1] == layer}
            if key in ref:
                ref[key] = prio
            elif len(in_layer) < cap:
                ref[key] = prio
            elif in_layer and prio > min(in_layer.values()):
                victim = min(in_layer, key=in_layer.get)
                del ref[victim]
                ref[key] = prio
            slot, evicted = tier.admit(key, prio)
            assert (slot is not None) == (key in ref)
        elif op == "touch" and key in ref:
            ref[key] = prio
            tier.update(key, prio)
        elif op == "remove" and key in ref:
            del ref[key]
            tier.remove(key)
        assert set(tier.slots) == set(ref)
        for lay in (0, 1):
            want = [k for k, _ in sorted(((k, p) for k, p in ref.items() if k[1] == lay), key=lambda kp: kp[1])]
            assert tier.eviction_order(lay) == want
            slots = [tier.slot(k) for k in ref if k[1] == lay]
            assert len(set(slots)) == len(slots) and all(0 <= s < cap for s in slots)


def test_pop_order_of_impress_priority() -> None:
    """Priority = important tokens x accesses: chunk B (2 important, 2 accesses) outranks A
    (1 important, 3 accesses), the paper's own example."""
    tier = TierIndex("device", 1, 1)
    tier.admit(("A", 0, 0), (1 * 3, 1))
    slot, evicted = tier.admit(("B", 0, 0), (2 * 2, 2))
    assert slot == 0 and evicted == (("A", 0, 0), 0)
    assert tier.admit(("C", 0, 0), (1 * 3, 3)) == (None, None)


# --------------------------------------------------------------------------- importance


def test_random_jaccard_is_ratio_of_expectations() -> None:
    for n in (4, 10, 50):
        for k in range(1, n + 1):
            inter = k * k / n
            assert random_jaccard(k, n) == pytest.approx(inter / (2 * k - inter))
    assert jaccard_threshold(20, 100) == pytest.approx((0.2 / 1.8) ** 0.6)


@FAST
@given(st.integers(1, 4), st.integers(2, 5), st.integers(3, 24), st.integers(0, 10_000))
def test_importance_selection_against_sets(num_layers, num_heads, n, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (num_layers, num_heads, n), generator=gen).float()
    frac = 0.3
    imp = select_important(scores, frac, num_heads=3)
    k = max(1, min(n, round(frac * n)))
    h = min(3, num_heads)
    assert imp.k == k
    for layer in range(num_layers):
        sets = []
        for head in range(h):
            ranked = sorted(range(n), key=lambda i: (-float(scores[layer, head, i]), i))
            sets.append(set(ranked[:k]))
        jac = [len(a & b) / len(a | b) for a, b in itertools.combinations(sets, 2)]
        mean = sum(jac) / len(jac) if jac else 1.0
        assert float(imp.mean_jaccard[layer]) == pytest.approx(mean, abs=1e-6)
        summed = scores[layer, :h].sum(0)
        ranked = sorted(range(n), key=lambda i: (-float(summed[i]), i))
        assert set(imp.important[layer].nonzero().flatten().tolist()) == set(ranked[:k])
        t = jaccard_threshold(k, n)
        assert bool(imp.load_all[layer]) == (k < n and mean < t)


def test_agreeing_heads_pass_and_disagreeing_heads_fall_back() -> None:
    n = 40
    same = torch.arange(n, dtype=torch.float32).expand(2, 3, n).clone()
    assert select_important(same, 0.25).num_fallbacks == 0
    # Three heads with disjoint top sets: Jaccard 0 < threshold.
    dis = torch.zeros(1, 3, n)
    for h in range(3):
        dis[0, h, h * 10 : h * 10 + 10] = 1.0
    imp = select_important(dis, 0.25)
    assert imp.load_all.tolist() == [True] and float(imp.mean_jaccard[0]) == 0.0
    assert select_important(dis, 0.25, check_agreement=False).num_fallbacks == 0
    # Only the first 3 of 4 heads are sampled: a wild 4th head changes nothing.
    four = torch.cat([same[:1], torch.rand(1, 1, n)], dim=1)
    assert select_important(four, 0.25).important.equal(select_important(same[:1], 0.25).important)
    assert top_k_mask(torch.zeros(5), 2).tolist() == [True, True, False, False, False]
    assert mean_pairwise_jaccard(torch.ones(2, 1, 4, dtype=torch.bool)).tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------- repacking


@FAST
@given(st.integers(1, 3), st.integers(1, 6), st.integers(0, 10_000), st.booleans())
def test_repacking_mapping_round_trip_and_density(num_layers, num_chunks, seed, repack) -> None:
    n = num_chunks * CHUNK
    gen = torch.Generator().manual_seed(seed)
    important = torch.rand(num_layers, n, generator=gen) < 0.4
    scores = torch.randint(0, 4, (num_layers, n), generator=gen).float()
    order = storage_order(important, scores, repack)
    data = torch.randn(num_layers, n, 2, 3, generator=gen)
    # mapping list: storage index s holds logical token order[l, s]
    stored = to_storage(data, order)
    for layer in range(num_layers):
        assert sorted(order[layer].tolist()) == list(range(n))
        for s in range(n):
            assert torch.equal(stored[layer, s], data[layer, int(order[layer, s])])
    assert torch.equal(to_logical(stored, order), data)
    # the disk tier's layout: storage order cut into chunks, each its K rows then its V rows
    kv = torch.randn(num_layers, n, 2, 3, 4, generator=gen)
    chunks = storage_chunks(kv, order, CHUNK)
    assert chunks.is_contiguous() and chunks.shape == (num_layers, num_chunks, 2, CHUNK, 3, 4)
    for layer in range(num_layers):
        for s in range(n):
            for kv_index in range(2):
                want = kv[layer, int(order[layer, s]), kv_index]
                assert torch.equal(chunks[layer, s // CHUNK, kv_index, s % CHUNK], want)
    inv = inverse_order(order)
    assert torch.equal(order.gather(1, inv), torch.arange(n).expand(num_layers, n))
    counts = chunk_counts(order, important, CHUNK)
    for layer in range(num_layers):
        per_chunk = [sum(bool(important[layer, int(order[layer, s])]) for s in range(c * CHUNK, (c + 1) * CHUNK))
                     for c in range(num_chunks)]
        assert counts[layer].tolist() == per_chunk
        if repack:
            k = int(important[layer].sum())
            # important tokens come first (dense) by descending score then index, the rest latest first
            assert all(bool(important[layer, int(i)]) for i in order[layer, :k])
            keyed = [(-float(scores[layer, i]), i) for i in order[layer, :k].tolist()]
            assert keyed == sorted(keyed)
            rest = order[layer, k:].tolist()
            assert rest == sorted(rest, reverse=True)
            # the fewest chunks that can hold the important tokens do hold them
            assert sum(1 for c in per_chunk if c) == -(-k // CHUNK)
        else:
            assert order[layer].tolist() == list(range(n))


@FAST
@given(st.integers(1, 3), st.integers(1, 6), st.integers(0, 10_000), st.integers(0, 12), st.integers(0, 12),
       st.lists(st.floats(0, 1), min_size=3, max_size=3))
def test_select_rows_per_layer_counts_against_brute_force(num_layers, num_chunks, seed, lo, hi, top_up) -> None:
    """Each layer brings its needed tokens plus its next eligible ones in storage order, up to
    its own count; shorter layers are padded with -1 at the tail."""
    n = num_chunks * CHUNK
    lo, hi = sorted((min(lo, n), min(hi, n)))
    gen = torch.Generator().manual_seed(seed)
    important = torch.rand(num_layers, n, generator=gen) < 0.3
    order = storage_order(important, torch.rand(num_layers, n, generator=gen))
    ar = torch.arange(n)
    eligible = ((ar >= lo) & (ar < hi)).expand(num_layers, n)
    needed = eligible & important
    have, most = needed.sum(1), eligible.sum(1)
    counts = have + ((most - have).float() * torch.tensor(top_up[:num_layers])).long()
    logical, storage = select_rows(order, needed, eligible, counts)
    assert logical.shape == (num_layers, int(counts.max()) if num_layers else 0)
    for layer in range(num_layers):
        c = int(counts[layer])
        want = [i for i in range(n) if needed[layer, i]]
        extra = [int(i) for i in order[layer] if eligible[layer, i] and not needed[layer, i]]
        want = sorted(want + extra[: c - len(want)])
        assert logical[layer, :c].tolist() == want
        assert order[layer, storage[layer, :c]].tolist() == want
        assert (logical[layer, c:] == -1).all() and (storage[layer, c:] == -1).all()
    with pytest.raises(ValueError):
        select_rows(order, needed, eligible, most + 1)
