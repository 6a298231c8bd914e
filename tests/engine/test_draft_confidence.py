"""A confidence threshold on the draft's chains (``SpeculativeConfig.draft_confidence_threshold``):
a chain ends where the draft's own distribution gives its likeliest token less than the
threshold, and the target verifies only the drafts before that.

The oracle of every greedy proposal is a dense teacher-forced pass of the same draft weights
(``training/teacher_forced.py``, no paged KV, no engine) over the sequence's tokens at proposal
time plus the drafts: each proposed draft is that pass's argmax with a peak probability at or
above the threshold, and a chain shorter than its K stops exactly where the peak falls below
it. Mutations caught: the threshold ignored (chains run to K), the chain not stopped (drafting
on past an unsure position), the peak read from raw logits instead of probabilities, and the
stop on the runner's path (``chained = False``) or the chained path alone. The output stays the
target's: token for token at T = 0 here, and in distribution in ``test_speculative_engine.py``
(temperature 0.7, top-p 0.9, top-k 50, with a threshold)."""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams
from keyserve.training.teacher_forced import teacher_forced_logits

THRESHOLD = 0.3
K = 6
PROMPTS = ["Once upon a time", "The dog ran to the park and", "Tom had a big red ball.", "One day,"]
TOLERANCE = 1e-3  # peaks this close to the threshold are not judged (float32 vs the dense pass)


@pytest.fixture(scope="module")
def target(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=256)


@pytest.fixture(scope="module")
def gated(stories_path: str, draft_dir: str) -> LLM:
    return LLM(stories_path, draft=draft_dir, num_speculative_tokens=K, adaptive_k=False, num_blocks=512,
               draft_dtype="float32", draft_confidence_threshold=THRESHOLD)


def _params(max_tokens: int = 48) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
            for k in (K, 3, 5, 2)]


def _record(llm: LLM, chained: bool) -> tuple[list[tuple[list[int], int, list[int]]], list[list[int]]]:
    """Every proposed chain (the sequence's tokens then, its K, its drafts) and the outputs."""
    drafter = llm.engine.speculative.drafter
    drafter.chained = chained
    seen: list[tuple[list[int], int, list[int]]] = []
    real = drafter.propose

    def propose(targets, num_draft):
        out = real(targets, num_draft)
        for i, t in enumerate(targets):
            n = int(out.num_draft[i])
            seen.append((list(t.token_ids), num_draft[i], out.token_ids[i, :n].tolist()))
        return out

    drafter.propose = propose
    try:
        outs = llm.generate(PROMPTS, _params())
    finally:
        del drafter.propose
    return seen, [o.token_ids for o in outs]


def _check_against_dense(llm: LLM, chains: list[tuple[list[int], int, list[int]]]) -> tuple[int, int]:
    """Every chain against the dense pass; (chains cut short by the threshold, chains at K)."""
    model = llm.engine.speculative.drafter.runner.model
    cut = full = 0
    for tokens, k, drafts in chains:
        logits = teacher_forced_logits(model, tokens + drafts).float()  # [n, vocab]
        rows = logits[len(tokens) - 1 :]  # row j predicts draft j
        peaks = torch.softmax(rows, -1).amax(-1)
        for j, token in enumerate(drafts):
            assert int(rows[j].argmax()) == token, (tokens, drafts, j)
            assert peaks[j] >= THRESHOLD - TOLERANCE, (tokens, drafts, j, float(peaks[j]))
        if len(drafts) < k:  # stopped by the draft's doubt: the next position's peak is low
            assert peaks[len(drafts)] < THRESHOLD + TOLERANCE, (tokens, drafts, float(peaks[len(drafts)]))
            cut += abs(float(peaks[len(drafts)]) - THRESHOLD) > TOLERANCE
        else:
            full += 1
    return cut, full


@pytest.mark.parametrize("chained", [True, False], ids=["chained", "runner"])
def test_chains_stop_where_the_draft_doubts(gated: LLM, target: LLM, chained: bool) -> None:
    chains, outputs = _record(gated, chained)
    cut, full = _check_against_dense(gated, chains)
    assert cut > 5 and full > 5, (cut, full)  # the threshold cut chains, and let others run to K
    assert any(not d for _, _, d in chains)  # some steps drafted nothing at all
    want = [o.token_ids for o in target.generate(PROMPTS, _params())]
    assert outputs == want  # greedy: the target's tokens whatever the drafts


def test_a_step_without_drafts_counts_as_a_target_forward(gated: LLM) -> None:
    """A speculating sequence whose draft doubted its first token is verified alone: one
    token from one target forward, in the request's and the engine's tokens per forward."""
    policy = gated.engine.speculative
    before = policy.num_misses
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, num_speculative_tokens=K)
    drafter = gated.engine.speculative.drafter
    steps = []
    real = drafter.propose

    def propose(targets, num_draft):
        out = real(targets, num_draft)
        steps.extend(int(n) for n in out.num_draft)
        return out

    drafter.propose = propose
    try:
        [out] = gated.generate(["Once upon a time"], params)
    finally:
        del drafter.propose
    misses = sum(1 for n in steps if n == 0)
    assert misses > 0 and policy.num_misses - before == misses
    stats = out.stats
    # every step that asked for drafts emitted its accepted drafts plus one token; the prompt's
    # step and a last one with a single token left to make (nothing to draft) one token each
    accepted = stats.spec_accepted_tokens
    assert stats.spec_tokens_per_forward == pytest.approx((accepted + len(steps)) / len(steps))
    assert stats.generated_tokens - (accepted + len(steps)) in (1, 2)


def test_the_threshold_is_checked() -> None:
    from pydantic import ValidationError

    from keyserve.config import SpeculativeConfig

    assert SpeculativeConfig(draft="default", draft_confidence_threshold=0.4).draft_confidence_threshold == 0.4
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValidationError, match="draft_confidence_threshold"):
            SpeculativeConfig(draft="default", draft_confidence_threshold=bad)
