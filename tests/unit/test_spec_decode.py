"""The rejection sampler emits exactly the target distribution (chi-square over 100k+ draws, one
vectorised call per test), reduces to target-argmax matching when greedy, and counts right."""

from __future__ import annotations

import math

import pytest
import torch

from keyserve.core.spec_decode import (
    PAD_TOKEN_ID,
    AcceptanceStats,
    AdaptiveK,
    expected_speedup,
    expected_tokens,
    rejection_sample,
)
from keyserve.core.sampler import inverse_cdf

N = 100_000  # draws per distribution test
ALPHA = 1e-3  # significance; seeds are fixed, so each test is deterministic


def chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells with zero expected mass must be empty."""
    observed, probs = observed.flatten().double(), probs.flatten().double()
    zero = probs <= 0
    assert observed[zero].sum() == 0, "a token with zero target probability was emitted"
    obs, exp = observed[~zero], probs[~zero] / probs[~zero].sum() * observed.sum()
    try:
        from scipy.stats import chisquare

        return float(chisquare(obs.numpy(), exp.numpy()).pvalue)
    except ImportError:  # regularised upper incomplete gamma via torch
        stat = float(((obs - exp) ** 2 / exp).sum())
        dof = obs.numel() - 1
        return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def dist(*xs: float) -> torch.Tensor:
    t = torch.tensor(xs, dtype=torch.float32)
    return t / t.sum()


# (draft p, target q) over a vocabulary of 5, covering the required corner cases.
CASES = {
    "random": (dist(0.1, 0.3, 0.2, 0.25, 0.15), dist(0.35, 0.05, 0.2, 0.1, 0.3)),
    "draft_mass_where_target_has_none": (dist(0.3, 0.3, 0.2, 0.1, 0.1), dist(0, 0, 0.5, 0.2, 0.3)),
    "zero_prob_draft_tokens": (dist(0.6, 0.4, 0, 0, 0), dist(0.1, 0.2, 0.3, 0.2, 0.2)),
    "disjoint": (dist(1, 1, 0, 0, 0), dist(0, 0, 1, 2, 3)),
    "equal": (dist(0.1, 0.2, 0.3, 0.2, 0.2), dist(0.1, 0.2, 0.3, 0.2, 0.2)),
    "peaked_target": (dist(0.2, 0.2, 0.2, 0.2, 0.2), dist(0.96, 0.01, 0.01, 0.01, 0.01)),
}


def sample_rows(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[..., V] -> [...] draws by inverse CDF (independent of the code under test)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[:-1], generator=g)[..., None] * cdf[..., -1:]
    return (cdf <= u).sum(-1).clamp(max=probs.shape[-1] - 1)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_first_token_distribution_equals_target(case: str, K: int) -> None:
    """Context-free p and q: the first emitted token is distributed as q."""
    p, q = CASES[case]
    g = torch.Generator().manual_seed(1000 * K + len(case))
    # Later positions get other distributions so a mixed-up position index would show.
    draft_probs = torch.stack([p.roll(-t) for t in range(K)]).expand(N, -1, -1)
    target_probs = torch.stack([q] + [q.roll(t) for t in range(1, K + 1)]).expand(N, -1, -1)
    draft_ids = sample_rows(draft_probs, g)
    out = rejection_sample(draft_probs, target_probs, draft_ids, generator=g)
    first = out.output_token_ids[:, 0]
    assert bool((first >= 0).all())
    counts = torch.bincount(first, minlength=5)
    assert chi_square_pvalue(counts, q) > ALPHA, (case, counts)


def markov_pair(p: torch.Tensor, q: torch.Tensor, K: int, start: int, g: torch.Generator,
                explicit: bool) -> torch.Tensor:
    """Generate the first two tokens after ``start`` with speculative sampling, where draft and
    target are Markov chains p(·|prev), q(·|prev) [V, V]. Returns [N, 2]."""

    def one_step(ctx: torch.Tensor) -> torch.Tensor:  # ctx [B] -> output ids [B, K+1]
        B, V = ctx.shape[0], p.shape[0]
        drafts, prev = [], ctx
        for _ in range(K):  # the draft proposes autoregressively
            prev = sample_rows(p[prev], g)
            drafts.append(prev)
        draft_ids = torch.stack(drafts, dim=1)  # [B, K]
        ctxs = torch.cat([ctx[:, None], draft_ids], dim=1)  # [B, K+1] context of each position
        kwargs = {}
        if explicit:
            kwargs = dict(accept_uniforms=torch.rand(B, K, generator=g),
                          draw_uniforms=torch.rand(B, dtype=torch.float64, generator=g))
        else:
            kwargs = dict(generator=g)
        return rejection_sample(p[ctxs[:, :K]], q[ctxs], draft_ids, **kwargs).output_token_ids

    out = one_step(torch.full((N,), start, dtype=torch.long))
    y1, y2 = out[:, 0], out[:, 1].clone()
    short = y2 < 0  # rejected at the first position: the second token comes from a new step
    y2[short] = one_step(y1[short])[:, 0]
    return torch.stack([y1, y2], dim=1)


@pytest.mark.parametrize("K,explicit", [(1, False), (2, True), (3, False), (4, True)])
def test_joint_of_two_tokens_equals_target_chain(K: int, explicit: bool) -> None:
    """Context-dependent p and q: the joint of the first two emitted tokens is q(y1)·q(y2|y1),
    including rows where the draft puts mass where the target has none and vice versa."""
    g = torch.Generator().manual_seed(7 + K + 10 * explicit)
    V = 5
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    q[0, 1] = 0.0  # target has no mass where the draft has some
    p[2, 3] = 0.0  # draft has no mass where the target has some
    p[1] = q[1]  # p == q for one context
    q, p = q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)
    pairs = markov_pair(p, q, K, start=0, g=g, explicit=explicit)
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    joint = q[0][:, None] * q  # [V, V]
    assert chi_square_pvalue(counts, joint) > ALPHA, counts.view(V, V)


def test_chi_square_has_power() -> None:
    """The same harness rejects a sampler that skips the correction (emits the draft token)."""
    p, q = CASES["random"]
    g = torch.Generator().manual_seed(0)
    draft = sample_rows(p.expand(N, -1), g)
    assert chi_square_pvalue(torch.bincount(draft, minlength=5), q) < 1e-12
    near_q = dist(0.36, 0.05, 0.2, 0.1, 0.29)  # off by 0.01 in two cells
    exact = sample_rows(q.expand(N, -1), g)
    assert chi_square_pvalue(torch.bincount(exact, minlength=5), near_q) < ALPHA


def test_inverse_cdf_distribution_and_zero_mass() -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.0, 3.0, 1.0, 0.0, 4.0])  # unnormalised is fine
    u = torch.rand(N, dtype=torch.float64, generator=g)
    u[:10] = 0.0  # extreme uniforms must not pick a zero-probability token
    u[10:20] = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    tok = inverse_cdf(probs.expand(N, -1), u)
    assert chi_square_pvalue(torch.bincount(tok, minlength=5), probs) > ALPHA


def test_greedy_is_exact_target_argmax_matching() -> None:
    g = torch.Generator().manual_seed(5)
    B, K, V = 512, 8, 11
    target_logits = torch.randn(B, K + 1, V, generator=g)
    target_argmax = target_logits.argmax(-1)  # [B, K+1]
    # Drafts agree with the target for a random prefix, then diverge at random.
    draft_ids = target_argmax[:, :K].clone()
    flip = torch.rand(B, K, generator=g) < 0.3
    draft_ids[flip] = (draft_ids[flip] + 1 + torch.randint(0, V - 1, (int(flip.sum()),),
                                                            generator=g)) % V
    num_draft = torch.randint(0, K + 1, (B,), generator=g)
    one_hot_q = torch.nn.functional.one_hot(target_argmax, V).float()
    one_hot_p = torch.nn.functional.one_hot(draft_ids, V).float()
    out = rejection_sample(one_hot_p, one_hot_q, draft_ids, num_draft=num_draft, generator=g)
    for b in range(B):  # loop-based oracle
        n = int(num_draft[b])
        a = 0
        while a < n and int(draft_ids[b, a]) == int(target_argmax[b, a]):
            a += 1
        expect = target_argmax[b, : a + 1].tolist() + [PAD_TOKEN_ID] * (K - a)
        assert out.output_token_ids[b].tolist() == expect
        assert int(out.num_accepted[b]) == a
    # Uniforms of exactly 1 (never produced by torch.rand) still give the target's tokens.
    out1 = rejection_sample(one_hot_p, one_hot_q, draft_ids, torch.ones(B, K),
                            torch.rand(B, dtype=torch.float64, generator=g), num_draft=num_draft)
    emitted = out1.output_token_ids
    assert bool(((emitted == target_argmax) | (emitted == PAD_TOKEN_ID)).all())


def test_accept_rule_hand_made() -> None:
    V = 4
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    p = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]])
    # Row 0: q/p(x̃=0) = 0.5 with r = 0.4 -> accept; then q/p(x̃=2) = 0.6 with r = 0.7 -> reject.
    # Row 1: r = 0.6 -> reject at once. Row 2: x̃ = 1 where p = 0 and q > 0 -> accepted
    # regardless of r, then x̃ = 2 with q = 0 -> rejected even with r = 0.
    draft_probs = torch.stack([p, p, torch.stack([p[0], p[1]])])
    target_probs = torch.stack([q, q, q])
    ids = torch.tensor([[0, 2], [0, 2], [1, 2]])
    target_probs[2, 1] = torch.tensor([0.2, 0.2, 0.0, 0.6])
    r = torch.tensor([[0.4, 0.7], [0.6, 0.0], [0.99, 0.0]])
    u = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = rejection_sample(draft_probs, target_probs, ids, r, u)
    assert out.num_accepted.tolist() == [1, 0, 1]
    # Recovered tokens come from norm(max(0, q − p)): row 0 position 1 -> {0, 1} minus
    # {2, 3}'s excess = [0.1, 0.2, 0, 0]; row 1 position 0 -> token 1 only; row 2 -> not 2.
    assert out.output_token_ids[0, 0] == 0 and int(out.output_token_ids[0, 1]) in (0, 1)
    assert out.output_token_ids[1].tolist() == [1, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert out.output_token_ids[2, 0] == 1 and int(out.output_token_ids[2, 1]) in (0, 1, 3)
    assert out.output_token_ids[:, 2].tolist() == [PAD_TOKEN_ID] * 3


def test_bonus_and_per_sequence_num_draft() -> None:
    """All accepted -> bonus from q at position num_draft; drafts past num_draft are ignored."""
    V, K = 6, 4
    q = torch.eye(V)[[1, 2, 3, 4, 5]]  # one-hot targets: 1, 2, 3, 4, 5
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0], [1, 9, 9, 9], [5, 5, 5, 5]])
    ids = ids.clamp(max=V - 1)
    p = torch.nn.functional.one_hot(ids, V).float()
    out = rejection_sample(p, q.expand(4, -1, -1), ids, num_draft=torch.tensor([4, 2, 1, 0]))
    assert out.num_accepted.tolist() == [4, 2, 1, 0]
    assert out.output_token_ids.tolist() == [
        [1, 2, 3, 4, 5],
        [1, 2, 3, -1, -1],
        [1, 2, -1, -1, -1],
        [1, -1, -1, -1, -1],
    ]
    # K = 0: just a sample from q.
    out0 = rejection_sample(torch.zeros(2, 0, V), q[:1].expand(2, 1, V),
                            torch.zeros(2, 0, dtype=torch.long))
    assert out0.output_token_ids.tolist() == [[1], [1]] and out0.num_accepted.tolist() == [0, 0]


def test_residual_fallback_when_q_equals_p() -> None:
    """A forced rejection with q == p has an all-zero residual: the draw falls back to q."""
    g = torch.Generator().manual_seed(11)
    q = dist(0.1, 0.2, 0.3, 0.4)
    ids = sample_rows(q.expand(N, 1, -1), g)
    out = rejection_sample(q.expand(N, 1, -1), q.expand(N, 2, -1), ids, torch.ones(N, 1),
                           torch.rand(N, dtype=torch.float64, generator=g))
    assert bool((out.num_accepted == 0).all())
    assert chi_square_pvalue(torch.bincount(out.output_token_ids[:, 0], minlength=4), q) > ALPHA


def test_stats_estimate_acceptance_and_tokens_per_forward() -> None:
    """With context-free p, q each draft is accepted w.p. α = Σ min(p, q), independently, so
    α̂ = accepted/tested → α and tokens per forward → 1 + α + … + α^K."""
    p, q = CASES["random"]
    alpha = float(torch.minimum(p, q).sum())
    g = torch.Generator().manual_seed(2)
    K, B = 4, 50_000
    ids = sample_rows(p.expand(B, K, -1), g)
    out = rejection_sample(p.expand(B, K, -1), q.expand(B, K + 1, -1), ids, generator=g)
    stats = AcceptanceStats()
    stats.update(K, out.num_accepted)
    assert stats.num_steps == B and stats.num_draft_tokens == K * B
    assert stats.per_token_acceptance == pytest.approx(alpha, abs=0.01)
    assert stats.mean_tokens_per_forward == pytest.approx(expected_tokens(alpha, K), abs=0.02)
    assert stats.acceptance_rate < stats.per_token_acceptance  # accepted/drafted is biased low
    total = stats + stats
    assert total.num_accepted_tokens == 2 * stats.num_accepted_tokens
    assert total.as_dict()["acceptance_rate"] == pytest.approx(stats.acceptance_rate)


def test_stats_hand_made() -> None:
    s = AcceptanceStats()
    s.update(torch.tensor([3, 3, 2]), torch.tensor([3, 1, 0]))
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_emitted_tokens) == (8, 4, 7)
    assert s.num_rejections == 2 and s.num_steps == 3
    assert s.acceptance_rate == 0.5 and s.per_token_acceptance == pytest.approx(4 / 6)
    assert s.mean_tokens_per_forward == pytest.approx(7 / 3)
    assert AcceptanceStats().acceptance_rate == 0.0


def test_expected_speedup_formula() -> None:
    assert expected_tokens(0.5, 3) == pytest.approx((1 - 0.5**4) / (1 - 0.5))
    assert expected_tokens(1.0, 3) == 4
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)


def test_adaptive_k() -> None:
    ak = AdaptiveK(k_min=1, k_max=8, cost_ratio=0.1)
    best = max(range(1, 9), key=lambda k: expected_speedup(0.7, k, 0.1))
    assert ak.alpha == pytest.approx(0.7) and ak.choose() == best
    for _ in range(60):  # everything accepted -> α → 1 -> the largest K
        ak.observe(torch.full((8,), 4), torch.full((8,), 4))
    assert ak.alpha > 0.99 and ak.choose() == 8
    for _ in range(60):  # everything rejected -> α → 0 (but for the prior's 8 trials) -> the smallest K
        ak.observe(4, torch.zeros(8, dtype=torch.long))
    assert ak.alpha < 0.1
    assert ak.choose() == 1
    off = AdaptiveK(k_min=0, k_max=6, cost_ratio=0.5, prior_alpha=0.3)
    assert off.choose() == 0  # α < c: speculation does not pay
    # A costly draft prefers a smaller K than a cheap one at the same α.
    cheap = AdaptiveK(cost_ratio=0.02, prior_alpha=0.8).choose()
    dear = AdaptiveK(cost_ratio=0.3, prior_alpha=0.8).choose()
    assert dear < cheap
    with pytest.raises(ValueError):
        AdaptiveK(k_min=3, k_max=2)


def test_large_batch_is_one_vectorised_call() -> None:
    """B = 100k, K = 4, V = 16 in one call, in a fraction of a second (no loop over rows)."""
    import time

    g = torch.Generator().manual_seed(0)
    B, K, V = 100_000, 4, 16
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    ids = sample_rows(p, g)
    t0 = time.perf_counter()
    out = rejection_sample(p, q, ids, generator=g)
    assert time.perf_counter() - t0 < 10.0  # a row loop would take minutes
    assert out.output_token_ids.shape == (B, K + 1)
    n = out.num_accepted
    emitted = (out.output_token_ids >= 0).sum(1)
    assert torch.equal(emitted, n + 1)
    assert math.isfinite(float(n.float().mean()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    g = torch.Generator().manual_seed(4)
    B, K, V = 1000, 3, 7
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1)
    ids = sample_rows(p, g)
    r, u = torch.rand(B, K, generator=g), torch.rand(B, V, generator=g)
    nd = torch.randint(0, K + 1, (B,), generator=g)
    a = rejection_sample(p, q, ids, r, u, num_draft=nd)
    b = rejection_sample(p.cuda(), q.cuda(), ids.cuda(), r.cuda(), u.cuda(), num_draft=nd.cuda())
    assert torch.equal(a.num_accepted, b.num_accepted.cpu())  # exact comparisons
    # log() may differ by an ulp across devices: a near-tie in the race could flip, rarely.
    same = (a.output_token_ids == b.output_token_ids.cpu()).all(dim=1).float().mean()
    assert float(same) > 0.99


def test_verify_drafts_greedy_and_sampled_rows_in_one_batch() -> None:
    """The engine's entry: greedy rows reduce to argmax matching (with ragged num_draft), sampled
    rows (temperature, top-k, top-p applied to q inside) emit exactly processed q as their
    first token, both in one call; logprobs are the raw model's at the emitted tokens."""
    from keyserve.core.sampler import SamplingTensors, processed_probs
    from keyserve.core.sampling_params import SamplingParams
    from keyserve.core.spec_decode import verify_drafts

    torch.manual_seed(9)
    g = torch.Generator().manual_seed(9)
    B, K, V = 40_000, 3, 6
    greedy = torch.arange(B) % 2 == 0
    base = torch.randn(K + 1, V, generator=g) * 1.5  # context-free target logits, one per position
    logits = base.expand(B, -1, -1).clone()
    sampled_params = SamplingParams(temperature=0.7, top_p=0.9, top_k=4)
    params = [SamplingParams(temperature=0.0) if bool(gr) else sampled_params for gr in greedy]
    st = SamplingTensors.from_params(params)
    p = torch.softmax(torch.randn(K, V, generator=g), -1)  # a draft that disagrees often
    draft_probs = p.expand(B, -1, -1).clone()
    ids = sample_rows(draft_probs, g)
    draft_probs[greedy] = torch.nn.functional.one_hot(ids[greedy], V).float()  # what a greedy draft sends
    num_draft = torch.randint(0, K + 1, (B,), generator=g)
    out = verify_drafts(logits, ids, num_draft, st, [None] * B, draft_probs, want_logprobs=True)
    argmax = base.argmax(-1)
    rows = greedy.nonzero().flatten()[:500]
    for b in rows.tolist():  # loop-based oracle for the greedy rows
        n, a = int(num_draft[b]), 0
        while a < n and int(ids[b, a]) == int(argmax[a]):
            a += 1
        assert out.output_token_ids[b].tolist() == argmax[: a + 1].tolist() + [PAD_TOKEN_ID] * (K - a)
    q0 = processed_probs(base[:1], SamplingTensors.from_params([sampled_params]))[0]
    first = out.output_token_ids[~greedy, 0]
    assert chi_square_pvalue(torch.bincount(first, minlength=V), q0) > ALPHA
    emitted = out.output_token_ids
    lp = torch.log_softmax(logits, -1).gather(-1, emitted.clamp(min=0)[..., None])[..., 0]
    assert torch.equal(out.logprobs[emitted >= 0], lp[emitted >= 0])
    # All greedy: no draft probabilities needed, the same tokens.
    g_out = verify_drafts(logits[greedy], ids[greedy], num_draft[greedy],
                          SamplingTensors.from_params([params[0]] * int(greedy.sum())), [None] * int(greedy.sum()))
    assert torch.equal(g_out.output_token_ids, out.output_token_ids[greedy])


def test_a_seeded_row_verifies_alike_whatever_its_neighbours_draft() -> None:
    """Each seeded row draws its accept uniforms from its own generator, and only as many as it
    has drafts: batched beside a row drafting 4, a row with 2 drafts emits what it emits alone,
    and its generator ends in the same state (so its later steps match too). Found by a
    hostile-input sweep: it drew the batch's widest count, which shifted every later draw."""
    from keyserve.core.sampler import SamplingTensors, make_generator
    from keyserve.core.sampling_params import SamplingParams
    from keyserve.core.spec_decode import verify_drafts

    V = 7
    g = torch.Generator().manual_seed(11)
    mine_logits = torch.randn(1, 3, V, generator=g)  # 2 drafts + the bonus row
    mine_ids = torch.randint(0, V, (1, 2), generator=g)
    mine_p = torch.softmax(torch.randn(1, 2, V, generator=g), -1)
    other_logits = torch.randn(1, 5, V, generator=g)
    other_ids = torch.randint(0, V, (1, 4), generator=g)
    other_p = torch.softmax(torch.randn(1, 4, V, generator=g), -1)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(batched: bool) -> tuple[list[int], int, torch.Tensor]:
        gen = make_generator(1234, 0)
        if not batched:
            st = SamplingTensors.from_params([params])
            out = verify_drafts(mine_logits, mine_ids, torch.tensor([2]), st, [gen], mine_p)
        else:
            pad = torch.nn.functional.pad
            logits = torch.cat([pad(mine_logits, (0, 0, 0, 2)), other_logits])
            ids = torch.cat([pad(mine_ids, (0, 2)), other_ids])
            probs = torch.cat([pad(mine_p, (0, 0, 0, 2)), other_p])
            st = SamplingTensors.from_params([params, SamplingParams(temperature=1.0, seed=99)])
            out = verify_drafts(logits, ids, torch.tensor([2, 4]), st, [gen, make_generator(99, 0)], probs)
        n = int(out.num_accepted[0])
        return out.output_token_ids[0, : n + 1].tolist(), n, torch.rand(4, generator=gen)

    for _ in range(20):
        alone, batched = run(False), run(True)
        assert alone[:2] == batched[:2] and torch.equal(alone[2], batched[2])
        mine_ids = torch.randint(0, V, (1, 2), generator=g)  # another case
