"""The engine's speculative policy (``engine.speculative.SpeculativeDecoder``) with adaptive K,
driven by hand (no model, no drafter: it only decides how many drafts): plain baseline steps
first, the measured cost then decides, and steps whose cost is not what a steady K costs (a
draft catching up, a probe) stay out of the cost model. Each test names the mutation it
catches."""

from __future__ import annotations

import pytest

from keyserve.config import SpeculativeConfig
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.sequence import Sequence
from keyserve.engine.speculative import SpeculativeDecoder

MAX_LEN = 10_000


def _seqs(n: int) -> list[Sequence]:
    out = []
    for i in range(n):
        seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1000, temperature=0.0))  # greedy, as the costs below
        seq.output_token_ids.append(5)  # decoding
        out.append(seq)
    return out


def _policy(k: int = 4) -> SpeculativeDecoder:
    cfg = SpeculativeConfig(num_speculative_tokens=k, adaptive_k=True)
    return SpeculativeDecoder(None, cfg, cost_ratio=0.05)


def test_baseline_first_then_the_measured_cost_decides() -> None:
    """Two plain steps (the baseline), then the 0.05 prior lets it draft; once the measured K
    step costs 5× a plain one, K = 0 for every sequence. Mutation caught: the
    ``wants_plain`` early return in ``lookaheads`` dropped (no baseline: the prior rules
    forever, since every step drafts)."""
    policy, seqs = _policy(), _seqs(4)
    for _ in range(2):
        assert policy.lookaheads(seqs, MAX_LEN) == {}
        policy.observe_step(4, 0, 1.0)
    wanted = policy.lookaheads(seqs, MAX_LEN)
    assert wanted and all(k > 0 for k in wanted.values())
    for _ in range(4):
        k = max(policy.lookaheads(seqs, MAX_LEN).values(), default=0)
        policy.observe_step(4, k, 1.0 + 4.0 * k)
    assert policy.lookaheads(seqs, MAX_LEN) == {}
    assert policy.costs.relative_cost(1, 4) > 2.0


def test_catch_up_and_probe_steps_stay_out_of_the_cost_model() -> None:
    """The first drafting step after not drafting (the draft catches up on its prompt or what
    it missed) is not a steady K's cost: it is not recorded; the next one is. Mutation caught:
    ``if k and (adaptive.last_was_probe or not self._last_k.get(seq.seq_id))`` → ``if False``
    (a catch-up step's cost would count as K's)."""
    policy, seqs = _policy(), _seqs(1)
    for _ in range(2):
        policy.lookaheads(seqs, MAX_LEN)
        policy.observe_step(1, 0, 1.0)
    k = policy.lookaheads(seqs, MAX_LEN)[seqs[0].seq_id]
    policy.observe_step(1, k, 50.0)  # the catch-up: left out
    assert k not in policy.costs.estimates(1)
    k2 = policy.lookaheads(seqs, MAX_LEN)[seqs[0].seq_id]
    policy.observe_step(1, k2, 1.2)
    assert policy.costs.estimates(1)[k2] == 1.2


def test_not_adaptive_records_nothing_and_k_is_fixed() -> None:
    """Without adaptive K the policy drafts K for everyone every step and keeps no costs.
    Mutation caught: ``if self.config.adaptive_k and seqs and self.costs.wants_plain(...)`` →
    ``if seqs and ...`` (fixed K would lose its first steps to a baseline it never uses)."""
    cfg = SpeculativeConfig(num_speculative_tokens=3)
    policy, seqs = SpeculativeDecoder(None, cfg, cost_ratio=0.05), _seqs(2)
    for _ in range(3):
        assert set(policy.lookaheads(seqs, MAX_LEN).values()) == {3}
        policy.observe_step(2, 3, 1.0)
    assert policy.costs.estimates(2) == {}


def test_new_sequences_start_from_the_engines_acceptance() -> None:
    """A sequence's first K comes from what this engine's drafts have been accepted at, not
    from a fixed optimistic prior. With a measured K-step cost of 1 + 0.25·K: at the default
    prior (0.7) a new sequence drafts 2 (2.19 tokens per 1.5 cost); after 40 verifications
    accepted 30 % of the time a new one drafts 1 (1.30 tokens per 1.25 beats 1.39 per 1.5).
    The sequence that started at the default prior follows the engine too (its prior is the
    engine's acceptance at every step). Mutations caught: ``adaptive.prior_alpha =
    self.prior_alpha()`` dropped from ``lookahead`` (both the fresh and the running sequence
    draft 2 again)."""
    policy, seqs = _policy(k=4), _seqs(1)
    for _ in range(2):
        policy.lookaheads(seqs, MAX_LEN)
        policy.observe_step(1, 0, 1.0)
    for k in (1, 2, 3, 4, 1, 2, 3, 4):
        policy.costs.record(1, k, 1.0 + 0.25 * k)
    assert [policy.costs.relative_cost(k, 1) for k in (1, 4)] == [1.25, 2.0]
    assert policy.prior_alpha() == 0.7
    assert policy.lookaheads(seqs, MAX_LEN)[seqs[0].seq_id] == 2
    for i in range(40):  # another request's verifications, 3 in 10 accepted
        policy.record("other", 99, 1, int(i % 10 < 3))
    assert abs(policy.prior_alpha() - 0.3) < 0.05
    fresh = _seqs(2)[1]
    fresh.seq_id = 12345
    assert policy.lookaheads([fresh], MAX_LEN)[fresh.seq_id] == 1
    assert policy.lookaheads(seqs, MAX_LEN)[seqs[0].seq_id] == 1  # the one started at 0.7 too


def _costly_drafts(policy: SpeculativeDecoder, seqs: list[Sequence]) -> None:
    """Plain baseline steps, then measured K-step costs of 1 + 0.6 K at batch 1 (K = 1 pays only
    above α ≈ 0.6)."""
    for _ in range(2):
        policy.lookaheads(seqs, MAX_LEN)
        policy.observe_step(1, 0, 1.0)
    for k in (1, 2, 1, 2):
        policy.costs.record(1, k, 1.0 + 0.6 * k)


def test_copied_drafts_count_in_the_stats_but_not_in_adaptive_k() -> None:
    """Prompt lookup's copies are accepted more often than the model's drafts and cost no
    draft forward: a sequence whose model drafts fail while its copies are all accepted keeps
    its K from the model's acceptance (here 0: a K = 1 step costs 1.6 plain ones), and so does
    the engine's prior for new sequences; the engine and request totals count both, the lookup
    part apart. Mutation caught: the ``if copied: ... return`` in ``record`` dropped (the
    copies lift α from ~0.1 to ~0.5 and the sequence drafts again)."""
    policy, seqs = _policy(k=2), _seqs(1)
    seq = seqs[0]
    _costly_drafts(policy, seqs)
    assert policy.lookaheads(seqs, MAX_LEN) == {seq.seq_id: 1}  # the default prior (0.7) pays
    for i in range(60):  # alternate steps: a failed model draft, two accepted copies
        if i % 2:
            policy.record(seq.request_id, seq.seq_id, 2, 2, copied=True)
        else:
            policy.record(seq.request_id, seq.seq_id, 1, int(i % 20 == 0))
    assert policy.prior_alpha() < 0.15
    assert policy.lookaheads(seqs, MAX_LEN) == {}  # the model's 0.1 does not pay at 1 + 0.6 K
    assert policy._adaptive[seq.seq_id].alpha < 0.15
    lookup, total = policy.lookup_stats, policy.stats
    assert (lookup.num_draft_tokens, lookup.num_accepted_tokens) == (60, 60)
    assert (total.num_draft_tokens, total.num_accepted_tokens) == (90, 63)
    assert policy.request_stats[seq.request_id] == total


def _looping_seq(seq_id: int) -> Sequence:
    """A decoding sequence whose last n tokens (2 to 4) occurred before: prompt lookup offers
    four copies (the tokens after the earlier [4, 1, 2, 3])."""
    seq = Sequence(f"loop{seq_id}", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=1000, temperature=0.0))
    seq.output_token_ids.append(3)
    seq.seq_id = seq_id
    return seq


def test_with_ngram_alone_the_copies_are_what_adaptive_k_learns_from() -> None:
    """``draft="ngram"``: every draft is a copy, so adaptive K must learn from them (else α
    sits at the prior forever and K never drops to 0 where copies do not pay). Copies accepted
    1 time in 10 at a K-step cost of 1 + 0.6 K: K = 0. Mutation caught: ``copy=copied``
    dropped from ``record``'s ``adapt`` (the copy arm keeps the prior's 0.7 and drafts on)."""
    cfg = SpeculativeConfig(draft="ngram", num_speculative_tokens=2, adaptive_k=True)
    policy, seq = SpeculativeDecoder(None, cfg, cost_ratio=0.0), _looping_seq(7)
    _costly_drafts(policy, [seq])
    assert policy.lookaheads([seq], MAX_LEN) == {seq.seq_id: 1}
    for i in range(40):
        policy.record(seq.request_id, seq.seq_id, 1, int(i % 10 == 0), copied=True)
    assert policy.lookaheads([seq], MAX_LEN) == {}
    assert policy.lookup_stats == policy.stats


def test_lookup_aware_k_with_ngram_asks_only_where_a_match_exists() -> None:
    """``draft="ngram"``, adaptive K: the engine looks the sequence up before choosing K, so a
    sequence without a match asks for no draft slots (nothing to propose: it decodes plainly
    and no miss is counted), and one with a match drafts from the copies' acceptance, never
    more than the copies on offer. Mutations caught: the ``lookup_only`` early return dropped
    from ``_adaptive_k`` (the sequence without a match reserves K again); the ``min(k,
    copies)`` cap dropped (K = 6 where 4 copies exist)."""
    cfg = SpeculativeConfig(draft="ngram", num_speculative_tokens=6, adaptive_k=True)
    policy = SpeculativeDecoder(None, cfg, cost_ratio=0.0)
    looping, plain = _looping_seq(7), _seqs(1)[0]
    for _ in range(2):  # the plain baseline, then copies that cost nothing extra
        policy.lookaheads([looping, plain], MAX_LEN)
        policy.observe_step(2, 0, 1.0)
    for k in (1, 2, 3, 4):
        policy.costs.record(2, k, 1.0)
    assert policy.lookaheads([looping, plain], MAX_LEN) == {looping.seq_id: 4}
    assert policy.num_misses == 0 and set(policy.matches.indexes) == {looping.seq_id, plain.seq_id}
    policy.release(looping)
    assert set(policy.matches.indexes) == {plain.seq_id}


def _cheap_copies(policy: SpeculativeDecoder) -> None:
    """Measured copy-step costs of 1 + 0.1 K at batch 1 (one sequence, all its drafts copies)."""
    for k in (1, 2, 3, 1, 2, 3):
        policy.observe_step(1, k, 1.0 + 0.1 * k, drafting=1, copies=1)


def test_lookup_aware_k_chooses_copies_apart_from_the_draft_model() -> None:
    """A draft model with prompt lookup first, adaptive K: the model's drafts fail (α ~0.1 at a
    K-step cost of 1 + 0.6 K: K = 0), copies are all accepted and their steps cost 1 + 0.1 K
    (no draft forward). Where lookup has a match the sequence drafts from the copy arm (K =
    3); where it has none, from the model's (K = 0); a step whose drafts were all copies is
    the copies' cost, not the model's. Mutations caught: ``matches.peek`` ignored (every
    sequence on the model's arm: K = 0 at the match); ``copy=copied`` dropped from ``record``
    (copies lift the model's α: the sequence without a match drafts); ``observe_step`` putting
    copy steps in ``costs`` (a K = 3 model step would read at 1.3x)."""
    cfg = SpeculativeConfig(num_speculative_tokens=3, adaptive_k=True, prompt_lookup_max=4)
    policy = SpeculativeDecoder(None, cfg, cost_ratio=0.05)
    looping, plain = _looping_seq(7), _seqs(1)[0]
    _costly_drafts(policy, [plain])
    _cheap_copies(policy)
    assert policy.copy_costs.relative_cost(3, 1) == pytest.approx(1.3)
    assert policy.costs.relative_cost(3, 1) == pytest.approx(2.8)
    for i in range(60):
        policy.record(plain.request_id, plain.seq_id, 1, int(i % 10 == 0))
        policy.record(looping.request_id, looping.seq_id, 3, 3, copied=True)
    assert policy.lookaheads([plain], MAX_LEN) == {}
    assert policy.lookaheads([looping], MAX_LEN) == {looping.seq_id: 3}
    assert policy.prior_alpha() < 0.15 and policy.prior_alpha(copy=True) > 0.95


def test_a_model_step_after_copies_is_a_catch_up() -> None:
    """A copy step runs no draft forward, so the draft model's next drafting step for that
    sequence catches up on the copied tokens: its cost stays out of the cost model (the copy
    step's own cost is steady and counts, as the copies'). Mutation caught: the copy branch of
    ``_adaptive_k`` leaving ``_last_k`` alone (the catch-up read as K = 1's cost)."""
    cfg = SpeculativeConfig(num_speculative_tokens=3, adaptive_k=True, prompt_lookup_max=4)
    policy, seq = SpeculativeDecoder(None, cfg, cost_ratio=0.05), _seqs(1)[0]  # [1, 2, 3, 5]: no match
    _costly_drafts(policy, [seq])
    _cheap_copies(policy)
    for _ in range(2):  # the model drafts (its first step a catch-up), then steadily
        assert policy.lookaheads([seq], MAX_LEN) == {seq.seq_id: 1}
        policy.observe_step(1, 1, 1.6, drafting=1)
    seq.output_token_ids += [1, 2]  # [1, 2] occurred before: copies
    assert policy.lookaheads([seq], MAX_LEN) == {seq.seq_id: 3}
    before = policy.copy_costs.estimates(1)[3]
    policy.observe_step(1, 3, 1.6, drafting=1, copies=1)
    assert policy.copy_costs.estimates(1)[3] > before  # a copy step's cost counts
    seq.output_token_ids.append(99)  # no match any more: the draft model drafts, catching up
    before_model = policy.costs.estimates(1)
    assert policy.lookaheads([seq], MAX_LEN) == {seq.seq_id: 1}
    policy.observe_step(1, 1, 50.0, drafting=1)
    assert policy.costs.estimates(1) == before_model


def test_misses_are_counted_and_change_no_estimate() -> None:
    """A sequence that reserved draft slots and got none (fixed K with ngram: no match; a
    draft model: its pool full, or unsure of its first draft) is counted, as a target forward
    of one token in the engine's and its request's tokens per forward, and no acceptance
    estimate moves (adaptive K asks for copies only where a match exists)."""
    policy, seq = _policy(k=2), _seqs(1)[0]
    policy.record(seq.request_id, seq.seq_id, 2, 2)  # one verification: 3 tokens
    policy.record_misses([seq.request_id, seq.request_id, "other"])
    assert policy.num_misses == 3
    assert policy._engine_alpha.tested == 2.0 and policy._engine_copy_alpha.tested == 0.0
    assert policy.stats.num_draft_tokens == 2 and policy.stats.num_steps == 4
    assert policy.stats.mean_tokens_per_forward == 6 / 4
    assert policy.request_stats[seq.request_id].mean_tokens_per_forward == 5 / 3
    assert policy.request_stats["other"].mean_tokens_per_forward == 1.0

class _TreeDrafter:
    """What the policy reads of a drafter: whether it drafts trees (no model behind it)."""

    supports_trees = True


def _tree_policy(shape: str = "3x2") -> SpeculativeDecoder:
    cfg = SpeculativeConfig(num_speculative_tokens=4, adaptive_k=True, speculative_tree=shape)
    return SpeculativeDecoder(_TreeDrafter(), cfg, cost_ratio=0.05)  # type: ignore[arg-type]


def _tree_steps(policy: SpeculativeDecoder, seqs: list[Sequence], seconds: float, accepted: int,
                steps: int) -> None:
    """``steps`` decode steps: every sequence verifying the tree gets ``accepted`` of its levels,
    and a step with trees in it takes ``seconds`` (a plain one 1.0)."""
    for _ in range(steps):
        wanted = policy.lookaheads(seqs, MAX_LEN)
        trees = [s for s in seqs if s.seq_id in policy.trees]
        for seq in trees:
            policy.record(seq.request_id, seq.seq_id, wanted[seq.seq_id], accepted, policy.trees[seq.seq_id][1:])
        policy.observe_step(len(seqs), max(wanted.values(), default=0), seconds if trees else 1.0,
                            drafting=len(trees), trees=len(trees))


def test_adaptive_trees_verify_while_they_pay_and_stop_when_they_cost_more() -> None:
    """Adaptive K with a tree: after the plain baseline every sequence verifies the tree (9
    nodes of a 3x2), the tree steps' cost goes to the trees' own cost model (not the chains',
    keyed by K = 9 or any K), and when tree steps cost 3x a plain step while one level in two
    is accepted (1.75 tokens per step under the model) every sequence decodes plainly. At 1.3x
    they keep the tree. Mutations caught: ``_tree_pays`` dropped from ``lookahead`` (trees at
    any cost), tree steps recorded into ``costs`` (the chains' model), the ``tree_costs`` plain
    baseline not recorded (the trees' model stays on its prior)."""
    cheap, dear = _tree_policy(), _tree_policy()
    for policy, seconds in ((cheap, 1.3), (dear, 3.0)):
        seqs = _seqs(2)
        for _ in range(2):
            assert policy.lookaheads(seqs, MAX_LEN) == {}  # the baseline of both models
            policy.observe_step(2, 0, 1.0)
        assert policy.lookaheads(seqs, MAX_LEN) == {s.seq_id: 9 for s in seqs}  # the prior says trees pay
        _tree_steps(policy, seqs, seconds, accepted=1, steps=12)
        assert policy.costs.estimates(2) == {0: 1.0}
        assert abs(policy.tree_costs.estimates(2)[2] - seconds) < 1e-9  # keyed by the tree's depth
    assert abs(cheap.prior_alpha(tree=True) - 0.5) < 0.05 and cheap.prior_alpha() == 0.7
    assert set(cheap.lookaheads(_seqs(2), MAX_LEN).values()) == {9}
    assert dear.lookaheads(_seqs(2), MAX_LEN) == {}


def test_a_trees_acceptance_counts_levels_not_nodes() -> None:
    """A 3x2 tree step that accepted 2 tokens went all the way down: 2 levels tested, none
    failed, where 9 drafts would read 7 untested (a failure). So the trees' α is 1.0 after
    such steps, and 0.5 after steps that accepted 1 (one level passed, one failed); a chain's
    estimate (``_engine_alpha``) is untouched. The request's statistics still count nodes (what
    was drafted). Mutation caught: ``record`` feeding ``adapt`` with ``num_draft`` (α 2/3)."""
    policy = _tree_policy()
    parents = list(policy.tree.parents[1:])  # type: ignore[union-attr]
    for _ in range(20):
        policy.record("r", 7, 9, 2, parents)
    assert abs(policy.prior_alpha(tree=True) - 1.0) < 1e-9
    assert policy.prior_alpha() == 0.7
    assert policy.stats.num_draft_tokens == 180 and policy.stats.num_accepted_tokens == 40
    other = _tree_policy()
    for _ in range(20):
        other.record("r", 7, 9, 1, parents)
    assert abs(other.prior_alpha(tree=True) - 0.5) < 1e-9


def test_the_guard_stops_speculation_that_delivers_less_than_plain_decoding() -> None:
    """A stream of short requests: every step one sequence is new, so its first drafting step
    (the draft reads its prompt) makes every step a catch-up, which the cost model leaves out;
    it never measures K and its prior (1 + 0.05·K) keeps every sequence drafting. The steps
    take 3 s against 1 s plain and accept one draft per sequence: 8 tokens per 3 s against 4
    per 1 s. The guard (``core.spec_guard``) sees the outcome: after its 16 drafting steps it
    turns speculation off at this batch size, with the plain steps going to both baselines.
    Mutation caught: ``or self.guard.blocks(len(seqs), sampled)`` dropped from ``lookaheads``
    (drafting every one of the 40 steps)."""
    policy = _policy(k=2)
    drafting_steps, plain_steps = _request_stream(policy, seconds=3.0, accepted=1)
    assert 2 not in policy.costs.estimates(4) and 1 not in policy.costs.estimates(4)  # never measured
    assert policy.guard.losses(4) == 1
    assert drafting_steps == 16 and plain_steps == 24  # 2 baseline steps, then 16 drafting, then blocked


def test_the_guard_counts_accepted_drafts_as_delivered_tokens() -> None:
    """The same stream where a drafting step takes 1.5 s and every draft is accepted: 4 + 8
    tokens per 1.5 s against 4 per 1 s pays, so the guard never turns speculation off.
    Mutations caught: ``batch + accepted`` → ``batch`` in ``observe_step``, and
    ``self._step_accepted += num_accepted`` dropped from ``record`` (both read 4 tokens per
    1.5 s, a loss)."""
    policy = _policy(k=2)
    drafting_steps, plain_steps = _request_stream(policy, seconds=1.5, accepted=2)
    assert policy.guard.losses(4) == 0
    assert drafting_steps == 38 and plain_steps == 2
    assert policy.guard.speedup(4) == pytest.approx(12 / 1.5 / 4)


def _request_stream(policy: SpeculativeDecoder, seconds: float, accepted: int) -> tuple[int, int]:
    """40 steps of 4 sequences, one of them new every step (short requests arriving): a step
    that drafts takes ``seconds`` and every drafting sequence has ``accepted`` drafts
    accepted; a plain one takes 1 s. Returns (drafting steps, plain steps)."""
    seqs = _seqs(4)
    next_id = 1000
    drafting_steps = plain_steps = 0
    for _ in range(40):
        fresh = _seqs(1)[0]
        fresh.seq_id, next_id = next_id, next_id + 1
        policy.forget(seqs[0].seq_id)
        seqs = seqs[1:] + [fresh]
        wanted = policy.lookaheads(seqs, MAX_LEN)
        for seq in seqs:
            if seq.seq_id in wanted:
                policy.record(seq.request_id, seq.seq_id, wanted[seq.seq_id], min(accepted, wanted[seq.seq_id]))
        k = max(wanted.values(), default=0)
        policy.observe_step(4, k, seconds if k else 1.0, drafting=len(wanted))
        drafting_steps += bool(k)
        plain_steps += not k
    return drafting_steps, plain_steps


def _batch8_copy_costs(policy: SpeculativeDecoder) -> None:
    """Batch 8, prompt lookup alone: plain steps 80 ms; a step in which all 8 sequences copy K
    costs 80 + 10 (once) + 8 K x 1 ms (per drafted row). Per sequence K = 1 then looks cheap
    (1.225x plain for 8 tokens' worth of chances), while a lone copier pays the 10 ms alone."""
    for _ in range(3):
        policy.observe_step(8, 0, 0.080)
    for i in range(12):
        k = 1 + i % 3
        policy.observe_step(8, k, 0.090 + 0.008 * k, drafting=8, copies=8, rows=8 * k)


def test_a_partly_drafting_step_is_weighed_as_a_whole() -> None:
    """Each sequence chooses K against a step where every sequence drafts (the fixed part shared
    by 8); in a step where only some draft, they pay it alone. One copier at α = 0.5 choosing
    K = 2 would gain 0.75 tokens (7.5 ms at 10 ms a token) for 10 + 2 ms: the step decodes plainly, its
    sequence marked as having skipped. Two copiers at α = 0.9 gain ~4.9 tokens for 16 ms: they
    draft. Mutations caught: the check in ``lookaheads`` dropped (the lone copier drafts);
    ``_step_pays`` counting E[tokens] instead of the extra tokens (the lone copier's 1.75
    tokens read as 17.5 ms > 12: it drafts)."""
    cfg = SpeculativeConfig(draft="ngram", num_speculative_tokens=3, adaptive_k=True)
    policy = SpeculativeDecoder(None, cfg, cost_ratio=0.0)
    _batch8_copy_costs(policy)
    assert policy.copy_costs.extra_seconds(3, 8) == pytest.approx(0.013)
    lone, others = _looping_seq(100), _seqs(7)
    for _ in range(30):
        policy.record(lone.request_id, lone.seq_id, 3, 1, copied=True)  # α = 0.5
    assert policy.lookaheads([lone, *others], MAX_LEN) == {}
    assert policy.num_unpaid_steps == 1 and policy._last_k[lone.seq_id] == 0
    policy.step_check = False  # the sequence's own choice, which the check overrode
    assert policy.lookaheads([lone, *others], MAX_LEN) == {lone.seq_id: 2}
    policy.step_check = True
    good = [_looping_seq(200), _looping_seq(201)]
    for seq in good:
        for i in range(30):
            policy.record(seq.request_id, seq.seq_id, 3, 3 if i % 10 else 0, copied=True)
    assert policy.lookaheads([*good, *others[:6]], MAX_LEN) == {good[0].seq_id: 3, good[1].seq_id: 3}
    assert policy.num_unpaid_steps == 1


def test_the_step_check_waits_for_its_fit_and_spares_full_steps() -> None:
    """Before ``min_fit`` drafting steps were measured the sequences' own choices stand; a step
    in which every sequence drafts is each sequence's own choice (the per-K means measure
    exactly that step). Mutations caught: ``_step_pays`` treating an unfitted model as "does
    not pay" (nothing ever drafts, so nothing is ever fitted); ``len(wanted) < len(seqs)``
    dropped (full steps vetoed by the lone-drafter reading)."""
    cfg = SpeculativeConfig(draft="ngram", num_speculative_tokens=3, adaptive_k=True)
    policy = SpeculativeDecoder(None, cfg, cost_ratio=0.0)
    for _ in range(3):
        policy.observe_step(8, 0, 0.080)
    lone, others = _looping_seq(100), _seqs(7)
    for _ in range(30):
        policy.record(lone.request_id, lone.seq_id, 3, 1, copied=True)
    assert policy.lookaheads([lone, *others], MAX_LEN) == {lone.seq_id: 3}  # the prior cost: no fit yet
    _batch8_copy_costs(policy)
    loopers = [_looping_seq(300 + i) for i in range(8)]
    for seq in loopers:
        for _ in range(30):
            policy.record(seq.request_id, seq.seq_id, 3, 1, copied=True)
    wanted = policy.lookaheads(loopers, MAX_LEN)
    assert set(wanted) == {seq.seq_id for seq in loopers} and min(wanted.values()) > 0
    assert policy.num_unpaid_steps == 0


def test_at_batch_1_the_measured_step_decides_not_the_fit() -> None:
    """A step in which every sequence drafts is exactly what the per-K means measured, so the
    sequences' choices stand there even where the fixed + per-row line disagrees. At batch 1,
    K = 1 / 2 / 3 steps cost +20 / +1 / +1 ms over a 10 ms plain step: the means pick K = 3
    for copies accepted 3 times in 10 (1.42 tokens for 1.1x); the line (slope clamped at 0)
    reads every drafting step at +7.3 ms, more than the 0.42 extra tokens are worth. Mutation
    caught: ``len(wanted) < len(seqs)`` dropped from the check (the step decodes plainly)."""
    cfg = SpeculativeConfig(draft="ngram", num_speculative_tokens=3, adaptive_k=True)
    policy = SpeculativeDecoder(None, cfg, cost_ratio=0.0)
    for _ in range(3):
        policy.observe_step(1, 0, 0.010)
    for _ in range(3):
        for k, extra in ((1, 0.020), (2, 0.001), (3, 0.001)):
            policy.observe_step(1, k, 0.010 + extra, drafting=1, copies=1, rows=k)
    seq = _looping_seq(7)
    for i in range(40):
        policy.record(seq.request_id, seq.seq_id, 1, int(i % 10 < 3), copied=True)
    assert policy.copy_costs.extra_seconds(3, 1) > 0.0042
    assert policy.lookaheads([seq], MAX_LEN) == {seq.seq_id: 3}
    assert policy.num_unpaid_steps == 0
