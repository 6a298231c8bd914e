"""Prompt lookup in the engine (stories260K target, a perturbed copy as the draft): drafts
copied from earlier in the sequence leave greedy output equal to the target alone for every K
and the sampled joint of the first two tokens equal to the target's exact one; the lookup
really drafts (its counters), and a sequence with no repeat still gets the model's drafts."""

from __future__ import annotations

from collections import Counter

import pytest

from keyserve import LLM, SamplingParams
from tests.engine.test_speculative_engine import _exact_first_two, _prompts, assert_counts_match


@pytest.fixture(scope="module")
def target(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=400)


@pytest.fixture(scope="module")
def lookup(stories_path: str, draft_dir: str) -> LLM:
    return LLM(stories_path, num_blocks=400, draft=draft_dir, num_speculative_tokens=4,
               prompt_lookup_max=3, prompt_lookup_min=1)


def test_greedy_equals_target_for_every_k(target: LLM, lookup: LLM) -> None:
    """stories260K loops within a few dozen tokens, so most steps draft by lookup; the rest
    (and the first steps of short prompts) by the draft model."""
    prompts = _prompts(12)
    lengths = [40 + (i * 7) % 30 for i in range(12)]
    alone = target.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    drafter = lookup.engine.speculative.drafter
    spec = lookup.engine.speculative
    for k in (1, 2, 4, 6):
        before = drafter.lookup_proposals, spec.stats.num_draft_tokens, drafter.lookup_tokens, spec.lookup_stats.num_draft_tokens
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
                  for n in lengths]
        outs = lookup.generate(prompts, params)
        for a, b in zip(alone, outs):
            assert b.token_ids == a.token_ids, f"K={k}"
        looked = drafter.lookup_proposals - before[0]
        drafted = lookup.engine.speculative.stats.num_draft_tokens - before[1]
        steps = sum(round(o.stats.generated_tokens / o.stats.spec_tokens_per_forward) for o in outs)
        assert 0 < looked < steps, f"K={k}: {looked} lookups in {steps} steps"  # both proposers drafted
        rates = [o.stats.spec_acceptance_rate for o in outs]
        assert 0.0 < sum(rates) / len(rates) < 1.0 and drafted > 0
        # the engine knows which verified drafts were copies (adaptive K leaves them out)
        copied = spec.lookup_stats.num_draft_tokens - before[3]
        assert copied == drafter.lookup_tokens - before[2] and 0 < copied < drafted, f"K={k}"
    engine = lookup.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not drafter.mirrors and not drafter.lookup_index.indexes


def test_a_lookup_draft_is_verified_like_any_other(lookup: LLM) -> None:
    """A prompt that repeats itself: the first speculative step copies what followed the last
    token's earlier occurrence, and the target accepts that copy when it agrees."""
    drafter = lookup.engine.speculative.drafter
    before = drafter.lookup_proposals, drafter.lookup_tokens
    [out] = lookup.generate(["the cat sat on the mat . the cat sat on the mat . the cat sat on the"],
                            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, num_speculative_tokens=4))
    assert drafter.lookup_proposals > before[0] and drafter.lookup_tokens > before[1]
    assert out.stats.spec_accepted_tokens > 0


def test_ngram_alone_greedy_equals_target_for_every_k(target: LLM, stories_path: str) -> None:
    """``draft="ngram"``: no draft model; a sequence drafts only where its last n tokens
    occurred before (stories260K loops, so most steps do after a few dozen tokens), and every
    draft is a copy (the engine counts them all as lookup's). Greedy output equals the target
    alone for every K."""
    llm = LLM(stories_path, num_blocks=400, draft="ngram", num_speculative_tokens=4)
    drafter = llm.engine.speculative.drafter
    assert type(drafter).__name__ == "LookupDrafter" and drafter.lookup_index.sizes == (2, 4)  # the ngram default
    prompts = _prompts(12)
    lengths = [40 + (i * 7) % 30 for i in range(12)]
    alone = target.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    for k in (1, 2, 4, 6):
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
                  for n in lengths]
        outs = llm.generate(prompts, params)
        for a, b in zip(alone, outs):
            assert b.token_ids == a.token_ids, f"K={k}"
        assert sum(o.stats.spec_accepted_tokens for o in outs) > 0
    spec = llm.engine.speculative
    copies, every = spec.lookup_stats, spec.stats
    assert (copies.num_draft_tokens, copies.num_accepted_tokens, copies.num_rejections) == (
        every.num_draft_tokens, every.num_accepted_tokens, every.num_rejections)
    assert every.num_draft_tokens == drafter.lookup_tokens > 0
    # the steps without a match are counted (record_misses), in the engine's tokens per forward
    # as one token each; every speculating step either verified copies or missed
    steps = sum(o.stats.generated_tokens for o in outs)
    assert 0 < spec.num_misses and spec.num_misses + drafter.lookup_proposals >= steps // 6
    assert every.num_steps == copies.num_steps + spec.num_misses
    assert every.num_emitted_tokens == copies.num_emitted_tokens + spec.num_misses
    assert copies.mean_tokens_per_forward > 1.5
    assert not drafter.lookup_index.indexes  # released with their sequences


@pytest.mark.parametrize("ngram", [True, False], ids=["ngram", "lookup-then-draft"])
def test_lookup_aware_adaptive_k_greedy_equals_target(target: LLM, stories_path: str, draft_dir: str,
                                                      ngram: bool) -> None:
    """Adaptive K with prompt lookup: the engine looks each sequence up before choosing its K
    (copies from the copy arm, else the draft model's). Greedy output equals the target alone;
    copies are drafted and verified; with ``draft="ngram"`` no sequence reserves slots the
    lookup cannot fill (the engine's lookup and the drafter's agree: no misses); the engine's
    indexes and copy estimates go with their sequences. Mutation caught: the ``lookup_only``
    early return dropped from ``_adaptive_k`` (sequences without a match reserve K: misses)."""
    llm = LLM(stories_path, num_blocks=400, draft="ngram" if ngram else draft_dir, num_speculative_tokens=4,
              adaptive_k=True, prompt_lookup_max=3, prompt_lookup_min=1)
    prompts = _prompts(12)
    lengths = [40 + (i * 7) % 30 for i in range(12)]
    alone = target.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    for a, b in zip(alone, outs):
        assert b.token_ids == a.token_ids
    spec = llm.engine.speculative
    assert spec.lookup_stats.num_accepted_tokens > 0
    if ngram:
        assert spec.num_misses == 0 and spec.lookup_stats == spec.stats
    assert not spec.matches.indexes and not spec._adaptive_copy and not spec._adaptive


def test_a_sequence_with_draft_slots_and_no_drafts_stays_a_decode_row(target: LLM) -> None:
    """Prompt lookup finds no match: the sequence reserved K draft slots and verifies nothing.
    Its one new token must run as a decode row (the native decode stack on the CPU), not as a
    one-token prefill chunk, which sent the whole step down the prefill path (measured:
    draft="ngram" at 0.79x plain decoding where it drafted little). Mutation caught: the
    ``num_lookahead`` case dropped from ``ModelRunner.prepare``'s ``as_rows``."""
    from keyserve.engine.step_input import StepInput, StepItem

    engine = target.engine
    rid = engine.add_request("once upon a time", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    seq = engine.requests[rid].seqs[0]
    item = StepItem(seq.seq_id, [seq.token_ids[-1]], seq.num_tokens - 1, list(seq.block_table), num_lookahead=3)
    inputs = engine.runner.prepare(StepInput([item], 0))  # placed after the decode items, as the core does
    assert inputs.meta.num_decode_seqs == 1 and inputs.meta.prefill_query_start_loc.tolist() == [0]
    engine.abort(rid)


@pytest.mark.parametrize("ngram", [False, True], ids=["lookup-then-draft", "ngram"])
def test_sampled_with_top_k_top_p_equals_target_exactly(stories_path: str, draft_dir: str, ngram: bool) -> None:
    """Temperature 0.7, top-p 0.9, top-k 50: the first two tokens of 20,480 samples against the
    target's exact joint q(t1)·q(t2 | t1). With n-grams down to one token, the first speculative
    step (which gives t2) drafts by lookup whenever t1 occurred in the prompt: a point-mass
    draft, accepted with probability q(x), else t2 drawn from q without x.

    Power (as test_speculative_engine's): a 0.02 shift in any cell is ≥ 5.7 standard errors,
    each cell is tested at 4.4. Mutation it catches: the copied token's p left at 0 instead of
    1 (every copy with q > 0 accepted): cell (t1, t2) = (286, 261) 29.7 standard errors off.
    With ``draft="ngram"`` (prompt lookup alone, ``LookupDrafter``) the steps that find no
    match verify nothing; every draft is a copy."""
    # 3 tokens: the step after t1 drafts one (a step never drafts past max_tokens)
    params = SamplingParams(n=64, max_tokens=3, temperature=0.7, top_p=0.9, top_k=50, ignore_eos=True,
                            num_speculative_tokens=2)
    llm = LLM(stories_path, num_blocks=1400, max_num_seqs=512, draft="ngram" if ngram else draft_dir,
              num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    # t1 is 'was' half the time, which occurred before ('max was sad'): the copy 'sad' is the
    # target's t2 about one time in eight, so both acceptance and the residual draw are exercised
    prompt = llm.tokenizer.encode("the little dog was happy. one day the big dog named max was sad. the little cat")
    requests = 320
    outs = llm.generate([prompt] * requests, [params.model_copy(update={"seed": i}) for i in range(requests)])
    drafter = llm.engine.speculative.drafter
    n = requests * 64
    assert drafter.lookup_proposals > n // 4  # half the first speculative steps drafted by lookup
    stats = llm.engine.speculative.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if ngram:  # every draft a copy; the engine's steps also count the misses (record_misses)
        spec = llm.engine.speculative
        copies = spec.lookup_stats
        assert (copies.num_draft_tokens, copies.num_accepted_tokens) == (stats.num_draft_tokens,
                                                                         stats.num_accepted_tokens)
        assert stats.num_steps == copies.num_steps + spec.num_misses
    counts = Counter((o.token_ids[0], o.token_ids[1]) for out in outs for o in out.outputs)
    assert sum(counts.values()) == n
    exact = _exact_first_two(stories_path, prompt, params)
    assert set(counts) <= set(exact), f"emitted outside the target's support: {set(counts) - set(exact)}"
    assert len(exact) <= 100
    assert_counts_match(counts, exact, n)
