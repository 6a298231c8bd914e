"""Tree speculation's pure logic (core/spec_tree.py): preorder layouts, the kernels' masks, the
batched walk (greedy = greedy decoding of the target; sampled = exactly the target's processed
distribution, chi-square over one call of 200k rows), seeded rows independent of their batch,
and the KV moves of an accepted path.

Mutations caught (each a one-line change to spec_tree.py, the suite rerun, the file restored
from a copy; the tests named fail):
- the walk stopping one level early (``level == depth_max - 1``: no bonus from a leaf): the
  greedy hand-made, oracle and chain tests, the sampled joint test;
- a child looked up under the wrong parent (``par[:, :-1]`` for the nodes' parents, or
  ``node_par == cur + 1``), or the matched child's offset off by one: the greedy tests;
- greedy testing each child against its own row's argmax instead of its parent's: the greedy
  hand-made walk (and the oracle and chain tests);
- the walk not moving below depth 1, so the bonus comes from the parent's row: the greedy tests
  and the sampled joint test (test_sampled_chi_square_has_power feeds the verifier exactly
  parents' rows in the leaves' places to show the statistic rejects it);
- every level reusing the first uniform (``u[:, 0]``): the sampled joint test only;
- a seeded row drawing the batch's widest count (``widths=None``): the seeded-row test;
- ``cdf < u·total`` for ``cdf <= u·total`` (a zero-probability token 0 drawn at u = 0), or the
  fallback clamped to the vocabulary's last token instead of the row's last positive one: the
  inverse-CDF test;
- padding past num_nodes left in the tree: the per-sequence batch test;
- logprobs of the processed distribution instead of the raw model's: the logprobs test;
- the root's bit left out of tree_masks, or an ancestor's bit off by one: the mask tests;
- kv_moves not skipping nodes already in place: both kv_moves tests;
- too few pointer-doubling rounds in tree_depths: its own test and the chain test;
- a looser preorder check (any earlier parent): the validation test; trim not renumbering
  the kept nodes' parents: the trim test.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from keyserve.core.sampler import SamplingTensors, make_generator, processed_probs
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.spec_decode import PAD_TOKEN_ID, verify_drafts
from keyserve.core.sampler import inverse_cdf
from keyserve.core.spec_tree import (
    MAX_NODES,
    Tree,
    TreeShape,
    item_masks,
    kv_moves,
    node_depths,
    tree_depths,
    tree_masks,
    trim,
    verify_tree,
)

ALPHA = 1e-3  # significance; seeds are fixed, so every test is deterministic
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Narrow tensors gain nothing from intra-op threads, and on a busy machine the threads'
    hand-offs cost more than the work (the sampled tests ran 2-3x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; 0.0 if an outcome of zero expected mass occurred."""
    from scipy.stats import chisquare

    observed, probs = observed.flatten().double(), probs.flatten().double()
    zero = probs <= 0
    if observed[zero].sum() > 0:  # impossible under the expected distribution
        return 0.0
    obs, exp = observed[~zero], probs[~zero] / probs[~zero].sum() * observed.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def random_tree(rng: random.Random, num_nodes: int) -> list[int]:
    """A uniformly shaped preorder tree: node j's parent is node j - 1 or one of its ancestors."""
    parents, path = [-1], [0]
    for j in range(1, num_nodes + 1):
        p = rng.choice(path)
        del path[path.index(p) + 1 :]
        path.append(j)
        parents.append(p)
    return parents


def ancestors_or_self(parents: list[int], r: int) -> set[int]:
    out = set()
    while r >= 0:
        out.add(r)
        r = parents[r]
    return out


def walk_oracle(parents: list[int], tokens: list[int], emit) -> tuple[list[int], list[int]]:
    """The walk, one node at a time: ``emit(row)`` gives the token emitted at a row."""
    cur, out, path = 0, [], []
    while True:
        x = emit(cur)
        out.append(x)
        kids = [j for j in range(1, len(parents)) if parents[j] == cur and tokens[j - 1] == x]
        if not kids:
            return out, path
        cur = kids[0]
        path.append(cur)


def pad_batch(trees: list[list[int]], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence trees as the verifier's padded [num_seqs, max_nodes (+ 1)] tensors."""
    m = max(len(p) - 1 for p in trees)
    parents = torch.tensor([p + [-1] * (m + 1 - len(p)) for p in trees])
    node_tokens = torch.tensor([t + [0] * (m - len(t)) for t in tokens], dtype=torch.int64).view(len(trees), m)
    num_nodes = torch.tensor([len(p) - 1 for p in trees])
    return parents, node_tokens, num_nodes


def with_argmax(logits: torch.Tensor, row: int, token: int) -> None:
    logits[row, token] = logits[row].max() + 2.0


# ---------------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------------


def test_shape_counts_and_chains() -> None:
    assert TreeShape.parse("3x2").num_nodes == 9 and TreeShape((3, 2)) == TreeShape.parse(" 3X2 ")
    assert TreeShape.parse("2x1").num_nodes == 4
    four = TreeShape.parse("4")
    assert (four.num_nodes, four.depth, four.parents) == (4, 1, (-1, 0, 0, 0, 0))
    chain = TreeShape.parse("1x1x1")
    assert (chain.num_nodes, chain.depth, chain.parents) == (3, 3, (-1, 0, 1, 2))
    assert TreeShape((2, 2, 2, 2, 2)).num_nodes == MAX_NODES == 62
    assert str(TreeShape((3, 2))) == "3x2"


def test_shape_preorder_by_hand() -> None:
    s = TreeShape((3, 2))  # 1=a 2=a.0 3=a.1 4=b 5=b.0 6=b.1 7=c 8=c.0 9=c.1
    assert s.parents == (-1, 0, 1, 1, 0, 4, 4, 0, 7, 7)
    assert s.depths == (0, 1, 2, 2, 1, 2, 2, 1, 2, 2)
    assert s.ranks == (0, 0, 0, 1, 1, 0, 1, 2, 0, 1)
    assert s.children[0] == (1, 4, 7) and s.children[4] == (5, 6) and s.children[9] == ()
    assert s.levels == ((0,), (1, 4, 7), (2, 3, 5, 6, 8, 9))
    t = TreeShape((2, 2, 1))  # 1=a 2=a.0 3=a.0.0 4=a.1 5=a.1.0 6=b 7=b.0 8=b.0.0 9=b.1 10=b.1.0
    assert t.parents == (-1, 0, 1, 2, 1, 4, 0, 6, 7, 6, 9)
    assert t.depths == (0, 1, 2, 3, 2, 3, 1, 2, 3, 2, 3)
    assert t.ranks == (0, 0, 0, 0, 1, 0, 1, 0, 0, 1, 0)
    assert (t.num_nodes, t.depth) == (10, 3)
    # The draft's top-1 chain sits at offsets 1..depth, where a chain's drafts would be.
    assert [t.parents[d] for d in range(1, t.depth + 1)] == [0, 1, 2]
    # The general kind agrees with the regular one, from either convention.
    assert Tree(list(t.parents)).depths == t.depths == Tree(list(t.parents[1:])).depths
    assert node_depths(t.parents) == list(t.depths) and node_depths(t.parents[1:]) == list(t.depths[1:])


@pytest.mark.parametrize("bad", ["0x2", "", "3x", "ax2", "2x-1", "8x8", "2x2x2x2x2x2"])
def test_shape_validation(bad: str) -> None:
    with pytest.raises(ValueError):
        TreeShape.parse(bad)


def test_shape_validation_direct_and_general() -> None:
    for widths in [(), (0,), (3, 0), (63,), (True, 2)]:
        with pytest.raises(ValueError):
            TreeShape(widths)
    TreeShape((62,))
    with pytest.raises(ValueError, match="preorder"):
        Tree([-1, 0, 1, 0, 2])  # node 4 under node 2, after node 3 left node 2's subtree
    with pytest.raises(ValueError, match="preorder"):
        Tree([-1, 1])  # a node its own parent
    with pytest.raises(ValueError, match="62"):
        tree_masks([-1] + list(range(63)))


def test_trim_by_depth() -> None:
    s = TreeShape((3, 2))
    assert s.trim(1) == TreeShape((3,)) and s.trim(5) == s
    with pytest.raises(ValueError):
        s.trim(0)
    assert trim(s.parents, 1) == [-1, 0, 0, 0] == list(s.trim(1).parents)
    assert trim(list(s.parents[1:]), 1) == [0, 0, 0]  # the nodes-alone convention stays so
    assert trim(s.parents, 0) == [-1]
    t = TreeShape((2, 2, 1))
    assert trim(t.parents, 2) == list(TreeShape((2, 2)).parents)
    rng = random.Random(4)
    for _ in range(50):  # a general tree: the kept nodes, renumbered, with their parents
        parents = random_tree(rng, rng.randint(1, 20))
        d = rng.randint(0, 4)
        depths = node_depths(parents)
        kept = [j for j in range(len(parents)) if depths[j] <= d]
        got = trim(parents, d)
        assert got == [-1 if parents[j] < 0 else kept.index(parents[j]) for j in kept]
        assert Tree(got).depth == min(d, max(depths))


# ---------------------------------------------------------------------------------------------
# Masks.
# ---------------------------------------------------------------------------------------------


def test_chain_masks_see_everything() -> None:
    for n in [1, 3, 62]:
        assert tree_masks([-1] + list(range(n))) == [-1] * (n + 1)


def test_masks_by_hand() -> None:
    # (2, 1): 1=a 2=a.0 3=b 4=b.0. ~bits = the slots hidden from the row.
    assert tree_masks(TreeShape((2, 1)).parents) == [-1, -1, -1, ~0b0110, ~0b1100]
    # (3, 2): 1=a 2=a.0 3=a.1 4=b 5=b.0 6=b.1 7=c 8=c.0 9=c.1
    assert tree_masks(TreeShape((3, 2)).parents) == [
        -1,  # root
        -1,  # a: root, itself
        -1,  # a.0: root, a, itself
        ~0b10,  # a.1: not a.0 (1 back)
        ~0b1110,  # b: not a.1, a.0, a (1..3 back)
        ~0b11100,  # b.0: b (1 back) yes; a.1, a.0, a (2..4 back) no
        ~0b111010,  # b.1: not b.0 (1 back), b yes, not a.1, a.0, a (3..5 back)
        ~0b1111110,  # c: none of the 6 nodes before it
        ~0b11111100,  # c.0: c yes, not b.1 .. a (2..7 back)
        ~0b111111010,  # c.1: not c.0, c yes, not b.1 .. a (3..8 back)
    ]


def test_masks_against_ancestors_for_random_trees() -> None:
    rng = random.Random(1)
    trees = [random_tree(rng, rng.randint(0, 30)) for _ in range(60)]
    trees += [random_tree(rng, 62), list(TreeShape((2, 2, 2, 2, 2)).parents)]
    for parents in trees:
        masks = tree_masks(parents)
        assert len(masks) == len(parents)
        torch.tensor(masks, dtype=torch.int64)  # signed int64 range
        for r, m in enumerate(masks):
            assert -(1 << 63) <= m < (1 << 63)
            visible = ancestors_or_self(parents, r)
            for i in range(64):  # bit 63: the sign, i.e. everything further back
                assert ((m >> i) & 1 == 1) == (i > r or (r - i) in visible), (parents, r, i)


def test_item_masks() -> None:
    parents = list(TreeShape((2, 1)).parents)
    assert item_masks(3, parents) == [-1, -1] + tree_masks(parents)  # root = the 3rd new token
    assert item_masks(3, parents[1:]) == item_masks(3, parents)  # StepItem.draft_parents form
    assert len(item_masks(3, parents)) == 3 + 4
    with pytest.raises(ValueError):
        item_masks(0, parents)


# ---------------------------------------------------------------------------------------------
# Greedy verification.
# ---------------------------------------------------------------------------------------------

# (3, 2): 1=a 2=a.0 3=a.1 4=b 5=b.0 6=b.1 7=c 8=c.0 9=c.1
SHAPE32 = TreeShape((3, 2))
TOKENS32 = [3, 7, 8, 5, 9, 10, 6, 11, 12]


def greedy_logits(argmaxes: dict[int, int], vocab: int = 20, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(SHAPE32.num_nodes + 1, vocab, generator=g)
    for row, token in argmaxes.items():
        with_argmax(logits, row, token)
    return logits


def verify_one(logits: torch.Tensor, parents, tokens, params: SamplingParams = GREEDY, **kw):
    p, t, n = pad_batch([list(parents)], [list(tokens)])
    return verify_tree(logits[None], t, p, n, SamplingTensors.from_params([params]), [None], **kw)


def test_greedy_walk_by_hand() -> None:
    """root -> b (the second child) -> b.0 -> bonus from b.0's row. Every other row's argmax is
    a token that some node carries, so a walk reading the wrong row would go elsewhere."""
    logits = greedy_logits({0: 5, 4: 9, 5: 15, 1: 7, 2: 12, 3: 10, 6: 3, 7: 11, 8: 9, 9: 5})
    out = verify_one(logits, SHAPE32.parents, TOKENS32)
    assert out.output_token_ids.tolist() == [[5, 9, 15]]
    assert out.num_accepted.tolist() == [2] and out.accepted_nodes.tolist() == [[4, 5]]
    assert kv_moves([4, 5]) == [(4, 1), (5, 2)]


def test_greedy_root_rejects_and_full_acceptance() -> None:
    rejects = verify_one(greedy_logits({0: 2}), SHAPE32.parents, TOKENS32)
    assert rejects.output_token_ids.tolist() == [[2, PAD_TOKEN_ID, PAD_TOKEN_ID]]
    assert rejects.num_accepted.tolist() == [0] and rejects.accepted_nodes.tolist() == [[-1, -1]]
    full = verify_one(greedy_logits({0: 6, 7: 12, 9: 17, 8: 1}), SHAPE32.parents, TOKENS32)
    assert full.output_token_ids.tolist() == [[6, 12, 17]]  # the bonus from the leaf c.1's row
    assert full.num_accepted.tolist() == [2] and full.accepted_nodes.tolist() == [[7, 9]]
    depth1 = verify_one(greedy_logits({0: 3, 1: 4}), SHAPE32.parents, TOKENS32)
    assert depth1.output_token_ids.tolist() == [[3, 4, PAD_TOKEN_ID]]
    assert depth1.accepted_nodes.tolist() == [[1, -1]]


def test_greedy_per_sequence_trees_in_one_batch() -> None:
    """Different trees and sizes in one call, with junk past num_nodes (tokens that would match,
    parents that point into the tree) never reached; each row equals its walk alone."""
    vocab = 20
    chain = [-1, 0, 1, 2, 3]  # depth 4, deeper than the (3, 2) tree
    chain_tokens = [4, 8, 1, 2]
    cut = list(SHAPE32.parents[:5])  # a preorder prefix: a, a.0, a.1, b
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, SHAPE32.num_nodes + 1, vocab, generator=g)
    for row, tok in {0: 5, 4: 9, 5: 15}.items():
        with_argmax(logits[0], row, tok)
    for row, tok in {0: 4, 1: 8, 2: 1, 3: 2, 4: 19}.items():
        with_argmax(logits[1], row, tok)  # all 4 accepted, bonus 19
    for row, tok in {0: 5, 4: 9}.items():
        with_argmax(logits[2], row, tok)  # b accepted; b.0 (node 5) is padding here
    with_argmax(logits[3], 0, 13)
    parents, node_tokens, num_nodes = pad_batch(
        [list(SHAPE32.parents), chain, cut, list(SHAPE32.parents)],
        [TOKENS32, chain_tokens, TOKENS32[:4], TOKENS32])
    parents[2, 5:] = torch.tensor([4, 4, 0, 7, 7])  # junk past num_nodes = 4
    node_tokens[2] = torch.tensor(TOKENS32)
    st = SamplingTensors.from_params([GREEDY] * 4)
    out = verify_tree(logits, node_tokens, parents, num_nodes, st, [None] * 4)
    P = PAD_TOKEN_ID
    assert out.output_token_ids.tolist() == [[5, 9, 15, P, P], [4, 8, 1, 2, 19], [5, 9, P, P, P], [13, P, P, P, P]]
    assert out.num_accepted.tolist() == [2, 4, 1, 0]
    assert out.accepted_nodes.tolist() == [[4, 5, -1, -1], [1, 2, 3, 4], [4, -1, -1, -1], [-1, -1, -1, -1]]


def test_greedy_equals_greedy_decoding_of_the_target() -> None:
    """Property: a random target given by its argmax after every context (a hash of the tokens
    so far); random trees whose children often carry that argmax; in one batched call, each
    row emits exactly the target's greedy continuation, as far as the tree holds it."""
    rng = random.Random(7)
    vocab, num_seqs = 64, 300

    def argmax_after(ctx: tuple[int, ...]) -> int:
        return random.Random(hash(ctx)).randrange(vocab)

    trees, all_tokens, contexts = [], [], []
    for s in range(num_seqs):
        parents = random_tree(rng, rng.choice([0, 1, 3, 9, 20, rng.randint(1, 40)]))
        kids: dict[int, list[int]] = {}
        for j in range(1, len(parents)):
            kids.setdefault(parents[j], []).append(j)
        ctx = {0: (s,)}  # the root's context: the prompt
        tokens = [0] * (len(parents) - 1)
        for j in range(len(parents)):  # preorder: a parent's context is known before its children
            if j not in kids:
                continue
            chosen = rng.sample(range(vocab), len(kids[j]))
            if rng.random() < 0.7 and argmax_after(ctx[j]) not in chosen:
                chosen[rng.randrange(len(chosen))] = argmax_after(ctx[j])
            for c, tok in zip(kids[j], chosen):
                tokens[c - 1] = tok
                ctx[c] = ctx[j] + (tok,)
        trees.append(parents)
        all_tokens.append(tokens)
        contexts.append(ctx)
    parents_t, node_tokens, num_nodes = pad_batch(trees, all_tokens)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(num_seqs, parents_t.shape[1], vocab, generator=g)
    for s in range(num_seqs):
        for j, c in contexts[s].items():
            with_argmax(logits[s], j, argmax_after(c))
    out = verify_tree(logits, node_tokens, parents_t, num_nodes,
                      SamplingTensors.from_params([GREEDY] * num_seqs), [None] * num_seqs)
    depth_max = max(max(node_depths(p)) for p in trees)
    assert out.output_token_ids.shape == (num_seqs, depth_max + 1)
    lengths = []
    for s in range(num_seqs):
        a = int(out.num_accepted[s])
        emitted = out.output_token_ids[s, : a + 1].tolist()
        greedy, ctx = [], contexts[s][0]
        for _ in range(a + 1):  # plain greedy decoding of the target
            greedy.append(argmax_after(ctx))
            ctx = ctx + (greedy[-1],)
        assert emitted == greedy
        assert out.output_token_ids[s, a + 1 :].eq(PAD_TOKEN_ID).all()
        expected, path = walk_oracle(trees[s], all_tokens[s], lambda j: argmax_after(contexts[s][j]))
        assert (emitted, out.accepted_nodes[s, :a].tolist()) == (expected, path)
        lengths.append(a)
    assert max(lengths) >= 3 and lengths.count(0) > 0  # the property was exercised deeply


def test_chain_tree_equals_verify_drafts() -> None:
    """A 1x1x..x1 tree verified greedily is the chain verifier: same tokens, same counts."""
    g = torch.Generator().manual_seed(2)
    num_seqs, K, vocab = 200, 4, 10
    logits = torch.randn(num_seqs, K + 1, vocab, generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(num_seqs, K, generator=g) < 0.75, argmax[:, :K],
                         torch.randint(0, vocab, (num_seqs, K), generator=g))
    num_draft = torch.randint(0, K + 1, (num_seqs,), generator=g)
    num_draft[0] = K
    st = SamplingTensors.from_params([GREEDY] * num_seqs)
    chain = verify_drafts(logits, drafts, num_draft, st, [None] * num_seqs)
    parents = torch.tensor([[-1] + [j if j < n else -1 for j in range(K)] for n in num_draft.tolist()])
    tree = verify_tree(logits, drafts, parents, num_draft, st, [None] * num_seqs)
    assert torch.equal(tree.output_token_ids, chain.output_token_ids)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    steps = torch.arange(1, K + 1)
    assert torch.equal(tree.accepted_nodes, torch.where(steps <= tree.num_accepted[:, None], steps, -1))
    assert 0 < int((chain.num_accepted == K).sum()) < num_seqs


def test_shapes_are_checked() -> None:
    logits = torch.zeros(2, 4, 5)
    st = SamplingTensors.from_params([GREEDY] * 2)
    with pytest.raises(ValueError):
        verify_tree(logits, torch.zeros(2, 2, dtype=torch.long), torch.full((2, 4), -1), torch.zeros(2), st, [None] * 2)
    with pytest.raises(ValueError):
        verify_tree(logits, torch.zeros(2, 3, dtype=torch.long), torch.full((2, 4), -1), torch.zeros(2), st, [None])


def test_tree_depths_by_pointer_doubling() -> None:
    rng = random.Random(5)
    trees = [random_tree(rng, rng.randint(0, 62)) for _ in range(40)] + [[-1] + list(range(62))]
    parents, _, _ = pad_batch(trees, [[0] * (len(p) - 1) for p in trees])
    want = [node_depths(p) + [0] * (parents.shape[1] - len(p)) for p in trees]
    assert tree_depths(parents).tolist() == want


# ---------------------------------------------------------------------------------------------
# Sampled verification.
# ---------------------------------------------------------------------------------------------

# (2, 2): 1=a 2=a.0 3=a.1 4=b 5=b.0 6=b.1; vocabulary 6. Node tokens: a=0, b=1 under the root;
# 2, 3 under a; 0, 4 under b. Per-row base distributions (top_k=5 removes each row's smallest):
# the candidates cover about half of each row's mass.
SHAPE22 = TreeShape((2, 2))
TOKENS22 = [0, 2, 3, 1, 0, 4]
BASE22 = torch.tensor([
    [0.30, 0.22, 0.18, 0.15, 0.12, 0.03],  # root
    [0.02, 0.25, 0.30, 0.20, 0.13, 0.10],  # a
    [0.25, 0.25, 0.20, 0.15, 0.01, 0.14],  # a.0 (leaf)
    [0.10, 0.30, 0.10, 0.01, 0.29, 0.20],  # a.1 (leaf)
    [0.35, 0.10, 0.02, 0.13, 0.25, 0.15],  # b
    [0.20, 0.20, 0.20, 0.20, 0.15, 0.05],  # b.0 (leaf)
    [0.01, 0.15, 0.25, 0.19, 0.20, 0.20],  # b.1 (leaf)
])
SAMPLED = SamplingParams(temperature=0.5, top_k=5)
LOGITS22 = 0.5 * BASE22.log()  # processed at T = 0.5: softmax(log base), less each row's smallest
N_DRAWS = 200_000
V22 = 6


def processed22(logits: torch.Tensor = LOGITS22) -> torch.Tensor:  # [7, 6] q per row
    return processed_probs(logits, SamplingTensors.from_params([SAMPLED] * logits.shape[0]))


def outcome_probs(q: torch.Tensor) -> torch.Tensor:
    """[7 ** 3] the exact probability of each emitted sequence (x1), (x1, x2), (x1, x2, x3),
    indexed by code(): the walk with q at every row, enumerated."""
    probs = torch.zeros(7 ** 3, dtype=torch.float64)
    children = SHAPE22.children

    def rec(row: int, prefix: tuple[int, ...], mass: float) -> None:
        for x in range(V22):
            m = mass * float(q[row, x])
            kid = [c for c in children[row] if TOKENS22[c - 1] == x]
            if kid and m > 0:
                rec(kid[0], prefix + (x,), m)
            else:
                probs[code(prefix + (x,))] += m

    rec(0, (), 1.0)
    return probs


def code(seq) -> int:
    padded = list(seq) + [PAD_TOKEN_ID] * (3 - len(seq))
    return sum((int(t) + 1) * 7 ** (2 - i) for i, t in enumerate(padded))


def sampled_runs(logits: torch.Tensor, seed: int, draws: int = N_DRAWS) -> torch.Tensor:  # [draws, 3]
    """One call: ``draws`` independent walks of the (2, 2) tree with these rows."""
    torch.manual_seed(seed)
    p, t, n = pad_batch([list(SHAPE22.parents)], [TOKENS22])
    st = SamplingTensors.from_params([SAMPLED] * draws)
    return verify_tree(logits.expand(draws, -1, -1), t.expand(draws, -1), p.expand(draws, -1),
                       n.expand(draws), st, [None] * draws).output_token_ids


@functools.lru_cache(maxsize=1)
def exact_draws() -> torch.Tensor:  # [N_DRAWS, 3], shared by the exactness and power tests
    return sampled_runs(LOGITS22, seed=11)


def outcome_counts(out: torch.Tensor) -> torch.Tensor:
    codes = ((out + 1) * torch.tensor([49, 7, 1])).sum(dim=1)
    return torch.bincount(codes, minlength=7 ** 3)


# Power (scipy.stats.ncx2): a 2 % relative shift of the root's likeliest token (0.309 -> 0.315,
# the mass taken from the next one, 0.227) gives a non-centrality N·Σδ²/p =
# 2e5·(0.0062²/0.309 + 0.0062²/0.227) ≈ 58.5: the first-token test (4 degrees of freedom,
# critical value 18.5 at ALPHA) rejects it with probability 0.9998, the joint one (the shift
# scales whole branches, so the same 58.5 over 28 degrees of freedom, critical value 56.9) with
# 0.97. A shift of 2 percentage points (0.309 -> 0.329) gives 611: power 1.0 for both.
# test_sampled_chi_square_has_power checks the relative shift on this seed.


def test_sampled_walk_is_exactly_the_target() -> None:
    """The first token is distributed as q(root); every emitted sequence (x1), (x1, x2),
    (x1, x2, x3) as the product of q at the rows of the nodes it walked through: the second
    token from the row of the child x1 matched, the bonus from the leaf's row."""
    q = processed22()
    assert bool((q == 0).any(dim=1).all())  # top-k left a zero in every row
    out = exact_draws()
    assert chi_square_pvalue(torch.bincount(out[:, 0], minlength=V22), q[0]) > ALPHA
    assert chi_square_pvalue(outcome_counts(out), outcome_probs(q)) > ALPHA
    lengths = (out >= 0).sum(dim=1)
    assert {1, 2, 3} <= set(lengths.unique().tolist())


def test_sampled_chi_square_has_power() -> None:
    """The same statistic rejects (1) the walk run with the leaves' rows replaced by their
    parents' (the bonus drawn from the parent's row) and (2) the exact draws judged against a
    target whose likeliest root token is 2 % (relative) more likely."""
    q = processed22()
    parents_rows = LOGITS22.clone()
    parents_rows[[2, 3, 5, 6]] = LOGITS22[[1, 1, 4, 4]]
    wrong = sampled_runs(parents_rows, seed=12, draws=20_000)
    assert chi_square_pvalue(outcome_counts(wrong), outcome_probs(q)) < ALPHA
    exact = exact_draws()
    shifted = q.clone()
    delta = 0.02 * float(shifted[0, 0])
    shifted[0, 0] += delta
    shifted[0, 1] -= delta
    assert chi_square_pvalue(torch.bincount(exact[:, 0], minlength=V22), shifted[0]) < ALPHA
    assert chi_square_pvalue(outcome_counts(exact), outcome_probs(shifted)) < ALPHA


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    """Mixed batch: greedy rows walk the argmax exactly; sampled rows' first tokens follow q."""
    n = 15_000
    greedy = torch.arange(n) % 3 == 0
    params = [GREEDY if bool(gr) else SAMPLED for gr in greedy]
    p, t, nn = pad_batch([list(SHAPE22.parents)], [TOKENS22])
    torch.manual_seed(13)
    out = verify_tree(LOGITS22.expand(n, -1, -1), t.expand(n, -1), p.expand(n, -1), nn.expand(n),
                      SamplingTensors.from_params(params), [None] * n)
    argmax = LOGITS22.argmax(-1)
    want, path = walk_oracle(list(SHAPE22.parents), TOKENS22, lambda r: int(argmax[r]))
    assert want == [0, 2, 0] and path == [1, 2]  # the argmax path a -> a.0 -> bonus
    assert (out.output_token_ids[greedy] == torch.tensor(want)).all()
    assert (out.accepted_nodes[greedy] == torch.tensor(path)).all()
    first = out.output_token_ids[~greedy, 0]
    assert chi_square_pvalue(torch.bincount(first, minlength=V22), processed22()[0]) > ALPHA
    assert (out.output_token_ids[~greedy] != torch.tensor(want)).any(dim=1).any()


def test_seeded_row_is_independent_of_its_batch() -> None:
    """A seeded row draws its own depth + 1 uniforms from its generator: beside a deeper seeded
    tree, a greedy row and an unseeded one, at another index, it emits what it emits alone and
    leaves its generator in the same state."""
    g = torch.Generator().manual_seed(21)
    vocab = 8
    params = SamplingParams(temperature=1.0, seed=1234)
    mine_logits = torch.randn(1, SHAPE32.num_nodes + 1, vocab, generator=g)
    mine_tokens = [int(x) for x in torch.randint(0, vocab, (9,), generator=g)]
    chain = [-1] + list(range(12))
    other_logits = torch.randn(3, 13, vocab, generator=g)

    def run(batched: bool) -> tuple[list[int], list[int], list[float]]:
        gen = make_generator(1234, 0)
        if not batched:
            p, t, n = pad_batch([list(SHAPE32.parents)], [mine_tokens])
            out = verify_tree(mine_logits, t, p, n, SamplingTensors.from_params([params]), [gen])
            row = 0
        else:
            p, t, n = pad_batch([chain, chain, list(SHAPE32.parents), chain],
                                [list(range(12)), list(range(12)), mine_tokens, list(range(12))])
            logits = torch.cat([other_logits[:2], torch.nn.functional.pad(mine_logits, (0, 0, 0, 3)),
                                other_logits[2:]])
            st = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=99), GREEDY, params,
                                              SamplingParams(temperature=0.8)])
            out = verify_tree(logits, t, p, n, st, [make_generator(99, 0), None, gen, None])
            row = 2
        a = int(out.num_accepted[row])
        return (out.output_token_ids[row, : a + 1].tolist(), out.accepted_nodes[row, :a].tolist(),
                torch.rand(4, generator=gen).tolist())

    torch.manual_seed(0)
    alone = run(False)
    torch.manual_seed(1)
    assert run(True) == alone
    runs = set()
    for seed in range(40):  # the row does sample: other seeds give other walks
        torch.manual_seed(seed)
        gen = make_generator(seed, 0)
        p, t, n = pad_batch([list(SHAPE32.parents)], [mine_tokens])
        out = verify_tree(mine_logits, t, p, n, SamplingTensors.from_params([params]), [gen])
        runs.add(tuple(out.output_token_ids[0].tolist()))
    assert len(runs) > 5


def test_zero_probability_tokens_are_never_emitted() -> None:
    """top-k 2 and min-p rows: every emitted token has positive processed probability at the
    row that emitted it, though the tree's candidates include filtered tokens."""
    g = torch.Generator().manual_seed(31)
    n, vocab = 10_000, 8
    logits = torch.randn(SHAPE32.num_nodes + 1, vocab, generator=g) * 2
    ranked = logits.argsort(dim=-1, descending=True).tolist()  # each row's tokens, likeliest first
    tokens = [0] * SHAPE32.num_nodes
    for row, kids in enumerate(SHAPE32.children):  # the third candidate of each row: filtered by top-k
        for rank, c in enumerate(kids):
            tokens[c - 1] = ranked[row][rank + (rank == 2)]
    params = [SamplingParams(temperature=1.3, top_k=2), SamplingParams(temperature=1.0, min_p=0.3)]
    rows_params = [params[i % 2] for i in range(n)]
    p, t, nn = pad_batch([list(SHAPE32.parents)], [tokens])
    torch.manual_seed(31)
    st = SamplingTensors.from_params(rows_params)
    out = verify_tree(logits.expand(n, -1, -1), t.expand(n, -1), p.expand(n, -1), nn.expand(n), st, [None] * n)
    q = torch.stack([processed_probs(logits, SamplingTensors.from_params([pp] * logits.shape[0])) for pp in params])
    rows = torch.cat([torch.zeros(n, 1, dtype=torch.long), out.accepted_nodes.clamp(min=0)], dim=1)  # emitting rows
    emitted = out.output_token_ids
    prob = q[torch.arange(n)[:, None] % 2, rows, emitted.clamp(min=0)]
    assert bool((prob[emitted >= 0] > 0).all())
    assert int((out.num_accepted == 2).sum()) > 1000  # the leaves' rows emitted too


def test_inverse_cdf_edges() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 4)
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    u = torch.tensor([0.0, 0.49, 0.5, float(below_one)])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]
    # u·total rounding to the total: the last positive token, not the vocabulary's last.
    odd = torch.tensor([[0.1, 0.7, 0.2 / 3, 0.0]])
    assert inverse_cdf(odd, torch.tensor([1.0])).tolist() == [2]


def test_logprobs_are_the_raw_models_at_the_emitting_rows() -> None:
    g = torch.Generator().manual_seed(41)
    n, vocab = 500, 8
    logits = torch.randn(n, SHAPE32.num_nodes + 1, vocab, generator=g)
    tokens = torch.randint(0, vocab, (n, SHAPE32.num_nodes), generator=g)
    tokens[:, 0] = logits[:, 0].argmax(-1)  # node a carries the root's argmax: greedy rows go deeper
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.6, top_p=0.8) for i in range(n)]
    p = torch.tensor(SHAPE32.parents).expand(n, -1)
    torch.manual_seed(41)
    out = verify_tree(logits, tokens, p, torch.full((n,), 9), SamplingTensors.from_params(params), [None] * n,
                      want_logprobs=True)
    rows = torch.cat([torch.zeros(n, 1, dtype=torch.long), out.accepted_nodes.clamp(min=0)], dim=1)
    emitted = out.output_token_ids
    raw = torch.log_softmax(logits, -1)[torch.arange(n)[:, None], rows, emitted.clamp(min=0)]
    assert torch.equal(out.logprobs[emitted >= 0], raw[emitted >= 0])
    assert bool((out.logprobs[emitted < 0] == 0).all())
    assert int((out.num_accepted > 0).sum()) > 100
    assert verify_tree(logits, tokens, p, torch.full((n,), 9), SamplingTensors.from_params(params),
                       [None] * n).logprobs is None


# ---------------------------------------------------------------------------------------------
# KV moves.
# ---------------------------------------------------------------------------------------------


def test_kv_moves_by_hand() -> None:
    assert kv_moves([4, 6]) == [(4, 1), (6, 2)]
    assert kv_moves([1, 2]) == []
    assert kv_moves([1, 3]) == [(3, 2)]
    assert kv_moves([7, 9, -1]) == [(7, 1), (9, 2)]  # -1 padding ends the path
    assert kv_moves([]) == []
    with pytest.raises(ValueError):
        kv_moves([3, 3])


def test_kv_moves_in_order_put_every_path_in_place() -> None:
    """Applied in order to a slot array, the moves leave node d of the path at offset d, the
    root untouched; no destination is a later move's source."""
    rng = random.Random(8)
    for _ in range(300):
        parents = random_tree(rng, rng.randint(1, 40))
        node = rng.randrange(len(parents))
        path = sorted(ancestors_or_self(parents, node) - {0})
        moves = kv_moves(path)
        for i, (_, dst) in enumerate(moves):
            assert dst not in [src for src, _ in moves[i + 1 :]]
        slots = list(range(len(parents)))  # slot j holds node j's KV
        for src, dst in moves:
            slots[dst] = slots[src]
        assert slots[: len(path) + 1] == [0] + path
        assert len(moves) == sum(1 for d, j in enumerate(path, 1) if j != d)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    """On the GPU (CPU generators for the seeded rows) the walk gives the CPU's answer: greedy
    rows exactly, sampled rows up to an ulp-level flip of a cumulative sum, rarely."""
    g = torch.Generator().manual_seed(51)
    n, vocab = 2000, 9
    logits = torch.randn(n, SHAPE32.num_nodes + 1, vocab, generator=g)
    tokens = torch.randint(0, vocab, (n, SHAPE32.num_nodes), generator=g)
    tokens[:, 0] = logits[:, 0].argmax(-1)
    parents = torch.tensor(SHAPE32.parents).expand(n, -1)
    num_nodes = torch.full((n,), SHAPE32.num_nodes)
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.9, top_k=6, seed=i) for i in range(n)]

    def run(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        gens = [make_generator(p.seed, 0) for p in params]
        out = verify_tree(logits.to(device), tokens.to(device), parents.to(device), num_nodes.to(device),
                          SamplingTensors.from_params(params, device=device), gens, want_logprobs=True)
        return out.output_token_ids.cpu(), out.accepted_nodes.cpu()

    cpu, gpu = run("cpu"), run("cuda")
    greedy = torch.arange(n) % 2 == 1
    assert torch.equal(cpu[0][greedy], gpu[0][greedy]) and torch.equal(cpu[1][greedy], gpu[1][greedy])
    assert float((cpu[0] == gpu[0]).all(dim=1).float().mean()) > 0.99
