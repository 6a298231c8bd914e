"""Which sequences take extra decode steps in a multi-step round (pure logic, milliseconds)."""

from __future__ import annotations

from keyserve.core.kv_policy import KVBudget, KVPolicy
from keyserve.core.multi_step import multi_step_lookahead
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.sequence import Sequence


def _decoding(prompt: int = 5, generated: int = 3, max_tokens: int = 100) -> Sequence:
    """A sequence past its prompt whose KV is computed up to its last token."""
    seq = Sequence("r", list(range(prompt)), SamplingParams(max_tokens=max_tokens))
    seq.output_token_ids = list(range(generated))
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_off_or_empty_is_a_single_step() -> None:
    assert multi_step_lookahead([_decoding()], 1, 2048, 64) is None
    assert multi_step_lookahead([], 4, 2048, 64) is None


def test_steady_decoders_take_n_minus_1_extra_steps() -> None:
    a, b = _decoding(), _decoding(prompt=9)
    assert multi_step_lookahead([a, b], 4, 2048, 64) == {a.seq_id: 3, b.seq_id: 3}


def test_a_sequence_with_prompt_work_makes_the_round_a_single_step() -> None:
    steady = _decoding()
    prompt = Sequence("p", [1, 2, 3], SamplingParams(max_tokens=10))  # no token yet
    assert multi_step_lookahead([steady, prompt], 4, 2048, 64) is None
    recompute = _decoding()
    recompute.num_computed_tokens = 0  # preempted: its whole stream is recomputed first
    assert multi_step_lookahead([steady, recompute], 4, 2048, 64) is None


def test_a_prompt_queued_behind_full_seats_does_not_stop_the_rounds() -> None:
    """A batch job's queue: while every seat is taken nothing can start, so the rounds run;
    once a seat is free the queued prompt could start, so the round is a single step."""
    a, b = _decoding(), _decoding()
    queued = Sequence("q", [1, 2, 3], SamplingParams(max_tokens=10))
    assert multi_step_lookahead([a, b, queued], 4, 2048, 2) == {a.seq_id: 3, b.seq_id: 3}
    assert multi_step_lookahead([a, queued], 4, 2048, 2) is None
    prefilling = Sequence("p", list(range(40)), SamplingParams(max_tokens=10))
    prefilling.num_computed_tokens = 16  # a chunked prompt part way in: it runs every step
    assert multi_step_lookahead([a, b, prefilling], 4, 2048, 2) is None


def test_never_past_max_tokens_or_the_context() -> None:
    near_end = _decoding(generated=8, max_tokens=10)  # 2 tokens left: 1 + 1 extra
    last = _decoding(generated=9, max_tokens=10)  # 1 token left: no extra step
    assert multi_step_lookahead([near_end, last], 8, 2048, 64) == {near_end.seq_id: 1}
    long = _decoding(prompt=20, generated=3)  # 23 tokens in a 25-token context: 2 more
    assert multi_step_lookahead([long], 8, 25, 64) == {long.seq_id: 1}


def test_budgeted_and_forced_sequences_take_single_steps_beside_the_others() -> None:
    plain, budgeted, forced = _decoding(), _decoding(), _decoding()
    budgeted.kv_budget = KVBudget(KVPolicy.H2O, 8)
    assert multi_step_lookahead([plain, budgeted, forced], 4, 2048, 64, {forced.seq_id}) == {plain.seq_id: 3}
    assert multi_step_lookahead([budgeted, forced], 4, 2048, 64, {forced.seq_id}) is None
